"""The ``fastlock`` command (also ``python -m fastlock``).

Subcommands::

    fastlock serve [--listen HOST:PORT] [--data-dir DIR] [--fsync always|interval|never] ...
    fastlock demo                     a server + worker processes writing a fenced ledger
    fastlock status [--server HOST:PORT]
    fastlock wal dump [--lock NAME] DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from . import __version__


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        raise argparse.ArgumentTypeError("expected HOST:PORT")
    try:
        p = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port {port!r}") from None
    if not 0 <= p <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range: {p}")
    return host.strip("[]") or "127.0.0.1", p


def _positive_int(value: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastlock", description="fastlock lock server and tools")
    parser.add_argument("--version", action="version", version=f"fastlock {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run a server")
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
    s.add_argument("--max-frame-bytes", type=_positive_int, default=1 << 20, metavar="BYTES")
    s.add_argument("--max-waiters-per-connection", type=_positive_int, default=10_000, metavar="N")
    s.add_argument("--no-uvloop", action="store_true", help="use the stdlib asyncio loop")
    s.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    d = sub.add_parser("demo", help="start a server and workers that write a fenced SQLite ledger")
    d.add_argument("args", nargs=argparse.REMAINDER)

    st = sub.add_parser("status", help="show a server's role, epoch and counters")
    st.add_argument("--server", default="127.0.0.1:7420", metavar="HOST:PORT")
    st.add_argument("--auth-secret-file", metavar="FILE")

    w = sub.add_parser("wal", help="inspect a write-ahead log")
    wsub = w.add_subparsers(dest="wal_command", required=True)
    wd = wsub.add_parser("dump", help="print the grant/release/expiry history")
    wd.add_argument("--lock", metavar="NAME", help="only this lock")
    wd.add_argument("directory", metavar="DIR")
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
    config = ServerConfig(
        host=args.listen[0],
        port=args.listen[1],
        data_dir=args.data_dir,
        fsync=args.fsync,
        fsync_interval_ms=args.fsync_interval_ms,
        snapshot_every=args.snapshot_every,
        auth_secret=_read_secret(args.auth_secret_file),
        max_frame_bytes=args.max_frame_bytes,
        max_waiters_per_connection=args.max_waiters_per_connection,
    )
    return serve(config, use_uvloop=not args.no_uvloop)


def _cmd_status(args: argparse.Namespace) -> int:
    from .client import connect

    async def run() -> dict:
        async with connect(args.server, auth=_read_secret(args.auth_secret_file), client_name="fastlock-status") as c:
            return await c.status()

    print(json.dumps(asyncio.run(run()), indent=2, sort_keys=True, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "serve":
        return _cmd_serve(args)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args.args)
    if args.command == "status":
        return _cmd_status(args)
    if args.command == "wal":
        from .wal import dump

        dump(args.directory, lock=args.lock, file=sys.stdout)
        return 0
    raise AssertionError(args.command)  # argparse enforces the choices
