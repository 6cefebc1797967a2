"""What the throwaway servers of the tests share (tests/pgserver.py, tests/etcdserver.py):
a free loopback port, and the tail of a child process's output read on a thread."""

from __future__ import annotations

import socket
import threading
from collections import deque
from collections.abc import Callable

__all__ = ["ProcessOutput", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessOutput:
    """The last ``keep`` lines a child wrote to a pipe, read on a daemon thread.

    ``on_line(line)`` (optional) sees each line as it arrives; :attr:`closed` is
    set once the pipe closed (the child exited).
    """

    def __init__(self, keep: int = 200, on_line: Callable[[str], None] | None = None) -> None:
        self.lines: deque[str] = deque(maxlen=keep)
        self.on_line = on_line
        self.closed = threading.Event()

    def follow(self, stream) -> None:
        """Start reading ``stream`` (a binary pipe) from a fresh start."""
        self.lines.clear()
        self.closed.clear()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip()
            self.lines.append(line)
            if self.on_line is not None:
                self.on_line(line)
        stream.close()
        self.closed.set()

    def tail(self, n: int = 30) -> str:
        return "\n".join(list(self.lines)[-n:])
