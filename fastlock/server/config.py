"""Settings of one server process: :class:`ServerConfig` and :func:`check_limits`.

The fsync mode and the write-ahead log's writer are enums
(:class:`FsyncMode`, :class:`WalWriter`); a plain string naming a member
("always", "thread", ...) is accepted where a config is built, as the command
line passes them, and turned into the member.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .. import protocol as P
from ..auth import Credentials
from ..coordination.access import EtcdAccess
from ..replication.syncrep import ReplicationMode, SyncAck, SyncOnTimeout, SyncSettings, parse_mode
from ..tls import DEFAULT_HANDSHAKE_TIMEOUT
from ..units import DEFAULT_PORT


class FsyncMode(str, enum.Enum):
    """When the write-ahead log is fsynced (see :mod:`fastlock.wal`)."""

    #: before a grant is acknowledged (group commit): no acknowledged grant is lost in a crash
    ALWAYS = "always"
    #: every ``fsync_interval_ms`` milliseconds: a crash may lose that much
    INTERVAL = "interval"
    #: never (the OS writes back): for tests and benchmarks
    NEVER = "never"


class WalWriter(str, enum.Enum):
    """Where the write-ahead log's group commit writes and fsyncs."""

    #: on a writer thread: the event loop keeps serving during an fsync
    THREAD = "thread"
    #: on the event loop itself
    INLINE = "inline"
    #: on the event loop while one client waits alone, on the writer thread otherwise
    AUTO = "auto"


def _member(cls: type[enum.Enum], value: Any, field_name: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{field_name} must be one of {choices}, not {value!r}") from None


@dataclass
class ServerConfig:
    """Settings of one server process.

    Units are in the names (``_ms``: milliseconds, ``_bytes``: bytes; other
    limits are counts).  The limits (from ``max_frame_bytes`` to
    ``max_watches_per_principal``) bound what peers can make the server hold;
    docs/limits.md gives each one's flag, default and what happens beyond it.
    A per-principal quota of None is the default share of its global cap (a
    quarter; the anonymous principal's a further ``anonymous_quota_divisor``:
    a sixteenth), 0 none beyond the global cap.

    :raises ValueError: ``fsync`` or ``wal_writer`` that names no mode (at
        construction); (from :class:`~fastlock.server.LockServer`) a limit that
        is not a positive integer (>= 0 for timeouts and quotas).
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    data_dir: str = "fastlock-data"
    fsync: FsyncMode = FsyncMode.ALWAYS  # a member's string value is accepted too
    fsync_interval_ms: int = 1000
    snapshot_every: int = 200_000
    snapshot_every_bytes: int = 128 << 20  # also snapshot after this many WAL bytes (0: by records only)
    auth_secret: str | None = None  # legacy shared secret: the client principal "shared-secret", every name
    credentials: Credentials | None = None  # principals (None: open mode, or only the shared secret)
    allow_unauthenticated: bool = False  # open mode on a non-loopback address (protected mode off)
    standby_token: str | None = None  # this node's replica token, to follow a primary
    auth_failures_before_ban: int = 5  # failed HELLOs from one address before it is banned (0: never)
    # -- limits: everything a peer can make the server hold (docs/limits.md) --
    max_frame_bytes: int = P.DEFAULT_MAX_FRAME_BYTES  # one request, bytes
    max_connections: int | None = None  # None: 10,000, lowered to fit the open-files limit
    max_connections_per_address: int = 1_000  # per client IP address
    hello_timeout_ms: int = 5_000  # close a connection that has not completed HELLO by then
    idle_timeout_ms: int = 0  # close a connection silent this long (0: never; see admission.py)
    max_output_bytes: int = 32 << 20  # replies a client leaves unread before it is dropped
    max_output_bytes_total: int = 256 << 20  # replies all clients together leave unread (admission.output_share)
    # ... of one principal's connections together: None a quarter of the total (anonymous: a sixteenth), 0 none
    max_output_bytes_per_principal: int | None = None
    max_replica_output_bytes: int = 64 << 20  # stream a standby leaves unread before it is dropped
    max_stream_frame_bytes: int = 256 << 20  # standby: one frame of the primary's stream
    max_waiters: int = 100_000  # waiting acquires, all connections together
    max_waiters_per_connection: int = 10_000
    max_leases: int = 1_000_000  # held leases
    max_watches: int = 100_000  # WATCH subscriptions, all connections together
    max_watches_per_connection: int = 10_000
    # per-principal quotas (fastlock.server.admission.quota_limits): None is a quarter of the global
    # cap (the anonymous principal: a sixteenth), 0 none; off by default with a single principal
    max_leases_per_principal: int | None = None  # leases plus waiting acquires (each reserves its lease)
    max_waiters_per_principal: int | None = None
    max_watches_per_principal: int | None = None
    max_keys: int = 100_000  # keys of the key store (fastlock.server.keys), all principals together
    max_keys_per_principal: int | None = None
    max_connections_per_principal: int | None = None  # connections that completed HELLO
    anonymous_quota_divisor: int = 4  # the anonymous principal's quotas: a principal's divided by this
    max_value_bytes: int = 64 << 10  # one key's value, bytes
    max_key_bytes: int = 256 << 20  # bytes of every key's value together
    max_key_bytes_per_principal: int | None = None  # bytes of one principal's key values
    standby_of: tuple[str, int] | None = None  # run as a standby of this primary
    failover_after_ms: int = 0  # standby: promote after this much primary silence (0: on command only)
    witness: tuple[str, int] | None = None  # the pair's witness (fastlock.replication.witness), or None
    promotion_grace_ms: int | None = None  # after promotion, no grants for this long (None: longest TTL seen)
    fence_margin_ms: int | None = None  # primary: stop granting this long before a standby may promote
    deadlock_timeout_ms: int = 1000  # a wait-for cycle this old is broken (0: no detection; PostgreSQL's default)
    name: str | None = None  # this node's name in logs and replication status
    repair_wal: bool = False  # cut a damaged last WAL segment instead of refusing to start
    wal_writer: WalWriter = WalWriter.AUTO  # a member's string value is accepted too
    metrics: tuple[str, int] | None = None  # serve Prometheus metrics on this address
    metrics_allow_remote: bool = False  # metrics may bind a non-loopback address (fastlock.metrics)
    metrics_lock_names: bool = False  # metrics may carry lock names in labels (fastlock.metrics)
    #: endpoints ("ip:port") plain-TCP clients may dial to reach this node besides the one their
    #: connection arrives at (NAT, port mapping); ("any",): any (the handshake's endpoint binding off)
    reachable_as: tuple[str, ...] = ()
    # TLS (see fastlock.tls): this node's certificate and key serve clients and, on a standby,
    # are presented to the primary; the CA verifies client certificates and the primary's
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_client_auth: str = "none"  # none | optional | required (mutual TLS)
    tls_handshake_timeout_ms: int = int(DEFAULT_HANDSHAKE_TIMEOUT * 1000)
    # synchronous replication (fastlock.replication.syncrep): "async" (default) or "sync"; a string is accepted
    replication: ReplicationMode = ReplicationMode.ASYNC
    sync_ack: SyncAck = SyncAck.FSYNCED  # where the standby has a record when it acknowledges it
    sync_timeout_ms: int = 2000  # the oldest reply waits this long for the standby, then sync_on_timeout
    sync_on_timeout: SyncOnTimeout = SyncOnTimeout.DEGRADE  # "degrade" (to async) or "fence" (strict: hold grants)
    sync_standbys: int = 1  # with a coordinator: standbys that must have a reply (k, fastlock.replication.groupsync)
    # etcd decides the primary (fastlock.server.coordinated): etcd://HOST:PORT[,HOST:PORT]/PREFIX, None: a pair
    coordinator: str | None = None
    node_id: str | None = None  # this node's id in etcd (None: the data directory's node-id file)
    advertise: str | None = None  # "host:port" others reach this node at (None: the bound address)
    coordinator_ttl_ms: int = 2000  # the etcd lease TTL (whole seconds)
    coordinator_access: EtcdAccess | None = None  # etcd over TLS, as an etcd user (None: plain HTTP, no user)
    # resuming watches (fastlock.server.watchlog): holder changes kept, seconds between progress notices (0: none)
    watch_history: int = 100_000
    watch_progress_interval: float = 10.0
    # a promoted primary keeps the old primary's waiters' places this long, seconds (fastlock.server.reclaim; 0: not)
    queue_reclaim_window: float = 5.0
    # sharding (fastlock.server.sharded): the shard map (a ShardMap, or a map file's path) and this
    # node's group in it; both None: not sharded (every name is served)
    shard_map: Any = None
    shard_group: str | None = None
    shard_map_etcd: str | None = None  # etcd://HOST:PORT/PREFIX whose map the node follows (newer epochs)

    def __post_init__(self) -> None:
        self.fsync = _member(FsyncMode, self.fsync, "fsync")
        self.wal_writer = _member(WalWriter, self.wal_writer, "wal_writer")
        self.replication = parse_mode(self.replication)
        settings = SyncSettings(self.sync_ack, self.sync_timeout_ms, self.sync_on_timeout)  # checks all three
        self.sync_ack, self.sync_on_timeout = settings.ack, settings.on_timeout
        if type(self.sync_standbys) is not int or self.sync_standbys < 1:
            raise ValueError(f"sync_standbys must be a positive integer, not {self.sync_standbys!r}")

    def sync_settings(self) -> SyncSettings | None:
        """The synchronous replication settings, or None with ``replication="async"``."""
        if self.replication is not ReplicationMode.SYNC:
            return None
        return SyncSettings(self.sync_ack, self.sync_timeout_ms, self.sync_on_timeout)


def check_limits(config: ServerConfig) -> None:
    """Refuse nonsensical limits (ValueError naming the field)."""
    positive = ("max_frame_bytes", "max_connections_per_address", "max_output_bytes", "max_output_bytes_total",
                "max_replica_output_bytes",
                "max_stream_frame_bytes", "max_waiters", "max_waiters_per_connection", "max_leases",
                "max_watches", "max_watches_per_connection", "max_keys", "max_value_bytes",
                "max_key_bytes", "anonymous_quota_divisor", "watch_history")
    for field_name in positive:
        value = getattr(config, field_name)
        if type(value) is not int or value <= 0:
            raise ValueError(f"{field_name} must be a positive integer, not {value!r}")
    for field_name in ("hello_timeout_ms", "idle_timeout_ms", "deadlock_timeout_ms"):
        value = getattr(config, field_name)
        if type(value) is not int or value < 0:
            raise ValueError(f"{field_name} must be an integer >= 0, not {value!r}")
    for field_name in ("max_leases_per_principal", "max_waiters_per_principal", "max_watches_per_principal",
                       "max_keys_per_principal", "max_connections_per_principal", "max_key_bytes_per_principal",
                       "max_output_bytes_per_principal"):
        value = getattr(config, field_name)
        if value is not None and (type(value) is not int or value < 0):
            raise ValueError(f"{field_name} must be an integer >= 0 or None (the default share), not {value!r}")
    if config.max_frame_bytes < P.MIN_MAX_FRAME_BYTES:
        raise ValueError(f"max_frame_bytes must be at least {P.MIN_MAX_FRAME_BYTES} (a request with its names, "
                         f"owner key and ids at their limits), not {config.max_frame_bytes}")
    if config.max_connections is not None and (type(config.max_connections) is not int
                                               or config.max_connections <= 0):
        raise ValueError(f"max_connections must be a positive integer or None, not {config.max_connections!r}")
