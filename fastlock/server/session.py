"""One client connection = one session: its input, output buffering, flow control and closing.

:class:`Session` is the asyncio protocol of every accepted connection.  It
feeds received bytes to a :class:`~fastlock.protocol.FrameDecoder`, hands each
request to the server's op handler table (:mod:`fastlock.server.handlers`),
and queues replies in memory until the end of the loop turn, when the server
flushes every session written to once (one ``transport.write`` per session per
turn).  A peer that leaves more than ``out_cap`` bytes of replies unread is
dropped, and a principal whose connections together leave more than its share
unread loses the ones with the most (:class:`~fastlock.server.output.OutputShares`);
while its transport's buffer is above the high-water mark its
requests are not read (a standby's acknowledgements keep flowing).  The
transport's high-water mark is kept at or below ``out_cap``, so a buffer
beyond the cap has always paused writing first: the cap is checked only
while writing is paused, not on every flush.

Work per loop turn is bounded per connection (:class:`Intake`): one read may
carry tens of thousands of pipelined requests; it is decoded a piece
(:data:`FEED_BYTES`) at a time, and at most :data:`MAX_REQUESTS_PER_TURN` (or
about :data:`TURN_BUDGET_NS`) of its requests are dispatched in a turn; the
rest wait, in order, for a later turn (``loop.call_soon``) while the
connection's reading is paused, so every other connection is served in
between.  Replies keep the order of their requests.

The input and the reply queue are compiled (:class:`~fastlock.server._wire.SessionWire`,
``fastlock/server/_wire.pyx``, the base of :class:`Session`): a short read is decoded and a
lone request dispatched there (:func:`fastlock.server._wire.dispatch`); the backlog below,
the output, flow control and closing are here.

Waiting goes by session (a waiter whose connection drops is removed at once);
ownership goes by lease (a held lease outlives its connection until its TTL).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, cast

from .. import protocol as P
from ..auth import ANONYMOUS, Principal
from ..errors import FastlockError, ProtocolError
from ..tls import peer_identity
from ..units import monotonic_ms
from ._wire import IntakeWire, SessionWire, dispatch

if TYPE_CHECKING:  # pragma: no cover
    from .lockserver import LockServer

log = logging.getLogger(__name__)

#: replies queued in one loop turn beyond which they go to the transport at once
FLUSH_EARLY_BYTES = 256 << 10


#: most requests of one connection dispatched in one loop turn (Intake); the rest of its
#: reads wait for a later turn.  A count bounds a turn of cheap requests (a PING costs a
#: few microseconds), the time below one of costly ones (a STATUS ~30 microseconds)
MAX_REQUESTS_PER_TURN = 64
#: ... and none after this long (nanoseconds, checked after each request): a loop turn
#: with C connections pipelining is then about C ms (at most LOOP_BUDGET_NS, below)
TURN_BUDGET_NS = 1_000_000
#: the loop time the connections with a backlog share in one loop turn (nanoseconds): with
#: more than ten, each gets its share of it (at least MIN_TURN_NS), so a new connection waits
#: about this long for its turn however many connections pipeline
LOOP_BUDGET_NS = 10_000_000
MIN_TURN_NS = 100_000
#: bytes of a read decoded at a time (about 1 ms of decoding at the worst: 5-byte requests)
FEED_BYTES = 16 << 10
#: ... before HELLO, when the decoder walks every byte first (about 1 ms of walking)
FEED_BYTES_BEFORE_HELLO = 1 << 10


class Backlogs:
    """How many connections (of every server in this process) have a backlog of requests
    now: each one's turn is a share of :data:`LOOP_BUDGET_NS`."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def turn_ns(self) -> int:
        """One connection's share of a loop turn (nanoseconds)."""
        return max(MIN_TURN_NS, min(TURN_BUDGET_NS, LOOP_BUDGET_NS // max(1, self.count)))


#: the connections with a backlog now
BACKLOGS = Backlogs()


class Intake(IntakeWire):
    """A connection's request decoder, the bytes received but not yet decoded and the
    requests decoded but not yet dispatched (its fields are slots of its compiled base,
    :class:`~fastlock.server._wire.IntakeWire`).

    ``decoder`` (:class:`~fastlock.protocol.WireDecoder`, None once closed); ``raw``:
    received bytes, decoded from offset ``raw_at`` on, a piece (:data:`FEED_BYTES`) at a
    time; ``pending``: decoded requests, dispatched from index ``next`` on; ``held``:
    reading is paused until the backlog is dispatched; ``scheduled``: a later turn's
    dispatch is queued (``call_soon``).  The backlog is dispatched whether or not the
    peer reads its replies: one that leaves more than the output cap unread is dropped.
    """

    __slots__ = ()

    def __init__(self, decoder: P.WireDecoder):
        self.decoder: P.WireDecoder | None = decoder
        self.raw = b""
        self.raw_at = 0
        self.pending: list[Any] = []
        self.next = 0
        self.held = False
        self.scheduled = False

    def add(self, data: bytes) -> None:
        """Keep a read's bytes behind those not yet decoded."""
        if self.raw_at >= len(self.raw):
            self.raw = data
        else:
            self.raw = self.raw[self.raw_at:] + data
        self.raw_at = 0

    def feed(self) -> bool:
        """Decode the next piece of the received bytes into ``pending`` (the requests before
        are dispatched); False if no byte is left.  :raises ProtocolError: bad bytes."""
        raw, at = self.raw, self.raw_at
        decoder = self.decoder
        if at >= len(raw) or decoder is None:
            return False
        end = at + (FEED_BYTES_BEFORE_HELLO if decoder.shape_all else FEED_BYTES)
        self.raw_at = end
        self.pending = decoder.feed(raw[at:end] if at or end < len(raw) else raw)
        self.next = 0
        return True

    @property
    def backlog(self) -> bool:
        """Requests or bytes wait to be dispatched."""
        return self.next < len(self.pending) or self.raw_at < len(self.raw)

    def hold(self, held: bool) -> bool:
        """Mark the backlog held (reading paused for it) or not; True if that changed."""
        if held == self.held:
            return False
        self.held = held
        BACKLOGS.count += 1 if held else -1
        return True

    def clear(self) -> None:
        self.raw = b""
        self.raw_at = 0
        self.pending = []
        self.next = 0
        self.hold(False)


#: the principal of a connection before HELLO: granted nothing
UNAUTHENTICATED = Principal(ANONYMOUS, "client")


def recorded_client(conn: Session) -> str:
    """What grants record as their client: ``principal:client name`` (the name may be
    empty) - the authenticated principal first, so the self-declared name is never
    mistaken for it.  A record without ``:`` is a bare client name from an older log."""
    return f"{conn.principal}:{conn.client_name or ''}"


def split_recorded_client(recorded: Any) -> tuple[str | None, str | None]:
    """``(principal, client name)`` from a grant's recorded client (see :func:`recorded_client`)."""
    if type(recorded) is not str:
        return None, None
    principal, sep, name = recorded.partition(":")
    if not sep:
        return None, recorded  # a log written before principals: the name alone
    return principal, name or None


def shown_client(recorded: Any) -> str | None:
    """A grant's recorded client as logs show it: ``principal:client name``, the principal
    alone for a client that gave no name (never a dangling ``principal:``)."""
    if type(recorded) is str and recorded.endswith(":"):
        return recorded[:-1]
    return recorded if type(recorded) is str else None


class Session(SessionWire, asyncio.Protocol):
    """One client connection = one session.

    ``grant`` (:class:`~fastlock.auth.Principal`) is who the connection
    authenticated as at HELLO (until then :data:`UNAUTHENTICATED`, granted
    nothing); ``principal`` is its name (per-principal quotas key on it),
    ``kind`` its kind (client | replica | admin).  ``recorded`` is what its
    grants record as their client (:func:`recorded_client`).  ``accepted_ms``
    and ``last_read_ms`` are monotonic milliseconds.
    """

    # (server, session, intake, transport, out, out_bytes, closed, ready, last_read_ms, grant, recorded,
    # the last owner key with its hash and _drain: SessionWire's)
    __slots__ = ("client_name", "peer", "watching", "address", "accepted_ms", "_out_cap", "waiting")

    def __init__(self, server: LockServer, session: int):
        self.server = server
        self.session = session
        # until HELLO every frame is walked before it is decoded (see protocol.FrameDecoder)
        config = server.config
        limits = P.request_limits(config.max_frame_bytes, config.max_value_bytes)
        self.intake = Intake(P.WireDecoder(limits=limits, shape_all=True))
        self.transport: asyncio.Transport  # set by connection_made, before the server sees the session
        self.out: list[bytes] = []
        self.out_bytes = 0  # bytes in out
        self.ready = False  # handshake done
        self.client_name: str | None = None  # self-declared: shown beside the principal, never trusted
        self.grant = UNAUTHENTICATED
        self.recorded = recorded_client(self)
        self.peer = "?"
        self.address = "?"  # the peer's IP address (per-address connection cap, failed-auth bans)
        self.closed = False
        self.watching: set[str] | None = None
        self.accepted_ms = self.last_read_ms = monotonic_ms()
        self._out_cap = server.config.max_output_bytes
        self.waiting = 0  # this connection's waiters as last counted (per-principal waiter quota)
        # while writing is paused (the transport's buffer is above its high-water mark):
        # a future done when it resumes (or the connection closes); else None
        self._drain: asyncio.Future | None = None

    # -- asyncio callbacks ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream transport: the server accepted it
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        peer = transport.get_extra_info("peername")
        if peer:
            self.address = str(peer[0])
            self.peer = f"{peer[0]}:{peer[1]}"
        self._cap_high_water()
        self.server.limits.admit(self)

    # data_received: SessionWire's (compiled)

    def _dispatch_turn(self) -> None:
        """Decode and dispatch this connection's backlog, at most MAX_REQUESTS_PER_TURN or about
        TURN_BUDGET_NS; if some remains, pause reading and continue in a later loop turn."""
        server = self.server
        intake = self.intake
        intake.scheduled = False
        if server.source.fencing:
            # after a stall, see the clock before a request can make the table grant
            server.source.fence_if_due(monotonic_ms())
        handlers = server.handlers
        deadline = 0
        count = 0
        while not self.closed:
            pending = intake.pending
            i = intake.next
            if i >= len(pending):
                try:
                    if not intake.feed():
                        break
                except ProtocolError as exc:
                    intake.clear()
                    self.fatal(exc)
                    break
                continue
            msg = pending[i]
            pending[i] = None  # dispatched: not kept alive by the backlog
            intake.next = i + 1
            dispatch(handlers, self, msg)
            count += 1
            if count == 1:
                if not intake.backlog:
                    break  # the common case: one request per read, no clock read
                deadline = perf_counter_ns() + BACKLOGS.turn_ns()  # the turn's share, from here
            elif count >= MAX_REQUESTS_PER_TURN or perf_counter_ns() > deadline:
                break
        if self.closed or not intake.backlog:
            was_held = intake.held
            intake.clear()  # frees the read's bytes and requests
            if was_held and not self.closed and not self._writing_paused():
                self.transport.resume_reading()
        else:
            if intake.hold(True):
                self.transport.pause_reading()
            self._next_turn()
        server.after_batch()

    def _next_turn(self) -> None:
        intake = self.intake
        if not intake.scheduled:
            intake.scheduled = True
            self.server.loop.call_soon(self._dispatch_turn)

    def _writing_paused(self) -> bool:
        """Reading is held for writing: the transport's buffer is above its high-water mark
        (a standby's reading never is)."""
        return (self._drain is not None and not self._drain.done()
                and self.session not in self.server.source.replicas)

    @property
    def decoder(self) -> P.WireDecoder | None:
        """The connection's request decoder (None once closed)."""
        return self.intake.decoder

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.intake.clear()
        self.server.quotas.output.count(self, 0)
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self.server.connection_lost(self)

    @property
    def peer_cert_identity(self) -> str | None:
        """The subject CN of the client certificate verified in this connection's
        TLS handshake (mutual TLS), else None."""
        return peer_identity(self.transport.get_extra_info("ssl_object"))

    # -- output -----------------------------------------------------------------
    # send(data): SessionWire's (compiled): queue ``data`` for this turn's flush

    # flush(): SessionWire's (compiled): hand the queued replies to the transport, then
    # paused_write() if the transport ever paused writing
    def paused_write(self) -> None:
        """After a write to a transport that paused writing (once or now): drop the peer if
        it leaves more than ``out_cap`` bytes unread, else count what is unread against its
        principal's share."""
        transport = self.transport
        # beyond out_cap is beyond the high-water mark (see out_cap): the
        # transport has paused writing, inside this write() or before it
        if transport.get_write_buffer_size() > self._out_cap:
            unsent = transport.get_write_buffer_size()
            # a peer that does not read (a stuck watcher, a standby too far behind): drop it,
            # as Redis's client-output-buffer-limit does, rather than grow without bound
            if self.session in self.server.source.replicas:
                log.error("standby on %s is too far behind (%d bytes unsent, limit %d): disconnecting "
                          "it; it resyncs when it reconnects", self.peer, unsent, self.out_cap)
            else:
                log.warning("closing connection %s (session %d): %d bytes of replies unread (limit %d)",
                            self.peer, self.session, unsent, self.out_cap)
            self.closed = True
            transport.abort()
            self.server.quotas.output.count(self, 0)
        elif self.session not in self.server.source.replicas:
            # writing is paused: count what is unread against the principal's share
            self.server.quotas.output.count(self, transport.get_write_buffer_size())

    # Flow control: while the peer does not read our replies, stop reading its
    # requests, so a pipelining client that never reads cannot grow our memory.
    # A standby's acknowledgements must keep flowing: its output is bounded by
    # out_cap instead (and the backlog it catches up on waits for drained()).
    @property
    def out_cap(self) -> int:
        """Bytes of output this peer may leave unread before it is dropped.  Setting
        it lowers the transport's high-water mark to it if it is above, as
        :meth:`flush` checks the cap only while writing is paused."""
        return self._out_cap

    @out_cap.setter
    def out_cap(self, out_cap: int) -> None:
        self._out_cap = out_cap
        self._cap_high_water()

    def _cap_high_water(self) -> None:
        transport = self.transport
        if transport is not None and transport.get_write_buffer_limits()[1] > self._out_cap:
            transport.set_write_buffer_limits(high=self._out_cap)

    @property
    def principal(self) -> str:
        """The name of the principal the connection acts as."""
        return self.grant.name

    @property
    def kind(self) -> str:
        """The principal's kind: client, replica or admin."""
        return self.grant.kind

    def pause_writing(self) -> None:
        if self._drain is None or self._drain.done():
            self._drain = self.server.loop.create_future()
        if self.session not in self.server.source.replicas:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None
        self.server.quotas.output.count(self, 0)  # below the low-water mark: what is left is not counted
        if not self.closed and self.session not in self.server.source.replicas and not self.intake.held:
            self.transport.resume_reading()

    # owner_hash(owner) -> bytes: SessionWire's (compiled): the hash of a checked owner key

    def authenticated(self, principal: Principal, client_name: str | None) -> None:
        """HELLO authenticated this connection as ``principal``: what its requests act as
        (its unread replies count against that principal's output share from here)."""
        self.server.quotas.output.moved(self, principal.name)
        self.client_name = client_name
        self.grant = principal
        self.recorded = recorded_client(self)

    def drained(self) -> asyncio.Future:
        """A future done when the transport's write buffer is below its low-water
        mark (at once if writing is not paused) or the connection is closed."""
        if self._drain is not None and not self._drain.done() and not self.closed:
            return self._drain
        fut = self.server.loop.create_future()
        fut.set_result(None)
        return fut

    # -- closing ----------------------------------------------------------------
    def fatal(self, exc: FastlockError) -> None:
        """Send a protocol error (request id 0) and close this connection only
        (logged at most once per 10 s, with the number of others)."""
        self.server.limits.fatal_log("closing connection %s (session %d): %s", self.peer, self.session, exc)
        self.send(P.encode_error(0, exc.code, str(exc)))
        self.flush()
        self.close()

    def close(self) -> None:
        """Close after sending what is queued; frees the decoder's partial frame at once."""
        self.closed = True
        self.intake.decoder = None
        self.intake.clear()
        self.transport.close()

    def close_after_flush(self) -> None:
        """Send what is queued now, then close (the decoder stays: the loop may still be feeding it)."""
        self.flush()
        self.closed = True
        self.transport.close()

    def abort(self) -> None:
        """Close at once, unsent replies discarded (a refused or evicted connection)."""
        self.closed = True
        self.intake.decoder = None
        self.intake.clear()
        self.transport.abort()
