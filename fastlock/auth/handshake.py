"""The HELLO handshake's proofs, sans-IO: a token is proved, never sent.

A mutual challenge-response in the manner of SCRAM-SHA-256 (RFC 5802 and
RFC 7677, as PostgreSQL authenticates its users), without PBKDF2: a fastlock
token carries 256 random bits, so there is no password to stretch.

Keys (all 32 bytes), from a principal's token ``T`` (the whole token string,
UTF-8)::

    ClientKey = HMAC-SHA256(T, "fastlock client key v2")
    StoredKey = SHA-256(ClientKey)                 # in the credentials file
    ServerKey = HMAC-SHA256(T, "fastlock server key v2")   # in the credentials file

The exchange (every nonce 32 random bytes)::

    client -> HELLO credential {"principal", "nonce", "role", "node", "from", "to"}
    server -> {"challenge": {"nonce": server nonce, "node": server node id}}
    client -> HELLO credential {"proof": ClientKey XOR HMAC(StoredKey, "client" || AuthMessage)}
    server -> hello info + {"server_proof": HMAC(ServerKey, "server" || AuthMessage)}

``AuthMessage`` is the msgpack array ``[label, principal, role, client nonce,
server nonce, server node id, client node id, dialed endpoint]`` (msgpack is unambiguous: no
field can spill into the next).  So a proof names who gives it (principal
and node), to whom (the server's node id), in which role and direction (the
client proof and the server proof use different keys and labels), and for
which exchange (both nonces): it cannot be replayed with a fresh server
nonce, nor reflected to the node that asked for it, nor used at another node.

The dialed endpoint (``"to"``: the ``ip:port`` the client's socket is connected to, as
the client sees it) binds the proof to the TCP endpoint: a server on plain TCP refuses
a handshake that names an endpoint other than the one the connection reached it at
(or one of the addresses it is told it is reached as, for NAT), so a process that
relays a client from another address (a squatter on a dead node's port, an address a
rogue etcd record names) gets the connection refused instead of a session, in the
spirit of SCRAM's channel binding (RFC 5929's endpoint binding, at the TCP layer).
A relay cannot strip or change ``"to"``: it is inside ``AuthMessage``.

The server keeps only ``StoredKey`` and ``ServerKey``: a stolen credentials
file lets a thief pose as the *server* to a principal (as with SCRAM), never
as the principal.  A client refuses to send anything but HELLO before the
server's proof checks out, and a client that holds a credential refuses a
server that does not prove itself (no downgrade to a server that claims not
to need one).  An unknown principal gets a challenge that looks like any
other (its keys are derived from a per-process secret), so the reply does not
tell which principals exist; the proof then fails.

Nothing here does I/O: :class:`ClientHandshake` turns replies into the next
credential to send, :class:`ServerHandshake` turns credentials into replies.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import AuthError, ConnectionLost, ProtocolError

__all__ = [
    "NONCE_BYTES",
    "ROLES",
    "ClientFirst",
    "ClientHandshake",
    "ClientSecret",
    "PendingProof",
    "ServerHandshake",
    "ServerKeys",
    "ServerNotProven",
    "auth_message",
    "client_secret",
    "derive_keys",
    "endpoint",
    "format_endpoint",
]

#: bytes of every nonce, either side
NONCE_BYTES = 32
#: the roles a client may say it expects to have (None: whatever its principal's kind is)
ROLES = ("client", "replica", "admin")
#: the longest node id either side may name, characters
MAX_NODE_CHARS = 128

_LABEL = "fastlock scram v2"
_CLIENT_KEY = b"fastlock client key v2"
_SERVER_KEY = b"fastlock server key v2"
_KEY_BYTES = 32
_PRINCIPAL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ServerNotProven(AuthError, ConnectionLost):
    """The server did not prove that it holds this client's credential (an
    impostor on the address, a server with another credentials file, one that
    claims to need no credential, or a node that is the client itself).
    Nothing but HELLO was sent to it.  It is a :class:`ConnectionLost` too, so
    a client tries its other addresses, and an :class:`AuthError`."""


@dataclass(frozen=True)
class ServerKeys:
    """What a server keeps of a principal's token: ``stored_key`` (SHA-256 of the
    ClientKey) and ``server_key``, 32 bytes each."""

    stored_key: bytes
    server_key: bytes


@dataclass(frozen=True)
class ClientSecret:
    """What a client proves with: its principal (None: the legacy shared secret)
    and the keys derived from its token (32 bytes each)."""

    principal: str | None
    client_key: bytes
    server_key: bytes

    def __repr__(self) -> str:  # never print the keys
        return f"ClientSecret(principal={self.principal!r})"


def _token_keys(token: str) -> tuple[bytes, bytes]:
    secret = token.encode("utf-8", "surrogatepass")
    return (hmac.new(secret, _CLIENT_KEY, hashlib.sha256).digest(),
            hmac.new(secret, _SERVER_KEY, hashlib.sha256).digest())


def client_secret(token: str, principal: str | None) -> ClientSecret:
    """The :class:`ClientSecret` of ``token``, proving ``principal`` (None: the shared secret)."""
    client_key, server_key = _token_keys(token)
    return ClientSecret(principal, client_key, server_key)


def derive_keys(token: str) -> ServerKeys:
    """The :class:`ServerKeys` a credentials file stores for ``token``."""
    client_key, server_key = _token_keys(token)
    return ServerKeys(hashlib.sha256(client_key).digest(), server_key)


def auth_message(principal: str | None, role: str | None, client_nonce: bytes, server_nonce: bytes,
                 server_node: str, client_node: str | None, dialed: str | None = None) -> bytes:
    """The bytes both proofs sign: every field of the exchange, as one msgpack array."""
    return msgpack.packb([_LABEL, principal, role, client_nonce, server_nonce, server_node, client_node,
                          dialed], use_bin_type=True)


def endpoint(sockaddr: Any) -> str | None:
    """``"ip:port"`` (``"[ip6]:port"``) of a socket address as asyncio reports it, or None."""
    if not isinstance(sockaddr, tuple) or len(sockaddr) < 2:
        return None
    return format_endpoint(str(sockaddr[0]), sockaddr[1])


def format_endpoint(host: str, port: int) -> str:
    """``"ip:port"`` (``"[ip6]:port"``) as the handshake binds it; an IPv4 address on a
    dual-stack socket (``::ffff:a.b.c.d``) as the IPv4 side sees it."""
    if host.startswith("::ffff:") and "." in host:
        host = host[7:]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _client_signature(stored_key: bytes, message: bytes) -> bytes:
    return hmac.new(stored_key, b"client\0" + message, hashlib.sha256).digest()


def _server_signature(server_key: bytes, message: bytes) -> bytes:
    return hmac.new(server_key, b"server\0" + message, hashlib.sha256).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).to_bytes(len(a), "big")


def _node(value: Any, what: str) -> str | None:
    if value is None:
        return None
    if type(value) is not str or not 0 < len(value) <= MAX_NODE_CHARS or not value.isprintable():
        raise ProtocolError(f"{what} is a printable string of 1..{MAX_NODE_CHARS} characters or None")
    return value


# -- the client's side -------------------------------------------------------------------------


class ClientHandshake:
    """One client's side of one handshake.

    Args:
        secret: what the client proves (None: it has no token; it is then
            anonymous, or known by its TLS certificate, in one round trip).
        role: the principal kind it expects to act as (one of :data:`ROLES`), or
            None for whatever its principal is.  A standby says ``"replica"``.
        expect_node: the node id of the server it means to reach, or None for any.
        own_node: its own node id (a node's standby link), or None; a server that
            names this id is the client itself and is refused.
        nonce: the client nonce (tests only; default :func:`os.urandom`).
        dialed: the endpoint (``"ip:port"``, see :func:`endpoint`) its socket is
            connected to, which the proofs bind; None binds none (then a relay
            could use the session: every fastlock client sets it, through
            :func:`~fastlock.auth.say_hello`).

    Use: send :meth:`first` as HELLO's credential; if the reply is a challenge
    send :meth:`answer` as the next HELLO's credential; pass the final reply to
    :meth:`welcome`, which returns the hello info once the server proved itself.
    Every check failure raises :class:`ServerNotProven`.
    """

    def __init__(self, secret: ClientSecret | None, *, role: str | None = None, expect_node: str | None = None,
                 own_node: str | None = None, nonce: bytes | None = None, dialed: str | None = None):
        if role is not None and role not in ROLES:
            raise ValueError(f"role must be one of {ROLES} or None, not {role!r}")
        self.secret = secret
        self.role = role
        self.expect_node = expect_node
        self.own_node = own_node
        self.nonce = nonce if nonce is not None else os.urandom(NONCE_BYTES)
        self.dialed = dialed
        self._message: bytes | None = None  # the AuthMessage, once the challenge came
        #: the node id the server proved it is (after :meth:`welcome`)
        self.server_node: str | None = None

    @property
    def needs_challenge(self) -> bool:
        """Does this handshake take two round trips (a secret to prove)?"""
        return self.secret is not None

    def first(self) -> dict | None:
        """The first HELLO's credential: None without a secret."""
        if self.secret is None:
            return None
        return {"principal": self.secret.principal, "nonce": self.nonce, "role": self.role,
                "node": self.expect_node, "from": self.own_node, "to": self.dialed}

    def answer(self, reply: Any) -> dict:
        """The second HELLO's credential: the proof, from the server's challenge ``reply``."""
        secret = self.secret
        if secret is None:
            raise ServerNotProven("no challenge expected without a credential")
        challenge = reply.get("challenge") if isinstance(reply, dict) else None
        if not isinstance(challenge, dict):
            raise ServerNotProven("the server did not answer the credential with a challenge: it does not "
                                  "prove that it knows this client's credential (refused: a server must "
                                  "prove itself to a client that has one)")
        nonce, node = challenge.get("nonce"), challenge.get("node")
        if type(nonce) is not bytes or len(nonce) != NONCE_BYTES or type(node) is not str or not node:
            raise ServerNotProven("malformed challenge from the server")
        if self.own_node is not None and node == self.own_node:
            raise ServerNotProven(f"the server is this node itself (node id {node}): a node never "
                                  "authenticates to itself (a relayed handshake)")
        if self.expect_node is not None and node != self.expect_node:
            raise ServerNotProven(f"the server is node {node}, not the expected node {self.expect_node}")
        self.server_node = node
        self._message = auth_message(secret.principal, self.role, self.nonce, nonce, node, self.own_node,
                                     self.dialed)
        stored_key = hashlib.sha256(secret.client_key).digest()
        return {"proof": _xor(secret.client_key, _client_signature(stored_key, self._message))}

    def welcome(self, info: Any) -> dict:
        """The hello info of the final reply, once its ``server_proof`` checks out
        (with a secret); raises :class:`ServerNotProven` otherwise."""
        if not isinstance(info, dict):
            raise ServerNotProven(f"bad handshake reply {type(info).__name__}")
        if self.secret is None:
            return info
        if self._message is None:
            raise ServerNotProven("the server accepted this client without a challenge: it cannot "
                                  "have checked the credential (refused)")
        proof = info.get("server_proof")
        expected = _server_signature(self.secret.server_key, self._message)
        if type(proof) is not bytes or not hmac.compare_digest(proof, expected):
            raise ServerNotProven("the server's proof is missing or wrong: it does not hold this "
                                  "client's credential (an impostor, or another credentials file)")
        return info


# -- the server's side -------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientFirst:
    """A client's first HELLO credential, checked for shape (see :class:`ClientHandshake`)."""

    principal: str | None
    nonce: bytes
    role: str | None
    expect_node: str | None
    client_node: str | None
    dialed: str | None = None  # the endpoint the client's socket is connected to, as it says

    @classmethod
    def parse(cls, credential: dict) -> ClientFirst:
        """Raises ProtocolError naming the malformed field."""
        unknown = set(credential) - {"principal", "nonce", "role", "node", "from", "to"}
        if unknown:
            raise ProtocolError(f"unknown credential fields {sorted(map(str, unknown))}")
        principal = credential.get("principal")
        if principal is not None and (type(principal) is not str or not _PRINCIPAL_NAME.match(principal)):
            raise ProtocolError("the credential's principal is a principal name or None")
        nonce = credential.get("nonce")
        if type(nonce) is not bytes or len(nonce) != NONCE_BYTES:
            raise ProtocolError(f"the credential's nonce is {NONCE_BYTES} bytes")
        role = credential.get("role")
        if role is not None and role not in ROLES:
            raise ProtocolError(f"the credential's role is one of {', '.join(ROLES)} or None")
        return cls(principal, nonce, role, _node(credential.get("node"), "the expected node"),
                   _node(credential.get("from"), "the client's node"),
                   _node(credential.get("to"), "the dialed endpoint"))


@dataclass(frozen=True)
class PendingProof:
    """What a server keeps between its challenge and the client's proof: the
    client's first message, the server nonce, and the keys to check against
    (``principal`` None: an unknown principal, checked against made-up keys so
    that it fails)."""

    first: ClientFirst
    server_nonce: bytes
    keys: ServerKeys
    principal: Any

    def message(self, server_node: str) -> bytes:
        f = self.first
        return auth_message(f.principal, f.role, f.nonce, self.server_nonce, server_node, f.client_node, f.dialed)


class ServerHandshake:
    """A server's side of the handshake: one per server (no per-connection state
    inside; the caller keeps each connection's :class:`PendingProof`).

    Args:
        node: this server's node id (in every challenge and every AuthMessage).
        decoy_key: secret bytes the keys of unknown principals are derived from
            (default: 32 random bytes per process).
    """

    def __init__(self, node: str, decoy_key: bytes | None = None):
        self.node = node
        self._decoy_key = decoy_key if decoy_key is not None else os.urandom(_KEY_BYTES)

    def decoy_keys(self, principal: str | None) -> ServerKeys:
        """Made-up keys for a principal the server does not know (no token matches them)."""
        name = (principal or "").encode("utf-8")
        return ServerKeys(hmac.new(self._decoy_key, b"stored\0" + name, hashlib.sha256).digest(),
                          hmac.new(self._decoy_key, b"server\0" + name, hashlib.sha256).digest())

    def challenge(self, first: ClientFirst, keys: ServerKeys | None, principal: Any,
                  nonce: bytes | None = None) -> tuple[PendingProof, dict]:
        """The pending proof to keep and the reply to send.  ``keys`` None (with
        ``principal`` None): an unknown principal, answered like any other."""
        pending = PendingProof(first, nonce if nonce is not None else os.urandom(NONCE_BYTES),
                               keys if keys is not None else self.decoy_keys(first.principal),
                               principal if keys is not None else None)
        return pending, {"challenge": {"nonce": pending.server_nonce, "node": self.node}}

    def verify(self, pending: PendingProof, credential: Any) -> bytes | None:
        """The server proof to send if ``credential`` holds a valid client proof for
        ``pending`` (and the principal is known), else None."""
        proof = credential.get("proof") if isinstance(credential, dict) and len(credential) == 1 else None
        if type(proof) is not bytes or len(proof) != _KEY_BYTES:
            return None
        message = pending.message(self.node)
        client_key = _xor(proof, _client_signature(pending.keys.stored_key, message))
        good = hmac.compare_digest(hashlib.sha256(client_key).digest(), pending.keys.stored_key)
        if not good or pending.principal is None:
            return None
        return _server_signature(pending.keys.server_key, message)
