"""What a durable hand-off's replies wait for (``--fsync always``).

A RELEASE is acknowledged without a sync; the next waiter's grant only once its record is
durable.  When the auto writer syncs the hand-off's batch (the release's record and the
grant's) on the loop itself - one client at a time waits, as on a contended lock - the
release's reply is written before that ``fdatasync``, not after it.  A real ``fastlock serve``
process whose ``fdatasync`` stalls while a marker file exists (a ``sitecustomize`` hook on the
segment writer's I/O seam) shows which reply waits for it.
"""

from __future__ import annotations

import asyncio

from fastlock._testbase.cluster import RawNode, poll, run
from fastlock._testbase.stall import stalled_fsync_env
from fastlock.protocol.ops import OP_LOCK_INFO

#: the interval timer's period (milliseconds): longer than the test, so every sync is asked for
QUIET_TIMER = ["--fsync-interval-ms", "60000"]
#: lone acquire+release pairs first: more batches than the auto writer's run of lone batches
#: (commit.LONE_BATCHES) before it syncs on the loop
LONE_PAIRS = 12



def test_a_handoffs_release_is_answered_before_the_grants_sync(server_factory, tmp_path):
    """A holder releases with a waiter queued while the server's fdatasync stalls: the release's
    reply arrives during the stall, the waiter's grant only after it, with the next token."""
    marker = tmp_path / "stall-fsync"
    server = server_factory(fsync="always", args=[*QUIET_TIMER, "--wal-writer", "auto"],
                            env=stalled_fsync_env(tmp_path / "hook", marker))

    async def main() -> None:
        holder = await RawNode.open(server.address)
        waiter = await RawNode.open(server.address)
        try:
            for _ in range(LONE_PAIRS):  # one client alone: the auto writer now syncs on the loop
                token, _, owner = await holder.acquire("contended", 10_000)
                await holder.release("contended", token, owner)
            token, _, owner = await holder.acquire("contended", 10_000)
            granted = asyncio.ensure_future(waiter.acquire("contended", 10_000, wait_ms=10_000))
            await poll(lambda: holder.request(OP_LOCK_INFO, "contended"), lambda info: info["waiter_count"] == 1,
                       timeout=5, what="the waiter queued")
            marker.touch()
            try:
                await asyncio.wait_for(holder.release("contended", token, owner), 5)
                # answered before the grant's sync, which now stalls: the grant waits for it
                await poll(lambda: asyncio.sleep(0, (tmp_path / "stall-fsync.stalled").exists()), timeout=5,
                           what="the grant's fdatasync stalled")
                assert not granted.done()
            finally:
                marker.unlink()
            next_token, _, _ = await asyncio.wait_for(granted, 10)
            assert next_token == token + 1
        finally:
            await holder.close()
            await waiter.close()

    run(main())
