"""The one request/reply layer of fastlock's protocol peers.

:class:`RpcConnection` is the asyncio ``Protocol`` under every party that
*sends* requests to a fastlock server: the client's connection, the CLI's
admin commands, the standby's link to its primary, and the test helpers.  It
does exactly the connection-level bookkeeping of the protocol described in
:mod:`fastlock.protocol`, and nothing of any caller's policy:

* **request ids** - :meth:`RpcConnection.request` gives each request the next
  id of this connection (1, 2, ...), remembers a future for it and writes the
  frame (at once on an idle connection; behind requests still in flight, the frames of
  one event-loop turn in one write at its end); the reply ``[id, 0, value]`` resolves the future with ``value``, an
  error reply ``[id, code, message, extra]`` with the exception
  :func:`~fastlock.errors.error_from_wire` builds (``NotPrimary`` keeps the
  primary it names).
* **server pushes** - ``[0, kind, payload]`` frames go to the ``on_push``
  callback, one call per push, in the order the server sent them (what the
  standby's stream of ``"snap"``/``"repl"``/``"hb"`` pushes needs).  After each
  read that held at least one push, ``on_read_end`` is called once (a follower
  acknowledges once per read, however many batches it held).  A push whose
  ``kind`` is a non-zero int is the server's reason for closing the
  connection: it is kept in :attr:`RpcConnection.close_error`.
* **raw frames** - :meth:`RpcConnection.write_raw` writes pre-encoded bytes
  (a caller that encodes a frame once for many peers, or a frame that needs no
  reply); :meth:`RpcConnection.next_id` reserves an id for such a frame.
* **fail-all on close** - when the connection ends (lost, aborted, or a
  malformed or oversized frame from the server), every pending future raises
  :class:`~fastlock.errors.ConnectionLost` at once, later requests fail at
  once, and ``on_close(conn, error)`` is called exactly once.
* **liveness** (optional, ``liveness_timeout`` seconds) - a server that stops
  answering while its TCP connection stays open (a frozen process, a stalled
  VM, a black-holed network) is found by one watchdog timer per connection,
  not per-request timers: while any request or subscription is outstanding,
  a ``PING`` goes out after a third of the timeout without a byte from the
  server, and after the full timeout of silence the connection is aborted
  (:attr:`RpcConnection.silent` is then True).  An idle connection is never
  pinged nor aborted.  While :attr:`RpcConnection.handshaking` is set (the
  HELLO exchange is under way: the server takes nothing but HELLO before it
  ends), no ``PING`` goes out; the connection is aborted after the full
  timeout of silence all the same.

Framing uses :class:`fastlock.protocol.WireDecoder` (the compiled
:class:`fastlock.protocol.framing.FrameDecoder`: msgpack's streaming unpacker with a
frame-size bound).  Everything here runs on the event loop's
thread; nothing is thread-safe.

Example::

    conn = await open_connection("127.0.0.1", 7420, timeout=5.0)
    info = await conn.request(P.OP_HELLO, P.PROTOCOL_VERSION, "me", None)
    status = await conn.request(P.OP_STATUS)
    conn.close()
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Any, cast

from ..errors import ConnectionLost, FastlockError, ProtocolError, error_from_wire
from ..logsafe import quote
from ..units import format_address
from ._wire import RpcWire, WireDecoder
from .framing import REPLY_LIMITS, DecodeLimits, packb
from .ops import OP_PING

log = logging.getLogger(__name__)

__all__ = ["NotFastlockReply", "RpcConnection", "TLS_PROBE_TIMEOUT", "answers_tls_hello", "looks_like_tls",
           "open_connection", "what_answered"]

#: default bound of one frame from a server, bytes (a status or a snapshot
#: reply can be large; a standby's link passes a larger one)
DEFAULT_MAX_FRAME_BYTES = 64 << 20


#: how many of the offending bytes a :class:`NotFastlockReply` keeps
HEAD_BYTES = 16


class NotFastlockReply(ConnectionLost):
    """The server sent bytes that are no fastlock reply (the connection is aborted).

    Attributes:
        head (bytes): the first of them (at most :data:`HEAD_BYTES`), to tell a port that
            speaks another protocol apart (:func:`looks_like_tls`).
    """

    def __init__(self, message: str, head: bytes):
        super().__init__(message)
        self.head = head


def looks_like_tls(head: bytes) -> bool:
    """Whether ``head``, the first bytes a server sent, start a TLS record: an alert
    (content type 21) or a handshake (22), with a 3.x record version - what a TLS port
    answers to a client that speaks plain TCP."""
    return len(head) >= 2 and head[0] in (0x15, 0x16) and head[1] == 0x03


def what_answered(head: bytes, tls: bool, tls_hint: str) -> str:
    """What a server that answered with ``head`` (bytes that are no fastlock reply) is,
    for an error message: a TLS port (then ``tls_hint``, how to turn TLS on) when a
    client without TLS (``tls`` False) got the start of a TLS record; otherwise not a
    fastlock server."""
    if looks_like_tls(head) and not tls:
        return f"it answered in TLS: a TLS port ({tls_hint})"
    return f"not a fastlock server (it answered {head!r})"


#: seconds a TLS probe (:func:`answers_tls_hello`) waits, at most, for the connection and the answer
TLS_PROBE_TIMEOUT = 1.0


async def answers_tls_hello(host: str, port: int, timeout: float = TLS_PROBE_TIMEOUT) -> bool:
    """Whether ``host:port`` answers a TLS client hello with a TLS record (a server hello
    or an alert), within ``timeout`` seconds for the connection and again for the answer.

    For an error message only: a TLS server never speaks first, so a client that spoke
    plain TCP to it hears nothing until the server's handshake deadline.  The probe is
    a new connection that sends the client hello of a throwaway context (no certificate
    checked, nothing else sent) and reads the first bytes back (:func:`looks_like_tls`);
    any failure means "no".
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    outgoing = ssl.MemoryBIO()
    tls = ctx.wrap_bio(ssl.MemoryBIO(), outgoing)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:  # the client hello is written, the server's answer awaited
        pass
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(outgoing.read())
        head = await asyncio.wait_for(reader.read(HEAD_BYTES), timeout)
        return looks_like_tls(head)
    except (OSError, asyncio.TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.transport.abort()


def _ignore_result(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class RpcConnection(RpcWire, asyncio.Protocol):
    """One protocol connection to one server (see the module docstring).

    Args:
        address: ``(host, port)`` of the server, for messages and for callers
            that keep per-address state.
        on_push: ``on_push(kind, payload)``, called for every push in order.
            An exception from it is logged and aborts the connection.
        on_read_end: called once after each read that delivered a push.
        on_close: ``on_close(conn, error)``, called once when the connection
            ends; ``error`` is the :class:`ConnectionLost` pending requests got.
        max_frame: bound of one frame from the server, bytes (default 64 MiB);
            beyond it the connection is aborted (:class:`ProtocolError` inside
            the ``ConnectionLost``).
        liveness_timeout: seconds (> 0) of server silence, while anything is
            outstanding, after which the connection is aborted; None: never.

    Attributes:
        transport: the asyncio transport (None before ``connection_made``).
        closed (bool): the connection ended (or was failed by :meth:`fail`).
        pending (dict[int, asyncio.Future[Any]]): requests without a reply yet.
        subscriptions (int): server-push subscriptions outstanding (watches);
            like a pending request, they keep the liveness watchdog armed.
        last_recv (float): ``loop.time()`` when bytes last arrived.
        close_error (FastlockError | None): the error the server gave for
            closing the connection, if it gave one.
        silent (bool): aborted by the liveness watchdog.
        pings (int): liveness pings sent.
        handshaking (bool): the HELLO exchange is under way (set by
            :func:`fastlock.auth.say_hello`): the watchdog sends no PING.
        received (bool): any byte has arrived.
    """

    # (transport, closed, pending, loop, last_recv, liveness_timeout, _decoder, _next_id, _watchdog: RpcWire's)
    __slots__ = ("address", "subscriptions", "close_error", "silent", "pings", "_on_push", "_on_read_end",
                 "_on_close", "_armed_at", "_ping_sent", "handshaking")

    def __init__(self, address: tuple[str, int] = ("", 0), *,
                 on_push: Callable[[Any, Any], Any] | None = None,
                 on_read_end: Callable[[], Any] | None = None,
                 on_close: Callable[[RpcConnection, ConnectionLost], Any] | None = None,
                 max_frame: int | None = DEFAULT_MAX_FRAME_BYTES,
                 limits: DecodeLimits | None = None,
                 liveness_timeout: float | None = None):
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.subscriptions = 0
        self.loop = asyncio.get_running_loop()
        self.last_recv = self._armed_at = self.loop.time()
        self.out = None
        self.writes = 0
        self.close_error: FastlockError | None = None
        self.silent = False
        self.pings = 0
        self.liveness_timeout = liveness_timeout
        self.handshaking = False
        # what a server sends: replies and pushes (a standby's stream has its own limits)
        self._decoder = WireDecoder(max_frame, limits=limits or REPLY_LIMITS)
        self._next_id = 1
        self._on_push = on_push
        self._on_read_end = on_read_end
        self._on_close = on_close
        self._watchdog: asyncio.TimerHandle | None = None
        # when the last ping went out (loop time); later than last_recv: no byte has come in since
        self._ping_sent = float("-inf")

    @property
    def received(self) -> bool:
        """Any byte has arrived on this connection."""
        return self._decoder.fed > 0

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream transport: create_connection made it

    # data_received(data): RpcWire's (compiled): resolves each reply's future; these take the rest
    def _bad_data(self, exc: ProtocolError, data: bytes) -> None:
        """Bytes that are no msgpack, or a frame beyond the limits: abort."""
        # in the first bytes: a port that speaks something else, which the handshake's caller reports
        log.log(logging.ERROR if self._decoder.fed > len(data) else logging.DEBUG, "bad data from %s: %s",
                self._where(), exc)
        self.abort(NotFastlockReply(f"bad data from the fastlock server at {self._where()}: {exc}",
                                    data[:HEAD_BYTES]))

    def _malformed(self, data: bytes) -> None:
        """A message that is no ``[id, status, ...]``: abort."""
        self.abort(NotFastlockReply(f"malformed message from {self._where()}", data[:HEAD_BYTES]))

    def _push(self, msg: Any) -> bool:
        """A message with request id 0: the server's reason for closing the connection (an
        int kind), or a push for ``on_push``.  False if the connection ended meanwhile."""
        status = msg[1]
        if type(status) is int:
            if status != 0:  # the server's reason for closing the connection
                self.close_error = error_from_wire(status, msg[2] if len(msg) > 2 else "",
                                                   msg[3] if len(msg) > 3 else None)
                log.warning("server %s closes the connection: %s", self._where(), quote(str(self.close_error)))
            return True
        if self._on_push is not None:
            try:
                self._on_push(status, msg[2] if len(msg) > 2 else None)
            except Exception as exc:
                if isinstance(exc, FastlockError):
                    log.error("push %r from %s refused: %s", status, self._where(), exc)
                else:
                    log.exception("push %r from %s failed", status, self._where())
                self.abort(ConnectionLost(f"push {status!r} from {self._where()} failed: {exc}"))
                return False
            if self.closed:
                return False
        return True

    def _read_end(self) -> None:
        """After a read that delivered a push: ``on_read_end``."""
        if self._on_read_end is not None:
            try:
                self._on_read_end()
            except Exception as exc:
                log.exception("read-end hook for %s failed", self._where())
                self.abort(ConnectionLost(f"read-end hook for {self._where()} failed: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        # exc tells e.g. that a TLS server refused this client's certificate
        reason = f"connection to the fastlock server lost: {exc}" if exc else "connection to the fastlock server lost"
        if self.close_error is not None:
            reason = f"the fastlock server closed the connection: {self.close_error}"
        error = ConnectionLost(reason)
        if self.close_error is not None:
            error.__cause__ = self.close_error
        self.fail(error)

    # -- requests ----------------------------------------------------------------------
    # request(op, *args) -> asyncio.Future: RpcWire's (compiled): send [id, op, *args], a future for its reply

    def send(self, op: int, *args: Any) -> None:
        """Send a request whose reply nobody awaits (an error reply is dropped)."""
        self.request(op, *args).add_done_callback(_ignore_result)

    def request_batch(self, requests: list[tuple[Any, ...]]) -> list[asyncio.Future[Any]]:
        """Send several requests ``(op, *args)`` together; a future for each reply's value,
        in order, each as :meth:`request`'s (all raise ConnectionLost at once if the connection
        has ended).  As :meth:`request`: written at once when nothing else is in flight, else
        behind the frames kept for this loop turn's write (:meth:`write_frame`), in order."""
        idle = not self.pending and self.out is None
        futs = [self.expect(self.next_id()) for _ in requests]
        if self.closed or self.transport is None:
            return futs
        first = self._next_id - len(requests)
        data = b"".join(packb([first + i, *req]) for i, req in enumerate(requests))
        if idle:
            self.writes += 1
            self.transport.write(data)
        else:
            self.write_frame(data)
        self.rearm()
        return futs

    def next_id(self) -> int:
        """Reserve a request id for a frame written with :meth:`write_raw`."""
        req_id = self._next_id
        self._next_id = req_id + 1
        return req_id

    def expect(self, req_id: int) -> asyncio.Future[Any]:
        """A future for the reply to ``req_id`` (reserved by :meth:`next_id`
        and sent with :meth:`write_raw`)."""
        fut = self.loop.create_future()
        if self.closed:
            fut.set_exception(ConnectionLost(f"connection to {self._where()} is closed"))
        else:
            self.pending[req_id] = fut
        return fut

    def write_raw(self, data: bytes) -> None:
        """Write pre-encoded frames as they are (dropped if the connection ended), after every
        request written before them (behind frames still kept for this loop turn's write)."""
        if not self.closed and self.transport is not None:
            if self.out is not None:
                self.write_frame(data)
            else:
                self.writes += 1
                self.transport.write(data)

    # -- ending ------------------------------------------------------------------------
    def fail(self, error: ConnectionLost) -> None:
        """Mark the connection dead now: every pending request raises ``error``
        and ``on_close`` runs.  Idempotent; the transport is not touched."""
        if self.closed:
            return
        self.closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        pending = list(self.pending.values())
        self.pending.clear()
        for fut in pending:
            if not fut.done():
                fut.set_exception(error)
        if self._on_close is not None:
            try:
                self._on_close(self, error)
            except Exception:
                log.exception("close hook for %s failed", self._where())

    def abort(self, error: ConnectionLost) -> None:
        """:meth:`fail` with ``error``, then drop the TCP connection without flushing."""
        self.fail(error)
        if self.transport is not None:
            self.transport.abort()

    def close(self, error: ConnectionLost | None = None) -> None:
        """:meth:`fail` (``ConnectionLost("connection closed")`` by default), then
        close the TCP connection after flushing what was written."""
        self.flush()  # requests written in this loop turn go out before the close
        self.fail(error or ConnectionLost("connection closed"))
        if self.transport is not None:
            self.transport.close()

    # -- liveness ----------------------------------------------------------------------
    def _arm_watchdog(self, timeout: float) -> None:
        # Silence counts from when something became outstanding: an idle
        # connection's silence is expected and says nothing about the server.
        now = self._armed_at = self.loop.time()
        self._ping_sent = float("-inf")
        due = now + timeout / 3.0
        self._watchdog = self.loop.call_at(due, self._check_liveness, due)

    def rearm(self) -> None:
        """Arm the liveness watchdog if it is idle (after a subscription began)."""
        if self._watchdog is None and self.liveness_timeout is not None and not self.closed:
            self._arm_watchdog(self.liveness_timeout)

    def _check_liveness(self, due: float | None) -> None:
        """Runs about every ``liveness_timeout / 3`` s while something is
        outstanding: pings a silent server, aborts a connection silent for
        ``liveness_timeout`` s despite a ping.  ``due`` is the ``loop.time()``
        it was scheduled for (None: do not judge lateness)."""
        self._watchdog = None
        timeout = self.liveness_timeout
        transport = self.transport
        if self.closed or (not self.pending and not self.subscriptions) or timeout is None or transport is None:
            return  # idle: re-armed by the next request
        loop = self.loop
        now = loop.time()
        interval = timeout / 3.0
        if due is not None and now - due > interval / 2:
            # We ran late: this process itself was stalled (SIGSTOP, a loop
            # hog), and replies may be sitting unread in the socket.  Look again
            # once the loop has read them (a timer one tick later runs after
            # the next I/O poll, on asyncio and on uvloop) - once: a loop that
            # is always this late must not postpone the verdict for ever.
            self._watchdog = loop.call_at(now + min(interval, 0.05), self._check_liveness, None)
            return
        since = max(self.last_recv, self._armed_at)
        silent = now - since
        pinged = self._ping_sent > self.last_recv  # a ping went out and no byte has come in since
        if silent >= timeout and (pinged or self.handshaking):
            # a server that never answered at all: the handshake's caller reports it (one error, no log noise)
            log.log(logging.WARNING if self.received else logging.DEBUG,
                    "no reply from %s for %.1f s (timeout %s s); dropping the connection", self._where(), silent,
                    timeout)
            self.silent = True
            self.abort(ConnectionLost(f"no reply from the fastlock server at {self._where()} for "
                                      f"{silent:.1f} s (request_timeout {timeout} s)"))
            return
        if silent >= interval and not pinged and not self.handshaking:
            self._ping_sent = now
            pinged = True
            self.pings += 1
            # not through request(): that would re-arm (and restart the silence)
            req_id = self.next_id()
            fut = loop.create_future()
            fut.add_done_callback(_ignore_result)
            self.pending[req_id] = fut
            self.write_frame(packb([req_id, OP_PING]))
        if self.handshaking:
            nxt = since + (timeout if silent >= interval else interval)
        elif pinged:
            nxt = max(since + timeout, self._ping_sent + interval)
        else:
            nxt = since + interval
        nxt = max(nxt, now + 0.001)
        self._watchdog = loop.call_at(nxt, self._check_liveness, nxt)

    def _where(self) -> str:
        return format_address(self.address)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.pending)} pending"
        return f"<RpcConnection {self._where()} {state}>"


async def open_connection(host: str, port: int, *, timeout: float | None = None,
                          factory: Callable[..., RpcConnection] = RpcConnection, ssl: Any = None,
                          server_hostname: str | None = None, **kwargs: Any) -> RpcConnection:
    """Open a TCP connection to ``host:port`` and return its :class:`RpcConnection`.

    ``timeout`` (seconds, None: no bound) bounds the TCP connect (and the TLS
    handshake).  ``ssl`` (an ``ssl.SSLContext``, or None for plain TCP) and
    ``server_hostname`` go to ``loop.create_connection``.  ``factory`` (a
    subclass, or a callable taking the same arguments) makes the protocol
    object; ``kwargs`` go to it.

    Raises:
        OSError: the connection was refused or failed (``ssl.SSLError``: the
            TLS handshake failed).
        TimeoutError: no connection within ``timeout`` seconds.
    """
    loop = asyncio.get_running_loop()
    address = (host, port)
    tls: dict[str, Any] = {} if ssl is None else {"ssl": ssl, "server_hostname": server_hostname or host}
    _, conn = await asyncio.wait_for(
        loop.create_connection(lambda: factory(address, **kwargs), host, port, **tls), timeout)
    return conn
