"""Lease-bounded execution: stop protected work before the server could grant its lock
to another holder (see ``docs/bounded-execution.md``).

The server counts a lease's TTL from the moment it *handles* a grant or a renewal,
which is after the client *sent* it.  So from the send time of the last request the
server confirmed (``confirmed_sent``, on this process's monotonic clock), the server
cannot expire the lease - and so cannot grant the lock to anyone else - before
``confirmed_sent + ttl`` measured on its own clock; on this process's clock, if the two
monotonic clocks run at rates that differ by at most ``drift`` (a fraction), not before
:func:`earliest_regrant` ``= confirmed_sent + ttl * (1 - drift)``.  A lock-delay on the
server only makes the real moment later.  Work that must not outlive the lease stops at
that moment minus a ``margin`` the caller chooses (the time it needs to stop).

Today the confirmed request is the lease's own grant or last renewal (``Lease.expires_at
- Lease.ttl``); a session keep-alive would feed the same function.

- :class:`BoundedWork` cancels an asyncio task at its lease's stop moment (``client.lock(...,
  bounded=True)``);
- :func:`stop_at` is the moment itself, for code that checks a deadline (``lease.deadline()``);
- :class:`ProcessGuard` sends SIGTERM then SIGKILL to a subprocess so that the SIGKILL lands
  at the stop moment at the latest (the blocking client's subprocess mode, ``fastlock run``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import InvalidArgument, LeaseExpiring, WrongArgumentType
from ..logsafe import quote
from ..units import check_seconds

if TYPE_CHECKING:  # pragma: no cover
    from .lease import Lease

log = logging.getLogger(__name__)

__all__ = ["DRIFT_BOUND", "SERVER_CLOCK_STEP", "WorkBound", "earliest_regrant", "stop_at", "check_margin",
           "lock_bound", "BoundedWork", "ProcessGuard"]

#: the default bound on how much the server's and this process's monotonic clocks may
#: differ in rate, as a fraction (1e-3: 0.1 %, ten times a quartz crystal's worst drift
#: and twice the fastest slew NTP applies to CLOCK_MONOTONIC, 500 ppm)
DRIFT_BOUND = 1e-3

#: seconds: the server reads its monotonic clock in whole milliseconds (truncated), so a TTL
#: counted from a request's receipt, and a reported queue wait, may each start up to 1 ms early
SERVER_CLOCK_STEP = 0.002


class WorkBound(NamedTuple):
    """How bounded work is stopped.

    Attributes:
        margin (float): seconds before the earliest re-grant by which the work must
            have stopped (the time the work needs to stop, plus the event loop's or the
            scheduler's latency).
        drift (float): the clock-rate bound, a fraction in [0, 0.5) (default :data:`DRIFT_BOUND`).
    """

    margin: float
    drift: float = DRIFT_BOUND


def check_margin(margin: Any, drift: Any = DRIFT_BOUND) -> WorkBound:
    """A :class:`WorkBound` from a margin (seconds, finite, >= 0) and a drift (a fraction in [0, 0.5)).

    Raises:
        WrongArgumentType: not a number.
        InvalidArgument: out of range (or NaN).
    """
    for value, what in ((margin, "margin"), (drift, "drift")):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WrongArgumentType(f"{what} must be a number, not {type(value).__name__}")
    if not (math.isfinite(margin) and margin >= 0):
        raise InvalidArgument(f"margin must be a finite number of seconds >= 0, got {margin!r}")
    if not 0 <= drift < 0.5:
        raise InvalidArgument(f"drift must be in [0, 0.5), got {drift!r}")
    return WorkBound(float(margin), float(drift))


def lock_bound(bounded: bool, margin: Any, drift: Any, ttl: Any) -> WorkBound | None:
    """The :class:`WorkBound` of ``client.lock(..., bounded=, margin=, drift=)``, or None
    when not bounded.  ``margin`` None: a tenth of ``ttl`` (seconds).

    Raises:
        InvalidArgument / WrongArgumentType: a bad margin, drift or TTL; a margin not
            shorter than the TTL; a margin given without ``bounded=True``.
    """
    if not bounded:
        if margin is not None:
            raise InvalidArgument("margin is only meaningful with bounded=True")
        return None
    ttl = check_seconds(ttl, "ttl")
    bound = check_margin(ttl / 10.0 if margin is None else margin, drift)
    if bound.margin >= ttl * (1.0 - bound.drift):
        raise InvalidArgument(f"margin ({bound.margin:g} s) must be shorter than the TTL ({ttl:g} s)")
    return bound


def earliest_regrant(confirmed_sent: float, ttl: float, drift: float = DRIFT_BOUND) -> float:
    """The earliest moment, on this process's monotonic clock (seconds), at which the
    server could grant a lock to another holder: ``confirmed_sent + ttl * (1 - drift)``,
    less :data:`SERVER_CLOCK_STEP` (the server's millisecond clock).

    Args:
        confirmed_sent: when this process sent the last request the server confirmed for
            the lease (its grant, counting the reported queue wait, or its last renewal).
        ttl: the TTL in seconds that request gave the lease.
        drift: the bound on the two clocks' rate difference (a fraction).
    """
    return confirmed_sent + ttl * (1.0 - drift) - SERVER_CLOCK_STEP


def stop_at(lease: Lease, bound: WorkBound) -> float:
    """The moment (``loop.time()`` seconds, which is ``time.monotonic()`` for the stdlib
    and uvloop loops) by which work protected by ``lease`` must have stopped:
    :func:`earliest_regrant` of its last confirmed request, less ``bound.margin``."""
    return earliest_regrant(lease.expires_at - lease.ttl, lease.ttl, bound.drift) - bound.margin


class BoundedWork:
    """Cancel ``task`` at ``lease``'s stop moment (:func:`stop_at`), or at once when the
    lease is known lost; every renewal moves the moment.  ``client.lock(...,
    bounded=True)`` makes one for its body.

    A timer on the event loop: it cannot fire while the loop is blocked by user code or
    the process is stopped (see ``docs/bounded-execution.md``); it fires at once when
    the loop runs again, and the body sees the cancellation at its next ``await``.
    """

    __slots__ = ("lease", "task", "bound", "fired", "_loop", "_timer", "_remove")

    def __init__(self, lease: Lease, task: asyncio.Task[Any], bound: WorkBound):
        self.lease = lease
        self.task = task
        self.bound = bound
        #: the moment (loop.time()) the task was cancelled, or None
        self.fired: float | None = None
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._remove: Callable[[], None] | None = None

    def start(self) -> BoundedWork:
        health = self.lease.health
        self._remove = health.add_listener(self._on_health)
        self._check()
        return self

    def stop(self) -> None:
        """Stop watching (the work ended); idempotent."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._remove is not None:
            self._remove()
            self._remove = None

    def stop_at(self) -> float:
        return stop_at(self.lease, self.bound)

    def _on_health(self, state: str) -> None:
        self._check()

    def _check(self) -> None:
        if self._timer is not None:  # called by a health transition: one timer at a time
            self._timer.cancel()
            self._timer = None
        if self.fired is not None or self._remove is None:
            return
        lost = self.lease.lost.is_set()
        when = self.stop_at()
        if lost or self._loop.time() >= when:
            self._fire("the lease was lost" if lost else "the lease's earliest re-grant, less the margin, came")
            return
        # uvloop rounds timers to the millisecond: an early call looks again
        self._timer = self._loop.call_at(when, self._check)

    def _fire(self, why: str) -> None:
        self.fired = self._loop.time()
        self.stop()
        lease = self.lease
        log.warning("stopping the work protected by %s token %d: %s", quote(lease.name), lease.fencing_token, why)
        self.task.cancel(f"fastlock: {why}")

    def expiring(self) -> LeaseExpiring:
        lease = self.lease
        return LeaseExpiring(f"the work protected by {quote(lease.name)} (fencing token {lease.fencing_token}) "
                             f"was stopped: the lease could not be proven held until the server's earliest "
                             f"re-grant less a {self.bound.margin:g} s margin", lease.name, lease.fencing_token,
                             self.fired or 0.0)

    async def settle(self, exc_type: type[BaseException] | None) -> LeaseExpiring | None:
        """Called on the way out of the work, in its task: None if the work was not
        stopped by this bound; else the :class:`LeaseExpiring` to raise, once the
        cancellation this bound requested is taken back (delivered at once if the work
        ended before it arrived)."""
        self.stop()
        if self.fired is None:
            return None
        if exc_type is not asyncio.CancelledError:
            try:  # the request is still pending: take it here, not at the caller's next await
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                pass
        uncancel = getattr(self.task, "uncancel", None)
        if uncancel is not None and uncancel() > 0:
            return None  # someone else cancelled the task too: their cancellation goes on
        return self.expiring()


class ProcessGuard:
    """Stop a subprocess before the server could grant its lock to another holder: send
    SIGTERM at ``stop_at - grace`` and SIGKILL at ``stop_at`` (:func:`stop_at` with the
    guard's margin), or both at once when the lease is known lost; a renewal moves both.
    A thread of its own (``threading.Timer``-like), so neither a blocked event loop nor a
    busy calling thread delays it; a stopped (SIGSTOP) parent process cannot send them.

    Args:
        lease: the lease that protects the work (an asyncio :class:`~fastlock.client.Lease`,
            renewed by a loop whose ``loop.time()`` is ``time.monotonic()``).
        pid: the process to stop (with ``group=True``: its process group, which it leads).
        bound: the margin and drift.
        grace: seconds between SIGTERM and SIGKILL.
        group: signal the process group ``pid`` (``os.killpg``) instead of the process.

    Attributes:
        termed, killed (float | None): ``time.monotonic()`` when SIGTERM / SIGKILL were sent.
    """

    def __init__(self, lease: Lease, pid: int, bound: WorkBound, grace: float, *, group: bool = False):
        self.lease = lease
        self.pid = pid
        self.bound = bound
        self.grace = grace
        self.group = group
        self.termed: float | None = None
        self.killed: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fastlock-guard-{pid}", daemon=True)

    def start(self) -> ProcessGuard:
        self._thread.start()
        return self

    def stop(self) -> None:
        """The process ended (or the lease was released after it did): stop the guard."""
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def kill_at(self) -> float:
        """The moment (``time.monotonic()``) of the SIGKILL; SIGTERM is ``grace`` seconds before."""
        if self.lease.lost.is_set():
            return -math.inf
        return stop_at(self.lease, self.bound)

    def _run(self) -> None:
        # polls at most every 50 ms (a renewal moves the moment; a loss brings it to now)
        while not self._done.is_set():
            kill_at = self.kill_at()
            now = time.monotonic()
            if self.termed is None and now >= kill_at - self.grace:
                self.termed = now
                self._signal(signal.SIGTERM)
            if now >= kill_at:
                self.killed = time.monotonic()
                self._signal(signal.SIGKILL)
                return
            target = kill_at if self.termed is not None else kill_at - self.grace
            self._done.wait(min(0.05, max(0.0, target - now)))

    def _signal(self, signum: int) -> None:
        try:
            if self.group:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
