"""Type stub of the compiled :mod:`fastlock.client._path` (see its ``.pyx`` docstring)."""

from typing import Any

from .acquire import AcquireRequest
from .lease import Lease

def acquire_request(name: Any, ttl: Any, wait: Any, lock_delay: Any, correlation_id: Any, shared: Any, limit: Any,
                    priority: Any, preempt: Any) -> AcquireRequest: ...
def grant_lease(name: str, owner: bytes, reply: Any, sent: float, connector: Any) -> Lease: ...
