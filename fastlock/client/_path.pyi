"""Type stub of the compiled :mod:`fastlock.client._path` (see its ``.pyx`` docstring)."""

import asyncio
from typing import Any

from .acquire import AcquireRequest
from .lease import Lease

def acquire_request(name: Any, ttl: Any, wait: Any, lock_delay: Any, correlation_id: Any, shared: Any, limit: Any,
                    priority: Any, preempt: Any) -> AcquireRequest: ...
def grant_lease(name: str, owner: bytes, reply: Any, sent: float, connector: Any) -> Lease: ...
def send_acquire(client: Any, name: Any, ttl: Any, wait: Any, lock_delay: Any, correlation_id: Any, shared: Any,
                 limit: Any, priority: Any, preempt: Any, owner: bytes | None = ...,
                 queue_behind_self: bool = ...) -> FirstAttempt: ...
def take_grant(client: Any, attempt: FirstAttempt, reply: Any, exclusive: bool,
               late_fraction: float) -> Lease | None: ...
def send_release(client: Any, lease: Any, op_timeout: float) -> FirstAttempt: ...
def acquire_tail(connector: Any, kind: tuple[Any, ...], priority: int, who: object) -> tuple[int, tuple[Any, ...]]: ...

IDEMPOTENT_OPS: frozenset[int]

class AttemptBound:
    started: float
    due: float
    op: int

class AttemptBounds:
    connector: Any
    outstanding: dict[int, AttemptBound]
    def __init__(self, connector: Any, loop: Any) -> None: ...
    def begin(self, started: float, attempt: float, op: int) -> int: ...
    def end(self, key: int) -> None: ...

def attempt_bounds(connector: Any, loop: Any) -> AttemptBounds: ...
async def call(connector: Any, op: int, args: tuple[Any, ...], op_timeout: float) -> Any: ...

class FirstAttempt:
    fut: asyncio.Future[Any] | None
    proto: Any
    loop: asyncio.AbstractEventLoop
    started: float
    sent: float
    request: AcquireRequest  # an acquire's (None in a release's)
    who: object
    connector: Any
    op: int
    args: tuple[Any, ...]
    op_timeout: float
    def end(self) -> None: ...
    async def ride_through(self, failed: BaseException | None = None) -> Any: ...
