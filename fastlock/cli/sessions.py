"""The operator's session commands: ``fastlock sessions`` and ``fastlock sessions close ID``.

``fastlock sessions [--principal P]`` lists the client sessions open on the primary (id,
principal, client name, address, leases attached, last heard, TTL left);
``fastlock sessions close ID [--reason TEXT]`` closes one and revokes every lease attached
to it at once (each next grant gets a higher fencing token), as ``fastlock revoke
--session ID`` does.  Options, servers and credentials are those of ``fastlock locks``
(:mod:`fastlock.cli.locks`); the server allows these requests to admin principals, and to
anyone in open mode (:mod:`fastlock.server.sessions`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from .locks import close_session, common_options, print_json, report_unreachable, run_with_client, table

__all__ = ["add_parser", "sessions_command"]


def add_parser(sub: Any) -> None:
    """Add ``sessions`` to ``fastlock``'s subparsers."""
    p = sub.add_parser("sessions", help="list the client sessions (id, principal, client, address, leases, last "
                                        "heard, TTL left), or close one: `sessions close ID` revokes its leases")
    p.set_defaults(handler=sessions_command, subparser=p)
    p.add_argument("action", nargs="?", choices=("list", "close"), default="list", help="list (default) or close")
    p.add_argument("id", nargs="?", metavar="ID", help="the session to close")
    p.add_argument("--principal", metavar="P", help="list only principal P's sessions")
    p.add_argument("--reason", metavar="TEXT", help="why (close), kept in the WAL's REVOKE records "
                                                    "(at most 256 characters)")
    common_options(p)


def sessions_command(args: argparse.Namespace) -> int:
    if args.action == "close":
        if args.id is None:
            args.subparser.error("sessions close needs a session ID")
        return close_session(args, args.id)
    if args.id is not None:
        args.subparser.error("an ID goes with `sessions close`")
    rows = run_with_client(args, lambda c: c.sessions(args.principal))
    if args.output == "json":
        print_json([dataclasses.asdict(s) for s in rows])
    else:
        print(table(("ID", "PRINCIPAL", "CLIENT", "ADDRESS", "LEASES", "HEARD AGO", "TTL LEFT"),
                    [(s.id, s.principal, s.client, s.address, s.leases, f"{s.last_heard:.1f}s",
                      f"{s.ttl_left:.1f}s") for s in rows]))
    # a sharded deployment's SessionList names the groups that could not be reached
    return report_unreachable(getattr(rows, "unreachable", {}), "its sessions are not listed")
