"""The key store: small values by key, attached to a lease or not, listed and watched by prefix.

A key attached to a lease lives while the lease lives, as an etcd key put with
a lease or a ZooKeeper ephemeral node: group membership and service discovery
("this worker is alive, here is its address") without a client-side sweeper.
The lease is an ordinary lock lease (a lock name and its fencing token): the
client that holds it keeps it alive by extending it (:class:`fastlock.Client`'s
``keepalive``), and when it is released or expires - its client vanished - the
server deletes every key attached to it and tells the watchers.  A key put
without a lease stays until it is deleted.

Operations (:mod:`fastlock.protocol.ops`, codes 40-45), each checked against the
principal's ACL on the key (or prefix) like a lock name, with the client ACL
operations ``put``, ``get`` and ``delete`` (a watch needs ``get``):

* KEY_PUT ``key, value, lease name|None, token, owner key, mode``: set the key;
  ``mode`` KEY_UPSERT, KEY_CREATE (:class:`~fastlock.errors.KeyExists` if present)
  or KEY_REPLACE (:class:`~fastlock.errors.KeyNotFound` if absent).  With a lease,
  the owner key and token must be the lease's current holder
  (:class:`~fastlock.errors.LeaseLost` otherwise).  Replies True if the key was
  created, False if replaced, once the KEY_PUT record is durable.
* KEY_GET ``key``: ``{"value", "lease", "token", "principal", "created_wall_ms",
  "updated_wall_ms"}`` or None.
* KEY_LIST ``prefix, limit[, after]``: one page, ``{"keys": [[key, value, lease, token,
  created_wall_ms, updated_wall_ms], ...], "more": bool, "cursor": str or None}``, in key
  order: the keys above ``after`` (None or absent: from the first), at most ``limit``
  (1..10000) and about :data:`~fastlock.protocol.ops.MAX_PAGE_BYTES` (64 KiB; one key
  alone always goes).  When ``more``, ``cursor`` is the ``after`` of the next page (the
  page's last key: the server keeps nothing between pages).  The page is built by walking
  the sorted keys from ``after`` and stopping at the budget, never the whole list.
* KEY_DELETE ``key``: True if it was there (once the KEY_DELETE record is durable).
* KEY_WATCH_FROM ``prefix, revision, offset``: KEY_WATCH with positions, a watch that
  resumes (:mod:`fastlock.server.keyrevisions`): ``revision, offset`` None, None starts a
  new watch; a position (revision, offset within its record) resumes one.  The server
  pushes ``"vbeg"`` ``[prefix]`` (what the connection received before it is replayed
  after it), then every published change under
  ``prefix`` after the position, then replies ``{"once": True, "revision": r}`` (every key
  change up to ``r`` was sent); later changes come live.  The connection's key changes
  are pushed as ``"vrev"`` ``[prefix, what, key, value, revision, offset]`` from then on,
  and progress notices as ``"vprog"`` ``[revision]``.  Refused with ``Compacted`` (extra:
  the oldest revision it can resume from) or ``WatchDiverged``, changing nothing.
* KEY_WATCH / KEY_UNWATCH ``prefix``: ``"value"`` pushes ``[prefix, what, key, value]``
  for every later change of a key under ``prefix``; ``what`` is "put", "delete",
  "expired" (its lease expired) or "released" (its lease was released).  A change
  reaches a connection ONCE however many of its watched prefixes match (``prefix`` is
  the shortest of them): KEY_WATCH replies ``{"once": True}`` to say so, and the client
  hands the push to each of its watches whose prefix the key starts with (a client that
  does not read that reply hands it to the watch of the prefix it names only).

Limits (:class:`~fastlock.server.ServerConfig`, ``fastlock serve`` flags): a key is
1..512 bytes of UTF-8 like a lock name, a value at most ``max_value_bytes``; at most
``max_keys`` keys and the principal's key quota (``--max-keys-per-principal``: by
default a quarter of ``max_keys``, see :mod:`fastlock.server.admission`), at most
``max_key_bytes`` bytes of values in all and the principal's quota of them
(``--max-key-bytes-per-principal``, a quarter by default; a put that replaces a
value counts the difference); key watches
count against the connection's, the principal's and the server's watch limits.  A refusal changes nothing.

Durability and replication: every change is a WAL record (KEY_PUT, KEY_DELETE;
a lease's end is its RELEASE / EXPIRE record) applied by the one
:func:`fastlock.wal.records.apply`, in snapshots, and streamed to the standby,
which keeps the keys when it is promoted (their leases keep their TTL there).
A write is admitted like a release: a fenced primary refuses it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..auth import hash_owner
from ..errors import (
    Compacted,
    FastlockError,
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    LeaseLost,
    LimitExceeded,
    WrongArgumentType,
)
from ..logsafe import quote
from ..protocol.ops import (
    KEY_CREATE,
    KEY_REPLACE,
    KEY_UPSERT,
    MAX_PAGE_BYTES,
    OP_KEY_DELETE,
    OP_KEY_GET,
    OP_KEY_LIST,
    OP_KEY_PUT,
    OP_KEY_UNWATCH,
    OP_KEY_WATCH,
    OP_KEY_WATCH_FROM,
    PUSH_KEY_BEGIN,
    PUSH_VALUE,
    PUSH_VALUE_REV,
)
from ..roles import Action
from ..units import monotonic_ms, wall_ms
from ..wal.keyspace import KeyEntry, KeySpace
from ._wire import KeysWire
from .keyrevisions import WHOLE, Kept
from .shares import limit_exceeded
from .watchlog import REPLAY_PAGE, REPLAY_PAGE_BYTES

if TYPE_CHECKING:  # pragma: no cover
    from .lockserver import LockServer
    from .session import Session

log = logging.getLogger(__name__)

#: most keys one KEY_LIST reply carries (and at most about MAX_PAGE_BYTES of them)
MAX_LIST = 10_000
#: what a listed key's row costs beside its key, value and lease name (msgpack bytes, at most)
ROW_BYTES = 40

#: KEY_WATCH's value: ``once`` - a change reaches the connection in one push however many of
#: its watches match (the client hands it to each; see :meth:`KeyStore._notify`)
WATCH_REPLY = {"once": True}

#: the client ACL operation each key operation needs (checked on the key or prefix)
PERMISSIONS: dict[int, str] = {OP_KEY_PUT: "put", OP_KEY_GET: "get", OP_KEY_LIST: "get",
                               OP_KEY_DELETE: "delete", OP_KEY_WATCH: "get", OP_KEY_UNWATCH: "get",
                               OP_KEY_WATCH_FROM: "get"}


def check_prefix(prefix: object) -> str:
    """A prefix: a str of at most 512 bytes of UTF-8 (may be empty: every key)."""
    if type(prefix) is not str:
        raise WrongArgumentType(f"a key prefix must be a str, not {type(prefix).__name__}")
    return P.check_name(prefix) if prefix else prefix


class KeyStore(KeysWire):
    """The server's key space, its prefix watches and the key operations' handlers."""

    def __init__(self, server: LockServer):
        self.server = server
        self.space = KeySpace()
        #: prefix -> sessions watching it; session id -> its prefixes
        self.watchers: dict[str, set[Session]] = {}
        self.watching: dict[int, set[str]] = {}
        #: the session ids of the connections that watch with KEY_WATCH_FROM (pushes with positions)
        self.revisioned: set[int] = set()

    def handlers(self) -> dict[int, Callable[[Session, int, list], None]]:
        """The handler of each key operation, for the server's op table."""
        return {OP_KEY_PUT: self.op_put, OP_KEY_GET: self.op_get, OP_KEY_LIST: self.op_list,
                OP_KEY_DELETE: self.op_delete, OP_KEY_WATCH: self.op_watch, OP_KEY_UNWATCH: self.op_unwatch,
                OP_KEY_WATCH_FROM: self.op_watch_from}

    # -- state from the log ---------------------------------------------------------------
    def recovered(self, space: KeySpace | None) -> None:
        """Take the key space recovery rebuilt; a key whose lease is not held any more is
        dropped (the lease's end is in the log, so this finds none unless the log was cut)."""
        if space is None:
            return
        table = self.server.table
        for name, token in space.leases():
            holder = table.holder(name, 0)  # recovered leases are installed with deadlines after 0
            if holder is None or holder.token != token:
                for key, _ in space.lease_ended(name, token):
                    log.warning("recovered key %s dropped: its lease %s token %d is gone", quote(key),
                                quote(name), token)
        self.space = space
        if len(space):
            log.info("recovered %d keys", len(space))

    def lease_ended(self, name: str, token: int, why: str) -> None:
        """The lease ``(name, token)`` was released, expired or revoked (``why``): its keys
        go (the RELEASE / EXPIRE / REVOKE record just logged says so: no record of their own),
        each a change of that record numbered in key order (:mod:`fastlock.server.keyrevisions`)."""
        if (name, token) not in self.space.by_lease:
            return
        logged = self.server.key_revisions.logged
        for index, (key, _) in enumerate(self.space.lease_ended(name, token)):
            logged(index, key, why, None)

    # -- watches -------------------------------------------------------------------------
    def publish(self, changes: list[Kept]) -> None:
        """Push committed key ``changes`` (in position order) to their watchers."""
        if not self.watchers:
            return
        for _, rev, index, key, what, value in changes:
            self._notify(what, key, value, rev, index)

    def _notify(self, what: str, key: str, value: bytes | None, rev: int, index: int) -> None:
        """Push the change to every connection watching a prefix of ``key``, ONCE per
        connection however many of its watches match: the push names the connection's
        shortest matching prefix, and the client hands it to each of its watches whose
        prefix ``key`` starts with (KEY_WATCH's reply says so: ``{"once": True}``).  A
        connection with KEY_WATCH_FROM watches gets ``"vrev"`` pushes with the change's
        position, the others ``"value"``.  A frame is built once per prefix and kind named,
        not per connection or per match."""
        watchers = self.watchers
        revisioned = self.revisioned
        told: set[Session] | None = None
        for n in range(len(key) + 1):
            conns = watchers.get(key[:n])
            if conns:
                plain = with_position = None
                for conn in conns:
                    if told is None:
                        told = set()
                    elif conn in told:
                        continue
                    told.add(conn)
                    if conn.session in revisioned:
                        if with_position is None:
                            with_position = P.encode_push(PUSH_VALUE_REV, [key[:n], what, key, value, rev, index])
                        conn.send(with_position)
                    else:
                        if plain is None:
                            plain = P.encode_push(PUSH_VALUE, [key[:n], what, key, value])
                        conn.send(plain)

    def forget(self, conn: Session) -> None:
        """``conn`` closed: drop its watches."""
        prefixes = self.watching.pop(conn.session, None)
        self.revisioned.discard(conn.session)
        if prefixes:
            for prefix in prefixes:
                self._unwatch(conn, prefix)
            self.server.quotas.count_watches(conn, -len(prefixes))

    def _unwatch(self, conn: Session, prefix: str) -> None:
        conns = self.watchers.get(prefix)
        if conns is not None:
            conns.discard(conn)
            if not conns:
                del self.watchers[prefix]

    # -- handlers ----------------------------------------------------------------------------
    def op_put(self, conn: Session, req_id: int, msg: list) -> None:
        key = P.check_name(msg[2])
        value, lease_name, token, owner, mode = msg[3], msg[4], msg[5], msg[6], msg[7]
        config = self.server.config
        if type(value) is not bytes:
            raise WrongArgumentType(f"a value must be bytes, not {type(value).__name__}")
        if len(value) > config.max_value_bytes:
            raise InvalidArgument(f"a value is at most {config.max_value_bytes} bytes (--max-value-bytes), "
                                  f"got {len(value)}")
        if type(mode) is not int or mode not in (KEY_UPSERT, KEY_CREATE, KEY_REPLACE):
            raise InvalidArgument(f"put mode must be {KEY_UPSERT}, {KEY_CREATE} or {KEY_REPLACE}, not {mode!r}")
        server = self.server
        server.roles.admit(Action.RELEASE)
        if lease_name is not None:
            lease_name = P.check_name(lease_name)
            token = P.check_token(token)
            holder = server.table.holder(lease_name, monotonic_ms(), hash_owner(P.check_owner(owner)))
            if holder is None or holder.token != token:
                revoked = server.handlers.lock_admin.revocations.get(lease_name, token)
                why = (f"was revoked by {revoked.principal}" + (f": {revoked.reason}" if revoked.reason else "")
                       if revoked is not None else "is not a current lease of this owner (expired, released or "
                       "never held)")
                raise LeaseLost(f"{lease_name!r}: token {token} {why}; key {key!r} not put")
            server.log_decided_for(token)  # the lease's grant record first, if it was granted in this batch
        else:
            token = 0
        space = self.space
        old = space.get(key)
        if mode == KEY_CREATE and old is not None:
            raise KeyExists(f"key {key!r} exists")
        if mode == KEY_REPLACE and old is None:
            raise KeyNotFound(f"key {key!r} does not exist")
        principal = conn.principal
        if old is None or old.principal != principal:
            if old is None and len(space) >= config.max_keys:
                raise limit_exceeded(config.max_keys, "the server", "keys", "max-keys")
            server.quotas.keys.check(principal, space.per_principal.get(principal, 0))
        # bytes of values: the new value replaces the old one (counted against whoever wrote it)
        size = len(value)
        if space.value_bytes - (len(old.value) if old is not None else 0) + size > config.max_key_bytes:
            raise LimitExceeded(f"the server has {space.value_bytes} of its {config.max_key_bytes} bytes of "
                                f"key values: {size} more would pass the cap (--max-key-bytes)")
        mine = space.value_bytes_per_principal.get(principal, 0)
        adding = size - (len(old.value) if old is not None and old.principal == principal else 0)
        if adding > 0:
            server.quotas.key_bytes.check(principal, mine, adding)
        space.put(key, value, lease_name, token, principal, wall_ms())
        server.wal.log_key_put(key, value, lease_name, token, principal)
        server.key_revisions.logged(0, key, "put", value)
        self._when_durable(conn, req_id, old is None)

    def op_get(self, conn: Session, req_id: int, msg: list) -> None:
        key = P.check_name(msg[2])
        self.server.roles.admit(Action.READ)
        entry = self.space.get(key)
        conn.send(P.encode_ok(req_id, None if entry is None else _entry_info(entry)))

    def op_list(self, conn: Session, req_id: int, msg: list) -> None:
        prefix = check_prefix(msg[2])
        limit = msg[3]
        if type(limit) is not int or not 1 <= limit <= MAX_LIST:
            raise InvalidArgument(f"list limit must be an int 1..{MAX_LIST}, not {limit!r}")
        after = P.check_name(msg[4]) if len(msg) > 4 and msg[4] is not None else None
        self.server.roles.admit(Action.READ)
        out: list[list[Any]] = []
        more = False
        size = 0
        for key, e in self.space.with_prefix(prefix, after):
            if len(out) == limit or size > MAX_PAGE_BYTES:
                more = True
                break
            out.append([key, e.value, e.lease_name, e.token, e.created_wall_ms, e.updated_wall_ms])
            size += ROW_BYTES + len(key) + len(e.value) + (len(e.lease_name) if e.lease_name else 0)
        conn.send(P.encode_ok(req_id, {"keys": out, "more": more, "cursor": out[-1][0] if more else None}))

    def op_delete(self, conn: Session, req_id: int, msg: list) -> None:
        key = P.check_name(msg[2])
        server = self.server
        server.roles.admit(Action.RELEASE)
        entry = self.space.delete(key)
        if entry is None:
            conn.send(P.encode_ok(req_id, False))
            return
        server.wal.log_key_delete(key)
        server.key_revisions.logged(0, key, "delete", None)
        self._when_durable(conn, req_id, True)

    def op_watch(self, conn: Session, req_id: int, msg: list) -> None:
        prefix = check_prefix(msg[2])
        self.server.roles.admit(Action.READ)
        self._add_watch(conn, prefix)
        conn.send(P.encode_ok(req_id, WATCH_REPLY))

    def op_watch_from(self, conn: Session, req_id: int, msg: list) -> None:
        """KEY_WATCH_FROM ``[prefix, revision, offset]`` (see the module docstring)."""
        prefix = check_prefix(msg[2])
        rev, index = msg[3], msg[4]
        if rev is None:
            if index is not None:
                raise InvalidArgument("key_watch_from: an offset needs a revision")
        elif type(rev) is not int or not 0 <= rev < 1 << 63 or (
                index is not None and (type(index) is not int or not 0 <= index < WHOLE)):
            raise InvalidArgument(f"key_watch_from takes a prefix, a revision (int, 0 <= r < 2**63) or None, and an "
                                  f"offset (int, 0 <= i < {WHOLE}) or None")
        server = self.server
        server.roles.admit(Action.READ)
        revisions = server.key_revisions
        pager = server.replays
        busy = pager.busy(conn)
        try:
            # (behind another resume of this connection: listed when its turn comes, so that only
            # the resume being sent holds its list)
            replay = [] if rev is None or busy else revisions.replay(prefix, rev, index)
        except Compacted as exc:
            conn.send(P.encode_error(req_id, exc.code, str(exc), exc.oldest))
            return
        if not busy and len(replay) <= REPLAY_PAGE and sum(
                len(c.value) for c in replay if c.value is not None) <= REPLAY_PAGE_BYTES:
            self._add_watch(conn, prefix)
            self.revisioned.add(conn.session)
            conn.send(P.encode_push(PUSH_KEY_BEGIN, [prefix]))
            for c in replay:
                conn.send(_value_rev_push(prefix, c))
            conn.send(P.encode_ok(req_id, {**WATCH_REPLY, "revision": revisions.progress()}))
            return
        # a long replay: a page per loop turn (at most REPLAY_PAGE changes and about
        # REPLAY_PAGE_BYTES of values; server.replays), then what was published meanwhile,
        # and the live watch from the turn it has caught up
        self._check_watch_room(conn, prefix)
        pending = deque(replay)
        cursor = (rev, index)
        begun = False

        def next_page(limit: int) -> tuple[list[bytes], bool]:
            nonlocal begun, cursor
            server.roles.admit(Action.READ)
            frames = []
            if not begun:
                frames.append(P.encode_push(PUSH_KEY_BEGIN, [prefix]))
                begun = True
            if cursor[0] is None:  # a new watch (queued behind a resume): nothing to replay
                return frames, True
            size = 0
            if not pending:  # what was published while it waited or the pages went out
                pending.extend(revisions.replay(prefix, *cursor))
            while pending and len(frames) < limit and size <= REPLAY_PAGE_BYTES:
                c = pending.popleft()
                cursor = (c.revision, c.offset)
                frames.append(_value_rev_push(prefix, c))
                size += len(c.value) if c.value is not None else 0
                if not pending:
                    pending.extend(revisions.replay(prefix, *cursor))
            return frames, not pending

        def finish() -> None:
            self._add_watch(conn, prefix)
            self.revisioned.add(conn.session)
            conn.send(P.encode_ok(req_id, {**WATCH_REPLY, "revision": revisions.progress()}))

        pager.add(conn, req_id, next_page, finish)

    def _check_watch_room(self, conn: Session, prefix: str) -> None:
        """Raise what :meth:`_add_watch` would for a new watch of ``prefix``, adding nothing."""
        mine = self.watching.get(conn.session, ())
        if prefix in mine:
            return
        config = self.server.config
        if len(mine) + len(conn.watching or ()) >= config.max_watches_per_connection:
            raise limit_exceeded(config.max_watches_per_connection, "this connection", "watches",
                                 "max-watches-per-connection")
        self.server.quotas.check_watch(conn)

    def _add_watch(self, conn: Session, prefix: str) -> None:
        """Add ``conn``'s watch of ``prefix`` (counted against the watch limits)."""
        server = self.server
        mine = self.watching.setdefault(conn.session, set())
        if prefix not in mine:
            config = server.config
            quotas = server.quotas
            if len(mine) + len(conn.watching or ()) >= config.max_watches_per_connection:
                raise limit_exceeded(config.max_watches_per_connection, "this connection", "watches",
                                     "max-watches-per-connection")
            quotas.check_watch(conn)
            quotas.count_watches(conn, 1)
            mine.add(prefix)
            self.watchers.setdefault(prefix, set()).add(conn)
            server.key_revisions.listener_added()  # changes published without a watcher get their sync

    def op_unwatch(self, conn: Session, req_id: int, msg: list) -> None:
        prefix = check_prefix(msg[2])
        mine = self.watching.get(conn.session)
        was = mine is not None and prefix in mine
        if mine is not None and was:
            mine.discard(prefix)
            self._unwatch(conn, prefix)
            self.server.quotas.count_watches(conn, -1)
        conn.send(P.encode_ok(req_id, was))

    def _when_durable(self, conn: Session, req_id: int, value: object) -> None:
        """Answer once the change's record is durable and, under synchronous replication, on
        the standby (as an extend's acknowledgement) - and only if this node may still write
        then.  The watchers hear of it once it is committed
        (:class:`~fastlock.server.keyrevisions.KeyRevisions`), so that nobody hears of a
        change a promoted standby never saw."""
        server = self.server
        reply = P.encode_ok(req_id, value)
        wal = server.wal

        def ack(refused: FastlockError | None = None) -> None:
            server.source.fence_if_due(monotonic_ms())
            if refused is None and server.roles.may(Action.RELEASE):
                conn.send(reply)
            else:
                if refused is None:
                    try:
                        server.roles.admit(Action.RELEASE)
                    except FastlockError as exc:  # the refusal a client sees (NotPrimary, Unavailable)
                        refused = exc
                if refused is not None:
                    conn.send(P.encode_error(req_id, refused.code, str(refused), getattr(refused, "primary", None)))
            server.after_batch()

        sync = server.source.sync
        if wal.flush_now():  # relaxed fsync modes: written now
            if not sync.enabled:
                conn.send(reply)
                return
            sync.after(ack)()  # a synchronous standby still acknowledges it
            return
        wal.when_durable(sync.after(ack))


def _value_rev_push(prefix: str, c: Any) -> bytes:
    """The PUSH_VALUE_REV of key change ``c`` (a
    :class:`~fastlock.server.keyrevisions.KeyChange`) to a watch of ``prefix``."""
    return P.encode_push(PUSH_VALUE_REV, [prefix, c.what, c.key, c.value, c.revision, c.offset])


def _entry_info(e: KeyEntry) -> dict:
    return {"value": e.value, "lease": e.lease_name, "token": e.token, "principal": e.principal,
            "created_wall_ms": e.created_wall_ms, "updated_wall_ms": e.updated_wall_ms}
