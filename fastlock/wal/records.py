"""The log's records as typed values, and the one set of rules that applies them.

A record on disk (and in the replication stream) is a msgpack array
``[type, field, ...]`` (see :mod:`fastlock.wal` for the table of types and
fields).  In memory each type is a :class:`~typing.NamedTuple` whose fields are
the array's fields after the type: :func:`encode` and :func:`decode` convert,
byte for byte the same as the positional lists written by every earlier
fastlock.

:func:`apply` is the only code that decides what a record does to a lock
table: recovery (:mod:`fastlock.wal.recovery`, onto a :class:`LogState`), the
standby (:mod:`fastlock.replication.follower`, onto its live table) and
``wal dump --state`` all call it, each with its own :class:`ApplyTarget`.
The rules:

* GRANT installs the holder and raises the epoch and the counter to the
  token's.  An exclusive grant replaces every holder of the name; a shared
  lease or a semaphore permit (the record's ``shared`` / ``limit``) replaces an
  exclusive holder, the same owner's lease and permits under another limit,
  and joins the other holders (as ``LockTable.install_holder``);
* RELEASE and EXPIRE remove the holder whose token matches;
* REVOKE (an operator's force-release, an audit record with who and why) removes
  the holder whose token matches, as RELEASE does;
* EXTEND sets the ``ttl_ms`` of the holder whose token matches;
* EPOCH raises the epoch; RESERVE raises the counter;
* KEY_PUT sets a key when it has no lease or its lease (lock name, token) is
  the current holder (a put attached to a lease already gone changes nothing);
  KEY_DELETE removes a key; a RELEASE or EXPIRE that removes a holder also
  removes every key attached to that lease (see :mod:`fastlock.wal.keyspace`);
  KEY_MOVED removes a key as KEY_DELETE does (a slot move gave it to another
  shard group: its watchers are told "moved", not "delete");
* LOCK_DELAY keeps, per name, the latest wall-clock end of a running
  lock-delay (recovery installs those still running; see :class:`LockDelay`);
* REVOKE_REQUEST keeps the deadline of a revoke request made to the lease
  (name, token) while that lease holds (the end of the lease drops it; see
  :class:`RevokeRequest`);
* SLOTS_ADOPTED raises the epoch to the adopted one and tells the target that this
  shard group imported slots ``first..last`` by a move (a standby's shard gate takes
  their flip only then, :mod:`fastlock.server.sharded`; see :class:`SlotsAdopted`);
  recovery keeps the slots and the waiter queue parts in :class:`ImportedSlots`, which a
  snapshot carries too (the slots imported and not yet taken when it was written);
* SLOTS_UNADOPTED tells the target that this shard group owns slots ``first..last``
  without their token floor (a standby's shard gate answers their names Unavailable
  until a SLOTS_ADOPTED record of them; recovery leaves it to the data directory's
  ``unadopted-slots.json``; see :class:`SlotsUnadopted`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from ..tokens import COUNTER_MASK, TOKEN_EPOCH_SHIFT, epoch_of
from .keyspace import KeySpace

__all__ = [
    "GRANT", "RELEASE", "EXPIRE", "EXTEND", "EPOCH", "RESERVE", "REVOKE", "KEY_PUT", "KEY_DELETE", "LOCK_DELAY",
    "RECORD_NAMES", "TOKEN_EPOCH_SHIFT", "COUNTER_MASK", "SHORT_GRANT",
    "Grant", "Release", "Expire", "Extend", "Epoch", "Reserve", "Revoke", "KeyPut", "KeyDelete", "LockDelay", "Record",
    "REVOKE_REQUEST", "RevokeRequest", "KEY_MOVED", "KeyMoved", "SLOTS_ADOPTED", "SlotsAdopted",
    "SLOTS_UNADOPTED", "SlotsUnadopted",
    "ImportedSlots", "HolderRecord", "LeaseMeta", "encode", "decode", "apply", "ApplyTarget", "LogState",
]

GRANT = 1
RELEASE = 2
EXPIRE = 3
EXTEND = 4
EPOCH = 5
RESERVE = 6
REVOKE = 10
LOCK_DELAY = 20
KEY_PUT = 30
KEY_DELETE = 31
REVOKE_REQUEST = 70
KEY_MOVED = 80
SLOTS_ADOPTED = 81
SLOTS_UNADOPTED = 86
RECORD_NAMES = {GRANT: "grant", RELEASE: "release", EXPIRE: "expire", EXTEND: "extend",
                EPOCH: "epoch", RESERVE: "reserve", REVOKE: "revoke",
                KEY_PUT: "key_put", KEY_DELETE: "key_delete", LOCK_DELAY: "lock_delay",
                REVOKE_REQUEST: "revoke_request", KEY_MOVED: "key_moved", SLOTS_ADOPTED: "slots_adopted",
                SLOTS_UNADOPTED: "slots_unadopted"}



class Grant(NamedTuple):
    """GRANT: ``name`` is held by the lease ``token``.  Times in milliseconds;
    ``wall_ms`` is the wall clock at logging (ms since the Unix epoch, audit only).

    ``shared`` (a shared lease) and ``limit`` (a semaphore permit's limit, 0 for a
    lock) are written only when one is set: an exclusive grant is the 8-field
    record every earlier fastlock wrote and reads (:func:`encode`)."""

    name: str
    token: int
    owner_hash: bytes
    ttl_ms: int
    lock_delay_ms: int
    client: str | None  # "principal:client_name" (bare client name in older logs)
    correlation_id: str | None
    wall_ms: int
    shared: bool = False
    limit: int = 0

    @property
    def kind(self) -> int:
        """The record type (``GRANT``), the first item of the array on disk."""
        return GRANT


class Release(NamedTuple):
    """RELEASE: the holder with ``token`` released ``name``."""

    name: str
    token: int
    wall_ms: int

    @property
    def kind(self) -> int:
        """The record type (``RELEASE``), the first item of the array on disk."""
        return RELEASE


class Expire(NamedTuple):
    """EXPIRE: the lease ``token`` on ``name`` ran out (only a primary expires leases)."""

    name: str
    token: int
    wall_ms: int

    @property
    def kind(self) -> int:
        """The record type (``EXPIRE``), the first item of the array on disk."""
        return EXPIRE


class Extend(NamedTuple):
    """EXTEND: the lease ``token`` on ``name`` now has ``ttl_ms`` (milliseconds)."""

    name: str
    token: int
    ttl_ms: int
    wall_ms: int

    @property
    def kind(self) -> int:
        """The record type (``EXTEND``), the first item of the array on disk."""
        return EXTEND


class Epoch(NamedTuple):
    """EPOCH: the epoch is now at least ``epoch``."""

    epoch: int
    wall_ms: int

    @property
    def kind(self) -> int:
        """The record type (``EPOCH``), the first item of the array on disk."""
        return EPOCH


class Reserve(NamedTuple):
    """RESERVE: counter values up to ``counter`` may be issued (``interval``/``never`` modes)."""

    counter: int
    wall_ms: int

    @property
    def kind(self) -> int:
        """The record type (``RESERVE``), the first item of the array on disk."""
        return RESERVE


class Revoke(NamedTuple):
    """REVOKE: an operator force-released the lease ``token`` on ``name``: ``principal``
    (the authenticated principal that asked) and ``reason`` (free text, may be None) are
    kept for the audit dump.  Replayed as a RELEASE of that token."""

    name: str
    token: int
    principal: str
    reason: str | None
    wall_ms: int

    @property
    def kind(self) -> int:
        """The record type (``REVOKE``), the first item of the array on disk."""
        return REVOKE


class KeyPut(NamedTuple):
    """KEY_PUT: ``key`` holds ``value``, attached to the lease (``lease_name``, ``token``)
    or to none (``lease_name`` None, ``token`` 0); written by ``principal``."""

    key: str
    value: bytes
    lease_name: str | None
    token: int
    principal: str | None
    wall_ms: int

    @property
    def kind(self) -> int:
        """The record type (``KEY_PUT``), the first item of the array on disk."""
        return KEY_PUT


class KeyDelete(NamedTuple):
    """KEY_DELETE: ``key`` was deleted."""

    key: str
    wall_ms: int

    @property
    def kind(self) -> int:
        """The record type (``KEY_DELETE``), the first item of the array on disk."""
        return KEY_DELETE


class LockDelay(NamedTuple):
    """LOCK_DELAY: no grant of ``name`` before ``until_wall_ms`` (wall clock, ms since
    the Unix epoch).  Logged when a lease with a lock-delay expires, and again for
    every running delay right after a snapshot (which holds leases only), so that a
    restart or a promoted standby keeps the lock unavailable until the delay has
    passed.  The wall clock is the only one that survives a restart; recovery caps
    what is left at the longest lock-delay (60 s), so a clock jump cannot extend it."""

    name: str
    until_wall_ms: int
    wall_ms: int

    @property
    def kind(self) -> int:
        """The record type (``LOCK_DELAY``), the first item of the array on disk."""
        return LOCK_DELAY


class RevokeRequest(NamedTuple):
    """REVOKE_REQUEST: ``principal`` asked the holder of the lease ``token`` on ``name``
    to yield (:mod:`fastlock.server.preemption`); unless it has ended by then, the
    serving primary revokes it at the deadline.  The deadline is written twice:
    ``grace_ms``, the milliseconds it had left when the record was logged (a standby
    counts them from the record's arrival, so its deadline is never earlier than the
    primary's), and ``until_wall_ms`` (wall clock, ms since the Unix epoch: the only
    clock that survives a restart; recovery caps what is left at the longest grace).
    Logged at the request, and again for every running request right after a
    snapshot (which holds leases only)."""

    name: str
    token: int
    principal: str
    until_wall_ms: int
    grace_ms: int
    wall_ms: int

    @property
    def kind(self) -> int:
        """The record type (``REVOKE_REQUEST``), the first item of the array on disk."""
        return REVOKE_REQUEST


class KeyMoved(NamedTuple):
    """KEY_MOVED: ``key`` left this shard group for group ``to_group`` (a slot move,
    :mod:`fastlock.server.slotmove`): removed here as by KEY_DELETE, but not deleted."""

    key: str
    to_group: str
    wall_ms: int

    @property
    def kind(self) -> int:
        """The record type (``KEY_MOVED``), the first item of the array on disk."""
        return KEY_MOVED


class SlotsAdopted(NamedTuple):
    """SLOTS_ADOPTED: this shard group's primary imported a page of the state of slots
    ``first..last`` by a move (:mod:`fastlock.server.slotmove`), above the source's token
    high-water mark ``floor`` (a fencing token), at ``epoch`` (the group's epoch after the
    import: at least the floor's).  ``queues``: the page's waiter queue parts, each
    ``[name, [owner-key hash, ...]]`` in FIFO order.  Written after the page's EPOCH,
    RESERVE, GRANT and KEY_PUT records, so a standby that has it has the page's state."""

    first: int
    last: int
    floor: int
    epoch: int
    queues: list
    wall_ms: int

    @property
    def kind(self) -> int:
        """The record type (``SLOTS_ADOPTED``), the first item of the array on disk."""
        return SLOTS_ADOPTED


class SlotsUnadopted(NamedTuple):
    """SLOTS_UNADOPTED: this shard group owns slots ``first..last`` without their token floor (a
    map gave them by a flip with no import: :class:`SlotsAdopted` never logged), so its nodes
    answer their names Unavailable until a SLOTS_ADOPTED record of them.  Logged by the primary
    when it takes such a map and again after every snapshot it sends (a standby that joins later
    learns it: :mod:`fastlock.server.sharded`)."""

    first: int
    last: int
    wall_ms: int

    @property
    def kind(self) -> int:
        """The record type (``SLOTS_UNADOPTED``), the first item of the array on disk."""
        return SLOTS_UNADOPTED


#: the most slots an :class:`ImportedSlots` may name (a sanity bound: a shard map has 16,384)
MAX_IMPORTED_SLOT = 1 << 16
#: the longest owner-key hash an :class:`ImportedSlots` queue may hold (bytes)
MAX_IMPORTED_OWNER_BYTES = 64


class ImportedSlots(NamedTuple):
    """What a shard group imported by slot moves (SLOTS_ADOPTED records) and has not taken yet
    by their flip or abort: ``slots``, the imported slots, ascending; ``queues``, name -> the
    moved waiters' owner-key hashes in FIFO order (:class:`fastlock.server.sharded.ShardGate`'s
    ``imported`` and ``imported_queues``).  A snapshot stores it as :meth:`to_list`; recovery
    rebuilds it from the snapshot's and the SLOTS_ADOPTED records after it."""

    slots: list[int]
    queues: dict[str, list[bytes]]

    def to_list(self) -> list:
        """``[slots, [[name, [owner-key hash, ...]], ...]]``: what a snapshot stores."""
        return [list(self.slots), [[name, list(owners)] for name, owners in self.queues.items()]]

    @classmethod
    def from_list(cls, value: Any) -> ImportedSlots:
        """The value :meth:`to_list` gave, checked.

        :raises ValueError: not that shape: slots that are not ints in 0..65535, a queue that is not
            a str name and a list of owner-key hashes (bytes of 1..64), a name twice.
        """
        if type(value) is not list or len(value) != 2 or type(value[0]) is not list or type(value[1]) is not list:
            raise ValueError("the imported slots are not [slots, queues]")
        slots = value[0]
        if not all(type(x) is int and 0 <= x < MAX_IMPORTED_SLOT for x in slots):
            raise ValueError(f"the imported slots are not ints in 0..{MAX_IMPORTED_SLOT - 1}")
        queues: dict[str, list[bytes]] = {}
        for part in value[1]:
            if (type(part) is not list or len(part) != 2 or type(part[0]) is not str or type(part[1]) is not list
                    or not all(type(o) is bytes and 0 < len(o) <= MAX_IMPORTED_OWNER_BYTES for o in part[1])):
                raise ValueError("an imported queue is not [name, [owner-key hash, ...]]")
            if part[0] in queues:
                raise ValueError(f"the imported queue of {part[0]!r:.100} is there twice")
            queues[part[0]] = part[1]
        return cls(sorted(set(slots)), queues)


Record = (Grant | Release | Expire | Extend | Epoch | Reserve | Revoke | KeyPut | KeyDelete | LockDelay | RevokeRequest
          | KeyMoved | SlotsAdopted | SlotsUnadopted)

_TYPES: dict[int, Any] = {GRANT: Grant, RELEASE: Release, EXPIRE: Expire, EXTEND: Extend,
                          EPOCH: Epoch, RESERVE: Reserve, REVOKE: Revoke,
                          KEY_PUT: KeyPut, KEY_DELETE: KeyDelete, LOCK_DELAY: LockDelay,
                          REVOKE_REQUEST: RevokeRequest, KEY_MOVED: KeyMoved, SLOTS_ADOPTED: SlotsAdopted,
                          SLOTS_UNADOPTED: SlotsUnadopted}
#: (type, length of the array) -> record class: the shape of every record body with all
#: its fields (an exclusive grant's shorter body is decoded by :func:`decode`)
SHAPES: dict[tuple[int, int], Any] = {(kind, len(cls._fields) + 1): cls for kind, cls in _TYPES.items()}
#: the array length of an exclusive grant: its type and the 8 fields before ``shared`` and ``limit``
SHORT_GRANT = len(Grant._fields) - 1


def encode(record: Record) -> list:
    """The record as the msgpack array written to disk: ``[type, field, ...]``
    (an exclusive :class:`Grant` without its ``shared`` and ``limit``)."""
    if type(record) is Grant and not record.shared and not record.limit:
        return [GRANT, *record[:SHORT_GRANT - 1]]
    return [record.kind, *record]


def decode(body: Any) -> Record:
    """The typed record for a decoded msgpack array ``[type, field, ...]``.

    :raises ValueError: not a list, an unknown type, or the wrong number of fields
        (field values are not checked: a CRC-checked log holds what the server wrote,
        and the standby checks what it needs).
    """
    if type(body) is list and body and type(body[0]) is int:
        cls = SHAPES.get((body[0], len(body)))
        if cls is not None:
            return tuple.__new__(cls, body[1:])
        if body[0] == GRANT and len(body) == SHORT_GRANT:
            return tuple.__new__(Grant, (*body[1:], False, 0))
        if body[0] in _TYPES:
            kind = body[0]
            raise ValueError(f"{RECORD_NAMES[kind]} record with {len(body) - 1} fields, "
                             f"not {len(_TYPES[kind]._fields)}")
    raise ValueError(f"not a record: {body!r:.80}")


class LeaseMeta(NamedTuple):
    """What the lock table keeps beside a lease for status and audit (its ``meta``)."""

    client: str | None
    correlation_id: str | None


class HolderRecord(NamedTuple):
    """A lease as the WAL remembers it (snapshot entry / recovered holder).

    On disk a snapshot holds each as the msgpack array of these fields, in order:
    the first 8 for an exclusive lease (as every earlier fastlock), all 10 for a
    shared lease or a semaphore permit (:meth:`stored`).
    """

    name: str
    token: int  # (epoch << 40) | counter
    owner: bytes  # the owner key's hash
    ttl_ms: int  # lease duration, milliseconds
    lock_delay_ms: int  # milliseconds
    client_name: str | None
    correlation_id: str | None
    granted_wall_ms: int  # wall clock at grant, ms since the Unix epoch; audit only (0 if unknown)
    shared: bool = False  # a shared (read) lease
    limit: int = 0  # a semaphore permit's limit; 0 for a lock's lease

    @classmethod
    def from_grant(cls, g: Grant) -> HolderRecord:
        return tuple.__new__(cls, g)  # the same 10 fields in the same order

    @classmethod
    def from_list(cls, item: Any) -> HolderRecord:
        """A holder as stored in a snapshot.  :raises ValueError: not a list of 8 or 10 items."""
        if type(item) is not list or len(item) not in (8, 10):
            raise ValueError(f"snapshot holder must be a list of 8 or 10 items: {item!r:.80}")
        if len(item) == 8:
            return tuple.__new__(cls, (*item, False, 0))
        return tuple.__new__(cls, item)

    def stored(self) -> tuple:
        """The fields a snapshot stores: 8 for an exclusive lease, else 10."""
        return tuple(self) if self.shared or self.limit else tuple(self)[:8]


class ApplyTarget(Protocol):
    """Where :func:`apply` makes a record's effect: a state that knows its holders'
    tokens, its epoch and its counter.  Each method is called only when the record
    changes something (the token matched, the value is higher)."""

    @property
    def epoch(self) -> int:
        """The highest epoch applied."""
        ...

    @property
    def counter(self) -> int:
        """The highest token counter applied."""
        ...

    def holds(self, name: str, token: int) -> bool:
        """Whether the lease ``token`` is a current holder of ``name``."""
        ...

    def install(self, grant: Grant) -> None:
        """Make ``grant`` a holder of its lock (replacing as the module docstring says);
        raise epoch and counter to its token's."""
        ...

    def remove(self, record: Release | Expire | Revoke) -> None:
        """Drop the holder ``record.token`` of ``record.name`` (it holds)."""
        ...

    def set_ttl(self, record: Extend) -> None:
        """Give the holder ``record.token`` of ``record.name`` the TTL ``record.ttl_ms`` (it holds)."""
        ...

    def raise_epoch(self, epoch: int) -> None:
        """Raise the epoch to ``epoch`` (higher than the current one)."""
        ...

    def raise_counter(self, counter: int) -> None:
        """Raise the counter to ``counter`` (higher than the current one)."""
        ...

    def set_lock_delay(self, record: LockDelay) -> None:
        """Keep the lock-delay of ``record.name`` running until ``record.until_wall_ms``."""
        ...

    @property
    def keys(self) -> KeySpace:
        """The key space: KEY_PUT, KEY_DELETE and the end of a lease change it through
        :meth:`put_key`, :meth:`delete_key` and :meth:`lease_ended`."""
        ...

    def put_key(self, record: KeyPut) -> None:
        """Set ``record.key`` (its lease, if any, is the current holder)."""
        ...

    def delete_key(self, record: KeyDelete | KeyMoved) -> None:
        """Remove ``record.key`` (it is present; a KEY_MOVED's key went to another shard group)."""
        ...

    def lease_ended(self, name: str, token: int) -> None:
        """Remove every key attached to the lease ``(name, token)`` (there are some)."""
        ...

    def request_revoke(self, record: RevokeRequest) -> None:
        """Keep the deadline of a revoke request to the lease ``(record.name, record.token)`` (it holds)."""
        ...

    def adopt_slots(self, record: SlotsAdopted) -> None:
        """Know that this shard group imported slots ``record.first..record.last`` by a move."""
        ...

    def unadopt_slots(self, record: SlotsUnadopted) -> None:
        """Know that this shard group owns slots ``record.first..record.last`` without their token floor."""
        ...


def apply(record: Record, target: ApplyTarget) -> bool:
    """Apply one record to ``target`` by the rules in the module docstring;
    return True if it changed something."""
    if type(record) is Grant:
        target.install(record)
        return True
    if type(record) is Release or type(record) is Expire or type(record) is Revoke:
        if not target.holds(record.name, record.token):
            return False
        target.remove(record)
        if (record.name, record.token) in target.keys.by_lease:
            target.lease_ended(record.name, record.token)
        return True
    if type(record) is Extend:
        if not target.holds(record.name, record.token):
            return False
        target.set_ttl(record)
        return True
    if type(record) is LockDelay:
        target.set_lock_delay(record)
        return True
    if type(record) is Epoch:
        if record.epoch > target.epoch:
            target.raise_epoch(record.epoch)
            return True
        return False
    if type(record) is Reserve and record.counter > target.counter:
        target.raise_counter(record.counter)
        return True
    if type(record) is KeyPut:
        if record.lease_name is not None and not target.holds(record.lease_name, record.token):
            return False
        target.put_key(record)
        return True
    if type(record) is KeyDelete or type(record) is KeyMoved:
        if target.keys.get(record.key) is None:
            return False
        target.delete_key(record)
        return True
    if type(record) is RevokeRequest:
        if not target.holds(record.name, record.token):
            return False
        target.request_revoke(record)
        return True
    if type(record) is SlotsAdopted:
        if record.epoch > target.epoch:
            target.raise_epoch(record.epoch)
        target.adopt_slots(record)
        return True
    if type(record) is SlotsUnadopted:
        target.unadopt_slots(record)
        return True
    return False


class LogState:
    """The lock table as the log describes it: holders by name, epoch, counter.

    What recovery rebuilds (from a snapshot, then every record after it, each
    through :func:`apply`) and hands to the server as a
    :class:`~fastlock.wal.RecoveredState`.  ``holders`` maps a lock name to its
    holders by token, each with its 10 fields: the :class:`Grant` record that
    installed it (a GRANT and a :class:`HolderRecord` have the same fields in the
    same order, so recovery does not copy every grant) or a
    :class:`HolderRecord`; :meth:`holder_records` gives them all as HolderRecords.
    """

    __slots__ = ("holders", "epoch", "counter", "keys", "lock_delays", "revoke_requests", "imported_slots",
                 "imported_queues")

    def __init__(self, epoch: int = 0, counter: int = 0, holders: list[HolderRecord] | None = None,
                 keys: KeySpace | None = None, imports: ImportedSlots | None = None):
        self.holders: dict[str, dict[int, Grant | HolderRecord]] = {}
        for h in holders or ():
            self.holders.setdefault(h.name, {})[h.token] = h
        self.epoch = epoch
        self.counter = counter
        self.keys = keys if keys is not None else KeySpace()
        #: name -> wall-clock ms until which its lock-delay runs (past ones too: recovery filters)
        self.lock_delays: dict[str, int] = {}
        #: (name, token) -> the latest revoke request to that lease while it holds
        self.revoke_requests: dict[tuple[str, int], RevokeRequest] = {}
        #: the slots imported by moves (a snapshot's, then every SLOTS_ADOPTED record's after it)
        self.imported_slots: set[int] = set(imports.slots) if imports is not None else set()
        #: name -> the moved waiters' owner-key hashes, FIFO (merged as the shard gate merges them)
        self.imported_queues: dict[str, list[bytes]] = (
            {n: list(q) for n, q in imports.queues.items()} if imports is not None else {})

    def imports(self) -> ImportedSlots | None:
        """The slots and queues imported by moves, as the snapshot and the log after it say
        (None: none); the shard gate takes off those whose flip or abort it served already."""
        if not self.imported_slots and not self.imported_queues:
            return None
        return ImportedSlots(sorted(self.imported_slots), self.imported_queues)

    def holder_records(self) -> list[HolderRecord]:
        """Every holder, as :class:`HolderRecord`."""
        return [h if type(h) is HolderRecord else tuple.__new__(HolderRecord, h)
                for by_token in self.holders.values() for h in by_token.values()]

    def lease_count(self) -> int:
        """The number of leases (each shared holder and permit counts)."""
        return sum(len(by_token) for by_token in self.holders.values())

    def holds(self, name: str, token: int) -> bool:
        by_token = self.holders.get(name)
        return by_token is not None and token in by_token

    def install(self, grant: Grant) -> None:
        by_token = self.holders.get(grant.name)
        if by_token is None or (not grant[8] and not grant[9]):  # the common case: exclusive
            self.holders[grant.name] = {grant.token: grant}
        else:
            # fields 2, 8, 9: owner hash, shared, limit (the same in a Grant and a HolderRecord)
            for token in [t for t, h in by_token.items()
                          if (not h[8] and not h[9]) or h[2] == grant[2] or h[9] != grant[9]]:
                del by_token[token]
            by_token[grant.token] = grant
        token = grant.token
        if token & COUNTER_MASK > self.counter:
            self.counter = token & COUNTER_MASK
        if epoch_of(token) > self.epoch:
            self.epoch = epoch_of(token)

    def remove(self, record: Release | Expire | Revoke) -> None:
        by_token = self.holders[record.name]
        del by_token[record.token]
        if not by_token:
            del self.holders[record.name]
        if self.revoke_requests:
            self.revoke_requests.pop((record.name, record.token), None)

    def set_ttl(self, record: Extend) -> None:
        by_token = self.holders[record.name]
        h = by_token[record.token]
        by_token[record.token] = tuple.__new__(HolderRecord, (*h[:3], record.ttl_ms, *h[4:]))

    def raise_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def raise_counter(self, counter: int) -> None:
        self.counter = counter

    def set_lock_delay(self, record: LockDelay) -> None:
        if record.until_wall_ms > self.lock_delays.get(record.name, 0):
            self.lock_delays[record.name] = record.until_wall_ms

    def put_key(self, record: KeyPut) -> None:
        self.keys.put(record.key, record.value, record.lease_name, record.token, record.principal, record.wall_ms)

    def delete_key(self, record: KeyDelete | KeyMoved) -> None:
        self.keys.delete(record.key)

    def lease_ended(self, name: str, token: int) -> None:
        self.keys.lease_ended(name, token)

    def request_revoke(self, record: RevokeRequest) -> None:
        self.revoke_requests[(record.name, record.token)] = record

    def unadopt_slots(self, record: SlotsUnadopted) -> None:
        """Nothing: a node keeps the slots it owns without their floor in its data directory
        (``unadopted-slots.json``); a standby takes the record as it applies it."""

    def adopt_slots(self, record: SlotsAdopted) -> None:
        """Add slots ``record.first..record.last`` and the record's queue parts (an owner known
        already keeps its place; new ones follow in the part's order); a malformed part is left
        out (the shard gate checks the slots' range)."""
        first, last = record.first, record.last
        if type(first) is not int or type(last) is not int or not 0 <= first <= last < MAX_IMPORTED_SLOT:
            return
        self.imported_slots.update(range(first, last + 1))
        for part in record.queues if type(record.queues) is list else ():
            if type(part) is list and len(part) == 2 and type(part[0]) is str and type(part[1]) is list:
                queue = self.imported_queues.setdefault(part[0], [])
                known = set(queue)
                queue.extend(o for o in dict.fromkeys(part[1]) if type(o) is bytes
                             and 0 < len(o) <= MAX_IMPORTED_OWNER_BYTES and o not in known)
