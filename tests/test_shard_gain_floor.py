"""A node never grants the names of a slot its group gained without that slot's token floor
(issue 30): real etcd groups following a map in etcd, the map written by hand.

A move's import raises the destination's token counter above the source's high-water mark
(SLOTS_ADOPTED).  A mark followed by its flip written to etcd by hand (or by an interrupted or
buggy driver) gives a group a slot with no import: the destination would grant the slot's
names from its own counter, below tokens the source granted.  It answers them ``Unavailable``
instead until the slot's floor is adopted (``fastlock shard adopt``), after a restart, on a
promoted standby and with a static map file too.

A move's flip records the floor it shipped on the range in the map: a node serving the range stays
above it whatever its log holds (a group whose nodes all start on empty data directories, a static
map file with floors), and ``fastlock shard adopt --force`` goes above it without ``--above-epoch``."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import pytest
from conftest import wait_until
from test_shard_move_tokens import _acquire_on, _rising, _status, shard

import fastlock
from fastlock._testbase.proxy import free_port
from fastlock._testbase.servers import ServerProcess
from fastlock._testbase.shards import names_owned_by
from fastlock.coordination.shardmap import load_from_etcd
from fastlock.errors import Unavailable
from fastlock.sharding import SLOTS, ShardGroup, ShardMap, even_ranges, slot_of, write_map_file
from fastlock.sharding.moves import finish_move, mark_moving
from fastlock.tokens import epoch_of, format_token, make_token

#: g0 serves at epoch 41 (its node has seen 40), g1 at 2: g1's own tokens are below g0's
HIGH = {"epochs": {"g0": 40, "g1": 1}, "seen": {"g0-0": 40}}


async def _granted_on_g0(g, name: str) -> int:
    async with fastlock.connect(g.servers["g0-0"].address, token=g.app, session=False) as client:
        lease = await client.acquire(name, ttl=30)
        await client.release(lease)
        return lease.fencing_token


async def _mark_and_flip_by_hand(g, slot: int, nodes: tuple[str, ...]) -> int:
    """Write the mark of ``slot`` moving to g1, then its flip, to etcd (no export, no import),
    each once ``nodes`` serve the map before it: the flipped map's epoch."""
    stored = await load_from_etcd(g.url)
    try:
        shard_map, revision = await stored.read()
        marked = mark_moving(shard_map, slot, slot, "g1")
        revision = await stored.replace(revision, shard_map, marked)
        for node in nodes:
            await wait_until(lambda node=node: g.serves_epoch(node, marked.epoch), 30, f"{node} to take the mark")
        flipped = finish_move(marked, slot, slot, "g1")
        await stored.replace(revision, marked, flipped)
        for node in nodes:
            await wait_until(lambda node=node: g.serves_epoch(node, flipped.epoch), 30, f"{node} to take the flip")
        return flipped.epoch
    finally:
        await stored.gateway.close()


async def _refused_on(g, node: str, name: str, slot: int, tokens: list[int]) -> None:
    """An acquire of ``name`` on ``node`` is refused for ``slot``'s token floor (a grant would
    first be checked against the ``tokens`` granted before, then fail)."""
    got = await _acquire_on(g.servers[node].address, g.app, name)
    if isinstance(got, int):
        tokens.append(got)
    _rising(name, tokens)
    _refused_for_its_floor(got, slot)


def _refused_for_its_floor(got, slot: int) -> None:
    assert isinstance(got, Unavailable), got
    assert f"slot {slot}" in str(got) and "fastlock shard adopt" in str(got), got


async def test_a_hand_written_mark_and_flip_is_not_served_until_the_slot_floor_is_adopted(groups_of):
    """g0 grants a name at epoch 41; its slot is marked moving to g1 and flipped by hand.  g1
    (epoch 2) answers the name Unavailable (the code before granted it at 2/1, below 41's token),
    shows the slot as not adopted, and still refuses after a restart; ``fastlock shard adopt
    --from g0`` adopts g0's high-water mark, and g1 grants above every token g0 granted."""
    g = await groups_of((1, 1), **HIGH)
    name = names_owned_by(g.shard_map, "g0", 1, "byhand")[0]
    slot = slot_of(name)
    tokens = [await _granted_on_g0(g, name)]
    assert epoch_of(tokens[0]) == 41
    await _mark_and_flip_by_hand(g, slot, ("g0-0", "g1-0"))
    await _refused_on(g, "g1-0", name, slot, tokens)
    st = await _status(g.servers["g1-0"])
    assert st["shard"]["unadopted"] == 1 and st["shard"]["unadopted_slots"] == [[slot, slot]], st["shard"]

    g.servers["g1-0"].stop()  # a restart keeps the slot unadopted (the data directory says so)
    g.servers["g1-0"] = g._server("g1-0").start()
    await wait_until(lambda: g.is_role("g1-0", "primary"), 60, "g1-0 to be the primary again")
    await _refused_on(g, "g1-0", name, slot, tokens)

    argv = ["shard", "adopt", "--coordinator", g.url, "--slots", str(slot), "--from", "g0"]
    assert await shard(argv) == 0
    st = await _status(g.servers["g1-0"])
    assert st["shard"]["unadopted"] == 0, st["shard"]
    got = await _acquire_on(g.servers["g1-0"].address, g.app, name)
    assert isinstance(got, int), got
    tokens.append(got)
    _rising(name, tokens)


async def test_a_promoted_standby_does_not_serve_a_slot_flipped_by_hand_and_force_adopts_above_a_lost_source(
        groups_of):
    """g1 has a standby; the slot is flipped to g1 by hand, then g1's primary and g0 (the source)
    are killed for good.  The promoted standby answers the name Unavailable; ``fastlock shard adopt
    --force --above-epoch 41`` (the source's highest epoch, as its etcd key says) raises g1 above
    it, and g1 grants above every token g0 granted.  Without ``--force`` nothing changes."""
    g = await groups_of((1, 2), **HIGH)
    name = names_owned_by(g.shard_map, "g0", 1, "lostsrc")[0]
    slot = slot_of(name)
    tokens = [await _granted_on_g0(g, name)]
    await _mark_and_flip_by_hand(g, slot, ("g0-0", "g1-0", "g1-1"))
    g.servers["g1-0"].kill()
    g.servers["g0-0"].kill()
    await wait_until(lambda: g.is_role("g1-1", "primary"), 60, "g1's standby to be promoted")
    await _refused_on(g, "g1-1", name, slot, tokens)

    adopt = ["shard", "adopt", "--coordinator", g.url, "--slots", str(slot)]
    with pytest.raises(SystemExit) as usage:  # --from or --force is needed
        await shard([*adopt, "--above-epoch", "41"])
    assert usage.value.code == 2
    await _refused_on(g, "g1-1", name, slot, tokens)
    assert await shard([*adopt, "--force", "--above-epoch", "41"]) == 0
    got = await _acquire_on(g.servers["g1-1"].address, g.app, name)
    assert isinstance(got, int), got
    tokens.append(got)
    _rising(name, tokens)
    assert epoch_of(got) >= 42


async def test_a_move_run_by_the_driver_leaves_no_slot_unadopted(groups_of):
    """The ordinary move (export, import, flip): the destination grants the moved name at once,
    above the source's tokens, and shows no slot unadopted."""
    g = await groups_of((1, 1), **HIGH)
    name = names_owned_by(g.shard_map, "g0", 1, "driven")[0]
    tokens = [await _granted_on_g0(g, name)]
    await g.move(slot_of(name), "g1")
    got = await _acquire_on(g.servers["g1-0"].address, g.app, name)
    assert isinstance(got, int), got
    tokens.append(got)
    _rising(name, tokens)
    assert (await _status(g.servers["g1-0"]))["shard"]["unadopted"] == 0
    flipped = await _stored_map(g)  # the flip recorded the floor the move shipped: g0's high-water mark
    floor = flipped.floor_of_slot(slot_of(name))
    assert floor is not None and tokens[0] <= floor < got and epoch_of(floor) == 41, floor
    assert flipped.ranges[[r.first <= slot_of(name) <= r.last for r in flipped.ranges].index(True)].floor_epoch \
        == flipped.epoch


async def _stored_map(g) -> ShardMap:
    stored = await load_from_etcd(g.url)
    try:
        return (await stored.read())[0]
    finally:
        await stored.gateway.close()


async def _granted_within(address: str, token: str | None, name: str, timeout: float = 30.0) -> int:
    """A token of ``name`` granted by the node at ``address``, asked again while it answers
    Unavailable (a primary raising its epoch above the map's floor first), for at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = await _acquire_on(address, token, name)
        if isinstance(got, int):
            return got
        assert isinstance(got, Unavailable) and time.monotonic() < deadline, got
        await asyncio.sleep(0.05)


async def test_a_destination_whose_nodes_all_restart_on_empty_data_directories_stays_above_the_maps_floor(
        groups_of):
    """A real move of a name's slot from g0 (epoch 41) to g1 (epoch 2), which grants it at the epoch
    it adopted; then both of g1's nodes are stopped and restarted on empty data directories, the
    map in etcd already giving g1 the slot.  The map's floor for the slot makes g1's new primary
    bid above it (to 43: above g0's tokens, g1's own at 41, and 42, where a primary of g1 raises its
    epoch for this floor) before it grants the name.  The code before granted it from g1's new
    counter, at 1/1, below both."""
    g = await groups_of((1, 2), **HIGH)
    name = names_owned_by(g.shard_map, "g0", 1, "wiped")[0]
    tokens = [await _granted_on_g0(g, name)]
    await g.move(slot_of(name), "g1")
    got = await _acquire_on(g.servers["g1-0"].address, g.app, name)
    assert isinstance(got, int), got
    tokens.append(got)
    for node in ("g1-1", "g1-0"):
        g.servers[node].stop()
    for node in ("g1-0", "g1-1"):
        shutil.rmtree(g.tmp_path / node)
    g.servers["g1-0"] = g._server("g1-0").start()
    await wait_until(lambda: g.is_role("g1-0", "primary"), 60, "g1-0 to be the primary on an empty data directory")
    g.servers["g1-1"] = g._server("g1-1").start()
    await wait_until(lambda: g.is_role("g1-1", "standby"), 60, "g1-1 to join as a standby")
    tokens.append(await _granted_within(g.servers["g1-0"].address, g.app, name))
    _rising(name, tokens)
    assert epoch_of(tokens[-1]) == 43, format_token(tokens[-1])
    st = await _status(g.servers["g1-0"])
    assert st["shard"]["below_floor"] == 0 and st["shard"]["unadopted"] == 0, st["shard"]
    g.servers["g1-0"].kill()  # its standby, promoted, goes above it too
    await wait_until(lambda: g.is_role("g1-1", "primary"), 60, "g1's standby to be promoted")
    tokens.append(await _granted_within(g.servers["g1-1"].address, g.app, name))
    _rising(name, tokens)


async def test_force_adoption_without_the_lost_groups_epoch_goes_above_the_maps_floor(groups_of):
    """A real move to g1 while g1's standby is detached (it misses the import); then g1's primary
    and g0 (the source, at epoch 41) are killed for good.  The promoted standby answers the name
    Unavailable; ``fastlock shard adopt --force`` with no ``--above-epoch`` (nobody told it g0's
    epoch) reads the slot's floor from the map and goes above it.  The code before took the
    highest epoch of the nodes that answered (g1's standby at 3) and granted the name at 4/1,
    below g0's 41."""
    g = await groups_of((1, 2), relayed=("g1-0",), **HIGH)
    name = names_owned_by(g.shard_map, "g0", 1, "forcefloor")[0]
    slot = slot_of(name)
    relay = g.relays["g1-0"]
    await wait_until(lambda: asyncio.to_thread(relay.count, "replication"), 30,
                     "g1's standby to replicate through the relay")
    tokens = [await _granted_on_g0(g, name)]
    relay.blackhole("replication")
    relay.cut("replication")  # detached: its attempts to attach again are held
    await g.move(slot, "g1")
    g.servers["g1-0"].kill()
    g.servers["g0-0"].kill()
    await wait_until(lambda: g.is_role("g1-1", "primary"), 60, "g1's standby to be promoted")
    await _refused_on(g, "g1-1", name, slot, tokens)
    assert await shard(["shard", "adopt", "--coordinator", g.url, "--slots", str(slot), "--force"]) == 0
    tokens.append(await _granted_within(g.servers["g1-1"].address, g.app, name))
    _rising(name, tokens)
    assert epoch_of(tokens[-1]) > 41, format_token(tokens[-1])


async def test_a_static_map_file_with_a_floor_is_served_above_it_from_an_empty_data_directory(tmp_path):
    """A node of group b started on an empty data directory with a map file whose range of b carries
    a token floor of epoch 41 (a move's flip recorded it): it grants that range's names at epoch 42
    at once, and after a restart above its own tokens.  The code before did not load the file."""
    port = free_port()
    floor = make_token(41, 7)
    plain = {"epoch": 3, "groups": [{"name": "a", "addresses": [f"127.0.0.1:{free_port()}"]},
                                    {"name": "b", "addresses": [f"127.0.0.1:{port}"]}],
             "ranges": [{"first": 0, "last": 8191, "group": "a"},
                        {"first": 8192, "last": SLOTS - 1, "group": "b", "floor": floor, "floor_epoch": 3}]}
    name = names_owned_by(ShardMap(1, (ShardGroup("a", ("h:1",)), ShardGroup("b", ("h:2",))), even_ranges(["a", "b"])),
                          "b", 1, "staticfloor")[0]
    path = tmp_path / "map.json"
    path.write_text(json.dumps(plain))
    server = ServerProcess(tmp_path / "b", fsync="never", port=port,
                           args=["--shard-map", str(path), "--shard-group", "b"])
    try:
        server.start()
        tokens = [floor, await _granted_within(server.address, None, name)]
        assert epoch_of(tokens[-1]) == 42, format_token(tokens[-1])
        server.stop()
        server.start()
        tokens.append(await _granted_within(server.address, None, name))
        _rising(name, tokens)
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()


async def test_a_static_map_file_flipped_between_restarts_is_not_served_until_adopted(tmp_path):
    """A node of group b with a static map file, restarted with a file marking a slot of a
    moving to b, then with its flip (no import in between): it answers the slot's names
    Unavailable (the code before granted them at b's epoch 1), and ``fastlock shard adopt --server
    NODE --force --above-epoch 41`` lets it grant them at epoch 42."""
    port = free_port()
    first = ShardMap(1, (ShardGroup("a", (f"127.0.0.1:{free_port()}",)), ShardGroup("b", (f"127.0.0.1:{port}",))),
                     even_ranges(["a", "b"]))
    name = names_owned_by(first, "a", 1, "static")[0]
    slot = slot_of(name)
    marked = mark_moving(first, slot, slot, "b")
    path = tmp_path / "map.json"
    server = ServerProcess(tmp_path / "b", fsync="never", port=port,
                           args=["--shard-map", str(path), "--shard-group", "b"])
    try:
        for shard_map in (first, marked, finish_move(marked, slot, slot, "b")):
            write_map_file(path, shard_map)
            if server.proc is not None:
                server.stop()
            server.start()
        _refused_for_its_floor(await _acquire_on(server.address, None, name), slot)
        assert (await _status(server))["shard"]["unadopted"] == 1
        argv = ["shard", "adopt", "--server", server.address, "--slots", str(slot), "--force", "--above-epoch", "41"]
        assert await shard(argv) == 0
        got = await _acquire_on(server.address, None, name)
        assert isinstance(got, int) and epoch_of(got) == 42, got
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()


async def test_a_standby_that_joins_after_a_flip_by_hand_learns_the_slot_is_unadopted(groups_of):
    """g1's second node starts on an empty data directory after the slot was flipped to g1 by
    hand: the first map it serves by already gives g1 the slot, so only its primary's log can
    tell it the slot has no floor (SLOTS_UNADOPTED, logged again after the snapshot it joins by).
    Promoted after g1's primary is killed, it answers the name Unavailable (the code before
    granted it at g1's epoch, below g0's 41)."""
    g = await groups_of((1, 2), later=("g1-1",), **HIGH)
    name = names_owned_by(g.shard_map, "g0", 1, "joinlate")[0]
    slot = slot_of(name)
    tokens = [await _granted_on_g0(g, name)]
    epoch = await _mark_and_flip_by_hand(g, slot, ("g0-0", "g1-0"))
    g.servers["g1-1"] = g._server("g1-1").start()
    await wait_until(lambda: g.is_role("g1-1", "standby"), 60, "g1-1 to join as a standby")
    assert await g.serves_epoch("g1-1", epoch)
    await wait_until(lambda: _unadopted(g, "g1-1"), 30, "g1-1 to learn the slot is unadopted")
    g.servers["g1-0"].kill()
    await wait_until(lambda: g.is_role("g1-1", "primary"), 60, "g1's standby to be promoted")
    await _refused_on(g, "g1-1", name, slot, tokens)


async def _unadopted(g, node: str) -> bool:
    st = await _status(g.servers[node])
    return st is not None and st["shard"]["unadopted"] == 1


async def test_a_destination_standby_that_missed_a_moves_import_refuses_the_moved_slot_once_promoted(groups_of):
    """A real move (the driver's export and import) to g1 while g1's standby is detached from its
    primary (its replication link black-holed, then cut and held over the move): the import is
    answered without it, and it sees the mark and the flip in etcd but never the SLOTS_ADOPTED
    record.  g1's primary is then SIGKILLed and the standby promoted: it holds neither the moved
    lease nor the slot's token floor, so it answers the moved name Unavailable instead of granting
    it beside the moved lease's holder (the code before granted it, 11/1 while 1/1 was held)."""
    g = await groups_of((1, 2), relayed=("g1-0",))
    name = names_owned_by(g.shard_map, "g0", 1, "missedimport")[0]
    slot = slot_of(name)
    relay = g.relays["g1-0"]
    await wait_until(lambda: asyncio.to_thread(relay.count, "replication"), 30,
                     "g1's standby to replicate through the relay")
    async with fastlock.connect(g.servers["g0-0"].address, token=g.app, session=False) as client:
        lease = await client.acquire(name, ttl=60)
        tokens = [lease.fencing_token]
        relay.blackhole("replication")
        relay.cut("replication")  # detached: its attempts to attach again are held
        await g.move(slot, "g1")
        g.servers["g1-0"].kill()
        await wait_until(lambda: g.is_role("g1-1", "primary"), 60, "g1's standby to be promoted")
        await _refused_on(g, "g1-1", name, slot, tokens)  # not granted beside the moved lease
        st = await _status(g.servers["g1-1"])
        assert [slot, slot] in st["shard"]["unadopted_slots"], st["shard"]
