"""Type stub of the compiled :mod:`fastlock.server._wire` (see its ``.pyx`` docstring)."""

from collections.abc import Sequence
from typing import Any

def ok_nil(req_id: int) -> bytes: ...
def ok_int(req_id: int, value: int) -> bytes: ...
def ok_grant(req_id: int, token: int, ttl_ms: int, waited_ms: int) -> bytes: ...
def dispatch(handlers: Any, conn: SessionWire, msg: Any) -> None: ...
def acquire(handlers: Any, conn: SessionWire, req_id: int, msg: list[Any], priority: int = 0) -> None: ...
def enter_acquire(handlers: Any, conn: SessionWire, req_id: int, msg: list[Any], name: str, owner: bytes,
                  priority: int = 0) -> None: ...
def deliver_grants(sessions: dict[int, Any], grants: list[Any]) -> list[Any]: ...
def release(handlers: Any, conn: SessionWire, req_id: int, msg: list[Any]) -> None: ...
def extend(handlers: Any, conn: SessionWire, req_id: int, msg: list[Any]) -> None: ...

class HandlersWire:
    server: Any
    table: Any
    roles: Any
    wal: Any
    config: Any
    source: Any
    quotas: Any
    watchers: Any
    keys: Any
    sessions: Any
    kinds: Any
    by_op: Any
    need_by_op: Any
    acquire_handler: Any
    release_handler: Any

class IntakeWire:
    decoder: Any
    raw: bytes
    raw_at: int
    pending: list[Any]
    next: int
    held: bool
    scheduled: bool

class ExpiryWire:
    handle: Any
    at_ms: int

class LimitsWire:
    sessions: dict[int, Any]
    idle_timeout_ms: int

class DelaysWire:
    per_principal: dict[str, Any]

class ReclaimWire:
    queues: dict[str, Any]

class SessionsWire:
    attached_to: dict[Any, Any]

class KeysWire:
    space: Any

class SessionWire:
    server: Any
    session: int
    intake: Any
    transport: Any
    out: list[bytes]
    out_bytes: int
    closed: bool
    ready: bool
    last_read_ms: int
    _drain: Any
    grant: Any
    @property
    def grant_everywhere(self) -> frozenset[str]: ...
    @property
    def grant_admin(self) -> bool: ...
    @property
    def grant_name(self) -> str: ...
    def data_received(self, data: bytes) -> None: ...
    def flush(self) -> None: ...
    def send(self, data: bytes) -> None: ...
    def owner_hash(self, owner: Any) -> bytes: ...

class BatchEnd:
    admitted: frozenset[Any] | None
    in_batch_end: bool
    batch_end_owed: bool
    granted_logged: int
    commit: Any
    snapshots: Any
    def process_events(self, events: list[Any]) -> None: ...
    def after_batch(self) -> None: ...
    def acknowledge(self, grants: list[Any]) -> None: ...
    def deliver_granted(self, grants: list[Any], refused_by: Any = None) -> None: ...
    def log_decided(self) -> None: ...
    def log_decided_for(self, token: int) -> None: ...
    def released(self, name: str, token: int, meta: tuple[Any, ...] | None, principal: str | None = None) -> None: ...

class UsageWire:
    leases: dict[Any, str]
    waiting: int

class QuotaCounts:
    ended_early: set[int]
    counted_now: set[int]
    def check_acquire(self, principal: str, leases: int, waiters: int) -> Any: ...
    def lock_delay_count(self, now: int) -> int: ...
    def acquired(self, u: Any, status: int, names: Sequence[str], last_token: int) -> None: ...
    def grant_event(self, ev: Any) -> None: ...
    def lease_ended(self, token: int, meta: Any = None, principal: str | None = None,
                    name: str | None = None) -> None: ...
