"""``fastlock demo`` end to end: a real server process, real worker processes,
SIGSTOP/SIGCONT, and a fenced SQLite ledger.

Each run carries a unique marker in its environment, inherited by every process
the demo starts, so the tests can prove that none of them outlives the demo.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

import fastlock

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the demo uses SIGSTOP/SIGCONT and /proc")

DEMO_TIMEOUT = 90  # seconds; a normal run takes 2-3 s


def _env(marker: str, tmp_path) -> dict[str, str]:
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp_path)  # the demo's temporary directory too, even if it is killed
    # Run the demo (and through it the server and workers) on the same fastlock
    # this test imported, whether installed or built in place.
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastlock.__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["FASTLOCK_DEMO_TEST_MARK"] = marker
    return env


def _marked_pids(marker: str) -> list[int]:
    """Live processes whose environment carries ``marker``."""
    needle = f"FASTLOCK_DEMO_TEST_MARK={marker}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def _wait_gone(marker: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = _marked_pids(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _run_demo(tmp_path, *args: str, module: tuple[str, ...] = ("fastlock.demo",)
              ) -> tuple[subprocess.CompletedProcess, str]:
    marker = uuid.uuid4().hex
    proc = subprocess.run(
        [sys.executable, "-m", *module, *args],
        cwd=tmp_path, env=_env(marker, tmp_path), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=DEMO_TIMEOUT,
    )
    return proc, marker


def _field(out: str, name: str) -> str:
    m = re.search(rf"^{re.escape(name)}: (.*)$", out, re.M)
    assert m, f"no {name!r} line in the report:\n{out}"
    return m.group(1).strip()


def test_demo_rejects_the_stale_write_and_keeps_the_ledger_consistent(tmp_path):
    proc, marker = _run_demo(tmp_path)
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert int(_field(proc.stdout, "stale writes rejected")) >= 1, report
    assert _field(proc.stdout, "ledger consistent") == "yes", report
    assert _field(proc.stdout, "result") == "PASS", report
    assert re.search(r"stale write\s+worker-1 resumed and wrote with token \d+: REJECTED", proc.stdout), report
    assert re.search(r"lease lost\s+worker-1 noticed: yes", proc.stdout), report
    # every worker was granted the lock at least once, and tokens were distinct
    for i in range(1, 5):
        m = re.search(rf"worker-{i}\s+grants\s+(\d+)", proc.stdout)
        assert m and int(m.group(1)) >= 1, report
    assert "all distinct: yes" in proc.stdout, report
    assert _wait_gone(marker, 5) == [], "the demo left processes behind"


def test_unfenced_demo_shows_the_corruption_and_fails(tmp_path):
    """Without the fencing check the frozen worker's write lands: the report
    must say so and the demo must fail (this also proves the checker works).
    Run as ``fastlock demo``, which must pass every flag on to the demo."""
    proc, marker = _run_demo(tmp_path, "--unfenced", "--workers", "3", "--quiet", "--keep",
                             module=("fastlock", "demo"))
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 1, report
    assert re.search(r"worker-3\s+grants", proc.stdout) and "worker-4" not in proc.stdout, report  # --workers 3
    assert "[demo]" not in proc.stderr, report  # --quiet
    kept = re.search(r"^kept (\S+)$", proc.stderr, re.M)  # --keep
    assert kept and os.path.isdir(kept.group(1)), report
    assert _field(proc.stdout, "stale writes rejected") == "0", report
    assert _field(proc.stdout, "ledger consistent") == "no", report
    assert "ACCEPTED (unfenced)" in proc.stdout, report
    assert "tokens non-decreasing: no" in proc.stdout, report
    assert _wait_gone(marker, 5) == [], "the demo left processes behind"


def test_demo_children_die_with_it(tmp_path):
    """SIGKILL the demo while a worker is frozen: the server and every worker,
    the frozen one included, must go too."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastlock.demo"],
        cwd=tmp_path, env=_env(marker, tmp_path), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    froze = threading.Event()
    lines: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("[demo] froze"):
                froze.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert froze.wait(DEMO_TIMEOUT), "the demo never froze a worker:\n" + "".join(lines)
        assert len(_marked_pids(marker)) >= 6  # demo + server + 4 workers
        proc.kill()
        proc.wait(timeout=10)
        left = _wait_gone(marker, 15)
        assert left == [], f"processes outlived the demo: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pid in _marked_pids(marker):  # never leave strays, even when failing
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reader.join(timeout=10)
