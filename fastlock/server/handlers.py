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

import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from .._core import LIMIT_CONFLICT, NOT_ACQUIRED, LockTable, NotHolder
from ..auth import Credentials
from ..errors import (
    AuthError,
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
from ..replication.messages import standby_address
from ..replication.syncrep import SYNC_PERMISSIONS
from ..roles import Action, NodeRole
from ..units import monotonic_ms
from .hello import Hello
from .keys import PERMISSIONS as KEY_PERMISSIONS
from .keys import KeyStore
from .kinds import KindHandlers, limit_conflict
from .lockadmin import LockAdmin, not_the_holder
from .session import Session, split_recorded_client
from .sessions import SessionRegistry
from .shares import limit_exceeded
from .statusview import client_status
from .watches import WatchRegistry

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
    # client sessions (fastlock.server.sessions): a client's own, proved by its session key (the
    # handler checks the principal, and "extend" on every name attached); SESSIONS and SESSION_REVOKE
    # are an admin's (or the anonymous principal's in open mode), checked by the handler
    P.OP_SESSION_OPEN: None,
    P.OP_SESSION_ATTACH: None,
    P.OP_SESSION_KEEPALIVE: None,
    P.OP_SESSION_CLOSE: None,
    P.OP_SESSIONS: None,
    P.OP_SESSION_REVOKE: None,
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
    return P.packb([req_id, exc.code, str(exc), getattr(exc, "primary", None)])


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


class Handlers:
    """The op handler table of ``server``: ``by_op`` maps an op code to
    ``(handler, fewest, most arguments)``; :meth:`dispatch` runs one request."""

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
        #: client sessions: one keep-alive renews every lease attached (fastlock.server.sessions)
        self.sessions = SessionRegistry(self)
        handlers: dict[int, Handler] = {
            P.OP_HELLO: self.hello.op_hello,
            P.OP_ACQUIRE: self.op_acquire,
            P.OP_RELEASE: self.op_release,
            P.OP_EXTEND: self.op_extend,
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
            **self.sessions.handlers_table(),
        }
        #: op -> (handler, fewest, most arguments): the arity is declared in protocol.OP_ARITY
        self.by_op: dict[int, tuple[Handler, int, int]] = {
            op: (handler, *P.OP_ARITY[op]) for op, handler in handlers.items()}
        #: op -> what it needs (PERMISSION; an op missing there needs an admin)
        self.need_by_op: dict[int, str | None] = {op: PERMISSION.get(op, "admin") for op in handlers}

    # -- dispatch -----------------------------------------------------------------
    def dispatch(self, conn: Session, msg: Any) -> None:
        """Run one decoded request ``msg`` from ``conn`` (its reply is queued on ``conn``)."""
        if type(msg) is not list or len(msg) < 2 or type(msg[0]) is not int or type(msg[1]) is not int or msg[0] < 1:
            conn.fatal(ProtocolError("a request must be an array [request_id >= 1, op, args...]"))
            return
        req_id = msg[0]
        op = msg[1]
        if not conn.ready and op != P.OP_HELLO:
            conn.fatal(ProtocolError("the first request must be HELLO"))
            return
        entry = self.by_op.get(op)
        try:
            if entry is None:
                raise ProtocolError(f"unknown operation {op}")
            handler, fewest, most = entry
            if not fewest <= len(msg) - 2 <= most:
                expected = (fewest if fewest == most else f"{fewest} or {most}" if most == fewest + 1
                            else f"{fewest} to {most}")
                raise ProtocolError(f"{P.OP_NAMES[op]} takes {expected} arguments, got {len(msg) - 2}")
            need = self.need_by_op.get(op, "admin")
            # grant.everywhere: what the principal may do on every name (no per-name check needed)
            if need is not None and need not in conn.grant.everywhere and (conn.kind != "admin" or need == "replica"):
                _authorize(conn, op, need, msg)
            handler(conn, req_id, msg)
        except FastlockError as exc:
            conn.send(_error_reply(req_id, exc))
            if isinstance(exc, AuthError):
                conn.close_after_flush()
        except Exception:  # a bug: log it, answer InternalServerError, keep serving everyone else
            log.exception("internal error handling %s from %s", P.OP_NAMES.get(op, op), conn.peer)
            conn.send(P.packb([req_id, InternalServerError.code, "internal server error", None]))

    # -- leases -------------------------------------------------------------------------
    def op_acquire(self, conn: Session, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        owner = conn.owner_hash(msg[3])  # only the hash is kept, logged and replicated
        ttl_ms = P.check_ttl_ms(msg[4])
        wait_ms = P.check_wait_ms(msg[5])
        delay_ms = P.check_lock_delay_ms(msg[6])
        corr = P.check_optional_str(msg[7], "correlation id", P.MAX_CORRELATION_ID_CHARS)
        shared = len(msg) > 8 and P.check_shared(msg[8])  # a shared lease (absent: exclusive)
        limit = P.check_limit(msg[9]) if len(msg) > 9 else 0  # a semaphore's limit (absent: a lock)
        actor = P.check_actor(msg[10]) if len(msg) > 10 else 0  # who waits in the session (absent: all of it)
        if shared and limit:
            raise InvalidArgument("a semaphore permit (limit > 0) cannot also be shared")
        table = self.table
        now = monotonic_ms()
        self.roles.admit(Action.ACQUIRE)
        config = self.config
        quotas = self.quotas
        if wait_ms != 0:
            if table.session_waiters(conn.session) >= config.max_waiters_per_connection:
                raise limit_exceeded(config.max_waiters_per_connection, "this connection", "waiting acquires",
                                     "max-waiters-per-connection")
            if table.waiter_count >= config.max_waiters:
                raise limit_exceeded(config.max_waiters, "the server", "waiting acquires", "max-waiters")
        # a retry of a held lease re-delivers it: it adds nothing
        retry = table.holder(name, now, owner) is not None
        # the global cap counts leases held: an exclusive request on a held name adds none now (it queues)
        # (running lock-delays count as leases: each keeps a lock entry until it ends)
        if (not retry and len(table) + quotas.lock_delay_count(now) >= config.max_leases
                and (shared or limit or not table.holders_of(name, now, 0, 1))):
            raise limit_exceeded(config.max_leases, "the server", "leases", "max-leases")
        # the principal's quotas: a lease, granted now or reserved by a waiter (see PrincipalQuotas)
        usage = None if retry else quotas.check_acquire(conn.principal, 1, 1 if wait_ms != 0 else 0)
        server = self.server
        if ttl_ms > server.max_ttl_ms:
            server.max_ttl_ms = ttl_ms
            server.node_state.raise_ttl(ttl_ms)  # rare: only a new longest TTL writes
        try:
            status = table.acquire(name, owner, conn.session, req_id, ttl_ms, wait_ms, delay_ms,
                                   (conn.recorded, corr), now, shared, limit, actor)
        except ValueError as exc:  # the owner key waits on name in a multi-lock request
            raise InvalidArgument(f"{name!r}: {exc}") from None
        if usage is not None:
            quotas.acquired(usage, status, (name,), table.last_token)
        if status == LIMIT_CONFLICT:
            raise limit_conflict(table, name, limit, now)
        if status == NOT_ACQUIRED:
            grace_ms = self.roles.grace_remaining_ms(now)
            if grace_ms:
                raise LockNotAcquired(f"{name!r}: no grants of free locks during {self.roles.grace_reason} "
                                      f"({grace_ms} ms left)")
            raise LockNotAcquired(_why_not_granted(table, name, now, conn.session))

    def op_release(self, conn: Session, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        token = P.check_token(msg[3])
        owner = conn.owner_hash(msg[4])
        # a fenced primary refuses too: the standby may have been promoted and would never
        # see this release (the client repeats it at whichever node is primary)
        self.roles.admit(Action.RELEASE)
        table = self.table
        now = monotonic_ms()
        meta = None
        if name in self.watchers:  # watchers are told whose lease it was
            holder = table.holder(name, now, owner)
            meta = holder.meta if holder is not None else None
        try:
            table.release(name, token, owner, now)
        except NotHolder:
            raise not_the_holder(self.lock_admin.revocations, name, token) from None
        self.server.released(name, token, meta)
        conn.send(P.encode_ok(req_id, None))

    def op_extend(self, conn: Session, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        token = P.check_token(msg[3])
        owner = conn.owner_hash(msg[4])
        ttl_ms = P.check_ttl_ms(msg[5])
        table = self.table
        now = monotonic_ms()
        self.roles.admit(Action.EXTEND)
        holder = table.holder(name, now, owner)
        try:
            table.extend(name, token, owner, ttl_ms, now, conn.session)  # the lease is held from this connection
        except NotHolder:
            raise not_the_holder(self.lock_admin.revocations, name, token) from None
        server = self.server
        if ttl_ms > server.max_ttl_ms:  # only the holder's extend counts towards the grace period
            server.max_ttl_ms = ttl_ms
            server.node_state.raise_ttl(ttl_ms)
        reply = P.encode_ok(req_id, ttl_ms)
        # Every extend is logged: the standby keeps each lease's deadline from the
        # records it receives, and a promoted standby keeps that deadline.
        wal = self.wal
        wal.log_extend(name, token, ttl_ms)
        sync = self.source.sync  # sync replication: every extend waits for the standby (it moves the deadline)
        if sync.enabled or ((holder is None or ttl_ms > holder.ttl_ms) and not wal.flush_now()):
            # recovery restores the recorded TTL: a longer one must be durable
            # before the holder relies on it (a shorter or equal one need not be)
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

            wal.when_durable(sync.after(ack))
            return
        conn.send(reply)

    def op_cancel(self, conn: Session, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        # The owner key is the proof of ownership: only its hash is stored, so only the client
        # that made the key can match it (a hash read from a replica's stream is hashed again).
        owner = conn.owner_hash(msg[3])
        self.roles.admit(Action.CANCEL_WAITER)  # withdrawing a queued waiter is local: fenced or not
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
        self.watches.add(conn, name)
        conn.send(P.encode_ok(req_id, self._holder_info(name)))

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
            self.source.attach(conn, req_id, from_lsn, incarnation, failover_after_ms, identity, address)
        except BaseException:
            conn.out_cap = self.config.max_output_bytes
            raise

    def op_repl_ack(self, conn: Session, req_id: int, msg: list) -> None:
        self.source.on_ack(conn, msg[2], msg[3])  # no reply: acks stream continuously

    def op_step_down(self, conn: Session, req_id: int, msg: list) -> None:
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
        conn.send(P.encode_ok(req_id, None))

