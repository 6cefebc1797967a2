"""Routing a client's calls over a sharded deployment: :class:`ShardedClient`.

Against a node that serves a shard map (its HELLO names ``shard_map_epoch``),
:func:`fastlock.connect` reads the map (``SHARD_MAP``) and returns a
:class:`ShardedClient`: a :class:`~fastlock.client.Client` whose every call that
names a lock, key or semaphore goes to the owning group's primary, as the map says
(:mod:`fastlock.sharding`).  Each group is reached by a client of its own
(:meth:`ShardedClient.client_for`), opened on first use with the options given to
``connect`` and the group's addresses from the map, so each rides through its own
group's failovers, and each has its own session (one session per group
connection).  No proxy stands in between, as Redis Cluster's clients route.

A node answers a name its group does not own with
:class:`~fastlock.errors.WrongShard`: an awaited call then reads the map again from
the owner the redirect names and, if that map sends the name elsewhere, retries
once.  A call whose names span groups (``acquire_many``, ``lock_many``) raises
:class:`~fastlock.errors.CrossShard` before anything is sent.  Calls that take a
prefix or none (``locks``, ``list_prefix``, ``watch_prefix``, ``status``,
``ping``, ``sessions``) go to the group the addresses given to ``connect``
belong to; :meth:`ShardedClient.group_clients` reaches each group.

``ShardedClient.client_for(name)`` is the ``Router`` the cross-shard multi-lock
takes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import CrossShard, LockNotHeld, ProtocolError, WrongShard
from ..protocol.ops import OP_SHARD_MAP
from ..sharding import ShardMap
from .across import AcrossContext, CrossShardLease, acquire_across, lock_across, release_across
from .admin import LockList, PrincipalRevocation
from .calls import call
from .client import Client
from .connection import RETRYABLE
from .session import SessionClosed, SessionInfo

__all__ = ["ShardedClient", "read_shard_map", "route_if_sharded"]

log = logging.getLogger(__name__)

#: makes a client of the given addresses with the options given to ``connect``
ClientFactory = Callable[[tuple[str, ...]], Client]


async def read_shard_map(client: Client, timeout: float = 5.0) -> tuple[str, ShardMap] | None:
    """The shard map ``client``'s node serves by and its group, or None: not sharded.

    :raises ShardMapError: the node sent no valid map.
    :raises ConnectionLost: no answer within ``timeout`` seconds.
    """
    reply = await call(client.connector, OP_SHARD_MAP, (), timeout)
    if reply is None:
        return None
    if not isinstance(reply, dict) or type(reply.get("group")) is not str:
        raise ProtocolError(f"a SHARD_MAP reply is {{'group', 'map'}} or None, not {reply!r:.200}")
    return reply["group"], ShardMap.from_wire(reply.get("map"))


async def route_if_sharded(client: Client, make_client: ClientFactory) -> Client:
    """Connect ``client``; if its node is sharded, a :class:`ShardedClient` built on it,
    making the other groups' clients with ``make_client``; else ``client`` itself."""
    await client.ensure_connected()
    if client.server_info.get("shard_map_epoch") is None:
        return client
    found = await read_shard_map(client, client.request_timeout or 5.0)
    if found is None:
        return client
    group, shard_map = found
    return ShardedClient(client, group, shard_map, make_client)


class ShardedClient(Client):
    """A client of a sharded deployment (see the module docstring); made by :func:`fastlock.connect`.

    ``seed`` is the connected client of group ``seed_group``; ``shard_map`` the map it
    served; ``make_client`` makes a client of a group's addresses.  Its own connection
    is never opened: every call goes to a group's client.
    """

    def __init__(self, seed: Client, seed_group: str, shard_map: ShardMap, make_client: ClientFactory):
        super().__init__(seed.connector.addresses, request_timeout=seed.request_timeout, session=False)
        self.shard_map = shard_map
        self.seed_group = seed_group
        self._make_client = make_client
        #: group name -> its client (the seed's group: the seed)
        self._clients: dict[str, Client] = {seed_group: seed}
        self._refreshing: asyncio.Future[None] | None = None

    # -- the router -------------------------------------------------------------------------
    def client_for(self, name: str) -> Client:
        """The client of the group that owns ``name`` (opened on its first call); for a
        ``name`` that is not a str, the seed's client (whose checks refuse it as usual)."""
        return self.group_client(self._group_for(name))

    def _group_for(self, name: Any) -> str:
        return self.shard_map.owner(name).name if type(name) is str else self.seed_group

    def group_client(self, group: str) -> Client:
        """The client of group ``group`` of the map.  :raises ShardMapError: no such group."""
        client = self._clients.get(group)
        if client is None:
            client = self._clients[group] = self._make_client(self.shard_map.group(group).addresses)
        return client

    def group_clients(self) -> dict[str, Client]:
        """A client for every group of the map that owns a slot, by group name.  A group that
        owns none (added before any slot is assigned to it) holds no lease, key or session a
        client made, so it is not dialled (and one not running yet fails no call)."""
        owners = {r.group for r in self.shard_map.ranges}
        return {g.name: self.group_client(g.name) for g in self.shard_map.groups if g.name in owners}

    def group_of(self, names: Iterable[str]) -> str:
        """The one group that owns every name of ``names``.

        :raises CrossShard: they span groups (put a hash tag in them: ``{tag}:name``).
        """
        groups = sorted({self.shard_map.owner(n).name for n in names if type(n) is str})
        if not groups:  # no name (or none of the right type): the seed's client refuses them as usual
            return self.seed_group
        if len(groups) != 1:
            raise CrossShard(f"these names span shard groups {', '.join(groups)} (shard map epoch "
                             f"{self.shard_map.epoch}): one call's names must be in one group; put a hash tag "
                             f"in them, e.g. '{{tag}}:name', to keep them together, or take them all or none "
                             f"across groups with lock_across", tuple(groups),
                             self.shard_map.epoch)
        return groups[0]

    async def refresh(self, redirect: WrongShard | None = None) -> ShardMap:
        """Read the map again (from the group ``redirect`` names, else the seed's) and keep it
        if its epoch is newer; returns the map kept.  Concurrent refreshes share one read."""
        if self._refreshing is not None:
            await asyncio.shield(self._refreshing)
            return self.shard_map
        self._refreshing = asyncio.get_running_loop().create_future()
        source: Client | None = None
        try:
            source = self._clients.get(self.seed_group)
            if redirect is not None and redirect.group is not None:
                known = self._clients.get(redirect.group)
                source = known if known is not None else (self._make_client(redirect.addresses)
                                                          if redirect.addresses else source)
            assert source is not None
            found = await read_shard_map(source, self.request_timeout or 5.0)
            if found is not None and found[1].epoch > self.shard_map.epoch:
                log.info("shard map epoch %d -> %d", self.shard_map.epoch, found[1].epoch)
                self.shard_map = found[1]
        finally:
            self._refreshing.set_result(None)
            self._refreshing = None
            if source is not None and source not in self._clients.values():
                await source.close()  # a client opened for this read only, whether or not it answered
        return self.shard_map

    async def _routed(self, name: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``client_for(name).method(*args, **kwargs)``; on WrongShard the map is read again and
        the call retried once if the name's owner changed."""
        group = self._group_for(name)
        try:
            return await getattr(self.group_client(group), method)(*args, **kwargs)
        except WrongShard as exc:
            await self.refresh(exc)
            if self._group_for(name) == group:
                raise
        return await getattr(self.client_for(name), method)(*args, **kwargs)

    # -- calls that name one name -------------------------------------------------------------
    async def acquire(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(name, "acquire", (name, *args), kwargs)

    async def check(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(name, "check", (name, *args), kwargs)

    async def holder(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(name, "holder", (name, *args), kwargs)

    async def contenders(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(name, "contenders", (name, *args), kwargs)

    async def lock_info(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(name, "lock_info", (name, *args), kwargs)

    async def revoke(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(name, "revoke", (name, *args), kwargs)

    async def limit(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(name, "limit", (name, *args), kwargs)

    async def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(key, "get", (key, *args), kwargs)

    async def put(self, key: str, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(key, "put", (key, *args), kwargs)

    async def delete(self, key: str, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(key, "delete", (key, *args), kwargs)

    # objects that call later (context managers, iterators, recipes): made by the owner's client
    def lock(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.client_for(name).lock(name, *args, **kwargs)

    def semaphore(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.client_for(name).semaphore(name, *args, **kwargs)

    def watch(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.client_for(name).watch(name, *args, **kwargs)

    def election(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.client_for(name).election(name, *args, **kwargs)

    def reentrant_lock(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.client_for(name).reentrant_lock(name, *args, **kwargs)

    def once_per(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.client_for(name).once_per(name, *args, **kwargs)

    def rate_limiter(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.client_for(name).rate_limiter(name, *args, **kwargs)

    def latch(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.client_for(name).latch(name, *args, **kwargs)

    def double_barrier(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.client_for(name).double_barrier(name, *args, **kwargs)

    # -- calls on a lease: its name's group ------------------------------------------------------
    async def release(self, lease: Any, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(_lease_name(lease), "release", (lease, *args), kwargs)

    async def extend(self, lease: Any, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(_lease_name(lease), "extend", (lease, *args), kwargs)

    async def renew_before(self, lease: Any, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(_lease_name(lease), "renew_before", (lease, *args), kwargs)

    async def transfer(self, lease: Any, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(_lease_name(lease), "transfer", (lease, *args), kwargs)

    def release_nowait(self, lease: Any, *args: Any, **kwargs: Any) -> Any:
        return self.client_for(_lease_name(lease)).release_nowait(lease, *args, **kwargs)

    def start_renewing(self, lease: Any, *args: Any, **kwargs: Any) -> Any:
        return self.client_for(_lease_name(lease)).start_renewing(lease, *args, **kwargs)

    # -- calls that name several names: one group's ---------------------------------------------
    async def acquire_many(self, names: Iterable[str], *args: Any, **kwargs: Any) -> Any:
        names = list(names)
        return await self.group_client(self.group_of(names)).acquire_many(names, *args, **kwargs)

    def lock_many(self, names: Iterable[str], *args: Any, **kwargs: Any) -> Any:
        names = list(names)
        return self.group_client(self.group_of(names)).lock_many(names, *args, **kwargs)

    async def release_many(self, multi: Any, *args: Any, **kwargs: Any) -> Any:
        names = getattr(multi, "names", ())  # not a MultiLease: the seed's client refuses it
        return await self.group_client(self.group_of(names)).release_many(multi, *args, **kwargs)

    # -- several names over several groups: a cross-shard multi-lock (fastlock.client.across) ------
    def lock_across(self, names: Iterable[str], *, ttl: float, wait: float | None = None,
                    **kwargs: Any) -> AcrossContext:
        """``async with client.lock_across(names, ttl=10.0) as multi:`` - every name, all or
        none, wherever the map puts each (wound-wait reservations, one per group): as
        :func:`fastlock.client.across.lock_across` with this client as the router; ``ttl``
        and ``wait`` in seconds, the same keyword arguments and errors."""
        return lock_across(self, names, ttl=ttl, wait=wait, **kwargs)

    async def acquire_across(self, names: Iterable[str], *, ttl: float, wait: float | None = None,
                             **kwargs: Any) -> CrossShardLease:
        """:meth:`lock_across` as a coroutine (release with :meth:`release_across`)."""
        return await acquire_across(self, names, ttl=ttl, wait=wait, **kwargs)

    async def release_across(self, multi: CrossShardLease) -> None:
        """Release every lease of ``multi`` (:func:`fastlock.client.across.release_across`)."""
        await release_across(multi)

    # -- calls that name none, or a prefix: the seed's group --------------------------------------
    @property
    def seed(self) -> Client:
        """The client of the group the addresses given to ``connect`` belong to."""
        return self._clients[self.seed_group]

    @property
    def server_info(self) -> dict[str, Any]:
        return self.seed.server_info

    @property
    def max_epoch(self) -> int:
        return self.seed.max_epoch

    async def ensure_connected(self, *args: Any, **kwargs: Any) -> Any:
        return await self.seed.ensure_connected(*args, **kwargs)

    async def status(self, *args: Any, **kwargs: Any) -> Any:
        return await self.seed.status(*args, **kwargs)

    async def ping(self, *args: Any, **kwargs: Any) -> Any:
        return await self.seed.ping(*args, **kwargs)

    async def locks(self, prefix: str = "", *, most: int | None = None, after: str | None = None,
                    order: str = "name") -> LockList:
        """One page of the held leases of every group (as :meth:`Client.locks`), merged: by name,
        the page stops where the first group whose own page was cut stopped (``next`` goes on
        from there in every group); by waiters, the ``most`` most contended of all groups.  A
        group that cannot be reached (ConnectionLost, NotPrimary, Unavailable once its client's
        deadline passed) is named in :attr:`LockList.unreachable` and the others are listed;
        when no group answers, the first group's error is raised."""
        clients = self.group_clients()
        answers = await asyncio.gather(*(c.locks(prefix, most=most, after=after, order=order)
                                         for c in clients.values()), return_exceptions=True)
        pages: list[LockList] = []
        unreachable: dict[str, str] = {}
        for group, answer in zip(clients, answers):
            if isinstance(answer, LockList):
                pages.append(answer)
            elif isinstance(answer, RETRYABLE) and len(answers) > 1:
                unreachable[group] = str(answer)  # listed as such; the live groups' leases still are
            elif isinstance(answer, BaseException):
                raise answer
        if not pages:  # no group answered
            raise next(a for a in answers if isinstance(a, BaseException))
        leases = [lease for page in pages for lease in page.locks]
        matched = sum(page.matched for page in pages)
        limit = most if most is not None else 10_000
        if order != "name":
            leases.sort(key=lambda lease: (-lease.waiters, lease.name))
            return LockList(leases[:limit], matched, any(p.truncated for p in pages) or len(leases) > limit,
                            unreachable=unreachable)
        leases.sort(key=lambda lease: lease.name)
        cut = min((p.locks[-1].name for p in pages if p.truncated and p.locks), default=None)
        if cut is not None:
            leases = [lease for lease in leases if lease.name <= cut]
        if len(leases) > limit:  # at a lock's boundary: a lock's leases stay on one page
            last = leases[limit - 1].name
            leases = [lease for lease in leases if lease.name <= last]
            cut = last
        return LockList(leases, matched, cut is not None, cut, unreachable)

    async def list_prefix(self, *args: Any, **kwargs: Any) -> Any:
        return await self.seed.list_prefix(*args, **kwargs)

    def watch_prefix(self, *args: Any, **kwargs: Any) -> Any:
        return self.seed.watch_prefix(*args, **kwargs)

    async def sessions(self, principal: str | None = None) -> list[SessionInfo]:
        """Every group's client sessions (as :meth:`Client.sessions`; a client has one per group)."""
        pages = await asyncio.gather(*(c.sessions(principal) for c in self.group_clients().values()))
        return [info for page in pages for info in page]

    async def close_session(self, session_id: str, *, reason: str | None = None) -> SessionClosed:
        """Close session ``session_id`` in the group that has it (as :meth:`Client.close_session`).

        :raises LockNotHeld: no group has it.
        """
        missing: LockNotHeld | None = None
        for client in self.group_clients().values():
            try:
                return await client.close_session(session_id, reason=reason)
            except LockNotHeld as exc:
                missing = exc
        assert missing is not None  # a map names at least one group
        raise missing

    async def revoke_principal(self, principal: str, *, reason: str | None = None) -> PrincipalRevocation:
        """Revoke every lease ``principal`` holds in every group (as :meth:`Client.revoke_principal`):
        the counts are the groups' sums."""
        done = await asyncio.gather(*(c.revoke_principal(principal, reason=reason)
                                      for c in self.group_clients().values()))
        return PrincipalRevocation(principal, sum(d.revoked for d in done), sum(d.waiting for d in done))

    async def close(self) -> None:
        """Close every group's client (each as :meth:`Client.close`)."""
        clients = list(self._clients.values())
        self._clients.clear()
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        await super().close()


def _lease_name(lease: Any) -> Any:
    """A lease's name, or None for what is not a lease (the seed's client refuses it)."""
    return getattr(lease, "name", None)
