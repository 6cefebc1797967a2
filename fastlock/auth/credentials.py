"""Tokens, principals and their ACLs, and the credentials file: who may do what
on a fastlock server (the rules are in :mod:`fastlock.auth`)."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import logging
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..errors import FastlockError
from .handshake import ClientSecret, ServerKeys, client_secret, derive_keys
from .sequencer_keys import SequencerKeyError, SequencerKeys, parse_sequencer_keys, sequencer_key_lines

log = logging.getLogger(__name__)

KINDS = ("client", "replica", "admin")
#: the operations a client ACL rule may grant ("*" in a rule means all of them)
CLIENT_OPS = ("acquire", "release", "extend", "cancel", "check", "holder", "watch",
              "put", "get", "delete",  # keys of the key store (fastlock.server.keys)
              "prioritize", "preempt")  # priorities above 0, revoke requests (fastlock.server.preemption)
#: the principal of connections that present no token (when the credentials allow it)
ANONYMOUS = "anonymous"
#: the client principal the legacy ``--auth-secret-file`` secret stands for
SHARED_SECRET_PRINCIPAL = "shared-secret"
TOKEN_PREFIX = "fl1"
MAX_TOKEN_CHARS = 1024
#: the credentials file format this fastlock reads and writes
FORMAT_VERSION = 2

_PRINCIPAL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HEX = re.compile(r"^[0-9a-f]*$")


class CredentialsError(FastlockError, ValueError):
    """A credentials or token file is missing, unreadable, empty or malformed
    (raised at start, with the file and the reason)."""


# -- hashing ----------------------------------------------------------------------------


def hash_token(token: str) -> bytes:
    """SHA-256 of a token as a format-1 credentials file stored it (``token_sha256``),
    32 bytes: what ``fastlock credentials upgrade`` checks a token file against."""
    return hashlib.sha256(b"fastlock token v1\0" + token.encode("utf-8", "surrogatepass")).digest()


def secret_of(token: str) -> ClientSecret:
    """What a client proves with ``token`` (:class:`~fastlock.auth.handshake.ClientSecret`):
    a token ``fl1.<principal>.<random>`` proves that principal; any other string is the
    legacy shared secret (principal None)."""
    return client_secret(token, token_principal(token))


#: BLAKE2b-128 personalised for owner keys, with nothing hashed yet: hash_owner copies it
#: (cheaper than setting the parameters up again for every request)
_OWNER_HASH = hashlib.blake2b(digest_size=16, person=b"fastlock-owner")


def hash_owner(owner: bytes) -> bytes:
    """BLAKE2b-128 (person ``fastlock-owner``) of a client's owner key: what the
    server keeps instead of the key."""
    h = _OWNER_HASH.copy()
    h.update(owner)
    return h.digest()


def make_token(principal: str) -> str:
    """A new random token for ``principal``: ``fl1.<principal>.<256 random bits, base64url>``."""
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode("ascii")
    return f"{TOKEN_PREFIX}.{principal}.{secret}"


def token_principal(token: str) -> str | None:
    """The principal name a token claims (not verified), or None if it is not a fastlock token."""
    head, sep, rest = token.partition(".")
    if head != TOKEN_PREFIX or not sep:
        return None
    name, sep, secret = rest.rpartition(".")
    if not sep or not secret or not _PRINCIPAL_NAME.match(name):
        return None
    return name


def read_token_file(path: str | os.PathLike) -> str:
    """Read a token (or legacy secret) file: one line, surrounding whitespace ignored.

    Raises CredentialsError if it cannot be read, is empty, or is longer than
    1024 characters.  Logs a warning if other users may read it.
    """
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read(MAX_TOKEN_CHARS + 2).strip()
            mode = os.fstat(f.fileno()).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise CredentialsError(f"cannot read token file {os.fspath(path)!r}: {exc}") from None
    if not value:
        raise CredentialsError(f"token file {os.fspath(path)!r} is empty")
    if len(value) > MAX_TOKEN_CHARS:
        raise CredentialsError(f"token file {os.fspath(path)!r} holds more than {MAX_TOKEN_CHARS} characters")
    if mode & 0o077:
        log.warning("token file %r may be read by other users (mode %o): chmod 600 it", os.fspath(path), mode & 0o777)
    return value


def is_loopback(host: str) -> bool:
    """True for a loopback listen address (127.0.0.0/8, ::1, localhost)."""
    if host in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# -- principals ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AclRule:
    """Grants ``ops`` (a subset of :data:`CLIENT_OPS`) on every name starting with ``prefix``."""

    prefix: str
    ops: frozenset


@dataclass(frozen=True)
class Principal:
    """One principal of a credentials file (see the module docstring)."""

    name: str
    kind: str
    keys: ServerKeys | None = None  # from the token (None: certificate identities only, or anonymous)
    acl: tuple = ()
    node_id: str | None = None
    cert_identities: tuple = ()

    def allows(self, op: str, name: str) -> bool:
        """May this principal do client operation ``op`` on lock ``name``?"""
        if self.kind == "admin":
            return True
        if self.kind != "client":
            return False
        if op in self.everywhere:
            return True
        for rule in self.acl:
            if op in rule.ops and name.startswith(rule.prefix):
                return True
        return False

    @cached_property
    def everywhere(self) -> frozenset:
        """What this principal may do whatever the lock name: the client operations
        its ACL grants on every name (rules with prefix ``""``; all of them for an
        admin), plus its kind for a replica or an admin (their operations take no
        lock name).  Computed once, so that the server checks a request of the open
        mode's anonymous principal, or of any full grant, with one set lookup
        instead of a walk over the rules; :meth:`allows` gives the same answers."""
        if self.kind == "admin":
            return frozenset((*CLIENT_OPS, "admin"))
        if self.kind != "client":
            return frozenset((self.kind,))
        return frozenset(op for rule in self.acl if rule.prefix == "" for op in rule.ops)


_EVERY_NAME = (AclRule("", frozenset(CLIENT_OPS)),)



def read_toml(path: str) -> dict:
    """The TOML table of the credentials file at ``path``.

    Raises CredentialsError naming the file: unreadable, not valid TOML, or a
    Python without :mod:`tomllib` (3.10).
    """
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        raise CredentialsError("credentials files need Python 3.11 or later (tomllib)") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise CredentialsError(f"cannot read credentials file {path!r}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CredentialsError(f"{path}: not valid TOML: {exc}") from None

@dataclass
class Credentials:
    """The principals a server knows.

    ``anonymous`` is the principal of a connection that presents no token (None:
    such connections are refused).  ``source`` names where they came from, for
    logs.
    """

    principals: dict = field(default_factory=dict)
    anonymous: Principal | None = None
    shared_secret: Principal | None = None  # the legacy shared secret's principal, with its keys
    source: str = "open mode"
    #: the group's sequencer keys (fastlock.auth.sequencer_keys): none in open mode
    sequencer_keys: SequencerKeys = field(default_factory=SequencerKeys)

    @property
    def open(self) -> bool:
        """No credentials at all: everyone is the anonymous client."""
        return not self.principals and self.shared_secret is None

    @classmethod
    def open_mode(cls) -> Credentials:
        """No credentials file: every connection is the anonymous client with every name (which
        may also list and revoke leases, see :mod:`fastlock.server.lockadmin`); replica and
        admin-only operations (replication, promote, serve-alone) are refused: nobody can
        authenticate as those."""
        return cls(anonymous=Principal(ANONYMOUS, "client", acl=_EVERY_NAME), source="open mode")

    def with_shared_secret(self, secret: str) -> Credentials:
        """Also accept the legacy shared secret, as the client principal ``shared-secret``
        with every name (never a replica or an admin).  Without a credentials file,
        connections without the secret are then refused, as before."""
        if not secret:
            raise CredentialsError("the shared secret is empty")
        anonymous = None if self.open else self.anonymous
        shared = Principal(SHARED_SECRET_PRINCIPAL, "client", derive_keys(secret), _EVERY_NAME)
        return Credentials(dict(self.principals), anonymous, shared,
                           self.source if not self.open else "shared secret", self.sequencer_keys)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Credentials:
        """Read a credentials file (TOML, see the module docstring).

        Raises CredentialsError naming the file and what is wrong with it.
        """
        where = os.fspath(path)
        data = read_toml(where)
        try:
            return cls._parse(data, where)
        except CredentialsError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise CredentialsError(f"{where}: malformed: {exc}") from None

    @classmethod
    def _parse(cls, data: dict, where: str) -> Credentials:
        version = data.get("version", 1)
        if version == 1:
            raise CredentialsError(
                f"{where}: credentials format 1 (token hashes, tokens sent in clear) is no longer read: "
                f"convert it with `fastlock credentials upgrade {os.path.dirname(where) or '.'}` "
                f"(reads the *.token files beside it; tokens stay the same)")
        if version != FORMAT_VERSION:
            raise CredentialsError(f"{where}: unsupported version {version!r} (this fastlock reads {FORMAT_VERSION})")
        table = data.get("principals")
        if not isinstance(table, dict) or not table:
            raise CredentialsError(f"{where}: no [principals.NAME] tables")
        principals: dict[str, Principal] = {}
        anonymous = None
        identities: dict[str, str] = {}
        for name, entry in table.items():
            what = f"{where}: principal {name!r}"
            if not _PRINCIPAL_NAME.match(name):
                raise CredentialsError(f"{what}: a name is 1-64 of A-Z a-z 0-9 _ . - (starting with a letter or digit)")
            if not isinstance(entry, dict):
                raise CredentialsError(f"{what}: must be a table")
            unknown = set(entry) - {"kind", "stored_key", "server_key", "acl", "node_id", "cert_identities"}
            if unknown:
                raise CredentialsError(f"{what}: unknown keys {sorted(unknown)}")
            kind = entry.get("kind")
            if kind not in KINDS:
                raise CredentialsError(f"{what}: kind must be one of {', '.join(KINDS)}, not {kind!r}")
            stored_key = _hex_field(entry, "stored_key", 32, what)
            server_key = _hex_field(entry, "server_key", 32, what)
            if (stored_key is None) != (server_key is None):
                raise CredentialsError(f"{what}: stored_key and server_key go together")
            keys = ServerKeys(stored_key, server_key) if stored_key is not None and server_key is not None else None
            if name == ANONYMOUS:
                if kind != "client" or keys is not None:
                    raise CredentialsError(f"{what}: the anonymous principal is a client without a token")
            elif keys is None and not entry.get("cert_identities"):
                raise CredentialsError(f"{what}: needs stored_key and server_key, or cert_identities")
            acl: tuple = ()
            if kind == "client":
                acl = _parse_acl(entry.get("acl"), what)
            elif "acl" in entry:
                raise CredentialsError(f"{what}: only client principals have an acl")
            node = entry.get("node_id")
            if node is not None and (kind != "replica" or type(node) is not str or not node):
                raise CredentialsError(f"{what}: node_id is a non-empty string, for replica principals only")
            certs = entry.get("cert_identities", [])
            if not isinstance(certs, list) or not all(isinstance(c, str) and c for c in certs):
                raise CredentialsError(f"{what}: cert_identities is a list of non-empty strings")
            for cn in certs:
                if cn in identities:
                    raise CredentialsError(f"{what}: certificate identity {cn!r} already maps to {identities[cn]!r}")
                identities[cn] = name
            p = Principal(name, kind, keys, acl, node, tuple(certs))
            if name == ANONYMOUS:
                anonymous = p
            else:
                principals[name] = p
        try:
            sequencer_keys = parse_sequencer_keys(data.get("sequencer_keys"), where)
        except SequencerKeyError as exc:
            raise CredentialsError(str(exc)) from None
        return cls(principals, anonymous, None, where, sequencer_keys)

    # -- lookups ------------------------------------------------------------------------
    def lookup(self, principal: str | None) -> Principal | None:
        """The principal a handshake names, if it has keys to prove: ``None`` names
        the legacy shared secret (as does ``"shared-secret"`` when no principal of
        that name exists)."""
        if principal is None:
            return self.shared_secret
        p = self.principals.get(principal)
        if p is None and principal == SHARED_SECRET_PRINCIPAL:
            return self.shared_secret
        return p if p is not None and p.keys is not None else None

    def by_cert_identity(self, identity: str) -> Principal | None:
        """The principal a verified client certificate's identity (its subject CN) maps to."""
        for p in self.principals.values():
            if identity in p.cert_identities:
                return p
        return None


def _hex_field(entry: dict, key: str, size: int, what: str) -> bytes | None:
    value = entry.get(key)
    if value is None:
        return None
    if type(value) is not str or len(value) != 2 * size or not _HEX.match(value):
        raise CredentialsError(f"{what}: {key} must be {2 * size} lowercase hex digits")
    return bytes.fromhex(value)


def _parse_acl(rules: Any, what: str) -> tuple:
    if rules is None:
        raise CredentialsError(f"{what}: a client needs an acl (e.g. acl = [{{prefix = \"\", ops = [\"*\"]}}])")
    if not isinstance(rules, list):
        raise CredentialsError(f"{what}: acl is a list of {{prefix, ops}} tables")
    out = []
    for rule in rules:
        if not isinstance(rule, dict) or set(rule) - {"prefix", "ops"}:
            raise CredentialsError(f"{what}: each acl rule is {{prefix = \"...\", ops = [...]}}")
        prefix = rule.get("prefix", "")
        ops = rule.get("ops")
        if type(prefix) is not str or "\x00" in prefix:
            raise CredentialsError(f"{what}: acl prefix must be a string without NUL")
        if not isinstance(ops, list) or not ops:
            raise CredentialsError(f"{what}: acl ops is a non-empty list of {', '.join(CLIENT_OPS)} or \"*\"")
        bad = [o for o in ops if o != "*" and o not in CLIENT_OPS]
        if bad:
            raise CredentialsError(f"{what}: unknown acl ops {bad} (known: {', '.join(CLIENT_OPS)}, \"*\")")
        out.append(AclRule(prefix, frozenset(CLIENT_OPS) if "*" in ops else frozenset(ops)))
    return tuple(out)


# -- generating credentials ------------------------------------------------------------------


def _toml_str(value: str) -> str:
    # a JSON string without non-ASCII escapes is a TOML basic string
    return json.dumps(value, ensure_ascii=False)


def generate(directory: str | os.PathLike, *, clients: Iterable[tuple[str, str]] = (("app", ""),),
             replicas: Iterable[str] = ("node-a", "node-b"), admins: Iterable[str] = ("admin",),
             anonymous_prefix: str | None = None,
             cert_identities: dict[str, Iterable[str]] | None = None,
             sequencer_algorithm: str | None = "ed25519") -> dict[str, str]:
    """Make ``DIR/credentials.toml`` and one ``DIR/<principal>.token`` per principal.

    ``clients`` are ``(name, prefix)`` pairs (the client may do every client
    operation on names starting with ``prefix``); ``anonymous_prefix``, when
    not None, lets connections without a token act as a client on that prefix.
    ``cert_identities`` maps principals to the subject CNs of mutual-TLS client
    certificates that authenticate as them (no token needed).
    ``sequencer_algorithm``: the group's first sequencer key (``"ed25519"``,
    ``"hmac-sha256"``; None: none, see :mod:`fastlock.auth.sequencer_keys`).
    The directory is made 0700 and every file 0600; existing files are never
    overwritten (CredentialsError).  Returns ``{principal: token file path}``.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    entries: list[tuple[str, str, str | None]] = [(n, "client", p) for n, p in clients]
    entries += [(n, "replica", None) for n in replicas]
    entries += [(n, "admin", None) for n in admins]
    certs = {k: list(v) for k, v in (cert_identities or {}).items()}
    seen = set()
    for name, _, _ in entries:
        if not _PRINCIPAL_NAME.match(name) or name == ANONYMOUS or name in seen:
            raise CredentialsError(f"bad or repeated principal name {name!r}")
        seen.add(name)
    unknown = set(certs) - seen
    if unknown:
        raise CredentialsError(f"certificate identities for unknown principals {sorted(unknown)}")
    targets = [os.path.join(directory, "credentials.toml")] + [os.path.join(directory, f"{n}.token")
                                                                for n, _, _ in entries]
    for path in targets:
        if os.path.exists(path):
            raise CredentialsError(f"{path} exists: not overwriting credentials (use another directory)")
    lines = list(FILE_HEADER)
    tokens: dict[str, str] = {}
    for name, kind, prefix in entries:
        token = make_token(name)
        tokens[name] = token
        lines += principal_lines(name, kind, derive_keys(token),
                                 [{"prefix": prefix or "", "ops": ["*"]}] if kind == "client" else None,
                                 None, certs.get(name))
    if anonymous_prefix is not None:
        lines += [f"[principals.{ANONYMOUS}]", 'kind = "client"',
                  f'acl = [{{prefix = {_toml_str(anonymous_prefix)}, ops = ["*"]}}]', ""]
    if sequencer_algorithm is not None:
        from ..sequencer import HAVE_ED25519, new_signing_key
        if sequencer_algorithm != "ed25519" or HAVE_ED25519:  # without cryptography: no Ed25519 key
            key = new_signing_key(sequencer_algorithm)
            lines += sequencer_key_lines((key,), key)
    _write_private(targets[0], "\n".join(lines))
    paths = {}
    for name, _, _ in entries:
        path = os.path.join(directory, f"{name}.token")
        _write_private(path, tokens[name] + "\n")
        paths[name] = path
    return paths


#: the first lines of a credentials file
FILE_HEADER = ("# fastlock credentials: keys derived from the tokens, never the tokens (those are in the",
               "# *.token files beside it). Give each program only its own token file.",
               "# See `pydoc fastlock.auth` for the format.",
               f"version = {FORMAT_VERSION}", "")


def principal_lines(name: str, kind: str, keys: ServerKeys | None, acl: list | None, node_id: str | None,
                    cert_identities: Iterable[str] | None) -> list[str]:
    """The TOML lines of one ``[principals.NAME]`` table (format 2), ending with a blank line."""
    lines = [f"[principals.{name}]", f"kind = {_toml_str(kind)}"]
    if keys is not None:
        lines.append(f'stored_key = "{keys.stored_key.hex()}"')
        lines.append(f'server_key = "{keys.server_key.hex()}"')
    if acl is not None:
        rules = ", ".join(f"{{prefix = {_toml_str(r.get('prefix', ''))}, "
                          f"ops = [{', '.join(map(_toml_str, r['ops']))}]}}" for r in acl)
        lines.append(f"acl = [{rules}]")
    if node_id is not None:
        lines.append(f"node_id = {_toml_str(node_id)}")
    if cert_identities:
        lines.append(f"cert_identities = [{', '.join(_toml_str(cn) for cn in cert_identities)}]")
    lines.append("")
    return lines


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
