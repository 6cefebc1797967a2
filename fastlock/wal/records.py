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

* GRANT installs the holder (replacing any), and raises the epoch and the
  counter to the token's;
* RELEASE and EXPIRE remove the holder when its token matches;
* REVOKE (an operator's force-release, an audit record with who and why) removes
  the holder when its token matches, as RELEASE does;
* EXTEND sets the holder's ``ttl_ms`` when its token matches;
* EPOCH raises the epoch; RESERVE raises the counter;
* KEY_PUT sets a key when it has no lease or its lease (lock name, token) is
  the current holder (a put attached to a lease already gone changes nothing);
  KEY_DELETE removes a key; a RELEASE or EXPIRE that removes a holder also
  removes every key attached to that lease (see :mod:`fastlock.wal.keyspace`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from .keyspace import KeySpace

__all__ = [
    "GRANT", "RELEASE", "EXPIRE", "EXTEND", "EPOCH", "RESERVE", "REVOKE", "KEY_PUT", "KEY_DELETE", "RECORD_NAMES",
    "TOKEN_EPOCH_SHIFT", "COUNTER_MASK",
    "Grant", "Release", "Expire", "Extend", "Epoch", "Reserve", "Revoke", "KeyPut", "KeyDelete", "Record",
    "HolderRecord", "LeaseMeta", "encode", "decode", "apply", "ApplyTarget", "LogState",
]

GRANT = 1
RELEASE = 2
EXPIRE = 3
EXTEND = 4
EPOCH = 5
RESERVE = 6
REVOKE = 10
KEY_PUT = 30
KEY_DELETE = 31
RECORD_NAMES = {GRANT: "grant", RELEASE: "release", EXPIRE: "expire", EXTEND: "extend",
                EPOCH: "epoch", RESERVE: "reserve", REVOKE: "revoke",
                KEY_PUT: "key_put", KEY_DELETE: "key_delete"}

#: token = (epoch << TOKEN_EPOCH_SHIFT) | counter (mirrors fastlock._core, kept
#: here so that the WAL and its tools do not need the compiled core).
TOKEN_EPOCH_SHIFT = 40
COUNTER_MASK = (1 << TOKEN_EPOCH_SHIFT) - 1


class Grant(NamedTuple):
    """GRANT: ``name`` is held by the lease ``token``.  Times in milliseconds;
    ``wall_ms`` is the wall clock at logging (ms since the Unix epoch, audit only)."""

    name: str
    token: int
    owner_hash: bytes
    ttl_ms: int
    lock_delay_ms: int
    client: str | None  # "principal:client_name" (bare client name in older logs)
    correlation_id: str | None
    wall_ms: int

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


Record = Grant | Release | Expire | Extend | Epoch | Reserve | Revoke | KeyPut | KeyDelete

_TYPES: dict[int, Any] = {GRANT: Grant, RELEASE: Release, EXPIRE: Expire, EXTEND: Extend,
                          EPOCH: Epoch, RESERVE: Reserve, REVOKE: Revoke,
                          KEY_PUT: KeyPut, KEY_DELETE: KeyDelete}
#: (type, length of the array) -> record class: the shape of every valid record body
SHAPES: dict[tuple[int, int], Any] = {(kind, len(cls._fields) + 1): cls for kind, cls in _TYPES.items()}


def encode(record: Record) -> list:
    """The record as the msgpack array written to disk: ``[type, field, ...]``."""
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

    On disk a snapshot holds each as the msgpack array of these 8 fields, in order.
    """

    name: str
    token: int  # (epoch << 40) | counter
    owner: bytes  # the owner key's hash
    ttl_ms: int  # lease duration, milliseconds
    lock_delay_ms: int  # milliseconds
    client_name: str | None
    correlation_id: str | None
    granted_wall_ms: int  # wall clock at grant, ms since the Unix epoch; audit only (0 if unknown)

    @classmethod
    def from_grant(cls, g: Grant) -> HolderRecord:
        return tuple.__new__(cls, g)  # the same 8 fields in the same order

    @classmethod
    def from_list(cls, item: Any) -> HolderRecord:
        """A holder as stored in a snapshot.  :raises ValueError: not a list of 8 items."""
        if type(item) is not list or len(item) != 8:
            raise ValueError(f"snapshot holder must be a list of 8 items: {item!r:.80}")
        return tuple.__new__(cls, item)


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

    def holder_token(self, name: str) -> int | None:
        """The token of ``name``'s current holder, or None."""
        ...

    def install(self, grant: Grant) -> None:
        """Make ``grant`` the holder of its lock (replacing any); raise epoch and counter to its token's."""
        ...

    def remove(self, record: Release | Expire | Revoke) -> None:
        """Drop the holder of ``record.name`` (its token matched)."""
        ...

    def set_ttl(self, record: Extend) -> None:
        """Give the holder of ``record.name`` the TTL ``record.ttl_ms`` (its token matched)."""
        ...

    def raise_epoch(self, epoch: int) -> None:
        """Raise the epoch to ``epoch`` (higher than the current one)."""
        ...

    def raise_counter(self, counter: int) -> None:
        """Raise the counter to ``counter`` (higher than the current one)."""
        ...

    @property
    def keys(self) -> KeySpace:
        """The key space: KEY_PUT, KEY_DELETE and the end of a lease change it through
        :meth:`put_key`, :meth:`delete_key` and :meth:`lease_ended`."""
        ...

    def put_key(self, record: KeyPut) -> None:
        """Set ``record.key`` (its lease, if any, is the current holder)."""
        ...

    def delete_key(self, record: KeyDelete) -> None:
        """Remove ``record.key`` (it is present)."""
        ...

    def lease_ended(self, name: str, token: int) -> None:
        """Remove every key attached to the lease ``(name, token)`` (there are some)."""
        ...


def apply(record: Record, target: ApplyTarget) -> bool:
    """Apply one record to ``target`` by the rules in the module docstring;
    return True if it changed something."""
    if type(record) is Grant:
        target.install(record)
        return True
    if type(record) is Release or type(record) is Expire or type(record) is Revoke:
        if target.holder_token(record.name) != record.token:
            return False
        target.remove(record)
        if (record.name, record.token) in target.keys.by_lease:
            target.lease_ended(record.name, record.token)
        return True
    if type(record) is Extend:
        if target.holder_token(record.name) != record.token:
            return False
        target.set_ttl(record)
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
        if record.lease_name is not None and target.holder_token(record.lease_name) != record.token:
            return False
        target.put_key(record)
        return True
    if type(record) is KeyDelete:
        if target.keys.get(record.key) is None:
            return False
        target.delete_key(record)
        return True
    return False


class LogState:
    """The lock table as the log describes it: holders by name, epoch, counter.

    What recovery rebuilds (from a snapshot, then every record after it, each
    through :func:`apply`) and hands to the server as a
    :class:`~fastlock.wal.RecoveredState`.  ``holders`` maps a lock name to its
    holder's 8 fields: the :class:`Grant` record that installed it (a GRANT and
    a :class:`HolderRecord` have the same fields in the same order, so recovery
    does not copy every grant) or a :class:`HolderRecord`; :meth:`holder_records`
    gives them all as HolderRecords.
    """

    __slots__ = ("holders", "epoch", "counter", "keys")

    def __init__(self, epoch: int = 0, counter: int = 0, holders: list[HolderRecord] | None = None,
                 keys: KeySpace | None = None):
        self.holders: dict[str, Grant | HolderRecord] = {h.name: h for h in holders or ()}
        self.epoch = epoch
        self.counter = counter
        self.keys = keys if keys is not None else KeySpace()

    def holder_records(self) -> list[HolderRecord]:
        """Every holder, as :class:`HolderRecord`."""
        return [h if type(h) is HolderRecord else tuple.__new__(HolderRecord, h) for h in self.holders.values()]

    def holder_token(self, name: str) -> int | None:
        h = self.holders.get(name)
        return None if h is None else h[1]  # the token: field 1 of both a Grant and a HolderRecord

    def install(self, grant: Grant) -> None:
        self.holders[grant.name] = grant
        token = grant.token
        if token & COUNTER_MASK > self.counter:
            self.counter = token & COUNTER_MASK
        if token >> TOKEN_EPOCH_SHIFT > self.epoch:
            self.epoch = token >> TOKEN_EPOCH_SHIFT

    def remove(self, record: Release | Expire | Revoke) -> None:
        del self.holders[record.name]

    def set_ttl(self, record: Extend) -> None:
        h = self.holders[record.name]
        self.holders[record.name] = tuple.__new__(HolderRecord, (*h[:3], record.ttl_ms, *h[4:]))

    def raise_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def raise_counter(self, counter: int) -> None:
        self.counter = counter

    def put_key(self, record: KeyPut) -> None:
        self.keys.put(record.key, record.value, record.lease_name, record.token, record.principal, record.wall_ms)

    def delete_key(self, record: KeyDelete) -> None:
        self.keys.delete(record.key)

    def lease_ended(self, name: str, token: int) -> None:
        self.keys.lease_ended(name, token)
