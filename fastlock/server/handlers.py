"""The op handler table: one handler per protocol operation, and the dispatch in front of it.

:meth:`Handlers.dispatch` checks a request's shape, that HELLO came first, the
op's arity (declared in :data:`fastlock.protocol.OP_ARITY`) and the
principal's permission (:data:`PERMISSION`) before the handler runs, so a
refused request changes nothing.  A handler validates its arguments, asks
:meth:`fastlock.roles.NodeRole.admit` whether this node may serve the request
now, then changes the lock table; the server's batch end
(:meth:`~fastlock.server.lockserver.LockServer.after_batch`) logs and delivers
what the table decided.

Errors: a :class:`~fastlock.errors.FastlockError` a handler raises is the
reply (an :class:`~fastlock.errors.AuthError` also closes the connection); any
other exception is a server bug: logged with its traceback, answered with
:class:`~fastlock.errors.InternalServerError`, and the server keeps serving.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from .._core import LIMIT_CONFLICT, LockTable
from ..auth import Credentials
from ..errors import (
    AuthError,
    Compacted,
    FastlockError,
    InternalServerError,
    InvalidArgument,
    LockNotAcquired,
    PermissionDenied,
    ProtocolError,
    StorageError,
    Unavailable,
)
from ..logsafe import quote
from ..protocol.ops import OP_RATE_LIMIT, OP_SHARD_MAP, OP_WATCH_FROM, PUSH_WATCH_REV
from ..replication.messages import standby_address
from ..replication.syncrep import SYNC_PERMISSIONS
from ..roles import Action, NodeRole
from ..units import monotonic_ms
from ._wire import HandlersWire, ok_nil
from ._wire import acquire as compiled_acquire
from ._wire import dispatch as dispatch_request
from ._wire import enter_acquire as compiled_enter_acquire
from ._wire import extend as compiled_extend
from ._wire import release as compiled_release
from .edgechase import PERMISSIONS as EDGE_CHASE_PERMISSIONS
from .edgechase import EdgeChase
from .hello import Hello
from .keys import PERMISSIONS as KEY_PERMISSIONS
from .keys import KeyStore
from .kinds import KindHandlers, limit_conflict, renewed_sequencer_reply, sequenced_request
from .lockadmin import LockAdmin, not_the_holder
from .mapnotice import PERMISSIONS as MAP_NOTICE_PERMISSIONS
from .mapnotice import MapNotices
from .preemption import PERMISSIONS as PREEMPTION_PERMISSIONS
from .preemption import Preemption
from .ratelimit import RateLimitHandler
from .session import Session, split_recorded_client
from .sessions import SessionRegistry
from .shares import limit_exceeded
from .slotmove import PERMISSIONS as SLOT_MOVE_PERMISSIONS
from .slotmove import SlotMoves
from .statusview import client_status
from .watches import WatchRegistry
from .watchlog import REPLAY_PAGE
from .woundwait import PERMISSIONS as WOUND_WAIT_PERMISSIONS
from .woundwait import WoundWait

if TYPE_CHECKING:  # pragma: no cover
    from .lockserver import LockServer

log = logging.getLogger(__name__)

#: what each operation needs: a client ACL operation (checked on the lock name; admins may
#: do it on any name), "replica", "admin", or None (every authenticated principal).
#: An operation missing here needs an admin: new operations are refused by default.
PERMISSION: dict[int, str | None] = {
    P.OP_HELLO: None,
    P.OP_PING: None,
    P.OP_STATUS: None,  # details (replication, pairing) for admins and replicas only
    P.OP_UNWATCH: None,  # only ever removes the connection's own watch
    P.OP_ACQUIRE: "acquire",
    P.OP_RELEASE: "release",
    P.OP_EXTEND: "extend",
    P.OP_CANCEL: "cancel",
    P.OP_CHECK: "check",
    P.OP_HOLDER: "holder",
    P.OP_WATCH: "watch",
    OP_WATCH_FROM: "watch",
    P.OP_REPLICATE: "replica",
    P.OP_REPL_ACK: "replica",
    P.OP_STEP_DOWN: "replica",  # epoch news: only the paired standby's principal (see op_step_down)
    P.OP_PROMOTE: "admin",
    P.OP_SERVE_ALONE: "admin",
    **KEY_PERMISSIONS,  # the key store's operations (fastlock.server.keys): put, get, delete
    **SYNC_PERMISSIONS,  # SYNC_ACK: a replica's (fastlock.replication.syncrep)
    # an admin's, or the anonymous principal's in open mode: checked by the handler (lockadmin.py)
    P.OP_LOCKS: None,
    P.OP_LOCK_INFO: None,
    P.OP_REVOKE: None,
    P.OP_ACQUIRE_MANY: "acquire",  # checked on every name by the handler
    P.OP_CONTENDERS: "holder",
    OP_RATE_LIMIT: "acquire",  # taking from a name's rate limiter (fastlock.server.ratelimit)
    **PREEMPTION_PERMISSIONS,  # priorities, revoke requests, transfers (fastlock.server.preemption)
    # client sessions (fastlock.server.sessions): a client's own, proved by its session key (the
    # handler checks the principal, and "extend" on every name attached); SESSIONS and SESSION_REVOKE
    # are an admin's (or the anonymous principal's in open mode), checked by the handler
    P.OP_SESSION_OPEN: None,
    P.OP_SESSION_ATTACH: None,
    P.OP_SESSION_KEEPALIVE: None,
    P.OP_SESSION_CLOSE: None,
    P.OP_SESSIONS: None,
    P.OP_SESSION_REVOKE: None,
    OP_SHARD_MAP: None,  # the shard map holds no secret: any principal that may connect reads it
    **WOUND_WAIT_PERMISSIONS,  # cross-shard multi-locks' reservations (fastlock.server.woundwait)
    **EDGE_CHASE_PERMISSIONS,  # deadlock detection across shards (fastlock.server.edgechase)
    **SLOT_MOVE_PERMISSIONS,  # a slot move's ops: an admin's, checked by the handler (fastlock.server.slotmove)
    **MAP_NOTICE_PERMISSIONS,  # a move's driver telling of a map change: an admin's (fastlock.server.mapnotice)
}

_ARTICLE = {"client": "a", "replica": "a", "admin": "an"}

Handler = Callable[[Session, int, list], None]


def refusal(roles: NodeRole, action: Action) -> FastlockError:
    """The error :meth:`NodeRole.admit` raises for ``action`` now (returned, not raised)."""
    try:
        roles.admit(action)
    except FastlockError as exc:
        return exc
    raise AssertionError(f"{action.name} is admitted")  # pragma: no cover - callers check may() first


def _error_reply(req_id: int, exc: FastlockError) -> bytes:
    """The error frame for ``exc``.  An error class with no wire code of its own (a
    :class:`~fastlock.errors.StorageError`: the node's log failed and it is stopping)
    travels as :class:`~fastlock.errors.Unavailable`, any other as
    :class:`~fastlock.errors.InternalServerError`."""
    if not exc.code:
        wire: FastlockError = (Unavailable(f"this node cannot serve: {exc}") if isinstance(exc, StorageError)
                               else InternalServerError(f"internal server error: {exc}"))
        exc = wire
    wire_extra = getattr(exc, "wire_extra", None)  # a sharding error's redirect (fastlock.errors.WrongShard)
    return P.packb([req_id, exc.code, str(exc), wire_extra() if wire_extra else getattr(exc, "primary", None)])


def _authorize(conn: Session, op: int, need: str, msg: list) -> None:
    """Refuse (PermissionDenied) what ``conn``'s principal is not granted (admins come here
    only for replica operations, which they are not granted either)."""
    if need == "replica" or need == "admin":
        if conn.kind != need:
            raise PermissionDenied(f"{P.OP_NAMES[op]} needs {_ARTICLE[need]} {need} principal; "
                                   f"{conn.principal!r} is {_ARTICLE[conn.kind]} {conn.kind}")
        return
    if conn.kind != "client":
        raise PermissionDenied(f"{P.OP_NAMES[op]} needs a client principal; "
                               f"{conn.principal!r} is {_ARTICLE[conn.kind]} {conn.kind}")
    name = msg[2] if len(msg) > 2 else None
    if type(name) is str and (conn.grant is None or not conn.grant.allows(need, name)):
        # a name of the wrong type is left to the handler's validation (no state change either way)
        raise PermissionDenied(f"principal {conn.principal!r} may not {need} {name!r}")


#: the most holders of one name a refusal looks at to count the caller's own (permits, shared leases)
_HOLDERS_EXAMINED = 1_000


def _watch_rev_push(name: str, change: Any) -> bytes:
    """The PUSH_WATCH_REV of ``change`` (a :class:`~fastlock.server.watchlog.WatchChange`) of lock ``name``."""
    client, corr = change.meta if change.meta else (None, None)
    principal, client = split_recorded_client(client)
    return P.encode_push(PUSH_WATCH_REV, [name, change.what, change.token, client, corr, principal, change.revision])


def _why_not_granted(table: LockTable, name: str, now: int, session: int) -> str:
    """Why an acquire with ``wait=0`` of ``name`` by connection ``session`` was not granted:
    in its lock-delay, held (exclusively, shared or all of a semaphore's permits), and how
    much of that this same connection holds (a client that forgot its own lease)."""
    holders = table.holders_of(name, now, 0, _HOLDERS_EXAMINED)
    if not holders:  # free, yet refused: a lease of it expired and its lock-delay runs
        return f"{name!r} is in its lock-delay (a lease of it expired; see lock_delay)"
    first = holders[0]
    if not first.shared and not first.limit:
        if first.session == session:
            return (f"{name!r} is held by this same connection (token {first.token}): "
                    "another acquire on it waits for that lease to end")
        return f"{name!r} is held"
    count = table.holder_count(name, now)
    mine = [h.token for h in holders if h.session == session]
    what = (f"all {first.limit} permits of semaphore {name!r} are held" if first.limit
            else f"{name!r} is held shared by {count} lease{'s' if count != 1 else ''}")
    if mine:
        tokens = ", ".join(map(str, mine[:3])) + (", ..." if len(mine) > 3 else "")
        what += f", {len(mine)} of them by this same connection (token{'s' if len(mine) > 1 else ''} {tokens})"
    return what


class Handlers(HandlersWire):
    """The op handler table of ``server``: ``by_op`` maps an op code to
    ``(handler, fewest, most arguments)``; :meth:`dispatch` runs one request.  The
    collaborators the lock operations read per request (``server``, ``table``, ``roles``,
    ``wal``, ``config``, ``source``, ``quotas``, ``watchers``, ``keys``, ``sessions``,
    ``kinds``, ``by_op``, ``need_by_op``) are slots of its compiled base
    (:class:`~fastlock.server._wire.HandlersWire`)."""

    def __init__(self, server: LockServer, credentials: Credentials):
        self.server = server
        #: who may connect (tokens, certificate identities, the anonymous principal)
        self.credentials = credentials
        self.watches = WatchRegistry()
        self.keys = KeyStore(server)  # the key store: its handlers join the table below
        # fixed for the server's life: kept here so that a handler reads them in one step
        self.table = server.table
        self.roles = server.roles
        self.wal = server.wal
        self.config = server.config
        self.source = server.source
        self.quotas = server.quotas
        self.watchers = self.watches.by_name
        #: HELLO: the handshake (fastlock.server.hello)
        self.hello = Hello(server, credentials)
        #: ACQUIRE_MANY, CONTENDERS and the deadlock timer
        self.kinds = kinds = KindHandlers(self)
        self.lock_admin = LockAdmin(self)
        #: RATE_LIMIT: the rate limiters (fastlock.server.ratelimit)
        self.rate_limits = RateLimitHandler(self.roles, self.table)
        #: ACQUIRE_PRIORITY, REQUEST_REVOKE, TRANSFER and the revoke requests' deadlines
        self.preemption = Preemption(self)
        #: client sessions: one keep-alive renews every lease attached (fastlock.server.sessions)
        self.sessions = SessionRegistry(self)
        #: ACQUIRE ``(conn, req_id, msg, priority=0)``, every form of it (server/_wire.pyx, acquire)
        self.acquire: Callable[..., None] = functools.partial(compiled_acquire, self)
        #: an ACQUIRE enters its lock's queue ``(conn, req_id, msg, name, owner, priority)``: the
        #: reclaim window's parked ones (server/_wire.pyx, enter_acquire)
        self.enter_acquire: Callable[..., None] = functools.partial(compiled_enter_acquire, self)
        #: RESERVE, COMMIT_RESERVATION: cross-shard multi-locks, wound-wait (fastlock.server.woundwait)
        self.wound_wait = WoundWait(self)
        #: WAIT_IDENTITY, WAITS_FOR: deadlock detection across shards (fastlock.server.edgechase)
        self.edge_chase = EdgeChase(self)
        #: SLOT_EXPORT / SLOT_IMPORT: a slot move's ops; SLOT_ADOPT: a slot's token floor (fastlock.server.slotmove)
        self.slot_moves = SlotMoves(self)
        #: SHARD_MAP_NOTICE: read the shard map in etcd now (fastlock.server.mapnotice)
        self.map_notices = MapNotices(self)
        #: the table's own ACQUIRE and RELEASE: dispatched by C calls while by_op holds them unwrapped
        self.acquire_handler = self.acquire
        self.release_handler = functools.partial(compiled_release, self)
        handlers: dict[int, Handler] = {
            P.OP_HELLO: self.hello.op_hello,
            # compiled (server/_wire.pyx)
            P.OP_ACQUIRE: self.acquire_handler,
            P.OP_RELEASE: self.release_handler,
            P.OP_EXTEND: functools.partial(compiled_extend, self),
            P.OP_CANCEL: self.op_cancel,
            P.OP_CHECK: self.op_check,
            P.OP_STATUS: self.op_status,
            P.OP_PING: self.op_ping,
            P.OP_WATCH: self.op_watch,
            P.OP_UNWATCH: self.op_unwatch,
            P.OP_HOLDER: self.op_holder,
            P.OP_REPLICATE: self.op_replicate,
            P.OP_REPL_ACK: self.op_repl_ack,
            P.OP_PROMOTE: self.op_promote,
            P.OP_SERVE_ALONE: self.op_serve_alone,
            P.OP_STEP_DOWN: self.op_step_down,
            **self.keys.handlers(),
            **server.source.sync.handlers(),
            P.OP_LOCKS: self.lock_admin.op_locks,
            P.OP_LOCK_INFO: self.lock_admin.op_lock_info,
            P.OP_REVOKE: self.lock_admin.op_revoke,
            P.OP_ACQUIRE_MANY: kinds.op_acquire_many,
            P.OP_CONTENDERS: kinds.op_contenders,
            OP_RATE_LIMIT: self.rate_limits.op_rate_limit,
            **self.preemption.handlers_by_op(),
            OP_WATCH_FROM: self.op_watch_from,
            **self.sessions.handlers_table(),
            OP_SHARD_MAP: self.op_shard_map,
            **self.wound_wait.handlers_by_op(),
            **self.edge_chase.handlers_by_op(),
            **self.slot_moves.handlers_by_op(),  # fastlock.server.slotmove
            **self.map_notices.handlers_by_op(),  # fastlock.server.mapnotice
        }
        #: op -> (handler, fewest, most arguments): the arity is declared in protocol.OP_ARITY
        self.by_op: dict[int, tuple[Handler, int, int]] = {
            op: (handler, *P.OP_ARITY[op]) for op, handler in handlers.items()}
        #: op -> what it needs (PERMISSION; an op missing there needs an admin)
        self.need_by_op: dict[int, str | None] = {op: PERMISSION.get(op, "admin") for op in handlers}

    # -- dispatch -----------------------------------------------------------------
    def dispatch(self, conn: Session, msg: Any) -> None:
        """Run one decoded request ``msg`` from ``conn`` (its reply is queued on ``conn``):
        its shape, HELLO first, a known op, the op's arity and the principal's permission
        are checked, in that order, before the op's handler runs (compiled:
        :func:`fastlock.server._wire.dispatch`)."""
        dispatch_request(self, conn, msg)

    @staticmethod
    def bad_arity(op: int, fewest: int, most: int, got: int) -> None:
        """:raises ProtocolError: ``op`` takes ``fewest`` to ``most`` arguments, not ``got``."""
        expected = (fewest if fewest == most else f"{fewest} or {most}" if most == fewest + 1
                    else f"{fewest} to {most}")
        raise ProtocolError(f"{P.OP_NAMES[op]} takes {expected} arguments, got {got}")

    #: refuse (PermissionDenied) what a connection's principal is not granted
    authorize = staticmethod(_authorize)

    @staticmethod
    def failed(conn: Session, req_id: int, op: int, exc: Exception) -> None:
        """A request's handler (or a check before it) raised ``exc``: a
        :class:`~fastlock.errors.FastlockError` is the reply (an
        :class:`~fastlock.errors.AuthError` also closes the connection); any other
        exception is a bug: logged, answered with InternalServerError."""
        if isinstance(exc, FastlockError):
            conn.send(_error_reply(req_id, exc))
            if isinstance(exc, AuthError):
                conn.close_after_flush()
            return
        log.error("internal error handling %s from %s", P.OP_NAMES.get(op, op), conn.peer, exc_info=exc)
        conn.send(P.packb([req_id, InternalServerError.code, "internal server error", None]))

    # -- leases -------------------------------------------------------------------------
    # ACQUIRE (every form), RELEASE and EXTEND are compiled (server/_wire.pyx): acquire,
    # enter_acquire, release, extend; the methods below are theirs
    def acquire_refused(self, conn: Session, name: str, limit: int, status: int, now: int) -> None:
        """Raise why the table did not take an acquire of ``name``: ``status`` LIMIT_CONFLICT
        (:class:`~fastlock.errors.LimitConflict`) or NOT_ACQUIRED with ``wait=0``
        (:class:`~fastlock.errors.LockNotAcquired`: held, in its lock-delay, or the grace period)."""
        if status == LIMIT_CONFLICT:
            raise limit_conflict(self.table, name, limit, now)
        grace_ms = self.roles.grace_remaining_ms(now)
        if grace_ms:
            raise LockNotAcquired(f"{name!r}: no grants of free locks during {self.roles.grace_reason} "
                                  f"({grace_ms} ms left)")
        raise LockNotAcquired(_why_not_granted(self.table, name, now, conn.session))

    def not_holder(self, name: str, token: int) -> FastlockError:
        """The error for a release or extend of ``name`` by one that does not hold ``token``
        (:class:`~fastlock.errors.LeaseLost`, saying so if an operator revoked it)."""
        return not_the_holder(self.lock_admin.revocations, name, token)

    def sequenced_request(self, conn: Session, req_id: int, flag: Any) -> Any:
        """The core's request object for an ACQUIRE whose ``sequencer`` argument is ``flag``
        (:func:`fastlock.server.kinds.sequenced_request`)."""
        return sequenced_request(self, conn, req_id, flag)

    def renewed_sequencer_reply(self, req_id: int, name: str, token: int, holder: Any, ttl_ms: int) -> bytes:
        """The reply of an EXTEND that asked for a sequencer
        (:func:`fastlock.server.kinds.renewed_sequencer_reply`)."""
        return renewed_sequencer_reply(self, req_id, name, token, holder, ttl_ms)

    def extend_when_durable(self, conn: Session, req_id: int, name: str, token: int, reply: bytes,
                            ttl_ms: int = 0) -> None:
        """Send an extend's ``reply`` once its record is durable (and, with sync replication,
        on the standby; and once the standbys know ``ttl_ms``, the new TTL in ms: see
        :mod:`fastlock.replication.ttlbound`) - if this node may still extend then; else its refusal."""
        server = self.server

        def ack(refused: FastlockError | None = None) -> None:
            # acknowledged only if this node may still extend (see LockServer.deliver_grants)
            self.source.fence_if_due(monotonic_ms())
            if refused is None and self.roles.may(Action.EXTEND):
                conn.send(reply)
            else:
                refused = refused or refusal(self.roles, Action.EXTEND)
                conn.send(P.encode_error(req_id, refused.code, f"{name!r}: {refused}",
                                         getattr(refused, "primary", None)))
                log.warning("extend of %s token %d not acknowledged: %s", quote(name), token, refused)
            server.after_batch()

        self.wal.when_durable(self.source.sync.after(self.source.ttl.after(ack, ttl_ms)))

    def op_cancel(self, conn: Session, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        # The owner key is the proof of ownership: only its hash is stored, so only the client
        # that made the key can match it (a hash read from a replica's stream is hashed again).
        owner = conn.owner_hash(msg[3])
        self.roles.admit(Action.CANCEL_WAITER)  # withdrawing a queued waiter is local: fenced or not
        reclaim = self.server.reclaim
        if reclaim.queues and reclaim.cancel(name, owner):  # parked or expected in the reclaim window
            conn.send(P.encode_ok(req_id, "cancelled"))
            return
        if self.wound_wait.parked and self.wound_wait.cancel_parked(conn.session, name, owner):
            conn.send(P.encode_ok(req_id, "cancelled"))  # a reservation waiting behind an older one
            return
        self.server.queues.touched(name)
        table = self.table
        now = monotonic_ms()
        result = None
        if table.cancel(name, owner, now):
            result = "cancelled"
        else:
            holder = table.holder(name, now, owner)
            if holder is not None:
                # The grant raced with the cancel: release it, never leak it - which is a
                # release, refused like one by a fenced primary.
                self.roles.admit(Action.RELEASE)
                self.server.log_decided()  # its grant's record first (granted in this batch)
                table.release(name, holder.token, owner, now)
                self.server.released(name, holder.token, holder.meta)
                result = "released"
        conn.send(P.encode_ok(req_id, result))

    def op_check(self, conn: Session, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        token = P.check_token(msg[3])
        self.roles.admit(Action.READ)  # a fenced primary's answer may already be false
        conn.send(P.encode_ok(req_id, self.table.check(name, token, monotonic_ms())))

    def op_holder(self, conn: Session, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        self.roles.admit(Action.READ)
        conn.send(P.encode_ok(req_id, self._holder_info(name, conn)))

    def _holder_info(self, name: str, asker: Session | None = None) -> dict | None:
        """The holder (of a shared lock or a semaphore: the earliest granted, and how many hold it);
        ``this_session``: the connection ``asker`` holds it (on a sync primary also while its
        grant waits for the standby's acknowledgement, before the acquire is answered)."""
        now = monotonic_ms()
        h = self.table.holder(name, now)
        if h is None:
            shared = self.table.holders_of(name, now, 0, 1)  # the earliest; the others are only counted
            if not shared:
                return None
            h = shared[0]
        holders = self.table.holder_count(name, now) if h.shared or h.limit else 1
        client, corr = h.meta if h.meta else (None, None)
        principal, client = split_recorded_client(client)
        return {"token": h.token, "principal": principal, "client": client, "correlation_id": corr,
                "ttl_ms": h.ttl_ms, "remaining_ms": h.deadline_ms - now, "shared": h.shared, "limit": h.limit,
                "holders": holders, "this_session": asker is not None and h.session == asker.session}

    # -- watches ------------------------------------------------------------------------
    def op_watch(self, conn: Session, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        self.roles.admit(Action.READ)
        self._add_watch(conn, name, self.server.revisions.current())
        conn.send(P.encode_ok(req_id, self._holder_info(name)))

    def op_watch_from(self, conn: Session, req_id: int, msg: list) -> None:
        """WATCH_FROM ``[name, since]``: WATCH with revisions (:mod:`fastlock.server.watchlog`).

        ``since`` None starts a new watch; a revision (int) resumes one: the published
        changes of ``name`` after it are pushed first (``PUSH_WATCH_REV``), then the
        live ones.  Replies ``{"holder": the holder now or None, "revision": R}``: for a
        resumed watch every change up to R was sent; for a new one R is the revision the
        holder state has (every change logged up to it, so none up to it is pushed later).
        Refused with ``Compacted`` (extra: the oldest revision
        kept) or ``WatchDiverged``, changing nothing."""
        name = P.check_name(msg[2])
        since = msg[3]
        if since is not None and (type(since) is not int or not 0 <= since < 1 << 63):
            raise InvalidArgument("watch_from takes a lock name and a revision (int, 0 <= r < 2**63) or None")
        self.roles.admit(Action.READ)
        revisions = self.server.revisions
        try:
            replay = [] if since is None else revisions.replay(name, since, REPLAY_PAGE + 1)
        except Compacted as exc:
            conn.send(P.encode_error(req_id, exc.code, str(exc), exc.oldest))
            return
        # a new watch begins at the revision its holder state has; a resumed one after ``since``
        start = revisions.current() if since is None else None
        pager = self.server.replays
        if len(replay) <= REPLAY_PAGE and not pager.busy(conn):
            self._add_watch(conn, name, start)
            self.watches.revisioned.add(conn.session)
            for change in replay:
                conn.send(_watch_rev_push(name, change))
            conn.send(P.encode_ok(req_id, {"holder": self._holder_info(name),
                                           "revision": start if start is not None else revisions.progress()}))
            return
        # a long replay: REPLAY_PAGE pushes per loop turn (server.replays), the live watch
        # started in the turn it has caught up with what is published
        self._check_watch_room(conn, name)
        after = since

        def next_page(limit: int) -> tuple[list[bytes], bool]:
            nonlocal after
            self.roles.admit(Action.READ)
            if after is None:  # a new watch (queued behind a resume): nothing to replay
                return [], True
            changes = revisions.replay(name, after, limit)
            if changes:
                after = changes[-1].revision
            return [_watch_rev_push(name, change) for change in changes], len(changes) < limit

        def finish() -> None:
            begins = revisions.current() if since is None else None
            self._add_watch(conn, name, begins)
            self.watches.revisioned.add(conn.session)
            conn.send(P.encode_ok(req_id, {"holder": self._holder_info(name),
                                           "revision": begins if begins is not None else revisions.progress()}))

        pager.add(conn, req_id, next_page, finish)

    def _check_watch_room(self, conn: Session, name: str) -> None:
        """Raise what :meth:`_add_watch` would for a new watch of ``name``, adding nothing."""
        if conn.watching is not None and name in conn.watching:
            return
        config = self.config
        if conn.watching is not None and len(conn.watching) >= config.max_watches_per_connection:
            raise limit_exceeded(config.max_watches_per_connection, "this connection", "watches",
                                 "max-watches-per-connection")
        self.quotas.check_watch(conn)

    def _add_watch(self, conn: Session, name: str, start: int | None = None) -> None:
        """Add ``conn``'s watch of ``name`` (counted against the watch limits), beginning at
        revision ``start`` (see :class:`~fastlock.server.watches.WatchRegistry`)."""
        if conn.watching is None:
            conn.watching = set()
        if name not in conn.watching:
            config = self.config
            quotas = self.quotas
            if len(conn.watching) >= config.max_watches_per_connection:
                raise limit_exceeded(config.max_watches_per_connection, "this connection", "watches",
                                     "max-watches-per-connection")
            quotas.check_watch(conn)
            quotas.count_watches(conn, 1)
        conn.watching.add(name)
        self.watches.add(conn, name, start)
        self.server.revisions.listener_added()  # changes published without a watcher get their sync

    def op_unwatch(self, conn: Session, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        watching = conn.watching
        was = watching is not None and name in watching
        if watching is not None and was:
            watching.discard(name)
            self.watches.remove(conn, name)
            self.quotas.count_watches(conn, -1)
        conn.send(P.encode_ok(req_id, was))

    # -- replication, promotion, stepping down (policy in fastlock.server.failover) ----------
    def op_replicate(self, conn: Session, req_id: int, msg: list) -> None:
        from_lsn, incarnation, failover_after_ms, name = msg[2], msg[3], msg[4], msg[5]
        if type(from_lsn) is not int or type(failover_after_ms) is not int or failover_after_ms < 0:
            raise InvalidArgument("replicate takes from_lsn:int, incarnation, failover_after_ms:int >= 0, name")
        name = P.check_optional_str(name, "standby name", P.MAX_CLIENT_NAME_CHARS)
        if not name:
            raise InvalidArgument("a standby must name itself ([label@]node id)")
        address = standby_address(msg[6] if len(msg) > 6 else None, conn.address)
        # the witness it asks before promoting (fastlock.replication.witness), as it names it
        witness = P.check_optional_str(msg[7] if len(msg) > 7 else None, "standby's witness", 300)
        self.roles.admit(Action.SERVE_STANDBY)
        # Pairing goes by the authenticated replica principal, plus the node id it declares
        # (which the credentials may pin): one replica credential cannot pose as another standby.
        label, _, node = name.rpartition("@")
        pinned = conn.grant.node_id if conn.grant is not None else None
        if pinned is not None and node != pinned:
            raise PermissionDenied(f"replica principal {conn.principal!r} may only attach as node {pinned!r}")
        identity = f"{label}@{conn.principal}/{node}" if label else f"{conn.principal}/{node}"
        conn.out_cap = self.config.max_replica_output_bytes  # (plus its snapshot: see ReplicationSource)
        try:
            self.source.attach(conn, req_id, from_lsn, incarnation, failover_after_ms, identity, address,
                               witness=witness)
        except BaseException:
            conn.out_cap = self.config.max_output_bytes
            raise

    def op_repl_ack(self, conn: Session, req_id: int, msg: list) -> None:
        self.source.on_ack(conn, msg[2], msg[3])  # no reply: acks stream continuously

    def op_step_down(self, conn: Session, req_id: int, msg: list) -> None:
        if self.source.coordinated:
            # etcd alone deposes a group's primary (it loses the key); a deposed node holding the
            # key would leave the group with no primary
            raise PermissionDenied(f"this node's role is decided by etcd (--coordinator): replica "
                                   f"{conn.principal!r} may not ask it to step down")
        if not self.source.may_announce_epoch(conn.principal):
            raise PermissionDenied(f"this primary is paired with another standby: replica {conn.principal!r} "
                                   f"may not ask it to step down")
        peer = quote(conn.client_name) if conn.client_name else "a peer"
        info = self.server.failover.on_step_down_request(
            msg[2], msg[3], f"replica {conn.principal} ({peer} at {conn.peer})")
        conn.send(P.encode_ok(req_id, info))

    def op_promote(self, conn: Session, req_id: int, msg: list) -> None:
        force = msg[2] is True
        failover = self.server.failover
        failover.check_promotable(force)

        async def run() -> None:
            try:
                info = await failover.promote(reason="operator command", force=force)
            except FastlockError as exc:  # refused (logged by the policy): the node is a standby again
                conn.send(_error_reply(req_id, exc))
                conn.flush()
                return
            except Exception as exc:
                conn.send(P.packb([req_id, Unavailable.code, f"promotion failed: {exc}", None]))
                conn.flush()
                raise  # a bug or an I/O failure: logged and counted as a failed background task
            conn.send(P.encode_ok(req_id, info))
            conn.flush()

        self.server.tasks.spawn(run(), "promotion by operator command")

    def op_serve_alone(self, conn: Session, req_id: int, msg: list) -> None:
        conn.send(P.encode_ok(req_id, self.server.failover.serve_alone()))

    # -- status -------------------------------------------------------------------------
    def op_status(self, conn: Session, req_id: int, msg: list) -> None:
        st = self.server.status()
        if conn.kind == "client":
            st = client_status(st)
        # usage against quota per principal: every principal's for operators and peers, a client's own
        st["principals"] = [asdict(u) for u in self.quotas.report(conn.principal if conn.kind == "client" else None)]
        conn.send(P.encode_ok(req_id, st))

    def op_ping(self, conn: Session, req_id: int, msg: list) -> None:
        conn.send(ok_nil(req_id))

    def op_shard_map(self, conn: Session, req_id: int, msg: list) -> None:
        """SHARD_MAP: ``{"group": this node's group, "map": the map's plain form}``
        (:mod:`fastlock.sharding.shardmap`), or None from a node that is not sharded."""
        gate = self.server.shard_gate
        conn.send(P.encode_ok(req_id, None if gate is None else {"group": gate.group,
                                                                 "map": gate.shard_map.to_wire()}))
