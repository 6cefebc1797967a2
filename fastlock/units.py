"""Units, clocks and addresses: the one place each of these rules is written.

A leaf module (it imports only :mod:`fastlock.errors`), shared by the client,
the server, the log and the command line.

- Durations in the Python API are **seconds** (``float``); on the wire, in the
  write-ahead log and in the core they are **milliseconds** (``int``).
  :func:`check_seconds` validates the former, :func:`seconds_to_ms` converts.
- :func:`monotonic_ms` is the clock every deadline uses (never the wall
  clock, which can jump); :func:`wall_ms` is for timestamps a person reads
  (log records, ``wal dump``).
- :func:`parse_address` is the one parser of ``host:port`` strings, used by
  :func:`fastlock.connect` and by every command-line flag that names a server.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal, overload

from .errors import InvalidArgument, WrongArgumentType

#: the port a server listens on, and a client dials, when none is given
DEFAULT_PORT = 7420

#: the longest duration any setting accepts: one year, in seconds
MAX_SECONDS = 86400.0 * 365


def monotonic_ms() -> int:
    """Monotonic time in integer milliseconds (``time.monotonic_ns() // 10**6``)."""
    return time.monotonic_ns() // 1_000_000


def wall_ms() -> int:
    """Wall-clock time in integer milliseconds since the Unix epoch."""
    return time.time_ns() // 1_000_000


@overload
def check_seconds(value: Any, what: str, *, allow_none: Literal[False] = False, allow_zero: bool = False,
                  maximum: float | None = None) -> float: ...


@overload
def check_seconds(value: Any, what: str, *, allow_none: bool, allow_zero: bool = False,
                  maximum: float | None = None) -> float | None: ...


def check_seconds(value: Any, what: str, *, allow_none: bool = False, allow_zero: bool = False,
                  maximum: float | None = None) -> float | None:
    """Validate a duration given in **seconds**; return it as a ``float``.

    Args:
        value: the caller's value: ``int`` or ``float`` (``bool`` is refused).
        what: the argument's name, for the error message.
        allow_none: accept ``None`` (meaning "no limit"), returned as is.
        allow_zero: accept 0 (otherwise the value must be > 0).
        maximum: refuse values above this many seconds (default: none).

    Raises:
        WrongArgumentType: not a number (or ``None`` where not allowed).
        InvalidArgument: NaN, infinite, negative, zero where not allowed, or
            above ``maximum``.
    """
    if value is None:
        if allow_none:
            return None
        raise WrongArgumentType(f"{what} must be a number of seconds, not None")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WrongArgumentType(f"{what} must be a number of seconds, not {type(value).__name__}")
    if math.isnan(value) or math.isinf(value):
        raise InvalidArgument(f"{what} must be a finite number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InvalidArgument(f"{what} must be {'>= 0' if allow_zero else '> 0'} seconds, got {value!r}")
    if maximum is not None and value > maximum:
        raise InvalidArgument(f"{what} must be at most {maximum:g} seconds, got {value!r}")
    return float(value)


def seconds_to_ms(value: Any, what: str, *, allow_none: bool = False, allow_zero: bool = False) -> int:
    """Convert a duration in **seconds** (Python API) to wire **milliseconds**.

    ``None`` becomes -1 (forever) when ``allow_none``.  The value is checked by
    :func:`check_seconds` (same errors); a positive value below 1 ms rounds up
    to 1 ms rather than down to 0.
    """
    seconds = check_seconds(value, what, allow_none=allow_none, allow_zero=allow_zero)
    if seconds is None:
        return -1
    if seconds == 0:
        return 0
    return max(1, math.ceil(seconds * 1000))


def parse_address(value: Any, *, default_port: int | None = DEFAULT_PORT,
                  allow_port_zero: bool = False) -> tuple[str, int]:
    """Parse a server address into ``(host, port)``.

    Accepts ``(host, port)`` tuples and the strings ``HOST:PORT``,
    ``[IPv6]:PORT`` and, when ``default_port`` is not ``None``, a bare
    ``HOST`` or ``[IPv6]``.  An empty host means ``127.0.0.1``.  Ports are
    1-65535 (0 too with ``allow_port_zero``: "any free port" for a listener).

    Raises:
        WrongArgumentType: neither a string nor a ``(host, port)`` pair.
        InvalidArgument: a missing or bad port, an IPv6 address without
            brackets, unbalanced brackets.
    """
    if isinstance(value, tuple) and len(value) == 2:
        host, port = value
        if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
            raise WrongArgumentType(f"an address tuple is (str host, int port), not {value!r}")
        return _checked(host or "127.0.0.1", port, repr(value), allow_port_zero)
    if not isinstance(value, str) or not value.strip():
        raise WrongArgumentType(f"an address is 'host:port' or (host, port), not {value!r}")
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        host, sep, port_text = text, "", ""
    else:
        host, sep, port_text = text.rpartition(":")
    if not sep:
        if default_port is None:
            raise InvalidArgument(f"expected HOST:PORT, got {value!r}")
        host, port_text = text, str(default_port)
    if host.startswith("[") != host.endswith("]"):
        raise InvalidArgument(f"unbalanced brackets in address {value!r}")
    if host.startswith("["):
        host = host[1:-1]
    elif ":" in host:
        raise InvalidArgument(f"an IPv6 address needs brackets, as '[::1]:{DEFAULT_PORT}'; got {value!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise InvalidArgument(f"bad port {port_text!r} in address {value!r}") from None
    return _checked(host or "127.0.0.1", port, repr(value), allow_port_zero)


def _checked(host: str, port: int, shown: str, allow_port_zero: bool) -> tuple[str, int]:
    low = 0 if allow_port_zero else 1
    if not low <= port <= 65535:
        raise InvalidArgument(f"port out of range ({low}-65535) in address {shown}")
    return host, port


def format_address(address: tuple[str, int]) -> str:
    """``(host, port)`` as text: ``host:port``, or ``[host]:port`` for IPv6."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
