"""WATCH subscriptions: which sessions watch which lock, and the push each change sends them.

A watcher hears ``[name, what, token, client, correlation id, principal]``
(``what``: "granted", "released" or "expired") as a ``PUSH_WATCH`` frame; the
limits on how many watches a connection, a principal and the server may have
are checked by the WATCH handler (:mod:`fastlock.server.handlers`).  A connection
that watches with WATCH_FROM (``revisioned``) hears the same payload and the
change's revision as a ``PUSH_WATCH_REV`` frame (:mod:`fastlock.server.watchlog`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import protocol as P
from ..protocol.ops import PUSH_WATCH_REV
from .session import split_recorded_client
from .watchlog import Kept

if TYPE_CHECKING:  # pragma: no cover
    from .session import Session


class WatchRegistry:
    """Lock name -> the sessions watching it.  ``by_name`` is read directly on the
    request path (``name in by_name``) so that an unwatched lock costs one lookup."""

    def __init__(self) -> None:
        self.by_name: dict[str, set[Session]] = {}
        #: the session ids of the connections that watch with WATCH_FROM (revisioned pushes)
        self.revisioned: set[int] = set()
        #: (session id, lock name) -> the revision a new watch began at: its reply showed the
        #: holder with every change logged up to it, so the changes up to it published later
        #: are not pushed to it again (dropped once a later change reaches it)
        self.starts: dict[tuple[int, str], int] = {}

    def add(self, conn: Session, name: str, start: int | None = None) -> None:
        """``conn`` watches ``name``; ``start``: the revision its reply's holder state has (None:
        a resumed watch, which hears every change after the revision it resumed from)."""
        self.by_name.setdefault(name, set()).add(conn)
        if start is not None:
            self.starts[(conn.session, name)] = start

    def remove(self, conn: Session, name: str) -> None:
        self.starts.pop((conn.session, name), None)
        group = self.by_name.get(name)
        if group is not None:
            group.discard(conn)
            if not group:
                del self.by_name[name]

    def notify(self, name: str, what: str, token: int, meta: tuple | None) -> None:
        """Tell ``name``'s watchers (there must be some) that its lease was ``what``;
        ``meta`` is the lease's (recorded client, correlation id)."""
        client, corr = meta if meta else (None, None)
        principal, client = split_recorded_client(client)
        data = P.encode_push(P.PUSH_WATCH, [name, what, token, client, corr, principal])
        for conn in self.by_name[name]:
            conn.send(data)

    def publish(self, changes: list[Kept]) -> bool:
        """Push committed ``changes`` (``(revision, name, what, token, meta)``, in revision
        order) to their locks' watchers; returns whether any push was queued."""
        by_name = self.by_name
        if not by_name:
            return False
        sent = False
        revisioned = self.revisioned
        starts = self.starts
        for rev, name, what, token, meta in changes:
            conns = by_name.get(name)
            if not conns:
                continue
            client, corr = meta if meta else (None, None)
            principal, client = split_recorded_client(client)
            payload = [name, what, token, client, corr, principal]
            plain = with_revision = None
            for conn in conns:
                if starts:
                    start = starts.get((conn.session, name))
                    if start is not None:
                        if rev <= start:
                            continue  # already in the holder state its watch began with
                        del starts[(conn.session, name)]
                if conn.session in revisioned:
                    if with_revision is None:
                        with_revision = P.encode_push(PUSH_WATCH_REV, [*payload, rev])
                    conn.send(with_revision)
                else:
                    if plain is None:
                        plain = P.encode_push(P.PUSH_WATCH, payload)
                    conn.send(plain)
                sent = True
        return sent
