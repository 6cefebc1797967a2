"""Lease-safe relaxed fsync modes: after an unclean stop of an ``interval``/``never``
run, the restarted server grants no free lock until the longest TTL has passed.

An OS crash (simulated: SIGKILL, then the active segment cut back to its last
fsynced offset, as a power cut would leave it) can take acknowledged grants with
it.  Without the grace, the lock of such a grant would be handed to a second
client at once while the first still believes it holds it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import fastlock
from fastlock._testbase import ServerProcess, power_cut
from fastlock.errors import LeaseLost, LockNotAcquired

TTL = 2.0  # seconds: the longest TTL granted, so the grace after the crash


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_lock_held_before_an_os_crash_is_not_granted_to_another_client_before_the_grace_ends(tmp_path):
    srv = ServerProcess(tmp_path / "data", fsync="never")

    async def main():
        await asyncio.to_thread(srv.start)
        first = await fastlock.connect(srv.address, client_name="first")
        try:
            for i in range(20):  # records before the grant, so the cut is not at the segment's start
                await first.release(await first.acquire(f"busy-{i}", ttl=TTL))
            lease = await first.acquire("held", ttl=TTL)
            wal = (await first.status())["wal"]
            assert wal["durable_offset"] < wal["written_offset"], wal  # the grant is not fsynced
            srv.kill()
            power_cut(srv.data_dir / wal["active_segment"], wal["durable_offset"])  # what a power cut leaves
            restarted = time.monotonic()
            await asyncio.to_thread(srv.start)
            async with fastlock.connect(srv.address, client_name="second") as second:
                assert not await second.check("held", lease.fencing_token)  # the grant was lost ...
                assert (await second.status())["grace_remaining_ms"] > 0
                for name in ("held", "never-held"):  # ... and no free lock is granted meanwhile
                    # the refusal names this grace: nothing was promoted
                    with pytest.raises(LockNotAcquired, match=rf"^'{name}': no grants of free locks during the "
                                       r"grace period after an unclean stop of a run with --fsync interval or "
                                       r"never \(grants it acknowledged may have been lost"):
                        await second.acquire(name, ttl=TTL, wait=0)
                taken = await second.acquire("held", ttl=TTL, wait=10.0)
                assert time.monotonic() - restarted >= TTL  # not before the first holder's TTL ran out
                assert taken.fencing_token > lease.fencing_token
                with pytest.raises(LeaseLost):  # the first holder learns it at its next renewal
                    await first.extend(lease)
                await second.release(taken)
        finally:
            await first.close()
        # a clean stop loses nothing: the next start grants at once
        await asyncio.to_thread(srv.stop)
        await asyncio.to_thread(srv.start)
        async with fastlock.connect(srv.address, client_name="third") as third:
            assert (await third.status())["grace_remaining_ms"] == 0
            await third.release(await third.acquire("held", ttl=TTL, wait=0))

    try:
        _run(main())
    finally:
        srv.stop()


def test_a_process_crash_in_always_mode_needs_no_grace(tmp_path):
    """``--fsync always`` loses no acknowledged grant: a restart after SIGKILL grants at once."""
    srv = ServerProcess(tmp_path / "data", fsync="always")

    async def main():
        await asyncio.to_thread(srv.start)
        async with fastlock.connect(srv.address, client_name="a") as c:
            await c.acquire("held", ttl=TTL)
        srv.kill()
        await asyncio.to_thread(srv.start)
        async with fastlock.connect(srv.address, client_name="b") as c:
            assert (await c.status())["grace_remaining_ms"] == 0
            await c.release(await c.acquire("free", ttl=TTL, wait=0))

    try:
        _run(main())
    finally:
        srv.stop()
