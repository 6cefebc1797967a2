"""The client's settings from the environment: one rule for :func:`fastlock.connect`,
:class:`~fastlock.client.blocking.SyncClient` and every ``fastlock`` command.

An explicit argument always wins; a variable fills in only what the caller left out:

========================  ==============================================================
``FASTLOCK_SERVER``       the servers, comma-separated ``host[:port]`` (also ``FASTLOCK_SERVERS``;
                          default ``127.0.0.1:7420``), when no address is given
``FASTLOCK_TOKEN_FILE``   a file holding this client's principal token (read by
                          :func:`fastlock.auth.resolve_credential`, the one rule for the
                          library and every command)
``FASTLOCK_AUTH_SECRET``  the legacy shared secret itself, when no token, token file nor
                          ``auth`` is given and ``FASTLOCK_TOKEN_FILE`` is unset
``FASTLOCK_TLS``          ``1``: connect over TLS (the system's CAs) when ``tls`` is not given
``FASTLOCK_TLS_CA``,      the client TLS files (``tls_ca``, ``tls_cert``, ``tls_key``) and the
``FASTLOCK_TLS_CERT``,    name the server certificates must carry (``server_hostname``), each
``FASTLOCK_TLS_KEY``,     when that argument is not given and ``tls`` is not False or an
``FASTLOCK_TLS_SERVER_    ``ssl.SSLContext``
NAME``
========================  ==============================================================
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from ..units import DEFAULT_PORT

__all__ = ["SERVER_VARIABLES", "addresses_from_env", "tls_from_env"]

#: the variables naming the servers, in the order they are read
SERVER_VARIABLES = ("FASTLOCK_SERVER", "FASTLOCK_SERVERS")

_TLS_VARIABLES = (("tls_ca", "FASTLOCK_TLS_CA"), ("tls_cert", "FASTLOCK_TLS_CERT"),
                  ("tls_key", "FASTLOCK_TLS_KEY"), ("server_hostname", "FASTLOCK_TLS_SERVER_NAME"))


def addresses_from_env(addresses: Iterable[Any], env: Mapping[str, str] | None = None) -> list[Any]:
    """``addresses`` as a list; when empty, the servers named by ``$FASTLOCK_SERVER`` (else
    ``$FASTLOCK_SERVERS``), else ``127.0.0.1:7420``."""
    given = list(addresses)
    if given:
        return given
    env = os.environ if env is None else env
    for var in SERVER_VARIABLES:
        named = [s.strip() for s in env.get(var, "").split(",") if s.strip()]
        if named:
            return named
    return [f"127.0.0.1:{DEFAULT_PORT}"]


def tls_from_env(tls: Any, options: dict[str, str | None],
                 env: Mapping[str, str] | None = None) -> tuple[Any, dict[str, str | None]]:
    """``(tls, options)`` with each TLS option the caller left None filled from the
    environment (module docstring); ``tls`` False or an SSLContext is left alone."""
    env = os.environ if env is None else env
    if tls is False or (tls is not None and tls is not True):
        return tls, options
    filled = dict(options)
    for key, var in _TLS_VARIABLES:
        if filled.get(key) is None and env.get(var):
            filled[key] = env[var]
    if tls is None and env.get("FASTLOCK_TLS", "") not in ("", "0"):
        tls = True
    return tls, filled
