"""Double barriers and countdown latches on the key store: :meth:`Client.double_barrier
<fastlock.client.Client.double_barrier>` and :meth:`Client.latch <fastlock.client.Client.latch>`.

Both are built, as etcd's ``contrib/recipes`` and Curator build theirs, on replicated
server objects - keys (:mod:`fastlock.server.keys`) - so they survive a failover as keys
do: a promoted standby has every key the old primary acknowledged.

**Double barrier** (Curator's ``DistributedDoubleBarrier``, etcd's ``DoubleBarrier``):
``count`` participants :meth:`~DoubleBarrier.enter` and are let through together once all
have entered; they :meth:`~DoubleBarrier.leave` and are let go together once all have left.
Each participant holds a lease (renewed in the background; its lock name is
``NAME/members/ID``) and its entry of a round is a key attached to that lease
(``NAME/ROUND/ID``), so the server deletes the entry when the lease ends.  The last to see
every entry writes ``NAME/ROUND/ready`` (create-only): a participant waits for that key,
not for the count, so one that reads late cannot miss the moment (the race of
apache/zookeeper PR#618, a participant that sees the others already leaving).  A participant
whose lease ends while the round is under way (its process killed, its renewals failed)
breaks the round: every other participant waiting in it gets
:class:`~fastlock.errors.BrokenBarrier`, within the lease's TTL plus the time a key event
takes to arrive (or :data:`RELIST_EVERY` at worst), instead of waiting for ever.

**Countdown latch** (Redisson's ``RCountDownLatch``, Hazelcast's ``ICountDownLatch``):
``NAME/count`` holds the count it was created with; :meth:`~CountDownLatch.count_down`
by a party writes ``NAME/done/PARTY`` (create-only: a party counts once, and a retry after
a failover does not count twice); :meth:`~CountDownLatch.wait` returns once ``count`` parties
have counted down.  The keys have no lease: the count is kept across a primary's SIGKILL
and a restart.  :meth:`~CountDownLatch.delete` removes them.

Waiting watches the prefix (events wake the waiter at once) and lists it again at least
every :data:`RELIST_EVERY` seconds (a watch started after a change, or dropped by a
failover, misses nothing for longer than that).  Names: ``NAME`` plus the suffixes above
must fit a key (512 bytes).  A participant or party id is 1..64 characters.

What fencing adds: each participant's lease has its own fencing token
(:attr:`DoubleBarrier.lease`): work done between ``enter`` and ``leave`` can carry it, and
a resource that checks tokens refuses the writes of a participant whose lease ended (the
one that broke the barrier) after the others were told.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from .. import protocol as P
from ..errors import (
    BrokenBarrier,
    ConnectionLost,
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    LockNotAcquired,
    WrongArgumentType,
)
from .keys import MAX_LIST, KeyEvent, KeyList
from .lease import Lease

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

__all__ = ["DoubleBarrier", "CountDownLatch", "RELIST_EVERY", "MAX_PARTICIPANTS"]

#: seconds: the longest a waiter goes without listing the keys again
RELIST_EVERY = 0.25
#: the most participants of a barrier and the largest count of a latch (one key listing)
MAX_PARTICIPANTS = MAX_LIST - 1


def _check_id(value: object, what: str) -> str:
    if type(value) is not str:
        raise WrongArgumentType(f"{what} must be a str, not {type(value).__name__}")
    if not 1 <= len(value) <= 64 or "/" in value:
        raise InvalidArgument(f"{what} must be 1..64 characters without '/', got {value!r}")
    return value


def _check_count(value: object, what: str) -> int:
    if type(value) is not int:
        raise WrongArgumentType(f"{what} must be an int, not {type(value).__name__}")
    if not 1 <= value <= MAX_PARTICIPANTS:
        raise InvalidArgument(f"{what} must be in 1 .. {MAX_PARTICIPANTS}, got {value}")
    return value


async def _wait(client: Client, prefix: str, done: Callable[[KeyList], bool],
                on_event: Callable[[KeyEvent], None], deadline: float | None) -> KeyList:
    """List ``prefix`` until ``done(keys)``, woken by the prefix's key events (each first
    given to ``on_event``, which may raise) or every :data:`RELIST_EVERY` seconds.

    Raises:
        LockNotAcquired: ``deadline`` (``loop.time()``) passed.
    """
    loop = asyncio.get_running_loop()
    events: AsyncIterator[KeyEvent] | None = None
    pending: asyncio.Future[KeyEvent] | None = None
    try:
        while True:
            if events is None:
                events = client.watch_prefix(prefix)
            if pending is None:
                pending = asyncio.ensure_future(events.__anext__())
            keys = await client.list_prefix(prefix, limit=MAX_LIST)
            if done(keys):
                return keys
            wait = RELIST_EVERY
            if deadline is not None:
                wait = min(wait, deadline - loop.time())
                if wait <= 0:
                    raise LockNotAcquired(f"{prefix!r}: not passed before the timeout")
            finished, _ = await asyncio.wait({pending}, timeout=wait)
            if finished:
                try:
                    event = pending.result()
                except ConnectionLost:  # a failover: watch again (the listing covers the gap)
                    events = None
                else:
                    on_event(event)
                pending = None
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        if events is not None:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()


class DoubleBarrier:
    """One participant ``participant`` of the double barrier ``name`` of ``count``
    participants (see the module's text).  Rounds follow each other: every
    :meth:`enter` begins the next round (1, 2, ...), which every participant must pass.

    Args:
        ttl: the participant's lease TTL in seconds (renewed in the background): how long
            after this process dies the others learn it (plus an event's travel).
    """

    __slots__ = ("client", "name", "count", "participant", "ttl", "round", "lease", "_renewing")

    def __init__(self, client: Client, name: str, count: int, *, participant: str | None = None,
                 ttl: float = 10.0):
        P.check_name(f"{name}/members/{'x' * 64}")
        self.client = client
        self.name = name
        self.count = _check_count(count, "count")
        self.participant = _check_id(participant if participant is not None else secrets.token_hex(8), "participant")
        P.check_ttl_ms(P.seconds_to_ms(ttl, "ttl"))
        self.ttl = ttl
        self.round = 0
        #: the participant's lease (its fencing token), once it entered a first time
        self.lease: Lease | None = None
        self._renewing = False

    def _round_prefix(self) -> str:
        return f"{self.name}/{self.round}/"

    def _watch_members(self, prefix: str, seen: set[str]) -> Callable[[KeyEvent], None]:
        ready = prefix + "ready"

        def on_event(event: KeyEvent) -> None:
            if event.key != ready and event.what in ("expired", "released"):
                raise BrokenBarrier(f"double barrier {self.name!r} round {self.round}: participant "
                                    f"{event.key[len(prefix):]!r} left without passing ({event.what} lease)")
        return on_event

    async def _hold(self) -> Lease:
        lease = self.lease
        if lease is None or lease.lost.is_set():
            lease = await self.client.acquire(f"{self.name}/members/{self.participant}", ttl=self.ttl, wait=0)
            self.client.start_renewing(lease)
            self.lease = lease
        return lease

    async def enter(self, *, timeout: float | None = None) -> None:
        """Enter the next round and wait until all ``count`` participants have entered it.

        Raises:
            BrokenBarrier: a participant that had entered this round left without passing.
            LockNotAcquired: not passed within ``timeout`` seconds (this entry is withdrawn).
            LeaseLost: this participant's own lease was lost.
        """
        lease = await self._hold()
        self.round += 1
        prefix = self._round_prefix()
        ready = prefix + "ready"
        mine = prefix + self.participant
        await self.client.put(mine, b"", lease=lease)
        seen: set[str] = set()
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout

        def passed(keys: KeyList) -> bool:
            names = {k.key for k in keys}
            if ready in names:
                return True
            if seen - names:
                raise BrokenBarrier(f"double barrier {self.name!r} round {self.round}: participant "
                                    f"{sorted(seen - names)[0][len(prefix):]!r} left before all had entered")
            seen.update(names)
            return len(names) >= self.count

        try:
            keys = await _wait(self.client, prefix, passed, self._watch_members(prefix, seen), deadline)
        except BaseException:
            with contextlib.suppress(BaseException):
                await self.client.delete(mine)
            raise
        if ready not in {k.key for k in keys}:
            with contextlib.suppress(KeyExists):
                await self.client.put(ready, b"", lease=lease, create=True)

    async def leave(self, *, timeout: float | None = None) -> None:
        """Leave the current round and wait until every participant has left it.

        Raises:
            BrokenBarrier: a participant's lease ended before it left.
            LockNotAcquired: not passed within ``timeout`` seconds.
        """
        prefix = self._round_prefix()
        ready = prefix + "ready"
        await self.client.delete(prefix + self.participant)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout

        def passed(keys: KeyList) -> bool:
            return not [k for k in keys if k.key != ready]

        await _wait(self.client, prefix, passed, self._watch_members(prefix, set()), deadline)
        with contextlib.suppress(KeyNotFound):
            await self.client.delete(ready)

    async def close(self) -> None:
        """Give up the participant's lease (its entries go with it: the others' waits break)."""
        lease, self.lease = self.lease, None
        if lease is not None:
            with contextlib.suppress(Exception):
                await self.client.release(lease)

    async def __aenter__(self) -> DoubleBarrier:
        await self.enter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.leave()


class CountDownLatch:
    """The countdown latch ``name`` (see the module's text)."""

    __slots__ = ("client", "name")

    def __init__(self, client: Client, name: str):
        P.check_name(f"{name}/done/{'x' * 64}")
        self.client = client
        self.name = name

    async def create(self, count: int) -> bool:
        """Create the latch with ``count`` (1 .. 9,999); False if it exists already with that count.

        Raises:
            InvalidArgument: it exists with another count.
        """
        _check_count(count, "count")
        key = f"{self.name}/count"
        try:
            await self.client.put(key, str(count).encode(), create=True)
            return True
        except KeyExists:
            existing = await self.count_total()
            if existing != count:
                raise InvalidArgument(f"latch {self.name!r} exists with count {existing}, not {count}") from None
            return False

    async def count_total(self) -> int:
        """The count the latch was created with (1 .. 9,999).

        Raises:
            KeyNotFound: it was not created.
            InvalidArgument: its count key does not hold a count (decimal digits, 1 ..
                9,999): written by something else than :meth:`create`; the latch is
                never taken as open for it.
        """
        kv = await self.client.get(f"{self.name}/count")
        if kv is None:
            raise KeyNotFound(f"latch {self.name!r} does not exist")
        raw = kv.value
        count = int(raw) if isinstance(raw, bytes) and raw.isdigit() and len(raw) <= len(str(MAX_PARTICIPANTS)) else 0
        if not 1 <= count <= MAX_PARTICIPANTS:
            raise InvalidArgument(f"latch {self.name!r} has a malformed count key {self.name}/count "
                                  f"({bytes(raw)[:16]!r}: not a count in 1 .. {MAX_PARTICIPANTS}); delete the latch "
                                  f"and create it again")
        return count

    async def count_down(self, party: str) -> bool:
        """``party`` counts down (once: again changes nothing); True if this call counted."""
        _check_id(party, "party")
        try:
            await self.client.put(f"{self.name}/done/{party}", b"", create=True)
            return True
        except KeyExists:
            return False

    async def remaining(self) -> int:
        """How many parties are still to count down (0: open)."""
        total = await self.count_total()
        done = await self.client.list_prefix(f"{self.name}/done/", limit=MAX_LIST)
        return max(0, total - len(done))

    async def wait(self, *, timeout: float | None = None) -> None:
        """Wait until the count reaches zero.

        Raises:
            KeyNotFound: the latch was not created.
            LockNotAcquired: not open within ``timeout`` seconds.
        """
        total = await self.count_total()
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        await _wait(self.client, f"{self.name}/done/", lambda keys: len(keys) >= total, lambda event: None, deadline)

    async def delete(self) -> None:
        """Remove the latch's keys."""
        keys = await self.client.list_prefix(f"{self.name}/", limit=MAX_LIST)
        for kv in keys:
            with contextlib.suppress(KeyNotFound):
                await self.client.delete(kv.key)
