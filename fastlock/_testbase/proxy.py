"""A fault-injecting TCP proxy on 127.0.0.1, for partition and reset tests.

:class:`TcpProxy` listens on a free loopback port and forwards every
connection to a target address.  It runs its own event loop in a thread, so
it keeps forwarding while the caller blocks, and a test's own loop cannot
partition it by accident.  Start a standby with ``--standby-of
<proxy.address>`` and the replication link goes through it.  Faults, each
applied to every connection or only to the connections with a given *label*:

- :meth:`TcpProxy.blackhole` - a partition: stop forwarding in both
  directions but keep every socket open (nothing is closed, nothing is
  refused; what the peers send waits in their kernel buffers, as TCP
  retransmits during a real partition).  New connections that match are
  accepted and held, not forwarded.
- :meth:`TcpProxy.heal` - end every partition: forward again, including the
  connections held meanwhile.
- :meth:`TcpProxy.cut` - close both sides of every matching connection (a
  reset link).  New connections are forwarded as usual unless black-holed.

Labels come from ``classify``, a function of a connection's first bytes from
the connecting side (read before anything is forwarded).
:func:`classify_fastlock` labels a fastlock standby's replication connection
``"replication"`` and anything else ``"client"``, so that a test can cut the
replication link while clients that were redirected through the same proxy
(a standby names the address it follows as the primary) keep working.

Bounded: at most ``max_connections`` connections at once (more are closed at
once); per connection, at most ``max_buffer_bytes`` read before the target
answered, and otherwise the transports' write buffers (asyncio's 64 KiB
high-water mark): a side whose peer does not drain is not read from.  A
black-holed connection is not read from at all.

The proxy shipped with asyncpg's test base (``test_adversity``) is the model
for putting such a proxy between a client and a real server.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import threading
from collections.abc import Callable
from typing import Any

from fastlock.protocol import OP_HELLO, FrameDecoder

log = logging.getLogger(__name__)

_EVERY = object()  # blackhole() without a label

#: how many of a connection's first bytes ``classify`` sees at most
CLASSIFY_BYTES = 4096


def classify_fastlock(first_bytes: bytes) -> str:
    """``"replication"`` when the first frame is a standby's HELLO (its client
    name starts ``standby:``), else ``"client"``."""
    try:
        msgs = FrameDecoder(CLASSIFY_BYTES).feed(first_bytes)
    except Exception:  # noqa: BLE001 - any undecodable start is simply not a standby
        return "client"
    for msg in msgs:
        if (type(msg) is list and len(msg) > 3 and msg[1] == OP_HELLO and type(msg[3]) is str
                and msg[3].startswith("standby:")):
            return "replication"
        break
    return "client"


class _Side(asyncio.Protocol):
    """One socket of a proxied connection."""

    def __init__(self, link: _Link):
        self.link = link
        self.transport: asyncio.Transport | None = None
        self.reading = True
        self.write_blocked = False  # our transport's buffer is above its high-water mark

    def connection_made(self, transport):
        self.transport = transport
        self.link.side_made(self)

    def data_received(self, data: bytes) -> None:
        self.link.forward(self, data)

    def connection_lost(self, exc):
        self.link.close()

    def pause_writing(self) -> None:
        self.write_blocked = True
        self.link.update_reading()

    def resume_writing(self) -> None:
        self.write_blocked = False
        self.link.update_reading()

    def set_reading(self, want: bool) -> None:
        if self.transport is None or self.transport.is_closing() or want == self.reading:
            return
        self.reading = want
        if want:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()


class _Link:
    """One proxied connection: the accepted side and, once connected, the target side."""

    def __init__(self, proxy: TcpProxy):
        self.proxy = proxy
        self.down = _Side(self)  # towards the connecting client
        self.up: _Side | None = None  # towards the target
        self.label: str | None = None
        self.classified = proxy.classify is None
        self.pending = bytearray()  # read from the client before the target side existed
        self.connecting = False
        self.closed = False

    def side_made(self, side: _Side) -> None:
        if side is self.down and self.classified:
            self.proxy._maybe_connect(self)
        self.update_reading()

    def forward(self, side: _Side, data: bytes) -> None:
        if self.closed:
            return
        self.proxy.record(side is self.down, data)
        if side is self.down and self.up is None:
            self.pending += data
            classify = self.proxy.classify
            if not self.classified and classify is not None:
                self.classified = True
                try:
                    self.label = classify(bytes(self.pending[:CLASSIFY_BYTES]))
                except Exception:
                    log.exception("proxy classifier failed")
                self.proxy._maybe_connect(self)
            self.update_reading()
            return
        peer = self.up if side is self.down else self.down
        if peer is not None and peer.transport is not None and not peer.transport.is_closing():
            peer.transport.write(data)

    def blackholed(self) -> bool:
        holes = self.proxy._holes
        return _EVERY in holes or (self.label is not None and self.label in holes)

    def update_reading(self) -> None:
        if self.closed:
            return
        hole = self.classified and self.blackholed()
        down, up = self.down, self.up
        if up is None:
            down.set_reading(not hole and len(self.pending) < self.proxy.max_buffer_bytes)
            return
        down.set_reading(not hole and not up.write_blocked)
        up.set_reading(not hole and not down.write_blocked)

    async def connect_up(self) -> None:
        proxy = self.proxy
        self.connecting = True
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(lambda: _Side(self), proxy.target[0], proxy.target[1])
        except OSError:
            self.close()
            return
        finally:
            self.connecting = False
        transport = up.transport
        assert transport is not None  # set by connection_made, before create_connection returns
        if self.closed:
            transport.close()
            return
        self.up = up
        if self.pending:
            transport.write(bytes(self.pending))
            self.pending.clear()
        self.update_reading()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.proxy._links.discard(self)
        for side in (self.down, self.up):
            if side is not None and side.transport is not None:
                side.transport.close()


#: where :func:`free_port` looks: below Linux's ephemeral range (32768-60999), so that no
#: server bound to port 0 and no outgoing connection takes the port before the proxy binds it
RESERVED_PORTS = range(20_000, 32_000)


def free_port() -> int:
    """A loopback TCP port free at the time of the call, for a proxy to listen on later
    (from :data:`RESERVED_PORTS`; raises OSError if 200 tries find none)."""
    for _ in range(200):
        port = random.choice(RESERVED_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("no free loopback port below the ephemeral range")


class TcpProxy:
    """Forward 127.0.0.1:<free port> to ``target`` (``"host:port"`` or a tuple).

    Args:
        target: where to forward.
        classify: ``f(first_bytes) -> label or None``, called once per
            connection with (up to :data:`CLASSIFY_BYTES` of) the first bytes
            the connecting side sent; the target is connected only after it.
            Use it only for protocols where the client speaks first (fastlock:
            :func:`classify_fastlock`).  ``None``: every connection unlabelled.
        max_buffer_bytes: bytes read from a client before its target side is
            connected, at most (default 1 MiB); past it the client is not read.
        max_connections: connections at once (default 1024); more are closed.
        record_bytes: bytes kept of each direction, every connection together
            (default 0: none): :meth:`recorded` returns them.
        port: the loopback port to listen on (default 0: a free one).  A server
            reached through the proxy refuses plain-TCP handshakes that name the
            proxy's endpoint unless started with ``--reachable-as 127.0.0.1:PORT``
            (the handshake binds the endpoint a client dialed): :func:`free_port`
            picks the port before the server starts, as :class:`Cluster` does.

    Use as a context manager, or call :meth:`start` and :meth:`close`.  Every
    fault method is thread-safe and returns once the proxy applied it.
    """

    def __init__(self, target: str | tuple[str, int], *, classify: Callable[[bytes], str | None] | None = None,
                 max_buffer_bytes: int = 1 << 20, max_connections: int = 1024, record_bytes: int = 0,
                 port: int = 0):
        if isinstance(target, str):
            host, _, target_port = target.rpartition(":")
            target = (host, int(target_port))
        self.target = target
        self.classify = classify
        self.max_buffer_bytes = max_buffer_bytes
        self.max_connections = max_connections
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._links: set[_Link] = set()
        self._holes: set[Any] = set()
        self._tasks: set[asyncio.Task] = set()
        self.record_bytes = record_bytes
        self._sent = bytearray()  # recorded: what connecting sides sent
        self._answered = bytearray()  # recorded: what the target sent back

    def record(self, from_client: bool, data: bytes) -> None:
        """Keep ``data`` (proxy thread), up to ``record_bytes`` per direction."""
        buf = self._sent if from_client else self._answered
        room = self.record_bytes - len(buf)
        if room > 0:
            buf += data[:room]

    def recorded(self) -> tuple[bytes, bytes]:
        """``(sent, answered)``: the bytes recorded so far from the connecting sides and from the target."""
        return self._run(lambda: (bytes(self._sent), bytes(self._answered)))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        loop = self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self._open())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name="tcpproxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("proxy did not start")
        return self

    async def _open(self) -> None:
        self._server = await asyncio.get_running_loop().create_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def _accept(self) -> asyncio.Protocol:
        if len(self._links) >= self.max_connections:
            return _Refuse()  # closed at once: max_connections reached
        link = _Link(self)
        self._links.add(link)
        return link.down

    def _maybe_connect(self, link: _Link) -> None:
        """Connect ``link`` to the target unless it is held by a partition."""
        if link.closed or link.up is not None or link.connecting or link.blackholed():
            return
        link.connecting = True
        task = asyncio.ensure_future(link.connect_up())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the proxy's loop and return its result (thread-safe)."""
        done = threading.Event()
        box: list[Any] = []
        loop = self._loop
        if loop is None:
            raise RuntimeError("the proxy is not started")

        def call() -> None:
            try:
                box.append(fn())
            finally:
                done.set()

        loop.call_soon_threadsafe(call)
        if not done.wait(10):
            raise RuntimeError("proxy loop did not answer")
        return box[0] if box else None

    def _matching(self, label: str | None) -> list[_Link]:
        return [ln for ln in self._links if label is None or ln.label == label]

    def blackhole(self, label: str | None = None) -> int:
        """Stop forwarding on every connection (``label=None``) or on those
        labelled ``label``, current and new, until :meth:`heal`; sockets stay
        open.  Returns how many current connections it froze."""
        def do() -> int:
            self._holes.add(_EVERY if label is None else label)
            links = self._matching(label)
            for link in links:
                link.update_reading()
            return len(links)

        return self._run(do)

    def heal(self) -> None:
        """End every partition: forward again, and connect the held connections."""
        def do() -> None:
            self._holes.clear()
            for link in list(self._links):
                if link.classified:
                    self._maybe_connect(link)
                link.update_reading()

        self._run(do)

    def cut(self, label: str | None = None) -> int:
        """Close both sides of every current connection (``label=None``) or of
        those labelled ``label``; returns how many."""
        def do() -> int:
            links = self._matching(label)
            for link in links:
                link.close()
            return len(links)

        return self._run(do)

    def count(self, label: str | None = None) -> int:
        """Current connections (with ``label``, if given)."""
        return self._run(lambda: len(self._matching(label)))

    # pause/resume: blackhole/heal of every connection
    def pause(self) -> None:
        """:meth:`blackhole` every connection."""
        self.blackhole()

    def resume(self) -> None:
        """:meth:`heal`."""
        self.heal()

    def close(self) -> None:
        """Close every connection and the listener, and stop the proxy's thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def do() -> None:
            for link in list(self._links):
                link.close()
            for task in list(self._tasks):
                task.cancel()
            if self._server is not None:
                self._server.close()
            loop.call_later(0.05, loop.stop)

        try:
            self._run(do)
        except RuntimeError:
            pass
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport):
        transport.close()
