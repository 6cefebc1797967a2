"""A slot move's two ops: SLOT_EXPORT on the source group's primary, SLOT_IMPORT on the destination's.

``fastlock shard move`` (:mod:`fastlock.cli.shardmove`) marks slots ``first..last`` moving to
group ``G`` in the map, then pages the frozen slots' state out of the source with
``SLOT_EXPORT first, last, after`` and into ``G``'s primary with ``SLOT_IMPORT``, then flips
the map.  Both ops need an ``admin`` principal (they are not in the dispatch's permission
table); a client principal gets ``PermissionDenied``.

``SLOT_EXPORT first, last, after`` (the source must serve a map marking ``first..last``
moving, and be the primary): one page (:data:`EXPORT_PAGE` rows at most) of :class:`MovedState`'s
plain form, the rows after the cursor ``after`` (None: from the first; a page names its own):
the leases, the waiter queues in parts (owner-key hashes in FIFO order, as the freeze took them
out), the running lock-delays, and the token high-water mark (the table's last token: every
token the source ever issued is at most that).

``SLOT_IMPORT first, last, state`` (``G`` must serve a map marking ``first..last`` moving to
``G``, and be the primary): ``state`` is a page as msgpack bytes (at most
:data:`MAX_STATE_BYTES`, decoded with small bounds of its own).  Every field is validated
(untrusted input: types, ranges, every name in ``first..last``, at most :data:`EXPORT_PAGE`
rows), then the import raises the
token floor (an ``EPOCH`` record if the source's epoch is higher, a ``RESERVE`` record for the
counter: every token ``G`` issues from then on is above the mark), installs each lease with its
token, owner-key hash and remaining TTL (a ``GRANT`` record each, so ``G``'s standbys and its
recovery have them), each lock-delay (a ``LOCK_DELAY`` record) and keeps the queues for the
flip.  The reply (``{"leases", "delays", "queues"}``: how many) comes once the records are
durable.  Importing the same state twice installs the same leases again: it changes nothing.
Keys (the key store) are not moved: SLOT_EXPORT refuses slots that hold keys
(:class:`SlotsHoldKeys`), and the mover then clears its mark.  Session shares are not moved
(a routing client attaches a moved lease to its session on the new group).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack

from .. import protocol as P
from ..errors import InvalidArgument, NotPrimary, WrongArgumentType
from ..protocol.ops import OP_SLOT_EXPORT, OP_SLOT_IMPORT
from ..roles import Role
from ..sharding import SLOTS, slot_of
from ..tokens import MAX_EPOCH, counter_of, epoch_of
from ..units import monotonic_ms, wall_ms
from .lockadmin import check_lock_admin

if TYPE_CHECKING:  # pragma: no cover
    from .handlers import Handlers
    from .session import Session

__all__ = ["MovedLease", "MovedState", "QueuePart", "SlotMoves", "EXPORT_PAGE", "PERMISSIONS"]

#: the dispatch's permission entries: checked by the handlers (check_lock_admin)
PERMISSIONS: dict[int, str | None] = {OP_SLOT_EXPORT: None, OP_SLOT_IMPORT: None}

log = logging.getLogger(__name__)

#: the most rows (leases, queue parts and lock-delays together) of one SLOT_EXPORT page and SLOT_IMPORT
#: request: at their fields' limits 20 rows stay within a request's 64 KiB frame
EXPORT_PAGE = 20
#: the most waiters of one queue part (a longer queue is shipped in parts, by its offset)
QUEUE_PART = 20
#: the most waiters of one queue a move carries
MAX_MOVED_WAITERS = 100_000
#: the largest SLOT_IMPORT state (bytes of msgpack)
MAX_STATE_BYTES = 60 << 10
#: the longest owner-key hash accepted (bytes)
MAX_OWNER_BYTES = 64
#: the longest remaining TTL or lock-delay accepted (ms): a day
MAX_REMAINING_MS = 86_400_000
#: the longest client name / correlation id kept with an imported lease
MAX_META_CHARS = 256


class MovedLease(NamedTuple):
    """One lease of a moved slot: name, fencing token, owner-key hash, remaining TTL (ms),
    lock-delay (ms), shared, semaphore limit (0: a lock), the recorded client and correlation id."""

    name: str
    token: int
    owner: bytes
    remaining_ms: int
    lock_delay_ms: int
    shared: bool
    limit: int
    client: str | None
    correlation_id: str | None


class QueuePart(NamedTuple):
    """Waiters ``offset`` .. ``offset + len(owners) - 1`` of the queue of ``name`` (owner-key hashes, FIFO)."""

    name: str
    offset: int
    owners: list[bytes]


class MovedState(NamedTuple):
    """One page of a move's state: ``leases``; ``queues`` (:class:`QueuePart`); ``delays``
    (``[name, remaining lock-delay ms]``); ``floor`` the source's token high-water mark;
    ``more``: another page follows (ask after ``after``, the page's cursor)."""

    leases: list[MovedLease]
    queues: list[QueuePart]
    delays: list[tuple[str, int]]
    floor: int
    more: bool
    after: list | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"leases": [list(x) for x in self.leases], "queues": [list(q) for q in self.queues],
                "delays": [list(d) for d in self.delays], "floor": self.floor, "more": self.more,
                "after": self.after}


class SlotsHoldKeys(InvalidArgument):
    """SLOT_EXPORT: the slots hold keys (the key store), which a move does not carry: nothing
    was shipped.  An :class:`~fastlock.errors.InvalidArgument`."""


def _int(value: Any, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise InvalidArgument(f"SLOT_IMPORT: {what} is an int {low}..{high}, not {value!r:.60}")
    return value


def _opt_str(value: Any, what: str) -> str | None:
    if value is not None and (type(value) is not str or len(value) > MAX_META_CHARS):
        raise InvalidArgument(f"SLOT_IMPORT: {what} is None or a str of at most {MAX_META_CHARS} characters")
    return value


def _list(value: Any, what: str, most: int) -> list:
    if type(value) is not list or len(value) > most:
        raise InvalidArgument(f"SLOT_IMPORT: {what} is a list of at most {most} items")
    return value


def decode_state(data: Any, first: int, last: int) -> MovedState:
    """The :class:`MovedState` of an import's ``state``: msgpack bytes (untrusted, at most
    :data:`MAX_STATE_BYTES`, decoded with small bounds).  :raises InvalidArgument: any bad field."""
    if type(data) is not bytes or len(data) > MAX_STATE_BYTES:
        raise InvalidArgument(f"SLOT_IMPORT: the state is msgpack bytes, at most {MAX_STATE_BYTES}")
    try:
        value = msgpack.unpackb(data, raw=False, max_array_len=EXPORT_PAGE * 10, max_map_len=8,
                                max_str_len=MAX_STATE_BYTES, max_bin_len=MAX_STATE_BYTES, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            RecursionError) as exc:
        raise InvalidArgument(f"SLOT_IMPORT: the state is not msgpack: {exc}") from None
    return parse_state(value, first, last)


def parse_state(value: Any, first: int, last: int) -> MovedState:
    """The :class:`MovedState` of a decoded import state (untrusted).  :raises InvalidArgument: any bad field."""
    if type(value) is not dict or not {"leases", "queues", "delays", "floor"} <= set(value) <= {
            "leases", "queues", "delays", "floor", "more", "after"}:
        raise InvalidArgument("SLOT_IMPORT: the state is {leases, queues, delays, floor[, more, after]}")
    if len(value["leases"] or ()) + len(value["queues"] or ()) + len(value["delays"] or ()) > EXPORT_PAGE:
        raise InvalidArgument(f"SLOT_IMPORT: at most {EXPORT_PAGE} rows of leases, queues and lock-delays")

    def name_in_range(name: Any) -> str:
        name = P.check_name(name)
        if not first <= slot_of(name) <= last:
            raise InvalidArgument(f"SLOT_IMPORT: {name!r:.100} is in slot {slot_of(name)}, not {first}..{last}")
        return name

    leases = []
    for row in _list(value["leases"], "leases", EXPORT_PAGE):
        if type(row) is not list or len(row) != len(MovedLease._fields):
            raise InvalidArgument(f"SLOT_IMPORT: a lease is a list of {len(MovedLease._fields)} fields")
        name, token, owner, remaining, delay, shared, limit, client, corr = row
        if type(owner) is not bytes or not 0 < len(owner) <= MAX_OWNER_BYTES:
            raise InvalidArgument(f"SLOT_IMPORT: an owner-key hash is 1..{MAX_OWNER_BYTES} bytes")
        if type(shared) is not bool:
            raise InvalidArgument("SLOT_IMPORT: shared is a bool")
        leases.append(MovedLease(name_in_range(name), _int(token, "a token", 1, (1 << 63) - 1), owner,
                                 _int(remaining, "a remaining TTL (ms)", 1, MAX_REMAINING_MS),
                                 _int(delay, "a lock-delay (ms)", 0, MAX_REMAINING_MS),
                                 shared, _int(limit, "a limit", 0, (1 << 31) - 1),
                                 _opt_str(client, "a client"), _opt_str(corr, "a correlation id")))
    queues: list[QueuePart] = []
    for row in _list(value["queues"], "queues", EXPORT_PAGE):
        if type(row) is not list or len(row) != 3:
            raise InvalidArgument("SLOT_IMPORT: a queue part is [name, offset, [owner-key hash, ...]]")
        owners = _list(row[2], "a queue part's waiters", QUEUE_PART)
        if not owners or any(type(o) is not bytes or not 0 < len(o) <= MAX_OWNER_BYTES for o in owners):
            raise InvalidArgument(f"SLOT_IMPORT: a queue part lists 1..{QUEUE_PART} owner-key hashes of "
                                  f"1..{MAX_OWNER_BYTES} bytes")
        queues.append(QueuePart(name_in_range(row[0]),
                                _int(row[1], "a queue part's offset", 0, MAX_MOVED_WAITERS - len(owners)), owners))
    delays: list[tuple[str, int]] = []
    for row in _list(value["delays"], "delays", EXPORT_PAGE):
        if type(row) is not list or len(row) != 2:
            raise InvalidArgument("SLOT_IMPORT: a lock-delay is [name, remaining ms]")
        delays.append((name_in_range(row[0]), _int(row[1], "a lock-delay (ms)", 1, MAX_REMAINING_MS)))
    floor = _int(value["floor"], "the token floor", 0, (MAX_EPOCH << 40) | ((1 << 40) - 1))
    more = value.get("more", False)
    if type(more) is not bool:
        raise InvalidArgument("SLOT_IMPORT: more is a bool")
    return MovedState(leases, queues, delays, floor, more)


def _cursor(after: Any) -> tuple[int, str, int] | None:
    if after is None:
        return None
    if (type(after) is not list or len(after) != 3 or type(after[0]) is not int or type(after[1]) is not str
            or type(after[2]) is not int):
        raise WrongArgumentType("after is None or the previous page's cursor [kind, name, number]")
    return after[0], after[1], after[2]


def _slots(msg: list) -> tuple[int, int]:
    first, last = msg[2], msg[3]
    if type(first) is not int or type(last) is not int or not 0 <= first <= last < SLOTS:
        raise WrongArgumentType(f"slots first, last are ints, 0 <= first <= last <= {SLOTS - 1}")
    return first, last


class SlotMoves:
    """SLOT_EXPORT and SLOT_IMPORT (see the module docstring) of ``handlers``' server."""

    def __init__(self, handlers: Handlers):
        self.handlers = handlers

    def handlers_by_op(self) -> dict[int, Any]:
        return {OP_SLOT_EXPORT: self.op_slot_export, OP_SLOT_IMPORT: self.op_slot_import}

    def _gate_and_check(self, first: int, last: int, to: str | None) -> Any:
        """This node's shard gate, checked: primary, ``first..last`` marked moving (to ``to``)."""
        server = self.handlers.server
        gate = server.shard_gate
        if gate is None:
            raise InvalidArgument("this node is not sharded: it has no slots to move")
        if server.roles.role is not Role.PRIMARY:
            raise NotPrimary("a slot move talks to each group's primary; this node is not one")
        shard_map = gate.shard_map
        for slot in range(first, last + 1):
            moving_to = shard_map.moving_to_of_slot(slot)
            owner = shard_map.owner_of_slot(slot).name
            if moving_to is None or (to is None and owner != gate.group) or (to is not None and moving_to != to):
                raise InvalidArgument(f"slot {slot} is not marked moving {'from' if to is None else 'to'} "
                                      f"{gate.group} in this node's shard map (epoch {shard_map.epoch}): "
                                      f"it may not have seen the new map yet; retry")
        return gate

    def op_slot_export(self, conn: Session, req_id: int, msg: list) -> None:
        """SLOT_EXPORT first, last, after: a page of the frozen slots' state (module docstring)."""
        check_lock_admin(self.handlers, conn, "slot_export")
        first, last = _slots(msg)
        after = _cursor(msg[4])
        gate = self._gate_and_check(first, last, None)
        space = self.handlers.server.keys.space
        keys = sum(1 for key in space.entries if first <= slot_of(key) <= last)
        if keys:
            raise SlotsHoldKeys(f"slots {first}..{last} hold {keys} keys of the key store, which a move does not "
                                f"carry: delete them, or abort the move (fastlock shard move --abort)")
        table = self.handlers.table
        now = monotonic_ms()
        # every row of the slots under one order, (kind, name, number): the cursor of a page stays
        # valid while leases expire between pages (nothing else changes on frozen slots)
        items: list[tuple[tuple[int, str, int], Any]] = []
        for h in table.holders():
            if first <= slot_of(h.name) <= last and h.deadline_ms > now:
                client, corr = h.meta if h.meta else (None, None)
                items.append(((0, h.name, h.token), MovedLease(
                    h.name, h.token, bytes(h.owner), h.deadline_ms - now, h.lock_delay_ms, bool(h.shared),
                    h.limit, client, corr)))
        for name, queue in gate.frozen_names(first, last).items():
            owners = [o for o, _priority in queue]
            for offset in range(0, min(len(owners), MAX_MOVED_WAITERS), QUEUE_PART):
                items.append(((1, name, offset), QueuePart(name, offset, owners[offset:offset + QUEUE_PART])))
        for name, until in table.lock_delays():
            if first <= slot_of(name) <= last and until > now:
                items.append(((2, name, 0), (name, until - now)))
        items.sort(key=lambda item: item[0])
        if after is not None:
            items = [item for item in items if item[0] > after]
        page = items[:EXPORT_PAGE]
        state = MovedState([x for k, x in page if k[0] == 0], [x for k, x in page if k[0] == 1],
                           [x for k, x in page if k[0] == 2], table.last_token, len(items) > len(page),
                           list(page[-1][0]) if page else None)
        conn.send(P.encode_ok(req_id, state.to_wire()))

    def op_slot_import(self, conn: Session, req_id: int, msg: list) -> None:
        """SLOT_IMPORT first, last, state: adopt a page of the moved slots' state (module docstring)."""
        check_lock_admin(self.handlers, conn, "slot_import")
        first, last = _slots(msg)
        state = decode_state(msg[4], first, last)
        server = self.handlers.server
        if server.shard_gate is None:
            raise InvalidArgument("this node is not sharded: it has no slots to move")
        gate = self._gate_and_check(first, last, server.shard_gate.group)
        for part in state.queues:  # checked before anything changes
            if part.offset > len(gate.imported_queues.get(part.name, ())):
                raise InvalidArgument(f"SLOT_IMPORT: {part.name!r:.100}'s queue part at {part.offset} comes "
                                      f"before the parts shipped so far")
        table = self.handlers.table
        wal = self.handlers.wal
        now = monotonic_ms()
        epoch = epoch_of(state.floor)
        if epoch > table.epoch:
            table.set_epoch(epoch)
            wal.log_epoch(epoch)
            server.node_state.raise_epoch(epoch)
        counter = counter_of(state.floor)
        if counter > table.counter:
            table.advance_counter(counter)
        wal.log_counter_floor(table.counter)
        quotas = server.quotas
        for x in state.leases:
            meta = (x.client, x.correlation_id)
            table.install_holder(x.name, x.token, x.owner, x.remaining_ms, x.lock_delay_ms, meta, now, x.shared,
                                 x.limit)
            quotas.of(quotas.principal_of(meta)).leases[x.token] = x.name  # counted as its principal's
            wal.log_grant(x.name, x.token, x.owner, x.remaining_ms, x.lock_delay_ms, x.client, x.correlation_id,
                          x.shared, x.limit)
        wall = wall_ms()
        for name, remaining in state.delays:
            if table.install_lock_delay(name, now + remaining, now):
                wal.log_lock_delay(name, wall + remaining)
        for part in state.queues:
            queue = gate.imported_queues.setdefault(part.name, [])
            queue[part.offset:part.offset + len(part.owners)] = part.owners
        gate.imported[first:last + 1] = b"\x01" * (last - first + 1)
        log.warning("slot move: imported %d leases, %d queues, %d lock-delays of slots %d..%d (token floor %d)",
                    len(state.leases), len(state.queues), len(state.delays), first, last, state.floor)
        reply = P.encode_ok(req_id, {"leases": len(state.leases), "queues": len(state.queues),
                                     "delays": len(state.delays)})

        def ack() -> None:
            conn.send(reply)
            server.after_batch()

        wal.when_durable(ack)
