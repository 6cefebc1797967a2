"""Arguments of the priority operations (``ACQUIRE_PRIORITY``, ``REQUEST_REVOKE``,
``TRANSFER``; op codes in :mod:`fastlock.protocol.ops`): a request's priority and the
grace a holder is given to yield.  Both units are in the names (milliseconds)."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgument, WrongArgumentType

__all__ = ["MAX_PRIORITY", "MAX_REVOKE_GRACE_MS", "MIN_REVOKE_GRACE_MS", "check_grace_ms", "check_priority"]

#: the highest priority an acquire may carry (0, the default, is the lowest; equal to
#: ``fastlock._core.MAX_PRIORITY``: a test checks they agree)
MAX_PRIORITY = 99
#: the shortest and longest grace (ms) a revoke request gives the holder before the
#: server takes the lock from it
MIN_REVOKE_GRACE_MS = 1
MAX_REVOKE_GRACE_MS = 600_000


def check_priority(priority: Any) -> int:
    """An acquire's priority: an int in 0..MAX_PRIORITY (higher granted first).

    :raises WrongArgumentType: not an int (bool refused).
    :raises InvalidArgument: out of range."""
    if type(priority) is not int:
        raise WrongArgumentType(f"priority must be an int, not {type(priority).__name__}")
    if not 0 <= priority <= MAX_PRIORITY:
        raise InvalidArgument(f"priority must be 0..{MAX_PRIORITY}, got {priority}")
    return priority


def check_grace_ms(grace_ms: Any) -> int:
    """The milliseconds a holder is given to yield: an int in MIN..MAX_REVOKE_GRACE_MS.

    :raises WrongArgumentType: not an int.  :raises InvalidArgument: out of range."""
    if type(grace_ms) is not int:
        raise WrongArgumentType(f"grace_ms must be an int, not {type(grace_ms).__name__}")
    if not MIN_REVOKE_GRACE_MS <= grace_ms <= MAX_REVOKE_GRACE_MS:
        raise InvalidArgument(f"grace_ms must be {MIN_REVOKE_GRACE_MS}..{MAX_REVOKE_GRACE_MS} ms, got {grace_ms}")
    return grace_ms
