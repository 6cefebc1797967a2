"""Double barriers and countdown latches (issue 29, item 2): participants pass together
with no early leaver; a participant killed with SIGKILL breaks the round for the others
(BrokenBarrier) instead of hanging them; a latch keeps its count across a primary's
SIGKILL."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from test_replication import caught_up

import fastlock
from fastlock import BrokenBarrier
from fastlock._testbase.cluster import run
from fastlock.errors import KeyNotFound

TIMEOUT = 30.0


async def test_rounds_of_a_double_barrier_have_no_early_leaver(connect):
    count, rounds = 4, 5
    entered = [0] * (rounds + 1)
    left = [0] * (rounds + 1)
    clients = [await connect(f"p{i}") for i in range(count)]

    async def participant(i):
        barrier = clients[i].double_barrier("bar/rounds", count, participant=f"p{i}", ttl=5.0)
        try:
            for r in range(1, rounds + 1):
                entered[r] += 1
                await barrier.enter()
                assert entered[r] == count, (i, r, entered[r])  # nobody passed before all entered
                assert barrier.round == r
                left[r] += 1
                await barrier.leave()
                assert left[r] == count, (i, r, left[r])  # nobody left before all were leaving
        finally:
            await barrier.close()

    async with asyncio.timeout(TIMEOUT * 2):
        await asyncio.gather(*(participant(i) for i in range(count)))
    assert await clients[0].list_prefix("bar/rounds/") == []  # every round's keys are gone


KILLED = r"""
import asyncio, sys
import fastlock

async def main():
    async with await fastlock.connect(sys.argv[1]) as c:
        b = c.double_barrier("bar/kill", 4, participant="doomed", ttl=1.0)
        await b._hold()
        b.round += 1
        await c.put(f"bar/kill/{b.round}/doomed", b"", lease=b.lease)
        print("entered", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_participant_killed_breaks_the_round_for_every_other(server, connect):
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", KILLED, server.address,
                                                stdout=subprocess.PIPE)
    try:
        async with asyncio.timeout(TIMEOUT):
            assert (await proc.stdout.readline()).strip() == b"entered"
        clients = [await connect(f"p{i}") for i in range(2)]
        barriers = [c.double_barrier("bar/kill", 4, participant=f"p{i}", ttl=5.0) for i, c in enumerate(clients)]
        waits = [asyncio.ensure_future(b.enter()) for b in barriers]
        async with asyncio.timeout(TIMEOUT):
            while len(await clients[0].list_prefix("bar/kill/1/")) < 3:
                await asyncio.sleep(0.02)
        assert not any(w.done() for w in waits)
        proc.kill()  # SIGKILL: its lease (TTL 1 s) is no longer renewed
        for w in waits:
            with pytest.raises(BrokenBarrier):
                async with asyncio.timeout(TIMEOUT):
                    await w
        for b in barriers:
            await b.close()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_a_latch_opens_when_every_party_counted_down(connect):
    a, b = await connect("a"), await connect("b")
    latch = a.latch("latch/open")
    assert await latch.create(3)
    assert not await b.latch("latch/open").create(3)  # exists with that count
    with pytest.raises(fastlock.InvalidArgument):
        await b.latch("latch/open").create(4)
    waiter = asyncio.ensure_future(b.latch("latch/open").wait())
    assert await latch.count_down("x")
    assert not await latch.count_down("x")  # a party counts once
    assert await latch.remaining() == 2
    await latch.count_down("y")
    assert not waiter.done()
    await b.latch("latch/open").count_down("z")
    async with asyncio.timeout(TIMEOUT):
        await waiter
    assert await latch.remaining() == 0
    with pytest.raises(fastlock.LockNotAcquired):
        await _no_latch_wait(a)
    with pytest.raises(KeyNotFound):
        await a.latch("latch/none").wait()
    await latch.delete()
    assert await a.list_prefix("latch/open/") == []


@pytest.mark.parametrize("stored", [b"0", b"-1", b"abc", b"", b" 3", b"3_0", b"10000", b"\xff"])
async def test_a_latch_with_a_malformed_count_key_raises_and_never_opens(connect, stored):
    c = await connect("c")
    await c.put("latch/bad/count", stored)
    latch = c.latch("latch/bad")
    for call in (latch.wait, latch.remaining, latch.count_total):
        with pytest.raises(fastlock.InvalidArgument, match="malformed count key"):
            await call()
    with pytest.raises(fastlock.InvalidArgument, match="malformed count key"):
        await latch.create(3)
    assert (await c.get("latch/bad/count")).value == stored  # nothing changed


async def _no_latch_wait(client):
    latch = client.latch("latch/slow")
    await latch.create(2)
    await latch.wait(timeout=0.1)


def test_a_latch_keeps_its_count_across_a_primary_sigkill(cluster):
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=1.0, grace=0.2)

    async def main():
        async with await fastlock.connect(p.address, s.address, connect_timeout=1.0) as c:
            latch = c.latch("latch/failover")
            await latch.create(3)
            await latch.count_down("a")
            await latch.count_down("b")
            await caught_up(s.address, p.address, timeout=TIMEOUT)
            p.kill()
            async with asyncio.timeout(TIMEOUT):
                while True:
                    try:
                        left = await latch.remaining()
                        break
                    except (fastlock.ConnectionLost, fastlock.NotPrimary, fastlock.Unavailable):
                        await asyncio.sleep(0.05)
            assert left == 1
            assert not await latch.count_down("a")  # counted before the failover: not again
            waiter = asyncio.ensure_future(latch.wait())
            await latch.count_down("c")
            async with asyncio.timeout(TIMEOUT):
                await waiter

    run(main(), timeout=90.0)


def test_blocking_client(server):
    import threading

    from fastlock.sync import SyncClient

    with SyncClient(server.address) as a, SyncClient(server.address) as b:
        latch = a.latch("latch/sync")
        assert latch.create(1)
        latch.count_down("only")
        b.latch("latch/sync").wait(timeout=TIMEOUT)
        errors: list[Exception] = []

        def other():
            try:
                with b.double_barrier("bar/sync", 2, participant="b", ttl=5.0) as barrier:
                    assert barrier.barrier.round == 1
                barrier.close()
            except (AssertionError, fastlock.FastlockError) as exc:  # reported below
                errors.append(exc)

        t = threading.Thread(target=other)
        t.start()
        mine = a.double_barrier("bar/sync", 2, participant="a", ttl=5.0)
        with mine:
            pass
        mine.close()
        t.join(TIMEOUT)
        assert not t.is_alive() and not errors
