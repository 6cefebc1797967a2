"""A tooz driver: ``fastlock://host:port[,host:port]?client_name=...``.

Installed with ``pip install fastlock[tooz]`` and registered under the
``tooz.backends`` entry point as ``fastlock``, so a service written for tooz
switches to fastlock by changing its URL::

    coordinator = tooz.coordination.get_coordinator("fastlock://10.0.0.5:7420,10.0.0.6:7420", b"worker-1")
    coordinator.start(start_heart=True)
    with coordinator.get_lock(b"resize-volumes"):
        ...

URL options (all optional):

``client_name``
    the name the server logs and records with grants (default: the member id).
``timeout``
    seconds (default 30, at most 3600): the TTL of the member's session lease and of every
    lock; :meth:`heartbeat` (tooz's ``Heart`` thread with ``start_heart=True``)
    extends them.  A member that stops beating leaves its groups within this.
``token`` / ``token_file``
    the client's principal token (see ``fastlock credentials init``).
``prefix``
    the names' prefix (default ``tooz/``), for ACLs: ``<prefix>lock/<name>``
    (locks), ``<prefix>group/<group>`` (groups), ``<prefix>member/<group>/<member>``
    (members), ``<prefix>session/<member>/<random>`` (the session lease),
    ``<prefix>leader-lock/<group>`` and ``<prefix>leader/<group>`` (elections).
    The principal needs ``acquire, release, extend, cancel, check`` and
    ``put, get, delete`` on it.
``connect_timeout``
    seconds for each connect (default 5).

A bad ``timeout`` or ``connect_timeout`` raises
:class:`~fastlock.errors.InvalidArgument` (a ``ValueError``) from
``get_coordinator``, not the ``ToozConnectionError`` a service retries on.

How tooz's concepts map to fastlock:

* a lock is a fastlock lock (fencing token and all) with a TTL of ``timeout``;
  ``blocking`` is the acquire's ``wait`` (False: one try; a number: that many
  seconds); ``is_still_owner`` is the server's token check; ``break_`` is the
  server's revoke (an admin request: an admin principal, or open mode).
  ``acquire(shared=True)`` takes a fastlock shared lease; a lock object keeps a
  stack of holds, and a shared acquire on an object that holds a live shared
  lease joins it (one more release needed) instead of queueing behind a waiting
  writer (:mod:`fastlock.contrib.tooz_lock`).
* a group is a key without lease (:mod:`fastlock.server.keys`); a member is a
  key attached to the coordinator's session lease, holding its capabilities
  (msgpack, as tooz's other drivers store them): the member vanishes when
  the session lease is released (``stop``) or expires (no heartbeat).  A listing
  (``get_groups``, ``get_members``) of more than :data:`LIST_LIMIT` (10,000) keys
  raises ``ToozError`` rather than return part of them: the server lists at most
  that many per request.
* join/leave watches compare the members between two ``run_watchers`` calls
  (tooz's cached watchers); an election is a lock per group
  (``leader-lock/<group>``) with a key naming the leader attached to its lease.

**A sharded deployment** (the URL names a node of any group): the coordinator's client
routes each name to its group (:mod:`fastlock.client.sharded`), listings span every
group.  A key attached to a lease lives in the lease's group, so the member keys of each
shard group hang on a session lease of that group (``<prefix>session/<member>/<random>``
with a hash tag, ``{...}``, that puts it in the member key's slot, taken at the first
join there; beaten and released with the others), and a leader lock's name carries the
hash tag of its leader key's slot (``<prefix>leader-lock/<group>{...}``): both the same
for every member.  An unsharded server sees the names above, unchanged.

Member and group ids are bytes; in names they appear as hex.  Every call runs
on the coordinator's own event loop thread, so a coordinator may be shared by
threads (as tooz's tests do).

**fork()**: a coordinator started before ``fork()`` has its loop thread, its
connection, its session (memberships) and its locks in the parent.  In the child
every call raises :class:`tooz.ToozError` at once (an asynchronous one: its
result's ``get()``) instead of waiting for a thread that is not there; ``stop()``
in the child drops the parent's state without sending anything or touching the
parent's connection, and ``start()`` then connects from the child, with a new
session.  A lock object the child inherited holds nothing there: its ``release()``
returns False and never frees the parent's lease.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import tooz
from tooz import coordination
from tooz import utils as tooz_utils

from .. import client as fl_client
from ..client.acquire import CALLER
from ..client.forks import keep_inherited
from ..client.keys import MAX_LIST
from ..client.sharded import ShardedClient
from ..errors import (
    ConnectionLost,
    FastlockError,
    InvalidArgument,
    KeyExists,
    KeyNotFound,
    LeaseLost,
    LockNotAcquired,
)
from ..protocol import MAX_TTL_MS
from ..sharding import slot_of
from ..units import check_seconds
from .tooz_lock import FastlockLock

__all__ = ["FastlockDriver", "FastlockLock"]

log = logging.getLogger(__name__)

#: keys one listing returns at most (the server's KEY_LIST limit, :mod:`fastlock.server.keys`)
LIST_LIMIT = MAX_LIST

T = TypeVar("T")


def _hex(data: bytes | str) -> str:
    return tooz_utils.to_binary(data).hex()


def _lock_part(name: bytes | str) -> str:
    """A tooz lock name as part of a fastlock name: its UTF-8 text, or ``hex:`` and its hex."""
    raw = tooz_utils.to_binary(name)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "hex:" + raw.hex()
    return text if text and not text.startswith("hex:") else "hex:" + raw.hex()


def _seconds_option(opts: dict[str, Any], key: str, default: float, maximum: float | None = None) -> float:
    """URL option ``key`` in seconds, > 0 and at most ``maximum``: checked when the driver is
    made (a bad URL is no connection failure, which a service would retry).

    Raises:
        InvalidArgument: not a number, NaN, infinite, <= 0 or above ``maximum``.
    """
    raw = opts.get(key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise InvalidArgument(f"the {key} option must be a number of seconds, got {raw!r}") from None
    return check_seconds(value, f"the {key} option", maximum=maximum)


def _iso(wall_ms: int) -> str:
    return datetime.datetime.fromtimestamp(wall_ms / 1000, datetime.timezone.utc).isoformat()


class _Loop:
    """An event loop on a daemon thread, for the coordinator's fastlock client."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        #: group operations run one at a time, in the order they were submitted (as tooz's
        #: other drivers run them on one executor thread): a join then a get sees the member
        self.serial = asyncio.Lock()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


class FastlockDriver(coordination.CoordinationDriverCachedRunWatchers):
    """The tooz coordinator on a fastlock server (see the module docstring)."""

    CHARACTERISTICS = (
        coordination.Characteristics.DISTRIBUTED_ACROSS_THREADS,
        coordination.Characteristics.DISTRIBUTED_ACROSS_PROCESSES,
        coordination.Characteristics.DISTRIBUTED_ACROSS_HOSTS,
        coordination.Characteristics.LINEARIZABLE,
        coordination.Characteristics.SEQUENTIAL,
        coordination.Characteristics.CAUSAL,
    )

    def __init__(self, member_id: bytes, parsed_url: Any, options: dict[str, Any]):
        super().__init__(member_id, parsed_url, options)
        opts = tooz_utils.collapse(options)
        self._addresses = [a for a in (parsed_url.netloc or "").split(",") if a] or ["127.0.0.1:7420"]
        self._timeout = _seconds_option(opts, "timeout", 30.0, maximum=MAX_TTL_MS / 1000)
        #: seconds: the TTL of every lock lease (the ``timeout`` option)
        self.lock_ttl = self._timeout
        self._connect_timeout = _seconds_option(opts, "connect_timeout", 5.0)
        self._prefix = str(opts.get("prefix", "tooz/"))
        self._client_name = str(opts.get("client_name") or tooz_utils.to_binary(member_id).decode("utf-8", "replace"))
        self._token = opts.get("token")
        self._token_file = opts.get("token_file")
        self._loop: _Loop | None = None
        self._fl: fl_client.Client | None = None
        self._session: fl_client.Lease | None = None
        #: on a sharded deployment: shard group -> the session lease of the member keys there
        #: (the home session's group excepted)
        self._shard_sessions: dict[str, fl_client.Lease] = {}
        self._acquired_locks: set[FastlockLock] = set()
        self._leader_locks: dict[bytes, FastlockLock] = {}
        #: the process that started the coordinator (see "fork()" in the module docstring)
        self._pid = 0

    # -- plumbing -------------------------------------------------------------------------
    def _name(self, kind: str, *parts: str) -> str:
        return self._prefix + kind + "/".join(parts)

    def fastlock_client(self) -> fl_client.Client:
        """The coordinator's :class:`fastlock.client.Client` (use it through :meth:`call`).

        Raises:
            tooz.ToozError: the coordinator is not started.
        """
        if self._fl is None:
            raise tooz.ToozError("the coordinator is not started")
        return self._fl

    def check_process(self) -> None:
        """Raise if this process is a fork of the one that started the coordinator.

        Raises:
            tooz.ToozError: a forked child (see "fork()" in the module docstring).
        """
        if self._loop is not None and self._pid != os.getpid():
            raise tooz.ToozError(f"this tooz coordinator was started in process {self._pid} and this process "
                                 f"({os.getpid()}) is a fork of it: call stop() then start() to connect from here")

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the coordinator's loop and wait for it (from any thread but the
        loop's own); a lost connection is tooz's ToozConnectionError, another fastlock error
        a ToozError (LockNotAcquired, LeaseLost, KeyExists and KeyNotFound pass through).

        Raises:
            tooz.ToozError: the coordinator is not started.
        """
        if self._loop is None:
            coro.close()
            raise tooz.ToozError("the coordinator is not started")
        try:
            self.check_process()
        except tooz.ToozError:
            coro.close()
            raise
        # the calling thread is the caller the client's self-wait check compares (the task
        # copies this context when it is scheduled), as the blocking client does
        caller = CALLER.set(threading.current_thread())
        try:
            return self._loop.run(coro)
        except (LockNotAcquired, LeaseLost, KeyExists, KeyNotFound):
            raise
        except ConnectionLost as exc:
            tooz_utils.raise_with_cause(coordination.ToozConnectionError, str(exc), cause=exc)
        except FastlockError as exc:
            tooz_utils.raise_with_cause(tooz.ToozError, str(exc), cause=exc)
        finally:
            CALLER.reset(caller)
        raise AssertionError("unreachable")  # pragma: no cover

    def lock_taken(self, lock: FastlockLock) -> None:
        """Note that ``lock`` holds a lease: :meth:`heartbeat` extends it, :meth:`stop` releases it."""
        self._acquired_locks.add(lock)

    def lock_dropped(self, lock: FastlockLock) -> None:
        """Note that ``lock`` holds no lease any more."""
        self._acquired_locks.discard(lock)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> coordination.CoordinatorResult[T]:
        """``coro`` on the coordinator's loop, as tooz's asynchronous result."""
        if self._loop is None:
            coro.close()
            raise tooz.ToozError("the coordinator is not started")
        try:
            self.check_process()
        except tooz.ToozError as exc:
            coro.close()
            failed: concurrent.futures.Future[T] = concurrent.futures.Future()
            failed.set_exception(exc)
            return coordination.CoordinatorResult(failed)
        return coordination.CoordinatorResult(self._loop.submit(_translated(coro, self._loop.serial)))

    def _start(self) -> None:
        self._pid = os.getpid()
        self._loop = _Loop(f"fastlock-tooz-{self._client_name}")
        kwargs: dict[str, Any] = {"client_name": self._client_name[:128], "connect_timeout": self._connect_timeout}
        if self._token is not None:
            kwargs["token"] = self._token
        if self._token_file is not None:
            kwargs["token_file"] = self._token_file

        async def start() -> tuple[fl_client.Client, fl_client.Lease]:
            client = await fl_client.connect(*self._addresses, **kwargs)
            try:
                session = await client.acquire(self._session_name(), ttl=self._timeout, wait=0)
            except BaseException:
                await client.close()
                raise
            return client, session

        try:
            self._fl, self._session = self._loop.run(start())
        except (FastlockError, OSError, ValueError) as exc:
            self._loop.close()
            self._loop = None
            tooz_utils.raise_with_cause(coordination.ToozConnectionError, f"cannot connect to fastlock: {exc}",
                                        cause=exc)

    def _session_name(self) -> str:
        return self._name("session/", _hex(self._member_id), os.urandom(8).hex())

    async def _session_for(self, key: str) -> fl_client.Lease:
        """The session lease a key of this member hangs on: on a sharded deployment, one in
        ``key``'s group (taken at the first need there); else the one session."""
        client, session = self.fastlock_client(), self._session
        assert session is not None
        if not isinstance(client, ShardedClient):
            return session
        group = client.group_of([key])
        if group == client.group_of([session.name]):
            return session
        lease = self._shard_sessions.get(group)
        if lease is None:
            lease = self._shard_sessions[group] = await client.acquire(
                self._session_name() + slot_tag(slot_of(key)), ttl=self._timeout, wait=0)
        return lease

    def _stop(self) -> None:
        loop, client = self._loop, self._fl
        if loop is None or client is None:
            return
        if self._pid != os.getpid():  # a forked child: the loop, connection and leases are the parent's
            keep_inherited(loop, client)
            self._loop = self._fl = self._session = None
            self._shard_sessions = {}
            self._acquired_locks.clear()
            self._leader_locks.clear()
            return
        # collected on this thread: a lock's stack guard may be held by a thread waiting on the loop
        leases = [lease for lock in list(self._acquired_locks) for lease in lock.forget()]
        if self._session is not None:
            leases.append(self._session)
        leases += self._shard_sessions.values()
        self._shard_sessions = {}

        async def stop() -> None:
            for lease in leases:  # the session's keys (memberships) go with it
                try:
                    await client.release(lease)
                except FastlockError:
                    pass
            await client.close()

        try:
            loop.run(stop())
        finally:
            self._acquired_locks.clear()
            self._leader_locks.clear()
            self._session = None
            self._fl = None
            loop.close()
            self._loop = None

    def heartbeat(self) -> float:
        """Extend the session lease (a new one if it ran out: the member's groups are
        then left) and every held lock; returns the seconds until the next beat."""
        client = self.fastlock_client()

        async def beat() -> None:
            try:
                self._session = await client.extend(self._session, ttl=self._timeout)  # type: ignore[arg-type]
            except LeaseLost:
                log.warning("tooz member %r: session lease expired; its group memberships are gone",
                            self._member_id)
                self._session = await client.acquire(self._session_name(), ttl=self._timeout, wait=0)
            for group, lease in list(self._shard_sessions.items()):
                try:
                    self._shard_sessions[group] = await client.extend(lease, ttl=self._timeout)
                except LeaseLost:  # its memberships are gone: the next join there takes a new one
                    del self._shard_sessions[group]

        self.call(beat())
        for lock in list(self._acquired_locks):
            lock.heartbeat()
        return self._timeout / 3

    # -- groups -----------------------------------------------------------------------------
    def _group_key(self, group_id: bytes) -> str:
        return self._name("group/", _hex(group_id))

    def _member_key(self, group_id: bytes, member_id: bytes) -> str:
        return self._name("member/", _hex(group_id), _hex(member_id))

    async def _list_all(self, prefix: str, what: str) -> list[fl_client.KeyValue]:
        """Every key under ``prefix``.  The server lists at most :data:`LIST_LIMIT` keys per
        request, with no continuation.

        Raises:
            tooz.ToozError: more keys matched (never part of them returned as all).
        """
        limit = LIST_LIMIT
        keys = await self.fastlock_client().list_prefix(prefix, limit=limit)
        if keys.more:
            raise tooz.ToozError(f"{what}: more than {limit} keys, and the fastlock server lists at most {limit} "
                                 "at once")
        return keys

    async def _check_group(self, group_id: bytes) -> None:
        if await self.fastlock_client().get(self._group_key(group_id)) is None:
            raise coordination.GroupNotCreated(group_id)

    def create_group(self, group_id: bytes) -> coordination.CoordinatorResult[None]:
        async def create() -> None:
            try:
                await self.fastlock_client().put(self._group_key(group_id), b"", create=True)
            except KeyExists:
                raise coordination.GroupAlreadyExist(group_id) from None

        return self._submit(create())

    def get_groups(self) -> coordination.CoordinatorResult[list[bytes]]:
        async def groups() -> list[bytes]:
            prefix = self._name("group/")
            keys = await self._list_all(prefix, "groups")
            return [bytes.fromhex(kv.key[len(prefix):]) for kv in keys]

        return self._submit(groups())

    def delete_group(self, group_id: bytes) -> coordination.CoordinatorResult[None]:
        async def delete() -> None:
            client = self.fastlock_client()
            await self._check_group(group_id)
            if await client.list_prefix(self._name("member/", _hex(group_id), ""), limit=1):
                raise coordination.GroupNotEmpty(group_id)
            if not await client.delete(self._group_key(group_id)):
                raise coordination.GroupNotCreated(group_id)

        return self._submit(delete())

    def join_group(self, group_id: bytes, capabilities: Any = b"") -> coordination.CoordinatorResult[None]:
        """Join ``group_id`` with ``capabilities`` (any msgpack-able value; tooz's default
        ``b""`` is stored as None, "no capabilities")."""
        group_id = tooz_utils.to_binary(group_id)
        if capabilities == b"":
            capabilities = None

        async def join() -> None:
            client = self.fastlock_client()
            await self._check_group(group_id)
            try:
                key = self._member_key(group_id, self._member_id)
                await client.put(key, tooz_utils.dumps(capabilities), lease=await self._session_for(key), create=True)
            except KeyExists:
                raise coordination.MemberAlreadyExist(group_id, self._member_id) from None
            self._joined_groups.add(group_id)

        return self._submit(join())

    def leave_group(self, group_id: bytes) -> coordination.CoordinatorResult[None]:
        group_id = tooz_utils.to_binary(group_id)

        async def leave() -> None:
            if not await self.fastlock_client().delete(self._member_key(group_id, self._member_id)):
                await self._check_group(group_id)
                raise coordination.MemberNotJoined(group_id, self._member_id)
            self._joined_groups.discard(group_id)

        return self._submit(leave())

    async def _members(self, group_id: bytes) -> dict[bytes, Any]:
        await self._check_group(group_id)
        prefix = self._name("member/", _hex(group_id), "")
        keys = await self._list_all(prefix, f"members of group {group_id!r}")
        return {bytes.fromhex(kv.key[len(prefix):]): tooz_utils.loads(kv.value) for kv in keys}

    def get_members(self, group_id: bytes) -> coordination.CoordinatorResult[set[bytes]]:
        async def members() -> set[bytes]:
            return set(await self._members(group_id))

        return self._submit(members())

    def get_members_with_capabilities(self, group_id: bytes) -> coordination.CoordinatorResult[dict[bytes, Any]]:
        return self._submit(self._members(group_id))

    async def _member(self, group_id: bytes, member_id: bytes) -> fl_client.KeyValue:
        kv = await self.fastlock_client().get(self._member_key(group_id, member_id))
        if kv is None:
            await self._check_group(group_id)
            raise coordination.MemberNotJoined(group_id, member_id)
        return kv

    def get_member_capabilities(self, group_id: bytes, member_id: bytes) -> coordination.CoordinatorResult[Any]:
        async def capabilities() -> Any:
            return tooz_utils.loads((await self._member(group_id, member_id)).value)

        return self._submit(capabilities())

    def get_member_info(self, group_id: bytes, member_id: bytes) -> coordination.CoordinatorResult[dict[str, Any]]:
        async def info() -> dict[str, Any]:
            kv = await self._member(group_id, member_id)
            return {"capabilities": tooz_utils.loads(kv.value), "created_at": _iso(kv.created_wall_ms),
                    "updated_at": _iso(kv.updated_wall_ms)}

        return self._submit(info())

    def update_capabilities(self, group_id: bytes, capabilities: Any) -> coordination.CoordinatorResult[None]:
        async def update() -> None:
            try:
                key = self._member_key(group_id, self._member_id)
                await self.fastlock_client().put(key, tooz_utils.dumps(capabilities),
                                                 lease=await self._session_for(key), replace=True)
            except KeyNotFound:
                await self._check_group(group_id)
                raise coordination.MemberNotJoined(group_id, self._member_id) from None

        return self._submit(update())

    # -- locks and elections ------------------------------------------------------------------
    def get_lock(self, name: bytes) -> FastlockLock:
        return FastlockLock(self, name, self._name("lock/", _lock_part(name)))

    def run_elect_coordinator(self) -> None:
        """Run for leader of every group with a ``watch_elected_as_leader`` hook: take the
        group's leader lock if free and, once leader, put the leader key on its lease."""
        for group_id, hooks in list(self._hooks_elected_leader.items()):
            lock = self._leader_locks.get(group_id)
            if lock is not None and lock.acquired:
                continue
            lock = self._leader_lock(group_id)
            if not lock.acquire(blocking=False):
                continue
            self._leader_locks[group_id] = lock
            self.call(self.fastlock_client().put(self._name("leader/", _hex(group_id)),
                                                 tooz_utils.to_binary(self._member_id), lease=lock.lease))
            hooks.run(coordination.LeaderElected(group_id, self._member_id))

    def _leader_lock(self, group_id: bytes) -> FastlockLock:
        name = self._name("leader-lock/", _hex(group_id))
        if isinstance(self._fl, ShardedClient):  # in its leader key's slot: the key hangs on its lease
            name += slot_tag(slot_of(self._name("leader/", _hex(group_id))))
        return FastlockLock(self, group_id or b"-", name)

    def run_watchers(self, timeout: float | None = None) -> list[Any]:
        result = super().run_watchers(timeout=timeout)
        self.run_elect_coordinator()
        return result

    def get_leader(self, group_id: bytes) -> coordination.CoordinatorResult[bytes | None]:  # type: ignore[override]
        async def leader() -> bytes | None:
            await self._check_group(group_id)
            kv = await self.fastlock_client().get(self._name("leader/", _hex(group_id)))
            return None if kv is None else kv.value

        return self._submit(leader())

    def stand_down_group_leader(self, group_id: bytes) -> bool:
        """Release the group's leader lock if this member holds it (its leader key goes with it)."""
        lock = self._leader_locks.pop(group_id, None)
        return lock is not None and lock.release()


async def _translated(coro: Coroutine[Any, Any, T], serial: asyncio.Lock) -> T:
    """``coro`` once ``serial`` is free, with a lost connection raised as ToozConnectionError
    and another fastlock error as ToozError (tooz's own errors pass through)."""
    try:
        async with serial:
            return await coro
    except ConnectionLost as exc:
        raise coordination.ToozConnectionError(str(exc)) from exc
    except FastlockError as exc:
        raise tooz.ToozError(str(exc)) from exc


#: slot -> the first hash tag ``{n}`` (n = 0, 1, ...) in that slot, as found
_SLOT_TAGS: dict[int, str] = {}


def slot_tag(slot: int) -> str:
    """A hash tag, ``{n}``, that puts a name in ``slot`` (0..16383) when the name has no ``{``
    before it; the same for every process (the first n whose slot it is: about 16,000 CRC16s
    on average, bounded by 10**6, then remembered).

    :raises ValueError: no n below 10**6 is in ``slot`` (a slot outside 0..16383).
    """
    tag = _SLOT_TAGS.get(slot)
    if tag is None:
        n = next((n for n in range(1_000_000) if slot_of(str(n)) == slot), None)
        if n is None:
            raise ValueError(f"no hash tag found for slot {slot}")
        tag = _SLOT_TAGS[slot] = f"{{{n}}}"
    return tag
