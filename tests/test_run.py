"""`fastlock run` (fastlock.cli.run) as a real process against a real server."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastlock._testbase.proxy import TcpProxy
from fastlock.cli.run import EXIT_LOST, EXIT_NOT_ACQUIRED, EXIT_OVERRAN, EXIT_UNAVAILABLE
from fastlock.sync import SyncClient

TIMEOUT = 15.0


def run_cmd(server, *args: str, command: list[str], tmp_path: Path) -> list[str]:
    return [sys.executable, "-m", "fastlock", "run", *args, "--server", server.address, "--", *command]


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = TIMEOUT) -> str:
    deadline = time.monotonic() + timeout
    while True:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text()
        if proc.poll() is not None:
            raise AssertionError(f"runner exited with {proc.returncode} before {path.name} appeared")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear within {timeout} s")
        time.sleep(0.01)


@pytest.fixture
def sync(server):
    with SyncClient(server.address, client_name="observer") as c:
        yield c


def test_passes_the_token_and_propagates_the_exit_status(server, sync, tmp_path):
    before = sync.acquire("job", ttl=5.0)
    sync.release(before)
    events = sync.watch("job", timeout=TIMEOUT)
    assert next(events).kind == "free"
    child = "import os, sys; print(os.environ['FASTLOCK_FENCING_TOKEN'], os.environ['FASTLOCK_LOCK_NAME']); sys.exit(7)"
    out = subprocess.run(run_cmd(server, "job", "--ttl", "2", command=py(child), tmp_path=tmp_path),
                         capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert out.returncode == 7, out.stderr
    token_text, name = out.stdout.split()
    token = int(token_text)
    assert name == "job" and token > before.fencing_token
    granted, released = next(events), next(events)
    assert (granted.kind, granted.token) == ("granted", token)  # the command ran under that grant
    assert (released.kind, released.token) == ("released", token)  # and it was released after
    events.close()
    assert sync.holder("job") is None


def test_command_killed_by_a_signal_gives_128_plus_n(server, tmp_path):
    child = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    out = subprocess.run(run_cmd(server, "sig", command=py(child), tmp_path=tmp_path),
                         capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert out.returncode == 128 + signal.SIGKILL


def test_not_acquired_within_wait(server, sync, tmp_path):
    held = sync.acquire("busy", ttl=10.0)
    marker = tmp_path / "ran"
    t0 = time.monotonic()
    out = subprocess.run(run_cmd(server, "busy", "--wait", "0.2", command=["touch", str(marker)], tmp_path=tmp_path),
                         capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert out.returncode == EXIT_NOT_ACQUIRED, out.stderr
    assert time.monotonic() - t0 >= 0.2
    assert not marker.exists()
    assert sync.status()["waiters"] == 0
    out = subprocess.run(run_cmd(server, "busy", "--wait", "0", "--conflict-exit-code", "1",
                                 command=["true"], tmp_path=tmp_path), timeout=TIMEOUT, cwd=tmp_path)
    assert out.returncode == 1
    sync.release(held)


def test_unknown_command_and_unreachable_server(server, tmp_path):
    out = subprocess.run(run_cmd(server, "nf", command=["/nonexistent/command"], tmp_path=tmp_path),
                         capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert out.returncode == 127
    with socket.socket() as unused:  # bound, never listening: connections are refused
        unused.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{unused.getsockname()[1]}"
        out = subprocess.run([sys.executable, "-m", "fastlock", "run", "x", "--server", dead, "--", "true"],
                             capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert out.returncode == 69
    out = subprocess.run([sys.executable, "-m", "fastlock", "run", "x"], capture_output=True, text=True,
                         timeout=TIMEOUT, cwd=tmp_path)
    assert out.returncode == 2 and "command" in out.stderr
    # SIGTERM would come between two renewals that succeed: refused before anything is sent
    out = subprocess.run([sys.executable, "-m", "fastlock", "run", "x", "--ttl", "1", "--grace", "0.5", "--margin",
                          "0.2", "--server", dead, "--", "true"], capture_output=True, text=True, timeout=TIMEOUT,
                         cwd=tmp_path)
    assert out.returncode == 2 and "two thirds of --ttl" in out.stderr


CHILD = """
import os, signal, sys, time
ignore = sys.argv[2] == "ignore"
def on_term(signum, frame):
    with open(sys.argv[1] + ".term", "w") as f:
        f.write("terminated\\n")
    sys.exit(3)
signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else on_term)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.getpid()} {os.environ['FASTLOCK_FENCING_TOKEN']}\\n")
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("child_mode", ["obey", "ignore"])
def test_a_runner_frozen_past_its_ttl_kills_the_command_and_exits_76(server, sync, tmp_path, child_mode):
    started = tmp_path / "started"
    proc = subprocess.Popen(
        run_cmd(server, "lose", "--ttl", "0.6", "--grace", "0.3",
                command=[sys.executable, "-c", CHILD, str(started), child_mode], tmp_path=tmp_path),
        cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        pid_text, token_text = wait_for_file(started, proc).split()
        # Freeze the runner past its TTL; meanwhile another client takes the lock.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            taker = sync.acquire("lose", ttl=10.0, wait=TIMEOUT)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert taker.fencing_token > int(token_text)
        code = proc.wait(TIMEOUT)
        # the command outlived the earliest re-grant (its runner was frozen): it says so
        assert code == EXIT_OVERRAN, proc.stderr.read()
        assert "could not be shown" in proc.stderr.read()
        with pytest.raises(ProcessLookupError):  # SIGKILLed at once: the moment had passed
            os.kill(int(pid_text), 0)
        assert sync.check("lose", taker.fencing_token)  # the new holder was not disturbed
        sync.release(taker)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("child_mode", ["obey", "ignore"])
def test_a_partitioned_runner_stops_the_command_before_the_regrant_and_exits_75(server, sync, tmp_path,
                                                                                 child_mode):
    started = tmp_path / "started"
    with TcpProxy(server.address) as proxy:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fastlock", "run", "part", "--ttl", "1.2", "--grace", "0.3", "--margin", "0.2",
             "--server", proxy.address, "--", sys.executable, "-c", CHILD, str(started), child_mode],
            cwd=tmp_path, stderr=subprocess.PIPE, text=True)
        try:
            pid_text, token_text = wait_for_file(started, proc).split()
            pidfd = os.pidfd_open(int(pid_text))
            try:
                proxy.blackhole()  # renewals go unanswered; the runner keeps running
                taker = sync.acquire("part", ttl=10.0, wait=TIMEOUT)
                # the command is dead once the next holder has the lock (benches/bounded.py
                # measures that it died before the grant itself)
                assert select.select([pidfd], [], [], 0)[0] == [pidfd]
            finally:
                os.close(pidfd)
            assert taker.fencing_token > int(token_text)
            proxy.heal()
            code = proc.wait(TIMEOUT)
            assert code == EXIT_LOST, proc.stderr.read()
            err = proc.stderr.read()
            assert "before the server's earliest re-grant" in err
            if child_mode == "obey":  # SIGTERM came --grace before the SIGKILL
                assert (tmp_path / "started.term").read_text() == "terminated\n"
            sync.release(taker)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_sigterm_is_forwarded_and_the_lock_released(server, sync, tmp_path):
    started = tmp_path / "started"
    proc = subprocess.Popen(
        run_cmd(server, "fwd", "--ttl", "5", command=[sys.executable, "-c", CHILD, str(started), "obey"],
                tmp_path=tmp_path), cwd=tmp_path)
    try:
        wait_for_file(started, proc)
        assert sync.holder("fwd") is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 3  # the command's own status
        assert (tmp_path / "started.term").exists()
        assert sync.holder("fwd") is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_signal_while_waiting_for_the_lock_withdraws_the_waiter(server, sync, tmp_path):
    held = sync.acquire("queue", ttl=10.0)
    proc = subprocess.Popen(run_cmd(server, "queue", command=["true"], tmp_path=tmp_path), cwd=tmp_path)
    try:
        deadline = time.monotonic() + TIMEOUT
        while sync.status()["waiters"] != 1:
            assert time.monotonic() < deadline, "runner never queued"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(TIMEOUT) == 128 + signal.SIGINT
        assert sync.status()["waiters"] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    sync.release(held)


@pytest.mark.parametrize("argv, message", [
    (["", "--ttl", "1"], "lock name"),
    (["job", "--ttl", "0"], "--ttl"),
    (["job", "--ttl", "-1"], "--ttl"),
    (["job", "--ttl", "90000"], "--ttl"),
    (["job", "--wait", "90000"], "--wait"),
    (["x" * 513], "lock name"),
])
def test_bad_arguments_exit_2_before_anything_is_sent(server, sync, tmp_path, argv, message):
    grants = sync.status()["grants"]
    out = subprocess.run([sys.executable, "-m", "fastlock", "run", *argv, "--server", server.address, "--", "true"],
                         capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    assert sync.status()["grants"] == grants


def test_ttl_help_says_it_must_be_positive(tmp_path):
    out = subprocess.run([sys.executable, "-m", "fastlock", "run", "-h"], capture_output=True, text=True,
                         timeout=TIMEOUT, cwd=tmp_path)
    assert out.returncode == 0 and "> 0" in " ".join(out.stdout.split())


def test_says_who_holds_the_lock_it_waits_for(server, sync, tmp_path):
    held = sync.acquire("busy", ttl=30.0, correlation_id="nightly-report")
    out = subprocess.run(run_cmd(server, "busy", "--ttl", "2", "--wait", "0.5", command=py("pass"),
                                 tmp_path=tmp_path), capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert out.returncode == EXIT_NOT_ACQUIRED, out.stderr
    assert (f"waiting for 'busy': held by anonymous:observer (token {held.fencing_token}, "
            f"correlation id nightly-report") in out.stderr


def _run_with_the_sync_standby_paused(cluster, tmp_path, sync_args: list[str], name: str, wait: str):
    """``fastlock run NAME --wait WAIT`` (anonymous) against a sync primary (``sync_args``)
    whose standby was in sync, then paused (SIGSTOP) for the run; the finished process."""
    primary = cluster.primary(args=["--replication", "sync", *sync_args])
    standby = cluster.standby(primary.address)
    deadline = time.monotonic() + TIMEOUT
    while primary.status()["replication"]["sync"].get("state") != "in_sync":
        assert time.monotonic() < deadline, primary.status()["replication"]
        time.sleep(0.05)
    standby.pause()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}  # anonymous client
        return subprocess.run(run_cmd(primary, name, "--wait", wait, command=py("pass"), tmp_path=tmp_path),
                              capture_output=True, text=True, timeout=TIMEOUT + 10, cwd=tmp_path, env=env)
    finally:
        standby.resume()


def test_on_a_sync_pair_its_own_pending_grant_is_not_reported_as_another_holder(cluster, tmp_path):
    """On a sync primary the grant waits for the standby's acknowledgement (here: a paused
    standby, until --sync-timeout) before the acquire is answered; meanwhile the holder report
    must not name this run's own grant as the hold it waits for."""
    out = _run_with_the_sync_standby_paused(cluster, tmp_path, ["--sync-timeout", "3"], "self5", "10")
    assert out.returncode == 0, out.stderr
    assert "acquired 'self5'" in out.stderr, out.stderr
    assert "waiting for" not in out.stderr, out.stderr


def test_a_fenced_sync_primary_is_logged_once_per_reason_and_window_then_the_error(cluster, tmp_path):
    """A strict sync primary whose standby is stopped refuses every acquire (Unavailable): the
    ride-through retries it many times a second, and says so in one INFO line per distinct
    refusal per REFUSAL_LOG_EVERY seconds, then the final error."""
    out = _run_with_the_sync_standby_paused(cluster, tmp_path, ["--sync-timeout", "0.3", "--sync-on-timeout", "fence"],
                                            "fenced", "4")
    assert out.returncode == EXIT_UNAVAILABLE, out.stderr
    refusals = [line for line in out.stderr.splitlines() if "looking for the primary" in line]
    reasons = {line.split("refused a request", 1)[1].split(" more like this")[0] for line in refusals}
    assert 1 <= len(refusals) <= 2 * len(reasons), out.stderr  # the first of each, one more per 5 s at most
    last = out.stderr.splitlines()[-1]
    assert "ERROR" in last and "has not acknowledged" in last, out.stderr  # the final error stays
