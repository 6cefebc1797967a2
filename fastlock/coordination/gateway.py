"""A small async client of etcd's v3 JSON gateway, and the coordinator URL.

:class:`EtcdGateway` posts to ``/v3/kv/range``, ``/v3/kv/put``, ``/v3/kv/txn``,
``/v3/lease/grant``, ``/v3/lease/keepalive`` and ``/v3/lease/revoke`` (keys and
values travel base64, 64-bit integers as decimal strings) over httpx, the
optional extra ``fastlock[etcd]``; every answer is read up to
:data:`MAX_RESPONSE_BYTES`.  :func:`parse_coordinator` reads
``etcd://HOST:PORT[,HOST:PORT]/PREFIX``.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from ..units import parse_address

#: the largest answer read from etcd (bytes): a member list at its limits fits several times
MAX_RESPONSE_BYTES = 16 << 20


class EtcdUnavailable(ConnectionError):
    """No etcd endpoint answered the request (or answered with an error)."""


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

    Raises:
        ImportError: httpx is not installed (``pip install 'fastlock[etcd]'``).
    """

    def __init__(self, endpoints: tuple[tuple[str, int], ...] | list[tuple[str, int]], timeout_s: float = 1.0):
        try:
            import httpx
        except ImportError:
            raise ImportError("the etcd coordinator needs httpx: pip install 'fastlock[etcd]'") from None
        self._httpx = httpx
        self.endpoints = list(endpoints)
        self._current = 0
        self._client = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=4))

    async def call(self, path: str, body: dict) -> dict:
        """POST ``body`` to ``/v3/<path>``; the decoded answer.

        Raises:
            EtcdUnavailable: no endpoint answered, or etcd answered with an error.
        """
        errors = []
        n = len(self.endpoints)
        for i in range(n):
            index = (self._current + i) % n
            host, port = self.endpoints[index]
            url = f"http://{host}:{port}/v3/{path}"
            try:
                status, data = await self._post(url, body)
            except (self._httpx.HTTPError, ValueError) as exc:
                errors.append(f"{host}:{port}: {exc.__class__.__name__}: {exc}")
                continue
            self._current = index
            if type(data) is not dict:
                raise EtcdUnavailable(f"etcd {host}:{port} answered {path} with a {type(data).__name__}")
            if "error" in data and status != 200:
                raise EtcdUnavailable(f"etcd {host}:{port}: {path}: {str(data.get('message'))[:200]}")
            return data
        raise EtcdUnavailable("no etcd endpoint answered: " + "; ".join(errors))

    async def _post(self, url: str, body: dict) -> tuple[int, Any]:
        """``(status, decoded JSON)``; ValueError: not JSON, or longer than :data:`MAX_RESPONSE_BYTES`."""
        async with self._client.stream("POST", url, json=body) as response:
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise ValueError(f"answer longer than {MAX_RESPONSE_BYTES} bytes")
                chunks.append(chunk)
            return response.status_code, json.loads(b"".join(chunks))

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
