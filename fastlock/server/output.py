"""Replies left unread, per principal and in all: :class:`OutputShares`.

A peer that pipelines requests and never reads makes the server hold their
replies (in its connection's transport write buffer).  Each connection has its
cap (``--max-output-bytes``, :mod:`fastlock.server.session`); the shares here
bound what the connections of one principal, and of all principals, hold
together, as the quotas of :mod:`fastlock.server.admission` bound leases,
waiters, watches, keys and connections (:class:`~fastlock.server.admission.PrincipalQuotas`
keeps it as ``output``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..logsafe import RateLimitedLog

if TYPE_CHECKING:  # pragma: no cover
    from .lockserver import LockServer
    from .session import Session
    from .shares import Quota

log = logging.getLogger(__name__)


class OutputShares:
    """Replies left unread (bytes in the connections' transport write buffers), per
    principal and in all, and the share of them each principal may leave unread.

    A connection's unread replies are measured (:meth:`count`) when it is flushed
    while writing is paused (its buffer above the high-water mark, 64 KiB at most)
    and when writing resumes; below the mark they are not counted, so the count is
    low by at most that much per connection.  When a principal's connections together
    leave more than its share unread (``--max-output-bytes-per-principal``; by default
    a quarter of ``--max-output-bytes-total``, the anonymous principal's a sixteenth;
    with one client principal at most, the total), or all clients together more than
    ``--max-output-bytes-total``, the connections (of that principal, or of anyone)
    with the most unread replies are closed until it is within again, each logged
    (at most one line per 10 s), as Redis's client-output-buffer-limit closes a client
    past its limit.  Each connection keeps its own cap too (``--max-output-bytes``).
    A standby's stream is not counted (``--max-replica-output-bytes`` bounds it).
    """

    def __init__(self, server: LockServer, budget: int, share: Quota):
        self.server = server
        self.budget = budget  # bytes, every client together (--max-output-bytes-total)
        self.share = share  # bytes per principal (see fastlock.server.admission.output_share)
        self.total = 0  # bytes counted, every principal together
        self.by_principal: dict[str, int] = {}  # bytes counted per principal (none: absent)
        self.unread: dict[int, int] = {}  # bytes counted per session id (none: absent)
        self.closed_log = RateLimitedLog(log)

    def count(self, conn: Session, unread: int) -> None:
        """``conn`` leaves ``unread`` bytes of replies unread now (0: none, or closed);
        past a share, close the connections with the most."""
        sid = conn.session
        delta = unread - self.unread.get(sid, 0)
        if not delta:
            return
        if unread:
            self.unread[sid] = unread
        else:
            del self.unread[sid]
        principal = conn.principal
        held = self.by_principal.get(principal, 0) + delta
        if held > 0:
            self.by_principal[principal] = held
        else:
            self.by_principal.pop(principal, None)
        self.total += delta
        if delta > 0:
            limit = self.share.limit_for(principal)
            if limit and held > limit:
                self._shed(principal, limit)
            elif self.total > self.budget:
                self._shed(None, self.budget)

    def moved(self, conn: Session, principal: str) -> None:
        """``conn`` now acts as ``principal`` (HELLO): its unread replies count against it."""
        unread = self.unread.get(conn.session, 0)
        if unread and principal != conn.principal:
            self.count(conn, 0)
            held = self.by_principal.get(principal, 0) + unread
            self.by_principal[principal] = held
            self.unread[conn.session] = unread
            self.total += unread

    def _shed(self, principal: str | None, limit: int) -> None:
        """Close the connections of ``principal`` (None: of anyone) with the most unread
        replies until what they leave unread is within ``limit`` bytes again."""
        sessions = self.server.limits.sessions
        replicas = self.server.source.replicas
        candidates = []
        for sid, unread in self.unread.items():
            conn = sessions.get(sid)
            if (conn is not None and not conn.closed and sid not in replicas
                    and (principal is None or conn.principal == principal)):
                candidates.append((unread, conn))
        candidates.sort(key=lambda c: c[0], reverse=True)
        for unread, conn in candidates:
            held = self.total if principal is None else self.by_principal.get(principal, 0)
            if held <= limit:
                break
            if principal is None:
                self.closed_log("closing connection %s (session %d) of principal %r: %d bytes of replies unread; "
                                "all clients leave %d unread (limit %d, --max-output-bytes-total)", conn.peer,
                                conn.session, conn.principal, unread, held, limit)
            else:
                self.closed_log("closing connection %s (session %d) of principal %r: %d bytes of replies unread; "
                                "its principal's connections leave %d unread (share %d, "
                                "--max-output-bytes-per-principal)", conn.peer, conn.session, principal,
                                unread, held, limit)
            conn.abort()
            self.count(conn, 0)

    def status(self) -> dict:
        """What STATUS shows: bytes of unread replies counted, every principal together, and the limit."""
        return {"unread_output_bytes": self.total, "max_output_bytes_total": self.budget}
