"""Type stub of the compiled :mod:`fastlock.replication._wire` (see its ``.pyx`` docstring)."""

from typing import Any

class SyncWire:
    enabled: bool

class QueuesWire:
    dirty: set[str]
    shipped: dict[str, list[bytes]]
    informed: set[int]

class SourceWire:
    fencing: bool
    sync: Any
    ttl: Any
    replicas: dict[int, Any]
