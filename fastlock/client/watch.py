"""Watches: the holder changes of one lock, pushed by the server (no polling).

A watch asks with WATCH_FROM (:mod:`fastlock.server.watchlog`): every change it
hears carries a revision, and when its connection drops (or the primary fails
over) it subscribes again on the connection the client rides to, from the last
revision it delivered, so that it sees every change once and in order.  From a
server without WATCH_FROM it watches with WATCH and ends with ``ConnectionLost``
when its connection does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from .. import protocol as P
from ..errors import ConnectionLost, ProtocolError
from ..protocol.ops import OP_WATCH_FROM
from .connection import RETRYABLE, ClientConnection, Connector, RideThrough
from .lease import WatchEvent

__all__ = ["watch_events", "subscribe", "unsubscribe"]

Registry = Callable[[ClientConnection], dict[str, set[asyncio.Queue[Any]]]]


async def subscribe(connector: Connector, timeout: float, registry: Registry, op: int,
                    key: str, args: tuple[Any, ...] = ()) -> tuple[ClientConnection, asyncio.Queue[Any], Any]:
    """Start a watch of ``key`` (a lock name, or a key prefix) with request ``op``
    (its arguments: ``key``, then ``args``).

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
            reply = await proto.request(op, key, *args)
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


async def watch_events(connector: Connector, name: str, timeout: float,
                       progress: bool = False) -> AsyncIterator[WatchEvent]:
    """Yield :class:`WatchEvent` for every change of ``name``'s holder (see
    :meth:`Client.watch <fastlock.client.Client.watch>`), starting with its
    holder now; started by :func:`subscribe`, and started again from the last
    revision delivered when the connection drops (each attempt rides through a
    failover within ``timeout`` seconds).  ``progress``: yield ``"progress"``
    events too.

    :raises Compacted: the server no longer keeps the changes since the last revision.
    :raises WatchDiverged: the server never had that revision (see docs/watches.md).
    :raises ConnectionLost: the client closed, or no primary answered within ``timeout``.
    """
    P.check_name(name)
    try:
        proto, queue, reply = await subscribe(connector, timeout, _lock_watches, OP_WATCH_FROM, name, (None,))
    except ProtocolError:  # a server without revisions
        async for event in _plain_watch(connector, name, timeout):
            yield event
        return
    last: int = reply["revision"]
    subscribed = True
    try:
        yield _first_event(name, reply["holder"], last)
        while True:
            event = await queue.get()
            if event is None:
                unsubscribe(proto, _lock_watches, name, queue, P.OP_UNWATCH)
                subscribed = False
                if connector.closed:
                    raise ConnectionLost(f"connection lost while watching {name!r}")
                proto, queue, reply = await subscribe(connector, timeout, _lock_watches, OP_WATCH_FROM, name,
                                                      (last,))
                subscribed = True
                # after the changes replayed (already queued): every change up to it was sent
                queue.put_nowait(WatchEvent(name, "progress", None, None, revision=reply["revision"]))
                continue
            rev = event.revision
            if event.kind == "progress":
                if rev >= last:  # (an idle watch hears the same revision again: still a notice)
                    last = rev
                    if progress:
                        yield event
                continue
            if rev is not None:
                if rev <= last:
                    continue  # delivered already (before a resume)
                last = rev
            yield event
    finally:
        if subscribed:
            unsubscribe(proto, _lock_watches, name, queue, P.OP_UNWATCH)


def _first_event(name: str, info: Any, revision: int | None) -> WatchEvent:
    """The ``"held"``/``"free"`` event that begins a watch (``info``: the holder or None)."""
    if info is None:
        return WatchEvent(name, "free", None, None, revision=revision)
    return WatchEvent(name, "held", info["token"], info["client"], info.get("correlation_id"),
                      info.get("principal"), revision)


async def _plain_watch(connector: Connector, name: str, timeout: float) -> AsyncIterator[WatchEvent]:
    """A WATCH without revisions: it ends with ``ConnectionLost`` when its connection does."""
    proto, queue, info = await subscribe(connector, timeout, _lock_watches, P.OP_WATCH, name)
    try:
        yield _first_event(name, info, None)
        while True:
            event = await queue.get()
            if event is None:
                raise ConnectionLost(f"connection lost while watching {name!r}")
            if event.kind != "progress":
                yield event
    finally:
        unsubscribe(proto, _lock_watches, name, queue, P.OP_UNWATCH)
