"""Who gets in and how much they may hold: connection limits and per-principal quotas.

:class:`ConnectionLimits` is the registry of open sessions and the caps on
them: connections in all (sized to the open-files limit, plus a reserve for
replica and admin principals), per client address, per principal, the HELLO
deadline and the idle timeout.  :class:`PrincipalQuotas` holds the
per-principal quotas (:class:`Quota`: leases, waiting acquires, watches, keys, key
value bytes, connections; unread replies: :mod:`~fastlock.server.output`) and each
principal's :class:`Usage`, counted as the op that creates a resource runs.  Each quota
is by default a quarter of its global cap, the ``anonymous`` principal's a sixteenth
(:mod:`.shares`).  Every refusal is a :class:`~fastlock.errors.LimitExceeded`
naming its flag, and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import LimitExceeded
from ..logsafe import RateLimitedLog
from ..units import monotonic_ms
from ._wire import LimitsWire, QuotaCounts, UsageWire
from .config import ServerConfig
from .lockdelays import RunningDelays
from .output import OutputShares
from .session import UNAUTHENTICATED, Session, split_recorded_client
from .shares import Quota, limit_exceeded, output_share, quota_limits

if TYPE_CHECKING:  # pragma: no cover
    from ..auth.handshake import PendingProof
    from .lockserver import LockServer

log = logging.getLogger(__name__)

#: open files kept free for the WAL, snapshots, the listening socket, the standby
#: connection, the metrics endpoint and worker threads when sizing max connections
RESERVED_FDS = 64
#: default connection cap when the open-files limit allows it (as Redis's maxclients)
DEFAULT_MAX_CONNECTIONS = 10_000


def raise_open_files_limit() -> int | None:
    """Raise this process's RLIMIT_NOFILE soft limit to its hard limit (each
    connection is a file descriptor).  Returns the soft limit now in force, or
    None where the platform has no such limit."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (AttributeError, OSError, ValueError):
        return None
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("open-files limit raised from %d to %d", soft, hard)
            soft = hard
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return hard if soft == resource.RLIM_INFINITY else soft


#: the bucket of leases whose record names no principal (written before principals)
UNRECORDED = "(unrecorded)"
#: connections beyond --max-connections kept for replica and admin principals
RESERVED_CONNECTIONS = 16
#: recorded clients whose principal is remembered (PrincipalQuotas.principal_of)
PRINCIPAL_CACHE = 4_096


def principal_of(meta: Any) -> str:
    """The principal a lease or waiter is counted against: the one its grant recorded
    (``meta``: (recorded client, correlation id), see
    :func:`~fastlock.server.session.recorded_client`), else :data:`UNRECORDED`."""
    principal = split_recorded_client(meta[0])[0] if meta else None
    return principal if principal is not None else UNRECORDED


class Usage(UsageWire):
    """What one principal holds now: ``leases`` (fencing token -> lock name; a lease whose
    token another lease of the principal has already, which only a slot move brings, as the
    source group issued it, is kept under ``(token, name)``: :meth:`count_lease`), ``waiting``
    (acquires queued, one per name of an ACQUIRE_MANY), ``watches`` (lock and key
    watches) and ``connections`` (that completed HELLO).  ``leases`` and ``waiting`` are slots
    of its compiled base, :class:`~fastlock.server._wire.UsageWire`."""

    __slots__ = ("watches", "connections")

    def __init__(self) -> None:
        self.leases: dict[int | tuple[int, str], str] = {}
        self.waiting = 0
        self.watches = 0
        self.connections = 0

    def count_lease(self, token: int, name: str) -> None:
        """Count the lease ``token`` of ``name`` (once, however often counted)."""
        leases = self.leases
        counted = leases.get(token)
        if counted is None or counted == name:
            leases[token] = name
        else:  # another lock's lease of the same token: issued by another group, moved here
            leases[(token, name)] = name

    def held(self) -> list[tuple[str, int]]:
        """The ``(name, token)`` of every lease counted."""
        return [(name, key[0] if isinstance(key, tuple) else key) for key, name in self.leases.items()]


@dataclass(frozen=True)
class PrincipalUsage:
    """One principal's usage against its quotas, as STATUS shows it to operators
    (counts; a quota of 0: none)."""

    principal: str
    leases: int
    leases_quota: int
    waiters: int
    waiters_quota: int
    watches: int
    watches_quota: int
    keys: int
    keys_quota: int
    connections: int
    connections_quota: int
    lock_delays: int = 0  # running after its leases expired (each counts as a lease until it ends)
    key_bytes: int = 0  # bytes of its key values
    key_bytes_quota: int = 0


class PrincipalQuotas(QuotaCounts):
    """The per-principal quotas and what each principal holds against them.

    Everything is counted as the op that creates it runs (not at the batch end):

    * a lease granted at once by ACQUIRE or ACQUIRE_MANY, by its token, in
      :meth:`acquired`; a waiter that becomes the holder when its grant event is
      processed (:meth:`grant_event`) - its lease was reserved when it queued;
    * a waiting acquire (each name of an ACQUIRE_MANY) counts against BOTH the
      waiter quota and the lease quota (it holds a reservation of the lease it
      will get), so a principal's leases plus waiters never pass its lease quota
      however its waiters are granted;
    * a lock-delay an expiring lease starts (:meth:`lease_expired`) is a lease of its
      principal and under --max-leases (:meth:`lock_delay_count`) until it ends, as
      its lock entry lives that long (:mod:`fastlock.server.lockdelays`);
    * watches (lock and key) in :meth:`count_watches`, connections at HELLO
      (:class:`ConnectionLimits`), keys by the key space itself.

    Leases are counted against the principal their grant recorded
    (:func:`principal_of`): after a restart or a promotion the held leases are
    counted again from the table (:meth:`sync`, when the table's epoch moved).
    """

    def __init__(self, config: ServerConfig, server: LockServer, *, single_principal: bool):
        self.server = server
        self.table = server.table
        self.config = config
        #: at most one client principal can connect: the default shares stay off (see quota_limits)
        self.single_principal = single_principal
        self.usage: dict[str, Usage] = {}
        self.watch_count = 0  # watches on the whole server (the global --max-watches)
        #: leases that ended before their waiter's grant event was processed (this batch)
        self.ended_early: set[int] = set()
        #: leases counted by an immediate grant whose grant event is not processed yet
        self.counted_now: set[int] = set()
        self._epoch = -1  # the table's epoch the lease counts were taken at
        self.delays = RunningDelays()
        #: a grant's recorded client -> its principal (the same str object for every grant of a connection)
        self._principal_of: dict[str, str] = {}
        #: replies left unread, per principal and in all
        self.output = OutputShares(server, config.max_output_bytes_total, output_share(config, single_principal))
        self.configure(config.max_connections or DEFAULT_MAX_CONNECTIONS)

    def configure(self, max_connections: int) -> None:
        """Set each quota from the config and the connection cap in force."""
        limits = quota_limits(self.config, self.single_principal, max_connections)
        self.leases = Quota(*limits["leases"], "leases and waiting acquires", "max-leases-per-principal")
        self.waiters = Quota(*limits["waiters"], "waiting acquires", "max-waiters-per-principal")
        self.watches = Quota(*limits["watches"], "watches", "max-watches-per-principal")
        self.keys = Quota(*limits["keys"], "keys", "max-keys-per-principal")
        self.connections = Quota(*limits["connections"], "connections", "max-connections-per-principal")
        self.key_bytes = Quota(*limits["key_bytes"], "bytes of key values", "max-key-bytes-per-principal")

    def of(self, principal: str) -> Usage:
        """``principal``'s usage (made on first use; principals are the credentials' few)."""
        u = self.usage.get(principal)
        if u is None:
            u = self.usage[principal] = Usage()
        return u

    # -- acquires ---------------------------------------------------------------------
    def lease_expired(self, ev: Any, now: int) -> None:
        """An EV_EXPIRED event at ``now`` (monotonic ms): uncount its lease, count the
        lock-delay it starts (until its deadline + lock_delay_ms) against its principal."""
        self.lease_ended(ev.token, ev.meta, None, ev.name)
        if ev.lock_delay_ms and ev.deadline_ms + ev.lock_delay_ms > now:
            self.delays.started(self.principal_of(ev.meta), ev.deadline_ms + ev.lock_delay_ms)

    def principal_of(self, meta: Any) -> str:
        """:func:`principal_of`, remembered by recorded client (at most
        :data:`PRINCIPAL_CACHE` of them; every grant of a connection records the same one)."""
        if meta:
            recorded = meta[0]
            principal = self._principal_of.get(recorded) if type(recorded) is str else None
            if principal is not None:
                return principal
            principal = principal_of(meta)
            if type(recorded) is str:
                if len(self._principal_of) >= PRINCIPAL_CACHE:
                    self._principal_of.clear()
                self._principal_of[recorded] = principal
            return principal
        return UNRECORDED

    def waiter_event(self, ev: Any) -> None:
        """A waiter left its queue without a grant (timeout, cancel, deadlock)."""
        u = self.of(self.principal_of(ev.meta))
        if u.waiting:
            u.waiting -= 1

    def waiters_dropped(self, principal: str, dropped: int) -> None:
        """A connection of ``principal`` closed with ``dropped`` waiters."""
        u = self.of(principal)
        u.waiting = max(0, u.waiting - dropped)

    def batch_done(self) -> None:
        """The batch's events were processed: a token left in ``ended_early`` was never counted."""
        if self.ended_early:
            self.ended_early.clear()

    def sync(self) -> None:
        """Count the held leases again from the table if its epoch moved (a promotion,
        a start): replicated and recovered leases count against the principal they
        recorded.  O(leases), once per epoch."""
        table = self.table
        if table.epoch == self._epoch:
            return
        self._epoch = table.epoch
        for u in self.usage.values():
            u.leases.clear()
        for h in table.holders():
            self.of(self.principal_of(h.meta)).count_lease(h.token, h.name)
        # a recovered or replicated lock-delay names no principal: UNRECORDED's, under the global cap
        now = monotonic_ms()
        self.delays.reset(UNRECORDED, [until for _, until in table.lock_delays() if until > now])

    def over_lease_quota(self, principals: set[str]) -> dict[str, tuple[int, int]]:
        """Those of ``principals`` whose leases and waiting acquires pass their lease quota now
        (a slot move's import counts what they held on the source without refusing it):
        principal -> (held, quota).  Their acquires are refused until they hold less."""
        over = {}
        for principal in sorted(principals):
            u = self.usage.get(principal)
            limit = self.leases.limit_for(principal)
            if u is not None and limit and len(u.leases) + u.waiting > limit:
                over[principal] = (len(u.leases) + u.waiting, limit)
        return over

    # -- watches ------------------------------------------------------------------------
    def check_watch(self, conn: Session) -> None:
        """Refuse (:class:`LimitExceeded`) one more watch to ``conn``'s principal
        (the global --max-watches, then the quota)."""
        config = self.config
        if self.watch_count >= config.max_watches:
            raise limit_exceeded(config.max_watches, "the server", "watches", "max-watches")
        principal = conn.principal
        self.watches.check(principal, self.of(principal).watches)

    def count_watches(self, conn: Session, delta: int) -> None:
        self.watch_count += delta
        self.of(conn.principal).watches += delta

    # -- the operator's view ------------------------------------------------------------
    def report(self, principal: str | None = None) -> list[PrincipalUsage]:
        """Usage against quota of every principal that holds or held anything (or of
        ``principal`` only), by name.  On a standby the lease counts are those of its
        last epoch change (replicated grants are counted when it is promoted)."""
        self.sync()
        self.delays.ended(monotonic_ms())
        space = self.server.keys.space
        keys = space.per_principal
        names = sorted(set(self.usage) | {p for p in keys if p is not None}) if principal is None else [principal]
        out = []
        for name in names:
            u = self.usage.get(name) or Usage()
            out.append(PrincipalUsage(
                name, len(u.leases), self.leases.limit_for(name), u.waiting, self.waiters.limit_for(name),
                u.watches, self.watches.limit_for(name), keys.get(name, 0), self.keys.limit_for(name),
                u.connections, self.connections.limit_for(name), self.delays.per_principal.get(name, 0),
                space.value_bytes_per_principal.get(name, 0), self.key_bytes.limit_for(name)))
        return out


class ConnectionLimits(LimitsWire):
    """The registry of open sessions and the caps on connections (``sessions`` and
    ``idle_timeout_ms`` are slots of its compiled base, :class:`~fastlock.server._wire.LimitsWire`).

    ``sessions`` maps session id to :class:`~fastlock.server.session.Session`
    (every counted connection, HELLO done or not).  At the global cap the
    oldest connection that has not completed HELLO is closed to make room (a
    handshake reserve: a flood of idle connections cannot lock out a client
    that authenticates, nor the standby); with no such connection, the new one
    is refused.

    The cap is ``max_connections`` for client principals plus
    :data:`RESERVED_CONNECTIONS` that only replica and admin principals keep
    after HELLO, so a server full of clients still admits its standby and an
    operator.  At HELLO a connection also counts against its principal's
    connection quota (``--max-connections-per-principal``): connections of one
    principal from any number of addresses cannot fill the table.
    """

    def __init__(self, config: ServerConfig, server: LockServer):
        self.config = config
        self.server = server
        self.sessions: dict[int, Session] = {}
        #: connections that have not completed HELLO, oldest first (the HELLO deadline)
        self.unready: dict[int, Session] = {}
        #: session -> the handshake awaiting its client proof (fastlock.server.hello): one per connection
        self.pending_proofs: dict[int, PendingProof] = {}
        self.per_address: dict[str, int] = {}
        #: connections that completed HELLO, counted against their principal
        self.ready: dict[int, Session] = {}
        self.ready_clients = 0  # of them, those of client principals (the --max-connections cap)
        self.max_connections = config.max_connections or DEFAULT_MAX_CONNECTIONS
        self.idle_timeout_ms = config.idle_timeout_ms
        self.hello_timer: asyncio.TimerHandle | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.refused_log = RateLimitedLog(log)
        self.evicted_log = RateLimitedLog(log)
        self.hello_log = RateLimitedLog(log)
        self.idle_log = RateLimitedLog(log, logging.INFO)
        self.fatal_log = RateLimitedLog(log)  # one line per 10 s however fast peers send garbage
        self._next_session = 1

    def new_session(self) -> Session:
        """A session for a connection being accepted (counted by :meth:`admit` once it is made)."""
        sid = self._next_session
        self._next_session = sid + 1
        return Session(self.server, sid)

    def size_to_open_files(self) -> None:
        """Raise the open-files soft limit to the hard limit, and keep the
        connection cap below it (RESERVED_FDS left for files and the standby)."""
        soft = raise_open_files_limit()
        if soft is None:
            self.server.quotas.configure(self.max_connections)
            return
        fit = max(16, soft - RESERVED_FDS - RESERVED_CONNECTIONS)
        if self.config.max_connections is None:
            self.max_connections = min(DEFAULT_MAX_CONNECTIONS, fit)
        elif self.config.max_connections > fit:
            log.warning("--max-connections %d is above what the open-files limit (%d) allows: using %d",
                        self.config.max_connections, soft, fit)
            self.max_connections = fit
        self.server.quotas.configure(self.max_connections)
        log.info("connection limits: %d in all (and %d more for replicas and admins), %d per address, "
                 "%d per principal (open-files limit %d)", self.max_connections, RESERVED_CONNECTIONS,
                 self.config.max_connections_per_address, self.server.quotas.connections.limit, soft)

    def start(self) -> None:
        """Start the idle sweep (if an idle timeout is set)."""
        if self.idle_timeout_ms > 0:
            self.idle_timer = self.server.loop.call_later(self._idle_sweep_s(), self._sweep_idle)

    def close(self) -> None:
        for timer in (self.hello_timer, self.idle_timer):
            if timer is not None:
                timer.cancel()

    def admit(self, conn: Session) -> None:
        """A new connection: count it, or refuse it (close, logged at most every 10 s)."""
        per = self.per_address.get(conn.address, 0)
        if per >= self.config.max_connections_per_address:
            self.refused_log("refusing connection from %s: already %d connections from this address "
                             "(--max-connections-per-address)", conn.peer, per)
            conn.abort()
            return
        if len(self.sessions) >= self.max_connections + RESERVED_CONNECTIONS:
            if not self.unready:
                self.refused_log("refusing connection from %s: %d connections open (--max-connections and "
                                 "%d reserved for replicas and admins)", conn.peer, len(self.sessions),
                                 RESERVED_CONNECTIONS)
                conn.abort()
                return
            victim = next(iter(self.unready.values()))
            self.evicted_log("connection limit %d reached: closing %s (no HELLO after %d ms) to admit %s",
                             self.max_connections, victim.peer, monotonic_ms() - victim.accepted_ms, conn.peer)
            self.forget(victim)
            victim.abort()
        self.sessions[conn.session] = conn
        self.per_address[conn.address] = per + 1
        self.unready[conn.session] = conn
        if self.hello_timer is None:
            self._arm_hello_timer()

    def handshake_done(self, conn: Session) -> None:
        """HELLO authenticated ``conn``: count it against its principal and, for a client
        principal, against ``max_connections``; it leaves the HELLO deadline and the
        handshake reserve.

        :raises LimitExceeded: the principal has its quota of connections, or the
            clients fill ``max_connections``: the connection is left unauthenticated
            and closed once the reply is out.
        """
        if conn.session in self.ready:
            return  # a HELLO again on an authenticated connection (same principal)
        principal = conn.principal
        quotas = self.server.quotas
        usage = quotas.of(principal)
        client = conn.kind == "client"
        try:
            if client and self.ready_clients >= self.max_connections:
                raise limit_exceeded(self.max_connections, "the server", "client connections", "max-connections")
            quotas.connections.check(principal, usage.connections)
        except LimitExceeded as exc:
            conn.ready = False
            conn.authenticated(UNAUTHENTICATED, conn.client_name)
            self.refused_log("refusing HELLO from %s: %s", conn.peer, exc)
            self.server.loop.call_soon(conn.close_after_flush)
            raise
        self.ready[conn.session] = conn
        usage.connections += 1
        if client:
            self.ready_clients += 1
        self.unready.pop(conn.session, None)
        self.pending_proofs.pop(conn.session, None)

    def forget(self, conn: Session) -> bool:
        """Uncount a connection; False if it was not counted (refused or already forgotten)."""
        if self.sessions.pop(conn.session, None) is None:
            return False
        self.unready.pop(conn.session, None)
        self.pending_proofs.pop(conn.session, None)
        if self.ready.pop(conn.session, None) is not None:
            usage = self.server.quotas.of(conn.principal)
            usage.connections -= 1
            if conn.kind == "client":
                self.ready_clients -= 1
        n = self.per_address.get(conn.address, 0) - 1
        if n > 0:
            self.per_address[conn.address] = n
        else:
            self.per_address.pop(conn.address, None)
        return True

    def status(self) -> dict:
        return {"connections": len(self.sessions), "connections_without_hello": len(self.unready),
                "max_connections": self.max_connections, "reserved_connections": RESERVED_CONNECTIONS}

    # -- the HELLO deadline ---------------------------------------------------------------
    def _arm_hello_timer(self) -> None:
        timeout = self.config.hello_timeout_ms
        if self.hello_timer is None and self.unready and timeout > 0:
            oldest = next(iter(self.unready.values()))
            delay = max(0, oldest.accepted_ms + timeout - monotonic_ms()) / 1000.0
            self.hello_timer = self.server.loop.call_later(delay, self._on_hello_timer)

    def _on_hello_timer(self) -> None:
        """Close every connection that has not completed HELLO within the deadline
        (one timer for all of them: they are kept in arrival order)."""
        self.hello_timer = None
        cutoff = monotonic_ms() - self.config.hello_timeout_ms
        late = []
        for conn in self.unready.values():
            if conn.accepted_ms > cutoff:
                break
            late.append(conn)
        for conn in late:
            self.forget(conn)
            conn.abort()
        if late:
            self.hello_log("closed %d connections that did not complete HELLO within %d ms (--hello-timeout; "
                           "the last from %s)", len(late), self.config.hello_timeout_ms, late[-1].peer)
        self._arm_hello_timer()

    # -- the idle timeout -----------------------------------------------------------------
    def _idle_sweep_s(self) -> float:
        return max(0.05, self.idle_timeout_ms / 4000.0)

    def _sweep_idle(self) -> None:
        """Close connections that sent nothing for ``idle_timeout_ms`` - except those
        waiting for a lock, watching one, or replicating (they wait for us, as
        Redis's timeout spares blocked clients)."""
        server = self.server
        self.idle_timer = server.loop.call_later(self._idle_sweep_s(), self._sweep_idle)
        cutoff = monotonic_ms() - self.idle_timeout_ms
        replicas = server.source.replicas
        table = server.table
        idle = [c for c in self.sessions.values()
                if c.ready and c.last_read_ms <= cutoff and not c.watching and c.session not in replicas
                and not table.session_waiters(c.session)]
        for conn in idle:
            conn.close()
        if idle:
            self.idle_log("closed %d connections idle for %d ms or more (--idle-timeout; the last %s)",
                          len(idle), self.idle_timeout_ms, idle[-1].peer)
