"""A user's script touching every public API, type-checked by tests/test_typing.py with
``mypy --strict``: it must check clean, and every value it names must have a precise type
(``assert_type`` fails on ``Any``)."""

from __future__ import annotations

import asyncio
from typing import assert_type

import fastlock
from fastlock import (
    Client,
    ConnectionLost,
    FastlockError,
    Lease,
    LeaseHealth,
    LockNotAcquired,
    MultiLease,
    NotPrimary,
    StaleFencingToken,
    WatchEvent,
)
from fastlock.client import KeyList, KeyValue
from fastlock.election import Election, Leader, Term
from fastlock.sync import SyncClient, SyncElection, SyncLease, SyncMultiLease, SyncTerm


async def with_the_async_client() -> int:
    async with fastlock.connect("127.0.0.1:7420", client_name="typed") as client:
        assert_type(client, Client)
        lease = await client.acquire("a", ttl=10.0, wait=1.0)
        assert_type(lease, Lease)
        assert_type(lease.name, str)
        assert_type(lease.fencing_token, int)
        assert_type(lease.ttl, float)
        assert_type(lease.epoch, int)
        assert_type(lease.lost, asyncio.Event)
        assert_type(lease.health, LeaseHealth)
        assert_type(lease.health.state, str)
        assert_type(lease.time_left(), float)
        lease = await client.extend(lease, ttl=20.0)
        assert_type(await client.check("a", lease.fencing_token), bool)
        holder = await client.holder("a")
        assert holder is not None
        assert_type(holder["token"], int)
        assert_type(holder["remaining_ms"], int)
        assert_type(holder["client"], str | None)
        async for event in client.watch("a"):
            assert_type(event, WatchEvent)
            break
        await client.release(lease)
        keys = await client.list_prefix("cfg/", limit=10)
        assert_type(keys, KeyList)
        assert_type(keys.more, bool)
        for kv in keys:
            assert_type(kv, KeyValue)
            assert_type(kv.value, bytes)
        async with client.lock("b", ttl=5.0) as held:
            assert_type(held, Lease)
        async with client.lock_many(["c", "d"], ttl=5.0) as multi:
            assert_type(multi, MultiLease)
            assert_type(multi.leases, tuple[Lease, ...])
        election = client.election("leader", "me", lease_duration=15.0)
        assert_type(election, Election)
        term = await election.campaign(wait=5.0)
        assert_type(term, Term)
        assert_type(term.fencing_token, int)
        assert_type(term.is_leader(), bool)
        await term.resign()
        leader = await election.leader()
        assert_type(leader, Leader | None)
        try:
            await client.acquire("a", ttl=1.0, wait=0)
        except LockNotAcquired as exc:
            assert_type(exc, LockNotAcquired)
        except (NotPrimary, ConnectionLost, StaleFencingToken):
            pass
        except FastlockError:
            raise
        return lease.fencing_token


def with_the_blocking_client() -> int:
    with SyncClient("127.0.0.1:7420", client_name="typed") as client:
        lease = client.acquire("a", ttl=10.0)
        assert_type(lease, SyncLease)
        assert_type(lease.fencing_token, int)
        assert_type(client.check("a", lease.fencing_token), bool)
        client.release(lease)
        with client.lock("a", ttl=5.0) as held:
            assert_type(held, SyncLease)
            assert_type(held.lost.is_set(), bool)
        with client.lock_many(["a", "b"], ttl=5.0) as held_many:
            assert_type(held_many, SyncMultiLease)
        sync_holder = client.holder("a")
        assert sync_holder is not None
        assert_type(sync_holder["token"], int)
        multi = client.acquire_many(["c", "d"], ttl=5.0)
        assert_type(multi, SyncMultiLease)
        assert_type(multi.fencing_tokens, dict[str, int])
        client.release_many(multi)
        for event in client.watch("a", timeout=1.0):
            assert_type(event, WatchEvent)
            assert_type(event.token, int | None)
        election = client.election("leader", "me")
        assert_type(election, SyncElection)
        term = election.campaign(wait=1.0)
        assert_type(term, SyncTerm)
        assert_type(term.is_leader(), bool)
        election.resign(term)
        with election.leadership(wait=1.0) as led:
            assert_type(led, SyncTerm)
        return lease.fencing_token
