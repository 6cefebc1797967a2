"""The fastlock daemon's composition root: :class:`LockServer`.

The server only moves bytes and time around.  Lock semantics live in the
compiled :class:`fastlock._core.LockTable` (sans-IO), framing and the op
table (with each op's arity) in :mod:`fastlock.protocol`, durability in
:mod:`fastlock.wal`.  Whether this node may serve a request - its role,
fence and grace - is asked of :class:`fastlock.roles.NodeRole` (one
``admit(action)`` per handler); promotion and stepping down are
:mod:`fastlock.server.failover`'s; replication sees this server through
:class:`fastlock.replication.host.ReplicationHost`, which it implements.

The parts, each in its own module of this package: :mod:`.session` (one
connection: buffering, flow control, closing), :mod:`.handlers` (the op
handler table), :mod:`.admission` (connection limits, per-principal quotas),
:mod:`.watches`, :mod:`.tasks` (background tasks kept and their failures
surfaced), :mod:`.serve` (the process: signals, loop policy).  This module
holds start-up and recovery, the batch end, the expiry timer and ``status``.

Request flow (one turn of the event loop)::

    data_received -> FrameDecoder -> handler -> LockTable (returns status, queues events)
                  -> after_batch: drain events -> WAL records -> when_durable(deliver grants)
                                  -> re-arm the ONE expiry timer at table.next_deadline()
                                  -> acknowledge a batch the WAL thread finished (wal.poll)
                                  -> flush every connection's output buffer once

What waits for the disk (``--fsync always``): a grant is acknowledged only
after its WAL record is fsynced, together with everything else logged in the
same loop turn (group commit); with ``--replication sync`` also after the
standby's ``SYNC_ACK`` (:mod:`fastlock.replication.syncrep`).  Releases and
extensions are acknowledged at once (extensions wait in sync mode): losing one
in a crash can only leave the lock held until its TTL runs out after
recovery - never give it to two holders.

Who may do what: HELLO authenticates the connection as a principal (a token,
a mutual-TLS certificate identity, or the anonymous principal - see
:mod:`fastlock.auth`); the dispatch then checks every request against
:data:`fastlock.server.handlers.PERMISSION` before its handler runs, so a
refused request changes nothing.  Owner keys are hashed as they arrive
(:func:`fastlock.auth.hash_owner`).

Sessions: each connection is a session.  Waiting goes by connection (a waiter
whose connection drops is removed at once); ownership goes by lease (a held
lease outlives its connection until its TTL; see :mod:`fastlock.server.session`).
A grant that cannot be delivered because its connection has already closed is
released at once, so a client that died while queued never becomes a ghost holder.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import ssl
import time
from collections.abc import Callable
from typing import Any

import msgpack

from .. import protocol as P
from .._core import EV_EXPIRED, LockTable, NotHolder
from .._version import __version__
from ..auth import Credentials, is_loopback
from ..errors import FastlockError, Unavailable
from ..logsafe import quote
from ..protocol.ops import PUSH_SHARD_MAP
from ..replication import STATE_FILE, NodeState, ReplicationSource, StandbyFollower, node_id
from ..replication.queues import QueueShipper
from ..replication.witnesslink import PrimaryWitnessLease, WitnessLink
from ..roles import Action, NodeRole, Role
from ..sharding import ShardMap
from ..tls import ServerTLS, client_context
from ..units import format_address, monotonic_ms
from ..wal import DataDirInUse, HolderSlices, SnapshotState, WalFatal, WriteAheadLog, secure_directory
from ..wal.log import paused_gc
from . import lockdelays
from ._wire import BatchEnd, ExpiryWire
from .admission import ConnectionLimits, PrincipalQuotas
from .config import ServerConfig, check_limits
from .coordinated import CoordinatedNode, claim_data_dir
from .endpoints import Endpoints
from .failover import FailoverPolicy, primary_to_follow
from .handlers import Handlers, refusal
from .keyrevisions import KeyRevisions
from .keys import KeyStore
from .kinds import expired_log, grant_reply, reply_id, unacked_log, undelivered_log, waiter_left
from .preemption import RevokeDeadlines
from .reclaim import ReclaimGate
from .session import Session, shown_client
from .sharded import ShardGate
from .shares import client_principals
from .tasks import BackgroundTasks
from .watchlog import ReplayPager, Revisions

log = logging.getLogger(__name__)

_pack = msgpack.Packer(use_bin_type=True).pack  # what LockTable.snapshot_step does not encode itself

#: exit status after a write-ahead log failure (so a supervisor restarts the server)
EXIT_WAL_FAILED = 3
#: seconds a step-down's closing of client connections waits at most for the replies of
#: records logged before it (their refusals) when the log is slow
CLOSE_AFTER_LOG_S = 1.0

#: a waiter's end that is not a grant -> the error code and reason its acquire is answered with
class ExpiryTimer(ExpiryWire):
    """The ONE timer of the lock table: it fires at the table's next deadline
    (monotonic ms), and calls ``on_fire`` from the event loop (``handle`` and ``at_ms`` are
    slots of its compiled base, :class:`~fastlock.server._wire.ExpiryWire`)."""

    __slots__ = ("_on_fire",)

    def __init__(self, on_fire: Callable[[], None]):
        self.handle: asyncio.TimerHandle | None = None
        self.at_ms = -1
        self._on_fire = on_fire

    def arm(self, loop: asyncio.AbstractEventLoop, at_ms: int, now_ms: int) -> None:
        self.cancel()
        self.handle = loop.call_later(max(0, at_ms - now_ms) / 1000.0, self._fire)
        self.at_ms = at_ms

    def _fire(self) -> None:
        self.handle = None
        self._on_fire()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class LockServer(BatchEnd):
    """The daemon.  ``await server.start()`` then ``await server.wait_closed()``.

    :raises ValueError: a nonsensical limit in ``config`` (see :func:`check_limits`).
    """

    def __init__(self, config: ServerConfig):
        self.config = config
        check_limits(config)
        secure_directory(config.data_dir)  # before anything writes to it
        self.table = LockTable()
        self.wal = WriteAheadLog(
            config.data_dir,
            fsync=config.fsync.value,
            fsync_interval_ms=config.fsync_interval_ms,
            snapshot_every=config.snapshot_every,
            snapshot_every_bytes=config.snapshot_every_bytes,
            on_fatal=self._wal_fatal,
            writer=config.wal_writer.value,
        )
        self.commit = self.wal.group_commit  # (read by the compiled batch end, BatchEnd)
        self.snapshots = self.wal.snapshotter
        self.node_state = NodeState(config.data_dir)
        standby_of = primary_to_follow(config, self.node_state)  # --standby-of, or the one it followed
        primary_address = f"{standby_of[0]}:{standby_of[1]}" if standby_of else None
        #: the node's role, fence and grace: every "may this node ... now?" is asked here
        self.roles = NodeRole(Role.STANDBY if standby_of or config.coordinator else Role.PRIMARY,
                              hold_grants_until=self.table.hold_grants_until, now_ms=monotonic_ms,
                              primary_address=primary_address, on_admitted=self._admitted_changed)
        credentials = config.credentials if config.credentials is not None else Credentials.open_mode()
        if config.auth_secret is not None:
            credentials = credentials.with_shared_secret(config.auth_secret)
        #: the longest TTL this node has granted, extended or recovered (ms): a
        #: standby's default promotion grace (sent in heartbeats)
        self.max_ttl_ms = 0
        self.endpoints = Endpoints(config)
        self.tasks = BackgroundTasks()
        # source.sync: synchronous replication, grant and extend replies wait for the standby (async: a no-op)
        self.source = ReplicationSource(self, fence_margin_ms=config.fence_margin_ms, sync=config.sync_settings())
        self.follower: StandbyFollower | None = None
        if standby_of or config.coordinator or config.standby_token is not None or config.tls_cert:
            ident = node_id(config.data_dir)
            # nobody until etcd names a primary (CoordinatedNode.on_primary), or it rejoins one (FailoverPolicy)
            self.follower = StandbyFollower(self, standby_of or ("127.0.0.1", 0), config.failover_after_ms,
                                            token=config.standby_token,
                                            name=f"{config.name}@{ident}" if config.name else ident,
                                            on_primary_silent=lambda: self.failover.on_primary_silent(),
                                            tls=self._standby_tls_context(),
                                            stream_limits=P.stream_limits(config.max_stream_frame_bytes,
                                                                          config.max_leases))
        self.failover = FailoverPolicy(self, self.source, self.follower,
                                       promotion_grace_ms=config.promotion_grace_ms, tasks=self.tasks)
        #: the pair's witness (``--witness``): the primary renews its lease, a promotion takes one
        self.witness: PrimaryWitnessLease | None = None
        if config.witness is not None and config.standby_token is not None:
            link = WitnessLink(config.witness, config.standby_token, node_id(config.data_dir),
                               tls=self._standby_tls_context())
            self.failover.witness = link
            self.source.witness_address = link.where
            if self.follower is not None:
                self.follower.link.witness = link.where
            self.witness = PrimaryWitnessLease(self, self.source, link, config.failover_after_ms)
        if config.coordinator:  # etcd decides who is primary; otherwise the pair does
            ident = node_id(config.data_dir)
            self.failover.coordinated = CoordinatedNode(self, config.coordinator, config.node_id or ident,
                                                        config.coordinator_ttl_ms, ident)
        self.limits = ConnectionLimits(config, self)
        # with one client principal at most (open mode, say) the default shares stay off
        self.quotas = PrincipalQuotas(config, self, single_principal=client_principals(credentials) <= 1)
        #: the shard map this node serves by and its group (fastlock.server.sharded); None: not sharded
        self.shard_gate = ShardGate.from_config(config.shard_map, config.shard_group)
        self.handlers = Handlers(self, credentials)
        if self.shard_gate is not None:
            self.shard_gate.install(self.handlers)
            self.shard_gate.on_change = self._announce_shard_map
            self.failover.after_promotion = self.shard_gate.promoted
            self.failover.known_epoch = self.shard_gate.floors_epoch
            if config.shard_map_etcd is not None:  # a promoted node serves the map etcd holds, not its watch's
                self.failover.before_serving = self.shard_gate.take_stored_map
        #: watch revisions: the history resuming watches replay, progress notices (fastlock.server.watchlog)
        self.revisions = Revisions(self, self.handlers.watches, config.watch_history, config.watch_progress_interval)
        #: the replays of resuming watches, a page per connection per loop turn (fastlock.server.watchlog)
        self.replays = ReplayPager(self)
        if self.follower is not None:
            self.follower.revisions = self.revisions
        #: key revisions: the history resuming prefix watches replay (fastlock.server.keyrevisions)
        self.key_revisions = KeyRevisions(self, config.watch_history, config.max_key_bytes,
                                          config.watch_progress_interval)
        if self.follower is not None:
            self.follower.key_revisions = self.key_revisions
        #: waiter queues: shipped to the standby, and kept in place by a promotion's reclaim window
        self.queues = QueueShipper(self)
        self.reclaim = ReclaimGate(self.handlers.enter_acquire, self.after_batch, config.queue_reclaim_window,
                                   config.max_waiters)
        if self.shard_gate is not None:  # a parked acquire enters behind the shard map's check
            self.reclaim.enter = self.shard_gate.checked_enter(self.reclaim.enter)
        if self.follower is not None:
            self.follower.queues.on_promoted = self._reclaim_queues
        #: process exit status: non-zero after a fatal WAL failure
        self.exit_status = 0
        #: sessions written to in this loop turn (flushed once at the batch end)
        self.dirty: list[Session] = []
        #: after_batch is processing its events, or the WAL runs the callbacks of a written batch
        #: (a grant delivered then leaves the flush to the batch end that follows) ...
        self.in_batch_end = False
        #: ... and one did (GroupCommit.batch_end runs after_batch after the callbacks then)
        self.batch_end_owed = False
        self.expiry = ExpiryTimer(self._on_timer)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = asyncio.Event()
        self._started_ms = monotonic_ms()

    def _reclaim_queues(self, queues: dict[str, list[bytes]]) -> None:
        """Promoted: the old primary's waiters keep their places for the reclaim window (those of
        slots a move is moving away, for the move: :meth:`ShardGate.promoted_mirror`)."""
        if self.shard_gate is not None:
            queues = self.shard_gate.promoted_mirror(queues)
        table = self.table
        self.reclaim.arm(queues, lambda name, owner: table.holder(name, monotonic_ms(), owner) is not None,
                         self.loop)

    # -- what replication and failover see (fastlock.replication.host.ReplicationHost) -----------
    @property
    def keys(self) -> KeyStore:
        """The key store (values attached to leases)."""
        return self.handlers.keys

    @property
    def revoke_deadlines(self) -> RevokeDeadlines:
        """The running revoke requests (:mod:`fastlock.server.preemption`)."""
        return self.handlers.preemption.deadlines

    @property
    def role(self) -> str:
        """The node's role as a string ("primary", "standby", "promoting", "deposed")."""
        return self.roles.role.value

    @property
    def data_dir(self) -> str:
        return self.config.data_dir

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the server runs on.  :raises RuntimeError: not started."""
        if self._loop is None:
            raise RuntimeError("the server is not started")
        return self._loop

    @property
    def credentials(self) -> Credentials:
        """Who may connect (see :mod:`fastlock.auth`)."""
        return self.handlers.credentials

    @property
    def tls(self) -> ServerTLS | None:
        """The client port's TLS (None: plain TCP)."""
        return self.endpoints.tls

    @property
    def address(self) -> tuple[str, int] | None:
        """``(host, port)`` the client port is bound to, once started."""
        return self.endpoints.address

    @property
    def sessions(self) -> dict[int, Session]:
        """Open sessions by id (see :class:`~fastlock.server.admission.ConnectionLimits`)."""
        return self.limits.sessions

    def close_client_connections(self, why: str, *, waiting_only: bool = False) -> None:
        """Close every connection but the standbys' (``waiting_only``: those with a
        queued acquire or a watch), once this turn's replies are out and every reply that
        waits for a record logged before now has been sent (a refusal, on a node no longer
        primary), or CLOSE_AFTER_LOG_S seconds from now if the log is slower (or stopped)."""
        closed = False

        def close() -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            replicas = self.source.replicas
            table = self.table
            clients = [c for c in self.limits.sessions.values() if c.session not in replicas and not c.closed
                       and (not waiting_only or c.watching or table.session_waiters(c.session))]
            if clients:
                log.warning("closing %d client connections: %s", len(clients), why)
            for conn in clients:
                conn.close_after_flush()

        try:
            self.wal.when_durable(close)  # after the callbacks of the records logged so far
        except WalFatal:
            pass
        self.loop.call_later(CLOSE_AFTER_LOG_S, close)

    def _announce_shard_map(self, shard_map: ShardMap) -> None:
        """Push ``shard_map``'s epoch to every client connection (PUSH_SHARD_MAP, one small
        frame each, under each connection's output cap): routing clients read the map again."""
        frame = P.encode_push(PUSH_SHARD_MAP, [shard_map.epoch])
        replicas = self.source.replicas
        for conn in list(self.limits.sessions.values()):
            if conn.session not in replicas and not conn.closed:
                conn.send(frame)
        self.after_batch()

    # -- life cycle -----------------------------------------------------------------
    async def start(self) -> None:
        """Recover the table from the WAL, then listen.

        Raises:
            PermissionError: open mode on a non-loopback address without ``allow_unauthenticated``.
            DataDirInUse: a standby's data directory started as a primary, or in use.
            WalCorruption, OSError: see :mod:`fastlock.wal`.
        """
        loop = self._loop = asyncio.get_running_loop()
        config = self.config
        if self.credentials.open and not is_loopback(config.host) and not config.allow_unauthenticated:
            # as Redis's protected mode: no credentials, so listen on loopback only
            raise PermissionError(
                f"refusing to listen on {config.host} without credentials: anyone who can reach it could "
                f"take every lock. Give --credentials FILE (see `fastlock credentials init`), listen on "
                f"127.0.0.1, or pass --allow-unauthenticated")
        self.limits.size_to_open_files()
        if self.roles.role is Role.PRIMARY and self.node_state.standby_of:
            raise DataDirInUse(
                f"{config.data_dir} belongs to a standby of {self.node_state.standby_of}: start it with "
                f"--standby-of, or promote it with `fastlock promote`; starting it as a primary would make "
                f"a second primary at the old epoch (delete {STATE_FILE} only if you know the old primary "
                f"is gone for good)")
        claim_data_dir(self.node_state, self.failover.coordinated, config.data_dir)
        if self.shard_gate is not None:  # the slots it owned before a restart stay its own
            self.shard_gate.remember(config.data_dir, defer_gains=config.coordinator is not None
                                     and config.shard_map_etcd is not None)
        self._recover()
        # the grants a written batch acknowledges are delivered as one batch (one after_batch)
        self.wal.group_commit.batch_end = self
        self.wal.start(loop)
        if self.wal.repaired:
            # The cut may have removed acknowledged grants, so the counter may be below
            # tokens already handed out: a new epoch puts every future token above them.
            table = self.table
            epoch = max(table.epoch, self.node_state.max_epoch_seen) + 1
            table.set_epoch(epoch)
            self.wal.log_epoch(epoch)
            self.node_state.raise_epoch(epoch)
            log.critical("the WAL was repaired (records cut): starting epoch %d so that no fencing token "
                         "is issued twice; leases in the cut records are forgotten", epoch)
        if config.metrics is not None:  # before "listening on": a bad address fails the start
            from ..metrics import MetricsExporter

            self.endpoints.metrics = MetricsExporter(self, *config.metrics)
        self.failover.on_start()  # a deposed primary stays deposed; a paired one may start fenced
        if self.shard_gate is not None:  # moved waiters imported before a restart, their flip come meanwhile
            self.shard_gate.let_in_restored()
        if self.shard_gate is not None and config.shard_map_etcd is not None:
            self.tasks.spawn(self.shard_gate.follow_etcd(config.shard_map_etcd, config.coordinator_access),
                             "following the shard map in etcd")
        if self.roles.role is Role.PRIMARY:
            self.revisions.started()
            self.key_revisions.started()
        self.revisions.start_progress(loop)
        self.key_revisions.start_progress(loop)
        self._rearm()
        host, port = await self.endpoints.listen(config.host, config.port, self._make_session)
        self.failover.listening(config.advertise or format_address((host, port)))
        log.info(
            "listening on %s:%d (fastlock %s, %s, fsync=%s, data dir %s, %s)",
            host, port, __version__, self.role, config.fsync.value, os.path.abspath(config.data_dir),
            "plain TCP" if self.tls is None else f"TLS, client certificates {config.tls_client_auth}",
        )
        creds = self.credentials
        if creds.open:
            log.warning("open mode (no --credentials): every connection is the anonymous client: it may take "
                        "any lock name and list or revoke anyone's lease (fastlock locks, lock, revoke); "
                        "replication, promote and serve-alone are refused (they need credentials)")
        else:
            log.info("credentials: %d principals from %s%s%s", len(creds.principals), creds.source,
                     ", shared secret accepted" if creds.shared_secret is not None else "",
                     ", anonymous clients allowed" if creds.anonymous is not None else "")
            signing = creds.sequencer_keys.signing
            if signing is not None:  # the public key id only; the secret never reaches a log
                log.info("sequencers: signed with %s key %s (%d key(s) in the file)", signing.algorithm,
                         signing.key_id.hex(), len(creds.sequencer_keys.keys))
        if self.failover.coordinated is not None:
            try:
                await self.failover.coordinated.start(config.advertise or format_address((host, port)))
            except BaseException:
                await self.close()
                raise
        elif self.follower is not None and self.roles.role is Role.STANDBY:
            self.follower.start()
        if self.witness is not None:
            self.witness.start()
        self.limits.start()

    def _recover(self) -> None:
        """Open the WAL and install every recovered lease with a fresh full TTL
        (this node cannot know how long it was down)."""
        t0 = time.perf_counter()
        table = self.table
        with paused_gc():  # a million objects that all survive: no collection rescans them as they come
            state = self.wal.open(repair=self.config.repair_wal)
            table.set_epoch(state.epoch)
            table.advance_counter(state.counter)
            now = monotonic_ms()
            self.max_ttl_ms = max(self.node_state.max_ttl_ms, table.install_holders(state.holders, now))
            gc.freeze()  # nor later: the recovered objects are out of the collector's view
        delays = lockdelays.install_recovered(table, state.lock_delays, now)
        revokes = self.revoke_deadlines.recovered(state.revoke_requests, now, armed=self.roles.expires_leases)
        table.drain_events()
        self.keys.recovered(state.keys)
        if self.shard_gate is not None:  # slots imported by a move and not taken yet (snapshot and log)
            self.shard_gate.restore_imports(state.imports)
        if not self.roles.expires_leases:
            # a standby runs its table on frozen time: only a primary expires leases
            for held in table.holders():
                table.install_holder(held.name, held.token, held.owner, held.ttl_ms, held.lock_delay_ms, held.meta, 0,
                                     held.shared, held.limit)
        log.info("recovered %d leases, epoch %d, counter %d (%d records replayed, %d torn bytes cut) in %.1f ms; "
                 "%d running lock-delays, %d revoke requests", len(state.holders), state.epoch, table.counter,
                 state.records_replayed, state.torn_bytes, (time.perf_counter() - t0) * 1000, delays, revokes)

    async def close(self) -> None:
        """Stop accepting, close every connection, flush and close the WAL."""
        if self._closed.is_set():
            return
        log.info("shutting down: %d sessions, %d locks held", len(self.limits.sessions), len(self.table))
        self.endpoints.close()
        self.source.close()
        self.failover.close()
        if self.witness is not None:
            self.witness.close()
        if self.failover.coordinated is not None:
            await self.failover.coordinated.close()
        if self.follower is not None:
            self.follower.stop()
        for conn in list(self.limits.sessions.values()):
            conn.close_after_flush()
        self.expiry.cancel()
        self.revisions.stop()
        self.key_revisions.stop()
        self.reclaim.stop()
        self.handlers.kinds.deadlocks.cancel()
        self.limits.close()
        self.tasks.cancel_all()
        await self.wal.close()
        self._closed.set()
        log.info("stopped")

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def _standby_tls_context(self) -> ssl.SSLContext | None:
        """A standby's context for its connection to the primary: the node's own
        certificate as the client certificate, the CA (or the system's trust
        store) to verify the primary.  None without TLS."""
        c = self.config
        return client_context(c.tls_ca, c.tls_cert, c.tls_key) if c.tls_cert else None

    def reload_tls(self) -> bool:
        """Reload the TLS certificate, key and CA files (on SIGHUP): new
        connections use them, established ones keep theirs.  On an error the
        old ones stay in use (logged).  Returns True if everything reloaded."""
        if self.tls is None:
            log.info("nothing to reload: TLS is off")
            return False
        ok = self.tls.reload()
        if ok and self.follower is not None:
            try:
                self.follower.tls = self._standby_tls_context()
            except OSError as exc:
                log.error("TLS reload failed for the connection to the primary: %s", exc)
                ok = False
        return ok

    def _wal_fatal(self, exc: BaseException) -> None:
        # As PostgreSQL after a failed fsync: we cannot know what reached the
        # disk, so we must not acknowledge anything more.  Stop serving: every
        # connection hears why (an error with request id 0, so a waiting client
        # sees an error, not a bare EOF), and the process exits non-zero so that
        # a supervisor (systemd Restart=on-failure) restarts it; recovery then
        # restores every acknowledged grant from the log.
        log.critical("write-ahead log failed (%s); stopping without acknowledging further grants", exc)
        self.exit_status = EXIT_WAL_FAILED
        notice = P.encode_error(0, Unavailable.code, f"the server stopped: its write-ahead log failed ({exc}); "
                                                     f"nothing pending was granted")
        for conn in list(self.limits.sessions.values()):
            conn.out.clear()
            conn.send(notice)
            conn.flush()
            conn.close()
        self.dirty.clear()
        self.endpoints.stop_listening()
        self._closed.set()

    def _make_session(self) -> Session:
        return self.limits.new_session()

    def connection_lost(self, conn: Session) -> None:
        """``conn`` closed: uncount it, drop its waiters and watches (its leases stay until their TTL)."""
        source = self.source
        if not self.limits.forget(conn) and conn.session not in source.replicas:
            return  # refused, or closed before HELLO: it holds nothing
        source.fence_if_due(monotonic_ms())
        if conn.session in source.replicas:
            source.detach(conn)
        self.keys.forget(conn)
        if conn.watching:
            watches = self.handlers.watches
            for name in conn.watching:
                watches.remove(conn, name)
            watches.revisioned.discard(conn.session)
            self.quotas.count_watches(conn, -len(conn.watching))
        dropped = self.table.drop_session(conn.session, self._table_now())
        self.handlers.wound_wait.session_closed(conn.session)
        self.handlers.edge_chase.session_closed(conn.session)
        self.quotas.waiters_dropped(conn.principal, dropped)
        if dropped:
            self.queues.sessions_dropped()
            log.debug("session %d closed; %d waiters removed", conn.session, dropped)
        self.after_batch()

    # -- the batch end: events, WAL, timer, output ------------------------------------
    # after_batch() (the batch end), deliver_granted() (a batch of grants acknowledged) and
    # released() (a release's bookkeeping) are compiled, on BatchEnd (server/_wire.pyx)

    def _other_event(self, ev: Any) -> None:
        """A table event other than a grant (the grants are ``BatchEnd.process_events``'s, compiled):
        a lease expired (logged, watchers told, its keys, session and quota count released, its
        lock-delay counted), or a waiter left its queue (wait timeout, cancel, deadlock: its acquire fails)."""
        if ev.kind == EV_EXPIRED:
            wal = self.wal
            wal.log_expire(ev.name, ev.token)
            self.revisions.logged(ev.name, "expired", ev.token, ev.meta)
            self.keys.lease_ended(ev.name, ev.token, "expired")
            self.handlers.sessions.lease_ended(ev.name, ev.token)
            if ev.lock_delay_ms:
                lockdelays.log_expired(wal, ev)
            self.quotas.lease_expired(ev, monotonic_ms())  # its lock-delay counts as its lease until it ends
            expired_log("lease expired: %s token %d (holder %s)", quote(ev.name), ev.token,
                        quote(shown_client(ev.meta[0]) if ev.meta else None))
        else:  # a waiter left (wait timeout, cancel, deadlock): its acquire fails
            waiter_left(self.limits.sessions.get(ev.session), ev, self.quotas)
            self.queues.touched(ev.name)

    def _deliver_rest(self, grants: list, refused_by: FastlockError | None) -> None:
        """The grants :meth:`deliver_granted` leaves: each one whose connection is gone is released
        (nobody can learn its token); when this node may no longer grant (``refused_by``, or its
        role now) each request is answered with the refusal; any other (a sequencer's, an
        ACQUIRE_MANY's) gets its reply."""
        sessions = self.limits.sessions
        table = self.table
        undelivered = False
        refused = refused_by or (None if self.roles.may(Action.ACQUIRE) else refusal(self.roles, Action.ACQUIRE))
        for ev in grants:
            conn = sessions.get(ev.session)
            if conn is None or conn.closed:
                # Nobody can learn this token any more: release it now rather
                # than leave a ghost holder until its TTL runs out.
                self.source.fence_if_due(monotonic_ms())
                try:
                    table.release(ev.name, ev.token, ev.owner, monotonic_ms())
                except NotHolder:
                    continue
                self.released(ev.name, ev.token, ev.meta)
                undelivered = True
                undelivered_log("released undeliverable grant %s token %d (session %d gone)", quote(ev.name),
                                ev.token, ev.session)
                continue
            if refused is not None:
                rid = reply_id(ev.request)
                if rid is not None:
                    conn.send(P.encode_error(rid, refused.code, f"{ev.name!r}: {refused}",
                                             getattr(refused, "primary", None)))
                unacked_log("grant %s token %d decided but not acknowledged: %s", quote(ev.name), ev.token, refused)
                continue
            reply = grant_reply(ev)
            if reply is not None:
                conn.send(reply)
        if undelivered:
            table.expire(monotonic_ms())

    # -- the expiry timer -------------------------------------------------------------------
    def _table_now(self) -> int:
        """The time to give the lock table: a standby's table runs on frozen time
        (0) so that it never expires a lease itself; only a primary expires."""
        return monotonic_ms() if self.roles.expires_leases else 0

    def _admitted_changed(self, admitted: frozenset) -> None:
        """The roles' ``on_admitted``: the actions admitted now, kept as the slot the compiled
        request path tests (``BatchEnd.admitted``)."""
        self.admitted = admitted

    def _rearm(self) -> None:
        nd = self.table.next_deadline()
        self.expiry.cancel()
        if nd < 0 or not self.roles.expires_leases:
            return
        self.expiry.arm(self.loop, nd, monotonic_ms())

    def _on_timer(self) -> None:
        if not self.roles.expires_leases:
            return
        now = monotonic_ms()
        self.source.fence_if_due(now)  # an expiry hands the lock to a waiter: not past the fence
        self.table.expire(now)
        self.after_batch()
        if self.expiry.handle is None:
            self._rearm()

    def snapshot_state(self) -> SnapshotState:
        """The table and the key store now, for a snapshot.

        The holders are encoded by the table itself (:class:`~fastlock.wal.HolderSlices`, a
        slice per loop turn, as the table was when begun): this runs on the event loop, and a
        Python object per holder would make it, and the cyclic garbage collections those
        objects trigger, cost seconds with a million leases."""
        keys, t = self.keys.space.to_list(), self.table
        imports = self.shard_gate.pending_imports() if self.shard_gate is not None else None
        # the slices are begun last: nothing can fail after them
        return SnapshotState(t.epoch, t.counter, HolderSlices(t, _pack), keys, imports)

    # -- status -----------------------------------------------------------------------------
    def status(self) -> dict:
        """The node's status (``fastlock status``): the table's counters, role, epoch,
        WAL, limits, TLS, replication (with ``node_name``, the ``--name``, and ``node_id``),
        and ``tasks`` (background tasks: running,
        failed, last_error - a failed automatic promotion shows there)."""
        t = self.table
        now = monotonic_ms()
        st: dict[str, Any] = dict(t.stats())
        st.update(
            role=self.roles.role.value,
            epoch=t.epoch,
            last_token=t.last_token,
            counter=t.counter,
            sessions=len(self.limits.sessions),
            uptime_ms=now - self._started_ms,
            fsync=self.config.fsync.value,
            wal=self.wal.stats(),
            version=__version__,
            grace_remaining_ms=self.roles.grace_remaining_ms(now),
            tasks=self.tasks.status(),
        )
        st["client_sessions"] = self.handlers.sessions.status()
        st["limits"] = {**self.limits.status(), "watches": self.quotas.watch_count, **self.quotas.output.status()}
        if self.tls is not None:
            st["tls"] = self.tls.status()
        if self.shard_gate is not None:  # its group in the shard map (fastlock.server.sharded)
            st["shard"] = self.shard_gate.info()
            # a move's imported copies are the source's leases until the flip: counted there, not here
            st["locks_held"] = st.get("locks_held", 0) - st["shard"]["imported_held"]
        if self.roles.role is Role.STANDBY and self.follower is not None:
            st["replication"] = self.follower.status()
        else:
            st["replication"] = self.source.status()
        st["replication"].setdefault("sync", self.source.sync.status())  # a standby's: its follower's view
        # who this node is (as `fastlock status --all` names it): its --name, and its data directory's node id
        st["replication"].update(node_name=self.config.name, node_id=self.handlers.hello.node)
        if self.failover.coordinated is not None:
            st["coordinator"] = self.failover.coordinated.status()
        st["watch_history"] = self.revisions.status()  # docs/watches.md
        st["key_watch_history"] = self.key_revisions.status()
        st["queue_reclaim"] = self.reclaim.status()
        if self.failover.witness is not None:
            st["replication"]["witness"] = self.failover.witness.status()
        return st
