"""A node of a group whose primary etcd names (``fastlock serve --coordinator etcd://.../PREFIX``).

:class:`CoordinatedNode` is the :class:`~fastlock.coordination.etcd.EtcdArbiter`'s
listener on a :class:`~fastlock.server.LockServer`, and changes the node only
through its role (:mod:`fastlock.roles`) and the failover policy
(:mod:`fastlock.server.failover`):

* every node starts as a standby that follows nobody; when etcd names a
  primary (another node), the node follows it (its follower is pointed at
  the primary's address, and clients are redirected there);
* when this node takes the primary key, it is promoted at the epoch etcd
  handed out (an automatic promotion: no ``STEP_DOWN``, since the old
  primary's lease - and with it its right to grant - has run out), with the
  usual grace period for grants that may not have reached it;
* while its lease is past the self-fencing deadline the primary is fenced
  (it grants, extends and releases nothing), and unfenced when a renewal
  succeeds and the key is still its own;
* a primary that loses the key steps down at once (``deposed.json``, as a
  pair's primary does), and once etcd names another primary it rejoins as
  that primary's standby (``DEPOSED`` -> ``STANDBY``): the primary's snapshot
  replaces its table.

Any number of standbys attach to the primary (none is paired: the etcd lease
is the fence), and none promotes itself on silence: etcd decides.

One node id is one live process: at start the node takes its member key
(:meth:`EtcdArbiter.claim <fastlock.coordination.etcd.EtcdArbiter.claim>`) and refuses
to start (exit status 1) while another live node with another data directory holds it;
if it loses the key to such a node later, it stops with exit status 1.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ..auth import token_principal
from ..coordination import EtcdGateway, PrimaryRecord, parse_coordinator
from ..coordination.insync import SyncArbiter
from ..coordination.records import credible_epoch
from ..errors import DataDirInUse
from ..replication.groupsync import GroupSyncGate
from ..roles import Role
from ..units import monotonic_ms, parse_address

if TYPE_CHECKING:  # pragma: no cover
    from ..replication.node_state import NodeState
    from .lockserver import LockServer

log = logging.getLogger("fastlock.coordination")


def claim_data_dir(state: NodeState, coordinated: CoordinatedNode | None, data_dir: str) -> None:
    """Bind a data directory to the etcd group it serves (its key prefix, kept in the node
    state): refuse to start it under another prefix or without ``--coordinator``, where it
    could become a second primary of the same locks at an epoch its own group has used.

    Raises:
        DataDirInUse: the directory belongs to another group, or to a group while this node
            has no coordinator.
    """
    group = coordinated.url.prefix if coordinated is not None else None
    if state.group is not None and state.group != group:
        under = f"prefix {group!r}" if group else "no coordinator"
        raise DataDirInUse(
            f"{data_dir} belongs to the etcd-arbitrated group at prefix {state.group!r}: start it with "
            f"--coordinator etcd://.../{state.group.lstrip('/')}; under {under} it could become a second "
            f"primary of the same locks (use an empty data directory to join another group)")
    if group is not None:
        state.set_group(group)


class CoordinatedNode:
    """The bridge from the etcd arbiter to one server (see the module docstring).

    Args:
        server: the node.
        url: ``etcd://HOST:PORT[,HOST:PORT]/PREFIX``.
        node: this node's id in etcd.
        ttl_ms: the etcd lease TTL (ms, whole seconds).
        ident: the data directory's identity (its ``node-id`` file), kept in the member key.

    etcd is reached as the server's ``config.coordinator_access`` says (TLS files, etcd
    user; None: plain HTTP, no user).

    Raises:
        InvalidArgument: a malformed URL or node id; an unusable TLS or password file
            (naming the setting).
        ImportError: httpx is not installed (``pip install 'fastlock[etcd]'``).
    """

    def __init__(self, server: LockServer, url: str, node: str, ttl_ms: int, ident: str = ""):
        self.server = server
        self.url = parse_coordinator(url)
        self.node = node
        self.ttl_ms = ttl_ms
        self.ident = ident
        self._stopping: asyncio.Task | None = None
        self.arbiter: SyncArbiter | None = None
        self._lost_since: int | None = None  # since when (ms) this standby has had no primary link
        self._low_primary: PrimaryRecord | None = None  # the primary below this node's epoch last logged
        #: the primary etcd names that the follower is pointed at: its node id is the node the
        #: standby link must find at that address (etcd's word alone proves nothing)
        self.following: PrimaryRecord | None = None
        # an etcd request may take up to half the TTL: a renewal or heartbeat answered that late
        # still lands before a standby's wait (one TTL) ends, and a loaded node abandons none
        self._gateway = EtcdGateway(self.url.endpoints, timeout_s=max(0.2, ttl_ms / 2000),
                                    access=server.config.coordinator_access)
        settings = server.config.sync_settings()
        if settings is not None:  # --replication sync: replies wait for the in-sync set (groupsync)
            server.source.sync = GroupSyncGate(server, server.source, settings, server.config.sync_standbys)
        # httpx logs every request at INFO: several lines a second per node
        logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger("httpx").level))

    async def start(self, address: str) -> None:
        """Take this node id's member key, then start bidding and following; ``address`` is
        where this node listens (``host:port``).

        Raises:
            NodeIdInUse: another live node holds this node id (see the module docstring).
        """
        server = self.server
        token = server.config.standby_token
        self.arbiter = SyncArbiter(self._gateway, self.url.prefix, self.node, address, self, ttl_ms=self.ttl_ms,
                                   ident=self.ident, principal=(token_principal(token) or "") if token else "")
        if isinstance(server.source.sync, GroupSyncGate):
            server.source.sync.publisher = self.arbiter.publish
            server.source.sync.member_idents = self.arbiter.member_idents
        self.arbiter.hurry = self.lost_primary
        if server.shard_gate is not None:  # its primary raises the group's epoch above the map's token floors
            self.arbiter.known_epoch = server.shard_gate.floors_epoch
            self.arbiter.moving_in = server.shard_gate.moving_in
            self.arbiter.before_bid = server.shard_gate.read_before_bid
        await self.arbiter.claim()
        server.source.coordinate(self.arbiter.fence_if_due)
        self.arbiter.start()
        log.info("coordinator %s: node %r at %s", self.url, self.node, address)

    def position(self) -> int:
        """How far this node is in the current primary's log: a standby's applied LSN (the
        primary's numbering: comparable between the standbys of one primary), 0 for a standby
        that has not synced since it started, and the last LSN of a primary's own log."""
        server = self.server
        if server.roles.role is Role.PRIMARY:
            return int(server.wal.stats()["last_lsn"])
        follower = server.follower
        return follower.applied_lsn if follower is not None and follower.synced else 0

    def lost_primary(self) -> bool:
        """Is this node a standby not connected to a primary (none named, or its link is down),
        for at most three TTLs (a standby cut off for longer steps at the usual pace)?"""
        follower = self.server.follower
        if self.server.roles.role is not Role.STANDBY or (follower is not None and follower.connected):
            self._lost_since = None
            return False
        now = monotonic_ms()
        if self._lost_since is None:
            self._lost_since = now
        return now - self._lost_since < 3 * self.ttl_ms

    def candidate(self) -> bool:
        return self.server.roles.role is Role.STANDBY

    def min_epoch(self) -> int:
        """The highest epoch this node has seen: its table's, the highest it persisted, its
        primary's (from replication), and the epoch etcd names for the primary it follows when
        that is credible (:func:`~fastlock.coordination.records.credible_epoch` against the
        others): a standby that has not synced yet still bids above the primary it was told to
        follow.  Only the record followed now counts, never the highest ever named, so etcd
        alone cannot walk it up."""
        server = self.server
        follower = server.follower
        own = max(server.table.epoch, server.node_state.max_epoch_seen,
                  follower.primary_epoch if follower is not None else 0)
        named = self.following.epoch if self.following is not None else 0
        return max(own, named) if credible_epoch(named, own) else own

    async def close(self) -> None:
        """Stop; a primary gives its lease back so that a standby takes over at once."""
        if self.arbiter is not None:
            await self.arbiter.close(revoke=True)
        else:
            await self._gateway.close()

    def status(self) -> dict:
        if self.arbiter is None:
            return {"coordinator": str(self.url), "node": self.node, "started": False}
        return {**self.arbiter.status(), "url": str(self.url)}

    # -- the arbiter's listener -------------------------------------------------------------------
    def on_primary(self, primary: PrimaryRecord | None) -> None:
        server = self.server
        roles = server.roles
        if primary is None:
            if roles.role is Role.DEPOSED and self.arbiter is not None:
                # it lost the key and nobody holds it: a standby again, so that it may bid
                # (at a higher epoch) - the only live node of a group must not stay down
                roles.transition(Role.STANDBY, "etcd names no primary: standing for the key again")
                self.arbiter.rejoined()
            return
        if primary.node == self.node or not primary.address:
            return  # this node's previous run whose lease has not run out yet, or a key it cannot follow
        seen = self.min_epoch()
        if primary.epoch < seen and self.arbiter is not None:
            # etcd names a primary below an epoch this node has seen (etcd lost its data): following
            # it would take tokens backwards; raise the group's epoch so that it steps down
            if self._low_primary != primary:
                self._low_primary = primary
                log.critical("etcd names node %r primary at epoch %d, below epoch %d this node has seen (did "
                             "etcd lose its data?): not following it; raising the group's epoch", primary.node,
                             primary.epoch, seen)
            server.tasks.spawn(self.arbiter.raise_epoch(seen), "raise the etcd epoch")
            return
        roles.primary_address = primary.address
        follower = server.follower
        if follower is None:
            return
        if roles.role is Role.DEPOSED and self.arbiter is not None:
            # it lost the key: follow the new primary; its table is replaced by the primary's snapshot
            roles.transition(Role.STANDBY, f"etcd names node {primary.node!r} primary at epoch {primary.epoch}")
            self.arbiter.rejoined()
        if roles.role is not Role.STANDBY:
            return
        target = parse_address(primary.address, default_port=None)
        previous, self.following = self.following, primary  # the node id etcd names at the link's address
        if follower.link.primary == target and not follower.stopped:
            return
        follower.stop()
        follower.link.primary = target
        follower.refused = None
        if previous != primary:
            # its position counts in the new primary's log once it has synced there; following the
            # same primary again (its link had ended) keeps it: its applied LSN is in that log, and
            # a position of 0 would make the in-sync standby wait for the others before it bids
            follower.synced = False
        follower.start()
        log.warning("following primary %r at %s (epoch %d, named by etcd)", primary.node, primary.address,
                    primary.epoch)

    def in_sync_at(self, epoch: int) -> str | None:
        """Why this node, elected at ``epoch``, may skip the promotion grace: the in-sync set its
        bid compared names the primary it followed at ``epoch - 1`` (the epoch etcd held) and
        this node, it synced with that primary, and that primary's last ``"sync"`` push said it
        is a member (:mod:`fastlock.replication.groupsync`); None: it keeps the grace."""
        arbiter, follower, following = self.arbiter, self.server.follower, self.following
        record = arbiter.sync_at_election if arbiter is not None else None
        if record is None or follower is None or following is None or not self.ident:
            return None
        if not (record.epoch == epoch - 1 and follower.ident in record.members and record.node == following.node
                and following.epoch == record.epoch and follower.synced and follower.primary_epoch == record.epoch
                and follower.sync.in_sync):  # the primary's own word, over the authenticated link, too
            return None
        return f"in the in-sync set of primary {record.node!r} at epoch {record.epoch} (etcd {self.url.prefix}/sync)"

    def on_elected(self, epoch: int) -> None:
        server = self.server
        in_sync = self.in_sync_at(epoch)

        async def promote() -> None:
            arbiter = self.arbiter
            try:
                await server.failover.promote(f"etcd named this node primary at epoch {epoch}", automatic=True,
                                              epoch=epoch, in_sync=in_sync)
            except BaseException:
                if arbiter is not None and arbiter.holding:
                    await arbiter.resign()  # a standby again: free the key for another node (or a new bid)
                raise
            if arbiter is not None and not arbiter.holding:
                self._step_down("the etcd primary key was lost during the promotion", epoch + 1)
            elif arbiter is not None and not arbiter.may_grant():
                self.on_fenced(True)  # its lease ran past the deadline while it promoted

        server.tasks.spawn(promote(), "promotion (etcd)")

    def on_fenced(self, fenced: bool) -> None:
        server = self.server
        roles = server.roles
        if roles.role is not Role.PRIMARY or roles.fenced == fenced:
            return
        roles.set_fenced(fenced)
        if not fenced:
            server.table.expire(monotonic_ms())  # hand blocked locks to their waiters
            server.after_batch()

    def on_refused(self, why: str) -> None:
        server = self.server
        server.exit_status = 1  # as a refused start: a supervisor must not restart it into the same conflict

        async def stop() -> None:
            if server.roles.role is Role.PRIMARY:
                self._step_down(why, server.table.epoch + 1)
            await server.close()

        self._stopping = asyncio.ensure_future(stop())  # not a server task: close() cancels those

    def on_lost(self, why: str) -> None:
        arbiter = self.arbiter
        primary = arbiter.primary if arbiter is not None else None
        # the step-down epoch is persisted (max_epoch_seen): an epoch only etcd names counts only
        # when it is credible, or a rogue record would leave this node unable to be promoted again
        named = primary.epoch if primary is not None and arbiter is not None and arbiter.credible_epoch(
            primary.epoch) else 0
        epoch = max(self.server.table.epoch + 1, named)
        if self.server.roles.role is Role.PRIMARY:
            self._step_down(why, epoch)

    def _step_down(self, why: str, epoch: int) -> None:
        if self.server.roles.role is Role.PRIMARY:
            self.server.failover.step_down(f"etcd: {why}", epoch)
