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

During a slot move (:mod:`fastlock.sharding.moves`, :mod:`fastlock.server.slotmove`) the
source group's slots marked ``moving_to`` are *frozen*: a request naming them is held
(:class:`Held`; at most :data:`MAX_HELD` at once, a principal's share of them at most
(:func:`held_share`: a quarter, the anonymous principal's a sixteenth, as the other global
caps of :mod:`fastlock.server.shares`), each at most :data:`HOLD_S` seconds, beyond any
:class:`~fastlock.errors.SlotMoving`, which a client retries), and every
waiter already queued on them leaves the lock table, whatever its name's state (their owner-key
hashes and priorities are kept, in FIFO order, for the export) with their acquires held too;
an acquire admitted earlier and let into the table later (a promotion's reclaim window, a
parked multi-lock reservation) meets the same check then, so nothing is granted on those
names while their state is shipped.  When the map flips the
slots to the destination, the source drops their leases (a ``REVOKE`` record each, by
principal ``shard-move``, so its standby and its recovery drop them too) and answers every
held request with ``WrongShard`` naming the new owner; the destination lets the moved
waiters' acquires back in their old order (the promoted primary's reclaim window,
:mod:`fastlock.server.reclaim`).  A move aborted (the mark cleared) runs the held requests.

Failovers around a move: a node that is not primary takes its maps from its own watch, which
may lag, fail, or bring the flip without the mark.  A node takes every map that takes slots
away from its group (:func:`~fastlock.sharding.moves.allowed_change`), and the flip of a move
into its group whose mark it missed only for slots its log says its group imported (the
primary's ``SLOTS_ADOPTED`` records, :meth:`ShardGate.adopted_by_log` on a standby; a map
refused for lack of one is offered again when the record arrives); a promotion reads the map
in etcd before the node serves (:meth:`ShardGate.take_stored_map`): a promoted node never grants the names of
slots the map in etcd gave another group (tokens of a moved name never go backwards).

A slot gained without its token floor: a map may give this group a slot by the flip of a move
whose state the group never imported (the mark and the flip written by hand, or a map file
restarted from the mark to the flip).  The node takes the map but answers every request naming
that slot :class:`~fastlock.errors.Unavailable` (:attr:`ShardGate.unadopted`, kept in the data
directory, ``unadopted-slots.json``) until a ``SLOTS_ADOPTED`` record of the slot arrives (an
import, or ``SLOT_ADOPT``: ``fastlock shard adopt``), else its tokens could be below those the
slot's previous group granted.  The slots a node owns in the first map it serves by on an empty
data directory are taken as never served by another group.

A slot's token floor in the map: a range a move gave this group carries the floor the move shipped
(:class:`~fastlock.sharding.shardmap.SlotRange`'s ``floor``, recorded by the flip).  The primary
serves a slot only while its last token is at or above that floor (:meth:`ShardGate.settle_floors`,
at its start, at its promotion and with each map it takes), whatever its log holds (a group whose
nodes all start on empty data directories, a static map file): below it, it raises its epoch to the
one after the floor's (in an etcd group first in etcd,
:meth:`~fastlock.coordination.etcd.EtcdArbiter.adopt_epoch_above`), and answers the slot's names
:class:`~fastlock.errors.Unavailable` until that is done (:attr:`ShardGate.owed`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from .._core import EV_WAIT_CANCELLED
from ..auth import ANONYMOUS
from ..coordination.access import EtcdAccess
from ..coordination.gateway import EtcdUnavailable
from ..coordination.shardmap import EtcdShardMap, load_from_etcd
from ..errors import CrossShard, FastlockError, InvalidArgument, SlotMoving, Unavailable, WrongShard
from ..protocol.ops import OP_SESSION_ATTACH, OP_SESSION_KEEPALIVE
from ..roles import Role
from ..sharding import SLOTS, ShardMap, ShardMapError, load_map_file, slot_of, write_map_file
from ..sharding.moves import allowed_change
from ..sharding.scope import NAMES_OF_OP, NamesAt, names_in
from ..tokens import epoch_of, make_token
from ..units import monotonic_ms, wall_ms
from ..wal.files import write_atomically
from ..wal.records import ImportedSlots
from .kinds import reply_id
from .shares import Quota, default_share
from .slotmove import drop_keys

if TYPE_CHECKING:  # pragma: no cover
    from ..wal.records import SlotsAdopted, SlotsUnadopted
    from .handlers import Handlers

log = logging.getLogger(__name__)

Handler = Callable[[Any, int, list], None]

#: the file in a sharded node's data directory holding the last map it served by
SERVED_MAP_FILE = "served-shard-map.json"
#: the file in a sharded node's data directory listing the slots its group owns without their token floor
UNADOPTED_FILE = "unadopted-slots.json"
#: the most slot runs :meth:`ShardGate.info` lists of the slots owned without their token floor
INFO_RUNS = 64
#: the file in a sharded node's data directory holding the moved queues a flip let in on this
#: primary, each until the end of its reclaim window (wall clock): a restart within it keeps their order
LET_IN_FILE = "moved-queues.json"
#: the most waiters of one moved queue :data:`LET_IN_FILE` keeps (as a standby's mirror keeps of a queue)
LET_IN_WAITERS = 1024

#: the most requests held at once for slots being moved (beyond: SlotMoving at once)
MAX_HELD = 10_000
#: the name of the held-requests share in SlotMoving refusals
HELD_WHAT = "requests held for moving slots"
#: the session ops a flip runs instead of redirecting (they name leases of several slots)
RERUN_AFTER_FLIP = (OP_SESSION_ATTACH, OP_SESSION_KEEPALIVE)
#: seconds a request is held for a slot being moved before it is answered SlotMoving
HOLD_S = 5.0
#: the principal a move's drop of the source's leases is logged as (REVOKE records)
MOVE_PRINCIPAL = "shard-move"
#: the most waiters of one queue part of a SLOTS_ADOPTED record logged again (:meth:`ShardGate.relog_imports`),
#: and the most parts of one such record (as an import's page: fastlock.server.slotmove.QUEUE_PART, EXPORT_PAGE)
RELOG_PART = 20
#: seconds between two attempts to raise an etcd group's epoch above the map's token floor of its slots
SETTLE_RETRY_S = 1.0


def _epoch_above(floors: list[tuple[int, int, int]]) -> int:
    """The epoch after the highest of ``floors``' (``(first, last, floor)``): every token issued
    in it is above each floor."""
    return max(epoch_of(floor) for _first, _last, floor in floors) + 1


def held_share(single_principal: bool, anonymous_divisor: int) -> Quota:
    """Each principal's share of the :data:`MAX_HELD` requests held for moving slots: a quarter
    (:func:`fastlock.server.shares.default_share`), the anonymous principal's a further
    ``1/anonymous_divisor`` of that (``--anonymous-quota-divisor``); with one client principal at
    most (``single_principal``), all of them.  Requests past a principal's share are answered
    :class:`~fastlock.errors.SlotMoving` at once; the other principals' are still held."""
    if single_principal:
        return Quota(MAX_HELD, MAX_HELD, HELD_WHAT, "")
    share = default_share(MAX_HELD)
    return Quota(share, max(1, share // max(1, anonymous_divisor)), HELD_WHAT, "")


def _or(a: bytes, b: bytes) -> bytes:
    """The table of 0/1 bytes that is 1 where ``a`` or ``b`` is 1 (tables of one length)."""
    return (int.from_bytes(a, "big") | int.from_bytes(b, "big")).to_bytes(len(a), "big")


def _and_not(a: bytes, b: bytes) -> bytes:
    """The table of 0/1 bytes that is 1 where ``a`` is 1 and ``b`` is 0 (tables of one length)."""
    return (int.from_bytes(a, "big") & ~int.from_bytes(b, "big")).to_bytes(len(a), "big")


def _ones(table: bytes) -> list[int]:
    """The indexes of the 1 bytes of a table of 0/1 bytes, ascending (found run by run)."""
    out: list[int] = []
    start = table.find(1)
    while start >= 0:
        end = table.find(0, start)
        end = len(table) if end < 0 else end
        out.extend(range(start, end))
        start = table.find(1, end)
    return out


class Held(NamedTuple):
    """A request held while its slot is moved: its connection, request id, request (None for
    a waiter taken out of a queue: its acquire is answered, never run again), the handler to
    run if the move is aborted, the name, its slot, until when it is held (monotonic ms) and
    the principal it counts against (:func:`held_share`)."""

    conn: Any
    req_id: int
    msg: list | None
    handler: Handler | None
    name: str
    slot: int
    until_ms: int
    principal: str


class ShardGate:
    """This node's shard map (``shard_map``) and group (``group``, a name of the map).

    :raises InvalidArgument: the map names no group ``group``.
    """

    def __init__(self, shard_map: ShardMap, group: str):
        self.group = group
        self.shard_map = shard_map
        self.owned = b""
        #: 1 at each owned slot a move is moving away (requests for it are held)
        self.moving = b""
        #: 1 at each slot whose state this group imported by a move (it may take their flip)
        self.imported = bytearray(SLOTS)
        #: requests held for moving slots, in arrival order
        self.held: list[Held] = []
        #: principal -> how many of :attr:`held` count against it
        self.held_by: dict[str, int] = {}
        #: each principal's share of the held requests (set by install from the server's credentials)
        self.held_share = held_share(True, 1)
        #: name -> the waiters (owner-key hash, priority) taken out of its queue by a move, FIFO
        self.frozen_queues: dict[str, list[tuple[bytes, int]]] = {}
        #: name -> owner-key hashes of an imported queue, FIFO: let back in that order at the flip
        self.imported_queues: dict[str, list[bytes]] = {}
        #: the server (set by install); None in unit tests of the check alone
        self.server: Any = None
        self._hold_timer: Any = None
        #: called with each newer map this node takes (the server pushes its epoch to its clients)
        self.on_change: Callable[[ShardMap], None] | None = None
        #: also called with each newer map this node takes (SHARD_MAP_NOTICE's replies: server.mapnotice)
        self.listeners: list[Callable[[ShardMap], None]] = []
        #: where the map served by is recorded (``DATA_DIR/served-shard-map.json``), once :meth:`remember` ran
        self.served_path: str | None = None
        #: 1 at each slot this group owned in the map this node last served by before this start
        #: (:meth:`remember`); None: no such map
        self.owned_before: bytes | None = None
        #: slots imported whose move was aborted while this node was down or a standby: their keys go back
        #: and their imported leases go at its start as the primary or its promotion (:meth:`_undo_imports`)
        self.undone_at_start: set[int] = set()
        #: the map kept in etcd, while :meth:`follow_etcd` follows it (SHARD_MAP_NOTICE reads it: server.mapnotice)
        self.stored: EtcdShardMap | None = None
        #: the newest map refused for a slot gained without a known import (offered again when the log
        #: brings that import: :meth:`adopted_by_log`)
        self.refused: ShardMap | None = None
        #: name -> owner-key hashes of a moved queue a standby saw flipped here: let in by its promotion
        #: within the primary's reclaim window after the flip (:meth:`take_stored_map`)
        self.promoted_queues: dict[str, list[bytes]] = {}
        #: 1 at each slot this group owns without its token floor: gained by a map (a mark and its flip)
        #: with no import of its state (no SLOTS_ADOPTED), so its names are answered Unavailable until
        #: the floor is adopted (:meth:`adopt`; ``fastlock shard adopt``)
        self.unadopted = bytearray(SLOTS)
        #: whether any slot is in :attr:`unadopted`
        self.unadopted_any = False
        #: 1 at each slot this group owns whose token floor in the map is above the primary's last token
        #: while it raises its epoch above it in etcd (:meth:`settle_floors`): its names are answered Unavailable
        self.owed = bytearray(SLOTS)
        #: whether any slot is in :attr:`owed`
        self.owed_any = False
        #: the task raising the group's epoch in etcd above the map's floors, while one runs
        self._settling: asyncio.Task | None = None
        #: where :attr:`unadopted` is kept (``DATA_DIR/unadopted-slots.json``), once :meth:`remember` ran
        self.unadopted_path: str | None = None
        #: slots this start's map gives this group that the map it last served by did not (their move's
        #: flip came while the node was down): adopted only if recovery finds their import (:meth:`restore_imports`)
        self.gained_at_start: list[int] = []
        #: where the moved queues let in on this primary are kept until their window ends (:data:`LET_IN_FILE`),
        #: once :meth:`remember` ran
        self.let_in_path: str | None = None
        #: name -> (the wall-clock end of its window, ms; owner-key hashes, FIFO): the moved queues a flip let in
        #: before this node's start, their window not over (read by :meth:`remember`, let in by its first
        #: run as the primary)
        self.let_in_before: dict[str, tuple[int, list[bytes]]] = {}
        #: name -> tokens of the leases this primary imported by a move whose slot has not flipped yet
        #: (:meth:`imported_held`; not kept across a restart, nor on a standby)
        self.imported_leases: dict[str, set[int]] = {}
        #: 1 at each slot a move is moving to this group
        self.incoming = bytes(SLOTS)
        #: at each slot a move is moving to this group, the epoch of the first map this node took (or
        #: started with) that marks it so, since it does without a break: SLOT_IMPORT refuses a page
        #: exported at an older epoch (from a move of the slot aborted since, server.slotmove)
        self.marked_since = array("q", bytes(8 * SLOTS))
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
        self.moving = shard_map.moving_slots_of(self.group)
        incoming = bytearray(SLOTS)
        for r in shard_map.ranges:
            if r.moving_to == self.group:
                incoming[r.first:r.last + 1] = b"\x01" * (r.last - r.first + 1)
        newly = _and_not(bytes(incoming), self.incoming)  # newly marked moving here, run by run
        start = newly.find(1)
        while start >= 0:
            end = newly.find(0, start)
            end = SLOTS if end < 0 else end
            self.marked_since[start:end] = array("q", [shard_map.epoch]) * (end - start)
            start = newly.find(1, end)
        self.incoming = bytes(incoming)
        #: whether a move is moving any of this group's slots
        self.moving_any = 1 in self.moving
        self._stopped()
        if self.served_path is not None:
            write_map_file(self.served_path, shard_map)
        log.info("shard map epoch %d: group %s owns %d of %d slots", shard_map.epoch, self.group,
                 sum(self.owned), SLOTS)

    def remember(self, data_dir: str | os.PathLike[str], defer_gains: bool = False) -> None:
        """Check this node's map against the last one it served by, recorded in ``data_dir``
        (:data:`SERVED_MAP_FILE`), then record it there, and every map it serves by from now on.

        :raises ShardMapError: this map gives this node's group a slot the recorded map gave another
            group and did not mark as moving here (a map file or etcd key changed by hand while the
            node was down): that group may hold leases of it, and slots change owner only by a move.
            With ``defer_gains`` (a node of an etcd group following the map in etcd: it grants only
            once promoted) it starts by the recorded map instead and takes this one as a running node
            takes a newer map (:meth:`offer`: once its log holds its group's import of those slots).
            Slots this map takes away are let go (a move that finished while the node was down).
        :raises OSError: the file cannot be read or written.
        """
        path = os.path.join(data_dir, SERVED_MAP_FILE)
        self.unadopted_path = os.path.join(data_dir, UNADOPTED_FILE)
        if os.path.exists(path):
            served = load_map_file(path)
            had = served.slots_of(self.group)
            self.owned_before = had
            # a slot lost is safe (this node stops granting it: a move finished while it was down);
            # a slot gained is safe only if the last map marked it as moving here (its state was imported)
            gained = [s for s in range(SLOTS) if self.owned[s] and not had[s]
                      and served.moving_to_of_slot(s) != self.group]
            if gained and defer_gains and served.epoch < self.shard_map.epoch:
                # an etcd group's node serves only once promoted, and a promotion takes the newer map only
                # if its log holds the group's import of those slots (offer): it starts by the map it served
                log.warning("shard map epoch %d gives group %s %d slots (the first %d) that epoch %d, the map this "
                            "node last served by, neither gave it nor marked as moving here (a move that ended "
                            "while it was down): it starts by epoch %d and takes the newer map once its log holds "
                            "its group's import of them (replicated from its primary)", self.shard_map.epoch,
                            self.group, len(gained), gained[0], served.epoch, served.epoch)
                self.refused = self.shard_map
                self.set_map(served)
                gained = []
            kept = self._load_unadopted(self.unadopted_path)
            # a slot owned without its floor before the restart stays so while this group owns it; a slot
            # gained while the node was down is so unless recovery finds its import (restore_imports)
            self.gained_at_start = [s for s in range(SLOTS) if self.owned[s] and not had[s]]
            self._set_unadopted([s for s in kept if self.owned[s] and had[s]] + self.gained_at_start, 1,
                                write=False)
            if gained:
                raise ShardMapError(f"shard map epoch {self.shard_map.epoch} gives group {self.group} other slots than "
                                    f"epoch {served.epoch}, the map this node last served by ({path}): "
                                    f"{len(gained)} slots (the first {gained[0]}) it did not own and no move was "
                                    f"bringing here; slots change owner only by a move, else two groups would "
                                    f"grant the same names (remove that file only if no other group holds "
                                    f"leases of those slots)")
        self.served_path = path
        write_map_file(path, self.shard_map)
        self._write_unadopted()
        self.let_in_path = os.path.join(data_dir, LET_IN_FILE)
        self.let_in_before = self._read_let_in()

    @staticmethod
    def _load_unadopted(path: str) -> list[int]:
        """The slots listed in the file at ``path`` (:data:`UNADOPTED_FILE`; none if absent).

        :raises ShardMapError: the file is not a JSON list of slots."""
        if not os.path.exists(path):
            return []
        try:
            with open(path, encoding="utf-8") as f:
                slots = json.load(f)
        except ValueError as exc:
            raise ShardMapError(f"{path} is not JSON: {exc}") from None
        if type(slots) is not list or not all(type(s) is int and 0 <= s < SLOTS for s in slots):
            raise ShardMapError(f"{path} is not a list of slots (ints 0..{SLOTS - 1})")
        return slots

    def _set_unadopted(self, slots: list[int] | range, value: int, write: bool = True) -> None:
        """Mark ``slots`` owned without (``value`` 1) or with (0) their token floor; ``write``: keep
        the set in the data directory (:data:`UNADOPTED_FILE`) if it changed."""
        table = self.unadopted
        changed = False
        for slot in slots:
            if table[slot] != value:
                table[slot] = value
                changed = True
        if changed:
            self.unadopted_any = 1 in table
            self._stopped()
            if write:
                self._write_unadopted()

    def _stopped(self) -> None:
        """Set :attr:`stopped`: 1 at each slot a move is moving away, owned without its floor, or
        whose map floor this primary has not reached yet (the one table :meth:`check_name` looks at
        for any of them, after ownership)."""
        stopped = self.moving
        if self.unadopted_any:
            stopped = _or(stopped, bytes(self.unadopted))
        if self.owed_any:
            stopped = _or(stopped, bytes(self.owed))
        #: 1 at each slot of :attr:`moving`, :attr:`unadopted` or :attr:`owed`
        self.stopped = stopped

    def _set_owed(self, ranges: list[tuple[int, int, int]]) -> None:
        """Make :attr:`owed` the slots of ``ranges`` (``(first, last, floor)``) this group owns."""
        owed = bytearray(SLOTS)
        for first, last, _floor in ranges:
            owed[first:last + 1] = self.owned[first:last + 1]
        self.owed = owed
        self.owed_any = 1 in owed
        self._stopped()

    def floors_epoch(self) -> int:
        """The epoch after the highest token floor the map records for this group's slots (0: none).
        The group's primary raises its epoch there before it grants their names (:meth:`settle_floors`),
        so a node of the group counts it as an epoch its group may have reached: an etcd bid and a
        promotion go above it, and etcd's epoch up to it is credible
        (:attr:`~fastlock.coordination.etcd.EtcdArbiter.known_epoch`).  A primary that raised its
        epoch there and died before its standbys heard so left that epoch in etcd alone: counting it
        keeps the next primary from raising its own to the same epoch for the same floor (every
        token of that epoch issued twice)."""
        floors = self.shard_map.floors_of(self.group)
        return _epoch_above(floors) if floors else 0

    def moving_in(self) -> bool:
        """Whether the map marks slots moving to this group: its primary's import of them raises the
        group's epoch to the source's if that is higher, by any amount, and a standby that missed the
        import (detached over it) knows of it only by etcd's epoch, which it then believes
        (:attr:`~fastlock.coordination.etcd.EtcdArbiter.moving_in`)."""
        group = self.group
        return any(r.moving_to == group for r in self.shard_map.ranges)

    def floors_above(self, token: int) -> list[tuple[int, int, int]]:
        """The ranges this group owns whose token floor in the map is above ``token``:
        ``(first, last, floor)``."""
        return [(first, last, floor) for first, last, floor in self.shard_map.floors_of(self.group) if floor > token]

    def settle_floors(self) -> None:
        """On the primary: every token it issues for a slot it owns must be above the slot's token
        floor in the map (the source's high-water mark a move recorded), whatever its log holds.  If
        its last token is below a floor, it raises its epoch to the one after the highest such floor's
        (above every token the source issued, and every token this group issued at the epoch it
        adopted with the move's import); in an etcd group whose epoch in etcd is below that, the
        slots are :attr:`owed` (answered Unavailable) until a task has raised it there first
        (:meth:`_settle_in_etcd`).  A node that is not the primary does nothing (its promotion runs
        this).  Run at the primary's start, at its promotion and with each map it takes."""
        if not self._is_primary():
            return
        server = self.server
        owed = self.floors_above(server.table.last_token)
        if not owed:
            if self.owed_any:
                self._set_owed([])
            return
        epoch = _epoch_above(owed)
        runs = [[first, last] for first, last, _floor in owed[:INFO_RUNS]]
        if server.handlers.slot_moves.raise_floor_now(make_token(epoch, 0)):
            self._set_owed(owed)
            self._refuse_owed_waiters()
            log.warning("shard group %s owns slots %s whose token floor in the shard map (epoch %d) is above its last "
                        "token %d: their names are answered Unavailable until the group's epoch in etcd is raised "
                        "to %d", self.group, runs, self.shard_map.epoch, server.table.last_token, epoch)
            if self._settling is None:
                self._settling = server.tasks.spawn(self._settle_in_etcd(), "raise the group's epoch in etcd above "
                                                    "the shard map's token floors")
            return
        self._set_owed([])
        self._batch_end()
        log.warning("shard group %s: slots %s have a token floor in the shard map (epoch %d) above this node's last "
                    "token: its epoch is raised to %d", self.group, runs, self.shard_map.epoch, epoch)

    def _refuse_owed_waiters(self) -> None:
        """Take out every waiter of the names of :attr:`owed` slots, each acquire answered
        Unavailable (:meth:`below_floor`: the client asks again): the gate refuses new requests for
        them, but a release, an expiry or a lock-delay's end would grant a waiter already queued a
        token below the slot's floor while the group's epoch is being raised above it."""
        server = self.server
        owed = self.owed
        names = server.table.waited_names(lambda name: owed[slot_of(name)] == 1)
        if not names:
            return
        server.after_batch()  # every event so far is delivered: what follows is this refusal's
        taken = self._take_waiters(names, monotonic_ms())

        def refuse(conn: Any, rid: int, name: str) -> None:
            if not getattr(conn, "closed", False):
                server.handlers.failed(conn, rid, 0, self.below_floor(name, slot_of(name)))

        self._answer_taken(taken, refuse)
        log.warning("shard group %s: %d waiters of %d locks whose slots' token floor is above its last token taken out "
                    "of their queues, answered Unavailable", self.group, sum(len(w) for w in taken.values()),
                    len(taken))
        server.after_batch()

    async def _settle_in_etcd(self) -> None:
        """While this node is the primary and owes a map floor: raise the group's epoch in etcd
        above it (:meth:`~fastlock.coordination.etcd.EtcdArbiter.adopt_epoch_above`, every
        :data:`SETTLE_RETRY_S` seconds until it succeeds), then in its log (:meth:`settle_floors`)."""
        server = self.server
        moves = server.handlers.slot_moves
        try:
            while self.owed_any and self._is_primary():
                owed = self.floors_above(server.table.last_token)
                if not owed:
                    break
                epoch = _epoch_above(owed)
                arbiter = moves.arbiter()
                try:
                    adopted = await arbiter.adopt_epoch_above(epoch) if arbiter is not None else epoch
                except EtcdUnavailable:
                    adopted = 0
                if adopted and self._is_primary():
                    moves.raise_floor_now(make_token(adopted, 0))
                    log.warning("shard group %s: its epoch is raised to %d, above the token floors of the shard map "
                                "(epoch %d)", self.group, adopted, self.shard_map.epoch)
                    self.settle_floors()
                    self._batch_end()
                    continue
                log.warning("shard group %s: could not raise its epoch in etcd to %d (above the shard map's token "
                            "floors): retrying in %g s", self.group, epoch, SETTLE_RETRY_S)
                await asyncio.sleep(SETTLE_RETRY_S)
        finally:
            self._settling = None

    def _write_unadopted(self) -> None:
        """Write :attr:`unadopted` to :attr:`unadopted_path` (a new file renamed over the old one)."""
        path = self.unadopted_path
        if path is None:
            return
        temp = path + ".new"
        with open(temp, "w", encoding="utf-8") as f:
            json.dump(_ones(bytes(self.unadopted)), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)

    def unadopted_runs(self) -> list[list[int]]:
        """The slots owned without their token floor, as runs ``[first, last]``, ascending."""
        runs: list[list[int]] = []
        for slot in _ones(bytes(self.unadopted)):
            if runs and runs[-1][1] == slot - 1:
                runs[-1][1] = slot
            else:
                runs.append([slot, slot])
        return runs

    def unadopted_by_log(self, record: SlotsUnadopted) -> None:
        """A standby applied its primary's SLOTS_UNADOPTED record: the slots of it this group owns
        are owned without their token floor here too (a standby that joined after the primary took
        their flip learns it so)."""
        first, last = record.first, record.last
        if type(first) is not int or type(last) is not int or not 0 <= first <= last < SLOTS:
            log.error("ignoring a SLOTS_UNADOPTED record of slots %r..%r: not 0 <= first <= last < %d", first, last,
                      SLOTS)
            return
        self._set_unadopted([s for s in range(first, last + 1) if self.owned[s]], 1)

    def relog_unadopted(self, wal: Any) -> int:
        """Log a SLOTS_UNADOPTED record for each run of slots this group owns without their token
        floor (after a standby's snapshot, and at a primary's start): how many."""
        runs = self.unadopted_runs() if self.unadopted_any else []
        for first, last in runs:
            wal.log_slots_unadopted(first, last)
        return len(runs)

    def adopt(self, first: int, last: int) -> None:
        """Slots ``first..last`` have their token floor now (a SLOTS_ADOPTED record of this group's,
        logged and durable): their names are served."""
        if self.unadopted_any:
            self._set_unadopted(range(first, last + 1), 0)
            log.warning("slots %d..%d: the token floor is adopted; their names are served", first, last)

    def restore_imports(self, imports: ImportedSlots | None) -> None:
        """Take what recovery found of this group's imports (``imports``: the snapshot's and the
        SLOTS_ADOPTED records' after it; None: none), after :meth:`remember`.  A slot a move is
        still bringing here is imported again (this node takes its flip, its queues wait for it);
        a queue of a name whose slot this group owns now and did not own in the map the node last
        served by is let in in its order at the primary's start (:meth:`let_in_restored`: the flip
        came while the node was down); an imported slot this group neither owns nor is being given
        (the move was aborted while the node was down) has its keys sent back at that start.  What
        the node had served already before the restart (a flip's let-in) is left out: the log keeps
        an import's record until a snapshot leaves it out (:meth:`pending_imports`)."""
        gained = set(self.gained_at_start)
        if imports is not None:  # a slot flipped here while the node was down, imported before: it has its floor
            self._set_unadopted([s for s in imports.slots if s in gained], 0, write=False)
        self._write_unadopted()
        if self.unadopted_any:
            log.error("shard group %s owns slots without their token floor (no import of their state): %s; their "
                      "names are answered Unavailable until `fastlock shard adopt` sets it", self.group,
                      self.unadopted_runs()[:INFO_RUNS])
        if imports is None:
            return
        before = self.owned_before
        for slot in imports.slots:
            if not 0 <= slot < SLOTS or self.owned[slot]:
                continue
            if self.shard_map.moving_to_of_slot(slot) == self.group:
                self.imported[slot] = 1
            else:  # the move was aborted (its keys go back; none left if that was done before)
                self.undone_at_start.add(slot)
        for name, owners in imports.queues.items():
            slot = slot_of(name)
            if self.imported[slot] or (self.owned[slot] and before is not None and not before[slot]):
                self.imported_queues[name] = list(owners)

    def pending_imports(self) -> ImportedSlots | None:
        """What a snapshot keeps of this group's imports (None: nothing): the slots imported and
        neither flipped nor aborted yet, those whose abort's keys are still to go back, and the
        moved queues of the slots imported (:meth:`restore_imports` takes it back)."""
        pending = set(_ones(_and_not(bytes(self.imported), self.owned))) | self.undone_at_start
        queues = {n: list(q) for n, q in self.imported_queues.items() if slot_of(n) in pending}
        if not pending and not queues:
            return None
        return ImportedSlots(sorted(pending), queues)

    def relog_imports(self, wal: Any, floor: int, epoch: int) -> int:
        """Log the slots imported and not yet taken (flipped or aborted), with their moved queues,
        as ``SLOTS_ADOPTED`` records again (one per run of consecutive slots; its queues in parts
        of at most :data:`RELOG_PART` waiters, at most :data:`RELOG_PART` parts a record, in FIFO
        order; ``floor``: the table's last fencing token, ``epoch``: its epoch).  Run right after
        a standby's snapshot is taken (the snapshot holds leases and keys only): a standby joining
        by it learns the imports from these records, as one that followed the import did
        (:meth:`adopted_by_log`).  Returns how many records were logged."""
        pending = _ones(_and_not(bytes(self.imported), self.owned))
        runs: list[list[int]] = []
        for slot in pending:
            if runs and runs[-1][1] == slot - 1:
                runs[-1][1] = slot
            else:
                runs.append([slot, slot])
        logged = 0
        for first, last in runs:
            parts = [[name, queue[i:i + RELOG_PART]] for name, queue in self.imported_queues.items()
                     if first <= slot_of(name) <= last for i in range(0, len(queue), RELOG_PART)]
            for i in range(0, max(len(parts), 1), RELOG_PART):
                wal.log_slots_adopted(first, last, floor, epoch, parts[i:i + RELOG_PART])
                logged += 1
        return logged

    def relog_owned(self, wal: Any, floor: int, epoch: int) -> int:
        """Log a ``SLOTS_ADOPTED`` record (no queues) for each run of slots this group owns with
        their token floor (``floor``: the table's last fencing token, ``epoch``: its epoch), right
        after a standby's snapshot is taken: the snapshot holds this primary's whole table, so the
        standby has the token floor of every such slot, those a move gave it included.  A standby
        that missed a move's mark and its import (down over them, or restarted with a map from
        before them) learns from these records that its group holds those slots
        (:meth:`adopted_by_log`) and takes the map that gave them, as one that replicated the import
        does.  Slots owned without their floor (:attr:`unadopted`) are left out: their
        ``SLOTS_UNADOPTED`` records follow (:meth:`relog_unadopted`).  Returns how many records
        were logged."""
        logged = 0
        owned = _and_not(bytes(self.owned), bytes(self.unadopted)) if self.unadopted_any else bytes(self.owned)
        start = owned.find(1)
        while start >= 0:
            end = owned.find(0, start)
            end = SLOTS if end < 0 else end
            wal.log_slots_adopted(start, end - 1, floor, epoch, [])
            logged += 1
            start = owned.find(1, end)
        return logged

    def adopted_by_log(self, record: SlotsAdopted) -> None:
        """A standby applied its primary's SLOTS_ADOPTED record: its group imported a page of
        slots ``record.first..record.last`` (and their waiter queue parts, kept for the flip and
        this node's promotion).  The standby logs the record too (its restart recovers the import
        from its log and snapshots, as the primary's does); a map refused for lack of that import
        is offered again."""
        first, last = record.first, record.last
        if type(first) is not int or type(last) is not int or not 0 <= first <= last < SLOTS:
            log.error("ignoring a SLOTS_ADOPTED record of slots %r..%r: not 0 <= first <= last < %d", first, last,
                      SLOTS)
            return
        for slot in range(first, last + 1):
            if not self.owned[slot]:
                self.imported[slot] = 1
        if self.unadopted_any:  # its primary adopted the floor of slots this group owns already
            self.adopt(first, last)
        for part in record.queues if type(record.queues) is list else ():
            if (type(part) is list and len(part) == 2 and type(part[0]) is str and type(part[1]) is list
                    and first <= slot_of(part[0]) <= last):
                queue = self.imported_queues.setdefault(part[0], [])
                known = set(queue)
                queue.extend(o for o in dict.fromkeys(part[1]) if type(o) is bytes and o not in known)
        refused = self.refused
        if refused is not None and refused.epoch > self.shard_map.epoch:
            self.refused = None
            self.offer(refused)

    def let_in_restored(self) -> None:
        """On the primary, at its start: let in the moved queues restored by :meth:`remember` whose
        slots this group owns already (the flip came while this node was down), and send back the
        keys of slots whose move was aborted while it was down (``KEY_MOVED`` naming the owner)."""
        if not self._is_primary():
            return
        self.settle_floors()
        if self.unadopted_any:  # its standbys learn it from the log
            self.relog_unadopted(self.server.wal)
        owned = sorted({slot_of(n) for n in self.imported_queues if self.owned[slot_of(n)]})
        if owned:
            self._let_in(owned, judge_floor=False)
        self._let_in_again()
        if self.undone_at_start:
            self._undo_imports(self.undone_at_start)
            self.undone_at_start.clear()

    def promoted(self) -> None:
        """This node was promoted (it is the primary, before its first grant): the imports of
        moves aborted while it was a standby are undone now (:meth:`_undo_imports`), unless its
        old primary's records did it (then nothing is left to drop); the map's token floors of its
        slots are settled (:meth:`settle_floors`)."""
        self.settle_floors()
        if self.undone_at_start and self._is_primary():
            self._undo_imports(self.undone_at_start)
            self.undone_at_start.clear()

    def _undo_imports(self, undone: set[int]) -> None:
        """On the primary: a move of the ``undone`` slots to this group was aborted after an
        import.  Their keys go back to the slots' owner (``KEY_MOVED`` naming it) and their
        imported leases are dropped (a ``REVOKE`` record each, by :data:`MOVE_PRINCIPAL`): the
        source served the slots again, so its holders may have released those leases there, and a
        later move of the slots here would otherwise serve them again (a released lease held, its
        token valid).  Slots this group owns by now, or a move is bringing here again, are left
        alone (their leases are this group's or the new move's)."""
        server = self.server
        undone = {slot for slot in undone if not self.owned[slot] and not self.incoming[slot]}
        if not undone:
            return
        if len(server.keys.space):  # the keys first: the leases' REVOKE records would delete those attached
            back: dict[str, set[int]] = {}
            for slot in undone:
                back.setdefault(self.shard_map.owner_of_slot(slot).name, set()).add(slot)
            for owner, slots in back.items():
                drop_keys(server, slots, owner)
        now = monotonic_ms()
        dropped = 0
        for h in server.table.holders():
            slot = slot_of(h.name)
            if slot in undone:
                server.handlers.lock_admin.take_lease(
                    h.name, h.token, h.meta, MOVE_PRINCIPAL,
                    f"the move of slot {slot} to shard group {self.group} was aborted", now)
                dropped += 1
        if dropped:
            log.warning("slot move: a move of %d slots here was aborted; %d leases it imported dropped", len(undone),
                        dropped)
        self._batch_end()

    def _read_let_in(self) -> dict[str, tuple[int, list[bytes]]]:
        """The moved queues in :data:`LET_IN_FILE` whose window has not ended (name -> (its end,
        wall-clock ms; owner-key hashes, FIFO)); a file that cannot be read is logged and ignored."""
        path = self.let_in_path
        if path is None or not os.path.exists(path):
            return {}
        now = wall_ms()
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            kept = {}
            for name, entry in data.items():
                until = entry["until_ms"]
                if type(name) is not str or type(until) is not int or type(entry["owners"]) is not list:
                    raise ValueError(f"{name!r:.100}: not a name with until_ms (int) and owners (a list)")
                if until > now:
                    kept[name] = (until, [bytes.fromhex(o) for o in entry["owners"][:LET_IN_WAITERS]])
            return kept
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.error("ignoring %s (the moved queues let in before this start: their order is not kept): %s", path,
                      exc)
            return {}

    def _keep_let_in(self, queues: dict[str, list[bytes]], window: float) -> None:
        """Record ``queues`` (let in now, by a flip, for ``window`` seconds) in :data:`LET_IN_FILE`,
        beside those still in their window; a write that fails is logged (a restart then does not
        keep their order)."""
        path = self.let_in_path
        if path is None or window <= 0:
            return
        entries = self._read_let_in()
        until = wall_ms() + int(window * 1000)
        for name, owners in queues.items():
            entries[name] = (until, owners[:LET_IN_WAITERS])
        data = {name: {"until_ms": until, "owners": [o.hex() for o in owners]}
                for name, (until, owners) in entries.items()}
        try:
            write_atomically(os.path.dirname(path), LET_IN_FILE, json.dumps(data).encode())
        except OSError as exc:
            log.error("could not record the moved queues let in (%s): a restart within their reclaim window will "
                      "not keep their order: %s", path, exc)

    def _let_in_again(self) -> None:
        """This node's first run as the primary since its start: the moved queues a flip let in on it
        before (:data:`LET_IN_FILE`) whose reclaim window has not ended keep their order for the rest of it."""
        before, self.let_in_before = self.let_in_before, {}
        server = self.server
        now = wall_ms()
        queues = {n: owners for n, (until, owners) in before.items() if until > now and self.owned[slot_of(n)]}
        if not queues or server is None:
            return
        left = max(until for n, (until, _owners) in before.items() if n in queues) - now
        table = server.table
        server.reclaim.arm(queues, lambda name, owner: table.holder(name, monotonic_ms(), owner) is not None,
                           asyncio.get_running_loop(), left / 1000)
        log.warning("slot move: %d moved queues let in before this start keep their order for %d ms more",
                    len(queues), left)

    # -- the check ------------------------------------------------------------------------
    def check_name(self, name: Any) -> int:
        """-1, or the slot of ``name`` if a move is moving it (the request is to be held).

        :raises WrongShard: this group does not own ``name``'s slot (a non-str is left to the handler).
        :raises Unavailable: this group owns it without its token floor (:meth:`not_adopted`)."""
        if type(name) is str:
            slot = slot_of(name)
            if not self.owned[slot]:
                raise self.wrong_shard(name, slot)
            if self.stopped[slot]:
                if self.moving[slot]:
                    return slot
                raise self.unserved(name, slot)
        return -1

    def check_names(self, where: NamesAt, args: list) -> tuple[str, int] | None:
        """Check every name of a request's arguments ``args`` at ``where``; None, or a name
        (and its slot) a move is moving (the request is to be held).

        :raises WrongShard: every name is another group's, all one group's.
        :raises CrossShard: the names span several groups.
        :raises Unavailable: a name's slot is this group's without its token floor (:meth:`not_adopted`).
        """
        owned = self.owned
        first: tuple[str, int] | None = None
        others: set[str] = set()
        mine = False
        moving: tuple[str, int] | None = None
        shard_map = self.shard_map
        for name in names_in(where, args):
            slot = slot_of(name)
            if owned[slot]:
                mine = True
                if moving is None and self.moving[slot]:
                    moving = (name, slot)
                elif self.stopped[slot] and not self.moving[slot]:
                    raise self.unserved(name, slot)
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
        return moving

    def wrong_shard(self, name: str, slot: int) -> WrongShard:
        """The redirect for ``name`` (in ``slot``), which another group owns."""
        owner = self.shard_map.owner_of_slot(slot)
        return WrongShard(f"{name!r:.100} is in slot {slot}, owned by shard group {owner.name} "
                          f"({', '.join(owner.addresses)}), not {self.group} (shard map epoch "
                          f"{self.shard_map.epoch})", slot, owner.name, owner.addresses, self.shard_map.epoch)

    def unserved(self, name: str, slot: int) -> Unavailable:
        """The retryable refusal of a request for ``name``, in ``slot``, which this group owns
        without its token floor (:meth:`not_adopted`) or below the map's floor (:meth:`below_floor`)."""
        return self.not_adopted(name, slot) if self.unadopted[slot] else self.below_floor(name, slot)

    def below_floor(self, name: str, slot: int) -> Unavailable:
        """The retryable refusal of a request for ``name``, in ``slot``, whose token floor in the map
        is above this primary's last token while it raises its epoch (:attr:`owed`)."""
        return Unavailable(f"{name!r:.100} is in slot {slot}, whose token floor in the shard map (epoch "
                           f"{self.shard_map.epoch}) is above shard group {self.group}'s last token: the group is "
                           f"raising its epoch above it; retry")

    def not_adopted(self, name: str, slot: int) -> Unavailable:
        """The retryable refusal of a request for ``name``, in ``slot``, which this group owns
        without its token floor (:attr:`unadopted`)."""
        return Unavailable(f"{name!r:.100} is in slot {slot}, which shard group {self.group} gained (shard map epoch "
                           f"{self.shard_map.epoch}) without its import: it has not adopted the slot's token floor, so "
                           f"its tokens could be below those the slot's previous group granted; run `fastlock shard "
                           f"adopt --slots {slot} --from GROUP` (the group that served it before), or `--force` if "
                           f"that group is lost (docs/runbooks/shard-adopt.md); retry")

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
        self.server = getattr(handlers, "server", None)
        quotas = getattr(self.server, "quotas", None)
        if quotas is not None:
            self.held_share = held_share(quotas.single_principal, quotas.config.anonymous_quota_divisor)
        for op, (handler, fewest, most) in list(handlers.by_op.items()):
            where = NAMES_OF_OP[op]
            if op == OP_SESSION_ATTACH and where is not None:
                handlers.by_op[op] = (self._attach_checked(handler, where), fewest, most)
            elif op == OP_SESSION_KEEPALIVE:
                handlers.by_op[op] = (self._keepalive_checked(handler), fewest, most)
            elif where is not None:
                handlers.by_op[op] = (self._checked(handler, where), fewest, most)

    def _checked(self, handler: Handler, where: NamesAt) -> Handler:
        if where.names == (0,) and not where.rows and not where.lists:  # one name, the first argument: the common case
            check_name = self.check_name

            def one_name(conn: Any, req_id: int, msg: list) -> None:
                slot = check_name(msg[2])
                if slot >= 0:
                    self.hold(conn, req_id, msg, handler, msg[2], slot)
                    return
                handler(conn, req_id, msg)

            return one_name
        check_names = self.check_names

        def names(conn: Any, req_id: int, msg: list) -> None:
            moving = check_names(where, msg[2:])
            if moving is not None:
                self.hold(conn, req_id, msg, handler, *moving)
                return
            handler(conn, req_id, msg)

        return names

    def _attach_checked(self, handler: Handler, where: NamesAt) -> Handler:
        """SESSION_ATTACH's check: a session attaches leases of every group's names a client held
        there (a lease whose slot moved away is still named by its old group's session), so the
        request is never refused for another group's names: the handler answers a lease of a name
        this group does not own as lost (:meth:`owns`; the routing client then re-homes it) and
        detaching one changes nothing.  A request naming a slot being moved is held, as an EXTEND."""

        def attach(conn: Any, req_id: int, msg: list) -> None:
            for name in names_in(where, msg[2:]) if self.moving_any else ():
                slot = slot_of(name)
                if self.owned[slot] and self.moving[slot]:  # checked again when the move ends
                    self.hold(conn, req_id, msg, attach, name, slot)
                    return
            handler(conn, req_id, msg)

        return attach

    def _keepalive_checked(self, handler: Handler) -> Handler:
        """SESSION_KEEPALIVE's check: while a move freezes slots, a keep-alive of a session with a
        lease attached in one of them is held as an EXTEND is (renewing it at the source after its
        state was shipped would leave the destination's copy shorter than the client believes);
        run when the move ends, it answers the leases the flip dropped as lost (the routing client
        re-homes them) and renews the others."""

        def keepalive(conn: Any, req_id: int, msg: list) -> None:
            sessions = getattr(getattr(self.server, "handlers", None), "sessions", None)
            if self.moving_any and sessions is not None and len(msg) > 2:
                for name, _token in sessions.leases_of(msg[2]):
                    slot = slot_of(name)
                    if self.owned[slot] and self.moving[slot]:
                        self.hold(conn, req_id, msg, keepalive, name, slot)
                        return
            handler(conn, req_id, msg)

        return keepalive

    def owns(self, name: str) -> WrongShard | None:
        """None if this group owns ``name``'s slot, else the redirect naming its owner."""
        slot = slot_of(name)
        return None if self.owned[slot] else self.wrong_shard(name, slot)

    def offer(self, shard_map: ShardMap) -> None:
        """Serve by ``shard_map`` if its epoch is above this node's map's.  A newer map that names
        no group of this node's, or gives its group a slot other than by a move
        (:func:`fastlock.sharding.moves.allowed_change`), is logged and refused (the node keeps
        the map it has): else it would grant names another group still holds.  A map that takes
        slots away is taken (a node must stop granting what the map gave another group).  The
        slots it marks moving are frozen, those it takes away dropped, those it gives by a
        move let in (see the module docstring)."""
        if shard_map.epoch <= self.shard_map.epoch:
            return
        # a node (a standby too) takes the flip of a move into its group whose mark it missed only for
        # slots its log says its group imported (SLOTS_ADOPTED records: a standby learns them by replication)
        why = allowed_change(self.shard_map, shard_map, bytes(self.imported), self.group)
        if why is not None:
            log.error("not applying shard map epoch %d: %s; this node knows of no import of that slot by group %s "
                      "(its log has no SLOTS_ADOPTED record of it)", shard_map.epoch, why, self.group)
            if self.refused is None or shard_map.epoch > self.refused.epoch:
                self.refused = shard_map
            return
        if self.refused is not None and self.refused.epoch <= shard_map.epoch:
            self.refused = None
        old_owned, old_moving = self.owned, self.moving
        try:
            self.set_map(shard_map)
        except InvalidArgument as exc:
            log.error("not applying shard map epoch %d: %s", shard_map.epoch, exc)
            return
        owned, moving = self.owned, self.moving
        # the per-slot tables compared as whole numbers (one bit a slot set): every node takes
        # each map change on its event loop, so this stays well under a millisecond
        frozen = _ones(_and_not(moving, old_moving))
        lost = _ones(_and_not(old_owned, owned))
        gained = _ones(_and_not(owned, old_owned))
        unmarked = _and_not(old_moving, moving)
        aborted = set(_ones(_and_not(unmarked, _and_not(unmarked, owned))))
        undone_frozen = [n for n in self.frozen_queues if slot_of(n) in aborted]
        for name in undone_frozen:
            del self.frozen_queues[name]  # their acquires are answered SlotMoving and asked again
        self._frozen_changed(undone_frozen)
        if self.imported_queues or 1 in self.imported:  # a move to this group that was aborted
            undone: set[int] = set()
            for slot in _ones(bytes(self.imported)):
                if not owned[slot] and shard_map.moving_to_of_slot(slot) != self.group:
                    self.imported[slot] = 0
                    undone.add(slot)
            if undone and self._is_primary():  # its imported keys go back, its imported leases go
                self._undo_imports(undone)
            elif undone:  # a standby: its primary's records undo them; if it is promoted first, it does
                self.undone_at_start |= undone
            undone_queues = [n for n in self.imported_queues if not self.imported[slot_of(n)] and not owned[slot_of(n)]]
            for name in undone_queues:
                del self.imported_queues[name]
        if frozen:
            self._freeze(bytes(moving))
        if lost:
            if self.unadopted_any:  # a slot that comes back later needs its floor again
                self._set_unadopted(lost, 0)
            self._drop(lost)
        if gained:
            self._let_in(gained)
        if self.held and (lost or 1 in unmarked):
            self._answer_held()
        self.settle_floors()
        if self.on_change is not None:
            self.on_change(shard_map)
        for listener in self.listeners:
            listener(shard_map)

    # -- a move's freeze, drop and let-in -------------------------------------------------------
    def _is_primary(self) -> bool:
        server = self.server
        return server is not None and server.roles.role is Role.PRIMARY

    def _is_standby(self) -> bool:
        """A standby, or a standby being promoted (it grants nothing yet)."""
        server = self.server
        return server is not None and server.roles.role in (Role.STANDBY, Role.PROMOTING)

    def _freeze(self, moving: bytes) -> None:
        """Take every waiter of the names in ``moving`` slots out of the lock table (kept in
        :attr:`frozen_queues`, FIFO; their acquires held), whatever the name's state: held
        (exclusive, shared or permits), free behind a lock-delay or the promotion grace, or an
        acquire_many() member waiting for its other names.  The lock table then holds no waiter
        of those slots and the gate holds every new request for them, so no grant is decided on
        them (a grant needs a waiter or an acquire): not at a lease's expiry, a lock-delay's end
        or the grace's end."""
        server = self.server
        if not self._is_primary():
            return
        server.after_batch()  # every event so far is delivered: what follows is the freeze's
        table = server.table
        now = monotonic_ms()
        table.expire(now)  # what is due now (a grace's end, an expiry) happens before the freeze
        server.process_events(table.drain_events())
        taken = self._take_waiters(table.waited_names(lambda name: moving[slot_of(name)] == 1), now)
        for name, waiters in taken.items():
            self._add_frozen(name, waiters)

        def hold(conn: Any, rid: int, name: str) -> None:  # counted against its share, never refused
            self._keep(Held(conn, rid, None, None, name, slot_of(name), now + int(HOLD_S * 1000), conn.principal))

        self._answer_taken(taken, hold)
        # a promoted primary's reclaim window: the waiters still expected there (and the acquires parked
        # there) queue behind those it let into the table already
        for name, (queue, parked) in server.reclaim.take(lambda name: moving[slot_of(name)] == 1).items():
            self._add_frozen(name, queue)
            for p in parked:
                if not getattr(p.conn, "closed", False):
                    hold(p.conn, p.req_id, name)
        if self.held and self._hold_timer is None:
            self._hold_timer = asyncio.get_running_loop().call_later(HOLD_S / 4, self._hold_tick)
        if self.frozen_queues:
            log.warning("slot move: %d waiters of %d locks taken out of their queues until the move ends",
                        sum(len(q) for q in self.frozen_queues.values()), len(self.frozen_queues))
        server.after_batch()

    def _add_frozen(self, name: str, waiters: list[tuple[bytes, int]]) -> None:
        """Append ``waiters`` (owner-key hash, priority; FIFO) to ``name``'s frozen queue, each
        owner once; the queue is shipped to this node's standbys (:mod:`fastlock.replication.queues`)."""
        queue = self.frozen_queues.setdefault(name, [])
        known = {o for o, _priority in queue}
        for owner, priority in waiters:
            if owner not in known:
                known.add(owner)
                queue.append((owner, priority))
        self._frozen_changed([name])

    def _frozen_changed(self, names: list[str]) -> None:
        """The frozen queues of ``names`` changed (filled or dropped): shipped to the standbys at the batch end."""
        queues = getattr(self.server, "queues", None)
        if queues is not None:
            for name in names:
                queues.touched(name)

    def promoted_mirror(self, queues: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
        """This standby is promoted with ``queues``, the old primary's waiter queues (name ->
        owner-key hashes, FIFO) as it last shipped them: those of slots a move is moving away become
        their frozen queues (the old primary froze them, or would have: the export ships them in
        that order); those of slots another group owns are dropped.  Returns the rest, for the
        reclaim window (:mod:`fastlock.server.reclaim`)."""
        rest: dict[str, list[bytes]] = {}
        frozen = []
        for name, owners in queues.items():
            slot = slot_of(name)
            if not self.owned[slot]:
                continue
            if self.moving[slot]:
                self._add_frozen(name, [(o, 0) for o in owners])
                frozen.append(name)
            else:
                rest[name] = owners
        if frozen:
            log.warning("slot move: %d waiters of %d locks of moving slots kept in the old primary's order for the "
                        "move", sum(len(self.frozen_queues[n]) for n in frozen), len(frozen))
        return rest

    @staticmethod
    def _take_waiters_of(table: Any, name: str, now: int) -> list[tuple[bytes, int]]:
        """Cancel every waiter of ``name``, in queue order: the (owner-key hash, priority) of
        those cancelled, FIFO.  A waiter granted meanwhile (a shared one behind a cancelled
        exclusive head, with shared holders) is not among them: it holds a lease, shipped as
        one by the export, which runs after the freeze."""
        return [(bytes(o), p) for o, p in table.waiter_priorities(name) if table.cancel(name, o, now)]

    def _take_waiters(self, names: list[str], now: int) -> dict[str, list[tuple[bytes, int]]]:
        """Cancel every waiter of ``names`` (EV_WAIT_CANCELLED events left in the table for the
        caller): name -> the waiters taken out (owner-key hash, priority), FIFO."""
        table = self.server.table
        taken: dict[str, list[tuple[bytes, int]]] = {}
        for name in names:
            waiters = self._take_waiters_of(table, name, now)
            if waiters:
                taken[name] = waiters
        return taken

    def _drop(self, lost: list[int]) -> None:
        """This group no longer owns the ``lost`` slots: take out any waiter left on their names
        (logged at WARNING with the name; each acquire is answered WrongShard), then drop their
        keys and leases (REVOKE records)."""
        server = self.server
        lost_set = set(lost)
        gone = [n for n in self.frozen_queues if slot_of(n) in lost_set]
        for name in gone:
            del self.frozen_queues[name]
        self._frozen_changed(gone)
        if not self._is_primary():
            return
        table = server.table
        now = monotonic_ms()
        left = table.waited_names(lambda name: slot_of(name) in lost_set)
        if left:  # the freeze took them all, unless one entered the table after it
            self._redirect_waiters(left, now)
        keys = 0
        if len(server.keys.space):  # the keys go first: the leases' REVOKE records would delete those attached
            by_owner: dict[str, set[int]] = {}
            for slot in lost:
                by_owner.setdefault(self.shard_map.owner_of_slot(slot).name, set()).add(slot)
            keys = sum(drop_keys(server, slots, owner) for owner, slots in by_owner.items())
        dropped = 0
        for h in table.holders():
            slot = slot_of(h.name)
            if slot in lost_set:
                owner = self.shard_map.owner_of_slot(slot).name
                server.handlers.lock_admin.take_lease(h.name, h.token, h.meta, MOVE_PRINCIPAL,
                                                      f"slot {slot} moved to shard group {owner}", now)
                dropped += 1
        log.warning("slot move: %d slots now owned by other groups; %d leases dropped here, %d keys moved", len(lost),
                    dropped, keys)
        server.after_batch()

    def _redirect_waiters(self, names: list[str], now: int) -> None:
        """Take out the waiters of ``names`` (slots another group owns now), each acquire answered
        WrongShard naming the owner; logged at WARNING with each name."""
        server = self.server
        server.after_batch()
        taken = self._take_waiters(names, now)
        for name, waiters in taken.items():
            log.warning("slot move: %r (slot %d) still had %d waiters when its slot went to shard group %s: "
                        "taken out, redirected", name, slot_of(name), len(waiters),
                        self.shard_map.owner_of_slot(slot_of(name)).name)

        def redirect(conn: Any, rid: int, name: str) -> None:
            if not getattr(conn, "closed", False):
                server.handlers.failed(conn, rid, 0, self.wrong_shard(name, slot_of(name)))

        self._answer_taken(taken, redirect)

    def _answer_taken(self, taken: dict, answer: Callable[[Any, int, str], None]) -> None:
        """Count each waiter of ``taken`` (name -> the waiters taken out of its queue) cancelled by
        the table as it leaves, and ``answer(conn, request id, name)`` it if its connection is
        there; every other event of the table goes its usual way."""
        server = self.server
        sessions = server.limits.sessions
        others = []
        for ev in server.table.drain_events():
            if ev.name in taken and ev.kind == EV_WAIT_CANCELLED:
                server.quotas.waiter_event(ev)
                conn = sessions.get(ev.session)
                rid = reply_id(ev.request)
                if conn is not None and rid is not None:
                    answer(conn, rid, ev.name)
            else:
                others.append(ev)
        server.process_events(others)

    def checked_enter(self, enter: Callable[..., None]) -> Callable[..., None]:
        """The reclaim window's way into the lock table (:class:`~fastlock.server.reclaim.ReclaimGate`'s
        ``enter(conn, req_id, msg, name, owner, priority)``) behind this gate: an acquire parked
        there enters later, and by then its name's slot may be frozen by a move (the acquire is
        held, as a new request for it is) or another group's (answered WrongShard), so it never
        queues on a slot this group is moving or gave away."""

        def enter_checked(conn: Any, req_id: int, msg: list, name: str, owner: bytes, priority: int = 0) -> None:
            slot = slot_of(name)
            try:
                if not self.owned[slot]:
                    raise self.wrong_shard(name, slot)
                if self.moving[slot]:
                    self.hold(conn, req_id, msg, lambda c, r, m: enter(c, r, m, name, owner, priority), name, slot)
                    return
                if self.stopped[slot]:
                    raise self.unserved(name, slot)
            except FastlockError as exc:
                self.server.handlers.failed(conn, req_id, 0, exc)
                return
            enter(conn, req_id, msg, name, owner, priority)

        return enter_checked

    def refusal(self, names: tuple[str, ...] | list[str]) -> FastlockError | None:
        """Why a request for ``names`` admitted earlier may not enter the lock table now (a parked
        multi-lock reservation let in later: :mod:`fastlock.server.woundwait`): WrongShard (a name
        another group owns), SlotMoving (a name a move is moving), Unavailable (a name of a slot
        this group owns without its token floor), or None."""
        for name in names:
            slot = slot_of(name)
            if not self.owned[slot]:
                return self.wrong_shard(name, slot)
            if self.moving[slot]:
                return self.slot_moving(name, slot)
            if self.stopped[slot]:
                return self.unserved(name, slot)
        return None

    def _let_in(self, gained: list[int], judge_floor: bool = True) -> None:
        """This group owns the ``gained`` slots by a move: their moved waiters come back in order;
        those it never imported are owned without their token floor (:attr:`unadopted`; not judged
        here when ``judge_floor`` is False: a start's recovery judged them, :meth:`restore_imports`)."""
        server = self.server
        gained_set = set(gained)
        queues = {n: q for n, q in self.imported_queues.items() if slot_of(n) in gained_set}
        for name in queues:
            del self.imported_queues[name]
        taken = [s for s in gained if self.imported[s]]
        for slot in taken:
            self.imported[slot] = 0
        taken_set = set(taken)
        floorless = [s for s in gained if s not in taken_set] if judge_floor and len(taken) < len(gained) else []
        if floorless:  # a mark and its flip with no import: this group never adopted their token floor
            self._set_unadopted(floorless, 1)
            if self._is_primary():  # its standbys learn it from the log (one that joins later too)
                self.relog_unadopted(server.wal)
            log.error("shard map epoch %d gives group %s slots %s by a move whose state this group never imported "
                      "(its log has no SLOTS_ADOPTED record of them): their names are answered Unavailable until "
                      "their token floor is adopted (`fastlock shard adopt`)", self.shard_map.epoch, self.group,
                      self.unadopted_runs()[:INFO_RUNS])
        if queues and self._is_standby():
            # kept for this node's promotion within the primary's reclaim window (take_stored_map), then forgotten
            self.promoted_queues.update(queues)
            window = getattr(getattr(server, "reclaim", None), "window", 0)
            asyncio.get_running_loop().call_later(max(window, 0), self._forget_promoted_queues, list(queues))
            queues = {}
        if queues and server is not None:
            table = server.table
            self._keep_let_in(queues, server.reclaim.window)
            server.reclaim.arm(queues, lambda name, owner: table.holder(name, monotonic_ms(), owner) is not None,
                               asyncio.get_running_loop())
        log.warning("slot move: %d slots now owned here; %d moved queues keep their order", len(gained), len(queues))

    def _forget_promoted_queues(self, names: list[str]) -> None:
        for name in names:
            self.promoted_queues.pop(name, None)

    # -- held requests ---------------------------------------------------------------------------
    def hold(self, conn: Any, req_id: int, msg: list, handler: Handler, name: str, slot: int) -> None:
        """Hold a request for ``name`` (in ``slot``, being moved) until the move ends or :data:`HOLD_S`.

        :raises SlotMoving: :data:`MAX_HELD` requests are held already, or the principal of ``conn``
            has its share of them held (:func:`held_share`)."""
        if len(self.held) >= MAX_HELD:
            raise self.slot_moving(name, slot)
        principal = getattr(conn, "principal", ANONYMOUS)
        limit = self.held_share.limit_for(principal)
        have = self.held_by.get(principal, 0)
        if have >= limit:
            raise self.slot_moving(name, slot, f"; principal {principal!r} already has {limit} {HELD_WHAT}")
        self._keep(Held(conn, req_id, msg, handler, name, slot, monotonic_ms() + int(HOLD_S * 1000), principal))
        if self._hold_timer is None:
            self._hold_timer = asyncio.get_running_loop().call_later(HOLD_S / 4, self._hold_tick)

    def _keep(self, h: Held) -> None:
        self.held.append(h)
        self.held_by[h.principal] = self.held_by.get(h.principal, 0) + 1

    def _set_held(self, held: list[Held]) -> None:
        """Hold ``held`` (what is left of :attr:`held`) and count it per principal again."""
        self.held = held
        by: dict[str, int] = {}
        for h in held:
            by[h.principal] = by.get(h.principal, 0) + 1
        self.held_by = by

    def slot_moving(self, name: str, slot: int, why: str = "") -> SlotMoving:
        """The retryable refusal of a request for ``name`` (in ``slot``, being moved); ``why``
        is appended to the message."""
        to = self.shard_map.moving_to_of_slot(slot)
        return SlotMoving(f"{name!r:.100} is in slot {slot}, being moved from shard group {self.group} to {to} "
                          f"(shard map epoch {self.shard_map.epoch}){why}; retry")

    def _hold_tick(self) -> None:
        self._hold_timer = None
        now = monotonic_ms()
        late = [h for h in self.held if h.until_ms <= now]
        if late:  # a waiter taken out of its queue asks again with the same owner key: its place is kept
            self._set_held([h for h in self.held if h.until_ms > now])
            for h in late:
                self._answer(h, self.slot_moving(h.name, h.slot))
            self._batch_end()
        if self.held:
            self._hold_timer = asyncio.get_running_loop().call_later(HOLD_S / 4, self._hold_tick)

    def _answer(self, h: Held, exc: FastlockError) -> None:
        if not getattr(h.conn, "closed", False):
            self.server.handlers.failed(h.conn, h.req_id, 0, exc)

    def _batch_end(self) -> None:
        if self.server is not None:
            self.server.after_batch()

    def _answer_held(self) -> None:
        """After a map change: answer the held requests whose slot another group owns now
        (WrongShard; a SESSION_ATTACH or SESSION_KEEPALIVE runs, answering the moved leases as lost), run those whose
        move was aborted, keep those still moving."""
        held = self.held
        self._set_held([])
        for h in held:
            if not self.owned[h.slot] and not (h.msg is not None and h.msg[1] in RERUN_AFTER_FLIP):
                self._answer(h, self.wrong_shard(h.name, h.slot))
            elif self.moving[h.slot]:
                self._keep(h)
            elif h.msg is None or h.handler is None:  # a waiter taken out of its queue: it asks again
                self._answer(h, self.slot_moving(h.name, h.slot))
            elif not getattr(h.conn, "closed", False):
                try:
                    h.handler(h.conn, h.req_id, h.msg)
                except Exception as exc:  # noqa: BLE001 - as the dispatch answers a handler's error
                    self.server.handlers.failed(h.conn, h.req_id, h.msg[1], exc)
        self._batch_end()

    def frozen_names(self, first: int, last: int) -> dict[str, list[tuple[bytes, int]]]:
        """The frozen queues of the names in slots ``first..last``."""
        return {n: q for n, q in self.frozen_queues.items() if first <= slot_of(n) <= last}

    async def _take_from_etcd(self, stored: EtcdShardMap, refusal: type[Exception], when: str,
                              outcome: str) -> None:
        """Read the map in etcd and take it if newer (:meth:`offer`), for :meth:`read_before_bid`
        and :meth:`take_stored_map`; each refuses its step with its own error class.

        :param refusal: the error raised when there is no map to go by (``EtcdUnavailable`` for
            a bid, which waits for the next step; ``Unavailable`` for a promotion).
        :param when: the step, in the messages ("before a bid").
        :param outcome: what the refusal means, in the message of a map this node cannot take.
        :raises refusal: etcd did not answer, holds no valid map, or holds one this node cannot
            take (logged by :meth:`offer`).
        """
        try:
            found = await stored.read()
        except EtcdUnavailable as exc:
            raise refusal(f"could not read the shard map in etcd {when}: {exc}") from None
        except ShardMapError as exc:
            raise refusal(f"no valid shard map in etcd {when}: {exc}") from None
        if found is None:
            raise refusal(f"no shard map in etcd at {stored.key} {when}")
        self.offer(found[0])
        if self.shard_map.epoch < found[0].epoch:
            raise refusal(f"this node cannot take shard map epoch {found[0].epoch} from etcd (it serves epoch "
                          f"{self.shard_map.epoch}; see its log): {outcome}")

    async def read_before_bid(self) -> None:
        """Read the map in etcd and take it if newer (:meth:`offer`), before this node's bid for
        its group's primary key reads the group's epoch
        (:attr:`~fastlock.coordination.etcd.EtcdArbiter.before_bid`): the bid then judges etcd's
        epoch by the floors and the moves into its group that the map holds now (:meth:`moving_in`,
        :meth:`floors_epoch`), not by what the watch has delivered so far.  Without that map there
        is no bid: judged by an older map, an epoch a move's import raised the group to is not
        credible, and a bid below it would overwrite it (the promotion's :meth:`take_stored_map`
        reads the map again, but the bid's epoch is taken by then).

        :raises EtcdUnavailable: etcd did not answer, holds no valid map, or holds one this node
            cannot take (logged by :meth:`offer`): the bid waits for the next step.
        """
        stored = self.stored
        if stored is None:
            return
        await self._take_from_etcd(stored, EtcdUnavailable, "before a bid", "no bid judged by an older map")

    async def take_stored_map(self) -> None:
        """Read the map in etcd now and take it (:meth:`offer`): run by a promotion before the
        node serves as the primary.  A standby's watch may lag or be failing; a primary serving
        an older map would grant the names of slots a move flipped away from its group meanwhile,
        beside their new owner and with tokens that may be below the new owner's.  After this
        read, a move's later flip comes after a mark this node serves (the mark precedes the
        export, which only the primary answers).  For a node following the map in etcd
        (:meth:`follow_etcd`; a map file changes only by a restart).

        :raises Unavailable: the map is not being followed (yet), etcd did not answer or holds no
            valid map, or this node cannot take the map it holds (logged by :meth:`offer`): the
            node is not to be promoted.
        """
        stored = self.stored
        if stored is None:
            raise Unavailable("this node does not follow the shard map in etcd (yet): not serving as the primary")
        await self._take_from_etcd(stored, Unavailable, "before serving as the primary", "not serving as the primary")
        queues = {n: q for n, q in self.promoted_queues.items() if self.owned[slot_of(n)]}
        self.promoted_queues.clear()
        # restored from the log at this node's start (it starts as a standby in an etcd group), their flip come
        # while it was down: let in now, as a primary's start lets them in (let_in_restored)
        for name in [n for n in self.imported_queues if self.owned[slot_of(n)]]:
            queues.setdefault(name, self.imported_queues.pop(name))
        server = self.server
        if queues and server is not None:  # moved waiters the old primary may not have let in yet keep their order
            table = server.table
            self._keep_let_in(queues, server.reclaim.window)
            server.reclaim.arm(queues, lambda name, owner: table.holder(name, monotonic_ms(), owner) is not None,
                               asyncio.get_running_loop())
        self._let_in_again()

    async def follow_etcd(self, url: str, access: EtcdAccess | None) -> None:
        """Follow the map kept in etcd at ``url`` (:mod:`fastlock.coordination.shardmap`) until cancelled."""
        stored = await load_from_etcd(url, access)
        self.stored = stored
        try:
            await stored.follow(self.offer)
        finally:
            self.stored = None
            await stored.gateway.close()

    def imported_held(self) -> int:
        """How many of the leases this primary imported by a move (:attr:`imported_leases`) it still
        holds in slots the move has not flipped yet (their source still holds and counts them): one
        look per imported lease; those of slots flipped or aborted since are forgotten here."""
        if not self.imported_leases or self.server is None:
            return 0
        pending = _and_not(bytes(self.imported), self.owned)
        table = self.server.table
        now = monotonic_ms()
        held = 0
        for name in list(self.imported_leases):
            if not pending[slot_of(name)]:
                del self.imported_leases[name]
                continue
            held += sum(1 for token in self.imported_leases[name] if table.check(name, token, now))
        return held

    def info(self) -> dict[str, Any]:
        """This node's place in the map: ``group``, ``epoch``, ``slots`` (how many it owns),
        ``moving`` (how many of them a move is moving away), ``held`` (requests held for them),
        ``unadopted`` (how many it owns without their token floor: their names are answered
        Unavailable), ``unadopted_slots`` (those, as runs ``[first, last]``, the first
        :data:`INFO_RUNS`), ``below_floor`` (how many it owns whose token floor in the map this
        primary is still raising its epoch above: their names are answered Unavailable meanwhile) and
        ``imported_held`` (leases a move imported here, its flip still to come, :meth:`imported_held`:
        the node's ``locks_held`` leaves them out, so a sum over the groups counts each lease once)."""
        return {"group": self.group, "epoch": self.shard_map.epoch, "slots": sum(self.owned),
                "moving": sum(self.moving), "held": len(self.held), "unadopted": self.unadopted.count(1),
                "unadopted_slots": self.unadopted_runs()[:INFO_RUNS] if self.unadopted_any else [],
                "below_floor": self.owed.count(1), "imported_held": self.imported_held()}
