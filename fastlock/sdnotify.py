"""Readiness and status notifications to the service manager (systemd's ``sd_notify`` protocol).

Under a systemd unit with ``Type=notify`` the service manager passes the path
of an ``AF_UNIX`` datagram socket in ``$NOTIFY_SOCKET``; the service sends
newline-separated ``KEY=VALUE`` assignments to it: ``READY=1`` once it
serves (systemd then starts the units ordered after it), ``STOPPING=1`` when
it begins to shut down, ``STATUS=...`` a line shown by ``systemctl status``.
A path starting with ``@`` names a socket in the abstract namespace.  This is
the protocol of sd_notify(3); it needs no library.

Without ``$NOTIFY_SOCKET`` (not under systemd, or ``Type=simple``) every
call does nothing and returns False.  A notification that cannot be sent is
logged and never raises: readiness reporting must not stop a server.
"""

from __future__ import annotations

import logging
import os
import socket

__all__ = ["notify", "ready", "stopping", "status"]

log = logging.getLogger(__name__)

_MAX_STATUS_CHARS = 200  # one line in `systemctl status`


def _socket_address(path: str) -> str | bytes:
    if path.startswith("@"):  # abstract namespace: a leading NUL byte
        return b"\0" + path[1:].encode()
    return path


def notify(*assignments: str) -> bool:
    """Send ``KEY=VALUE`` assignments in one datagram to ``$NOTIFY_SOCKET``.

    Returns:
        True if sent; False when there is no ``$NOTIFY_SOCKET`` or sending
        failed (logged at WARNING).

    Raises:
        ValueError: an assignment without ``=`` or containing a newline
            (it would be read as another assignment).
    """
    for a in assignments:
        if "=" not in a or "\n" in a:
            raise ValueError(f"not a KEY=VALUE line: {a!r}")
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if not (path.startswith("/") or path.startswith("@")):
        log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract socket name: not notifying", path)
        return False
    message = "\n".join(assignments).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(_socket_address(path))
            sock.sendall(message)
    except OSError as exc:
        log.warning("could not notify the service manager at %s: %s", path, exc)
        return False
    return True


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line[:_MAX_STATUS_CHARS]


def ready(status_text: str | None = None) -> bool:
    """``READY=1`` (and ``MAINPID``, ``STATUS`` if given): the server accepts connections."""
    lines = ["READY=1", f"MAINPID={os.getpid()}"]
    if status_text:
        lines.append("STATUS=" + _one_line(status_text))
    return notify(*lines)


def stopping(status_text: str | None = None) -> bool:
    """``STOPPING=1``: the server began to shut down."""
    lines = ["STOPPING=1"]
    if status_text:
        lines.append("STATUS=" + _one_line(status_text))
    return notify(*lines)


def status(text: str) -> bool:
    """``STATUS=<text>`` (whitespace folded to one line of at most 200 characters)."""
    return notify("STATUS=" + _one_line(text))
