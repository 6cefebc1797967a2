"""``fastlock serve``: its flags and the :class:`~fastlock.server.ServerConfig` they make."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from ..auth import Credentials, read_token_file
from ..coordination.access import EtcdAccess
from ..logformat import LOG_FORMATS, configure
from ..protocol import REQUEST_OVERHEAD_BYTES
from ..server import ServerConfig, serve
from ..units import DEFAULT_PORT, format_address
from .args import (
    add_server_tls_arguments,
    check_server_tls_arguments,
    count_arg,
    frame_bytes_arg,
    listen_address,
    positive_int,
    positive_seconds_arg,
    reachable_as,
    read_secret,
    seconds_arg,
    server_address,
)
from .config import render

__all__ = ["add_limit_flags", "add_parser", "check_args", "coordinator_access", "limit_config", "serve_command"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to ``fastlock``'s subparsers."""
    s = sub.add_parser("serve", help="run a server")
    s.set_defaults(subparser=s, handler=serve_command)
    s.add_argument("--listen", type=listen_address, default=("127.0.0.1", DEFAULT_PORT), metavar="HOST:PORT",
                   help="address to listen on (default 127.0.0.1:7420; port 0 picks a free port)")
    s.add_argument("--data-dir", default="fastlock-data", metavar="DIR",
                   help="directory for the write-ahead log and snapshots (default ./fastlock-data)")
    s.add_argument("--fsync", choices=("always", "interval", "never"), default="always",
                   help="always: grants are acknowledged after fsync (group commit, default); "
                        "interval: fsync every --fsync-interval-ms; never: leave it to the OS")
    s.add_argument("--fsync-interval-ms", type=positive_int, default=1000, metavar="MS")
    s.add_argument("--snapshot-every", type=positive_int, default=200_000, metavar="RECORDS",
                   help="write a snapshot and drop old WAL segments after this many records")
    s.add_argument("--snapshot-every-bytes", type=count_arg, default=128 << 20, metavar="BYTES",
                   help="also write a snapshot after this many bytes of records, whichever of the two comes first "
                        "(default 134217728: 128 MiB; 0: by records only), so that large key values cannot grow "
                        "the log without bound between snapshots")
    s.add_argument("--credentials", metavar="FILE",
                   help="principals, the keys their tokens prove, and ACLs (TOML; make one with "
                        "`fastlock credentials init DIR`). "
                        "Without it: open mode, loopback only - every connection is a client of every lock "
                        "that may also list and revoke leases (locks, lock, revoke); replication, promote and "
                        "serve-alone are refused")
    s.add_argument("--standby-token-file", metavar="FILE",
                   help="this node's replica token, presented to the primary it follows (needed with "
                        "--standby-of; keep it for a primary too, for when it is restarted as a standby)")
    s.add_argument("--allow-unauthenticated", action="store_true",
                   help="allow open mode (no --credentials) on a non-loopback address (protected mode off)")
    s.add_argument("--auth-failures-before-ban", type=int, default=5, metavar="N",
                   help="after N failed authentications within 60 s, refuse every HELLO from that address for "
                        "1 s, doubling with each ban up to 300 s (default 5; 0: never ban)")
    s.add_argument("--auth-secret-file", metavar="FILE",
                   help="legacy: a shared secret (or env FASTLOCK_AUTH_SECRET) that makes a client of every "
                        "lock; not a replica nor an admin. Prefer --credentials")
    add_server_tls_arguments(
        s, cert_help="serve TLS with this certificate (PEM, with its chain); a standby also presents it to its "
                     "primary, and a node to its --witness (which then must serve TLS too)",
        ca_help="CA certificate(s) that verify client certificates and, on a standby, the primary's, on a "
                "node with --witness, the witness's (default for the latter two: the system's CAs)")
    add_limit_flags(s)
    s.add_argument("--standby-of", type=listen_address, metavar="HOST:PORT",
                   help="run as a standby of this primary: follow its log, answer clients NotPrimary")
    s.add_argument("--failover-after", type=seconds_arg, default=0.0, metavar="SECONDS",
                   help="standby: promote itself after the primary has been silent this long (default: "
                        "only on `fastlock promote`); the primary then fences itself earlier (see --fence-margin). "
                        "On a primary with a replica credential: the window it follows with once it has rejoined "
                        "its promoted standby as a standby")
    s.add_argument("--witness", type=listen_address, metavar="HOST:PORT",
                   help="a pair's third opinion (`fastlock witness`; needs --standby-token-file): the primary keeps "
                        "granting while it hears its standby OR holds the witness's lease, and a standby promotes "
                        "only with the witness's lease for the new epoch (docs/failover-safety.md)")
    s.add_argument("--promotion-grace", type=seconds_arg, default=None, metavar="SECONDS",
                   help="after promotion, grant nothing new for this long (default: the longest TTL seen); "
                        "shorten only when every writer enforces fencing tokens")
    s.add_argument("--fence-margin", type=seconds_arg, default=None, metavar="SECONDS",
                   help="primary: stop granting this long before a silent standby may promote "
                        "(default: a quarter of its failover window)")
    s.add_argument("--deadlock-timeout", type=seconds_arg, default=1.0, metavar="SECONDS",
                   help="fail one waiter of a wait-for cycle (DeadlockDetected) once the cycle is this old "
                        "(default 1 s, as PostgreSQL's deadlock_timeout; 0: no detection)")
    s.add_argument("--name", metavar="NAME", help="this node's name in logs and replication status")
    s.add_argument("--metrics", type=listen_address, metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (needs prometheus_client); "
                        "HOST must be a loopback address unless --metrics-allow-remote")
    s.add_argument("--metrics-allow-remote", action="store_true",
                   help="let --metrics bind a non-loopback address (the endpoint has no authentication)")
    s.add_argument("--reachable-as", type=reachable_as, default=(), metavar="IP:PORT[,IP:PORT...]|any",
                   help="over plain TCP a client's handshake names the endpoint it dialed, and the server "
                        "refuses one that names another than the connection arrived at (a relay: a process on "
                        "a dead node's port, an address a rogue etcd record names); these endpoints are also "
                        "accepted (NAT, port mapping, a TCP proxy); 'any' turns the check off. TLS connections "
                        "are not checked (the certificate binds the server)")
    s.add_argument("--metrics-lock-names", action="store_true",
                   help="export lock names as metric labels (fastlock_lock_contention{lock}); default: none")
    s.add_argument("--wal-writer", choices=("auto", "thread", "inline"), default="auto",
                   help="auto (default): write+fdatasync on the loop itself while one client waits alone, on a "
                        "writer thread when clients wait together; thread: always on the writer thread (the loop "
                        "keeps serving during every sync); inline: always on the loop (stalls everyone during a sync)")
    s.add_argument("--replication", choices=("async", "sync"), default="async",
                   help="async (default): a grant is acknowledged without waiting for the standby (a promoted "
                        "standby then waits a grace period); sync: grants and extends are acknowledged once the "
                        "standby has them too (a promoted standby that was in sync needs no grace)")
    s.add_argument("--sync-ack", choices=("written", "fsynced"), default="fsynced",
                   help="with --replication sync, where the standby has a record when it acknowledges it: "
                        "written (to its WAL file, survives its process dying) or fsynced (default; survives "
                        "its machine losing power)")
    s.add_argument("--sync-timeout", type=positive_seconds_arg, default=2.0, metavar="SECONDS",
                   help="with --replication sync, how long a reply waits for the standby before "
                        "--sync-on-timeout applies (default 2)")
    s.add_argument("--sync-on-timeout", choices=("degrade", "fence"), default="degrade",
                   help="with --replication sync, when the standby has not acknowledged in --sync-timeout, or "
                        "none is attached: degrade (default, as Patroni's synchronous_mode: acknowledge without "
                        "it, as async, until it catches up; logged CRITICAL, in status and metrics) or fence (the "
                        "strict mode, as Patroni's synchronous_mode_strict: waiting replies fail with Unavailable "
                        "and no lock is granted until a standby has caught up)")
    s.add_argument("--sync-standbys", type=positive_int, default=1, metavar="K",
                   help="with --replication sync and --coordinator, how many standbys must have a grant before it "
                        "is acknowledged (default 1); the in-sync set in etcd holds up to K standbys, and only "
                        "they are promoted without a grace period")
    s.add_argument("--coordinator", metavar="etcd://HOST:PORT[,HOST:PORT]/PREFIX",
                   help="let etcd decide which node of the group is primary (any number of standbys; needs "
                        "fastlock[etcd]); every node of the group names the same etcd and prefix")
    s.add_argument("--node-id", metavar="ID",
                   help="with --coordinator, this node's id in etcd (default: the data directory's node-id file)")
    s.add_argument("--advertise", type=server_address, metavar="HOST:PORT",
                   help="with --coordinator, the address the other nodes and clients reach this node at "
                        "(default: --listen's, which must then not be a wildcard address)")
    s.add_argument("--coordinator-ttl", type=positive_seconds_arg, default=2.0, metavar="SECONDS",
                   help="with --coordinator, the etcd lease TTL (whole seconds, default 2): a dead primary is "
                        "replaced after about this long; it stops granting a quarter of it earlier")
    s.add_argument("--coordinator-protocol", choices=("http", "https"), default="http",
                   help="with --coordinator, how to reach etcd (Patroni's etcd3 protocol): https verifies etcd's "
                        "certificate (see docs/etcd.md); default http")
    s.add_argument("--coordinator-cacert", metavar="FILE",
                   help="with --coordinator-protocol https, the CA that signed etcd's certificate (PEM; default: "
                        "the system's trust store)")
    s.add_argument("--coordinator-cert", metavar="FILE",
                   help="with --coordinator-protocol https, this node's client certificate for etcd's "
                        "--client-cert-auth (PEM, with only a subjectAltName: etcd's gateway refuses a CN)")
    s.add_argument("--coordinator-key", metavar="FILE",
                   help="the --coordinator-cert's private key (default: in --coordinator-cert)")
    s.add_argument("--coordinator-user", metavar="NAME",
                   help="with --coordinator, the etcd user to log in as (confine it to the prefix: docs/etcd.md)")
    s.add_argument("--coordinator-password-file", metavar="FILE",
                   help="the --coordinator-user's password, on the file's first line (never given on the command "
                        "line, never logged)")
    s.add_argument("--repair-wal", action="store_true",
                   help="start even if the WAL's last segment has a damaged record in the middle: cut it "
                        "there (records after it are lost; logged at ERROR). Without it the server refuses.")
    s.add_argument("--no-uvloop", action="store_true", help="use the stdlib asyncio loop")
    s.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="the least severe messages logged (any case; default INFO)")
    s.add_argument("--log-format", choices=LOG_FORMATS, default="text", type=str.lower,
                   help="text (default) or json: one object per line with time, level, logger, message "
                        "and the session, client, lock, token, correlation id where they apply")
    s.add_argument("--config", metavar="FILE",
                   help="a TOML file of settings, keyed by flag name without the dashes (or env "
                        "FASTLOCK_CONFIG); every flag is also env FASTLOCK_<FLAG>; a flag wins over the "
                        "environment, which wins over the file (see fastlock.cli.config)")
    s.add_argument("--print-config", action="store_true",
                   help="print the resulting settings and where each came from (TOML), and exit")
    s.add_argument("--shard-map", metavar="FILE|etcd://HOST:PORT/PREFIX",
                   help="serve as one group of a sharded deployment: the shard map (JSON, or TOML if FILE ends in "
                        ".toml; or the map kept in etcd, which the node follows: `fastlock shard init`; "
                        "docs/sharding.md); names whose slots other groups own get WrongShard")
    s.add_argument("--shard-group", metavar="NAME", help="this node's group in --shard-map")
    s.add_argument("--shards", type=positive_int, metavar="N",
                   help="shard-per-core: run N shard processes on ports P..P+N-1 of --listen, data directories "
                        "DIR/shard-K of --data-dir, each a group of its own, under this process, which writes "
                        "their shard map to DIR/shard-map.json and stops them all on SIGTERM/SIGINT")

    return s


def _share(cap_flag: str) -> str:
    """The help text of a per-principal quota's default (see fastlock.server.admission.quota_limits)."""
    return (f"a quarter of {cap_flag}, the anonymous principal's a sixteenth; 0: only the global limit; "
            f"with one client principal at most (no --credentials, say): the global limit)")


def add_limit_flags(s: argparse.ArgumentParser) -> None:
    """``fastlock serve`` flags for the limits on what peers can make the server
    hold (docs/limits.md); defaults are ServerConfig's."""
    d = ServerConfig()
    g = s.add_argument_group("limits", "bounds on what clients and standbys can make the server hold; "
                                       "a request beyond one gets a LimitExceeded error naming it")
    g.add_argument("--max-frame-bytes", type=frame_bytes_arg, default=d.max_frame_bytes, metavar="BYTES",
                   help=f"largest request frame (default {d.max_frame_bytes}, raised to --max-value-bytes + "
                        f"{REQUEST_OVERHEAD_BYTES}); a larger one closes the connection")
    g.add_argument("--max-connections", type=positive_int, default=None, metavar="N",
                   help="connections of client principals (default 10000, lowered to fit the open-files limit), "
                        "and 16 more that only replica and admin principals keep past HELLO; at the limit the "
                        "oldest connection without HELLO is closed to make room, else the new one is refused")
    g.add_argument("--max-connections-per-address", type=positive_int, default=d.max_connections_per_address,
                   metavar="N", help=f"connections from one IP address (default {d.max_connections_per_address})")
    g.add_argument("--hello-timeout", type=seconds_arg, default=d.hello_timeout_ms / 1000, metavar="SECONDS",
                   help=f"close a connection that has not completed HELLO within this time "
                        f"(default {d.hello_timeout_ms / 1000:g}; 0: never)")
    g.add_argument("--idle-timeout", type=seconds_arg, default=0.0, metavar="SECONDS",
                   help="close a connection that sent nothing for this long, unless it waits for a lock, "
                        "watches one or replicates (default 0: never)")
    g.add_argument("--max-output-bytes", type=positive_int, default=d.max_output_bytes, metavar="BYTES",
                   help=f"unread replies after which a client is disconnected (default {d.max_output_bytes})")
    g.add_argument("--max-output-bytes-total", type=positive_int, default=d.max_output_bytes_total,
                   metavar="BYTES", help=f"unread replies of all clients together; past it the connections with the "
                                         f"most are disconnected (default {d.max_output_bytes_total})")
    g.add_argument("--max-output-bytes-per-principal", type=count_arg, default=None, metavar="BYTES",
                   help=f"unread replies of one principal's connections together; past it its connections with "
                        f"the most are disconnected (default {_share('--max-output-bytes-total')}")
    g.add_argument("--max-replica-output-bytes", type=positive_int, default=d.max_replica_output_bytes,
                   metavar="BYTES", help=f"unsent stream after which a standby is disconnected; it resyncs "
                                         f"(default {d.max_replica_output_bytes})")
    g.add_argument("--max-stream-frame-bytes", type=positive_int, default=d.max_stream_frame_bytes,
                   metavar="BYTES", help=f"standby: largest frame accepted from the primary (a snapshot is one "
                                         f"frame; default {d.max_stream_frame_bytes})")
    for flag, what in (("waiters", "waiting acquires"), ("leases", "held leases"), ("watches", "watches")):
        g.add_argument(f"--max-{flag}", type=positive_int, default=getattr(d, f"max_{flag}"), metavar="N",
                       help=f"{what}, all connections together (default {getattr(d, f'max_{flag}')})")
        if flag != "leases":
            g.add_argument(f"--max-{flag}-per-connection", type=positive_int,
                           default=getattr(d, f"max_{flag}_per_connection"), metavar="N",
                           help=f"{what} of one connection (default {getattr(d, f'max_{flag}_per_connection')})")
        g.add_argument(f"--max-{flag}-per-principal", type=count_arg, default=None, metavar="N",
                       help=f"{what} of one principal, all its connections together"
                            f"{' (a waiting acquire reserves its lease)' if flag == 'leases' else ''} "
                            f"(default {_share(f'--max-{flag}')}")
    g.add_argument("--max-keys", type=positive_int, default=d.max_keys, metavar="N",
                   help=f"keys of the key store, all principals together (default {d.max_keys})")
    g.add_argument("--max-keys-per-principal", type=count_arg, default=None, metavar="N",
                   help=f"keys of one principal (default {_share('--max-keys')}")
    g.add_argument("--max-connections-per-principal", type=count_arg, default=None, metavar="N",
                   help=f"connections of one principal past HELLO, from any addresses "
                        f"(default {_share('--max-connections')}")
    g.add_argument("--anonymous-quota-divisor", type=positive_int, default=d.anonymous_quota_divisor, metavar="N",
                   help=f"the anonymous principal's quotas are a principal's divided by N "
                        f"(default {d.anonymous_quota_divisor}: a sixteenth of each global limit)")
    g.add_argument("--max-value-bytes", type=positive_int, default=d.max_value_bytes, metavar="BYTES",
                   help=f"one key's value (default {d.max_value_bytes})")
    g.add_argument("--max-key-bytes", type=positive_int, default=d.max_key_bytes, metavar="BYTES",
                   help=f"bytes of every key's value together (default {d.max_key_bytes})")
    g.add_argument("--max-key-bytes-per-principal", type=count_arg, default=None, metavar="BYTES",
                   help=f"bytes of one principal's key values (default {_share('--max-key-bytes')}")
    g.add_argument("--watch-history", type=positive_int, default=d.watch_history, metavar="N",
                   help=f"holder changes, and key changes, kept for watches that resume from a revision "
                        f"(default {d.watch_history} of each, about 150 bytes each plus a key change's value, "
                        f"at most --max-key-bytes of values; an older revision gets Compacted)")
    g.add_argument("--watch-progress-interval", type=seconds_arg, default=d.watch_progress_interval,
                   metavar="SECONDS", help=f"a resumable watch hears the revision at least this often "
                                           f"(default {d.watch_progress_interval:g} s; 0: never)")
    g.add_argument("--queue-reclaim-window", type=seconds_arg, default=d.queue_reclaim_window, metavar="SECONDS",
                   help=f"after a promotion, the old primary's waiters that ride through keep their places in "
                        f"the lock queues this long; new arrivals queue behind them (default "
                        f"{d.queue_reclaim_window:g} s; 0: no reclaim)")


def limit_config(args: argparse.Namespace) -> dict[str, Any]:
    """ServerConfig fields from the flags of :func:`add_limit_flags`."""
    return dict(
        max_frame_bytes=args.max_frame_bytes,
        max_connections=args.max_connections,
        max_connections_per_address=args.max_connections_per_address,
        hello_timeout_ms=round(args.hello_timeout * 1000),
        idle_timeout_ms=round(args.idle_timeout * 1000),
        max_output_bytes=args.max_output_bytes,
        max_output_bytes_total=args.max_output_bytes_total,
        max_output_bytes_per_principal=args.max_output_bytes_per_principal,
        max_replica_output_bytes=args.max_replica_output_bytes,
        max_stream_frame_bytes=args.max_stream_frame_bytes,
        max_waiters=args.max_waiters,
        max_waiters_per_connection=args.max_waiters_per_connection,
        max_leases=args.max_leases,
        max_watches=args.max_watches,
        max_watches_per_connection=args.max_watches_per_connection,
        max_leases_per_principal=args.max_leases_per_principal,
        max_waiters_per_principal=args.max_waiters_per_principal,
        max_watches_per_principal=args.max_watches_per_principal,
        max_keys=args.max_keys,
        max_keys_per_principal=args.max_keys_per_principal,
        max_connections_per_principal=args.max_connections_per_principal,
        anonymous_quota_divisor=args.anonymous_quota_divisor,
        max_value_bytes=args.max_value_bytes,
        max_key_bytes=args.max_key_bytes,
        max_key_bytes_per_principal=args.max_key_bytes_per_principal,
        watch_history=args.watch_history,
        watch_progress_interval=args.watch_progress_interval,
        queue_reclaim_window=args.queue_reclaim_window,
    )


def check_args(args: argparse.Namespace) -> None:
    """Refuse combinations of flags no single flag's type can see (exits 2 with the reason)."""
    if args.standby_of is not None and args.standby_token_file is None and not args.tls_cert:
        args.subparser.error("--standby-of needs --standby-token-file (or a --tls-cert that the primary's "
                             "credentials map to a replica principal): a standby authenticates to its "
                             "primary as a replica principal (see `fastlock credentials init`)")
    check_server_tls_arguments(args, args.subparser)
    if args.coordinator:
        from ..coordination import parse_coordinator  # (no httpx needed to check the URL)

        try:
            parse_coordinator(args.coordinator)
        except ValueError as exc:
            args.subparser.error(str(exc))
    if args.coordinator and args.standby_of is not None:
        args.subparser.error("--coordinator and --standby-of exclude each other: etcd names the primary to follow")
    if args.sync_standbys != 1 and not (args.coordinator and args.replication == "sync"):
        args.subparser.error("--sync-standbys applies only with --replication sync and --coordinator")
    if args.coordinator and args.standby_token_file is None and not args.tls_cert:
        args.subparser.error("--coordinator needs --standby-token-file (or a --tls-cert that the credentials map "
                             "to a replica principal): each node follows the primary as a replica principal")
    if (args.node_id is not None or args.advertise is not None) and not args.coordinator:
        args.subparser.error("--node-id and --advertise only apply with --coordinator")
    access = coordinator_access(args)
    if access != EtcdAccess() and not args.coordinator and not (args.shard_map or "").startswith("etcd://"):
        args.subparser.error("--coordinator-protocol, -cacert, -cert, -key, -user and -password-file only apply "
                             "with --coordinator (or a --shard-map kept in etcd)")
    try:
        access.check()
    except ValueError as exc:
        args.subparser.error(str(exc))
    if args.node_id is not None and (not args.node_id or not args.node_id.isprintable() or "/" in args.node_id):
        args.subparser.error(f"--node-id must be printable characters without '/', not {args.node_id!r}")
    if args.coordinator and args.coordinator_ttl != int(args.coordinator_ttl):
        args.subparser.error(f"--coordinator-ttl is whole seconds (etcd leases are), not {args.coordinator_ttl}")
    if args.coordinator and args.advertise is None and args.listen[0] in ("0.0.0.0", "::", ""):
        args.subparser.error(f"--coordinator with --listen {args.listen[0]} needs --advertise HOST:PORT: etcd "
                             f"tells the other nodes where this one is, and a wildcard address reaches nothing")
    if (args.shard_map is None) != (args.shard_group is None):
        args.subparser.error("--shard-map and --shard-group go together: the map, and this node's group in it")
    if args.shards is not None and (args.shard_map is not None or args.coordinator or args.standby_of):
        args.subparser.error("--shards runs its own shard processes and writes their map: it excludes "
                             "--shard-map, --coordinator and --standby-of")
    if args.shards is not None and args.listen[0] in ("0.0.0.0", "::", ""):
        args.subparser.error(f"--shards with --listen {args.listen[0]}: the shard map names each shard's address "
                             f"for clients, and a wildcard address reaches nothing; listen on the host's address")
    if args.witness is not None and (args.standby_token_file is None or args.coordinator):
        args.subparser.error("--witness needs --standby-token-file (the node proves its replica token to the "
                             "witness) and applies to a pair, not to a node run with --coordinator")
    if args.failover_after and args.standby_of is None and args.standby_token_file is None and not args.tls_cert:
        args.subparser.error("--failover-after only applies to a standby (it needs --standby-of, or a replica "
                             "credential with which a primary rejoins its promoted standby as a standby): a primary "
                             "learns its standby's failover window from the standby itself")


def coordinator_access(args: argparse.Namespace) -> EtcdAccess:
    """The way to etcd the ``--coordinator-*`` flags name (no file is read here)."""
    return EtcdAccess(args.coordinator_protocol, args.coordinator_cacert, args.coordinator_cert,
                      args.coordinator_key, args.coordinator_user, args.coordinator_password_file)


async def _read_etcd_map(url: str, access: EtcdAccess) -> Any:
    """The shard map kept in etcd at ``url`` (``etcd://HOST:PORT/PREFIX``).  :raises RuntimeError: none there."""
    from ..coordination.shardmap import load_from_etcd

    stored = await load_from_etcd(url, access)
    try:
        found = await stored.read()
    finally:
        await stored.gateway.close()
    if found is None:
        raise RuntimeError(f"no map at {stored.key} (`fastlock shard init` writes one)")
    return found[0]


def serve_command(args: argparse.Namespace) -> int:
    """``fastlock serve``: run a server until it is stopped; returns the exit status.

    The server logs its own errors (a damaged WAL, an address in use) and
    exits non-zero; unreadable credential files print one line and exit 1."""
    check_args(args)
    if args.print_config:
        print(render(args.subparser, args, getattr(args, "argv", ()), getattr(args, "config_sources", {})))
        return 0
    configure(args.log_level, args.log_format, sys.stderr)
    shard_map: Any = args.shard_map
    if shard_map is not None and shard_map.startswith("etcd://"):  # the map kept in etcd, followed
        try:
            shard_map = asyncio.run(_read_etcd_map(shard_map, coordinator_access(args)))
        except (OSError, ValueError, RuntimeError) as exc:
            print(f"fastlock serve: the shard map in etcd: {exc}", file=sys.stderr)
            return 1
    try:
        secret = read_secret(args.auth_secret_file)
        credentials = Credentials.load(args.credentials) if args.credentials else None
        standby_token = read_token_file(args.standby_token_file) if args.standby_token_file else None
    except (OSError, ValueError) as exc:
        print(f"fastlock serve: {exc}", file=sys.stderr)
        return 1
    config = ServerConfig(
        host=args.listen[0],
        port=args.listen[1],
        data_dir=args.data_dir,
        fsync=args.fsync,
        fsync_interval_ms=args.fsync_interval_ms,
        snapshot_every=args.snapshot_every,
        snapshot_every_bytes=args.snapshot_every_bytes,
        auth_secret=secret,
        credentials=credentials,
        standby_token=standby_token,
        allow_unauthenticated=args.allow_unauthenticated,
        auth_failures_before_ban=max(0, args.auth_failures_before_ban),
        **limit_config(args),
        standby_of=args.standby_of,
        failover_after_ms=int(args.failover_after * 1000),
        witness=args.witness,
        promotion_grace_ms=None if args.promotion_grace is None else int(args.promotion_grace * 1000),
        fence_margin_ms=None if args.fence_margin is None else int(args.fence_margin * 1000),
        deadlock_timeout_ms=int(args.deadlock_timeout * 1000),
        name=args.name,
        repair_wal=args.repair_wal,
        wal_writer=args.wal_writer,
        replication=args.replication,
        sync_ack=args.sync_ack,
        sync_timeout_ms=max(1, round(args.sync_timeout * 1000)),
        sync_on_timeout=args.sync_on_timeout,
        sync_standbys=args.sync_standbys,
        coordinator=args.coordinator,
        node_id=args.node_id,
        advertise=None if args.advertise is None else format_address(args.advertise),
        coordinator_ttl_ms=max(1000, -(-round(args.coordinator_ttl * 1000) // 1000) * 1000),
        coordinator_access=coordinator_access(args),
        metrics=args.metrics,
        metrics_allow_remote=args.metrics_allow_remote,
        metrics_lock_names=args.metrics_lock_names,
        reachable_as=args.reachable_as,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        tls_client_auth=args.tls_client_auth,
        tls_handshake_timeout_ms=int(args.tls_handshake_timeout * 1000),
        shard_map=shard_map,
        shard_group=args.shard_group,
        shard_map_etcd=args.shard_map if shard_map is not args.shard_map else None,
    )
    if args.shards is not None:  # shard-per-core (fastlock.cli.shards)
        from .shards import run_shards

        return run_shards(config, args.shards, args)
    return serve(config, use_uvloop=not args.no_uvloop)
