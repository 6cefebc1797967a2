"""A slot move leaves no waiter behind on the source (issue 30): the freeze takes out every
waiter of the moving slots whatever its name's state, not only those queued behind a holder or
a lock-delay, so the source never grants a name after its slot went to another group.  Real
servers following a map in etcd: a multi-lock request waiting on a free name of the moving slot
(for its other, held name), and an acquire queued on a free name during the source's promotion
grace (an etcd group whose primary was SIGKILLed)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from conftest import wait_until
from test_shard_move_tokens import EtcdGroups

import fastlock
from fastlock._testbase.cluster import RawNode
from fastlock._testbase.shards import names_owned_by
from fastlock.errors import FastlockError, WrongShard
from fastlock.sharding import slot_of
from fastlock.tokens import format_token

#: the TTL (ms) of the lease a promoted node's grace lasts for (the longest TTL it saw): it
#: covers the promotion and the move with room to spare on a loaded machine
GRACE_TTL_MS = 30_000


#: seconds a promoted node keeps the old primary's waiters' places (--queue-reclaim-window): it
#: covers the move, and ends before the grace
RECLAIM_WINDOW_S = 15


class WindowedGroups(EtcdGroups):
    """:class:`EtcdGroups` whose nodes keep a promotion's reclaim window for :data:`RECLAIM_WINDOW_S`."""

    def _server(self, node: str):
        server = super()._server(node)
        server.args += ["--queue-reclaim-window", str(RECLAIM_WINDOW_S)]
        return server


@pytest.fixture
async def etcd_groups(etcd, tmp_path, monkeypatch):
    """Shard groups g0 (a primary and a standby) and g1 (one node), etcd-arbitrated, the map in
    etcd (``test_shard_move_tokens.EtcdGroups``), stopped after the test."""
    g = WindowedGroups(etcd, tmp_path, monkeypatch, (2, 1))
    try:
        await g.start()
        yield g
    finally:
        g.stop()


async def _status(address: str, token: str) -> dict:
    node = await RawNode.open(address, token=token)
    try:
        return await node.status()
    finally:
        await node.close()


async def _waiters_at_least(address: str, token: str, n: int) -> bool:
    return (await _status(address, token))["waiters"] >= n


def _rising(name: str, tokens: list[int]) -> None:
    for before, after in zip(tokens, tokens[1:]):
        assert after > before, (f"{name!r}: token went backwards: {format_token(after)} granted after "
                                f"{format_token(before)} (all: {[format_token(t) for t in tokens]})")


async def test_a_multi_lock_waiting_on_a_free_name_of_a_moving_slot_leaves_with_the_move(groups):
    """An ACQUIRE_MANY over a held name and a free one waits in the free name's queue with no
    holder there.  Moving the free name's slot takes that waiter out (the whole request); once
    the slot is g1's, the release of the held name on g0 grants nothing on the moved name there,
    and g1's holder of it stays the only one."""
    held, free = next((a, b) for a, b in [names_owned_by(groups.shard_map, "g0", 2, f"many{k}-") for k in range(50)]
                      if slot_of(a) != slot_of(b))
    g0 = groups.servers["g0"].address
    async with groups.connect() as holder, groups.connect() as many, groups.connect() as other:
        lease = await holder.acquire(held, ttl=30)
        multi = asyncio.ensure_future(many.acquire_many([held, free], ttl=30, wait=60))
        await wait_until(lambda: _waiters_at_least(g0, groups.app, 2), 10, "the multi-lock to queue on both names")
        await groups.move(str(slot_of(free)), "g1")
        moved = await other.acquire(free, ttl=30, wait=30)  # on g1 (after its reclaim window for the moved waiter)
        await holder.release(lease)  # on g0: its queue for ``held`` must not hold the multi-lock any more
        done, _ = await asyncio.wait([multi], timeout=30)
        assert done, "the multi-lock was neither granted nor refused"
        exc = multi.exception()
        assert isinstance(exc, FastlockError), (
            f"g0 granted the multi-lock over {free!r} after its slot moved to g1, which holds it "
            f"(token {format_token(moved.fencing_token)}): {multi.result()!r}")
        g1 = await RawNode.open(groups.servers["g1"].address, token=groups.app)
        try:
            assert (await g1.holder(free))["token"] == moved.fencing_token
        finally:
            await g1.close()
        g0_node = await RawNode.open(g0, token=groups.app)
        try:
            assert (await g0_node.status())["waiters"] == 0
        finally:
            await g0_node.close()
        await other.release(moved)


async def test_a_waiter_queued_in_the_sources_promotion_grace_is_redirected_by_the_move(etcd_groups):
    """g0's primary is SIGKILLed; its standby, promoted, holds every grant for its grace (the
    longest TTL it saw).  An acquire queued there on a free name waits behind no holder.  The
    name's slot moves to g1 within the grace: the source answers that acquire WrongShard (it
    never grants it at the grace's end), and g1's holders of the name follow one another with
    rising tokens."""
    g = etcd_groups
    name, other = names_owned_by(g.shard_map, "g0", 2, "graced")
    primary, standby = g.servers["g0-0"], g.servers["g0-1"]
    async with fastlock.connect(primary.address, token=g.app, session=False) as client:
        await client.acquire(other, ttl=GRACE_TTL_MS / 1000)
        await wait_until(lambda: _holds_one(standby.address, g.app), 30, "the standby to have the long lease")
    primary.kill()
    await wait_until(lambda: g.is_role("g0-1", "primary"), 60, "g0's standby to be promoted")
    assert (await _status(standby.address, g.app))["grace_remaining_ms"] > 0, "promoted without a grace period"
    waiter = await RawNode.open(standby.address, token=g.app)
    owner = os.urandom(16)
    queued = asyncio.ensure_future(waiter.acquire(name, 5_000, 60_000, owner))
    try:
        await wait_until(lambda: _waiters_at_least(standby.address, g.app, 1), 10, "the acquire to queue in the grace")
        await g.move(slot_of(name), "g1")
        assert (await _status(standby.address, g.app))["grace_remaining_ms"] > 0, (
            "the move ended after the grace: this run does not test a move within it")
        tokens: list[int] = []
        g1 = await RawNode.open(g.servers["g1-0"].address, token=g.app)
        try:
            first = await g1.acquire(name, 60_000, 30_000)  # after g1's reclaim window for the moved waiter
            tokens.append(first[0])
            # the source's grace ends while g1 holds the name: the source must grant it to nobody
            await wait_until(lambda: _grace_over(standby.address, g.app), 60, "the source's grace to end")
            done, _ = await asyncio.wait([queued], timeout=30)
            assert done, "the queued acquire was neither granted nor refused by the source"
            exc = queued.exception()
            assert exc is not None, (
                f"the source granted {name!r} (token {format_token(queued.result()[0])}) after its slot moved "
                f"to g1, which holds it (token {format_token(first[0])})")
            assert isinstance(exc, WrongShard) and exc.group == "g1", exc
            assert (await _status(standby.address, g.app))["waiters"] == 0
            # the redirected waiter asks g1 and gets the name after the holder there
            second = asyncio.ensure_future(g1.acquire(name, 5_000, 30_000, owner))
            await g1.release(name, first[0], first[2])
            got = await asyncio.wait_for(second, 30)
            tokens.append(got[0])
            await g1.release(name, got[0], owner)
        finally:
            await g1.close()
        _rising(name, tokens)
    finally:
        if not queued.done():
            queued.cancel()
        await waiter.close()


async def test_an_acquire_parked_in_the_sources_reclaim_window_never_queues_on_a_moved_slot(etcd_groups):
    """g0's old primary had a holder and a waiter of a name (its queue shipped to the standby);
    promoted, the standby's reclaim window keeps the waiter's place and parks a newcomer's
    acquire.  The name's slot moves to g1 within the window: the parked acquire never enters
    g0's lock table (it would be granted there at the grace's end, the moved lease being dropped
    from g0; the freeze takes it out of the window and holds it) but is answered WrongShard
    naming g1."""
    g = etcd_groups
    name = names_owned_by(g.shard_map, "g0", 1, "parked")[0]
    primary, standby = g.servers["g0-0"], g.servers["g0-1"]
    async with fastlock.connect(primary.address, token=g.app, session=False) as client:
        lease = await client.acquire(name, ttl=GRACE_TTL_MS / 1000)
        old_waiter = await RawNode.open(primary.address, token=g.app)
        queued_before = asyncio.ensure_future(old_waiter.acquire(name, 5_000, 60_000))
        await wait_until(lambda: _waiters_at_least(primary.address, g.app, 1), 10, "the old waiter to queue")
        await wait_until(lambda: _holds_one(standby.address, g.app), 30, "the standby to have the lease")
        start = len(standby.lines)
        primary.kill()
        await asyncio.to_thread(standby.wait_for_log, r"reclaim window: 1 locks", 60, start)
        window_from = time.monotonic()
    await old_waiter.close()
    queued_before.cancel()
    newcomer = await RawNode.open(standby.address, token=g.app)
    parked = asyncio.ensure_future(newcomer.acquire(name, 5_000, 60_000))
    try:
        await g.move(slot_of(name), "g1")
        assert time.monotonic() - window_from < RECLAIM_WINDOW_S, \
            "the move ended after the reclaim window: this run does not test it"
        done, _ = await asyncio.wait([parked], timeout=60)
        assert done, "the parked acquire was neither granted nor refused by the source"
        exc = parked.exception()
        assert exc is not None, (f"the source granted {name!r} (token {format_token(parked.result()[0])}) after its "
                                 f"slot moved to g1 (which holds it with token {format_token(lease.fencing_token)})")
        assert isinstance(exc, WrongShard) and exc.group == "g1", exc
        assert (await _status(standby.address, g.app))["waiters"] == 0
        g1 = await RawNode.open(g.servers["g1-0"].address, token=g.app)
        try:
            assert (await g1.holder(name))["token"] == lease.fencing_token
        finally:
            await g1.close()
    finally:
        if not parked.done():
            parked.cancel()
        await newcomer.close()


async def _holds_one(address: str, token: str) -> bool:
    return (await _status(address, token))["locks_held"] >= 1


async def _grace_over(address: str, token: str) -> bool:
    return (await _status(address, token))["grace_remaining_ms"] == 0
