"""pytest plugin: real fastlock servers and clients for the tests of your own code.

Installed with fastlock and loaded by pytest through the ``pytest11`` entry
point (nothing to configure; ``-p no:fastlock`` turns it off).  Every fixture
starts real servers on free 127.0.0.1 ports and stops them after the test,
as pytest-redis does for Redis.  Fixtures (all function-scoped):

``fastlock_server``
    A ``fastlock serve`` subprocess (:class:`fastlock._testbase.ServerProcess`):
    ``.address`` (``"127.0.0.1:PORT"``), ``.kill()`` (SIGKILL, a crash),
    ``.pause()`` / ``.resume()`` (SIGSTOP / SIGCONT), ``.stop()``,
    ``.wait_for_log(regex, timeout)``.  For crash and failover tests.
``fastlock_server_factory``
    ``fastlock_server_factory(name="data", args=[...], fsync="always")``
    starts one more subprocess server per call (each with its own data
    directory under ``tmp_path``); all are stopped after the test.
``fastlock_inprocess_server``
    A :class:`fastlock.server.LockServer` running on its own event loop in a
    background thread of the test process (starts in milliseconds; cannot be
    crashed).  ``.address`` as above.
``fastlock_client``
    An async :class:`fastlock.Client` connected to ``fastlock_server``
    (needs pytest-asyncio; closed after the test).
``fastlock_sync_client``
    A blocking :class:`fastlock.sync.SyncClient` connected to ``fastlock_server``.
``fastlock_pair``
    A primary and a standby following it (:class:`ServerPair`): both
    addresses for ``connect(*pair.addresses)``, ``pair.promote()`` to make the
    standby primary (after ``pair.primary.kill()``, say).
``fastlock_history``
    A :class:`fastlock._testbase.HistoryChecker`: call ``held(name, token, at)``
    when your code starts acting as a lock's holder and ``released(...)`` when
    it stops (``at`` from ``time.monotonic()``); after the test the plugin
    checks that no two holdings of one lock overlapped and that fencing
    tokens grew, and fails the test otherwise (Jepsen-style history check).

Servers run in open mode (no credentials) except the pair, whose servers
share a credentials file (replica principals for the standby, an ``admin``
principal for ``promote``); anonymous clients may take every lock name on
both.  docs/testing.md has examples.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from fastlock._testbase import CredentialsDir, HistoryChecker, ServerProcess
    from fastlock.server import LockServer
    from fastlock.sync import SyncClient

try:
    import pytest_asyncio
except ImportError:  # pragma: no cover - the async fixture then explains itself
    pytest_asyncio = None  # type: ignore[assignment]

__all__ = ["InProcessServer", "ServerPair"]


class InProcessServer:
    """A :class:`fastlock.server.LockServer` on a background thread's event loop.

    Args:
        data_dir: the server's data directory (created if missing).
        fsync: ``"always"`` | ``"interval"`` | ``"never"``.
        port: 0 (default) for a free port.

    :meth:`start` blocks until the server listens (at most ``timeout``
    seconds; raises what the server raised on starting); :meth:`stop` closes
    it and joins the thread.  Usable as a context manager.
    """

    def __init__(self, data_dir: str | os.PathLike[str], *, fsync: str = "always", port: int = 0):
        from fastlock.server import FsyncMode, ServerConfig

        self.config = ServerConfig(host="127.0.0.1", port=port, data_dir=str(data_dir), fsync=FsyncMode(fsync))
        self.server: LockServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None

    @property
    def address(self) -> str:
        """``"127.0.0.1:PORT"`` once started."""
        if self.server is None or self.server.address is None:
            raise RuntimeError("the server has not started")
        host, port = self.server.address
        return f"{host}:{port}"

    def start(self, timeout: float = 10.0) -> InProcessServer:
        self._thread = threading.Thread(target=self._run, name="fastlock-inprocess-server", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError(f"in-process fastlock server did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main())
        finally:
            loop.close()

    async def _main(self) -> None:
        from fastlock.server import LockServer

        self._stop = asyncio.Event()
        try:
            server = LockServer(self.config)
            await server.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised by start() in the caller's thread
            self._error = exc
            self._started.set()
            return
        self.server = server
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await server.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Close the server (its sessions are dropped, the WAL flushed) and join the thread."""
        loop, stop, thread = self._loop, self._stop, self._thread
        if thread is None:
            return
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        thread.join(timeout)
        self._thread = None

    def __enter__(self) -> InProcessServer:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class ServerPair:
    """A primary and a standby that follows it (from the ``fastlock_pair`` fixture).

    Attributes:
        primary (ServerProcess): the primary.
        standby (ServerProcess): the standby (attached when the fixture returns).
        credentials (CredentialsDir): the shared credentials; ``credentials.token("admin")``
            is the operator's token.
    """

    primary: ServerProcess
    standby: ServerProcess
    credentials: CredentialsDir

    @property
    def addresses(self) -> tuple[str, str]:
        """Both addresses, primary first: ``await fastlock.connect(*pair.addresses)``."""
        return (self.primary.address, self.standby.address)

    def promote(self, timeout: float = 10.0) -> None:
        """Promote the standby (``fastlock promote --force`` as the admin); returns once it is primary.

        Raises:
            subprocess.CalledProcessError: the command failed (its output is in the error).
        """
        subprocess.run(
            [sys.executable, "-m", "fastlock", "promote", "--server", self.standby.address,
             "--token-file", self.credentials.token_file("admin"), "--force"],
            check=True, capture_output=True, text=True, timeout=timeout, cwd=str(self.standby.data_dir.parent),
        )


def _new_dir(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "fastlock" / name
    if path.exists():
        raise ValueError(f"a fastlock server named {name!r} was already started in this test")
    return path


@pytest.fixture
def fastlock_server_factory(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """``make(name="data", *, args=(), fsync="always", port=0, log_level="INFO", env=None)``:
    start a ``fastlock serve`` subprocess with data dir ``tmp_path/fastlock/<name>``; every one
    is stopped (SIGTERM, then SIGKILL) after the test."""
    from fastlock._testbase import ServerProcess

    started: list[ServerProcess] = []

    def make(name: str = "data", *, args: Sequence[str] = (), **kwargs: Any) -> ServerProcess:
        srv = ServerProcess(_new_dir(tmp_path, name), args=args, **kwargs)
        started.append(srv)
        return srv.start()

    try:
        yield make
    finally:
        for srv in started:
            srv.stop()


@pytest.fixture
def fastlock_server(fastlock_server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    """A ``fastlock serve`` subprocess on a free 127.0.0.1 port (open mode, ``--fsync always``)."""
    return fastlock_server_factory("server")


@pytest.fixture
def fastlock_inprocess_server(tmp_path: Path) -> Iterator[InProcessServer]:
    """A LockServer on a background thread of this process, on a free 127.0.0.1 port."""
    srv = InProcessServer(_new_dir(tmp_path, "inprocess")).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def fastlock_sync_client(fastlock_server: ServerProcess) -> Iterator[SyncClient]:
    """A blocking :class:`fastlock.sync.SyncClient` connected to ``fastlock_server``; closed after the test."""
    from fastlock.sync import SyncClient

    client = SyncClient(fastlock_server.address, client_name="pytest")
    try:
        yield client
    finally:
        client.close()


if pytest_asyncio is not None:

    @pytest_asyncio.fixture
    async def fastlock_client(fastlock_server: ServerProcess) -> Any:
        """An async :class:`fastlock.Client` connected to ``fastlock_server``; closed after the test."""
        from fastlock.client import connect

        client = await connect(fastlock_server.address, client_name="pytest")
        try:
            yield client
        finally:
            await client.close()

else:  # pragma: no cover

    @pytest.fixture
    def fastlock_client() -> None:
        """Needs pytest-asyncio (``pip install pytest-asyncio``)."""
        pytest.skip("the fastlock_client fixture needs pytest-asyncio")


@pytest.fixture
def fastlock_pair(tmp_path: Path) -> Iterator[ServerPair]:
    """A primary and a standby attached to it (subprocesses; both stopped after the test)."""
    from fastlock._testbase import CredentialsDir, ServerProcess

    creds = CredentialsDir(_new_dir(tmp_path, "credentials"), replicas=2)
    primary = ServerProcess(_new_dir(tmp_path, "primary"), args=["--name", "primary", *creds.server_args("node-1")])
    standby = ServerProcess(_new_dir(tmp_path, "standby"),
                            args=["--name", "standby", *creds.server_args("node-2")])
    try:
        primary.start()
        standby.args += ["--standby-of", primary.address]
        standby.start()
        standby.wait_for_log(r"replicating from", 10)
        yield ServerPair(primary, standby, creds)
    finally:
        standby.stop()
        primary.stop()


@pytest.fixture
def fastlock_history() -> Iterator[HistoryChecker]:
    """A :class:`fastlock._testbase.HistoryChecker`, checked after the test (fails it on a violation)."""
    from fastlock._testbase import HistoryChecker

    checker = HistoryChecker()
    yield checker
    checker.check()
