"""fastlock: leased locks with fencing tokens, FIFO waiters, a write-ahead log and a standby.

The public API is :func:`connect` and the error classes; see the README.
"""

from ._version import __version__
from .client import (
    Client,
    Election,
    Leader,
    Lease,
    LeaseHealth,
    LockContext,
    LockManyContext,
    MultiLease,
    Term,
    WatchEvent,
    connect,
)
from .errors import (
    AuthError,
    Cancelled,
    ConnectionLost,
    FastlockError,
    InternalServerError,
    InvalidArgument,
    LeaseLost,
    LimitExceeded,
    LockNotAcquired,
    LockNotHeld,
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
    "LeaseHealth",
    "WatchEvent",
    "Election",
    "Term",
    "Leader",
    "FastlockError",
    "LockNotAcquired",
    "LeaseLost",
    "LockNotHeld",
    "NotPrimary",
    "ConnectionLost",
    "ProtocolError",
    "InternalServerError",
    "AuthError",
    "PermissionDenied",
    "InvalidArgument",
    "WrongArgumentType",
    "LimitExceeded",
    "Cancelled",
    "Unavailable",
    "StaleFencingToken",
]
