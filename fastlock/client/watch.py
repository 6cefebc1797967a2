"""Watches: the holder changes of one lock, pushed by the server (no polling)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from .. import protocol as P
from ..errors import ConnectionLost
from .connection import RETRYABLE, ClientConnection, Connector, RideThrough
from .lease import WatchEvent

__all__ = ["watch_events", "subscribe", "unsubscribe"]

Registry = Callable[[ClientConnection], dict[str, set[asyncio.Queue[Any]]]]


async def subscribe(connector: Connector, timeout: float, registry: Registry, op: int,
                    key: str) -> tuple[ClientConnection, asyncio.Queue[Any], Any]:
    """Start a watch of ``key`` (a lock name, or a key prefix) with request ``op``.

    A queue is registered in ``registry(connection)`` (the connection's push handler
    feeds it; ``None`` means the connection ended) before the request goes out, so no
    push is missed.  Starting rides through a failover within ``timeout`` seconds,
    as every call does.  Returns ``(connection, queue, reply)``; the watch keeps the
    connection's liveness watchdog armed until :func:`unsubscribe`.
    """
    pacing = RideThrough(connector, asyncio.get_running_loop().time() + timeout)
    pause = False
    while True:
        proto = await pacing.connection(pause)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        registry(proto).setdefault(key, set()).add(queue)
        try:
            reply = await proto.request(op, key)
            break
        except RETRYABLE as exc:
            _drop(registry(proto), key, queue)
            if connector.closed:
                raise
            pause = pacing.failed(proto, exc)
    proto.subscriptions += 1
    proto.rearm()
    return proto, queue, reply


def unsubscribe(proto: ClientConnection, registry: Registry, key: str, queue: asyncio.Queue[Any],
                op: int) -> None:
    """End a watch :func:`subscribe` started; the server is told (request ``op``) when
    it was the connection's last watch of ``key``."""
    proto.subscriptions -= 1
    if _drop(registry(proto), key, queue) and not proto.closed:
        proto.send(op, key)


def _drop(watches: dict[str, set[asyncio.Queue[Any]]], key: str, queue: asyncio.Queue[Any]) -> bool:
    """Remove ``queue``; True if it was ``key``'s last."""
    group = watches.get(key)
    if group is None:
        return False
    group.discard(queue)
    if group:
        return False
    del watches[key]
    return True


def _lock_watches(proto: ClientConnection) -> dict[str, set[asyncio.Queue[Any]]]:
    return proto.watches


async def watch_events(connector: Connector, name: str, timeout: float) -> AsyncIterator[WatchEvent]:
    """Yield :class:`WatchEvent` for every change of ``name``'s holder (see
    :meth:`Client.watch <fastlock.client.Client.watch>`), starting with its
    holder now; started by :func:`subscribe`."""
    P.check_name(name)
    proto, queue, info = await subscribe(connector, timeout, _lock_watches, P.OP_WATCH, name)
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
        unsubscribe(proto, _lock_watches, name, queue, P.OP_UNWATCH)
