"""SHARD_MAP_NOTICE (fastlock.server.mapnotice): a move's driver tells a primary to read the shard map
in etcd now.  The node takes only what etcd holds, by the rule of every map it follows: a notice of a
map etcd does not hold, or of a change of owner that is not a move, changes nothing; only an admin may
send one; a move reports when each step of its freeze ended."""

from __future__ import annotations

import json

import pytest
from test_shard_move import Groups

from fastlock._testbase.cluster import RawNode
from fastlock._testbase.shards import names_owned_by
from fastlock.coordination.shardmap import load_from_etcd
from fastlock.errors import InvalidArgument, PermissionDenied, WrongShard
from fastlock.protocol.ops import OP_SHARD_MAP, OP_SHARD_MAP_NOTICE
from fastlock.sharding import ShardMap, SlotRange, slot_of
from fastlock.sharding.moves import mark_moving


async def _write(groups: Groups, change) -> ShardMap:
    """Write ``change(map in etcd)`` to etcd (an etcd transaction, as the map's writers do)."""
    stored = await load_from_etcd(groups.url)
    try:
        old, revision = await stored.read()
        new = change(old)
        await stored.replace(revision, old, new)
        return new
    finally:
        await stored.gateway.close()


async def _epoch(node: RawNode) -> int:
    return (await node.request(OP_SHARD_MAP))["map"]["epoch"]


async def test_a_notice_takes_only_what_etcd_holds(groups):
    name = names_owned_by(groups.shard_map, "g0", 1, "noticed")[0]
    slot = slot_of(name)
    admin0 = await RawNode.open(groups.servers["g0"].address, token=groups.creds.token("admin"))
    admin1 = await RawNode.open(groups.servers["g1"].address, token=groups.creds.token("admin"))
    app = await RawNode.open(groups.servers["g0"].address, token=groups.app)
    try:
        # a notice of an epoch etcd does not hold: the node reads etcd, keeps its map, says which it serves
        assert await admin0.request(OP_SHARD_MAP_NOTICE, 7) == {"epoch": 1}
        assert await _epoch(admin0) == 1
        # a map in etcd giving g0's slot to g1 without a move: g1 refuses it by the rule of every map
        # a node follows (it would grant a name g0 may hold), so g1 still redirects the name; g0 takes
        # it (a map that takes slots away is always taken) and redirects too: nobody grants it
        by_hand = await _write(groups, lambda m: ShardMap(2, m.groups, tuple(
            SlotRange(r.first, r.last, "g1" if r.first <= slot <= r.last else r.group) for r in m.ranges)))
        assert by_hand.owner(name).name == "g1"
        assert await admin1.request(OP_SHARD_MAP_NOTICE, 2) == {"epoch": 1}
        with pytest.raises(WrongShard):
            await admin1.holder(name)
        assert await admin0.request(OP_SHARD_MAP_NOTICE, 2) == {"epoch": 2}
        with pytest.raises(WrongShard):
            await app.acquire(name, 5_000)
        # only an admin may send it; bad epochs are refused
        with pytest.raises(PermissionDenied):
            await app.request(OP_SHARD_MAP_NOTICE, 2)
        for bad in ("2", -1, 1 << 63, True, None, 2.0):
            with pytest.raises(InvalidArgument):
                await admin0.request(OP_SHARD_MAP_NOTICE, bad)
        assert await _epoch(admin0) == 2 and await _epoch(admin1) == 1
    finally:
        await app.close()
        await admin0.close()
        await admin1.close()


async def test_a_notice_of_a_mark_freezes_the_slot_at_once(groups):
    name = names_owned_by(groups.shard_map, "g0", 1, "marked")[0]
    slot = slot_of(name)
    admin0 = await RawNode.open(groups.servers["g0"].address, token=groups.creds.token("admin"))
    try:
        await _epoch(admin0)
        marked = await _write(groups, lambda m: mark_moving(m, slot, slot, "g1"))
        # the reply comes once the node serves the map it read: the mark, whatever its watch does
        assert await admin0.request(OP_SHARD_MAP_NOTICE, marked.epoch) == {"epoch": marked.epoch}
        reply = await admin0.request(OP_SHARD_MAP)
        assert [r["moving_to"] for r in reply["map"]["ranges"] if r.get("moving_to")] == ["g1"]
        # a notice of an epoch it serves already is answered without a read
        assert await admin0.request(OP_SHARD_MAP_NOTICE, 1) == {"epoch": marked.epoch}
    finally:
        await admin0.close()


async def test_a_move_reports_when_each_step_of_its_freeze_ended(groups, capsys):
    name = names_owned_by(groups.shard_map, "g0", 1, "timed")[0]
    capsys.readouterr()
    await groups.move(str(slot_of(name)), "g1")
    report = json.loads(capsys.readouterr().out)
    phases = report["phases_ms"]
    assert set(phases) == {"mark_txn", "source_serves_mark", "dest_serves_mark", "shipped", "flip_txn",
                           "source_serves_flip", "dest_serves_flip"}
    assert phases["mark_txn"] <= phases["shipped"] <= phases["flip_txn"] <= phases["source_serves_flip"]
    assert max(phases["source_serves_mark"], phases["dest_serves_mark"]) <= phases["shipped"]
