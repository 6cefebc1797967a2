"""A task (or a blocking client's thread) that acquires a lock it already holds
(issue 14): it is told so at once, with the held token, instead of queueing behind its
own lease; other tasks and threads of the same client queue as usual, and
``queue_behind_self=True`` queues anyway."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest

import fastlock
from fastlock import AlreadyHeld, LockNotAcquired
from fastlock.sync import SyncClient

TIMEOUT = 10.0


def test_a_blocking_acquire_of_a_held_lock_raises_at_once(server):
    async def main():
        async with await fastlock.connect(server.address) as client:
            async with client.lock("jobs/1", ttl=30.0) as lease:
                with pytest.raises(AlreadyHeld) as err:
                    async with asyncio.timeout(TIMEOUT):   # the same task (wait_for would make another)
                        await client.acquire("jobs/1", ttl=5.0, wait=None)
                assert err.value.token == lease.fencing_token
                assert str(lease.fencing_token) in str(err.value)
                assert isinstance(err.value, LockNotAcquired)
                with pytest.raises(AlreadyHeld):
                    async with asyncio.timeout(TIMEOUT):
                        await client.lock("jobs/1", ttl=5.0, wait=2.0)
                # another name, and another client, are not affected
                other = await client.acquire("jobs/2", ttl=5.0, wait=0)
                await client.release(other)
                async with await fastlock.connect(server.address) as second:
                    with pytest.raises(LockNotAcquired) as err2:
                        await second.acquire("jobs/1", ttl=5.0, wait=0.2)
                    assert not isinstance(err2.value, AlreadyHeld)
            # released: the same client takes it again, with a higher token
            again = await asyncio.wait_for(client.acquire("jobs/1", ttl=5.0, wait=None), TIMEOUT)
            assert again.fencing_token > lease.fencing_token
            await client.release(again)
    asyncio.run(main())


def test_a_lost_or_expired_lease_does_not_block_the_next_acquire(server):
    async def main():
        async with await fastlock.connect(server.address) as client:
            short = await client.acquire("jobs/short", ttl=0.2)
            # the TTL passes (no renewer): the server expires it, the check sees it dead
            deadline = asyncio.get_running_loop().time() + TIMEOUT
            while short.time_left() > 0:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.05)
            lease = await asyncio.wait_for(client.acquire("jobs/short", ttl=5.0, wait=None), TIMEOUT)
            assert lease.fencing_token > short.fencing_token
            lease.lost.set()     # known lost (as a refused renewal marks it)
            with pytest.raises(LockNotAcquired) as err:
                await client.acquire("jobs/short", ttl=5.0, wait=0.2)   # the server still has it
            assert not isinstance(err.value, AlreadyHeld)
    asyncio.run(main())


def test_other_tasks_queue_and_queue_behind_self_waits_in_the_same_task(server):
    async def main():
        async with await fastlock.connect(server.address) as client:
            first = await client.acquire("shared/1", ttl=30.0)
            # a task that is a caller of its own (not one acting for the holder, as a task it
            # creates is by default) queues as usual: it is listed as a waiter
            other = asyncio.create_task(client.acquire("shared/1", ttl=30.0, wait=TIMEOUT),
                                        context=contextvars.Context())
            async with asyncio.timeout(TIMEOUT):
                while (await client.lock_info("shared/1")).waiters == []:
                    assert not other.done()
                    await asyncio.sleep(0.02)
            await client.release(first)
            second = await asyncio.wait_for(other, TIMEOUT)
            assert second.fencing_token > first.fencing_token
            # the same task queues behind its own lease when asked; a timer releases it
            asyncio.get_running_loop().call_later(0.3, client.release_nowait, second)
            async with asyncio.timeout(TIMEOUT):
                third = await client.acquire("shared/1", ttl=30.0, wait=TIMEOUT, queue_behind_self=True)
            assert third.fencing_token > second.fencing_token
            await client.release(third)
    asyncio.run(main())


def test_the_blocking_client_raises_at_once_too(server):
    with SyncClient(server.address) as client:
        with client.lock("sync/1", ttl=30.0) as lease:
            with pytest.raises(AlreadyHeld) as err:
                client.acquire("sync/1", ttl=5.0, wait=None)
            assert err.value.token == lease.fencing_token
            with pytest.raises(AlreadyHeld):
                with client.lock("sync/1", ttl=5.0, wait=None):
                    pass
            # another thread sharing the client waits for this one, as usual
            got: list[int] = []
            other = threading.Thread(target=lambda: got.append(client.acquire("sync/1", ttl=5.0,
                                                                              wait=TIMEOUT).fencing_token))
            other.start()
            deadline = time.monotonic() + TIMEOUT
            while client.lock_info("sync/1").waiters == []:
                assert time.monotonic() < deadline and other.is_alive()
                time.sleep(0.02)
        other.join(TIMEOUT)
        assert got and got[0] > lease.fencing_token


def test_the_table_of_held_leases_stays_bounded_by_the_live_ones():
    """Leases that expire without release are swept out as the table grows (a client
    that takes many names and lets them expire does not keep them all)."""
    from fastlock.client.acquire import SWEEP_MIN, HeldLeases
    from fastlock.client.lease import Lease, LeaseState

    async def main():
        held = HeldLeases()
        now = asyncio.get_running_loop().time()
        live = [Lease(f"live/{i}", i + 1, 60.0, b"k" * 16, LeaseState(now + 60.0)) for i in range(10)]
        for lease in live:
            held.remember(lease, True)
        for i in range(5 * SWEEP_MIN):
            held.remember(Lease(f"gone/{i}", 100 + i, 1.0, b"k" * 16, LeaseState(now - 1.0)), True)
            assert len(held.by_name) <= SWEEP_MIN
        assert all(held.by_name[lease.name].lease is lease for lease in live)
    asyncio.run(main())


def test_a_shared_holder_may_ask_for_another_shared_lease_but_not_an_exclusive_one(server):
    async def main():
        async with await fastlock.connect(server.address) as client:
            reader = await client.acquire("doc/1", ttl=30.0, shared=True)
            async with asyncio.timeout(TIMEOUT):
                second = await client.acquire("doc/1", ttl=30.0, shared=True, wait=TIMEOUT)   # beside it
                with pytest.raises(AlreadyHeld) as err:
                    await client.acquire("doc/1", ttl=30.0, wait=TIMEOUT)                     # would wait for itself
            assert err.value.token == second.fencing_token
            await client.release(second)
            await client.release(reader)
    asyncio.run(main())
