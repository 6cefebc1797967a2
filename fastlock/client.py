"""The asyncio client.

One :class:`Client` holds one TCP connection to the primary and pipelines every
request of every task over it (requests carry ids; replies may come back in
any order).  Typical use::

    async with fastlock.connect("127.0.0.1:7420", "127.0.0.1:7421") as client:
        async with client.lock("orders/42", ttl=10.0, wait=5.0) as lease:
            await write_with_fencing(lease.fencing_token)
            if lease.lost.is_set():
                ...  # stop acting as the holder

Times in this API are float **seconds** (as asyncio); the wire carries
integer milliseconds.  Arguments are checked before anything is sent:
a bad one raises :class:`~fastlock.errors.InvalidArgument` (a ValueError) or
:class:`~fastlock.errors.WrongArgumentType` (a TypeError).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from . import protocol as P
from .logsafe import quote
from .errors import (
    ConnectionLost,
    FastlockError,
    InvalidArgument,
    LeaseLost,
    NotPrimary,
    Unavailable,
    WrongArgumentType,
)
from .rpc import RpcConnection
from .tls import client_ssl_context

if TYPE_CHECKING:  # pragma: no cover
    from .election import Election

log = logging.getLogger(__name__)

DEFAULT_PORT = 7420

__all__ = ["connect", "Client", "Lease", "LeaseHealth", "LockContext", "MultiLease", "LockManyContext",
           "WatchEvent"]

SAFE = "safe"
IN_JEOPARDY = "in_jeopardy"
LOST = "lost"


class _LostEvent(asyncio.Event):
    """The ``lost`` event of leases made by this client: an ``asyncio.Event``
    that also tells the lease's :class:`LeaseHealth` (if anyone asked for it)
    when it is set, so health listeners hear of a loss however it was found."""

    _health: "LeaseHealth | None" = None

    def set(self) -> None:
        if not self.is_set():
            super().set()
            health = self._health
            if health is not None:
                health._on_lost()


class LeaseHealth:
    """The health of a held lease: ``"safe"``, ``"in_jeopardy"`` or ``"lost"``.

    After Chubby's session events (jeopardy / safe / expired) and the DynamoDB
    lock client's "danger zone": a lease goes **in jeopardy** when no renewal
    has succeeded and less than ``jeopardy_fraction`` of its TTL is left before
    the client's conservative expiry estimate; it is **safe** again as soon as a
    renewal succeeds; it is **lost** when ``lease.lost`` is set (a renewal was
    refused, or the TTL passed without one).  Jeopardy is a warning (finish or
    checkpoint the current write, stop starting new ones); lost is final.

    States are computed by the auto-renewal of :meth:`Client.lock` /
    :meth:`Client.lock_many` and of election terms; a lease renewed by hand
    stays ``"safe"`` until it is lost.  Shared by every copy of a lease that
    :meth:`Client.extend` returns (it hangs off the shared ``lost`` event).

    Attributes:
        state (str): the current state.
        safe (asyncio.Event): set while the state is ``"safe"``.
        jeopardy (asyncio.Event): set while the state is ``"in_jeopardy"``.
        lost (asyncio.Event): the lease's ``lost`` event (set once, for good).
        jeopardy_fraction (float): in (0, 1); default 0.5.

    Listeners (:meth:`add_listener`) are called with the new state, on the
    event loop's thread, at every transition.
    """

    __slots__ = ("lost", "safe", "jeopardy", "jeopardy_fraction", "_state", "_listeners", "_timer")

    def __init__(self, lost: asyncio.Event, jeopardy_fraction: float = 0.5):
        self.lost = lost
        self.safe = asyncio.Event()
        self.jeopardy = asyncio.Event()
        self.jeopardy_fraction = _check_fraction(jeopardy_fraction)
        self._listeners: list[Callable[[str], Any]] = []
        self._timer: asyncio.TimerHandle | None = None
        if lost.is_set():
            self._state = LOST
        else:
            self._state = SAFE
            self.safe.set()

    @property
    def state(self) -> str:
        if self._state != LOST and self.lost.is_set():  # a plain Event set by hand
            self._on_lost()
        return self._state

    def add_listener(self, callback: Callable[[str], Any]) -> Callable[[], None]:
        """Call ``callback(state)`` at each transition; returns a function that
        removes it.  Exceptions from callbacks are logged, not raised."""
        self._listeners.append(callback)

        def remove() -> None:
            try:
                self._listeners.remove(callback)
            except ValueError:
                pass

        return remove

    def _transition(self, state: str) -> None:
        if state == self._state or self._state == LOST:
            return
        self._state = state
        if state == SAFE:
            self.jeopardy.clear()
            self.safe.set()
        else:
            self.safe.clear()
            if state == IN_JEOPARDY:
                self.jeopardy.set()
        for callback in list(self._listeners):
            try:
                callback(state)
            except Exception:  # a listener must not break renewal
                log.exception("lease health listener %r failed", callback)

    def _on_lost(self) -> None:
        self._disarm()
        self._transition(LOST)

    # Driven by renewal loops: ``deadline`` is the loop.time() by which the
    # lease must be renewed, ``window`` the full span (TTL or renew deadline).
    def _renewed(self, deadline: float, window: float) -> None:
        if self._state == LOST:
            return
        self._transition(SAFE)
        self._disarm()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(deadline - self.jeopardy_fraction * window, self._transition, IN_JEOPARDY)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def __repr__(self) -> str:
        return f"<LeaseHealth {self.state}>"


def _check_timeout(value: Any, what: str, allow_none: bool) -> float | None:
    """A timeout in seconds: a finite number > 0 (or None where allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WrongArgumentType(f"{what} must be a number of seconds, not {type(value).__name__}")
    if not 0.0 < value < float("inf"):
        raise InvalidArgument(f"{what} must be > 0 seconds, got {value!r}")
    return float(value)


def _check_fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WrongArgumentType(f"jeopardy_fraction must be a number, not {type(value).__name__}")
    if not 0.0 < value < 1.0:
        raise InvalidArgument(f"jeopardy_fraction must be in (0, 1), got {value!r}")
    return float(value)


@dataclass(frozen=True, eq=False)
class Lease:
    """A granted lock.  Immutable; :meth:`Client.extend` returns a new one
    (same token, owner and ``lost`` event) when the TTL changes.

    Attributes:
        name (str): the lock's name.
        fencing_token (int): strictly increasing per grant across restarts and
            failovers; pass it to every write the lock protects.
        ttl (float): the lease's time to live in seconds, counted on the
            server's monotonic clock from the grant (or the last extend).
        owner (bytes): the secret key that proves ownership to the server.
        lost (asyncio.Event): set when the client learns, or must assume, that
            the lease is no longer held (a renewal was refused, or the TTL
            passed without a successful renewal).
        expires_at (float): the client's conservative estimate, in
            ``loop.time()`` seconds, of when the server will expire the lease.
    """

    name: str
    fencing_token: int
    ttl: float
    owner: bytes = field(repr=False)
    lost: asyncio.Event = field(repr=False, compare=False)
    expires_at: float = field(repr=False, compare=False, default=0.0)

    @property
    def epoch(self) -> int:
        """The fencing epoch (the token's high bits; raised by each promotion)."""
        return self.fencing_token >> 40

    @property
    def health(self) -> LeaseHealth:
        """The lease's :class:`LeaseHealth` (made on first use; shared by the
        copies :meth:`Client.extend` returns)."""
        lost = self.lost
        health = getattr(lost, "_health", None)
        if health is None:
            health = lost._health = LeaseHealth(lost)
        return health

    @property
    def in_jeopardy(self) -> bool:
        """True while renewals are failing and little of the TTL is left (see :class:`LeaseHealth`)."""
        return self.health.state == IN_JEOPARDY

    def time_left(self) -> float:
        """Seconds until the client's conservative estimate of the server's
        expiry (``expires_at - loop.time()``; negative once passed).  Unlike
        ``lost``, this needs no task to have run: a process that was frozen
        sees at once, on its own clock, that its lease may be gone."""
        return self.expires_at - asyncio.get_running_loop().time()


@dataclass(frozen=True)
class WatchEvent:
    """A change of a lock's holder, pushed by the server (see :meth:`Client.watch`).

    ``kind`` is ``"granted"``, ``"released"``, ``"expired"``, or, for the
    first event of a watch, ``"held"``/``"free"`` (the state when it began).
    ``token`` is the fencing token concerned (None for ``"free"``);
    ``client`` the holder's client name, if it gave one; ``correlation_id``
    the acquire's correlation id, if the server reports it (None otherwise).
    """

    name: str
    kind: str
    token: int | None
    client: str | None
    correlation_id: str | None = None


#: why a TLS server most likely closed or reset a connection during the handshake
_REFUSED_CERT_HINT = (" (a TLS server that requires client certificates drops the connection when it refuses "
                      "this client's, or its lack of one)")
#: appended when a plain-TCP client gets no HELLO reply: a TLS port waits for a
#: handshake, then drops the connection
_PLAIN_TO_TLS_HINT = " (if it is a TLS port: pass tls_ca=... or tls=True)"


def _parse_address(addr: Any) -> tuple[str, int]:
    if isinstance(addr, tuple) and len(addr) == 2:
        return str(addr[0]), int(addr[1])
    if not isinstance(addr, str) or not addr:
        raise WrongArgumentType(f"an address is 'host:port' or (host, port), not {addr!r}")
    host, sep, port = addr.rpartition(":")
    if not sep:
        return addr, DEFAULT_PORT
    if addr.startswith("[") and addr.endswith("]"):  # "[::1]": IPv6, default port
        return addr[1:-1], DEFAULT_PORT
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise InvalidArgument(f"an IPv6 address needs brackets: '[{addr}]:{DEFAULT_PORT}', not {addr!r}")
    try:
        p = int(port)
    except ValueError:
        raise InvalidArgument(f"bad port in address {addr!r}") from None
    if not 0 < p <= 65535:
        raise InvalidArgument(f"port out of range (1-65535) in address {addr!r}")
    return host.strip("[]") or "127.0.0.1", p


class _ClientConnection(RpcConnection):
    """The client's connection: an :class:`~fastlock.rpc.RpcConnection` whose
    pushes feed the watches opened on it, and whose liveness timeout is the
    client's ``request_timeout``."""

    __slots__ = ("watches",)

    def __init__(self, address: tuple[str, int], client: "Client"):
        super().__init__(address, on_push=self._dispatch_push, on_close=client._on_connection_closed,
                         liveness_timeout=client._request_timeout)
        self.watches: dict[str, set[asyncio.Queue]] = {}

    def _dispatch_push(self, kind: Any, payload: Any) -> None:
        if kind == P.PUSH_WATCH:
            event = WatchEvent(*payload)
            for queue in self.watches.get(event.name, ()):
                queue.put_nowait(event)


# Errors after which an operation looks for the primary and tries again
# (within its deadline): the connection is gone, or the node is not (or no
# longer) a primary that may serve it.  Every other error surfaces at once.
_RETRYABLE = (ConnectionLost, NotPrimary, Unavailable)
_BACKOFF_FIRST = 0.02  # seconds: the first pause between sweeps of the address list
_BACKOFF_MAX = 0.5  # seconds: the longest pause (doubling from the first, with jitter)
#: a grant read with less than this fraction of its TTL left (by the client's
#: conservative estimate) is verified with an EXTEND before it is returned
LATE_GRANT_FRACTION = 0.5


class _RideThrough:
    """The retry state of one operation: its deadline (``loop.time()``
    seconds, None: none), the last error, and the pause (backoff with
    jitter) before the next sweep of the address list."""

    __slots__ = ("client", "deadline", "last", "backoff", "max_backoff", "loop")

    def __init__(self, client: "Client", deadline: float | None, max_backoff: float = _BACKOFF_MAX):
        self.client = client
        self.deadline = deadline
        self.last: BaseException | None = None
        self.backoff = min(_BACKOFF_FIRST, max_backoff)
        self.max_backoff = max_backoff
        self.loop = asyncio.get_running_loop()

    def failed(self, conn: _ClientConnection | None, exc: BaseException) -> bool:
        """Record a failed attempt on ``conn``; True if the next one should
        pause first (a redirect that names the primary is followed at once)."""
        self.last = exc
        if isinstance(exc, (NotPrimary, Unavailable)) and conn is not None:
            self.client._refused(conn, exc)
        return not (isinstance(exc, NotPrimary) and exc.primary)

    def expired(self) -> ConnectionLost:
        err = ConnectionLost(f"no fastlock primary could serve the request before its deadline "
                             f"(last error: {self.last or 'none'})")
        err.__cause__ = self.last
        return err

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - self.loop.time()

    async def connection(self, pause: bool) -> _ClientConnection:
        """A connection to a primary for the next attempt (after a pause when
        ``pause``); raises :class:`ConnectionLost` once the deadline passed."""
        client = self.client
        while True:
            if client._closed:
                raise ConnectionLost("client is closed")
            if pause:
                delay = random.uniform(0.5, 1.0) * self.backoff
                self.backoff = min(self.backoff * 2.0, self.max_backoff)
                left = self.left()
                if left is not None:
                    delay = min(delay, left)
                if delay > 0:
                    await asyncio.sleep(delay)
            left = self.left()
            if left is not None and left <= 0:
                raise self.expired()
            try:
                return await client._ensure_connected(self.deadline)
            except ConnectionLost as exc:
                if client._closed:
                    raise
                self.last = exc
                pause = True


class Client:
    """A connection to a fastlock primary.  Create it with :func:`connect`.

    Many tasks may share one client; their requests are pipelined on one
    connection.  Held leases survive a dropped connection until their TTL.

    **Riding through a failover.**  Every operation runs under one deadline:
    ``wait`` plus ``connect_timeout`` for an acquire (none when ``wait`` is
    None), ``request_timeout`` (or ``connect_timeout`` when that is None) for
    every other call, and the lease's own expiry for a renewal.  Within it, a
    lost connection, a ``NotPrimary`` refusal (a standby, a deposed primary)
    or ``Unavailable`` (a fenced primary, a server shutting down) makes the
    client drop that connection, look for the current primary - every
    address, redirects followed first, an address that went silent or
    answered "deposed"/"fenced"/``Unavailable`` tried last, with backoff and
    jitter (20 ms doubling to 0.5 s) between sweeps - and send the request
    again.  A retried acquire carries the same owner key, so the server finds
    its existing lease (or waiter) instead of granting the lock twice, as
    ZooKeeper's lock recipe finds its own node again.  Only when the deadline
    passes with no primary able to serve does :class:`ConnectionLost` reach
    the caller (its ``__cause__`` is the last refusal).  See the table in
    ``docs/client-features.md``.

    **Liveness.**  A server that stops answering while its TCP connection
    stays open (a frozen process, a stalled VM, a black-holed network) is
    detected by a per-connection watchdog (:class:`fastlock.rpc.RpcConnection`),
    not by per-request timers: while any request (including a waiting
    acquire) or watch is outstanding, a ``PING`` is sent after
    ``request_timeout / 3`` seconds without a byte from the server, and after
    ``request_timeout`` seconds of silence the connection is aborted and that
    address is tried last from then on; the operations pending on it ride
    through as above.  An idle connection is never pinged nor aborted.  A
    waiting acquire is therefore never failed by its own ``wait`` being long:
    only by the server going silent.
    """

    def __init__(self, addresses: Iterable[Any], *, auth: str | None = None, client_name: str | None = None,
                 connect_timeout: float = 5.0, request_timeout: float | None = 5.0,
                 tls: bool | ssl.SSLContext | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, server_hostname: str | None = None):
        self._addresses = [_parse_address(a) for a in addresses]
        if not self._addresses:
            raise InvalidArgument("connect() needs at least one address")
        self._auth = P.check_optional_str(auth, "auth secret", 1024)
        self._client_name = P.check_optional_str(client_name, "client name", P.MAX_CLIENT_NAME_CHARS)
        self._connect_timeout = _check_timeout(connect_timeout, "connect_timeout", allow_none=False)
        self._request_timeout = _check_timeout(request_timeout, "request_timeout", allow_none=True)
        self._ssl = client_ssl_context(tls, tls_ca, tls_cert, tls_key)
        if server_hostname is not None:
            if type(server_hostname) is not str or not server_hostname:
                raise WrongArgumentType(f"server_hostname must be a non-empty str, not {server_hostname!r}")
            if self._ssl is None:
                raise InvalidArgument("server_hostname is only meaningful with TLS")
        self._server_hostname = server_hostname
        # the deadline of every call but acquire and renewals (seconds)
        self._op_timeout = self._request_timeout if self._request_timeout is not None else self._connect_timeout
        self._proto: _ClientConnection | None = None
        self._connecting: asyncio.Future | None = None  # result of the connection attempt in progress
        self._connect_task: asyncio.Task | None = None
        self._attempt: dict = {}  # {"addr": the address the attempt in progress is trying}
        self._suspects: set[tuple[str, int]] = set()  # addresses that went silent: tried last
        self._demoted: set[tuple[str, int]] = set()  # answered deposed / fenced / Unavailable: tried last
        self._preferred: tuple[str, int] | None = None  # named as the primary by a refusal: tried first
        self._closed = False
        self._renewers: dict[int, asyncio.Task] = {}
        self._orphans: list[tuple[str, bytes]] = []  # acquires given up on: cancelled by owner on reconnect
        self.server_info: dict = {}
        #: the highest fencing epoch this client has seen; sent in every HELLO so
        #: that a deposed primary that still runs learns it and steps down
        self.max_epoch = 0

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def request_timeout(self) -> float | None:
        """Seconds of server silence, while something is outstanding, after
        which the connection is declared dead (None: never)."""
        return self._request_timeout

    # -- connection management ------------------------------------------------------
    async def _ensure_connected(self, deadline: float | None = None) -> _ClientConnection:
        """The connection to the primary, connecting first if needed (one
        attempt shared by every caller).  ``deadline`` (``loop.time()``) bounds
        this caller's wait for the attempt.

        Raises:
            ConnectionLost: no address accepted a connection as primary (in
                one sweep, or before ``deadline``), or the client is closed.
            AuthError: the secret was refused.
        """
        proto = self._proto
        if proto is not None and not proto.closed:
            return proto
        if self._closed:
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

    async def _connect_into(self, fut: asyncio.Future, attempt: dict) -> None:
        """Run one connection attempt and hand its outcome to ``fut`` - unless
        ``fut`` was settled meanwhile (:meth:`_reset_connection`, :meth:`close`),
        in which case a connection it made is closed, not used."""
        try:
            proto, info = await self._connect(attempt)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiters
            if not fut.done():
                if isinstance(exc, asyncio.CancelledError):
                    exc = ConnectionLost("client is closed" if self._closed else "connection attempt abandoned")
                fut.set_exception(exc)
                fut.add_done_callback(_ignore_result)  # no waiter left is fine
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            if self._connecting is fut and fut.done():
                self._connecting = None
        if fut.done() or self._closed:  # abandoned while the handshake was in flight
            proto.close(ConnectionLost("connection attempt abandoned"))
            if self._connecting is fut:
                self._connecting = None
            return
        self.server_info = info
        self.max_epoch = max(self.max_epoch, info.get("epoch", 0))
        self._proto = proto
        self._suspects.discard(proto.address)
        self._demoted.discard(proto.address)
        self._preferred = None
        if self._orphans:
            orphans, self._orphans = self._orphans, []
            for name, owner in orphans:
                proto.send(P.OP_CANCEL, name, owner)
        fut.set_result(proto)
        if self._connecting is fut:
            self._connecting = None

    async def _connect(self, attempt: dict) -> tuple[_ClientConnection, dict]:
        """Sweep the addresses once (following redirects) until one is a
        primary and accepts the handshake; ``attempt["addr"]`` says which one
        is being tried.  Order: a primary named by the last refusal, then the
        others, then addresses that went silent, then those that answered
        deposed/fenced/``Unavailable`` (a fenced primary is used only when no
        other address is a primary)."""
        loop = asyncio.get_running_loop()
        errors = []
        later = self._suspects | self._demoted
        candidates = [a for a in self._addresses if a not in later]
        candidates += [a for a in self._addresses if a in self._suspects and a not in self._demoted]
        candidates += [a for a in self._addresses if a in self._demoted]
        if self._preferred is not None:
            candidates.insert(0, self._preferred)
        tried: set[tuple[str, int]] = set()

        def redirect(primary: Any) -> None:
            try:
                target = _parse_address(primary)
            except FastlockError:
                return
            if target in later:
                candidates.append(target)
            else:
                candidates.insert(0, target)

        deferred: set[tuple[str, int]] = set()
        while candidates:
            addr = candidates.pop(0)
            if addr in tried:
                continue
            tried.add(addr)
            attempt["addr"] = addr
            try:
                _, proto = await asyncio.wait_for(
                    loop.create_connection(lambda: _ClientConnection(addr, self), addr[0], addr[1],
                                           **self._tls_arguments(addr)),
                    self._connect_timeout,
                )
            except asyncio.TimeoutError:
                self._suspects.add(addr)
                errors.append(f"{addr[0]}:{addr[1]}: connect timed out after {self._connect_timeout} s")
                continue
            except (OSError, OverflowError) as exc:
                hint = _REFUSED_CERT_HINT if self._ssl is not None and isinstance(exc, ConnectionResetError) else ""
                errors.append(f"{addr[0]}:{addr[1]}: {exc or type(exc).__name__}{hint}")
                continue
            try:
                info = await asyncio.wait_for(
                    proto.request(P.OP_HELLO, P.PROTOCOL_VERSION, self._client_name, self._auth, self.max_epoch),
                    self._connect_timeout,
                )
            except NotPrimary as exc:
                proto.close()
                errors.append(f"{addr[0]}:{addr[1]}: not primary (primary: {exc.primary})")
                if exc.primary:
                    redirect(exc.primary)
                else:
                    self._demoted.add(addr)
                continue
            except Unavailable as exc:
                proto.close()
                self._demoted.add(addr)
                errors.append(f"{addr[0]}:{addr[1]}: unavailable: {exc}")
                continue
            except asyncio.TimeoutError:
                proto.abort(ConnectionLost("handshake timed out"))
                self._suspects.add(addr)
                hint = _PLAIN_TO_TLS_HINT if self._ssl is None else ""
                errors.append(f"{addr[0]}:{addr[1]}: no handshake reply within {self._connect_timeout} s{hint}")
                continue
            except ConnectionLost as exc:
                proto.abort(exc)
                hint = _REFUSED_CERT_HINT if self._ssl is not None else _PLAIN_TO_TLS_HINT
                errors.append(f"{addr[0]}:{addr[1]}: handshake failed: {exc}{hint}")
                continue
            except BaseException:
                proto.abort(ConnectionLost("handshake failed"))
                raise
            if not isinstance(info, dict):
                proto.abort(ConnectionLost("bad handshake reply"))
                errors.append(f"{addr[0]}:{addr[1]}: bad handshake reply {info!r}")
                continue
            self.max_epoch = max(self.max_epoch, info.get("epoch", 0) if type(info.get("epoch")) is int else 0)
            if info.get("role") != "primary":
                proto.close()
                primary = info.get("primary")
                errors.append(f"{addr[0]}:{addr[1]}: is a {info.get('role')} (primary: {primary})")
                if primary:
                    redirect(primary)
                if info.get("role") != "standby":  # deposed, promoting: not a primary soon
                    self._demoted.add(addr)
                continue
            if info.get("fenced") and addr not in deferred and any(c not in tried for c in candidates):
                # a primary that is not granting (its standby may have taken over): try the
                # other addresses first, and come back to it only if none is a primary
                proto.close()
                errors.append(f"{addr[0]}:{addr[1]}: primary is fenced (not granting)")
                self._demoted.add(addr)
                deferred.add(addr)
                tried.discard(addr)
                candidates.append(addr)
                continue
            log.debug("connected to %s:%d (session %s)", addr[0], addr[1], info.get("session"))
            return proto, info
        raise ConnectionLost("could not connect to a fastlock primary: " + "; ".join(errors))

    def _tls_arguments(self, addr: tuple[str, int]) -> dict:
        """``create_connection`` arguments for TLS to ``addr`` (none for plain TCP): the
        certificate must name ``server_hostname``, or else the address's host."""
        if self._ssl is None:
            return {}
        return {"ssl": self._ssl, "server_hostname": self._server_hostname or addr[0]}

    def _on_connection_closed(self, proto: _ClientConnection, error: ConnectionLost) -> None:
        """Called once per connection when it ends: the client forgets it (so
        the next request reconnects), a silent address is tried last, and
        every watch on it ends."""
        if self._proto is proto:
            self._proto = None
        if proto.silent:
            self._suspects.add(proto.address)
        for queues in proto.watches.values():
            for queue in queues:
                queue.put_nowait(None)  # end of this watch
        proto.watches.clear()

    def _refused(self, proto: _ClientConnection, exc: BaseException) -> None:
        """A request on ``proto`` was refused with ``NotPrimary`` or
        ``Unavailable``: that node cannot serve now.  Drop the connection (the
        requests pending on it ride through elsewhere), try a primary it named
        first, and the node itself last unless it named nobody."""
        addr = proto.address
        primary = getattr(exc, "primary", None)
        target = None
        if primary:
            try:
                target = _parse_address(primary)
            except FastlockError:
                target = None
        if target is not None and target != addr:
            self._preferred = target
        self._demoted.add(addr)
        if not proto.closed:
            log.info("%s:%d refused a request (%s: %s); looking for the primary", addr[0], addr[1],
                     type(exc).__name__, quote(str(exc)))
            proto.abort(ConnectionLost(f"{addr[0]}:{addr[1]} cannot serve: {exc}"))

    def _reset_connection(self, reason: str) -> None:
        """Give up on the current connection and on any connection attempt in
        progress: their requests raise :class:`ConnectionLost` (``reason``), the
        address concerned is tried last next time, and the next request
        reconnects.  For callers with their own deadline that found the server
        silent (a renewal that must not keep waiting on a frozen socket)."""
        proto = self._proto
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
            fut.add_done_callback(_ignore_result)
            task = self._connect_task
            if task is not None and not task.done():
                task.cancel()
        self._connecting = None

    def _reset_if_silent_since(self, started: float, reason: str) -> None:
        """A request sent at ``started`` (``loop.time()``) timed out: reset the
        connection (:meth:`_reset_connection`) unless the server has sent us
        something since - then it is alive, only slow, and the connection (with
        everyone else's requests on it) is kept.  A connection attempt still in
        progress is reset too."""
        proto = self._proto
        if proto is not None and not proto.closed and proto.last_recv > started:
            return
        self._reset_connection(reason)

    async def _request(self, op: int, *args: Any) -> Any:
        """Send one request and return its reply's value, riding through a
        failover within ``request_timeout`` (see :class:`Client`)."""
        proto = self._proto
        if proto is not None and not proto.closed:
            started = proto.loop.time()
            try:
                return await proto.request(op, *args)
            except _RETRYABLE as exc:
                if self._closed:
                    raise
                return await self._retry(op, args, started + self._op_timeout, proto, exc)
        return await self._retry(op, args, asyncio.get_running_loop().time() + self._op_timeout)

    async def _retry(self, op: int, args: tuple, deadline: float | None, proto: _ClientConnection | None = None,
                     exc: BaseException | None = None, *, attempt_timeout: float | None = None,
                     max_backoff: float = _BACKOFF_MAX) -> Any:
        """Send ``op`` until a primary answers or ``deadline`` passes.

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
        loop = asyncio.get_running_loop()
        pacing = _RideThrough(self, deadline, max_backoff)
        unknown = False  # an attempt may have taken effect, its reply lost
        pause = False
        if exc is not None:
            unknown = isinstance(exc, ConnectionLost)
            pause = pacing.failed(proto, exc)
        while True:
            proto = await pacing.connection(pause)
            sent = loop.time()
            try:
                fut = proto.request(op, *args)
                if attempt_timeout is None:
                    return await fut
                left = pacing.left()
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
                pacing.last = ConnectionLost(f"no reply within {attempt_timeout:.3f} s")
                self._reset_if_silent_since(sent, f"{P.OP_NAMES.get(op, op)} got no reply in time")
                pause = True
            except _RETRYABLE as err:
                if self._closed:
                    raise
                unknown = unknown or isinstance(err, ConnectionLost)
                pause = pacing.failed(proto, err)

    async def close(self) -> None:
        """Stop auto-renewals and close the connection.

        Every request still pending (a waiting acquire included) raises
        :class:`ConnectionLost` ("client is closed") at once, and so does any
        later call.  Held leases stay held on the server until their TTL
        (release them first if you want them freed now)."""
        self._closed = True
        for task in list(self._renewers.values()):
            task.cancel()
        self._renewers.clear()
        closed = ConnectionLost("client is closed")
        fut = self._connecting
        self._connecting = None
        if fut is not None and not fut.done():
            fut.set_exception(closed)
            fut.add_done_callback(_ignore_result)
        task = self._connect_task
        if task is not None and not task.done():
            task.cancel()
        proto = self._proto
        self._proto = None
        if proto is not None and not proto.closed:
            proto.close(closed)

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- lock operations ----------------------------------------------------------------
    async def acquire(self, name: str, *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
                      correlation_id: str | None = None) -> Lease:
        """Acquire ``name`` and return its :class:`Lease`.

        Args:
            name: lock name, non-empty, at most 512 bytes of UTF-8.
            ttl: lease time to live in seconds (1 ms .. 24 h), counted on the
                server's monotonic clock from the grant.
            wait: seconds to wait in the lock's FIFO queue; ``0`` tries once,
                ``None`` waits forever.  The whole call, failovers included,
                runs under one deadline: ``wait + connect_timeout`` seconds
                (none when ``wait`` is None).
            lock_delay: seconds (0 .. 60) during which the lock stays
                unavailable after this lease *expires* (not after a clean
                release), as Chubby's lock-delay and Consul's session lock-delay.
            correlation_id: free text (<= 256 chars) recorded with the grant in
                the server's WAL, for audits (``fastlock wal dump``).

        A lost connection, a standby or deposed node (``NotPrimary``) or a
        fenced primary (``Unavailable``) does not end the call: the client
        finds the current primary and asks again with the same owner key, so
        a grant that was made before the failure is found again, never made
        twice (see :class:`Client`).  A request that waited in the queue asks
        again for the wait that is left (its place in the queue is lost: a
        waiter goes with its connection).

        **No dead lease returned as granted** (the fault of etcd issue 11456,
        found by Jepsen).  The server reports how long the request waited in
        its queue (``waited_ms``, on its own monotonic clock).  The grant
        cannot have happened before ``sent + waited`` on this client's clock
        (``sent``: when this client sent the request), so the lease's
        ``expires_at`` is ``sent + waited + ttl`` - an estimate that is never
        later than the server's expiry, assuming the two monotonic clocks run
        at the same rate (quartz drift, about 1e-4, is far inside the margin
        below).  If, when the reply is read, less than half of the TTL is left
        by that estimate (this process was frozen, or its loop stalled, while
        the grant waited unread), the lease is not returned on trust: one
        EXTEND verifies it with the server (renewing it from now) and the
        lease is returned only if that succeeds and leaves time.  Otherwise the
        lock is released (best effort) and, while ``wait`` has time left, the
        acquire queues again with a new owner key; when it has none,
        :class:`LeaseLost` is raised - not a lease already marked lost, so that
        no code path can act on it by mistake.  On the normal path this costs
        no extra round trip.

        Raises:
            LockNotAcquired: the wait ran out (or ``wait=0`` and it was held).
            LeaseLost: a grant arrived too late to be proven alive, and the
                wait had no time left to queue again (see above).
            ConnectionLost: the deadline passed with no primary reachable,
                or the client was closed.
            LimitExceeded: too many waiting acquires on this connection.
            InvalidArgument / WrongArgumentType: bad arguments (nothing sent).

        Cancelling the awaiting task (``task.cancel()``, ``asyncio.timeout``)
        removes the waiter on the server; if the grant raced with the cancel,
        the server releases it (never a ghost holder).
        """
        P.check_name(name)
        ttl_ms = P.check_ttl_ms(P.seconds_to_ms(ttl, "ttl"))
        wait_ms = P.check_wait_ms(P.seconds_to_ms(wait, "wait", allow_none=True, allow_zero=True))
        delay_ms = P.check_lock_delay_ms(P.seconds_to_ms(lock_delay, "lock_delay", allow_zero=True))
        P.check_optional_str(correlation_id, "correlation_id", P.MAX_CORRELATION_ID_CHARS)
        owner = os.urandom(16)
        proto = self._proto
        if proto is not None and not proto.closed:
            sent = started = proto.loop.time()
            fut = proto.request(P.OP_ACQUIRE, name, owner, ttl_ms, wait_ms, delay_ms, correlation_id)
            try:
                reply = await fut
            except asyncio.CancelledError:
                self._abandon(proto, name, owner)
                raise
            except _RETRYABLE as exc:
                reply, sent = await self._acquire_retry(name, owner, ttl_ms, wait_ms, delay_ms, correlation_id,
                                                        sent, proto, exc)
        else:
            started = asyncio.get_running_loop().time()
            reply, sent = await self._acquire_retry(name, owner, ttl_ms, wait_ms, delay_ms, correlation_id,
                                                    started)
        token = reply[0]
        granted_ttl = reply[1] / 1000.0
        # The grant happened no earlier than `sent + waited` on our clock (the
        # server received the request after we sent it, then it waited).
        waited = reply[2] / 1000.0 if len(reply) > 2 else 0.0
        expires_at = sent + waited + granted_ttl
        epoch = token >> 40
        if epoch > self.max_epoch:
            self.max_epoch = epoch
        lease = Lease(name, token, granted_ttl, owner, _LostEvent(), expires_at)
        if expires_at - asyncio.get_running_loop().time() >= granted_ttl * LATE_GRANT_FRACTION:
            return lease
        return await self._late_grant(lease, (name, ttl_ms, wait_ms, delay_ms, correlation_id), started)

    async def _late_grant(self, lease: Lease, request: tuple, started: float) -> Lease:
        """A grant read with less than :data:`LATE_GRANT_FRACTION` of its TTL
        left by the conservative estimate: verify it with one EXTEND, or give
        it back and queue again while the wait allows (see :meth:`acquire`)."""
        loop = asyncio.get_running_loop()
        name, ttl_ms, wait_ms, delay_ms, correlation_id = request
        log.warning("grant of %s token %d was read with %.3f s of its %.3f s TTL left (this process or the "
                    "network stalled); verifying it with the server", quote(lease.name), lease.fencing_token,
                    lease.expires_at - loop.time(), lease.ttl)
        try:
            verified = await self.extend(lease)
        except FastlockError as exc:
            log.warning("late grant of %s token %d could not be verified (%s); giving it back",
                        quote(lease.name), lease.fencing_token, exc)
            lease.lost.set()
            self._drop(lease)
        else:
            if verified.expires_at > loop.time():
                return verified
            lease.lost.set()
            self._drop(lease)
        if wait_ms < 0:
            return await self.acquire(name, ttl=ttl_ms / 1000.0, wait=None, lock_delay=delay_ms / 1000.0,
                                      correlation_id=correlation_id)
        left = started + wait_ms / 1000.0 - loop.time()
        if wait_ms > 0 and left > 0:
            return await self.acquire(name, ttl=ttl_ms / 1000.0, wait=left, lock_delay=delay_ms / 1000.0,
                                      correlation_id=correlation_id)
        raise LeaseLost(f"{name!r} was granted (token {lease.fencing_token}) but the grant was read too late to "
                        f"prove the lease alive, and the wait had no time left to queue again")

    async def _acquire_retry(self, name: str, owner: bytes, ttl_ms: int, wait_ms: int, delay_ms: int,
                             correlation_id: str | None, started: float, proto: _ClientConnection | None = None,
                             exc: BaseException | None = None) -> tuple[list, float]:
        """Ride an acquire through a failover: same owner key, the wait that is
        left, until ``started + wait + connect_timeout``.  Returns the reply and
        the ``loop.time()`` its request was sent."""
        loop = asyncio.get_running_loop()
        wait_end = None if wait_ms < 0 else started + wait_ms / 1000.0
        deadline = None if wait_end is None else wait_end + self._connect_timeout
        pacing = _RideThrough(self, deadline)
        pause = False
        if exc is not None:
            if self._closed:
                self._orphans.append((name, owner))
                raise exc
            pause = pacing.failed(proto, exc)
        while True:
            try:
                proto = await pacing.connection(pause)
            except BaseException:
                # the grant may have been made before the failure: cancel by owner
                # (now, or on the next connection) so that it is released, not left to its TTL
                self._abandon(self._proto, name, owner)
                raise
            if wait_end is None:
                left_ms = -1
            else:
                left_ms = max(0, int((wait_end - loop.time()) * 1000))
            sent = loop.time()
            try:
                reply = await proto.request(P.OP_ACQUIRE, name, owner, ttl_ms, left_ms, delay_ms, correlation_id)
                return reply, sent
            except asyncio.CancelledError:
                self._abandon(proto, name, owner)
                raise
            except _RETRYABLE as err:
                if self._closed:
                    self._orphans.append((name, owner))
                    raise
                pause = pacing.failed(proto, err)

    def _abandon(self, proto: _ClientConnection | None, name: str, owner: bytes,
                 op: int = P.OP_CANCEL, *args: Any) -> None:
        """Withdraw the acquire (``name``, ``owner``) without waiting: CANCEL
        by owner (or ``op`` with ``args``, e.g. a RELEASE) on ``proto``.  If
        that connection is, or turns out to be, dead before it answers, the
        client cancels by owner on its next connection (CANCEL releases a
        grant that raced), so a grant is never left to run out its TTL."""
        if proto is None or proto.closed:
            self._orphans.append((name, owner))
            return
        fut = proto.request(op, name, *(args or (owner,)))

        def done(f: asyncio.Future) -> None:
            if f.cancelled():
                return
            if isinstance(f.exception(), ConnectionLost) and not self._closed:
                current = self._proto
                if current is not None and not current.closed and current is not proto:
                    self._abandon(current, name, owner)
                else:
                    self._orphans.append((name, owner))

        fut.add_done_callback(done)

    async def release(self, lease: Lease) -> None:
        """Release ``lease``; the next waiter (if any) is granted at once.

        Rides through a failover within ``request_timeout``: a release refused
        by a node that is not (or no longer) the serving primary - a deposed
        node (``NotPrimary``), a fenced one (``Unavailable``; it changes
        nothing) - is sent again to the current primary, so an acknowledged
        release takes effect on whichever node is primary afterwards.

        Raises:
            LeaseLost: the lease is no longer the holder (expired, or released
                already); nothing changed on the server.  ``lease.lost`` is set.
                (After an attempt whose outcome is unknown, a ``LeaseLost``
                from the retry counts as released.)
            ConnectionLost: no primary could be reached within ``request_timeout``;
                the lease expires by its TTL.
        """
        _check_lease(lease)
        task = self._renewers.pop(id(lease.lost), None)
        if task is not None:
            task.cancel()
        try:
            await self._request(P.OP_RELEASE, lease.name, lease.fencing_token, lease.owner)
        except LeaseLost:
            lease.lost.set()
            raise

    async def extend(self, lease: Lease, *, ttl: float | None = None) -> Lease:
        """Renew ``lease`` for ``ttl`` seconds from now (default: its current TTL).

        Returns the lease (a new object if the TTL changed).  An expired lease
        is never revived.  Rides through a failover within ``request_timeout``.

        Raises:
            LeaseLost: the lease expired or was released; ``lease.lost`` is set.
            ConnectionLost: no primary could be reached within ``request_timeout``.
        """
        _check_lease(lease)
        ttl_ms = P.check_ttl_ms(P.seconds_to_ms(lease.ttl if ttl is None else ttl, "ttl"))
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            granted = await self._request(P.OP_EXTEND, lease.name, lease.fencing_token, lease.owner, ttl_ms)
        except LeaseLost:
            lease.lost.set()
            raise
        return self._extended(lease, granted, sent)

    def _extended(self, lease: Lease, granted_ms: int, sent: float) -> Lease:
        # the server's TTL counts from when it handled the extend: after `sent`
        new_ttl = granted_ms / 1000.0
        object.__setattr__(lease, "expires_at", sent + new_ttl)
        epoch = lease.fencing_token >> 40
        if epoch > self.max_epoch:
            self.max_epoch = epoch
        if new_ttl == lease.ttl:
            return lease
        return Lease(lease.name, lease.fencing_token, new_ttl, lease.owner, lease.lost, sent + new_ttl)

    async def _renew(self, lease: Lease, deadline: float, *, ttl: float | None = None,
                     attempt_timeout: float | None = None) -> Lease:
        """One renewal that must succeed before ``deadline`` (``loop.time()``):
        EXTEND (for ``ttl`` seconds, default the lease's) through the
        ride-through path, each attempt bounded by ``attempt_timeout`` seconds
        (default a third of the TTL) so a silent server leaves time to find the
        next primary.

        Raises:
            LeaseLost: the server refused the renewal, or none succeeded
                before ``deadline`` (``lease.lost`` is set by the caller).
        """
        ttl_s = lease.ttl if ttl is None else ttl
        ttl_ms = P.check_ttl_ms(P.seconds_to_ms(ttl_s, "ttl"))
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            granted = await self._retry(P.OP_EXTEND, (lease.name, lease.fencing_token, lease.owner, ttl_ms),
                                        deadline, attempt_timeout=attempt_timeout or ttl_s / 3.0,
                                        max_backoff=min(_BACKOFF_MAX, ttl_s / 10.0))
        except ConnectionLost as exc:
            if self._closed:
                raise
            raise LeaseLost(f"no renewal of {lease.name!r} succeeded before the lease's deadline: {exc}") from exc
        # the successful attempt was sent at or after `sent`: conservative
        return self._extended(lease, granted, sent)

    async def check(self, name: str, fencing_token: int) -> bool:
        """Is ``fencing_token`` the current, unexpired holder's token of ``name``?

        The server-side half of Chubby's sequencer check: a downstream service
        may call it before acting on a request that carries a token.  Rides
        through a failover within ``request_timeout``.
        """
        P.check_name(name)
        P.check_token(fencing_token)
        return await self._request(P.OP_CHECK, name, fencing_token)

    async def status(self) -> dict:
        """The primary's status: role, epoch, counters, sessions, WAL stats."""
        return await self._request(P.OP_STATUS)

    async def ping(self) -> float:
        """Round trip to the primary, in seconds."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await self._request(P.OP_PING)
        return loop.time() - t0

    async def holder(self, name: str) -> dict | None:
        """The current holder of ``name``: ``{"token", "client", "ttl_ms", "remaining_ms"}`` or None."""
        P.check_name(name)
        return await self._request(P.OP_HOLDER, name)

    async def watch(self, name: str):
        """Yield :class:`WatchEvent` for every change of ``name``'s holder.

        Pushed by the server (no polling), in the order it applied them.  The
        first event is the state when the watch began (``"held"`` with the
        token, or ``"free"``).  A grant is reported once it is durable.  If the
        connection drops the iterator raises :class:`ConnectionLost` (events
        may have been missed: start a new watch, which begins with the state,
        and rides through to the new primary).  Breaking out of the loop
        unsubscribes.

        Example::

            async for event in client.watch("leader"):
                print(event.kind, event.token, event.client)
        """
        P.check_name(name)
        pacing = _RideThrough(self, asyncio.get_running_loop().time() + self._op_timeout)
        pause = False
        while True:  # starting rides through a failover, as every call does
            proto = await pacing.connection(pause)
            queue: asyncio.Queue = asyncio.Queue()
            proto.watches.setdefault(name, set()).add(queue)
            try:
                info = await proto.request(P.OP_WATCH, name)
                break
            except _RETRYABLE as exc:
                group = proto.watches.get(name)
                if group is not None:
                    group.discard(queue)
                    if not group:
                        del proto.watches[name]
                if self._closed:
                    raise
                pause = pacing.failed(proto, exc)
        proto.subscriptions += 1
        proto.rearm()  # the watch keeps the liveness watchdog armed
        try:
            if info is None:
                yield WatchEvent(name, "free", None, None)
            else:
                yield WatchEvent(name, "held", info["token"], info["client"], info.get("correlation_id"))
            while True:
                event = await queue.get()
                if event is None:
                    raise ConnectionLost(f"connection lost while watching {name!r}")
                yield event
        finally:
            proto.subscriptions -= 1
            group = proto.watches.get(name)
            if group is not None:
                group.discard(queue)
                if not group:
                    del proto.watches[name]
                    if not proto.closed:
                        proto.send(P.OP_UNWATCH, name)

    def lock(self, name: str, *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
             correlation_id: str | None = None, renew: bool = True,
             jeopardy_fraction: float = 0.5) -> "LockContext":
        """Acquire ``name`` and keep renewing it.

        ``async with client.lock(...) as lease:`` acquires, renews at about a
        third of the TTL (minus 10-20 % random jitter, so many holders do not
        renew in step) and releases on exit.  ``lease = await client.lock(...)``
        acquires and renews until :meth:`release`.  If a renewal is refused or
        the TTL passes without one succeeding, ``lease.lost`` is set and
        renewal stops; the body is not interrupted - check ``lease.lost``
        (or pass the fencing token to your writes) before acting.

        ``lease.health`` (:class:`LeaseHealth`) turns ``"in_jeopardy"`` when
        renewals have failed and less than ``jeopardy_fraction`` (0 < f < 1,
        default 0.5) of the TTL is left, and ``"safe"`` again when one succeeds.

        Arguments and errors are those of :meth:`acquire`.
        """
        P.check_name(name)
        _check_fraction(jeopardy_fraction)
        return LockContext(self, name, dict(ttl=ttl, wait=wait, lock_delay=lock_delay,
                                            correlation_id=correlation_id), renew, jeopardy_fraction)

    # -- several locks at once --------------------------------------------------------
    async def acquire_many(self, names: Iterable[str], *, ttl: float, wait: float | None = None,
                           lock_delay: float = 0.0, correlation_id: str | None = None) -> "MultiLease":
        """Acquire every lock in ``names``, or none of them.

        The locks are taken one after the other in one global order - sorted
        by the UTF-8 bytes of their names - whatever order ``names`` lists them
        in.  Every multi-lock takes its locks in that same total order, so no
        set of them can wait on each other in a cycle (the waits-for graph
        stays acyclic: ordered two-phase locking), and a single-lock holder
        waits for nothing while it holds.  The price is one round trip per
        name (plus queueing), and a lock taken early is held while later ones
        are awaited.

        Args:
            names: distinct lock names (at least one; each checked as in
                :meth:`acquire`).
            ttl: each lease's time to live in seconds, counted from *its* grant
                (:meth:`acquire_many` does not renew: with a long ``wait`` and
                a short ``ttl``, use :meth:`lock_many`).
            wait: one overall deadline in seconds for all of them; ``0`` tries
                each once; ``None`` waits forever.
            lock_delay, correlation_id: as :meth:`acquire`, for every lease.

        Returns:
            a :class:`MultiLease`.

        Raises:
            LockNotAcquired: the deadline passed; the locks taken so far are
                released before this is raised.
            InvalidArgument / WrongArgumentType: no names, a duplicate name, or
                a bad argument (nothing sent).
            ConnectionLost: the connection dropped; partial grants are released
                (cancelled by owner on the next connection, else they expire).

        Cancelling the awaiting task releases whatever was taken.
        """
        return await self._acquire_many(names, dict(ttl=ttl, lock_delay=lock_delay,
                                                    correlation_id=correlation_id), wait, None)

    def lock_many(self, names: Iterable[str], *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
                  correlation_id: str | None = None, jeopardy_fraction: float = 0.5) -> "LockManyContext":
        """:meth:`acquire_many` plus auto-renewal of every lease, as :meth:`lock`.

        ``async with client.lock_many(["a", "b"], ttl=10.0) as locks:`` holds
        all of them in the body and releases them on exit; ``await
        client.lock_many(...)`` holds them until :meth:`release_many`.  Each
        lease is renewed from the moment it is granted (so waiting for the
        later ones cannot let the early ones expire).  ``locks.lost`` is set as
        soon as any one of them is lost.
        """
        checked = _sorted_names(names)
        _check_fraction(jeopardy_fraction)
        return LockManyContext(self, checked, dict(ttl=ttl, lock_delay=lock_delay, correlation_id=correlation_id),
                               wait, jeopardy_fraction)

    async def _acquire_many(self, names: Iterable[str], kwargs: dict, wait: float | None,
                            renew_fraction: float | None) -> "MultiLease":
        ordered = names if isinstance(names, _SortedNames) else _sorted_names(names)
        # Validate everything before the first request goes out.
        P.check_ttl_ms(P.seconds_to_ms(kwargs["ttl"], "ttl"))
        P.seconds_to_ms(wait, "wait", allow_none=True, allow_zero=True)
        P.check_lock_delay_ms(P.seconds_to_ms(kwargs["lock_delay"], "lock_delay", allow_zero=True))
        P.check_optional_str(kwargs["correlation_id"], "correlation_id", P.MAX_CORRELATION_ID_CHARS)
        loop = asyncio.get_running_loop()
        deadline = None if wait is None else loop.time() + wait
        leases: list[Lease] = []
        multi_lost = asyncio.Event()
        try:
            for name in ordered:
                left = None if deadline is None else max(0.0, deadline - loop.time())
                lease = await self.acquire(name, wait=left, **kwargs)
                leases.append(lease)
                if renew_fraction is not None:
                    self._start_renewing(lease, renew_fraction)
            multi = MultiLease(tuple(leases), multi_lost)
            if multi.lost.is_set():
                raise LeaseLost(f"a lease was lost while acquiring the others: {multi.lost_names()}")
            return multi
        except asyncio.CancelledError:
            for lease in leases:
                self._drop(lease)
            raise
        except BaseException:
            if leases:
                await asyncio.gather(*(self._release_quietly(lease) for lease in leases))
            raise

    def _drop(self, lease: Lease) -> None:
        """Release ``lease`` without waiting (for cancellation paths)."""
        task = self._renewers.pop(id(lease.lost), None)
        if task is not None:
            task.cancel()
        self._abandon(self._proto, lease.name, lease.owner, P.OP_RELEASE, lease.fencing_token, lease.owner)

    async def _release_quietly(self, lease: Lease) -> None:
        try:
            await self.release(lease)
        except FastlockError:
            pass
        except asyncio.CancelledError:
            self._drop(lease)
            raise

    async def release_many(self, multi: "MultiLease") -> None:
        """Release every lease of ``multi`` (all of them, even if one fails).

        Raises:
            LeaseLost: at least one lease was no longer held (after trying to
                release the others); ``multi.lost`` is set.
        """
        if not isinstance(multi, MultiLease):
            raise WrongArgumentType(f"expected a fastlock MultiLease, not {type(multi).__name__}")
        results = await asyncio.gather(*(self.release(lease) for lease in reversed(multi.leases)),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        for err in errors:
            if not isinstance(err, LeaseLost):
                raise err
        if errors:
            multi.lost.set()
            raise errors[0]

    # -- leader election --------------------------------------------------------------
    def election(self, name: str, candidate_id: str, *, lease_duration: float = 15.0, renew_deadline: float = 10.0,
                 retry_period: float = 2.0, jeopardy_fraction: float = 0.5) -> "Election":
        """A leader election on lock ``name`` for candidate ``candidate_id``.

        See :class:`fastlock.election.Election` (Kubernetes' leaderelection
        semantics and defaults: 15 s lease, 10 s renew deadline, 2 s retry).
        """
        from .election import Election

        return Election(self, name, candidate_id, lease_duration=lease_duration, renew_deadline=renew_deadline,
                        retry_period=retry_period, jeopardy_fraction=jeopardy_fraction)

    def _start_renewing(self, lease: Lease, jeopardy_fraction: float | None = None) -> None:
        if jeopardy_fraction is not None:
            lease.health.jeopardy_fraction = jeopardy_fraction
        task = asyncio.ensure_future(self._renew_loop(lease))
        self._renewers[id(lease.lost)] = task

    async def _renew_loop(self, lease: Lease) -> None:
        """Renew ``lease`` at about a third of its TTL (minus 10-20 % jitter)
        until cancelled.  A renewal rides through a failover until the lease's
        conservative expiry (:meth:`_renew`); when it cannot succeed by then, or
        the server refuses it, ``lease.lost`` is set.  Never ends silently: an
        unexpected error is logged and sets ``lease.lost`` too."""
        loop = asyncio.get_running_loop()
        key = id(lease.lost)
        current = lease
        health = lease.health
        health._renewed(lease.expires_at, lease.ttl)
        try:
            while True:
                interval = current.ttl / 3.0 * (1.0 - random.uniform(0.10, 0.20))
                # renew well before the jeopardy threshold, however high it is set
                interval = min(interval, current.ttl * (1.0 - health.jeopardy_fraction) * 0.6)
                # a lease that has little left (a late grant) is renewed sooner
                remaining = current.expires_at - loop.time()
                await asyncio.sleep(max(0.0, min(interval, remaining / 2.0)))
                if current.expires_at <= loop.time():
                    log.warning("lease %s token %d: TTL passed without a renewal; lost",
                                quote(current.name), current.fencing_token)
                    lease.lost.set()
                    return
                try:
                    current = await self._renew(current, current.expires_at)
                except LeaseLost as exc:
                    log.warning("lease %s token %d lost: %s", quote(current.name), current.fencing_token, exc)
                    lease.lost.set()
                    return
                object.__setattr__(lease, "expires_at", current.expires_at)
                health._renewed(current.expires_at, current.ttl)
        except asyncio.CancelledError:
            raise
        except ConnectionLost as exc:  # the client was closed
            log.info("renewal of %s stopped: %s", quote(current.name), exc)
            lease.lost.set()
        except Exception:  # noqa: BLE001 - a renewal task must never die unseen
            log.exception("renewal of %s token %d failed unexpectedly; the lease is treated as lost",
                          current.name, current.fencing_token)
            lease.lost.set()
        finally:
            health._disarm()
            if self._renewers.get(key) is asyncio.current_task():
                del self._renewers[key]


class LockContext:
    """Returned by :meth:`Client.lock`: awaitable and an async context manager
    (as asyncpg's ``pool.acquire()``)."""

    __slots__ = ("_client", "_name", "_kwargs", "_renew", "_lease", "_jeopardy_fraction")

    def __init__(self, client: Client, name: str, kwargs: dict, renew: bool, jeopardy_fraction: float = 0.5):
        self._client = client
        self._name = name
        self._kwargs = kwargs
        self._renew = renew
        self._lease: Lease | None = None
        self._jeopardy_fraction = jeopardy_fraction

    async def _acquire(self) -> Lease:
        lease = await self._client.acquire(self._name, **self._kwargs)
        if self._renew:
            self._client._start_renewing(lease, self._jeopardy_fraction)
        return lease

    def __await__(self):
        return self._acquire().__await__()

    async def __aenter__(self) -> Lease:
        self._lease = await self._acquire()
        return self._lease

    async def __aexit__(self, exc_type, exc, tb) -> None:
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            await self._client.release(lease)
        except FastlockError as err:
            # never into the caller's code: the lease is given up either way
            # (it expires by its TTL if no primary could be reached)
            if not lease.lost.is_set():
                log.warning("could not release %s token %d: %s", quote(lease.name), lease.fencing_token, err)
            lease.lost.set()


class _SortedNames(tuple):
    """Names already checked, deduplicated and put in the global lock order."""


def _sorted_names(names: Iterable[str]) -> _SortedNames:
    if isinstance(names, (str, bytes)):
        raise WrongArgumentType("names must be an iterable of lock names, not a single string")
    try:
        checked = [P.check_name(n) for n in names]
    except TypeError:
        raise WrongArgumentType(f"names must be an iterable of lock names, not {type(names).__name__}") from None
    if not checked:
        raise InvalidArgument("at least one lock name is needed")
    keyed = sorted((n.encode("utf-8"), n) for n in checked)
    for (a, name), (b, _) in zip(keyed, keyed[1:]):
        if a == b:
            raise InvalidArgument(f"lock name {name!r} is listed twice (locks are not re-entrant)")
    return _SortedNames(n for _, n in keyed)


class MultiLease:
    """The leases of :meth:`Client.acquire_many` / :meth:`Client.lock_many`.

    Attributes:
        leases (tuple[Lease, ...]): in acquisition order (UTF-8 byte order of
            the names).
        lost (asyncio.Event): set as soon as any one of the leases is lost.

    ``multi["orders/42"]`` is that name's :class:`Lease`;
    ``multi.fencing_tokens`` maps each name to its token.
    """

    __slots__ = ("leases", "lost", "_by_name", "__weakref__")

    def __init__(self, leases: tuple[Lease, ...], lost: asyncio.Event | None = None):
        self.leases = leases
        self.lost = lost if lost is not None else asyncio.Event()
        self._by_name = {lease.name: lease for lease in leases}
        for lease in leases:
            if lease.lost.is_set():
                self.lost.set()
            lease.health.add_listener(self._on_change)

    def _on_change(self, state: str) -> None:
        if state == LOST:
            self.lost.set()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(lease.name for lease in self.leases)

    @property
    def fencing_tokens(self) -> dict[str, int]:
        return {lease.name: lease.fencing_token for lease in self.leases}

    def lost_names(self) -> list[str]:
        """The names whose lease is lost."""
        return [lease.name for lease in self.leases if lease.lost.is_set()]

    def __getitem__(self, name: str) -> Lease:
        return self._by_name[name]

    def __iter__(self):
        return iter(self.leases)

    def __len__(self) -> int:
        return len(self.leases)

    def __repr__(self) -> str:
        return f"<MultiLease {self.fencing_tokens}{' lost' if self.lost.is_set() else ''}>"


class LockManyContext:
    """Returned by :meth:`Client.lock_many`: awaitable and an async context manager."""

    __slots__ = ("_client", "_names", "_kwargs", "_wait", "_fraction", "_multi")

    def __init__(self, client: Client, names: _SortedNames, kwargs: dict, wait: float | None, fraction: float):
        self._client = client
        self._names = names
        self._kwargs = kwargs
        self._wait = wait
        self._fraction = fraction
        self._multi: MultiLease | None = None

    def _acquire(self):
        return self._client._acquire_many(self._names, self._kwargs, self._wait, self._fraction)

    def __await__(self):
        return self._acquire().__await__()

    async def __aenter__(self) -> MultiLease:
        self._multi = await self._acquire()
        return self._multi

    async def __aexit__(self, exc_type, exc, tb) -> None:
        multi, self._multi = self._multi, None
        if multi is None:
            return
        try:
            await self._client.release_many(multi)
        except FastlockError as err:
            if not multi.lost.is_set():
                log.warning("could not release all of %s: %s", [quote(n) for n in multi.names], err)
            multi.lost.set()


def _check_lease(lease: Any) -> None:
    if not isinstance(lease, Lease):
        raise WrongArgumentType(f"expected a fastlock Lease, not {type(lease).__name__}")


def _ignore_result(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


class _ConnectContext:
    """Returned by :func:`connect`: ``await`` it for a :class:`Client`, or use
    it as ``async with`` to close the client on exit."""

    __slots__ = ("_client",)

    def __init__(self, client: Client):
        self._client = client

    async def _open(self) -> Client:
        await self._client._ensure_connected()
        return self._client

    def __await__(self):
        return self._open().__await__()

    async def __aenter__(self) -> Client:
        return await self._open()

    async def __aexit__(self, *exc) -> None:
        await self._client.close()


def connect(*addresses: Any, auth: str | None = None, client_name: str | None = None,
            connect_timeout: float = 5.0, request_timeout: float | None = 5.0,
            tls: bool | ssl.SSLContext | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
            tls_key: str | None = None, server_hostname: str | None = None) -> _ConnectContext:
    """Connect to a fastlock primary.

    Args:
        *addresses: ``"host:port"`` strings or ``(host, port)`` tuples, tried in
            order; a standby's ``NotPrimary`` redirect is followed.  Default
            port 7420.
        auth: the server's shared secret, if it has one.
        client_name: shown in server logs and recorded with grants in the WAL.
        connect_timeout: seconds for each TCP connect and handshake; also
            added to an acquire's ``wait`` to make its deadline.
        request_timeout: seconds (> 0) of silence from the server, while any
            request or watch is outstanding, after which the connection is
            dropped (a ``PING`` goes out after a third of it; an idle
            connection is left alone) and what was pending on it rides
            through to the primary; also the deadline of every call but
            acquire and renewals.  ``None`` disables the check (the deadline
            is then ``connect_timeout``).  See :class:`Client`.
        tls: ``True`` to connect over TLS, verifying the server's certificate
            (against ``tls_ca``, or the system's trust store) and its host
            name; an ``ssl.SSLContext`` to use as it is; ``False`` for plain
            TCP.  Default ``None``: TLS if any ``tls_*`` file is given.
        tls_ca: PEM file of the CA(s) that sign the servers' certificates.
        tls_cert: PEM file of this client's certificate, for servers that
            require one (mutual TLS); the key may be in the same file.
        tls_key: PEM file of that certificate's private key.
        server_hostname: the name the server certificates must carry (default:
            the host of each address, so an IP address must be in the
            certificate's subjectAltName).

    Example::

        async with fastlock.connect("10.0.0.5:7420", tls_ca="ca.pem",
                                    tls_cert="app.pem", tls_key="app-key.pem") as client:
            ...

    Raises (when awaited):
        ConnectionLost: no address accepted a connection as primary (an
            untrusted server certificate, or one refusing this client's, is
            named in the message).
        AuthError: the secret was refused.

    Raises at once: ``InvalidArgument`` for contradictory TLS arguments;
    ``OSError`` (``ssl.SSLError`` included) when a TLS file cannot be read
    or is not a matching PEM certificate/key.
    """
    if not addresses:
        addresses = ("127.0.0.1:7420",)
    return _ConnectContext(Client(addresses, auth=auth, client_name=client_name,
                                  connect_timeout=connect_timeout, request_timeout=request_timeout,
                                  tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                  server_hostname=server_hostname))

