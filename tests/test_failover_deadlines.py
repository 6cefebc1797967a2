"""Failover keeps each lease's deadline, and a fenced primary acknowledges nothing.

Against real ``fastlock serve`` processes (a primary and a standby started
with ``--failover-after 1.0``):

- a promoted standby keeps the deadline it tracked for every replicated lease
  (its arrival plus the time the lease had left) instead of a fresh full TTL:
  a lease nobody renews expires about one TTL after its grant, not one TTL
  after the promotion, so repeated failovers cannot keep an orphan alive; and
  it never expires a lease before its holder's own deadline, counted from the
  holder's last extend (every extend is replicated, even one at the same TTL);
- a grant decided just before the primary freezes, and made durable only after
  its standby promoted, is answered with ``Unavailable``, not with a token of
  the old epoch; so is an extend that lengthens a TTL (it waits for durability
  too).  The WAL's fsync is stalled by a ``sitecustomize`` hook in the server
  process (only while a marker file exists), so the decision and the
  acknowledgement are certainly split by the freeze.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock._testbase.stall import stalled_fsync_env
from fastlock.client.bounded import SERVER_CLOCK_STEP
from fastlock.errors import NotPrimary, Unavailable

FAILOVER = 1.0  # --failover-after, seconds
GRACE = 0.2  # --promotion-grace, seconds
TTL_MS = 6000


async def log_line(srv, pattern: str, timeout: float) -> float:
    """Wait (in a thread) for a log line; return the monotonic time it was seen."""
    await asyncio.to_thread(srv.wait_for_log, pattern, timeout)
    return time.monotonic()


async def gone_at(node: RawNode, name: str, timeout: float) -> float:
    """Poll HOLDER of ``name`` every 20 ms; the monotonic time it is first seen free."""
    await poll(lambda: node.holder(name), lambda h: h is None, timeout=timeout, what=f"{name} to expire",
               interval=0.02)
    return time.monotonic()


def test_promotion_keeps_each_replicated_deadline(cluster):
    """Lease ``snap`` reaches the standby in its first snapshot (3 s after its
    grant, so with about 3 s left) and is never renewed; lease ``rec`` arrives
    as a grant record and is extended three times at the same TTL.  After the
    primary is killed and the standby promotes, ``snap`` expires about one TTL
    after its grant - well before one TTL after the promotion, which is what a
    fresh full TTL would give - and neither lease expires before its holder's
    own deadline (the send time of its grant or last extend plus the TTL)."""
    p = cluster.primary()

    async def main():
        a = await RawNode.open(p.address)
        try:
            snap_sent = time.monotonic()
            await a.acquire("snap", TTL_MS)
            await asyncio.sleep(0.5)  # the lease ages: the standby's snapshot carries less than its TTL
            s = await asyncio.to_thread(cluster.standby, p.address, failover_after=FAILOVER, grace=GRACE)
            rec_token, _, rec_owner = await a.acquire("rec", TTL_MS)
            for _ in range(3):
                await asyncio.sleep(0.3)
                rec_sent = time.monotonic()
                assert await a.extend("rec", rec_token, rec_owner, TTL_MS) == TTL_MS
            await poll(lambda: status_of(s.address),
                       lambda st: st["replication"]["lag_records"] == 0 and st["locks_held"] == 2,
                       timeout=5, what="standby caught up")
        finally:
            await a.close()
        promoted = asyncio.ensure_future(log_line(s, r"PROMOTED", 10))
        await asyncio.to_thread(p.kill)
        promoted_at = await promoted
        b = await RawNode.open(s.address)
        try:
            snap_gone, rec_gone = await asyncio.gather(gone_at(b, "snap", 15), gone_at(b, "rec", 15))
        finally:
            await b.close()
        ttl = TTL_MS / 1000
        # never before the holder's own deadline, less the server's clock step (it reads its clock in
        # whole, truncated milliseconds: fastlock.client.bounded.SERVER_CLOCK_STEP, which clients allow for)
        early = SERVER_CLOCK_STEP
        assert snap_gone >= snap_sent + ttl - early, f"snap expired {snap_sent + ttl - snap_gone:.4f} s early"
        assert rec_gone >= rec_sent + ttl - early, f"rec expired {rec_sent + ttl - rec_gone:.4f} s early"
        # and not a fresh full TTL from the promotion
        assert snap_gone < promoted_at + ttl - 1.0, (
            f"snap lived {snap_gone - promoted_at:.3f} s after the promotion (ttl {ttl} s)")
        for name in ("snap", "rec"):
            s.wait_for_log(rf"lease expired: '{name}'", 5)
        print(f"\nsnap: granted -{promoted_at - snap_sent:.2f} s, expired +{snap_gone - promoted_at:.2f} s "
              f"after the promotion; rec: last extend -{promoted_at - rec_sent:.2f} s, expired "
              f"+{rec_gone - promoted_at:.2f} s")

    run(main())




def test_grant_made_durable_after_promotion_is_not_acknowledged(cluster, tmp_path):
    """Stall the primary's fsync, send an acquire and a TTL-lengthening extend
    (both wait for durability), SIGSTOP the primary, let the standby promote,
    un-stall, SIGCONT: both requests get ``Unavailable`` (or ``NotPrimary`` if
    the old primary already stepped down) - no token of the old epoch."""
    marker = tmp_path / "stall-fsync"
    # the writer thread syncs every batch (the hook stalls it there; the loop stays free)
    p = cluster.primary(env=stalled_fsync_env(tmp_path / "hook", marker, writer_thread_only=True),
                        args=["--wal-writer", "thread"])
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)

    async def main():
        a = await RawNode.open(p.address)
        try:
            held, _, held_owner = await a.acquire("held", 3000)
            await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 1, timeout=5,
                       what="standby has the lease")
            marker.touch()
            granted = asyncio.ensure_future(a.acquire("late", 5000))
            extended = asyncio.ensure_future(a.extend("held", held, held_owner, 10_000))
            await poll(lambda: asyncio.sleep(0, (tmp_path / "stall-fsync.stalled").exists()), timeout=5,
                       what="the primary's fsync stalled")
            await poll(lambda: a.status(), lambda st: st["locks_held"] == 2, timeout=5,
                       what="the grant decided")
            assert not granted.done() and not extended.done()
            promoted = asyncio.ensure_future(log_line(s, r"PROMOTED", 10))
            p.pause()
            try:
                await promoted
                marker.unlink()
            finally:
                p.resume()
            for fut in (granted, extended):
                with pytest.raises((Unavailable, NotPrimary)):
                    await asyncio.wait_for(fut, 10)
        finally:
            marker.unlink(missing_ok=True)
            await a.close()
        # the new primary never heard of "late" (its grant record was never sent)
        b = await RawNode.open(s.address)
        try:
            assert await b.holder("late") is None
            assert b.hello["epoch"] == 1
        finally:
            await b.close()
        p.wait_for_log(r"grant 'late' token \d+ decided but not acknowledged", 5)
        p.wait_for_log(r"extend of 'held' token \d+ not acknowledged", 5)

    run(main())
