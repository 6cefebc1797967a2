"""The ``fastlock`` command (also ``python -m fastlock``).

Subcommands::

    fastlock serve [--listen HOST:PORT] [--data-dir DIR] [--fsync always|interval|never] ...
    fastlock demo                     a server + worker processes writing a fenced ledger
    fastlock status [--server HOST:PORT]
    fastlock wal dump [--lock NAME] DIR
    fastlock run NAME --ttl S [--wait S] [--server HOST:PORT] -- CMD ...
    fastlock promote --server HOST:PORT [--force]
    fastlock serve-alone --server HOST:PORT

TLS: ``serve`` takes ``--tls-cert/--tls-key`` (and ``--tls-ca`` with
``--tls-client-auth`` for mutual TLS); the client commands (``status``,
``promote``, ``serve-alone``, ``run``) take ``--tls-ca/--tls-cert/--tls-key``
or the environment variables ``FASTLOCK_TLS_CA``, ``FASTLOCK_TLS_CERT``,
``FASTLOCK_TLS_KEY`` (see :func:`add_client_tls_arguments`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys

from . import __version__


DEFAULT_PORT = 7420


def _host_port(value: str, default_port: int | None) -> tuple[str, int]:
    """Parse ``HOST:PORT``, ``[IPv6]:PORT`` (and, with ``default_port``, a bare
    ``HOST`` or ``[IPv6]``); raise argparse.ArgumentTypeError with the reason."""
    value = value.strip()
    if value.startswith("[") and value.endswith("]") and default_port is not None:
        host, port = value, str(default_port)
    else:
        host, sep, port = value.rpartition(":")
        if not sep:
            if default_port is None:
                raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
            host, port = value, str(default_port)
    if host.startswith("[") != host.endswith("]"):
        raise argparse.ArgumentTypeError(f"unbalanced brackets in {value!r}")
    if host.startswith("["):
        host = host[1:-1]
    elif ":" in host:
        raise argparse.ArgumentTypeError(f"an IPv6 address needs brackets, as [::1]:{DEFAULT_PORT}; got {value!r}")
    try:
        p = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port {port!r} in {value!r}") from None
    if not 0 <= p <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range (0-65535): {p}")
    return host or "127.0.0.1", p


def _listen(value: str) -> tuple[str, int]:
    """argparse type: ``HOST:PORT`` or ``[IPv6]:PORT`` to listen on (port 0: any free port)."""
    return _host_port(value, None)


def _server(value: str) -> tuple[str, int]:
    """argparse type: a server to talk to, ``HOST[:PORT]`` or ``[IPv6][:PORT]`` (default port 7420)."""
    host, port = _host_port(value, DEFAULT_PORT)
    if port == 0:
        raise argparse.ArgumentTypeError(f"port 0 is not a server's port: {value!r}")
    return host, port


def _fmt_addr(addr: tuple[str, int]) -> str:
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _positive_int(value: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _frame_bytes(value: str) -> int:
    from . import protocol as P

    v = _positive_int(value)
    if v < P.MIN_MAX_FRAME_BYTES:
        raise argparse.ArgumentTypeError(f"expected at least {P.MIN_MAX_FRAME_BYTES} (a request with its names, "
                                         f"owner key and ids at their limits), got {v}")
    return v


def seconds_arg(value: str) -> float:
    """argparse type: a finite number of seconds, 0 <= s < 1 year."""
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not (v >= 0 and v < 86400 * 365):
        raise argparse.ArgumentTypeError(f"expected 0 <= seconds < 1 year, got {value!r}")
    return v


def _count_arg(value: str) -> int:
    """argparse type: an integer >= 0 (0: no limit / off, where the flag says so)."""
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _add_limit_flags(s: argparse.ArgumentParser) -> None:
    """``fastlock serve`` flags for the limits on what peers can make the server
    hold (README "Limits"); defaults are ServerConfig's."""
    from .server import ServerConfig

    d = ServerConfig()
    g = s.add_argument_group("limits", "bounds on what clients and standbys can make the server hold; "
                                       "a request beyond one gets a LimitExceeded error naming it")
    g.add_argument("--max-frame-bytes", type=_frame_bytes, default=d.max_frame_bytes, metavar="BYTES",
                   help=f"largest request frame (default {d.max_frame_bytes}); a larger one closes the connection")
    g.add_argument("--max-connections", type=_positive_int, default=None, metavar="N",
                   help="connections in all (default 10000, lowered to fit the open-files limit); at the limit "
                        "the oldest connection without HELLO is closed to make room, else the new one is refused")
    g.add_argument("--max-connections-per-address", type=_positive_int, default=d.max_connections_per_address,
                   metavar="N", help=f"connections from one IP address (default {d.max_connections_per_address})")
    g.add_argument("--hello-timeout", type=seconds_arg, default=d.hello_timeout_ms / 1000, metavar="SECONDS",
                   help=f"close a connection that has not completed HELLO within this time "
                        f"(default {d.hello_timeout_ms / 1000:g}; 0: never)")
    g.add_argument("--idle-timeout", type=seconds_arg, default=0.0, metavar="SECONDS",
                   help="close a connection that sent nothing for this long, unless it waits for a lock, "
                        "watches one or replicates (default 0: never)")
    g.add_argument("--max-output-bytes", type=_positive_int, default=d.max_output_bytes, metavar="BYTES",
                   help=f"unread replies after which a client is disconnected (default {d.max_output_bytes})")
    g.add_argument("--max-replica-output-bytes", type=_positive_int, default=d.max_replica_output_bytes,
                   metavar="BYTES", help=f"unsent stream after which a standby is disconnected; it resyncs "
                                         f"(default {d.max_replica_output_bytes})")
    g.add_argument("--max-stream-frame-bytes", type=_positive_int, default=d.max_stream_frame_bytes,
                   metavar="BYTES", help=f"standby: largest frame accepted from the primary (a snapshot is one "
                                         f"frame; default {d.max_stream_frame_bytes})")
    for flag, what in (("waiters", "waiting acquires"), ("leases", "held leases"), ("watches", "watches")):
        g.add_argument(f"--max-{flag}", type=_positive_int, default=getattr(d, f"max_{flag}"), metavar="N",
                       help=f"{what}, all connections together (default {getattr(d, f'max_{flag}')})")
        if flag != "leases":
            g.add_argument(f"--max-{flag}-per-connection", type=_positive_int,
                           default=getattr(d, f"max_{flag}_per_connection"), metavar="N",
                           help=f"{what} of one connection (default {getattr(d, f'max_{flag}_per_connection')})")
        g.add_argument(f"--max-{flag}-per-principal", type=_count_arg, default=0, metavar="N",
                       help=f"{what} of one principal, all its connections together (default 0: only the "
                            f"global limit)")


def _limit_config(args: argparse.Namespace) -> dict:
    """ServerConfig fields from the flags of :func:`_add_limit_flags`."""
    return dict(
        max_frame_bytes=args.max_frame_bytes,
        max_connections=args.max_connections,
        max_connections_per_address=args.max_connections_per_address,
        hello_timeout_ms=round(args.hello_timeout * 1000),
        idle_timeout_ms=round(args.idle_timeout * 1000),
        max_output_bytes=args.max_output_bytes,
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
    )


def add_client_tls_arguments(p: argparse.ArgumentParser) -> None:
    """Add a client command's TLS options (each falls back to an environment variable)."""
    g = p.add_argument_group("TLS (a --tls-* file or FASTLOCK_TLS_* variable turns TLS on)")
    g.add_argument("--tls", action="store_true",
                   help="connect over TLS, verifying the server against the system's CAs or --tls-ca "
                        "(or env FASTLOCK_TLS=1)")
    g.add_argument("--tls-ca", metavar="FILE", help="CA certificate(s) to verify the server (or env FASTLOCK_TLS_CA)")
    g.add_argument("--tls-cert", metavar="FILE",
                   help="client certificate, for servers that require one (or env FASTLOCK_TLS_CERT)")
    g.add_argument("--tls-key", metavar="FILE", help="its private key (or env FASTLOCK_TLS_KEY)")
    g.add_argument("--tls-server-name", metavar="NAME",
                   help="the name the server's certificate must carry (default: the host of --server; "
                        "or env FASTLOCK_TLS_SERVER_NAME)")


def client_tls_options(args: argparse.Namespace) -> dict:
    """The TLS keyword arguments of :func:`fastlock.connect` from a command's
    options (see :func:`add_client_tls_arguments`) and the environment."""
    env = os.environ

    def pick(value: str | None, var: str) -> str | None:
        return value or env.get(var) or None

    options = {
        "tls_ca": pick(args.tls_ca, "FASTLOCK_TLS_CA"),
        "tls_cert": pick(args.tls_cert, "FASTLOCK_TLS_CERT"),
        "tls_key": pick(args.tls_key, "FASTLOCK_TLS_KEY"),
        "server_hostname": pick(args.tls_server_name, "FASTLOCK_TLS_SERVER_NAME"),
    }
    if args.tls or env.get("FASTLOCK_TLS", "") not in ("", "0") or any(options.values()):
        return {"tls": True, **options}
    return {}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastlock", description="fastlock lock server and tools")
    parser.add_argument("--version", action="version", version=f"fastlock {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run a server")
    s.set_defaults(subparser=s)
    s.add_argument("--listen", type=_listen, default=("127.0.0.1", 7420), metavar="HOST:PORT",
                   help="address to listen on (default 127.0.0.1:7420; port 0 picks a free port)")
    s.add_argument("--data-dir", default="fastlock-data", metavar="DIR",
                   help="directory for the write-ahead log and snapshots (default ./fastlock-data)")
    s.add_argument("--fsync", choices=("always", "interval", "never"), default="always",
                   help="always: grants are acknowledged after fsync (group commit, default); "
                        "interval: fsync every --fsync-interval-ms; never: leave it to the OS")
    s.add_argument("--fsync-interval-ms", type=_positive_int, default=1000, metavar="MS")
    s.add_argument("--snapshot-every", type=_positive_int, default=200_000, metavar="RECORDS",
                   help="write a snapshot and drop old WAL segments after this many records")
    s.add_argument("--auth-secret-file", metavar="FILE",
                   help="file holding a shared secret clients must present (or env FASTLOCK_AUTH_SECRET)")
    s.add_argument("--tls-cert", metavar="FILE",
                   help="serve TLS with this certificate (PEM, with its chain); a standby also presents it "
                        "to its primary")
    s.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (default: in --tls-cert)")
    s.add_argument("--tls-ca", metavar="FILE",
                   help="CA certificate(s) that verify client certificates and, on a standby, the primary's "
                        "(default for the latter: the system's CAs)")
    s.add_argument("--tls-client-auth", choices=("none", "optional", "required"), default="none",
                   help="client certificates: none (default), optional (verified if sent), required "
                        "(mutual TLS); needs --tls-ca")
    s.add_argument("--tls-handshake-timeout", type=seconds_arg, default=10.0, metavar="SECONDS",
                   help="drop a connection whose TLS handshake takes longer (default 10)")
    _add_limit_flags(s)
    s.add_argument("--standby-of", type=_listen, metavar="HOST:PORT",
                   help="run as a standby of this primary: follow its log, answer clients NotPrimary")
    s.add_argument("--failover-after", type=seconds_arg, default=0.0, metavar="SECONDS",
                   help="standby: promote itself after the primary has been silent this long (default: "
                        "only on `fastlock promote`); the primary then fences itself earlier (see --fence-margin)")
    s.add_argument("--promotion-grace", type=seconds_arg, default=None, metavar="SECONDS",
                   help="after promotion, grant nothing new for this long (default: the longest TTL seen); "
                        "shorten only when every writer enforces fencing tokens")
    s.add_argument("--fence-margin", type=seconds_arg, default=None, metavar="SECONDS",
                   help="primary: stop granting this long before a silent standby may promote "
                        "(default: a quarter of its failover window)")
    s.add_argument("--name", metavar="NAME", help="this node's name in logs and replication status")
    s.add_argument("--metrics", type=_listen, metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (needs prometheus_client)")
    s.add_argument("--wal-writer", choices=("thread", "inline"), default="thread",
                   help="thread (default): write+fsync on a writer thread while the loop keeps serving; "
                        "inline: on the loop itself (lower latency when idle, stalls everyone during an fsync)")
    s.add_argument("--repair-wal", action="store_true",
                   help="start even if the WAL's last segment has a damaged record in the middle: cut it "
                        "there (records after it are lost; logged at ERROR). Without it the server refuses.")
    s.add_argument("--no-uvloop", action="store_true", help="use the stdlib asyncio loop")
    s.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    d = sub.add_parser("demo", help="start a server and workers that write a fenced SQLite ledger")
    d.add_argument("args", nargs=argparse.REMAINDER)

    st = sub.add_parser("status", help="show one node's role, epoch, counters and replication state")
    st.add_argument("--server", type=_server, default=("127.0.0.1", DEFAULT_PORT), metavar="HOST:PORT",
                    help="the node to ask (default 127.0.0.1:7420); a standby answers for itself, "
                         "no redirect to its primary")
    st.add_argument("--auth-secret-file", metavar="FILE")
    add_client_tls_arguments(st)

    pr = sub.add_parser("promote", help="promote a standby to primary (new epoch, grace period)")
    pr.add_argument("--server", type=_server, required=True, metavar="HOST:PORT", help="the standby")
    pr.add_argument("--force", action="store_true",
                    help="the operator's word that the old primary is dead: promote even if it cannot "
                         "confirm stepping down and does not fence itself, or if this standby never "
                         "synchronised (its data dir must then be current)")
    pr.add_argument("--timeout", type=seconds_arg, default=300.0, metavar="SECONDS",
                    help="how long to wait for the promotion, which may wait out the old primary's "
                         "fence (default 300)")
    pr.add_argument("--auth-secret-file", metavar="FILE")
    add_client_tls_arguments(pr)

    sa = sub.add_parser("serve-alone", help="tell a primary its standby is gone: stop fencing itself")
    sa.add_argument("--server", type=_server, required=True, metavar="HOST:PORT", help="the primary")
    sa.add_argument("--auth-secret-file", metavar="FILE")
    add_client_tls_arguments(sa)

    from . import runner

    runner.add_run_parser(sub)

    w = sub.add_parser("wal", help="inspect a write-ahead log")
    wsub = w.add_subparsers(dest="wal_command", required=True)
    wd = wsub.add_parser("dump", help="print the grant/release/expiry history",
                         description="Print a data directory's WAL as audit lines. Exits 1 with a one-line "
                                     "message if DIR is missing, is not a directory, holds no WAL segment or "
                                     "snapshot at all (most likely the wrong directory), or is corrupt "
                                     "(after printing what precedes the damage). A WAL with no records prints "
                                     "nothing and exits 0.")
    wd.add_argument("--lock", metavar="NAME", help="only this lock")
    wd.add_argument("directory", metavar="DIR", help="the server's --data-dir")
    return parser


def _read_secret(path: str | None) -> str | None:
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    return os.environ.get("FASTLOCK_AUTH_SECRET") or None


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from .server import ServerConfig, serve

    _setup_logging(args.log_level)
    try:
        secret = _read_secret(args.auth_secret_file)
    except (OSError, ValueError) as exc:
        print(f"fastlock serve: cannot read the auth secret: {exc}", file=sys.stderr)
        return 1
    config = ServerConfig(
        host=args.listen[0],
        port=args.listen[1],
        data_dir=args.data_dir,
        fsync=args.fsync,
        fsync_interval_ms=args.fsync_interval_ms,
        snapshot_every=args.snapshot_every,
        auth_secret=secret,
        **_limit_config(args),
        standby_of=args.standby_of,
        failover_after_ms=int(args.failover_after * 1000),
        promotion_grace_ms=None if args.promotion_grace is None else int(args.promotion_grace * 1000),
        fence_margin_ms=None if args.fence_margin is None else int(args.fence_margin * 1000),
        name=args.name,
        repair_wal=args.repair_wal,
        wal_writer=args.wal_writer,
        metrics=args.metrics,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        tls_client_auth=args.tls_client_auth,
        tls_handshake_timeout_ms=int(args.tls_handshake_timeout * 1000),
    )
    return serve(config, use_uvloop=not args.no_uvloop)


def _cmd_status(args: argparse.Namespace) -> int:
    """Print the status of exactly the node named by ``--server`` (a direct
    request: a standby reports itself, not its primary)."""
    from . import protocol as P

    result = _admin(args.server, args.auth_secret_file, P.OP_STATUS, tls=client_tls_options(args))
    print(json.dumps(result, indent=2, sort_keys=True, default=str))
    return 0


ADMIN_TIMEOUT = 10.0  # seconds for the TCP connect, and again for the replies


def _admin(server: tuple[str, int], secret_file: str | None, op: int, *args,
           reply_timeout: float = ADMIN_TIMEOUT, tls: dict | None = None) -> object:
    """Send one request straight to ``server`` (no redirects: it targets a node).

    ``tls``: :func:`client_tls_options` (empty or None: plain TCP).

    Raises FastlockError (the server's refusal), OSError (connect/read
    failures, an unreadable secret file or TLS file, ``ssl.SSLError`` for a
    failed TLS handshake) or TimeoutError (no answer within
    ``ADMIN_TIMEOUT`` seconds).
    """
    from . import protocol as P
    from .errors import ConnectionLost
    from .tls import client_ssl_context

    secret = _read_secret(secret_file)
    host, port = server
    tls = dict(tls or {})
    server_hostname = tls.pop("server_hostname", None)
    ctx = client_ssl_context(tls.pop("tls", None), tls.pop("tls_ca", None), tls.pop("tls_cert", None),
                             tls.pop("tls_key", None))
    ssl_args = {"ssl": ctx, "server_hostname": server_hostname or host} if ctx is not None else {}

    # what a server closing or resetting the connection most likely means
    hint = (" (it may require TLS: --tls-ca)" if ctx is None else
            " (it may have refused this client's certificate, or its lack of one: --tls-cert)")

    async def exchange():
        from . import rpc

        try:
            conn = await rpc.open_connection(host, port, timeout=ADMIN_TIMEOUT, **ssl_args)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no connection within {ADMIN_TIMEOUT:g} s") from None
        try:
            hello = conn.request(P.OP_HELLO, P.PROTOCOL_VERSION, "fastlock-admin", secret)
            reply = conn.request(op, *args)
            try:
                await asyncio.wait_for(hello, reply_timeout)
                return await asyncio.wait_for(reply, reply_timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no reply within {reply_timeout:g} s") from None
            except ConnectionLost:
                if conn.close_error is not None:  # the server said why it closed
                    raise conn.close_error from None
                raise ConnectionError("the server closed the connection" + hint) from None
        finally:
            reply.add_done_callback(lambda f: f.cancelled() or f.exception())
            conn.close()

    async def run():
        try:
            return await exchange()
        except (ConnectionResetError, BrokenPipeError) as exc:
            # a TLS server that refuses a client certificate may reset rather than close
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise ConnectionError(f"{reason}{hint}") from None

    return asyncio.run(run())


def _cmd_wal_dump(args: argparse.Namespace) -> int:
    from .wal import dump

    d = args.directory
    if not os.path.exists(d):
        raise FileNotFoundError(f"{d}: no such directory")
    if not os.path.isdir(d):
        raise NotADirectoryError(f"{d}: not a directory")
    names = os.listdir(d)
    if not any(_WAL_FILE.match(n) for n in names):
        raise FileNotFoundError(f"{d}: no WAL segment (wal-*.log) or snapshot (snap-*.snap) here; "
                                f"is it a fastlock --data-dir?")
    dump(d, lock=args.lock, file=sys.stdout)
    return 0


_WAL_FILE = re.compile(r"^(wal-\d{20}\.log|snap-\d{20}\.snap)$")


def main(argv: list[str] | None = None) -> int:
    """Run the ``fastlock`` command; returns the exit status.

    Usage errors (bad arguments) exit 2 with argparse's message; runtime
    errors (unreachable server, refused request, missing or damaged WAL)
    print one line, ``fastlock <command>: <reason>``, to stderr and exit 1.
    """
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        if (args.tls_key or args.tls_ca) and not args.tls_cert:
            args.subparser.error("--tls-key and --tls-ca need --tls-cert (this node's certificate)")
        if args.tls_client_auth != "none" and not args.tls_ca:
            args.subparser.error(f"--tls-client-auth {args.tls_client_auth} needs --tls-ca (the CA that signs "
                                 f"client certificates)")
        if args.tls_cert and args.tls_handshake_timeout <= 0:
            args.subparser.error("--tls-handshake-timeout must be > 0 seconds")
    if args.command == "serve" and args.failover_after and args.standby_of is None:
        args.subparser.error("--failover-after only applies to a standby (it needs --standby-of): a primary "
                             "learns its standby's failover window from the standby itself")
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args.args)
    if args.command == "run":
        from . import runner

        return runner.main(args.args)
    if args.command == "serve":
        return _cmd_serve(args)  # logs its own errors (bad WAL, address in use) and exits non-zero
    command = "wal dump" if args.command == "wal" else args.command
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `fastlock wal dump DIR | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        return 1
    except Exception as exc:  # noqa: BLE001 - one clear line, not a traceback
        from .errors import FastlockError
        from .wal import WalCorruption

        if not isinstance(exc, (FastlockError, WalCorruption, OSError, TimeoutError, ValueError)):
            raise  # a bug: keep the traceback
        print(f"fastlock {command}: {_describe(args, exc)}", file=sys.stderr)
        return 1


def _describe(args: argparse.Namespace, exc: BaseException) -> str:
    """One line for a runtime error: the node concerned (if any) and the reason."""
    import ssl

    server = getattr(args, "server", None)
    where = f"{_fmt_addr(server)}: " if isinstance(server, tuple) else ""
    if isinstance(exc, ssl.SSLError):  # its errno is OpenSSL's, not an OS error number
        return f"{where}TLS: {getattr(exc, 'verify_message', None) or exc.reason or exc}"
    if isinstance(exc, OSError) and exc.strerror:
        reason = os.strerror(exc.errno) if exc.errno else exc.strerror  # asyncio's text repeats the address
        what = f"{exc.filename}: {reason}" if exc.filename else reason
        return f"{where}{'cannot connect: ' if where and not exc.filename else ''}{what}"
    if isinstance(exc, OSError) or isinstance(exc, TimeoutError):
        return f"{where}{exc or type(exc).__name__}"
    return f"{where}{type(exc).__name__}: {exc}"


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "status":
        return _cmd_status(args)
    if args.command in ("promote", "serve-alone"):
        from . import protocol as P

        if args.command == "promote":
            # a promotion may wait out the old primary's fence (up to --failover-after)
            result = _admin(args.server, args.auth_secret_file, P.OP_PROMOTE, bool(args.force),
                            reply_timeout=args.timeout, tls=client_tls_options(args))
        else:
            result = _admin(args.server, args.auth_secret_file, P.OP_SERVE_ALONE, tls=client_tls_options(args))
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    if args.command == "wal":
        return _cmd_wal_dump(args)
    raise AssertionError(args.command)  # argparse enforces the choices
