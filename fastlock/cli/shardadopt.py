"""``fastlock shard adopt``: give slots their token floor on the group that owns them
(docs/runbooks/shard-adopt.md).

A group serves the names of a slot it gained by a map change only once it holds the slot's
token floor: a move's import brings it (SLOTS_ADOPTED).  A mark and its flip written without
the import (by hand, or by a driver that stopped between them and was not run again) leave
the slot *unadopted* on its new owner: its names are answered ``Unavailable``
(:meth:`fastlock.server.sharded.ShardGate.not_adopted`).  :func:`adopt_slots` sets the floor
on the owner's primary (``SLOT_ADOPT``, :mod:`fastlock.server.slotmove`), from:

- ``--from GROUP``, the group that served the slots before: its primary's last fencing token
  (every token it ever issued is at most that);
- ``--force``, when that group is lost for good: a token of an epoch above every epoch known,
  the highest of ``--above-epoch`` and the epochs of every node of the map that answers (as
  ``serve-alone`` steps its epoch above what it has seen).  Tokens the lost group issued at a
  higher epoch than any of those can still be above the new owner's: give ``--above-epoch`` at
  least that group's highest epoch (its etcd key ``PREFIX/epoch``, or ``max_epoch_seen`` in its
  nodes' ``node-state.json``).

Either way the floor is at least the one the map records for the slots (a move's flip records the
source's high-water mark on the range it gives, :class:`~fastlock.sharding.shardmap.SlotRange`),
and with ``--force`` an epoch above that floor's: the owner may have issued tokens at the epoch it
adopted with that move's import, and its nodes that knew them may be the ones lost.
"""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

from ..client import Client
from ..client.calls import call
from ..errors import FastlockError
from ..protocol.ops import OP_SLOT_ADOPT, OP_STATUS
from ..sharding import ShardMap, ShardMapError
from ..tokens import MAX_EPOCH, epoch_of, make_token
from ..units import parse_address
from .admin import admin_request

__all__ = ["AdoptReport", "adopt_slots", "map_floor", "ASK_TIMEOUT_S"]

#: seconds to wait for each node's status (``--force``) and for the owner's answer
ASK_TIMEOUT_S = 10.0


class AdoptReport(NamedTuple):
    """What :func:`adopt_slots` did: the slots, their owner group, the floor adopted (a fencing
    token), where it came from (``"group NAME"`` or ``"epoch N"``), the owner's epoch after it,
    and how many of the slots were owned without a floor before."""

    first: int
    last: int
    owner: str
    floor: int
    source: str
    epoch: int
    adopted: int


def _owner_of(shard_map: ShardMap, first: int, last: int) -> str:
    """The one group owning slots ``first..last``, none of them being moved.

    :raises ShardMapError: several owners, or a move under way."""
    owners = {shard_map.owner_of_slot(s).name for s in range(first, last + 1)}
    if len(owners) != 1 or any(shard_map.moving_to_of_slot(s) is not None for s in range(first, last + 1)):
        raise ShardMapError(f"slots {first}..{last} are not owned by one group with no move under way (shard map "
                            f"epoch {shard_map.epoch}): adopt one owner's slots at a time, after the move ends")
    return owners.pop()


def map_floor(shard_map: ShardMap, first: int, last: int) -> int | None:
    """The highest token floor ``shard_map`` records for slots ``first..last`` (a fencing token), or None."""
    floors = [r.floor for r in shard_map.ranges if r.floor is not None and r.first <= last and r.last >= first]
    return max(floors) if floors else None


async def _highest_epoch(shard_map: ShardMap, token: str | None) -> int:
    """The highest epoch (``status``'s) of every node of the map that answers within :data:`ASK_TIMEOUT_S`."""
    async def ask(address: str) -> int:
        try:
            st = await asyncio.to_thread(admin_request, parse_address(address, default_port=None), token, OP_STATUS,
                                         reply_timeout=ASK_TIMEOUT_S, connect_timeout=ASK_TIMEOUT_S)
        except (OSError, TimeoutError, FastlockError):
            return 0
        epoch = st.get("epoch") if isinstance(st, dict) else None
        return epoch if type(epoch) is int else 0

    addresses = [a for g in shard_map.groups for a in g.addresses]
    return max([0, *await asyncio.gather(*(ask(a) for a in addresses))])


async def adopt_slots(shard_map: ShardMap, first: int, last: int, *, source: str | None, force: bool,
                      above_epoch: int = 0, token: str | None = None, progress: Any = None) -> AdoptReport:
    """Give slots ``first..last`` their token floor on their owner's primary (module docstring):
    from group ``source``'s last token, or (``force``) an epoch above ``above_epoch`` and every
    node's epoch; ``token``: the admin credential for the nodes' status; ``progress(text)`` is
    told each step.

    :raises ShardMapError: the slots have no one owner, ``source`` is not another group of the map,
        or neither ``source`` nor ``force`` is given.
    :raises FastlockError: a node's refusal (the owner's primary: not an admin, not the primary).
    """
    def tell(text: str) -> None:
        if progress is not None:
            progress(text)

    owner = _owner_of(shard_map, first, last)
    recorded = map_floor(shard_map, first, last)
    if source is not None:
        shard_map.group(source)  # raises ShardMapError if absent
        if source == owner:
            raise ShardMapError(f"slots {first}..{last} are owned by {owner}: --from names the group that served them "
                                f"before")
        client = Client(list(shard_map.group(source).addresses), client_name="fastlock-shard-adopt")
        try:
            st = await call(client.connector, OP_STATUS, (), ASK_TIMEOUT_S)
        finally:
            await client.close()
        floor = st["last_token"]
        if above_epoch:
            floor = max(floor, make_token(min(above_epoch + 1, MAX_EPOCH), 0))
        origin = f"group {source}"
        tell(f"group {source}'s primary issued tokens up to {floor}")
        if recorded is not None and recorded > floor:
            floor = recorded
            origin = f"the shard map's floor (epoch {shard_map.epoch})"
            tell(f"the shard map records the token floor {recorded} for these slots, above it: that is the floor")
    elif force:
        known = max(above_epoch, await _highest_epoch(shard_map, token),
                    epoch_of(recorded) if recorded is not None else 0)
        epoch = min(known + 1, MAX_EPOCH)
        floor = make_token(epoch, 0)
        origin = f"epoch {epoch}"
        if recorded is not None:
            tell(f"the shard map records the token floor {recorded} (epoch {epoch_of(recorded)}) for these slots")
        tell(f"the highest epoch known is {epoch - 1}: the floor is epoch {epoch}")
    else:
        raise ShardMapError("give --from GROUP (the group that served the slots before) or, if it is lost, --force")
    client = Client(list(shard_map.group(owner).addresses), client_name="fastlock-shard-adopt")
    try:
        reply = await call(client.connector, OP_SLOT_ADOPT, (first, last, floor), ASK_TIMEOUT_S * 2)
    finally:
        await client.close()
    return AdoptReport(first, last, owner, floor, origin, reply["epoch"], reply["adopted"])
