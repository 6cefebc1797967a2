"""Who gets in and how much they may hold: connection limits and per-principal quotas.

:class:`ConnectionLimits` is the registry of open sessions and the caps on
them: connections in all (sized to the open-files limit), per client address,
the HELLO deadline and the idle timeout.  :class:`Quota` is ONE per-principal
limit check with its counts; :class:`PrincipalQuotas` holds the three of them
(leases held, waiting acquires, watches) and their bookkeeping, kept only while
the quota is set.  Every refusal is a :class:`~fastlock.errors.LimitExceeded`
naming the flag that sets the limit, and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import TYPE_CHECKING

from ..errors import LimitExceeded
from ..logsafe import RateLimitedLog
from ..units import monotonic_ms
from .config import ServerConfig
from .session import Session

if TYPE_CHECKING:  # pragma: no cover
    from ..auth.handshake import PendingProof
    from .lockserver import LockServer

log = logging.getLogger(__name__)

#: open files kept free for the WAL, snapshots, the listening socket, the standby
#: connection, the metrics endpoint and worker threads when sizing max connections
RESERVED_FDS = 64
#: default connection cap when the open-files limit allows it (as Redis's maxclients)
DEFAULT_MAX_CONNECTIONS = 10_000


def limit_exceeded(limit: int, who: str, what: str, flag: str) -> LimitExceeded:
    """The refusal of one more of ``what`` to ``who`` at ``limit``:
    "``who`` already has ``limit`` ``what`` (--``flag``)" (returned, for the caller to raise)."""
    return LimitExceeded(f"{who} already has {limit} {what} (--{flag})")


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


class Quota:
    """One per-principal limit: ``limit`` (0: none) of ``what`` per principal, set by ``--flag``."""

    __slots__ = ("limit", "what", "flag", "counts")

    def __init__(self, limit: int, what: str, flag: str):
        self.limit = limit
        self.what = what
        self.flag = flag
        self.counts: dict[str, int] = {}

    def check(self, principal: str) -> None:
        """Raise :class:`LimitExceeded` if ``principal`` already has ``limit`` (never with no limit)."""
        if self.limit and self.counts.get(principal, 0) >= self.limit:
            raise limit_exceeded(self.limit, f"principal {principal!r}", self.what, self.flag)

    def add(self, principal: str, delta: int) -> None:
        self.counts[principal] = self.counts.get(principal, 0) + delta


class PrincipalQuotas:
    """The per-principal quotas on leases held, waiting acquires and watches.

    Bookkeeping runs only while the quota is set (the handlers test ``leases.limit``
    and ``waiters.limit`` before calling in), so an unset quota costs nothing.
    """

    def __init__(self, config: ServerConfig, server: LockServer):
        self.server = server
        self.leases = Quota(config.max_leases_per_principal, "leases", "max-leases-per-principal")
        self.waiters = Quota(config.max_waiters_per_principal, "waiting acquires", "max-waiters-per-principal")
        self.watches = Quota(config.max_watches_per_principal, "watches", "max-watches-per-principal")
        self.watch_count = 0  # watches on the whole server (the global --max-watches)
        self.lease_principal: dict[int, str] = {}  # a lease's fencing token -> principal of its holder

    def lease_granted(self, session: int, token: int) -> None:
        """A fresh grant (the lease ``token``) to ``session``: count it against its principal."""
        conn = self.server.limits.sessions.get(session)
        if self.waiters.limit and conn is not None and conn.waiting:
            self.count_waiters(conn)  # a waiter became the holder
        if self.leases.limit:
            principal = conn.principal if conn is not None else "-"
            self.lease_principal[token] = principal
            self.leases.add(principal, 1)

    def lease_ended(self, token: int) -> None:
        """The lease ``token`` was released or expired: uncount it."""
        principal = self.lease_principal.pop(token, None)
        if principal is not None:
            self.leases.add(principal, -1)

    def count_waiters(self, conn: Session) -> None:
        """Re-count ``conn``'s waiters into its principal's total."""
        n = self.server.table.session_waiters(conn.session)
        if n != conn.waiting:
            self.waiters.add(conn.principal, n - conn.waiting)
            conn.waiting = n

    def drop_waiters(self, conn: Session) -> None:
        """``conn`` closed: its waiters are gone."""
        if conn.waiting:
            self.waiters.add(conn.principal, -conn.waiting)
            conn.waiting = 0

    def count_watches(self, conn: Session, delta: int) -> None:
        self.watch_count += delta
        if self.watches.limit:
            self.watches.add(conn.principal, delta)


class ConnectionLimits:
    """The registry of open sessions and the caps on connections.

    ``sessions`` maps session id to :class:`~fastlock.server.session.Session`
    (every counted connection, HELLO done or not).  At the global cap the
    oldest connection that has not completed HELLO is closed to make room (a
    handshake reserve: a flood of idle connections cannot lock out a client
    that authenticates, nor the standby); with no such connection, the new one
    is refused.
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
            return
        fit = max(16, soft - RESERVED_FDS)
        if self.config.max_connections is None:
            self.max_connections = min(DEFAULT_MAX_CONNECTIONS, fit)
        elif self.config.max_connections > fit:
            log.warning("--max-connections %d is above what the open-files limit (%d) allows: using %d",
                        self.config.max_connections, soft, fit)
            self.max_connections = fit
        log.info("connection limits: %d in all, %d per address (open-files limit %d)", self.max_connections,
                 self.config.max_connections_per_address, soft)

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
        if len(self.sessions) >= self.max_connections:
            if not self.unready:
                self.refused_log("refusing connection from %s: %d connections open (--max-connections)",
                                 conn.peer, len(self.sessions))
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
        """HELLO succeeded: the connection leaves the HELLO deadline and the handshake reserve."""
        self.unready.pop(conn.session, None)
        self.pending_proofs.pop(conn.session, None)

    def forget(self, conn: Session) -> bool:
        """Uncount a connection; False if it was not counted (refused or already forgotten)."""
        if self.sessions.pop(conn.session, None) is None:
            return False
        self.unready.pop(conn.session, None)
        self.pending_proofs.pop(conn.session, None)
        n = self.per_address.get(conn.address, 0) - 1
        if n > 0:
            self.per_address[conn.address] = n
        else:
            self.per_address.pop(conn.address, None)
        return True

    def status(self) -> dict:
        return {"connections": len(self.sessions), "connections_without_hello": len(self.unready),
                "max_connections": self.max_connections}

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
