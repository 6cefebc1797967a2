"""Fencing tokens of a moved slot's names never go backwards when a group fails over around a
move (issue 30): real etcd groups (a primary and an asynchronous standby each) following a map
in etcd, a move, then the source's primary SIGKILLed.

The source's standby may not follow the move as it happens: cut off from the map over it, it
reads the flipped map afterwards without ever seeing the mark; cut off until it is promoted, it
reads no map at all.  Promoted, it must not grant the moved names (the destination grants them, with tokens
that may be above anything the source's next epoch issues): it takes every map that takes
slots from its group, and a promotion reads the map in etcd before the node serves.

On the destination's side its standby learns the import from the log (SLOTS_ADOPTED: the
slots, the adopted epoch, the moved queues) before the import is answered: a primary killed
right after an import leaves a standby that grants the moved names above the source's tokens
and keeps the moved waiters' order, and a standby whose log shows no import refuses a map
giving its group a slot without a move (written by hand)."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field

import msgpack
import pytest
from conftest import wait_until
from etcdserver import unique_prefix

import fastlock
from fastlock._testbase.cluster import RawNode
from fastlock._testbase.proxy import TcpProxy, classify_fastlock, free_port
from fastlock._testbase.servers import CredentialsDir, ServerProcess
from fastlock._testbase.shards import names_owned_by
from fastlock.auth import hash_owner
from fastlock.cli import main
from fastlock.coordination.shardmap import load_from_etcd
from fastlock.errors import FastlockError, LeaseLost, NotPrimary, SlotMoving, WrongShard
from fastlock.protocol.ops import OP_ACQUIRE, OP_SLOT_EXPORT, OP_SLOT_IMPORT
from fastlock.replication.node_state import STATE_FILE
from fastlock.sharding import ShardGroup, ShardMap, even_ranges, slot_of
from fastlock.sharding.moves import finish_move, mark_moving
from fastlock.tokens import format_token

#: etcd's epoch of g1 before its first node bids: g1 serves at epoch 10, above every epoch g0 reaches here
G1_EPOCH = 9
#: lease TTL (ms): the longest a promoted node holds new grants for (its grace)
TTL_MS = 3000


async def shard(argv: list[str]) -> int:
    """``fastlock shard ...`` in this process (on a thread: it runs its own event loop)."""
    return await asyncio.to_thread(main, argv)


async def _status(server: ServerProcess) -> dict | None:
    try:
        return await asyncio.to_thread(server.status)
    except (OSError, FastlockError):
        return None


class EtcdGroups:
    """Shard groups g0 and g1 of etcd-arbitrated nodes (``g0-0``, ``g0-1``, ``g1-0``, ...), the map
    in etcd; each group's second node follows the map through a TCP proxy (:attr:`map_links`)."""

    def __init__(self, etcd, tmp_path, monkeypatch, sizes: tuple[int, int], epochs: dict[str, int] | None = None,
                 relayed: tuple[str, ...] = (), seen: dict[str, int] | None = None, later: tuple[str, ...] = ()):
        self.etcd = etcd
        self.url = f"etcd://{etcd.address}{unique_prefix()}"
        self.coordinators = {f"g{k}": f"etcd://{etcd.address}{unique_prefix()}" for k in range(2)}
        self.creds = CredentialsDir(tmp_path / "credentials")
        monkeypatch.setenv("FASTLOCK_TOKEN_FILE", self.creds.token_file("admin"))  # the mover is an admin
        self.app = self.creds.token("app")
        self.tmp_path = tmp_path
        self.map_links = {node: TcpProxy(etcd.address).start() for node in ("g0-1", "g1-1")}
        self.ports = {f"g{k}-{i}": free_port() for k in range(2) for i in range(sizes[k])}
        self.shard_map = ShardMap(1, tuple(
            ShardGroup(f"g{k}", tuple(f"127.0.0.1:{self.ports[f'g{k}-{i}']}" for i in range(sizes[k])))
            for k in range(2)), even_ranges(["g0", "g1"]))
        self.servers: dict[str, ServerProcess] = {}
        #: etcd's epoch of each group before its first node bids
        self.epochs = {"g1": G1_EPOCH} if epochs is None else epochs
        #: node -> the highest epoch its data directory has seen before it starts (node-state.json)
        self.seen = seen or {}
        #: the nodes :meth:`start` leaves out (a test starts them: ``servers[node] = _server(node).start()``)
        self.later = later
        #: the nodes others reach through a proxy (``--advertise``): their standbys' replication links go through it
        self.relays = {node: TcpProxy(f"127.0.0.1:{self.ports[node]}", classify=classify_fastlock).start()
                       for node in relayed}

    def _server(self, node: str) -> ServerProcess:
        group = node.split("-")[0]
        if node in self.seen:  # a node that served a high epoch before (etcd believes an epoch at most 16 above it)
            data_dir = self.tmp_path / node
            data_dir.mkdir(mode=0o700)
            (data_dir / STATE_FILE).write_text(json.dumps({"max_epoch_seen": self.seen[node]}))
        link = self.map_links.get(node)
        map_url = self.url if link is None else self.url.replace(self.etcd.address, link.address)
        relay = self.relays.get(node)
        return ServerProcess(self.tmp_path / node, fsync="never", port=self.ports[node],
                             args=[*(["--advertise", relay.address] if relay is not None else []),
                                   "--shard-map", map_url, "--shard-group", group,
                                   "--coordinator", self.coordinators[group], "--node-id", node,
                                   "--coordinator-ttl", "2", *self.etcd.serve_flags(None),
                                   *self.creds.server_args(f"node-{list(self.ports).index(node) + 1}")])

    async def start(self) -> None:
        stored = await load_from_etcd(self.url)
        try:
            await stored.create(self.shard_map)
            for group, epoch in self.epochs.items():
                prefix = self.coordinators[group].split(self.etcd.address, 1)[1]
                await stored.gateway.put(f"{prefix}/epoch", str(epoch).encode())
        finally:
            await stored.gateway.close()
        for group in ("g0", "g1"):
            nodes = [n for n in self.ports if n.startswith(group + "-")]
            for k, node in enumerate(nodes):
                if node in self.later:
                    continue
                self.servers[node] = self._server(node).start()
                await wait_until(lambda node=node, k=k: self.is_role(node, "standby" if k else "primary"), 60,
                                 f"{node} to be {'a standby' if k else 'the primary'}")

    async def is_role(self, node: str, role: str) -> bool:
        st = await _status(self.servers[node])
        return st is not None and st["role"] == role and (role != "standby" or st.get("replication", {}).get(
            "synced", True) is not False)

    async def serves_epoch(self, node: str, epoch: int) -> bool:
        st = await _status(self.servers[node])
        return st is not None and st["shard"]["epoch"] >= epoch

    def stop(self) -> None:
        for server in self.servers.values():
            if server.proc is not None and server.proc.poll() is None:
                server.stop()
        for link in [*self.map_links.values(), *self.relays.values()]:
            link.close()

    async def move(self, slot: int, to: str) -> None:
        argv = ["shard", "move", "--coordinator", self.url, "--slots", str(slot), "--to", to]
        assert await shard(argv) == 0


async def _acquire_on(address: str, token: str, name: str) -> int | FastlockError:
    """A fencing token of ``name`` granted by the node at ``address`` (waiting up to 4 TTLs: a
    promoted node's grace), or the error it answered."""
    node = await RawNode.open(address, token=token)
    try:
        return (await asyncio.wait_for(node.acquire(name, TTL_MS, 4 * TTL_MS, os.urandom(16)), 60))[0]
    except FastlockError as exc:
        return exc
    finally:
        await node.close()


def _rising(name: str, tokens: list[int]) -> None:
    for before, after in zip(tokens, tokens[1:]):
        assert after > before, (f"{name!r}: token went backwards: {format_token(after)} granted after "
                                f"{format_token(before)} (all: {[format_token(t) for t in tokens]})")


async def _moved_and_regranted(g: EtcdGroups, name: str) -> list[int]:
    """``name`` granted on g0, moved to g1 held, released there and granted again by g1: the tokens."""
    async with fastlock.connect(g.servers["g0-0"].address, token=g.app, session=False) as client:
        lease = await client.acquire(name, ttl=TTL_MS / 1000)
        await g.move(slot_of(name), "g1")
        await client.release(lease)  # routed to g1
        again = await client.acquire(name, ttl=TTL_MS / 1000)
        await client.release(again)
        return [lease.fencing_token, again.fencing_token]


async def test_standbys_that_missed_the_mark_take_the_flip_and_the_source_promoted_grants_no_moved_name(groups_of):
    """Both groups' standbys are cut off from the map over the move: each reads the flipped map
    without the mark.  g0's standby lets the slot go (else, promoted, it grants the moved name at
    g0's next epoch, below g1's tokens) and g1's takes it; g0's primary is killed: its standby,
    promoted, redirects."""
    g = await groups_of((2, 2))
    name = names_owned_by(g.shard_map, "g0", 1, "moved")[0]
    starts = {node: len(g.servers[node].lines) for node in g.map_links}
    for link in g.map_links.values():
        link.blackhole()
    try:
        tokens = await _moved_and_regranted(g, name)
    finally:
        for link in g.map_links.values():
            link.heal()
    g0_standby_took = g.servers["g0-1"].wait_for_log(r"shard map epoch 3", timeout=60, start=starts["g0-1"])
    g.servers["g0-0"].kill()
    await wait_until(lambda: g.is_role("g0-1", "primary"), 60, "g0's standby to be promoted")
    got = await _acquire_on(g.servers["g0-1"].address, g.app, name)
    if isinstance(got, int):
        tokens.append(got)
    _rising(name, tokens)
    assert isinstance(got, WrongShard) and got.group == "g1", got
    assert "not applying" not in g0_standby_took
    await wait_until(lambda: g.serves_epoch("g1-1", 3), 30, "g1's standby to take the flip it saw without the mark")


async def test_a_standby_whose_map_link_is_cut_is_not_promoted_before_it_reads_the_map(groups_of):
    """g0's standby reads no map (its link to etcd's map black-holed) over the move; g0's primary
    is killed: promoted then, it would serve by its old map (its watch has not brought the flip)
    and grant the moved name below g1's tokens.  It does not even bid for the primary key while
    it cannot read the map (the bid's epoch is judged by it), and is promoted once it reads it."""
    g = await groups_of((2, 1))
    name = names_owned_by(g.shard_map, "g0", 1, "moved")[0]
    g.map_links["g0-1"].blackhole()
    tokens = await _moved_and_regranted(g, name)
    start = len(g.servers["g0-1"].lines)
    g.servers["g0-0"].kill()
    g.servers["g0-1"].wait_for_log(r"could not read the shard map in etcd before a bid", timeout=60, start=start)
    got = await _acquire_on(g.servers["g0-1"].address, g.app, name)  # while it has no map of etcd's
    if isinstance(got, int):
        tokens.append(got)
    _rising(name, tokens)
    assert not await g.is_role("g0-1", "primary")
    assert not any("took the primary role" in line for line in g.servers["g0-1"].lines[start:])
    g.map_links["g0-1"].heal()
    await wait_until(lambda: g.is_role("g0-1", "primary"), 60, "g0's standby to be promoted once it reads the map")
    assert await g.serves_epoch("g0-1", 3)
    got = await _acquire_on(g.servers["g0-1"].address, g.app, name)
    assert isinstance(got, WrongShard) and got.group == "g1", got


async def _map_epoch(g: EtcdGroups) -> int:
    """The epoch of the map in etcd."""
    stored = await load_from_etcd(g.url)
    try:
        found = await stored.read()
        return found[0].epoch if found is not None else 0
    finally:
        await stored.gateway.close()


async def test_a_destination_primary_killed_after_the_import_leaves_a_standby_that_grants_above_the_source(groups_of):
    """g0 serves at epoch 41 (its node has seen 40), g1 at 2 with an asynchronous standby whose replication link is
    black-holed while g1 imports a slot of g0 (raising g1's epoch to 41); g1's primary is
    SIGKILLed once the import is logged, the link cut (what it held is lost), the standby promoted.  The import is
    answered only once the standby applied it (SLOTS_ADOPTED), so the map does not flip to a
    group whose next primary knows neither the moved lease nor the epoch: the promoted standby
    (at epoch 3: etcd's 41 is not credible to it) takes the slot only when the move is run again
    through it, keeps the moved lease, and grants the moved name above every token g0 granted."""
    g = await groups_of((1, 2), epochs={"g0": 40, "g1": 1}, seen={"g0-0": 40}, relayed=("g1-0",))
    name = names_owned_by(g.shard_map, "g0", 1, "moved")[0]
    relay = g.relays["g1-0"]
    await wait_until(lambda: asyncio.to_thread(relay.count, "replication"), 30,
                     "g1's standby to replicate through the relay")
    async with fastlock.connect(g.servers["g0-0"].address, token=g.app, session=False) as client:
        lease = await client.acquire(name, ttl=30)
        tokens = [lease.fencing_token]
        relay.blackhole("replication")
        start = len(g.servers["g1-0"].lines)
        argv = ["shard", "move", "--coordinator", g.url, "--slots", str(slot_of(name)), "--to", "g1"]
        mover = asyncio.ensure_future(shard(argv))
        await asyncio.to_thread(g.servers["g1-0"].wait_for_log, r"slot move: imported", 60, start)

        async def flipped_or_waiting() -> bool:  # the flip in etcd, or the import's reply waiting for the standby
            return (await _map_epoch(g) >= 3 or mover.done()
                    or any("waits for standbys" in line for line in g.servers["g1-0"].lines[start:]))

        await wait_until(flipped_or_waiting, 60, "the flip, or the import waiting for g1's standby")
        g.servers["g1-0"].kill()
        relay.cut("replication")  # what the killed primary wrote to the standby is lost with the link
        relay.heal()
        await wait_until(lambda: g.is_role("g1-1", "primary"), 60, "g1's standby to be promoted")
        await mover  # the first run fails at the import (the mark stays) or, retried on g1-1, completes
        await g.move(slot_of(name), "g1")  # resumed (or done already)
        try:
            await client.release(lease)  # routed to g1
            lost = None
        except LeaseLost as exc:
            lost = exc
        again = await client.acquire(name, ttl=30)
        tokens.append(again.fencing_token)
        await client.release(again)
    _rising(name, tokens)
    assert lost is None, f"the moved lease did not survive the move and g1's failover: {lost}"


async def test_a_map_gain_written_by_hand_is_not_served_by_a_promoted_standby(groups_of):
    """A map giving one of g0's slots to g1 without a move is written to etcd by hand; g1's
    primary is killed.  g1's standby, whose log shows no import of that slot, refuses that map (a
    log line says why) and is not promoted by it: nobody in g1 grants the slot's names, whose
    tokens g1 never learned the floor of."""
    g = await groups_of((2, 2))
    name = names_owned_by(g.shard_map, "g0", 1, "gained")[0]
    slot = slot_of(name)
    stored = await load_from_etcd(g.url)
    try:
        shard_map, revision = await stored.read()
        given = ShardMap(shard_map.epoch + 1, shard_map.groups,
                         finish_move(mark_moving(shard_map, slot, slot, "g1"), slot, slot, "g1").ranges)
        start = len(g.servers["g1-1"].lines)
        await stored.replace(revision, shard_map, given)
    finally:
        await stored.gateway.close()
    refused = await asyncio.to_thread(g.servers["g1-1"].wait_for_log, r"not applying shard map epoch 2", 60, start)
    assert "no SLOTS_ADOPTED record" in refused
    start = len(g.servers["g1-1"].lines)
    g.servers["g1-0"].kill()
    await asyncio.to_thread(g.servers["g1-1"].wait_for_log, r"cannot take shard map epoch 2", 60, start)
    got = await _acquire_on(g.servers["g1-1"].address, g.app, name)
    assert isinstance(got, (NotPrimary, WrongShard)), got
    assert not await g.is_role("g1-1", "primary")


@dataclass
class ShippedQueue:
    """A holder's connection and two waiters' on g0, whose queue a test ships to g1."""
    holder: RawNode
    waiters: list[RawNode]
    owners: list[bytes] = field(default_factory=lambda: [bytes([k + 1]) * 16 for k in range(2)])


async def _hold_and_queue_two(g, q: ShippedQueue, name: str) -> tuple[int, bytes, list]:
    """``name`` held on g0 and both waiters queued behind it, in order: (token, owner, their requests)."""
    token, _ttl, owner = await q.holder.acquire(name, 15_000)  # g1's promoted node grants nothing for 15 s (its grace)
    queued = []
    async with fastlock.connect(g.servers["g0-0"].address, token=g.creds.token("admin"), session=False) as client:
        for k, w in enumerate(q.waiters):
            queued.append(w.request(OP_ACQUIRE, name, q.owners[k], 30_000, 60_000, 0, None))

            async def queue_length(n: int) -> bool:
                info = await client.lock_info(name)
                return info is not None and info.waiter_count >= n

            await wait_until(lambda k=k: queue_length(k + 1), 10, f"waiter {k} to queue")
    return token, owner, queued


async def _mark_and_import(g, stored, q: ShippedQueue, name: str, slot: int) -> tuple[ShardMap, int]:
    """Mark ``slot`` moving to g1, and ship it (its queue of ``q``'s two owners) from g0-0 to g1-0:
    (the marked map, its key's revision)."""
    shard_map, revision = await stored.read()
    marked = mark_moving(shard_map, slot, slot, "g1")
    revision = await stored.replace(revision, shard_map, marked)
    for node in ("g0-0", "g1-0"):
        await wait_until(lambda node=node: g.serves_epoch(node, marked.epoch), 20, f"{node} to follow the mark")
    admin_token = g.creds.token("admin")
    admin0 = await RawNode.open(g.servers["g0-0"].address, token=admin_token)
    admin1 = await RawNode.open(g.servers["g1-0"].address, token=admin_token)
    try:
        page = await admin0.request(OP_SLOT_EXPORT, slot, slot, None)
        assert page["queues"] == [[name, 0, [hash_owner(o) for o in q.owners]]]
        assert (await admin1.request(OP_SLOT_IMPORT, slot, slot, msgpack.packb(page)))["queues"] == 1
    finally:
        await admin0.close()
        await admin1.close()
    return marked, revision


async def _granted_in_their_old_order(again: list[RawNode], owners: list[bytes], name: str, token: int,
                                      owner: bytes) -> None:
    """The two moved waiters ask g1's node again in the opposite order (``again[1]`` first); the
    holder (``again[2]``) releases: the first waiter is granted first, then the second."""
    second = again[1].request(OP_ACQUIRE, name, owners[1], 30_000, 60_000, 0, None)
    await asyncio.sleep(0)  # sent before the first waiter's
    first = again[0].request(OP_ACQUIRE, name, owners[0], 30_000, 60_000, 0, None)
    await again[2].release(name, token, owner)
    got_first = await asyncio.wait_for(first, 60)  # after the promoted node's grace (the lease's TTL)
    assert not second.done() and got_first[0] > token
    await again[0].release(name, got_first[0], owners[0])
    got_second = await asyncio.wait_for(second, 30)
    assert got_second[0] > got_first[0]


async def test_moved_waiters_keep_their_order_when_the_destination_fails_over_before_the_flip(groups_of):
    """Two waiters queued on g0 are shipped to g1 (a primary and a standby); g1's primary is
    SIGKILLed, its standby promoted, then the map flips: the standby learned the imported queue
    from the log (SLOTS_ADOPTED), so the waiters, asking it again in the opposite order, are
    granted in their old order."""
    g = await groups_of((1, 2))
    name = names_owned_by(g.shard_map, "g0", 1, "failoverq")[0]
    slot = slot_of(name)
    q = ShippedQueue(await RawNode.open(g.servers["g0-0"].address, token=g.app),
                     [await RawNode.open(g.servers["g0-0"].address, token=g.app) for _ in range(2)])
    again: list[RawNode] = []
    try:
        token, owner, queued = await _hold_and_queue_two(g, q, name)
        stored = await load_from_etcd(g.url)
        try:
            marked, revision = await _mark_and_import(g, stored, q, name, slot)
            g.servers["g1-0"].kill()
            await wait_until(lambda: g.is_role("g1-1", "primary"), 60, "g1's standby to be promoted")
            flipped = finish_move(marked, slot, slot, "g1")
            await stored.replace(revision, marked, flipped)
        finally:
            await stored.gateway.close()
        for request in queued:  # held until the flip (WrongShard) or HOLD_S (SlotMoving): the client asks again
            with pytest.raises((WrongShard, SlotMoving)):
                await asyncio.wait_for(request, 30)
        again = [await RawNode.open(g.servers["g1-1"].address, token=g.app) for _ in range(3)]
        await wait_until(lambda: g.serves_epoch("g1-1", flipped.epoch), 20, "g1's new primary to follow the flip")
        assert (await again[2].holder(name))["token"] == token  # the adopted lease, replicated
        await _granted_in_their_old_order(again, q.owners, name, token, owner)
    finally:
        for node in [q.holder, *q.waiters, *again]:
            await node.close()


async def test_a_destination_standby_joining_by_snapshot_after_an_import_takes_the_flip_and_is_promoted(groups_of):
    """g1's second node starts after g1's first imported a slot of g0 with two waiters queued on
    it: a new standby, it joins by a snapshot, and its link to the map in etcd is black-holed from
    before the mark until after the flip.  A snapshot holds leases and keys only: the primary logs
    its imports not yet flipped again right after it (SLOTS_ADOPTED), so the standby knows the
    import; g1's primary is killed after the flip: the standby takes the flip whose mark it
    missed, is promoted, holds the moved lease and lets the waiters, asking it again in the
    opposite order, in in their old order."""
    g = await groups_of((1, 2), relayed=("g1-0",), later=("g1-1",))
    name = names_owned_by(g.shard_map, "g0", 1, "joinsnap")[0]
    slot = slot_of(name)
    relay = g.relays["g1-0"]
    relay.blackhole("replication")  # g1-1 reaches g1-0 only after the import
    g.servers["g1-1"] = g._server("g1-1").start()
    await asyncio.to_thread(g.servers["g1-1"].wait_for_log, r"shard map epoch 1: group g1", 60)
    g.map_links["g1-1"].blackhole()  # it sees neither the mark nor the flip
    q = ShippedQueue(await RawNode.open(g.servers["g0-0"].address, token=g.app),
                     [await RawNode.open(g.servers["g0-0"].address, token=g.app) for _ in range(2)])
    again: list[RawNode] = []
    try:
        token, owner, queued = await _hold_and_queue_two(g, q, name)
        stored = await load_from_etcd(g.url)
        try:
            marked, revision = await _mark_and_import(g, stored, q, name, slot)
            start = len(g.servers["g1-0"].lines)
            relay.cut("replication")
            relay.heal()
            await asyncio.to_thread(g.servers["g1-0"].wait_for_log, r"standby .* attached \(snapshot from", 60, start)
            await wait_until(lambda: g.is_role("g1-1", "standby"), 60, "g1-1 to apply its snapshot")
            flipped = finish_move(marked, slot, slot, "g1")
            await stored.replace(revision, marked, flipped)
        finally:
            await stored.gateway.close()
        assert not await g.serves_epoch("g1-1", marked.epoch)  # its map is still the one before the mark
        g.servers["g1-0"].kill()
        g.map_links["g1-1"].heal()
        await wait_until(lambda: g.is_role("g1-1", "primary"), 60, "g1's standby to be promoted")
        assert await g.serves_epoch("g1-1", flipped.epoch)
        for request in queued:  # held until the flip (WrongShard) or HOLD_S (SlotMoving): the client asks again
            with pytest.raises((WrongShard, SlotMoving)):
                await asyncio.wait_for(request, 30)
        again = [await RawNode.open(g.servers["g1-1"].address, token=g.app) for _ in range(3)]
        assert (await again[2].holder(name))["token"] == token  # the adopted lease, in the snapshot
        await _granted_in_their_old_order(again, q.owners, name, token, owner)
    finally:
        for node in [q.holder, *q.waiters, *again]:
            await node.close()
