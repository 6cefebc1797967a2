"""One configuration story: ``fastlock serve`` from a TOML file, the environment and flags
(flag > env > file > default, shown by ``--print-config``), and the client side - the
Python client, SyncClient and the CLI - reading FASTLOCK_SERVER(S), FASTLOCK_AUTH_SECRET
the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fastlock._testbase import ServerProcess

TIMEOUT = 30.0


def run_fastlock(*args: str, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "fastlock", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=cwd, env=full)


def settings(out: subprocess.CompletedProcess) -> dict[str, tuple[str, str]]:
    """``--print-config`` output as key -> (value, source)."""
    assert out.returncode == 0, out.stderr
    result = {}
    for line in out.stdout.splitlines():
        if line.startswith("#"):
            continue
        key, _, rest = line.partition(" = ")
        value, _, source = rest.partition("  # ")
        result[key] = (value, source)
    return result


def test_each_source_alone_gives_the_same_settings(tmp_path):
    (tmp_path / "f.toml").write_text('fsync = "interval"\nmax-leases = 7\nlisten = "127.0.0.1:7999"\n')
    by_file = settings(run_fastlock("serve", "--config", "f.toml", "--print-config", cwd=tmp_path))
    by_env = settings(run_fastlock("serve", "--print-config", cwd=tmp_path, env={
        "FASTLOCK_FSYNC": "interval", "FASTLOCK_MAX_LEASES": "7", "FASTLOCK_LISTEN": "127.0.0.1:7999"}))
    by_flag = settings(run_fastlock("serve", "--fsync", "interval", "--max-leases", "7", "--listen",
                                    "127.0.0.1:7999", "--print-config", cwd=tmp_path))
    by_env_file = settings(run_fastlock("serve", "--print-config", cwd=tmp_path,
                                        env={"FASTLOCK_CONFIG": str(tmp_path / "f.toml")}))
    values = [{k: v for k, (v, _) in s.items()} for s in (by_file, by_env, by_flag, by_env_file)]
    assert values[0] == values[1] == values[2] == values[3]
    assert values[0]["fsync"] == '"interval"' and values[0]["max-leases"] == "7"
    assert by_file["fsync"][1] == "file f.toml" and by_env["fsync"][1] == "env FASTLOCK_FSYNC"
    assert by_flag["fsync"][1] == "flag" and by_file["snapshot-every"][1] == "default"


def test_a_flag_beats_the_environment_which_beats_the_file(tmp_path):
    (tmp_path / "f.toml").write_text('fsync = "never"\nmax_leases = 5\nsnapshot-every = 10\nrepair-wal = true\n')
    got = settings(run_fastlock("serve", "--config", "f.toml", "--max-leases", "9", "--print-config",
                                "--log-level", "debug", cwd=tmp_path,
                                env={"FASTLOCK_FSYNC": "interval", "FASTLOCK_MAX_LEASES": "8",
                                     "FASTLOCK_REPAIR_WAL": "off"}))
    assert got["max-leases"] == ("9", "flag")
    assert got["fsync"] == ('"interval"', "env FASTLOCK_FSYNC")
    assert got["repair-wal"] == ("false", "env FASTLOCK_REPAIR_WAL")
    assert got["snapshot-every"] == ("10", "file f.toml")
    assert got["log-level"] == ('"DEBUG"', "flag")  # case-insensitive


@pytest.mark.parametrize("content, env, needle", [
    ('fsync = "sometimes"\n', {}, "config file f.toml: --fsync must be one of"),
    ('max-leases = -1\n', {}, "config file f.toml: --max-leases"),
    ('max-leeses = 1\n', {}, "unknown setting 'max-leeses'"),
    ('fsync = [\n', {}, "not valid TOML"),
    ('', {"FASTLOCK_MAX_LEASES": "lots"}, "$FASTLOCK_MAX_LEASES: --max-leases"),
    ('', {"FASTLOCK_REPAIR_WAL": "maybe"}, "$FASTLOCK_REPAIR_WAL: --repair-wal is a switch"),
])
def test_a_bad_setting_is_a_usage_error_naming_its_source(tmp_path, content, env, needle):
    (tmp_path / "f.toml").write_text(content)
    out = run_fastlock("serve", "--config", "f.toml", "--print-config", cwd=tmp_path, env=env)
    assert out.returncode == 2 and needle in out.stderr, out.stderr
    # a one-line usage pointing to --help, not serve's 40-odd lines of usage above the error
    usage, error = out.stderr.splitlines()
    assert usage == "usage: fastlock serve [OPTION ...] (`fastlock serve --help` lists every option)", out.stderr
    assert error.startswith("fastlock serve: error: ") and needle in error, out.stderr


def test_a_server_runs_from_its_config_file(tmp_path):
    (tmp_path / "fastlock.toml").write_text("max-leases = 1\n")
    srv = ServerProcess(tmp_path / "data", args=["--config", str(tmp_path / "fastlock.toml")]).start()
    try:
        out = subprocess.run([sys.executable, "-c", CLIENT_SCRIPT], capture_output=True, text=True,
                             timeout=TIMEOUT, env=_clean_env(FASTLOCK_SERVER=srv.address))
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["acquired", "LimitExceeded"]
    finally:
        srv.stop()


CLIENT_SCRIPT = """
import asyncio, fastlock
async def main():
    async with fastlock.connect() as client:   # no address: $FASTLOCK_SERVER
        await client.acquire("one", ttl=5.0)
        print("acquired")
        try:
            await client.acquire("two", ttl=5.0)
        except fastlock.LimitExceeded:
            print("LimitExceeded")
asyncio.run(main())
"""


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
    env.update(extra)
    return env


def test_clients_need_only_FASTLOCK_SERVER_and_FASTLOCK_AUTH_SECRET(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret-for-tests\n")
    srv = ServerProcess(tmp_path / "data", args=["--auth-secret-file", str(secret)]).start()
    script = """
import asyncio, fastlock
from fastlock.sync import SyncClient
async def main():
    async with fastlock.connect() as client:
        lease = await client.acquire("env/a", ttl=5.0)
        print(lease.fencing_token > 0)
asyncio.run(main())
with SyncClient() as sync:
    print(sync.acquire("env/b", ttl=5.0).fencing_token > 0)
"""
    try:
        env = _clean_env(FASTLOCK_SERVERS=f"127.0.0.1:1,{srv.address}", FASTLOCK_AUTH_SECRET="s3cret-for-tests")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT,
                             env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["True", "True"]
        refused = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT,
                                 env=_clean_env(FASTLOCK_SERVER=srv.address))
        assert refused.returncode != 0 and "AuthError" in refused.stderr
        status = run_fastlock("status", cwd=tmp_path, env={"FASTLOCK_SERVER": srv.address,
                                                           "FASTLOCK_AUTH_SECRET": "s3cret-for-tests"})
        assert status.returncode == 0 and '"role": "primary"' in status.stdout, status.stderr
    finally:
        srv.stop()


def test_json_logs_are_one_object_per_line_with_context(tmp_path):
    import asyncio
    import json

    import fastlock

    srv = ServerProcess(tmp_path / "data", log_level="info", args=["--log-format", "JSON"]).start()
    try:
        async def revoke() -> None:
            async with fastlock.connect(srv.address, client_name="j") as client:
                await client.acquire("json/lock", ttl=30.0, correlation_id="c-1")
                await client.revoke("json/lock", reason="test")

        asyncio.run(revoke())
        line = srv.wait_for_log(r"revoked by")
    finally:
        srv.stop()
    record = json.loads(line)
    assert record["level"] == "WARNING" and record["logger"] == "fastlock.server.lockadmin"
    assert (record["lock"], record["correlation_id"], record["client"]) == ("json/lock", "c-1", "j")
    assert record["time"].endswith("Z") and isinstance(record["token"], int)
    for other in srv.lines:
        if other.strip():
            assert set(json.loads(other)) >= {"time", "level", "logger", "message"}


def test_an_abbreviated_option_is_refused_not_silently_ignored(tmp_path):
    (tmp_path / "x.toml").write_text("max-leases = 7\n")
    out = run_fastlock("serve", "--conf", "x.toml", "--print-config", cwd=tmp_path)
    assert out.returncode == 2 and "unrecognized arguments: --conf" in out.stderr, out.stderr
    out = run_fastlock("serve", "--config", "x.toml", "--print-co", cwd=tmp_path)
    assert out.returncode == 2 and "--print-co" in out.stderr, out.stderr
    out = run_fastlock("locks", "--serv", "127.0.0.1:1", cwd=tmp_path)
    assert out.returncode == 2 and "unrecognized arguments: --serv" in out.stderr, out.stderr


def test_print_config_is_valid_toml_whatever_the_values_hold(tmp_path):
    import tomllib

    hostile = 'a"b\\c\nname = "forged"\r\t\b\f\x01\x1b[31m\x7f\u2028é'
    (tmp_path / "f.toml").write_text(f"data-dir = {json.dumps(hostile + chr(0))}\n")  # JSON's escapes are TOML's
    out = run_fastlock("serve", "--config", "f.toml", "--print-config", cwd=tmp_path,
                       env={"FASTLOCK_NAME": hostile})
    assert out.returncode == 0, out.stderr
    parsed = tomllib.loads(out.stdout)
    assert parsed["data-dir"] == hostile + "\x00" and parsed["name"] == hostile
    assert "forged" not in {k for k in parsed}


@pytest.mark.parametrize("content", ['max-leases = 5\nmax_leases = 6\n', 'max_leases = 5\nmax-leases = 6\n'])
def test_two_spellings_of_one_setting_are_refused_naming_both(tmp_path, content):
    (tmp_path / "f.toml").write_text(content)
    out = run_fastlock("serve", "--config", "f.toml", "--print-config", cwd=tmp_path)
    assert out.returncode == 2, out.stdout
    assert "'max-leases' and 'max_leases'" in out.stderr or "'max_leases' and 'max-leases'" in out.stderr
    assert "config file f.toml" in out.stderr, out.stderr


def _serve_parser():
    """``fastlock``'s top parser with only ``serve``, and ``serve``'s parser."""
    from fastlock.cli import serve
    from fastlock.cli.config import RecordingParser

    top = RecordingParser(prog="fastlock")
    return top, serve.add_parser(top.add_subparsers(dest="command", parser_class=RecordingParser))


def _round_trip(tmp_path, flags: list[str]) -> tuple[dict, dict]:
    """Every configurable setting parsed from ``flags``, and parsed again from the file
    ``--print-config`` wrote for them."""
    from fastlock.cli.config import NOT_CONFIGURABLE, layer_defaults, render

    top, serve_parser = _serve_parser()
    given = top.parse_args(["serve", *flags])
    toml = render(serve_parser, given, flags, layer_defaults(serve_parser, flags, env={}))
    (tmp_path / "printed.toml").write_text(toml + "\n")
    top, serve_parser = _serve_parser()
    argv = ["--config", str(tmp_path / "printed.toml")]
    layer_defaults(serve_parser, argv, env={})
    loaded = top.parse_args(["serve", *argv])
    dests = {a.dest for a in serve_parser.options if a.option_strings and a.dest not in NOT_CONFIGURABLE}
    assert len(dests) > 50  # every serve flag, not an empty set
    return {d: getattr(given, d) for d in dests}, {d: getattr(loaded, d) for d in dests}


def test_print_config_of_the_defaults_loads_back_unchanged(tmp_path):
    given, loaded = _round_trip(tmp_path, [])
    assert loaded == given


@pytest.mark.parametrize("reachable", ["127.0.0.1:7420", "127.0.0.1:7420,[::1]:7421", "any",
                                       "10.0.0.1:1,10.0.0.2:2,10.0.0.3:3"])
def test_print_config_of_every_list_and_address_setting_loads_back_unchanged(tmp_path, reachable):
    given, loaded = _round_trip(tmp_path, [
        "--listen", "[::1]:7430", "--standby-of", "127.0.0.1:7431", "--metrics", "127.0.0.1:9100",
        "--advertise", "127.0.0.2:7432", "--reachable-as", reachable, "--name", "n1",
        "--fence-margin", "0.25", "--promotion-grace", "1e-3", "--sync-timeout", "0.5"])
    assert given["reachable_as"] and given["listen"] == ("::1", 7430)  # the flags took effect
    assert loaded == given


def test_print_config_output_is_a_config_file_serve_accepts(tmp_path):
    printed = run_fastlock("serve", "--reachable-as", "127.0.0.1:7420,127.0.0.2:7420", "--print-config",
                           cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    (tmp_path / "f.toml").write_text(printed.stdout)
    again = run_fastlock("serve", "--config", "f.toml", "--print-config", cwd=tmp_path)
    assert {k: v for k, (v, _) in settings(again).items()} == {k: v for k, (v, _) in settings(printed).items()}
    assert settings(again)["reachable-as"] == ('"127.0.0.1:7420,127.0.0.2:7420"', "file f.toml")
