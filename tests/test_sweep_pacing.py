"""The pauses between two sweeps of a client's address list (fastlock/client/sweep.py).

While an address answers ``WAITING`` (a standby, a promoting node) the pause is at most
``WAITING_BACKOFF_MAX`` for ``WAITING_FAST_SWEEPS`` pauses, then doubles to the usual
longest one: a client finds a new primary soon after its promotion, and a client waiting
through a long failover sends a bounded number of sweeps.  The pauses are read from
:class:`SweepPacing` and from :func:`find_primary` with ``asyncio.sleep`` replaced by a
recorder (no time passes), against a connector that answers like a standby.
"""

from __future__ import annotations

import asyncio

import pytest

from fastlock.client import sweep
from fastlock.client.connection import BACKOFF_FIRST, BACKOFF_MAX
from fastlock.client.sweep import (
    WAITING_BACKOFF_MAX,
    WAITING_FAST_SWEEPS,
    AddressAnswer,
    NoPrimaryFound,
    Outcome,
    SweepPacing,
    find_primary,
)


def test_waiting_answers_cap_the_pause_for_a_bounded_number_of_sweeps():
    pacing = SweepPacing(BACKOFF_FIRST, BACKOFF_MAX)
    fast = [pacing.next_pause(True) for _ in range(WAITING_FAST_SWEEPS)]
    assert all(0 < p <= WAITING_BACKOFF_MAX for p in fast)
    later = [pacing.next_pause(True) for _ in range(20)]
    assert all(BACKOFF_MAX / 2 <= p <= BACKOFF_MAX for p in later[3:])


@pytest.mark.parametrize("jitter", [0.5, 1.0])
def test_after_the_fast_pauses_the_pause_doubles_from_the_fast_cap(monkeypatch, jitter):
    """The pause sequence with the jitter pinned at its bounds: the fast pauses double from
    the first pause to the fast cap and stay there; the pauses after them double from the
    fast cap (0.1, 0.2, 0.4 s) to the longest, never jumping to the longest at once."""
    monkeypatch.setattr(sweep.random, "uniform", lambda low, high: jitter)
    pacing = SweepPacing(BACKOFF_FIRST, BACKOFF_MAX)
    pauses = [pacing.next_pause(True) for _ in range(WAITING_FAST_SWEEPS + 6)]
    fast_values = [BACKOFF_FIRST, 2 * BACKOFF_FIRST, 4 * BACKOFF_FIRST] + [WAITING_BACKOFF_MAX] * (
        WAITING_FAST_SWEEPS - 3)
    later_values = [WAITING_BACKOFF_MAX, 2 * WAITING_BACKOFF_MAX, 4 * WAITING_BACKOFF_MAX, BACKOFF_MAX,
                    BACKOFF_MAX, BACKOFF_MAX]
    assert pauses == pytest.approx([jitter * v for v in fast_values + later_values])


def test_a_waiting_answer_after_long_pauses_brings_the_fast_cap_back(monkeypatch):
    """Pauses grown to the longest (no address answered ``WAITING``) drop to the fast cap at
    the first ``WAITING`` answer, and double from it once the fast pauses are spent."""
    monkeypatch.setattr(sweep.random, "uniform", lambda low, high: high)
    pacing = SweepPacing(BACKOFF_FIRST, BACKOFF_MAX)
    grown = [pacing.next_pause(False) for _ in range(6)]
    assert grown[-1] == pytest.approx(BACKOFF_MAX)
    assert pacing.next_pause(True) == pytest.approx(WAITING_BACKOFF_MAX)
    assert pacing.next_pause(False) == pytest.approx(WAITING_BACKOFF_MAX)
    assert pacing.next_pause(False) == pytest.approx(2 * WAITING_BACKOFF_MAX)


def test_a_longest_pause_below_the_fast_cap_bounds_every_pause(monkeypatch):
    """A ride-through's longest pause may be below the fast cap (a short lease): every pause,
    fast or not, stays within it."""
    monkeypatch.setattr(sweep.random, "uniform", lambda low, high: high)
    pacing = SweepPacing(BACKOFF_FIRST, 0.05)
    pauses = [pacing.next_pause(i % 3 != 0) for i in range(WAITING_FAST_SWEEPS + 20)]
    assert max(pauses) == pytest.approx(0.05) and pauses[0] == pytest.approx(BACKOFF_FIRST)


def test_without_waiting_answers_the_pause_doubles_to_the_longest():
    pacing = SweepPacing(BACKOFF_FIRST, BACKOFF_MAX)
    pauses = [pacing.next_pause(False) for _ in range(12)]
    assert BACKOFF_FIRST / 2 <= pauses[0] <= BACKOFF_FIRST
    assert all(BACKOFF_MAX / 2 <= p <= BACKOFF_MAX for p in pauses[-4:])


class StandbyOnly:
    """A connector whose every sweep hears a standby (``WAITING``); a primary answers the
    ``promoted_at``-th sweep."""

    proto = None
    closed = False

    def __init__(self, promoted_at: int) -> None:
        self.sweeps = 0
        self.promoted_at = promoted_at

    async def ensure_connected(self, deadline=None):
        self.sweeps += 1
        if self.sweeps >= self.promoted_at:
            return "primary"
        raise NoPrimaryFound((AddressAnswer("127.0.0.1", 7421, "not the primary (role standby)", Outcome.WAITING),))


async def test_a_first_connect_sweeps_often_while_a_standby_answers_then_backs_off(monkeypatch):
    pauses: list[float] = []

    async def recorded(delay, result=None):
        pauses.append(delay)
        return result

    connector = StandbyOnly(promoted_at=WAITING_FAST_SWEEPS + 30)
    monkeypatch.setattr(asyncio, "sleep", recorded)
    assert await find_primary(connector, None, None, BACKOFF_FIRST, BACKOFF_MAX) == "primary"
    monkeypatch.undo()
    assert connector.sweeps == WAITING_FAST_SWEEPS + 30 and len(pauses) == connector.sweeps - 1
    assert all(p <= WAITING_BACKOFF_MAX for p in pauses[:WAITING_FAST_SWEEPS])
    assert all(p >= BACKOFF_MAX / 2 for p in pauses[WAITING_FAST_SWEEPS + 4:])
    # the bound on one client's sweeps: over any 10 s of pauses, at most the fast ones plus
    # one sweep every BACKOFF_MAX / 2
    elapsed, sweeps = 0.0, 0
    for p in pauses:
        elapsed += p
        if elapsed > 10.0:
            break
        sweeps += 1
    assert sweeps <= WAITING_FAST_SWEEPS + 10.0 / (BACKOFF_MAX / 2) + 4
