"""Exception hierarchy and the wire error-code registry.

Every error fastlock raises derives from :class:`FastlockError`.  Where an
error resembles a builtin it also subclasses that builtin (as asyncpg does), so
``except TimeoutError`` catches a lock that was not acquired in time and
``except ConnectionError`` catches a lost connection.

Errors that travel over the wire carry a stable integer ``code``.  Each class
that can be sent registers its code once; :func:`error_from_wire` maps a code
back to its class.  Registering the same code twice fails at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "FastlockError",
    "LockNotAcquired",
    "LeaseLost",
    "LeaseExpiring",
    "NotPrimary",
    "ConnectionLost",
    "ProtocolError",
    "AuthError",
    "PermissionDenied",
    "InvalidArgument",
    "WrongArgumentType",
    "LimitExceeded",
    "Cancelled",
    "Unavailable",
    "StaleFencingToken",
    "InternalServerError",
    "LimitConflict",
    "DeadlockDetected",
    "LockNotHeld",
    "AcquireLimitReached",
    "BrokenBarrier",
    "error_from_wire",
]

_REGISTRY: dict[int, type[FastlockError]] = {}
_E = TypeVar("_E", bound="FastlockError")


def _register(code: int) -> Callable[[type[_E]], type[_E]]:
    def deco(cls: type[_E]) -> type[_E]:
        if code in _REGISTRY:
            raise RuntimeError(
                f"error code {code} registered twice: {_REGISTRY[code].__name__} and {cls.__name__}"
            )
        cls.code = code
        _REGISTRY[code] = cls
        return cls

    return deco


class FastlockError(Exception):
    """Base class of every fastlock error.

    ``code`` is the stable wire code (0 for errors that never travel).
    """

    code: int = 0


@_register(1)
class ProtocolError(FastlockError):
    """A peer broke the protocol: malformed frame, unknown operation, wrong types,
    an oversized frame, or a version mismatch.  The server closes the
    connection after sending it when it cannot resynchronise."""


@_register(2)
class AuthError(FastlockError, PermissionError):
    """The handshake's credentials were missing or wrong (bad token, unknown
    principal, a banned source address, a primary that could not prove
    itself).  The server closes the connection after sending it."""


@_register(3)
class LockNotAcquired(FastlockError, TimeoutError):
    """The lock was not granted within ``wait`` seconds (``wait=0``: it was held)."""


class AlreadyHeld(LockNotAcquired):
    """Raised by the client, at once and sending nothing, for a waiting acquire
    (``wait`` not 0) by a task that holds the lock already through the same
    :class:`~fastlock.client.Client` (with ``SyncClient``: the calling thread):
    it would queue behind its own lease until that lease's TTL runs out, or
    forever while it is renewed.  The server cannot tell the two requests apart
    (each acquire has its own owner key); the client keeps its last grant per
    name and the task it went to (one dict lookup per acquire).  A live lease
    counts: granted, not released, not known lost, its TTL not passed by the
    client's estimate (a lease revoked by an operator counts until the client
    learns of it).  A shared lease or a permit asked beside a shared lease or a
    permit is not refused; unrelated tasks of the client queue as usual.  With
    ``wait=0`` the server answers (its message names a same-connection holder).
    ``token`` is the held lease's fencing token.  Pass ``queue_behind_self=True``
    to queue anyway (a task waiting for a lease it handed to another to release)."""

    def __init__(self, message: str, token: int = 0):
        super().__init__(message)
        self.token = token


class AcquireLimitReached(AlreadyHeld):
    """Raised by the client, at once and sending nothing, for a re-entry into a
    re-entrant lock (:meth:`Client.reentrant_lock <fastlock.client.Client.reentrant_lock>`)
    whose calling task (or thread) holds it already ``acquire_limit`` times, as
    Hazelcast's ``LockAcquireLimitReachedException``: it never waits (waiting would be
    for itself).  ``token`` is the held lease's fencing token, ``count`` the hold count."""

    def __init__(self, message: str, token: int = 0, count: int = 0):
        super().__init__(message, token)
        self.count = count


class BrokenBarrier(FastlockError):
    """Raised by the client to every participant waiting at a barrier or double barrier
    (:mod:`fastlock.client.barriers`) when a participant that had entered left without
    passing it: its lease ended (its process died, or its renewals failed, and the TTL
    passed) or its entry was deleted.  As ``threading.BrokenBarrierError``; never sent."""


@_register(4)
class LeaseLost(FastlockError):
    """The lease is not the lock's current holder any more: it expired, was
    released, or never existed.  Nothing was changed on the server."""


class LeaseExpiring(LeaseLost):
    """Raised by the client, never sent: the protected work of a bounded lock
    (``client.lock(..., bounded=True)``) was stopped because the earliest moment the
    server could grant the lock to another holder, less the work's margin, came
    before a renewal moved it (see ``docs/bounded-execution.md``).  The lease may
    still be held on the server (it is released on the way out); ``name`` and
    ``token`` say which one, ``stop_at`` the moment (``loop.time()`` seconds) at
    which the work was stopped."""

    def __init__(self, message: str, name: str = "", token: int = 0, stop_at: float = 0.0):
        super().__init__(message)
        self.name = name
        self.token = token
        self.stop_at = stop_at


@_register(5)
class NotPrimary(FastlockError):
    """The server is a standby (or a deposed primary).

    ``primary`` is the ``host:port`` it believes is the primary, or None.
    """

    def __init__(self, message: str = "not primary", primary: str | None = None):
        super().__init__(message)
        self.primary = primary


@_register(6)
class InvalidArgument(FastlockError, ValueError):
    """An argument is out of range or of the wrong type (raised by the client
    before sending, or by the server if a client did not check)."""


class WrongArgumentType(InvalidArgument, TypeError):
    """An argument has the wrong type (e.g. a float where an int of
    milliseconds is due, a bool where a number is due).  Travels as
    InvalidArgument's code."""


@_register(7)
class LimitExceeded(FastlockError):
    """A server limit was reached (e.g. waiters per connection)."""


@_register(8)
class Cancelled(FastlockError):
    """A waiting acquire was cancelled (by the client, or superseded by a retry
    carrying the same acquire id)."""


@_register(9)
class Unavailable(FastlockError):
    """The server cannot serve this request now: it is shutting down, or it is
    a primary that stopped granting because it lost contact with its standby."""


@_register(10)
class LockNotHeld(FastlockError, LookupError):
    """An operator's revoke named a lock that has no holder (or no holder with the
    fencing token given).  Nothing was changed."""


@_register(16)
class PermissionDenied(FastlockError, PermissionError):
    """The authenticated principal is not granted this operation (on this lock
    name, for a client's ACL).  Nothing was changed; the connection stays open."""


@_register(20)
class KeyExists(FastlockError):
    """A create-only ``put`` found the key already present (nothing was changed)."""


@_register(21)
class KeyNotFound(FastlockError, LookupError):
    """A replace-only ``put`` found no such key (nothing was changed)."""


class ConnectionLost(FastlockError, ConnectionError):
    """The connection to the server was lost (or could not be made) and the
    request's outcome is unknown or could not be delivered."""


class StaleFencingToken(FastlockError):
    """A fenced write was refused: the caller's fencing token is lower than the
    highest token already recorded for the resource (the writer's side of
    Kleppmann's fencing contract, as Chubby's sequencer check on the server)."""

    def __init__(self, message: str, token: int | None = None, highest: int | None = None):
        super().__init__(message)
        self.token = token
        self.highest = highest


@_register(17)
class InternalServerError(FastlockError):
    """The server hit a bug while handling this request (an unexpected exception,
    logged there with its traceback).  The request's effect is unknown; the
    connection stays open and the server keeps serving (as PostgreSQL's
    ``internal_error``, SQLSTATE XX000)."""


@_register(18)
class LimitConflict(FastlockError):
    """A semaphore's limit disagrees with the name's current one: the name has
    holders or waiters as a lock, or as a semaphore with another limit (the limit
    is kept with the semaphore while it has holders or waiters, as Curator's
    InterProcessSemaphoreV2 and ``consul lock -n`` keep theirs).  Nothing changed."""


@_register(19)
class DeadlockDetected(LockNotAcquired):
    """This waiting acquire was chosen to break a deadlock (as PostgreSQL's deadlock
    detector, SQLSTATE 40P01): for longer than the server's ``--deadlock-timeout``
    (seconds), two or more parties each waited for the next one around a cycle, and
    this acquire was the youngest wait of the cycle's parties.

    A party is one task (asyncio) or thread (:mod:`fastlock.sync`) of a client
    connection: the client sends its number with each acquire, and a lease's holder
    is the party whose acquire got it.  A party that waits holds on to its leases;
    another task of the same client may still release its own.  So two tasks of one
    client waiting behind another client's holder are no deadlock, while two tasks
    of one client each holding what the other waits for are.  A client that sends no
    task number is one party per connection.  The message names the cycle as
    ``session S waits for 'name'`` steps; the leases this client holds are unchanged
    (release some, then retry)."""


def error_from_wire(code: int, message: str, extra: Any = None) -> FastlockError:
    """Build the exception for a wire error reply; unknown codes give a ProtocolError."""
    cls = _REGISTRY.get(code)
    if cls is None:
        return ProtocolError(f"unknown error code {code}: {message}")
    if cls is NotPrimary:
        return NotPrimary(message, extra if isinstance(extra, str) else None)
    if cls is Compacted:
        return Compacted(message, extra if type(extra) is int else None)
    if cls is WrongShard or cls is CrossShard:
        return cls.from_wire_extra(message, extra)
    return cls(message)


# -- storage: the write-ahead log, snapshots and the node's state files -------------------
# None of these travels over the wire (code 0).  Each also subclasses the builtin that
# callers caught before it joined the hierarchy.
__all__ += ["StorageError", "WalCorruption", "WalFatal", "DataDirInUse", "WalCompacted", "NodeFileDamaged"]


class StorageError(FastlockError):
    """Base class of the errors of the data directory: the log, its snapshots and
    the node's state files."""


class WalCorruption(StorageError):
    """The log or a snapshot is damaged in a way recovery must not paper over.

    Attributes: ``path`` (file), ``offset`` (byte offset of the bad frame or -1),
    ``lsn`` (LSN the bad frame would have had, or -1).
    """

    def __init__(self, message: str, path: str = "", offset: int = -1, lsn: int = -1):
        super().__init__(message)
        self.path = path
        self.offset = offset
        self.lsn = lsn


class WalFatal(StorageError, RuntimeError):
    """A write or fsync failed earlier: the log accepts nothing more (see the log's ``on_fatal``)."""


class DataDirInUse(StorageError, RuntimeError):
    """Another process holds the data directory's lock: two servers must never
    append to one log (they would overwrite each other's records and hand out
    the same tokens).  As etcd and ZooKeeper, the directory is locked with
    ``flock`` on its ``LOCK`` file for as long as the log is open."""


class WalCompacted(StorageError, LookupError):
    """A read of the log asked for an LSN whose segment was deleted after a snapshot."""


class NodeFileDamaged(StorageError, RuntimeError):
    """A node state file (``node-state.json``, ``pairing.json``, ``deposed.json``)
    is not the JSON object, with the field types, this node writes: the server
    refuses to start rather than guess its epoch, pairing or role."""


# -- watches that resume from a revision (fastlock.server.watchlog) --------------------------
__all__ += ["Compacted", "WatchDiverged"]


@_register(50)
class Compacted(FastlockError, LookupError):
    """A watch asked to resume from a revision older than the history the server keeps
    (``--watch-history`` changes; as etcd's ``ErrCompacted``).  ``oldest`` (int or None)
    is the oldest revision it can resume from.  Nothing changed: start a new watch,
    which begins with the lock's state now."""

    def __init__(self, message: str, oldest: int | None = None):
        super().__init__(message)
        self.oldest = oldest


@_register(51)
class WatchDiverged(FastlockError):
    """A watch asked to resume from a revision this server never had: the primary
    that delivered it lost changes its standby had not received (asynchronous
    replication) before the standby was promoted.  The changes the watch saw after
    the standby's promotion point are not in the new history; nothing changed: start
    a new watch, which begins with the lock's state now."""


# -- sharding (fastlock.sharding; error codes 60-64 are reserved for it) --------------------------
__all__ += ["WrongShard", "CrossShard"]


def _redirect_fields(extra: Any) -> dict[str, Any]:
    """The fields of a sharding error's wire ``extra`` that have their types (others dropped)."""
    if not isinstance(extra, dict):
        return {}
    fields: dict[str, Any] = {}
    for key in ("slot", "epoch"):
        if type(extra.get(key)) is int:
            fields[key] = extra[key]
    if type(extra.get("group")) is str:
        fields["group"] = extra["group"]
    addresses = extra.get("addresses")
    # within a shard map's limits (fastlock.sharding.shardmap: 16 addresses of at most 300
    # characters, 1024 groups); a redirect past them names none (the client reads its own map)
    if (isinstance(addresses, list) and len(addresses) <= 16
            and all(type(a) is str and len(a) <= 300 for a in addresses)):
        fields["addresses"] = tuple(addresses)
    groups = extra.get("groups")
    if isinstance(groups, list) and len(groups) <= 1024 and all(type(g) is str and len(g) <= 64 for g in groups):
        fields["groups"] = tuple(groups)
    return fields


@_register(60)
class WrongShard(FastlockError):
    """The node does not own the name's slot in its shard map: another group does (as Redis
    Cluster's ``MOVED``).  Nothing changed.  ``slot`` (int, 0..16383) is the name's slot,
    ``group`` the owning group's name, ``addresses`` its nodes' ``host:port`` addresses (a
    tuple of str), ``epoch`` the epoch of the node's map (int).  A routing client
    (:mod:`fastlock.client.sharded`) fetches the map again and sends the call to the owner.
    ``owner`` (bytes or None) is set by the client on an acquire's redirect: the owner key the
    acquire was sent with, so that the call sent to the owner asks with the same key (a waiter a
    slot move shipped is recognised by it)."""

    def __init__(self, message: str, slot: int | None = None, group: str | None = None,
                 addresses: tuple[str, ...] = (), epoch: int | None = None):
        super().__init__(message)
        self.slot = slot
        self.group = group
        self.addresses = addresses
        self.epoch = epoch
        self.owner: bytes | None = None

    def wire_extra(self) -> dict[str, Any]:
        """The reply's ``extra``: ``{"slot", "group", "addresses", "epoch"}``."""
        return {"slot": self.slot, "group": self.group, "addresses": list(self.addresses), "epoch": self.epoch}

    @classmethod
    def from_wire_extra(cls, message: str, extra: Any) -> WrongShard:
        fields = _redirect_fields(extra)
        return cls(message, fields.get("slot"), fields.get("group"), fields.get("addresses", ()),
                   fields.get("epoch"))


@_register(61)
class CrossShard(FastlockError, ValueError):
    """One request names several lock or key names whose slots different groups own (as Redis
    Cluster's ``CROSSSLOT``): a multi-lock, or a key attached to a lease, must stay in one
    group.  Nothing changed.  Put a hash tag in the names (``{order-17}:a``, ``{order-17}:b``)
    to keep them in one slot.  ``groups`` (a tuple of str) are the groups named, ``epoch``
    the epoch of the map that says so (int or None)."""

    def __init__(self, message: str, groups: tuple[str, ...] = (), epoch: int | None = None):
        super().__init__(message)
        self.groups = groups
        self.epoch = epoch

    def wire_extra(self) -> dict[str, Any]:
        """The reply's ``extra``: ``{"groups", "epoch"}``."""
        return {"groups": list(self.groups), "epoch": self.epoch}

    @classmethod
    def from_wire_extra(cls, message: str, extra: Any) -> CrossShard:
        fields = _redirect_fields(extra)
        return cls(message, fields.get("groups", ()), fields.get("epoch"))
__all__ += ["Wounded"]


@_register(65)
class Wounded(LockNotAcquired):
    """A cross-shard multi-lock's reservation was wounded by an older one (the wound-wait
    rule, :mod:`fastlock.server.woundwait`): its parts on that shard were taken away, or
    it is gone (wounded, expired, or never made on this connection) when it was to be
    committed.  :func:`fastlock.client.across.lock_across` releases every part it took
    and tries again with the same age stamp; nothing of the wounded attempt stays held."""


__all__ += ["SlotMoving"]


@_register(62)
class SlotMoving(Unavailable):
    """The name's slot is being moved to another shard group (``fastlock shard move``) and the
    request was held longer than the freeze allows, or too many are held: nothing changed.
    An :class:`Unavailable`, so a client retries it; once the move ends the old owner answers
    :class:`WrongShard` naming the new one."""
