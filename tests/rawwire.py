"""A blocking msgpack connection for the tests that write frames by hand (several in one
write, to put them in one batch of the server) and read the replies one at a time."""

from __future__ import annotations

import socket

import msgpack

from fastlock import protocol as P

__all__ = ["RawWire"]


class RawWire:
    """One TCP connection to a server on 127.0.0.1:``port``; a context manager that closes it.

    :param timeout: seconds a connect, a send or a read may take before ``OSError``.
    """

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.unpacker = msgpack.Unpacker()

    def __enter__(self) -> RawWire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, *frames: list) -> None:
        """Write ``frames`` in one ``sendall`` (one read for the server, usually one batch)."""
        self.sock.sendall(b"".join(msgpack.packb(f) for f in frames))

    def reply(self) -> list:
        """The next reply frame; AssertionError if the server closes the connection first."""
        for obj in self.unpacker:
            return obj
        while True:
            data = self.sock.recv(65536)
            assert data, "the server closed the connection"
            self.unpacker.feed(data)
            for obj in self.unpacker:
                return obj

    def hello(self, client_name: str) -> list:
        """An anonymous HELLO (a server without credentials); its reply."""
        self.send([1, P.OP_HELLO, P.PROTOCOL_VERSION, client_name, None])
        return self.reply()
