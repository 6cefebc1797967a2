"""Crash tests: SIGKILL a real server under load, restart it, check nothing acknowledged is lost.

Checks the guarantees that fencing tokens never go backwards nor are reused, and that
nothing acknowledged is lost.

* ``test_sigkill_under_load``: the CI-size run of ``benches/crash.py`` (see its
  docstring for the workload and every check): 12 SIGKILLs at random moments
  (seeded), workers doing acquire -> fenced SQLite write -> release, restart on
  the same data dir and port, and after each restart: every acknowledged,
  unreleased grant still held with the same token, every later token above
  every token acknowledged before, the fenced ledger consistent.
* ``test_sigkill_during_snapshots_and_compaction``: the same with frequent
  snapshots, so that kills also hit snapshot writes and segment deletion.
* ``test_power_cut_in_always_mode_keeps_every_acknowledged_grant``: the same cut
  in ``always`` mode loses no acknowledged grant.
* ``test_lost_unsynced_tail_never_reuses_a_token``: ``--fsync interval`` and
  ``never`` acknowledge grants before they are on disk.  SIGKILL alone loses
  nothing (the page cache survives the process), so after the kill everything
  after the active segment's last fsynced offset is zeroed (``power_cut``), as a
  power cut would leave the preallocated segment;
  acknowledged grants are then really gone, yet the next token is above every
  token acknowledged before (the RESERVE record), and the fence rejects the
  forgotten holder's late write.

Each test runs once (not once per event loop): the server is a separate
process either way, and the crash run is the slow part of the suite.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from pathlib import Path

import pytest

import fastlock
from fastlock._testbase import ServerProcess, power_cut
from fastlock.errors import StaleFencingToken
from fastlock.fencing import SQLiteFence
from fastlock.wal.format import SEG_HEADER, FrameReader

# benches/ is not installed with the package: import it from the source tree
# (appended, so that ``fastlock`` itself still comes from the installed package)
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from benches.crash import CrashConfig, run_crash  # noqa: E402

COUNTER_MASK = (1 << 40) - 1


def _run(coro):
    return asyncio.run(coro)


@pytest.mark.timeout(90)
def test_sigkill_under_load(tmp_path):
    # 12 kills under load, and after every 4th one a second kill while the server restarts;
    # each round makes 20 grants before its random delay to the kill starts, so that the
    # counts checked below do not depend on how fast the machine is
    cfg = CrashConfig(kills=12, workers=8, locks=6, seed=20251130, startup_kill_every=4, min_round_grants=20)
    report = _run(run_crash(cfg, str(tmp_path)))
    print("\ncrash run:", report.summary())
    assert report.violations == [], "\n".join(report.violations[:20])
    assert report.kills >= 12
    # the run really exercised what it claims to check
    assert report.grants >= 200 and report.writes >= 200
    assert report.ledger_rows == report.writes
    assert report.held_at_kill >= 5, "too few leases were held at a kill to mean anything"


@pytest.mark.timeout(90)
def test_sigkill_during_snapshots_and_compaction(tmp_path):
    """The same run with a snapshot every 50 records: kills also land while a snapshot is
    written or covered segments are deleted, and recovery starts from snapshots.  A restart
    counts records towards the next snapshot from zero, so each round makes 40 grants (80
    records with their releases) before its random delay to the kill starts, however slow
    the machine."""
    cfg = CrashConfig(kills=10, workers=8, locks=6, seed=7, snapshot_every=50, min_round_grants=40)
    report = _run(run_crash(cfg, str(tmp_path)))
    print("\ncrash run with snapshots:", report.summary())
    assert report.violations == [], "\n".join(report.violations[:20])
    assert report.kills == 10 and report.grants >= 100
    assert report.snapshots >= 5 and report.segments_deleted >= 1


#: seconds: the leases' TTL in the lost-tail rounds, so the restart grace each crash costs
TAIL_TTL = 1.0


async def _lose_tail_round(srv: ServerProcess, rnd: int, acked: list[int], fence: SQLiteFence):
    """Acknowledge many grants, then SIGKILL and cut the unsynced tail.  Returns (lost bytes,
    the leases held at the crash)."""
    async with fastlock.connect(srv.address, client_name=f"tail-{rnd}") as c:
        held = []
        for i in range(150):
            lease = await c.acquire(f"tail/r{rnd}/busy-{i % 7}", ttl=TAIL_TTL, wait=0)
            acked.append(lease.fencing_token)
            await c.release(lease)
        for i in range(10):
            lease = await c.acquire(f"tail/r{rnd}/held-{i}", ttl=TAIL_TTL, wait=0)
            acked.append(lease.fencing_token)
            held.append(lease)
        fence.execute("tail/ledger", held[0].fencing_token, "INSERT INTO ledger (token) VALUES (?)",
                      (held[0].fencing_token,))
        wal = (await c.status())["wal"]
    # everything was handed to the OS, but not all of it was fsynced
    assert wal["pending_bytes"] == 0 and wal["written_lsn"] == wal["last_lsn"]
    assert wal["durable_offset"] < wal["written_offset"], wal
    srv.kill()
    seg = str(srv.data_dir / wal["active_segment"])  # a client sees its file name
    with open(seg, "rb") as f:
        data = f.read()
    reader = FrameReader(data, SEG_HEADER.size, seg, 1, last=True)
    assert sum(1 for _ in reader) and reader.end == wal["written_offset"]  # SIGKILL alone lost nothing
    assert reader.zero_tail == len(data) - reader.end  # preallocated zeros after the records
    return power_cut(seg, wal["durable_offset"]), held  # ... a power cut would have


@pytest.mark.parametrize("mode,args", [("interval", ["--fsync-interval-ms", "10000"]), ("never", [])])
def test_lost_unsynced_tail_never_reuses_a_token(tmp_path, mode, args):
    db = sqlite3.connect(str(tmp_path / "ledger.sqlite"), isolation_level=None)
    db.execute("CREATE TABLE ledger (id INTEGER PRIMARY KEY, token INTEGER)")
    fence = SQLiteFence(db)
    fence.ensure_schema()
    srv = ServerProcess(tmp_path / "data", fsync=mode, args=args)

    async def main():
        acked: list[int] = []
        await asyncio.to_thread(srv.start)
        for rnd in range(2):  # the second crash follows a recovery from the first
            before = list(acked)
            lost, held = await _lose_tail_round(srv, rnd, acked, fence)
            assert lost > 0
            # every token of this round was above everything acknowledged before the last crash
            assert min(acked[len(before):]) > max(before, default=-1)
            await asyncio.to_thread(srv.start)  # same data dir, same port
            async with fastlock.connect(srv.address, client_name="after") as c:
                st = await c.status()
                assert st["counter"] >= max(acked) & COUNTER_MASK
                # acknowledged grants really were lost with the tail (the documented trade-off) ...
                forgotten = [lease for lease in held if not await c.check(lease.name, lease.fencing_token)]
                assert forgotten, "the cut tail should have taken acknowledged grants with it"
                for lease in held:  # the ones that did survive (if any): recovered with a fresh TTL
                    if lease not in forgotten:
                        await c.release(lease)
                # ... yet the next token is above every token acknowledged before the crash (granted
                # once the restart grace - the longest TTL - is over: see test_relaxed_restart.py)
                old = forgotten[0]
                nxt = await c.acquire(old.name, ttl=TAIL_TTL, wait=10.0)
                assert nxt.fencing_token > max(acked), (nxt.fencing_token, max(acked))
                # and fencing protects the data: the new holder writes, the forgotten one is refused
                fence.execute("tail/ledger", nxt.fencing_token, "INSERT INTO ledger (token) VALUES (?)",
                              (nxt.fencing_token,))
                with pytest.raises(StaleFencingToken):
                    fence.execute("tail/ledger", old.fencing_token,
                                  "INSERT INTO ledger (token) VALUES (?)", (old.fencing_token,))
                acked.append(nxt.fencing_token)
                await c.release(nxt)
        tokens = [t for (t,) in db.execute("SELECT token FROM ledger ORDER BY id")]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)

    try:
        _run(asyncio.wait_for(main(), 60))
    finally:
        srv.stop()
        db.close()


def test_power_cut_in_always_mode_keeps_every_acknowledged_grant(tmp_path):
    """``--fsync always``: cutting the active segment back to its fsynced size (a power cut)
    loses no acknowledged grant; only releases acknowledged after the last fsync may come back."""
    srv = ServerProcess(tmp_path / "data", fsync="always")

    async def main():
        await asyncio.to_thread(srv.start)
        async with fastlock.connect(srv.address, client_name="pc") as c:
            held = [await c.acquire(f"pc/held-{i}", ttl=30.0) for i in range(50)]
            released = []
            for i in range(50):
                lease = await c.acquire(f"pc/busy-{i}", ttl=30.0)
                await c.release(lease)
                released.append(lease)
            wal = (await c.status())["wal"]
        srv.kill()
        power_cut(srv.data_dir / wal["active_segment"], wal["durable_offset"])
        await asyncio.to_thread(srv.start)
        async with fastlock.connect(srv.address, client_name="pc-check") as c:
            for lease in held:
                assert await c.check(lease.name, lease.fencing_token), lease.name
            # a grant's fsync covers every release logged before it: only the last release,
            # acknowledged after the last grant, can have missed the last fsync
            back = [lease for lease in released if await c.check(lease.name, lease.fencing_token)]
            assert back in ([], released[-1:])
            nxt = await c.acquire("pc/next", ttl=30.0)
            assert nxt.fencing_token > max(lease.fencing_token for lease in held + released)

    try:
        _run(asyncio.wait_for(main(), 60))
    finally:
        srv.stop()


def test_sigkill_after_a_lone_durable_grant_keeps_it(tmp_path):
    """``--fsync always``, one client alone: once the auto writer syncs its batches on the loop
    at the batch end (``fastlock.wal.commit.LONE_BATCHES`` batches in a row), a grant acknowledged
    right before a SIGKILL and a power cut (the segment cut back to its fsynced size) is held
    after the restart."""
    from fastlock.wal.commit import LONE_BATCHES

    srv = ServerProcess(tmp_path / "data", fsync="always")

    async def main():
        await asyncio.to_thread(srv.start)
        async with fastlock.connect(srv.address, client_name="lone") as c:
            for i in range(LONE_BATCHES + 2):  # the pairs that make the client alone
                await c.release(await c.acquire(f"lone/busy-{i}", ttl=30.0))
            before = (await c.status())["wal"]
            lease = await c.acquire("lone/held", ttl=30.0)
            wal = (await c.status())["wal"]
        # the grant was synced on the loop (no thread sync since), and nothing is unsynced
        assert wal["fsyncs"] > before["fsyncs"] and wal["thread_fsyncs"] == before["thread_fsyncs"], wal
        assert wal["durable_offset"] == wal["written_offset"], wal
        srv.kill()
        power_cut(srv.data_dir / wal["active_segment"], wal["durable_offset"])
        await asyncio.to_thread(srv.start)
        async with fastlock.connect(srv.address, client_name="lone-check") as c:
            assert await c.check(lease.name, lease.fencing_token)
            nxt = await c.acquire("lone/next", ttl=30.0)
            assert nxt.fencing_token > lease.fencing_token

    try:
        _run(asyncio.wait_for(main(), 60))
    finally:
        srv.stop()


def test_power_cut_in_always_mode_keeps_every_grant_acknowledged_to_clients_waiting_together(tmp_path):
    """``--fsync always``, 24 clients acquiring and releasing together, some on a shared lock (a
    release hands it to a waiter): the grants of a loop turn's batch ends are acknowledged by one
    durability callback of the written batch; none is answered before its record's fsync, so the
    segment cut back to its fsynced size (a power cut) after a SIGKILL keeps every lease the
    clients were told they hold, and the next token is above every one acknowledged."""
    srv = ServerProcess(tmp_path / "data", fsync="always")

    async def main():
        await asyncio.to_thread(srv.start)
        clients = [await fastlock.connect(srv.address, client_name=f"tg-{i}").__aenter__() for i in range(24)]
        try:
            async def work(i: int, c) -> list:
                held = []
                for j in range(20):
                    name = "tg/shared" if j % 5 == 0 else f"tg/own-{i}"
                    lease = await c.acquire(name, ttl=30.0, wait=30.0)
                    if j == 19:
                        held.append(lease)
                        break
                    await c.release(lease)
                held.append(await c.acquire(f"tg/held-{i}", ttl=30.0))
                return held

            held = [lease for got in await asyncio.gather(*(work(i, c) for i, c in enumerate(clients)))
                    for lease in got]
            wal = (await clients[0].status())["wal"]
        finally:
            for c in clients:
                await c.__aexit__(None, None, None)
        assert wal["thread_fsyncs"] > 0, wal  # (the clients waited together: batches on the writer thread)
        srv.kill()
        power_cut(srv.data_dir / wal["active_segment"], wal["durable_offset"])
        await asyncio.to_thread(srv.start)
        async with fastlock.connect(srv.address, client_name="tg-check") as c:
            for lease in held:
                assert await c.check(lease.name, lease.fencing_token), lease.name
            nxt = await c.acquire("tg/next", ttl=30.0)
            assert nxt.fencing_token > max(lease.fencing_token for lease in held)

    try:
        _run(asyncio.wait_for(main(), 60))
    finally:
        srv.stop()
