"""Running lock-delays kept across a restart and a promotion.

A lock-delay (Chubby's; Consul's session ``LockDelay``) starts when a lease
that has one expires: the lock is granted to nobody until ``deadline_ms +
lock_delay_ms``.  The lock table holds it on the monotonic clock, which does not
survive a restart, so the log holds it on the wall clock
(:class:`fastlock.wal.records.LockDelay`): logged at the expiry
(:func:`log_expired`), logged again for every running delay after each snapshot
(:func:`relog_running`: a snapshot holds leases only), and installed again at
recovery (:func:`install_recovered`) with what is left of it, capped at the
longest lock-delay so that a wall-clock jump cannot make it longer.  A standby
applies the same records to its table, so a promoted standby keeps the delay.

The table keeps a lock entry while its delay runs, so a lease with a lock-delay is
one entry from its grant to its delay's end whatever its TTL: :class:`RunningDelays`
counts each running delay against the principal whose lease started it, until it
ends (:class:`~fastlock.server.admission.PrincipalQuotas` counts it as a lease).
"""

from __future__ import annotations

import heapq
from typing import Any

from .. import protocol as P
from ..units import monotonic_ms, wall_ms
from ._wire import DelaysWire


def log_expired(wal: Any, ev: Any) -> None:
    """Log the lock-delay an EV_EXPIRED event with ``lock_delay_ms > 0`` starts."""
    left = ev.deadline_ms + ev.lock_delay_ms - monotonic_ms()
    if left > 0:
        wal.log_lock_delay(ev.name, wall_ms() + left)


def relog_running(wal: Any, table: Any) -> None:
    """Log every running lock-delay again (called right after a snapshot was started)."""
    wal.log_lock_delays(table.lock_delays(), monotonic_ms())


def install_recovered(table: Any, delays: list[tuple[str, int]], now: int) -> int:
    """Install the recovered lock-delays (``(name, until_wall_ms)``) still running, on
    the table's clock ``now`` (ms); returns how many."""
    wall = wall_ms()
    installed = 0
    for name, until_wall_ms in delays:
        left = min(until_wall_ms - wall, P.MAX_LOCK_DELAY_MS)
        if left > 0 and table.install_lock_delay(name, now + left, now):
            installed += 1
    return installed


class RunningDelays(DelaysWire):
    """The running lock-delays, each counted against a principal until it ends:
    ``per_principal`` (principal -> how many; empty exactly when none runs; a field of its
    compiled base), ``len()`` all of them."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, str]] = []  # (end on the monotonic clock in ms, principal)
        self.per_principal: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._heap)

    def started(self, principal: str, until_ms: int) -> None:
        """A lock-delay of ``principal``'s runs until ``until_ms`` (monotonic ms)."""
        heapq.heappush(self._heap, (until_ms, principal))
        self.per_principal[principal] = self.per_principal.get(principal, 0) + 1

    def ended(self, now: int) -> None:
        """Uncount every delay that ended by ``now`` (monotonic ms)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            principal = heapq.heappop(heap)[1]
            n = self.per_principal.get(principal, 0) - 1
            if n > 0:
                self.per_principal[principal] = n
            else:
                self.per_principal.pop(principal, None)

    def reset(self, principal: str, ends_ms: list[int]) -> None:
        """Count only the delays ending at ``ends_ms`` (monotonic ms), all ``principal``'s."""
        self._heap = [(until, principal) for until in ends_ms]
        heapq.heapify(self._heap)
        self.per_principal = {principal: len(ends_ms)} if ends_ms else {}
