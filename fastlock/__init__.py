"""fastlock: leased locks with fencing tokens, FIFO waiters, a write-ahead log and a standby.

The public API is :func:`connect` and the error classes; see the README.
"""

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    AuthError,
    Cancelled,
    ConnectionLost,
    FastlockError,
    InvalidArgument,
    LeaseLost,
    LimitExceeded,
    LockNotAcquired,
    NotPrimary,
    ProtocolError,
    StaleFencingToken,
    Unavailable,
    WrongArgumentType,
)
from .client import Client, Lease, LockContext, WatchEvent, connect  # noqa: E402

__all__ = [
    "__version__",
    "connect",
    "Client",
    "Lease",
    "LockContext",
    "WatchEvent",
    "FastlockError",
    "LockNotAcquired",
    "LeaseLost",
    "NotPrimary",
    "ConnectionLost",
    "ProtocolError",
    "AuthError",
    "InvalidArgument",
    "WrongArgumentType",
    "LimitExceeded",
    "Cancelled",
    "Unavailable",
    "StaleFencingToken",
]
