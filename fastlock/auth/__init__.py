"""Principals, credentials and permissions: who may do what on a fastlock server.

Principals
----------
Every connection acts for one *principal*, fixed by its HELLO:

``client``
    Lock operations (acquire, release, extend, cancel, check, holder, watch) on
    the names its ACL grants: a list of rules ``{prefix, ops}``, as Consul's ACL
    tokens per key prefix or etcd's RBAC per key range.  A rule with prefix
    ``""`` covers every name.  Anything no rule grants is refused
    (:class:`~fastlock.errors.PermissionDenied`).
``replica``
    A standby: attach (REPLICATE), acknowledge heartbeats (REPL_ACK) and ask
    its primary to step down for a new epoch (STEP_DOWN; only the paired
    standby's principal).  Pairing goes by the replica principal (plus the node
    id it declares, which the credentials file may pin with ``node_id``), so one
    replica credential cannot pose as another standby.
``admin``
    Operator operations (promote, serve-alone, STATUS details and every
    operation added later that is not a lock or replica operation), and every
    client operation on every name (as etcd's root user).

Every authenticated connection may PING, UNWATCH and ask a basic STATUS.

Credentials file
----------------
A TOML file (read with :mod:`tomllib`), made by ``fastlock credentials init DIR``::

    version = 1

    [principals.app]
    kind = "client"
    token_sha256 = "<hex>"                   # SHA-256 of the token: the token itself is never stored
    acl = [{prefix = "orders/", ops = ["acquire", "release", "extend", "cancel"]},
           {prefix = "", ops = ["check", "holder", "watch"]}]
    cert_identities = ["app.example.com"]    # optional: mutual-TLS certificate CNs for this principal

    [principals.anonymous]                   # optional: connections that present no token
    kind = "client"
    acl = [{prefix = "public/", ops = ["*"]}]

    [principals.node-a]
    kind = "replica"
    token_sha256 = "<hex>"
    primary_proof_key = "<hex>"              # lets a primary prove itself to this standby
    node_id = "<hex>"                        # optional: the only node id this credential may attach as

    [principals.admin]
    kind = "admin"
    token_sha256 = "<hex>"

Tokens look like ``fl1.<principal>.<43 base64url characters>`` (256 random
bits).  The server finds the entry by the principal part and compares
``SHA-256(token)`` with the stored hash in constant time
(:func:`hmac.compare_digest`).  A fast hash is enough because tokens are
random, not passwords (no dictionary to guess from).

Peers authenticate both ways.  Without TLS a primary proves itself to its
standby before the standby sends its token: the standby's HELLO carries
``{"principal": NAME, "challenge": NONCE}``, and the primary answers
``HMAC-SHA256(primary_proof_key, NAME || NONCE)``; ``primary_proof_key`` is
derived from the replica's token (:func:`primary_proof_key`), so the standby
can check it and a server that never had the credentials file cannot.

Owner keys
----------
The random owner key a client makes per acquire is its proof of ownership.  The
server hashes it at ingress (:func:`hash_owner`, BLAKE2b-128), so the lock
table, the WAL, snapshots, the replication stream and ``wal dump`` only ever
hold the hash; presenting a hash gets it hashed again and matches nothing.

Failed authentication
---------------------
:class:`AuthFailures` bans a source address for a while after repeated failed
HELLOs (doubling up to a limit) and logs failures in a form that cannot be
flooded: the first failure from an address in a window, bans, and one summary
line per interval for the rest.
"""

from .credentials import (
    ANONYMOUS,
    CLIENT_OPS,
    FORMAT_VERSION,
    KINDS,
    MAX_TOKEN_CHARS,
    SHARED_SECRET_PRINCIPAL,
    TOKEN_PREFIX,
    AclRule,
    Credentials,
    CredentialsError,
    Principal,
    generate,
    hash_owner,
    hash_token,
    is_loopback,
    make_token,
    read_token_file,
    secret_of,
    token_principal,
)
from .environment import resolve_credential
from .exchange import say_hello
from .failures import AuthFailures
from .handshake import ClientHandshake, ClientSecret, ServerKeys, ServerNotProven, derive_keys
from .upgrade import upgrade

__all__ = [
    "ANONYMOUS",
    "CLIENT_OPS",
    "FORMAT_VERSION",
    "KINDS",
    "MAX_TOKEN_CHARS",
    "SHARED_SECRET_PRINCIPAL",
    "TOKEN_PREFIX",
    "AclRule",
    "AuthFailures",
    "ClientHandshake",
    "ClientSecret",
    "Credentials",
    "CredentialsError",
    "Principal",
    "ServerKeys",
    "ServerNotProven",
    "derive_keys",
    "generate",
    "hash_owner",
    "hash_token",
    "is_loopback",
    "make_token",
    "read_token_file",
    "resolve_credential",
    "say_hello",
    "secret_of",
    "token_principal",
    "upgrade",
]
