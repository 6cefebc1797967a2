"""The key watches open on one client connection, and how a ``"value"`` push reaches them.

:class:`KeyWatches` maps each watched prefix to the queues of the watches of it
(:meth:`fastlock.client.Client.watch_prefix`).  A server whose KEY_WATCH reply says
``{"once": True}`` (:mod:`fastlock.server.keys`) pushes a key change ONCE per connection
however many of its watched prefixes match; :meth:`KeyWatches.deliver` then hands it to
every watch whose prefix the key starts with, each under its own prefix.  From a server
without that reply, a push goes to the watches of the prefix it names.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["KeyWatches"]


class KeyWatches(dict[str, set[asyncio.Queue[Any]]]):
    """Prefix -> the queues of its watches; each queue receives ``[prefix, what, key,
    value]`` items (then None when the connection ends).  ``once`` (bool): the server
    pushes a change once per connection (set from KEY_WATCH's reply)."""

    once = False

    def deliver(self, payload: list[Any]) -> None:
        """Hand a ``"value"`` push's payload ``[prefix, what, key, value]`` to its watches."""
        key = payload[2]
        if self.once and type(key) is str:
            for prefix, queues in self.items():
                if key.startswith(prefix):
                    item = [prefix, *payload[1:]]
                    for queue in queues:
                        queue.put_nowait(item)
        else:
            for queue in self.get(payload[0], ()):
                queue.put_nowait(payload)
