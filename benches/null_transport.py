"""A transport that does nothing, the base of the in-process fakes.

:class:`NullTransport` has the methods of an ``asyncio.Transport`` that a connection
may call besides ``write`` - ``get_extra_info``, ``is_closing``, ``close``, ``abort``,
reading and write-buffer flow control - each doing nothing and answering as an open
transport with an empty buffer would; ``write`` drops the bytes.  The fakes that stand
for a socket (:mod:`benches.client_path`, :mod:`benches.server_path` and the client path's
tests) subclass it and define ``write``.
"""

from __future__ import annotations

from typing import Any


class NullTransport:
    """An open transport that writes nowhere: every method does nothing."""

    def write(self, data: bytes) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_limits(self) -> tuple[int, int]:
        """The low and high water marks in bytes: asyncio's defaults, 16 KiB and 64 KiB."""
        return (16 << 10, 64 << 10)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0
