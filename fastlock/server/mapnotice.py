"""SHARD_MAP_NOTICE (op 103): a slot move's driver tells a primary that the shard map in etcd changed.

``fastlock shard move`` (:mod:`fastlock.cli.shardmove`) writes a move's mark and its flip to
etcd, then sends ``SHARD_MAP_NOTICE epoch`` to the source's and the destination's primaries
instead of waiting for each to see the change through its etcd watch.  The notice carries no
map: the node reads the map key from etcd itself (a read started after the notice arrived)
and takes what it read by the rule of every map it follows
(:meth:`fastlock.server.sharded.ShardGate.offer`: a higher epoch only, a change of owner only
by a move).  A notice naming an epoch etcd does not hold therefore changes nothing: the reply
names the epoch the node serves, below the one named.

Reply: ``{"epoch": E}``, the epoch this node serves: at once when it serves ``epoch`` or newer
already; else as soon as it takes a map of ``epoch`` or newer, by whichever way comes first
(its etcd watch's event or the read the notice started); else once that read is taken.

Bounds: an admin's op (the handler checks, as SLOT_EXPORT's); one read of etcd in flight per
node, and one more queued behind it that every notice arriving meanwhile shares; at most
:data:`MAX_WAITING` notices wait for a read (beyond, the reply names the epoch served at once:
the driver then looks at SHARD_MAP until the watch brings the map); each read is bounded by the
etcd gateway's timeout (2 seconds).  Errors: ``InvalidArgument`` (the node is not sharded, or
its map is a file, not kept in etcd), ``WrongArgumentType`` (``epoch`` is not an int
0..2**63-1), ``Unavailable`` (etcd did not answer, or holds no valid map).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..coordination.gateway import EtcdUnavailable
from ..errors import InvalidArgument, Unavailable, WrongArgumentType
from ..protocol.ops import OP_SHARD_MAP_NOTICE
from ..sharding import ShardMap, ShardMapError
from .lockadmin import check_lock_admin

if TYPE_CHECKING:  # pragma: no cover
    from .handlers import Handlers
    from .session import Session

__all__ = ["MapNotices", "PERMISSIONS", "MAX_WAITING"]

log = logging.getLogger(__name__)

#: the dispatch's permission entries: checked by the handler (check_lock_admin)
PERMISSIONS: dict[int, str | None] = {OP_SHARD_MAP_NOTICE: None}

#: the most notices waiting for a read of etcd at once (beyond: answered with the epoch served)
MAX_WAITING = 64


@dataclass
class Notice:
    """A notice waiting: its connection, request id, the epoch it names and whether it was answered."""

    conn: Any
    req_id: int
    epoch: int
    answered: bool = False


class MapNotices:
    """SHARD_MAP_NOTICE (see the module docstring) of ``handlers``' server."""

    def __init__(self, handlers: Handlers):
        self.handlers = handlers
        #: notices that arrived after the read in flight started: the next read answers them
        self.waiting: list[Notice] = []
        #: the notices the read in flight answers
        self.reading: list[Notice] = []
        self._task: asyncio.Task | None = None
        self._listening = False

    def handlers_by_op(self) -> dict[int, Any]:
        return {OP_SHARD_MAP_NOTICE: self.op_shard_map_notice}

    def op_shard_map_notice(self, conn: Session, req_id: int, msg: list) -> None:
        """SHARD_MAP_NOTICE epoch: read the map in etcd now (module docstring)."""
        check_lock_admin(self.handlers, conn, "shard_map_notice")
        epoch = msg[2]
        if type(epoch) is not int or not 0 <= epoch < (1 << 63):
            raise WrongArgumentType("epoch is an int 0..2**63-1: the shard map epoch written to etcd")
        gate = self.handlers.server.shard_gate
        if gate is None:
            raise InvalidArgument("this node is not sharded: it has no shard map to read")
        if gate.stored is None:
            raise InvalidArgument("this node's shard map is not followed in etcd (a map file, or not read yet): "
                                  "nothing to read")
        if gate.shard_map.epoch >= epoch or len(self.waiting) + len(self.reading) >= MAX_WAITING:
            conn.send(P.encode_ok(req_id, {"epoch": gate.shard_map.epoch}))
            return
        if not self._listening:  # a map taken by any way (the watch's event, a read) answers the notices it meets
            gate.listeners.append(self._taken)
            self._listening = True
        self.waiting.append(Notice(conn, req_id, epoch))
        if self._task is None:
            self._start()

    def _answer(self, n: Notice, epoch: int) -> None:
        n.answered = True
        if not getattr(n.conn, "closed", False):
            n.conn.send(P.encode_ok(n.req_id, {"epoch": epoch}))

    def _taken(self, shard_map: ShardMap) -> None:
        """The node serves ``shard_map`` from now on: answer the notices of its epoch or older."""
        met = [n for n in (*self.reading, *self.waiting) if not n.answered and n.epoch <= shard_map.epoch]
        for n in met:
            self._answer(n, shard_map.epoch)
        if met:
            self.waiting = [n for n in self.waiting if not n.answered]
            self.handlers.server.after_batch()

    def _start(self) -> None:
        self.reading, self.waiting = self.waiting, []
        self._task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        server = self.handlers.server
        gate = server.shard_gate
        try:
            error: Unavailable | None = None
            stored = gate.stored if gate is not None else None
            try:
                if gate is None or stored is None:
                    raise EtcdUnavailable("this node no longer follows the shard map in etcd")
                found = await stored.read()
            except (EtcdUnavailable, ShardMapError) as exc:
                error = Unavailable(f"could not read the shard map in etcd: {exc}")
            else:
                if found is not None:
                    gate.offer(found[0])
            for n in self.reading:
                if n.answered:
                    continue
                if error is not None:
                    n.answered = True
                    if not getattr(n.conn, "closed", False):
                        self.handlers.failed(n.conn, n.req_id, OP_SHARD_MAP_NOTICE, error)
                elif gate is not None:  # etcd holds no newer map than the node serves: the epoch it serves
                    self._answer(n, gate.shard_map.epoch)
            server.after_batch()
        finally:
            self.reading = []
            self._task = None
            if self.waiting:
                self._start()
