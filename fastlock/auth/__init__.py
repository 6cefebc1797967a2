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

    version = 2

    [principals.app]
    kind = "client"
    stored_key = "<hex>"                     # SHA-256(ClientKey): the token itself is never stored
    server_key = "<hex>"                     # ServerKey: what the server proves itself with
    acl = [{prefix = "orders/", ops = ["acquire", "release", "extend", "cancel"]},
           {prefix = "", ops = ["check", "holder", "watch"]}]
    cert_identities = ["app.example.com"]    # optional: mutual-TLS certificate CNs for this principal

    [principals.anonymous]                   # optional: connections that present no token
    kind = "client"
    acl = [{prefix = "public/", ops = ["*"]}]

    [principals.node-a]
    kind = "replica"
    stored_key = "<hex>"
    server_key = "<hex>"
    node_id = "<hex>"                        # optional: the only node id this credential may attach as

    [principals.admin]
    kind = "admin"
    stored_key = "<hex>"
    server_key = "<hex>"

Tokens look like ``fl1.<principal>.<43 base64url characters>`` (256 random
bits).  A file of format 1 (``token_sha256``, ``primary_proof_key``) is
refused at start with a :class:`CredentialsError` naming
``fastlock credentials upgrade DIR`` (:func:`upgrade`), which rewrites it as
format 2 from the ``DIR/<principal>.token`` files beside it; tokens do not
change.

Peers authenticate both ways, and a token is proved, never sent
------------------------------------------------------------------
HELLO is a mutual challenge-response in the manner of SCRAM-SHA-256 (RFC
5802/7677, as PostgreSQL uses it), without PBKDF2 because tokens are random,
not passwords: ``ClientKey = HMAC-SHA256(T, "fastlock client key v2")``,
``StoredKey = SHA-256(ClientKey)``, ``ServerKey = HMAC-SHA256(T, "fastlock
server key v2")``.  The client proves ``ClientKey``; the server, which keeps
only ``StoredKey`` and ``ServerKey``, proves ``ServerKey``; both proofs sign
one ``AuthMessage`` naming the principal, the role, both nonces, the server's
node id and the client's (a standby's) node id, and the TCP endpoint the
client dialed, so a proof says who gives it, to whom, where, in which role
and direction, and cannot be replayed, reflected to the node that asked for
it, used at another node, or relayed: a node on plain TCP refuses a
handshake naming an endpoint other than the one the connection arrived at
(``serve --advertise`` and ``--reachable-as`` add endpoints, for NAT).  The client checks
the server's proof before it sends anything else, and a client with a token
refuses a server that does not prove itself.  A node authenticates a replica
principal only while it is primary (or promoting), and never the replica
principal it follows its own primary as.  The exchange is
:mod:`fastlock.auth.handshake` (sans-IO); :func:`say_hello` runs it on a
connection.  Which token a client presents: :func:`resolve_credential`
(one rule for the library and every command).

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
