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
from dataclasses import dataclass, field
from typing import Any, Iterable

from . import protocol as P
from .errors import (
    ConnectionLost,
    FastlockError,
    InvalidArgument,
    LeaseLost,
    NotPrimary,
    ProtocolError,
    WrongArgumentType,
    error_from_wire,
)

log = logging.getLogger(__name__)

DEFAULT_PORT = 7420

__all__ = ["connect", "Client", "Lease", "LockContext", "WatchEvent"]


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


@dataclass(frozen=True)
class WatchEvent:
    """A change of a lock's holder, pushed by the server (see :meth:`Client.watch`).

    ``kind`` is ``"granted"``, ``"released"``, ``"expired"``, or, for the
    first event of a watch, ``"held"``/``"free"`` (the state when it began).
    ``token`` is the fencing token concerned (None for ``"free"``);
    ``client`` the holder's client name, if it gave one.
    """

    name: str
    kind: str
    token: int | None
    client: str | None


def _parse_address(addr: Any) -> tuple[str, int]:
    if isinstance(addr, tuple) and len(addr) == 2:
        return str(addr[0]), int(addr[1])
    if not isinstance(addr, str) or not addr:
        raise WrongArgumentType(f"an address is 'host:port' or (host, port), not {addr!r}")
    host, sep, port = addr.rpartition(":")
    if not sep:
        return addr, DEFAULT_PORT
    try:
        return host.strip("[]") or "127.0.0.1", int(port)
    except ValueError:
        raise InvalidArgument(f"bad port in address {addr!r}") from None


class _ClientProtocol(asyncio.Protocol):
    __slots__ = ("decoder", "pending", "transport", "closed", "on_lost", "watches")

    def __init__(self, on_lost):
        self.decoder = P.FrameDecoder(64 << 20)
        self.pending: dict[int, asyncio.Future] = {}
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.on_lost = on_lost
        self.watches: dict[str, set[asyncio.Queue]] = {}

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as exc:
            log.error("bad data from server: %s", exc)
            self.transport.abort()
            return
        pending = self.pending
        for msg in messages:
            req_id = msg[0]
            if req_id == 0:
                if len(msg) >= 3 and msg[1] == P.PUSH_WATCH:
                    event = WatchEvent(*msg[2])
                    for queue in self.watches.get(event.name, ()):
                        queue.put_nowait(event)
                elif len(msg) >= 3 and isinstance(msg[1], int) and msg[1] != 0:
                    log.error("server closed the connection: %s", msg[2])
                continue
            fut = pending.pop(req_id, None)
            if fut is None or fut.done():
                continue
            if msg[1] == 0:
                fut.set_result(msg[2])
            else:
                fut.set_exception(error_from_wire(msg[1], msg[2], msg[3] if len(msg) > 3 else None))

    def connection_lost(self, exc):
        self.closed = True
        pending = list(self.pending.values())
        self.pending.clear()
        for fut in pending:
            if not fut.done():
                fut.set_exception(ConnectionLost("connection to the fastlock server lost"))
        for queues in self.watches.values():
            for queue in queues:
                queue.put_nowait(None)  # end of this watch
        self.watches.clear()
        self.on_lost(self)


class Client:
    """A connection to a fastlock primary.  Create it with :func:`connect`.

    Many tasks may share one client; their requests are pipelined on one
    connection.  If the connection drops, requests in flight raise
    :class:`ConnectionLost` and the next request reconnects (trying every
    address, following ``NotPrimary`` redirects).  Held leases survive a
    dropped connection until their TTL; :meth:`lock` keeps renewing across a
    reconnect.
    """

    def __init__(self, addresses: Iterable[Any], *, auth: str | None = None, client_name: str | None = None,
                 connect_timeout: float = 5.0):
        self._addresses = [_parse_address(a) for a in addresses]
        if not self._addresses:
            raise InvalidArgument("connect() needs at least one address")
        self._auth = P.check_optional_str(auth, "auth secret", 1024)
        self._client_name = P.check_optional_str(client_name, "client name", P.MAX_CLIENT_NAME_CHARS)
        self._connect_timeout = connect_timeout
        self._proto: _ClientProtocol | None = None
        self._connecting: asyncio.Future | None = None
        self._next_id = 1
        self._closed = False
        self._renewers: dict[int, asyncio.Task] = {}
        self._orphans: list[tuple[str, bytes]] = []  # acquires whose reply was lost with a connection
        self._rtt = 0.001  # smoothed round-trip estimate, seconds
        self.server_info: dict = {}

    # -- connection management ------------------------------------------------------
    async def _ensure_connected(self) -> _ClientProtocol:
        proto = self._proto
        if proto is not None and not proto.closed:
            return proto
        if self._closed:
            raise ConnectionLost("client is closed")
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        fut = self._connecting
        try:
            return await asyncio.shield(fut)
        finally:
            if fut.done() and self._connecting is fut:
                self._connecting = None

    async def _connect(self) -> _ClientProtocol:
        loop = asyncio.get_running_loop()
        errors = []
        candidates = list(self._addresses)
        tried: set[tuple[str, int]] = set()
        while candidates:
            addr = candidates.pop(0)
            if addr in tried:
                continue
            tried.add(addr)
            try:
                _, proto = await asyncio.wait_for(
                    loop.create_connection(lambda: _ClientProtocol(self._on_connection_lost), addr[0], addr[1]),
                    self._connect_timeout,
                )
            except (OSError, asyncio.TimeoutError) as exc:
                errors.append(f"{addr[0]}:{addr[1]}: {exc or type(exc).__name__}")
                continue
            try:
                info = await asyncio.wait_for(
                    self._call(proto, P.OP_HELLO, P.PROTOCOL_VERSION, self._client_name, self._auth),
                    self._connect_timeout,
                )
            except NotPrimary as exc:
                proto.transport.close()
                errors.append(f"{addr[0]}:{addr[1]}: not primary (primary: {exc.primary})")
                if exc.primary:
                    candidates.insert(0, _parse_address(exc.primary))
                continue
            except (ConnectionLost, asyncio.TimeoutError) as exc:
                proto.transport.close()
                errors.append(f"{addr[0]}:{addr[1]}: handshake failed: {exc or type(exc).__name__}")
                continue
            except FastlockError:
                proto.transport.close()
                raise
            if info.get("role") != "primary":
                proto.transport.close()
                primary = info.get("primary")
                errors.append(f"{addr[0]}:{addr[1]}: is a {info.get('role')} (primary: {primary})")
                if primary:
                    candidates.insert(0, _parse_address(primary))
                continue
            self.server_info = info
            self._proto = proto
            log.debug("connected to %s:%d (session %s)", addr[0], addr[1], info.get("session"))
            if self._orphans:
                orphans, self._orphans = self._orphans, []
                for name, owner in orphans:
                    self._send_nowait(proto, P.OP_CANCEL, name, owner)
            return proto
        raise ConnectionLost("could not connect to a fastlock primary: " + "; ".join(errors))

    def _on_connection_lost(self, proto: _ClientProtocol) -> None:
        if self._proto is proto:
            self._proto = None

    def _call(self, proto: _ClientProtocol, op: int, *args: Any) -> asyncio.Future:
        req_id = self._next_id
        self._next_id = req_id + 1
        fut = asyncio.get_running_loop().create_future()
        proto.pending[req_id] = fut
        proto.transport.write(P.packb([req_id, op, *args]))
        return fut

    def _send_nowait(self, proto: _ClientProtocol, op: int, *args: Any) -> None:
        fut = self._call(proto, op, *args)
        fut.add_done_callback(_ignore_result)

    async def _request(self, op: int, *args: Any) -> Any:
        proto = self._proto
        if proto is None or proto.closed:
            proto = await self._ensure_connected()
        return await self._call(proto, op, *args)

    async def close(self) -> None:
        """Stop auto-renewals and close the connection.  Held leases stay held
        on the server until their TTL (release them first if you want them
        freed now)."""
        self._closed = True
        for task in list(self._renewers.values()):
            task.cancel()
        self._renewers.clear()
        if self._connecting is not None:
            self._connecting.cancel()
        proto = self._proto
        self._proto = None
        if proto is not None and not proto.closed:
            proto.transport.close()

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
                ``None`` waits forever.
            lock_delay: seconds (0 .. 60) during which the lock stays
                unavailable after this lease *expires* (not after a clean
                release), as Chubby's lock-delay and Consul's session lock-delay.
            correlation_id: free text (<= 256 chars) recorded with the grant in
                the server's WAL, for audits (``fastlock wal dump``).

        Raises:
            LockNotAcquired: the wait ran out (or ``wait=0`` and it was held).
            ConnectionLost: the connection dropped while waiting.
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
        loop = asyncio.get_running_loop()
        proto = self._proto
        if proto is None or proto.closed:
            proto = await self._ensure_connected()
        sent = loop.time()
        fut = self._call(proto, P.OP_ACQUIRE, name, owner, ttl_ms, wait_ms, delay_ms, correlation_id)
        try:
            token, granted_ttl_ms = await fut
        except asyncio.CancelledError:
            self._abandon(proto, name, owner)
            raise
        except ConnectionLost:
            # The grant may have been sent just before the connection died:
            # cancel by owner on the next connection so it is released.
            self._orphans.append((name, owner))
            raise
        received = loop.time()
        granted_ttl = granted_ttl_ms / 1000.0
        # The server's TTL counts from its grant, which happened after we sent
        # and before we received; for a queued grant, back off one RTT.
        start = sent if received - sent <= 2 * self._rtt + 0.002 else received - self._rtt
        self._observe_rtt(received - sent, queued=wait_ms != 0)
        return Lease(name, token, granted_ttl, owner, asyncio.Event(), start + granted_ttl)

    def _abandon(self, proto: _ClientProtocol, name: str, owner: bytes) -> None:
        if not proto.closed:
            self._send_nowait(proto, P.OP_CANCEL, name, owner)
        else:
            self._orphans.append((name, owner))

    def _observe_rtt(self, sample: float, queued: bool) -> None:
        if not queued or sample < self._rtt * 4:
            self._rtt = 0.875 * self._rtt + 0.125 * sample

    async def release(self, lease: Lease) -> None:
        """Release ``lease``; the next waiter (if any) is granted at once.

        Raises:
            LeaseLost: the lease is no longer the holder (expired, or released
                already); nothing changed on the server.  ``lease.lost`` is set.
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
        is never revived.

        Raises:
            LeaseLost: the lease expired or was released; ``lease.lost`` is set.
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
        new_ttl = granted / 1000.0
        object.__setattr__(lease, "expires_at", sent + new_ttl)
        if new_ttl == lease.ttl:
            return lease
        return Lease(lease.name, lease.fencing_token, new_ttl, lease.owner, lease.lost, sent + new_ttl)

    async def check(self, name: str, fencing_token: int) -> bool:
        """Is ``fencing_token`` the current, unexpired holder's token of ``name``?

        The server-side half of Chubby's sequencer check: a downstream service
        may call it before acting on a request that carries a token.
        """
        P.check_name(name)
        P.check_token(fencing_token)
        return await self._request(P.OP_CHECK, name, fencing_token)

    async def status(self) -> dict:
        """The server's status: role, epoch, counters, sessions, WAL stats."""
        return await self._request(P.OP_STATUS)

    async def ping(self) -> float:
        """Round trip to the server, in seconds."""
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
        may have been missed: start a new watch, which begins with the state).
        Breaking out of the loop unsubscribes.

        Example::

            async for event in client.watch("leader"):
                print(event.kind, event.token, event.client)
        """
        P.check_name(name)
        proto = self._proto
        if proto is None or proto.closed:
            proto = await self._ensure_connected()
        queue: asyncio.Queue = asyncio.Queue()
        proto.watches.setdefault(name, set()).add(queue)
        try:
            info = await self._call(proto, P.OP_WATCH, name)
            if info is None:
                yield WatchEvent(name, "free", None, None)
            else:
                yield WatchEvent(name, "held", info["token"], info["client"])
            while True:
                event = await queue.get()
                if event is None:
                    raise ConnectionLost(f"connection lost while watching {name!r}")
                yield event
        finally:
            group = proto.watches.get(name)
            if group is not None:
                group.discard(queue)
                if not group:
                    del proto.watches[name]
                    if not proto.closed:
                        self._send_nowait(proto, P.OP_UNWATCH, name)

    def lock(self, name: str, *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
             correlation_id: str | None = None, renew: bool = True) -> "LockContext":
        """Acquire ``name`` and keep renewing it.

        ``async with client.lock(...) as lease:`` acquires, renews at about a
        third of the TTL (minus 10-20 % random jitter, so many holders do not
        renew in step) and releases on exit.  ``lease = await client.lock(...)``
        acquires and renews until :meth:`release`.  If a renewal is refused or
        the TTL passes without one succeeding, ``lease.lost`` is set and
        renewal stops; the body is not interrupted - check ``lease.lost``
        (or pass the fencing token to your writes) before acting.

        Arguments and errors are those of :meth:`acquire`.
        """
        P.check_name(name)
        return LockContext(self, name, dict(ttl=ttl, wait=wait, lock_delay=lock_delay,
                                            correlation_id=correlation_id), renew)

    def _start_renewing(self, lease: Lease) -> None:
        task = asyncio.ensure_future(self._renew_loop(lease))
        self._renewers[id(lease.lost)] = task

    async def _renew_loop(self, lease: Lease) -> None:
        loop = asyncio.get_running_loop()
        key = id(lease.lost)
        current = lease
        try:
            while True:
                interval = current.ttl / 3.0 * (1.0 - random.uniform(0.10, 0.20))
                await asyncio.sleep(max(0.0, min(interval, current.expires_at - loop.time())))
                while True:
                    remaining = current.expires_at - loop.time()
                    if remaining <= 0:
                        log.warning("lease %s token %d: TTL passed without a renewal; lost",
                                    current.name, current.fencing_token)
                        lease.lost.set()
                        return
                    try:
                        current = await asyncio.wait_for(self.extend(current), remaining)
                        break
                    except LeaseLost:
                        log.warning("lease %s token %d lost (server refused renewal)",
                                    current.name, current.fencing_token)
                        lease.lost.set()
                        return
                    except (ConnectionLost, NotPrimary, asyncio.TimeoutError, OSError) as exc:
                        log.info("renewal of %s failed (%s); retrying", current.name, exc or type(exc).__name__)
                        await asyncio.sleep(min(current.ttl / 10.0, max(0.0, current.expires_at - loop.time()) / 2))
                object.__setattr__(lease, "expires_at", current.expires_at)
        finally:
            if self._renewers.get(key) is asyncio.current_task():
                del self._renewers[key]


class LockContext:
    """Returned by :meth:`Client.lock`: awaitable and an async context manager
    (as asyncpg's ``pool.acquire()``)."""

    __slots__ = ("_client", "_name", "_kwargs", "_renew", "_lease")

    def __init__(self, client: Client, name: str, kwargs: dict, renew: bool):
        self._client = client
        self._name = name
        self._kwargs = kwargs
        self._renew = renew
        self._lease: Lease | None = None

    async def _acquire(self) -> Lease:
        lease = await self._client.acquire(self._name, **self._kwargs)
        if self._renew:
            self._client._start_renewing(lease)
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
        except (LeaseLost, ConnectionLost) as err:
            if not lease.lost.is_set():
                log.warning("could not release %s token %d: %s", lease.name, lease.fencing_token, err)
            lease.lost.set()


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
            connect_timeout: float = 5.0) -> _ConnectContext:
    """Connect to a fastlock primary.

    Args:
        *addresses: ``"host:port"`` strings or ``(host, port)`` tuples, tried in
            order; a standby's ``NotPrimary`` redirect is followed.  Default
            port 7420.
        auth: the server's shared secret, if it has one.
        client_name: shown in server logs and recorded with grants in the WAL.
        connect_timeout: seconds for each TCP connect and handshake.

    Raises (when awaited):
        ConnectionLost: no address accepted a connection as primary.
        AuthError: the secret was refused.
    """
    if not addresses:
        addresses = ("127.0.0.1:7420",)
    return _ConnectContext(Client(addresses, auth=auth, client_name=client_name,
                                  connect_timeout=connect_timeout))

