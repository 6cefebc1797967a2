"""Once-per-window runs (issue 29, item 3): a run that ends early keeps the job's name
taken until its window ends on the server's clock; a run going past its window keeps the
lock and gives it up at its end; the window survives a primary's SIGKILL; workers whose
clocks are skewed by +-1 s (libfaketime) run a job exactly once per window."""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from test_replication import caught_up

import fastlock
from fastlock import LockNotAcquired
from fastlock._testbase.cluster import run
from fastlock.sync import SyncClient
from fastlock.wal.dump import dump

TIMEOUT = 20.0


async def _granted_within(client, name, timeout):
    """The lease of a run of ``name`` once one is granted (trying every 20 ms), within ``timeout`` s."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                return await client.once_per(name, 30.0).start()
            except LockNotAcquired:
                await asyncio.sleep(0.02)


async def test_an_early_end_keeps_the_window_taken(client, connect):
    other = await connect("other")
    async with client.once_per("jobs/report", 30.0) as lease:
        with pytest.raises(LockNotAcquired):
            await other.once_per("jobs/report", 30.0).start()
    # the run ended; its window has not
    with pytest.raises(LockNotAcquired):
        await other.once_per("jobs/report", 30.0).start()
    with pytest.raises(LockNotAcquired):
        await client.once_per("jobs/report", 30.0).start()
    holder = await other.holder("jobs/report")
    assert holder is not None and holder["token"] == lease.fencing_token
    assert 0 < holder["remaining_ms"] <= 30_000


async def test_the_next_window_opens_when_the_servers_deadline_passes(client, connect):
    other = await connect("other")
    run_ = client.once_per("jobs/short", 0.5)
    async with run_ as first:
        pass
    second = await _granted_within(other, "jobs/short", TIMEOUT)
    assert second.fencing_token > first.fencing_token
    holder = await other.holder("jobs/short")
    assert holder is not None and holder["token"] == second.fencing_token


async def test_a_run_past_its_window_keeps_the_lock_then_releases_it(client, connect):
    other = await connect("other")
    run_ = client.once_per("jobs/long", 0.6, ttl=3.0)
    lease = await run_.start()
    # the run goes on past its window: the lease is extended with ttl and renewed
    async with asyncio.timeout(TIMEOUT):
        while run_.lease is lease:  # the run goes on past its window: its lease is extended
            await asyncio.sleep(0.02)
    async with asyncio.timeout(TIMEOUT):
        while (await other.holder("jobs/long"))["ttl_ms"] != 3000:
            await asyncio.sleep(0.02)
    with pytest.raises(LockNotAcquired):
        await other.once_per("jobs/long", 0.6).start()
    await asyncio.sleep(0.6)  # at least the window has passed since the grant, on any clock
    await run_.finish()
    assert not lease.lost.is_set()
    assert await other.holder("jobs/long") is None  # released: the window had passed


async def test_a_run_extended_inside_its_window_keeps_the_rest_of_it(client, connect):
    other = await connect("other")
    run_ = client.once_per("jobs/edge", 3.0, ttl=30.0)  # extended 1 s before the window's end
    lease = await run_.start()
    async with asyncio.timeout(TIMEOUT):
        while run_.lease is lease:
            await asyncio.sleep(0.02)
    await run_.finish()
    holder = await other.holder("jobs/edge")
    if holder is not None:  # (None only if this test was stalled past the window)
        assert holder["token"] == lease.fencing_token
        assert holder["ttl_ms"] < 30_000  # what was left of the window, not the run's ttl
    await _granted_within(other, "jobs/edge", TIMEOUT)


def test_blocking_client(server):
    with SyncClient(server.address) as a, SyncClient(server.address) as b:
        with a.once_per("jobs/sync", 30.0) as lease:
            with pytest.raises(LockNotAcquired):
                b.once_per("jobs/sync", 30.0).start()
        with pytest.raises(LockNotAcquired):
            b.once_per("jobs/sync", 30.0).start()
        assert b.holder("jobs/sync")["token"] == lease.fencing_token


def test_arguments_are_checked(server):
    with SyncClient(server.address) as c:
        for bad in (0, -1.0, 3601.0, float("nan")):
            with pytest.raises(fastlock.InvalidArgument):
                c.once_per("jobs/x", bad)
        with pytest.raises(fastlock.InvalidArgument):
            c.once_per("", 10.0)


def test_the_window_survives_a_primary_sigkill(cluster):
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=1.0, grace=0.2)

    async def main():
        async with await fastlock.connect(p.address, s.address, connect_timeout=1.0) as a:
            async with a.once_per("jobs/failover", 20.0) as lease:
                pass
            await caught_up(s.address, p.address, timeout=TIMEOUT)
            p.kill()
            async with await fastlock.connect(s.address, p.address, connect_timeout=1.0) as b:
                async with asyncio.timeout(TIMEOUT):
                    while True:
                        try:
                            holder = await b.holder("jobs/failover")
                            break
                        except (fastlock.ConnectionLost, fastlock.NotPrimary, fastlock.Unavailable):
                            await asyncio.sleep(0.05)
                assert holder is not None and holder["token"] == lease.fencing_token
                with pytest.raises(LockNotAcquired):
                    await b.once_per("jobs/failover", 20.0).start()

    run(main(), timeout=60.0)


# -- 20 workers with clocks skewed by +-1 s (libfaketime), compressed time ------------------

WORKER = r"""
import json, sys, time
from fastlock.sync import SyncClient
from fastlock import LockNotAcquired
address, name, window, offset = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
runs = []
with SyncClient(address, connect_timeout=5.0) as c:
    c.ping()
    print("ready", flush=True)
    until = float(sys.stdin.readline()) + offset  # the end, read on this worker's skewed clock
    while time.time() < until:
        try:
            with c.once_per(name, window) as lease:
                runs.append(lease.fencing_token)
                time.sleep(window / 10)  # a short job
        except LockNotAcquired:
            pass
        time.sleep(window / 20)  # the schedule: every worker tries 20 times a window
print(json.dumps(runs), flush=True)
"""


def _faketime_lib():
    for path in ("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1"):
        if os.path.exists(path):
            return path
    return None


@pytest.mark.skipif(_faketime_lib() is None or shutil.which("faketime") is None, reason="libfaketime not installed")
def test_twenty_skewed_workers_run_once_per_window(server):
    """Each worker's clocks (wall and monotonic) are offset by -1 s .. +1 s; the job runs
    exactly once per window by the server's clock (a grant every time the last run's window
    ends, never two in one window)."""
    window = 1.0
    span = 8.0  # seconds of compressed time: 8 windows of 1 s (as 8 windows of 15 min)
    name = "jobs/skewed"

    async def main():
        procs = []
        for i in range(20):
            offset = -1.0 + 2.0 * i / 19  # -1 s .. +1 s
            env = dict(os.environ, LD_PRELOAD=_faketime_lib(), FAKETIME=f"{offset:+.3f}s",
                       FAKETIME_NO_CACHE="1")
            procs.append(await asyncio.create_subprocess_exec(
                sys.executable, "-c", WORKER, server.address, name, str(window), str(offset),
                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for p in procs:  # every worker connected before the first window
            assert (await p.stdout.readline()).strip() == b"ready"
        end = f"{time.time() + span}\n".encode()
        for p in procs:
            p.stdin.write(end)
        outputs = [await p.communicate() for p in procs]
        return outputs, [p.returncode for p in procs]

    outputs, codes = run(main(), timeout=120.0)
    assert codes == [0] * 20, [err.decode()[-500:] for _, err in outputs]
    runs = sorted(token for out, _ in outputs for token in json.loads(out))
    assert len(runs) == len(set(runs))  # no token twice
    # the server's log of the name: every grant is a run that was reported, and each run's
    # lease (TTL: the window) ended by EXPIRING - never released early - before the next grant
    out = io.StringIO()
    dump(server.data_dir, lock=name, file=out, output="json")
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    records = [r for r in records if r.get("type") in ("grant", "release", "expire")]
    grants = [r for r in records if r["type"] == "grant"]
    assert sorted(g["token"] for g in grants) == runs
    assert all(g["ttl_ms"] == window * 1000 for g in grants)
    kinds = [(r["type"], r["token"]) for r in records]
    for before, after in zip(grants, grants[1:], strict=False):
        ended = kinds.index(("expire", before["token"]))
        assert ended < kinds.index(("grant", after["token"])), kinds
        assert ("release", before["token"]) not in kinds
    times = [datetime.datetime.fromisoformat(g["time"].replace("Z", "+00:00")).timestamp() for g in grants]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # the same by the server's wall clock at logging (a record is logged a little after its grant)
    assert all(gap >= window - 0.05 for gap in gaps), gaps
    assert len(runs) >= span / window / 2, runs  # (a run in most windows: workers try every 50 ms)


# -- fastlock run --once-per ----------------------------------------------------------------

def _fastlock_run(server, *args, command=("true",)):
    return subprocess.run([sys.executable, "-m", "fastlock", "run", *args, "--server", server.address, "--",
                           *command], capture_output=True, text=True, timeout=60)


def test_cli_runs_once_per_window(server, tmp_path):
    marker = tmp_path / "ran"
    first = _fastlock_run(server, "jobs/cli", "--once-per", "15m", "--ttl", "5",
                          command=(sys.executable, "-c", f"open({str(marker)!r}, 'a').write('x')"))
    assert first.returncode == 0, first.stderr
    assert marker.read_text() == "x"
    second = _fastlock_run(server, "jobs/cli", "--once-per", "15m", "--ttl", "5",
                           command=(sys.executable, "-c", f"open({str(marker)!r}, 'a').write('y')"))
    assert second.returncode == 73, second.stderr
    assert "not run in this window" in second.stderr
    assert marker.read_text() == "x"
    third = _fastlock_run(server, "jobs/cli", "--once-per", "900s", "--ttl", "5", "--conflict-exit-code", "0")
    assert third.returncode == 0
    with SyncClient(server.address) as c:
        holder = c.holder("jobs/cli")
        assert holder is not None and holder["ttl_ms"] == 900_000  # the first run's window, still running


def test_cli_once_per_arguments(server):
    for args in (["--once-per", "2h"], ["--once-per", "abc"], ["--once-per", "1s", "--ttl", "5"],
                 ["--once-per", "1m", "--wait", "1"], ["--once-per", "1m", "--shared"]):
        out = _fastlock_run(server, "jobs/cli-bad", *args)
        assert out.returncode == 2, (args, out.stderr)


def test_cli_a_run_longer_than_its_window_is_renewed_not_stopped(server):
    out = _fastlock_run(server, "jobs/cli-long", "--once-per", "1s", "--ttl", "1",
                        command=(sys.executable, "-c", "import time; time.sleep(2.5)"))
    assert out.returncode == 0, out.stderr  # not stopped by the process guard (75/76)
    with SyncClient(server.address) as c:
        assert c.holder("jobs/cli-long") is None  # released at its end: the window had passed
