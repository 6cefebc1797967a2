"""Type stub of the compiled :mod:`fastlock.server._watchlog` (see its ``.pyx`` docstring)."""

from typing import Any

class HistoryWire:
    limit: int
    changes: Any
    by_name: dict[str, Any]
    pending: Any
    floor: int | None
    published: int
    def record(self, rev: int, name: str, what: str, token: int, meta: Any, published: bool = False) -> None: ...
    def publish(self, upto: int) -> list[tuple[int, str, str, int, Any]]: ...

class CommittedWire:
    server: Any
    log: Any
    revision_at: int
    commit: Any
    scheduled: int
    def listening(self) -> bool: ...
    def deliver(self, changes: list[Any]) -> bool: ...
    def batch_end(self) -> None: ...
    def listener_added(self) -> None: ...
    def _publish(self, upto: int, refused: Any = None, flush: bool = True) -> None: ...

class RevisionsWire(CommittedWire):
    registry: Any
    def logged(self, name: str, what: str, token: int, meta: Any) -> None: ...
