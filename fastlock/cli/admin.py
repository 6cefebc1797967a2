"""The operator's commands: ``status``, ``promote``, ``serve-alone``,
``credentials init`` and ``wal dump``.

``status``, ``promote`` and ``serve-alone`` send one request straight to the
node named by ``--server`` (default: ``$FASTLOCK_SERVER`` when it names one
address; ``status`` then falls back to 127.0.0.1:7420): no redirect to a
primary, since they target a node.  They authenticate with an admin
principal's token (``--token-file`` or ``$FASTLOCK_TOKEN_FILE``) and take the
client TLS options of :func:`fastlock.cli.args.add_client_tls_arguments`.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import re
import sys
from collections.abc import Iterable
from typing import Any

from .. import wal
from ..auth import ClientHandshake, ServerNotProven, generate, say_hello, secret_of, upgrade
from ..errors import ConnectionLost, FastlockError
from ..protocol import OP_PROMOTE, OP_SERVE_ALONE, OP_STATUS
from ..protocol.rpc import NotFastlockReply, answers_tls_hello, open_connection, what_answered
from ..tls import client_ssl_context
from ..units import DEFAULT_PORT, format_address
from . import seqkeys
from .args import (
    CONNECT_TIMEOUT,
    SERVER_VARIABLE,
    OneServer,
    add_client_tls_arguments,
    add_connect_timeout_argument,
    add_token_arguments,
    client_tls_options,
    read_token,
    seconds_arg,
    server_address,
    servers_from_env,
)
from .groupstatus import group_status_command

__all__ = ["ADMIN_TIMEOUT", "NotFastlock", "add_parsers", "admin_request", "resolve_server", "where"]

#: seconds for the TCP connect, and again for HELLO's reply (and the replies of every
#: command but promote), unless the command's ``--connect-timeout`` says otherwise
ADMIN_TIMEOUT = CONNECT_TIMEOUT


class NotFastlock(ConnectionError):
    """The address answers TCP but not the fastlock protocol (or not in time)."""

_WAL_FILE = re.compile(r"^(wal-\d{20}\.log|snap-\d{20}\.snap)$")


def add_parsers(sub: Any) -> None:
    """Add the admin commands to ``fastlock``'s subparsers."""
    server_help = f"(one node; default: ${SERVER_VARIABLE} if it names exactly one node)"
    st = sub.add_parser("status", help="show one node's role, epoch, counters and replication state")
    st.set_defaults(handler=status_command, subparser=st, default_server=("127.0.0.1", DEFAULT_PORT))
    st.add_argument("--server", type=server_address, action=OneServer, metavar="HOST:PORT",
                    help=f"the one node to ask (default: ${SERVER_VARIABLE} if it names exactly one node, "
                         f"127.0.0.1:7420 if it is unset; several nodes there are an error); a standby answers "
                         f"for itself, no redirect to its primary")
    st.add_argument("--all", action="store_true",
                    help="a table of every node of the pair or etcd group (address, node, role, epoch, lag, "
                         "in sync), learned from the node asked (as etcdctl endpoint status --cluster -w table)")
    _output_argument(st)
    add_connect_timeout_argument(st)
    add_token_arguments(st)
    add_client_tls_arguments(st)

    pr = sub.add_parser("promote", help="promote a standby to primary (new epoch, grace period)")
    pr.set_defaults(handler=promote_command, subparser=pr, default_server=None)
    pr.add_argument("--server", type=server_address, action=OneServer, metavar="HOST:PORT",
                    help=f"the standby {server_help}")
    pr.add_argument("--force", action="store_true",
                    help="the operator's word that the old primary is dead: promote even if it cannot "
                         "confirm stepping down and does not fence itself, or if this standby never "
                         "synchronised (its data dir must then be current)")
    pr.add_argument("--timeout", type=seconds_arg, default=300.0, metavar="SECONDS",
                    help="how long to wait for the promotion, which may wait out the old primary's "
                         "fence (default 300)")
    _output_argument(pr)
    add_token_arguments(pr)
    add_client_tls_arguments(pr)

    sa = sub.add_parser("serve-alone", help="tell a primary its standby is gone: stop fencing itself")
    sa.set_defaults(handler=serve_alone_command, subparser=sa, default_server=None)
    sa.add_argument("--server", type=server_address, action=OneServer, metavar="HOST:PORT",
                    help=f"the primary {server_help}")
    _output_argument(sa)
    add_token_arguments(sa)
    add_client_tls_arguments(sa)

    c = sub.add_parser("credentials", help="make a credentials file and token files")
    csub = c.add_subparsers(dest="credentials_command", required=True)
    ci = csub.add_parser(
        "init", help="make DIR/credentials.toml and one 0600 DIR/<principal>.token per principal",
        description="Make a credentials file (keys derived from the tokens, never the tokens) and a token "
                    "file per principal in DIR "
                    "(made 0700; existing files are never overwritten). Defaults: client 'app' (every lock), "
                    "replicas 'node-a' and 'node-b' (one per node of a pair), admin 'admin'.")
    ci.set_defaults(handler=credentials_init_command)
    ci.add_argument("directory", metavar="DIR")
    ci.add_argument("--client", action="append", metavar="NAME[=PREFIX]",
                    help="a client principal, with every client operation on names starting with PREFIX "
                         "(default: every name); repeatable")
    ci.add_argument("--replica", action="append", metavar="NAME", help="a replica principal; repeatable")
    ci.add_argument("--admin", action="append", metavar="NAME", help="an admin principal; repeatable")
    ci.add_argument("--cert", action="append", metavar="PRINCIPAL=CN",
                    help="with mutual TLS, a client certificate whose subject CN is CN authenticates as "
                         "PRINCIPAL without a token; repeatable")
    ci.add_argument("--anonymous", metavar="PREFIX",
                    help="let connections without a token act as a client on names starting with PREFIX "
                         "('' for every name)")

    cu = csub.add_parser(
        "upgrade", help="rewrite DIR/credentials.toml from format 1 to format 2 (from the token files beside it)",
        description="Rewrite a format-1 DIR/credentials.toml (token hashes) as format 2 (the handshake's "
                    "stored and server keys), reading each principal's token from DIR/<principal>.token. "
                    "Tokens do not change, so clients need no change. Atomic, mode 0600; nothing is written "
                    "if a token file is missing or holds another token.")
    cu.set_defaults(handler=credentials_upgrade_command)
    cu.add_argument("directory", metavar="DIR")
    seqkeys.add_arguments(csub.add_parser(
        "sequencer-key", help="list, add, switch, retire or export the group's sequencer keys",
        description="The keys that sign sequencers (fastlock.sequencer), in DIR/credentials.toml. Rotation: "
                    "--add, give --public to the resources, copy the file to every node, --sign ID, later "
                    "--retire the old ID."))

    w = sub.add_parser("wal", help="inspect a write-ahead log")
    wsub = w.add_subparsers(dest="wal_command", required=True)
    wd = wsub.add_parser("dump", help="print the grant/release/expiry history",
                         description="Print a data directory's WAL as audit lines. Exits 1 with a one-line "
                                     "message if DIR is missing, is not a directory, holds no WAL segment or "
                                     "snapshot at all (most likely the wrong directory), or is corrupt "
                                     "(after printing what precedes the damage). A WAL with no records prints "
                                     "nothing and exits 0.")
    wd.set_defaults(handler=wal_dump_command)
    wd.add_argument("--lock", metavar="NAME", help="only this lock")
    wd.add_argument("--state", action="store_true",
                    help="then print the state the records add up to (epoch, counter, holders)")
    wd.add_argument("-o", "--output", choices=("text", "json"), default="text",
                    help="text: audit lines (peer-chosen values JSON-quoted unless plain); json: one JSON "
                         "object per record per line")
    wd.add_argument("directory", metavar="DIR", help="the server's --data-dir")


def _output_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=("json",), default=None,
                   help="json (the result is always JSON; with -o json an error is a JSON object on stderr too)")


def resolve_server(args: argparse.Namespace) -> None:
    """Fill in ``args.server`` of a node-targeting command: ``--server``, else
    ``$FASTLOCK_SERVER`` if it names exactly one node, else the command's
    default; exits 2 (argparse's usage error) when none applies."""
    if args.server is not None:
        return
    parser: argparse.ArgumentParser = args.subparser
    servers = servers_from_env()
    if len(servers) > 1:
        parser.error(f"${SERVER_VARIABLE} names several servers ({', '.join(servers)}); this command targets "
                     f"one node: name it with --server")
    if servers:
        try:
            args.server = server_address(servers[0])
        except argparse.ArgumentTypeError as exc:
            parser.error(f"${SERVER_VARIABLE}: {exc}")
        return
    if args.default_server is None:
        parser.error(f"--server is required (or ${SERVER_VARIABLE}): the node this command targets")
    args.server = args.default_server


def admin_request(server: tuple[str, int], token: str | None, op: int, *args: Any,
                  reply_timeout: float = ADMIN_TIMEOUT, tls: dict[str, Any] | None = None,
                  connect_timeout: float = ADMIN_TIMEOUT) -> Any:
    """Send one request straight to ``server`` (no redirects: it targets a node); return its reply.

    Args:
        server: ``(host, port)`` of the node.
        token: the admin principal's token (or None).
        op: the op code (:mod:`fastlock.protocol.ops`); ``args`` its arguments.
        reply_timeout: seconds to wait for each reply.
        connect_timeout: seconds to wait for the connection, and at most that for HELLO's reply.
        tls: :func:`~fastlock.cli.args.client_tls_options` (empty or None: plain TCP).

    Raises:
        FastlockError: the server's refusal.
        OSError: connect or read failures, an unreadable TLS file, ``ssl.SSLError``
            for a failed TLS handshake.
        TimeoutError: no connection within ``connect_timeout`` seconds, or
            no reply within ``reply_timeout`` seconds.
    """
    host, port = server
    options = dict(tls or {})
    server_hostname = options.pop("server_hostname", None)
    ctx = client_ssl_context(options.pop("tls", None), options.pop("tls_ca", None), options.pop("tls_cert", None),
                             options.pop("tls_key", None))
    ssl_args: dict[str, Any] = {"ssl": ctx, "server_hostname": server_hostname or host} if ctx is not None else {}

    # what a server closing or resetting the connection most likely means
    hint = (" (it may require TLS: --tls-ca)" if ctx is None else
            " (it may have refused this client's certificate, or its lack of one: --tls-cert)")

    async def exchange() -> Any:
        try:
            conn = await open_connection(host, port, timeout=connect_timeout, **ssl_args)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no connection within {connect_timeout:g} s") from None
        # the token is proved, never sent; the request goes only to a server that proved itself
        hello = say_hello(conn, "fastlock-admin", ClientHandshake(secret_of(token) if token else None))
        reply: Any = None
        try:
            try:  # a port that does not speak fastlock: fail within the connect timeout, saying so
                info = await asyncio.wait_for(hello, min(reply_timeout, connect_timeout))
            except asyncio.TimeoutError:
                waited = min(reply_timeout, connect_timeout)
                if ctx is None and await answers_tls_hello(host, port):  # a TLS server never speaks first
                    raise NotFastlock(f"no answer to HELLO within {waited:g} s, but a TLS hello is answered: "
                                      f"a TLS port (pass --tls-ca or --tls)") from None
                raise NotFastlock(f"not a fastlock server, or a stalled one (no answer to HELLO within {waited:g} s: "
                                  f"a stopped process, or an event loop kept busy)") from None
            except ServerNotProven:
                raise
            except ConnectionLost as exc:
                if conn.close_error is None and conn.received:  # it answered, not in fastlock
                    if not isinstance(exc, NotFastlockReply):
                        raise NotFastlock(f"not a fastlock server ({exc})") from None
                    raise NotFastlock(what_answered(exc.head, ctx is not None, "pass --tls-ca or --tls")) from None
                raise
            if not isinstance(info, dict) or info.get("server") != "fastlock":
                raise NotFastlock(f"not a fastlock server (HELLO answered {info!r:.60})")
            reply = conn.request(op, *args)
            return await asyncio.wait_for(reply, reply_timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no reply within {reply_timeout:g} s") from None
        except ServerNotProven:
            raise
        except ConnectionLost:
            if conn.close_error is not None:  # the server said why it closed
                raise conn.close_error from None
            raise ConnectionError("the server closed the connection" + hint) from None
        finally:
            if reply is not None:
                reply.add_done_callback(lambda f: f.cancelled() or f.exception())
            conn.close()

    async def run() -> Any:
        try:
            return await exchange()
        except (ConnectionResetError, BrokenPipeError) as exc:
            # a TLS server that refuses a client certificate may reset rather than close
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise ConnectionError(f"{reason}{hint}") from None

    return asyncio.run(run())


def status_command(args: argparse.Namespace) -> int:
    """Print the status of exactly the node named by ``--server`` (a direct
    request: a standby reports itself, not its primary); with ``--all`` the table of
    every node (:mod:`fastlock.cli.groupstatus`)."""
    if args.all:
        return group_status_command(args, lambda server, op: admin_request(
            server, read_token(args), op, tls=client_tls_options(args), connect_timeout=args.connect_timeout))
    result = admin_request(args.server, read_token(args), OP_STATUS, tls=client_tls_options(args),
                           connect_timeout=args.connect_timeout)
    print(json.dumps(result, indent=2, sort_keys=True, default=str))
    return 0


#: seconds between two progress reports of ``fastlock promote``
PROMOTE_REPORT_EVERY = 1.0


def promote_command(args: argparse.Namespace) -> int:
    """Promote the standby named by ``--server``; prints the new epoch and role.

    While the node works (a promotion may wait out the old primary's fence, up to its
    ``--failover-after``), each change of its role, epoch or replication state is
    reported on stderr (with ``-o json``, as ``{"command": "promote", "progress": TEXT}``),
    from a status request every :data:`PROMOTE_REPORT_EVERY` s."""
    token = read_token(args)
    tls = client_tls_options(args)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        promotion = pool.submit(admin_request, args.server, token, OP_PROMOTE, bool(args.force),
                                reply_timeout=args.timeout, tls=tls)
        last = None
        while True:
            try:
                result = promotion.result(timeout=PROMOTE_REPORT_EVERY)
                break
            except concurrent.futures.TimeoutError:
                pass
            try:
                st = admin_request(args.server, token, OP_STATUS, tls=tls)
                repl = st.get("replication") or {}
                step = (f"role {st.get('role')}, epoch {st.get('epoch')}, "
                        f"primary connected {repl.get('connected')}, applied LSN {repl.get('applied_lsn')}")
            except (OSError, TimeoutError, FastlockError) as exc:
                step = f"status unavailable ({exc})"
            if step != last:
                if args.output == "json":
                    print(json.dumps({"command": "promote", "progress": step}), file=sys.stderr, flush=True)
                else:
                    print(f"promote: still working: {step}", file=sys.stderr, flush=True)
                last = step
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def serve_alone_command(args: argparse.Namespace) -> int:
    """Tell the primary named by ``--server`` that its standby is gone."""
    result = admin_request(args.server, read_token(args), OP_SERVE_ALONE, tls=client_tls_options(args))
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def credentials_init_command(args: argparse.Namespace) -> int:
    """Write DIR/credentials.toml and a token file per principal (:func:`fastlock.auth.generate`)."""
    clients = []
    for spec in args.client or ["app"]:
        name, _, prefix = spec.partition("=")
        clients.append((name, prefix))
    certs: dict[str, Iterable[str]] = {}
    for spec in args.cert or []:
        principal, sep, cn = spec.partition("=")
        if not sep or not cn:
            raise ValueError(f"--cert takes PRINCIPAL=CN, not {spec!r}")
        certs[principal] = [*certs.get(principal, ()), cn]
    paths = generate(args.directory, clients=clients, replicas=args.replica or ["node-a", "node-b"],
                     admins=args.admin or ["admin"], anonymous_prefix=args.anonymous, cert_identities=certs)
    print(f"wrote {os.path.join(args.directory, 'credentials.toml')} (keys, no tokens; give it to every server "
          f"with --credentials) and these token files (mode 0600; each only to its user):")
    for path in paths.values():
        print(f"  {path}")
    return 0


def credentials_upgrade_command(args: argparse.Namespace) -> int:
    """Rewrite DIR/credentials.toml as format 2 (:func:`fastlock.auth.upgrade`)."""
    names = upgrade(args.directory)
    print(f"upgraded {os.path.join(args.directory, 'credentials.toml')} to format 2 "
          f"(keys derived for {', '.join(names) or 'no principal'}); tokens are unchanged")
    return 0


def wal_dump_command(args: argparse.Namespace) -> int:
    """Print a data directory's WAL as audit lines (:func:`fastlock.wal.dump`).

    Raises:
        FileNotFoundError: the directory is missing or holds no WAL segment nor snapshot.
        NotADirectoryError: it is not a directory.
        WalCorruption: the log is damaged (after printing what precedes the damage).
    """
    d = args.directory
    if not os.path.exists(d):
        raise FileNotFoundError(f"{d}: no such directory")
    if not os.path.isdir(d):
        raise NotADirectoryError(f"{d}: not a directory")
    if not any(_WAL_FILE.match(n) for n in os.listdir(d)):
        raise FileNotFoundError(f"{d}: no WAL segment (wal-*.log) or snapshot (snap-*.snap) here; "
                                f"is it a fastlock --data-dir?")
    wal.dump(d, lock=args.lock, file=sys.stdout, state=args.state, output=args.output)
    return 0


def where(args: argparse.Namespace) -> str:
    """The node a failed command concerned, as ``host:port: `` (or "")."""
    server = getattr(args, "server", None)
    return f"{format_address(server)}: " if isinstance(server, tuple) else ""
