"""Run a server process: :func:`serve` (event loop policy, signals, exit status).

``fastlock serve`` calls :func:`serve` with a :class:`~fastlock.server.config.ServerConfig`;
SIGTERM and SIGINT stop the server cleanly, SIGHUP reloads its TLS files.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from .. import sdnotify
from ..coordination import NodeIdInUse
from ..errors import InvalidArgument
from ..replication import NodeFileDamaged
from ..units import format_address
from ..wal import DataDirInUse, WalCorruption
from .config import ServerConfig
from .lockserver import LockServer

log = logging.getLogger(__name__)


def install_loop_policy() -> str:
    """Make uvloop the event loop where it is installed; returns the loop's name."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where available
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


async def _serve(config: ServerConfig) -> int:
    server = LockServer(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if server.tls is not None:  # SIGHUP keeps its default (exit) without TLS
        loop.add_signal_handler(signal.SIGHUP, server.reload_tls)
    await server.start()
    address = server.address
    assert address is not None  # start() returns once listening
    sdnotify.ready(f"{server.role} on {format_address(address)}")  # systemd Type=notify
    waiter = asyncio.ensure_future(stop.wait())
    closed = asyncio.ensure_future(server.wait_closed())
    await asyncio.wait([waiter, closed], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("signal received")
    sdnotify.stopping(f"{server.role}: shutting down")
    await server.close()
    waiter.cancel()
    closed.cancel()
    return server.exit_status


def serve(config: ServerConfig, *, use_uvloop: bool = True) -> int:
    """Run a server until SIGTERM/SIGINT.  Returns the process exit status
    (0; 1: cannot start; 2: the WAL is damaged; 3: the WAL failed while serving)."""
    loop_name = install_loop_policy() if use_uvloop else "asyncio"
    log.info("event loop: %s", loop_name)
    os.umask(0o077)  # every file this process creates is its owner's only (the data holds owner keys)
    try:
        return asyncio.run(_serve(config))
    except WalCorruption as exc:
        log.critical("refusing to start: %s (start with --repair-wal to cut the damaged tail and "
                     "lose the records after it)", exc)
        return 2
    except (OSError, DataDirInUse, ImportError, InvalidArgument, NodeFileDamaged, NodeIdInUse) as exc:
        log.critical("cannot start: %s", exc)
        return 1
