"""Type stub of the compiled :mod:`fastlock.protocol._wire` (see its ``.pyx`` docstring)."""

import asyncio
from typing import Any

from .framing import FrameDecoder

def feed_frames(decoder: FrameDecoder, data: bytes) -> list[Any]: ...

class RpcWire:
    transport: asyncio.Transport | None
    closed: bool
    pending: dict[int, asyncio.Future[Any]]
    loop: asyncio.AbstractEventLoop
    last_recv: float
    liveness_timeout: float | None
    _decoder: FrameDecoder
    _next_id: int
    _watchdog: asyncio.TimerHandle | None
    out: list[bytes] | None
    writes: int
    def data_received(self, data: bytes) -> None: ...
    def request(self, op: int, *args: Any) -> asyncio.Future[Any]: ...
    def write_frame(self, frame: bytes) -> None: ...
    def flush(self) -> None: ...
