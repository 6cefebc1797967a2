"""Lease health events (Chubby's jeopardy/safe/expired) against a real server that we freeze with SIGSTOP."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

import fastlock

TIMEOUT = 5.0


async def test_jeopardy_then_safe_when_the_server_comes_back(client, connect, server):
    other = await connect("other")
    states: list[str] = []
    async with client.lock("health", ttl=1.0, jeopardy_fraction=0.5) as lease:
        lease.health.add_listener(states.append)
        assert lease.health.state == "safe" and lease.health.safe.is_set()
        assert not lease.in_jeopardy
        server.pause()
        try:
            await asyncio.wait_for(lease.health.jeopardy.wait(), TIMEOUT)
            assert lease.in_jeopardy
            assert not lease.health.safe.is_set()
            # less than half the TTL is left on our conservative estimate
            assert 0 < lease.time_left() <= 0.5
            assert not lease.lost.is_set()
        finally:
            server.resume()
        await asyncio.wait_for(lease.health.safe.wait(), TIMEOUT)
        assert lease.health.state == "safe"
        assert not lease.health.jeopardy.is_set()
        assert not lease.lost.is_set()
        with pytest.raises(fastlock.LockNotAcquired):
            await other.acquire("health", ttl=1.0, wait=0)
        assert await other.check("health", lease.fencing_token)
    assert states == ["in_jeopardy", "safe"]


async def test_jeopardy_then_lost_when_the_server_stays_frozen(client, connect, server):
    other = await connect("other")
    states: list[str] = []
    async with client.lock("health", ttl=0.6) as lease:
        lease.health.add_listener(states.append)
        server.pause()
        try:
            await asyncio.wait_for(lease.lost.wait(), TIMEOUT)
            # the client gives up on its own clock, while the server is still frozen
            assert lease.time_left() <= 0
        finally:
            server.resume()
        assert lease.health.state == "lost"
        assert not lease.health.safe.is_set()
    assert states == ["in_jeopardy", "lost"]
    # once the server has expired it, the lock is free again with a higher token
    fresh = await other.acquire("health", ttl=1.0, wait=TIMEOUT)
    assert fresh.fencing_token > lease.fencing_token
    await other.release(fresh)


async def test_lost_when_the_lease_is_taken_over(client, connect):
    # A holder whose renewal is refused goes straight to lost.
    other = await connect("other")
    lease = await client.acquire("taken", ttl=0.3)
    states: list[str] = []
    lease.health.add_listener(states.append)
    successor = await other.acquire("taken", ttl=5.0, wait=TIMEOUT)  # after our TTL ran out
    with pytest.raises(fastlock.LeaseLost):
        await client.extend(lease)
    assert states == ["lost"]
    assert lease.health.state == "lost" and lease.lost.is_set()
    await other.release(successor)


async def test_health_is_shared_by_extended_copies_and_manual_leases_stay_safe(client):
    lease = await client.acquire("copies", ttl=1.0)
    longer = await client.extend(lease, ttl=2.0)
    assert longer is not lease and longer.health is lease.health
    assert lease.health.state == "safe"
    await client.release(longer)
    assert lease.health.state == "safe"  # a clean release is not a loss


async def test_a_released_multi_lock_whose_health_was_read_is_freed_without_the_cyclic_collector(client):
    """A lease's ``lost`` event and its health refer to each other; the event's reference is
    weak, so a lease set released and dropped is freed by reference counting alone (no cyclic
    garbage per lease: the collector's passes pause the client's loop), and a loss still
    reaches the health's listeners while the lease is held."""
    held = await client.acquire_many(["gc/1", "gc/2", "gc/3"], ttl=10.0)
    healths = [weakref.ref(lease.health) for lease in held]  # the set's ``lost`` listens on each
    lost_event = weakref.ref(held.leases[0].lost)
    assert all(h() is not None for h in healths)
    await client.release_many(held)
    gc.disable()
    try:
        del held
        assert [h() for h in healths] == [None, None, None]
        assert lost_event() is None
    finally:
        gc.enable()
    kept = await client.acquire_many(["gc/4", "gc/5"], ttl=10.0)
    heard: list[str] = []
    kept.leases[1].health.add_listener(heard.append)
    kept.leases[1].lost.set()  # a loss found by whoever holds the event
    assert heard == ["lost"] and kept.lost.is_set() and kept.leases[1].health.state == "lost"
    await client.release(kept.leases[0])


@pytest.mark.parametrize("fraction", [0, 1, 1.5, -0.1, float("nan"), True, "0.5"])
def test_bad_jeopardy_fraction_is_refused(fraction):
    client = fastlock.Client(["127.0.0.1:1"])  # never connects: refused before anything is sent
    with pytest.raises((fastlock.InvalidArgument, fastlock.WrongArgumentType)):
        client.lock("x", ttl=1.0, jeopardy_fraction=fraction)
    with pytest.raises((fastlock.InvalidArgument, fastlock.WrongArgumentType)):
        client.lock_many(["x", "y"], ttl=1.0, jeopardy_fraction=fraction)


async def test_a_lease_is_immutable_and_its_copies_share_one_state(client):
    import dataclasses

    lease = await client.acquire("immutable", ttl=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lease.ttl = 5.0
    before = lease.expires_at
    longer = await client.extend(lease, ttl=2.0)
    assert longer.ttl == 2.0 and lease.ttl == 1.0  # the original object is unchanged
    assert longer.state is lease.state and lease.expires_at == longer.expires_at > before
    await client.release(longer)


async def test_one_renewer_per_held_lock_stopped_by_release(client):
    async with client.lock("renewed-a", ttl=0.6) as a, client.lock_many(["renewed-b", "renewed-c"], ttl=0.6) as bc:
        assert len(client.renewers) == 3
        await asyncio.sleep(1.5)  # 2.5 TTLs: only renewals (every ~0.2 s) keep the three alive
        assert not a.lost.is_set() and not bc.lost.is_set() and a.time_left() > 0.1
        for lease in (a, *bc):
            assert await client.check(lease.name, lease.fencing_token)
    assert len(client.renewers) == 0
    assert a.health.state == "safe" and not bc.lost.is_set()  # released, not lost
