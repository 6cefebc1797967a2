"""The client's connection to the primary: address selection, ride-through, liveness.

:class:`Connector` owns the one connection a :class:`~fastlock.client.Client`
pipelines its requests on: it sweeps the address list for the primary
(redirects followed first; addresses that went silent, or answered
"deposed"/"fenced"/``Unavailable``, tried last), shares one connection attempt
between every caller, and forgets a connection that ended so that the next
request reconnects.  :class:`RideThrough` is the retry state of one
operation: within its deadline, a lost connection or a refusal from a node
that cannot serve makes it find the primary again (backoff with jitter) and
send the request again.  Liveness - a server that stops answering while its
TCP connection stays open - is found by the per-connection watchdog of
:class:`fastlock.protocol.rpc.RpcConnection` (``liveness_timeout`` = the client's
``request_timeout``).

Everything here runs on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import ssl
from collections.abc import Callable, Iterable
from typing import Any

from .. import protocol as P
from ..auth import ClientHandshake, ServerNotProven, resolve_credential, say_hello, secret_of
from ..errors import ConnectionLost, FastlockError, InvalidArgument, LeaseLost, NotPrimary, Unavailable
from ..logsafe import RateLimitedLog, quote
from ..protocol.ops import (
    PUSH_KEY_BEGIN,
    PUSH_KEY_PROGRESS,
    PUSH_REVOKE_REQUESTED,
    PUSH_SHARD_MAP,
    PUSH_VALUE,
    PUSH_VALUE_REV,
    PUSH_WATCH_PROGRESS,
    PUSH_WATCH_REV,
    PUSH_WOUNDED,
)
from ..protocol.rpc import NotFastlockReply, RpcConnection, answers_tls_hello, what_answered
from ..units import parse_address
from .keywatch import KeyWatches
from .lease import WatchEvent
from .sweep import AddressAnswer, NoPrimaryFound, Outcome, SweepPacing

log = logging.getLogger(__name__)

__all__ = ["ClientConnection", "Connector", "RideThrough", "RETRYABLE", "resolve_credential"]

#: Errors after which an operation looks for the primary and tries again
#: (within its deadline): the connection is gone, or the node is not (or no
#: longer) a primary that may serve it.  Every other error surfaces at once.
RETRYABLE = (ConnectionLost, NotPrimary, Unavailable)
BACKOFF_FIRST = 0.02  # seconds: the first pause between sweeps of the address list
BACKOFF_MAX = 0.5  # seconds: the longest pause (doubling from the first, with jitter)
#: seconds between two INFO lines for one refusal (same node, error and message): the later line
#: counts the ones left out (a ride-through retries a refusing node many times a second)
REFUSAL_LOG_EVERY = 5.0
#: the most distinct refusals a connector rate-limits at once (the oldest is forgotten first)
REFUSALS_KEPT = 32

#: why a TLS server most likely closed or reset a connection during the handshake
_REFUSED_CERT_HINT = (" (a TLS server that requires client certificates drops the connection when it refuses "
                      "this client's, or its lack of one)")
#: appended when a plain-TCP client gets no HELLO reply: a TLS port waits for a
#: handshake, then drops the connection
#: how to ask for TLS, in the library's and the command line's words
_ASK_FOR_TLS = "pass tls_ca=... or tls=True; fastlock commands: --tls-ca or FASTLOCK_TLS_CA"
_PLAIN_TO_TLS_HINT = f" (if it is a TLS port: {_ASK_FOR_TLS})"

Address = tuple[str, int]
#: addresses whose proven node id a connector remembers, at most
MAX_PINNED_NODES = 256


def ignore_result(fut: asyncio.Future[Any]) -> None:
    """A done-callback that retrieves a future's exception (none waits for it)."""
    if not fut.cancelled():
        fut.exception()


class ClientConnection(RpcConnection):
    """The client's connection: an :class:`~fastlock.protocol.rpc.RpcConnection` whose
    pushes feed the watches opened on it, and whose liveness timeout is the
    client's ``request_timeout``.

    Attributes:
        watches (dict[str, set[asyncio.Queue[Any]]]): the queues of the watches
            open on this connection, by lock name; each receives
            :class:`~fastlock.client.WatchEvent` items, then ``None`` when the
            connection ends.
        key_watches (KeyWatches): the same for the key watches
            (:mod:`fastlock.client.keys`), by prefix (:mod:`fastlock.client.keywatch`).
    """

    __slots__ = ("watches", "key_watches", "revoke_handler", "wound_handler", "shard_map_handler")

    def __init__(self, address: Address, on_close: Callable[[RpcConnection, ConnectionLost], Any],
                 liveness_timeout: float | None):
        super().__init__(address, on_push=self._dispatch_push, on_close=on_close,
                         liveness_timeout=liveness_timeout)
        self.watches: dict[str, set[asyncio.Queue[Any]]] = {}
        self.key_watches = KeyWatches()
        #: called with a PUSH_REVOKE_REQUESTED payload (set by the Connector that made it)
        self.revoke_handler: Callable[[list[Any]], Any] | None = None
        #: called with a PUSH_WOUNDED payload (set by the Connector that made it)
        self.wound_handler: Callable[[list[Any]], Any] | None = None
        #: called with a PUSH_SHARD_MAP's epoch (set by the Connector that made it)
        self.shard_map_handler: Callable[[int], Any] | None = None

    def _dispatch_push(self, kind: Any, payload: Any) -> None:
        if kind == P.PUSH_WATCH:
            event = WatchEvent(*payload)
            for queue in self.watches.get(event.name, ()):
                queue.put_nowait(event)
        elif kind == PUSH_VALUE and type(payload) is list and len(payload) == 4:
            self.key_watches.deliver(payload)
        elif kind == PUSH_REVOKE_REQUESTED and type(payload) is list and len(payload) == 5:
            handler = self.revoke_handler
            if handler is not None:
                handler(payload)
        elif kind == PUSH_WATCH_REV and type(payload) is list and len(payload) == 7:
            event = WatchEvent(*payload)
            for queue in self.watches.get(event.name, ()):
                queue.put_nowait(event)
        elif kind == PUSH_VALUE_REV and type(payload) is list and len(payload) == 6:
            self.key_watches.deliver(payload)
        elif kind == PUSH_KEY_BEGIN and type(payload) is list and len(payload) == 1:
            self.key_watches.begin(payload[0])
        elif kind == PUSH_KEY_PROGRESS and type(payload) is list and len(payload) == 1:
            self.key_watches.progress(payload[0])
        elif kind == PUSH_WOUNDED and type(payload) is list and len(payload) == 3:
            handler = self.wound_handler
            if handler is not None:
                handler(payload)
        elif kind == PUSH_SHARD_MAP and type(payload) is list and len(payload) == 1 and type(payload[0]) is int:
            shard_map_handler = self.shard_map_handler
            if shard_map_handler is not None:
                shard_map_handler(payload[0])
        elif kind == PUSH_WATCH_PROGRESS and type(payload) is list and len(payload) == 1:
            for name, queues in self.watches.items():
                notice = WatchEvent(name, "progress", None, None, revision=payload[0])
                for queue in queues:
                    queue.put_nowait(notice)


class Connector:
    """Finds the primary among ``addresses`` and keeps one connection to it.

    Args:
        addresses: ``"host:port"`` strings or ``(host, port)`` tuples
            (:func:`fastlock.units.parse_address`; default port 7420).
        auth: the token (or legacy secret) proved in HELLO, never sent (see
            :func:`resolve_credential` and :mod:`fastlock.auth.handshake`).
        client_name: sent in HELLO (checked by the caller).
        connect_timeout: seconds for each TCP connect and each handshake.
        request_timeout: the connections' liveness timeout in seconds (None: none).
        ssl_context, server_hostname: TLS (None: plain TCP).

    Attributes:
        proto (ClientConnection | None): the connection to the primary, or None.
        closed (bool): set by :meth:`close`; every later call fails.
        server_info (dict): the primary's HELLO reply.
        max_epoch (int): the highest fencing epoch seen; sent in every HELLO so
            that a deposed primary that still runs learns it and steps down.
        orphans (list[tuple[str, bytes]]): acquires given up on (name, owner
            key), cancelled by owner on the next connection.
        sequencers (bool): every ACQUIRE asks for a signed sequencer (set by the client).

    Raises:
        InvalidArgument / WrongArgumentType: no address, or a bad one.
    """

    __slots__ = ("addresses", "proto", "closed", "server_info", "max_epoch", "orphans", "no_acquire_many",
                 "on_revoke_request", "wound_listeners", "on_shard_map_epoch",
                 "_auth", "_client_name",
                 "_connect_timeout", "_request_timeout", "_ssl", "_server_hostname", "_connecting",
                 "_connect_task", "_attempt", "_suspects", "_demoted", "_preferred", "_nodes", "_refusal_logs",
                 "sequencers", "attempt_bounds")

    def __init__(self, addresses: Iterable[Any], *, auth: str | None, client_name: str | None,
                 connect_timeout: float, request_timeout: float | None, ssl_context: ssl.SSLContext | None,
                 server_hostname: str | None):
        self.addresses = [parse_address(a) for a in addresses]
        if not self.addresses:
            raise InvalidArgument("connect() needs at least one address")
        self._auth = secret_of(auth) if auth is not None else None
        self._client_name = client_name
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._ssl = ssl_context
        self._server_hostname = server_hostname
        self.proto: ClientConnection | None = None
        self.closed = False
        self.server_info: dict[str, Any] = {}
        self.max_epoch = 0
        self.orphans: list[tuple[str, bytes]] = []
        self.sequencers = False
        #: the attempt bounds of the calls on this connector (a ``fastlock.client.calls.AttemptBounds``,
        #: made by the first call that needs one)
        self.attempt_bounds: Any = None
        #: set once a server refused ACQUIRE_MANY as unknown (an older fastlock): multi-locks go one by one
        self.no_acquire_many = False
        #: given every PUSH_REVOKE_REQUESTED payload (the client finds the lease it names)
        self.on_revoke_request: Callable[[list[Any]], Any] | None = None
        #: multi-lock id -> called with each PUSH_WOUNDED payload naming it (fastlock.client.across)
        self.wound_listeners: dict[bytes, Callable[[list[Any]], Any]] = {}
        #: given the shard map epoch a node names: pushed (PUSH_SHARD_MAP) or in its HELLO (fastlock.client.sharded)
        self.on_shard_map_epoch: Callable[[int], Any] | None = None
        self._connecting: asyncio.Future[Any] | None = None  # result of the connection attempt in progress
        self._connect_task: asyncio.Task[Any] | None = None
        self._attempt: dict[str, Any] = {}  # {"addr": the address the attempt in progress is trying}
        self._suspects: set[Address] = set()  # addresses that went silent: tried last
        self._demoted: set[Address] = set()  # answered deposed / fenced / Unavailable: tried last
        self._preferred: Address | None = None  # named as the primary by a refusal: tried first
        #: address -> the node id that proved itself there: a later handshake at that address expects
        #: it (a process on a dead server's port relaying to another node is refused)
        self._nodes: dict[Address, str] = {}
        #: (address, error, message) -> its rate-limited "refused a request" line (REFUSAL_LOG_EVERY)
        self._refusal_logs: dict[tuple[Address, str, str], RateLimitedLog] = {}

    async def ensure_connected(self, deadline: float | None = None) -> ClientConnection:
        """The connection to the primary, connecting first if needed (one
        attempt shared by every caller).  ``deadline`` (``loop.time()``) bounds
        this caller's wait for the attempt.

        Raises:
            ConnectionLost: no address accepted a connection as primary (in
                one sweep, or before ``deadline``), or the connector is closed.
            AuthError: the secret was refused.
        """
        proto = self.proto
        if proto is not None and not proto.closed:
            return proto
        if self.closed:
            raise ConnectionLost("client is closed")
        fut = self._connecting
        if fut is None or fut.done():
            fut = self._connecting = asyncio.get_running_loop().create_future()
            self._attempt = {}
            self._connect_task = asyncio.ensure_future(self._connect_into(fut, self._attempt))
        # shielded: one caller's cancellation must not abandon everyone's attempt
        if deadline is None:
            return await asyncio.shield(fut)
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise ConnectionLost("the deadline passed before a primary was found")
        try:
            return await asyncio.wait_for(asyncio.shield(fut), left)
        except asyncio.TimeoutError:
            raise ConnectionLost(f"no primary found within {left:.3f} s") from None

    async def _connect_into(self, fut: asyncio.Future[Any], attempt: dict[str, Any]) -> None:
        """Run one connection attempt and hand its outcome to ``fut`` - unless
        ``fut`` was settled meanwhile (:meth:`reset`, :meth:`close`), in which
        case a connection it made is closed, not used."""
        try:
            proto, info = await self._connect(attempt)
        except BaseException as exc:
            if not fut.done():
                if isinstance(exc, asyncio.CancelledError):
                    exc = ConnectionLost("client is closed" if self.closed else "connection attempt abandoned")
                fut.set_exception(exc)
                fut.add_done_callback(ignore_result)  # no waiter left is fine
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            if self._connecting is fut and fut.done():
                self._connecting = None
        if fut.done() or self.closed:  # abandoned while the handshake was in flight
            proto.close(ConnectionLost("connection attempt abandoned"))
            if self._connecting is fut:
                self._connecting = None
            return
        self.server_info = info
        self.max_epoch = max(self.max_epoch, info.get("epoch", 0))
        if type(info.get("shard_map_epoch")) is int:
            self._shard_map_epoch(info["shard_map_epoch"])
        self.proto = proto
        self._suspects.discard(proto.address)
        self._demoted.discard(proto.address)
        self._preferred = None
        if self.orphans:
            orphans, self.orphans = self.orphans, []
            for name, owner in orphans:
                proto.send(P.OP_CANCEL, name, owner)
        fut.set_result(proto)
        if self._connecting is fut:
            self._connecting = None

    async def _connect(self, attempt: dict[str, Any]) -> tuple[ClientConnection, dict[str, Any]]:
        """Sweep the addresses once (following redirects) until one is a
        primary and accepts the handshake; ``attempt["addr"]`` says which one
        is being tried.  Order: a primary named by the last refusal, then the
        others, then addresses that went silent, then those that answered
        deposed/fenced/``Unavailable`` (a fenced primary is used only when no
        other address is a primary)."""
        loop = asyncio.get_running_loop()
        answers: list[AddressAnswer] = []

        def answer(addr: Address, reason: str, outcome: Outcome) -> None:
            answers.append(AddressAnswer(addr[0], addr[1], reason, outcome))

        later = self._suspects | self._demoted
        candidates = [a for a in self.addresses if a not in later]
        candidates += [a for a in self.addresses if a in self._suspects and a not in self._demoted]
        candidates += [a for a in self.addresses if a in self._demoted]
        if self._preferred is not None:
            candidates.insert(0, self._preferred)
        tried: set[Address] = set()

        def redirect(primary: Any) -> None:
            try:
                target = parse_address(primary)
            except FastlockError:
                return
            if target in later:
                candidates.append(target)
            else:
                candidates.insert(0, target)

        deferred: set[Address] = set()
        while candidates:
            addr = candidates.pop(0)
            if addr in tried:
                continue
            tried.add(addr)
            attempt["addr"] = addr
            try:
                _, proto = await asyncio.wait_for(
                    loop.create_connection(functools.partial(ClientConnection, addr, self._on_connection_closed,
                                                             self._request_timeout),
                                           addr[0], addr[1], **self._tls_arguments(addr)),
                    self._connect_timeout,
                )
            except asyncio.TimeoutError:
                self._suspects.add(addr)
                answer(addr, f"connect timed out after {self._connect_timeout} s", Outcome.DOWN)
                continue
            except (OSError, OverflowError) as exc:
                hint = _REFUSED_CERT_HINT if self._ssl is not None and isinstance(exc, ConnectionResetError) else ""
                final = isinstance(exc, (ssl.SSLError, OverflowError))  # a certificate refused, a bad port
                errno = exc.errno if isinstance(exc, OSError) and not final else None
                said = os.strerror(errno) if errno else exc  # asyncio's own text repeats the address
                answer(addr, f"{said or type(exc).__name__}{hint}", Outcome.FINAL if final else Outcome.DOWN)
                continue
            proto.revoke_handler = self.on_revoke_request
            proto.wound_handler = self._wounded
            proto.shard_map_handler = self._shard_map_epoch
            handshake = ClientHandshake(self._auth, expect_node=self._nodes.get(addr))
            try:
                info = await asyncio.wait_for(say_hello(proto, self._client_name, handshake, self.max_epoch),
                                              self._connect_timeout)
                if handshake.server_node is not None and len(self._nodes) < MAX_PINNED_NODES:
                    self._nodes[addr] = handshake.server_node
            except NotPrimary as exc:
                proto.close()
                answer(addr, f"not primary (primary: {exc.primary})", Outcome.WAITING)
                if exc.primary:
                    redirect(exc.primary)
                else:
                    self._demoted.add(addr)
                continue
            except Unavailable as exc:
                proto.close()
                self._demoted.add(addr)
                answer(addr, f"unavailable: {exc}", Outcome.WAITING)
                continue
            except ServerNotProven as exc:  # nothing but HELLO went to it: try the others
                proto.abort(exc)
                self._demoted.add(addr)
                answer(addr, str(exc), Outcome.FINAL)
                continue
            except (asyncio.TimeoutError, ConnectionLost) as exc:
                if isinstance(exc, ConnectionLost) and not proto.silent:
                    proto.abort(exc)
                    if isinstance(exc, NotFastlockReply):  # it answered, not in fastlock's protocol
                        what = what_answered(exc.head, self._ssl is not None, _ASK_FOR_TLS)
                        answer(addr, f"{what} ({exc})", Outcome.FINAL)
                    elif proto.received:  # it spoke fastlock and closed (its reason is in exc)
                        answer(addr, f"handshake failed: {exc}", Outcome.DOWN)
                    else:  # closed without a byte: most likely a TLS port (or a refused client certificate)
                        hint = _REFUSED_CERT_HINT if self._ssl is not None else _PLAIN_TO_TLS_HINT
                        answer(addr, f"handshake failed: {exc}{hint}", Outcome.DOWN)
                    continue
                # silent (the handshake's deadline, or the liveness watchdog on the same timeout)
                proto.abort(ConnectionLost("handshake timed out"))
                self._suspects.add(addr)
                waited = self._request_timeout if isinstance(exc, ConnectionLost) else self._connect_timeout
                if self._ssl is None and await answers_tls_hello(*addr):  # a TLS server never speaks first
                    answer(addr, f"no handshake reply within {waited:g} s, but a TLS hello is answered: a TLS port "
                                 f"({_ASK_FOR_TLS})", Outcome.FINAL)
                else:
                    answer(addr, f"no handshake reply within {waited:g} s: not a fastlock server (or a stalled one)",
                           Outcome.DOWN)
                continue
            except BaseException:
                proto.abort(ConnectionLost("handshake failed"))
                raise
            if not isinstance(info, dict):
                proto.abort(ConnectionLost("bad handshake reply"))
                answer(addr, f"bad handshake reply {info!r}", Outcome.FINAL)
                continue
            self.max_epoch = max(self.max_epoch, info.get("epoch", 0) if type(info.get("epoch")) is int else 0)
            if info.get("role") != "primary":
                proto.close()
                primary = info.get("primary")
                waits = Outcome.DOWN if info.get("role") == "deposed" else Outcome.WAITING  # deposed: none soon
                answer(addr, f"not the primary (role {info.get('role')}, primary: {primary})", waits)
                if primary:
                    redirect(primary)
                if info.get("role") != "standby":  # deposed, promoting: not a primary soon
                    self._demoted.add(addr)
                continue
            if info.get("fenced") and addr not in deferred and any(c not in tried for c in candidates):
                # a primary that is not granting (its standby may have taken over): try the
                # other addresses first, and come back to it only if none is a primary
                proto.close()
                answer(addr, "primary is fenced (not granting)", Outcome.WAITING)
                self._demoted.add(addr)
                deferred.add(addr)
                tried.discard(addr)
                candidates.append(addr)
                continue
            log.debug("connected to %s:%d (session %s)", addr[0], addr[1], info.get("session"))
            return proto, info
        raise NoPrimaryFound(tuple(answers))

    def _tls_arguments(self, addr: Address) -> dict[str, Any]:
        """``create_connection`` arguments for TLS to ``addr`` (none for plain TCP): the
        certificate must name ``server_hostname``, or else the address's host."""
        if self._ssl is None:
            return {}
        return {"ssl": self._ssl, "server_hostname": self._server_hostname or addr[0]}

    def _on_connection_closed(self, proto: RpcConnection, error: ConnectionLost) -> None:
        """Called once per connection when it ends: forget it (so the next
        request reconnects), try a silent address last, end every watch on it."""
        if not isinstance(proto, ClientConnection):  # only ClientConnections are made with this callback
            return
        if self.proto is proto:
            self.proto = None
        if proto.silent:
            self._suspects.add(proto.address)
        for watches in (proto.watches, proto.key_watches):
            for queues in watches.values():
                for queue in queues:
                    queue.put_nowait(None)  # end of this watch
            watches.clear()
        # a multi-lock's uncommitted reservations on this connection end with it (the server's
        # table of them is per connection, and a new primary has none): told as a wound
        for multi_id, listener in list(self.wound_listeners.items()):
            listener([multi_id, None, None])

    def refused(self, proto: ClientConnection, exc: BaseException) -> None:
        """A request on ``proto`` was refused with ``NotPrimary`` or
        ``Unavailable``: that node cannot serve now.  Drop the connection (the
        requests pending on it ride through elsewhere), try a primary it named
        first, and the node itself last unless it named nobody."""
        addr = proto.address
        primary = getattr(exc, "primary", None)
        target = None
        if primary:
            try:
                target = parse_address(primary)
            except FastlockError:
                target = None
        if target is not None and target != addr:
            self._preferred = target
        self._demoted.add(addr)
        if not proto.closed:
            reason = (addr, type(exc).__name__, str(exc))
            line = self._refusal_logs.pop(reason, None) or RateLimitedLog(log, logging.INFO, REFUSAL_LOG_EVERY)
            self._refusal_logs[reason] = line  # the most recent last
            while len(self._refusal_logs) > REFUSALS_KEPT:
                del self._refusal_logs[next(iter(self._refusal_logs))]
            text = ("%s:%d refused a request (%s: %s); looking for the primary", addr[0], addr[1], reason[1],
                    quote(reason[2]))
            if not line(*text):
                log.debug(*text)  # each one at DEBUG, the INFO line counts them
            proto.abort(ConnectionLost(f"{addr[0]}:{addr[1]} cannot serve: {exc}"))

    def reset(self, reason: str) -> None:
        """Give up on the current connection and on any connection attempt in
        progress: their requests raise :class:`ConnectionLost` (``reason``), the
        address concerned is tried last next time, and the next request
        reconnects.  For callers with their own deadline that found the server
        silent (a renewal that must not keep waiting on a frozen socket)."""
        proto = self.proto
        if proto is not None and not proto.closed:
            self._suspects.add(proto.address)
            log.warning("resetting the connection to %s:%d: %s", proto.address[0], proto.address[1], reason)
            proto.abort(ConnectionLost(reason))
        fut = self._connecting
        if fut is not None and not fut.done():
            addr = self._attempt.get("addr")
            if addr is not None:
                self._suspects.add(addr)
                log.warning("abandoning the connection attempt to %s:%d: %s", addr[0], addr[1], reason)
            fut.set_exception(ConnectionLost(reason))
            fut.add_done_callback(ignore_result)
            task = self._connect_task
            if task is not None and not task.done():
                task.cancel()
        self._connecting = None

    def reset_if_silent_since(self, started: float, reason: str) -> None:
        """A request sent at ``started`` (``loop.time()``) timed out: :meth:`reset`
        unless the server has sent something since - then it is alive, only
        slow, and the connection (with everyone else's requests on it) is kept.
        A connection attempt still in progress is reset too."""
        proto = self.proto
        if proto is not None and not proto.closed and proto.last_recv > started:
            return
        self.reset(reason)

    @property
    def connect_timeout(self) -> float:
        """Seconds allowed to find a primary (per attempt, and after a wait for riding through)."""
        return self._connect_timeout

    def _shard_map_epoch(self, epoch: int) -> None:
        listener = self.on_shard_map_epoch
        if listener is not None:
            listener(epoch)

    def _wounded(self, payload: list[Any]) -> None:
        listener = self.wound_listeners.get(payload[0]) if type(payload[0]) is bytes else None
        if listener is not None:
            listener(payload)

    def withdraw(self, proto: ClientConnection | None, name: str, owner: bytes, op: int = P.OP_CANCEL,
                 *args: Any) -> None:
        """Withdraw the acquire (``name``, ``owner``) without waiting: CANCEL
        by owner (or ``op`` with ``args``, e.g. a RELEASE) on ``proto``.  If
        that connection is, or turns out to be, dead before it answers, it is
        cancelled by owner on the next connection (CANCEL releases a grant
        that raced), so a grant is never left to run out its TTL."""
        if proto is None or proto.closed:
            self.orphans.append((name, owner))
            return
        fut = proto.request(op, name, *(args or (owner,)))

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                return
            if isinstance(f.exception(), ConnectionLost) and not self.closed:
                current = self.proto
                if current is not None and not current.closed and current is not proto:
                    self.withdraw(current, name, owner)
                else:
                    self.orphans.append((name, owner))

        fut.add_done_callback(done)

    def close(self) -> None:
        """Close the connection; every pending request and every later call
        raises :class:`ConnectionLost` ("client is closed").  Idempotent."""
        self.closed = True
        closed = ConnectionLost("client is closed")
        fut = self._connecting
        self._connecting = None
        if fut is not None and not fut.done():
            fut.set_exception(closed)
            fut.add_done_callback(ignore_result)
        task = self._connect_task
        if task is not None and not task.done():
            task.cancel()
        proto = self.proto
        self.proto = None
        if proto is not None and not proto.closed:
            proto.close(closed)


class RideThrough:
    """The retry state of one operation: its deadline (``loop.time()``
    seconds, None: none), the last error, and the pause (backoff with
    jitter, :data:`BACKOFF_FIRST` doubling to ``max_backoff`` seconds, shorter
    while a failover is under way: :class:`~fastlock.client.sweep.SweepPacing`)
    before the next sweep of the address list."""

    __slots__ = ("connector", "deadline", "last", "pacing", "loop")

    def __init__(self, connector: Connector, deadline: float | None, max_backoff: float = BACKOFF_MAX):
        self.connector = connector
        self.deadline = deadline
        self.last: BaseException | None = None
        self.pacing = SweepPacing(BACKOFF_FIRST, max_backoff)
        self.loop = asyncio.get_running_loop()

    def failed(self, conn: ClientConnection | None, exc: BaseException) -> bool:
        """Record a failed attempt on ``conn``; True if the next one should
        pause first (a redirect that names the primary is followed at once)."""
        self.last = exc
        if isinstance(exc, (NotPrimary, Unavailable)) and conn is not None:
            self.connector.refused(conn, exc)
        return not (isinstance(exc, NotPrimary) and exc.primary)

    def expired(self) -> ConnectionLost:
        err = ConnectionLost(f"no fastlock primary could serve the request before its deadline "
                             f"(last error: {self.last or 'none'})")
        err.__cause__ = self.last
        return err

    def left(self) -> float | None:
        """Seconds left before the deadline (None: no deadline)."""
        return None if self.deadline is None else self.deadline - self.loop.time()

    async def connection(self, pause: bool) -> ClientConnection:
        """A connection to a primary for the next attempt (after a pause when
        ``pause``); raises :class:`ConnectionLost` once the deadline passed."""
        connector = self.connector
        while True:
            if connector.closed:
                raise ConnectionLost("client is closed")
            if pause:
                last = self.last
                waiting = (isinstance(last, NoPrimaryFound) and last.failover_under_way) or (
                    isinstance(last, (NotPrimary, Unavailable)) and not (isinstance(last, NotPrimary) and last.primary))
                delay = self.pacing.next_pause(waiting)
                left = self.left()
                if left is not None:
                    delay = min(delay, left)
                if delay > 0:
                    await asyncio.sleep(delay)
            left = self.left()
            if left is not None and left <= 0:
                raise self.expired()
            try:
                return await connector.ensure_connected(self.deadline)
            except ConnectionLost as exc:
                if connector.closed or (isinstance(exc, NoPrimaryFound) and exc.final):
                    raise  # closed, or every address gave an answer that sweeping again cannot change
                left = self.left()
                if self.last is None or left is None or left > 0:
                    self.last = exc  # at the deadline, the error of a sweep that ended says more
                pause = True

    async def send(self, op: int, args: tuple[Any, ...], proto: ClientConnection | None = None,
                   exc: BaseException | None = None, *, attempt_timeout: float | None = None) -> Any:
        """Send ``op`` until a primary answers or the deadline passes.

        ``proto``/``exc``: a first attempt already failed there with that
        error.  ``attempt_timeout`` (seconds) bounds each attempt (a silent
        connection is then reset); None leaves that to the liveness watchdog.
        A RELEASE refused as ``LeaseLost`` after an attempt whose outcome is
        unknown (the connection died with it in flight) counts as done: the
        lease is gone either way.

        Raises:
            ConnectionLost: the deadline passed with no primary able to serve.
            any other error the server replied with.
        """
        loop = self.loop
        connector = self.connector
        unknown = False  # an attempt may have taken effect, its reply lost
        pause = False
        if exc is not None:
            unknown = isinstance(exc, ConnectionLost)
            pause = self.failed(proto, exc)
        while True:
            proto = await self.connection(pause)
            sent = loop.time()
            try:
                fut = proto.request(op, *args)
                if attempt_timeout is None:
                    return await fut
                left = self.left()
                bound = attempt_timeout if left is None else max(0.001, min(attempt_timeout, left))
                return await asyncio.wait_for(fut, bound)
            except LeaseLost:
                if op == P.OP_RELEASE and unknown:
                    log.info("release of %r: an earlier attempt's outcome is unknown and the lease is gone "
                             "now; taking it as released", args[0])
                    return None
                raise
            except asyncio.TimeoutError:
                unknown = True
                self.last = ConnectionLost(f"no reply within {attempt_timeout:.3f} s")
                connector.reset_if_silent_since(sent, f"{P.OP_NAMES.get(op, op)} got no reply in time")
                pause = True
            except RETRYABLE as err:
                if connector.closed:
                    raise
                unknown = unknown or isinstance(err, ConnectionLost)
                pause = self.failed(proto, err)
