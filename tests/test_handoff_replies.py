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
import textwrap

from fastlock._testbase.cluster import RawNode, poll, run
from fastlock.protocol.ops import OP_LOCK_INFO

#: the interval timer's period (milliseconds): longer than the test, so every sync is asked for
QUIET_TIMER = ["--fsync-interval-ms", "60000"]
#: lone acquire+release pairs first: more batches than the auto writer's run of lone batches
#: (commit.LONE_BATCHES) before it syncs on the loop
LONE_PAIRS = 12

STALL_HOOK = textwrap.dedent('''
    """Test hook: every WAL fdatasync waits while a marker file exists (it says so in
    ``<marker>.stalled``).  It wraps the segment writer's I/O seam (``SegmentWriter.disk``)."""
    import os
    import time
    import types

    _marker = os.environ.get("FASTLOCK_TEST_STALL_FSYNC")
    if _marker:
        from fastlock.wal import writer as _writer

        _init = _writer.SegmentWriter.__init__

        def _stalling_init(self, *args, **kwargs):
            _init(self, *args, **kwargs)
            real = self.disk

            def datasync(fd):
                if os.path.exists(_marker):
                    open(_marker + ".stalled", "w").close()
                    deadline = time.monotonic() + 20
                    while os.path.exists(_marker) and time.monotonic() < deadline:
                        time.sleep(0.005)
                return real.datasync(fd)

            self.disk = types.SimpleNamespace(pwrite_all=real.pwrite_all, datasync=datasync,
                                              zero_fill=real.zero_fill)

        _writer.SegmentWriter.__init__ = _stalling_init
''')


def test_a_handoffs_release_is_answered_before_the_grants_sync(server_factory, tmp_path):
    """A holder releases with a waiter queued while the server's fdatasync stalls: the release's
    reply arrives during the stall, the waiter's grant only after it, with the next token."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STALL_HOOK)
    marker = tmp_path / "stall-fsync"
    server = server_factory(fsync="always", args=[*QUIET_TIMER, "--wal-writer", "auto"],
                            env={"PYTHONPATH": str(hook), "FASTLOCK_TEST_STALL_FSYNC": str(marker)})

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
