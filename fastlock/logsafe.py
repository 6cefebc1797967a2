"""Log hygiene: peer-chosen text is escaped, repeated warnings are rate limited.

A leaf module (imports nothing from fastlock), used wherever a lock name, a
client name, a standby name or a peer address reaches a log line.
"""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["quote", "RateLimitedLog"]


def quote(value: Any) -> str:
    """``value`` as one log-safe token: ``repr()``, which quotes a str and escapes
    every non-printable character in it (newlines, carriage returns, terminal
    escapes, Unicode line separators), so a name holding a newline cannot forge
    a second log line; None is ``-``."""
    return "-" if value is None else repr(value)


class RateLimitedLog:
    """Log one kind of event at most once per ``interval_s`` seconds, with the
    number of occurrences suppressed since the last line (so a flood of refused
    connections cannot flood the log).

    Usage::

        refused = RateLimitedLog(log, logging.WARNING, 10.0)
        refused("refusing connection from %s: %d connections", peer, n)
    """

    __slots__ = ("logger", "level", "interval_s", "_next", "_suppressed")

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING, interval_s: float = 10.0):
        self.logger = logger
        self.level = level
        self.interval_s = interval_s
        self._next = 0.0
        self._suppressed = 0

    def __call__(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        self._next = now + self.interval_s
        if self._suppressed:
            msg = msg + " (%d more like this in the last %g s)"
            args = (*args, self._suppressed, self.interval_s)
            self._suppressed = 0
        self.logger.log(self.level, msg, *args)
