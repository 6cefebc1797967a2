"""fastlock: leased locks with fencing tokens, FIFO waiters, a write-ahead log and a standby.

The public API is :func:`connect` and the error classes; see the README.
"""

from importlib.metadata import PackageNotFoundError as _NotInstalled, version as _version

try:  # the one place the version is kept is pyproject.toml
    __version__ = _version("fastlock")
except _NotInstalled:  # a source tree that was never installed
    __version__ = "0+unknown"

from .client import (
    Client,
    Election,
    Leader,
    Lease,
    LeaseHealth,
    LockContext,
    LockManyContext,
    MultiLease,
    Semaphore,
    Term,
    WatchEvent,
    connect,
)
from .errors import (
    AuthError,
    Cancelled,
    ConnectionLost,
    DeadlockDetected,
    FastlockError,
    InvalidArgument,
    LeaseLost,
    LimitConflict,
    LimitExceeded,
    LockNotAcquired,
    NotPrimary,
    PermissionDenied,
    ProtocolError,
    StaleFencingToken,
    Unavailable,
    WrongArgumentType,
)

__all__ = [
    "__version__",
    "connect",
    "Client",
    "Lease",
    "LockContext",
    "LockManyContext",
    "MultiLease",
    "Semaphore",
    "LeaseHealth",
    "WatchEvent",
    "Election",
    "Term",
    "Leader",
    "FastlockError",
    "LockNotAcquired",
    "LeaseLost",
    "NotPrimary",
    "ConnectionLost",
    "ProtocolError",
    "AuthError",
    "PermissionDenied",
    "InvalidArgument",
    "WrongArgumentType",
    "LimitExceeded",
    "Cancelled",
    "Unavailable",
    "StaleFencingToken",
    "LimitConflict",
    "DeadlockDetected",
]
