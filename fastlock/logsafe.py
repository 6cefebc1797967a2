"""Log hygiene: peer-chosen text is escaped, repeated warnings are rate limited.

A leaf module (imports nothing from fastlock), used wherever a lock name, a
client name, a standby name or a peer address reaches a log line, an audit line
or a human table.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

__all__ = ["display", "quote", "text_value", "RateLimitedLog"]


def quote(value: Any) -> str:
    """``value`` as one log-safe token: ``repr()``, which quotes a str and escapes
    every non-printable character in it (newlines, carriage returns, terminal
    escapes, Unicode line separators), so a name holding a newline cannot forge
    a second log line; None is ``-``."""
    return "-" if value is None else repr(value)


def display(value: Any) -> str:
    """``value`` (a peer-chosen name) for a human table or terminal: unchanged when every
    character is printable; a backslash and each non-printable character (control
    characters, terminal escapes, newlines, Unicode separators and format characters) as
    its ``repr()`` escape, so it can neither drive the terminal nor forge a row; None is ``-``."""
    if value is None:
        return "-"
    text = str(value)
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in text)


#: a value printed bare: printable ASCII without a space, a double quote or a backslash
_BARE = re.compile(r'[!#-\[\]-~]+')


def text_value(value: Any) -> str:
    """A value (a peer-chosen name, a client name, a correlation id, a reason) as one token
    of an audit line or one cell of a human table: bare when it is printable ASCII without
    a space, ``"`` or ``\\`` (and is not ``-``); otherwise a JSON string (ASCII only: every
    control character, line separator and non-ASCII character escaped), so a value can
    neither split a line or a row, nor forge a field or a column, nor drive the terminal;
    None is ``-``, an int its digits.  A reader takes a token that starts with ``"`` as
    JSON, any other literally."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    return text if text != "-" and _BARE.fullmatch(text) else json.dumps(text)


class RateLimitedLog:
    """Log one kind of event at most ``burst`` times per ``interval_s`` seconds, with
    the number of occurrences suppressed in the last window on the next line
    logged (so a flood of refused connections cannot flood the log).

    Usage::

        refused = RateLimitedLog(log, logging.WARNING, 10.0)
        refused("refusing connection from %s: %d connections", peer, n)
    """

    __slots__ = ("logger", "level", "interval_s", "burst", "_next", "_left", "_suppressed")

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING, interval_s: float = 10.0,
                 burst: int = 1):
        self.logger = logger
        self.level = level
        self.interval_s = interval_s
        self.burst = max(1, burst)
        self._next = 0.0
        self._left = 0  # lines still allowed in the window that ends at _next
        self._suppressed = 0

    def __call__(self, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` unless the window's lines are spent; True when it was logged."""
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval_s
            self._left = self.burst
        elif not self._left:
            self._suppressed += 1
            return False
        self._left -= 1
        if self._suppressed:
            msg = msg + " (%d more like this in the last %g s)"
            args = (*args, self._suppressed, self.interval_s)
            self._suppressed = 0
        self.logger.log(self.level, msg, *args)
        return True
