"""A slot move ships the sessions' share of the moving slots (fastlock.server.slotmove,
fastlock.server.sessions): each moved lease stays a member of its client session on the destination
(listed, closed with it, renewed by its keep-alives once the client attaches it there), and the
principals' lease counts follow the leases (the destination counts and revokes what it imported,
even a lease whose token it issued itself to another lock; a principal the import puts over its
quota keeps its leases and is refused new ones).  Real servers following a map in etcd (the
``groups`` fixture: tests/test_shard_move.py's Groups; ``groups_of``: etcd-arbitrated groups)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import wait_until

import fastlock
from fastlock._testbase.cluster import RawNode
from fastlock._testbase.shards import names_owned_by
from fastlock.errors import LimitExceeded
from fastlock.protocol.ops import (
    OP_REVOKE,
    OP_SESSION_ATTACH,
    OP_SESSION_KEEPALIVE,
    OP_SESSION_OPEN,
    OP_SESSIONS,
)
from fastlock.sharding import slot_of
from fastlock.tokens import epoch_of


async def _moved(groups, capsys, name: str) -> dict:
    """Move ``name``'s slot from g0 to g1; the mover's report (``-o json``)."""
    capsys.readouterr()
    await groups.move(str(slot_of(name)), "g1")
    return json.loads(capsys.readouterr().out)


def _principal(status: dict, principal: str) -> dict:
    return next(row for row in status["principals"] if row["principal"] == principal)


async def test_a_moved_lease_stays_in_its_session_on_the_destination(groups, capsys):
    """A lease attached to a session on g0 is attached to the session of the same key (and id) on
    g1 by the move: listed there, resumed by the client with it, renewed by the keep-alive once the
    client attached it there itself (not before: the client's own deadline moves only with renewals
    it knows of); the source's session keeps the other lease and names the moved one lost."""
    moved, stays = names_owned_by(groups.shard_map, "g0", 2, "share")
    key = os.urandom(16)
    g0 = await RawNode.open(groups.servers["g0"].address, token=groups.app)
    g1 = await RawNode.open(groups.servers["g1"].address, token=groups.app)
    admin1 = await RawNode.open(groups.servers["g1"].address)
    try:
        token_m, _ttl, owner_m = await g0.acquire(moved, 30_000)
        token_s, _ttl, owner_s = await g0.acquire(stays, 30_000)
        opened = await g0.request(OP_SESSION_OPEN, key, 20_000)
        attached = await g0.request(OP_SESSION_ATTACH, key, [[moved, token_m, owner_m], [stays, token_s, owner_s]],
                                    [])
        assert attached["attached"] == 2
        report = await _moved(groups, capsys, moved)
        rows = (await admin1.request(OP_SESSIONS, None))["sessions"]
        assert [(r["id"], r["principal"], r["leases"]) for r in rows] == [(opened["id"], "app", 1)]
        assert report["leases"] == 1 and report["sessions"] == 1
        kept = await g0.request(OP_SESSION_KEEPALIVE, key)
        assert kept["renewed"] == 1
        assert [row[:2] for row in kept["lost"]] == [[moved, token_m]] and "g1" in kept["lost"][0][2]
        resumed = await g1.request(OP_SESSION_OPEN, key, 20_000)
        assert resumed == {"id": opened["id"], "ttl_ms": 20_000, "resumed": True, "leases": 1}
        assert (await g1.request(OP_SESSION_KEEPALIVE, key))["renewed"] == 0
        again = await g1.request(OP_SESSION_ATTACH, key, [[moved, token_m, owner_m]], [])
        assert again["attached"] == 1 and again["lost"] == []
        assert (await g1.request(OP_SESSION_KEEPALIVE, key))["renewed"] == 1
    finally:
        for node in (g0, g1, admin1):
            await node.close()


async def test_closing_a_session_after_a_move_revokes_its_moved_leases(groups):
    """A routing client's session holds a lease that a move takes to g1: closing the session (as
    ``fastlock sessions close ID`` does, over every group) revokes that lease on g1 too, whether or
    not the client re-homed it there yet, and the client loses both leases instead of keeping the
    moved one alive on g1."""
    moved, stays = names_owned_by(groups.shard_map, "g0", 2, "close")
    admin_token = groups.creds.token("admin")
    async with fastlock.connect(groups.servers["g0"].address, token=groups.app, session=True) as client, \
            fastlock.connect(groups.servers["g0"].address, token=admin_token, session=False) as admin:
        lease_m = await client.lock(moved, ttl=3)
        lease_s = await client.lock(stays, ttl=3)
        keeper = client.group_client("g0").session_keeper

        async def attached_on_g0() -> bool:
            sessions = await admin.group_client("g0").sessions("app")
            return keeper.id is not None and [(s.id, s.leases) for s in sessions] == [(keeper.id, 2)]

        await wait_until(attached_on_g0, 20, "both leases to be attached to the session on g0")
        await groups.move(str(slot_of(moved)), "g1")
        closed = await admin.close_session(keeper.id, reason="test")
        assert closed.revoked == 2
        assert await admin.group_client("g1").holder(moved) is None
        await wait_until(lambda: lease_m.lost.is_set() and lease_s.lost.is_set(), 20, "the client to lose both")
        assert await admin.group_client("g1").holder(moved) is None


async def test_the_destination_counts_and_revokes_a_moved_lease_whose_token_it_issued_too(groups, capsys):
    """Two groups number their tokens each on its own: g1 holds a lease of app with the same token
    as app's lease the move brings from g0.  g1 counts both against app, and revoking app's leases
    there takes both; g0 counts none after the flip."""
    moved = names_owned_by(groups.shard_map, "g0", 1, "clash")[0]
    here = names_owned_by(groups.shard_map, "g1", 1, "clash")[0]
    g0 = await RawNode.open(groups.servers["g0"].address, token=groups.app)
    g1 = await RawNode.open(groups.servers["g1"].address, token=groups.app)
    admin1 = await RawNode.open(groups.servers["g1"].address)
    try:
        token_m, _ttl, _owner = await g0.acquire(moved, 30_000)
        token_h, _ttl, owner_h = await g1.acquire(here, 30_000)
        assert epoch_of(token_h) == epoch_of(token_m)  # (fresh groups start at one epoch)
        for _ in range(1_000):  # g1 issues tokens until one is the moved lease's
            if token_h >= token_m:
                break
            await g1.release(here, token_h, owner_h)
            token_h, _ttl, owner_h = await g1.acquire(here, 30_000)
        assert token_h == token_m
        await _moved(groups, capsys, moved)
        assert (await g1.holder(moved))["token"] == token_m
        assert _principal(await g1.status(), "app")["leases"] == 2
        assert _principal(await g0.status(), "app")["leases"] == 0
        revoked = await admin1.request(OP_REVOKE, None, None, "test", "app")
        assert revoked["revoked"] == 2
        assert await g1.holder(moved) is None and await g1.holder(here) is None
        assert _principal(await g1.status(), "app")["leases"] == 0
    finally:
        for node in (g0, g1, admin1):
            await node.close()


async def test_a_move_that_puts_a_principal_over_its_quota_keeps_its_leases_and_refuses_new_ones(groups, capsys):
    """g1 gives app at most 2 leases; app holds 2 there and 1 in a slot moving from g0.  The move
    is made (a held lease survives it) and its report names app over its quota on g1; app's new
    acquires on g1 are refused until it holds fewer than 2 there."""
    groups.args["g1"] = ["--max-leases-per-principal", "2"]
    groups.restart("g1")
    moved = names_owned_by(groups.shard_map, "g0", 1, "over")[0]
    first, second, third = names_owned_by(groups.shard_map, "g1", 3, "over")
    g0 = await RawNode.open(groups.servers["g0"].address, token=groups.app)
    g1 = await RawNode.open(groups.servers["g1"].address, token=groups.app)
    try:
        token_m, _ttl, owner_m = await g0.acquire(moved, 30_000)
        held = [await g1.acquire(first, 30_000), await g1.acquire(second, 30_000)]
        report = await _moved(groups, capsys, moved)
        assert report["leases"] == 1 and report["over_quota"] == {"app": [3, 2]}
        assert (await g1.holder(moved))["token"] == token_m
        with pytest.raises(LimitExceeded):
            await g1.acquire(third, 30_000)
        token, _ttl, owner = held[0]
        await g1.release(first, token, owner)
        with pytest.raises(LimitExceeded):  # 2 held: still at its quota
            await g1.acquire(third, 30_000)
        await g1.release(moved, token_m, owner_m)
        token, _ttl, owner = await g1.acquire(third, 30_000)
        await g1.release(third, token, owner)
    finally:
        await g0.close()
        await g1.close()


async def test_a_destination_session_stays_open_when_an_import_raises_the_destination_epoch(groups_of, capsys):
    """etcd groups, g0 at epoch 40 and g1 at epoch 1: a move from g0 raises g1's epoch, and a
    session open on g1 before it is still the same session after it (its keep-alive renews its
    lease; a session of an earlier epoch is answered "no such session" and must be opened again)."""
    g = await groups_of((1, 1), epochs={"g0": 40, "g1": 1}, seen={"g0-0": 40})
    moved = names_owned_by(g.shard_map, "g0", 1, "raise")[0]
    here, after = names_owned_by(g.shard_map, "g1", 2, "raise")
    key = os.urandom(16)
    g0 = await RawNode.open(g.servers["g0-0"].address, token=g.app)
    g1 = await RawNode.open(g.servers["g1-0"].address, token=g.app)
    try:
        token_m, _ttl, _owner = await g0.acquire(moved, 30_000)
        token_h, _ttl, owner_h = await g1.acquire(here, 30_000)
        assert epoch_of(token_m) > epoch_of(token_h)
        await g1.request(OP_SESSION_OPEN, key, 20_000)
        assert (await g1.request(OP_SESSION_ATTACH, key, [[here, token_h, owner_h]], []))["attached"] == 1
        await g.move(slot_of(moved), "g1")
        assert epoch_of((await g1.acquire(after, 1_000))[0]) >= epoch_of(token_m)
        assert (await g1.request(OP_SESSION_KEEPALIVE, key))["renewed"] == 1
    finally:
        await g0.close()
        await g1.close()


async def test_a_destination_restart_forgets_the_moved_session_and_the_client_attaches_again(groups, capsys):
    """Sessions are soft state: g1 restarted after the move keeps the moved lease (its GRANT
    record) but not its session; the client opens the session again there and attaches it."""
    moved = names_owned_by(groups.shard_map, "g0", 1, "soft")[0]
    key = os.urandom(16)
    g0 = await RawNode.open(groups.servers["g0"].address, token=groups.app)
    try:
        token_m, _ttl, owner_m = await g0.acquire(moved, 30_000)
        await g0.request(OP_SESSION_OPEN, key, 20_000)
        await g0.request(OP_SESSION_ATTACH, key, [[moved, token_m, owner_m]], [])
        assert (await _moved(groups, capsys, moved))["sessions"] == 1
    finally:
        await g0.close()
    groups.restart("g1")
    g1 = await RawNode.open(groups.servers["g1"].address, token=groups.app)
    admin1 = await RawNode.open(groups.servers["g1"].address)
    try:
        assert (await g1.holder(moved))["token"] == token_m
        assert (await admin1.request(OP_SESSIONS, None))["sessions"] == []
        opened = await g1.request(OP_SESSION_OPEN, key, 20_000)
        assert not opened["resumed"] and opened["leases"] == 0
        assert (await g1.request(OP_SESSION_ATTACH, key, [[moved, token_m, owner_m]], []))["attached"] == 1
        assert (await g1.request(OP_SESSION_KEEPALIVE, key))["renewed"] == 1
    finally:
        await g1.close()
        await admin1.close()
