"""Slot moves on the shard map: marking a range moving, flipping it, and which map changes a node takes.

A move of slots ``first..last`` from their owner ``S`` to group ``G`` changes the map twice
(each an epoch + 1, written by an etcd transaction, :mod:`fastlock.coordination.shardmap`):

1. :func:`mark_moving`: the range is still ``S``'s, with ``moving_to = G`` and the new epoch as
   its ``marked_epoch`` (``G`` refuses state exported before it).  ``S`` stops
   serving its names (requests for them are held, :mod:`fastlock.server.sharded`) while its
   state is shipped to ``G`` (:mod:`fastlock.server.slotmove`).
2. :func:`finish_move`: the range is ``G``'s, ``moving_to`` cleared (adjacent ranges of one
   owner and floor merged), with the token floor the move shipped (``S``'s high-water mark) and
   the new epoch recorded on it (:class:`~fastlock.sharding.shardmap.SlotRange`: ``G``'s tokens
   for those names stay above it whatever its log holds).  ``S`` answers ``WrongShard`` naming ``G``.

:func:`abort_move` clears ``moving_to`` with ``S`` still the owner.  :func:`allowed_change` is
the rule a node applies to a newer map: per slot, owner and ``moving_to`` may stay, be marked,
be cleared, or flip to the group it was moving to; any other change of owner is refused (a slot
changes owner only by a move, else the new owner would grant names the old one still holds),
except of a slot the node's group neither owns nor is moving to in the new map: a node always
lets a slot go (it stops granting its names; a node of the source that missed a move's mark
takes its flip, else it would keep serving the slot with the old map, and grant its names
beside the destination, with tokens that may be below the destination's).
"""

from __future__ import annotations

from typing import NamedTuple

from .shardmap import ShardMap, ShardMapError, SlotRange
from .slots import SLOTS

__all__ = ["MoveState", "mark_moving", "finish_move", "abort_move", "record_floor", "move_state", "allowed_change",
           "parse_slots", "split_half"]


class MoveState(NamedTuple):
    """Where a move of ``first..last`` to ``to`` stands in a map: ``step`` is ``"start"`` (no
    slot of it marked yet), ``"moving"`` (all marked moving to ``to``) or ``"done"`` (all owned
    by ``to``); ``source`` the owner before the move (None once done)."""

    first: int
    last: int
    to: str
    step: str
    source: str | None


def parse_slots(text: str) -> tuple[int, int]:
    """``"A"`` or ``"A-B"`` (0 <= A <= B <= 16383) as ``(first, last)``.  :raises ShardMapError: not so."""
    first_text, dash, last_text = text.partition("-")
    try:
        first = int(first_text)
        last = int(last_text) if dash else first
    except ValueError:
        raise ShardMapError(f"slots are A or A-B (0..{SLOTS - 1}), not {text!r:.100}") from None
    if not 0 <= first <= last < SLOTS:
        raise ShardMapError(f"slots are A or A-B with 0 <= A <= B <= {SLOTS - 1}, not {text!r:.100}")
    return first, last


#: one slot's place in a map: its owner, the group a move is moving it to (or None), its token
#: floor and the map epoch that floor was recorded at (or None, None), the map epoch of the mark (or None)
_Slot = tuple[str, str | None, int | None, int | None, int | None]


def _per_slot(shard_map: ShardMap) -> list[_Slot]:
    out: list[_Slot] = []
    for r in shard_map.ranges:
        out.extend([(r.group, r.moving_to, r.floor, r.floor_epoch, r.marked_epoch)] * (r.last - r.first + 1))
    return out


def _ranges(per_slot: list[_Slot]) -> tuple[SlotRange, ...]:
    ranges: list[SlotRange] = []
    start = 0
    for slot in range(1, SLOTS + 1):
        if slot == SLOTS or per_slot[slot] != per_slot[start]:
            ranges.append(SlotRange(start, slot - 1, *per_slot[start]))
            start = slot
    return tuple(ranges)


def move_state(shard_map: ShardMap, first: int, last: int, to: str) -> MoveState:
    """Where the move of ``first..last`` to group ``to`` stands in ``shard_map``.

    :raises ShardMapError: no group ``to``; the slots have several owners, or are moving
        elsewhere, or part are moved and part not (a move of other slots overlaps).
    """
    shard_map.group(to)
    slots = [(s[0], s[1]) for s in _per_slot(shard_map)[first:last + 1]]
    states = set(slots)
    if states == {(to, None)}:
        return MoveState(first, last, to, "done", None)
    if len(states) != 1:
        raise ShardMapError(f"slots {first}..{last} have several owners or moves in the map (epoch "
                            f"{shard_map.epoch}): {sorted(states, key=str)[:4]}; move one owner's slots at a time")
    owner, moving_to = slots[0]
    if moving_to is None:
        return MoveState(first, last, to, "start", owner)
    if moving_to != to:
        raise ShardMapError(f"slots {first}..{last} are being moved to {moving_to}, not {to}: finish or abort "
                            f"that move first")
    return MoveState(first, last, to, "moving", owner)


def _changed(shard_map: ShardMap, first: int, last: int, owner: str, moving_to: str | None,
             floor: int | None = None, keep_floor: bool = True) -> ShardMap:
    """The next map (epoch + 1): ``first..last`` owned by ``owner``, moving to ``moving_to`` (marked
    at the new epoch: its ``marked_epoch``); each slot keeps its token floor (``keep_floor``) or
    gets ``floor`` recorded at the new epoch (None: no floor)."""
    epoch = shard_map.epoch + 1
    marked = None if moving_to is None else epoch
    slots = _per_slot(shard_map)
    for slot in range(first, last + 1):
        had, had_at = slots[slot][2], slots[slot][3]
        if keep_floor:
            slots[slot] = (owner, moving_to, had, had_at, marked)
        else:
            slots[slot] = (owner, moving_to, floor, None if floor is None else epoch, marked)
    return ShardMap(epoch, shard_map.groups, _ranges(slots))


def mark_moving(shard_map: ShardMap, first: int, last: int, to: str) -> ShardMap:
    """The next map (epoch + 1): ``first..last`` marked moving to ``to``.

    :raises ShardMapError: the move cannot start (see :func:`move_state`; or ``to`` owns them)."""
    state = move_state(shard_map, first, last, to)
    if state.step != "start":
        raise ShardMapError(f"slots {first}..{last}: the move to {to} is {state.step} already")
    assert state.source is not None
    return _changed(shard_map, first, last, state.source, to)


def finish_move(shard_map: ShardMap, first: int, last: int, to: str, floor: int | None = None) -> ShardMap:
    """The next map (epoch + 1): ``first..last`` owned by ``to``, no longer moving, with ``floor``
    (a fencing token: the source's high-water mark the move shipped) as their token floor,
    recorded at the new epoch; None: no floor (the range asks nothing of its new owner's tokens).

    :raises ShardMapError: they are not marked moving to ``to``, or ``floor`` is not a valid floor."""
    if move_state(shard_map, first, last, to).step != "moving":
        raise ShardMapError(f"slots {first}..{last} are not marked moving to {to}")
    return _changed(shard_map, first, last, to, None, floor, keep_floor=False)


def abort_move(shard_map: ShardMap, first: int, last: int, to: str) -> ShardMap:
    """The next map (epoch + 1): ``first..last`` no longer moving, still their owner's.

    :raises ShardMapError: they are not marked moving to ``to``."""
    state = move_state(shard_map, first, last, to)
    if state.step != "moving":
        raise ShardMapError(f"slots {first}..{last} are not marked moving to {to}")
    assert state.source is not None
    return _changed(shard_map, first, last, state.source, None)


def record_floor(shard_map: ShardMap, first: int, last: int, owner: str, floor: int) -> ShardMap | None:
    """The next map (epoch + 1) with ``floor`` (a fencing token) recorded, at the new epoch, as the
    token floor of each of slots ``first..last`` whose floor is lower or absent (``fastlock shard
    adopt`` records the floor its owner adopted, so that the group's nodes stay above it whatever
    their logs hold); owners and moves unchanged.  None: every slot has that floor or a higher one.

    :raises ShardMapError: a slot is not ``owner``'s any more, or ``floor`` is not a valid floor."""
    epoch = shard_map.epoch + 1
    slots = _per_slot(shard_map)
    changed = False
    for slot in range(first, last + 1):
        group, moving_to, had, had_at, marked = slots[slot]
        if group != owner:
            raise ShardMapError(f"slot {slot} is owned by {group} in the shard map (epoch {shard_map.epoch}), not "
                                f"{owner}: its floor is not recorded")
        if had is None or had < floor:
            slots[slot] = (group, moving_to, floor, epoch, marked)
            changed = True
    return ShardMap(epoch, shard_map.groups, _ranges(slots)) if changed else None


def allowed_change(old: ShardMap, new: ShardMap, imported: bytes = b"", group: str | None = None) -> str | None:
    """None if a node may go from ``old`` to ``new`` (see the module docstring), else why not.
    ``imported``: a table of :data:`SLOTS` bytes, 1 at each slot whose state this node's group
    imported (a node that missed the map marking the move may take the flip of those).
    ``group``: the node's group; a slot this group neither owns nor is moving to in ``new`` may
    change in any way (the node grants it not in that map: a bystander, or the source, that
    missed a move's mark takes its flip)."""
    if old.ranges == new.ranges:
        return None
    # judged run by run: the slots between two consecutive range starts of either map share
    # their owner and moving_to in each map
    starts = sorted({r.first for r in old.ranges} | {r.first for r in new.ranges})
    for k, first in enumerate(starts):
        last = starts[k + 1] - 1 if k + 1 < len(starts) else SLOTS - 1
        was = (old.owner_of_slot(first).name, old.moving_to_of_slot(first))
        now = (new.owner_of_slot(first).name, new.moving_to_of_slot(first))
        if was == now:
            continue
        (owner, moving_to), (new_owner, new_moving_to) = was, now
        if new_owner == owner and (moving_to is None or new_moving_to is None):
            continue  # marked, or aborted
        if moving_to is not None and new_owner == moving_to and new_moving_to is None:
            continue  # the flip of a move
        if group is not None and group not in (new_owner, new_moving_to):
            continue  # this node grants none of them in the new map: a slot is always let go
        slot = first
        if imported and new_moving_to is None and moving_to is None:
            # the flip of a move whose mark this node did not see: every slot of the run imported
            missing = imported.find(0, first, last + 1)
            if missing < 0:
                continue
            slot = missing
        return (f"slot {slot} goes from {owner} (moving to {moving_to}) to {new_owner} (moving to {new_moving_to}): "
                f"a slot changes owner only by a move (fastlock shard move)")
    return None


def split_half(shard_map: ShardMap, group: str) -> tuple[int, int]:
    """The upper half of the largest range ``group`` owns (``fastlock shard split``): ``(first, last)``.

    :raises ShardMapError: ``group`` owns no range of two slots or more."""
    ranges = [r for r in shard_map.ranges if r.group == group and r.moving_to is None and r.last > r.first]
    if not ranges:
        raise ShardMapError(f"group {group} owns no range of two slots or more to split")
    r = max(ranges, key=lambda r: r.last - r.first)
    return (r.first + r.last + 1) // 2, r.last
