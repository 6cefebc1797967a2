"""The operator's lock commands: ``fastlock locks``, ``lock``, ``revoke``, ``principals``.

Each goes through the Python client (:mod:`fastlock.client.admin`), so it finds the
primary among ``--server`` / ``$FASTLOCK_SERVER`` (comma-separated) as every client
does, and authenticates with ``--token-file`` / ``$FASTLOCK_TOKEN_FILE`` or the shared
secret (``--auth-secret-file`` / ``$FASTLOCK_AUTH_SECRET``).  The server allows these
requests to admin principals, and to anyone in open mode (see
:mod:`fastlock.server.lockadmin`).  Output: a table by default, ``-o json`` for scripts
(times in seconds, as the Python API).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import sys
from collections.abc import Sequence
from typing import Any

from ..client import Client, LeaseInfo, LockList, WaiterInfo
from ..client.sharded import ShardedClient, route_if_sharded
from ..logsafe import text_value
from ..protocol import check_name, check_token
from ..units import DEFAULT_PORT
from .args import (
    SERVER_VARIABLE,
    add_client_tls_arguments,
    add_connect_timeout_argument,
    add_token_arguments,
    client_tls_options,
    read_token,
    servers_from_env,
)

__all__ = ["add_parsers", "table", "common_options", "print_json", "run_with_client", "close_session"]


def _name_arg(value: str) -> str:
    try:
        return check_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _token_arg(value: str) -> int:
    try:
        return check_token(int(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"a fencing token is an integer 1..2**63-1: {exc}") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", action="append", metavar="HOST:PORT[,HOST:PORT]",
                   help=f"a server; repeat it (or separate with commas) for each node of a pair or group: the "
                        f"primary is found among them, riding through a failover as the client does (default "
                        f"${SERVER_VARIABLE}, comma-separated, else 127.0.0.1:{DEFAULT_PORT})")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    add_connect_timeout_argument(p)
    add_token_arguments(p)
    add_client_tls_arguments(p)


def add_parsers(sub: Any) -> None:
    """Add ``locks``, ``lock``, ``revoke`` and ``principals`` to ``fastlock``'s subparsers."""
    ls = sub.add_parser("locks", help="list the held locks (token, holder, remaining TTL, waiters)")
    ls.set_defaults(handler=locks_command)
    ls.add_argument("prefix", nargs="?", default="", metavar="PREFIX", help="only names starting with PREFIX")
    _common(ls)

    one = sub.add_parser("lock", help="show one lock's holders and its waiters in queue order")
    one.set_defaults(handler=lock_command)
    one.add_argument("name", type=_name_arg, metavar="NAME")
    _common(one)

    rv = sub.add_parser("revoke", help="force-release a lock, or every lease of a principal (logged with who "
                                       "and why); the next holder gets a higher fencing token")
    rv.set_defaults(handler=revoke_command, subparser=rv)
    rv.add_argument("name", type=_name_arg, metavar="NAME", nargs="?", help="the lock (or give --principal)")
    rv.add_argument("--token", type=_token_arg, metavar="T", help="only the lease with this fencing token "
                                                                  "(default: every holder)")
    rv.add_argument("--principal", metavar="P", help="instead of NAME: every lease principal P holds (its "
                                                     "waiting acquires stay queued)")
    rv.add_argument("--session", metavar="ID", help="instead of NAME: close client session ID and revoke "
                                                    "every lease attached to it (as `fastlock sessions close`)")
    rv.add_argument("--reason", metavar="TEXT", help="why, kept in the WAL's audit record (at most 256 characters)")
    _common(rv)


    pr = sub.add_parser("principals", help="what each principal holds against its quotas (leases, waiters, "
                                           "watches, keys, connections); a client sees its own only")
    pr.set_defaults(handler=principals_command)
    _common(pr)


def _servers(args: argparse.Namespace) -> list[str]:
    named = [s.strip() for given in args.server or [] for s in given.split(",") if s.strip()]
    if named:
        return named
    return servers_from_env() or [f"127.0.0.1:{DEFAULT_PORT}"]


def _with_client(args: argparse.Namespace, work: Any) -> Any:
    """Run ``work(client)`` on a client connected as the command's options say."""
    token = read_token(args)

    def make_client(addresses: Any) -> Client:
        return Client(addresses, token=token, client_name="fastlock-cli", connect_timeout=args.connect_timeout,
                      **client_tls_options(args))

    async def run() -> Any:
        client = make_client(_servers(args))
        try:
            client = await route_if_sharded(client, make_client)  # a sharded deployment: every group
            return await work(client)
        finally:
            await client.close()

    return asyncio.run(run())


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """``rows`` under ``headers``, in left-aligned columns ("-" for None; peer-chosen text
    bare or as a JSON string, as :func:`fastlock.logsafe.text_value` shows it)."""
    cells = [[str(h) for h in headers]] + [[text_value(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _secs(v: float | None) -> str | None:
    return None if v is None else f"{v:.1f}s"


def _holder(h: LeaseInfo | WaiterInfo) -> str | None:
    who = h.principal or ""
    if h.client:
        who = f"{who}:{h.client}" if who else h.client
    return who or None  # raw: table() and the callers quote it once with text_value()


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


#: the shared options, the client and JSON output of these commands, for fastlock.cli.sessions
common_options = _common
run_with_client = _with_client
print_json = _print_json


#: the exit status of a command whose answer is incomplete: a shard group could not be reached
#: (a stderr line names each); what the other groups answered is printed
EXIT_PARTIAL = 3


def report_unreachable(unreachable: dict[str, str], what: str) -> int:
    """Name each unreachable shard group (group name -> the error) on stderr, saying ``what``
    is missing; :data:`EXIT_PARTIAL` if any, else 0."""
    for group, error in sorted(unreachable.items()):
        print(f"fastlock: shard group {text_value(group)} could not be reached, {what}: {text_value(error)}",
              file=sys.stderr)
    return EXIT_PARTIAL if unreachable else 0


#: leases asked for per LOCKS request when ``fastlock locks`` pages through the table
PAGE = 1_000
#: most leases ``fastlock locks`` lists (it then says how many matched)
MAX_LISTED = 100_000


async def _every_lock(client: Client, prefix: str) -> LockList:
    """Every held lease whose name starts with ``prefix`` (at most :data:`MAX_LISTED`), a page
    (:data:`PAGE` leases, about 64 KiB) per request, so the server never builds the whole
    listing at once; ``matched`` as the first page said."""
    page = first = await client.locks(prefix, most=PAGE)
    leases = list(page.locks)
    unreachable = dict(page.unreachable)
    while page.truncated and page.next is not None and len(leases) < MAX_LISTED:
        page = await client.locks(prefix, most=PAGE, after=page.next)
        leases += page.locks
        unreachable.update(page.unreachable)
    return LockList(leases, first.matched, page.truncated, unreachable=unreachable)


def locks_command(args: argparse.Namespace) -> int:
    listing = _with_client(args, lambda c: _every_lock(c, args.prefix))
    if args.output == "json":
        _print_json(dataclasses.asdict(listing))
        return report_unreachable(listing.unreachable, "its locks are not listed")
    print(table(("NAME", "TOKEN", "HOLDER", "CORRELATION", "REMAINING", "TTL", "LOCK-DELAY", "WAITERS"),
                [(h.name, h.fencing_token, _holder(h), h.correlation_id, _secs(h.remaining), _secs(h.ttl),
                  _secs(h.lock_delay), h.waiters) for h in listing.locks]))
    if listing.truncated:
        print(f"({listing.matched} held locks match; the first {len(listing.locks)} shown)")
    return report_unreachable(listing.unreachable, "its locks are not listed")


def _iso(unix_seconds: float) -> str:
    dt = datetime.datetime.fromtimestamp(unix_seconds, tz=datetime.timezone.utc)
    return dt.isoformat(timespec="seconds").replace("+00:00", "Z")


def lock_command(args: argparse.Namespace) -> int:
    info = _with_client(args, lambda c: c.lock_info(args.name))
    if args.output == "json":
        _print_json(dataclasses.asdict(info))
        return 0
    if info.holders:
        print(table(("HOLDER", "TOKEN", "CORRELATION", "REMAINING", "TTL", "KIND"),
                    [(_holder(h), h.fencing_token, h.correlation_id, _secs(h.remaining), _secs(h.ttl),
                      "shared" if h.shared else f"permit/{h.limit}" if h.limit else "exclusive")
                     for h in info.holders]))
    else:
        print(f"{text_value(info.name)}: no holder")
    if info.waiters:
        print()
        print(table(("#", "WAITER", "CORRELATION", "WAITING SINCE", "WAITED", "WAIT LEFT"),
                    [(i + 1, _holder(w), w.correlation_id, _iso(w.since), _secs(w.waiting),
                      "forever" if w.wait_remaining is None else _secs(w.wait_remaining))
                     for i, w in enumerate(info.waiters)]))
        if info.waiter_count > len(info.waiters):
            print(f"({info.waiter_count} waiters; the first {len(info.waiters)} shown)")
    else:
        print("no waiters")
    return 0


def close_session(args: argparse.Namespace, session_id: str) -> int:
    """Close client session ``session_id`` and print what was revoked (``revoke --session``
    and ``sessions close``, :mod:`fastlock.cli.sessions`)."""
    done = _with_client(args, lambda c: c.close_session(session_id, reason=args.reason))
    if args.output == "json":
        _print_json(dataclasses.asdict(done))
        return 0
    print(f"closed session {text_value(done.id)} of principal {text_value(done.principal)}: "
          f"revoked {done.revoked} leases")
    return 0


def revoke_command(args: argparse.Namespace) -> int:
    if args.session is not None:
        if args.name is not None or args.principal is not None or args.token is not None:
            args.subparser.error("--session goes alone (no NAME, --principal or --token)")
        return close_session(args, args.session)
    if (args.name is None) == (args.principal is None):
        args.subparser.error("give a lock NAME or --principal P (not both)")
    if args.principal is not None:
        if args.token is not None:
            args.subparser.error("--token goes with a lock NAME, not with --principal")
        done = _with_client(args, lambda c: c.revoke_principal(args.principal, reason=args.reason))
        if args.output == "json":
            _print_json(dataclasses.asdict(done))
        else:
            print(f"revoked {done.revoked} leases of principal {text_value(done.principal)} "
                  f"({done.waiting} of its acquires still waiting)")
        return report_unreachable(done.unreachable, "its leases of that principal are not revoked")
    revoked = _with_client(args, lambda c: c.revoke(args.name, fencing_token=args.token, reason=args.reason))
    if args.output == "json":
        _print_json([dataclasses.asdict(h) for h in revoked])
        return 0
    for h in revoked:
        print(f"revoked {text_value(h.name)} token {h.fencing_token} (holder {text_value(_holder(h))}, "
              f"{_secs(h.remaining)} left)")
    return 0


def _of(used: int, quota: int) -> str:
    return f"{used}/{quota}" if quota else str(used)


async def _principal_rows(client: Client) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """STATUS ``principals`` rows; for a sharded deployment every group's, each with its
    ``group`` (quotas hold per group), and the unreachable groups."""
    if not isinstance(client, ShardedClient):
        return (await client.status())["principals"], {}
    found = await client.over_groups(lambda c: c.status())
    return [{**u, "group": group} for group, st in found.answers.items() for u in st["principals"]], found.reasons()


def principals_command(args: argparse.Namespace) -> int:
    """Print each principal's usage against its quotas (STATUS ``principals``; 0 quota: none);
    for a sharded deployment a row per principal and group (GROUP first)."""
    rows, unreachable = _with_client(args, _principal_rows)
    if args.output == "json":
        _print_json(rows)
        return report_unreachable(unreachable, "its principals are not listed")
    grouped = any("group" in u for u in rows)
    print(table((*(("GROUP",) if grouped else ()), "PRINCIPAL", "LEASES", "WAITERS", "WATCHES", "KEYS",
                 "CONNECTIONS", "KEY BYTES", "LOCK-DELAYS"),
                [(*((u["group"],) if grouped else ()), u["principal"], _of(u["leases"], u["leases_quota"]),
                  _of(u["waiters"], u["waiters_quota"]),
                  _of(u["watches"], u["watches_quota"]), _of(u["keys"], u["keys_quota"]),
                  _of(u["connections"], u["connections_quota"]),
                  _of(u.get("key_bytes", 0), u.get("key_bytes_quota", 0)), str(u.get("lock_delays", 0)))
                 for u in rows]))
    print("(used/quota; a lease quota counts leases plus waiting acquires plus running lock-delays)")
    return report_unreachable(unreachable, "its principals are not listed")
