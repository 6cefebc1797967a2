"""What one sweep of the address list heard, and the first connect's wait for a primary.

:class:`~fastlock.client.connection.Connector` tries every address once per
sweep; each address's answer is an :class:`AddressAnswer` whose
:class:`Outcome` says what it means for a client still looking for the
primary:

- ``WAITING``: a fastlock node answered that it is not the primary now - a
  standby (its primary named or not), a node promoting, a fenced primary,
  ``NotPrimary`` or ``Unavailable``.  A failover may be under way: a primary
  may appear, so looking again is worth it.
- ``DOWN``: nothing usable answered - the TCP connect was refused, timed out
  or was reset, or the connection ended (or went silent) before the
  handshake's reply; or a deposed node, which names no primary and will not
  become one.  A dead, frozen, restarting or deposed node.
- ``FINAL``: the address answered and looking again will not change it - a
  TLS failure (an untrusted or mismatched certificate), a peer that does not
  speak fastlock, a server that did not prove it holds this client's
  credential, a malformed handshake reply.

A sweep that finds no primary raises :class:`NoPrimaryFound` (a
:class:`~fastlock.errors.ConnectionLost`) carrying every answer.
:func:`find_primary` is the first connect of a client (``connect()``,
``SyncClient()``, the ``fastlock`` commands): it sweeps again, with backoff,
while some address answered ``WAITING``, until its deadline - the connect's
``failover_timeout`` - and fails at once when no address did (a server that
is simply down, or only ``FINAL`` answers).

The pause between two sweeps (:class:`SweepPacing`) doubles from a first one to
a longest one, with jitter; while some address answers ``WAITING`` (a standby
or a promoting node: a new primary may appear at any moment) it is at most
:data:`WAITING_BACKOFF_MAX` for the first :data:`WAITING_FAST_SWEEPS` pauses of
one operation, so a client finds a new primary within about 0.1 s of its
promotion, and one client's extra sweeps in one failover stay bounded.  The
doubling is held at :data:`WAITING_BACKOFF_MAX` during those fast pauses, so the
pauses after them double from it (0.1, 0.2, 0.4 s, then the longest) rather than
starting at the longest.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from typing import TYPE_CHECKING, NamedTuple

from ..errors import ConnectionLost
from ..logsafe import quote

if TYPE_CHECKING:  # pragma: no cover
    from .connection import ClientConnection, Connector

log = logging.getLogger(__name__)

__all__ = ["FAILOVER_TIMEOUT", "WAITING_BACKOFF_MAX", "WAITING_FAST_SWEEPS", "AddressAnswer", "NoPrimaryFound",
           "Outcome", "SweepPacing", "find_primary"]

#: seconds a client's first connect looks for a primary while a failover is under way
#: (:func:`find_primary`): longer than a pair's ``--failover-after`` (the README's 3 s) plus
#: its promotion, and an etcd group's ``--coordinator-ttl`` (2 s) plus its election
FAILOVER_TIMEOUT = 15.0
#: seconds: the longest pause between two sweeps while an address answers ``WAITING`` (jitter: half to all of it)
WAITING_BACKOFF_MAX = 0.1
#: how many pauses of one operation :data:`WAITING_BACKOFF_MAX` caps (about 4 s of sweeps: an etcd
#: group's TTL plus its election); the later ones double from :data:`WAITING_BACKOFF_MAX` to the
#: usual longest pause
WAITING_FAST_SWEEPS = 50


class Outcome(enum.Enum):
    """What an address's answer means for a client looking for the primary (see the module docstring)."""

    WAITING = "waiting"
    DOWN = "down"
    FINAL = "final"


class AddressAnswer(NamedTuple):
    """One address's answer in one sweep: ``host``, ``port``, ``reason`` (what it
    said, for the error message) and its :class:`Outcome`."""

    host: str
    port: int
    reason: str
    outcome: Outcome

    def __str__(self) -> str:
        return f"{self.host}:{self.port}: {self.reason}"


class NoPrimaryFound(ConnectionLost):
    """A sweep of every address found no primary that accepted this client.

    Attributes:
        answers (tuple[AddressAnswer, ...]): every address's answer, in the order tried.
    """

    def __init__(self, answers: tuple[AddressAnswer, ...], prefix: str = "could not connect to a fastlock primary"):
        super().__init__(f"{prefix}: " + "; ".join(str(a) for a in answers))
        self.answers = answers

    @property
    def failover_under_way(self) -> bool:
        """Some address answered as a fastlock node that is not the primary now (``WAITING``)."""
        return any(a.outcome is Outcome.WAITING for a in self.answers)

    @property
    def final(self) -> bool:
        """Every address gave a ``FINAL`` answer: sweeping again cannot find a primary."""
        return bool(self.answers) and all(a.outcome is Outcome.FINAL for a in self.answers)


class SweepPacing:
    """The pauses (seconds) before the next sweeps of one operation: ``first`` doubling to
    ``longest``, each a random half to all of the current value; while a failover is under
    way (an address answered ``WAITING``) at most :data:`WAITING_BACKOFF_MAX` (with the same
    jitter), for :data:`WAITING_FAST_SWEEPS` pauses.  A fast pause doubles the current value
    only up to :data:`WAITING_BACKOFF_MAX`, so the pauses after the fast ones double from
    there to ``longest``."""

    __slots__ = ("backoff", "longest", "fast_left")

    def __init__(self, first: float, longest: float) -> None:
        self.backoff = min(first, longest)
        self.longest = longest
        self.fast_left = WAITING_FAST_SWEEPS

    def next_pause(self, waiting: bool) -> float:
        """The next pause (seconds); ``waiting``: the last sweep or attempt heard a ``WAITING`` answer."""
        if waiting and self.fast_left > 0:
            self.fast_left -= 1
            current = min(self.backoff, WAITING_BACKOFF_MAX)
            self.backoff = min(current * 2.0, WAITING_BACKOFF_MAX, self.longest)
        else:
            current = self.backoff
            self.backoff = min(self.backoff * 2.0, self.longest)
        return random.uniform(0.5, 1.0) * current


async def find_primary(connector: Connector, deadline: float | None, failover_timeout: float | None,
                       backoff_first: float, backoff_max: float) -> ClientConnection:
    """The first connection of a client: sweep the addresses (one attempt shared with
    every other caller, :meth:`Connector.ensure_connected`); while a sweep finds no
    primary but some address answered ``WAITING``, pause (``backoff_first`` seconds
    doubling to ``backoff_max``, with jitter, :class:`SweepPacing`) and sweep again, until ``deadline``
    (``loop.time()``), or when that is None ``failover_timeout`` seconds from now
    (None too: no limit).  The first sweep always runs to its end, whatever the
    deadline.  An open connection is returned at once.

    Raises:
        NoPrimaryFound: a sweep in which no address answered ``WAITING`` (at once),
            or the deadline passed (the last sweep's answers, prefixed "within N s").
        ConnectionLost: the client was closed.
        AuthError: a server refused the credential (at once).
    """
    proto = connector.proto
    if proto is not None and not proto.closed:
        return proto
    started = asyncio.get_running_loop().time()
    if deadline is None and failover_timeout is not None:
        deadline = started + failover_timeout
    timeout = None if deadline is None else deadline - started
    loop = asyncio.get_running_loop()
    pacing = SweepPacing(backoff_first, backoff_max)
    last: NoPrimaryFound | None = None
    while True:
        if connector.closed:
            raise ConnectionLost("client is closed")
        try:
            if last is None:  # the first sweep runs to its end: its answers make the message
                return await connector.ensure_connected()
            return await connector.ensure_connected(deadline)
        except NoPrimaryFound as exc:
            if not exc.failover_under_way:
                raise
            if last is None:
                log.info("no primary yet, a failover may be under way (%s); looking again for %s", quote(str(exc)),
                         "ever" if timeout is None else f"up to {timeout:.3g} s")
            last = exc
        except ConnectionLost:
            if connector.closed or last is None:
                raise
            # the deadline passed during a sweep: the last complete sweep says more
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            assert last is not None
            within = f"{max(0.0, timeout):g} s" if timeout is not None else "the deadline"
            raise NoPrimaryFound(last.answers, f"no fastlock primary within {within} (failover_timeout); "
                                               "the last sweep") from None
        delay = pacing.next_pause(True)
        await asyncio.sleep(delay if left is None else min(delay, left))
