"""The slow paths of :meth:`Client.acquire <fastlock.client.Client.acquire>`.

- :func:`acquire_retry` rides an acquire through a failover with the same
  owner key, so a grant made before the failure is found again, never made
  twice (as ZooKeeper's lock recipe finds its own node again);
- :func:`verify_late_grant` checks, with one EXTEND, a grant that was read
  with less than :data:`~fastlock.client.client.LATE_GRANT_FRACTION` of its
  TTL left, instead of returning a lease that may already be dead.

The first attempt of an acquire (the normal path) stays in ``Client.acquire``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..errors import FastlockError, LeaseLost
from ..logsafe import quote
from .connection import RETRYABLE, ClientConnection, Connector, RideThrough
from .lease import Lease

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

log = logging.getLogger(__name__)

__all__ = ["acquire_retry", "verify_late_grant"]


async def acquire_retry(connector: Connector, connect_timeout: float, request: tuple[Any, ...], owner: bytes,
                        started: float, proto: ClientConnection | None = None,
                        exc: BaseException | None = None) -> tuple[list[Any], float]:
    """Ride an acquire through a failover: same owner key, the wait that is
    left, until ``started + wait + connect_timeout``.  Returns the reply and
    the ``loop.time()`` its request was sent.  ``request``: ``(name, ttl_ms,
    wait_ms, delay_ms, correlation_id, kind)`` (``kind``: ACQUIRE's trailing
    arguments, see :func:`~fastlock.client.kinds.kind_args`); ``connect_timeout`` in seconds."""
    name, ttl_ms, wait_ms, delay_ms, correlation_id, kind = request
    loop = asyncio.get_running_loop()
    wait_end = None if wait_ms < 0 else started + wait_ms / 1000.0
    deadline = None if wait_end is None else wait_end + connect_timeout
    pacing = RideThrough(connector, deadline)
    pause = False
    if exc is not None:
        if connector.closed:
            connector.orphans.append((name, owner))
            raise exc
        pause = pacing.failed(proto, exc)
    while True:
        try:
            proto = await pacing.connection(pause)
        except BaseException:
            # the grant may have been made before the failure: cancel by owner
            # (now, or on the next connection) so that it is released, not left to its TTL
            connector.withdraw(connector.proto, name, owner)
            raise
        if wait_end is None:
            left_ms = -1
        else:
            left_ms = max(0, int((wait_end - loop.time()) * 1000))
        sent = loop.time()
        try:
            reply = await proto.request(P.OP_ACQUIRE, name, owner, ttl_ms, left_ms, delay_ms, correlation_id, *kind)
            return reply, sent
        except asyncio.CancelledError:
            connector.withdraw(proto, name, owner)
            raise
        except RETRYABLE as err:
            if connector.closed:
                connector.orphans.append((name, owner))
                raise
            pause = pacing.failed(proto, err)


async def verify_late_grant(client: Client, lease: Lease, request: tuple[Any, ...], started: float) -> Lease:
    """A grant read with less than :data:`LATE_GRANT_FRACTION` of its TTL
    left by the conservative estimate: verify it with one EXTEND, or give
    it back and queue again while the wait allows (see :meth:`Client.acquire`)."""
    loop = asyncio.get_running_loop()
    name, ttl_ms, wait_ms, delay_ms, correlation_id, kind = request
    shared, limit = (kind + (False, 0))[:2]
    log.warning("grant of %s token %d was read with %.3f s of its %.3f s TTL left (this process or the "
                "network stalled); verifying it with the server", quote(lease.name), lease.fencing_token,
                lease.expires_at - loop.time(), lease.ttl)
    try:
        verified = await client.extend(lease)
    except FastlockError as exc:
        log.warning("late grant of %s token %d could not be verified (%s); giving it back",
                    quote(lease.name), lease.fencing_token, exc)
        lease.lost.set()
        client.release_nowait(lease)
    else:
        if verified.expires_at > loop.time():
            return verified
        lease.lost.set()
        client.release_nowait(lease)
    if wait_ms < 0:
        return await client.acquire(name, ttl=ttl_ms / 1000.0, wait=None, lock_delay=delay_ms / 1000.0,
                                    correlation_id=correlation_id, shared=shared, limit=limit)
    left = started + wait_ms / 1000.0 - loop.time()
    if wait_ms > 0 and left > 0:
        return await client.acquire(name, ttl=ttl_ms / 1000.0, wait=left, lock_delay=delay_ms / 1000.0,
                                    correlation_id=correlation_id, shared=shared, limit=limit)
    raise LeaseLost(f"{name!r} was granted (token {lease.fencing_token}) but the grant was read too late to "
                    f"prove the lease alive, and the wait had no time left to queue again")
