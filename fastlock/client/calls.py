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
"""

from __future__ import annotations

import asyncio
from typing import Any

from .. import protocol as P
from ..protocol.ops import OP_KEY_GET, OP_KEY_LIST
from .connection import RETRYABLE, Connector, RideThrough

__all__ = ["IDEMPOTENT_OPS", "call"]

#: operations that may be sent again while an earlier attempt's outcome is unknown: a
#: second RELEASE finds the lease gone (taken as released, see :meth:`RideThrough.send`),
#: a second EXTEND renews again, the rest only read
IDEMPOTENT_OPS = frozenset({P.OP_RELEASE, P.OP_EXTEND, P.OP_CHECK, P.OP_STATUS, P.OP_PING, P.OP_HOLDER,
                            P.OP_LOCKS, P.OP_LOCK_INFO, OP_KEY_GET, OP_KEY_LIST, P.OP_CONTENDERS})


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
        check = None if attempt is None else loop.call_later(
            attempt, connector.reset_if_silent_since, started, f"{P.OP_NAMES.get(op, op)} got no reply in time")
        try:
            return await proto.request(op, *args)
        except RETRYABLE as exc:
            failed: BaseException = exc
            if connector.closed:
                raise
        finally:
            if check is not None:
                check.cancel()
        return await RideThrough(connector, started + op_timeout).send(op, args, proto, failed, attempt_timeout=attempt)
    deadline = asyncio.get_running_loop().time() + op_timeout
    return await RideThrough(connector, deadline).send(op, args, attempt_timeout=attempt)
