"""The fastlock daemon: connections, sessions, one expiry timer, group-committed grants.

This module only moves bytes and time around.  Lock semantics live in the
compiled :class:`fastlock._core.LockTable` (sans-IO), framing and the op
table (with each op's arity) in :mod:`fastlock.protocol`, durability in
:mod:`fastlock.wal`.  Whether this node may serve a request - its role,
fence and grace - is asked of :class:`fastlock.roles.NodeRole` (one
``admit(action)`` per handler); promotion and stepping down are
:mod:`fastlock.failover`'s; replication sees this server through
:class:`fastlock.replication_host.ReplicationHost`, which it implements.

Request flow (one turn of the event loop)::

    data_received -> FrameDecoder -> handler -> LockTable (returns status, queues events)
                  -> _after_batch: drain events -> WAL records -> when_durable(deliver grants)
                                   -> re-arm the ONE expiry timer at table.next_deadline()
                                   -> flush every connection's output buffer once

What waits for the disk (``--fsync always``): a grant is acknowledged only
after its WAL record is fsynced, together with everything else logged in the
same loop turn (group commit).  Releases and extensions are acknowledged at
once: losing one in a crash can only leave the lock held until its TTL runs out
after recovery - never give it to two holders.

Who may do what: HELLO authenticates the connection as a principal (a token,
a mutual-TLS certificate identity, or the anonymous principal - see
:mod:`fastlock.auth`); ``_handle`` then checks every request against
``_PERMISSION`` before its handler runs, so a refused request changes nothing.
Owner keys are hashed as they arrive (:func:`fastlock.auth.hash_owner`).

Sessions: each connection is a session.  Waiting goes by connection (a waiter
whose connection drops is removed at once); ownership goes by lease (a held
lease outlives its connection until its TTL).  A grant that cannot be
delivered because its connection has already closed is released at once, so
a client that died while queued never becomes a ghost holder.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

from . import __version__
from . import protocol as P
from . import sdnotify
from .units import format_address
from .auth import (
    ANONYMOUS,
    AuthFailures,
    Credentials,
    Principal,
    hash_owner,
    is_loopback,
    primary_proof,
    MAX_CHALLENGE_BYTES,
    MIN_CHALLENGE_BYTES,
)
from ._core import (
    EV_EXPIRED,
    EV_GRANTED,
    EV_WAIT_CANCELLED,
    EV_WAIT_TIMEOUT,
    NOT_ACQUIRED,
    LockTable,
    NotHolder,
)
from .errors import (
    AuthError,
    Cancelled,
    FastlockError,
    InvalidArgument,
    LeaseLost,
    LimitExceeded,
    LockNotAcquired,
    NotPrimary,
    PermissionDenied,
    ProtocolError,
    Unavailable,
)
from .failover import FailoverPolicy
from .replication import (
    STATE_FILE,
    NodeFileDamaged,
    NodeState,
    ReplicationSource,
    StandbyFollower,
    node_id,
)
from .logsafe import RateLimitedLog, quote
from .roles import Action, NodeRole, Role
from .tls import DEFAULT_HANDSHAKE_TIMEOUT, ServerTLS, client_context, peer_identity
from .wal import DataDirInUse, HolderRecord, WalCorruption, WriteAheadLog, secure_directory

log = logging.getLogger(__name__)

_monotonic_ns = time.monotonic_ns

#: open files kept free for the WAL, snapshots, the listening socket, the standby
#: connection, the metrics endpoint and worker threads when sizing max connections
RESERVED_FDS = 64
#: default connection cap when the open-files limit allows it (as Redis's maxclients)
DEFAULT_MAX_CONNECTIONS = 10_000
#: replies queued in one loop turn beyond which they go to the transport at once
FLUSH_EARLY_BYTES = 256 << 10
#: exit status after a write-ahead log failure (so a supervisor restarts the server)
EXIT_WAL_FAILED = 3


def _refusal(roles: NodeRole, action: Action) -> FastlockError:
    """The error :meth:`NodeRole.admit` raises for ``action`` now (returned, not raised)."""
    try:
        roles.admit(action)
    except FastlockError as exc:
        return exc
    raise AssertionError(f"{action.name} is admitted")  # pragma: no cover - callers check may() first


def now_ms() -> int:
    """The server's clock: monotonic milliseconds (never the wall clock)."""
    return _monotonic_ns() // 1_000_000


@dataclass
class ServerConfig:
    """Settings of one server process.

    Units are in the names (``_ms``: milliseconds, ``_bytes``: bytes; other
    limits are counts).  The limits (from ``max_frame_bytes`` to
    ``max_watches_per_principal``) bound what peers can make the server hold;
    README "Limits" gives each one's flag, default and what happens beyond it.
    A per-principal quota of 0 means none beyond the global cap.
    :raises ValueError: (from :class:`LockServer`) a limit that is not a
        positive integer (>= 0 for timeouts and quotas).
    """

    host: str = "127.0.0.1"
    port: int = 7420
    data_dir: str = "fastlock-data"
    fsync: str = "always"
    fsync_interval_ms: int = 1000
    snapshot_every: int = 200_000
    auth_secret: str | None = None  # legacy shared secret: the client principal "shared-secret", every name
    credentials: Credentials | None = None  # principals (None: open mode, or only the shared secret)
    allow_unauthenticated: bool = False  # open mode on a non-loopback address (protected mode off)
    standby_token: str | None = None  # this node's replica token, to follow a primary
    auth_failures_before_ban: int = 5  # failed HELLOs from one address before it is banned (0: never)
    # -- limits: everything a peer can make the server hold (README "Limits") --
    max_frame_bytes: int = P.DEFAULT_MAX_FRAME_BYTES  # one request, bytes
    max_connections: int | None = None  # None: 10,000, lowered to fit the open-files limit
    max_connections_per_address: int = 1_000  # per client IP address
    hello_timeout_ms: int = 5_000  # close a connection that has not completed HELLO by then
    idle_timeout_ms: int = 0  # close a connection silent this long (0: never; see _sweep_idle)
    max_output_bytes: int = 32 << 20  # replies a client leaves unread before it is dropped
    max_replica_output_bytes: int = 64 << 20  # stream a standby leaves unread before it is dropped
    max_stream_frame_bytes: int = 256 << 20  # standby: one frame of the primary's stream
    max_waiters: int = 100_000  # waiting acquires, all connections together
    max_waiters_per_connection: int = 10_000
    max_leases: int = 1_000_000  # held leases
    max_watches: int = 100_000  # WATCH subscriptions, all connections together
    max_watches_per_connection: int = 10_000
    max_leases_per_principal: int = 0  # 0: no quota beyond the global cap
    max_waiters_per_principal: int = 0
    max_watches_per_principal: int = 0
    standby_of: tuple[str, int] | None = None  # run as a standby of this primary
    failover_after_ms: int = 0  # standby: promote after this much primary silence (0: on command only)
    promotion_grace_ms: int | None = None  # after promotion, no grants for this long (None: longest TTL seen)
    fence_margin_ms: int | None = None  # primary: stop granting this long before a standby may promote
    name: str | None = None  # this node's name in logs and replication status
    repair_wal: bool = False  # cut a damaged last WAL segment instead of refusing to start
    wal_writer: str = "thread"  # group commit on a writer thread, or "inline" on the loop (see wal.py)
    metrics: tuple[str, int] | None = None  # serve Prometheus metrics on this address
    # TLS (see fastlock.tls): this node's certificate and key serve clients and, on a standby,
    # are presented to the primary; the CA verifies client certificates and the primary's
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_client_auth: str = "none"  # none | optional | required (mutual TLS)
    tls_handshake_timeout_ms: int = int(DEFAULT_HANDSHAKE_TIMEOUT * 1000)
    extra: dict[str, Any] = field(default_factory=dict)


class _Connection(asyncio.Protocol):
    """One client connection = one session.

    ``principal`` (str) is who the connection authenticated as - "anonymous"
    until authentication sets it at HELLO; per-principal quotas key on it.
    ``peer_cert_identity``: the subject CN of the client certificate verified
    in this connection's TLS handshake (mutual TLS), else None.
    """

    __slots__ = ("server", "transport", "session", "decoder", "out", "ready", "client_name", "peer", "closed",
                 "watching", "principal", "kind", "grant", "address", "accepted_ms", "last_read_ms", "out_cap",
                 "out_bytes", "waiting", "_drain", "peer_cert_identity")

    def __init__(self, server: "LockServer", session: int):
        self.server = server
        self.session = session
        # until HELLO every frame is walked before it is decoded (see protocol.FrameDecoder)
        self.decoder = P.FrameDecoder(server.config.max_frame_bytes, shape_all=True)
        self.transport: asyncio.Transport | None = None
        self.out: list[bytes] = []
        self.out_bytes = 0  # bytes in out
        self.ready = False  # handshake done
        self.client_name: str | None = None  # self-declared: shown beside the principal, never trusted
        #: the authenticated principal's name ("anonymous" until HELLO) and kind
        #: (client | replica | admin); quotas and logs key on the name
        self.principal = ANONYMOUS
        self.kind = "client"
        self.grant: Principal | None = None  # its permissions (None until HELLO)
        self.peer = "?"
        self.address = "?"  # the peer's IP address (per-address connection cap, failed-auth bans)
        self.closed = False
        self.watching: set[str] | None = None
        self.accepted_ms = self.last_read_ms = now_ms()
        self.out_cap = server.config.max_output_bytes
        self.waiting = 0  # this connection's waiters as last counted (per-principal waiter quota)
        self._drain: asyncio.Future | None = None
        #: the verified client certificate's subject CN over mutual TLS, else None
        self.peer_cert_identity: str | None = None

    # -- asyncio callbacks ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.peer_cert_identity = peer_identity(transport.get_extra_info("ssl_object"))
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        peer = transport.get_extra_info("peername")
        if peer:
            self.address = str(peer[0])
            self.peer = f"{peer[0]}:{peer[1]}"
        self.server._admit(self)

    def data_received(self, data: bytes) -> None:
        server = self.server
        if self.closed:
            return
        if server.idle_timeout_ms:
            self.last_read_ms = now_ms()
        if server.source.fencing:
            # after a stall, see the clock before a request can make the table grant
            server.source.fence_if_due(now_ms())
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as exc:
            self.fatal(exc)
            server.after_batch()
            return
        handle = server._handle
        for msg in messages:
            if self.closed:
                break
            handle(self, msg)
        server.after_batch()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self.server._connection_lost(self)

    # -- output -----------------------------------------------------------------
    def send(self, data: bytes) -> None:
        if not self.closed:
            if not self.out:
                self.server._dirty.append(self)
            self.out.append(data)
            self.out_bytes += len(data)
            if self.out_bytes > FLUSH_EARLY_BYTES:
                # one read of small requests can ask for far larger replies: hand them to
                # the transport now, so the output cap applies within the batch too
                self.flush()

    def flush(self) -> None:
        out = self.out
        self.out_bytes = 0
        if out and not self.closed:
            transport = self.transport
            transport.write(out[0] if len(out) == 1 else b"".join(out))
            unsent = transport.get_write_buffer_size()
            if unsent > self.out_cap:
                # a peer that does not read (a stuck watcher, a standby too far behind): drop it,
                # as Redis's client-output-buffer-limit does, rather than grow without bound
                if self.session in self.server.source.replicas:
                    log.error("standby on %s is too far behind (%d bytes unsent, limit %d): disconnecting "
                              "it; it resyncs when it reconnects", self.peer, unsent, self.out_cap)
                else:
                    log.warning("closing connection %s (session %d): %d bytes of replies unread (limit %d)",
                                self.peer, self.session, unsent, self.out_cap)
                self.closed = True
                transport.abort()
        out.clear()

    # Flow control: while the peer does not read our replies, stop reading its
    # requests, so a pipelining client that never reads cannot grow our memory.
    # A standby's acknowledgements must keep flowing: its output is bounded by
    # out_cap instead (and the backlog it catches up on waits for drained()).
    def pause_writing(self) -> None:
        if self._drain is None or self._drain.done():
            self._drain = self.server._loop.create_future()
        if self.session not in self.server.source.replicas:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if not self.closed and self.session not in self.server.source.replicas:
            self.transport.resume_reading()

    def drained(self) -> asyncio.Future:
        """A future done when the transport's write buffer is below its low-water
        mark (at once if writing is not paused) or the connection is closed."""
        if self._drain is not None and not self._drain.done() and not self.closed:
            return self._drain
        fut = self.server._loop.create_future()
        fut.set_result(None)
        return fut

    def fatal(self, exc: FastlockError) -> None:
        """Send a protocol error (request id 0) and close this connection only
        (logged at most once per 10 s, with the number of others)."""
        self.server._fatal_log("closing connection %s (session %d): %s", self.peer, self.session, exc)
        self.send(P.encode_error(0, exc.code, str(exc)))
        self.flush()
        self.close()

    def close(self) -> None:
        """Close after sending what is queued; frees the decoder's partial frame at once."""
        self.closed = True
        self.decoder = None
        if self.transport is not None:
            self.transport.close()


_ARTICLE = {"client": "a", "replica": "a", "admin": "an"}

def _split_recorded_client(recorded: Any) -> tuple[str | None, str | None]:
    """``(principal, client name)`` from a grant's recorded client (see ``_recorded_client``)."""
    if type(recorded) is not str:
        return None, None
    principal, sep, name = recorded.partition(":")
    if not sep:
        return None, recorded  # a log written before principals: the name alone
    return principal, name or None


#: what each operation needs: a client ACL operation (checked on the lock name; admins may
#: do it on any name), "replica", "admin", or None (every authenticated principal).
#: An operation missing here needs an admin: new operations are refused by default.
_PERMISSION: dict[int, str | None] = {
    P.OP_HELLO: None,
    P.OP_PING: None,
    P.OP_STATUS: None,  # details (replication, pairing) for admins and replicas only
    P.OP_UNWATCH: None,  # only ever removes the connection's own watch
    P.OP_ACQUIRE: "acquire",
    P.OP_RELEASE: "release",
    P.OP_EXTEND: "extend",
    P.OP_CANCEL: "cancel",
    P.OP_CHECK: "check",
    P.OP_HOLDER: "holder",
    P.OP_WATCH: "watch",
    P.OP_REPLICATE: "replica",
    P.OP_REPL_ACK: "replica",
    P.OP_STEP_DOWN: "replica",  # epoch news: only the paired standby's principal (see _op_step_down)
    P.OP_PROMOTE: "admin",
    P.OP_SERVE_ALONE: "admin",
}


class LockServer:
    """The daemon.  ``await server.start()`` then ``await server.wait_closed()``."""

    def __init__(self, config: ServerConfig):
        self.config = config
        check_limits(config)
        secure_directory(config.data_dir)  # before anything writes to it
        self.table = LockTable()
        self.wal = WriteAheadLog(
            config.data_dir,
            fsync=config.fsync,
            fsync_interval_ms=config.fsync_interval_ms,
            snapshot_every=config.snapshot_every,
            on_fatal=self._wal_fatal,
            writer=config.wal_writer,
        )
        primary_address = f"{config.standby_of[0]}:{config.standby_of[1]}" if config.standby_of else None
        #: the node's role, fence and grace: every "may this node ... now?" is asked here
        self.roles = NodeRole(Role.STANDBY if config.standby_of else Role.PRIMARY,
                              hold_grants_until=self.table.hold_grants_until, now_ms=now_ms,
                              primary_address=primary_address)
        credentials = config.credentials if config.credentials is not None else Credentials.open_mode()
        if config.auth_secret is not None:
            credentials = credentials.with_shared_secret(config.auth_secret)
        self.credentials = credentials
        self.auth_failures = AuthFailures(max_failures=config.auth_failures_before_ban)
        #: the longest TTL this node has granted, extended or recovered (ms): a
        #: standby's default promotion grace (sent in heartbeats)
        self.max_ttl_ms = 0
        self.node_state = NodeState(config.data_dir)
        self.tls: ServerTLS | None = None
        if config.tls_cert:
            self.tls = ServerTLS(config.tls_cert, config.tls_key, config.tls_ca, config.tls_client_auth,
                                 config.tls_handshake_timeout_ms / 1000.0)
        self.source = ReplicationSource(self, fence_margin_ms=config.fence_margin_ms)
        self.follower: StandbyFollower | None = None
        if config.standby_of:
            self.node_state.set_standby_of(primary_address)
            ident = node_id(config.data_dir)
            self.follower = StandbyFollower(self, config.standby_of, config.failover_after_ms,
                                            token=config.standby_token,
                                            name=f"{config.name}@{ident}" if config.name else ident,
                                            on_primary_silent=lambda: self.failover.on_primary_silent(),
                                            tls=self._standby_tls_context(),
                                            stream_limits=P.stream_limits(config.max_stream_frame_bytes,
                                                                          config.max_leases))
        self.failover = FailoverPolicy(self, self.source, self.follower,
                                       promotion_grace_ms=config.promotion_grace_ms)
        self._sessions: dict[int, _Connection] = {}
        #: connections that have not completed HELLO, oldest first (the HELLO deadline)
        self._unready: dict[int, _Connection] = {}
        self._per_address: dict[str, int] = {}
        self.max_connections = config.max_connections or DEFAULT_MAX_CONNECTIONS
        self.idle_timeout_ms = config.idle_timeout_ms
        self._hello_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._refused_log = RateLimitedLog(log)
        self._evicted_log = RateLimitedLog(log)
        self._hello_log = RateLimitedLog(log)
        self._idle_log = RateLimitedLog(log, logging.INFO)
        self._fatal_log = RateLimitedLog(log)  # one line per 10 s however fast peers send garbage
        self._watch_count = 0
        # per-principal quotas (kept only when the quota is set)
        self._lease_principal: dict[str, str] = {}  # lock name -> principal of its holder
        self._principal_leases: dict[str, int] = {}
        self._principal_waiters: dict[str, int] = {}
        self._principal_watches: dict[str, int] = {}
        #: process exit status: non-zero after a fatal WAL failure
        self.exit_status = 0
        self._next_session = 1
        self._dirty: list[_Connection] = []
        self._watchers: dict[str, set[_Connection]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._closed = asyncio.Event()
        self._started_ms = now_ms()
        self.address: tuple[str, int] | None = None
        self._metrics = None
        handlers = {
            P.OP_HELLO: self._op_hello,
            P.OP_ACQUIRE: self._op_acquire,
            P.OP_RELEASE: self._op_release,
            P.OP_EXTEND: self._op_extend,
            P.OP_CANCEL: self._op_cancel,
            P.OP_CHECK: self._op_check,
            P.OP_STATUS: self._op_status,
            P.OP_PING: self._op_ping,
            P.OP_WATCH: self._op_watch,
            P.OP_UNWATCH: self._op_unwatch,
            P.OP_HOLDER: self._op_holder,
            P.OP_REPLICATE: self._op_replicate,
            P.OP_REPL_ACK: self._op_repl_ack,
            P.OP_PROMOTE: self._op_promote,
            P.OP_SERVE_ALONE: self._op_serve_alone,
            P.OP_STEP_DOWN: self._op_step_down,
        }
        #: op -> (handler, fewest, most arguments): the arity is declared in protocol.OP_ARITY
        self._handlers = {op: (handler, *P.OP_ARITY[op]) for op, handler in handlers.items()}

    # -- what replication and failover see (fastlock.replication_host.ReplicationHost) -----------
    @property
    def role(self) -> str:
        """The node's role as a string ("primary", "standby", "promoting", "deposed")."""
        return self.roles.role.value

    @property
    def data_dir(self) -> str:
        return self.config.data_dir

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def close_client_connections(self, why: str, *, waiting_only: bool = False) -> None:
        """Close every connection but the standbys' (``waiting_only``: those with a
        queued acquire or a watch), once this turn's replies are out."""
        def close() -> None:
            replicas = self.source.replicas
            table = self.table
            clients = [c for c in self._sessions.values() if c.session not in replicas and not c.closed
                       and (not waiting_only or c.watching or table.session_waiters(c.session))]
            if clients:
                log.warning("closing %d client connections: %s", len(clients), why)
            for conn in clients:
                conn.flush()
                conn.closed = True
                conn.transport.close()

        self._loop.call_soon(close)

    # -- life cycle -----------------------------------------------------------------
    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        if self.credentials.open and not is_loopback(self.config.host) and not self.config.allow_unauthenticated:
            # as Redis's protected mode: no credentials, so listen on loopback only
            raise PermissionError(
                f"refusing to listen on {self.config.host} without credentials: anyone who can reach it could "
                f"take every lock. Give --credentials FILE (see `fastlock credentials init`), listen on "
                f"127.0.0.1, or pass --allow-unauthenticated")
        self._size_connection_limit()
        if self.roles.role is Role.PRIMARY and self.node_state.standby_of:
            raise DataDirInUse(
                f"{self.config.data_dir} belongs to a standby of {self.node_state.standby_of}: start it with "
                f"--standby-of, or promote it with `fastlock promote`; starting it as a primary would make "
                f"a second primary at the old epoch (delete {STATE_FILE} only if you know the old primary "
                f"is gone for good)")
        t0 = time.perf_counter()
        state = self.wal.open(repair=self.config.repair_wal)
        table = self.table
        table.set_epoch(state.epoch)
        table.advance_counter(state.counter)
        now = now_ms()
        self.max_ttl_ms = self.node_state.max_ttl_ms
        for h in state.holders:
            self.max_ttl_ms = max(self.max_ttl_ms, h.ttl_ms)
            # A fresh full TTL from recovery: we cannot know how long we were down.
            table.install_holder(h.name, h.token, h.owner, h.ttl_ms, h.lock_delay_ms,
                                 (h.client_name, h.correlation_id), now)
        table.drain_events()
        if not self.roles.expires_leases:
            # a standby runs its table on frozen time: only a primary expires leases
            for h in table.holders():
                table.install_holder(h.name, h.token, h.owner, h.ttl_ms, h.lock_delay_ms, h.meta, 0)
        log.info(
            "recovered %d leases, epoch %d, counter %d (%d records replayed, %d torn bytes cut) in %.1f ms",
            len(state.holders), state.epoch, table.counter, state.records_replayed, state.torn_bytes,
            (time.perf_counter() - t0) * 1000,
        )
        self.wal.start(loop)
        if self.wal.repaired:
            # The cut may have removed acknowledged grants, so the counter may be below
            # tokens already handed out: a new epoch puts every future token above them.
            epoch = max(table.epoch, self.node_state.max_epoch_seen) + 1
            table.set_epoch(epoch)
            self.wal.log_epoch(epoch)
            self.node_state.raise_epoch(epoch)
            log.critical("the WAL was repaired (records cut): starting epoch %d so that no fencing token "
                         "is issued twice; leases in the cut records are forgotten", epoch)
        if self.config.metrics is not None:  # before "listening on": a bad address fails the start
            from .metrics import MetricsExporter

            self._metrics = MetricsExporter(self, *self.config.metrics)
        self.failover.on_start()  # a deposed primary stays deposed; a paired one may start fenced
        self._rearm()
        if self.tls is None:
            self._server = await loop.create_server(
                self._make_connection, self.config.host, self.config.port, reuse_address=True,
                backlog=1024,
            )
            sockname = self._server.sockets[0].getsockname()
        else:
            sockname = await self.tls.listen(self.config.host, self.config.port, self._make_connection, backlog=1024)
        self.address = (sockname[0], sockname[1])
        log.info(
            "listening on %s:%d (fastlock %s, %s, fsync=%s, data dir %s, %s)",
            sockname[0], sockname[1], __version__, self.role, self.config.fsync,
            os.path.abspath(self.config.data_dir),
            "plain TCP" if self.tls is None else f"TLS, client certificates {self.config.tls_client_auth}",
        )
        creds = self.credentials
        if creds.open:
            log.warning("open mode (no --credentials): every connection is the anonymous client with every "
                        "lock name; replica and admin operations are refused")
        else:
            log.info("credentials: %d principals from %s%s%s", len(creds.principals), creds.source,
                     ", shared secret accepted" if creds.shared_secret_hash is not None else "",
                     ", anonymous clients allowed" if creds.anonymous is not None else "")
        if self.follower is not None:
            self.follower.start()
        if self.idle_timeout_ms > 0:
            self._idle_timer = loop.call_later(self._idle_sweep_s(), self._sweep_idle)

    async def close(self) -> None:
        """Stop accepting, close every connection, flush and close the WAL."""
        if self._closed.is_set():
            return
        log.info("shutting down: %d sessions, %d locks held", len(self._sessions), len(self.table))
        if self._server is not None:
            self._server.close()
        if self.tls is not None:
            self.tls.close()
        self.source.close()
        if self.follower is not None:
            self.follower.stop()
        if self._metrics is not None:
            self._metrics.close()
        for conn in list(self._sessions.values()):
            conn.flush()
            conn.closed = True
            conn.transport.close()
        for timer in (self._timer, self._hello_timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
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
        for conn in list(self._sessions.values()):
            conn.out.clear()
            conn.send(notice)
            conn.flush()
            conn.close()
        self._dirty.clear()
        if self._server is not None:
            self._server.close()
        if self.tls is not None:
            self.tls.close()
        self._closed.set()

    def _make_connection(self) -> _Connection:
        sid = self._next_session
        self._next_session = sid + 1
        return _Connection(self, sid)

    # -- connection limits ---------------------------------------------------------------
    def _size_connection_limit(self) -> None:
        """Raise the open-files soft limit to the hard limit, and keep the
        connection cap below it (RESERVED_FDS left for files and the standby)."""
        soft = raise_open_files_limit()
        if soft is None:
            return
        fit = max(16, soft - RESERVED_FDS)
        if self.config.max_connections is None:
            self.max_connections = min(DEFAULT_MAX_CONNECTIONS, fit)
        elif self.config.max_connections > fit:
            log.warning("--max-connections %d is above what the open-files limit (%d) allows: using %d",
                        self.config.max_connections, soft, fit)
            self.max_connections = fit
        log.info("connection limits: %d in all, %d per address (open-files limit %d)", self.max_connections,
                 self.config.max_connections_per_address, soft)

    def _admit(self, conn: _Connection) -> None:
        """A new connection: count it, or refuse it (close, logged at most every 10 s).

        At the global cap the oldest connection that has not completed HELLO is
        closed to make room (a handshake reserve: a flood of idle connections
        cannot lock out a client that authenticates, nor the standby); with no
        such connection, the new one is refused.
        """
        per = self._per_address.get(conn.address, 0)
        if per >= self.config.max_connections_per_address:
            self._refused_log("refusing connection from %s: already %d connections from this address "
                              "(--max-connections-per-address)", conn.peer, per)
            self._refuse(conn)
            return
        if len(self._sessions) >= self.max_connections:
            if not self._unready:
                self._refused_log("refusing connection from %s: %d connections open (--max-connections)",
                                  conn.peer, len(self._sessions))
                self._refuse(conn)
                return
            victim = next(iter(self._unready.values()))
            self._evicted_log("connection limit %d reached: closing %s (no HELLO after %d ms) to admit %s",
                              self.max_connections, victim.peer, now_ms() - victim.accepted_ms, conn.peer)
            self._forget(victim)
            self._refuse(victim)
        self._sessions[conn.session] = conn
        self._per_address[conn.address] = per + 1
        self._unready[conn.session] = conn
        if self._hello_timer is None:
            self._arm_hello_timer()

    @staticmethod
    def _refuse(conn: _Connection) -> None:
        conn.closed = True
        conn.decoder = None
        conn.transport.abort()

    def _forget(self, conn: _Connection) -> bool:
        """Uncount a connection; False if it was not counted (refused or already forgotten)."""
        if self._sessions.pop(conn.session, None) is None:
            return False
        self._unready.pop(conn.session, None)
        n = self._per_address.get(conn.address, 0) - 1
        if n > 0:
            self._per_address[conn.address] = n
        else:
            self._per_address.pop(conn.address, None)
        return True

    def _arm_hello_timer(self) -> None:
        timeout = self.config.hello_timeout_ms
        if self._hello_timer is None and self._unready and timeout > 0:
            oldest = next(iter(self._unready.values()))
            delay = max(0, oldest.accepted_ms + timeout - now_ms()) / 1000.0
            self._hello_timer = self._loop.call_later(delay, self._on_hello_timer)

    def _on_hello_timer(self) -> None:
        """Close every connection that has not completed HELLO within the deadline
        (one timer for all of them: they are kept in arrival order)."""
        self._hello_timer = None
        cutoff = now_ms() - self.config.hello_timeout_ms
        late = []
        for conn in self._unready.values():
            if conn.accepted_ms > cutoff:
                break
            late.append(conn)
        for conn in late:
            self._forget(conn)
            self._refuse(conn)
        if late:
            self._hello_log("closed %d connections that did not complete HELLO within %d ms (--hello-timeout; "
                            "the last from %s)", len(late), self.config.hello_timeout_ms, late[-1].peer)
        self._arm_hello_timer()

    def _idle_sweep_s(self) -> float:
        return max(0.05, self.idle_timeout_ms / 4000.0)

    def _sweep_idle(self) -> None:
        """Close connections that sent nothing for ``idle_timeout_ms`` - except those
        waiting for a lock, watching one, or replicating (they wait for us, as
        Redis's timeout spares blocked clients)."""
        self._idle_timer = self._loop.call_later(self._idle_sweep_s(), self._sweep_idle)
        cutoff = now_ms() - self.idle_timeout_ms
        replicas = self.source.replicas
        table = self.table
        idle = [c for c in self._sessions.values()
                if c.ready and c.last_read_ms <= cutoff and not c.watching and c.session not in replicas
                and not table.session_waiters(c.session)]
        for conn in idle:
            conn.close()
        if idle:
            self._idle_log("closed %d connections idle for %d ms or more (--idle-timeout; the last %s)",
                           len(idle), self.idle_timeout_ms, idle[-1].peer)

    def _connection_lost(self, conn: _Connection) -> None:
        if not self._forget(conn) and conn.session not in self.source.replicas:
            return  # refused, or closed before HELLO: it holds nothing
        self.source.fence_if_due(now_ms())
        if conn.session in self.source.replicas:
            self.source.detach(conn)
        if conn.watching:
            for name in conn.watching:
                self._unwatch(conn, name)
            self._count_watches(conn, -len(conn.watching))
        dropped = self.table.drop_session(conn.session, self._table_now())
        if conn.waiting:
            self._principal_waiters[conn.principal] -= conn.waiting
            conn.waiting = 0
        if dropped:
            log.debug("session %d closed; %d waiters removed", conn.session, dropped)
        self.after_batch()

    # -- the batch end: events, WAL, timer, output ------------------------------------
    def after_batch(self) -> None:
        """The batch end: log and deliver the table's events, re-arm the timer, flush replies."""
        table = self.table
        events = table.drain_events()
        if events:
            self._process_events(events)
        nd = table.next_deadline()
        if nd >= 0 and (self._timer is None or nd < self._timer_at) and self.roles.expires_leases:
            self._rearm()
        dirty = self._dirty
        if dirty:
            for conn in dirty:
                conn.flush()
            dirty.clear()

    def _process_events(self, events: list) -> None:
        wal = self.wal
        grants = None
        sessions = self._sessions
        quotas = self.config.max_leases_per_principal or self.config.max_waiters_per_principal
        for ev in events:
            kind = ev.kind
            if kind == EV_GRANTED:
                if ev.fresh:
                    meta = ev.meta
                    wal.log_grant(ev.name, ev.token, ev.owner, ev.ttl_ms, ev.lock_delay_ms, meta[0], meta[1])
                    if quotas:
                        self._lease_granted(ev)
                if grants is None:
                    grants = []
                grants.append(ev)
            elif kind == EV_EXPIRED:
                wal.log_expire(ev.name, ev.token)
                if self._lease_principal:
                    self._lease_ended(ev.name)
                if ev.name in self._watchers:
                    self._notify(ev.name, "expired", ev.token, ev.meta)
                log.info("lease expired: %s token %d (holder %s)", quote(ev.name), ev.token,
                         quote(ev.meta[0] if ev.meta else None))
            elif kind == EV_WAIT_TIMEOUT:
                conn = sessions.get(ev.session)
                if conn is not None:
                    conn.send(P.encode_error(ev.request, LockNotAcquired.code, f"{ev.name!r}: wait ran out"))
                    if conn.waiting:
                        self._count_waiters(conn)
            elif kind == EV_WAIT_CANCELLED:
                conn = sessions.get(ev.session)
                if conn is not None:
                    conn.send(P.encode_error(ev.request, Cancelled.code, f"{ev.name!r}: acquire cancelled"))
                    if conn.waiting:
                        self._count_waiters(conn)
        if grants is not None:
            if wal.flush_now():  # relaxed fsync modes: written to the OS now, ack in this turn
                self._deliver_grants(grants)
            else:
                wal.when_durable(lambda: self._deliver_grants(grants))
        wal.maybe_snapshot(self.snapshot_state)

    def _deliver_grants(self, grants: list) -> None:
        """Acknowledge a batch of grants once durable - if this node may still grant.

        The fence is checked again here, at the acknowledgement, not only when the
        grants were decided: a primary frozen (SIGSTOP, a VM stall) between the two
        may find its standby promoted meanwhile.  Then every waiting request gets
        ``Unavailable`` instead of its token (the lease stays in this node's table);
        the client repeats the acquire with the same owner key at whichever node is
        primary, which hands it the lease if it was replicated, or queues it.  One
        check per batch: the normal path does not pay per grant.
        """
        sessions = self._sessions
        table = self.table
        undelivered = False
        watchers = self._watchers
        self.source.fence_if_due(now_ms())
        refused = None if self.roles.may(Action.ACQUIRE) else _refusal(self.roles, Action.ACQUIRE)
        for ev in grants:
            if refused is None and watchers and ev.name in watchers and ev.fresh:
                self._notify(ev.name, "granted", ev.token, ev.meta)
            conn = sessions.get(ev.session)
            if conn is None or conn.closed:
                # Nobody can learn this token any more: release it now rather
                # than leave a ghost holder until its TTL runs out.
                self.source.fence_if_due(now_ms())
                try:
                    table.release(ev.name, ev.token, ev.owner, now_ms())
                except NotHolder:
                    continue
                self._released(ev.name, ev.token, ev.meta)
                undelivered = True
                log.info("released undeliverable grant %s token %d (session %d gone)", quote(ev.name), ev.token,
                         ev.session)
                continue
            if refused is not None:
                conn.send(P.encode_error(ev.request, refused.code, f"{ev.name!r}: {refused}",
                                         getattr(refused, "primary", None)))
                log.warning("grant %s token %d decided but not acknowledged: %s", quote(ev.name), ev.token, refused)
                continue
            conn.send(P.packb([ev.request, 0, [ev.token, ev.ttl_ms, ev.waited_ms]]))
        if undelivered:
            table.expire(now_ms())
        self.after_batch()

    def _table_now(self) -> int:
        """The time to give the lock table: a standby's table runs on frozen time
        (0) so that it never expires a lease itself; only a primary expires."""
        return now_ms() if self.roles.expires_leases else 0

    def _rearm(self) -> None:
        nd = self.table.next_deadline()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if nd < 0 or not self.roles.expires_leases:
            return
        delay = max(0, nd - now_ms()) / 1000.0
        self._timer = self._loop.call_later(delay, self._on_timer)
        self._timer_at = nd

    def _on_timer(self) -> None:
        self._timer = None
        if not self.roles.expires_leases:
            return
        now = now_ms()
        self.source.fence_if_due(now)  # an expiry hands the lock to a waiter: not past the fence
        self.table.expire(now)
        self.after_batch()
        if self._timer is None:
            self._rearm()

    def snapshot_state(self) -> tuple[int, int, list[HolderRecord]]:
        """``(epoch, counter, holders)`` of the table now (for snapshots and standbys)."""
        t = self.table
        return (
            t.epoch,
            t.counter,
            [
                HolderRecord(h.name, h.token, h.owner, h.ttl_ms, h.lock_delay_ms,
                             h.meta[0] if h.meta else None, h.meta[1] if h.meta else None, 0)
                for h in t.holders()
            ],
        )

    # -- dispatch -----------------------------------------------------------------
    def _handle(self, conn: _Connection, msg: Any) -> None:
        if type(msg) is not list or len(msg) < 2 or type(msg[0]) is not int or type(msg[1]) is not int or msg[0] < 1:
            conn.fatal(ProtocolError("a request must be an array [request_id >= 1, op, args...]"))
            return
        req_id = msg[0]
        op = msg[1]
        if not conn.ready and op != P.OP_HELLO:
            conn.fatal(ProtocolError("the first request must be HELLO"))
            return
        entry = self._handlers.get(op)
        try:
            if entry is None:
                raise ProtocolError(f"unknown operation {op}")
            handler, fewest, most = entry
            if not fewest <= len(msg) - 2 <= most:
                expected = fewest if fewest == most else f"{fewest} or {most}"
                raise ProtocolError(f"{P.OP_NAMES[op]} takes {expected} arguments, got {len(msg) - 2}")
            need = _PERMISSION.get(op, "admin")
            if need is not None and (conn.kind != "admin" or need == "replica"):
                self._authorize(conn, op, need, msg)
            handler(conn, req_id, msg)
        except FastlockError as exc:
            conn.send(P.packb([req_id, exc.code, str(exc), getattr(exc, "primary", None)]))
            if isinstance(exc, AuthError):
                conn.flush()
                conn.closed = True
                conn.transport.close()
        except Exception:  # a bug: answer, log, keep serving everyone else
            log.exception("internal error handling %s from %s", P.OP_NAMES.get(op, op), conn.peer)
            conn.send(P.packb([req_id, ProtocolError.code, "internal server error", None]))

    @staticmethod
    def _authorize(conn: _Connection, op: int, need: str, msg: list) -> None:
        """Refuse (PermissionDenied) what ``conn``'s principal is not granted (admins come here
        only for replica operations, which they are not granted either)."""
        if need == "replica" or need == "admin":
            if conn.kind != need:
                raise PermissionDenied(f"{P.OP_NAMES[op]} needs {_ARTICLE[need]} {need} principal; "
                                       f"{conn.principal!r} is {_ARTICLE[conn.kind]} {conn.kind}")
            return
        if conn.kind != "client":
            raise PermissionDenied(f"{P.OP_NAMES[op]} needs a client principal; "
                                   f"{conn.principal!r} is {_ARTICLE[conn.kind]} {conn.kind}")
        name = msg[2] if len(msg) > 2 else None
        if type(name) is str and not conn.grant.allows(need, name):
            # a name of the wrong type is left to the handler's validation (no state change either way)
            raise PermissionDenied(f"principal {conn.principal!r} may not {need} {name!r}")

    def _op_hello(self, conn: _Connection, req_id: int, msg: list) -> None:
        """HELLO: version, client name, credentials (and an epoch hint, which changes nothing).

        Credentials are a token (str: a principal's token or the legacy shared
        secret), None (the verified mTLS certificate's identity if the
        credentials map it, else the anonymous principal if allowed), or a
        standby's ``{"principal", "challenge"}``: the primary then answers with
        its proof (see :mod:`fastlock.auth`) and the connection stays
        unauthenticated until a HELLO with the token follows.
        """
        # a 4th argument, the highest epoch the peer has seen, is a hint only: it never
        # changes this node's role (a standby that promotes sends STEP_DOWN instead)
        version, client_name, credential = msg[2], msg[3], msg[4]
        if version != P.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version!r} not supported (server speaks {P.PROTOCOL_VERSION})")
        client_name = P.check_optional_str(client_name, "client name", P.MAX_CLIENT_NAME_CHARS)
        failures = self.auth_failures
        # a ban refuses new connections only: a peer authenticated before it (a standby's
        # replication link, saying HELLO again to depose) is not cut off by someone else's failures
        banned = 0.0 if conn.ready else failures.banned_for(conn.address)
        if banned > 0:
            failures.refused_while_banned(conn.address)
            raise AuthError(f"too many failed authentications from this address: retry in {banned:.0f} s")
        if type(credential) is dict:
            conn.send(P.encode_ok(req_id, self._primary_proof(conn, credential, client_name)))
            return
        principal = self._authenticate(conn, credential, client_name)
        if conn.ready and principal.name != conn.principal:
            raise ProtocolError(f"this connection is authenticated as {conn.principal!r}; "
                                f"open a new one to act as {principal.name!r}")
        conn.client_name = client_name
        conn.principal = principal.name
        conn.kind = principal.kind
        conn.grant = principal
        self._handshake_done(conn)
        log.debug("session %d hello from %s: principal %s (%s), client name %s", conn.session, conn.peer,
                  conn.principal, conn.kind, quote(conn.client_name))
        conn.send(P.encode_ok(req_id, self._hello_info(conn)))

    def _authenticate(self, conn: _Connection, credential: Any, client_name: str | None) -> Principal:
        creds = self.credentials
        principal = None
        if credential is None:
            if conn.peer_cert_identity is not None:
                principal = creds.by_cert_identity(conn.peer_cert_identity)
            if principal is None:
                principal = creds.anonymous
            reason = "no token, and anonymous connections are not allowed"
        elif type(credential) is str and 0 < len(credential) <= 1024:
            principal = creds.authenticate(credential)
            if principal is None and creds.open:
                principal = creds.anonymous  # open mode: a token cannot be checked, and is not needed
            reason = "unknown token"
        else:
            reason = "the credential must be a token string (1..1024 characters) or None"
        if principal is None:
            self.auth_failures.failed(conn.address, f"client name {quote(client_name)}", reason)
            raise AuthError(f"authentication failed: {reason}")
        return principal

    def _primary_proof(self, conn: _Connection, credential: dict, client_name: str | None) -> dict:
        """A standby's challenge: prove that this node holds the standby's credential."""
        name = credential.get("principal")
        challenge = credential.get("challenge")
        replica = self.credentials.replica(name)
        if (replica is None or type(challenge) is not bytes
                or not MIN_CHALLENGE_BYTES <= len(challenge) <= MAX_CHALLENGE_BYTES):
            self.auth_failures.failed(conn.address, f"client name {quote(client_name)}",
                                      "challenge for an unknown replica principal, or a malformed challenge")
            raise AuthError("authentication failed: no replica principal of that name, or a malformed challenge "
                            f"({MIN_CHALLENGE_BYTES}..{MAX_CHALLENGE_BYTES} bytes)")
        return {"principal": replica.name, "proof": primary_proof(replica.proof_key, replica.name, challenge)}

    def _handshake_done(self, conn: _Connection) -> None:
        """HELLO succeeded: the connection leaves the HELLO deadline and the
        handshake reserve (see :meth:`_admit`), and its frames are no longer walked
        before decoding."""
        conn.ready = True
        self._unready.pop(conn.session, None)
        if conn.decoder is not None:
            conn.decoder.shape_all = False

    def _hello_info(self, conn: _Connection) -> dict:
        return {
            "server": "fastlock",
            "version": __version__,
            "protocol": P.PROTOCOL_VERSION,
            "session": conn.session,
            "role": self.roles.role.value,
            "epoch": self.table.epoch,
            "primary": self.roles.primary_address if self.roles.role is Role.STANDBY else None,
            "fenced": self.roles.fenced,
            "clock_ms": now_ms(),  # this node's monotonic clock: a standby echoes it in STEP_DOWN
            "max_frame_bytes": self.config.max_frame_bytes,
            "principal": conn.principal,
            "kind": conn.kind,
        }

    def _op_acquire(self, conn: _Connection, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        owner = hash_owner(P.check_owner(msg[3]))  # only the hash is kept, logged and replicated
        ttl_ms = P.check_ttl_ms(msg[4])
        wait_ms = P.check_wait_ms(msg[5])
        delay_ms = P.check_lock_delay_ms(msg[6])
        corr = P.check_optional_str(msg[7], "correlation id", P.MAX_CORRELATION_ID_CHARS)
        table = self.table
        now = now_ms()
        self.roles.admit(Action.ACQUIRE)
        config = self.config
        if wait_ms != 0:
            if table.session_waiters(conn.session) >= config.max_waiters_per_connection:
                raise LimitExceeded(f"this connection already has {config.max_waiters_per_connection} waiting "
                                    f"acquires (--max-waiters-per-connection)")
            if table.waiter_count >= config.max_waiters:
                raise LimitExceeded(f"the server already has {config.max_waiters} waiting acquires (--max-waiters)")
            if (config.max_waiters_per_principal
                    and self._principal_waiters.get(conn.principal, 0) >= config.max_waiters_per_principal):
                raise LimitExceeded(f"principal {conn.principal!r} already has {config.max_waiters_per_principal} "
                                    f"waiting acquires (--max-waiters-per-principal)")
        if len(table) >= config.max_leases and table.holder(name, now) is None:
            raise LimitExceeded(f"the server already holds {config.max_leases} leases (--max-leases)")
        if (config.max_leases_per_principal
                and self._principal_leases.get(conn.principal, 0) >= config.max_leases_per_principal
                and table.holder(name, now) is None):
            raise LimitExceeded(f"principal {conn.principal!r} already holds {config.max_leases_per_principal} "
                                f"leases (--max-leases-per-principal)")
        if ttl_ms > self.max_ttl_ms:
            self.max_ttl_ms = ttl_ms
            self.node_state.raise_ttl(ttl_ms)  # rare: only a new longest TTL writes
        status = table.acquire(name, owner, conn.session, req_id, ttl_ms, wait_ms, delay_ms,
                               (self._recorded_client(conn), corr), now)
        if config.max_waiters_per_principal:
            self._count_waiters(conn)
        if status == NOT_ACQUIRED:
            grace_ms = self.roles.grace_remaining_ms(now)
            if grace_ms:
                raise LockNotAcquired(f"{name!r}: no grants during the promotion grace period "
                                      f"({grace_ms} ms left)")
            raise LockNotAcquired(f"{name!r} is held")

    def _op_release(self, conn: _Connection, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        token = P.check_token(msg[3])
        owner = hash_owner(P.check_owner(msg[4]))
        # a fenced primary refuses too: the standby may have been promoted and would never
        # see this release (the client repeats it at whichever node is primary)
        self.roles.admit(Action.RELEASE)
        table = self.table
        now = now_ms()
        meta = None
        if name in self._watchers:  # watchers are told whose lease it was
            holder = table.holder(name, now)
            meta = holder.meta if holder is not None else None
        try:
            table.release(name, token, owner, now)
        except NotHolder:
            raise LeaseLost(f"{name!r}: token {token} is not the current holder (expired, released or never held)") from None
        self._released(name, token, meta)
        conn.send(P.encode_ok(req_id, None))

    def _op_extend(self, conn: _Connection, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        token = P.check_token(msg[3])
        owner = hash_owner(P.check_owner(msg[4]))
        ttl_ms = P.check_ttl_ms(msg[5])
        table = self.table
        now = now_ms()
        self.roles.admit(Action.EXTEND)
        holder = table.holder(name, now)
        try:
            table.extend(name, token, owner, ttl_ms, now)
        except NotHolder:
            raise LeaseLost(f"{name!r}: token {token} is not the current holder (expired, released or never held)") from None
        if ttl_ms > self.max_ttl_ms:  # only the holder's extend counts towards the grace period
            self.max_ttl_ms = ttl_ms
            self.node_state.raise_ttl(ttl_ms)
        reply = P.encode_ok(req_id, ttl_ms)
        # Every extend is logged: the standby keeps each lease's deadline from the
        # records it receives, and a promoted standby keeps that deadline.
        self.wal.log_extend(name, token, ttl_ms)
        if ttl_ms > holder.ttl_ms and not self.wal.flush_now():
            # recovery restores the recorded TTL: a longer one must be durable
            # before the holder relies on it (a shorter or equal one need not be)
            def ack() -> None:
                # acknowledged only if this node may still extend (see _deliver_grants)
                self.source.fence_if_due(now_ms())
                if self.roles.may(Action.EXTEND):
                    conn.send(reply)
                else:
                    refused = _refusal(self.roles, Action.EXTEND)
                    conn.send(P.encode_error(req_id, refused.code, f"{name!r}: {refused}",
                                             getattr(refused, "primary", None)))
                    log.warning("extend of %s token %d not acknowledged: %s", quote(name), token, refused)
                self.after_batch()

            self.wal.when_durable(ack)
            return
        conn.send(reply)

    def _op_cancel(self, conn: _Connection, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        # The owner key is the proof of ownership: only its hash is stored, so only the client
        # that made the key can match it (a hash read from a replica's stream is hashed again).
        owner = hash_owner(P.check_owner(msg[3]))
        self.roles.admit(Action.CANCEL_WAITER)  # withdrawing a queued waiter is local: fenced or not
        table = self.table
        now = now_ms()
        result = None
        if table.cancel(name, owner, now):
            result = "cancelled"
            if self.config.max_waiters_per_principal:
                self._count_waiters(conn)
        else:
            holder = table.holder(name, now)
            if holder is not None and holder.owner == owner:
                # The grant raced with the cancel: release it, never leak it - which is a
                # release, refused like one by a fenced primary.
                self.roles.admit(Action.RELEASE)
                table.release(name, holder.token, owner, now)
                self._released(name, holder.token, holder.meta)
                result = "released"
        conn.send(P.encode_ok(req_id, result))

    def _op_check(self, conn: _Connection, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        token = P.check_token(msg[3])
        self.roles.admit(Action.READ)  # a fenced primary's answer may already be false
        conn.send(P.encode_ok(req_id, self.table.check(name, token, now_ms())))

    def _released(self, name: str, token: int, meta: tuple | None) -> None:
        """Log a release and tell the lock's watchers (``meta``: the lease's (client, correlation id))."""
        self.wal.log_release(name, token)
        if self._lease_principal:
            self._lease_ended(name)
        if name in self._watchers:
            self._notify(name, "released", token, meta)

    def _notify(self, name: str, what: str, token: int, meta: tuple | None) -> None:
        client, corr = meta if meta else (None, None)
        principal, client = _split_recorded_client(client)
        data = P.encode_push(P.PUSH_WATCH, [name, what, token, client, corr, principal])
        for conn in self._watchers[name]:
            conn.send(data)

    @staticmethod
    def _recorded_client(conn: _Connection) -> str:
        """What grants record as their client: ``principal:client name`` (the name may be
        empty) - the authenticated principal first, so the self-declared name is never
        mistaken for it.  A record without ``:`` is a bare client name from an older log."""
        return f"{conn.principal}:{conn.client_name or ''}"
    # -- per-principal quotas (bookkeeping only while a quota is set) ----------------------
    def _lease_granted(self, ev) -> None:
        conn = self._sessions.get(ev.session)
        if self.config.max_waiters_per_principal and conn is not None and conn.waiting:
            self._count_waiters(conn)  # a waiter became the holder
        if self.config.max_leases_per_principal:
            principal = conn.principal if conn is not None else "-"
            self._lease_principal[ev.name] = principal
            self._principal_leases[principal] = self._principal_leases.get(principal, 0) + 1

    def _lease_ended(self, name: str) -> None:
        principal = self._lease_principal.pop(name, None)
        if principal is not None:
            self._principal_leases[principal] -= 1

    def _count_waiters(self, conn: _Connection) -> None:
        """Re-count ``conn``'s waiters into its principal's total."""
        n = self.table.session_waiters(conn.session)
        if n != conn.waiting:
            self._principal_waiters[conn.principal] = self._principal_waiters.get(conn.principal, 0) + n - conn.waiting
            conn.waiting = n

    def _count_watches(self, conn: _Connection, delta: int) -> None:
        self._watch_count += delta
        if self.config.max_watches_per_principal:
            self._principal_watches[conn.principal] = self._principal_watches.get(conn.principal, 0) + delta

    def _holder_info(self, name: str) -> dict | None:
        now = now_ms()
        h = self.table.holder(name, now)
        if h is None:
            return None
        client, corr = h.meta if h.meta else (None, None)
        principal, client = _split_recorded_client(client)
        return {"token": h.token, "principal": principal, "client": client, "correlation_id": corr,
                "ttl_ms": h.ttl_ms, "remaining_ms": h.deadline_ms - now}

    def _op_watch(self, conn: _Connection, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        self.roles.admit(Action.READ)
        if conn.watching is None:
            conn.watching = set()
        if name not in conn.watching:
            config = self.config
            if len(conn.watching) >= config.max_watches_per_connection:
                raise LimitExceeded(f"this connection already watches {len(conn.watching)} locks "
                                    f"(--max-watches-per-connection)")
            if self._watch_count >= config.max_watches:
                raise LimitExceeded(f"the server already has {config.max_watches} watches (--max-watches)")
            if (config.max_watches_per_principal
                    and self._principal_watches.get(conn.principal, 0) >= config.max_watches_per_principal):
                raise LimitExceeded(f"principal {conn.principal!r} already has {config.max_watches_per_principal} "
                                    f"watches (--max-watches-per-principal)")
            self._count_watches(conn, 1)
        conn.watching.add(name)
        self._watchers.setdefault(name, set()).add(conn)
        conn.send(P.encode_ok(req_id, self._holder_info(name)))

    def _op_unwatch(self, conn: _Connection, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        was = conn.watching is not None and name in conn.watching
        if was:
            conn.watching.discard(name)
            self._unwatch(conn, name)
            self._count_watches(conn, -1)
        conn.send(P.encode_ok(req_id, was))

    def _unwatch(self, conn: _Connection, name: str) -> None:
        group = self._watchers.get(name)
        if group is not None:
            group.discard(conn)
            if not group:
                del self._watchers[name]

    def _op_holder(self, conn: _Connection, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        self.roles.admit(Action.READ)
        conn.send(P.encode_ok(req_id, self._holder_info(name)))

    # -- replication, promotion, stepping down (policy in fastlock.failover) ---------------------
    def _op_replicate(self, conn: _Connection, req_id: int, msg: list) -> None:
        from_lsn, incarnation, failover_after_ms, name = msg[2], msg[3], msg[4], msg[5]
        if type(from_lsn) is not int or type(failover_after_ms) is not int or failover_after_ms < 0:
            raise InvalidArgument("replicate takes from_lsn:int, incarnation, failover_after_ms:int >= 0, name")
        name = P.check_optional_str(name, "standby name", P.MAX_CLIENT_NAME_CHARS)
        if not name:
            raise InvalidArgument("a standby must name itself ([label@]node id)")
        self.roles.admit(Action.SERVE_STANDBY)
        # Pairing goes by the authenticated replica principal, plus the node id it declares
        # (which the credentials may pin): one replica credential cannot pose as another standby.
        label, _, node = name.rpartition("@")
        pinned = conn.grant.node_id
        if pinned is not None and node != pinned:
            raise PermissionDenied(f"replica principal {conn.principal!r} may only attach as node {pinned!r}")
        identity = f"{label}@{conn.principal}/{node}" if label else f"{conn.principal}/{node}"
        conn.out_cap = self.config.max_replica_output_bytes  # (plus its snapshot: see ReplicationSource)
        try:
            self.source.attach(conn, req_id, from_lsn, incarnation, failover_after_ms, identity)
        except BaseException:
            conn.out_cap = self.config.max_output_bytes
            raise

    def _op_repl_ack(self, conn: _Connection, req_id: int, msg: list) -> None:
        self.source.on_ack(conn, msg[2], msg[3])  # no reply: acks stream continuously

    def _op_step_down(self, conn: _Connection, req_id: int, msg: list) -> None:
        if not self.source.may_announce_epoch(conn.principal):
            raise PermissionDenied(f"this primary is paired with another standby: replica {conn.principal!r} "
                                   f"may not ask it to step down")
        info = self.failover.on_step_down_request(
            msg[2], msg[3], f"replica {conn.principal} ({quote(conn.client_name) if conn.client_name else 'a peer'} at {conn.peer})")
        conn.send(P.encode_ok(req_id, info))

    def _op_promote(self, conn: _Connection, req_id: int, msg: list) -> None:
        force = msg[2] is True
        self.failover.check_promotable(force)

        async def run():
            try:
                info = await self.failover.promote(reason="operator command", force=force)
            except FastlockError as exc:  # refused: the node is a standby again
                conn.send(P.packb([req_id, exc.code, str(exc), None]))
            except Exception as exc:  # report, keep serving
                log.exception("promotion failed")
                conn.send(P.packb([req_id, Unavailable.code, f"promotion failed: {exc}", None]))
            else:
                conn.send(P.encode_ok(req_id, info))
            conn.flush()

        asyncio.ensure_future(run())

    def _op_serve_alone(self, conn: _Connection, req_id: int, msg: list) -> None:
        conn.send(P.encode_ok(req_id, self.failover.serve_alone()))

    def _op_status(self, conn: _Connection, req_id: int, msg: list) -> None:
        st = self.status()
        repl = st["replication"]
        if conn.kind == "client" and "standbys" in repl:
            # a primary's standby, its identity and pairing are for operators and peers only
            st["replication"] = {"fenced": repl["fenced"], "serving_alone": repl["serving_alone"]}
        conn.send(P.encode_ok(req_id, st))

    def _op_ping(self, conn: _Connection, req_id: int, msg: list) -> None:
        conn.send(P.encode_ok(req_id, None))

    def status(self) -> dict:
        t = self.table
        st = dict(t.stats())
        st.update(
            role=self.roles.role.value,
            epoch=t.epoch,
            last_token=t.last_token,
            counter=t.counter,
            sessions=len(self._sessions),
            uptime_ms=now_ms() - self._started_ms,
            fsync=self.config.fsync,
            wal=self.wal.stats(),
            version=__version__,
            grace_remaining_ms=self.roles.grace_remaining_ms(now_ms()),
        )
        st["limits"] = {"connections": len(self._sessions), "connections_without_hello": len(self._unready),
                        "max_connections": self.max_connections, "watches": self._watch_count}
        if self.tls is not None:
            st["tls"] = self.tls.status()
        if self.roles.role is Role.STANDBY and self.follower is not None:
            st["replication"] = self.follower.status()
        else:
            st["replication"] = self.source.status()
        return st


def raise_open_files_limit() -> int | None:
    """Raise this process's RLIMIT_NOFILE soft limit to its hard limit (each
    connection is a file descriptor).  Returns the soft limit now in force, or
    None where the platform has no such limit."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (AttributeError, OSError, ValueError):
        return None
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("open-files limit raised from %d to %d", soft, hard)
            soft = hard
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return hard if soft == resource.RLIM_INFINITY else soft


def check_limits(config: ServerConfig) -> None:
    """Refuse nonsensical limits (ValueError naming the field)."""
    positive = ("max_frame_bytes", "max_connections_per_address", "max_output_bytes", "max_replica_output_bytes",
                "max_stream_frame_bytes", "max_waiters", "max_waiters_per_connection", "max_leases",
                "max_watches", "max_watches_per_connection")
    for field_name in positive:
        value = getattr(config, field_name)
        if type(value) is not int or value <= 0:
            raise ValueError(f"{field_name} must be a positive integer, not {value!r}")
    for field_name in ("hello_timeout_ms", "idle_timeout_ms", "max_leases_per_principal",
                       "max_waiters_per_principal", "max_watches_per_principal"):
        value = getattr(config, field_name)
        if type(value) is not int or value < 0:
            raise ValueError(f"{field_name} must be an integer >= 0, not {value!r}")
    if config.max_frame_bytes < P.MIN_MAX_FRAME_BYTES:
        raise ValueError(f"max_frame_bytes must be at least {P.MIN_MAX_FRAME_BYTES} (a request with its names, "
                         f"owner key and ids at their limits), not {config.max_frame_bytes}")
    if config.max_connections is not None and (type(config.max_connections) is not int
                                               or config.max_connections <= 0):
        raise ValueError(f"max_connections must be a positive integer or None, not {config.max_connections!r}")


def _install_loop_policy() -> str:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where available
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


async def _serve(config: ServerConfig) -> int:
    server = LockServer(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if server.tls is not None:  # SIGHUP keeps its default (exit) without TLS
        loop.add_signal_handler(signal.SIGHUP, server.reload_tls)
    await server.start()
    sdnotify.ready(f"{server.role} on {format_address(server.address)}")  # systemd Type=notify
    waiter = asyncio.ensure_future(stop.wait())
    closed = asyncio.ensure_future(server.wait_closed())
    await asyncio.wait([waiter, closed], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("signal received")
    sdnotify.stopping(f"{server.role}: shutting down")
    await server.close()
    waiter.cancel()
    closed.cancel()
    return server.exit_status


def serve(config: ServerConfig, *, use_uvloop: bool = True) -> int:
    """Run a server until SIGTERM/SIGINT.  Returns the process exit status."""
    loop_name = _install_loop_policy() if use_uvloop else "asyncio"
    log.info("event loop: %s", loop_name)
    os.umask(0o077)  # every file this process creates is its owner's only (the data holds owner keys)
    try:
        return asyncio.run(_serve(config))
    except WalCorruption as exc:
        log.critical("refusing to start: %s (start with --repair-wal to cut the damaged tail and "
                     "lose the records after it)", exc)
        return 2
    except (OSError, DataDirInUse, ImportError, InvalidArgument, NodeFileDamaged) as exc:
        log.critical("cannot start: %s", exc)
        return 1
