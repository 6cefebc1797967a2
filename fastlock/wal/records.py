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
* EXTEND sets the ``ttl_ms`` of the holder whose token matches;
* EPOCH raises the epoch; RESERVE raises the counter;
* LOCK_DELAY keeps, per name, the latest wall-clock end of a running
  lock-delay (recovery installs those still running; see :class:`LockDelay`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Union

__all__ = [
    "GRANT", "RELEASE", "EXPIRE", "EXTEND", "EPOCH", "RESERVE", "LOCK_DELAY", "RECORD_NAMES", "LockDelay",
    "TOKEN_EPOCH_SHIFT", "COUNTER_MASK",
    "Grant", "Release", "Expire", "Extend", "Epoch", "Reserve", "Record",
    "HolderRecord", "LeaseMeta", "SHORT_GRANT", "encode", "decode", "apply", "ApplyTarget", "LogState",
]

GRANT = 1
RELEASE = 2
EXPIRE = 3
EXTEND = 4
EPOCH = 5
RESERVE = 6
LOCK_DELAY = 20
RECORD_NAMES = {GRANT: "grant", RELEASE: "release", EXPIRE: "expire", EXTEND: "extend",
                EPOCH: "epoch", RESERVE: "reserve", LOCK_DELAY: "lock_delay"}

#: token = (epoch << TOKEN_EPOCH_SHIFT) | counter (mirrors fastlock._core, kept
#: here so that the WAL and its tools do not need the compiled core).
TOKEN_EPOCH_SHIFT = 40
COUNTER_MASK = (1 << TOKEN_EPOCH_SHIFT) - 1


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

    kind = GRANT


class Release(NamedTuple):
    """RELEASE: the holder with ``token`` released ``name``."""

    name: str
    token: int
    wall_ms: int

    kind = RELEASE


class Expire(NamedTuple):
    """EXPIRE: the lease ``token`` on ``name`` ran out (only a primary expires leases)."""

    name: str
    token: int
    wall_ms: int

    kind = EXPIRE


class Extend(NamedTuple):
    """EXTEND: the lease ``token`` on ``name`` now has ``ttl_ms`` (milliseconds)."""

    name: str
    token: int
    ttl_ms: int
    wall_ms: int

    kind = EXTEND


class Epoch(NamedTuple):
    """EPOCH: the epoch is now at least ``epoch``."""

    epoch: int
    wall_ms: int

    kind = EPOCH


class Reserve(NamedTuple):
    """RESERVE: counter values up to ``counter`` may be issued (``interval``/``never`` modes)."""

    counter: int
    wall_ms: int

    kind = RESERVE


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

    kind = LOCK_DELAY


Record = Union[Grant, Release, Expire, Extend, Epoch, Reserve, LockDelay]

_TYPES: dict[int, Any] = {GRANT: Grant, RELEASE: Release, EXPIRE: Expire, EXTEND: Extend,
                          EPOCH: Epoch, RESERVE: Reserve, LOCK_DELAY: LockDelay}
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

    epoch: int
    counter: int

    def holds(self, name: str, token: int) -> bool:
        """Whether the lease ``token`` is a current holder of ``name``."""
        ...

    def install(self, grant: Grant) -> None:
        """Make ``grant`` a holder of its lock (replacing as the module docstring says);
        raise epoch and counter to its token's."""
        ...

    def remove(self, record: Release | Expire) -> None:
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


def apply(record: Record, target: ApplyTarget) -> bool:
    """Apply one record to ``target`` by the rules in the module docstring;
    return True if it changed something."""
    kind = type(record)
    if kind is Grant:
        target.install(record)  # type: ignore[arg-type]
        return True
    if kind is Release or kind is Expire or kind is Extend:
        if not target.holds(record.name, record.token):  # type: ignore[union-attr]
            return False
        if kind is Extend:
            target.set_ttl(record)  # type: ignore[arg-type]
        else:
            target.remove(record)  # type: ignore[arg-type]
        return True
    if kind is LockDelay:
        target.set_lock_delay(record)  # type: ignore[arg-type]
        return True
    if kind is Epoch:
        if record.epoch > target.epoch:  # type: ignore[union-attr]
            target.raise_epoch(record.epoch)  # type: ignore[union-attr]
            return True
        return False
    if record.counter > target.counter:  # type: ignore[union-attr]
        target.raise_counter(record.counter)  # type: ignore[union-attr]
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

    __slots__ = ("holders", "epoch", "counter", "lock_delays")

    def __init__(self, epoch: int = 0, counter: int = 0, holders: list[HolderRecord] | None = None):
        self.holders: dict[str, dict[int, Grant | HolderRecord]] = {}
        for h in holders or ():
            self.holders.setdefault(h.name, {})[h.token] = h
        self.epoch = epoch
        self.counter = counter
        #: name -> wall-clock ms until which its lock-delay runs (past ones too: recovery filters)
        self.lock_delays: dict[str, int] = {}

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
        if token >> TOKEN_EPOCH_SHIFT > self.epoch:
            self.epoch = token >> TOKEN_EPOCH_SHIFT

    def remove(self, record: Release | Expire) -> None:
        by_token = self.holders[record.name]
        del by_token[record.token]
        if not by_token:
            del self.holders[record.name]

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
