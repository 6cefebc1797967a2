"""Multi-lock (all or none, in one global order) against a real server process."""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest
from conftest import wait_until

import fastlock
from fastlock._testbase import HistoryChecker

TIMEOUT = 10.0


async def holders(client, names):
    return [await client.holder(n) for n in names]


async def test_acquire_many_takes_all_in_byte_order_and_releases_all(client, connect):
    watcher = await connect("watcher")
    names = ["b", "é", "a", "Z", "aa"]  # code point / UTF-8 byte order: Z a aa b é
    granted: list[str] = []
    ready = [asyncio.Event() for _ in names]

    async def watch(name, ready):
        async for event in watcher.watch(name):
            if event.kind == "free":
                ready.set()  # subscribed: every later change will be pushed
            elif event.kind == "granted":
                granted.append(name)
                return

    watchers = [asyncio.ensure_future(watch(n, r)) for n, r in zip(names, ready)]
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), TIMEOUT)
    multi = await client.acquire_many(names, ttl=5.0)
    await asyncio.wait_for(asyncio.gather(*watchers), TIMEOUT)
    assert multi.names == ("Z", "a", "aa", "b", "é")
    assert granted == list(multi.names)  # the server saw them granted in that order
    assert set(multi.fencing_tokens) == set(names)
    for name in names:
        assert await client.check(name, multi[name].fencing_token)
    await client.release_many(multi)
    assert await holders(client, names) == [None] * len(names)
    with pytest.raises(fastlock.LeaseLost):
        await client.release_many(multi)
    assert multi.lost.is_set()


@pytest.mark.parametrize("names", [[], ["a", "a"], ["a", "b", "a"], "ab", [1], None])
def test_bad_name_sets_are_refused_before_sending(names):
    client = fastlock.Client(["127.0.0.1:1"])  # never connects
    with pytest.raises((fastlock.InvalidArgument, fastlock.WrongArgumentType)):
        client.lock_many(names, ttl=1.0)


async def test_timeout_releases_what_was_taken(client, connect):
    other = await connect("other")
    blocker = await other.acquire("m2", ttl=10.0)
    t0 = time.monotonic()
    with pytest.raises(fastlock.LockNotAcquired):
        await client.acquire_many(["m1", "m2", "m3"], ttl=10.0, wait=0.3)
    assert time.monotonic() - t0 >= 0.29  # it waited (the upper end is the call's deadline, wait + connect)
    # the set waited as one request holding none of its names; it left every queue
    assert await client.holder("m1") is None
    assert await client.holder("m3") is None
    assert (await client.status())["waiters"] == 0
    await other.release(blocker)


async def test_cancel_withdraws_the_waiting_set(client, connect):
    other = await connect("other")
    blocker = await other.acquire("c2", ttl=10.0)
    task = asyncio.ensure_future(client.acquire_many(["c1", "c2"], ttl=10.0))
    await wait_until(lambda: queued(other, 2), what="the set waiting on c1 and c2")
    assert (await other.holder("c1")) is None  # a waiting set holds none of its names
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: no_holder(other, "c1"), what="c1 released after cancel")
    await wait_until(lambda: queued(other, 0), what="waiter for c2 removed")
    await other.release(blocker)


async def queued(client, n):
    return (await client.status())["waiters"] == n


async def no_holder(client, name):
    return await client.holder(name) is None


async def test_lock_many_renews_every_lease_and_releases_on_exit(client, connect):
    other = await connect("other")
    async with client.lock_many(["r1", "r2"], ttl=0.3) as multi:
        await asyncio.sleep(1.0)  # hold for > 3 TTLs: only renewal keeps them
        assert not multi.lost.is_set()
        for lease in multi:
            assert await other.check(lease.name, lease.fencing_token)
    assert await holders(other, ["r1", "r2"]) == [None, None]


async def test_lock_many_lost_is_set_when_any_lease_is_lost(client, server):
    multi = await client.lock_many(["l1", "l2"], ttl=0.5)
    server.pause()  # renewals cannot get through; the client gives up at its TTL
    try:
        await asyncio.wait_for(multi.lost.wait(), TIMEOUT)
    finally:
        server.resume()
    assert multi.lost_names()
    # the client gives up at its own TTL, before the resumed server has expired the leases:
    # wait (bounded) until the server has, then a release must find nothing to release
    deadline = time.monotonic() + TIMEOUT
    while any([await client.holder(n) for n in ("l1", "l2")]):
        assert time.monotonic() < deadline, "the server never expired the leases"
        await asyncio.sleep(0.05)
    with pytest.raises(fastlock.LeaseLost):
        await client.release_many(multi)


async def test_20_tasks_overlapping_sets_no_deadlock_and_exclusion(connect):
    """Random overlapping multi-locks and single locks for 3 s (the issue's
    10 s: ``FASTLOCK_MULTILOCK_SECONDS=10 pytest tests/test_multilock.py -k 20_tasks``)."""
    seconds = float(os.environ.get("FASTLOCK_MULTILOCK_SECONDS", "3"))
    holdings = await _random_overlapping_sets(connect, duration=seconds, tasks=20, names=8)
    print(f"{holdings} holdings in {seconds} s, no deadlock, exclusion held on every name")


async def _random_overlapping_sets(connect, *, duration: float, tasks: int, names: int) -> int:
    pool = [f"res/{i}" for i in range(names)]
    clients = [await connect(f"m{i}") for i in range(5)]  # 4 tasks share each client
    history = HistoryChecker()
    inside: dict[str, int] = {n: 0 for n in pool}
    stop_at = time.monotonic() + duration
    done = [0] * tasks

    async def worker(i: int) -> None:
        rng = random.Random(i)
        c = clients[i % len(clients)]
        while time.monotonic() < stop_at:
            chosen = rng.sample(pool, rng.randint(1, 4))
            if i % 5 == 0 and len(chosen) == 1:  # some single-lock users on the same names
                multi_names = None
                lease = await c.acquire(chosen[0], ttl=5.0)
                leases = [lease]
            else:
                multi_names = chosen
                multi = await c.acquire_many(chosen, ttl=5.0)
                leases = list(multi)
            now = time.monotonic()
            for lease in leases:
                history.held(lease.name, lease.fencing_token, now)
                inside[lease.name] += 1
                assert inside[lease.name] == 1, f"two holders of {lease.name}"
            await asyncio.sleep(rng.uniform(0, 0.003))  # hold
            now = time.monotonic()
            for lease in leases:
                inside[lease.name] -= 1
                history.released(lease.name, lease.fencing_token, now)
            if multi_names is None:
                await c.release(leases[0])
            else:
                await c.release_many(multi)
            done[i] += 1

    # A deadlock would leave tasks waiting forever: the bound catches it.
    await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(tasks))), duration + 20)
    assert all(done), f"a task never got its locks: {done}"
    return history.check()


async def test_a_set_of_max_many_names_is_granted_in_one_request(client):
    names = [f"many/{i:02d}" for i in range(fastlock.protocol.MAX_MANY)]
    # the largest set the protocol takes (a refused frame closes the connection and the client
    # sends it again on a new one: hence the bound)
    multi = await asyncio.wait_for(client.acquire_many(names, ttl=5.0), TIMEOUT)
    assert len(multi.fencing_tokens) == fastlock.protocol.MAX_MANY
    assert await client.holder(names[-1]) is not None  # the connection is still open
    await client.release_many(multi)
    assert await client.holder(names[0]) is None
