"""A small async client of etcd's v3 JSON gateway, and the coordinator URL.

:class:`EtcdGateway` posts to ``/v3/kv/range``, ``/v3/kv/put``, ``/v3/kv/txn``,
``/v3/lease/grant``, ``/v3/lease/keepalive`` and ``/v3/lease/revoke`` (keys and
values travel base64, 64-bit integers as decimal strings) over httpx, the
optional extra ``fastlock[etcd]``; every answer is read up to
:data:`MAX_RESPONSE_BYTES`.  :func:`parse_coordinator` reads
``etcd://HOST:PORT[,HOST:PORT]/PREFIX``.

With an :class:`~fastlock.coordination.access.EtcdAccess` it speaks HTTPS
(etcd's certificate verified, a client certificate presented) and logs in as an
etcd user: ``/v3/auth/authenticate`` returns a token that every later request
carries in its ``Authorization`` header, as etcd's gateway expects; when etcd
answers that the token is invalid (it expired, or the user's password was
reset), the gateway logs in again once and repeats the request.  What etcd
refuses for good (a wrong password, a missing permission, a certificate it does
not trust or that we do not trust) raises :class:`EtcdRefused`, naming the
setting to check.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from ..units import parse_address
from .access import EtcdAccess, EtcdLogin

#: the largest answer read from etcd (bytes): a member list at its limits fits several times
MAX_RESPONSE_BYTES = 16 << 20
#: the longest message of a watch stream (bytes); a watch of one key carries small ones
MAX_WATCH_MESSAGE_BYTES = 1 << 20


#: the most watch streams one gateway holds open at once (an arbiter watches two keys)
WATCHES = 2


class EtcdUnavailable(ConnectionError):
    """No etcd endpoint answered the request (or answered with an error)."""


class EtcdRefused(EtcdUnavailable):
    """etcd refused this node for a reason that waiting does not cure: authentication
    failed, the user lacks a permission, or TLS failed (a certificate not trusted, or
    the wrong protocol).  The message names the setting to check.  At start the node
    refuses to start; later it is logged and retried as any etcd error."""


class _TokenRejected(EtcdUnavailable):
    """etcd answered that the token sent is invalid (expired or revoked)."""


#: etcd's gRPC status codes, as the gateway's JSON errors carry them
_INVALID_ARGUMENT, _PERMISSION_DENIED, _UNAUTHENTICATED = 3, 7, 16


@dataclass(frozen=True)
class CoordinatorUrl:
    """``etcd://HOST:PORT[,HOST:PORT...]/PREFIX``, parsed."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str

    def __str__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"etcd://{hosts}{self.prefix}"


def parse_coordinator(value: Any) -> CoordinatorUrl:
    """Parse ``etcd://HOST:PORT[,HOST:PORT...]/PREFIX`` (port default 2379).

    Raises:
        InvalidArgument: not a string of that form, or an empty prefix.
    """
    if type(value) is not str or not value.startswith("etcd://"):
        raise InvalidArgument(f"coordinator must be etcd://HOST:PORT[,HOST:PORT]/PREFIX, not {value!r}")
    rest = value[len("etcd://"):]
    hosts, slash, prefix = rest.partition("/")
    prefix = "/" + prefix.strip("/")
    if not slash or prefix == "/" or not hosts:
        raise InvalidArgument(f"coordinator {value!r} needs at least one HOST:PORT and a key prefix "
                              f"(etcd://127.0.0.1:2379/fastlock)")
    if any(c.isspace() for c in prefix) or len(prefix) > 256:
        raise InvalidArgument(f"coordinator prefix {prefix!r} must be at most 256 characters without spaces")
    endpoints = tuple(parse_address(h, default_port=2379) for h in hosts.split(","))
    return CoordinatorUrl(endpoints, prefix)


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with ``prefix``."""
    end = bytearray(prefix)
    end[-1] += 1  # prefixes here end in "/", never 0xff
    return bytes(end)


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd returned it."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int

    @classmethod
    def decode(cls, kv: dict) -> KeyValue:
        return cls(base64.b64decode(kv.get("key", "")), base64.b64decode(kv.get("value", "")),
                   int(kv.get("create_revision", 0)), int(kv.get("mod_revision", 0)), int(kv.get("lease", 0)))


class EtcdGateway:
    """A small async client of etcd's v3 JSON gateway (keys and values travel base64).

    Args:
        endpoints: ``(host, port)`` of each etcd member; a request goes to the
            one that answered last, then to the others in turn.
        timeout_s: seconds one HTTP request may take.
        access: protocol, TLS files and etcd user (default: plain HTTP, no user).

    Attributes:
        authentications: how many times this gateway logged in to etcd.

    Raises:
        ImportError: httpx is not installed (``pip install 'fastlock[etcd]'``).
        InvalidArgument: a TLS file or the password file is unusable (the message names
            the setting), or a user over plain HTTP to an address off loopback (the
            password would cross the network in clear).
    """

    def __init__(self, endpoints: tuple[tuple[str, int], ...] | list[tuple[str, int]], timeout_s: float = 1.0,
                 access: EtcdAccess | None = None):
        try:
            import httpx
        except ImportError:
            raise ImportError("the etcd coordinator needs httpx: pip install 'fastlock[etcd]'") from None
        access = access or EtcdAccess()
        context = access.ssl_context()
        self._login: EtcdLogin | None = access.login()
        if self._login is not None and context is None and any(
                host not in ("127.0.0.1", "::1", "localhost") for host, _ in endpoints):
            raise InvalidArgument("--coordinator-user over --coordinator-protocol http would send the etcd "
                                  "password in clear off loopback: use --coordinator-protocol https")
        self._httpx = httpx
        self.endpoints = list(endpoints)
        self.scheme = access.protocol
        self.authentications = 0
        self._token: str | None = None
        self._auth_lock = asyncio.Lock()
        self._current = 0
        self._context = context
        self._timeout_s = timeout_s
        self._client = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=4),
                                         verify=context if context is not None else True)
        #: the watches' own connections, one per watched key (the primary key and the heartbeat: a
        #: stream holds its connection for good, never one of the requests' four)
        self._watch_client = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=WATCHES),
                                               verify=context if context is not None else True)

    async def probe(self) -> None:
        """Check the way to etcd before the first request, on one plain socket per endpoint
        (stdlib :mod:`ssl`, so that a TLS alert keeps its reason): a ``/v3/maintenance/status``
        request, which needs no user.  Returns once one endpoint answers it.

        Raises:
            EtcdRefused: TLS failed on an endpoint that was reached (etcd's certificate not
                trusted, this node's certificate refused, TLS against plain HTTP or the reverse),
                or a client certificate etcd's gateway refuses.
            EtcdUnavailable: no endpoint was reached.
        """
        errors: list[str] = []
        refusals: list[str] = []
        request = (b"POST /v3/maintenance/status HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        for host, port in self.endpoints:
            where = f"{host}:{port}"
            writer = None
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    host, port, ssl=self._context, server_hostname=host if self._context else None), self._timeout_s)
                writer.write(request)
                answer = await asyncio.wait_for(_read_until_closed(reader, 65536), self._timeout_s)
            except (OSError, asyncio.TimeoutError) as exc:
                refusal = _tls_refusal(exc)
                (refusals if refusal else errors).append(f"{where}: {refusal or _describe(exc)}")
                continue
            finally:
                if writer is not None:
                    writer.close()
            head, _, body = answer.partition(b"\r\n\r\n")
            if not answer and self._context is None:
                refusals.append(f"{where}: closed the connection without an answer (does etcd serve https? "
                                f"check --coordinator-protocol)")
            elif b"CommonName" in body:
                self._decode(where, "maintenance/status", 400, body, None)  # raises EtcdRefused
            elif head.startswith(b"HTTP/1.1 200"):
                return
            else:
                errors.append(f"{where}: answered {head[:60]!r}")
        if refusals:
            raise EtcdRefused("etcd refused this node: " + "; ".join(refusals + errors))
        raise EtcdUnavailable("no etcd endpoint answered: " + "; ".join(errors))

    async def call(self, path: str, body: dict) -> dict:
        """POST ``body`` to ``/v3/<path>`` (logged in first when a user is set); the decoded answer.

        Raises:
            EtcdRefused: etcd refused the login, the permission, or the TLS connection.
            EtcdUnavailable: no endpoint answered, or etcd answered with an error.
        """
        if self._login is None:
            return await self._request(path, body, None)
        token = self._token or await self._authenticate(None)
        try:
            return await self._request(path, body, token)
        except _TokenRejected:
            token = await self._authenticate(token)
        try:
            return await self._request(path, body, token)
        except _TokenRejected as exc:
            raise EtcdRefused(f"{exc} right after logging in as {self._login.user!r}") from None

    async def _authenticate(self, rejected: str | None) -> str:
        """Log in (once for all callers waiting at the same time); the new token.
        ``rejected``: the token etcd refused (another caller may have replaced it already)."""
        login = self._login
        assert login is not None
        async with self._auth_lock:
            if self._token is not None and self._token != rejected:
                return self._token
            self._token = None
            data = await self._request("auth/authenticate", {"name": login.user, "password": login.password}, None)
            token = data.get("token")
            if type(token) is not str or not token or len(token) > 4096 or not token.isprintable():
                raise EtcdUnavailable("etcd answered auth/authenticate without a usable token")
            self._token = token
            self.authentications += 1
            return token

    async def _request(self, path: str, body: dict, token: str | None) -> dict:
        errors: list[str] = []
        refusals: list[str] = []
        n = len(self.endpoints)
        headers = {"Authorization": token} if token else None
        for i in range(n):
            index = (self._current + i) % n
            host, port = self.endpoints[index]
            url = f"{self.scheme}://{host}:{port}/v3/{path}"
            try:
                status, raw = await self._post(url, body, headers)
            except (self._httpx.HTTPError, OSError) as exc:  # OSError: an ssl.SSLError httpx lets through
                refusal = _tls_refusal(exc)
                (refusals if refusal else errors).append(f"{host}:{port}: {refusal or _describe(exc)}")
                continue
            except ValueError as exc:
                errors.append(f"{host}:{port}: {exc}")
                continue
            self._current = index
            return self._decode(f"{host}:{port}", path, status, raw, token)
        if refusals:
            raise EtcdRefused("etcd refused the TLS connection: " + "; ".join(refusals + errors))
        raise EtcdUnavailable("no etcd endpoint answered: " + "; ".join(errors))

    def _decode(self, where: str, path: str, status: int, raw: bytes, token: str | None) -> dict:
        """The answer of ``where`` as a dict; the refusals etcd states raise (see :meth:`call`)."""
        try:
            data = json.loads(raw)
        except ValueError:
            text = raw[:200].decode("utf-8", "replace").strip()
            if "HTTPS server" in text:
                raise EtcdRefused(f"etcd {where} serves HTTPS: set --coordinator-protocol https") from None
            if "CommonName" in text:
                raise EtcdRefused(f"etcd {where} refuses gateway requests whose client certificate has a Common "
                                  f"Name: give --coordinator-cert a certificate with only a subjectAltName "
                                  f"({text[:120]!r})") from None
            raise EtcdUnavailable(f"etcd {where} answered {path} with HTTP {status} and no JSON: "
                                  f"{text[:100]!r}") from None
        if type(data) is not dict:
            raise EtcdUnavailable(f"etcd {where} answered {path} with a {type(data).__name__}")
        if "error" not in data or status == 200:
            return data
        message, code = str(data.get("message") or data.get("error"))[:200], data.get("code")
        user = self._login.user if self._login is not None else None
        if code == _UNAUTHENTICATED and token is not None:
            raise _TokenRejected(f"etcd {where}: {path}: {message}")
        if code == _PERMISSION_DENIED:
            raise EtcdRefused(f"etcd {where} denied {path} to user {user!r}: {message} (the user needs a role "
                              f"with readwrite on the group's key prefix: see --coordinator-user)")
        if code == _INVALID_ARGUMENT and "authentication failed" in message:
            raise EtcdRefused(f"etcd {where} refused user {user!r}: {message} (check --coordinator-user and "
                              f"--coordinator-password-file)")
        if "authentication is not enabled" in message:
            raise EtcdRefused(f"etcd {where} has authentication disabled, so --coordinator-user cannot log in: "
                              f"enable it (docs/etcd.md) or drop --coordinator-user ({message})")
        if code == _INVALID_ARGUMENT and "user name is empty" in message:
            raise EtcdRefused(f"etcd {where} has authentication enabled: set --coordinator-user and "
                              f"--coordinator-password-file ({message})")
        raise EtcdUnavailable(f"etcd {where}: {path}: {message}")

    async def _post(self, url: str, body: dict, headers: dict | None) -> tuple[int, bytes]:
        """``(status, body)``; ValueError: longer than :data:`MAX_RESPONSE_BYTES`."""
        async with self._client.stream("POST", url, json=body, headers=headers) as response:
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise ValueError(f"answer longer than {MAX_RESPONSE_BYTES} bytes")
                chunks.append(chunk)
            return response.status_code, b"".join(chunks)

    async def watch(self, key: str, on_event: Any, on_value: Any = None) -> None:
        """Watch ``key`` (etcd's streaming ``POST /v3/watch``) and call ``on_event(kind)``
        (``"PUT"`` or ``"DELETE"``) for each change, in order, until the stream ends, and
        ``on_value(kv)`` (a :class:`KeyValue`: the key as put, or the deletion with its
        revision) after it when given.  Every
        message is bounded by :data:`MAX_WATCH_MESSAGE_BYTES`; the connect by the gateway's
        timeout (seconds), the stream by nothing (the caller cancels it).

        Raises:
            EtcdUnavailable: the stream could not start, ended, or carried what is not a
                watch message (the caller opens a new one).
        """
        host, port = self.endpoints[self._current]
        url = f"{self.scheme}://{host}:{port}/v3/watch"
        headers = None
        if self._login is not None:
            headers = {"Authorization": self._token or await self._authenticate(None)}
        timeout = self._httpx.Timeout(self._timeout_s, read=None)
        body = {"create_request": {"key": b64(key)}}
        try:
            async with self._watch_client.stream("POST", url, json=body, headers=headers,
                                                 timeout=timeout) as response:
                if response.status_code != 200:
                    raise EtcdUnavailable(f"etcd {host}:{port}: watch answered HTTP {response.status_code}")
                buffer = b""
                async for chunk in response.aiter_bytes():
                    buffer += chunk
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        self._watch_message(line, on_event, on_value)
                    if len(buffer) > MAX_WATCH_MESSAGE_BYTES:
                        raise EtcdUnavailable(f"etcd {host}:{port}: a watch message over "
                                              f"{MAX_WATCH_MESSAGE_BYTES} bytes")
                if buffer.strip():
                    self._watch_message(buffer, on_event, on_value)
        except (self._httpx.HTTPError, OSError) as exc:
            raise EtcdUnavailable(f"etcd {host}:{port}: watch: {_describe(exc)}") from None
        raise EtcdUnavailable(f"etcd {host}:{port}: the watch stream ended")

    @staticmethod
    def _watch_message(line: bytes, on_event: Any, on_value: Any = None) -> None:
        if not line.strip():
            return
        try:
            data = json.loads(line)
        except ValueError:
            raise EtcdUnavailable("etcd sent a watch message that is not JSON") from None
        result = data.get("result") if type(data) is dict else None
        if type(result) is not dict:
            error = data.get("error") if type(data) is dict else None
            raise EtcdUnavailable(f"etcd ended the watch: {str(error)[:200] if error else 'no result'}")
        if result.get("canceled"):
            raise EtcdUnavailable(f"etcd cancelled the watch: {str(result.get('cancel_reason'))[:200]}")
        for event in result.get("events") or ():
            if type(event) is dict:
                on_event("DELETE" if event.get("type") == "DELETE" else "PUT")
                kv = event.get("kv")
                if on_value is not None and type(kv) is dict:
                    try:
                        value = KeyValue.decode(kv)
                    except (ValueError, TypeError):
                        raise EtcdUnavailable("etcd sent a watch event whose key is not one") from None
                    on_value(value)

    async def get(self, key: str) -> KeyValue | None:
        data = await self.call("kv/range", {"key": b64(key)})
        kvs = data.get("kvs") or []
        return KeyValue.decode(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: str, limit: int) -> list[KeyValue]:
        raw = prefix.encode()
        data = await self.call("kv/range", {"key": b64(raw), "range_end": b64(prefix_end(raw)), "limit": limit})
        return [KeyValue.decode(kv) for kv in data.get("kvs") or []]

    async def put(self, key: str, value: bytes, lease: int = 0) -> None:
        await self.call("kv/put", {"key": b64(key), "value": b64(value), "lease": str(lease)})

    async def txn(self, compare: list[dict], success: list[dict], failure: list[dict] | None = None) -> dict:
        data = await self.call("kv/txn", {"compare": compare, "success": success, "failure": failure or []})
        return data

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: ``(id, ttl_s)``."""
        data = await self.call("lease/grant", {"TTL": str(ttl_s)})
        return int(data["ID"]), int(data.get("TTL", 0))

    async def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its TTL in seconds (0: the lease no longer exists)."""
        data = await self.call("lease/keepalive", {"ID": str(lease)})
        result = data.get("result")
        return int(result.get("TTL", 0)) if type(result) is dict else 0

    async def revoke(self, lease: int) -> None:
        await self.call("lease/revoke", {"ID": str(lease)})

    async def close(self) -> None:
        await self._client.aclose()
        await self._watch_client.aclose()


async def _read_until_closed(reader: asyncio.StreamReader, limit: int) -> bytes:
    """What the peer sends until it closes the connection, at most ``limit`` bytes."""
    data = b""
    while len(data) < limit and (chunk := await reader.read(limit - len(data))):
        data += chunk
    return data


def _describe(exc: BaseException) -> str:
    return f"{exc.__class__.__name__}: {exc}"


def _tls_refusal(exc: BaseException) -> str | None:
    """What TLS refused, if the cause of ``exc`` is a TLS failure that retrying does not cure."""
    seen = 0
    cause: BaseException | None = exc
    while cause is not None and seen < 8:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return (f"etcd's certificate is not trusted ({cause.verify_message or cause}): check "
                    f"--coordinator-cacert")
        if isinstance(cause, ssl.SSLError) and not isinstance(cause, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
            reason = cause.reason or str(cause)
            if reason == "WRONG_VERSION_NUMBER":
                return "etcd does not serve TLS there (WRONG_VERSION_NUMBER): check --coordinator-protocol"
            if "CERTIFICATE" in reason.upper() and "ALERT" in reason.upper():
                return (f"etcd refused this node's client certificate ({reason}): check --coordinator-cert "
                        f"and --coordinator-key (etcd's --client-cert-auth needs one its CA signed)")
            return (f"TLS refused ({reason}): check --coordinator-cert and --coordinator-key (etcd's "
                    f"--client-cert-auth needs a certificate its CA signed)")
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return None
