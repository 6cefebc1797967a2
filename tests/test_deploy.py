"""The deployment files: the Dockerfile (parsed, and its entrypoint run container-less with the
image's paths mapped into a temporary directory), the systemd unit (``systemd-analyze verify``
where systemd is installed; its settings parsed everywhere)."""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fastlock._testbase import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
UNIT = ROOT / "deploy" / "fastlock.service"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def test_dockerfile_is_multi_stage_non_root_with_volume_and_healthcheck():
    ins = dockerfile_instructions()
    stages = [a.split()[-1] for i, a in ins if i == "FROM"]
    assert stages == ["builder", "runtime"]
    runtime = ins[max(n for n, (i, _) in enumerate(ins) if i == "FROM"):]
    # the runtime stage gets the built wheels from the builder, and no compiler
    assert any(i == "COPY" and a.startswith("--from=builder") for i, a in runtime)
    assert not any(i == "RUN" and re.search(r"\b(gcc|cython)\b", a, re.I) for i, a in runtime)
    users = [a for i, a in runtime if i == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    volumes = [v for i, a in runtime if i == "VOLUME" for v in exec_form(a)]
    cmd = exec_form(next(a for i, a in reversed(runtime) if i == "CMD"))
    assert cmd[cmd.index("--data-dir") + 1] in volumes  # the data dir is the volume
    health = next(a for i, a in runtime if i == "HEALTHCHECK")
    assert exec_form(health.split(" CMD ", 1)[1])[:2] == ["fastlock", "status"]
    assert exec_form(next(a for i, a in runtime if i == "ENTRYPOINT")) == ["fastlock"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dockerfile_entrypoint_and_healthcheck_run_container_less(tmp_path):
    """ENTRYPOINT + CMD and the HEALTHCHECK command, with the image's paths mapped into
    tmp_path and the listen address onto a free loopback port."""
    ins = dockerfile_instructions()
    env = dict(a.split("=", 1) for i, a in ins if i == "ENV")
    entry = exec_form(next(a for i, a in ins if i == "ENTRYPOINT"))
    cmd = exec_form(next(a for i, a in reversed(ins) if i == "CMD"))
    health = exec_form(next(a for i, a in ins if i == "HEALTHCHECK").split(" CMD ", 1)[1])
    port = _free_port()
    creds = tmp_path / "etc-fastlock"
    subprocess.run([sys.executable, "-m", "fastlock", "credentials", "init", str(creds)], check=True,
                   capture_output=True, cwd=tmp_path)
    paths = {"/var/lib/fastlock": str(tmp_path / "data"), "/etc/fastlock": str(creds),
             "0.0.0.0:7420": f"127.0.0.1:{port}", "127.0.0.1:7420": f"127.0.0.1:{port}"}

    def mapped(args: list[str]) -> list[str]:
        out = []
        for a in args:
            for image_path, here in paths.items():
                a = a.replace(image_path, here)
            out.append(a)
        return out

    def fastlock_argv(argv: list[str]) -> list[str]:
        assert argv[0] == "fastlock"
        return [sys.executable, "-m", "fastlock", *mapped(argv[1:])]

    run_env = {**os.environ, **{k: mapped([v])[0] for k, v in env.items()}}
    argv = fastlock_argv(entry + cmd)
    assert "--credentials" in argv  # the image listens on every address: never in open mode

    class Entrypoint(ServerProcess):
        def command(self) -> list[str]:
            return argv

    srv = Entrypoint(tmp_path / "data", port=port, env=run_env).start()
    try:
        ok = subprocess.run(fastlock_argv(health), env=run_env, capture_output=True, text=True, timeout=30,
                            cwd=tmp_path)
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["role"] == "primary"
    finally:
        srv.stop()
    down = subprocess.run(fastlock_argv(health), env=run_env, capture_output=True, text=True, timeout=30,
                          cwd=tmp_path)
    assert down.returncode != 0


def unit_settings() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_systemd_unit_settings():
    unit = unit_settings()
    svc = unit["Service"]
    assert svc["Type"] == "notify"
    assert svc["Restart"] == "on-failure"
    assert svc["User"] and svc["User"] != "root"
    for hardening in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "RestrictSUIDSGID"):
        assert svc[hardening] == "yes", hardening
    assert svc["ProtectSystem"] == "strict"
    exec_start = svc["ExecStart"].split()
    assert exec_start[1] == "serve"
    assert exec_start[exec_start.index("--data-dir") + 1] == f"/var/lib/{svc['StateDirectory']}"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path):
    # the unit names /usr/local/bin/fastlock; point it at this environment's command
    exe = shutil.which("fastlock") or str(Path(sys.executable).parent / "fastlock")
    unit = tmp_path / "fastlock.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/fastlock", exe))
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True,
                            text=True, timeout=60)
    problems = [line for line in (result.stdout + result.stderr).splitlines()
                if "fastlock.service" in line]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


def test_every_file_deploy_readme_names_exists():
    readme = ROOT / "deploy" / "README.md"
    targets = re.findall(r"\]\(([^)#\s]+)\)", readme.read_text())
    assert {"fastlock.service", "../Dockerfile", "../docs/deployment.md"} <= set(targets)
    missing = [t for t in targets if not (readme.parent / t).is_file()]
    assert not missing, missing


def test_the_unit_runs_the_command_make_install_puts_in_place():
    prefix = re.search(r"^PREFIX \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert unit_settings()["Service"]["ExecStart"].split()[0] == f"{prefix}/bin/fastlock"


WHEELS = sorted((ROOT / "dist").glob("fastlock-*.whl"))


@pytest.mark.timeout(600)
@pytest.mark.skipif(not WHEELS, reason="no wheel in dist/: `make wheel` builds one (CI's make wheel-check does)")
@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_install_then_the_unit_verifies(tmp_path):
    """docs/deployment.md's steps: ``make install`` (here with PREFIX in a temporary directory, from
    the wheel in dist/) puts an executable ``PREFIX/bin/fastlock``; the unit, with /usr/local
    replaced by that PREFIX, passes ``systemd-analyze verify`` where systemd is installed."""
    prefix = tmp_path / "usr" / "local"
    out = subprocess.run(["make", "-s", "install", f"PREFIX={prefix}", f"PYTHON={sys.executable}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout + out.stderr
    command = prefix / "bin" / "fastlock"
    assert command.is_symlink() and os.access(command, os.X_OK)
    version = subprocess.run([str(command), "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("fastlock "), version.stderr
    if shutil.which("systemd-analyze") is None:
        return  # the unit's settings are checked above; verify needs systemd
    unit = tmp_path / "fastlock.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/fastlock", str(command)))
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True,
                            text=True, timeout=60)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if "fastlock.service" in line]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr
