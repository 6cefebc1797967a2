"""Slots and the shard map (fastlock.sharding): the slot rule, the map's validation, lookups, files."""

from __future__ import annotations

import json
from binascii import crc_hqx

import msgpack
import pytest

from fastlock import protocol as P
from fastlock.errors import CrossShard, WrongShard, error_from_wire
from fastlock.sharding import (
    SLOTS,
    ShardGroup,
    ShardMap,
    ShardMapError,
    SlotRange,
    even_ranges,
    hash_tag,
    load_map_file,
    slot_of,
    write_map_file,
)
from fastlock.sharding.scope import NAMES_OF_OP, NamesAt, names_in


def two_groups(epoch: int = 1) -> ShardMap:
    return ShardMap(epoch, (ShardGroup("a", ("127.0.0.1:7420",)), ShardGroup("b", ("127.0.0.1:7421", "h:1"))),
                    (SlotRange(0, 8191, "a"), SlotRange(8192, SLOTS - 1, "b")))


# -- the slot rule -------------------------------------------------------------------------------

def test_slots_agree_with_redis_cluster_documented_values():
    # Redis Cluster specification, appendix A: CRC16 (XMODEM) of "123456789" is 0x31C3 (12739 mod 16384)
    assert slot_of("123456789") == 0x31C3 % SLOTS
    # Redis's CLUSTER KEYSLOT documentation: "somekey" is slot 11058, "foo{hash_tag}" slot 2515
    assert slot_of("somekey") == 11058
    assert slot_of("foo{hash_tag}") == 2515
    assert slot_of("bar{hash_tag}") == 2515


def test_hash_tags_follow_redis_cluster_rules():
    # the specification's examples: the first '{' and the first '}' after it
    assert slot_of("{user1000}.following") == slot_of("{user1000}.followers") == slot_of("user1000")
    assert hash_tag("foo{}{bar}") is None  # an empty tag: the whole name is hashed
    assert slot_of("foo{}{bar}") == crc_hqx(b"foo{}{bar}", 0) % SLOTS != slot_of("bar")
    assert hash_tag("foo{{bar}}zap") == "{bar"
    assert hash_tag("foo{bar}{zap}") == "bar"
    assert hash_tag("no tag {here") is None
    assert all(0 <= slot_of(f"lock-{i}") < SLOTS for i in range(2000))


def test_non_ascii_names_hash_their_utf8_bytes():
    assert slot_of("é") == slot_of("{é}x")
    assert 0 <= slot_of("\udcff") < SLOTS  # a lone surrogate (msgpack can carry one) still has a slot


# -- the map ----------------------------------------------------------------------------------

def test_lookups_find_each_slots_owner():
    m = two_groups()
    assert m.owner_of_slot(0).name == "a" and m.owner_of_slot(8191).name == "a"
    assert m.owner_of_slot(8192).name == "b" and m.owner_of_slot(SLOTS - 1).name == "b"
    assert m.owner("somekey").name == "b"  # slot 11058
    assert m.owner("foo{hash_tag}").name == "a"  # slot 2515
    assert m.slot_count("a") == 8192 and m.slots_of("b")[8192] == 1 and m.slots_of("b")[8191] == 0
    assert m.group("b").addresses == ("127.0.0.1:7421", "h:1")
    with pytest.raises(ShardMapError, match="no group 'c'"):
        m.group("c")


def test_even_ranges_cover_every_slot():
    for n in (1, 2, 3, 7):
        ranges = even_ranges([f"g{k}" for k in range(n)])
        m = ShardMap(1, tuple(ShardGroup(f"g{k}", ("127.0.0.1:1",)) for k in range(n)), ranges)
        assert sum(m.slot_count(f"g{k}") for k in range(n)) == SLOTS


@pytest.mark.parametrize("ranges, match", [
    ((SlotRange(0, 8191, "a"),), "slots 8192..16383 are owned by no group"),
    ((SlotRange(0, 8191, "a"), SlotRange(8000, SLOTS - 1, "b")), "overlaps"),
    ((SlotRange(0, 100, "a"), SlotRange(200, SLOTS - 1, "b")), "leaves slots 101..199 unowned"),
    ((SlotRange(0, SLOTS, "a"),), "first <= last"),
    ((SlotRange(0, SLOTS - 1, "c"),), "names no group"),
    ((SlotRange(1, SLOTS - 1, "a"),), "leaves slots 0..0 unowned"),
    ((SlotRange(0, 5.5, "a"),), "first, last"),
    ((), "1 to"),
])
def test_invalid_ranges_are_refused_with_the_reason(ranges, match):
    with pytest.raises(ShardMapError, match=match):
        ShardMap(1, (ShardGroup("a", ("h:1",)), ShardGroup("b", ("h:2",))), ranges)


@pytest.mark.parametrize("epoch, groups, match", [
    (0, (ShardGroup("a", ("h:1",)),), "epoch"),
    (True, (ShardGroup("a", ("h:1",)),), "epoch"),
    (1, (ShardGroup("a", ("h:1",)), ShardGroup("a", ("h:2",))), "named twice"),
    (1, (ShardGroup("a b", ("h:1",)),), "group name"),
    (1, (ShardGroup("a", ()),), "1 to 16 addresses"),
    (1, (ShardGroup("a", ("nohostport",)),), "host:port"),
    (1, (ShardGroup("a", ("h:1",) * 17),), "1 to 16 addresses"),
    (1, tuple(ShardGroup(f"g{i}", ("h:1",)) for i in range(1025)), "1 to 1024 groups"),
])
def test_invalid_groups_are_refused(epoch, groups, match):
    with pytest.raises(ShardMapError, match=match):
        ShardMap(epoch, groups, (SlotRange(0, SLOTS - 1, groups[0].name),))


def test_the_plain_form_round_trips_and_bad_forms_are_refused():
    m = two_groups(7)
    assert ShardMap.from_wire(m.to_wire()) == m
    assert ShardMap.from_wire(msgpack.unpackb(P.packb(m.to_wire()))) == m
    for bad in (None, [], {"epoch": 1}, {**m.to_wire(), "extra": 1}, {**m.to_wire(), "groups": "a"},
                {**m.to_wire(), "ranges": [[0, SLOTS - 1, "a"]]},
                {**m.to_wire(), "groups": [{"name": "a", "addresses": "h:1"}]}):
        with pytest.raises(ShardMapError):
            ShardMap.from_wire(bad)


def test_map_files_json_and_toml(tmp_path):
    m = two_groups(3)
    write_map_file(tmp_path / "map.json", m)
    assert load_map_file(tmp_path / "map.json") == m
    (tmp_path / "map.toml").write_text(
        'epoch = 3\n'
        '[[groups]]\nname = "a"\naddresses = ["127.0.0.1:7420"]\n'
        '[[groups]]\nname = "b"\naddresses = ["127.0.0.1:7421", "h:1"]\n'
        '[[ranges]]\nfirst = 0\nlast = 8191\ngroup = "a"\n'
        '[[ranges]]\nfirst = 8192\nlast = 16383\ngroup = "b"\n')
    assert load_map_file(tmp_path / "map.toml") == m
    (tmp_path / "bad.json").write_text(json.dumps({**m.to_wire(), "epoch": -1}))
    with pytest.raises(ShardMapError, match="bad.json: .*epoch"):
        load_map_file(tmp_path / "bad.json")
    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(ShardMapError, match="not a shard map file"):
        load_map_file(tmp_path / "garbage.json")


# -- where ops carry names, and the errors ------------------------------------------------------

def test_every_op_says_where_its_names_are():
    """A new op must be classified in NAMES_OF_OP, or a sharded node could serve a name it does not own."""
    assert set(NAMES_OF_OP) == set(P.OP_ARITY)


def test_names_in_reads_names_and_rows_and_skips_other_types():
    assert list(names_in(NamesAt(names=(0, 2)), ["k", b"v", None, b"t"])) == ["k"]
    assert list(names_in(NamesAt(names=(0, 2)), ["k", b"v", "lease"])) == ["k", "lease"]
    assert list(names_in(NamesAt(rows=(0,)), [[["a", False], ["b", True], [1], []], b"o"])) == ["a", "b"]
    assert list(names_in(NamesAt(rows=(1, 2)), [b"s", "not a list"])) == []


def test_sharding_errors_carry_their_redirect_over_the_wire():
    exc = WrongShard("moved", 11058, "b", ("127.0.0.1:7421",), 4)
    back = error_from_wire(exc.code, str(exc), msgpack.unpackb(P.packb(exc.wire_extra())))
    assert isinstance(back, WrongShard) and back.code == 60
    assert (back.slot, back.group, back.addresses, back.epoch) == (11058, "b", ("127.0.0.1:7421",), 4)
    cross = error_from_wire(CrossShard.code, "spans", {"groups": ["a", "b"], "epoch": 2})
    assert isinstance(cross, CrossShard) and isinstance(cross, ValueError) and cross.code == 61
    assert cross.groups == ("a", "b") and cross.epoch == 2
    # a malformed extra from a peer gives the error without the bad fields
    odd = error_from_wire(WrongShard.code, "moved", {"slot": "x", "addresses": [1], "group": None})
    assert isinstance(odd, WrongShard) and odd.slot is None and odd.addresses == () and odd.group is None
    assert isinstance(error_from_wire(WrongShard.code, "moved", [1, 2]), WrongShard)


def test_with_addresses_replaces_a_group_or_adds_one_and_moves_no_slot():
    m = two_groups(3)
    changed = m.with_addresses("b", ("127.0.0.1:9",))
    assert changed.epoch == 4 and changed.group("b").addresses == ("127.0.0.1:9",) and changed.ranges == m.ranges
    added = m.with_addresses("c", ("127.0.0.1:10",))
    assert [g.name for g in added.groups] == ["a", "b", "c"] and added.slot_count("c") == 0
    with pytest.raises(ShardMapError, match="host:port"):
        m.with_addresses("b", ("nowhere",))


def test_a_sharded_node_refuses_to_start_with_an_op_it_cannot_check():
    """A new op missing from NAMES_OF_OP stops a sharded node at start, never runs unchecked."""
    from types import SimpleNamespace

    from fastlock.server.sharded import ShardGate

    gate = ShardGate(two_groups(), "a")
    handlers = SimpleNamespace(by_op={P.OP_PING: (print, 0, 0), 199: (print, 0, 0)})
    with pytest.raises(RuntimeError, match=r"ops \[199\] are not in"):
        gate.install(handlers)
    calls = []
    handlers = SimpleNamespace(by_op={P.OP_HOLDER: (lambda conn, req_id, msg: calls.append(msg), 1, 1),
                                      P.OP_PING: (print, 0, 0)})
    gate.install(handlers)
    assert handlers.by_op[P.OP_PING][0] is print  # an op that names no name is left as it was
    mine = next(f"x{i}" for i in range(1000) if gate.shard_map.owner(f"x{i}").name == "a")
    theirs = next(f"x{i}" for i in range(1000) if gate.shard_map.owner(f"x{i}").name == "b")
    handlers.by_op[P.OP_HOLDER][0](None, 1, [1, P.OP_HOLDER, mine])
    with pytest.raises(WrongShard):
        handlers.by_op[P.OP_HOLDER][0](None, 2, [2, P.OP_HOLDER, theirs])
    assert calls == [[1, P.OP_HOLDER, mine]]


def test_a_newer_map_is_applied_and_an_older_or_foreign_one_is_not():
    from fastlock.server.sharded import ShardGate

    gate = ShardGate(two_groups(2), "a")
    gate.offer(two_groups(1))
    assert gate.shard_map.epoch == 2
    gate.offer(two_groups(3).with_addresses("b", ("127.0.0.1:1",)))
    assert gate.shard_map.epoch == 4 and gate.info() == {"group": "a", "epoch": 4, "slots": 8192,
                                                                 "moving": 0, "held": 0, "unadopted": 0,
                                                                 "unadopted_slots": [], "below_floor": 0,
                                                                 "imported_held": 0}
    gate.offer(ShardMap(9, (ShardGroup("z", ("h:1",)),), (SlotRange(0, SLOTS - 1, "z"),)))  # names no "a"
    assert gate.shard_map.epoch == 4
    # slots that change owner without a move: refused
    gate.offer(ShardMap(10, gate.shard_map.groups, (SlotRange(0, 99, "b"), SlotRange(100, SLOTS - 1, "a"))))
    assert gate.shard_map.epoch == 4 and gate.owned[0] == 1
    # a map that only takes slots from "a" (a move's flip its node read without the mark): taken, they are let go
    gate.offer(ShardMap(11, gate.shard_map.groups,
                        (SlotRange(0, 99, "b"), SlotRange(100, 8191, "a"), SlotRange(8192, SLOTS - 1, "b"))))
    assert gate.shard_map.epoch == 11 and gate.owned[0] == 0 and gate.owned[100] == 1


def test_a_slot_gained_by_a_flip_without_its_import_is_answered_unavailable_until_adopted(tmp_path):
    """A mark and its flip with no import between them: the gate takes the map, but a name of
    the gained slot is answered Unavailable (the slot has no token floor here) until a
    SLOTS_ADOPTED record of it arrives, and the data directory keeps that across a restart; a
    slot imported before its flip is served at once, and one lost again needs its floor again."""
    from fastlock.errors import Unavailable
    from fastlock.server.sharded import ShardGate
    from fastlock.sharding.moves import finish_move, mark_moving
    from fastlock.wal.records import SlotsAdopted

    def name_in(slot: int) -> str:
        return next(f"x{i}" for i in range(100_000) if slot_of(f"x{i}") == slot)

    gate = ShardGate(two_groups(), "b")
    gate.remember(tmp_path)
    marked = mark_moving(two_groups(), 0, 1, "b")
    gate.offer(marked)
    gate.imported[1] = 1  # slot 1's state was imported (SLOTS_ADOPTED), slot 0's not
    flipped = finish_move(marked, 0, 1, "b")
    gate.offer(flipped)
    assert gate.shard_map.epoch == flipped.epoch and gate.owned[0] == gate.owned[1] == 1
    with pytest.raises(Unavailable, match=r"slot 0, which shard group b gained .* `fastlock shard adopt"):
        gate.check_name(name_in(0))
    with pytest.raises(Unavailable):
        gate.check_names(NamesAt(lists=(0,)), [[name_in(0), name_in(1)]])
    assert gate.refusal([name_in(0)]) is not None
    assert gate.check_name(name_in(1)) == -1  # imported: served
    assert gate.info()["unadopted"] == 1 and gate.info()["unadopted_slots"] == [[0, 0]]

    again = ShardGate(flipped, "b")  # a restart with the same map: still unadopted
    again.remember(tmp_path)
    again.restore_imports(None)
    with pytest.raises(Unavailable):
        again.check_name(name_in(0))
    again.adopted_by_log(SlotsAdopted(0, 0, 5 << 40, 5, [], 0))  # its primary adopted the floor
    assert again.check_name(name_in(0)) == -1 and again.info()["unadopted"] == 0
    assert json.loads((tmp_path / "unadopted-slots.json").read_text()) == []

    gate.offer(finish_move(mark_moving(gate.shard_map, 0, 0, "a"), 0, 0, "a").with_epoch(flipped.epoch + 2))
    assert gate.owned[0] == 0 and gate.unadopted[0] == 0  # gone: a later gain needs its floor again


def test_a_node_started_with_a_flip_that_came_while_it_was_down_adopts_only_imported_slots(tmp_path):
    """A node that last served the mark and starts with the flip: a gained slot whose import its
    recovery finds is served; one without is answered Unavailable."""
    from fastlock.errors import Unavailable
    from fastlock.server.sharded import ShardGate
    from fastlock.sharding.moves import finish_move, mark_moving
    from fastlock.wal.records import ImportedSlots

    marked = mark_moving(two_groups(), 0, 1, "b")
    before = ShardGate(marked, "b")
    before.remember(tmp_path)
    gate = ShardGate(finish_move(marked, 0, 1, "b"), "b")
    gate.remember(tmp_path)
    gate.restore_imports(ImportedSlots([1], {}))
    with pytest.raises(Unavailable):
        gate.check_name(next(f"x{i}" for i in range(100_000) if slot_of(f"x{i}") == 0))
    assert gate.check_name(next(f"x{i}" for i in range(100_000) if slot_of(f"x{i}") == 1)) == -1


def _one_group(**changes) -> dict:
    value = {"epoch": 1, "groups": [{"name": "a", "addresses": ["127.0.0.1:7420"]}],
             "ranges": [{"first": 0, "last": SLOTS - 1, "group": "a"}]}
    return {**value, **changes}


@pytest.mark.parametrize("value, match", [
    (_one_group(ranges=[{"first": 0, "last": SLOTS - 1, "group": ["a"]}]), "names no group"),
    (_one_group(ranges=[{"first": 0, "last": SLOTS - 1, "group": {"a": 1}}]), "names no group"),
    (_one_group(groups=[{"name": "a", "addresses": ["x:y"]}]), "host:port"),
    (_one_group(groups=[{"name": "a", "addresses": ["127.0.0.1:70000"]}]), "host:port"),
    (_one_group(groups=[{"name": "a", "addresses": ["127.0.0.1:0"]}]), "host:port"),
])
def test_wrong_types_and_ports_in_a_map_are_refused_as_shard_map_errors(value, match):
    """From a file, a SHARD_MAP reply or etcd: a ShardMapError naming the fault, never a TypeError."""
    with pytest.raises(ShardMapError, match=match):
        ShardMap.from_wire(value)


def test_a_map_file_nested_too_deep_is_refused_as_a_shard_map_error(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ShardMapError, match="deep.json: not a shard map file"):
        load_map_file(tmp_path / "deep.json")


@pytest.mark.parametrize("body", [json.dumps(_one_group(ranges=[{"first": 0, "last": SLOTS - 1, "group": ["a"]}])),
                                  "[" * 100_000 + "]" * 100_000,
                                  json.dumps(_one_group(ranges=[{"first": 0, "last": SLOTS - 1, "group": "a",
                                                                 "floor": 5, "floor_epoch": 2}]))],
                         ids=["unhashable-group", "deep", "floor-of-a-later-epoch"])
def test_serve_refuses_a_bad_map_file_with_exit_1_and_the_reason(tmp_path, body):
    from fastlock._testbase.servers import ServerProcess

    (tmp_path / "map.json").write_text(body)
    server = ServerProcess(tmp_path / "data", fsync="never",
                           args=["--shard-map", str(tmp_path / "map.json"), "--shard-group", "a"])
    with pytest.raises(RuntimeError):
        server.start(timeout=20)
    assert server.stop() == 1
    assert any("cannot start: " in line for line in server.lines)
    assert not any("Traceback" in line for line in server.lines)


# -- slot moves on the map (fastlock.sharding.moves) -----------------------------------------------

def test_a_move_marks_then_flips_a_range_and_each_map_round_trips():
    from fastlock.sharding.moves import abort_move, finish_move, mark_moving, move_state

    m = two_groups()
    assert "moving_to" not in json.dumps(m.to_wire())  # a map with no move is the plain form every node reads
    marked = mark_moving(m, 100, 199, "b")
    assert marked.epoch == 2 and marked.moving_slots_of("a")[100:200] == b"\x01" * 100
    assert marked.owner_of_slot(150).name == "a" and marked.moving_to_of_slot(150) == "b"
    assert ShardMap.from_wire(json.loads(json.dumps(marked.to_wire()))) == marked
    assert move_state(marked, 100, 199, "b").step == "moving"
    flipped = finish_move(marked, 100, 199, "b")
    assert flipped.epoch == 3 and flipped.owner_of_slot(150).name == "b" and flipped.slot_count("b") == 8292
    assert move_state(flipped, 100, 199, "b").step == "done"
    assert abort_move(marked, 100, 199, "b").ranges == m.ranges
    with pytest.raises(ShardMapError):
        mark_moving(marked, 100, 199, "b")  # marked already
    with pytest.raises(ShardMapError):
        mark_moving(m, 8000, 8300, "b")  # two owners
    with pytest.raises(ShardMapError):
        finish_move(m, 100, 199, "b")  # never marked
    with pytest.raises(ShardMapError):
        mark_moving(m, 100, 199, "nope")


def test_a_map_with_a_bad_moving_to_is_refused():
    wire = two_groups().to_wire()
    for bad in ("a", "nope", 7, ""):  # its own owner, no such group, not a name
        wire["ranges"][0]["moving_to"] = bad
        with pytest.raises(ShardMapError):
            ShardMap.from_wire(wire)
    wire["ranges"][0] = {"first": 0, "last": 8191, "group": "a", "extra": 1}
    with pytest.raises(ShardMapError):
        ShardMap.from_wire(wire)


def test_a_flip_records_the_moves_token_floor_on_the_range_and_later_marks_keep_it(tmp_path):
    """finish_move records the floor the move shipped (a fencing token) and the flip's epoch on the
    range it gives; a later mark and an abort keep it; a later flip replaces it; the plain form,
    JSON and TOML files carry it; a map no move changed has no floor (the JSON earlier versions wrote)."""
    from fastlock.sharding.moves import abort_move, finish_move, mark_moving
    from fastlock.tokens import make_token

    m = two_groups()
    assert "floor" not in json.dumps(m.to_wire()) and m.floors_of("b") == []
    floor = make_token(41, 7)
    flipped = finish_move(mark_moving(m, 100, 199, "b"), 100, 199, "b", floor)
    assert flipped.epoch == 3 and flipped.floor_of_slot(150) == floor and flipped.floor_of_slot(99) is None
    assert flipped.floors_of("b") == [(100, 199, floor)] and flipped.floors_of("a") == []
    assert flipped.ranges[1] == SlotRange(100, 199, "b", None, floor, 3)
    assert ShardMap.from_wire(json.loads(json.dumps(flipped.to_wire()))) == flipped
    write_map_file(tmp_path / "map.json", flipped)
    assert load_map_file(tmp_path / "map.json") == flipped
    (tmp_path / "map.toml").write_text(
        'epoch = 3\n[[groups]]\nname = "a"\naddresses = ["127.0.0.1:7420"]\n'
        '[[groups]]\nname = "b"\naddresses = ["127.0.0.1:7421"]\n'
        f'[[ranges]]\nfirst = 0\nlast = 8191\ngroup = "a"\n'
        f'[[ranges]]\nfirst = 8192\nlast = {SLOTS - 1}\ngroup = "b"\nfloor = {floor}\nfloor_epoch = 2\n')
    assert load_map_file(tmp_path / "map.toml").floors_of("b") == [(8192, SLOTS - 1, floor)]
    marked = mark_moving(flipped, 150, 199, "a")  # half of it moves on: both halves keep the floor
    assert marked.floor_of_slot(120) == marked.floor_of_slot(160) == floor
    assert abort_move(marked, 150, 199, "a").ranges == flipped.ranges
    back = finish_move(marked, 150, 199, "a", make_token(41, 9))
    assert back.floor_of_slot(160) == make_token(41, 9) and back.ranges[2].floor_epoch == 5
    assert back.floor_of_slot(120) == floor
    plain = finish_move(mark_moving(m, 100, 199, "b"), 100, 199, "b")  # no floor given: none recorded
    assert plain.floor_of_slot(150) is None and "floor" not in json.dumps(plain.to_wire())


@pytest.mark.parametrize("floor, floor_epoch, match", [
    (-1, 1, "floor is a fencing token"),
    (True, 1, "floor is a fencing token"),
    ("5", 1, "floor is a fencing token"),
    (1.5, 1, "floor is a fencing token"),
    (1 << 63, 1, "floor is a fencing token"),
    ((((1 << 23) - 1) << 40), 1, "floor is a fencing token"),  # of the last epoch: no epoch left above it
    (5, None, "floor_epoch is the map epoch"),
    (None, 1, "floor is a fencing token"),
    (5, 0, "floor_epoch is the map epoch"),
    (5, 2, "floor_epoch is the map epoch"),  # later than the map itself
    (5, "1", "floor_epoch is the map epoch"),
])
def test_a_map_with_a_bad_token_floor_is_refused_with_the_reason(floor, floor_epoch, match):
    """A floor comes from etcd, a file or a node's reply: untrusted; a bad one refuses the whole map."""
    wire = two_groups().to_wire()
    wire["ranges"][1] = {**wire["ranges"][1], "floor": floor, "floor_epoch": floor_epoch}
    if floor is None:
        del wire["ranges"][1]["floor"]
    if floor_epoch is None:
        del wire["ranges"][1]["floor_epoch"]
    with pytest.raises(ShardMapError, match=match):
        ShardMap.from_wire(wire)
    largest = two_groups().to_wire()
    largest["ranges"][1] |= {"floor": (((1 << 23) - 1) << 40) - 1, "floor_epoch": 1}  # the last epoch's eve: valid
    assert ShardMap.from_wire(largest).floor_of_slot(SLOTS - 1) == (((1 << 23) - 1) << 40) - 1


def test_a_mark_records_its_epoch_on_the_range_and_a_bad_one_is_refused():
    """mark_moving records the mark's map epoch (``marked_epoch``) beside ``moving_to``; the
    flip and the abort clear it; a marked_epoch without moving_to, or not 1..the map's epoch, is
    refused; a mark without one (an earlier mover's) still loads."""
    from fastlock.sharding.moves import abort_move, finish_move, mark_moving

    marked = mark_moving(two_groups(), 100, 199, "b")
    assert marked.ranges[1] == SlotRange(100, 199, "a", "b", None, None, 2) and marked.marked_epoch_of(150, 150) == 2
    assert marked.marked_epoch_of(0, 99) == 0
    assert ShardMap.from_wire(json.loads(json.dumps(marked.to_wire()))) == marked
    assert abort_move(marked, 100, 199, "b").marked_epoch_of(0, SLOTS - 1) == 0
    assert finish_move(marked, 100, 199, "b").marked_epoch_of(0, SLOTS - 1) == 0
    older = marked.to_wire()
    del older["ranges"][1]["marked_epoch"]
    assert ShardMap.from_wire(older).moving_to_of_slot(150) == "b"
    for r, bad in ((0, 1), (1, 3), (1, 0), (1, True), (1, "2")):  # range 0 is not moving; epoch 3 is after the map's
        wire = marked.to_wire()
        wire["ranges"][r]["marked_epoch"] = bad
        with pytest.raises(ShardMapError, match="marked_epoch is the map epoch of the mark"):
            ShardMap.from_wire(wire)


def test_a_node_takes_a_slot_only_by_a_move():
    from fastlock.sharding import SlotRange as R
    from fastlock.sharding.moves import allowed_change, finish_move, mark_moving, parse_slots, split_half

    m = two_groups()
    marked = mark_moving(m, 0, 9, "b")
    flipped = finish_move(marked, 0, 9, "b")
    assert allowed_change(m, marked) is None and allowed_change(marked, flipped) is None
    assert allowed_change(marked, m.with_epoch(3)) is None  # an abort
    by_hand = ShardMap(2, m.groups, (R(0, 9, "b"), R(10, 8191, "a"), R(8192, SLOTS - 1, "b")))
    assert "only by a move" in allowed_change(m, by_hand)
    imported = bytearray(SLOTS)
    imported[0:10] = b"\x01" * 10
    assert allowed_change(m, by_hand, bytes(imported)) is None  # a destination that missed the mark
    # a bystander (group c, owning none of them) that missed the mark of a move between a and b takes the flip
    three = ShardMap(1, (*m.groups, ShardGroup("c", ("127.0.0.1:7422",))),
                     (R(0, 8191, "a"), R(8192, 12287, "b"), R(12288, SLOTS - 1, "c")))
    flip_only = finish_move(mark_moving(three, 0, 9, "b"), 0, 9, "b")
    assert allowed_change(three, flip_only, group="c") is None
    assert "only by a move" in allowed_change(three, flip_only, group="b")  # the new owner did not import
    assert allowed_change(three, flip_only, group="a") is None  # the source that missed the mark lets them go
    assert "only by a move" in allowed_change(three, flip_only)  # judged for no group: a change of owner
    assert parse_slots("5") == (5, 5) and parse_slots("5-9") == (5, 9)
    for bad in ("9-5", "x", "-1", "16384"):
        with pytest.raises(ShardMapError):
            parse_slots(bad)
    assert split_half(m, "a") == (4096, 8191)


def test_a_gate_freezes_marked_slots_and_redirects_after_the_flip():
    from fastlock.server.sharded import ShardGate
    from fastlock.sharding.moves import finish_move, mark_moving

    gate = ShardGate(two_groups(), "a")
    name = next(f"x{i}" for i in range(1000) if gate.shard_map.owner(f"x{i}").name == "a")
    slot = slot_of(name)
    assert gate.check_name(name) == -1
    marked = mark_moving(gate.shard_map, slot, slot, "b")
    gate.offer(marked)
    assert gate.check_name(name) == slot  # to be held
    gate.offer(finish_move(marked, slot, slot, "b"))
    with pytest.raises(WrongShard) as caught:
        gate.check_name(name)
    assert caught.value.group == "b"


def test_a_gate_takes_a_gain_only_for_slots_its_log_says_were_imported():
    # a map giving group b a slot of a without a move b's node saw is refused, whatever the node's role
    # (a standby too); once the node applies its primary's SLOTS_ADOPTED record of that slot, the
    # refused map is offered again and taken, and the record's queue is kept for the flip
    from fastlock.server.sharded import ShardGate
    from fastlock.sharding.moves import finish_move, mark_moving
    from fastlock.wal.records import SlotsAdopted, apply, decode, encode

    gate = ShardGate(two_groups(), "b")
    name = next(f"x{i}" for i in range(1000) if gate.shard_map.owner(f"x{i}").name == "a")
    slot = slot_of(name)
    flipped = finish_move(mark_moving(gate.shard_map, slot, slot, "b"), slot, slot, "b")
    gain = ShardMap(2, flipped.groups, flipped.ranges)  # the flip alone: the mark never seen
    gate.offer(gain)
    assert gate.shard_map.epoch == 1 and gate.refused is gain
    with pytest.raises(WrongShard):
        gate.check_name(name)
    other = (slot + 1) % SLOTS if gate.shard_map.owner_of_slot((slot + 1) % SLOTS).name == "a" else slot - 1
    record = decode(encode(SlotsAdopted(other, other, 5 << 40, 5, [], 0)))
    gate.adopted_by_log(record)  # another slot's import: the map stays refused
    assert gate.shard_map.epoch == 1 and gate.refused is gain
    record = decode(encode(SlotsAdopted(slot, slot, (5 << 40) | 7, 5, [[name, [b"o1", b"o2", b"o1"]], ["y", [b"o"]]],
                                        0)))
    assert record.kind == 81 and record.queues == [[name, [b"o1", b"o2", b"o1"]], ["y", [b"o"]]]
    gate.refused = None
    gate.adopted_by_log(record)
    assert gate.imported[slot] and gate.imported_queues == {name: [b"o1", b"o2"]}  # names outside the slots skipped
    gate.offer(gain)
    assert gate.shard_map.epoch == 2 and gate.check_name(name) == -1 and not gate.imported[slot]
    gate = ShardGate(two_groups(), "b")
    gate.offer(gain)
    gate.adopted_by_log(record)  # the import arrives after the map: the refused map is taken then
    assert gate.shard_map.epoch == 2 and gate.refused is None and gate.check_name(name) == -1
    gate.adopted_by_log(SlotsAdopted(7, 3, 0, 0, [], 0))  # a malformed range changes nothing
    assert not gate.imported[3:8].strip(b"\x00")

    class Target:  # apply: the epoch raised, then the gate's target told
        epoch, told = 2, []

        def raise_epoch(self, epoch):
            self.epoch = epoch

        def adopt_slots(self, r):
            self.told.append(r)

    target = Target()
    assert apply(record, target) and target.epoch == 5 and target.told == [record]


def _allowed_per_slot(old: ShardMap, new: ShardMap, imported: bytes, group: str | None = None) -> int | None:
    """The rule of fastlock.sharding.moves.allowed_change judged slot by slot: the first slot refused, or None."""
    for slot in range(SLOTS):
        owner, moving_to = old.owner_of_slot(slot).name, old.moving_to_of_slot(slot)
        new_owner, new_moving_to = new.owner_of_slot(slot).name, new.moving_to_of_slot(slot)
        if (owner, moving_to) == (new_owner, new_moving_to):
            continue
        if new_owner == owner and (moving_to is None or new_moving_to is None):
            continue
        if moving_to is not None and new_owner == moving_to and new_moving_to is None:
            continue
        if group is not None and group not in (new_owner, new_moving_to):
            continue
        if imported and imported[slot] and new_moving_to is None and moving_to is None:
            continue
        return slot
    return None


def test_map_changes_are_judged_run_by_run_as_slot_by_slot():
    # allowed_change and the gate's freeze/drop/let-in tables work on runs of slots (every node takes
    # each map change on its event loop); random maps and changes agree with the slot-by-slot rule
    import random

    from fastlock.server.sharded import ShardGate
    from fastlock.sharding.moves import allowed_change

    rng = random.Random(30)
    groups = (ShardGroup("a", ("127.0.0.1:7420",)), ShardGroup("b", ("127.0.0.1:7421",)),
              ShardGroup("c", ("127.0.0.1:7422",)))

    def random_map(epoch: int) -> ShardMap:
        cuts = sorted(rng.sample(range(1, SLOTS), rng.randint(0, 6)))
        starts = [0, *cuts]
        ranges = []
        for k, first in enumerate(starts):
            last = starts[k + 1] - 1 if k + 1 < len(starts) else SLOTS - 1
            owner = rng.choice("abc")
            moving_to = rng.choice([None, None, *(g for g in "abc" if g != owner)])
            ranges.append(SlotRange(first, last, owner, moving_to))
        merged: list[SlotRange] = []
        for r in ranges:  # adjacent equal ranges merged, as a valid map has them
            if merged and (merged[-1].group, merged[-1].moving_to) == (r.group, r.moving_to):
                merged[-1] = SlotRange(merged[-1].first, r.last, r.group, r.moving_to)
            else:
                merged.append(r)
        return ShardMap(epoch, groups, tuple(merged))

    refused = 0
    for _ in range(60):
        old = random_map(1)
        new = random_map(2) if rng.random() < 0.5 else ShardMap(2, groups, tuple(
            SlotRange(r.first, r.last, r.moving_to or r.group, None) if rng.random() < 0.7 else r for r in old.ranges))
        imported = bytearray(SLOTS)
        if rng.random() < 0.5:
            a = rng.randrange(SLOTS)
            b = min(SLOTS, a + rng.randint(1, 3000))
            imported[a:b] = b"\x01" * (b - a)
        expected = _allowed_per_slot(old, new, bytes(imported))
        why = allowed_change(old, new, bytes(imported))
        assert (why is None) == (expected is None), (old, new, why, expected)
        if expected is not None:
            refused += 1
            assert why.startswith(f"slot {expected} ")
        expected_a = _allowed_per_slot(old, new, bytes(imported), "a")
        why = allowed_change(old, new, bytes(imported), "a")  # as group a's node judges it
        assert (why is None) == (expected_a is None), (old, new, why, expected_a)
        gate = ShardGate(old, "a")
        gate.imported[:] = imported
        gate.offer(new)
        if why is None:  # taken: the gate's tables are the new map's
            assert gate.shard_map is new and gate.owned == new.slots_of("a") and gate.moving == new.moving_slots_of("a")
            assert all(not gate.imported[s] or gate.owned[s] or new.moving_to_of_slot(s) == "a"
                       for s in range(SLOTS))
        else:
            assert gate.shard_map is old
    assert 0 < refused < 60  # both kinds of change were judged


def test_a_gate_keeps_its_imports_in_snapshots_and_relogs_them_for_a_standby_joining_by_snapshot():
    # what a snapshot keeps (pending_imports) comes back by restore_imports; the records relogged after a
    # standby's snapshot (relog_imports) teach a standby that never saw the import, which then takes the
    # flip whose mark it missed; a restart leaves out what the node served before it (a flip's let-in)
    from fastlock.server.sharded import RELOG_PART, ShardGate
    from fastlock.sharding.moves import finish_move, mark_moving
    from fastlock.wal.records import ImportedSlots, SlotsAdopted

    base = two_groups()
    name = next(f"x{i}" for i in range(1000) if base.owner(f"x{i}").name == "a")
    slot = slot_of(name)
    marked = mark_moving(base, slot, slot, "b")
    flipped = finish_move(marked, slot, slot, "b")
    owners = [bytes([k + 1]) * 16 for k in range(RELOG_PART + 3)]
    primary = ShardGate(marked, "b")
    assert primary.pending_imports() is None
    primary.restore_imports(ImportedSlots([slot], {name: owners}))  # recovered before the flip
    assert primary.imported[slot] and primary.imported_queues == {name: owners}
    assert primary.pending_imports() == ImportedSlots([slot], {name: owners})

    class Wal:
        records: list = []

        def log_slots_adopted(self, first, last, floor, epoch, queues):
            self.records.append(SlotsAdopted(first, last, floor, epoch, queues, 0))

    wal = Wal()
    assert primary.relog_imports(wal, (4 << 40) | 9, 4) == 1
    assert wal.records[0][:4] == (slot, slot, (4 << 40) | 9, 4)
    assert wal.records[0].queues == [[name, owners[:RELOG_PART]], [name, owners[RELOG_PART:]]]
    standby = ShardGate(base, "b")  # joined by a snapshot: its map never showed the mark
    standby.offer(ShardMap(flipped.epoch, flipped.groups, flipped.ranges))
    assert standby.refused is not None and standby.shard_map.epoch == 1
    for record in wal.records:
        standby.adopted_by_log(record)
    assert standby.shard_map.epoch == flipped.epoch and standby.check_name(name) == -1
    # a restart after the flip: the queue is let in only if the map served before the restart did not own the slot
    for owned_before, kept in ((base.slots_of("b"), {name: owners}), (flipped.slots_of("b"), {})):
        again = ShardGate(flipped, "b")
        again.owned_before = owned_before
        again.restore_imports(ImportedSlots([slot], {name: owners}))
        assert again.imported_queues == kept and not again.imported[slot] and not again.undone_at_start
        assert again.pending_imports() is None
    aborted = ShardGate(base, "b")  # the move was aborted while the node was down: the slot's keys go back
    aborted.restore_imports(ImportedSlots([slot], {name: owners}))
    assert aborted.undone_at_start == {slot} and aborted.imported_queues == {}
    assert aborted.pending_imports() == ImportedSlots([slot], {})
