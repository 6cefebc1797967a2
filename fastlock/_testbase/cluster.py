"""Several nodes for one test: raw connections to one node, and clusters of
real servers with proxies between them.

:class:`RawNode`
    A protocol connection to exactly ONE node: no redirects, no reconnects,
    no epoch bookkeeping - what a test needs to ask "what does THIS address
    answer?".  Errors come back as the :mod:`fastlock.errors` exception the
    server sent.

:class:`Cluster`
    Starts primaries, standbys and proxies (:class:`~fastlock._testbase.proxy.TcpProxy`)
    for one test and stops all of them (use it from a fixture's ``finally``).

:func:`run`, :func:`poll`, :func:`status_of`
    Run a coroutine with a bound; wait for a condition with a bound; one
    STATUS round trip to exactly one address.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from types import EllipsisType
from typing import Any

from fastlock import protocol as P
from fastlock._testbase.proxy import TcpProxy, free_port
from fastlock._testbase.servers import CredentialsDir, ServerProcess
from fastlock.auth import ClientHandshake, say_hello, secret_of
from fastlock.errors import ConnectionLost
from fastlock.protocol import rpc
from fastlock.units import parse_address

log = logging.getLogger(__name__)

__all__ = ["Cluster", "RawNode", "poll", "run", "status_of"]


class RawNode:
    """A protocol connection to one node only (no redirects, no reconnects).

    ``await RawNode.open(address, known_epoch=None)`` sends HELLO (with
    ``known_epoch`` as its optional fourth argument when given) and keeps the
    server's answer in :attr:`hello`.  :meth:`request` pipelines requests and
    raises the server's error as a :mod:`fastlock.errors` exception, or
    :class:`~fastlock.errors.ConnectionLost` when the connection drops.
    Built on :class:`fastlock.protocol.rpc.RpcConnection` (pushes are ignored).
    """

    def __init__(self, address: str):
        self.address = address
        self.host, self.port = parse_address(address, default_port=None)
        self.hello: dict = {}
        self._conn: rpc.RpcConnection | None = None

    @classmethod
    async def open(cls, address: str, *, known_epoch: int | None = None, name: str = "raw",
                   timeout: float = 5.0, token: str | None | EllipsisType = ...,
                   on_push: Any = None) -> RawNode:
        """``token``: the credential for HELLO (default: the token in the file named by
        ``FASTLOCK_TOKEN_FILE`` - a :class:`Cluster` sets it to its admin's - else None);
        ``on_push(kind, payload)``: called with each server push (None: pushes are ignored)."""
        if token is ...:
            path = os.environ.get("FASTLOCK_TOKEN_FILE")
            token = Path(path).read_text().strip() if path else None
        node = cls(address)
        node._conn = await rpc.open_connection(node.host, node.port, timeout=timeout,
                                               **({"on_push": on_push} if on_push is not None else {}))
        handshake = ClientHandshake(secret_of(token) if token else None)
        try:
            node.hello = await asyncio.wait_for(say_hello(node._conn, name, handshake, known_epoch), timeout)
        except BaseException:
            await node.close()
            raise
        return node

    def request(self, op: int, *args: Any) -> asyncio.Future:
        if self._conn is None:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(ConnectionLost(f"connection to {self.address} is closed"))
            return fut
        return self._conn.request(op, *args)

    # -- lock operations in wire units (ms) -----------------------------------------------
    async def acquire(self, name: str, ttl_ms: int, wait_ms: int = 0,
                      owner: bytes | None = None) -> tuple[int, int, bytes]:
        """Returns ``(token, ttl_ms, owner)``."""
        owner = owner or os.urandom(16)
        reply = await self.request(P.OP_ACQUIRE, name, owner, ttl_ms, wait_ms, 0, None)
        return reply[0], reply[1], owner

    async def release(self, name: str, token: int, owner: bytes) -> None:
        await self.request(P.OP_RELEASE, name, token, owner)

    async def extend(self, name: str, token: int, owner: bytes, ttl_ms: int) -> int:
        return await self.request(P.OP_EXTEND, name, token, owner, ttl_ms)

    async def status(self) -> dict:
        return await self.request(P.OP_STATUS)

    async def holder(self, name: str) -> dict | None:
        return await self.request(P.OP_HOLDER, name)

    @property
    def closed(self) -> bool:
        return self._conn is None or self._conn.closed

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class Cluster:
    """Real ``fastlock serve`` processes and proxies for one test; :meth:`stop_all` ends them.

    Every server gets the same credentials file (:attr:`creds`) and its own replica
    principal (by server name: :meth:`replica_of`); while the cluster runs,
    ``FASTLOCK_TOKEN_FILE`` names the admin's token, so ``fastlock`` commands,
    clients and :class:`RawNode` act as the admin unless told otherwise.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.servers: list[ServerProcess] = []
        self.proxies: list[TcpProxy] = []
        # a mutual-TLS certificate with CN "admin" is the admin (as in test_tls.py)
        self.creds = CredentialsDir(self.root / "credentials", cert_identities={"admin": ["admin"]})
        self._replicas: dict[str, str] = {}
        #: data directory -> the port a proxy to that server listens on (see :meth:`proxy`): each
        #: server is started with ``--reachable-as 127.0.0.1:PORT``, so a client's handshake through
        #: the test's proxy is not taken for a relay's
        self._relay_ports: dict[Path, int] = {}
        self._saved_env = os.environ.get("FASTLOCK_TOKEN_FILE")
        os.environ["FASTLOCK_TOKEN_FILE"] = self.creds.token_file("admin")

    def replica_of(self, name: str) -> str:
        """The replica principal of the server called ``name``."""
        if name not in self._replicas:
            self._replicas[name] = self.creds.next_replica()
        return self._replicas[name]

    def auth_args(self, name: str) -> list[str]:
        return self.creds.server_args(self.replica_of(name))

    def primary(self, name: str = "primary", *, args: Sequence[str] = (), replica_credential: bool = True,
                **kw) -> ServerProcess:
        """Start a primary called ``name``.  ``replica_credential=False``: without
        ``--standby-token-file``, so that once fenced it cannot ask its paired standby's
        address whether that node was promoted, nor follow it there: it stays a fenced
        primary (its log says so) instead of stepping down and closing every connection."""
        auth = self.auth_args(name) if replica_credential else ["--credentials", self.creds.file]
        return self._start(ServerProcess(self.root / name, args=["--name", name, *auth,
                                                                 *self._relay_args(name), *args], **kw))

    def _relay_args(self, name: str) -> list[str]:
        port = self._relay_ports.setdefault(self.root / name, free_port())
        return ["--reachable-as", f"127.0.0.1:{port}"]

    def standby(self, of: str, name: str = "standby", *, failover_after: float | None = None,
                grace: float | None = None, args: Sequence[str] = (), wait_sync: bool = True,
                **kw) -> ServerProcess:
        """Start a standby of ``of`` (an address: a primary's or a proxy's); by default
        wait until it has attached (its "replicating from" log line)."""
        argv = ["--standby-of", of, "--name", name, *self.auth_args(name), *self._relay_args(name)]
        if failover_after is not None:
            argv += ["--failover-after", str(failover_after)]
        if grace is not None:
            argv += ["--promotion-grace", str(grace)]
        srv = self._start(ServerProcess(self.root / name, args=[*argv, *args], **kw))
        if wait_sync:
            srv.wait_for_log(r"replicating from", 10)
            if failover_after:  # automatic failover is armed only once the primary has paired
                srv.wait_for_log(r"paired: primary", 10)
        return srv

    def restart(self, srv: ServerProcess) -> ServerProcess:
        """Start a stopped server again on the same data dir (on a new free port)."""
        fresh = ServerProcess(srv.data_dir, fsync=srv.fsync, args=srv.args, log_level=srv.log_level, env=srv.env,
                              log_path=srv.log_path)
        return self._start(fresh)

    def proxy(self, target: str) -> TcpProxy:
        """A :class:`TcpProxy` to the server at ``target``, on the port that server was told
        it is reachable as (a second proxy to one server gets a free port)."""
        srv = next((s for s in self.servers if s.address == target), None)
        port = self._relay_ports.get(Path(srv.data_dir), 0) if srv is not None else 0
        if port in {p.port for p in self.proxies}:
            port = 0
        px = TcpProxy(target, port=port).start()
        self.proxies.append(px)
        return px

    def _start(self, srv: ServerProcess) -> ServerProcess:
        self.servers.append(srv)
        return srv.start()

    def stop_all(self) -> None:
        if self._saved_env is None:
            os.environ.pop("FASTLOCK_TOKEN_FILE", None)
        else:
            os.environ["FASTLOCK_TOKEN_FILE"] = self._saved_env
        for px in self.proxies:
            px.close()
        for srv in self.servers:
            try:
                srv.stop(5)
            except Exception:  # keep stopping the others
                log.exception("stopping %s failed", srv.data_dir)


def run(coro, timeout: float = 40.0):
    """Run ``coro`` on a fresh loop, failing after ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def poll(fn, pred=bool, *, timeout: float, what: str, interval: float = 0.01):
    """Call ``await fn()`` until ``pred(value)``; return the value, or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = await fn()
            if pred(last):
                return last
        except (ConnectionLost, OSError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; last value: {last!r}")
        await asyncio.sleep(interval)


async def status_of(address: str) -> dict:
    """One STATUS round trip to exactly ``address``."""
    node = await RawNode.open(address, name="status")
    try:
        return await asyncio.wait_for(node.status(), 5)
    finally:
        await node.close()
