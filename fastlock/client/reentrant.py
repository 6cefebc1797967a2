"""Re-entrant locks (opt-in): :meth:`Client.reentrant_lock <fastlock.client.Client.reentrant_lock>`.

A re-entry by the caller that holds the lock - the same asyncio task, or a task it
created (the :class:`~fastlock.client.acquire.Caller` tree the self-wait check uses),
or, with the blocking client, the same thread - returns the same lease, with the same
fencing token, and counts; the lease is released when the count comes back to zero.
Another caller (an unrelated task, another thread, another client) queues on the
server as for any lock.  As Hazelcast's FencedLock (``lockAcquireLimit``), Curator's
InterProcessMutex (counted per thread) and PostgreSQL's advisory locks (counted).

**The count is kept by the client, not the server.**  The server holds one lease per
re-entrant hold, granted by the first acquire and renewed in the background; re-entries
and inner releases are local (no round trip, nothing logged).  The count is a property
of the caller, which only the client can see: the server knows a connection and an
owner key, and a re-entry sent to it would need the first acquire's owner key anyway.
What a server-side count would add - a count that outlives the client process - has
no use, since a lease outlives its process only until its TTL.  A re-entry into a lease
that was lost (expired, revoked) raises :class:`~fastlock.errors.LeaseLost` instead of
hiding the loss behind a count.

**The acquire limit** (``acquire_limit``; ``None``: 2**31 - 1) bounds the count: a re-entry
at the limit raises :class:`~fastlock.errors.AcquireLimitReached` at once, sending
nothing; it never waits for itself.  ``acquire_limit=1`` makes a lock that refuses
re-entry outright (Hazelcast's non-reentrant FencedLock).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..errors import AcquireLimitReached, FastlockError, InvalidArgument, LeaseLost, LockNotHeld, WrongArgumentType
from ..logsafe import quote
from .acquire import acts_for, current_caller
from .lease import Lease

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

__all__ = ["ReentrantLock", "ReentrantHold", "MAX_ACQUIRE_LIMIT", "check_acquire_limit"]

#: the largest ``acquire_limit`` (and the count of an unlimited re-entrant lock)
MAX_ACQUIRE_LIMIT = (1 << 31) - 1


def check_acquire_limit(value: Any) -> int:
    """``acquire_limit``: None (-> :data:`MAX_ACQUIRE_LIMIT`) or an int in 1 .. 2**31 - 1.

    Raises:
        WrongArgumentType: not an int (or None).
        InvalidArgument: out of range.
    """
    if value is None:
        return MAX_ACQUIRE_LIMIT
    if type(value) is not int:
        raise WrongArgumentType(f"acquire_limit must be an int or None, not {type(value).__name__}")
    if not 1 <= value <= MAX_ACQUIRE_LIMIT:
        raise InvalidArgument(f"acquire_limit must be in 1 .. {MAX_ACQUIRE_LIMIT}, got {value}")
    return value


class ReentrantHold:
    """One re-entrant hold of a name through one client.

    Attributes:
        caller (object): the task node or thread whose first acquire took it
            (see :func:`~fastlock.client.acquire.current_caller`).
        lease (Lease | None): the server's lease; None while the first acquire waits.
        granted (asyncio.Future[Lease]): resolved with the lease (or the first
            acquire's error), for re-entries made while it waits.
        count (int): how many acquires are not yet released.
    """

    __slots__ = ("caller", "lease", "granted", "count")

    def __init__(self, caller: object, granted: asyncio.Future[Lease]):
        self.caller = caller
        self.lease: Lease | None = None
        self.granted = granted
        self.count = 0


#: per client: lock name -> the hold of that name through the client
_HOLDS: weakref.WeakKeyDictionary[Client, dict[str, ReentrantHold]] = weakref.WeakKeyDictionary()


def _holds(client: Client) -> dict[str, ReentrantHold]:
    holds = _HOLDS.get(client)
    if holds is None:
        holds = _HOLDS[client] = {}
    return holds


class ReentrantLock:
    """A re-entrant lock on ``name`` (see the module's text); made by
    :meth:`Client.reentrant_lock <fastlock.client.Client.reentrant_lock>`.

    ``async with lock as lease:`` acquires (or re-enters) and releases one count on
    exit; :meth:`acquire` / :meth:`release` do the same by hand.  Every
    ``ReentrantLock`` of one name made from one client shares the hold.

    Args (checked at once):
        name: the lock's name.
        ttl: lease TTL in seconds; the lease is renewed in the background (``renew``).
        wait: seconds the first acquire waits (None: forever; 0: try once); a re-entry never waits.
        acquire_limit: the largest hold count (None: 2**31 - 1).
        lock_delay, correlation_id: as :meth:`Client.acquire <fastlock.client.Client.acquire>`.
    """

    __slots__ = ("client", "name", "ttl", "wait", "acquire_limit", "lock_delay", "correlation_id", "renew")

    def __init__(self, client: Client, name: str, *, ttl: float, wait: float | None = None,
                 acquire_limit: int | None = None, lock_delay: float = 0.0, correlation_id: str | None = None,
                 renew: bool = True):
        P.check_name(name)
        P.check_ttl_ms(P.seconds_to_ms(ttl, "ttl"))
        if wait is not None:
            P.check_wait_ms(P.seconds_to_ms(wait, "wait", allow_zero=True))
        self.client = client
        self.name = name
        self.ttl = ttl
        self.wait = wait
        self.acquire_limit = check_acquire_limit(acquire_limit)
        self.lock_delay = lock_delay
        self.correlation_id = correlation_id
        self.renew = bool(renew)

    def _mine(self) -> ReentrantHold | None:
        hold = _holds(self.client).get(self.name)
        if hold is not None and acts_for(current_caller(), hold.caller):
            return hold
        return None

    @property
    def hold_count(self) -> int:
        """How many times the calling task (or thread) holds the lock now (0: not held by it)."""
        hold = self._mine()
        return 0 if hold is None or hold.lease is None else hold.count

    def count_of(self, caller: object) -> int:
        """How many times ``caller`` (a thread of a blocking client, or a task's
        :class:`~fastlock.client.acquire.Caller`) holds the lock now."""
        hold = _holds(self.client).get(self.name)
        return 0 if hold is None or hold.lease is None or not acts_for(caller, hold.caller) else hold.count

    @property
    def lease(self) -> Lease | None:
        """The lease the calling task (or thread) holds, or None."""
        hold = self._mine()
        return None if hold is None else hold.lease

    async def acquire(self) -> Lease:
        """Acquire the lock, or re-enter it if the calling task (or thread) holds it.

        Returns the lease: on a re-entry the same lease (same fencing token).

        Raises:
            AcquireLimitReached: a re-entry with the count at ``acquire_limit`` (at once;
                nothing sent).
            LeaseLost: a re-entry into a hold whose lease is lost (expired, revoked).
            LockNotAcquired, ConnectionLost, ...: the first acquire's errors (as
                :meth:`Client.acquire <fastlock.client.Client.acquire>`).
        """
        holds = _holds(self.client)
        name = self.name
        who = current_caller()
        hold = holds.get(name)
        if hold is not None and acts_for(who, hold.caller):
            if hold.count >= self.acquire_limit:
                token = 0 if hold.lease is None else hold.lease.fencing_token
                raise AcquireLimitReached(f"{quote(name)} is held {hold.count} times by this caller "
                                          f"(token {token}): its acquire_limit is {self.acquire_limit}",
                                          token, hold.count)
            hold.count += 1
            try:
                lease = hold.lease if hold.lease is not None else await asyncio.shield(hold.granted)
                if lease.lost.is_set():
                    raise LeaseLost(f"{quote(name)} (token {lease.fencing_token}) was lost while held: "
                                    "a re-entry cannot hide it")
            except BaseException:
                await self._uncount(hold)
                raise
            return lease
        return await self._first(holds, who)

    async def _first(self, holds: dict[str, ReentrantHold], who: object) -> Lease:
        loop = asyncio.get_running_loop()
        mine = ReentrantHold(who, loop.create_future())
        mine.count = 1
        # another caller's hold: queue on the server (the hold is made ours only once granted)
        waiting_for_other = self.name in holds
        if not waiting_for_other:
            holds[self.name] = mine
        try:
            lease = await self.client.acquire(self.name, ttl=self.ttl, wait=self.wait, lock_delay=self.lock_delay,
                                              correlation_id=self.correlation_id)
        except BaseException as exc:
            if holds.get(self.name) is mine:
                del holds[self.name]
            if not mine.granted.done():
                mine.granted.set_exception(exc if isinstance(exc, Exception) else LeaseLost("acquire cancelled"))
                mine.granted.exception()  # retrieved: re-entries waiting on it raise it
            raise
        mine.lease = lease
        mine.granted.set_result(lease)
        holds[self.name] = mine  # the server granted it: any hold left of the name has ended
        if self.renew:
            self.client.start_renewing(lease)
        return lease

    async def release(self) -> None:
        """Release one count; the lease is released on the server when the count reaches 0.

        Raises:
            LockNotHeld: the calling task (or thread) does not hold the lock.
            LeaseLost: (the last release only) the lease was no longer held on the server.
            ConnectionLost: (the last release only) no primary reachable; the lease ends by its TTL.
        """
        hold = self._mine()
        if hold is None or hold.lease is None:
            raise LockNotHeld(f"{quote(self.name)} is not held by this caller through this client")
        await self._uncount(hold)

    async def _uncount(self, hold: ReentrantHold) -> None:
        hold.count -= 1
        if hold.count > 0:
            return
        holds = _holds(self.client)
        if holds.get(self.name) is hold:
            del holds[self.name]
        if hold.lease is not None:
            await self.client.release(hold.lease)

    async def __aenter__(self) -> Lease:
        return await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.release()
        except FastlockError:  # as Client.lock: a loss is on lease.lost, never raised into the caller's code
            pass

    def __repr__(self) -> str:
        return f"<ReentrantLock {self.name!r} acquire_limit={self.acquire_limit}>"
