"""One call to the primary under one deadline: every operation of
:class:`~fastlock.client.Client` but acquires and renewals.

The call goes out on the open connection (the fast path, no retry state); a
lost connection or a refusal from a node that cannot serve sends it through
:class:`~fastlock.client.connection.RideThrough` until ``started +
op_timeout``.  An idempotent call (:data:`IDEMPOTENT_OPS`: a release, an
extend, the reads) also bounds each attempt by half that deadline: a server
that has sent nothing since the attempt went out (frozen, black-holed) is
given up on then, leaving the other half to find the next primary - the
connection's liveness watchdog alone takes the whole ``request_timeout`` to
notice, which would leave nothing of the deadline.  Non-idempotent calls (key
writes, revocations) wait for the watchdog: sending them twice could act
twice.

The attempt bounds of the calls on one connector share one timer
(:class:`AttemptBounds`), armed for the earliest bound outstanding, as etcd's
lessor keeps one timer for its earliest lease: a call records its bound and
drops it when its reply comes, with no timer of its own.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, NamedTuple

from .. import protocol as P
from ..protocol.ops import OP_KEY_GET, OP_KEY_LIST
from .connection import RETRYABLE, Connector, RideThrough

__all__ = ["IDEMPOTENT_OPS", "AttemptBound", "AttemptBounds", "attempt_bounds", "call"]

#: operations that may be sent again while an earlier attempt's outcome is unknown: a
#: second RELEASE finds the lease gone (taken as released, see :meth:`RideThrough.send`),
#: a second EXTEND renews again, the rest only read
IDEMPOTENT_OPS = frozenset({P.OP_RELEASE, P.OP_EXTEND, P.OP_CHECK, P.OP_STATUS, P.OP_PING, P.OP_HOLDER,
                            P.OP_LOCKS, P.OP_LOCK_INFO, OP_KEY_GET, OP_KEY_LIST, P.OP_CONTENDERS})


class AttemptBound(NamedTuple):
    """One first attempt's bound (:class:`AttemptBounds`)."""

    started: float  #: ``loop.time()`` when the request went out
    due: float  #: ``loop.time()`` by which the server must have sent something since ``started``
    op: int  #: the request's op, for the reason given


class AttemptBounds:
    """The attempt bounds of one connector's calls, on one timer.

    :meth:`begin` records a bound; the caller drops it from :attr:`outstanding` (by the
    key it got) when the reply comes.  The timer is armed for the earliest bound
    outstanding; when it fires, each bound that is due and still outstanding is
    checked as a timer of its own would check it
    (:meth:`Connector.reset_if_silent_since
    <fastlock.client.connection.Connector.reset_if_silent_since>`: the connection is
    reset unless the server sent something since the request went out), then the timer
    is armed for the earliest bound left.

    Attributes:
        outstanding (dict[int, AttemptBound]): key -> the bound of an attempt whose
            reply has not come, in the order they began.
    """

    __slots__ = ("connector", "outstanding", "_loop", "_timer", "_timer_due", "_last_key")

    def __init__(self, connector: Connector, loop: asyncio.AbstractEventLoop):
        self.connector = connector
        self.outstanding: dict[int, AttemptBound] = {}
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = math.inf
        self._last_key = 0

    def begin(self, started: float, attempt: float, op: int) -> int:
        """Record the bound of an attempt sent at ``started`` (``loop.time()``) that must
        hear from the server within ``attempt`` seconds; return its key."""
        key = self._last_key = self._last_key + 1
        due = started + attempt
        self.outstanding[key] = _new_bound(AttemptBound, (started, due, op))
        if due < self._timer_due:
            self._arm(due)
        return key

    def _arm(self, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = due
        self._timer = self._loop.call_at(due, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._timer_due = math.inf
        now = self._loop.time()
        outstanding = self.outstanding
        due = [(key, bound) for key, bound in outstanding.items() if bound.due <= now]
        for key, _ in due:
            del outstanding[key]
        for _, bound in due:
            self.connector.reset_if_silent_since(bound.started,
                                                 f"{P.OP_NAMES.get(bound.op, bound.op)} got no reply in time")
        if outstanding:
            self._arm(min(bound.due for bound in outstanding.values()))


#: a NamedTuple made without its Python-level ``__new__``
_new_bound = tuple.__new__


def attempt_bounds(connector: Connector, loop: asyncio.AbstractEventLoop) -> AttemptBounds:
    """The connector's :class:`AttemptBounds` (made on first use, on ``loop``)."""
    bounds: AttemptBounds | None = connector.attempt_bounds
    if bounds is None:
        bounds = connector.attempt_bounds = AttemptBounds(connector, loop)
    return bounds


async def call(connector: Connector, op: int, args: tuple[Any, ...], op_timeout: float) -> Any:
    """Send ``op`` with ``args`` and return its reply's value, riding through a
    failover within ``op_timeout`` seconds (see the module docstring).

    Raises:
        ConnectionLost: no primary answered before the deadline.
        any other error the server replied with.
    """
    attempt = op_timeout / 2.0 if op in IDEMPOTENT_OPS else None
    proto = connector.proto
    if proto is not None and not proto.closed:
        loop = proto.loop
        started = loop.time()
        if attempt is not None:
            bounds = connector.attempt_bounds
            if bounds is None:
                bounds = attempt_bounds(connector, loop)
            key = bounds.begin(started, attempt, op)
        try:
            return await proto.request(op, *args)
        except RETRYABLE as exc:
            failed: BaseException = exc
            if connector.closed:
                raise
        finally:
            if attempt is not None:
                bounds.outstanding.pop(key, None)
        return await RideThrough(connector, started + op_timeout).send(op, args, proto, failed, attempt_timeout=attempt)
    deadline = asyncio.get_running_loop().time() + op_timeout
    return await RideThrough(connector, deadline).send(op, args, attempt_timeout=attempt)
