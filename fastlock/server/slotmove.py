"""A slot move's two ops: SLOT_EXPORT on the source group's primary, SLOT_IMPORT on the destination's;
and SLOT_ADOPT, a slot's token floor set on its owner's primary without a move (``fastlock shard adopt``).

``fastlock shard move`` (:mod:`fastlock.cli.shardmove`) marks slots ``first..last`` moving to
group ``G`` in the map, then pages the frozen slots' state out of the source with
``SLOT_EXPORT first, last, after`` and into ``G``'s primary with ``SLOT_IMPORT``, then flips
the map.  Both ops need an ``admin`` principal (they are not in the dispatch's permission
table); a client principal gets ``PermissionDenied``.

``SLOT_EXPORT first, last, after`` (the source must serve a map marking ``first..last``
moving, and be the primary): one page (:data:`EXPORT_PAGE` rows at most) of :class:`MovedState`'s
plain form, the rows after the cursor ``after`` (None: from the first; a page names its own):
the leases, the waiter queues in parts (owner-key hashes in FIFO order, as the freeze took them
out), the running lock-delays, the keys of the key store (:class:`MovedKey`: value, the lease it
is attached to, who wrote it; a page holds at most :data:`PAGE_BYTES` of rows, one key alone
always goes), and the token high-water mark (the table's last token: every token the source
ever issued is at most that).

``SLOT_IMPORT first, last, state`` (``G`` must serve a map marking ``first..last`` moving to
``G``, and be the primary): ``state`` is a page as msgpack bytes (at most
:data:`MAX_STATE_BYTES`, or one key's value at ``--max-value-bytes`` and :data:`KEY_ROW_BYTES`
more, decoded with small bounds of its own; it names the map epoch the source served at its export,
and a page exported before the mark this node serves began is refused: a page of an earlier move of
the slots, aborted since; the mark's epoch is the range's ``marked_epoch`` in the map, or the first
map this node took that marked the slots, whichever is later).  Every field is validated
(untrusted input: types, ranges, every name in ``first..last``, at most :data:`EXPORT_PAGE`
rows), then the import raises the
token floor (an ``EPOCH`` record if the source's epoch is higher, a ``RESERVE`` record for the
counter: every token ``G`` issues from then on is above the mark; in an etcd group the
group's epoch in etcd is raised first, with its primary record, by the arbiter's own
transaction, :meth:`~fastlock.coordination.etcd.EtcdArbiter.adopt_epoch`, so that its
standbys never see their primary named below the epoch they replicate and it stays
primary), installs each lease with its
token, owner-key hash and remaining TTL (a ``GRANT`` record each, so ``G``'s standbys and its
recovery have them), each lock-delay (a ``LOCK_DELAY`` record), each key (a ``KEY_PUT``
record, after the leases: a key whose lease is not held here any more is skipped, as its
lease's end would have deleted it) and keeps the queues for the flip.  The keys are admitted
against the server's ``--max-keys`` and ``--max-key-bytes`` (the page is refused whole,
``LimitExceeded``, beyond them) and counted against the principal that wrote them, without
its own quota's check (it held them already on the source).  The reply (``{"leases",
"delays", "queues", "keys", "sessions"}``: how many, ``sessions`` the leases attached to their
sessions; ``"over_quota"``: principal -> [held, quota], "Sessions' share" below) comes once
the records are durable (and, under synchronous replication, on the standby, as a grant's
reply) and applied by every attached standby (see "The adoption in the log" below).  Importing the
same state twice installs the same leases and keys again: it changes nothing (a key with the
same value, lease and writer is not logged again).

Keys and revisions.  A key change's revision is its group's (``epoch << 40 | lsn`` of the
record there): every group numbers its own changes, rising.  The destination publishes each
imported key as a ``"put"`` at its own next revision (above every revision it gave before; a
watch of the destination resuming from a position it had sees it); at the flip the source
removes each moved key with a ``KEY_MOVED`` record, published as ``"moved"`` (the key was not
deleted: it lives in the group the record names), so a watch over every group
(``ShardedClient.watch_prefix``) misses no change and sees no revision of one group go
backwards; a consumer keeping the keys' values ignores ``"moved"``.  A key attached to a lease
moves with it: SLOT_EXPORT refuses (:class:`SlotsHoldKeys`; the mover then clears its mark) a
range where a key and its lease are in different slots, one inside the range and one outside
(put them under one ``{tag}``).  A move aborted after keys were imported: the destination
removes them again (``KEY_MOVED`` naming the source) and drops the leases it imported
(``REVOKE`` records: the source served them again and their holders may have released them
there).

Sessions' share.  A moved lease's row names the client session it is attached to on the source
(:class:`~fastlock.server.sessions.SessionShare`: the session key's hash, as the source keeps it,
never the key; its principal, its TTL and the lease's TTL as attached; None when it is attached to
none).  The import attaches the lease to the session of that key here, opened if this node has
none (:meth:`~fastlock.server.sessions.SessionRegistry.adopt`, within the session limits; a session
of that key held by another principal is left alone): the lease is listed with the session, revoked
when the session is closed, and renewed by the session's keep-alives once the client attaches it here
itself (the routing client opens its session with one key in every group and re-homes a moved lease
with an ``EXTEND`` and an attach here).  The import counts each lease against its principal's lease
quota without refusing it (a held lease survives a move) and reports the principals it put over
that quota (``over_quota``; their acquires here are refused until they hold less).

Queue order.  The destination merges each queue part into the queue it has for the name (an
owner shipped before keeps its place; new ones follow in the part's order) and keeps its
imported queues and slots until the flip lets them in (:class:`~fastlock.server.sharded.ShardGate`;
an abort, seen then or at the node's next start, sends the imported keys back), so a restart of
the destination before the flip, or a failover of the source after a ship, keeps the old order.

The adoption in the log.  After a page's records the import logs ``SLOTS_ADOPTED`` (the range,
the token floor, the group's epoch after the import, the page's queue parts;
:class:`~fastlock.wal.records.SlotsAdopted`; fsynced before the reply in every fsync mode): a
standby applying it raises its highest epoch seen to that epoch and learns the imported slots
and queues, so that, promoted, it takes their flip (and only theirs, of flips whose mark it
missed), lets the queues in in their order and issues tokens above the floor.  The import is
kept by the log alone: a WAL snapshot holds the slots imported and not yet taken, with their
queues (:class:`~fastlock.wal.records.ImportedSlots`), so a restart recovers them from the
snapshot and the records after it; a standby that joins by a snapshot gets them as
``SLOTS_ADOPTED`` records logged again right after it (:meth:`ShardGate.relog_imports
<fastlock.server.sharded.ShardGate.relog_imports>`, as running lock-delays are).  The reply is
sent once every standby attached to this primary has applied that record (at most :data:`STANDBY_WAIT_S`; else
:class:`~fastlock.errors.Unavailable`): the mover writes the flip only after it.

A slot gained without an import.  A group that gains a slot by a map change with no import of
it (a mark and its flip written by hand) does not serve its names
(:attr:`fastlock.server.sharded.ShardGate.unadopted`) until ``SLOT_ADOPT first, last, floor``
(an admin's, on the owner's primary) raises its token floor above ``floor`` as an import does
and logs ``SLOTS_ADOPTED`` with no queues (:meth:`SlotMoves.op_slot_adopt`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack

from .. import protocol as P
from ..errors import FastlockError, InvalidArgument, LimitExceeded, NotPrimary, Unavailable, WrongArgumentType
from ..protocol.ops import OP_SLOT_ADOPT, OP_SLOT_EXPORT, OP_SLOT_IMPORT
from ..roles import Role
from ..sharding import SLOTS, slot_of
from ..tokens import MAX_EPOCH, counter_of, epoch_of
from ..units import monotonic_ms, wall_ms
from .lockadmin import check_lock_admin
from .session import split_recorded_client
from .sessions import SessionShare

if TYPE_CHECKING:  # pragma: no cover
    from .handlers import Handlers
    from .session import Session

__all__ = ["MovedLease", "MovedKey", "MovedState", "QueuePart", "SlotMoves", "EXPORT_PAGE", "PERMISSIONS",
           "drop_keys"]

#: the dispatch's permission entries: checked by the handlers (check_lock_admin)
PERMISSIONS: dict[int, str | None] = {OP_SLOT_EXPORT: None, OP_SLOT_IMPORT: None, OP_SLOT_ADOPT: None}

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
#: the longest client name / correlation id kept with an imported lease, and principal of an imported key
MAX_META_CHARS = 256
#: the most bytes (msgpack) of the rows of one SLOT_EXPORT page; a page's first row always goes
PAGE_BYTES = 48 << 10
#: what a key's row and its page hold beside its value, at most (bytes): key, lease name, principal
KEY_ROW_BYTES = 3 << 10
#: the most seconds an import's reply waits for every attached standby to apply it
STANDBY_WAIT_S = 10.0
#: seconds between two looks at the standbys' applied positions while an import's reply waits
STANDBY_POLL_S = 0.005
#: the largest token floor accepted (an import's or SLOT_ADOPT's): the largest fencing token
MAX_FLOOR = (MAX_EPOCH << 40) | ((1 << 40) - 1)


class MovedLease(NamedTuple):
    """One lease of a moved slot: name, fencing token, owner-key hash, remaining TTL (ms),
    lock-delay (ms), shared, semaphore limit (0: a lock), the recorded client and correlation id,
    and the client session it is attached to on the source (None: none; a row of an older
    source has no such field)."""

    name: str
    token: int
    owner: bytes
    remaining_ms: int
    lock_delay_ms: int
    shared: bool
    limit: int
    client: str | None
    correlation_id: str | None
    session: SessionShare | None = None

    def to_wire(self) -> list:
        return [*self[:9], None if self.session is None else list(self.session)]


class MovedKey(NamedTuple):
    """One key of a moved slot (the key store): key, value, the lease it is attached to (lock
    name and token; None and 0: none) and the principal that wrote it."""

    key: str
    value: bytes
    lease_name: str | None
    token: int
    principal: str | None


class QueuePart(NamedTuple):
    """Waiters ``offset`` .. ``offset + len(owners) - 1`` of the queue of ``name`` (owner-key hashes, FIFO)."""

    name: str
    offset: int
    owners: list[bytes]


class MovedState(NamedTuple):
    """One page of a move's state: ``leases``; ``queues`` (:class:`QueuePart`); ``delays``
    (``[name, remaining lock-delay ms]``); ``floor`` the source's token high-water mark;
    ``more``: another page follows (ask after ``after``, the page's cursor); ``keys``
    (:class:`MovedKey`); ``epoch``: the epoch of the map the source served when it exported
    the page (None: not named; the destination then does not compare it with its mark's)."""

    leases: list[MovedLease]
    queues: list[QueuePart]
    delays: list[tuple[str, int]]
    floor: int
    more: bool
    after: list | None = None
    keys: list[MovedKey] = []
    epoch: int | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"leases": [x.to_wire() for x in self.leases], "queues": [list(q) for q in self.queues],
                "delays": [list(d) for d in self.delays], "floor": self.floor, "more": self.more,
                "after": self.after, "keys": [list(k) for k in self.keys], "epoch": self.epoch}


class SlotsHoldKeys(InvalidArgument):
    """SLOT_EXPORT: the slots hold keys attached to leases outside them (or leases holding keys
    outside them), which a move cannot split: nothing was shipped.  An
    :class:`~fastlock.errors.InvalidArgument`."""


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


def state_bytes(max_value_bytes: int) -> int:
    """The largest SLOT_IMPORT state a server storing values of ``max_value_bytes`` (bytes) accepts."""
    return max(MAX_STATE_BYTES, max_value_bytes + KEY_ROW_BYTES)


def decode_state(data: Any, first: int, last: int, max_value_bytes: int = 0) -> MovedState:
    """The :class:`MovedState` of an import's ``state``: msgpack bytes (untrusted, at most
    :func:`state_bytes` of ``max_value_bytes``, the largest key value accepted, decoded with
    small bounds).  :raises InvalidArgument: any bad field."""
    most = state_bytes(max_value_bytes)
    if type(data) is not bytes or len(data) > most:
        raise InvalidArgument(f"SLOT_IMPORT: the state is msgpack bytes, at most {most}")
    try:
        value = msgpack.unpackb(data, raw=False, max_array_len=EXPORT_PAGE * 10, max_map_len=8,
                                max_str_len=most, max_bin_len=most, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            RecursionError) as exc:
        raise InvalidArgument(f"SLOT_IMPORT: the state is not msgpack: {exc}") from None
    return parse_state(value, first, last, max_value_bytes)


def parse_state(value: Any, first: int, last: int, max_value_bytes: int = 0) -> MovedState:
    """The :class:`MovedState` of a decoded import state (untrusted); a key's value is at most
    ``max_value_bytes`` bytes.  :raises InvalidArgument: any bad field."""
    fields = {"leases", "queues", "delays", "floor"}
    if type(value) is not dict or not fields <= set(value) <= fields | {"more", "after", "keys", "epoch"}:
        raise InvalidArgument("SLOT_IMPORT: the state is {leases, queues, delays, floor[, more, after, keys, "
                              "epoch]}")
    rows = [value[f] for f in ("leases", "queues", "delays", "keys") if f in value]
    if any(type(r) is not list for r in rows) or sum(len(r) for r in rows) > EXPORT_PAGE:
        raise InvalidArgument(f"SLOT_IMPORT: leases, queues, lock-delays and keys are lists of at most "
                              f"{EXPORT_PAGE} rows together")

    def name_in_range(name: Any) -> str:
        name = P.check_name(name)
        if not first <= slot_of(name) <= last:
            raise InvalidArgument(f"SLOT_IMPORT: {name!r:.100} is in slot {slot_of(name)}, not {first}..{last}")
        return name

    leases = []
    width = len(MovedLease._fields)  # a row of an older source has no session
    for row in _list(value["leases"], "leases", EXPORT_PAGE):
        if type(row) is not list or not width - 1 <= len(row) <= width:
            raise InvalidArgument(f"SLOT_IMPORT: a lease is a list of {width - 1} or {width} fields")
        name, token, owner, remaining, delay, shared, limit, client, corr = row[:width - 1]
        session = _session_share(row[width - 1]) if len(row) == width else None
        if type(owner) is not bytes or not 0 < len(owner) <= MAX_OWNER_BYTES:
            raise InvalidArgument(f"SLOT_IMPORT: an owner-key hash is 1..{MAX_OWNER_BYTES} bytes")
        if type(shared) is not bool:
            raise InvalidArgument("SLOT_IMPORT: shared is a bool")
        leases.append(MovedLease(name_in_range(name), _int(token, "a token", 1, (1 << 63) - 1), owner,
                                 _int(remaining, "a remaining TTL (ms)", 1, MAX_REMAINING_MS),
                                 _int(delay, "a lock-delay (ms)", 0, MAX_REMAINING_MS),
                                 shared, _int(limit, "a limit", 0, (1 << 31) - 1),
                                 _opt_str(client, "a client"), _opt_str(corr, "a correlation id"), session))
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
    keys: list[MovedKey] = []
    for row in value.get("keys", ()):
        if type(row) is not list or len(row) != len(MovedKey._fields):
            raise InvalidArgument(f"SLOT_IMPORT: a key is a list of {len(MovedKey._fields)} fields")
        key, data, lease_name, token, principal = row
        if type(data) is not bytes or len(data) > max_value_bytes:
            raise InvalidArgument(f"SLOT_IMPORT: a key's value is bytes, at most {max_value_bytes} "
                                  f"(--max-value-bytes of this server)")
        if lease_name is None:
            token = _int(token, "the token of a key without lease", 0, 0)
        else:
            lease_name = name_in_range(lease_name)
            token = _int(token, "a key's lease token", 1, (1 << 63) - 1)
        keys.append(MovedKey(name_in_range(key), data, lease_name, token, _opt_str(principal, "a key's principal")))
    floor = _int(value["floor"], "the token floor", 0, MAX_FLOOR)
    more = value.get("more", False)
    if type(more) is not bool:
        raise InvalidArgument("SLOT_IMPORT: more is a bool")
    epoch = value.get("epoch")
    if epoch is not None:
        epoch = _int(epoch, "the map epoch of the export", 0, (1 << 63) - 1)
    return MovedState(leases, queues, delays, floor, more, None, keys, epoch)


def _session_share(row: Any) -> SessionShare | None:
    """A moved lease's session share (None, or [key hash, principal, session TTL ms, lease TTL ms]).
    :raises InvalidArgument: a bad field."""
    if row is None:
        return None
    if type(row) is not list or len(row) != len(SessionShare._fields):
        raise InvalidArgument("SLOT_IMPORT: a lease's session is None or [key hash, principal, TTL ms, lease TTL ms]")
    key_hash, principal, ttl_ms, lease_ttl_ms = row
    if type(key_hash) is not bytes or not 0 < len(key_hash) <= MAX_OWNER_BYTES:
        raise InvalidArgument(f"SLOT_IMPORT: a session's key hash is 1..{MAX_OWNER_BYTES} bytes")
    if type(principal) is not str or not 0 < len(principal) <= MAX_META_CHARS:
        raise InvalidArgument(f"SLOT_IMPORT: a session's principal is a str of 1..{MAX_META_CHARS} characters")
    return SessionShare(key_hash, principal, _int(ttl_ms, "a session's TTL (ms)", 1, MAX_REMAINING_MS),
                        _int(lease_ttl_ms, "a session lease's TTL (ms)", 1, MAX_REMAINING_MS))


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
    """SLOT_EXPORT, SLOT_IMPORT and SLOT_ADOPT (see the module docstring) of ``handlers``' server."""

    def __init__(self, handlers: Handlers):
        self.handlers = handlers

    def handlers_by_op(self) -> dict[int, Any]:
        return {OP_SLOT_EXPORT: self.op_slot_export, OP_SLOT_IMPORT: self.op_slot_import,
                OP_SLOT_ADOPT: self.op_slot_adopt}

    def _gate_and_check(self, first: int, last: int, to: str | None) -> Any:
        """This node's shard gate, checked: primary, ``first..last`` marked moving (to ``to``)."""
        server = self.handlers.server
        gate = server.shard_gate
        if gate is None:
            raise InvalidArgument("this node is not sharded: it has no slots to move")
        if server.roles.role is not Role.PRIMARY:
            raise NotPrimary("a slot move talks to each group's primary; this node is not one")
        if server.roles.fenced:  # another node may be primary already, serving by the map it read then
            raise NotPrimary("a slot move talks to each group's primary; this one is fenced (it may have been "
                             "replaced): retry the move")
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
        _check_keys_move_whole(space, first, last)
        table = self.handlers.table
        share_of = self.handlers.sessions.share_of
        now = monotonic_ms()
        # every row of the slots under one order, (kind, name, number): the cursor of a page stays
        # valid while leases expire between pages (nothing else changes on frozen slots)
        items: list[tuple[tuple[int, str, int], Any]] = []
        for h in table.holders():
            if first <= slot_of(h.name) <= last and h.deadline_ms > now:
                client, corr = h.meta if h.meta else (None, None)
                items.append(((0, h.name, h.token), MovedLease(
                    h.name, h.token, bytes(h.owner), h.deadline_ms - now, h.lock_delay_ms, bool(h.shared),
                    h.limit, client, corr, share_of(h.name, h.token))))
        for name, queue in gate.frozen_names(first, last).items():
            owners = [o for o, _priority in queue]
            for offset in range(0, min(len(owners), MAX_MOVED_WAITERS), QUEUE_PART):
                items.append(((1, name, offset), QueuePart(name, offset, owners[offset:offset + QUEUE_PART])))
        for name, until in table.lock_delays():
            if first <= slot_of(name) <= last and until > now:
                items.append(((2, name, 0), (name, until - now)))
        for key, entry in space.entries.items():
            if first <= slot_of(key) <= last:
                items.append(((3, key, 0), MovedKey(key, entry.value, entry.lease_name, entry.token,
                                                    entry.principal)))
        items.sort(key=lambda item: item[0])
        if after is not None:
            items = [item for item in items if item[0] > after]
        page: list[tuple[tuple[int, str, int], Any]] = []
        size = 0
        for item in items[:EXPORT_PAGE]:
            row = msgpack.packb(item[1].to_wire() if item[0][0] == 0 else list(item[1]))
            if page and size + len(row) > PAGE_BYTES:
                break
            page.append(item)
            size += len(row)
        state = MovedState([x for k, x in page if k[0] == 0], [x for k, x in page if k[0] == 1],
                           [x for k, x in page if k[0] == 2], table.last_token, len(items) > len(page),
                           list(page[-1][0]) if page else None, [x for k, x in page if k[0] == 3],
                           gate.shard_map.epoch)
        conn.send(P.encode_ok(req_id, state.to_wire()))

    def op_slot_import(self, conn: Session, req_id: int, msg: list) -> None:
        """SLOT_IMPORT first, last, state: adopt a page of the moved slots' state (module docstring)."""
        check_lock_admin(self.handlers, conn, "slot_import")
        first, last = _slots(msg)
        server = self.handlers.server
        state = decode_state(msg[4], first, last, server.config.max_value_bytes)
        if server.shard_gate is None:
            raise InvalidArgument("this node is not sharded: it has no slots to move")
        gate = self._gate_and_check(first, last, server.shard_gate.group)
        # the mark's epoch as the map records it, or as this node saw it first (a map marked by an earlier
        # mover records none): a node whose watch skipped an abort and a new mark still knows the new one
        marked = max(max(gate.marked_since[first:last + 1]), gate.shard_map.marked_epoch_of(first, last))
        if state.epoch is not None and state.epoch < marked:
            # exported before the mark this node serves: a page of an earlier move of these slots, aborted
            # since (the source served them again meanwhile: its holders may have released what it holds)
            raise InvalidArgument(f"SLOT_IMPORT: the page was exported at shard map epoch {state.epoch}, before "
                                  f"slots {first}..{last} were marked moving here (epoch {marked}): a page of an "
                                  f"earlier move of them; run the move again")
        for part in state.queues:  # checked before anything changes
            have = len(gate.imported_queues.get(part.name, ()))
            if part.offset > have:
                raise InvalidArgument(f"SLOT_IMPORT: {part.name!r:.100}'s queue part at {part.offset} comes "
                                      f"before the parts shipped so far")
            if have + len(part.owners) > MAX_MOVED_WAITERS:
                raise InvalidArgument(f"SLOT_IMPORT: {part.name!r:.100}'s queue would pass {MAX_MOVED_WAITERS} "
                                      f"moved waiters")
        new_keys = _admit_keys(server, state.keys)
        table = self.handlers.table
        wal = self.handlers.wal
        now = monotonic_ms()
        if not self._raise_floor(state.floor, conn, req_id, msg, self.op_slot_import, "slot import"):
            return
        quotas = server.quotas
        quotas.sync()  # (counted from the table if the epoch moved: the leases below are counted once)
        sessions = self.handlers.sessions
        origin = f"(moved from shard group {gate.shard_map.owner_of_slot(first).name})"
        principals: set[str] = set()
        attached = 0
        for x in state.leases:
            meta = (x.client, x.correlation_id)
            table.install_holder(x.name, x.token, x.owner, x.remaining_ms, x.lock_delay_ms, meta, now, x.shared,
                                 x.limit)
            gate.imported_leases.setdefault(x.name, set()).add(x.token)  # the source's until the flip (status)
            principal = quotas.principal_of(meta)
            quotas.of(principal).count_lease(x.token, x.name)  # counted as its principal's, its quota checked below
            principals.add(principal)
            wal.log_grant(x.name, x.token, x.owner, x.remaining_ms, x.lock_delay_ms, x.client, x.correlation_id,
                          x.shared, x.limit)
            if x.session is not None and _holds(table, x, now) and sessions.adopt(x.session, x.name, x.token, x.owner,
                                                        split_recorded_client(x.client)[1], origin, now):
                attached += 1
        over = quotas.over_lease_quota(principals)
        if over:
            log.warning("slot move: the imported leases put %s over their lease quota here (held/quota: %s): "
                        "their leases are kept, their new acquires refused until they hold less",
                        ", ".join(over), ", ".join(f"{h}/{q}" for h, q in over.values()))
        wall = wall_ms()
        for name, remaining in state.delays:
            if table.install_lock_delay(name, now + remaining, now):
                wal.log_lock_delay(name, wall + remaining)
        space = server.keys.space
        for k in new_keys:  # after the leases: a key's lease is installed first
            if k.lease_name is not None and not table.check(k.lease_name, k.token, now):
                continue  # its lease ended meanwhile: its end would have deleted the key
            space.put(k.key, k.value, k.lease_name, k.token, k.principal, wall)
            wal.log_key_put(k.key, k.value, k.lease_name, k.token, k.principal)
            server.key_revisions.logged(0, k.key, "put", k.value)
        # the adoption in the log, after the page's state: a standby that has it has the page (it takes the
        # flip of these slots, and never takes a lower epoch than this one, only then; sharded.py)
        wal.log_slots_adopted(first, last, state.floor, table.epoch, [[p.name, p.owners] for p in state.queues])
        logged = wal.logged_lsn
        for part in state.queues:  # an owner shipped before keeps its place (see QUEUE ORDER in the docs)
            queue = gate.imported_queues.setdefault(part.name, [])
            known = set(queue)
            queue.extend(o for o in dict.fromkeys(part.owners) if o not in known)
        gate.imported[first:last + 1] = b"\x01" * (last - first + 1)
        log.warning("slot move: imported %d leases, %d queues, %d lock-delays, %d keys of slots %d..%d (token "
                    "floor %d)", len(state.leases), len(state.queues), len(state.delays), len(state.keys), first,
                    last, state.floor)
        reply = P.encode_ok(req_id, {"leases": len(state.leases), "queues": len(state.queues),
                                     "delays": len(state.delays), "keys": len(state.keys), "sessions": attached,
                                     "over_quota": {p: list(v) for p, v in over.items()}})

        self._reply_once_committed(conn, req_id, reply, logged, "slot import")

    def _raise_floor(self, floor: int, conn: Session, req_id: int, msg: list, rerun: Any, what: str) -> bool:
        """Raise this primary's token floor above ``floor`` (a fencing token): an ``EPOCH`` record
        if its epoch is higher, a ``RESERVE`` record for the counter, so every token issued from
        then on is above it.  In an etcd group whose epoch in etcd is below ``floor``'s, the
        group's epoch in etcd is raised first (:meth:`_adopt_then_import`, which runs
        ``rerun(conn, req_id, msg)`` after it): False then (the request is answered by the rerun)."""
        epoch = self.raise_floor_now(floor)
        if epoch:  # an etcd group: the group's epoch in etcd first, then the request (run again)
            self.handlers.server.tasks.spawn(self._adopt_then_import(self.arbiter(), epoch, conn, req_id, msg, rerun),
                                             f"{what}: raise the group's epoch in etcd")
            return False
        return True

    def arbiter(self) -> Any:
        """This node's etcd arbiter, or None (a group not arbitrated by etcd)."""
        coordinated = self.handlers.server.failover.coordinated
        return coordinated.arbiter if coordinated is not None else None

    def raise_floor_now(self, floor: int) -> int:
        """On the primary: make every token issued from now on above ``floor`` (a fencing token): an
        ``EPOCH`` record if ``floor``'s epoch is above this node's, a ``RESERVE`` record for the
        counter.  Returns 0 once done; in an etcd group whose primary is named in etcd below
        ``floor``'s epoch, nothing is changed and that epoch is returned: the group's epoch in etcd
        is to be raised first (by the arbiter's own transaction, so its standbys never see their
        primary named below the epoch they replicate), then this called again."""
        server = self.handlers.server
        table = self.handlers.table
        wal = self.handlers.wal
        epoch = epoch_of(floor)
        arbiter = self.arbiter()
        if epoch > table.epoch and arbiter is not None and arbiter.epoch < epoch:
            return epoch
        if epoch > table.epoch:
            self.handlers.sessions.epoch_raised(table.epoch, epoch)  # this node stays the primary throughout
            table.set_epoch(epoch)
            wal.log_epoch(epoch)
            server.node_state.raise_epoch(epoch)
        counter = counter_of(floor)
        if counter > table.counter:
            table.advance_counter(counter)
        wal.log_counter_floor(table.counter)
        return 0

    def op_slot_adopt(self, conn: Session, req_id: int, msg: list) -> None:
        """SLOT_ADOPT first, last, floor: this group's primary adopts ``floor`` (a fencing token:
        the highest any group granted for names of slots ``first..last``, or a token of an epoch
        above every epoch known) as the token floor of slots ``first..last``, which its group owns
        in this node's map (``fastlock shard adopt``): the floor is raised as an import's is, a
        ``SLOTS_ADOPTED`` record (no queues) is logged, and once it is durable (and applied by
        every attached standby, as an import's) the slots' names are served
        (:meth:`~fastlock.server.sharded.ShardGate.adopt`).  The reply: ``{"epoch": the group's
        epoch after it, "adopted": how many of the slots were owned without their floor}``.

        :raises PermissionDenied: not an admin principal.  :raises NotPrimary: not the primary,
            or fenced.  :raises InvalidArgument: not sharded, or a slot this group does not own or is
            moving away.  :raises WrongArgumentType: slots or floor are not ints in range."""
        check_lock_admin(self.handlers, conn, "slot_adopt")
        first, last = _slots(msg)
        floor = msg[4]
        if type(floor) is not int or not 0 <= floor <= MAX_FLOOR:
            raise WrongArgumentType(f"SLOT_ADOPT: the floor is a fencing token, an int 0..{MAX_FLOOR}")
        server = self.handlers.server
        gate = server.shard_gate
        if gate is None:
            raise InvalidArgument("this node is not sharded: it has no slots to adopt")
        if server.roles.role is not Role.PRIMARY or server.roles.fenced:
            raise NotPrimary("SLOT_ADOPT goes to the primary of the group that owns the slots; this node is not it")
        for slot in range(first, last + 1):
            if not gate.owned[slot] or gate.moving[slot]:
                raise InvalidArgument(f"slot {slot} is not owned by shard group {gate.group} in this node's shard map "
                                      f"(epoch {gate.shard_map.epoch}), or is being moved away: a slot's floor is "
                                      f"adopted by the primary of the group that owns it")
        if not self._raise_floor(floor, conn, req_id, msg, self.op_slot_adopt, "slot adopt"):
            return
        table = self.handlers.table
        wal = self.handlers.wal
        wal.log_slots_adopted(first, last, floor, table.epoch, [])
        logged = wal.logged_lsn
        adopted = gate.unadopted[first:last + 1].count(1)
        log.warning("slot adopt: slots %d..%d adopt the token floor %d (%d owned without one); epoch %d", first, last,
                    floor, adopted, table.epoch)
        reply = P.encode_ok(req_id, {"epoch": table.epoch, "adopted": adopted})

        self._reply_once_committed(conn, req_id, reply, logged, "slot adopt", lambda: gate.adopt(first, last))

    def _reply_once_committed(self, conn: Session, req_id: int, reply: Any, logged: int, what: str,
                              committed: Any = None) -> None:
        """Once the records just logged (up to LSN ``logged``) are durable and, under synchronous
        replication, acknowledged: call ``committed()`` (if given) and send ``reply`` once every
        attached standby has applied them (:meth:`_reply_once_standbys_have`); a refused
        acknowledgement is the request's error instead (the mover fails; a rerun does it again)."""
        server = self.handlers.server

        def ack(refused: FastlockError | None = None) -> None:
            if refused is None:
                if committed is not None:
                    committed()
                server.tasks.spawn(self._reply_once_standbys_have(conn, req_id, reply, logged),
                                   f"{what}: wait for the standbys")
                return
            conn.send(P.encode_error(req_id, refused.code, str(refused), None))
            server.after_batch()

        self.handlers.wal.when_durable(server.source.sync.after(ack))

    async def _reply_once_standbys_have(self, conn: Session, req_id: int, reply: Any, lsn: int) -> None:
        """Send an import's ``reply`` once every standby attached to this primary (asynchronous ones
        too) has applied its records up to ``lsn`` (its SLOTS_ADOPTED record), polled every
        :data:`STANDBY_POLL_S` seconds for at most :data:`STANDBY_WAIT_S` seconds; else answer
        :class:`~fastlock.errors.Unavailable` (the mover stops before the flip; run it again).  The
        flip is written after this reply: a standby promoted after it knows the import, so it
        takes the flip and issues tokens above the adopted epoch."""
        server = self.handlers.server
        deadline = monotonic_ms() + int(STANDBY_WAIT_S * 1000)
        told = False
        while True:
            behind = [r.name for r in list(server.source.replicas.values())
                      if not r.conn.closed and r.acked_lsn < lsn]
            if not behind or getattr(conn, "closed", False) or monotonic_ms() >= deadline:
                break
            if not told and monotonic_ms() + int(STANDBY_WAIT_S * 900) >= deadline:  # behind after a tenth
                log.warning("slot move: the import's reply waits for standbys %s to apply it (LSN %d)",
                            ", ".join(map(str, behind[:4])), lsn)
                told = True
            await asyncio.sleep(STANDBY_POLL_S)
        if behind:
            log.warning("slot move: standbys %s did not apply the import (LSN %d) within %g s: the import is "
                        "answered Unavailable", ", ".join(map(str, behind[:4])), lsn, STANDBY_WAIT_S)
            reply = P.encode_error(req_id, Unavailable.code, (
                f"SLOT_IMPORT: {len(behind)} standbys of this group did not apply the import within "
                f"{STANDBY_WAIT_S:g} s (a standby promoted without it would not know the slots' token floor): "
                f"retry the move"), None)
        if not getattr(conn, "closed", False):
            conn.send(reply)
        server.after_batch()

    async def _adopt_then_import(self, arbiter: Any, epoch: int, conn: Session, req_id: int, msg: list,
                                 rerun: Any) -> None:
        """Raise the etcd group's epoch to ``epoch`` (the source's, from its token floor) by the
        arbiter's own transaction (:meth:`~fastlock.coordination.etcd.EtcdArbiter.adopt_epoch`:
        the primary stays primary), then run the request again (``rerun(conn, req_id, msg)``: the
        import or the adoption); an error is the request's reply."""
        handlers = self.handlers
        try:
            if not await arbiter.adopt_epoch(epoch):
                raise NotPrimary(f"SLOT_IMPORT: this node could not raise its group's epoch to {epoch} in etcd (it "
                                 f"is not the primary any more, or the group's epoch changed): retry the move")
            if getattr(conn, "closed", False):
                return
            rerun(conn, req_id, msg)
        except Exception as exc:  # noqa: BLE001 - answered as the dispatch answers a handler's error
            handlers.failed(conn, req_id, msg[1], exc)
        handlers.server.after_batch()


def _holds(table: Any, lease: MovedLease, now: int) -> bool:
    """The moved ``lease`` is held here now, with its token (installed by the import)."""
    holder = table.holder(lease.name, now, lease.owner)
    return holder is not None and holder.token == lease.token


def _check_keys_move_whole(space: Any, first: int, last: int) -> None:
    """:raises SlotsHoldKeys: a key in slots ``first..last`` is attached to a lease outside
    them, or a lease inside them holds a key outside them (a move carries a key with its lease)."""
    for (lease_name, _token), keys in space.by_lease.items():
        inside = first <= slot_of(lease_name) <= last
        split = [k for k in keys if (first <= slot_of(k) <= last) != inside]
        if split:
            raise SlotsHoldKeys(
                f"slots {first}..{last} hold keys attached to a lease on the other side of the range (key "
                f"{split[0]!r:.100} in slot {slot_of(split[0])}, its lease {lease_name!r:.100} in slot "
                f"{slot_of(lease_name)}): a move carries a key with its lease; put both under one {{tag}}, or "
                f"abort the move (fastlock shard move --abort)")


def _admit_keys(server: Any, keys: list[MovedKey]) -> list[MovedKey]:
    """The ``keys`` of an import page that change the key space (a key already held with the
    same value, lease and writer is left alone).

    :raises LimitExceeded: they would pass the server's ``--max-keys`` or ``--max-key-bytes``."""
    space = server.keys.space
    config = server.config
    new: list[MovedKey] = []
    added = grown = 0
    for k in keys:
        old = space.get(k.key)
        if old is not None and (old.value, old.lease_name, old.token, old.principal) == (
                k.value, k.lease_name, k.token, k.principal):
            continue
        new.append(k)
        added += old is None
        grown += len(k.value) - (len(old.value) if old is not None else 0)
    if len(space) + added > config.max_keys:
        raise LimitExceeded(f"SLOT_IMPORT: {added} more keys would pass this server's {config.max_keys} "
                            f"(--max-keys); nothing was imported")
    if space.value_bytes + grown > config.max_key_bytes:
        raise LimitExceeded(f"SLOT_IMPORT: {grown} more bytes of key values would pass this server's "
                            f"{config.max_key_bytes} (--max-key-bytes); nothing was imported")
    return new


def drop_keys(server: Any, slots: set[int], to_group: str) -> int:
    """Remove every key of ``slots`` from this primary's key space, each by a ``KEY_MOVED``
    record naming ``to_group`` (published as ``"moved"``): at a move's flip on the source (the
    keys live in ``to_group`` now), and on a destination whose move was aborted (back to the
    source).  Returns how many."""
    space = server.keys.space
    gone = [key for key in space.entries if slot_of(key) in slots]
    wal = server.wal
    logged = server.key_revisions.logged
    for key in gone:
        space.delete(key)
        wal.log_key_moved(key, to_group)
        logged(0, key, "moved", None)
    return len(gone)
