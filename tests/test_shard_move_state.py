"""What a slot move carries beside leases (fastlock.server.slotmove): the key store's keys, with the
lease they hang on, and what a prefix watch of either group sees of them; real servers following a
map in etcd (the two groups of tests/test_shard_move.py)."""

from __future__ import annotations

import asyncio
import io
import json

import msgpack
import pytest
from conftest import wait_until
from etcdserver import unique_prefix
from test_shard_move import Groups, _mark, _serves_mark, shard

import fastlock
from fastlock._testbase.cluster import RawNode
from fastlock._testbase.proxy import free_port
from fastlock._testbase.servers import ServerProcess
from fastlock._testbase.shards import names_owned_by
from fastlock.auth import hash_owner
from fastlock.cli.shardmove import abort_slots
from fastlock.coordination.shardmap import load_from_etcd
from fastlock.errors import FastlockError, InvalidArgument, LimitExceeded, SlotMoving, WrongShard
from fastlock.protocol.ops import (
    OP_ACQUIRE,
    OP_KEY_LIST,
    OP_KEY_WATCH_FROM,
    OP_SHARD_MAP,
    OP_SLOT_EXPORT,
    OP_SLOT_IMPORT,
    PUSH_VALUE_REV,
)
from fastlock.sharding import ShardGroup, ShardMap, slot_of
from fastlock.sharding.moves import finish_move, mark_moving
from fastlock.wal.dump import dump


class KeyWatch:
    """A KEY_WATCH_FROM of ``prefix`` on one node: the ``vrev`` pushes it got, as
    ``(revision, offset, what, key, value)``."""

    def __init__(self) -> None:
        self.changes: list[tuple[int, int, str, str, bytes | None]] = []
        self.node: RawNode | None = None
        self.start = 0

    def on_push(self, kind, payload) -> None:
        if kind == PUSH_VALUE_REV:
            _prefix, what, key, value, revision, offset = payload
            self.changes.append((revision, offset, what, key, value))

    @classmethod
    async def open(cls, address: str, token: str, prefix: str, revision: int | None = None) -> KeyWatch:
        watch = cls()
        watch.node = await RawNode.open(address, token=token, on_push=watch.on_push)
        reply = await watch.node.request(OP_KEY_WATCH_FROM, prefix, revision, None)
        watch.start = reply["revision"]
        return watch

    def of(self, key: str) -> list[tuple[str, bytes | None]]:
        return [(what, value) for _rev, _off, what, k, value in self.changes if k == key]

    def positions_rise(self) -> bool:
        positions = [(rev, off) for rev, off, *_ in self.changes]
        return positions == sorted(positions) and len(set(positions)) == len(positions)

    async def close(self) -> None:
        if self.node is not None:
            await self.node.close()


async def _keys_on(address: str, token: str, prefix: str) -> list[str]:
    """The keys under ``prefix`` that the node at ``address`` holds (KEY_LIST: its own, owned or not)."""
    node = await RawNode.open(address, token=token)
    try:
        return [row[0] for row in (await node.request(OP_KEY_LIST, prefix, 1000))["keys"]]
    finally:
        await node.close()


async def test_keys_move_with_their_slot_and_each_groups_watch_sees_every_change_in_rising_order(groups, capsys):
    """A key without lease and a key on a lease (both under one tag) move with their slot: g1
    publishes them as puts at its own rising revisions, g0 as "moved" (not deleted, not revoked);
    a watch of g1 resuming from a position before the move replays every change since, in order;
    the lease's release on g1 deletes its key there; restarts of both groups keep it so (the
    KEY_PUT and KEY_MOVED records)."""
    tag = names_owned_by(groups.shard_map, "g0", 1, "keytag")[0]
    plain, leased, lease_name = f"mvk{{{tag}}}a", f"mvk{{{tag}}}b", f"{{{tag}}}:lease"
    stays = next(n for n in names_owned_by(groups.shard_map, "g0", 20, "mvkstay") if slot_of(n) != slot_of(tag))
    g0, g1 = groups.servers["g0"].address, groups.servers["g1"].address
    async with groups.connect() as client:
        lease = await client.acquire(lease_name, ttl=60)
        await client.put(plain, b"A")
        await client.put(leased, b"B", lease=lease)
        await client.put(stays, b"S")
        on_g0 = await KeyWatch.open(g0, groups.app, "mvk")
        on_g1 = await KeyWatch.open(g1, groups.app, "mvk")
        try:
            capsys.readouterr()
            await groups.move(str(slot_of(tag)), "g1")
            assert json.loads(capsys.readouterr().out)["keys"] == 2
            await wait_until(lambda: _async(len(on_g1.of(plain)) == 1 and len(on_g1.of(leased)) == 1), 20,
                             "g1's watch to see the imported keys")
            await wait_until(lambda: _async(len(on_g0.of(plain)) == 1 and len(on_g0.of(leased)) == 1), 20,
                             "g0's watch to see the keys leave")
            assert on_g1.of(plain) == [("put", b"A")] and on_g1.of(leased) == [("put", b"B")]
            assert on_g0.of(plain) == [("moved", None)] and on_g0.of(leased) == [("moved", None)]
            assert on_g0.of(stays) == [] and all(rev > on_g1.start for rev, *_ in on_g1.changes)
            # the keys are served by g1 (routed there), the one of another slot by g0
            got = await client.get(leased)
            assert (got.value, got.lease, got.token) == (b"B", lease_name, lease.fencing_token)
            assert (await client.get(plain)).value == b"A" and (await client.get(stays)).value == b"S"
            assert sorted(await _keys_on(g1, groups.app, "mvk")) == sorted([plain, leased])
            assert await _keys_on(g0, groups.app, "mvk") == [stays]
            await client.put(plain, b"A2")  # routed to g1
            await wait_until(lambda: _async(len(on_g1.of(plain)) == 2), 20, "g1's watch to see the new value")
            assert on_g1.of(plain)[-1] == ("put", b"A2") and on_g1.positions_rise() and on_g0.positions_rise()
            # a watch of g1 resuming from a position before the move misses nothing and goes forwards
            resumed = await KeyWatch.open(g1, groups.app, "mvk", on_g1.start)
            try:
                assert [c[2:] for c in resumed.changes] == [c[2:] for c in on_g1.changes]
                assert resumed.positions_rise()
            finally:
                await resumed.close()
            await client.release(lease)  # on g1: its key goes with it, there
            await wait_until(lambda: _async(len(on_g1.of(leased)) == 2), 20, "g1's watch to see the release")
            assert on_g1.of(leased)[-1] == ("released", None)
        finally:
            await on_g0.close()
            await on_g1.close()
    groups.restart("g0")
    groups.restart("g1")
    assert await _keys_on(g0, groups.app, "mvk") == [stays]  # KEY_MOVED recovered: not back on g0
    assert await _keys_on(g1, groups.app, "mvk") == [plain]  # KEY_PUT recovered on g1


async def _async(value: bool) -> bool:
    return value


async def test_a_key_and_its_lease_in_different_slots_are_not_moved_and_the_mark_is_cleared(groups, capsys):
    key, lease_name = names_owned_by(groups.shard_map, "g0", 2, "split")
    assert slot_of(key) != slot_of(lease_name)
    slot = slot_of(key)
    async with groups.connect() as client:
        lease = await client.acquire(lease_name, ttl=60)
        await client.put(key, b"v", lease=lease)
        argv = ["shard", "move", "--coordinator", groups.url, "--slots", str(slot), "--to", "g1"]
        assert await shard(argv) == 1
        assert "hold keys attached to a lease on the other side" in capsys.readouterr().err
        stored = await load_from_etcd(groups.url)
        try:
            shard_map, _revision = await stored.read()
        finally:
            await stored.gateway.close()
        assert shard_map.owner_of_slot(slot).name == "g0" and shard_map.moving_to_of_slot(slot) is None

        async def g0_serves(epoch: int) -> bool:
            status = await asyncio.to_thread(groups.servers["g0"].status)
            return status["shard"]["epoch"] == epoch and status["shard"]["moving"] == 0

        await wait_until(lambda: g0_serves(shard_map.epoch), 20, "g0 to follow the cleared mark")
        got = await client.get(key)  # served by g0 as before, still on its lease
        assert got is not None and got.token == lease.fencing_token
        assert await _keys_on(groups.servers["g1"].address, groups.app, "") == []
        await client.release(lease)


async def test_hostile_key_rows_of_a_slot_import_are_refused_and_change_nothing(groups):
    tag = names_owned_by(groups.shard_map, "g0", 1, "hostilekeys")[0]
    slot = slot_of(tag)
    key, lease_name = f"{{{tag}}}k", f"{{{tag}}}l"
    outside = next(n for n in names_owned_by(groups.shard_map, "g0", 20, "out") if slot_of(n) != slot)
    await _mark(groups, slot)
    admin = await RawNode.open(groups.servers["g1"].address, token=groups.creds.token("admin"))
    try:
        await wait_until(lambda: _serves_mark(admin, groups), 20, "g1 to follow the mark")
        base = {"leases": [], "queues": [], "delays": [], "floor": 0}
        bad_keys = [
            [[key, "text", None, 0, "app"]],  # a value that is not bytes
            [[outside, b"v", None, 0, "app"]],  # a key outside the slots
            [[key, b"v", outside, 5, "app"]],  # its lease outside the slots
            [[key, b"v", None, 5, "app"]],  # a token without a lease
            [[key, b"v", lease_name, 0, "app"]],  # a lease without a token
            [[key, b"v", None, 0, "p" * 300]],  # a principal too long
            [[key, b"v", None, 0]],  # too few fields
            [[key, b"v" * ((64 << 10) + 1), None, 0, "app"]],  # a value over --max-value-bytes
            [[f"{{{tag}}}{i}", b"v", None, 0, "app"] for i in range(21)],  # more rows than a page
            "keys",
        ]
        for rows in bad_keys:
            with pytest.raises(InvalidArgument):
                await admin.request(OP_SLOT_IMPORT, slot, slot, msgpack.packb({**base, "keys": rows}))
        assert await _keys_on(groups.servers["g1"].address, groups.app, "") == []
    finally:
        await admin.close()


async def test_an_import_past_the_destinations_key_limits_is_refused_whole(etcd, tmp_path, monkeypatch):
    """A destination started with --max-keys 2 refuses a page of 3 new keys (LimitExceeded) and
    holds none of them."""
    g = Groups(etcd, tmp_path, monkeypatch)
    g.servers["g1"].args.extend(["--max-keys", "2"])
    try:
        await g.start()
        tag = names_owned_by(g.shard_map, "g0", 1, "limit")[0]
        slot = slot_of(tag)
        await _mark(g, slot)
        admin = await RawNode.open(g.servers["g1"].address, token=g.creds.token("admin"))
        try:
            await wait_until(lambda: _serves_mark(admin, g), 20, "g1 to follow the mark")
            rows = [[f"{{{tag}}}{i}", b"v", None, 0, "app"] for i in range(3)]
            page = {"leases": [], "queues": [], "delays": [], "floor": 0, "keys": rows}
            with pytest.raises(LimitExceeded, match="max-keys"):
                await admin.request(OP_SLOT_IMPORT, slot, slot, msgpack.packb(page))
            assert await _keys_on(g.servers["g1"].address, g.app, "") == []
            page["keys"] = rows[:2]
            assert (await admin.request(OP_SLOT_IMPORT, slot, slot, msgpack.packb(page)))["keys"] == 2
            assert (await admin.request(OP_SLOT_IMPORT, slot, slot, msgpack.packb(page)))["keys"] == 2  # again
            assert len(await _keys_on(g.servers["g1"].address, g.app, "")) == 2
            async with g.connect() as client:  # a routing client lists a key from its slot's owner only
                assert [kv.key for kv in await client.list_prefix(f"{{{tag}")] == []
        finally:
            await admin.close()
    finally:
        g.stop()


async def _status(server: ServerProcess) -> dict:
    return await asyncio.to_thread(server.status)


async def test_a_destination_etcd_group_below_the_sources_epoch_raises_it_without_a_failover(
        etcd, tmp_path, monkeypatch):
    """g1 is an etcd group (a primary and a standby) at epoch 1; g0 serves at epoch 5 (raised by
    an import of a move aborted after it).  Moving a held lease from g0 to g1 raises g1's epoch to
    5 in etcd, with its primary record, before g1 logs it: g1's primary stays primary (its
    standby, which replicates epoch 5, follows a primary etcd names at 5), and every token g1
    grants after is above the moved one."""
    g = Groups(etcd, tmp_path, monkeypatch)
    coordinator = f"etcd://{etcd.address}{unique_prefix()}"
    ports = [g.servers["g1"].port, free_port()]
    g.shard_map = ShardMap(1, (g.shard_map.groups[0], ShardGroup("g1", tuple(f"127.0.0.1:{p}" for p in ports))),
                           g.shard_map.ranges)

    def member(k: int) -> ServerProcess:
        return ServerProcess(tmp_path / f"g1-{k}", fsync="always", port=ports[k],
                             args=["--shard-map", g.url, "--shard-group", "g1", "--coordinator", coordinator,
                                   "--node-id", f"g1-{k}", "--coordinator-ttl", "2", *etcd.serve_flags(None),
                                   *g.creds.server_args(f"node-{2 + k}")])

    g.servers["g1"] = member(0)
    try:
        await g.start()

        async def role(server: ServerProcess, wanted: str) -> bool:
            try:
                return (await _status(server))["role"] == wanted
            except (OSError, FastlockError):
                return False

        await wait_until(lambda: role(g.servers["g1"], "primary"), 30, "g1's first node to take the primary key")
        g.servers["g1-standby"] = standby = member(1)
        standby.start()
        await wait_until(lambda: role(standby, "standby"), 30, "g1's second node to follow")
        primary = await _status(g.servers["g1"])
        assert primary["epoch"] == 1
        # g0 at epoch 5: a move of a g1 slot to g0 marked, an empty page with floor 5 imported, the move aborted
        spare = names_owned_by(g.shard_map, "g1", 1, "spare")[0]
        stored = await load_from_etcd(g.url)
        try:
            shard_map, revision = await stored.read()
            await stored.replace(revision, shard_map, mark_moving(shard_map, slot_of(spare), slot_of(spare), "g0"))
            admin = await RawNode.open(g.servers["g0"].address, token=g.creds.token("admin"))
            try:
                async def g0_serves_mark() -> bool:
                    reply = await admin.request(OP_SHARD_MAP)
                    return any(r.get("moving_to") == "g0" for r in reply["map"]["ranges"])

                await wait_until(g0_serves_mark, 20, "g0 to follow the mark")
                page = {"leases": [], "queues": [], "delays": [], "floor": 5 << 40 | 1}
                await admin.request(OP_SLOT_IMPORT, slot_of(spare), slot_of(spare), msgpack.packb(page))
            finally:
                await admin.close()
        finally:
            await stored.gateway.close()
        stored = await load_from_etcd(g.url)
        try:
            await abort_slots(stored, slot_of(spare), slot_of(spare), "g0")
        finally:
            await stored.gateway.close()
        assert (await _status(g.servers["g0"]))["epoch"] == 5
        name = names_owned_by(g.shard_map, "g0", 1, "epochs")[0]
        async with g.connect() as client:
            lease = await client.acquire(name, ttl=60)
            assert lease.fencing_token >> 40 == 5
            await g.move(str(slot_of(name)), "g1")
            after = await _status(g.servers["g1"])
            assert after["role"] == "primary" and after["epoch"] == 5
            assert after["coordinator"]["holding"] and after["coordinator"]["epoch"] == 5

            async def standby_at(epoch: int) -> bool:
                st = await _status(standby)
                return (st["role"] == "standby" and st["epoch"] == epoch and st["coordinator"]["primary"] is not None
                        and st["coordinator"]["primary"]["epoch"] == epoch)

            await wait_until(lambda: standby_at(5), 30, "g1's standby to replicate epoch 5 and see it in etcd")
            # the standby's next steps would raise etcd's epoch above the primary's if etcd named it below:
            # let it read three more heartbeats of the primary
            seen = (await _status(standby))["coordinator"]["heartbeat"]["seen_revision"]

            async def beats(n: int) -> bool:
                return (await _status(standby))["coordinator"]["heartbeat"]["seen_revision"] >= seen + n

            await wait_until(lambda: beats(3), 60, "g1's standby to see three more heartbeats")
            still = await _status(g.servers["g1"])
            assert still["role"] == "primary" and still["coordinator"]["holding"]
            assert still["coordinator"]["epoch"] == 5 and not still["coordinator"]["stepped_down"]
            assert (await client.group_client("g1").holder(name))["token"] == lease.fencing_token
            await client.release(lease)
            again = await client.acquire(name, ttl=5)
            assert again.fencing_token > lease.fencing_token
            await client.release(again)
    finally:
        g.stop()


@pytest.mark.parametrize("snapshot", [False, True], ids=["log", "snapshot"])
async def test_moved_waiters_keep_their_order_when_the_destination_restarts_before_the_flip(groups, snapshot):
    """Two waiters queued on g0 are shipped to g1, g1 restarts, then the map flips (no second
    ship): g1's log holds the imported queue (its SLOTS_ADOPTED record or, with a snapshot every
    2 records, a snapshot written after the import, from which recovery starts without reading the
    record), so the waiters, asking g1 again in the opposite order, are granted in their old order."""
    if snapshot:
        groups.args["g1"] = ["--snapshot-every", "2"]
        groups.restart("g1")
    name = names_owned_by(groups.shard_map, "g0", 1, "restartq")[0]
    slot = slot_of(name)
    g0 = await RawNode.open(groups.servers["g0"].address, token=groups.app)
    waiters = [await RawNode.open(groups.servers["g0"].address, token=groups.app) for _ in range(2)]
    owners = [bytes([k + 1]) * 16 for k in range(2)]
    again: list[RawNode] = []
    try:
        token, _ttl, owner = await g0.acquire(name, 60_000)
        queued = []
        admin = fastlock.connect(groups.servers["g0"].address, token=groups.creds.token("admin"), session=False)
        async with admin as client:
            for k, w in enumerate(waiters):
                queued.append(w.request(OP_ACQUIRE, name, owners[k], 30_000, 60_000, 0, None))

                async def queue_length(n: int) -> bool:
                    info = await client.lock_info(name)
                    return info is not None and info.waiter_count >= n

                await wait_until(lambda k=k: queue_length(k + 1), 10, f"waiter {k} to queue")
        await _mark(groups, slot)
        admin0 = await RawNode.open(groups.servers["g0"].address, token=groups.creds.token("admin"))
        admin1 = await RawNode.open(groups.servers["g1"].address, token=groups.creds.token("admin"))
        try:
            await wait_until(lambda: _serves_mark(admin1, groups), 20, "g1 to follow the mark")
            page = await admin0.request(OP_SLOT_EXPORT, slot, slot, None)
            assert page["queues"] == [[name, 0, [hash_owner(o) for o in owners]]]
            assert (await admin1.request(OP_SLOT_IMPORT, slot, slot, msgpack.packb(page)))["queues"] == 1
        finally:
            await admin0.close()
            await admin1.close()
        data_dir = groups.servers["g1"].data_dir
        rows = await asyncio.to_thread(_rows, data_dir)
        adopted = [row["lsn"] for row in rows if row.get("type") == "slots_adopted"]
        assert len(adopted) == 1, rows
        if snapshot:  # recovery starts from a snapshot written after the import: the record is not replayed

            def covered() -> bool:
                return any(int(f.stem.split("-")[1]) >= adopted[0] for f in data_dir.glob("snap-*.snap"))

            await wait_until(covered, 20, "a snapshot of g1 covering its SLOTS_ADOPTED record")
        groups.restart("g1")
        stored = await load_from_etcd(groups.url)
        try:
            shard_map, revision = await stored.read()
            flipped = finish_move(shard_map, slot, slot, "g1")
            await stored.replace(revision, shard_map, flipped)
        finally:
            await stored.gateway.close()
        for q in queued:  # held until the flip (WrongShard) or HOLD_S (SlotMoving): the client asks again
            with pytest.raises((WrongShard, SlotMoving)):
                await asyncio.wait_for(q, 30)
        again = [await RawNode.open(groups.servers["g1"].address, token=groups.app) for _ in range(3)]

        async def g1_serves(epoch: int) -> bool:
            return (await again[2].request(OP_SHARD_MAP))["map"]["epoch"] >= epoch

        await wait_until(lambda: g1_serves(flipped.epoch), 20, "g1 to follow the flip")
        assert (await again[2].holder(name))["token"] == token  # the adopted lease, kept across the restart
        second = again[1].request(OP_ACQUIRE, name, owners[1], 30_000, 60_000, 0, None)
        await asyncio.sleep(0)  # sent before the first waiter's
        first = again[0].request(OP_ACQUIRE, name, owners[0], 30_000, 60_000, 0, None)
        await again[2].release(name, token, owner)
        got_first = await asyncio.wait_for(first, 30)
        assert not second.done() and got_first[0] > token
        await again[0].release(name, got_first[0], owners[0])
        got_second = await asyncio.wait_for(second, 30)
        assert got_second[0] > got_first[0]
    finally:
        for node in [g0, *waiters, *again]:
            await node.close()


def _rows(data_dir) -> list[dict]:
    """The records of the WAL of ``data_dir`` as ``fastlock wal dump -o json`` prints them."""
    out = io.StringIO()
    dump(data_dir, file=out, output="json")
    return [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


def _key_records(data_dir) -> list[tuple[str, str]]:
    """``(record type, key)`` of the key records in the WAL of ``data_dir`` (``fastlock wal dump``)."""
    rows = _rows(data_dir)
    return [(row["type"], row["key"]) for row in rows if row.get("type") in ("key_put", "key_delete", "key_moved")]


async def test_standbys_log_the_moved_keys_as_their_primaries_do(groups):
    """g1's standby logs the imported keys (KEY_PUT) and the adoption (SLOTS_ADOPTED), g0's the
    keys leaving (KEY_MOVED naming g1), from the replication stream, as every record."""
    standbys = {}
    for k, group in enumerate(("g0", "g1")):
        standbys[group] = ServerProcess(groups.tmp_path / f"{group}-standby", fsync="always",
                                        args=["--standby-of", groups.servers[group].address,
                                              "--shard-map", groups.url, "--shard-group", group,
                                              *groups.creds.server_args(f"node-{3 + k}")])
    try:
        for standby in standbys.values():
            standby.start()
            standby.wait_for_log(r"replicating from", 20)
        tag = names_owned_by(groups.shard_map, "g0", 1, "standbykeys")[0]
        plain, leased = f"{{{tag}}}:a", f"{{{tag}}}:b"
        async with groups.connect() as client:
            lease = await client.acquire(f"{{{tag}}}:lease", ttl=60)
            await client.put(plain, b"A")
            await client.put(leased, b"B", lease=lease)
            await groups.move(str(slot_of(tag)), "g1")

            async def logged(group: str, want: list[tuple[str, str]]) -> bool:
                have = await asyncio.to_thread(_key_records, standbys[group].data_dir)
                return all(w in have for w in want)

            await wait_until(lambda: logged("g1", [("key_put", plain), ("key_put", leased)]), 20,
                             "g1's standby to log the imported keys")
            await wait_until(lambda: logged("g0", [("key_moved", plain), ("key_moved", leased)]), 20,
                             "g0's standby to log the keys leaving")
            adopted = [row for row in await asyncio.to_thread(_rows, standbys["g1"].data_dir)
                       if row.get("type") == "slots_adopted"]
            # the import's SLOTS_ADOPTED (beside those of the group's owned slots logged after its snapshot)
            assert f"{slot_of(tag)}..{slot_of(tag)}" in [row["slots"] for row in adopted], adopted
            assert ("key_delete", plain) not in await asyncio.to_thread(_key_records, standbys["g0"].data_dir)
            await client.release(lease)
    finally:
        for standby in standbys.values():
            if standby.proc is not None:
                standby.stop()


async def test_a_session_held_lease_joins_the_clients_session_on_the_new_group(groups):
    """The session share of a move: a routing client's session holds two leases on g0; one's
    slot moves to g1.  Afterwards g1 lists the client's session there with the moved lease
    attached and g0 its session with the other one only: each group's keep-alive renews the
    leases it holds, and each lease counts in one group's session (and principal) only."""
    moved, stays = names_owned_by(groups.shard_map, "g0", 2, "sessionshare")
    admin = fastlock.connect(groups.servers["g0"].address, token=groups.creds.token("admin"), session=False)
    async with fastlock.connect(groups.servers["g0"].address, token=groups.app, session=True) as client, \
            admin as operator:
        async def attached(group: str, n: int) -> bool:
            found = await operator.group_client(group).sessions("app")
            return sum(s.leases for s in found) == n

        async with client.lock(moved, ttl=2) as lease, client.lock(stays, ttl=2) as other:
            await wait_until(lambda: attached("g0", 2), 20, "both leases to be attached to the session on g0")
            await groups.move(str(slot_of(moved)), "g1")
            await wait_until(lambda: attached("g1", 1), 20, "the moved lease to join the client's session on g1")
            await wait_until(lambda: attached("g0", 1), 20, "g0's session to keep the other lease only")
            g1_holder = await client.group_client("g1").holder(moved)
            assert g1_holder is not None and g1_holder["token"] == lease.fencing_token
            assert not lease.lost.is_set() and not other.lost.is_set()


async def test_keys_imported_by_a_move_aborted_while_the_destination_was_down_go_back_at_its_start(groups):
    tag = names_owned_by(groups.shard_map, "g0", 1, "abortdown")[0]
    slot = slot_of(tag)
    await _mark(groups, slot)
    admin = await RawNode.open(groups.servers["g1"].address, token=groups.creds.token("admin"))
    try:
        await wait_until(lambda: _serves_mark(admin, groups), 20, "g1 to follow the mark")
        rows = [[f"{{{tag}}}{i}", b"v", None, 0, "app"] for i in range(2)]
        page = {"leases": [], "queues": [], "delays": [], "floor": 0, "keys": rows}
        assert (await admin.request(OP_SLOT_IMPORT, slot, slot, msgpack.packb(page)))["keys"] == 2
    finally:
        await admin.close()
    assert len(await _keys_on(groups.servers["g1"].address, groups.app, "")) == 2
    old = groups.servers["g1"]
    old.stop()
    stored = await load_from_etcd(groups.url)
    try:
        await abort_slots(stored, slot, slot, "g1")
    finally:
        await stored.gateway.close()
    groups.servers["g1"] = groups._server("g1", old.port)
    groups.servers["g1"].start()
    assert await _keys_on(groups.servers["g1"].address, groups.app, "") == []
