"""TLS for fastlock, on the standard library's :mod:`ssl`.

Three pieces:

* :func:`server_context` and :func:`client_context` build ``ssl.SSLContext``
  objects from PEM files: TLS 1.2 or later, the cipher choice and certificate
  checks of :func:`ssl.create_default_context`.  A client verifies the server's
  certificate and host name by default.
* :class:`ServerTLS` is a server's TLS state: the current context (rebuilt
  from the same files by :meth:`ServerTLS.reload`, e.g. on SIGHUP, so new
  handshakes use a renewed certificate without a restart), and the listener
  that accepts TCP connections and runs each TLS handshake under a deadline
  before the fastlock connection object sees a single byte.  Handshakes in
  progress are bounded in all and per source address; at a bound the oldest
  pending handshake (of that address at its bound, else of the address with
  the most in progress) is dropped to make room, and under pressure stalled ones are dropped early, so a flood of
  silent connections cannot keep a real client out.  A handshake that fails,
  stalls or is dropped costs one log line at most every
  :data:`FAILURE_LOG_INTERVAL` seconds (the rest are counted), never a flood.
* :func:`peer_identity`: the subject common name (CN) of a *verified* client
  certificate - the identity mutual TLS establishes, as etcd's
  ``--client-cert-auth`` uses the CN as the user name.  The server stores it
  as ``peer_cert_identity`` on the connection, for authorisation to map to a
  principal.

Client authentication modes (``client_auth``): ``"none"`` (no client
certificate asked for), ``"optional"`` (asked for, verified against the CA if
sent; a client without one still connects, with no identity), ``"required"``
(mutual TLS: the handshake fails without a certificate the CA signed).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .errors import AuthError, InvalidArgument, WrongArgumentType

log = logging.getLogger(__name__)

__all__ = ["CLIENT_AUTH_MODES", "DEFAULT_HANDSHAKE_TIMEOUT", "ServerTLS", "server_context", "client_context",
           "client_ssl_context", "peer_identity"]

#: values of ``client_auth``, in increasing strictness
CLIENT_AUTH_MODES = ("none", "optional", "required")

#: seconds a TLS handshake may take on the server before the connection is dropped
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
#: handshakes in progress at once, in all and from one source address; a connection
#: accepted at either bound makes room by dropping the oldest pending handshake (of its
#: address at the per-address bound, else of all), as ConnectionLimits evicts the oldest
#: connection without HELLO
DEFAULT_MAX_HANDSHAKES = 1024
DEFAULT_MAX_HANDSHAKES_PER_ADDRESS = 64
#: seconds a handshake may take while more than half of ``max_handshakes`` are in
#: progress (never more than the configured timeout): a handshake begun under that
#: pressure gets this deadline, and older ones past it are dropped at the next accept
PRESSURE_HANDSHAKE_TIMEOUT = 1.0

#: at most one failed-handshake log line per this many seconds (the rest are counted)
FAILURE_LOG_INTERVAL = 10.0

_VERIFY_MODES = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def _default_context(purpose: ssl.Purpose, ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """``ssl.create_default_context(purpose, cafile=ca)`` (only ``ca`` trusted when
    given), TLS 1.2+, with the certificate chain loaded; every error names its file.

    Raises:
        OSError: a file cannot be read (``filename`` set: ssl's own errors for
            a missing file do not say which); ``ssl.SSLError``: not PEM, or the
            key does not match the certificate (the message names the files).
    """
    for path in (ca, cert, key):
        if path:
            with open(path, "rb"):
                pass
    try:
        ctx = ssl.create_default_context(purpose, cafile=ca)
    except ssl.SSLError as exc:
        raise ssl.SSLError(exc.errno, f"CA file {ca}: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert:
        try:
            ctx.load_cert_chain(cert, key)
        except ssl.SSLError as exc:
            raise ssl.SSLError(exc.errno, f"certificate {cert}, key {key or cert}: {exc}") from None
    return ctx


def server_context(cert: str, key: str | None = None, ca: str | None = None,
                   client_auth: str = "none") -> ssl.SSLContext:
    """A server-side context: TLS 1.2+, ``ssl.create_default_context`` ciphers.

    Args:
        cert: PEM file with the server certificate (and its chain).
        key: PEM file with its private key (None: the key is in ``cert``).
        ca: PEM file of the CA(s) that sign client certificates; needed when
            ``client_auth`` is not ``"none"``.
        client_auth: ``"none"``, ``"optional"`` or ``"required"`` (see the module docstring).

    Raises:
        InvalidArgument: an unknown ``client_auth``, or client auth without ``ca``.
        OSError: a file cannot be read; ``ssl.SSLError`` (an OSError): a file is
            not a PEM certificate or key, or the key does not match the certificate.
    """
    if client_auth not in _VERIFY_MODES:
        raise InvalidArgument(f"client_auth must be one of {', '.join(CLIENT_AUTH_MODES)}, not {client_auth!r}")
    if client_auth != "none" and not ca:
        raise InvalidArgument(f"client_auth={client_auth!r} needs a CA file to verify client certificates")
    ctx = _default_context(ssl.Purpose.CLIENT_AUTH, ca, cert, key)
    ctx.verify_mode = _VERIFY_MODES[client_auth]
    return ctx


def client_context(ca: str | None = None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """A client-side context: TLS 1.2+, the server's certificate and host name verified.

    Args:
        ca: PEM file of the CA(s) to trust for the server's certificate
            (None: the system's default trust store).
        cert: PEM file with this client's certificate, for mutual TLS.
        key: PEM file with its private key (None: the key is in ``cert``).

    Raises:
        InvalidArgument: ``key`` without ``cert``.
        OSError: a file cannot be read; ``ssl.SSLError``: a file is not PEM,
            or the key does not match the certificate.
    """
    if key and not cert:
        raise InvalidArgument("a TLS key needs its certificate (tls_cert)")
    return _default_context(ssl.Purpose.SERVER_AUTH, ca, cert, key)


def client_ssl_context(tls: bool | ssl.SSLContext | None, ca: str | None = None, cert: str | None = None,
                       key: str | None = None) -> ssl.SSLContext | None:
    """The context for :func:`fastlock.connect`'s ``tls``/``tls_ca``/``tls_cert``/``tls_key`` arguments.

    ``tls=None`` (default) means TLS if any file is given, plain TCP otherwise;
    ``True`` means TLS (trusting ``ca``, or the system's store); ``False``
    plain TCP; an ``ssl.SSLContext`` is used as it is.  Returns None for
    plain TCP.

    Raises:
        WrongArgumentType: ``tls`` is not a bool, None or an SSLContext.
        InvalidArgument: files together with ``tls=False`` or with an SSLContext.
        OSError / ssl.SSLError: as :func:`client_context`.
    """
    files = ca is not None or cert is not None or key is not None
    if isinstance(tls, ssl.SSLContext):
        if files:
            raise InvalidArgument("pass either an SSLContext as tls, or tls_ca/tls_cert/tls_key, not both")
        return tls
    if tls is not None and type(tls) is not bool:
        raise WrongArgumentType(f"tls must be True, False, None or an ssl.SSLContext, not {type(tls).__name__}")
    if tls is False:
        if files:
            raise InvalidArgument("tls=False together with tls_ca/tls_cert/tls_key")
        return None
    if tls is None and not files:
        return None
    return client_context(ca, cert, key)


def peer_identity(ssl_object: Any) -> str | None:
    """The subject common name (CN) of the peer's certificate, if it was verified.

    Python's ``getpeercert()`` returns an empty dict when no certificate was
    verified (none sent, or ``verify_mode`` is ``CERT_NONE``), so an
    unverified certificate never yields an identity.  Returns None then, or
    when the certificate has no CN.

    Raises:
        AuthError: the subject has more than one CN (``CN=billing, CN=admin``):
            which one names the peer is a guess, so none does.
    """
    if ssl_object is None:
        return None
    cert = ssl_object.getpeercert()
    if not cert:
        return None
    names = [value for rdn in cert.get("subject", ()) for attr, value in rdn if attr == "commonName"]
    if len(names) > 1:
        raise AuthError(f"the client certificate's subject has {len(names)} common names (CN): refused, "
                        f"a certificate identity is exactly one CN")
    return names[0] if names else None


class PendingHandshake(NamedTuple):
    """A TLS handshake in progress: its peer's source IP address, and when its
    connection was accepted (``time.monotonic()`` seconds)."""

    source: str
    accepted: float


class ServerTLS:
    """A server's TLS: the current context, its reload, and the bounded handshake.

    Args:
        cert, key, ca, client_auth: as :func:`server_context`.
        handshake_timeout: seconds (> 0) a handshake may take before the
            connection is dropped.
        max_handshakes: handshakes in progress at once (default 1,024), so a
            flood of connections that never handshake holds at most this many
            sockets.  A connection accepted at the bound drops the oldest
            pending handshake of the address with the most in progress to make
            room (counted in ``handshakes_evicted``).
        max_handshakes_per_address: the same bound per source IP address
            (default 64), so one address cannot take every slot; at it, the
            oldest pending handshake *of that address* is dropped.

    Under pressure (more than half of ``max_handshakes`` in progress) a new
    handshake gets :data:`PRESSURE_HANDSHAKE_TIMEOUT` seconds (or
    ``handshake_timeout`` if shorter), and every pending one older than that is
    dropped at the next accept: a flood of silent connections is recycled
    within about a second while a real client's handshake, which takes
    milliseconds, completes.

    :meth:`listen` accepts TCP connections on its own sockets and hands each
    one to ``loop.connect_accepted_socket`` with the context current at that
    moment, so a failed or stalled handshake surfaces here as an exception
    (logged, counted) instead of vanishing inside the event loop.  The
    fastlock connection object sees only connections whose handshake
    succeeded; it can read its peer's identity with :func:`peer_identity`.

    Raises (at construction): as :func:`server_context`.
    """

    def __init__(self, cert: str, key: str | None = None, ca: str | None = None, client_auth: str = "none",
                 handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT, *,
                 max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
                 max_handshakes_per_address: int = DEFAULT_MAX_HANDSHAKES_PER_ADDRESS):
        if not handshake_timeout > 0:
            raise InvalidArgument(f"handshake_timeout must be > 0 seconds, got {handshake_timeout!r}")
        if max_handshakes < 1 or max_handshakes_per_address < 1:
            raise InvalidArgument("the handshake bounds must be at least 1")
        self.max_handshakes = max_handshakes
        self.max_handshakes_per_address = max_handshakes_per_address
        #: per source address, its handshakes in progress, oldest first (values unused)
        self._pending_by_address: dict[str, dict[asyncio.Task, None]] = {}
        self.evicted = 0  # pending handshakes dropped to make room, or stalled under pressure
        self.cert, self.key, self.ca, self.client_auth = cert, key, ca, client_auth
        self.handshake_timeout = handshake_timeout
        self.pressure_timeout = min(handshake_timeout, PRESSURE_HANDSHAKE_TIMEOUT)
        self.context = server_context(cert, key, ca, client_auth)
        self.handshakes = 0  # completed
        self.failures = 0  # failed or timed out
        self.reloads = 0
        self._sockets: list[socket.socket] = []
        self._accepting: list[asyncio.Task] = []
        self._pending: dict[asyncio.Task, PendingHandshake] = {}  # handshakes in progress, oldest first
        self._unstarted: dict[asyncio.Task, socket.socket] = {}  # accepted, the handshake not begun yet
        self._unlogged = 0  # failures since the last failure log line
        self._logged_at = float("-inf")  # time.monotonic() of that line

    def reload(self) -> bool:
        """Rebuild the context from the same files; new handshakes use it,
        established connections keep theirs.  On an error the old context stays
        (logged).  Returns True if the new files were loaded."""
        try:
            ctx = server_context(self.cert, self.key, self.ca, self.client_auth)
        except (OSError, InvalidArgument) as exc:
            log.error("TLS reload failed, keeping the current certificate: %s", exc)
            return False
        self.context = ctx
        self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.cert)
        return True

    async def listen(self, host: str, port: int, make_connection: Callable[[], asyncio.Protocol], *,
                     backlog: int = 1024) -> tuple[str, int]:
        """Listen on ``host:port`` (every address it resolves to, as
        ``loop.create_server``) and serve TLS connections made by
        ``make_connection()``.  Returns the first socket's address.

        Raises OSError if an address cannot be bound.
        """
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, type_, proto, _, addr in dict.fromkeys(infos):
                sock = socket.socket(family, type_, proto)
                self._sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
                sock.listen(backlog)
                sock.setblocking(False)
        except OSError:
            self.close()
            raise
        for sock in self._sockets:
            self._accepting.append(asyncio.ensure_future(self._accept(sock, make_connection)))
        name = self._sockets[0].getsockname()
        return name[0], name[1]

    def status(self) -> dict:
        return {"client_auth": self.client_auth, "handshakes": self.handshakes, "handshake_failures": self.failures,
                "handshakes_in_progress": len(self._pending), "handshakes_evicted": self.evicted,
                "reloads": self.reloads}

    def close(self) -> None:
        """Stop accepting and abandon every handshake in progress (their
        connections are closed); established connections are not touched."""
        for task in self._accepting:
            task.cancel()
        self._accepting.clear()
        for sock in self._sockets:
            sock.close()
        self._sockets.clear()
        for task in list(self._pending):
            task.cancel()
        for sock in self._unstarted.values():
            sock.close()
        self._unstarted.clear()

    async def _accept(self, listening: socket.socket, make_connection: Callable[[], asyncio.Protocol]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(listening)
            except OSError as exc:  # e.g. out of file descriptors: back off, as asyncio's server does
                log.error("accepting a connection failed: %s; pausing accepts for 1 s", exc)
                await asyncio.sleep(1.0)
                continue
            source = addr[0] if isinstance(addr, tuple) and addr else "?"
            timeout = self._make_room(source)
            task = asyncio.ensure_future(self._handshake(sock, addr, source, make_connection, timeout))
            self._pending[task] = PendingHandshake(source, time.monotonic())
            self._pending_by_address.setdefault(source, {})[task] = None
            self._unstarted[task] = sock
            # (also from the handshake itself: a done callback runs a loop turn later, when the
            # peer's first request may already have been read and counted it as in progress)
            task.add_done_callback(functools.partial(self._handshake_ended, source=source))

    def _make_room(self, source: str) -> float:
        """Before a handshake from ``source`` starts: drop what the bounds require
        (see the class docstring); returns the new handshake's timeout (seconds)."""
        pending = self._pending
        if len(pending) * 2 <= self.max_handshakes:
            timeout = self.handshake_timeout
        else:  # under pressure: drop the stalled ones, oldest first, and give the new one less time
            timeout = self.pressure_timeout
            cutoff = time.monotonic() - timeout
            stalled = []
            for task, handshake in pending.items():
                if handshake.accepted > cutoff:
                    break
                stalled.append(task)
            for task in stalled:
                self._evict(task, f"stalled over {timeout:g} s while more than half of the "
                                  f"{self.max_handshakes} handshake slots were taken")
        from_source = self._pending_by_address.get(source)
        if from_source is not None and len(from_source) >= self.max_handshakes_per_address:
            self._evict(next(iter(from_source)), f"the oldest of {len(from_source)} from its address "
                                                  f"(at most {self.max_handshakes_per_address})")
        elif len(pending) >= self.max_handshakes:
            # the address holding the most slots gives up its oldest (an address with one
            # handshake in progress loses it only when every address has one: then the oldest)
            busiest = max(self._pending_by_address.values(), key=len)
            victim = next(iter(busiest if len(busiest) > 1 else pending))
            self._evict(victim, f"the oldest of the address with the most of {len(pending)} "
                                f"(at most {self.max_handshakes})")
        return timeout

    def _evict(self, task: asyncio.Task, why: str) -> None:
        """Drop the pending handshake ``task`` (its connection is closed) and count it out at once."""
        source, accepted = self._pending[task]
        self._handshake_ended(task, source)
        task.cancel()
        sock = self._unstarted.pop(task, None)
        if sock is not None:  # cancelled before it ran, it would never close its socket
            sock.close()
        self.evicted += 1
        self._failed(source, ConnectionAbortedError(
            f"pending TLS handshake dropped after {time.monotonic() - accepted:.3f} s to admit another: {why}"),
            counted=False)

    def _handshake_ended(self, task: asyncio.Task | None, source: str) -> None:
        if task is None or self._pending.pop(task, None) is None:  # counted out already
            return
        self._unstarted.pop(task, None)
        from_source = self._pending_by_address.get(source)
        if from_source is not None:
            from_source.pop(task, None)
            if not from_source:
                del self._pending_by_address[source]

    async def _handshake(self, sock: socket.socket, addr: Any, source: str,
                         make_connection: Callable[[], asyncio.Protocol], timeout: float) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._unstarted.pop(task, None)  # from here on the transport closes the socket
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else "?"
        # (on any failure, or when the handshake is dropped (cancelled), the loop closes the
        # transport, and the socket with it)
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                make_connection, sock, ssl=self.context, ssl_handshake_timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - whatever the peer did, count it and go on
            self._failed(peer, exc)
            return
        finally:
            self._handshake_ended(asyncio.current_task(), source)
        self.handshakes += 1

    def _failed(self, peer: str, exc: BaseException, counted: bool = True) -> None:
        """Log a failed or dropped handshake (at most one line per FAILURE_LOG_INTERVAL);
        ``counted``: add it to ``failures`` (a dropped one is counted in ``evicted``)."""
        if counted:
            self.failures += 1
        log.debug("TLS handshake with %s failed: %s", peer, _describe(exc))
        now = time.monotonic()
        if now - self._logged_at < FAILURE_LOG_INTERVAL:
            self._unlogged += 1
            return
        more = f" (and {self._unlogged} more failed handshakes since the last report)" if self._unlogged else ""
        log.warning("TLS handshake with %s failed: %s%s", peer, _describe(exc), more)
        self._logged_at = now
        self._unlogged = 0


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return f"{exc.reason} ({exc.library or 'ssl'})"
    return str(exc) or type(exc).__name__
