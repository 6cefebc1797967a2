"""Watches: the holder changes of one lock, pushed by the server (no polling)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from .. import protocol as P
from ..errors import ConnectionLost
from .connection import RETRYABLE, Connector, RideThrough
from .lease import WatchEvent

__all__ = ["watch_events"]


async def watch_events(connector: Connector, name: str, timeout: float) -> AsyncIterator[WatchEvent]:
    """Yield :class:`WatchEvent` for every change of ``name``'s holder (see
    :meth:`Client.watch <fastlock.client.Client.watch>`).  Starting the watch
    rides through a failover within ``timeout`` seconds; the events flow
    through the queue the connection's push handler feeds (``None`` there
    means the connection ended)."""
    P.check_name(name)
    pacing = RideThrough(connector, asyncio.get_running_loop().time() + timeout)
    pause = False
    while True:  # starting rides through a failover, as every call does
        proto = await pacing.connection(pause)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        proto.watches.setdefault(name, set()).add(queue)
        try:
            info = await proto.request(P.OP_WATCH, name)
            break
        except RETRYABLE as exc:
            group = proto.watches.get(name)
            if group is not None:
                group.discard(queue)
                if not group:
                    del proto.watches[name]
            if connector.closed:
                raise
            pause = pacing.failed(proto, exc)
    proto.subscriptions += 1
    proto.rearm()  # the watch keeps the liveness watchdog armed
    try:
        if info is None:
            yield WatchEvent(name, "free", None, None)
        else:
            yield WatchEvent(name, "held", info["token"], info["client"], info.get("correlation_id"),
                             info.get("principal"))
        while True:
            event = await queue.get()
            if event is None:
                raise ConnectionLost(f"connection lost while watching {name!r}")
            yield event
    finally:
        proto.subscriptions -= 1
        group = proto.watches.get(name)
        if group is not None:
            group.discard(queue)
            if not group:
                del proto.watches[name]
                if not proto.closed:
                    proto.send(P.OP_UNWATCH, name)
