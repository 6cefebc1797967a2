"""Type stub of the compiled :mod:`fastlock.server._wire` (see its ``.pyx`` docstring)."""

from typing import Any

def ok_nil(req_id: int) -> bytes: ...
def ok_int(req_id: int, value: int) -> bytes: ...
def ok_grant(req_id: int, token: int, ttl_ms: int, waited_ms: int) -> bytes: ...
def dispatch(handlers: Any, conn: SessionWire, msg: Any) -> None: ...

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
    def data_received(self, data: bytes) -> None: ...
    def send(self, data: bytes) -> None: ...
