"""Where each protocol op carries the lock, key or semaphore names a shard map routes.

:data:`NAMES_OF_OP` has one entry for every op of :data:`fastlock.protocol.ops.OPS`
(a test keeps it so, and a new op without an entry fails it): a :class:`NamesAt`
saying which of its arguments (0: the first after ``[req_id, op]``) hold names, or
None for an op that names none this way: the handshake, status, replication,
sessions (one per connection, so one per group), the shard map itself, and the ops
that take a *prefix* (``locks``, ``key_list``, ``key_watch``...), which answer for
the names this group owns.

:func:`names_in` lists a request's names; both the server's check
(:mod:`fastlock.server.sharded`) and a routing client read the table.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from ..protocol import ops as P

__all__ = ["NamesAt", "NAMES_OF_OP", "names_in"]


class NamesAt(NamedTuple):
    """Which arguments of an op hold names (indexes after ``[req_id, op]``)."""

    #: each holds one name (or None: no name, as KEY_PUT's lease)
    names: tuple[int, ...] = ()
    #: each holds a list of rows whose first item is a name (ACQUIRE_MANY's ``[name, shared]``,
    #: SESSION_ATTACH's ``[name, token, ...]``)
    rows: tuple[int, ...] = ()
    #: each holds a list of names (RESERVE's)
    lists: tuple[int, ...] = ()


_FIRST = NamesAt(names=(0,))

#: op code -> where its names are (None: it names none a map routes; see the module docstring)
NAMES_OF_OP: dict[int, NamesAt | None] = {
    P.OP_HELLO: None,
    P.OP_ACQUIRE: _FIRST,
    P.OP_RELEASE: _FIRST,
    P.OP_EXTEND: _FIRST,
    P.OP_CANCEL: _FIRST,
    P.OP_CHECK: _FIRST,
    P.OP_STATUS: None,
    P.OP_PING: None,
    P.OP_WATCH: _FIRST,
    P.OP_UNWATCH: _FIRST,
    P.OP_HOLDER: _FIRST,
    P.OP_REPLICATE: None,
    P.OP_REPL_ACK: None,
    P.OP_PROMOTE: None,
    P.OP_SERVE_ALONE: None,
    P.OP_STEP_DOWN: None,
    P.OP_KEY_PUT: NamesAt(names=(0, 2)),  # the key, and the lease it is attached to (or None)
    P.OP_KEY_GET: _FIRST,
    P.OP_KEY_LIST: None,  # a prefix: this group's keys
    P.OP_KEY_DELETE: _FIRST,
    P.OP_KEY_WATCH: None,  # a prefix: this group's keys
    P.OP_KEY_UNWATCH: None,
    P.OP_LOCKS: None,  # a prefix: this group's locks
    P.OP_LOCK_INFO: _FIRST,
    P.OP_REVOKE: _FIRST,
    P.OP_ACQUIRE_MANY: NamesAt(rows=(0,)),
    P.OP_CONTENDERS: _FIRST,
    P.OP_SYNC_ACK: None,
    P.OP_RATE_LIMIT: _FIRST,
    P.OP_ACQUIRE_PRIORITY: _FIRST,
    P.OP_REQUEST_REVOKE: _FIRST,
    P.OP_TRANSFER: _FIRST,
    P.OP_WATCH_FROM: _FIRST,
    P.OP_SESSION_OPEN: None,
    P.OP_SESSION_ATTACH: NamesAt(rows=(1, 2)),  # the leases attached, and those detached
    P.OP_SESSION_KEEPALIVE: None,
    P.OP_SESSION_CLOSE: None,
    P.OP_SESSIONS: None,
    P.OP_SESSION_REVOKE: None,
    P.OP_KEY_WATCH_FROM: None,  # a prefix: this group's keys
    P.OP_SHARD_MAP: None,
    P.OP_RESERVE: NamesAt(lists=(0,)),  # one shard's part of a cross-shard multi-lock: this group's names
    P.OP_COMMIT_RESERVATION: None,  # a multi-lock id
    P.OP_WAIT_IDENTITY: None,  # a secret
    P.OP_WAITS_FOR: None,  # a wait id
    P.OP_SLOT_EXPORT: None,  # a slot range being moved (an admin's, fastlock.server.slotmove)
    P.OP_SLOT_IMPORT: None,
    P.OP_SLOT_ADOPT: None,  # a slot range this group owns (an admin's: fastlock shard adopt)
    P.OP_SHARD_MAP_NOTICE: None,  # names no name: a move's driver tells of a map change (server.mapnotice)
}


def names_in(where: NamesAt, args: list) -> Iterator[str]:
    """The names (str) in a request's arguments ``args`` (after ``[req_id, op]``) at ``where``;
    an argument of another type is skipped (the op's handler refuses it)."""
    count = len(args)
    for i in where.names:
        if i < count and type(args[i]) is str:
            yield args[i]
    for i in where.rows:
        rows = args[i] if i < count else None
        if type(rows) is list:
            for row in rows:
                if type(row) is list and row and type(row[0]) is str:
                    yield row[0]
    for i in where.lists:
        names = args[i] if i < count else None
        if type(names) is list:
            for name in names:
                if type(name) is str:
                    yield name
