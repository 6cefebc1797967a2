"""The slow paths of :meth:`Client.acquire <fastlock.client.Client.acquire>`.

- :func:`acquire_retry` rides an acquire through a failover with the same
  owner key, so a grant made before the failure is found again, never made
  twice (as ZooKeeper's lock recipe finds its own node again);
- :class:`HeldLeases` refuses an acquire of a lock the same client
  holds already (it would queue behind itself);
- :func:`verify_late_grant` checks, with one EXTEND, a grant that was read
  with less than :data:`~fastlock.client.client.LATE_GRANT_FRACTION` of its
  TTL left, instead of returning a lease that may already be dead.

The first attempt of an acquire (the normal path) stays in ``Client.acquire``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import weakref
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import protocol as P
from ..errors import AlreadyHeld, FastlockError, LeaseLost
from ..logsafe import quote
from .connection import RETRYABLE, ClientConnection, Connector, RideThrough
from .lease import Lease

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

log = logging.getLogger(__name__)

__all__ = ["AcquireRequest", "SentReply", "acquire_retry", "duration_ms", "verify_late_grant", "HeldLease",
           "HeldLeases", "CALLER", "current_caller", "actor_id", "with_actor"]


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

#: who acquires, for the self-wait check: the blocking client sets its calling
#: thread (its tasks inherit the context); unset, the current asyncio task is the caller
CALLER: ContextVar[object | None] = ContextVar("fastlock_caller", default=None)


def current_caller(loop: asyncio.AbstractEventLoop | None = None) -> object:
    """The thread (blocking client) or the asyncio task that calls now; ``loop``: the
    running loop, if the caller has it (CPython finds it with a ``getpid()`` call otherwise)."""
    who = CALLER.get()
    return who if who is not None else asyncio.current_task(loop)


_ACTORS: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
_ACTORS_LOCK = threading.Lock()
_NEXT_ACTOR = itertools.count(1)


def actor_id() -> int:
    """This process's number (1, 2, ...; never reused) for the calling task or thread
    (see :func:`current_caller`): the ``actor`` by which the server's deadlock detection
    tells the waits of one connection apart; 0 outside a task."""
    who = current_caller()
    if who is None:
        return 0
    with _ACTORS_LOCK:
        n = _ACTORS.get(who)
        if n is None:
            n = _ACTORS[who] = next(_NEXT_ACTOR)
    return n


def with_actor(connector: Connector, kind: tuple[Any, ...]) -> tuple[Any, ...]:
    """ACQUIRE's trailing arguments: ``kind`` (see :func:`~fastlock.client.kinds.kind_args`)
    and, to a server that reads it (HELLO's ``"actors"``), the caller's :func:`actor_id`."""
    if not connector.server_info.get("actors"):
        return kind
    return (*kind_pair(kind), actor_id())


def kind_pair(kind: tuple[Any, ...]) -> tuple[bool, int]:
    """``(shared, limit)`` of ACQUIRE's trailing kind arguments (``()``, ``(True,)`` or ``(False, limit)``)."""
    return (bool(kind[0]) if kind else False, kind[1] if len(kind) > 1 else 0)


#: the smallest size at which :class:`HeldLeases` sweeps out ended leases
SWEEP_MIN = 1024


class HeldLease(NamedTuple):
    """An entry of :attr:`HeldLeases.by_name`: the last lease granted of a name, to whom."""

    lease: Lease
    caller: object  #: the task or thread it went to (see :func:`current_caller`)
    exclusive: bool  #: neither a shared lease nor a semaphore permit


class HeldLeases:
    """The last lease a client was granted per lock name, and the task (or blocking
    client's thread) it went to: the self-wait check of :meth:`Client.acquire
    <fastlock.client.Client.acquire>`.  An entry goes on release; entries of leases that
    ended otherwise (expired, lost) are swept out whenever the table has doubled since
    the last sweep, so it holds at most about twice the live leases."""

    __slots__ = ("by_name", "_sweep_at")

    def __init__(self) -> None:
        #: lock name -> its entry; read directly by ``Client.acquire`` (one lookup)
        self.by_name: dict[str, HeldLease] = {}
        self._sweep_at = SWEEP_MIN

    def remember(self, lease: Lease, exclusive: bool, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Record ``lease`` as the caller's grant of its name (``exclusive``: not a
        shared lease nor a semaphore permit; ``loop``: the running loop, if known)."""
        by_name = self.by_name
        by_name[lease.name] = HeldLease(lease, current_caller(loop), exclusive)
        if len(by_name) >= self._sweep_at:
            for name, entry in list(by_name.items()):
                if entry.lease.lost.is_set() or entry.lease.time_left() <= 0:
                    del by_name[name]
            self._sweep_at = max(SWEEP_MIN, 2 * len(by_name))

    def forget(self, lease: Lease) -> None:
        """Drop ``lease`` if it is the entry of its name (any copy of it)."""
        entry = self.by_name.get(lease.name)
        if entry is not None and entry.lease.state is lease.state:
            del self.by_name[lease.name]

    def refuse_self_wait(self, entry: HeldLease, exclusive: bool) -> None:
        """Raise :class:`AlreadyHeld` if ``entry`` (from :attr:`by_name`) belongs to the
        caller, is still live (not lost, its TTL not passed by the client's estimate)
        and either it or the request (``exclusive``) is exclusive: a shared lease or a
        permit asked by a holder of a shared lease or a permit can be granted beside it.
        A dead entry is dropped."""
        lease = entry.lease
        if not (entry.exclusive or exclusive):
            return
        if lease.lost.is_set() or lease.time_left() <= 0:
            self.forget(lease)
            return
        if entry.caller is not current_caller():
            return  # another task or thread of this client: waiting for it is no deadlock
        raise AlreadyHeld(f"this client already holds {quote(lease.name)} (fencing token {lease.fencing_token}); "
                          "a second acquire would wait for itself (pass queue_behind_self=True to queue anyway)",
                          lease.fencing_token)


async def acquire_retry(connector: Connector, connect_timeout: float, request: AcquireRequest,
                        started: float, proto: ClientConnection | None = None,
                        exc: BaseException | None = None) -> SentReply:
    """Ride an acquire through a failover: same owner key, the wait that is
    left, until ``started + wait + connect_timeout`` (``started``: ``loop.time()``;
    ``connect_timeout`` in seconds).  ``proto`` and ``exc``: the connection of a first
    attempt and the error it ended with.  Returns the reply and when its request was sent.

    :raises: the last retryable error once the deadline has passed; ``asyncio.CancelledError``
        (the waiter is withdrawn by owner key)."""
    name, owner, ttl_ms, wait_ms, delay_ms, correlation_id, kind = request
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
            reply = await proto.request(P.OP_ACQUIRE, name, owner, ttl_ms, left_ms, delay_ms, correlation_id,
                                        *with_actor(connector, kind))
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
                                    correlation_id=request.correlation_id, shared=shared, limit=limit)
    raise LeaseLost(f"{request.name!r} was granted (token {lease.fencing_token}) but the grant was read too late to "
                    f"prove the lease alive, and the wait had no time left to queue again")
