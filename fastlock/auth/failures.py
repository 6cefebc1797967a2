"""Failed authentication: per-address bans and flood-proof logging (see
:mod:`fastlock.auth`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

__all__ = ["AuthFailures"]


class AuthFailures:
    """Per source address: ban after repeated failed authentications; flood-proof logging.

    After ``max_failures`` failures (0: never ban) from one address within ``window_s``
    seconds, that address is banned for ``ban_s`` seconds (doubling with each
    further ban, up to ``max_ban_s``): its HELLOs are refused without looking
    at the token, so guessing is bounded to ``max_failures`` tries per ban.  At
    most ``max_addresses`` addresses are tracked (the oldest is forgotten).

    Logging: the first failure of an address (after ``window_s`` without a ban)
    and every ban are logged at WARNING, at most ``max_lines`` of them per
    ``summary_every_s`` seconds; the other failures are counted and reported in
    one summary line at most every ``summary_every_s`` seconds.  ``clock`` returns
    monotonic seconds (for tests).
    """

    def __init__(self, *, max_failures: int = 5, window_s: float = 60.0, ban_s: float = 1.0,
                 max_ban_s: float = 300.0, max_addresses: int = 4096, summary_every_s: float = 10.0,
                 max_lines: int = 20, clock: Callable[[], float] = time.monotonic):
        self.max_failures = max_failures
        self.window_s = window_s
        self.ban_s = ban_s
        self.max_ban_s = max_ban_s
        self.max_addresses = max_addresses
        self.summary_every_s = summary_every_s
        self.max_lines = max_lines
        self._lines = 0  # lines logged in the current summary interval
        self._clock = clock
        # address -> [window start, failures in window, banned until, bans so far]
        self._by_address: dict[str, list] = {}
        self._suppressed = 0
        self._suppressed_addresses: set[str] = set()
        self._last_summary = clock()
        self.total = 0

    def banned_for(self, address: str) -> float:
        """Seconds left of ``address``'s ban (0.0: not banned)."""
        entry = self._by_address.get(address)
        if entry is None:
            return 0.0
        return max(0.0, entry[2] - self._clock())

    def failed(self, address: str, who: str, reason: str) -> None:
        """Record (and maybe log) one failed authentication from ``address``."""
        now = self._clock()
        self.total += 1
        entry = self._by_address.get(address)
        if entry is None:
            if len(self._by_address) >= self.max_addresses:
                self._by_address.pop(next(iter(self._by_address)))
            entry = self._by_address[address] = [now, 0, float("-inf"), 0]  # start, count, banned until, bans
        if now - entry[0] > self.window_s:
            entry[0], entry[1] = now, 0
        quiet = now - entry[2] > self.window_s  # no ban of this address ended within the window
        if now - entry[2] > self.max_ban_s:
            entry[3] = 0  # quiet for longer than the longest ban: bans start short again
        entry[1] += 1
        logged = False
        if entry[1] == 1 and quiet:
            logged = self._line(now, "authentication failed from %s (%s): %s; further failures from it are "
                                "summarised", address, who, reason)
        if self.max_failures and entry[1] >= self.max_failures and entry[2] <= now:
            ban = min(self.max_ban_s, self.ban_s * (2 ** entry[3]))
            entry[2] = now + ban
            entry[3] += 1
            entry[0], entry[1] = now, 0
            logged = self._line(now, "%s banned for %.0f s after %d failed authentications", address, ban,
                                self.max_failures) or logged
        if not logged:
            self._suppressed += 1
            self._suppressed_addresses.add(address)
        self._maybe_summarise(now)

    def _line(self, now: float, msg: str, *args) -> bool:
        """Log one line unless ``max_lines`` were logged in this summary interval (then the
        event goes into the summary): many addresses cannot flood the log either."""
        if now - self._last_summary >= self.summary_every_s:
            self._maybe_summarise(now)
        if self._lines >= self.max_lines:
            return False
        self._lines += 1
        log.warning(msg, *args)
        return True

    def refused_while_banned(self, address: str) -> None:
        """Count a HELLO refused because its address is banned (logged in the summary only)."""
        self.total += 1
        self._suppressed += 1
        self._suppressed_addresses.add(address)
        self._maybe_summarise(self._clock())

    def _maybe_summarise(self, now: float) -> None:
        if self._suppressed and now - self._last_summary >= self.summary_every_s:
            log.warning("%d more failed or refused authentications from %d addresses in the last %.0f s",
                        self._suppressed, len(self._suppressed_addresses), now - self._last_summary)
            self._suppressed = 0
            self._suppressed_addresses.clear()
            self._last_summary = now
            self._lines = 0
        elif not self._suppressed and now - self._last_summary >= self.summary_every_s:
            self._last_summary = now
            self._lines = 0
