"""The fastlock server: the composition root of the node.

:class:`LockServer` (in :mod:`.lockserver`) ties the lock table, the
write-ahead log, replication and failover together; :func:`serve` runs one
as a process.  The parts: :mod:`.config` (:class:`ServerConfig`),
:mod:`.session` (one connection), :mod:`.handlers` (the op handler table),
:mod:`.admission` (connection limits and per-principal quotas),
:mod:`.watches`, :mod:`.tasks` (background tasks), :mod:`.failover`
(promotion, stepping down), :mod:`.endpoints` (the listening ports),
:mod:`.serve` (the process).
"""

from ..units import monotonic_ms as now_ms
from .admission import DEFAULT_MAX_CONNECTIONS, RESERVED_FDS, raise_open_files_limit
from .config import FsyncMode, ServerConfig, WalWriter, check_limits
from .failover import FailoverPolicy, check_step_down_epoch
from .handlers import PERMISSION
from .lockserver import EXIT_WAL_FAILED, LockServer
from .serve import serve
from .session import FLUSH_EARLY_BYTES, Session
from .tasks import BackgroundTasks

__all__ = [
    "BackgroundTasks",
    "DEFAULT_MAX_CONNECTIONS",
    "EXIT_WAL_FAILED",
    "FLUSH_EARLY_BYTES",
    "FailoverPolicy",
    "FsyncMode",
    "LockServer",
    "PERMISSION",
    "RESERVED_FDS",
    "ServerConfig",
    "Session",
    "WalWriter",
    "check_limits",
    "check_step_down_epoch",
    "now_ms",
    "raise_open_files_limit",
    "serve",
]
