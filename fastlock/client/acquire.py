"""The slow paths of :meth:`Client.acquire <fastlock.client.Client.acquire>`.

- :func:`acquire_retry` rides an acquire through a failover with the same
  owner key, so a grant made before the failure is found again, never made
  twice (as ZooKeeper's lock recipe finds its own node again);
- :class:`HeldLeases` refuses an acquire of a lock the same client
  holds already (it would queue behind itself);
- :func:`verify_late_grant` checks, with one EXTEND, a grant that was read
  with less than :data:`~fastlock.client.client.LATE_GRANT_FRACTION` of its
  TTL left, instead of returning a lease that may already be dead.

The first attempt of an acquire (the normal path) stays in ``Client.acquire``, its
compiled steps in ``fastlock/client/_path.pyx``.  Who calls (:class:`Caller`,
:func:`current_caller`, :func:`party`, :func:`actor_id`) and :class:`HeldLeases` are
compiled in ``fastlock/client/_callers.pyx`` and named here.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import protocol as P
from ..errors import FastlockError, InvalidArgument, LeaseLost, ProtocolError
from ..logsafe import quote
from ..protocol.ops import OP_ACQUIRE_PRIORITY
from ._callers import (
    CALLER,
    MAX_ANCESTRY,
    SWEEP_MIN,
    Caller,
    HeldLease,
    HeldLeases,
    actor_id,
    acts_for,
    current_caller,
    new_caller,
    party,
)
from .connection import RETRYABLE, ClientConnection, Connector, RideThrough
from .lease import Lease
from .preempt import send_revoke_request

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

log = logging.getLogger(__name__)

# Caller, party, current_caller, new_caller, acts_for, actor_id, CALLER, MAX_ANCESTRY, HeldLease, HeldLeases and
# SWEEP_MIN are compiled (fastlock/client/_callers.pyx): imported from there, and named here
__all__ = ["MAX_ANCESTRY", "SWEEP_MIN", "AcquireRequest", "SentReply", "acquire_retry", "duration_ms",
           "verify_late_grant", "HeldLease", "HeldLeases", "CALLER", "Caller", "current_caller", "new_caller",
           "acts_for", "party", "actor_id", "with_actor", "extend_args", "extended_ms"]


class AcquireRequest(NamedTuple):
    """One acquire as :meth:`Client.acquire <fastlock.client.Client.acquire>` checked it,
    for its slow paths (a retry through a failover, a late grant's verification)."""

    name: str
    owner: bytes  #: the owner key: the same on every retry, so a grant is found again, never made twice
    ttl_ms: int
    wait_ms: int  #: -1: wait forever, 0: try once
    lock_delay_ms: int
    correlation_id: str | None
    kind: tuple[Any, ...]  #: ACQUIRE's trailing kind arguments (see :func:`~fastlock.client.kinds.kind_args`)
    priority: int = 0  #: 0..MAX_PRIORITY; above 0 it is sent as ACQUIRE_PRIORITY (see :func:`acquire_call`)
    #: ms: the grace of the revoke request sent right behind each attempt that may wait (None: none)
    preempt_ms: int | None = None


class SentReply(NamedTuple):
    """An ACQUIRE's reply and when (``loop.time()``, seconds) its request was sent."""

    reply: list[Any]
    sent: float


def duration_ms(value: Any, what: str, *, allow_zero: bool = False) -> int:
    """:func:`fastlock.units.seconds_to_ms` (same result, same errors), with the
    common case - a finite positive ``float`` or ``int`` - decided in one test
    (the normal path of an acquire)."""
    if (type(value) is float or type(value) is int) and 0 < value < 1e9:  # NaN fails the test
        return max(1, math.ceil(value * 1000))
    return P.seconds_to_ms(value, what, allow_zero=allow_zero)



def with_actor(connector: Connector, kind: tuple[Any, ...], who: object = None) -> tuple[Any, ...]:
    """ACQUIRE's trailing arguments: ``kind`` (see :func:`~fastlock.client.kinds.kind_args`)
    and, to a server that reads it (HELLO's ``"actors"``), the caller's :func:`actor_id`
    (``who``: the :func:`current_caller`, if the caller has it); then ``True`` when the
    client asks for sequencers (``connect(sequencers=True)``).

    :raises InvalidArgument: sequencers asked for, and the server holds no sequencer key."""
    if asks_sequencers(connector):
        return (*kind_pair(kind), actor_id(connector, who), True)
    if not connector.server_info.get("actors"):
        return kind
    return (*kind_pair(kind), actor_id(connector, who))


def asks_sequencers(connector: Connector) -> bool:
    """True when the client asks for signed sequencers (``connect(sequencers=True)``).

    :raises InvalidArgument: sequencers asked for, and the server holds no sequencer key."""
    if not connector.sequencers:
        return False
    if not connector.server_info.get("sequencers"):
        raise InvalidArgument("this client asks for sequencers and the server hands out none "
                              "(no sequencer key in its credentials: `fastlock credentials sequencer-key`)")
    return True


def acquire_call(connector: Connector, kind: tuple[Any, ...], priority: int,
                 who: object = None) -> tuple[int, tuple[Any, ...]]:
    """The op and trailing arguments of an acquire: ACQUIRE with :func:`with_actor`'s, or for a
    priority above 0, ACQUIRE_PRIORITY with shared, limit, actor and the priority, then ``True``
    when the client asks for sequencers (:mod:`fastlock.server.preemption`).  ``who``: the
    :func:`current_caller`, if the caller has it.

    :raises InvalidArgument: sequencers asked for, and the server holds no sequencer key."""
    if not priority:
        return P.OP_ACQUIRE, with_actor(connector, kind, who)
    actor = actor_id(connector, who) if connector.server_info.get("actors") else 0
    if asks_sequencers(connector):
        return OP_ACQUIRE_PRIORITY, (*kind_pair(kind), actor, priority, True)
    return OP_ACQUIRE_PRIORITY, (*kind_pair(kind), actor, priority)


def kind_pair(kind: tuple[Any, ...]) -> tuple[bool, int]:
    """``(shared, limit)`` of ACQUIRE's trailing kind arguments (``()``, ``(True,)`` or ``(False, limit)``)."""
    return (bool(kind[0]) if kind else False, kind[1] if len(kind) > 1 else 0)


async def acquire_retry(connector: Connector, connect_timeout: float, request: AcquireRequest,
                        started: float, proto: ClientConnection | None = None,
                        exc: BaseException | None = None) -> SentReply:
    """Ride an acquire through a failover: same owner key, the wait that is
    left, until ``started + wait + connect_timeout`` (``started``: ``loop.time()``;
    ``connect_timeout`` in seconds).  ``proto`` and ``exc``: the connection of a first
    attempt and the error it ended with.  Returns the reply and when its request was sent.

    :raises: the last retryable error once the deadline has passed; ``asyncio.CancelledError``
        (the waiter is withdrawn by owner key)."""
    name, owner, ttl_ms, wait_ms, delay_ms, correlation_id, kind = request[:7]
    op, tail = acquire_call(connector, kind, request.priority)
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
            fut = proto.request(op, name, owner, ttl_ms, left_ms, delay_ms, correlation_id, *tail)
            if request.preempt_ms is not None and left_ms != 0:
                # asked again at each node: a deadline the new primary already has (replicated) stays
                send_revoke_request(proto, name, owner, request.preempt_ms)
            reply = await fut
            return SentReply(reply, sent)
        except asyncio.CancelledError:
            connector.withdraw(proto, name, owner)
            raise
        except RETRYABLE as err:
            if connector.closed:
                connector.orphans.append((name, owner))
                raise
            pause = pacing.failed(proto, err)


async def verify_late_grant(client: Client, lease: Lease, request: AcquireRequest, started: float) -> Lease:
    """A grant read with less than :data:`LATE_GRANT_FRACTION` of its TTL
    left by the conservative estimate: verify it with one EXTEND, or give
    it back and queue again while the wait allows (see :meth:`Client.acquire`)."""
    loop = asyncio.get_running_loop()
    shared, limit = kind_pair(request.kind)
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
    left = started + request.wait_ms / 1000.0 - loop.time()
    if request.wait_ms < 0 or (request.wait_ms > 0 and left > 0):
        return await client.acquire(request.name, ttl=request.ttl_ms / 1000.0,
                                    wait=None if request.wait_ms < 0 else left,
                                    lock_delay=request.lock_delay_ms / 1000.0,
                                    correlation_id=request.correlation_id, shared=shared, limit=limit,
                                    priority=request.priority)
    raise LeaseLost(f"{request.name!r} was granted (token {lease.fencing_token}) but the grant was read too late to "
                    f"prove the lease alive, and the wait had no time left to queue again")


def extend_args(lease: Lease, ttl_ms: int) -> tuple[Any, ...]:
    """EXTEND's arguments for ``lease`` renewed for ``ttl_ms`` milliseconds: with the
    ``sequencer`` flag when the lease carries a signed sequencer, so the reply brings it
    re-signed with the renewed expiry (:func:`extended_ms`)."""
    if lease.state.sequencer is not None:
        return (lease.name, lease.fencing_token, lease.owner, ttl_ms, True)
    return (lease.name, lease.fencing_token, lease.owner, ttl_ms)


def extended_ms(lease: Lease, granted: Any) -> int:
    """The TTL (milliseconds) an EXTEND reply ``granted`` gave ``lease``; a reply
    ``[ttl_ms, {"sequencer": bytes}]`` (an EXTEND with the ``sequencer`` flag) also replaces
    the lease's sequencer by the re-signed one (every copy of the lease sees it).

    :raises ProtocolError: a reply of another shape."""
    if type(granted) is int:
        return granted
    if type(granted) is list and len(granted) == 2 and type(granted[0]) is int and type(granted[1]) is dict:
        blob = granted[1].get("sequencer")
        if type(blob) is bytes:
            lease.state.sequencer = blob
        return granted[0]
    raise ProtocolError(f"unexpected EXTEND reply: {type(granted).__name__}")
