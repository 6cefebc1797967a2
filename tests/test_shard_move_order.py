"""Moved waiters keep their FIFO order across failovers and restarts around a move (issue 30).

A move's freeze takes the waiters of the moving slots out of the source's lock table; the
export ships them, in that order, to the destination, which lets them in in that order at the
flip.  The source's primary ships its queues to its standby (PUSH_QUEUES), the frozen ones
too: a standby promoted before the ship exports the old primary's queue, whatever order the
waiters ask it again in.  So does one promoted before the freeze whose reclaim window still
keeps the old waiters' places when the move freezes their slot.  The destination keeps the
queues it let in at the flip (``moved-queues.json``) until their reclaim window ends, so a
restart within it keeps their order, and a node that was down at the flip lets in the queues
its log holds when it is promoted.  Real etcd groups: g0 and g1, the map in etcd
(``test_shard_move_tokens.EtcdGroups``); the waiters ask again in the opposite order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from conftest import wait_until
from test_shard_move_tokens import ShippedQueue, _hold_and_queue_two, _mark_and_import
from test_shard_move_waiters import RECLAIM_WINDOW_S, WindowedGroups, _status

from fastlock._testbase.cluster import RawNode
from fastlock._testbase.shards import names_owned_by
from fastlock.coordination.shardmap import load_from_etcd
from fastlock.errors import ConnectionLost, LeaseLost, LockNotHeld, SlotMoving, WrongShard
from fastlock.protocol.ops import OP_ACQUIRE
from fastlock.sharding import slot_of
from fastlock.sharding.moves import finish_move, mark_moving


async def _asked_in_reverse(g, address: str, q: ShippedQueue, name: str) -> tuple[list[RawNode], list]:
    """Both waiters of ``q`` ask the node at ``address`` of ``g`` again, the second first (its
    request there before the first's is sent): (their connections, their requests)."""
    conns = [await RawNode.open(address, token=g.app) for _ in range(2)]
    status = await RawNode.open(address, token=g.creds.token("admin"))
    try:
        before = await _asking(status)
        requests = [None, conns[1].request(OP_ACQUIRE, name, q.owners[1], 30_000, 60_000, 0, None)]
        await wait_until(lambda: requests[1].done() or _asking_more(status, before), 10,
                         "the second waiter's request to arrive")
        requests[0] = conns[0].request(OP_ACQUIRE, name, q.owners[0], 30_000, 60_000, 0, None)
    finally:
        await status.close()
    return conns, requests


async def _asking(node: RawNode) -> int:
    """The acquires a node has waiting: queued, parked by its reclaim window or held by a move."""
    st = await node.status()
    return st["waiters"] + (st.get("queue_reclaim") or {}).get("parked", 0) + st.get("shard", {}).get("held", 0)


async def _asking_more(node: RawNode, before: int) -> bool:
    return await _asking(node) > before


async def _granted_in_their_old_order(g, address: str, q: ShippedQueue, name: str, held: int,
                                      holder_owner: bytes, asked_by: float | None = None) -> None:
    """The waiters of ``q`` ask the node at ``address`` of ``g`` (which holds ``name`` with token ``held``
    for ``holder_owner``, the moved lease, unless it expired) again, the second first (by
    ``asked_by``, a ``time.monotonic()``, if given); the holder releases: the first waiter is
    granted first, then the second."""
    holder = await RawNode.open(address, token=g.app)
    info = await holder.holder(name)
    assert info is None or info["token"] == held, info
    conns, (first, second) = await _asked_in_reverse(g, address, q, name)
    try:
        assert asked_by is None or time.monotonic() < asked_by, \
            "the waiters asked again after the reclaim window: this run does not test it"
        if info is not None:  # else the moved lease expired: the next waiter is granted at once
            with contextlib.suppress(LeaseLost, LockNotHeld):  # it expired meanwhile
                await holder.release(name, held, holder_owner)
        done, _ = await asyncio.wait([first, second], timeout=60, return_when=asyncio.FIRST_COMPLETED)
        assert done, "neither waiter was granted"
        assert first in done and not second.done(), \
            f"the second waiter was granted {name!r} before the first (its order on the old primary)"
        got_first = first.result()
        assert got_first[0] > held
        await conns[0].release(name, got_first[0], q.owners[0])
        got_second = await asyncio.wait_for(second, 30)
        assert got_second[0] > got_first[0]
    finally:
        for node in [holder, *conns]:
            await node.close()


async def _redirected(requests: list) -> None:
    for request in requests:  # held until the flip (WrongShard) or HOLD_S (SlotMoving): the client asks again
        with pytest.raises((WrongShard, SlotMoving)):
            await asyncio.wait_for(request, 60)


@pytest.fixture
async def windowed(etcd, tmp_path, monkeypatch):
    """g0 (a primary and a standby) and g1 (one node), whose nodes keep a promotion's reclaim
    window for ``test_shard_move_waiters.RECLAIM_WINDOW_S``, stopped after the test."""
    made: list[WindowedGroups] = []

    async def make(sizes: tuple[int, int]) -> WindowedGroups:
        g = WindowedGroups(etcd, tmp_path, monkeypatch, sizes)
        made.append(g)
        await g.start()
        return g

    try:
        yield make
    finally:
        for g in made:
            g.stop()


async def test_moved_waiters_keep_their_order_when_the_source_fails_over_before_the_ship(windowed):
    """Two waiters queued on g0 behind a holder; the slot is marked moving to g1 (g0's primary
    freezes it) and g0's primary is SIGKILLed before the ship.  The waiters ask g0's promoted
    standby again in the opposite order, the move is run to its end, and they ask g1 in the
    opposite order too: g1 grants them in their order on the old primary."""
    g = await windowed((2, 1))
    name = names_owned_by(g.shard_map, "g0", 1, "srcfail")[0]
    slot = slot_of(name)
    q = ShippedQueue(await RawNode.open(g.servers["g0-0"].address, token=g.app),
                     [await RawNode.open(g.servers["g0-0"].address, token=g.app) for _ in range(2)])
    conns: list[RawNode] = []
    try:
        token, owner, queued = await _hold_and_queue_two(g, q, name)
        await wait_until(lambda: _mirrors(g.servers["g0-1"].address, g.creds.token("admin"), 2), 30,
                         "g0's standby to mirror the queue")
        start = len(g.servers["g0-0"].lines)
        await _mark(g, slot)
        await asyncio.to_thread(g.servers["g0-0"].wait_for_log, r"slot move: 2 waiters of 1 locks taken out", 30,
                                start)
        g.servers["g0-0"].kill()
        await wait_until(lambda: g.is_role("g0-1", "primary"), 60, "g0's standby to be promoted")
        conns, requests = await _asked_in_reverse(g, g.servers["g0-1"].address, q, name)
        window_from = time.monotonic()  # g1's window (if any) starts at the flip, later
        await g.move(slot, "g1")  # resumed: shipped from g0's new primary, then flipped
        for request in queued:  # asked of the old primary
            with pytest.raises(ConnectionLost):
                await asyncio.wait_for(request, 30)
        await _redirected(requests)
        await _granted_in_their_old_order(g, g.servers["g1-0"].address, q, name, token, owner,
                                          window_from + RECLAIM_WINDOW_S)
    finally:
        for node in [q.holder, *q.waiters, *conns]:
            await node.close()


async def _mark(g, slot: int) -> None:
    """Mark ``slot`` moving from g0 to g1 in the map in etcd."""
    stored = await load_from_etcd(g.url)
    try:
        shard_map, revision = await stored.read()
        await stored.replace(revision, shard_map, mark_moving(shard_map, slot, slot, "g1"))
    finally:
        await stored.gateway.close()


async def _mirrors(address: str, token: str, n: int) -> bool:
    """Does the standby at ``address`` mirror ``n`` waiters of its primary?"""
    return (await _status(address, token)).get("replication", {}).get("mirrored_waiters", 0) >= n


async def test_moved_waiters_keep_their_order_when_the_move_freezes_a_promoted_sources_reclaim_window(windowed):
    """Two waiters queued on g0 behind a holder; g0's primary is SIGKILLed, its standby promoted
    keeps their places (its reclaim window).  Only the second asks it again (parked there) before
    the slot moves to g1 within the window; both then ask g1, the second first: g1 grants them in
    their order on the old primary."""
    g = await windowed((2, 1))
    name = names_owned_by(g.shard_map, "g0", 1, "reclaimq")[0]
    slot = slot_of(name)
    q = ShippedQueue(await RawNode.open(g.servers["g0-0"].address, token=g.app),
                     [await RawNode.open(g.servers["g0-0"].address, token=g.app) for _ in range(2)])
    second = await RawNode.open(g.servers["g0-1"].address, token=g.app)
    try:
        token, owner, _queued = await _hold_and_queue_two(g, q, name)
        await wait_until(lambda: _mirrors(g.servers["g0-1"].address, g.creds.token("admin"), 2), 30,
                         "g0's standby to mirror the queue")
        start = len(g.servers["g0-1"].lines)
        g.servers["g0-0"].kill()
        await asyncio.to_thread(g.servers["g0-1"].wait_for_log, r"reclaim window: 1 locks keep the places of 2",
                                60, start)
        window_from = time.monotonic()
        parked = second.request(OP_ACQUIRE, name, q.owners[1], 30_000, 60_000, 0, None)
        await wait_until(lambda: _parked(g.servers["g0-1"].address, g.creds.token("admin")), 10,
                         "the second waiter to be parked")
        moved_from = time.monotonic()  # g1's window (if any) starts at the flip, later
        await g.move(slot, "g1")
        assert time.monotonic() - window_from < RECLAIM_WINDOW_S, \
            "the reclaim window ended before the move: this run does not test it"
        await _granted_in_their_old_order(g, g.servers["g1-0"].address, q, name, token, owner,
                                          moved_from + RECLAIM_WINDOW_S)
        await _redirected([parked])
    finally:
        for node in [q.holder, *q.waiters, second]:
            await node.close()


async def _parked(address: str, token: str) -> bool:
    reclaim = (await _status(address, token)).get("queue_reclaim") or {}
    return reclaim.get("parked", 0) == 1  # the second waiter, behind the first (still expected)


async def test_moved_waiters_keep_their_order_when_the_destination_restarts_in_the_reclaim_window(windowed):
    """Two waiters queued on g0 behind a holder are moved to g1 (one node); g1 lets them in in
    their order (its reclaim window) and is SIGKILLed and started again within that window, before
    either asks it: they ask it again in the opposite order, and it grants them in their order."""
    g = await windowed((1, 1))
    name = names_owned_by(g.shard_map, "g0", 1, "destrestart")[0]
    slot = slot_of(name)
    q = ShippedQueue(await RawNode.open(g.servers["g0-0"].address, token=g.app),
                     [await RawNode.open(g.servers["g0-0"].address, token=g.app) for _ in range(2)])
    try:
        token, owner, queued = await _hold_and_queue_two(g, q, name)
        dest = g.servers["g1-0"]
        window_from = time.monotonic()  # g1's window starts at the flip, later
        await g.move(slot, "g1")
        await _redirected(queued)
        dest.kill()
        dest.start()
        await wait_until(lambda: g.is_role("g1-0", "primary"), 60, "g1's node to serve again")
        await _granted_in_their_old_order(g, dest.address, q, name, token, owner, window_from + RECLAIM_WINDOW_S)
    finally:
        for node in [q.holder, *q.waiters]:
            await node.close()


async def test_moved_waiters_keep_their_order_when_the_flip_comes_while_the_destination_is_down(windowed):
    """Two waiters queued on g0 behind a holder are shipped to g1 (one node of an etcd group);
    g1's node is SIGKILLed, the map flips while it is down, and it starts again (as a standby
    that etcd then names primary): it lets the moved queue, restored from its log, in in its
    order, whatever order the waiters ask it again in."""
    g = await windowed((1, 1))
    name = names_owned_by(g.shard_map, "g0", 1, "flipdown")[0]
    slot = slot_of(name)
    q = ShippedQueue(await RawNode.open(g.servers["g0-0"].address, token=g.app),
                     [await RawNode.open(g.servers["g0-0"].address, token=g.app) for _ in range(2)])
    try:
        token, owner, queued = await _hold_and_queue_two(g, q, name)
        stored = await load_from_etcd(g.url)
        try:
            marked, revision = await _mark_and_import(g, stored, q, name, slot)
            dest = g.servers["g1-0"]
            dest.kill()
            flipped = finish_move(marked, slot, slot, "g1")
            await stored.replace(revision, marked, flipped)
        finally:
            await stored.gateway.close()
        await _redirected(queued)
        dest.start()
        await wait_until(lambda: g.is_role("g1-0", "primary"), 60, "g1's node to serve again")
        await _granted_in_their_old_order(g, dest.address, q, name, token, owner)
    finally:
        for node in [q.holder, *q.waiters]:
            await node.close()

