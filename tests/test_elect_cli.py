"""``fastlock elect`` (issue 14, as ``etcdctl elect``) with real processes: a listener
sees leader A, then B once A is stopped (it resigns on SIGTERM) or killed (its lease
runs out); a candidate prints its proposal once elected."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from fastlock._testbase import ServerProcess

TIMEOUT = 20.0


class Proc:
    """A ``fastlock elect`` process whose stdout lines arrive on a queue."""

    def __init__(self, *args: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "fastlock", "elect", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        self.errors: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.errors), daemon=True).start()

    @staticmethod
    def _read(stream, lines: queue.Queue[str]) -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))

    def line(self) -> str:
        return self.lines.get(timeout=TIMEOUT)

    def error(self) -> str:
        return self.errors.get(timeout=TIMEOUT)

    def leader(self) -> dict:
        """The next ``-o json`` line that names a leader (a release shows as a null
        leader before the next grant)."""
        while True:
            event = json.loads(self.line())
            if event["leader"] is not None:
                return event

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=TIMEOUT)


def test_listen_sees_each_leader_and_a_candidate_resigns_on_sigterm(server):
    listen = Proc("--listen", "jobs-leader", "-o", "json", "--server", server.address)
    a = Proc("jobs-leader", "proposal-A", "--server", server.address)
    try:
        assert a.line() == "proposal-A"                       # A is elected and says so
        first = listen.leader()
        assert first["leader"] == "proposal-A" and first["token"] > 0
        b = Proc("jobs-leader", "proposal-B", "--server", server.address)
        try:
            # B waits in line: the lock lists it as a waiter
            info = subprocess.run([sys.executable, "-m", "fastlock", "lock", "jobs-leader", "-o", "json",
                                   "--server", server.address], capture_output=True, text=True, timeout=TIMEOUT)
            assert json.loads(info.stdout)["holders"][0]["correlation_id"] == "proposal-A"
            assert a.stop(signal.SIGTERM) == 0                # resigns: B is elected at once
            assert b.line() == "proposal-B"
            second = listen.leader()
            assert second["leader"] == "proposal-B" and second["token"] > first["token"]
        finally:
            assert b.stop(signal.SIGINT) == 0
        assert json.loads(listen.line()) == {"leader": None, "token": None}
    finally:
        a.stop(signal.SIGKILL)
        assert listen.stop(signal.SIGTERM) == 0


def test_a_killed_leader_is_replaced_when_its_term_runs_out(server):
    listen = Proc("--listen", "svc", "--server", server.address)
    a = Proc("svc", "node-a", "--ttl", "1", "--server", server.address)
    b = None
    try:
        assert a.line() == "node-a"
        assert listen.line() == "node-a"
        b = Proc("svc", "node-b", "--ttl", "1", "--server", server.address)
        a.stop(signal.SIGKILL)                                # no resignation: the lease expires
        assert b.line() == "node-b"
        assert listen.line() == "node-b"
    finally:
        a.stop(signal.SIGKILL)
        if b is not None:
            b.stop(signal.SIGKILL)
        listen.stop(signal.SIGKILL)


def test_campaign_or_listen_not_both(server):
    both = subprocess.run([sys.executable, "-m", "fastlock", "elect", "--listen", "x", "y", "--server",
                           server.address], capture_output=True, text=True, timeout=TIMEOUT)
    assert both.returncode == 2 and "either" in both.stderr


def test_listen_says_it_is_retrying_while_the_server_is_away_and_resumes(server):
    listen = Proc("--listen", "svc", "-o", "json", "--server", server.address)
    restarted = None
    try:
        assert json.loads(listen.line()) == {"leader": None, "token": None}
        server.stop()
        retrying = json.loads(listen.error())
        assert retrying["command"] == "elect" and retrying["error"] == "Disconnected", retrying
        assert "retrying every" in retrying["message"], retrying
        restarted = ServerProcess(server.data_dir, port=server.port).start()
        a = Proc("svc", "node-a", "--server", restarted.address)
        try:
            assert a.line() == "node-a"
            assert listen.leader()["leader"] == "node-a"       # the listener is back
        finally:
            a.stop(signal.SIGKILL)
    finally:
        listen.stop(signal.SIGKILL)
        if restarted is not None:
            restarted.stop()


def test_a_leader_stopped_with_transfer_hands_over_to_the_chosen_candidate(server):
    a = Proc("roll", "node-a", "--transfer", "node-c", "--server", server.address)
    b = c = None
    try:
        assert a.line() == "node-a"
        b = Proc("roll", "node-b", "--server", server.address)
        c = Proc("roll", "node-c", "--server", server.address)
        deadline = time.monotonic() + TIMEOUT
        while True:  # both queued (polled through the CLI, bounded)
            out = subprocess.run([sys.executable, "-m", "fastlock", "elect", "--candidates", "roll", "-o", "json",
                                  "--server", server.address], capture_output=True, text=True, timeout=TIMEOUT)
            if sorted(json.loads(out.stdout)) == ["node-b", "node-c"]:
                break
            assert time.monotonic() < deadline, out
        assert a.stop(signal.SIGTERM) == 0
        assert c.line() == "node-c"          # the chosen one, not the first in line
        assert b.proc.poll() is None and b.lines.empty()
    finally:
        for p in (a, b, c):
            if p is not None:
                p.stop()
