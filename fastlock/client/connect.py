"""The client's entry point: :func:`connect`, awaitable or an ``async with``
context (as asyncpg's ``connect``)."""

from __future__ import annotations

import os
import ssl
from collections.abc import Generator
from typing import Any

from .client import Client
from .session import DEFAULT_SESSION_TTL
from .sharded import ClientFactory, route_if_sharded
from .sweep import FAILOVER_TIMEOUT

__all__ = ["connect"]


class _ConnectContext:
    """Returned by :func:`connect`: ``await`` it for a :class:`Client`, or use
    it as ``async with`` to close the client on exit."""

    __slots__ = ("_client", "_make_client")

    def __init__(self, client: Client, make_client: ClientFactory):
        self._client = client
        self._make_client = make_client  # a sharded deployment's other groups (fastlock.client.sharded)

    async def _open(self) -> Client:
        self._client = await route_if_sharded(self._client, self._make_client)
        return self._client

    def __await__(self) -> Generator[Any, None, Client]:
        return self._open().__await__()

    async def __aenter__(self) -> Client:
        return await self._open()

    async def __aexit__(self, *exc: object) -> None:
        await self._client.close()


def connect(*addresses: Any, auth: str | None = None, client_name: str | None = None,
            connect_timeout: float = 5.0, request_timeout: float | None = 5.0, token: str | None = None,
            token_file: str | os.PathLike[str] | None = None,
            tls: bool | ssl.SSLContext | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
            tls_key: str | None = None, server_hostname: str | None = None,
            failover_timeout: float | None = FAILOVER_TIMEOUT, sequencers: bool = False, session: bool = True,
            session_ttl: float = DEFAULT_SESSION_TTL) -> _ConnectContext:
    """Connect to a fastlock primary.

    Args:
        *addresses: ``"host:port"`` strings or ``(host, port)`` tuples, tried in
            order; a standby's ``NotPrimary`` redirect is followed.  Default
            port 7420.  None given: ``$FASTLOCK_SERVER`` (comma-separated), else
            127.0.0.1:7420.  Every argument left out is taken from the environment
            as :mod:`fastlock.client.environment` says (``FASTLOCK_AUTH_SECRET``,
            ``FASTLOCK_TOKEN_FILE``, ``FASTLOCK_TLS_*``); an argument given wins.
        auth: legacy: the server's shared secret (``--auth-secret-file``).
        token: this client's principal token (see ``fastlock credentials init``).
        token_file: a file holding the token (default: the file named by the
            environment variable ``FASTLOCK_TOKEN_FILE``, when neither token
            nor auth is given).  Without any, the server takes the connection
            as its anonymous principal, if it allows one.
        client_name: shown in server logs and recorded with grants in the WAL,
            beside the authenticated principal (it is self-declared).
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
        failover_timeout: seconds (default 15; ``None``: no limit; 0: one
            sweep) that connecting keeps looking for the primary while a
            failover is under way: while no address is a primary but some
            answers as a fastlock node that is not one now (a standby, a node
            promoting, a fenced primary), the addresses are swept again with
            backoff (20 ms doubling to 0.5 s, with jitter; at most 0.1 s for
            the first 50 pauses, then doubling from it:
            :class:`~fastlock.client.sweep.SweepPacing`).  A sweep in which
            no address answers so (every one refused, unreachable, timed out,
            or a TLS or protocol failure) fails at once.  Also the bound of
            every later reconnect made by :meth:`Client.ensure_connected`.
        sequencers: ask for a signed sequencer with every grant
            (``lease.sequencer``, :mod:`fastlock.sequencer`); the server must hold a
            sequencer key (its HELLO says ``"sequencers": True``), else every acquire
            raises ``InvalidArgument`` before anything is sent.
        session: renew every auto-renewed lease by one session keep-alive
            (default True; docs/sessions.md); False: each lease by its own EXTENDs.
        session_ttl: seconds (default 10) the server keeps the session with
            no lease attached.

    Example::

        async with fastlock.connect("10.0.0.5:7420", tls_ca="ca.pem",
                                    tls_cert="app.pem", tls_key="app-key.pem") as client:
            ...

    Raises (when awaited):
        NoPrimaryFound: (a :class:`ConnectionLost`) no address accepted a
            connection as primary; its ``answers`` and its message say what
            each address answered (an untrusted server certificate, or one
            refusing this client's, is named there).
        AuthError: the token or secret was refused (or needed and missing).

    Raises at once: ``InvalidArgument`` for contradictory TLS arguments;
    ``OSError`` (``ssl.SSLError`` included) when a TLS file cannot be read
    or is not a matching PEM certificate/key; ``CredentialsError`` when
    ``token_file`` cannot be read or is empty.

    Operations the principal is not granted raise :class:`PermissionDenied`.

    Against a node of a sharded deployment (docs/sharding.md) the client returned is a
    :class:`~fastlock.client.sharded.ShardedClient`: it reads the shard map and sends each
    call to the primary of the group that owns its name, with the options given here.
    """
    def make_client(group_addresses: Any) -> Client:
        return Client(group_addresses, auth=auth, client_name=client_name,
                      connect_timeout=connect_timeout, request_timeout=request_timeout,
                      token=token, token_file=token_file,
                      tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                      server_hostname=server_hostname, failover_timeout=failover_timeout,
                      sequencers=sequencers, session=session, session_ttl=session_ttl)

    return _ConnectContext(make_client(addresses), make_client)


