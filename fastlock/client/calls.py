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

# compiled (fastlock/client/_path.pyx): the call is a coroutine of C, its bound one entry of a dict
from ._path import IDEMPOTENT_OPS, AttemptBound, AttemptBounds, attempt_bounds, call

__all__ = ["IDEMPOTENT_OPS", "AttemptBound", "AttemptBounds", "attempt_bounds", "call"]
