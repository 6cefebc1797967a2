"""WATCH subscriptions: which sessions watch which lock, and the push each change sends them.

A watcher hears ``[name, what, token, client, correlation id, principal]``
(``what``: "granted", "released" or "expired") as a ``PUSH_WATCH`` frame; the
limits on how many watches a connection, a principal and the server may have
are checked by the WATCH handler (:mod:`fastlock.server.handlers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import protocol as P
from .session import split_recorded_client

if TYPE_CHECKING:  # pragma: no cover
    from .session import Session


class WatchRegistry:
    """Lock name -> the sessions watching it.  ``by_name`` is read directly on the
    request path (``name in by_name``) so that an unwatched lock costs one lookup."""

    def __init__(self) -> None:
        self.by_name: dict[str, set[Session]] = {}

    def add(self, conn: Session, name: str) -> None:
        self.by_name.setdefault(name, set()).add(conn)

    def remove(self, conn: Session, name: str) -> None:
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
