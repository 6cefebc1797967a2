"""Type stub of the compiled :mod:`fastlock.client._callers` (see its ``.pyx`` docstring)."""

import asyncio
import weakref
from contextvars import ContextVar
from typing import Any, NamedTuple

from .lease import Lease

class Caller:
    task: weakref.ref[asyncio.Task[Any]]
    parent: Caller | None
    held: dict[int, int] | None
    actor: int
    def __init__(self, task: asyncio.Task[Any], parent: Caller | None) -> None: ...

def party(who: Caller, key: int) -> Caller: ...

CALLER: ContextVar[object | None]
MAX_ANCESTRY: int

def current_caller(loop: asyncio.AbstractEventLoop | None = None) -> object: ...
def new_caller() -> None: ...
def acts_for(who: object, holder: object) -> bool: ...
def actor_id(connector: object | None = None, who: object = None) -> int: ...

SWEEP_MIN: int

class HeldLease(NamedTuple):
    lease: Lease
    caller: object
    exclusive: bool
    party: Caller | None

class HeldLeases:
    by_name: dict[str, HeldLease]
    def __init__(self, connector: object | None = None) -> None: ...
    def remember(self, lease: Lease, exclusive: bool, loop: asyncio.AbstractEventLoop | None = None,
                 who: object = None) -> None: ...
    def forget(self, lease: Lease) -> None: ...
    def refuse_self_wait(self, entry: HeldLease, exclusive: bool) -> None: ...
