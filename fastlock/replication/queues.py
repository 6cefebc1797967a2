"""Waiter queues that survive a failover: the primary ships them, the standby mirrors them.

A waiter is a connection's queued acquire, kept in the primary's memory only (it
is not in the write-ahead log: a waiter that loses its connection is gone anyway).
So that a failover does not reorder the waiters that ride through it, the primary
sends its standby each lock's queue - the owner-key hashes of its first
:data:`MAX_SHIPPED` waiters in FIFO order - whenever it changes
(:class:`QueueShipper`, a ``PUSH_QUEUES`` push at the end of the batch that changed
it; the whole map to a standby that attaches).  The standby keeps the last state
(:class:`QueueMirror`); a promotion hands it to the new primary's reclaim gate
(:mod:`fastlock.server.reclaim`), which lets the riding-through waiters queue again
in their old order.  A lock whose slot a move froze has its waiters out of the lock
table, in the :class:`~fastlock.server.sharded.ShardGate`'s frozen queues: that queue is
shipped instead, and a standby promoted before the move's ship takes it back as the
slot's frozen queue (the export ships it in the old primary's order).

The pushes are not logged or fsynced: a waiter's place is worth keeping only while
its client is alive and rides through, and a restart of either node drops every
connection.  They carry owner-key hashes only, as the log does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ProtocolError
from ..protocol.framing import encode_push
from ..protocol.ops import PUSH_QUEUES
from ._wire import QueuesWire

__all__ = ["MAX_SHIPPED", "MAX_QUEUES", "QueueShipper", "QueueMirror"]

#: waiters per lock whose place is shipped (later ones queue again at the tail after a failover)
MAX_SHIPPED = 1024
#: locks with waiters a standby mirrors at most (a bigger map is refused, the link resyncs)
MAX_QUEUES = 1_000_000


class QueueShipper(QueuesWire):
    """The primary's side: which queues changed in this batch, and the state shipped.

    ``host`` is the server (its ``table``, its ``source.replicas``); ``dirty``, ``shipped`` and
    ``informed`` are slots of its compiled base (:class:`~fastlock.replication._wire.QueuesWire`)."""

    def __init__(self, host: Any) -> None:
        self.host = host
        #: lock names whose queue may have changed since the last shipment
        self.dirty: set[str] = set()
        #: lock name -> the owner hashes last shipped (non-empty lists only)
        self.shipped: dict[str, list[bytes]] = {}
        #: the replica sessions already sent the whole map
        self.informed: set[int] = set()

    def touched(self, name: str) -> None:
        """``name``'s queue may have changed (a waiter queued, left or was granted)."""
        self.dirty.add(name)

    def granted(self, name: str) -> None:
        """A grant of ``name``: its queue changed if it had waiters shipped."""
        if name in self.shipped:
            self.dirty.add(name)

    def sessions_dropped(self) -> None:
        """A connection closed with waiters: any shipped queue may have lost one."""
        self.dirty.update(self.shipped)

    def batch_end(self) -> None:
        """Ship the queues that changed (to every standby), and the whole map to a new one."""
        replicas = self.host.source.replicas
        if not replicas:  # nobody to ship to: the queues are read when a standby attaches
            self.informed.clear()
            if len(self.dirty) > MAX_QUEUES:  # a bound on the names remembered meanwhile
                self.dirty.clear()
            return
        if not self.dirty and replicas.keys() <= self.informed:
            return
        table = self.host.table
        gate = getattr(self.host, "shard_gate", None)
        frozen = gate.frozen_queues if gate is not None else {}
        changes = []
        for name in self.dirty:
            taken = frozen.get(name)
            owners = ([o for o, _priority in taken[:MAX_SHIPPED]] if taken is not None
                      else table.waiters(name)[:MAX_SHIPPED])
            if owners != self.shipped.get(name, []):
                if owners:
                    self.shipped[name] = owners
                else:
                    self.shipped.pop(name, None)
                changes.append([name, owners])
        self.dirty.clear()
        update = encode_push(PUSH_QUEUES, [False, changes]) if changes else None
        whole = None
        for session, replica in replicas.items():
            conn = replica.conn
            if conn.closed:
                continue
            if session not in self.informed:
                if whole is None:
                    whole = encode_push(PUSH_QUEUES, [True, [[n, o] for n, o in self.shipped.items()]])
                conn.send(whole)
            elif update is not None:
                conn.send(update)
            else:
                continue
            conn.flush()
        self.informed = set(replicas)


class QueueMirror:
    """The standby's side: the primary's queues as last shipped (lock name -> owner hashes).

    ``on_promoted`` (set by the server) receives them when this node is promoted."""

    def __init__(self) -> None:
        self.queues: dict[str, list[bytes]] = {}
        self.on_promoted: Callable[[dict[str, list[bytes]]], Any] | None = None

    def apply(self, payload: Any) -> None:
        """Apply a ``PUSH_QUEUES`` payload ``[whole, [[name, [owner hash, ...]], ...]]``.

        :raises ProtocolError: a malformed payload (nothing is applied).
        """
        if (type(payload) is not list or len(payload) != 2 or type(payload[0]) is not bool
                or type(payload[1]) is not list):
            raise ProtocolError("a queues push is [whole, [[name, [owner hash, ...]], ...]]")
        whole, changes = payload
        for change in changes:
            if (type(change) is not list or len(change) != 2 or type(change[0]) is not str
                    or type(change[1]) is not list or len(change[1]) > MAX_SHIPPED
                    or not all(type(o) is bytes for o in change[1])):
                raise ProtocolError("a queues push names a lock and at most "
                                    f"{MAX_SHIPPED} owner hashes (bytes)")
        if whole:
            self.queues.clear()
        queues = self.queues
        for name, owners in changes:
            if owners:
                queues[name] = owners
            else:
                queues.pop(name, None)
        if len(queues) > MAX_QUEUES:
            queues.clear()
            raise ProtocolError(f"the primary's queues name more than {MAX_QUEUES} locks")

    def promoted(self) -> None:
        """This node was promoted: hand the queues to ``on_promoted`` and forget them."""
        queues, self.queues = self.queues, {}
        if self.on_promoted is not None and queues:
            self.on_promoted(queues)
