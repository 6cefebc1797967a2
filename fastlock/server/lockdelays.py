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
"""

from __future__ import annotations

from typing import Any

from .. import protocol as P
from ..units import monotonic_ms, wall_ms


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
