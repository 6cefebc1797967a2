"""A sharded node's check of every name against its shard map: :class:`ShardGate`.

A node started with a shard map and the name of its group (``fastlock serve
--shard-map FILE --shard-group NAME``) serves only the names whose slots its group
owns (:mod:`fastlock.sharding`).  :meth:`ShardGate.install` wraps the handler of every
op that names names (:data:`fastlock.sharding.scope.NAMES_OF_OP`; the compiled
ACQUIRE, RELEASE and EXTEND included) in the handler table, so the check runs in
one place, after the dispatch's permission check and before the op's handler: a
request with a name this group does not own is answered with
:class:`~fastlock.errors.WrongShard` (the name's slot, the owner group, its
addresses, the map's epoch; as Redis Cluster's ``MOVED``), one whose names span
groups with :class:`~fastlock.errors.CrossShard` (as ``CROSSSLOT``); either changes
nothing.  A node without a map installs nothing: its handlers are unchanged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..coordination.access import EtcdAccess
from ..coordination.shardmap import load_from_etcd
from ..errors import CrossShard, InvalidArgument, WrongShard
from ..sharding import SLOTS, ShardMap, ShardMapError, load_map_file, slot_of, write_map_file
from ..sharding.scope import NAMES_OF_OP, NamesAt, names_in

if TYPE_CHECKING:  # pragma: no cover
    from .handlers import Handlers

log = logging.getLogger(__name__)

Handler = Callable[[Any, int, list], None]

#: the file in a sharded node's data directory holding the last map it served by
SERVED_MAP_FILE = "served-shard-map.json"


class ShardGate:
    """This node's shard map (``shard_map``) and group (``group``, a name of the map).

    :raises InvalidArgument: the map names no group ``group``.
    """

    def __init__(self, shard_map: ShardMap, group: str):
        self.group = group
        self.shard_map = shard_map
        self.owned = b""
        #: where the map served by is recorded (``DATA_DIR/served-shard-map.json``), once :meth:`remember` ran
        self.served_path: str | None = None
        self.set_map(shard_map)

    @classmethod
    def from_config(cls, shard_map: ShardMap | str | None, group: str | None) -> ShardGate | None:
        """The gate of a server config's ``shard_map`` (a map, or the path of a map file) and
        ``shard_group``; None for an unsharded node (neither given).

        :raises InvalidArgument: one given without the other, a bad map file, an unknown group.
        :raises OSError: the map file cannot be read.
        """
        if shard_map is None and group is None:
            return None
        if shard_map is None or group is None:
            raise InvalidArgument("a sharded node needs both a shard map and the name of its group")
        if not isinstance(shard_map, ShardMap):
            shard_map = load_map_file(shard_map)
        return cls(shard_map, group)

    def set_map(self, shard_map: ShardMap) -> None:
        """Serve by ``shard_map`` from now on (a newer map's epoch; the caller compares).

        :raises InvalidArgument: the map names no group of this node's name.
        """
        shard_map.group(self.group)  # raises ShardMapError (an InvalidArgument) if absent
        self.shard_map = shard_map
        self.owned = shard_map.slots_of(self.group)
        if self.served_path is not None:
            write_map_file(self.served_path, shard_map)
        log.info("shard map epoch %d: group %s owns %d of %d slots", shard_map.epoch, self.group,
                 sum(self.owned), SLOTS)

    def remember(self, data_dir: str | os.PathLike[str]) -> None:
        """Check this node's map against the last one it served by, recorded in ``data_dir``
        (:data:`SERVED_MAP_FILE`), then record it there, and every map it serves by from now on.

        :raises ShardMapError: the recorded map gives this node's group other slots than this map
            does (a map file or etcd key changed by hand while the node was down): its leases of
            those slots are in this data directory, and slots change owner only by a move.
        :raises OSError: the file cannot be read or written.
        """
        path = os.path.join(data_dir, SERVED_MAP_FILE)
        if os.path.exists(path):
            served = load_map_file(path)
            if served.slots_of(self.group) != self.owned:
                raise ShardMapError(f"shard map epoch {self.shard_map.epoch} gives group {self.group} other slots than "
                                    f"epoch {served.epoch}, the map this node last served by ({path}): slots change "
                                    f"owner only by a move, else two groups would grant the same names (remove "
                                    f"that file only if this data directory holds no lease)")
        self.served_path = path
        write_map_file(path, self.shard_map)

    # -- the check ------------------------------------------------------------------------
    def check_name(self, name: Any) -> None:
        """:raises WrongShard: this group does not own ``name``'s slot (a non-str is left to the handler)."""
        if type(name) is str:
            slot = slot_of(name)
            if not self.owned[slot]:
                raise self.wrong_shard(name, slot)

    def check_names(self, where: NamesAt, args: list) -> None:
        """Check every name of a request's arguments ``args`` at ``where``.

        :raises WrongShard: every name is another group's, all one group's.
        :raises CrossShard: the names span several groups.
        """
        owned = self.owned
        first: tuple[str, int] | None = None
        others: set[str] = set()
        mine = False
        shard_map = self.shard_map
        for name in names_in(where, args):
            slot = slot_of(name)
            if owned[slot]:
                mine = True
            else:
                if first is None:
                    first = (name, slot)
                others.add(shard_map.owner_of_slot(slot).name)
            if others and (mine or len(others) > 1):
                groups = tuple(sorted(others | ({self.group} if mine else set())))
                raise CrossShard(f"the names of one request must be in one shard group; these span groups "
                                 f"{', '.join(groups)} (shard map epoch {shard_map.epoch}); put a hash tag "
                                 f"in them, e.g. '{{tag}}:name', to keep them together", groups, shard_map.epoch)
        if first is not None:
            raise self.wrong_shard(*first)

    def wrong_shard(self, name: str, slot: int) -> WrongShard:
        """The redirect for ``name`` (in ``slot``), which another group owns."""
        owner = self.shard_map.owner_of_slot(slot)
        return WrongShard(f"{name!r:.100} is in slot {slot}, owned by shard group {owner.name} "
                          f"({', '.join(owner.addresses)}), not {self.group} (shard map epoch "
                          f"{self.shard_map.epoch})", slot, owner.name, owner.addresses, self.shard_map.epoch)

    # -- the handler table -------------------------------------------------------------------
    def install(self, handlers: Handlers) -> None:
        """Wrap the handler of every op of ``handlers.by_op`` that names names.

        :raises RuntimeError: an op of the table is missing from ``NAMES_OF_OP`` (a new op must
            say where its names are before a sharded node serves it).
        """
        missing = sorted(op for op in handlers.by_op if op not in NAMES_OF_OP)
        if missing:
            raise RuntimeError(f"ops {missing} are not in fastlock.sharding.scope.NAMES_OF_OP: a sharded "
                               f"node cannot check their names")
        for op, (handler, fewest, most) in list(handlers.by_op.items()):
            where = NAMES_OF_OP[op]
            if where is not None:
                handlers.by_op[op] = (self._checked(handler, where), fewest, most)

    def _checked(self, handler: Handler, where: NamesAt) -> Handler:
        if where.names == (0,) and not where.rows and not where.lists:  # one name, the first argument: the common case
            check_name = self.check_name

            def one_name(conn: Any, req_id: int, msg: list) -> None:
                check_name(msg[2])
                handler(conn, req_id, msg)

            return one_name
        check_names = self.check_names

        def names(conn: Any, req_id: int, msg: list) -> None:
            check_names(where, msg[2:])
            handler(conn, req_id, msg)

        return names

    def offer(self, shard_map: ShardMap) -> None:
        """Serve by ``shard_map`` if its epoch is above this node's map's.  A newer map that names
        no group of this node's, or gives a slot to another group than this node's map does, is
        logged and refused (the node keeps the map it has): a slot changes owner only by a move,
        which ships its leases and token high-water mark (not done yet), else the new owner
        would grant names the old one still holds."""
        if shard_map.epoch <= self.shard_map.epoch:
            return
        if shard_map.ranges != self.shard_map.ranges:
            log.error("not applying shard map epoch %d: it gives slots to other groups than epoch %d does, "
                      "and slots change owner only by a move (not done yet)", shard_map.epoch,
                      self.shard_map.epoch)
            return
        try:
            self.set_map(shard_map)
        except InvalidArgument as exc:
            log.error("not applying shard map epoch %d: %s", shard_map.epoch, exc)

    async def follow_etcd(self, url: str, access: EtcdAccess | None) -> None:
        """Follow the map kept in etcd at ``url`` (:mod:`fastlock.coordination.shardmap`) until cancelled."""
        stored = await load_from_etcd(url, access)
        try:
            await stored.follow(self.offer)
        finally:
            await stored.gateway.close()

    def info(self) -> dict[str, Any]:
        """This node's place in the map: ``group``, ``epoch``, ``slots`` (how many it owns)."""
        return {"group": self.group, "epoch": self.shard_map.epoch, "slots": sum(self.owned)}
