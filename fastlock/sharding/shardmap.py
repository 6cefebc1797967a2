"""The shard map: which group of servers owns which slot range (:mod:`fastlock.sharding.slots`).

A :class:`ShardMap` is a named record: its ``epoch`` (rises with every change, so a
node or a client keeps the newer of two maps), its groups (:class:`ShardGroup`: a
name and the ``host:port`` addresses of the group's nodes, its primary and
standbys, as :func:`fastlock.connect` takes them) and its slot ranges
(:class:`SlotRange`: ``first..last`` inclusive, owned by one group).  A valid map
covers every slot exactly once with ranges in slot order, names every group a range
names, and stays within :data:`MAX_GROUPS`, :data:`MAX_ADDRESSES` and
:data:`MAX_RANGES`.  A group may own no range (a group added before any slot is
assigned to it).

The same plain form travels over the wire (the ``SHARD_MAP`` op), is written to a
static map file (JSON, or TOML when the file name ends in ``.toml``) and is kept in
etcd::

    {"epoch": 1,
     "groups": [{"name": "a", "addresses": ["127.0.0.1:7420"]},
                {"name": "b", "addresses": ["127.0.0.1:7421"]}],
     "ranges": [{"first": 0, "last": 8191, "group": "a"},
                {"first": 8192, "last": 16383, "group": "b"}]}

A range a move gave its owner carries the move's token floor: ``"floor"``, the source's
fencing-token high-water mark when it shipped the slots (every token the source issued for
their names is at most that), and ``"floor_epoch"``, the map epoch of the flip that recorded
it.  A node serving the range issues tokens above its floor, whatever its log holds (it may
start on an empty data directory); a range without a floor (an initial assignment) asks
nothing.  Maps without floors (written before floors existed) load as they are.  A range
marked ``moving_to`` also carries ``"marked_epoch"``, the map epoch of the mark (a destination
refuses a page exported before it, though its watch skipped an abort in between).

Finding a slot's owner is a binary search over the ranges' first slots (O(log n)).
"""

from __future__ import annotations

import bisect
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..errors import InvalidArgument, WrongArgumentType
from ..tokens import MAX_EPOCH
from ..units import parse_address
from .slots import SLOTS, slot_of

__all__ = ["ShardMap", "ShardGroup", "SlotRange", "ShardMapError", "load_map_file", "write_map_file",
           "even_ranges", "MAX_GROUPS", "MAX_ADDRESSES", "MAX_RANGES", "MAX_FLOOR"]

#: the most groups one map names
MAX_GROUPS = 1024
#: the most addresses one group lists (its primary and standbys)
MAX_ADDRESSES = 16
#: the most slot ranges of one map (one per slot at most)
MAX_RANGES = SLOTS
#: the longest group name (characters); a name is letters, digits, ``.``, ``_`` and ``-``
MAX_GROUP_NAME_CHARS = 64
#: the longest address (characters)
MAX_ADDRESS_CHARS = 300
#: the largest map epoch (below 2**63, as fencing epochs)
MAX_MAP_EPOCH = (1 << 63) - 1
#: the largest token floor of a range: a fencing token of an epoch below the last (a node raising its
#: tokens above it needs the epoch after it at most)
MAX_FLOOR = (MAX_EPOCH << 40) - 1
#: the largest map file read (bytes)
MAX_MAP_FILE_BYTES = 16 << 20

_GROUP_NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_GROUP_NAME_CHARS}}}\Z")


class ShardMapError(InvalidArgument):
    """A shard map (a file, a ``SHARD_MAP`` reply, etcd's value) is not a valid map:
    the message names what is wrong.  A ``ValueError``."""


class ShardGroup(NamedTuple):
    """One group: its ``name`` and the ``host:port`` addresses of its nodes."""

    name: str
    addresses: tuple[str, ...]


class SlotRange(NamedTuple):
    """Slots ``first`` to ``last`` (inclusive, 0..16383), owned by the group named ``group``;
    ``moving_to``: the group a slot move (``fastlock shard move``) is moving them to, None
    when no move is under way (:mod:`fastlock.sharding.moves`); ``floor``: the fencing-token
    floor the move that gave ``group`` these slots recorded (the source's high-water mark: every
    token issued for their names before is at most it; None: no move gave them, nothing is asked),
    ``floor_epoch``: the map epoch of that move's flip (None exactly when ``floor`` is);
    ``marked_epoch``: the map epoch of the mark that set ``moving_to`` (None without a move, or in
    a map marked by a mover from before it was recorded)."""

    first: int
    last: int
    group: str
    moving_to: str | None = None
    floor: int | None = None
    floor_epoch: int | None = None
    marked_epoch: int | None = None


@dataclass(frozen=True)
class ShardMap:
    """A validated shard map (see the module docstring).

    :raises ShardMapError: the map is not valid (at construction).
    """

    epoch: int
    groups: tuple[ShardGroup, ...]
    ranges: tuple[SlotRange, ...]
    _starts: list[int] = field(init=False, repr=False, compare=False)
    _by_name: dict[str, ShardGroup] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            by_name = _check_groups(self.epoch, self.groups)
            _check_ranges(self.ranges, by_name, self.epoch)
        except ShardMapError:
            raise
        except ValueError:  # a refusal naming an int of more digits than Python turns into text
            raise ShardMapError("a shard map holds an integer of more digits than can be read") from None
        object.__setattr__(self, "_starts", [r.first for r in self.ranges])
        object.__setattr__(self, "_by_name", by_name)

    # -- lookups ----------------------------------------------------------------------
    def owner_of_slot(self, slot: int) -> ShardGroup:
        """The group that owns ``slot`` (0..16383), by binary search over the ranges."""
        return self._by_name[self.ranges[bisect.bisect_right(self._starts, slot) - 1].group]

    def owner(self, name: str) -> ShardGroup:
        """The group that owns the lock, key or semaphore ``name`` (its :func:`slot_of`)."""
        return self.owner_of_slot(slot_of(name))

    def group(self, name: str) -> ShardGroup:
        """The group named ``name``.  :raises ShardMapError: no such group."""
        try:
            return self._by_name[name]
        except KeyError:
            raise ShardMapError(f"the shard map (epoch {self.epoch}) has no group {name!r}") from None

    def slots_of(self, group: str) -> bytes:
        """A table of :data:`SLOTS` bytes: 1 at each slot ``group`` owns, 0 elsewhere."""
        table = bytearray(SLOTS)
        for r in self.ranges:
            if r.group == group:
                table[r.first:r.last + 1] = b"\x01" * (r.last - r.first + 1)
        return bytes(table)

    def moving_slots_of(self, group: str) -> bytes:
        """A table of :data:`SLOTS` bytes: 1 at each slot ``group`` owns that a move is
        moving away (its range's ``moving_to`` is set), 0 elsewhere."""
        table = bytearray(SLOTS)
        for r in self.ranges:
            if r.group == group and r.moving_to is not None:
                table[r.first:r.last + 1] = b"\x01" * (r.last - r.first + 1)
        return bytes(table)

    def moving_to_of_slot(self, slot: int) -> str | None:
        """The group a move is moving ``slot`` to, or None."""
        return self.ranges[bisect.bisect_right(self._starts, slot) - 1].moving_to

    def floor_of_slot(self, slot: int) -> int | None:
        """The token floor the map records for ``slot`` (a fencing token), or None."""
        return self.ranges[bisect.bisect_right(self._starts, slot) - 1].floor

    def marked_epoch_of(self, first: int, last: int) -> int:
        """The latest ``marked_epoch`` of the ranges holding slots ``first..last`` (0: none recorded)."""
        return max([r.marked_epoch for r in self.ranges
                    if r.marked_epoch is not None and r.first <= last and r.last >= first], default=0)

    def floors_of(self, group: str) -> list[tuple[int, int, int]]:
        """The ranges ``group`` owns that carry a token floor, as ``(first, last, floor)``."""
        return [(r.first, r.last, r.floor) for r in self.ranges if r.group == group and r.floor is not None]

    def slot_count(self, group: str) -> int:
        """How many slots ``group`` owns."""
        return sum(r.last - r.first + 1 for r in self.ranges if r.group == group)

    # -- the plain form ------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        """The plain form (msgpack and JSON encode it as it is)."""
        return {"epoch": self.epoch,
                "groups": [{"name": g.name, "addresses": list(g.addresses)} for g in self.groups],
                "ranges": [_range_wire(r) for r in self.ranges]}

    @classmethod
    def from_wire(cls, value: Any) -> ShardMap:
        """The map of a plain form (:meth:`to_wire`'s).  :raises ShardMapError: not a valid map."""
        if not isinstance(value, dict) or set(value) != {"epoch", "groups", "ranges"}:
            raise ShardMapError("a shard map is an object with exactly: epoch, groups, ranges")
        groups, ranges = value["groups"], value["ranges"]
        if not isinstance(groups, list) or not 0 < len(groups) <= MAX_GROUPS:
            raise ShardMapError(f"a shard map's groups are a list of 1 to {MAX_GROUPS} groups")
        if not isinstance(ranges, list) or not 0 < len(ranges) <= MAX_RANGES:
            raise ShardMapError(f"a shard map's ranges are a list of 1 to {MAX_RANGES} ranges")
        parsed_groups = []
        for g in groups:
            if not isinstance(g, dict) or set(g) != {"name", "addresses"} or not isinstance(g["addresses"], list):
                raise ShardMapError(f"a group is an object with exactly: name, addresses (a list); not {g!r:.200}")
            parsed_groups.append(ShardGroup(g["name"], tuple(g["addresses"])))
        parsed_ranges = []
        for r in ranges:
            if not isinstance(r, dict) or not {"first", "last", "group"} <= set(r) <= _RANGE_KEYS:
                raise ShardMapError(f"a range is an object with: first, last, group (and moving_to, marked_epoch "
                                    f"while a move is under way, floor and floor_epoch once a move gave it); not "
                                    f"{r!r:.200}")
            parsed_ranges.append(SlotRange(r["first"], r["last"], r["group"], r.get("moving_to"), r.get("floor"),
                                           r.get("floor_epoch"), r.get("marked_epoch")))
        return cls(value["epoch"], tuple(parsed_groups), tuple(parsed_ranges))

    def with_epoch(self, epoch: int) -> ShardMap:
        """This map at ``epoch``."""
        return ShardMap(epoch, self.groups, self.ranges)

    def with_addresses(self, group: str, addresses: tuple[str, ...]) -> ShardMap:
        """The next map (epoch + 1): group ``group``'s addresses replaced, or a new group (owning
        no slot yet) added.  No slot changes owner.  :raises ShardMapError: an invalid result."""
        groups = tuple(ShardGroup(g.name, addresses) if g.name == group else g for g in self.groups)
        if group not in self._by_name:
            groups += (ShardGroup(group, addresses),)
        return ShardMap(self.epoch + 1, groups, self.ranges)


#: the keys of a range's plain form (``moving_to`` only while a move is under way, ``floor`` and
#: ``floor_epoch`` only once a move gave the range)
_RANGE_KEYS = {"first", "last", "group", "moving_to", "floor", "floor_epoch", "marked_epoch"}


def _range_wire(r: SlotRange) -> dict[str, Any]:
    """A range's plain form; ``moving_to``, ``marked_epoch``, ``floor`` and ``floor_epoch`` are
    written only when set, so a map no move changed is the same JSON every earlier fastlock wrote
    and reads."""
    wire: dict[str, Any] = {"first": r.first, "last": r.last, "group": r.group}
    if r.moving_to is not None:
        wire["moving_to"] = r.moving_to
    if r.marked_epoch is not None:
        wire["marked_epoch"] = r.marked_epoch
    if r.floor is not None:
        wire["floor"] = r.floor
        wire["floor_epoch"] = r.floor_epoch
    return wire


def _check_groups(epoch: Any, groups: Any) -> dict[str, ShardGroup]:
    if type(epoch) is not int or not 1 <= epoch <= MAX_MAP_EPOCH:
        raise ShardMapError(f"a shard map's epoch is an int, 1 <= epoch < 2**63, not {epoch!r:.100}")
    if type(groups) is not tuple or not 0 < len(groups) <= MAX_GROUPS:
        raise ShardMapError(f"a shard map names 1 to {MAX_GROUPS} groups")
    by_name: dict[str, ShardGroup] = {}
    for g in groups:
        if not isinstance(g, ShardGroup):
            raise ShardMapError(f"a group is a ShardGroup, not {g!r:.200}")
        if type(g.name) is not str or not _GROUP_NAME.match(g.name):
            raise ShardMapError(f"a group name is 1 to {MAX_GROUP_NAME_CHARS} letters, digits, '.', '_' "
                                f"or '-', not {g.name!r:.100}")
        if g.name in by_name:
            raise ShardMapError(f"group {g.name!r} is named twice")
        if type(g.addresses) is not tuple or not 0 < len(g.addresses) <= MAX_ADDRESSES:
            raise ShardMapError(f"group {g.name!r} lists 1 to {MAX_ADDRESSES} addresses")
        for a in g.addresses:
            if type(a) is not str or not 0 < len(a) <= MAX_ADDRESS_CHARS or not _is_address(a):
                raise ShardMapError(f"group {g.name!r}: an address is 'host:port' (port 1-65535), not {a!r:.100}")
        by_name[g.name] = g
    return by_name


def _is_address(text: str) -> bool:
    """Whether ``text`` is ``host:port`` (or ``[IPv6]:port``) with a port 1-65535, as ``connect`` takes it."""
    try:
        parse_address(text, default_port=None)
    except (InvalidArgument, WrongArgumentType):
        return False
    return True


def _check_ranges(ranges: Any, by_name: dict[str, ShardGroup], epoch: int) -> None:
    if type(ranges) is not tuple or not 0 < len(ranges) <= MAX_RANGES:
        raise ShardMapError(f"a shard map has 1 to {MAX_RANGES} slot ranges")
    expected = 0
    for r in ranges:
        if not isinstance(r, SlotRange) or type(r.first) is not int or type(r.last) is not int:
            raise ShardMapError(f"a slot range is first, last (ints) and a group, not {r!r:.200}")
        if r.first != expected:
            what = ("overlaps the one before it" if r.first < expected
                    else f"leaves slots {expected}..{r.first - 1} unowned")
            raise ShardMapError(f"slot range {r.first}..{r.last} {what} (ranges go in slot order, each "
                                f"beginning where the last ended)")
        if not r.first <= r.last < SLOTS:
            raise ShardMapError(f"slot range {r.first}..{r.last}: first <= last <= {SLOTS - 1}")
        if type(r.group) is not str or r.group not in by_name:
            raise ShardMapError(f"slot range {r.first}..{r.last} names no group of the map: {r.group!r:.100}")
        if r.moving_to is not None and (type(r.moving_to) is not str or r.moving_to not in by_name
                                        or r.moving_to == r.group):
            raise ShardMapError(f"slot range {r.first}..{r.last}: moving_to names another group of the map "
                                f"than its owner {r.group!r}, not {r.moving_to!r:.100}")
        if r.floor is not None or r.floor_epoch is not None:
            _check_floor(r, epoch)
        if r.marked_epoch is not None and (r.moving_to is None or type(r.marked_epoch) is not int
                                           or not 1 <= r.marked_epoch <= epoch):
            raise ShardMapError(f"slot range {r.first}..{r.last}: marked_epoch is the map epoch of the mark of a move "
                                f"under way (with moving_to), an int 1..{epoch} (the map's epoch); not "
                                f"{r.marked_epoch!r:.100}")
        expected = r.last + 1
    if expected != SLOTS:
        raise ShardMapError(f"slots {expected}..{SLOTS - 1} are owned by no group (a map covers 0..{SLOTS - 1})")


def _check_floor(r: SlotRange, epoch: int) -> None:
    """A range's token floor: a fencing token 0..:data:`MAX_FLOOR` (its epoch below the last) with
    ``floor_epoch``, the map epoch of the flip that recorded it, 1..``epoch`` (the map's)."""
    floor, floor_epoch = r.floor, r.floor_epoch
    if type(floor) is not int or not 0 <= floor <= MAX_FLOOR:
        raise ShardMapError(f"slot range {r.first}..{r.last}: floor is a fencing token, an int 0..{MAX_FLOOR} (its "
                            f"epoch below {MAX_EPOCH}), given with floor_epoch; not {floor!r:.100}")
    if type(floor_epoch) is not int or not 1 <= floor_epoch <= epoch:
        raise ShardMapError(f"slot range {r.first}..{r.last}: floor_epoch is the map epoch of the flip that recorded "
                            f"its floor, an int 1..{epoch} (the map's epoch), given with floor; not "
                            f"{floor_epoch!r:.100}")


def even_ranges(groups: list[str] | tuple[str, ...]) -> tuple[SlotRange, ...]:
    """The slots split into one contiguous range per group, in order, as evenly as can be."""
    n = len(groups)
    if not 0 < n <= MAX_GROUPS:
        raise ShardMapError(f"1 to {MAX_GROUPS} groups, not {n}")
    return tuple(SlotRange(SLOTS * k // n, SLOTS * (k + 1) // n - 1, g) for k, g in enumerate(groups))


def load_map_file(path: str | os.PathLike[str]) -> ShardMap:
    """The map in file ``path``: JSON, or TOML when its name ends in ``.toml``
    (the plain form, with ``[[groups]]`` and ``[[ranges]]`` tables).

    :raises ShardMapError: the file is not a valid map (or larger than 16 MiB).
    :raises OSError: it cannot be read.
    """
    with open(path, "rb") as f:
        data = f.read(MAX_MAP_FILE_BYTES + 1)
    if len(data) > MAX_MAP_FILE_BYTES:
        raise ShardMapError(f"{path}: a shard map file is at most {MAX_MAP_FILE_BYTES} bytes")
    try:
        if os.fspath(path).endswith(".toml"):
            import tomllib

            value = tomllib.loads(data.decode("utf-8"))
        else:
            value = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError; RecursionError: nested too deep
        raise ShardMapError(f"{path}: not a shard map file: {exc}") from None
    try:
        return ShardMap.from_wire(value)
    except ShardMapError as exc:
        raise ShardMapError(f"{path}: {exc}") from None


def write_map_file(path: str | os.PathLike[str], shard_map: ShardMap) -> None:
    """Write ``shard_map`` to ``path`` as JSON (through a temporary file and a rename)."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(shard_map.to_wire(), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
