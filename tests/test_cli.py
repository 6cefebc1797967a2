"""The `fastlock` command line as a real process: status of exactly the named
node, and one clear line (never a traceback) with exit 1 for runtime errors,
exit 2 for usage errors."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastlock import cli
from fastlock._testbase import CredentialsDir, ServerProcess
from fastlock.server import ServerConfig, check_limits

TIMEOUT = 30.0


def fastlock(*args: str, cwd: Path, server_env: str | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m fastlock ARGS``; ``server_env``: the value of FASTLOCK_SERVER (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "FASTLOCK_SERVER"}
    if server_env is not None:
        env["FASTLOCK_SERVER"] = server_env
    return subprocess.run([sys.executable, "-m", "fastlock", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=cwd, env=env)


def one_clear_line(out: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert out.returncode == code, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    last = lines[-1]
    if code == 1:
        assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in last, last
    return last


def test_status_reports_the_named_node_itself(tmp_path):
    creds = CredentialsDir(tmp_path / "credentials")
    a = ServerProcess(tmp_path / "a", args=creds.server_args("node-1")).start()
    b = ServerProcess(tmp_path / "b", args=["--standby-of", a.address, *creds.server_args("node-2")])
    try:
        b.start()
        b.wait_for_log("applied snapshot", timeout=TIMEOUT)
        standby = fastlock("status", "--server", b.address, cwd=tmp_path)
        assert standby.returncode == 0, standby.stderr
        assert json.loads(standby.stdout)["role"] == "standby"  # not redirected to the primary
        primary = fastlock("status", "--server", a.address, cwd=tmp_path)
        assert primary.returncode == 0, primary.stderr
        assert json.loads(primary.stdout)["role"] == "primary"
    finally:
        b.stop()
        a.stop()


@pytest.fixture
def refused() -> str:
    """An address whose connections are refused (bound, never listening)."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{unused.getsockname()[1]}"


@pytest.mark.parametrize("command", [["status"], ["promote"], ["serve-alone"]])
def test_unreachable_server_is_one_line_and_exit_1(tmp_path, refused, command):
    line = one_clear_line(fastlock(*command, "--server", refused, cwd=tmp_path), 1, refused, "Connection refused")
    assert line.startswith(f"fastlock {command[0]}: ")


@pytest.mark.parametrize("command", [["status"], ["promote"], ["serve-alone"]])
def test_admin_commands_take_the_node_from_FASTLOCK_SERVER(tmp_path, refused, command):
    line = one_clear_line(fastlock(*command, cwd=tmp_path, server_env=refused), 1, refused, "Connection refused")
    assert line.startswith(f"fastlock {command[0]}: ")


@pytest.mark.parametrize("command, server_env, needle", [
    (["promote"], None, "--server is required"),
    (["serve-alone"], "", "--server is required"),
    (["status"], "127.0.0.1:7001,127.0.0.1:7002", "names several servers"),
    (["status"], "127.0.0.1:http", "bad port"),
])
def test_admin_commands_without_one_node_are_usage_errors(tmp_path, command, server_env, needle):
    one_clear_line(fastlock(*command, cwd=tmp_path, server_env=server_env), 2, needle)


@pytest.mark.parametrize("args, needle", [
    (["status", "--server", "127.0.0.1:99999"], "port out of range"),
    (["status", "--server", "::1"], "brackets"),
    (["status", "--server", "127.0.0.1:http"], "bad port"),
    (["serve", "--listen", "127.0.0.1:65536"], "port out of range"),
    (["serve", "--listen", "::1:7420"], "brackets"),
    (["serve", "--failover-after", "2"], "--standby-of"),
    (["status", "--connect-timeout", "0"], "--connect-timeout"),
    (["locks", "--connect-timeout", "nan"], "--connect-timeout"),
])
def test_usage_errors_exit_2(tmp_path, args, needle):
    one_clear_line(fastlock(*args, cwd=tmp_path), 2, needle)


def test_addresses_parse_ipv6_in_brackets_and_check_ports():
    assert cli.args.listen_address("[::1]:7420") == ("::1", 7420)
    assert cli.args.listen_address("127.0.0.1:0") == ("127.0.0.1", 0)
    assert cli.args.listen_address(":7420") == ("127.0.0.1", 7420)
    assert cli.args.server_address("[::1]") == ("::1", 7420)
    assert cli.args.server_address("db-1") == ("db-1", 7420)
    for bad in ("127.0.0.1:-1", "127.0.0.1:65536", "::1", "[::1:7420", "7420"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.args.listen_address(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        cli.args.server_address("127.0.0.1:0")


def test_wal_dump_errors_are_one_line_and_exit_1(tmp_path):
    missing = tmp_path / "missing"
    one_clear_line(fastlock("wal", "dump", str(missing), cwd=tmp_path), 1, str(missing), "no such directory")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    one_clear_line(fastlock("wal", "dump", str(a_file), cwd=tmp_path), 1, "not a directory")
    no_wal = tmp_path / "no-wal"
    no_wal.mkdir()
    (no_wal / "notes.txt").write_text("not a WAL")
    one_clear_line(fastlock("wal", "dump", str(no_wal), cwd=tmp_path), 1, "no WAL segment")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "wal-00000000000000000001.log").write_bytes(b"\x00garbage" * 100)
    one_clear_line(fastlock("wal", "dump", str(garbage), cwd=tmp_path), 1, "WalCorruption")


def test_wal_dump_of_a_wal_with_no_records_prints_nothing_and_exits_0(tmp_path):
    srv = ServerProcess(tmp_path / "data").start()
    srv.stop()
    out = fastlock("wal", "dump", "--lock", "nothing-here", str(tmp_path / "data"), cwd=tmp_path)
    assert out.returncode == 0 and out.stdout == "" and out.stderr == "", out
    state = fastlock("wal", "dump", "--state", str(tmp_path / "data"), cwd=tmp_path)
    assert state.returncode == 0 and state.stderr == "", state
    assert [line.split()[2] for line in state.stdout.splitlines()] == ["state"], state.stdout
    assert "holders=0" in state.stdout, state.stdout


def test_serve_refuses_a_frame_limit_too_small_for_a_valid_request(tmp_path):
    """--max-frame-bytes 10 used to start a server that closed every connection at HELLO."""
    res = subprocess.run([sys.executable, "-m", "fastlock", "serve", "--data-dir", str(tmp_path / "d"),
                          "--listen", "127.0.0.1:0", "--max-frame-bytes", "10"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "--max-frame-bytes: expected at least 4096" in res.stderr
    assert not (tmp_path / "d").exists()
    with pytest.raises(ValueError, match="max_frame_bytes must be at least 4096"):
        check_limits(ServerConfig(max_frame_bytes=4095))
    check_limits(ServerConfig(max_frame_bytes=4096))


#: what a TLS port answers a client that speaks plain TCP: an alert record (TLS 1.0, fatal, decode_error)
TLS_ALERT = bytes.fromhex("15030100020232")


@pytest.mark.parametrize("command", ["status", "locks"])
@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 400 Bad Request\r\n\r\n", TLS_ALERT],
                         ids=["silent", "http", "tls-alert"])
def test_a_port_that_does_not_speak_fastlock_is_one_line_within_the_connect_timeout(tmp_path, answer, command):
    """Status (a direct request) and locks (the client library) say "not a fastlock server" -
    or, when the bytes start a TLS record, that the port speaks TLS - in one line on stderr
    (no log line), within the connect timeout (``--connect-timeout``, 1 s here: the silent port
    waits it out)."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            if answer:
                conn.recv(4096)
                conn.sendall(answer)
                conn.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        out = fastlock(command, "--server", f"127.0.0.1:{listener.getsockname()[1]}", "--connect-timeout", "1",
                       cwd=tmp_path)
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
    if answer == TLS_ALERT:
        line = one_clear_line(out, 1, "answered in TLS", "--tls" if command == "status" else "tls")
        assert "not a fastlock server" not in line
    else:
        line = one_clear_line(out, 1, "not a fastlock server")
        assert "TLS" not in line, line
    if answer == b"" and command == "status":
        assert "within 1 s" in line, line  # the --connect-timeout ended the wait (not the 5 s default)


@pytest.mark.parametrize("command", [["status"], ["promote"], ["serve-alone"], ["locks"], ["lock", "x"],
                                     ["revoke", "x"], ["top"]])
def test_with_o_json_a_runtime_error_is_one_json_object_on_stderr(tmp_path, refused, command):
    out = fastlock(*command, "--server", refused, "-o", "json", cwd=tmp_path)
    assert out.returncode == 1 and out.stdout == "", (out.stdout, out.stderr)
    (line,) = out.stderr.splitlines()
    error = json.loads(line)
    assert set(error) == {"command", "error", "message"} and error["command"] == command[0], error
    assert error["error"] in ("ConnectionRefusedError", "ConnectionLost") and refused in error["message"], error


@pytest.mark.parametrize("argv,command,message", [
    (["locks", "-o", "json", "--bogus"], "locks", "unrecognized arguments: --bogus"),
    (["top", "--output=json", "--rows"], "top", "argument --rows: expected one argument"),
    (["lock", "-ojson"], "lock", "the following arguments are required: NAME"),
    (["promote", "--output", "json", "--timeout", "soon"], "promote", "argument --timeout: "),
    (["wal", "dump", "-o", "json"], "wal dump", "the following arguments are required: DIR"),
])
def test_with_o_json_a_usage_error_is_one_json_object_on_stderr(capsys, argv, command, message):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    error = json.loads(line)
    assert set(error) == {"command", "error", "message"}, error
    assert (error["command"], error["error"]) == (command, "usage") and error["message"].startswith(message), error


@pytest.mark.parametrize("argv", [["locks", "--bogus"], ["locks", "-o", "xml"], ["run", "-o", "json", "--bogus"]])
def test_without_o_json_a_usage_error_stays_argparse_text(capsys, argv):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("usage: fastlock")


def test_wal_dump_errors_are_json_with_o_json(tmp_path):
    out = fastlock("wal", "dump", "-o", "json", str(tmp_path / "missing"), cwd=tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    assert json.loads(out.stderr) == {"command": "wal dump", "error": "FileNotFoundError",
                                      "message": f"{tmp_path / 'missing'}: no such directory"}


@pytest.mark.parametrize("command", [["status"], ["promote"], ["serve-alone"]])
def test_a_node_command_refuses_a_repeated_server(tmp_path, refused, command):
    """A command that targets one node says so for a second --server, never silently uses the last."""
    line = one_clear_line(fastlock(*command, "--server", "127.0.0.1:7001", "--server", refused, cwd=tmp_path), 2,
                          "--server given more than once", "127.0.0.1:7001", refused, "one node")
    assert line.startswith(f"fastlock {command[0]}: error: ")


@pytest.mark.parametrize("command", [["locks"], ["lock", "a"], ["principals"], ["top", "--once"]])
def test_a_primary_command_finds_the_primary_among_repeated_servers(tmp_path, server, refused, command):
    """``--server A --server B`` names both nodes (as the client's list): the command finds the
    answering primary, whichever --server names it."""
    out = fastlock(*command, "--server", server.address, "--server", refused, "--connect-timeout", "2",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    out = fastlock(*command, "--server", f"{refused},{server.address}", "--connect-timeout", "2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr


def test_status_help_says_several_nodes_in_the_environment_are_refused(tmp_path):
    out = fastlock("status", "--help", cwd=tmp_path)
    assert "several nodes there are an error" in " ".join(out.stdout.split()), out.stdout


def test_status_all_of_a_sync_pair_names_both_nodes_from_either(tmp_path, cluster):
    """Asked at the primary or at the standby, every cell a node's STATUS can fill is filled:
    NODE (its --name), the standby's ADDRESS (as it announced it) and IN SYNC."""
    primary = cluster.primary("a", args=["--replication", "sync"])
    standby = cluster.standby(primary.address, "b", failover_after=1.0)
    deadline = time.monotonic() + TIMEOUT
    while primary.status()["replication"]["sync"].get("state") != "in_sync":
        assert time.monotonic() < deadline, primary.status()["replication"]
        time.sleep(0.05)
    expected = {("a", primary.address, "primary", None), ("b", standby.address, "standby", True)}
    for asked in (primary, standby):
        out = fastlock("status", "--all", "-o", "json", "--server", asked.address, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        assert {(r["node"], r["address"], r["role"], r["in_sync"]) for r in rows} == expected, rows


def test_a_holder_without_a_client_name_is_shown_by_its_principal_alone(tmp_path, server):
    """A SyncClient that gives no client name: the expiry log line and the WAL dump name its
    principal, never a dangling ``anonymous:``."""
    from fastlock.sync import SyncClient

    with SyncClient(server.address) as client:
        lease = client.acquire("nameless", ttl=0.2)  # not renewed: it expires
        line = server.wait_for_log(r"lease expired: 'nameless'", timeout=TIMEOUT)
    assert f"token {lease.fencing_token} (holder 'anonymous')" in line, line
    out = fastlock("wal", "dump", "--lock", "nameless", str(server.data_dir), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    grant = next(line for line in out.stdout.splitlines() if " grant " in line)
    assert " client=anonymous " in grant and "anonymous:" not in out.stdout, out.stdout
