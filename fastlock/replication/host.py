"""What replication and failover see of the server: the narrow host interface.

:mod:`fastlock.replication` (the primary's :class:`~fastlock.replication.ReplicationSource`,
the standby's :class:`~fastlock.replication.StandbyFollower`) and
:mod:`fastlock.server.failover` never touch :class:`~fastlock.server.LockServer`'s
private members: they see a :class:`ReplicationHost`.  ``LockServer``
implements it; tests implement it with a fake (``tests/fakehost.py``)
to drive the fence and the follower without sockets - as etcd's lessor takes
small injected interfaces instead of the server.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from .._core import LockTable
    from ..roles import NodeRole
    from ..wal import SnapshotState, WriteAheadLog
    from ..wal.keyspace import KeySpace
    from .node_state import NodeState


class ReplicaConnection(Protocol):
    """A standby's connection on the primary, as the replication source uses it.

    Attributes:
        session: the server's session id of the connection.
        peer: ``host:port`` of the standby, for logs.
        closed: set once the connection is closing; nothing more is sent.
        out_cap: bytes it may leave unsent before it is dropped (the source
            raises it by the size of a snapshot it sends).
    """

    session: int
    peer: str
    closed: bool
    out_cap: int

    def drained(self) -> asyncio.Future[None]:
        """Done once the connection's write buffer is low again (or it closed)."""
        ...

    def send(self, data: bytes) -> None:
        """Queue encoded frames for this connection."""
        ...

    def flush(self) -> None:
        """Write what is queued now."""
        ...

    def abort(self) -> None:
        """Close at once, unsent data discarded; ``closed`` is set."""
        ...


class KeyHost(Protocol):
    """The server's key store as replication sees it: its :class:`KeySpace`."""

    space: KeySpace


class ReplicationHost(Protocol):
    """The server as replication and failover see it.

    Attributes:
        table: the lock table (sans-IO; times in monotonic ms).
        wal: the write-ahead log (``stats()``, ``read_from``, ``add_listener``,
            ``log_*``, ``when_durable``).
        node_state: what the node remembers beyond its WAL (highest epoch seen,
            longest TTL, standby-of).
        roles: the node's role, fence and grace (:class:`~fastlock.roles.NodeRole`).
        data_dir: the data directory (pairing and step-down files live there).
        loop: the event loop (timers).
        max_ttl_ms: the longest TTL this node has granted, extended or
            recovered (ms): the standby's default promotion grace.
        keys: the key store (:mod:`fastlock.wal.keyspace`): snapshots carry it,
            the standby applies KEY_PUT / KEY_DELETE records to it.
    """

    table: LockTable
    wal: WriteAheadLog
    node_state: NodeState
    roles: NodeRole
    max_ttl_ms: int

    @property
    def keys(self) -> KeyHost:
        """The key store: snapshots carry it, the standby applies KEY_PUT / KEY_DELETE to it."""
        ...

    @property
    def data_dir(self) -> str:
        """The data directory (pairing and step-down files live there)."""
        ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop (timers)."""
        ...

    def snapshot_state(self) -> SnapshotState:
        """The table and the key store now, for a snapshot."""
        ...

    def after_batch(self) -> None:
        """Run the end of a batch: log and deliver the table's events, re-arm the
        expiry timer, flush replies.  Call after changing the table outside a request."""
        ...

    def close_client_connections(self, why: str, *, waiting_only: bool = False) -> None:
        """Close every connection that is not a standby's (soon, after the current
        replies are flushed): its waiters are dropped, its clients look elsewhere.
        ``waiting_only``: only connections with a queued acquire or a watch."""
        ...
