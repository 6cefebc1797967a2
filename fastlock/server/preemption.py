"""Priorities, cooperative preemption and directed hand-off: ``ACQUIRE_PRIORITY``,
``REQUEST_REVOKE`` and ``TRANSFER`` (op codes in :mod:`fastlock.protocol.ops`).

**Priorities** (Apache Helix's priority lock): an acquire may carry a priority,
0 (the default, what ``ACQUIRE`` asks) to :data:`~fastlock.protocol.priority.MAX_PRIORITY`;
a queued request waits ahead of every waiter of a lower priority and behind every one of
its own or a higher one (FIFO within a priority; the lock table's queue, see
``LockTable.acquire``).  Asking for a priority above 0 needs the ACL right
``"prioritize"`` on the name: a priority is a claim on other principals' turns, so it
is granted per name prefix like the other rights (invariant 12, fair shares: a
principal without the right keeps the FIFO order among its peers).

**Cooperative preemption** (Curator's Revoker, Chubby's "conflicting lock request"
event): a principal with the right ``"preempt"`` on the name whose request waits on it
with a priority above the exclusive holder's asks that holder to yield within
``grace_ms``.  The holder's connection gets a ``PUSH_REVOKE_REQUESTED`` frame
``[name, token, principal, client, grace_ms]`` (the requester's principal and client
name; nothing secret).  If the lease still holds at the deadline (server's monotonic
clock) the server revokes it exactly as ``fastlock revoke`` does (a ``REVOKE``
record, replicated; watchers told ``"revoked"``), by the requesting principal: the
lock goes to the head waiter with a higher fencing token, so a fenced write of the
old holder is refused.  One deadline per lease: a later request never moves it later.
A request lasts only while its requester waits: at the deadline the lease is revoked
only if a request that asked still waits on the name with a priority above the
holder's (attributed to the first such requester).  When every requester stopped
waiting (its wait ran out, it cancelled, its connection closed), the request lapses:
the lease is kept and the holder is not told (its ``revoke_requested`` stays set; it
may go on, or yield anyway).
A deadline is replicated (the REVOKE_REQUEST record); who asked is kept by the node that
heard the request: on a promoted node a replicated deadline revokes only while some
waiter of a priority above the holder's still waits (the requester, riding through the
failover, asks again and is kept once more).
One principal has at most :data:`MAX_REVOKE_DEADLINES_PER_PRINCIPAL` deadlines running
(``LimitExceeded`` beyond).

A deadline survives a restart and a failover: the request is a ``REVOKE_REQUEST``
record (:class:`fastlock.wal.records.RevokeRequest`), logged when it is made and again
for every running request after each snapshot, replicated like every record.  A
standby keeps each one (:class:`RevokeDeadlines`, no timer) on its own monotonic
clock, counted from the record's arrival, until the lease ends; a promotion arms
them, so the promoted primary revokes a lease still held at its deadline (at once
if that has passed).  Recovery arms the recovered ones on the wall clock, capped at
the longest grace.  A primary that may not revoke at a deadline (fenced, or held by
strict synchronous replication) keeps it and tries again every
:data:`REVOKE_RETRY_MS` while the lease holds.  A request answered less than the replication lag before the
primary died may be missing on the standby (asynchronous replication): the
requester's client asks again when it waits on the new primary.

**Directed hand-off** (Kubernetes' coordinated leader election): the exclusive holder
releases to the waiter whose correlation id is ``candidate`` in one step
(``LockTable.release_to``): that waiter is granted at once with a fresh, higher token;
the release and the grant are logged as any release and grant.  The candidate must be
among the first :data:`MAX_CANDIDATES_SCANNED` waiters, and the only one of them
carrying that id: a correlation id is chosen by its client, so when several waiters
carry it the transfer is refused (``InvalidArgument``) rather than handed to the first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import protocol as P
from ..errors import FastlockError, InvalidArgument, LimitExceeded, LockNotHeld, PermissionDenied
from ..logsafe import quote
from ..protocol.ops import OP_ACQUIRE_PRIORITY, OP_REQUEST_REVOKE, OP_TRANSFER, PUSH_REVOKE_REQUESTED
from ..protocol.priority import MAX_REVOKE_GRACE_MS, check_grace_ms, check_priority
from ..roles import Action, Role
from ..units import monotonic_ms, wall_ms
from .lockadmin import not_the_holder
from .session import split_recorded_client

if TYPE_CHECKING:  # pragma: no cover
    import asyncio

    from .handlers import Handlers
    from .session import Session

log = logging.getLogger(__name__)

#: what each operation needs (an ACL right checked on the name; see handlers.PERMISSION)
PERMISSIONS: dict[int, str | None] = {
    OP_ACQUIRE_PRIORITY: "acquire",  # and "prioritize" for a priority above 0 (checked by the handler)
    OP_REQUEST_REVOKE: "preempt",
    OP_TRANSFER: "release",
}

#: the most waiters a TRANSFER looks through for its candidate
MAX_CANDIDATES_SCANNED = 1_000
#: the most revoke deadlines one principal may have running (each lasts at most
#: MAX_REVOKE_GRACE_MS): one principal's requests never crowd out another's
MAX_REVOKE_DEADLINES_PER_PRINCIPAL = 1_000
#: ms: how long a primary that may not revoke at a deadline (fenced, or held by strict
#: synchronous replication) waits before it tries that deadline again
REVOKE_RETRY_MS = 250


class RevokeDeadline(NamedTuple):
    """A running revoke request: the lease (``name``, ``token``) asked to yield, the
    ``principal`` that asked, and ``due_ms``, when the lease is revoked if it still
    holds (this node's monotonic clock, milliseconds)."""

    name: str
    token: int
    principal: str
    due_ms: int


class RevokeDeadlines:
    """The running revoke requests of this node, at most one per lease.

    On a primary each runs a timer on the event loop ``get_loop()`` that calls
    ``on_due(deadline)`` at its ``due_ms``; a standby keeps the replicated ones without
    a timer until a promotion arms them (:meth:`arm_all`).  ``by_principal``: how many
    each principal asked for.  ``on_due(deadline, requesters)`` gets who asked on this node
    (None: nobody here, a replicated or recovered deadline).
    """

    def __init__(self, get_loop: Callable[[], Any],
                 on_due: Callable[[RevokeDeadline, dict[bytes, str] | None], None]):
        self.get_loop = get_loop
        self.on_due = on_due
        #: (name, token) -> its running request
        self.running: dict[tuple[str, int], RevokeDeadline] = {}
        #: principal -> how many of the running requests it made
        self.by_principal: dict[str, int] = {}
        self._timers: dict[tuple[str, int], asyncio.TimerHandle] = {}
        #: (name, token) -> the requests that asked on this node (owner hash -> principal), in
        #: order, at most MAX_REQUESTERS_KEPT; a replicated or recovered deadline has none
        self.requesters: dict[tuple[str, int], dict[bytes, str]] = {}
        #: (name, token) -> the holder's connection (server session number) told of the request
        self.told: dict[tuple[str, int], int] = {}

    def __len__(self) -> int:
        return len(self.running)

    def get(self, name: str, token: int) -> RevokeDeadline | None:
        """The running request to the lease (``name``, ``token``), or None."""
        return self.running.get((name, token))

    def add(self, deadline: RevokeDeadline, *, armed: bool) -> bool:
        """Keep ``deadline`` unless its lease has one already (a later request never
        moves it); ``armed``: run its timer now (a primary).  True if kept."""
        key = (deadline.name, deadline.token)
        if key in self.running:
            return False
        self.running[key] = deadline
        self.by_principal[deadline.principal] = self.by_principal.get(deadline.principal, 0) + 1
        if armed:
            self._arm(key, deadline.due_ms)
        return True

    def replicated(self, record: Any, due_ms: int) -> bool:
        """Keep the replicated request ``record`` (:class:`fastlock.wal.records.RevokeRequest`)
        without a timer, due at ``due_ms`` (this node's monotonic ms); True if kept."""
        return self.add(RevokeDeadline(record.name, record.token, record.principal, due_ms), armed=False)

    def drop(self, name: str, token: int) -> RevokeDeadline | None:
        """Forget the request to the lease (``name``, ``token``) (its timer cancelled); it, or None."""
        key = (name, token)
        deadline = self.running.pop(key, None)
        if deadline is None:
            return None
        self.requesters.pop(key, None)
        self.told.pop(key, None)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        left = self.by_principal.get(deadline.principal, 1) - 1
        if left > 0:
            self.by_principal[deadline.principal] = left
        else:
            self.by_principal.pop(deadline.principal, None)
        return deadline

    def arm_all(self) -> int:
        """Run a timer for every request kept without one (a promotion); returns how many."""
        armed = 0
        for key, deadline in list(self.running.items()):
            if key not in self._timers:
                self._arm(key, deadline.due_ms)
                armed += 1
        return armed

    def relog(self, wal: Any, now: int) -> None:
        """Log every running request again (after a snapshot, which holds leases only);
        ``now``: this node's monotonic ms."""
        wall = wall_ms()
        for d in self.running.values():
            left = max(0, d.due_ms - now)
            wal.log_revoke_request(d.name, d.token, d.principal, wall + left, left)

    def recovered(self, requests: list, now: int, *, armed: bool) -> int:
        """Keep the recovered requests (:class:`fastlock.wal.records.RevokeRequest` of leases
        recovered as held) on the monotonic clock ``now`` (ms): what is left of each by the
        wall clock, at most :data:`MAX_REVOKE_GRACE_MS`; returns how many."""
        wall = wall_ms()
        kept = 0
        for r in requests:
            left = min(max(0, r.until_wall_ms - wall), MAX_REVOKE_GRACE_MS)
            kept += self.add(RevokeDeadline(r.name, r.token, r.principal, now + left), armed=armed)
        return kept

    def _arm(self, key: tuple[str, int], due_ms: int) -> None:
        delay_s = max(0, due_ms - monotonic_ms()) / 1000.0
        self._timers[key] = self.get_loop().call_later(delay_s, lambda: self._fire(key))

    def _fire(self, key: tuple[str, int]) -> None:
        self._timers.pop(key, None)
        requesters = self.requesters.get(key)
        deadline = self.drop(*key)
        if deadline is not None:
            self.on_due(deadline, requesters)
#: the most requests kept per revoke deadline (the ones still waiting are the deadline's reason)
MAX_REQUESTERS_KEPT = 64


class Preemption:
    """The handlers of the priority operations and the deadlines of revoke requests
    (:class:`RevokeDeadlines`: one timer per lease asked to yield, dropped when it fires)."""

    def __init__(self, handlers: Handlers):
        self.handlers = handlers
        self.table = handlers.table
        self.roles = handlers.roles
        #: the running revoke requests (replicated; armed on a primary)
        self.deadlines = RevokeDeadlines(lambda: handlers.server.loop, self._deadline)

    def handlers_by_op(self) -> dict:
        """op code -> handler, for the server's handler table."""
        return {OP_ACQUIRE_PRIORITY: self.op_acquire_priority, OP_REQUEST_REVOKE: self.op_request_revoke,
                OP_TRANSFER: self.op_transfer}

    def op_acquire_priority(self, conn: Session, req_id: int, msg: list) -> None:
        """ACQUIRE_PRIORITY: ACQUIRE's nine arguments, then ``priority`` (0..MAX_PRIORITY) and,
        optionally, ACQUIRE's ``sequencer`` flag.
        :raises PermissionDenied: a priority above 0 without the right ``"prioritize"``."""
        priority = check_priority(msg[11])
        if priority and conn.kind == "client":
            name = msg[2]
            if type(name) is str and (conn.grant is None or not conn.grant.allows("prioritize", name)):
                raise PermissionDenied(f"principal {conn.principal!r} may not prioritize {name!r} "
                                       f"(priority {priority} needs the right 'prioritize')")
        self.handlers.acquire(conn, req_id, msg[:11] + msg[12:13], priority)

    def op_request_revoke(self, conn: Session, req_id: int, msg: list) -> None:
        """REQUEST_REVOKE name, owner key, grace_ms: ask the exclusive holder of ``name`` to
        yield within ``grace_ms``; the caller's request (owner key) must wait on ``name``
        with a priority above the holder's.  Value: ``{"token": the holder's token,
        "deadline_ms": ms from now until the server takes the lock, "delivered": whether
        the holder's connection was told}``.
        :raises LockNotHeld: no exclusive holder.  :raises InvalidArgument: the owner key
        does not wait on ``name``, or its priority is not above the holder's."""
        name = P.check_name(msg[2])
        owner = conn.owner_hash(msg[3])
        grace_ms = check_grace_ms(msg[4])
        self.roles.admit(Action.RELEASE)  # it may end in a revocation: a primary's work
        table = self.table
        now = monotonic_ms()
        holder = table.holder(name, now)
        holder_priority = table.holder_priority(name)
        if holder is None or holder_priority < 0:
            raise LockNotHeld(f"{name!r} has no exclusive holder to ask")
        mine = table.waiter_priority(name, owner)
        if mine < 0:
            raise InvalidArgument(f"a revoke request needs a request waiting on {name!r}")
        if mine <= holder_priority:
            raise InvalidArgument(f"the waiting request's priority {mine} is not above the holder's "
                                  f"({holder_priority}) on {name!r}")
        deadlines = self.deadlines
        deadline = deadlines.get(name, holder.token)
        if deadline is None:
            running = deadlines.by_principal.get(conn.principal, 0)
            if running >= MAX_REVOKE_DEADLINES_PER_PRINCIPAL:
                raise LimitExceeded(f"principal {conn.principal!r} already has {running} revoke requests running "
                                    f"(at most {MAX_REVOKE_DEADLINES_PER_PRINCIPAL})")
            deadline = RevokeDeadline(name, holder.token, conn.principal, now + grace_ms)
            deadlines.add(deadline, armed=True)
            self.handlers.server.log_decided_for(holder.token)  # the lease's grant record first (this batch's)
            self.handlers.wal.log_revoke_request(name, holder.token, conn.principal, wall_ms() + grace_ms, grace_ms)
        requesters = deadlines.requesters.setdefault((name, holder.token), {})
        if owner not in requesters and len(requesters) >= MAX_REQUESTERS_KEPT:
            for gone in [o for o in requesters if table.waiter_priority(name, o) <= holder_priority]:
                del requesters[gone]  # stopped waiting: its request lapsed
        if len(requesters) < MAX_REQUESTERS_KEPT:  # else as many still wait: the deadline stands for them
            requesters.setdefault(owner, conn.principal)
        deadline_ms = max(0, deadline.due_ms - now)
        target = self.handlers.server.sessions.get(holder.session)
        principal, client = split_recorded_client(conn.recorded)
        # the holder's connection is told once per deadline (again only if it holds from another
        # connection now): a request asked again and again does not flood it, or the log
        if target is not None and deadlines.told.get((name, holder.token)) != target.session:
            deadlines.told[(name, holder.token)] = target.session
            target.send(P.encode_push(PUSH_REVOKE_REQUESTED, [name, holder.token, principal, client, deadline_ms]))
            log.info("%s asks the holder of %s (token %d) to yield within %d ms", conn.principal, quote(name),
                     holder.token, deadline_ms, extra={"session": conn.session, "lock": name, "token": holder.token})
        conn.send(P.encode_ok(req_id, {"token": holder.token, "deadline_ms": deadline_ms,
                                       "delivered": target is not None}))

    def _deadline(self, deadline: RevokeDeadline, requesters: dict[bytes, str] | None) -> None:
        """A revoke request's deadline: take the lease if it still holds (primary only)."""
        name, token, principal = deadline.name, deadline.token, deadline.principal
        server = self.handlers.server
        now = monotonic_ms()
        server.source.fence_if_due(now)  # the revocation hands the lock to a waiter: not past the fence
        holder = self.table.holder(name, now)
        if holder is None or holder.token != token:
            return  # it yielded (or expired) in time
        try:
            self.roles.admit(Action.RELEASE)
        except FastlockError:
            if self.roles.role is Role.PRIMARY:  # fenced for now: the deadline stays, tried again
                self.deadlines.add(deadline._replace(due_ms=now + REVOKE_RETRY_MS), armed=True)
                if requesters is not None:
                    self.deadlines.requesters[(name, token)] = requesters
            return  # no longer a primary: the lease is the new primary's to keep or expire
        table = self.table
        holder_priority = table.holder_priority(name)
        if requesters is not None:  # who asked here: the first that still waits above the holder
            asking = next((who for owner, who in requesters.items()
                           if table.waiter_priority(name, owner) > holder_priority), None)
        else:  # replicated or recovered: any waiter above the holder keeps the request standing
            asking = principal if any(p > holder_priority for _, p in table.waiter_priorities(name, 1)) else None
        if asking is None:
            log.info("the revoke request on %s (token %d) lapsed: no requester waits any more", quote(name), token,
                     extra={"lock": name, "token": token})
            return
        lock_admin = self.handlers.lock_admin
        lock_admin.revoke_lease(name, holder, asking, "did not yield to a revoke request by its deadline",
                                now, None)
        server.after_batch()

    def op_transfer(self, conn: Session, req_id: int, msg: list) -> None:
        """TRANSFER name, token, owner key, candidate: release the exclusive lease to the
        waiter whose correlation id is ``candidate``, granted at once with a higher token.
        :raises LeaseLost: not the holder.  :raises InvalidArgument: no such plain
        exclusive waiter among the first MAX_CANDIDATES_SCANNED, or more than one."""
        name = P.check_name(msg[2])
        token = P.check_token(msg[3])
        owner = conn.owner_hash(msg[4])
        candidate = P.check_optional_str(msg[5], "candidate", P.MAX_CORRELATION_ID_CHARS)
        if not candidate:
            raise InvalidArgument("a transfer names its candidate (a waiter's correlation id)")
        self.roles.admit(Action.RELEASE)
        table = self.table
        now = monotonic_ms()
        holder = table.holder(name, now, owner)
        if holder is None or holder.token != token or holder.shared or holder.limit:
            raise not_the_holder(self.handlers.lock_admin.revocations, name, token)
        matches = [(w_owner, meta[0]) for w_owner, _session, meta, _enqueued, _deadline, shared
                   in table.waiter_info(name, MAX_CANDIDATES_SCANNED) if not shared and meta and meta[1] == candidate]
        if not matches:
            raise InvalidArgument(f"no candidate {candidate!r} waits on {name!r}")
        if len(matches) > 1:
            who = sorted({split_recorded_client(recorded)[0] or "-" for _owner, recorded in matches})
            raise InvalidArgument(f"{len(matches)} waiters on {name!r} carry the candidate id {candidate!r} "
                                  f"(principals {', '.join(who)}): the hand-off is refused, its target is ambiguous")
        target = matches[0][0]
        self.handlers.server.log_decided()  # a grant decided earlier in this batch is logged first
        try:
            table.release_to(name, token, owner, target, now)
        except ValueError as exc:
            raise InvalidArgument(f"{name!r}: {exc}") from None
        self.handlers.server.released(name, token, holder.meta)
        conn.send(P.encode_ok(req_id, None))
