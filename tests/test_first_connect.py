"""Clients that first connect while a pair fails over (issue 24), on real processes.

Each failover test starts a real primary and standby (``fastlock serve``,
``--failover-after`` FAILOVER), kills the primary with SIGKILL, checks that the
standby still answers as a standby (so the new client really starts during
the failover), then starts the client under test listing both addresses:
the asyncio client (``fastlock.connect`` + ``acquire(wait=20)``), the
blocking ``SyncClient``, ``fastlock run --wait 20`` and ``fastlock locks``.
Each must get through to the promoted standby.  The other tests pin the
bounds: a client pointed at nothing, at a standby that never promotes, or
at a peer that does not speak fastlock fails with every address's answer.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import threading

import pytest

import fastlock
from fastlock._testbase.cluster import run, status_of
from fastlock.client import NoPrimaryFound
from fastlock.client.sweep import Outcome
from fastlock.sync import SyncClient

FAILOVER = 3.0  # --failover-after, seconds: the window in which each client starts
GRACE = 0.3  # --promotion-grace, seconds
WAIT = 20.0
#: the client's log line when a sweep found a standby and no primary (see fastlock.client.sweep)
WAITING_LINE = "no primary yet, a failover may be under way"


def failing_over(cluster):
    """A pair whose primary was just SIGKILLed; returns (dead primary, standby) once the
    standby is seen still a standby (its promotion is FAILOVER seconds away)."""
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)
    p.kill()
    st = run(status_of(s.address), timeout=10)
    assert st["role"] == "standby", f"the standby promoted before the client started: {st['role']}"
    return p, s


def epoch(token: int) -> int:
    return token >> 40


class WaitingLines(logging.Handler):
    """Counts the first-connect ride-through's log lines (from any thread)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._logger = logging.getLogger("fastlock.client.sweep")

    def emit(self, record: logging.LogRecord) -> None:
        if WAITING_LINE in record.getMessage():
            self.lines.append(record.getMessage())

    def __enter__(self) -> WaitingLines:
        self._level = self._logger.level
        self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


def test_a_new_asyncio_client_started_during_a_failover_gets_its_lock(cluster):
    p, s = failing_over(cluster)

    async def main():
        async with fastlock.connect(p.address, s.address, client_name="late", connect_timeout=1.0) as client:
            lease = await client.acquire("job", ttl=5.0, wait=WAIT)
            assert client.server_info["role"] == "primary" and client.connection.address[1] == s.port
            assert epoch(lease.fencing_token) == 1
            assert await client.check("job", lease.fencing_token)
            await client.release(lease)

    with WaitingLines() as seen:
        run(main(), timeout=60)
    assert seen.lines and s.address in seen.lines[0] and p.address in seen.lines[0], seen.lines


def test_a_new_sync_client_started_during_a_failover_gets_its_lock(cluster):
    p, s = failing_over(cluster)
    with WaitingLines() as seen:
        with SyncClient(p.address, s.address, client_name="late-sync", connect_timeout=1.0) as client:
            assert threading.current_thread() is threading.main_thread()
            with client.lock("job", ttl=5.0, wait=WAIT) as lease:
                assert epoch(lease.fencing_token) == 1
                assert client.check("job", lease.fencing_token)
    assert seen.lines, "the SyncClient did not start during the failover"


def test_fastlock_run_started_during_a_failover_runs_its_command(cluster, tmp_path):
    p, s = failing_over(cluster)
    out = subprocess.run([sys.executable, "-m", "fastlock", "run", "job", "--wait", str(WAIT), "--ttl", "5",
                          "--log-level", "INFO", "--server", p.address, "--server", s.address, "--",
                          sys.executable, "-c", "import os; print('token', os.environ['FASTLOCK_FENCING_TOKEN'])"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    token = int(out.stdout.split("token", 1)[1])
    assert epoch(token) == 1
    assert WAITING_LINE in out.stderr, out.stderr


def test_an_admin_command_started_during_a_failover_answers(cluster, tmp_path):
    p, s = failing_over(cluster)
    out = subprocess.run([sys.executable, "-m", "fastlock", "locks", "-o", "json", "--connect-timeout", "1",
                          "--server", f"{p.address},{s.address}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    st = run(status_of(s.address), timeout=10)
    assert st["role"] == "primary" and st["epoch"] == 1


# --------------------------------------------------------------------------- bounds


def refused_address() -> str:
    """A loopback address where connections are refused (bound, never listening) - while the
    returned socket stays open."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    refused_address.keep.append(sock)
    return f"127.0.0.1:{sock.getsockname()[1]}"


refused_address.keep = []  # type: ignore[attr-defined]


@pytest.fixture
def nowhere():
    try:
        yield refused_address, refused_address()
    finally:
        for sock in refused_address.keep:
            sock.close()
        refused_address.keep.clear()


def test_a_client_pointed_at_nothing_fails_at_once_with_each_address_answer(nowhere):
    make, first = nowhere
    second = make()

    async def main():
        with pytest.raises(NoPrimaryFound) as info:
            await fastlock.connect(first, second, failover_timeout=None)  # no limit: fails by its rule
        return info.value

    exc = run(main(), timeout=30)
    assert [f"{a.host}:{a.port}" for a in exc.answers] == [first, second]
    assert all(a.outcome is Outcome.DOWN for a in exc.answers)
    assert first in str(exc) and second in str(exc) and "refused" in str(exc).lower()
    with pytest.raises(NoPrimaryFound):
        SyncClient(first, second, failover_timeout=None)


def test_a_standby_that_never_promotes_fails_the_connect_at_its_failover_timeout(cluster, nowhere):
    _, dead = nowhere
    p = cluster.primary()
    s = cluster.standby(p.address)  # promotion by command only
    p.kill()

    async def main():
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(NoPrimaryFound) as info:
            await fastlock.connect(s.address, dead, connect_timeout=1.0, failover_timeout=1.5)
        return info.value, loop.time() - started

    exc, took = run(main(), timeout=60)
    assert took >= 1.5  # it waited for a promotion that never came
    assert "within 1.5 s (failover_timeout)" in str(exc)
    by_address = {f"{a.host}:{a.port}": a for a in exc.answers}
    assert by_address[s.address].outcome is Outcome.WAITING and "role standby" in by_address[s.address].reason
    assert by_address[dead].outcome is Outcome.DOWN


async def _not_fastlock(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An HTTP server's answer to bytes it cannot parse."""
    await reader.read(4096)
    writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    await writer.drain()
    writer.close()


def test_a_peer_that_does_not_speak_fastlock_is_a_final_answer(cluster):
    p = cluster.primary()
    s = cluster.standby(p.address)  # never promotes: only the final answers can end the connect
    p.kill()

    async def main():
        server = await asyncio.start_server(_not_fastlock, "127.0.0.1", 0)
        http = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            with pytest.raises(NoPrimaryFound) as alone:
                await fastlock.connect(http, failover_timeout=None)
            # beside a standby, the connect keeps waiting for its promotion, until failover_timeout
            with pytest.raises(NoPrimaryFound) as beside:
                await fastlock.connect(http, s.address, failover_timeout=0.5)
        finally:
            server.close()
        return alone.value, beside.value

    alone, beside = run(main(), timeout=60)
    assert alone.final and [a.outcome for a in alone.answers] == [Outcome.FINAL]
    assert "not a fastlock server" in str(alone), str(alone)
    assert beside.failover_under_way and not beside.final and "within 0.5 s" in str(beside)


def test_failover_timeout_is_checked():
    with pytest.raises(fastlock.errors.InvalidArgument):
        fastlock.connect("127.0.0.1:1", failover_timeout=-1)
    with pytest.raises(fastlock.errors.WrongArgumentType):
        fastlock.connect("127.0.0.1:1", failover_timeout="5")


def test_an_acquire_on_a_client_that_never_connected_rides_through_too(cluster):
    p, s = failing_over(cluster)

    async def main():
        client = fastlock.Client([p.address, s.address], connect_timeout=1.0)
        try:
            lease = await client.acquire("lazy", ttl=5.0, wait=WAIT)
            assert epoch(lease.fencing_token) == 1
        finally:
            await client.close()

    run(main(), timeout=60)
