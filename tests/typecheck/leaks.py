"""Public APIs that still give ``Any`` to a ``mypy --strict`` user (tests/test_typing.py
expects each check here to fail until the annotation in the library is fixed)."""

from __future__ import annotations

from typing import assert_type

import fastlock
from fastlock import WatchEvent
from fastlock.sync import SyncClient, SyncLease, SyncMultiLease


def sync_lock_enter(client: SyncClient) -> None:
    with client.lock("a", ttl=5.0) as lease:
        assert_type(lease, SyncLease)


def sync_lock_many_enter(client: SyncClient) -> None:
    with client.lock_many(["a", "b"], ttl=5.0) as multi:
        assert_type(multi, SyncMultiLease)


async def async_watch(client: fastlock.Client) -> None:
    async for event in client.watch("a"):
        assert_type(event, WatchEvent)


async def async_holder(client: fastlock.Client) -> None:
    holder = await client.holder("a")
    assert holder is not None
    assert_type(holder["token"], int)
    assert_type(holder["remaining_ms"], int)


def sync_holder(client: SyncClient) -> None:
    holder = client.holder("a")
    assert holder is not None
    assert_type(holder["token"], int)
