"""The shard map kept in etcd (:mod:`fastlock.sharding`): :class:`EtcdShardMap`.

The map lives in one key, ``PREFIX/shard-map``, of the etcd the groups already use for
arbitration, as the JSON plain form of :class:`~fastlock.sharding.ShardMap`.  It is written
only by an etcd transaction: :meth:`EtcdShardMap.create` when the key does not exist,
:meth:`EtcdShardMap.replace` when the key is unchanged since the map of the epoch it
replaces was read (its ``mod_revision``; every write raises the epoch by one, so this
compares the epoch), so two operators never overwrite each other.  Nodes read it at start
(``--shard-map etcd://HOST:PORT/PREFIX``) and :meth:`EtcdShardMap.follow` it: a map of a
higher epoch replaces theirs.  Clients never talk to etcd: every node serves the map.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from ..errors import FastlockError
from ..sharding import ShardMap, ShardMapError
from .access import EtcdAccess
from .gateway import EtcdGateway, EtcdUnavailable, b64, parse_coordinator

__all__ = ["EtcdShardMap", "MapConflict", "MAP_KEY", "load_from_etcd"]

log = logging.getLogger(__name__)

#: the key of the map, under the coordinator's prefix
MAP_KEY = "shard-map"
#: seconds between attempts to watch the map again after etcd failed
RETRY_S = 1.0
#: seconds after which a follower reads the map again even if the watch told of no change
REREAD_S = 10.0


class MapConflict(FastlockError, RuntimeError):
    """The map in etcd is not the one the change was made from (another change came first),
    or a map exists where a new one was to be created.  Nothing was written."""


class EtcdShardMap:
    """The shard map under ``prefix`` (``/fastlock``, say) of the etcd ``gateway`` reaches."""

    def __init__(self, gateway: EtcdGateway, prefix: str):
        self.gateway = gateway
        self.key = f"{prefix.rstrip('/')}/{MAP_KEY}"

    async def read(self) -> tuple[ShardMap, int] | None:
        """The map and its key's ``mod_revision``, or None: no map.

        :raises ShardMapError: the key holds no valid map.  :raises EtcdUnavailable: etcd did not answer.
        """
        kv = await self.gateway.get(self.key)
        if kv is None:
            return None
        try:
            value = json.loads(kv.value)
        except (ValueError, RecursionError):  # RecursionError: nested too deep
            raise ShardMapError(f"etcd key {self.key} holds no JSON shard map") from None
        return ShardMap.from_wire(value), kv.mod_revision

    async def read_existing(self) -> tuple[ShardMap, int]:
        """:meth:`read`, for a caller that needs a map there.

        :raises ShardMapError: no map at the key (or not a valid one).  :raises EtcdUnavailable: etcd did not answer.
        """
        found = await self.read()
        if found is None:
            raise ShardMapError(f"no shard map in etcd at {self.key}")
        return found

    async def rewrite(self, change: Callable[[ShardMap], ShardMap]) -> ShardMap:
        """Read the map and write ``change(map)`` in its place (one etcd transaction comparing the
        key's revision, as :meth:`replace`); the map written.

        :raises ShardMapError: no map, or ``change`` refused it.  :raises MapConflict: the map changed
            between the read and the write (run it again).
        """
        shard_map, revision = await self.read_existing()
        new = change(shard_map)
        await self.replace(revision, shard_map, new)
        return new

    async def create(self, shard_map: ShardMap) -> None:
        """Write ``shard_map`` if no map exists.  :raises MapConflict: one does."""
        answer = await self.gateway.txn(
            [{"key": b64(self.key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            [{"request_put": {"key": b64(self.key), "value": b64(_encode(shard_map))}}])
        if not answer.get("succeeded"):
            raise MapConflict(f"etcd key {self.key} already holds a shard map: change it, do not create one")

    async def replace(self, read_revision: int, old: ShardMap, new: ShardMap) -> int:
        """Write ``new`` in place of ``old``, read at ``read_revision``, if the key is unchanged since;
        the key's revision with ``new`` (0 if etcd's answer named none).

        :raises MapConflict: it changed (read it again).  :raises ShardMapError: ``new``'s epoch is not above ``old``'s.
        """
        if new.epoch <= old.epoch:
            raise ShardMapError(f"a new map's epoch ({new.epoch}) must be above the old one's ({old.epoch})")
        answer = await self.gateway.txn(
            [{"key": b64(self.key), "target": "MOD", "result": "EQUAL", "mod_revision": str(read_revision)}],
            [{"request_put": {"key": b64(self.key), "value": b64(_encode(new))}}])
        if not answer.get("succeeded"):
            raise MapConflict(f"the shard map in etcd changed since epoch {old.epoch} was read: read it again")
        header = answer.get("header")
        try:
            return int(header.get("revision", 0)) if type(header) is dict else 0
        except (TypeError, ValueError):
            return 0

    async def follow(self, on_map: Callable[[ShardMap], None]) -> None:
        """Call ``on_map`` with the map now and after every change, until cancelled; etcd
        failures are logged and retried every second.  A key that holds no valid map is
        logged and skipped (the node keeps the map it has)."""
        changed = asyncio.Event()
        while True:
            changed.clear()
            watch = asyncio.ensure_future(self.gateway.watch(self.key, lambda _kind: changed.set()))
            try:
                while True:
                    try:
                        found = await self.read()
                    except ShardMapError as exc:
                        log.error("ignoring the shard map in etcd: %s", exc)
                    else:
                        if found is not None:
                            on_map(found[0])
                    waiter = asyncio.ensure_future(changed.wait())
                    # read again at least every REREAD_S: a change made while the watch was being set up
                    await asyncio.wait([waiter, watch], timeout=REREAD_S, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    if watch.done():
                        watch.result()  # raises why the watch ended
                    changed.clear()
            except EtcdUnavailable as exc:
                log.warning("following the shard map in etcd: %s; again in %g s", exc, RETRY_S)
            finally:
                watch.cancel()
            await asyncio.sleep(RETRY_S)


async def load_from_etcd(url: str, access: EtcdAccess | None = None) -> EtcdShardMap:
    """The map of ``etcd://HOST:PORT[,HOST:PORT]/PREFIX`` (:func:`parse_coordinator`), opened.

    :raises InvalidArgument: a bad URL.  :raises EtcdUnavailable: etcd did not answer.
    """
    where = parse_coordinator(url)
    return EtcdShardMap(EtcdGateway(list(where.endpoints), timeout_s=2.0, access=access), where.prefix)


def _encode(shard_map: ShardMap) -> bytes:
    return json.dumps(shard_map.to_wire(), separators=(",", ":")).encode()
