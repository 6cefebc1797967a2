"""One blocking client per process, made on first use and made again after ``fork()``.

Celery's prefork pool and ``gunicorn --preload`` fork workers from a parent
that may already have built a client.  A :class:`~fastlock.sync.SyncClient`
reconnects in a forked child by itself, but the child's recipes should not
share a client object with the parent's leases at all, so the client here is
keyed by the process id: each worker process makes its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from fastlock.sync import SyncClient


class ProcessClient:
    """Holds a :class:`~fastlock.sync.SyncClient` per process.

    Args:
        factory: builds the client (called at most once per process, under a lock).
    """

    def __init__(self, factory: Callable[[], SyncClient]):
        self._factory = factory
        self._lock = threading.Lock()
        self._client: SyncClient | None = None
        self._pid = 0

    def get(self) -> SyncClient:
        """This process's client (connects on first use; raises what :class:`SyncClient` raises)."""
        pid = os.getpid()
        with self._lock:
            if self._client is None or self._pid != pid:
                # a client inherited through fork() is left to the parent, not closed here
                self._client = self._factory()
                self._pid = pid
            return self._client

    def reset(self) -> None:
        """Close this process's client (if any); the next :meth:`get` makes a new one."""
        with self._lock:
            client, self._client = self._client, None
            if client is not None and self._pid == os.getpid():
                client.close()


def client_from_options(options: dict[str, Any]) -> SyncClient:
    """A :class:`SyncClient` from a settings mapping.

    Keys (all optional): ``SERVERS`` (list of ``"host:port"``; default
    ``["127.0.0.1:7420"]``), ``CLIENT_NAME``, ``TOKEN``, ``TOKEN_FILE``,
    ``CONNECT_TIMEOUT`` and ``REQUEST_TIMEOUT`` (seconds), ``TLS_CA``,
    ``TLS_CERT``, ``TLS_KEY`` - as the arguments of :func:`fastlock.connect`.

    Raises:
        InvalidArgument: an unknown key (a typo must not silently connect elsewhere).
    """
    from fastlock.errors import InvalidArgument

    known = {"SERVERS", "CLIENT_NAME", "TOKEN", "TOKEN_FILE", "CONNECT_TIMEOUT", "REQUEST_TIMEOUT",
             "TLS_CA", "TLS_CERT", "TLS_KEY"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidArgument(f"unknown fastlock setting(s) {unknown}; known: {sorted(known)}")
    servers = options.get("SERVERS") or ["127.0.0.1:7420"]
    if isinstance(servers, str):
        servers = [s.strip() for s in servers.split(",") if s.strip()]
    kwargs: dict[str, Any] = {
        "client_name": options.get("CLIENT_NAME"),
        "token": options.get("TOKEN"),
        "token_file": options.get("TOKEN_FILE"),
        "tls_ca": options.get("TLS_CA"),
        "tls_cert": options.get("TLS_CERT"),
        "tls_key": options.get("TLS_KEY"),
    }
    if "CONNECT_TIMEOUT" in options:
        kwargs["connect_timeout"] = options["CONNECT_TIMEOUT"]
    if "REQUEST_TIMEOUT" in options:
        kwargs["request_timeout"] = options["REQUEST_TIMEOUT"]
    return SyncClient(*servers, **kwargs)
