"""The key store from the client: small values by key, attached to a lease or not.

:class:`KeyMethods` gives :class:`~fastlock.client.Client` ``put``, ``get``,
``list_prefix``, ``delete`` and ``watch_prefix`` (the server side and its limits
are described in :mod:`fastlock.server.keys`).  A key put with ``lease=`` lives
while that lease lives, as an etcd key with a lease or a ZooKeeper ephemeral
node: keep the lease alive with ``client.lock(name, ttl=...)`` (renewed about
every TTL/3) and the key disappears - with a ``"expired"`` event to every
watcher of its prefix - within the TTL after this process vanishes::

    async with client.lock("workers/session/w1", ttl=10.0) as lease:
        await client.put("workers/w1", b"10.0.0.7:8080", lease=lease)
        ...                                  # the key lives while the block runs
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import protocol as P
from ..errors import ConnectionLost, InvalidArgument, ProtocolError, WrongArgumentType
from ..protocol.ops import (
    KEY_CREATE,
    KEY_REPLACE,
    KEY_UPSERT,
    OP_KEY_DELETE,
    OP_KEY_GET,
    OP_KEY_LIST,
    OP_KEY_PUT,
    OP_KEY_UNWATCH,
    OP_KEY_WATCH,
    OP_KEY_WATCH_FROM,
)
from .keywatch import BEGIN, KeyWatches
from .lease import Lease, check_lease
from .watch import subscribe, unsubscribe

if TYPE_CHECKING:  # pragma: no cover
    from .connection import ClientConnection, Connector

__all__ = ["KeyValue", "KeyList", "KeyEvent", "KeyMethods", "SyncKeyMethods", "MAX_LIST"]

#: most keys one list_prefix() returns (the server's bound on one reply)
MAX_LIST = 10_000


class KeyValue(NamedTuple):
    """A key and its value.  ``lease``: the lock name of the lease it is attached to
    (None: no lease) and ``token`` that lease's fencing token (0 without lease);
    wall-clock times in milliseconds since the Unix epoch (display only)."""

    key: str
    value: bytes
    lease: str | None
    token: int
    created_wall_ms: int
    updated_wall_ms: int


class KeyList(list[KeyValue]):
    """What :meth:`KeyMethods.list_prefix` returns: a list of :class:`KeyValue` in key
    order, and ``more`` (bool): True when more keys matched than the ``limit`` let the
    server list (the list is then a prefix of them, not all); ``cursor`` (str or None):
    when ``more``, the ``after`` that lists the next keys; ``unreachable``: for a sharded
    deployment, the groups that could not be reached (group name -> the error), whose keys
    are not listed."""

    more: bool
    cursor: str | None
    unreachable: dict[str, str]

    def __init__(self, keys: list[KeyValue], more: bool, cursor: str | None = None,
                 unreachable: dict[str, str] | None = None):
        super().__init__(keys)
        self.more = more
        self.cursor = cursor
        self.unreachable = dict(unreachable or {})


class KeyEvent(NamedTuple):
    """A change of a key under a watched ``prefix``: ``what`` is ``"put"`` (``value``
    is the new value), ``"delete"``, ``"expired"`` (its lease expired), ``"released"``
    (its lease was released), ``"revoked"`` (an operator revoked its lease) or ``"moved"``
    (a slot move gave it to another shard group, where it lives on: not a deletion; that
    group's watch reports it as a ``"put"``); ``value`` is None but for a put.

    ``revision`` (int) and ``offset`` (int) are the change's position: the revision of
    the write-ahead-log record that made it and its index within that record (0; a
    lease's end deletes its keys in one record, numbered 0, 1, ... in key order); positions grow
    in the order the changes were applied, on the primary and its standbys alike (see
    docs/watches.md).  None from a server without KEY_WATCH_FROM.  A ``"progress"``
    event (``watch_prefix(..., progress=True)``) has ``key`` "", ``offset`` None and the
    revision up to which every change was sent."""

    prefix: str
    what: str
    key: str
    value: bytes | None
    revision: int | None = None
    offset: int | None = None


def _check_prefix(prefix: Any) -> str:
    if type(prefix) is not str:
        raise WrongArgumentType(f"a key prefix must be a str, not {type(prefix).__name__}")
    return P.check_name(prefix) if prefix else prefix


class KeyMethods:
    """The key store's methods of :class:`~fastlock.client.Client` (a mixin: it uses the
    client's ``_request`` and ``_connector``)."""

    _connector: Connector
    _op_timeout: float

    async def _request(self, op: int, *args: Any) -> Any:  # pragma: no cover - the Client's
        raise NotImplementedError

    async def put(self, key: str, value: bytes, *, lease: Lease | None = None, create: bool = False,
                  replace: bool = False) -> bool:
        """Set ``key`` to ``value``; return True if the key was created, False if replaced.

        Args:
            key: 1..512 bytes of UTF-8 (as a lock name; the ACL operation is ``put``).
            value: bytes, at most the server's ``--max-value-bytes`` (default 64 KiB).
            lease: attach the key to this lease (of this client): the server deletes the
                key when the lease is released or expires.  None: the key stays until deleted.
            create: only create (:class:`~fastlock.errors.KeyExists` if it exists).
            replace: only replace (:class:`~fastlock.errors.KeyNotFound` if absent).

        Acknowledged once durable on the server and, under synchronous replication, on
        its standby (like a grant).  A retry after a lost
        reply (failover) repeats the put, so ``create=True`` may then raise KeyExists
        for the caller's own key.

        Raises:
            LeaseLost: ``lease`` is no longer held.
            LimitExceeded: ``--max-keys``, ``--max-keys-per-principal``, ``--max-key-bytes``
                or ``--max-key-bytes-per-principal`` reached.
            PermissionDenied: the ACL does not grant ``put`` on ``key``.
        """
        P.check_name(key)
        if type(value) is not bytes:
            raise WrongArgumentType(f"value must be bytes, not {type(value).__name__}")
        if create and replace:
            raise InvalidArgument("create and replace exclude each other")
        mode = KEY_CREATE if create else KEY_REPLACE if replace else KEY_UPSERT
        if lease is None:
            return bool(await self._request(OP_KEY_PUT, key, value, None, 0, None, mode))
        check_lease(lease)
        return bool(await self._request(OP_KEY_PUT, key, value, lease.name, lease.fencing_token,
                                        lease.owner, mode))

    async def get(self, key: str) -> KeyValue | None:
        """``key``'s :class:`KeyValue`, or None if absent (ACL operation ``get``)."""
        P.check_name(key)
        info = await self._request(OP_KEY_GET, key)
        if info is None:
            return None
        return KeyValue(key, info["value"], info["lease"], info["token"], info["created_wall_ms"],
                        info["updated_wall_ms"])

    async def list_prefix(self, prefix: str, *, limit: int = 1000, after: str | None = None) -> KeyList:
        """The keys that start with ``prefix`` ("" for every key the ACL lets one read), in
        key order, at most ``limit`` (1..10000); ``.more`` of the :class:`KeyList` tells
        whether more matched, and its ``.cursor`` is the ``after`` that lists them.
        ``after`` (a key, or None): only the keys above it.

        The server answers in pages of about 64 KiB
        (:data:`~fastlock.protocol.ops.MAX_PAGE_BYTES`); this follows them (at most
        ``limit`` keys, so at most ``limit`` requests) until ``limit`` keys or the last one.
        Pages are read one after another, not at one instant: a key changed meanwhile may
        show its old or its new value, and one added or deleted meanwhile may be missing.

        Raises:
            PermissionDenied: the ACL does not grant ``get`` on a prefix of ``prefix``.
            InvalidArgument: ``limit`` is not an int 1..10000, ``after`` not a key.
        """
        _check_prefix(prefix)
        if type(limit) is not int or not 1 <= limit <= MAX_LIST:
            raise InvalidArgument(f"limit must be an int 1..{MAX_LIST}, not {limit!r}")
        if after is not None:
            P.check_name(after)
        keys: list[KeyValue] = []
        while True:
            args = (prefix, limit - len(keys)) if after is None else (prefix, limit - len(keys), after)
            reply = await self._request(OP_KEY_LIST, *args)
            keys += [KeyValue(*item) for item in reply["keys"]]
            more = bool(reply.get("more"))
            cursor = reply.get("cursor")
            if not more or len(keys) >= limit or type(cursor) is not str or not reply["keys"]:
                # the last page; or a server that does not page (no cursor): its one reply
                return KeyList(keys, more, keys[-1].key if more and keys else None)
            after = cursor

    async def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed (ACL operation ``delete``)."""
        P.check_name(key)
        return bool(await self._request(OP_KEY_DELETE, key))

    def watch_prefix(self, prefix: str, *, progress: bool = False) -> AsyncIterator[KeyEvent]:
        """Yield a :class:`KeyEvent` for every later change of a key under ``prefix``.

        Pushed by the server in the order it applied the changes (no polling), each
        once the server committed it.  When the connection drops, or the primary
        fails over, the watch subscribes again on the node the client rides to, from
        the position of the last change it delivered (KEY_WATCH_FROM): no change is
        lost or repeated (docs/watches.md).  To see the current keys too, list them
        after the watch started (:meth:`list_prefix`): a change between the two shows
        in both.  ``progress``: yield the server's progress notices too (``"progress"``
        events; the first one is the watch's start: every change after its revision
        follows).  Breaking out of the loop unsubscribes.

        Raises:
            Compacted: the server no longer keeps the changes since the last position
                (``--watch-history``); start a new watch and list again.
            WatchDiverged: the promoted standby never had the last change delivered
                (asynchronous replication).
            ConnectionLost: the client closed, or no primary answered within the
                client's ``request_timeout``; from a server without KEY_WATCH_FROM, when
                the connection drops.
        """
        _check_prefix(prefix)
        return _watch_prefix(self._connector, prefix, self._op_timeout, progress)


def _key_watches(proto: ClientConnection) -> KeyWatches:
    return proto.key_watches


async def _watch_prefix(connector: Connector, prefix: str, timeout: float,
                        progress: bool = False) -> AsyncIterator[KeyEvent]:
    """A prefix watch that resumes from the position of its last change (KEY_WATCH_FROM).

    Its queue holds, in the connection's order: what came before the server's
    ``"vbeg"`` (:data:`~fastlock.client.keywatch.BEGIN`: dropped, the replay after it
    has it), the replay, then the live changes; a change at or below the last
    position delivered is dropped (another watch's replay on the same connection)."""
    try:
        proto, queue, reply = await subscribe(connector, timeout, _key_watches, OP_KEY_WATCH_FROM, prefix,
                                              (None, None))
    except ProtocolError:  # a server without KEY_WATCH_FROM
        async for event in _plain_watch_prefix(connector, prefix, timeout):
            yield event
        return
    proto.key_watches.once = True
    last: tuple[int, float] = (reply["revision"], INF)  # (revision, index); INF: every change of the revision
    begun = False
    subscribed = True
    try:
        if progress:  # the watch's start: every change after it follows
            yield KeyEvent(prefix, "progress", "", None, reply["revision"], None)
        while True:
            item = await queue.get()
            if item is None:
                unsubscribe(proto, _key_watches, prefix, queue, OP_KEY_UNWATCH)
                subscribed = False
                if connector.closed:
                    raise ConnectionLost(f"connection lost while watching keys under {prefix!r}")
                rev, index = last
                proto, queue, reply = await subscribe(connector, timeout, _key_watches, OP_KEY_WATCH_FROM, prefix,
                                                      (rev, None if index == INF else index))
                proto.key_watches.once = True
                subscribed = True
                begun = False
                continue
            if item is BEGIN:
                begun = True
                continue
            if not begun or len(item) < 6:
                continue  # sent before this watch's replay, which has it (or without a position)
            at: tuple[int, float] = (item[4], INF if item[5] is None else item[5])
            if at <= last:
                continue  # delivered already
            last = at
            if item[1] == "progress":
                if progress:
                    yield KeyEvent(prefix, "progress", "", None, item[4], None)
                continue
            yield KeyEvent(*item)
    finally:
        if subscribed:
            unsubscribe(proto, _key_watches, prefix, queue, OP_KEY_UNWATCH)


#: the index of a position that covers every change of its revision (a progress notice's)
INF = float("inf")


async def _plain_watch_prefix(connector: Connector, prefix: str, timeout: float) -> AsyncIterator[KeyEvent]:
    """A KEY_WATCH without positions: it ends with ``ConnectionLost`` when its connection does."""
    proto, queue, reply = await subscribe(connector, timeout, _key_watches, OP_KEY_WATCH, prefix)
    if type(reply) is dict and reply.get("once") is True:
        proto.key_watches.once = True
    try:
        while True:
            item = await queue.get()
            if item is None:
                raise ConnectionLost(f"connection lost while watching keys under {prefix!r}")
            if item is BEGIN or item[1] == "progress":
                continue
            yield KeyEvent(*item)
    finally:
        unsubscribe(proto, _key_watches, prefix, queue, OP_KEY_UNWATCH)


class SyncKeyMethods:
    """The key store's methods of :class:`~fastlock.sync.SyncClient` (a mixin: it uses the
    blocking client's ``call``, ``_follow`` and ``_client``)."""

    @property
    def _client(self) -> KeyMethods:  # pragma: no cover - the SyncClient's
        raise NotImplementedError

    def call(self, coro: Any) -> Any:  # pragma: no cover - the SyncClient's
        raise NotImplementedError

    def _follow(self, make: Any, timeout: float | None, what: str) -> Iterator[Any]:  # pragma: no cover
        raise NotImplementedError

    def watch_prefix(self, prefix: str, *, timeout: float | None = None,
                     progress: bool = False) -> Iterator[KeyEvent]:
        """Yield :class:`KeyEvent` as :meth:`KeyMethods.watch_prefix` does (it resumes across
        a dropped connection and a failover); close the generator (or break out of the
        loop) to unsubscribe.

        Args:
            timeout: seconds to wait for each event; ``None`` waits forever.
            progress: yield the server's progress notices too.

        Raises:
            TimeoutError: no event within ``timeout``.
            Compacted, WatchDiverged, ConnectionLost: as :meth:`KeyMethods.watch_prefix`.
        """
        _check_prefix(prefix)
        return self._follow(lambda: self._client.watch_prefix(prefix, progress=progress), timeout,
                            f"keys under {prefix!r}")

    def put(self, key: str, value: bytes, *, lease: Any = None, create: bool = False, replace: bool = False) -> bool:
        """As :meth:`KeyMethods.put`; ``lease``: a :class:`~fastlock.sync.SyncLease` of this client, or None."""
        inner = getattr(lease, "lease", lease)
        return bool(self.call(self._client.put(key, value, lease=inner, create=create, replace=replace)))

    def get(self, key: str) -> KeyValue | None:
        """As :meth:`KeyMethods.get`."""
        return self.call(self._client.get(key))  # type: ignore[no-any-return]

    def list_prefix(self, prefix: str, *, limit: int = 1000, after: str | None = None) -> KeyList:
        """As :meth:`KeyMethods.list_prefix`."""
        return self.call(self._client.list_prefix(prefix, limit=limit, after=after))  # type: ignore[no-any-return]

    def delete(self, key: str) -> bool:
        """As :meth:`KeyMethods.delete`."""
        return bool(self.call(self._client.delete(key)))
