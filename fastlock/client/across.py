"""An atomic multi-lock across shards, with no coordinator: :func:`lock_across` (asyncio)
and :func:`lock_across_sync` (threads, over :class:`~fastlock.client.blocking.SyncClient`).

Each name belongs to one shard; a :class:`Router` says which (``client_for(name)``: the
client of the shard that owns the name).  :func:`lock_across` takes every name, all or
none, and returns a :class:`CrossShardLease` with each name's fencing token:

1. it takes a multi-lock id (16 random bytes) and an **age stamp** (this host's wall clock,
   milliseconds), both kept across retries;
2. it takes each shard's names with one ``RESERVE`` (atomic on that shard, as
   ``ACQUIRE_MANY``): to every shard at once (the default: one round trip), or, with
   ``in_order=True``, one shard after the other in one global order of shards (by the
   shards' addresses; a multi-lock then waits on at most one shard at a time);
3. if a part is **wounded** (an older multi-lock needed one of its names: the server
   revoked that part and pushed ``PUSH_WOUNDED``, or answered a waiting ``RESERVE`` with
   :class:`~fastlock.errors.Wounded`), or the connection to its shard is lost (a failover:
   the shard's table of reservations is gone; a ``RESERVE`` that fails for that reason is
   tried again after a pause, 20 ms doubling to 0.5 s, within the wait), that part alone is
   released and reserved again at once, with the same stamp and id, while the other parts are kept (held or
   waiting: every wait still goes from younger to older, so keeping them closes no cycle);
   with ``in_order=True`` it lets go of every part it took and starts again;
4. once every part is held it commits each (``COMMIT_RESERVATION``, to every shard at once):
   a committed part is an ordinary lease nobody can wound.  A commit refused as wounded
   releases every part (the ones already committed too: a committed part must never wait)
   and the multi-lock starts again with the same stamp and id.
   The leases are renewed from the moment each part is granted (so a long wait at a
   later shard does not lose an earlier part) until released.

The servers' side is :mod:`fastlock.server.woundwait` (the wound-wait rule, the limits on
untrusted stamps).

**No deadlock.**  A multi-lock waits only for (a) a plain or committed lease - whose holder
waits for nothing of this protocol (a committed multi-lock holds everything it needs) - or
(b) an older uncommitted reservation (one that holds or waits on the name: the server wounds
any younger one it finds there, parks a younger newcomer behind a waiting older one, and
wounds a younger one granted while an older one waits).  Every wait between multi-locks
goes from younger to older, so the waits-for graph has no cycle - whatever order the parts
are taken in (the global order is not needed for this; it is kept as an option).
**No starvation.**  Ranks are total (stamp, then id) and a multi-lock keeps its stamp
across retries: the oldest multi-lock in the system is never wounded (nothing is older)
and never parked, so it waits only for plain or committed leases, which end; then it
holds everything and commits.  Every other one becomes the oldest in time (new ones are
younger, up to the clocks' skew).  This holds while its stamp is accepted: a server
refuses stamps older than :data:`~fastlock.protocol.ops.MAX_STAMP_AGE_MS` (60 s), so a
multi-lock still trying after :data:`STAMP_REFRESH_S` (55 s) takes a fresh stamp
(loses its seniority once).

**Failover of a shard.**  A new primary has no table of reservations: it sees an
uncommitted part as a plain lease.  The client lost its connection there, counts that
as a wound of the part, releases it and reserves it again (see step 3), so the part is
woundable again once the client has reconnected (:mod:`fastlock.server.woundwait` gives
the argument that no record of reservations is needed).

What is not covered: names also taken one by one with plain acquires while holding some
(a plain set that waits for a reservation while holding nothing is fine): a routing
client's incremental acquires are checked for cycles across shards by edge chasing
(:mod:`fastlock.client.edgechase`), but a cycle through a multi-lock's reservation is not
followed by it; shared parts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import random
import secrets
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from .. import protocol as P
from ..errors import ConnectionLost, FastlockError, LeaseLost, LockNotAcquired, Wounded
from ..logsafe import quote
from ..protocol.ops import MAX_STAMP_AGE_MS, OP_COMMIT_RESERVATION, OP_RESERVE
from ..units import wall_ms
from .connection import BACKOFF_FIRST, BACKOFF_MAX, RETRYABLE
from .kinds import leases_granted
from .lease import Lease, check_fraction
from .multilock import LeaseSet, LeaseSetContext, sorted_names
from .owner_keys import new_owner_key
from .renewer import Renewer

if TYPE_CHECKING:  # pragma: no cover
    from .blocking import SyncClient
    from .client import Client

log = logging.getLogger(__name__)

__all__ = ["Router", "SyncRouter", "CrossShardLease", "AcrossContext", "lock_across", "acquire_across",
           "release_across", "PartTiming",
           "lock_across_sync", "SyncCrossShardLease", "STAMP_REFRESH_S", "shard_key"]

#: seconds: a multi-lock still trying after this long takes a fresh age stamp (servers refuse
#: stamps older than MAX_STAMP_AGE_MS, 60 s)
STAMP_REFRESH_S = (MAX_STAMP_AGE_MS - 5_000) / 1000.0

_T = TypeVar("_T")


class Router(Protocol):
    """Which shard owns a name: ``client_for(name)`` returns the asyncio
    :class:`~fastlock.client.Client` of that shard's group (the same object for every
    name of one shard)."""

    def client_for(self, name: str) -> Client: ...


class SyncRouter(Protocol):
    """:class:`Router` for threads: ``client_for(name)`` returns the shard's
    :class:`~fastlock.client.blocking.SyncClient`."""

    def client_for(self, name: str) -> SyncClient: ...


def shard_key(client: Client) -> tuple[str, ...]:
    """A shard's place in the global order of shards that every multi-lock follows: its
    client's addresses, as text, sorted."""
    return tuple(sorted(str(a) for a in client.connector.addresses))


class _Shard:
    """One shard's client, and the event loop it runs on (None: the caller's)."""

    __slots__ = ("client", "loop", "order")

    def __init__(self, client: Client, loop: asyncio.AbstractEventLoop | None):
        self.client = client
        self.loop = loop
        #: the shard's place in the global order
        self.order = shard_key(client)

    async def run(self, fn: Callable[..., Coroutine[Any, Any, _T]], *args: Any) -> _T:
        """``fn(client, *args)`` on this shard's loop."""
        if self.loop is None or self.loop is asyncio.get_running_loop():
            return await fn(self.client, *args)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fn(self.client, *args), self.loop))

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(client, *args)`` on this shard's loop, without waiting."""
        if self.loop is None:
            fn(self.client, *args)
        else:
            self.loop.call_soon_threadsafe(fn, self.client, *args)


class _Wound:
    """One attempt's wound (or any one-shot flag of a multi-lock): set once (from any thread)
    by a push or a failed part; each shard's request waits on a future of its own loop
    (:meth:`waiter`, :meth:`add`)."""

    __slots__ = ("flag", "_lock", "_waiters")

    def __init__(self) -> None:
        self.flag = False
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def set(self) -> None:
        with self._lock:
            if self.flag:
                return
            self.flag = True
            waiters, self._waiters = self._waiters, []
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for loop, fut in waiters:
            if loop is running:
                _resolve(fut)
            else:
                loop.call_soon_threadsafe(_resolve, fut)

    def is_set(self) -> bool:
        return self.flag

    def waiter(self) -> asyncio.Future[None]:
        """A future of the running loop, done once the wound is set."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.add(fut)
        return fut

    def add(self, fut: asyncio.Future[None]) -> None:
        """Resolve ``fut`` (a future of the running loop) once the wound is set (at once if it is)."""
        with self._lock:
            if not self.flag:
                self._waiters.append((asyncio.get_running_loop(), fut))
                return
        _resolve(fut)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class PartTiming(NamedTuple):
    """When one shard's part of a multi-lock was taken (``CrossShardLease.timings``).

    Attributes:
        sent (float): the loop time (seconds, ``loop.time()``) the part's last ``RESERVE`` was sent.
        granted (float): the loop time (seconds) its grant was read.
        waited_ms (int): how long the request waited in the shard, milliseconds, as the shard
            reported it: parked behind an older multi-lock, then in the names' queues (the time on
            the wire and in this client's loop is not in it).
        reserves (int): how many ``RESERVE`` requests the part took (1: never wounded there).
    """

    sent: float
    granted: float
    waited_ms: int
    reserves: int


class _Part:
    """The leases one shard granted a multi-lock, and when (:class:`PartTiming`)."""

    __slots__ = ("shard", "leases", "committed", "sent", "granted", "waited_ms", "reserves")

    def __init__(self, shard: _Shard, leases: list[Lease]):
        self.shard = shard
        self.leases = leases
        self.committed = False
        self.sent = self.granted = 0.0
        self.waited_ms = 0
        self.reserves = 0

    def timing(self) -> PartTiming:
        return PartTiming(self.sent, self.granted, self.waited_ms, self.reserves)


class CrossShardLease(LeaseSet):
    """The leases of :func:`lock_across`, every one committed.

    Attributes:
        leases (tuple[Lease, ...]): in the shards' order, names in UTF-8 byte order within a shard.
        lost (asyncio.Event): set as soon as any one of the leases is lost (on the loop
            that ran :func:`lock_across`).
        attempts (int): how many times the multi-lock was tried (1: never wounded).
        timings (tuple[PartTiming, ...]): when each shard's part was taken, in the shards' order.
        commit_sent (float): the loop time (seconds) the commits were sent.

    ``multi["orders/42"]`` is that name's :class:`Lease`; ``multi.fencing_tokens``
    maps each name to its token.  Release with :func:`release_across` (or leave the
    ``async with`` of :class:`AcrossContext`).
    """

    __slots__ = ("parts", "leases", "lost", "attempts", "timings", "commit_sent", "_by_name")

    def __init__(self, parts: list[_Part], attempts: int, commit_sent: float = 0.0):
        self.parts = tuple(parts)
        self.timings = tuple(part.timing() for part in parts)
        self.commit_sent = commit_sent
        self.leases = tuple(lease for part in parts for lease in part.leases)
        self.lost = asyncio.Event()
        self.attempts = attempts
        self._by_name = {lease.name: lease for lease in self.leases}
        loop = asyncio.get_running_loop()
        for part in parts:
            for lease in part.leases:
                if part.shard.loop is None or part.shard.loop is loop:
                    lease.health.when_lost(self.lost.set)
                else:
                    lease.health.when_lost(lambda: loop.call_soon_threadsafe(self.lost.set))


def _shards(router: Any, names: Iterable[str], sync: bool) -> list[tuple[_Shard, tuple[str, ...]]]:
    """The names grouped by shard (``router``: a :class:`Router`, or a :class:`SyncRouter`
    when ``sync``), the shards in the global order."""
    groups: dict[int, tuple[_Shard, list[str]]] = {}
    for name in sorted_names(names):
        owner: Any = router.client_for(name)
        entry = groups.get(id(owner))
        if entry is None:
            shard = _Shard(owner.client, owner.loop) if sync else _Shard(owner, None)
            entry = groups[id(owner)] = (shard, [])
        entry[1].append(name)
    ordered = sorted(groups.values(), key=lambda e: e[0].order)
    for a, b in zip(ordered, ordered[1:]):
        if a[0].order == b[0].order:
            raise FastlockError(f"two clients of the router talk to the same addresses {a[0].order}: "
                                "one shard, one client")
    return [(shard, tuple(names)) for shard, names in ordered]


async def _reserve(client: Client, part: _Part, names: tuple[str, ...], ttl_ms: int, wait_ms: int,
                   corr: str | None, stamp: int, multi_id: bytes, wound: _Wound,
                   renew: bool, renew_fraction: float | None) -> list[Lease]:
    """One RESERVE of ``names`` on ``client``'s shard, given up (and withdrawn) as soon as
    ``wound`` is set first (:class:`Wounded`); the leases renewed from the grant when ``renew``."""
    connector = client.connector
    proto = await client.ensure_connected()
    owner = new_owner_key()
    loop = asyncio.get_running_loop()
    sent = loop.time()
    part.sent = sent
    part.reserves += 1
    reply_fut = proto.request(OP_RESERVE, list(names), owner, ttl_ms, wait_ms, corr, stamp, multi_id)
    woken = wound.waiter()  # done by the wound, or by the reply
    if not woken.done():
        reply_fut.add_done_callback(functools.partial(_wake, woken))
    try:
        await woken
    except asyncio.CancelledError:
        reply_fut.add_done_callback(_retrieve)
        _withdraw(connector, proto, names, owner)
        raise
    if not reply_fut.done():
        reply_fut.add_done_callback(_retrieve)  # its answer (Cancelled, a grant released) is not needed
        _withdraw(connector, proto, names, owner)
        raise Wounded("wounded by an older multi-lock on another shard")
    error = reply_fut.exception()
    if error is not None:  # raised with neither the future nor the error kept in this frame: no cycle
        del reply_fut
        if isinstance(error, RETRYABLE):
            # the connection failed with the request's outcome unknown: the server may have granted it
            # before the reply was lost, so it is withdrawn by owner (on the next connection if this one
            # is dead: CANCEL releases a grant) instead of being left held until its TTL
            _withdraw(connector, proto, names, owner)
        try:
            raise error
        finally:
            del error
    reply = reply_fut.result()
    part.granted = loop.time()
    part.waited_ms = reply[2]
    leases = leases_granted(connector, names, owner, reply, sent)
    for lease in leases:
        if renew_fraction is not None:
            lease.health.jeopardy_fraction = check_fraction(renew_fraction)
        if renew:
            Renewer(client, lease, on_lost=functools.partial(_part_lost, part, lease)).start()
    part.leases = leases
    return leases


def _part_lost(part: _Part, lease: Lease, why: str) -> None:
    """A part's lease is lost: a warning once committed (before, a wound is the usual reason)."""
    if part.committed and not lease.state.lost.is_set():
        log.warning("lease %s token %d of a multi-lock lost: %s", quote(lease.name), lease.fencing_token, why)
    lease.state.lost.set()


def _withdraw(connector: Any, proto: Any, names: tuple[str, ...], owner: bytes) -> None:
    """A CANCEL by owner per name: the first withdraws a waiting request (all its names);
    each releases its name if the grant raced with the withdrawal."""
    for name in names:
        connector.withdraw(proto, name, owner)


def _raise_dropped(error: BaseException, *lists: list[Any]) -> None:
    """Raise ``error`` after emptying ``lists`` (which hold it): the caller's frame, which the
    error's traceback holds, then keeps no reference back to it (no reference cycle)."""
    for items in lists:
        items.clear()
    try:
        raise error
    finally:
        del error


def _wake(woken: asyncio.Future[None], _reply: asyncio.Future[Any]) -> None:
    _resolve(woken)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def _write_commits(parts: list[_Part], multi_id: bytes) -> list[asyncio.Future[Any]] | None:
    """Write every part's ``COMMIT_RESERVATION`` now, in the callback that saw the last part
    held (no trip through the loop's queue of ready callbacks, which on a busy loop is where a
    held part's time goes); the replies' futures.  None when a shard runs on another loop or
    is not connected: the caller commits with :func:`_commit` instead."""
    protos = []
    for part in parts:
        proto = part.shard.client.connector.proto if part.shard.loop is None else None
        if proto is None or proto.closed:
            return None
        protos.append(proto)
    return [proto.request(OP_COMMIT_RESERVATION, multi_id) for proto in protos]


def _drop_commits(commits: list[asyncio.Future[Any]] | None) -> None:
    """Commits written and no longer awaited (the attempt failed): their outcomes are not needed."""
    for fut in commits or ():
        fut.add_done_callback(_retrieve)


async def _commit(client: Client, multi_id: bytes) -> None:
    proto = await client.ensure_connected()
    await proto.request(OP_COMMIT_RESERVATION, multi_id)


async def _release_leases(client: Client, leases: list[Lease]) -> list[BaseException]:
    """Release ``leases`` (one shard's part): their RELEASEs in one write; one whose connection
    failed under it is released again with :meth:`Client.release` (riding through a failover,
    a ``LeaseLost`` then counting as released).  Returns the errors (``LeaseLost``: ``lease.lost``
    is set)."""
    return await _released(client, leases, _write_releases(client, leases))


def _write_releases(client: Client, leases: list[Lease]) -> list[asyncio.Future[Any]] | None:
    """Write the RELEASEs of ``leases`` now, in one write (their renewals stopped), when the
    connection is up: the replies' futures for :func:`_released`; None otherwise."""
    proto = client.connector.proto
    if not leases or proto is None or proto.closed:
        return None
    renewers = client.renewers
    if renewers.by_state:
        for lease in leases:
            renewers.stop(lease)
    return proto.request_batch([(P.OP_RELEASE, lease.name, lease.fencing_token, lease.owner) for lease in leases])


async def _released(client: Client, leases: list[Lease], futs: list[asyncio.Future[Any]] | None
                    ) -> list[BaseException]:
    """The outcomes of the RELEASEs :func:`_write_releases` wrote (``futs``), or, with None,
    of releasing each lease with :meth:`Client.release`: the errors, as :func:`_release_leases`."""
    if not leases:
        return []
    if futs is None:
        results = await asyncio.gather(*(client.release(lease) for lease in leases), return_exceptions=True)
        return [r for r in results if isinstance(r, BaseException)]
    results = await asyncio.gather(*futs, return_exceptions=True)
    errors: list[BaseException] = []
    for lease, result in zip(leases, results):
        if isinstance(result, RETRYABLE):
            try:
                await client.release(lease)
            except LeaseLost:
                pass  # the first attempt's outcome is unknown: it may have released it
            except FastlockError as exc:
                errors.append(exc)
        elif isinstance(result, LeaseLost):
            lease.lost.set()
            errors.append(result)
        elif isinstance(result, BaseException):
            errors.append(result)
    return errors


async def _let_go(parts: list[_Part]) -> None:
    """Release every lease of ``parts`` (the ones already revoked answer LeaseLost: ignored); if
    cancelled meanwhile, each release is sent without waiting (:func:`_let_go_nowait`)."""
    try:
        await asyncio.gather(*(part.shard.run(_release_leases, part.leases) for part in parts),
                             return_exceptions=True)
    except asyncio.CancelledError:
        _let_go_nowait(parts)
        raise


def _let_go_nowait(parts: list[_Part]) -> None:
    for part in parts:
        for lease in part.leases:
            part.shard.call(lambda client, lease=lease: client.release_nowait(lease))


async def _lock(shards: list[tuple[_Shard, tuple[str, ...]]], ttl: float, wait: float | None,
                correlation_id: str | None, renew: bool, renew_fraction: float | None,
                in_order: bool) -> CrossShardLease:
    ttl_ms = P.check_ttl_ms(P.seconds_to_ms(ttl, "ttl"))
    wait_ms = P.check_wait_ms(P.seconds_to_ms(wait, "wait", allow_none=True, allow_zero=True))
    P.check_optional_str(correlation_id, "correlation_id", P.MAX_CORRELATION_ID_CHARS)
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = None if wait_ms < 0 else started + wait_ms / 1000.0
    multi_id = secrets.token_bytes(16)
    stamp, stamped_at = wall_ms(), started
    wounded = _Wound()
    #: shard index -> the wound of that shard's part now (all at once: each part is re-reserved alone)
    part_wounds: dict[int, _Wound] = {}
    pause = BACKOFF_FIRST  # seconds before an attempt that follows a shard's failure (not a wound)

    def listener(k: int) -> Callable[[list[Any]], None]:
        def on_wound(_payload: list[Any]) -> None:  # on the shard's loop: a wound, or its connection lost
            w = part_wounds.get(k)
            if w is not None:
                w.set()
            wounded.set()
        return on_wound

    def listen(client: Client, on_wound: Callable[[list[Any]], None]) -> None:
        client.connector.wound_listeners[multi_id] = on_wound

    for k, (shard, _names) in enumerate(shards):
        shard.call(listen, listener(k))
    attempts = 0
    rereserved = 0  # parts taken again alone after a wound of theirs (all at once)
    holding: set[int] = set()  # the shards whose part is held, in this round (all at once)
    all_held = _Wound()  # every part is held, in this round
    #: the commits' replies, once written at the moment the last part was held (all at once, every
    #: shard on this loop and connected); None: not written yet
    commits: list[asyncio.Future[Any]] | None = None
    commit_sent = 0.0

    def left_ms() -> int:
        return -1 if deadline is None else max(0, int((deadline - loop.time()) * 1000))

    parts_now: list[_Part] = []  # this attempt's parts (all at once)

    async def hold_part(k: int, part: _Part, names: tuple[str, ...], aborted: list[bool]) -> None:
        """Hold shard ``k``'s part: after a wound of that part alone, what is left of it is
        released and it is reserved again at once, with the same stamp and id (the other
        parts are kept: every wait still goes from younger to older)."""
        nonlocal rereserved, commits, commit_sent
        pause = BACKOFF_FIRST  # seconds before reserving again after the part's connection failed
        while True:
            w = part_wounds[k] = _Wound()
            if aborted[0]:
                raise Wounded("another shard's part failed")
            try:
                await part.shard.run(_reserve, part, names, ttl_ms, left_ms(), correlation_id, stamp, multi_id, w,
                                     renew, renew_fraction)
            except Wounded:
                if aborted[0] or (deadline is not None and loop.time() >= deadline):
                    raise
            except RETRYABLE:
                # the part's connection was lost under its RESERVE (a failover, a restart): a wound of
                # this part alone, the others kept; paced as a client rides through, within the wait
                if aborted[0] or deadline is None or loop.time() >= deadline:
                    raise
                await asyncio.sleep(min(max(0.0, deadline - loop.time()), pause * random.uniform(0.5, 1.0)))
                pause = min(2 * pause, BACKOFF_MAX)
            else:
                # held: until every part is, a wound of this one is answered at once
                holding.add(k)
                if len(holding) == len(shards):
                    if not any(part_wounds[i].is_set() for i in holding):
                        # none wounded since its grant (a wound read but not yet acted on is taken again
                        # alone by the caller's next round, not by a failed commit and a restart)
                        commits = _write_commits(parts_now, multi_id)
                        commit_sent = loop.time()
                    all_held.set()
                either: asyncio.Future[None] = loop.create_future()  # done by a wound of the part, or all held
                w.add(either)
                all_held.add(either)
                await either
                if not w.is_set() or all_held.is_set():
                    return  # (a wound once all are held: the caller's next round)
                holding.discard(k)
                if aborted[0]:
                    raise Wounded("another shard's part failed")
            await part.shard.run(_release_leases, part.leases)
            part.leases = []
            rereserved += 1

    async def hold_or_abort(k: int, part: _Part, names: tuple[str, ...], aborted: list[bool]) -> None:
        try:
            await hold_part(k, part, names, aborted)
        except Exception:
            aborted[0] = True  # the other shards' requests are withdrawn too
            for w in list(part_wounds.values()):
                w.set()
            raise
    try:
        while True:
            attempts += 1
            if loop.time() - stamped_at > STAMP_REFRESH_S:
                stamp, stamped_at = wall_ms(), loop.time()
            wounded = _Wound()  # this attempt's
            parts: list[_Part] = []
            commits = None
            try:
                if in_order:
                    for shard, names in shards:
                        part = _Part(shard, [])
                        parts.append(part)  # first: a grant read on the shard's loop is let go if this is cancelled
                        await shard.run(_reserve, part, names, ttl_ms, left_ms(), correlation_id, stamp, multi_id,
                                        wounded, renew, renew_fraction)
                    if wounded.is_set():
                        raise Wounded("wounded by an older multi-lock")
                else:
                    parts = parts_now[:] = [_Part(shard, []) for shard, _names in shards]
                    aborted = [False]
                    todo = list(range(len(parts)))
                    while todo:
                        holding = set(range(len(parts))) - set(todo)
                        all_held = _Wound()
                        results = await asyncio.gather(*(hold_or_abort(k, parts[k], shards[k][1], aborted)
                                                         for k in todo), return_exceptions=True)
                        failed = [r for r in results if isinstance(r, BaseException)]
                        if failed:  # the cause, rather than the withdrawals it caused
                            _raise_dropped(next((r for r in failed if not isinstance(r, Wounded)), failed[0]),
                                           results, failed)
                        if commits is not None:
                            break  # written as the last part was held: a wound since fails its commit
                        # a part wounded after its grant, while another shard's was still awaited: again, alone
                        todo = [k for k in range(len(parts)) if part_wounds[k].is_set()]
                        for k in todo:
                            await parts[k].shard.run(_release_leases, parts[k].leases)
                            parts[k].leases = []
                            rereserved += 1
                # every part is held: commit them all at once (any order will do)
                if commits is not None:
                    results = await asyncio.gather(*commits, return_exceptions=True)
                else:
                    commit_sent = loop.time()
                    results = await asyncio.gather(*(part.shard.run(_commit, multi_id) for part in parts),
                                                   return_exceptions=True)
                failed = [r for r in results if isinstance(r, BaseException)]
                if failed:
                    _raise_dropped(failed[0], results, failed)
                for part in parts:
                    part.committed = True
            except (Wounded, LeaseLost, *RETRYABLE) as exc:
                _drop_commits(commits)
                await _let_go(parts)
                if isinstance(exc, ConnectionLost) and not isinstance(exc, Wounded) and deadline is None:
                    raise
                if deadline is not None and loop.time() >= deadline:
                    raise LockNotAcquired(f"{sum(len(n) for _, n in shards)} locks across {len(shards)} shards: "
                                          f"wait ran out after {attempts} attempts ({exc})") from None
                log.debug("multi-lock attempt %d: %s; trying again with the same age stamp", attempts, exc)
                if not isinstance(exc, Wounded):  # a shard down or failing over: paced, as a client rides through
                    left = float("inf") if deadline is None else deadline - loop.time()
                    await asyncio.sleep(min(left, pause * random.uniform(0.5, 1.0)))
                    pause = min(2 * pause, BACKOFF_MAX)
                continue
            except asyncio.CancelledError:
                _drop_commits(commits)
                _let_go_nowait(parts)
                raise
            except BaseException:
                _drop_commits(commits)
                await _let_go(parts)
                raise
            return CrossShardLease(parts, attempts + rereserved, commit_sent)
    finally:
        for shard, _names in shards:
            shard.call(lambda client: client.connector.wound_listeners.pop(multi_id, None))


def lock_across(router: Router, names: Iterable[str], *, ttl: float, wait: float | None = None,
                correlation_id: str | None = None, jeopardy_fraction: float | None = None,
                in_order: bool = False) -> AcrossContext:
    """Lock every name of ``names``, over the shards ``router`` names, all or none.

    Args:
        router: which shard's client owns each name (:class:`Router`).
        names: the lock names (at most 64 per shard; distinct).
        ttl: each lease's TTL, seconds; the leases are renewed (from each part's grant) until released.
        wait: seconds to keep trying, over every retry (None: without end; 0: once).
        correlation_id: recorded with every lease.
        jeopardy_fraction: as :meth:`Client.lock <fastlock.client.Client.lock>`.
        in_order: take the shards' parts one after the other in the global order of
            shards (False, the default: every shard's part at once - one round trip
            instead of one per shard; wound-wait alone keeps it free of deadlock).

    Returns an :class:`AcrossContext`: await it for a :class:`CrossShardLease`
    (released with :func:`release_across`), or ``async with`` it.

    Raises:
        LockNotAcquired: ``wait`` ran out (nothing is held).
        InvalidArgument / WrongArgumentType: bad names or arguments (nothing sent).
        PermissionDenied, LimitExceeded: a shard refused (nothing is held).
        ConnectionLost: a shard could not be reached and ``wait`` is None.
    """
    return AcrossContext(lambda: _lock(_shards(router, names, False), ttl, wait, correlation_id, True,
                                       jeopardy_fraction, in_order))


async def acquire_across(router: Router, names: Iterable[str], *, ttl: float, wait: float | None = None,
                         correlation_id: str | None = None, jeopardy_fraction: float | None = None,
                         in_order: bool = False, renew: bool = False) -> CrossShardLease:
    """:func:`lock_across` as a coroutine: the :class:`CrossShardLease` (release it with
    :func:`release_across`); the same arguments and errors.  As ``Client.acquire_many``,
    the leases are renewed only when ``renew`` is True (:func:`lock_across` always renews)."""
    return await _lock(_shards(router, names, False), ttl, wait, correlation_id, renew, jeopardy_fraction, in_order)


async def release_across(multi: CrossShardLease) -> None:
    """Release every lease of ``multi`` (all of them, even if one fails; if cancelled, each
    release is still sent, without waiting for its reply).  The releases of the shards on the
    caller's loop are written before the first wait, so the names are free one round trip after
    the call, however busy the loop.
    :raises LeaseLost: a lease had ended already (the others are released)."""
    try:
        results = await asyncio.gather(*(_released(part.shard.client, part.leases,
                                                    _write_releases(part.shard.client, part.leases))
                                          if part.shard.loop is None else part.shard.run(_release_leases, part.leases)
                                          for part in multi.parts),
                                       return_exceptions=True)
    except asyncio.CancelledError:
        _let_go_nowait(list(multi.parts))
        raise
    multi.raise_failed_release(e for r in results for e in (r if isinstance(r, list) else [r]))


class AcrossContext(LeaseSetContext[CrossShardLease]):
    """Returned by :func:`lock_across`: awaitable (a :class:`CrossShardLease`) and an async
    context manager (released on exit)."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[], Coroutine[Any, Any, CrossShardLease]]):
        super().__init__()
        self._make = make

    def _acquire(self) -> Coroutine[Any, Any, CrossShardLease]:
        return self._make()

    async def _release(self, multi: CrossShardLease) -> None:
        await release_across(multi)


class SyncCrossShardLease:
    """:class:`CrossShardLease` for threads (:func:`lock_across_sync`): ``fencing_tokens``,
    ``names``, ``lost`` (a threading-safe check: ``lost.is_set()``), ``release()``, and a
    context manager that releases on exit."""

    __slots__ = ("multi", "_loop")

    def __init__(self, multi: CrossShardLease, loop: asyncio.AbstractEventLoop):
        self.multi = multi
        self._loop = loop

    @property
    def fencing_tokens(self) -> dict[str, int]:
        return self.multi.fencing_tokens

    @property
    def names(self) -> tuple[str, ...]:
        return self.multi.names

    @property
    def lost(self) -> asyncio.Event:
        return self.multi.lost

    def release(self) -> None:
        """As :func:`release_across`."""
        asyncio.run_coroutine_threadsafe(release_across(self.multi), self._loop).result()

    def __enter__(self) -> SyncCrossShardLease:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.release()
        except FastlockError as err:
            log.warning("could not release all of %d locks across shards: %s", len(self.multi), err)


def lock_across_sync(router: SyncRouter, names: Iterable[str], *, ttl: float, wait: float | None = None,
                     correlation_id: str | None = None, jeopardy_fraction: float | None = None,
                     in_order: bool = False) -> SyncCrossShardLease:
    """:func:`lock_across` for threads: ``router`` returns each name's
    :class:`~fastlock.client.blocking.SyncClient`.  The multi-lock runs on the first
    shard's loop (each shard's requests on its own); blocks until it holds every name or
    fails with :func:`lock_across`'s errors."""
    shards = _shards(router, names, True)
    loop = shards[0][0].loop
    assert loop is not None
    fut: concurrent.futures.Future[CrossShardLease] = asyncio.run_coroutine_threadsafe(
        _lock(shards, ttl, wait, correlation_id, True, jeopardy_fraction, in_order), loop)
    try:
        return SyncCrossShardLease(fut.result(), loop)
    except BaseException:
        if not fut.cancel() and fut.done() and not fut.cancelled() and fut.exception() is None:
            # taken as the caller gave up (an interrupt while it waited): let go of it
            loop.call_soon_threadsafe(_let_go_nowait, list(fut.result().parts))
        raise
