"""How a node reaches etcd: the protocol, the TLS files and the etcd user.

:class:`EtcdAccess` holds the settings, named as Patroni's ``etcd3`` section
names them (``protocol``, ``cacert``, ``cert``, ``key``, ``username``,
``password``), here the ``fastlock serve`` flags ``--coordinator-protocol``,
``--coordinator-cacert``, ``--coordinator-cert``, ``--coordinator-key``,
``--coordinator-user`` and ``--coordinator-password-file``.  The password is
read from a file (never from the command line, the environment or the config
file itself) and lives only in :class:`EtcdLogin`, whose ``repr`` hides it.

Every problem with a setting raises :class:`~fastlock.errors.InvalidArgument`
naming that setting, at start: a CA file that cannot be read or is not PEM, a
certificate whose key does not match, an empty or unreadable password file.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass, field

from ..errors import InvalidArgument
from ..tls import client_context

__all__ = ["EtcdAccess", "EtcdLogin", "PROTOCOLS"]

log = logging.getLogger("fastlock.coordination")

#: the values of ``--coordinator-protocol``
PROTOCOLS = ("http", "https")
#: the longest password file read (bytes): etcd passwords are short
MAX_PASSWORD_BYTES = 1024


@dataclass(frozen=True)
class EtcdLogin:
    """An etcd user and its password, sent only to ``/v3/auth/authenticate`` over the
    gateway's connection (its ``repr`` shows the user, never the password)."""

    user: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class EtcdAccess:
    """The way to etcd's v3 JSON gateway (all optional: plain HTTP, no user by default).

    Attributes:
        protocol: ``"http"`` or ``"https"`` (``--coordinator-protocol``; Patroni's ``protocol``).
        cacert: PEM file of the CA that signed etcd's server certificate
            (``--coordinator-cacert``; None: the system's trust store).
        cert: PEM file of this node's client certificate for etcd's
            ``--client-cert-auth`` (``--coordinator-cert``).
        key: PEM file of that certificate's key (``--coordinator-key``; None: in ``cert``).
        user: the etcd user (``--coordinator-user``; Patroni's ``username``).
        password_file: a file holding that user's password on its first line
            (``--coordinator-password-file``).
    """

    protocol: str = "http"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password_file: str | None = None

    def check(self) -> None:
        """Refuse settings that cannot work together (no file is read).

        Raises:
            InvalidArgument: an unknown protocol, TLS files with ``http``, a key without a
                certificate, a user without a password file or the reverse.
        """
        if self.protocol not in PROTOCOLS:
            raise InvalidArgument(f"--coordinator-protocol must be http or https, not {self.protocol!r}")
        if self.protocol == "http" and (self.cacert or self.cert or self.key):
            raise InvalidArgument("--coordinator-cacert, --coordinator-cert and --coordinator-key need "
                                  "--coordinator-protocol https")
        if self.key and not self.cert:
            raise InvalidArgument("--coordinator-key needs --coordinator-cert (the certificate it belongs to)")
        if bool(self.user) != bool(self.password_file):
            raise InvalidArgument("--coordinator-user and --coordinator-password-file go together (an etcd "
                                  "user and the file holding its password)")
        if self.user is not None and (not self.user.isprintable() or len(self.user) > 256):
            raise InvalidArgument("--coordinator-user must be at most 256 printable characters")

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context (None with ``http``): etcd's certificate and host name
        verified against ``cacert``, ``cert``/``key`` presented to etcd.

        Raises:
            InvalidArgument: a file cannot be read, is not PEM, or the key does not match
                the certificate (the message names the setting and the file).
        """
        self.check()
        if self.protocol != "https":
            return None
        try:
            client_context(self.cacert)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgument(f"--coordinator-cacert {self.cacert}: not a readable PEM CA file ({exc})") from None
        try:
            return client_context(self.cacert, self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidArgument(f"--coordinator-cert {self.cert} / --coordinator-key {self.key or self.cert}: "
                                  f"not a readable PEM certificate and matching key ({exc})") from None

    def login(self) -> EtcdLogin | None:
        """The user and the password read from ``password_file`` (None: no user).

        Raises:
            InvalidArgument: the file cannot be read, is empty, or is longer than
                :data:`MAX_PASSWORD_BYTES` (the message names the file, never its content).

        Logs a warning when other users may read the file (as a token file).
        """
        self.check()
        if not self.user or not self.password_file:
            return None
        try:
            with open(self.password_file, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                data = f.read(MAX_PASSWORD_BYTES + 1)
        except OSError as exc:
            raise InvalidArgument(f"--coordinator-password-file {self.password_file}: "
                                  f"{exc.strerror or exc}") from None
        lines = data.decode("utf-8", "replace").splitlines()
        password = lines[0] if lines else ""
        if len(data) > MAX_PASSWORD_BYTES or not password:
            raise InvalidArgument(f"--coordinator-password-file {self.password_file}: expected the etcd "
                                  f"password on its first line (1..{MAX_PASSWORD_BYTES} bytes)")
        if mode & 0o077:
            log.warning("--coordinator-password-file %r may be read by other users (mode %o): chmod 600 it",
                        self.password_file, mode & 0o777)
        return EtcdLogin(self.user, password)
