"""The key watches open on one client connection, and how a ``"value"`` push reaches them.

:class:`KeyWatches` maps each watched prefix to the queues of the watches of it
(:meth:`fastlock.client.Client.watch_prefix`).  A server whose KEY_WATCH reply says
``{"once": True}`` (:mod:`fastlock.server.keys`) pushes a key change ONCE per connection
however many of its watched prefixes match; :meth:`KeyWatches.deliver` then hands it to
every watch whose prefix the key starts with, each under its own prefix.  From a server
without that reply, a push goes to the watches of the prefix it names.

A watch that resumes (KEY_WATCH_FROM, :mod:`fastlock.server.keyrevisions`) hears
``"vrev"`` pushes (the change and its position), a ``"vbeg"`` marker before its replay
(:data:`BEGIN` in the queues of that prefix: what came before it is replayed after it)
and ``"vprog"`` progress notices (a ``[prefix, "progress", "", None, revision, WHOLE]``
item in every queue).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["BEGIN", "KeyWatches"]

#: the item a KEY_WATCH_FROM's ``"vbeg"`` push puts in the queues of its prefix
BEGIN = "begin"


class KeyWatches(dict[str, set[asyncio.Queue[Any]]]):
    """Prefix -> the queues of its watches; each queue receives ``[prefix, what, key,
    value]`` items (then None when the connection ends).  ``once`` (bool): the server
    pushes a change once per connection (set from KEY_WATCH's reply)."""

    once = False

    def deliver(self, payload: list[Any]) -> None:
        """Hand a ``"value"`` push's payload ``[prefix, what, key, value]`` (or a ``"vrev"``
        push's, with ``revision, index``: always once per connection) to its watches."""
        key = payload[2]
        if (self.once or len(payload) == 6) and type(key) is str:
            for prefix, queues in self.items():
                if key.startswith(prefix):
                    item = [prefix, *payload[1:]]
                    for queue in queues:
                        queue.put_nowait(item)
        else:
            for queue in self.get(payload[0], ()):
                queue.put_nowait(payload)

    def begin(self, prefix: Any) -> None:
        """A ``"vbeg"`` push: the replay of a KEY_WATCH_FROM of ``prefix`` follows."""
        for queue in self.get(prefix, ()):
            queue.put_nowait(BEGIN)

    def progress(self, revision: Any) -> None:
        """A ``"vprog"`` push: every key change up to ``revision`` was sent."""
        for prefix, queues in self.items():
            item = [prefix, "progress", "", None, revision, None]
            for queue in queues:
                queue.put_nowait(item)
