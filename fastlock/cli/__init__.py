"""The ``fastlock`` command (also ``python -m fastlock``).

Subcommands::

    fastlock serve [--listen HOST:PORT] [--data-dir DIR] [--fsync always|interval|never] ...
    fastlock demo [--workers N] [--unfenced] [--quiet] [--keep] ...
    fastlock status [--server HOST:PORT] [--all] [-o json]   one node, or the table of every node
    fastlock wal dump [--lock NAME] [--state] [-o json] DIR
    fastlock run NAME --ttl S [--wait S] [--server HOST:PORT] -- CMD ...
    fastlock promote --server HOST:PORT [--force] [--token-file FILE]
    fastlock serve-alone --server HOST:PORT [--token-file FILE]
    fastlock credentials init DIR     credentials.toml (keys) + one 0600 token file per principal
    fastlock credentials upgrade DIR  a format-1 credentials.toml rewritten as format 2
    fastlock locks [PREFIX] [-o json]                 the held locks
    fastlock lock NAME [-o json]                      one lock's holders and ordered waiters
    fastlock revoke NAME [--token T] [--reason TEXT]  force-release (audit record in the WAL)
    fastlock revoke --principal P [--reason TEXT]     every lease of a principal
    fastlock revoke --session ID [--reason TEXT]      every lease of a client session
    fastlock sessions [--principal P] [-o json]       the client sessions
    fastlock sessions close ID [--reason TEXT]        close one, revoking its leases
    fastlock principals [-o json]                     usage per principal against its quotas
    fastlock elect NAME PROPOSAL | --listen NAME      campaign / print each new leader
    fastlock top [--once] [--rows N] [-o json]        live view of the busiest and most contended locks
    fastlock shard init|status|addresses --coordinator etcd://HOST:PORT/PREFIX   the shard map in etcd
    fastlock shard status --server HOST:PORT          the shard map a node serves by

The package holds one module per concern: :mod:`~fastlock.cli.args` (argument
types and shared options), :mod:`~fastlock.cli.serve`,
:mod:`~fastlock.cli.admin` (status, promote, serve-alone, credentials, wal
dump), :mod:`~fastlock.cli.groupstatus` (``status --all``),
:mod:`~fastlock.cli.locks` (locks, lock, revoke, principals), :mod:`~fastlock.cli.sessions`,
:mod:`~fastlock.cli.elect`,
:mod:`~fastlock.cli.top`, :mod:`~fastlock.cli.run` and :mod:`~fastlock.cli.demo`.

Client commands name their server with ``--server`` or the environment
variable ``FASTLOCK_SERVER``.  TLS: ``serve`` takes ``--tls-cert/--tls-key``
(and ``--tls-ca`` with ``--tls-client-auth`` for mutual TLS); the client
commands (``status``, ``promote``, ``serve-alone``, ``run``) take
``--tls-ca/--tls-cert/--tls-key`` or the environment variables
``FASTLOCK_TLS_CA``, ``FASTLOCK_TLS_CERT``, ``FASTLOCK_TLS_KEY`` (see
:func:`fastlock.cli.args.add_client_tls_arguments`).
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys

from .._version import __version__
from ..client import NoPrimaryFound
from ..errors import FastlockError
from ..wal import WalCorruption
from . import admin, config, demo, elect, locks, run, serve, sessions, shard, top, witness
from .args import COMMAND_NAMES, add_client_tls_arguments, client_tls_options, print_error, seconds_arg

__all__ = ["add_client_tls_arguments", "build_parser", "client_tls_options", "main", "seconds_arg"]

def build_parser() -> argparse.ArgumentParser:
    """The ``fastlock`` argument parser; each subcommand sets ``handler``."""
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``fastlock`` parser and its ``serve`` subparser."""
    parser = config.RecordingParser(prog="fastlock", description="fastlock lock server and tools")
    parser.add_argument("--version", action="version", version=f"fastlock {__version__}")
    # every subcommand's parser keeps its options, for serve's config layers (fastlock.cli.config)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=config.RecordingParser)
    serve_parser = serve.add_parser(sub)
    demo.add_parser(sub)
    admin.add_parsers(sub)
    locks.add_parsers(sub)
    sessions.add_parser(sub)
    elect.add_parser(sub)
    top.add_parser(sub)
    run.add_parser(sub)
    witness.add_parser(sub)
    shard.add_parser(sub)
    return parser, serve_parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``fastlock`` command; returns the exit status.

    Usage errors (bad arguments) exit 2 with argparse's message (with ``-o json``
    on the command line, a JSON object: :class:`~fastlock.cli.config.RecordingParser`); runtime
    errors (unreachable server, refused request, missing or damaged WAL)
    print one line, ``fastlock <command>: <reason>``, to stderr and exit 1 -
    with ``-o json``, that line is a JSON object, ``{"command", "error",
    "message"}`` (:func:`~fastlock.cli.args.print_error`); stdout only ever
    holds results.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, serve_parser = _build()
    if argv[:1] == ["serve"]:  # flag > environment > config file > default (fastlock.cli.config)
        serve_parser.set_defaults(config_sources=config.layer_defaults(serve_parser, argv[1:]), argv=argv[1:])
    args = parser.parse_args(argv)
    if args.command in ("serve", "demo", "run", "witness"):
        return int(args.handler(args))  # each reports its own errors and exit status
    if args.command in ("status", "promote", "serve-alone"):
        admin.resolve_server(args)
    command = COMMAND_NAMES.get(args.command, args.command)
    if args.command == "credentials":
        command = f"credentials {args.credentials_command}"
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `fastlock wal dump DIR | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        return 1
    except Exception as exc:
        if not isinstance(exc, (FastlockError, WalCorruption, OSError, TimeoutError, ValueError)):
            raise  # a bug: keep the traceback
        print_error(args, command, describe(args, exc), public_name(exc))
        return 1


def public_name(exc: BaseException) -> str:
    """The error's class name for a script: a failed search for the primary is a ``ConnectionLost``."""
    return "ConnectionLost" if isinstance(exc, NoPrimaryFound) else type(exc).__name__


def describe(args: argparse.Namespace, exc: BaseException) -> str:
    """One line for a runtime error: the node concerned (if any) and the reason."""
    where = admin.where(args)
    if isinstance(exc, ssl.SSLError):  # its errno is OpenSSL's, not an OS error number
        return f"{where}TLS: {getattr(exc, 'verify_message', None) or exc.reason or exc}"
    if isinstance(exc, OSError) and exc.strerror:
        reason = os.strerror(exc.errno) if exc.errno else exc.strerror  # asyncio's text repeats the address
        what = f"{exc.filename}: {reason}" if exc.filename else reason
        return f"{where}{'cannot connect: ' if where and not exc.filename else ''}{what}"
    if isinstance(exc, (OSError, TimeoutError)):
        return f"{where}{exc or type(exc).__name__}"
    return f"{where}{public_name(exc)}: {exc}"
