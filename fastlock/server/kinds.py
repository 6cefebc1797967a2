"""The lock kinds beyond one exclusive lock: the atomic multi-lock, contenders, deadlocks.

* ``ACQUIRE_MANY`` (:meth:`KindHandlers.op_acquire_many`) asks the core's
  ``acquire_many`` for a set of names at once; its request is a
  :class:`ManyRequest`, which collects the one ``EV_GRANTED`` per name the core
  emits for it (in one drain) and answers once, with every token in request order.
* ``CONTENDERS`` (:meth:`KindHandlers.op_contenders`): a lock's holders and its
  ordered waiters, as kazoo's ``contenders()``, a page (about 64 KiB) per request
  with a cursor to the next.
* :class:`DeadlockTimer`: while anything waits, every ``deadlock_timeout_ms / 2``
  it asks the core to break the wait-for cycles older than ``deadlock_timeout_ms``
  (PostgreSQL's ``deadlock_timeout``); each victim's acquire fails with
  :class:`~fastlock.errors.DeadlockDetected` naming the cycle.

Shared locks and semaphores need no op of their own: ACQUIRE carries ``shared``
and ``limit`` (see :mod:`fastlock.protocol`).  An ACQUIRE that asks for a signed
sequencer (its optional ``sequencer`` flag) has a :class:`SequencedRequest` as its
request: its grant reply carries the sequencer, signed when the grant is acknowledged.
An EXTEND that asks for one (:func:`renewed_sequencer_reply`) and a client session's renewals
(:mod:`fastlock.server.sessions`) re-sign it with the renewed expiry
(:func:`renewal_sequencer`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import protocol as P
from .. import sequencer
from .._core import EV_DEADLOCK, EV_WAIT_CANCELLED, EV_WAIT_TIMEOUT, LIMIT_CONFLICT, NOT_ACQUIRED
from ..auth import hash_owner
from ..errors import (
    Cancelled,
    DeadlockDetected,
    InvalidArgument,
    LimitConflict,
    LockNotAcquired,
    PermissionDenied,
    WrongArgumentType,
)
from ..logsafe import RateLimitedLog, quote
from ..protocol.ops import MAX_PAGE_BYTES
from ..roles import Action
from ..units import monotonic_ms
from ._wire import ok_grant
from .admission import PrincipalQuotas
from .session import Session, recorded_client, split_recorded_client
from .shares import limit_exceeded

if TYPE_CHECKING:  # pragma: no cover
    from .handlers import Handlers
    from .lockserver import LockServer

log = logging.getLogger(__name__)


class ManyRequest:
    """The request object of one ACQUIRE_MANY in the lock table: the core's
    events for it (one per name) carry it as ``Event.request``.

    The reply goes out once: every token (:meth:`granted`, after the last name's
    grant) or one error (:meth:`error_id`, for the first failure event).
    """

    __slots__ = ("req_id", "count", "tokens", "done")

    def __init__(self, req_id: int, count: int):
        self.req_id = req_id
        self.count = count
        self.tokens: list[int] = []
        self.done = False

    def granted(self, token: int, ttl_ms: int, waited_ms: int) -> bytes | None:
        """Collect one name's grant; the reply frame once every name is granted, else None."""
        if self.done:
            return None
        self.tokens.append(token)
        if len(self.tokens) < self.count:
            return None
        self.done = True
        return P.encode_ok(self.req_id, [self.tokens, ttl_ms, waited_ms])

    def error_id(self) -> int | None:
        """The request id to fail, the first time only (later events of the same request: None)."""
        if self.done:
            return None
        self.done = True
        return self.req_id


class SequencedManyRequest(ManyRequest):
    """A :class:`ManyRequest` that asked for sequencers: one signed per name as its grant is
    delivered; the reply is ``[[token, ...], ttl_ms, waited_ms, {"sequencers": [bytes, ...]}]``,
    the sequencers in the tokens' order."""

    __slots__ = ("principal", "key", "sequencers")

    def __init__(self, req_id: int, count: int, principal: str, key: sequencer.SigningKey):
        super().__init__(req_id, count)
        self.principal = principal
        self.key = key
        self.sequencers: list[bytes] = []

    def granted_event(self, ev: Any) -> bytes | None:
        """Collect one name's grant (``EV_GRANTED`` event ``ev``) and its sequencer; the reply
        frame once every name is granted, else None."""
        if self.done:
            return None
        mode = sequencer.SHARED if ev.shared else sequencer.EXCLUSIVE
        self.sequencers.append(sequencer.sign(self.key, ev.name, ev.token, self.principal, mode,
                                              ev.deadline_ms - monotonic_ms()))
        if self.granted(ev.token, ev.ttl_ms, ev.waited_ms) is None:
            return None
        return P.encode_ok(self.req_id, [self.tokens, ev.ttl_ms, ev.waited_ms, {"sequencers": self.sequencers}])


class SequencedRequest:
    """The request object of an ACQUIRE that asked for a sequencer (:mod:`fastlock.sequencer`):
    its grant reply is ``[token, ttl_ms, waited_ms, {"sequencer": bytes}]``, the sequencer
    signed with the group's ``key`` when the grant is acknowledged (so only a node that may
    grant, never a standby, signs), its expiry the server's wall clock plus what is left of
    the lease."""

    __slots__ = ("req_id", "principal", "key")

    def __init__(self, req_id: int, principal: str, key: sequencer.SigningKey):
        self.req_id = req_id
        self.principal = principal
        self.key = key

    def reply(self, ev: Any) -> bytes:
        """The grant reply frame for ``EV_GRANTED`` event ``ev``, with its sequencer."""
        mode = sequencer.PERMIT if ev.limit else sequencer.SHARED if ev.shared else sequencer.EXCLUSIVE
        blob = sequencer.sign(self.key, ev.name, ev.token, self.principal, mode, ev.deadline_ms - monotonic_ms())
        return P.packb([self.req_id, 0, [ev.token, ev.ttl_ms, ev.waited_ms, {"sequencer": blob}]])

    def error_id(self) -> int:
        """The request id an error event answers (one ACQUIRE: every time its own)."""
        return self.req_id


def sequenced_request(handlers: Handlers, conn: Session, req_id: int, flag: Any) -> Any:
    """The core's request object for an ACQUIRE whose ``sequencer`` argument is ``flag``:
    ``req_id`` itself when false, else a :class:`SequencedRequest`.

    :raises WrongArgumentType: ``flag`` is not a bool.
    :raises InvalidArgument: this server has no signing key in its credentials."""
    if type(flag) is not bool:
        raise WrongArgumentType(f"sequencer must be a bool, not {type(flag).__name__}")
    if not flag:
        return req_id
    key = handlers.credentials.sequencer_keys.signing
    if key is None:
        raise InvalidArgument("this server has no sequencer key (see `fastlock credentials sequencer-key`)")
    return SequencedRequest(req_id, conn.principal or "", key)


class SequencedAs(NamedTuple):
    """What a re-signed sequencer of a held lease carries besides its name, token and
    expiry: the grant's ``principal`` and its ``mode`` (:data:`fastlock.sequencer.EXCLUSIVE`,
    ``SHARED`` or ``PERMIT``)."""

    principal: str
    mode: int


def sequenced_as(holder: Any) -> SequencedAs:
    """The principal and mode of the lease ``holder`` (a :class:`fastlock._core.Holder`):
    the principal recorded with its grant (as the grant's sequencer names it), the mode
    of its kind."""
    meta = holder.meta
    principal = split_recorded_client(meta[0])[0] if isinstance(meta, (tuple, list)) and meta else None
    mode = sequencer.PERMIT if holder.limit else sequencer.SHARED if holder.shared else sequencer.EXCLUSIVE
    return SequencedAs(principal or "", mode)


def renewal_sequencer(key: sequencer.SigningKey, name: str, token: int, signed_as: SequencedAs,
                      ttl_left_ms: int) -> bytes:
    """A fresh sequencer for lease ``token`` of ``name`` just renewed: the same name, token,
    principal and mode as its grant's, the expiry this server's wall clock plus
    ``ttl_left_ms`` (milliseconds: the renewed TTL).  Called only after the renewal was
    admitted (a node that may extend leases: never a standby)."""
    return sequencer.sign(key, name, token, signed_as.principal, signed_as.mode, ttl_left_ms)


def renewed_sequencer_reply(handlers: Handlers, req_id: int, name: str, token: int, holder: Any,
                             ttl_ms: int) -> bytes:
    """The reply frame of an EXTEND with a true ``sequencer`` flag (the compiled EXTEND,
    ``server/_wire.pyx``, ``extend``, renewed the lease ``token`` of ``name`` for ``ttl_ms``
    ms; ``holder``: its :class:`fastlock._core.Holder` before, or None):
    ``[ttl_ms, {"sequencer": bytes}]``, the lease's sequencer re-signed with the renewed
    expiry, ``{}`` when this server holds no signing key."""
    key = handlers.credentials.sequencer_keys.signing
    signed: dict[str, bytes] = {}
    if key is not None and holder is not None:
        signed["sequencer"] = renewal_sequencer(key, name, token, sequenced_as(holder), ttl_ms)
    return P.encode_ok(req_id, [ttl_ms, signed])


#: per-lease lines of the expiry and grant paths (fastlock.server.lockserver's logger): at most
#: 10 of each kind a second, then one with the count left out, however fast leases come and go
_server_log = logging.getLogger(__package__ + ".lockserver")
expired_log = RateLimitedLog(_server_log, logging.INFO, 1.0, 10)
undelivered_log = RateLimitedLog(_server_log, logging.INFO, 1.0, 10)
unacked_log = RateLimitedLog(_server_log, logging.WARNING, 1.0, 10)


def reply_id(request: Any) -> int | None:
    """The request id an error event answers: an ACQUIRE's own id, an ACQUIRE_MANY's
    once (None for its other names' events)."""
    return request if type(request) is int else request.error_id()


def grant_reply(ev: Any) -> bytes | None:
    """The reply frame for a delivered ``EV_GRANTED`` event (None: an ACQUIRE_MANY still
    collecting its other names)."""
    request = ev.request
    if type(request) is int:
        return ok_grant(request, ev.token, ev.ttl_ms, ev.waited_ms)
    if type(request) is SequencedRequest:
        return request.reply(ev)
    if type(request) is SequencedManyRequest:
        return request.granted_event(ev)
    return request.granted(ev.token, ev.ttl_ms, ev.waited_ms)


def waiter_left(conn: Session | None, ev: Any, quotas: PrincipalQuotas) -> None:
    """Fail the acquire of a waiter that left the queue: EV_WAIT_TIMEOUT
    (LockNotAcquired), EV_WAIT_CANCELLED (Cancelled) or EV_DEADLOCK
    (DeadlockDetected); ``conn``: its session, None if closed.  The waiter leaves its
    principal's count either way."""
    quotas.waiter_event(ev)
    if conn is None:
        return
    rid = reply_id(ev.request)  # an ACQUIRE_MANY is answered once, not per name
    if rid is not None:
        kind = ev.kind
        if kind == EV_WAIT_TIMEOUT:
            conn.send(P.encode_error(rid, LockNotAcquired.code, f"{ev.name!r}: wait ran out"))
        elif kind == EV_WAIT_CANCELLED:
            conn.send(P.encode_error(rid, Cancelled.code, f"{ev.name!r}: acquire cancelled"))
        elif kind == EV_DEADLOCK:
            conn.send(P.encode_error(rid, DeadlockDetected.code, deadlock_message(ev)))


def deadlock_message(ev: Any) -> str:
    """What a deadlock victim's client reads: the cycle as session -> lock steps."""
    steps = " -> ".join(f"session {session} waits for {name!r}" for session, name in ev.cycle or ())
    return f"{ev.name!r}: deadlock detected ({steps}); this acquire was chosen to break it"


def limit_conflict(table: Any, name: str, limit: int, now: int) -> LimitConflict:
    """The error for an acquire whose ``limit`` disagrees with the name's."""
    holders = table.holders_of(name, now, 0, 1)
    current = (f"a semaphore of limit {holders[0].limit}" if holders and holders[0].limit
               else "a lock" if holders else "waited on under another limit")
    asked = f"a semaphore of limit {limit}" if limit else "a lock"
    return LimitConflict(f"{name!r} is {current}; this acquire asked for {asked}")


class KindHandlers:
    """The handlers of ACQUIRE_MANY and CONTENDERS (registered in :class:`Handlers`),
    and the server's :class:`DeadlockTimer` (``deadlocks``)."""

    def __init__(self, handlers: Handlers):
        self.handlers = handlers
        self.table = handlers.table
        self.roles = handlers.roles
        self.config = handlers.config
        self.server = handlers.server
        self.deadlocks = DeadlockTimer(handlers.server, handlers.config.deadlock_timeout_ms)

    def op_acquire_many(self, conn: Session, req_id: int, msg: list) -> None:
        """ACQUIRE_MANY: ``[[name, shared], ...], owner, ttl_ms, wait_ms, lock_delay_ms,
        corr_id[, actor[, sequencer]]``; each name is checked against the principal's ACL for
        ``acquire``."""
        items = P.check_many_items(msg[2])
        owner = hash_owner(P.check_owner(msg[3]))
        ttl_ms = P.check_ttl_ms(msg[4])
        wait_ms = P.check_wait_ms(msg[5])
        delay_ms = P.check_lock_delay_ms(msg[6])
        corr = P.check_optional_str(msg[7], "correlation id", P.MAX_CORRELATION_ID_CHARS)
        actor = P.check_actor(msg[8]) if len(msg) > 8 else 0  # who waits in the session (absent: all of it)
        signed: Any = sequenced_request(self.handlers, conn, req_id, msg[9]) if len(msg) > 9 else req_id
        request = (ManyRequest(req_id, len(items)) if type(signed) is int
                   else SequencedManyRequest(req_id, len(items), signed.principal, signed.key))
        self.take_many(conn, request, items, owner, ttl_ms, wait_ms, delay_ms, corr, actor)

    def take_many(self, conn: Session, request: ManyRequest, items: list, owner: bytes, ttl_ms: int, wait_ms: int,
                  delay_ms: int, corr: str | None, actor: int = 0) -> int:
        """ACQUIRE_MANY's work once its arguments are checked: the ACL on every name, the limits
        and quotas, then the core's ``acquire_many`` with ``request`` (its grant and error
        replies); returns the core's status (GRANTED or QUEUED).
        :raises LimitConflict: a name is a semaphore.  :raises LockNotAcquired: ``wait_ms`` 0
        and not all free."""
        grant = conn.grant
        if conn.kind == "client":
            for name, _shared in items:
                if grant is None or not grant.allows("acquire", name):
                    raise PermissionDenied(f"principal {conn.principal!r} may not acquire {name!r}")
        table = self.table
        now = monotonic_ms()
        self.roles.admit(Action.ACQUIRE)
        config = self.config
        if wait_ms != 0:
            if table.session_waiters(conn.session) + len(items) > config.max_waiters_per_connection:
                raise limit_exceeded(config.max_waiters_per_connection, "this connection", "waiting acquires",
                                     "max-waiters-per-connection")
            if table.waiter_count + len(items) > config.max_waiters:
                raise limit_exceeded(config.max_waiters, "the server", "waiting acquires", "max-waiters")
        if len(table) + self.server.quotas.lock_delay_count(now) + len(items) > config.max_leases:
            raise limit_exceeded(config.max_leases, "the server", "leases", "max-leases")
        # the principal's quotas, all or nothing: the set's leases, granted now or reserved by its
        # waiters; a retry of a set the owner holds re-delivers it and adds nothing
        fresh = table.holder(items[0][0], now, owner) is None
        n = len(items) if fresh else 0
        quotas = self.server.quotas
        usage = quotas.check_acquire(conn.principal, n, n if wait_ms != 0 else 0)
        server = self.server
        if ttl_ms > server.max_ttl_ms:
            server.max_ttl_ms = ttl_ms
            server.node_state.raise_ttl(ttl_ms)
        try:
            status = table.acquire_many(items, owner, conn.session, request, ttl_ms,
                                        wait_ms, delay_ms, (recorded_client(conn), corr), now, actor)
        except ValueError as exc:  # an owner key already holding or awaiting some name in another request
            raise InvalidArgument(f"acquire_many: {exc}") from None
        if n:
            quotas.acquired(usage, status, [name for name, _shared in items], table.last_token)
        if status == LIMIT_CONFLICT:
            raise LimitConflict("acquire_many takes locks, not semaphores: one of the names is a semaphore")
        if status == NOT_ACQUIRED:
            raise LockNotAcquired(f"{len(items)} locks: not all free now")
        return status

    def op_contenders(self, conn: Session, req_id: int, msg: list) -> None:
        """CONTENDERS ``name[, cursor]``: one page of the lock's holders (grant order), then
        its waiters (queue order: by priority, FIFO within one; each with its ``priority``):
        ``{"holders": [...], "waiters": [...], "cursor": ...}``.
        A page holds at most :data:`MAX_CONTENDERS_LISTED` contenders and about
        :data:`~fastlock.protocol.ops.MAX_PAGE_BYTES` (one alone always goes); ``cursor``
        (None on the last page) is what the next request sends back: ``[part, position]``,
        part 0 the holders, 1 the waiters, ``position`` how many of that part were listed
        (checked, never server state).  Only the page's rows are built (the core skips the
        earlier contenders and stops at the page's end)."""
        name = P.check_name(msg[2])
        part, position = check_contenders_cursor(msg[3] if len(msg) > 3 else None)
        self.roles.admit(Action.READ)
        now = monotonic_ms()
        table = self.table
        page = ContendersPage()
        if part == 0:
            for h in table.holders_of(name, now, position, MAX_CONTENDERS_LISTED + 1):
                client, corr = h.meta if h.meta else (None, None)
                principal, client = split_recorded_client(client)
                if not page.add(page.holders, {"token": h.token, "shared": h.shared, "limit": h.limit,
                                               "principal": principal, "client": client, "correlation_id": corr,
                                               "remaining_ms": h.deadline_ms - now}):
                    page.cursor = [0, position + len(page.holders)]
                    break
            else:
                part, position = 1, 0
        if part == 1:
            queued = table.waiter_details(name, position, MAX_CONTENDERS_LISTED + 1 - len(page.holders))
            # the same waiters' priorities, in the same queue order
            priorities = [p for _, p in table.waiter_priorities(name, position + len(queued))[position:]]
            for (_session, shared, limit, meta, many), priority in zip(queued, priorities):
                client, corr = meta if meta else (None, None)
                principal, client = split_recorded_client(client)
                if not page.add(page.waiters, {"shared": shared, "limit": limit, "principal": principal,
                                               "client": client, "correlation_id": corr, "many": many,
                                               "priority": priority}):
                    page.cursor = [1, position + len(page.waiters)]
                    break
        conn.send(P.encode_ok(req_id, {"holders": page.holders, "waiters": page.waiters, "cursor": page.cursor}))


#: most contenders (holders and waiters together) one CONTENDERS page lists
MAX_CONTENDERS_LISTED = 1_000
#: what a contender's row costs beside its principal, client name and correlation id (msgpack bytes, at most)
CONTENDER_ROW_BYTES = 120
#: the highest position a CONTENDERS cursor may name (no lock has more holders or waiters)
MAX_CURSOR_POSITION = 1 << 40


def check_contenders_cursor(cursor: Any) -> tuple[int, int]:
    """``(part, position)`` from a CONTENDERS cursor: None (the first page) or
    ``[part 0|1, position 0..2**40]``.  :raises InvalidArgument: anything else."""
    if cursor is None:
        return 0, 0
    if (type(cursor) is not list or len(cursor) != 2 or cursor[0] not in (0, 1) or type(cursor[0]) is not int
            or type(cursor[1]) is not int or not 0 <= cursor[1] <= MAX_CURSOR_POSITION):
        raise InvalidArgument("a contenders cursor is None or the [part, position] the previous page returned, "
                              f"not this {type(cursor).__name__}")
    return cursor[0], cursor[1]


class ContendersPage:
    """One CONTENDERS page being built: its rows, their estimated size, the next page's cursor."""

    __slots__ = ("holders", "waiters", "size", "cursor")

    def __init__(self) -> None:
        self.holders: list[dict] = []
        self.waiters: list[dict] = []
        self.size = 0
        self.cursor: list[int] | None = None

    def add(self, rows: list[dict], row: dict) -> bool:
        """Add ``row`` to ``rows`` if the page has room; False if it is full."""
        listed = len(self.holders) + len(self.waiters)
        if listed and (listed >= MAX_CONTENDERS_LISTED or self.size > MAX_PAGE_BYTES):
            return False
        rows.append(row)
        self.size += (CONTENDER_ROW_BYTES + len(row["principal"] or "") + len(row["client"] or "")
                      + len(row["correlation_id"] or ""))
        return True


#: seconds between two calls of break_deadlocks() while a search is left unfinished at its
#: work bound (the loop serves everyone else in between)
DEADLOCK_CONTINUE_S = 0.005


class DeadlockTimer:
    """Breaks deadlocks: while the table has waiters on a primary, every half
    ``timeout_ms`` it calls ``table.break_deadlocks(now, timeout_ms)``, so a
    cycle is broken between ``timeout_ms`` and 1.5 x ``timeout_ms`` after it
    formed.  Each call does bounded work (the core's ``DEADLOCK_WORK`` nodes of
    the wait-for graph, a few milliseconds); a larger search goes on every
    :data:`DEADLOCK_CONTINUE_S` seconds until it is done, so a very large graph
    adds its search time to that bound.  ``timeout_ms`` 0 turns detection off."""

    def __init__(self, server: LockServer, timeout_ms: int):
        self.server = server
        self.timeout_ms = timeout_ms
        self.handle: asyncio.TimerHandle | None = None
        self.broken_log = RateLimitedLog(log, logging.WARNING, 1.0, 10)  # clients make cycles at will

    def poke(self) -> None:
        """Arm the timer if something waits and it is not armed (called at each batch end)."""
        if self.handle is None and self.timeout_ms and self.server.table.waiter_count:
            self.handle = self.server.loop.call_later(self.timeout_ms / 2000.0, self._fire)

    def _fire(self) -> None:
        self.handle = None
        server = self.server
        if not server.roles.expires_leases:
            return
        now = monotonic_ms()
        cycles = server.table.break_deadlocks(now, self.timeout_ms)
        for cycle in cycles:
            self.broken_log("deadlock broken: %s", " -> ".join(f"session {s} waits for {quote(n)}" for s, n in cycle))
        if server.table.deadlock_backlog:  # the search stopped at its work bound: go on shortly
            self.handle = server.loop.call_later(DEADLOCK_CONTINUE_S, self._fire)
        server.after_batch()
        self.poke()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
