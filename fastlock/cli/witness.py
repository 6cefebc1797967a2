"""``fastlock witness``: a pair's third opinion, holding no locks (:mod:`fastlock.replication.witness`).

``fastlock witness --listen HOST:PORT --data DIR --credentials FILE`` runs until
SIGINT or SIGTERM.  It keeps its vote (the highest epoch it granted a lease for,
and to whom) in ``DIR/witness.json``, fsynced before every answer that changed
it.  Both pair nodes name it with ``serve --witness HOST:PORT``; the credentials
file is the pair's (its replica principals prove themselves to the witness).
With ``--tls-cert`` (and ``--tls-key``, ``--tls-ca``, ``--tls-client-auth``,
``--tls-handshake-timeout``, as ``serve``'s) it serves TLS only; nodes run with
``--tls-cert`` reach it over TLS.  SIGHUP reloads the TLS files.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

from ..auth import Credentials
from ..logformat import LOG_FORMATS, configure
from ..replication.witness import Witness
from ..tls import ServerTLS
from .args import add_server_tls_arguments, check_server_tls_arguments, listen_address, reachable_as

__all__ = ["add_parser"]

log = logging.getLogger("fastlock.witness")


def add_parser(sub: Any) -> None:
    """Add ``witness`` to ``fastlock``'s subparsers."""
    p = sub.add_parser("witness", help="run a pair's witness: a tiny process that breaks the tie between a dead "
                                       "standby and a partition (serve --witness)")
    p.set_defaults(handler=witness_command, subparser=p)
    p.add_argument("--listen", type=listen_address, required=True, metavar="HOST:PORT",
                   help="where the pair's nodes reach the witness (port 0: any free port)")
    p.add_argument("--data", required=True, metavar="DIR", help="where the vote (witness.json) is kept")
    p.add_argument("--credentials", required=True, metavar="FILE",
                   help="the pair's credentials file (its replica principals prove themselves)")
    p.add_argument("--reachable-as", type=reachable_as, default=(), metavar="IP:PORT[,IP:PORT...]|any",
                   help="a node's handshake names the endpoint it dialed, and the witness refuses one that names "
                        "another than the connection arrived at (a relay); these endpoints are also accepted "
                        "(NAT, port mapping, a TCP proxy); 'any' turns the check off (as serve --reachable-as)")
    add_server_tls_arguments(
        p, cert_help="serve TLS with this certificate (PEM, with its chain); the pair's nodes, run with "
                     "--tls-cert, reach the witness over TLS",
        ca_help="CA certificate(s) that verify the nodes' client certificates (with --tls-client-auth)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="the least severe messages logged (default INFO)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text", type=str.lower,
                   help="text (default) or json, one object per line")


def witness_command(args: argparse.Namespace) -> int:
    """Run the witness until SIGINT or SIGTERM; returns the exit status (1: it could not start)."""
    check_server_tls_arguments(args, args.subparser)
    configure(args.log_level, args.log_format, sys.stderr)
    try:
        credentials = Credentials.load(args.credentials)
        witness = Witness(args.data, credentials, reachable_as=args.reachable_as)
        tls = (ServerTLS(args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_auth, args.tls_handshake_timeout)
               if args.tls_cert else None)
    except (OSError, ValueError) as exc:
        print(f"fastlock witness: {exc}", file=sys.stderr)
        return 1
    host, port = args.listen
    return asyncio.run(_run(witness, host, port, tls))


async def _run(witness: Witness, host: str, port: int, tls: ServerTLS | None) -> int:
    try:
        where = await witness.start(host, port, tls)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc)
        return 1
    vote = witness.vote
    log.info("witness listening on %s%s (node id %s; vote: epoch %d, %s)", where, " (TLS)" if tls else "",
             witness.node, vote.epoch, vote.holder or "nobody")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGHUP, witness.reload_tls)
    await stop.wait()
    witness.close()
    log.info("witness stopped")
    return 0
