"""Type stub of the compiled :mod:`fastlock.protocol._wire` (see its ``.pyx`` docstring)."""

import asyncio
from typing import Any

from .framing import DecodeLimits, FrameDecoder

def feed_frames(decoder: FrameDecoder | WireDecoder, data: bytes) -> list[Any]: ...

def encode_request(req_id: Any, op: Any, args: tuple[Any, ...]) -> bytes: ...

class WireDecoder:
    reference: FrameDecoder
    shape_all: bool
    def __init__(self, max_frame: int | None = None, *, limits: DecodeLimits | None = None,
                 shape_all: bool = False) -> None: ...
    @property
    def limits(self) -> DecodeLimits: ...
    @property
    def fed(self) -> int: ...
    def feed(self, data: bytes) -> list[Any]: ...

class RpcWire:
    transport: asyncio.Transport | None
    closed: bool
    pending: dict[int, asyncio.Future[Any]]
    loop: asyncio.AbstractEventLoop
    last_recv: float
    liveness_timeout: float | None
    _decoder: WireDecoder
    _next_id: int
    _watchdog: asyncio.TimerHandle | None
    out: list[bytes] | None
    writes: int
    def data_received(self, data: bytes) -> None: ...
    def request(self, op: int, *args: Any) -> asyncio.Future[Any]: ...
    def write_frame(self, frame: bytes) -> None: ...
    def flush(self) -> None: ...
