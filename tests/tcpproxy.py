"""Loopback tools for the replication and failover tests.

:class:`TcpProxy`
    A small TCP proxy on 127.0.0.1 that runs its own event loop in a thread
    (so it keeps forwarding while a test blocks, and a test's loop cannot
    partition it by accident).  Start a standby with ``--standby-of
    <proxy.address>`` and the replication link goes through it:

    - :meth:`TcpProxy.pause` - a partition: stop forwarding in both
      directions but keep every socket open (nothing is closed, nothing is
      refused; bytes pile up in kernel buffers).  New connections are
      accepted and held, not forwarded.
    - :meth:`TcpProxy.resume` - heal the partition: forward again,
      including anything held.
    - :meth:`TcpProxy.cut` - close both sides of every current connection
      (a reset link).  New connections are forwarded as usual afterwards.

:class:`RawNode`
    A protocol connection to exactly ONE node: no redirects, no reconnects,
    no epoch bookkeeping - what a test needs to ask "what does THIS address
    answer?".  Errors come back as the :mod:`fastlock.errors` exception the
    server sent.

:class:`Cluster`
    Starts primaries, standbys and proxies for one test and stops all of them
    (use it from a fixture's ``finally``).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from fastlock import protocol as P
from fastlock import rpc
from fastlock._testbase import CredentialsDir, ServerProcess
from fastlock.errors import ConnectionLost


class _Side(asyncio.Protocol):
    """One socket of a proxied connection; forwards what it reads to its peer."""

    def __init__(self, link: "_Link"):
        self.link = link
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []  # read before the peer side existed

    def connection_made(self, transport):
        self.transport = transport
        if self.link.proxy._paused:
            transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.pending.append(data)
        else:
            peer.transport.write(data)

    def connection_lost(self, exc):
        self.link.close()


class _Link:
    def __init__(self, proxy: "TcpProxy"):
        self.proxy = proxy
        self.down = _Side(self)  # towards the connecting client
        self.up: _Side | None = None  # towards the target
        self.closed = False

    async def connect_up(self) -> None:
        proxy = self.proxy
        await proxy._resumed.wait()  # a new connection during a partition is held
        if self.closed:
            return
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(lambda: _Side(self), proxy.target[0], proxy.target[1])
        except OSError:
            self.close()
            return
        if self.closed:
            up.transport.close()
            return
        self.up = up
        up.peer, self.down.peer = self.down, up
        for chunk in self.down.pending:
            up.transport.write(chunk)
        self.down.pending.clear()

    def sides(self):
        return [s for s in (self.down, self.up) if s is not None and s.transport is not None]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.proxy._links.discard(self)
        for side in self.sides():
            side.transport.close()


class TcpProxy:
    """Forward 127.0.0.1:<free port> to ``target`` (``"host:port"`` or a tuple).

    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    def __init__(self, target: str | tuple[str, int]):
        if isinstance(target, str):
            host, _, port = target.rpartition(":")
            target = (host, int(port))
        self.target = target
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._links: set[_Link] = set()
        self._paused = False
        self._resumed: asyncio.Event | None = None
        self.connections = 0  # accepted so far

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "TcpProxy":
        loop = self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self._open())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name="tcpproxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("proxy did not start")
        return self

    async def _open(self) -> None:
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._server = await asyncio.get_running_loop().create_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def _accept(self) -> _Side:
        link = _Link(self)
        self._links.add(link)
        self.connections += 1
        asyncio.ensure_future(link.connect_up())
        return link.down

    def _run(self, fn) -> Any:
        """Run ``fn()`` on the proxy's loop and return its result (thread-safe)."""
        done = threading.Event()
        box: list = []

        def call() -> None:
            try:
                box.append(fn())
            finally:
                done.set()

        self._loop.call_soon_threadsafe(call)
        if not done.wait(10):
            raise RuntimeError("proxy loop did not answer")
        return box[0] if box else None

    def pause(self) -> None:
        """Stop forwarding (both directions, every connection); keep sockets open."""
        def do() -> None:
            self._paused = True
            self._resumed.clear()
            for link in list(self._links):
                for side in link.sides():
                    side.transport.pause_reading()

        self._run(do)

    def resume(self) -> None:
        """Forward again."""
        def do() -> None:
            self._paused = False
            self._resumed.set()
            for link in list(self._links):
                for side in link.sides():
                    side.transport.resume_reading()

        self._run(do)

    def cut(self) -> int:
        """Close both sides of every current connection; returns how many."""
        def do() -> int:
            links = list(self._links)
            for link in links:
                link.close()
            return len(links)

        return self._run(do)

    def close(self) -> None:
        if self._loop is None or self._loop.is_closed():
            return

        def do() -> None:
            for link in list(self._links):
                link.close()
            self._resumed.set()  # held connections' tasks see they are closed and end
            if self._server is not None:
                self._server.close()
            self._loop.call_later(0.05, self._loop.stop)

        try:
            self._run(do)
        except RuntimeError:
            pass
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> "TcpProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class RawNode:
    """A protocol connection to one node only (no redirects, no reconnects).

    ``await RawNode.open(address, known_epoch=None)`` sends HELLO (with
    ``known_epoch`` as its optional fourth argument when given) and keeps the
    server's answer in :attr:`hello`.  :meth:`request` pipelines requests and
    raises the server's error as a :mod:`fastlock.errors` exception, or
    :class:`~fastlock.errors.ConnectionLost` when the connection drops.
    Built on :class:`fastlock.rpc.RpcConnection` (pushes are ignored).
    """

    def __init__(self, address: str):
        host, _, port = address.rpartition(":")
        self.address = address
        self.host, self.port = host, int(port)
        self.hello: dict = {}
        self._conn: rpc.RpcConnection | None = None

    @classmethod
    async def open(cls, address: str, *, known_epoch: int | None = None, name: str = "raw",
                   timeout: float = 5.0, token: str | None | type = ...) -> "RawNode":
        """``token``: the credential for HELLO (default: the token in the file named by
        ``FASTLOCK_TOKEN_FILE`` - a :class:`Cluster` sets it to its admin's - else None)."""
        if token is ...:
            path = os.environ.get("FASTLOCK_TOKEN_FILE")
            token = Path(path).read_text().strip() if path else None
        node = cls(address)
        node._conn = await rpc.open_connection(node.host, node.port, timeout=timeout)
        args: list[Any] = [P.PROTOCOL_VERSION, name, token]
        if known_epoch is not None:
            args.append(known_epoch)
        try:
            node.hello = await asyncio.wait_for(node.request(P.OP_HELLO, *args), timeout)
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
    async def acquire(self, name: str, ttl_ms: int, wait_ms: int = 0, owner: bytes | None = None) -> tuple[int, int, bytes]:
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
        self._saved_env = os.environ.get("FASTLOCK_TOKEN_FILE")
        os.environ["FASTLOCK_TOKEN_FILE"] = self.creds.token_file("admin")

    def replica_of(self, name: str) -> str:
        """The replica principal of the server called ``name``."""
        if name not in self._replicas:
            self._replicas[name] = self.creds.next_replica()
        return self._replicas[name]

    def auth_args(self, name: str) -> list[str]:
        return self.creds.server_args(self.replica_of(name))

    def primary(self, name: str = "primary", *, args: Sequence[str] = (), **kw) -> ServerProcess:
        return self._start(ServerProcess(self.root / name, args=["--name", name, *self.auth_args(name), *args],
                                         **kw))

    def standby(self, of: str, name: str = "standby", *, failover_after: float | None = None,
                grace: float | None = None, args: Sequence[str] = (), wait_sync: bool = True,
                **kw) -> ServerProcess:
        """Start a standby of ``of`` (an address: a primary's or a proxy's); by default
        wait until it has attached (its "replicating from" log line)."""
        argv = ["--standby-of", of, "--name", name, *self.auth_args(name)]
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
        fresh = ServerProcess(srv.data_dir, fsync=srv.fsync, args=srv.args, log_level=srv.log_level, env=srv.env)
        return self._start(fresh)

    def proxy(self, target: str) -> TcpProxy:
        px = TcpProxy(target).start()
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
                pass


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
