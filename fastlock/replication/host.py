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
    from ..wal import RevokeRequest, SnapshotState, WriteAheadLog
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


class RevokeHost(Protocol):
    """The server's running revoke requests as replication and failover see them
    (``fastlock.server.preemption.RevokeDeadlines``)."""

    running: dict

    def replicated(self, record: RevokeRequest, due_ms: int) -> bool:
        """Keep a replicated request without a timer, due at ``due_ms`` (this node's monotonic ms)."""
        ...

    def drop(self, name: str, token: int) -> object:
        """Forget the request to the lease (``name``, ``token``), if any."""
        ...

    def arm_all(self) -> int:
        """Run a timer for every request kept without one (a promotion)."""
        ...

    def relog(self, wal: WriteAheadLog, now: int) -> None:
        """Log every running request again (``now``: this node's monotonic ms)."""
        ...


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
    def revoke_deadlines(self) -> RevokeHost:
        """The running revoke requests (:mod:`fastlock.server.preemption`): the standby
        keeps the replicated ones, a promotion arms them, a snapshot sent re-logs them."""
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
