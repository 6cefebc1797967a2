"""An ASGI middleware for HTTP services that take fenced writes: each write request
carries its lease's signed sequencer in the ``If-Fencing-Sequencer`` header, and the
service refuses a forged one (403) or a stale one (409) before the app sees it.

Nothing here imports a framework: it wraps any ASGI 3 app (Starlette, FastAPI, Django's
ASGI handler...)::

    from fastlock.contrib.asgi import FencingMiddleware
    from fastlock.sequencer import keys_from_text
    from fastlock.watermarks import SequencerFence

    fence = SequencerFence(keys_from_text(open("group.pub").read()))
    app = FencingMiddleware(app, fence, resource=lambda scope: scope["path"].removeprefix("/ledger/"))

The client sends ``lease.sequencer`` (``connect(sequencers=True)``)::

    httpx.put(url, content=body, headers={"If-Fencing-Sequencer": lease.sequencer})

For a fenced request (by default every method but GET, HEAD and OPTIONS):

* no header: ``428 Precondition Required``;
* a sequencer that does not verify (forged, altered, an unknown key, another resource's,
  expired beyond the skew allowance; :class:`fastlock.sequencer.SequencerRejected`):
  ``403 Forbidden``;
* a valid sequencer whose token is below the highest accepted for the resource
  (:class:`fastlock.errors.StaleFencingToken`): ``409 Conflict``;
* otherwise the app runs, with the verified :class:`~fastlock.sequencer.Sequencer` in
  ``scope["fastlock.sequencer"]``.

Within one process, requests for one resource run the check and the app one at a time
(an ``asyncio.Lock`` per resource while any request for it is in flight), so a stale
holder's write cannot land after a newer holder's accepted one.  Across processes, keep
the mark where the write goes (:class:`fastlock.fencing.SQLiteFence` or
:class:`~fastlock.fencing.PostgresFence` with ``keys``, or a conditional write: see
:mod:`fastlock.watermarks`); this middleware then only refuses early.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..errors import StaleFencingToken
from ..sequencer import SequencerRejected
from ..watermarks import SequencerFence

__all__ = ["FencingMiddleware", "HEADER", "path_resource"]

#: the request header that carries the sequencer (base64url text)
HEADER = "If-Fencing-Sequencer"
_HEADER_KEY = HEADER.lower().encode("ascii")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def path_resource(scope: Scope) -> str | None:
    """The default fenced resource of a request: its path without the one leading ``/``
    (``/orders/1`` -> ``orders/1``, the lock name a client acquires); None without a path."""
    path = scope.get("path")
    return path.removeprefix("/") if isinstance(path, str) else None


class FencingMiddleware:
    """Refuse forged (403) and stale (409) fenced writes (see the module docstring).

    :param app: the ASGI app to wrap.
    :param fence: verifies sequencers and keeps the marks (:class:`SequencerFence`).
    :param resource: the fenced resource (the lock name the sequencer must carry) of a
        request, from its ASGI scope; None: the request is not fenced.  Default:
        :func:`path_resource`, the path without its leading ``/`` (a lock ``orders/1``
        fences ``PUT /orders/1``).
    :param methods: the fenced HTTP methods (default: every method but GET, HEAD, OPTIONS).
    """

    def __init__(self, app: App, fence: SequencerFence, *,
                 resource: Callable[[Scope], str | None] | None = None,
                 methods: frozenset[str] | None = None) -> None:
        self.app = app
        self.fence = fence
        self.resource = resource or path_resource
        self.methods = methods
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # resource -> (lock, requests holding it)

    def _fenced(self, method: str) -> bool:
        if self.methods is not None:
            return method in self.methods
        return method not in ("GET", "HEAD", "OPTIONS")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or not self._fenced(scope.get("method", "")):
            await self.app(scope, receive, send)
            return
        name = self.resource(scope)
        if name is None:
            await self.app(scope, receive, send)
            return
        value = None
        for key, raw in scope.get("headers", ()):
            if key.lower() == _HEADER_KEY:
                value = raw
                break
        if value is None:
            await _answer(send, 428, f"{HEADER} header required for a fenced write to {name!r}")
            return
        lock, users = self._locks.get(name, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[name] = (lock, users + 1)
        try:
            async with lock:
                try:
                    verified = await self.fence.check_async(name, value.decode("latin-1").strip())
                except SequencerRejected as exc:
                    await _answer(send, 403, str(exc))
                    return
                except StaleFencingToken as exc:
                    await _answer(send, 409, str(exc))
                    return
                scope["fastlock.sequencer"] = verified
                await self.app(scope, receive, send)
        finally:
            lock, users = self._locks[name]
            if users == 1:
                del self._locks[name]
            else:
                self._locks[name] = (lock, users - 1)


async def _answer(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode("utf-8")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
