"""Several locks at once, all or none: :class:`MultiLease`, :class:`LockManyContext`
and the acquisition behind :meth:`Client.acquire_many
<fastlock.client.Client.acquire_many>` / :meth:`Client.lock_many
<fastlock.client.Client.lock_many>`.

Up to 64 names go in ONE ``ACQUIRE_MANY`` request
(:func:`fastlock.client.kinds.acquire_set`): the server grants the set
atomically and queues it FIFO on every name, holding none while it waits.  More
names, or a server without that op (an older fastlock), take the locks one
after the other in one global order - sorted by the UTF-8 bytes of their names -
so no set of multi-locks can wait on each other in a cycle (ordered two-phase
locking).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .. import protocol as P
from ..errors import FastlockError, InvalidArgument, LeaseLost, ProtocolError, WrongArgumentType
from ..logsafe import quote
from .kinds import acquire_set
from .lease import Lease

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

log = logging.getLogger(__name__)

__all__ = ["LeaseSet", "LeaseSetContext", "MultiLease", "LockManyContext", "SortedNames", "sorted_names",
           "acquire_many", "release_many"]

#: the lease set a LeaseSetContext gives
_Set = TypeVar("_Set", bound="LeaseSet")


class SortedNames(tuple[str, ...]):
    """Names already checked, deduplicated and put in the global lock order."""


def sorted_names(names: Iterable[str]) -> SortedNames:
    """Check ``names`` and sort them by their UTF-8 bytes (the global lock order).

    Raises:
        WrongArgumentType: a single string, or not an iterable of names.
        InvalidArgument: no name, a bad name, or a name listed twice.
    """
    if isinstance(names, SortedNames):
        return names
    if isinstance(names, (str, bytes)):
        raise WrongArgumentType("names must be an iterable of lock names, not a single string")
    try:
        checked = [P.check_name(n) for n in names]
    except TypeError:
        raise WrongArgumentType(f"names must be an iterable of lock names, not {type(names).__name__}") from None
    if not checked:
        raise InvalidArgument("at least one lock name is needed")
    keyed = sorted((n.encode("utf-8"), n) for n in checked)
    for (a, name), (b, _) in zip(keyed, keyed[1:]):
        if a == b:
            raise InvalidArgument(f"lock name {name!r} is listed twice (locks are not re-entrant)")
    return SortedNames(n for _, n in keyed)


class LeaseSet:
    """What every set of leases taken together offers (:class:`MultiLease`,
    :class:`~fastlock.client.across.CrossShardLease`): ``leases`` (a tuple of
    :class:`Lease`), ``lost`` (an :class:`asyncio.Event` set as soon as any one of them
    is lost), ``multi["orders/42"]`` (that name's lease), ``names``, ``fencing_tokens``
    (name -> token), iteration and ``len``."""

    __slots__ = ()
    leases: tuple[Lease, ...]
    lost: asyncio.Event
    _by_name: dict[str, Lease]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(lease.name for lease in self.leases)

    @property
    def fencing_tokens(self) -> dict[str, int]:
        return {lease.name: lease.fencing_token for lease in self.leases}

    def raise_failed_release(self, results: Iterable[object]) -> None:
        """Apply the releases' ``results`` (values or exceptions, as ``asyncio.gather``
        returns them with ``return_exceptions=True``): an error other than
        :class:`LeaseLost` is raised at once; else, if any lease was lost, the set is marked
        lost and the first :class:`LeaseLost` raised; else nothing."""
        errors = [r for r in results if isinstance(r, BaseException)]
        for err in errors:
            if not isinstance(err, LeaseLost):
                raise err
        if errors:
            self.lost.set()
            raise errors[0]

    def lost_names(self) -> list[str]:
        """The names whose lease is lost."""
        return [lease.name for lease in self.leases if lease.lost.is_set()]

    def __getitem__(self, name: str) -> Lease:
        return self._by_name[name]

    def __iter__(self) -> Iterator[Lease]:
        return iter(self.leases)

    def __len__(self) -> int:
        return len(self.leases)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.fencing_tokens}{' lost' if self.lost.is_set() else ''}>"


class MultiLease(LeaseSet):
    """The leases of :meth:`Client.acquire_many` / :meth:`Client.lock_many`.

    Attributes:
        leases (tuple[Lease, ...]): in acquisition order (UTF-8 byte order of
            the names).
        lost (asyncio.Event): set as soon as any one of the leases is lost.

    ``multi["orders/42"]`` is that name's :class:`Lease`;
    ``multi.fencing_tokens`` maps each name to its token.
    """

    __slots__ = ("leases", "lost", "_by_name", "__weakref__")

    def __init__(self, leases: tuple[Lease, ...], lost: asyncio.Event | None = None):
        self.leases = leases
        self.lost = lost if lost is not None else asyncio.Event()
        self._by_name = {lease.name: lease for lease in leases}
        for lease in leases:
            lease.health.when_lost(self.lost.set)


def shared_names(shared: Iterable[str], names: SortedNames) -> frozenset[str]:
    """The names of ``names`` to take shared.  :raises InvalidArgument: a name not in ``names``."""
    if isinstance(shared, (str, bytes)):
        raise WrongArgumentType("shared must be an iterable of lock names, not a single string")
    out = frozenset(shared)
    stray = out.difference(names)
    if stray:
        raise InvalidArgument(f"shared names {sorted(stray)!r} are not among the names to lock")
    return out


async def acquire_many(client: Client, names: Iterable[str], kwargs: dict[str, Any], wait: float | None,
                       renew_fraction: float | None) -> MultiLease:
    """Acquire every name under one deadline of ``wait`` seconds (None: none): with one
    ACQUIRE_MANY request when the server has it and there are at most 64 names, else
    one by one in the global order; ``kwargs``: ``ttl``, ``lock_delay``,
    ``correlation_id`` and ``shared`` (names to take shared).  Renew each lease from
    its grant when ``renew_fraction`` (the jeopardy fraction) is given.  See
    :meth:`Client.acquire_many`."""
    ordered = sorted_names(names)
    kwargs = dict(kwargs)
    shared = shared_names(kwargs.pop("shared", ()), ordered)
    # Validate everything before the first request goes out.
    ttl_ms = P.check_ttl_ms(P.seconds_to_ms(kwargs["ttl"], "ttl"))
    wait_ms = P.check_wait_ms(P.seconds_to_ms(wait, "wait", allow_none=True, allow_zero=True))
    delay_ms = P.check_lock_delay_ms(P.seconds_to_ms(kwargs["lock_delay"], "lock_delay", allow_zero=True))
    P.check_optional_str(kwargs["correlation_id"], "correlation_id", P.MAX_CORRELATION_ID_CHARS)
    if len(ordered) <= P.MAX_MANY and not client.connector.no_acquire_many:
        try:
            leases = await acquire_set(client, [(n, n in shared) for n in ordered], ttl_ms, wait_ms, delay_ms,
                                       kwargs["correlation_id"])
        except ProtocolError as exc:
            if f"unknown operation {P.OP_ACQUIRE_MANY}" not in str(exc):
                raise
            client.connector.no_acquire_many = True  # an older server: one by one from now on
            log.info("the server has no atomic multi-lock (an older fastlock): taking locks one by one")
        else:
            if renew_fraction is not None:
                for lease in leases:
                    client.start_renewing(lease, renew_fraction)
            return MultiLease(tuple(leases))
    return await _one_by_one(client, ordered, shared, kwargs, wait, renew_fraction)


async def _one_by_one(client: Client, ordered: SortedNames, shared: frozenset[str], kwargs: dict[str, Any],
                      wait: float | None, renew_fraction: float | None) -> MultiLease:
    """The locks one after the other in the global order; on any failure the locks
    taken so far are released (cancellation: released without waiting)."""
    loop = asyncio.get_running_loop()
    deadline = None if wait is None else loop.time() + wait
    leases: list[Lease] = []
    try:
        for name in ordered:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            lease = await client.acquire(name, wait=left, shared=name in shared, **kwargs)
            leases.append(lease)
            if renew_fraction is not None:
                client.start_renewing(lease, renew_fraction)
        multi = MultiLease(tuple(leases))
        if multi.lost.is_set():
            raise LeaseLost(f"a lease was lost while acquiring the others: {multi.lost_names()}")
        return multi
    except asyncio.CancelledError:
        for lease in leases:
            client.release_nowait(lease)
        raise
    except BaseException:
        if leases:
            await asyncio.gather(*(_release_quietly(client, lease) for lease in leases))
        raise


async def _release_quietly(client: Client, lease: Lease) -> None:
    try:
        await client.release(lease)
    except FastlockError:
        pass
    except asyncio.CancelledError:
        client.release_nowait(lease)
        raise


async def release_many(client: Client, multi: MultiLease) -> None:
    """Release every lease of ``multi`` (all of them, even if one fails); see
    :meth:`Client.release_many`."""
    if not isinstance(multi, MultiLease):
        raise WrongArgumentType(f"expected a fastlock MultiLease, not {type(multi).__name__}")
    results = await asyncio.gather(*(client.release(lease) for lease in reversed(multi.leases)),
                                   return_exceptions=True)
    multi.raise_failed_release(results)


class LeaseSetContext(Generic[_Set]):
    """Awaitable (the :class:`LeaseSet` taken) and an async context manager that releases
    it on exit: the shape of :meth:`Client.lock_many` and of
    :func:`~fastlock.client.across.lock_across`.  A subclass says how to take the set
    (``_acquire``) and release it (``_release``); a release that fails marks the set
    lost and logs a warning once."""

    __slots__ = ("_multi",)

    def __init__(self) -> None:
        self._multi: _Set | None = None

    def _acquire(self) -> Coroutine[Any, Any, _Set]:
        raise NotImplementedError

    async def _release(self, multi: _Set) -> None:
        raise NotImplementedError

    def __await__(self) -> Generator[Any, None, _Set]:
        return self._acquire().__await__()

    async def __aenter__(self) -> _Set:
        self._multi = await self._acquire()
        return self._multi

    async def __aexit__(self, *exc: object) -> None:
        multi, self._multi = self._multi, None
        if multi is None:
            return
        try:
            await self._release(multi)
        except FastlockError as err:
            if not multi.lost.is_set():
                log.warning("could not release all of %s: %s", [quote(n) for n in multi.names], err)
            multi.lost.set()


class LockManyContext(LeaseSetContext[MultiLease]):
    """Returned by :meth:`Client.lock_many`: awaitable and an async context manager."""

    __slots__ = ("_client", "_names", "_kwargs", "_wait", "_fraction")

    def __init__(self, client: Client, names: SortedNames, kwargs: dict[str, Any], wait: float | None, fraction: float):
        super().__init__()
        self._client = client
        self._names = names
        self._kwargs = kwargs
        self._wait = wait
        self._fraction = fraction

    def _acquire(self) -> Coroutine[Any, Any, MultiLease]:
        return acquire_many(self._client, self._names, self._kwargs, self._wait, self._fraction)

    async def _release(self, multi: MultiLease) -> None:
        await release_many(self._client, multi)
