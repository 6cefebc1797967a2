"""Type stub of the compiled :mod:`fastlock.server._watchlog` (see its ``.pyx`` docstring)."""

from typing import Any

class ChangeLogWire:
    pending: Any
    def publish(self, upto: int) -> list[Any]: ...
    def mark_published(self, upto: int) -> None: ...

class HistoryWire(ChangeLogWire):
    limit: int
    changes: Any
    by_name: dict[str, Any]
    floor: int | None
    published: int
    def record(self, rev: int, name: str, what: str, token: int, meta: Any, published: bool = False) -> None: ...

class CommittedWire:
    server: Any
    source: Any
    log: Any
    revision_at: int
    commit: Any
    scheduled: int
    def listening(self) -> bool: ...
    def deliver(self, changes: list[Any]) -> bool: ...
    def batch_end(self) -> None: ...
    def settle(self) -> None: ...
    def listener_added(self) -> None: ...
    def _publish(self, upto: int, refused: Any = None, flush: bool = True) -> None: ...

class RevisionsWire(CommittedWire):
    registry: Any
    watched: dict[str, Any]
    table: Any
    def logged(self, name: str, what: str, token: int, meta: Any) -> None: ...
