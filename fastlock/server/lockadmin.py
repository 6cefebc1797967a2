"""The operator's lock requests: list the held locks, show one lock, revoke a lease.

``LOCKS``, ``LOCK_INFO`` and ``REVOKE`` (op codes in :mod:`fastlock.protocol.ops`) are
what ``fastlock locks``, ``fastlock lock`` and ``fastlock revoke`` send, as etcd's
``lease timetolive --keys`` / ``lease revoke``, Consul's ``session list`` / ``session
destroy`` and kazoo's ``Lock.contenders()``.

Who may run them (:func:`check_lock_admin`): an ``admin`` principal; and, in open mode
only (no credentials at all, which the server allows on a loopback address or with
``--allow-unauthenticated``), the anonymous principal - in open mode every connection
may already take any lock name, and a user whose script crashed holding a lock with a
long TTL must be able to free it with nothing but the command line.  Any other client
gets :class:`~fastlock.errors.PermissionDenied`.

A revocation removes the lease at once (no lock-delay: the lock was not abandoned, an
operator freed it), logs a ``REVOKE`` record with the principal that asked and its reason
(replayed by :func:`fastlock.wal.records.apply` as a release of that token, on recovery and
on the standby), tells the lock's watchers (``"revoked"``), and hands the lock to its first
waiter, whose token is higher - so the old holder's writes are refused by a fenced store,
and its next renewal gets :class:`~fastlock.errors.LeaseLost`.  The reply waits until the
record is durable.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import protocol as P
from ..errors import FastlockError, InvalidArgument, LeaseLost, LockNotHeld, PermissionDenied, WrongArgumentType
from ..logsafe import quote
from ..protocol.ops import MAX_PAGE_BYTES
from ..roles import Action
from ..units import monotonic_ms, wall_ms
from .session import split_recorded_client

if TYPE_CHECKING:  # pragma: no cover
    from .._core import Holder
    from .handlers import Handlers
    from .session import Session

log = logging.getLogger(__name__)

#: the most locks one LOCKS reply lists (a client may ask for fewer); the reply says how many matched
MAX_LOCKS_LISTED = 10_000
#: what a LOCKS row costs beside its name, principal, client name and correlation id (msgpack bytes, at most)
LOCK_ROW_BYTES = 200
#: the most waiters one LOCK_INFO reply lists; the reply gives the full count
MAX_WAITERS_LISTED = 1_000
#: the most holders (shared leases, permits) one LOCK_INFO reply lists (CONTENDERS pages through all)
MAX_HOLDERS_LISTED = 1_000
#: the longest revocation reason kept in the log (characters)
MAX_REASON_CHARS = 256
#: leases one loop turn of a revocation by principal revokes
REVOKE_PAGE = 1_000
#: the most revocations remembered to tell their holders who revoked them and why
MAX_REVOCATIONS_KEPT = 4_096
#: the longest principal name a revocation accepts (credentials allow 64)
MAX_PRINCIPAL_CHARS = 64


def check_lock_admin(handlers: Handlers, conn: Session, op: str) -> None:
    """Refuse (PermissionDenied) ``op`` to a principal that may not administer locks:
    anyone but an admin, except the anonymous principal in open mode (module docstring)."""
    if conn.kind == "admin" or (handlers.credentials.open and conn.kind == "client"):
        return
    raise PermissionDenied(f"{op} needs an admin principal; {conn.principal!r} is a {conn.kind}")


def _who(meta: Any) -> dict:
    client, corr = meta if meta else (None, None)
    principal, client = split_recorded_client(client)
    return {"principal": principal, "client": client, "correlation_id": corr}


def _row_bytes(row: dict) -> int:
    """About what a lease's or waiter's row costs in a reply (msgpack bytes, at most)."""
    return (LOCK_ROW_BYTES + len(row.get("name") or "") + len(row["principal"] or "") + len(row["client"] or "")
            + len(row["correlation_id"] or ""))


def lease_info(h: Holder, now: int) -> dict:
    """One lease as LOCKS and LOCK_INFO show it (times in ms)."""
    return {"name": h.name, "token": h.token, **_who(h.meta), "ttl_ms": h.ttl_ms,
            "remaining_ms": h.deadline_ms - now, "lock_delay_ms": h.lock_delay_ms,
            "shared": bool(h.shared), "limit": h.limit}


class Revocation(NamedTuple):
    """Who revoked a lease, and why (None: no reason given)."""

    principal: str
    reason: str | None


class RecentRevocations:
    """The last :data:`MAX_REVOCATIONS_KEPT` revocations by (lock name, token), oldest
    dropped first: what a revoked holder's next release or extend is told (its lease
    was revoked, by whom, why) instead of "not the current holder".  Bounded in count,
    each reason in length (:data:`MAX_REASON_CHARS`); kept in memory only (after a
    restart or a promotion the holder hears "not the current holder")."""

    def __init__(self, limit: int = MAX_REVOCATIONS_KEPT):
        self.limit = limit
        self._by_lease: OrderedDict[tuple[str, int], Revocation] = OrderedDict()

    def add(self, name: str, token: int, principal: str, reason: str | None) -> None:
        by_lease = self._by_lease
        by_lease[(name, token)] = Revocation(principal, reason)
        if len(by_lease) > self.limit:
            by_lease.popitem(last=False)

    def get(self, name: str, token: int) -> Revocation | None:
        return self._by_lease.get((name, token))

    def __len__(self) -> int:
        return len(self._by_lease)


def not_the_holder(revocations: RecentRevocations, name: str, token: int) -> LeaseLost:
    """The LeaseLost for a release or extend of ``name`` with a ``token`` that does not
    hold it: revoked (by whom, why) if it is a recent revocation, else the general case."""
    revoked = revocations.get(name, token)
    if revoked is None:
        return LeaseLost(f"{name!r}: token {token} is not the current holder (expired, released or never held)")
    why = f": {revoked.reason}" if revoked.reason else " (no reason given)"
    return LeaseLost(f"{name!r}: token {token} was revoked by {revoked.principal}{why}")


class LockAdmin:
    """The LOCKS, LOCK_INFO and REVOKE handlers of ``handlers``' server.

    ``revocations``: the recent revocations (:class:`RecentRevocations`), for the
    revoked holders' next requests."""

    def __init__(self, handlers: Handlers):
        self.handlers = handlers
        self.table = handlers.table
        self.roles = handlers.roles
        self.revocations = RecentRevocations()

    def op_locks(self, conn: Session, req_id: int, msg: list) -> None:
        """LOCKS prefix, most[, after[, order]]: one page of the held leases whose name starts
        with ``prefix`` (str, "" for all), each with its lock's number of waiters; at most
        ``most`` leases (int, None: :data:`MAX_LOCKS_LISTED`) and about
        :data:`~fastlock.protocol.ops.MAX_PAGE_BYTES` (one lock always goes), a lock's
        leases never split over two pages (a lock with more leases than fit lists its first).
        ``order`` "name" (None, the default): by name, only names above ``after`` (str or
        None: the ``next`` of the previous page); "contended": the locks with the most
        waiters first, then by name (no ``after``).  Only the page's rows are built
        (:meth:`~fastlock._core.LockTable.held_page`).  Value: ``{"locks": [...],
        "matched": int, "truncated": bool, "next": str or None}`` - ``matched`` counts
        the leases that match (above ``after``), ``next`` is the cursor of the next page
        when ``truncated``."""
        check_lock_admin(self.handlers, conn, "locks")
        prefix, most = msg[2], msg[3]
        after = msg[4] if len(msg) > 4 else None
        order = msg[5] if len(msg) > 5 else None
        if type(prefix) is not str:
            raise WrongArgumentType(f"prefix must be str, not {type(prefix).__name__}")
        if len(prefix.encode("utf-8", "surrogatepass")) > P.MAX_NAME_BYTES:
            raise InvalidArgument(f"prefix is longer than a lock name ({P.MAX_NAME_BYTES} bytes)")
        if most is None:
            most = MAX_LOCKS_LISTED
        elif type(most) is not int or not 1 <= most <= MAX_LOCKS_LISTED:
            raise InvalidArgument(f"most must be 1..{MAX_LOCKS_LISTED} or None")
        if order not in (None, "name", "contended"):
            raise InvalidArgument(f"order must be 'name', 'contended' or None, not {quote(order)}")
        if after is not None:
            if order == "contended":
                raise InvalidArgument("after pages by name: not with order 'contended'")
            P.check_name(after)
        self.roles.admit(Action.READ)
        table = self.table
        now = monotonic_ms()
        page, matched = table.held_page(prefix, after, most, order == "contended", now)
        listed: list[dict] = []
        last = None
        size = 0
        for name, waiters in page:
            holders = table.holders_of(name, now, 0, most)
            if listed and (len(listed) + len(holders) > most or size > MAX_PAGE_BYTES):
                break
            for h in holders:
                if listed and size > MAX_PAGE_BYTES:
                    break  # a lock whose leases alone fill the page lists its first ones
                listed.append({**lease_info(h, now), "waiters": waiters})
                size += _row_bytes(listed[-1])
            last = name
        truncated = len(listed) < matched
        conn.send(P.encode_ok(req_id, {"locks": listed, "matched": matched, "truncated": truncated,
                                       "next": last if truncated and order != "contended" else None}))

    def op_lock_info(self, conn: Session, req_id: int, msg: list) -> None:
        """LOCK_INFO name: its holders (grant order, at most :data:`MAX_HOLDERS_LISTED`) and
        its waiters (FIFO order, at most :data:`MAX_WAITERS_LISTED`), together about
        :data:`~fastlock.protocol.ops.MAX_PAGE_BYTES` (only those rows are built; CONTENDERS
        pages through all of them): each waiter's principal, client name, correlation id,
        session, ``waiting_ms``, ``since_wall_ms`` (ms since the Unix epoch, this server's
        clock), ``wait_remaining_ms`` (None: waits without end) and ``shared``."""
        check_lock_admin(self.handlers, conn, "lock_info")
        name = P.check_name(msg[2])
        self.roles.admit(Action.READ)
        now = monotonic_ms()
        wall_now = wall_ms()
        table = self.table
        size = 0
        holders: list[dict] = []
        for h in table.holders_of(name, now, 0, MAX_HOLDERS_LISTED):
            if holders and size > MAX_PAGE_BYTES:
                break
            holders.append(lease_info(h, now))
            size += _row_bytes(holders[-1])
        waiters: list[dict] = []
        for _owner, session, meta, enqueued, deadline, shared in table.waiter_info(name, MAX_WAITERS_LISTED):
            if size > MAX_PAGE_BYTES:
                break
            waiters.append({**_who(meta), "session": session, "waiting_ms": now - enqueued,
                            "since_wall_ms": wall_now - (now - enqueued),
                            "wait_remaining_ms": None if deadline < 0 else max(0, deadline - now), "shared": shared})
            size += _row_bytes(waiters[-1])
        conn.send(P.encode_ok(req_id, {"name": name, "holders": holders, "waiters": waiters,
                                       "waiter_count": table.queue_length(name)}))

    def op_revoke(self, conn: Session, req_id: int, msg: list) -> None:
        """REVOKE name, token, reason[, principal]: force-release the lease ``token`` of
        ``name`` (None: every lease of it).  Value, once the REVOKE records are durable:
        ``{"name", "revoked": [lease info...]}``.  With ``principal`` (name and token None):
        every lease of that principal, see :meth:`revoke_principal`.
        :raises LockNotHeld: no such lease (nothing changed)."""
        check_lock_admin(self.handlers, conn, "revoke")
        if len(msg) > 5 and msg[5] is not None:
            self.revoke_principal(conn, req_id, msg)
            return
        name = P.check_name(msg[2])
        token = None if msg[3] is None else P.check_token(msg[3])
        reason = P.check_optional_str(msg[4], "reason", MAX_REASON_CHARS)
        # a revocation is a release: a fenced primary refuses it (the standby may have been
        # promoted and would never see it), a standby redirects to its primary
        self.roles.admit(Action.RELEASE)
        handlers = self.handlers
        table = self.table
        now = monotonic_ms()
        leases = [h for h in table.holders_of(name, now) if token is None or h.token == token]
        if not leases:
            which = f"lease with token {token}" if token is not None else "holder"
            raise LockNotHeld(f"{name!r} has no {which}")
        server = handlers.server
        revoked = [self.revoke_lease(name, h, conn.principal, reason, now, conn.session) for h in leases]
        reply = P.encode_ok(req_id, {"name": name, "revoked": revoked})

        def ack() -> None:
            conn.send(reply)
            server.after_batch()

        handlers.wal.when_durable(ack)

    def revoke_lease(self, name: str, h: Holder, principal: str, reason: str | None, now: int,
                     session: int | None) -> dict:
        """Take the lease ``h`` of ``name`` away (:meth:`take_lease`) and log it; its lease
        info (:func:`lease_info`).  ``session``: the connection that asked (None: the server itself)."""
        info = lease_info(h, now)
        self.take_lease(name, h.token, h.meta, principal, reason, now)
        log.warning("lease %d on %s (principal %s, client %s) revoked by %s: %s", h.token, quote(name),
                    info["principal"], quote(info["client"]), principal, quote(reason),
                    extra={"session": session, "lock": name, "token": h.token, "principal": principal,
                           "client": info["client"], "correlation_id": info["correlation_id"]})
        return info

    def take_lease(self, name: str, token: int, meta: object, principal: str, reason: str | None,
                   now: int) -> None:
        """Take the lease ``token`` of ``name`` (recorded ``meta``) away as ``principal`` revoking it
        for ``reason``: a REVOKE record, its keys deleted (as the record ends them on a standby
        and in recovery), its quota given back, watchers told ``"revoked"``.  No log line of its
        own: a bulk revocation logs one for all."""
        handlers = self.handlers
        handlers.server.log_decided()  # the lease's grant record first, if it was granted in this batch
        self.table.remove_holder(name, token, now)
        handlers.wal.log_revoke(name, token, principal, reason)
        self.revocations.add(name, token, principal, reason)
        server = handlers.server
        server.quotas.lease_ended(token, meta, None, name)
        server.keys.lease_ended(name, token, "revoked")
        handlers.sessions.lease_ended(name, token)
        server.revisions.logged(name, P.WATCH_REVOKED, token, meta)

    def revoke_principal(self, conn: Session, req_id: int, msg: list) -> None:
        """REVOKE None, None, reason, principal: revoke every lease ``principal`` holds now,
        :data:`REVOKE_PAGE` per loop turn (other clients are served between pages), each
        logged, replicated and told to watchers as one revocation by name.

        The principal's waiting acquires are left in their queues: waiting goes by
        connection, and ends with it (an operator shuts a principal out by removing its
        credential; its open connections then end at their next HELLO or when closed).
        Value, once the last REVOKE record is durable: ``{"principal", "revoked": int,
        "waiting": int}`` (``waiting``: its acquires still queued).  A principal holding
        nothing gets ``revoked`` 0.  If this node stops being the primary part way, the
        request fails (Unavailable / NotPrimary) after the pages already revoked.
        """
        if msg[2] is not None or msg[3] is not None:
            raise InvalidArgument("revoke by principal takes no lock name and no token")
        principal = msg[5]
        if type(principal) is not str or not 0 < len(principal) <= MAX_PRINCIPAL_CHARS:
            raise InvalidArgument(f"principal must be a name of 1..{MAX_PRINCIPAL_CHARS} characters")
        reason = P.check_optional_str(msg[4], "reason", MAX_REASON_CHARS)
        self.roles.admit(Action.RELEASE)
        handlers = self.handlers
        server = handlers.server
        quotas = server.quotas
        quotas.sync()
        usage = quotas.usage.get(principal)
        leases = usage.held() if usage is not None else []  # (name, token) held now
        log.warning("revoking the %d leases of principal %s, asked by %s: %s", len(leases), principal,
                    conn.principal, quote(reason), extra={"session": conn.session, "principal": conn.principal})

        def value(revoked: int) -> dict:
            waiting = usage.waiting if usage is not None else 0
            log.warning("revoked %d leases of principal %s (%d of its acquires still wait)", revoked, principal,
                        waiting)
            return {"principal": principal, "revoked": revoked, "waiting": waiting}

        self.revoke_paged(conn, req_id, leases, reason,
                          f"the {len(leases)} leases of {principal!r}", value)

    def revoke_paged(self, conn: Session, req_id: int, leases: list[tuple[str, int]], reason: str | None,
                     what: str, value: Callable[[int], dict]) -> None:
        """Revoke ``leases`` (``(name, token)`` pairs; one no longer held is skipped) as
        ``conn``'s principal for ``reason``, :data:`REVOKE_PAGE` per loop turn (other clients
        are served between pages), each by :meth:`take_lease`; reply ``value(revoked)`` once
        the last REVOKE record is durable.  If this node stops being the primary part way,
        the request fails (Unavailable / NotPrimary), saying how many of ``what`` went first."""
        server = self.handlers.server
        revoked = 0

        def page(start: int) -> None:
            nonlocal revoked
            try:
                self.roles.admit(Action.RELEASE)
            except FastlockError as exc:
                why = f"revoked {revoked} of {what}, then: {exc}"
                conn.send(P.encode_error(req_id, exc.code, why, getattr(exc, "primary", None)))
                server.after_batch()
                return
            table = self.table
            now = monotonic_ms()
            for name, token in leases[start:start + REVOKE_PAGE]:
                for h in table.holders_of(name, now):
                    if h.token == token:
                        self.take_lease(name, token, h.meta, conn.principal, reason, now)
                        revoked += 1
                        break
            if start + REVOKE_PAGE < len(leases):
                server.loop.call_soon(page, start + REVOKE_PAGE)
                if start:  # (the first page runs inside the request: its read's batch end follows)
                    server.after_batch()
                return
            reply = P.encode_ok(req_id, value(revoked))

            def ack() -> None:
                conn.send(reply)
                server.after_batch()

            self.handlers.wal.when_durable(ack)
            if start:
                server.after_batch()

        page(0)
