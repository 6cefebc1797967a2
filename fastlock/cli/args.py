"""Argument types and shared options of the ``fastlock`` commands.

Every type wraps the library's own rule - :func:`fastlock.units.parse_address`
for addresses, :func:`fastlock.units.check_seconds` for durations, the
protocol's validators for lock arguments - and turns its
:class:`~fastlock.errors.InvalidArgument` into argparse's
``ArgumentTypeError``, so a flag accepts exactly what the Python API accepts
and says why it refuses the rest (exit status 2).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
from typing import Any

from ..auth import CredentialsError, read_token_file, resolve_credential
from ..auth.handshake import format_endpoint
from ..errors import FastlockError
from ..protocol import MAX_TTL_MS, MIN_MAX_FRAME_BYTES, check_ttl_ms, check_wait_ms, seconds_to_ms
from ..units import DEFAULT_PORT, MAX_SECONDS, check_seconds, format_address, parse_address

__all__ = [
    "COMMAND_NAMES", "CONNECT_TIMEOUT", "SERVER_VARIABLE", "OneServer", "add_client_tls_arguments",
    "add_connect_timeout_argument", "add_server_tls_arguments", "add_token_arguments", "asks_json",
    "check_server_tls_arguments", "client_tls_options", "count_arg", "exit_code_arg", "frame_bytes_arg",
    "listen_address", "positive_int", "positive_seconds_arg", "print_error", "read_secret", "read_token",
    "seconds_arg", "server_address", "servers_from_env", "ttl_arg", "wait_arg",
]

#: the environment variable naming the server(s) a client command talks to
#: (comma-separated ``HOST:PORT``), as ``fastlock run`` and the admin commands read it
SERVER_VARIABLE = "FASTLOCK_SERVER"


def listen_address(value: str) -> tuple[str, int]:
    """argparse type: ``HOST:PORT`` or ``[IPv6]:PORT`` to listen on (port 0: any free port)."""
    try:
        return parse_address(value, default_port=None, allow_port_zero=True)
    except FastlockError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def server_address(value: str) -> tuple[str, int]:
    """argparse type: a server to talk to, ``HOST[:PORT]`` or ``[IPv6][:PORT]``
    (default port 7420, :data:`fastlock.units.DEFAULT_PORT`)."""
    try:
        return parse_address(value, default_port=DEFAULT_PORT)
    except FastlockError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class OneServer(argparse.Action):
    """argparse action of a node-targeting command's ``--server``: the value once;
    a second ``--server`` is a usage error (exit 2) naming both, never a silent choice."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = getattr(namespace, self.dest, None)
        if given is not None:
            parser.error(f"{option_string} given more than once ({format_address(given)}, then "
                         f"{format_address(values)}): "
                         f"this command targets one node; name only that node")
        setattr(namespace, self.dest, values)


def reachable_as(value: str) -> tuple[str, ...]:
    """argparse type of ``serve --reachable-as``: ``any``, or comma-separated ``IP:PORT``
    endpoints (IPv6 as ``[IP]:PORT``), returned as the handshake writes them
    (:func:`fastlock.auth.handshake.endpoint`)."""
    if value.strip() == "any":
        return ("any",)
    out: list[str] = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        try:
            host, port = parse_address(part, default_port=None)
            ip = ipaddress.ip_address(host)
        except (FastlockError, ValueError):
            raise argparse.ArgumentTypeError(f"{part!r} is not IP:PORT (an IP address, not a name; IPv6 as "
                                             "[IP]:PORT) nor 'any'") from None
        out.append(format_endpoint(str(ip), port))
    if not out:
        raise argparse.ArgumentTypeError("give IP:PORT endpoints (comma-separated) or 'any'")
    return tuple(out)


def servers_from_env() -> list[str]:
    """The addresses in ``$FASTLOCK_SERVER``, else ``$FASTLOCK_SERVERS`` (comma-separated;
    empty entries dropped), as the Python client reads them (:mod:`fastlock.client.environment`)."""
    for var in (SERVER_VARIABLE, "FASTLOCK_SERVERS"):
        named = [s.strip() for s in os.environ.get(var, "").split(",") if s.strip()]
        if named:
            return named
    return []


def _int_arg(value: str, low: int, high: int | None, expected: str) -> int:
    """An integer in ``low..high`` (``high`` None: no bound above), or ArgumentTypeError."""
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}") from None
    if v < low or (high is not None and v > high):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {v}")
    return v


def positive_int(value: str) -> int:
    """argparse type: an integer > 0."""
    return _int_arg(value, 1, None, "a positive integer")


def count_arg(value: str) -> int:
    """argparse type: an integer >= 0 (0: no limit / off, where the flag says so)."""
    return _int_arg(value, 0, None, "an integer >= 0")


def frame_bytes_arg(value: str) -> int:
    """argparse type: a request frame bound in bytes, at least
    :data:`fastlock.protocol.MIN_MAX_FRAME_BYTES`."""
    v = positive_int(value)
    if v < MIN_MAX_FRAME_BYTES:
        raise argparse.ArgumentTypeError(f"expected at least {MIN_MAX_FRAME_BYTES} (a request with its names, "
                                         f"owner key and ids at their limits), got {v}")
    return v


def exit_code_arg(value: str) -> int:
    """argparse type: a process exit status, 0..255."""
    return _int_arg(value, 0, 255, "an exit code (0..255)")


def _seconds(value: str, what: str, *, allow_zero: bool) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    try:
        seconds = check_seconds(number, what, allow_zero=allow_zero, maximum=MAX_SECONDS)
    except FastlockError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return seconds


def seconds_arg(value: str) -> float:
    """argparse type: a finite number of seconds, 0 to one year (``units.MAX_SECONDS``)."""
    return _seconds(value, "the duration", allow_zero=True)


def positive_seconds_arg(value: str) -> float:
    """argparse type: a finite number of seconds, > 0 and at most one year."""
    return _seconds(value, "the duration", allow_zero=False)


#: seconds a client command waits for the TCP connection, and again for the server's first answer
CONNECT_TIMEOUT = 5.0


def add_connect_timeout_argument(p: argparse.ArgumentParser) -> None:
    """Add ``--connect-timeout SECONDS`` (default :data:`CONNECT_TIMEOUT`) to a client command."""
    p.add_argument("--connect-timeout", type=positive_seconds_arg, default=CONNECT_TIMEOUT, metavar="SECONDS",
                   help=f"seconds to wait for the connection, and again for the server's first answer "
                        f"(default {CONNECT_TIMEOUT:g})")


def ttl_arg(value: str) -> float:
    """argparse type: a lease TTL in seconds, > 0 and at most 1 hour (the protocol's limits)."""
    seconds = _seconds(value, "ttl", allow_zero=False)
    try:
        check_ttl_ms(seconds_to_ms(seconds, "ttl"))
    except FastlockError:
        raise argparse.ArgumentTypeError(f"a TTL is in seconds, > 0 and at most {MAX_TTL_MS // 1000} (1 hour; "
                                         f"a longer hold is renewed), got {value!r}") from None
    return seconds


def wait_arg(value: str) -> float:
    """argparse type: seconds to wait for a lock, 0 (try once) to 24 h."""
    seconds = _seconds(value, "wait", allow_zero=True)
    try:
        check_wait_ms(seconds_to_ms(seconds, "wait", allow_zero=True))
    except FastlockError:
        raise argparse.ArgumentTypeError(f"a wait must be 0 to 86400 seconds, got {value!r}") from None
    return seconds


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


def client_tls_options(args: argparse.Namespace) -> dict[str, Any]:
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


def add_token_arguments(p: argparse.ArgumentParser) -> None:
    """Add an admin command's credential options (see :func:`read_token`)."""
    p.add_argument("--token-file", metavar="FILE",
                   help="an admin principal's token file (default: env FASTLOCK_TOKEN_FILE)")
    p.add_argument("--auth-secret-file", metavar="FILE", help="legacy shared secret file")


def read_secret(path: str | None) -> str | None:
    """The legacy shared secret: from ``path``, else env FASTLOCK_AUTH_SECRET.

    Raises:
        CredentialsError: the variable is set but empty (never taken as the secret "").
        OSError: ``path`` cannot be read.
    """
    if path:
        return read_token_file(path)
    value = os.environ.get("FASTLOCK_AUTH_SECRET")
    if value is not None and not value.strip():
        raise CredentialsError("FASTLOCK_AUTH_SECRET is set but empty")
    return value.strip() if value else None


def read_token(args: argparse.Namespace) -> str | None:
    """The credential a command presents, by the one rule of
    :func:`fastlock.auth.resolve_credential` (--token-file, then --auth-secret-file,
    then env FASTLOCK_TOKEN_FILE, then env FASTLOCK_AUTH_SECRET); None: no credential."""
    path = getattr(args, "auth_secret_file", None)
    return resolve_credential(token_file=getattr(args, "token_file", None) or None,
                              auth=read_token_file(path) if path else None)


#: a command's name in its errors, where its first word is not all of it
COMMAND_NAMES = {"wal": "wal dump", "credentials": "credentials init"}


def asks_json(argv: list[str]) -> bool:
    """Does the command line ``argv`` ask for JSON output (``-o json``, ``-ojson``,
    ``--output json`` or ``--output=json``, before any ``--``)?"""
    for i, arg in enumerate(argv):
        if arg == "--":
            return False
        if arg in ("-ojson", "--output=json") or arg in ("-o", "--output") and argv[i + 1:i + 2] == ["json"]:
            return True
    return False


def print_error(args: argparse.Namespace, command: str, message: str, error: str) -> None:
    """Report a runtime error of ``fastlock COMMAND`` on stderr: the line
    ``fastlock COMMAND: MESSAGE``, or with ``-o json`` one JSON object
    ``{"command": COMMAND, "error": ERROR, "message": MESSAGE}`` (``error``: the
    exception's class name, e.g. ``"PermissionDenied"``, ``"NotFastlock"``)."""
    if getattr(args, "output", None) == "json":
        print(json.dumps({"command": command, "error": error, "message": message}), file=sys.stderr, flush=True)
    else:
        print(f"fastlock {command}: {message}", file=sys.stderr, flush=True)


def add_server_tls_arguments(p: argparse.ArgumentParser, *, cert_help: str, ca_help: str) -> None:
    """The TLS flags of a listening command (``serve``, ``witness``): ``--tls-cert``,
    ``--tls-key``, ``--tls-ca``, ``--tls-client-auth``, ``--tls-handshake-timeout``
    (seconds), as :class:`fastlock.tls.ServerTLS` takes them; ``cert_help`` and ``ca_help``
    say what the certificate and the CA are used for besides serving."""
    p.add_argument("--tls-cert", metavar="FILE", help=cert_help)
    p.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (default: in --tls-cert)")
    p.add_argument("--tls-ca", metavar="FILE", help=ca_help)
    p.add_argument("--tls-client-auth", choices=("none", "optional", "required"), default="none",
                   help="client certificates: none (default), optional (verified if sent), required "
                        "(mutual TLS); needs --tls-ca")
    p.add_argument("--tls-handshake-timeout", type=seconds_arg, default=10.0, metavar="SECONDS",
                   help="drop a connection whose TLS handshake takes longer (default 10; at most 1 while more "
                        "than half of the 1,024 handshake slots are taken)")


def check_server_tls_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse the flags of :func:`add_server_tls_arguments` that do not go together (exit 2)."""
    if (args.tls_key or args.tls_ca) and not args.tls_cert:
        parser.error("--tls-key and --tls-ca need --tls-cert (this node's certificate)")
    if args.tls_client_auth != "none" and not args.tls_ca:
        parser.error(f"--tls-client-auth {args.tls_client_auth} needs --tls-ca (the CA that signs client "
                     f"certificates)")
    if args.tls_cert and args.tls_handshake_timeout <= 0:
        parser.error("--tls-handshake-timeout must be > 0 seconds")
