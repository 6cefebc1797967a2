"""Where a server listens: its client port (plain TCP, or TLS with bounded
handshakes) and the Prometheus metrics endpoint."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..tls import ServerTLS
from .config import ServerConfig
from .session import Session

if TYPE_CHECKING:  # pragma: no cover
    from ..metrics import MetricsExporter

__all__ = ["Endpoints"]


class Endpoints:
    """Where the server listens: its client port (plain TCP or TLS) and the metrics endpoint."""

    def __init__(self, config: ServerConfig):
        self.tls: ServerTLS | None = None
        if config.tls_cert:
            self.tls = ServerTLS(config.tls_cert, config.tls_key, config.tls_ca, config.tls_client_auth,
                                 config.tls_handshake_timeout_ms / 1000.0)
        self.listener: asyncio.base_events.Server | None = None
        self.metrics: MetricsExporter | None = None  # with --metrics
        #: the (host, port) the client port is bound to, once listening
        self.address: tuple[str, int] | None = None

    async def listen(self, host: str, port: int, factory: Callable[[], Session]) -> tuple[str, int]:
        if self.tls is None:
            self.listener = await asyncio.get_running_loop().create_server(
                factory, host, port, reuse_address=True, backlog=1024)
            sockname = self.listener.sockets[0].getsockname()
        else:
            sockname = await self.tls.listen(host, port, factory, backlog=1024)
        self.address = (sockname[0], sockname[1])
        return self.address

    def stop_listening(self) -> None:
        if self.listener is not None:
            self.listener.close()
        if self.tls is not None:
            self.tls.close()

    def close(self) -> None:
        self.stop_listening()
        if self.metrics is not None:
            self.metrics.close()
