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
once.  A node that takes a newer map pushes its epoch (``PUSH_SHARD_MAP``), and a
reconnection's HELLO names it: a newer epoch than the client's makes it read the map
from that group at once (one read at a time).  A call whose names span groups
(``acquire_many``, ``lock_many``) raises :class:`~fastlock.errors.CrossShard` before
anything is sent.  :data:`FORWARDED` lists the calls forwarded to one group's client.

Calls over every group (``locks``, ``sessions``, ``close_session``,
``revoke_principal``, ``list_prefix``, ``watch_prefix``) follow one rule,
:meth:`ShardedClient.over_groups`: the groups that answer are answered for, the ones
that cannot be reached are named in the answer's ``unreachable``.  A prefix with a
whole hash tag goes to its one group.  ``status`` and ``ping`` go to the group the
addresses given to ``connect`` belong to; :meth:`ShardedClient.group_clients`
reaches each group.

``ShardedClient.client_for(name)`` is the ``Router`` the cross-shard multi-lock
takes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from ..errors import CrossShard, FastlockError, LockNotHeld, ProtocolError, WrongShard
from ..protocol.ops import OP_SHARD_MAP
from ..sharding import ShardMap
from ..units import parse_address
from .across import AcrossContext, CrossShardLease, acquire_across, lock_across, release_across
from .admin import LockList, PrincipalRevocation
from .calls import call
from .client import Client
from .connection import RETRYABLE
from .edgechase import EdgeChaser
from .keys import KeyEvent, KeyList
from .renewer import Renewer
from .session import SessionClosed, SessionInfo

__all__ = ["GroupAnswers", "SessionList", "ShardedClient", "read_shard_map", "route_if_sharded"]

log = logging.getLogger(__name__)

#: seconds a redirect waits for its owner to serve a map as new as the redirect's epoch
REDIRECT_CATCH_UP_S = 2.0
#: seconds before the first look again at a node whose map is older than a redirect's (doubling each look)
CATCH_UP_FIRST_S = 0.002
#: the most seconds between two such looks
CATCH_UP_S = 0.02
#: how many times one call follows its name to a new owner
REDIRECT_HOPS = 3

#: makes a client of the given addresses with the options given to ``connect``
ClientFactory = Callable[[tuple[str, ...]], Client]
T = TypeVar("T")


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
        #: deadlock detection across groups for waiting acquires (fastlock.client.edgechase):
        #: ``edges.deadlock_timeout`` seconds before a wait's first probe (None: off)
        self.edges = EdgeChaser(self)
        seed.lease_moved = self._lease_moved
        #: the session key every group's client opens its session with (the seed's; None: no sessions)
        self._session_key = seed.session_keeper.key if seed.session_keeper is not None else None
        self._rehoming: set[asyncio.Future[None]] = set()
        #: the re-read a node's newer epoch started (one at a time)
        self._epoch_task: asyncio.Task[None] | None = None
        self._listen(seed_group, seed)

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
            client.lease_moved = self._lease_moved
            if client.session_keeper is not None and self._session_key is not None:
                # one session, one id, in every group: a slot move attaches the leases it ships to the
                # session of the same key on the destination, which this client's keep-alives there renew
                client.session_keeper.key = self._session_key
            self._listen(group, client)
        return client

    def _listen(self, group: str, client: Client) -> None:
        client.connector.on_shard_map_epoch = lambda epoch: self._saw_epoch(group, epoch)

    def _saw_epoch(self, group: str, epoch: int) -> None:
        """A node of ``group`` named map epoch ``epoch`` (pushed, or in its HELLO): a newer one
        than this client's is read from that group at once, one re-read at a time."""
        if epoch <= self.shard_map.epoch or self._epoch_task is not None or not self._clients:
            return
        self._epoch_task = asyncio.get_running_loop().create_task(self._read_newer(group))

    async def _read_newer(self, group: str) -> None:
        try:
            await self.refresh(group=group)
        except FastlockError as exc:  # the next redirect or epoch notice reads it again
            log.info("could not read shard map from group %s: %s", group, exc)
        finally:
            self._epoch_task = None


    # -- leases whose slot moved (fastlock shard move) -----------------------------------------
    def _lease_moved(self, renewer: Renewer, why: str) -> bool:
        """A group client's renewer heard that its lease is not held there (``why``): take it
        over; :meth:`_rehome` moves it to the name's new group, or loses it."""
        task = asyncio.ensure_future(self._rehome(renewer, why))
        self._rehoming.add(task)
        task.add_done_callback(self._rehoming.discard)
        return True

    async def _rehome(self, renewer: Renewer, why: str) -> None:
        """Read the map again; if another group owns the lease's name now, renew it there
        (an EXTEND through the new group proves the lease was adopted; the renewer moves to that
        group's client and session), else the lease is lost.  The renewer's deadline runs
        throughout: a move that takes longer loses the lease, as a silent server does."""
        old = renewer.client
        name = renewer.lease.name
        try:
            await self.refresh()
            new = self.client_for(name)
            if new is old:
                renewer.lose(why)
                return
            renewer.lease = await new.extend(renewer.lease)
        except FastlockError as exc:
            renewer.lose(f"{why}; after the shard map was read again: {exc}")
            return
        log.info("lease %s token %d moved to shard group %s", name, renewer.lease.fencing_token,
                 self._group_for(name))
        renewer.move_to(new)

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

    async def refresh(self, redirect: WrongShard | None = None, *, group: str | None = None) -> ShardMap:
        """Read the map again (from the group ``redirect`` names, else from ``group``, else the
        seed's) and keep it if its epoch is newer (a group's changed addresses are its client's
        from then on); returns the map kept.  Concurrent refreshes share one read.

        :raises ConnectionLost: no answer within the request timeout.
        :raises ShardMapError: the node sent no valid map.
        """
        if self._refreshing is not None:
            await asyncio.shield(self._refreshing)
            return self.shard_map
        self._refreshing = asyncio.get_running_loop().create_future()
        source: Client | None = None
        try:
            source = self._clients.get(group or self.seed_group) or self._clients.get(self.seed_group)
            if redirect is not None and redirect.group is not None:
                known = self._clients.get(redirect.group)
                source = known if known is not None else (self._make_client(redirect.addresses)
                                                          if redirect.addresses else source)
            assert source is not None
            found = await read_shard_map(source, self.request_timeout or 5.0)
            # the redirecting node may serve a newer map than the owner it names has read from etcd
            # yet (a move's flip reaches the nodes one by one): read again, 2 ms later, then twice as
            # long each time up to every 20 ms, for at most REDIRECT_CATCH_UP_S, until the map is as
            # new as the redirect's
            wanted = redirect.epoch if redirect is not None and type(redirect.epoch) is int else 0
            deadline = asyncio.get_running_loop().time() + REDIRECT_CATCH_UP_S
            pause = CATCH_UP_FIRST_S
            while (found is not None and found[1].epoch < wanted
                   and asyncio.get_running_loop().time() < deadline):
                await asyncio.sleep(pause)
                pause = min(pause * 2, CATCH_UP_S)
                found = await read_shard_map(source, self.request_timeout or 5.0)
            if found is not None and found[1].epoch > self.shard_map.epoch:
                log.info("shard map epoch %d -> %d", self.shard_map.epoch, found[1].epoch)
                self._take_map(found[1])
        finally:
            self._refreshing.set_result(None)
            self._refreshing = None
            if source is not None and source not in self._clients.values():
                await source.close()  # a client opened for this read only, whether or not it answered
        return self.shard_map

    def _take_map(self, shard_map: ShardMap) -> None:
        self.shard_map = shard_map
        for group in shard_map.groups:
            client = self._clients.get(group.name)
            addresses = [parse_address(a) for a in group.addresses]
            if client is not None and client.connector.addresses != addresses:
                client.connector.addresses = addresses  # the next connection attempt sweeps these

    async def _routed(self, name: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``client_for(name).method(*args, **kwargs)``; on WrongShard the map is read again and
        the call sent to the name's new owner if it changed (at most REDIRECT_HOPS times: a name
        may move on while a call follows it), or, while the redirecting node's map is older than
        this client's, asked again every 20 ms for at most REDIRECT_CATCH_UP_S seconds.  An
        acquire asked again goes with the owner key of the one redirected (``WrongShard.owner``):
        a waiter that a slot move shipped is known by that key at the new owner and keeps its place."""
        group = self._group_for(name)
        deadline = asyncio.get_running_loop().time() + REDIRECT_CATCH_UP_S
        hops = 0
        pause = CATCH_UP_FIRST_S
        while True:
            try:
                return await getattr(self.group_client(group), method)(*args, **kwargs)
            except WrongShard as exc:
                if exc.owner is not None and method == "acquire":
                    kwargs = {**kwargs, "_owner": exc.owner}
                await self.refresh(exc)
                owner = self._group_for(name)
                if owner != group and hops < REDIRECT_HOPS:
                    hops += 1
                    group = owner
                    continue
                lagging = type(exc.epoch) is int and exc.epoch < self.shard_map.epoch
                if owner != group or not lagging or asyncio.get_running_loop().time() >= deadline:
                    raise
                # the node serves an older map than this client's (a move's flip reaches the nodes one
                # by one): ask it again once it may have caught up (2 ms, then twice as long up to 20 ms)
                await asyncio.sleep(pause)
                pause = min(pause * 2, CATCH_UP_S)

    # -- calls written out (the others: FORWARDED, below the class) --------------------------
    async def acquire(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """As :meth:`Client.acquire <fastlock.client.Client.acquire>` on the owner's group; a
        waiting acquire is also checked for deadlocks across groups (:mod:`fastlock.client.edgechase`):
        :raises DeadlockDetected: it was the youngest wait of a wait-for cycle across groups."""
        return await self.edges.acquire(name, kwargs.get("wait"),
                                        lambda: self._routed(name, "acquire", (name, *args), kwargs))

    def lock(self, name: str, *args: Any, **kwargs: Any) -> Any:
        # the context acquires, renews and releases through this client: each call routed, a
        # release after a move sent to the name's new group
        return Client.lock(self, name, *args, **kwargs)

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

    async def over_groups(self, ask: Callable[[Client], Awaitable[T]]) -> GroupAnswers[T]:
        """``ask`` every group's client at once: the answers of the groups that answered and
        the errors of those that could not be reached (ConnectionLost, NotPrimary, Unavailable
        once its client's deadline passed) -- the one rule of every call over the whole map.

        :raises FastlockError: a group's other error (a refusal, a bad argument) as it came;
            when no group answered, the first group's error.
        """
        clients = self.group_clients()
        results = await asyncio.gather(*(ask(c) for c in clients.values()), return_exceptions=True)
        answers: dict[str, T] = {}
        unreachable: dict[str, BaseException] = {}
        for group, result in zip(clients, results):
            if not isinstance(result, BaseException):
                answers[group] = result
            elif isinstance(result, RETRYABLE):
                unreachable[group] = result
            else:
                raise result
        if not answers:
            raise next(iter(unreachable.values()))
        return GroupAnswers(answers, unreachable)

    async def locks(self, prefix: str = "", *, most: int | None = None, after: str | None = None,
                    order: str = "name") -> LockList:
        """One page of the held leases of every group (as :meth:`Client.locks`), merged, each lease
        once (during a slot move two groups hold it: the copy of the group owning its slot here is
        listed; ``matched`` counts it once when both copies are on the pages): by name,
        the page stops where the first group whose own page was cut stopped (``next`` goes on
        from there in every group); by waiters, the ``most`` most contended of all groups.  A
        group that cannot be reached is named in :attr:`LockList.unreachable` and the others
        are listed (:meth:`over_groups`)."""
        found = await self.over_groups(lambda c: c.locks(prefix, most=most, after=after, order=order))
        pages = list(found.answers.values())
        unreachable = found.reasons()
        # a lease is listed once: between a slot move's ship and its flip (and until the source
        # drops it) two groups hold it, with the same token; the copy of the group owning its
        # slot in this client's map is kept
        kept: dict[tuple[str, int], Any] = {}
        for group, page in found.answers.items():
            for lease in page.locks:
                key = (lease.name, lease.fencing_token)
                if key not in kept or self._group_for(lease.name) == group:
                    kept[key] = lease
        leases = list(kept.values())
        matched = sum(page.matched for page in pages) - (sum(len(page.locks) for page in pages) - len(leases))
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

    def _prefix_group(self, prefix: Any) -> str | None:
        """The one group owning every name that starts with ``prefix``: one that holds a whole
        hash tag (``{user42}:``); else None (its names are in every group)."""
        if type(prefix) is str:
            start = prefix.find("{")
            if start >= 0 and prefix.find("}", start + 1) > start + 1:
                return self._group_for(prefix)
        return None

    async def list_prefix(self, prefix: str, *, limit: int = 1000, after: str | None = None) -> KeyList:
        """The keys that start with ``prefix`` in every group (as :meth:`Client.list_prefix`),
        merged in key order, each from the group that owns its slot in the client's map (a slot
        move's destination holds a copy from the ship to the flip): the list stops where the
        first group whose own list was cut stopped (``cursor`` goes on from there in every
        group).  A prefix holding a whole hash tag is asked of its one group.  The groups that
        cannot be reached are named in :attr:`KeyList.unreachable` (:meth:`over_groups`)."""
        group = self._prefix_group(prefix)
        if group is not None:
            return await self.group_client(group).list_prefix(prefix, limit=limit, after=after)
        found = await self.over_groups(lambda c: c.list_prefix(prefix, limit=limit, after=after))
        pages = list(found.answers.values())
        # a key is listed from the group owning its slot in this client's map only: during a slot
        # move the destination holds the imported copy from the ship to the flip
        owned = (kv for group, page in found.answers.items() for kv in page if self._group_for(kv.key) == group)
        keys = sorted(owned, key=lambda kv: kv.key)
        cut = min((page[-1].key for page in pages if page.more and page), default=None)
        if cut is not None:
            keys = [kv for kv in keys if kv.key <= cut]
        more = cut is not None or len(keys) > limit
        keys = keys[:limit]
        return KeyList(keys, more, keys[-1].key if more and keys else None, found.reasons())

    def watch_prefix(self, prefix: str, *, progress: bool = False) -> AsyncIterator[KeyEvent]:
        """Every later change of a key under ``prefix`` in every group (as
        :meth:`Client.watch_prefix` in each, merged as they arrive: each group's changes in
        its order, the revisions each group's own).  A prefix holding a whole hash tag is
        watched in its one group.  A group's error (ConnectionLost once its client's deadline
        passed, Compacted, WatchDiverged) ends the whole watch."""
        group = self._prefix_group(prefix)
        if group is not None:
            return self.group_client(group).watch_prefix(prefix, progress=progress)
        return merge_streams([c.watch_prefix(prefix, progress=progress) for c in self.group_clients().values()])

    async def sessions(self, principal: str | None = None) -> SessionList:
        """Every group's client sessions (as :meth:`Client.sessions`; a client has one per group);
        the groups that cannot be reached are named in :attr:`SessionList.unreachable`
        (:meth:`over_groups`)."""
        found = await self.over_groups(lambda c: c.sessions(principal))
        return SessionList((info for page in found.answers.values() for info in page), found.reasons())

    async def close_session(self, session_id: str, *, reason: str | None = None) -> SessionClosed:
        """Close session ``session_id`` in every group that has it (as :meth:`Client.close_session`;
        a routing client's session has one id in every group, and a slot move takes its leases'
        share with them): ``revoked`` counts the leases revoked in all of them.

        :raises LockNotHeld: no group has it.
        :raises ConnectionLost: (or NotPrimary, Unavailable) no group that answered has it and a
            group could not be reached (it may be there).
        """
        missing: list[LockNotHeld] = []

        async def close(client: Client) -> SessionClosed | None:
            try:
                return await client.close_session(session_id, reason=reason)
            except LockNotHeld as exc:
                missing.append(exc)
                return None

        found = await self.over_groups(close)
        closed = [answer for answer in found.answers.values() if answer is not None]
        if closed:
            return SessionClosed(closed[0].id, closed[0].principal, sum(c.revoked for c in closed))
        if found.unreachable:
            raise next(iter(found.unreachable.values()))
        raise missing[0]

    async def revoke_principal(self, principal: str, *, reason: str | None = None) -> PrincipalRevocation:
        """Revoke every lease ``principal`` holds in every group (as :meth:`Client.revoke_principal`):
        the counts are the sums of the groups that answered; those that cannot be reached are
        named in :attr:`PrincipalRevocation.unreachable` (:meth:`over_groups`)."""
        found = await self.over_groups(lambda c: c.revoke_principal(principal, reason=reason))
        done = found.answers.values()
        return PrincipalRevocation(principal, sum(d.revoked for d in done), sum(d.waiting for d in done),
                                   found.reasons())

    async def close(self) -> None:
        """Close every group's client (each as :meth:`Client.close`)."""
        clients = list(self._clients.values())
        self._clients.clear()
        if self._epoch_task is not None:
            self._epoch_task.cancel()
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        await super().close()


@dataclass(frozen=True)
class GroupAnswers(Generic[T]):
    """A call over every group (:meth:`ShardedClient.over_groups`): ``answers`` (group name ->
    its answer) of the groups that answered, ``unreachable`` (group name -> its error) of
    those that could not be reached."""

    answers: dict[str, T]
    unreachable: dict[str, BaseException]

    def reasons(self) -> dict[str, str]:
        """``unreachable`` as group name -> the error's text (LockList's, SessionList's)."""
        return {group: str(error) for group, error in self.unreachable.items()}


class SessionList(list[SessionInfo]):
    """:meth:`ShardedClient.sessions`' list of sessions, and ``unreachable`` (group name -> the
    error) naming the groups that could not be reached, whose sessions are not listed."""

    def __init__(self, sessions: Iterable[SessionInfo] = (), unreachable: dict[str, str] | None = None):
        super().__init__(sessions)
        self.unreachable: dict[str, str] = dict(unreachable or {})


#: items a merged watch holds for its reader beyond what each group's watch holds
MERGED_BACKLOG = 64


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of every stream of ``streams`` as they arrive (each stream's in its order);
    the first error of any stream is raised; closing this closes them all."""
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue(MERGED_BACKLOG)

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((True, item))
            await queue.put((False, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((False, exc))
        finally:
            closing = getattr(stream, "aclose", None)
            if closing is not None:
                await closing()

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    running = len(tasks)
    try:
        while running:
            is_item, value = await queue.get()
            if is_item:
                yield value
            elif value is not None:
                raise value
            else:
                running -= 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _lease_name(lease: Any) -> Any:
    """A lease's name, or None for what is not a lease (the seed's client refuses it)."""
    return getattr(lease, "name", None)


def _first(value: Any) -> Any:
    return value


class Forwarded(NamedTuple):
    """How :class:`ShardedClient` forwards one :class:`Client` method: ``where`` picks the
    client (``"owner"``: the group owning the name found from the first argument by
    ``name_of``; ``"seed"``: the seed's group); ``awaited`` calls are retried once after a
    redirect (``"owner"`` only); the others return an object made by that client."""

    method: str
    where: str
    awaited: bool
    name_of: Callable[[Any], Any] = _first


#: every Client method a ShardedClient forwards as it is (the others, ``acquire`` and ``lock`` among
#: them, are written out in the class)
FORWARDED: tuple[Forwarded, ...] = (
    # calls that name one name or key
    *(Forwarded(m, "owner", True) for m in ("check", "holder", "contenders", "lock_info", "revoke",
                                            "limit", "get", "put", "delete")),
    # objects that call later (context managers, iterators, recipes): made by the owner's client
    *(Forwarded(m, "owner", False) for m in ("semaphore", "watch", "election", "reentrant_lock",
                                             "once_per", "rate_limiter", "latch", "double_barrier")),
    # calls on a lease: its name's group
    *(Forwarded(m, "owner", True, _lease_name) for m in ("release", "extend", "renew_before", "transfer")),
    *(Forwarded(m, "owner", False, _lease_name) for m in ("release_nowait", "start_renewing")),
    # calls that name none, or a prefix: the seed's group
    *(Forwarded(m, "seed", True) for m in ("ensure_connected", "status", "ping")),
)


def _forwarder(entry: Forwarded) -> Callable[..., Any]:
    """The ShardedClient method ``entry`` describes (documented as Client's)."""
    method, name_of = entry.method, entry.name_of

    async def to_seed(self: ShardedClient, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.seed, method)(*args, **kwargs)

    def made_by_seed(self: ShardedClient, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.seed, method)(*args, **kwargs)

    async def to_owner(self: ShardedClient, first: Any, *args: Any, **kwargs: Any) -> Any:
        return await self._routed(name_of(first), method, (first, *args), kwargs)

    def made_by_owner(self: ShardedClient, first: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.client_for(name_of(first)), method)(first, *args, **kwargs)

    forward: Callable[..., Any] = ((to_seed if entry.awaited else made_by_seed) if entry.where == "seed"
                                   else (to_owner if entry.awaited else made_by_owner))
    forward = functools.wraps(getattr(Client, method))(forward)
    forward.__qualname__ = f"ShardedClient.{method}"
    return forward


for _entry in FORWARDED:
    setattr(ShardedClient, _entry.method, _forwarder(_entry))
del _entry
