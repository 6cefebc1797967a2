"""HELLO: who a connection acts as, proved without a secret on the wire.

A client with a token proves it in two HELLOs (the exchange and its
bindings are in :mod:`fastlock.auth.handshake`): the first carries the
client's nonce and names, the server answers with a challenge (its nonce and
node id) and keeps a :class:`~fastlock.auth.handshake.PendingProof` for the
connection (one at most, dropped when the connection closes; a connection
still without HELLO is closed at the HELLO deadline); the second carries the
client's proof, and the reply is the hello info plus the server's proof.

A client without a token says HELLO once with credential None: it is the
principal its verified TLS certificate maps to, else the anonymous principal
if the credentials allow one.

A replica principal is authenticated only by a primary (or a node promoting
to one; any other node answers a valid proof with
:class:`~fastlock.errors.NotPrimary` and no proof of its own), and never by
the node that uses that principal itself
(its own standby token): a standby's challenge relayed to the standby's own
listener, or to another standby, gets no proof.  Every refusal is an :class:`~fastlock.errors.AuthError` (the
connection closes) and counts towards the address's ban
(:class:`~fastlock.auth.AuthFailures`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from .._version import __version__
from ..auth import AuthFailures, Credentials, Principal, token_principal
from ..auth.handshake import ClientFirst, ServerHandshake, endpoint
from ..errors import AuthError, NotPrimary, ProtocolError
from ..logsafe import RateLimitedLog, quote
from ..replication import node_id
from ..roles import Role
from ..units import monotonic_ms

if TYPE_CHECKING:  # pragma: no cover
    from .lockserver import LockServer
    from .session import Session

log = logging.getLogger(__name__)
#: handshakes refused as relayed (the endpoint check): one line per 10 s, with a count of the rest
_relayed_log = RateLimitedLog(log)


class Hello:
    """The HELLO handler of ``server``, with ``credentials`` (who may connect).

    Attributes:
        node (str): this node's id (``<data dir>/node-id``, made after the WAL opened, at the
            first HELLO), named in every challenge.
        own_replica (str | None): the replica principal this node follows a primary
            as (from its standby token), which it never authenticates.
    """

    def __init__(self, server: LockServer, credentials: Credentials):
        self.server = server
        self.credentials = credentials
        self.auth_failures = AuthFailures(max_failures=server.config.auth_failures_before_ban)
        self._verifier: ServerHandshake | None = None  # made at the first HELLO (the node id file then exists)
        token = server.config.standby_token
        self.own_replica = token_principal(token) if token else None

    @property
    def verifier(self) -> ServerHandshake:
        if self._verifier is None:
            self._verifier = ServerHandshake(node_id(self.server.config.data_dir))
        return self._verifier

    @property
    def node(self) -> str:
        return self.verifier.node

    def op_hello(self, conn: Session, req_id: int, msg: list) -> None:
        """HELLO: version, client name, credential (and an epoch hint, which changes nothing).

        The credential is None (a TLS certificate's identity, or anonymous), a
        handshake's first message or its proof (dicts, see
        :mod:`fastlock.auth.handshake`).  A token string is refused: tokens are
        proved, never sent.
        """
        # a 4th argument, the highest epoch the peer has seen, is a hint only: it never
        # changes this node's role (a standby that promotes sends STEP_DOWN instead)
        version, client_name, credential = msg[2], msg[3], msg[4]
        if version != P.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version!r} not supported (server speaks {P.PROTOCOL_VERSION}: "
                                f"a client that proves its token without sending it; upgrade the client)")
        client_name = P.check_optional_str(client_name, "client name", P.MAX_CLIENT_NAME_CHARS)
        failures = self.auth_failures
        # a ban refuses new connections only: a peer authenticated before it (a standby's
        # replication link, saying HELLO again to depose) is not cut off by someone else's failures
        banned = 0.0 if conn.ready else failures.banned_for(conn.address)
        if banned > 0:
            failures.refused_while_banned(conn.address)
            raise AuthError(f"too many failed authentications from this address: retry in {banned:.0f} s")
        pending = self.server.limits.pending_proofs
        if type(credential) is dict and "proof" in credential:
            principal, server_proof = self._check_proof(conn, credential, client_name)
        elif type(credential) is dict:
            if self.credentials.open:
                raise AuthError("this server runs in open mode (no credentials): it holds no key to prove "
                                "itself with, so a client with a token refuses it; connect without a token")
            first = ClientFirst.parse(credential)
            self._check_endpoint(conn, first.dialed, client_name)
            found = self.credentials.lookup(first.principal)
            proof_pending, reply = self.verifier.challenge(first, found.keys if found is not None else None, found)
            pending[conn.session] = proof_pending
            conn.send(P.encode_ok(req_id, reply))
            return
        elif credential is None:
            principal, server_proof = self._without_token(conn, client_name), None
            self._replica_here(principal)
        else:
            self.auth_failures.failed(conn.address, f"client name {quote(client_name)}", "a token sent in clear")
            raise AuthError("authentication failed: a token is proved, never sent (protocol "
                            f"{P.PROTOCOL_VERSION}: the credential is None or a handshake message)")
        if conn.ready and principal.name != conn.principal:
            raise ProtocolError(f"this connection is authenticated as {conn.principal!r}; "
                                f"open a new one to act as {principal.name!r}")
        conn.authenticated(principal, client_name)
        # the connection leaves the HELLO deadline and the handshake reserve, and
        # its frames are no longer walked before decoding
        conn.ready = True
        self.server.limits.handshake_done(conn)
        if conn.decoder is not None:
            conn.decoder.shape_all = False
        log.debug("session %d hello from %s: principal %s (%s), client name %s", conn.session, conn.peer,
                  conn.principal, conn.kind, quote(conn.client_name))
        info = self.hello_info(conn)
        if server_proof is not None:
            info["server_proof"] = server_proof
        conn.send(P.encode_ok(req_id, info))

    def _without_token(self, conn: Session, client_name: str | None) -> Principal:
        creds = self.credentials
        principal = None
        try:
            identity = conn.peer_cert_identity
        except AuthError as exc:  # a certificate with several CNs
            self.auth_failures.failed(conn.address, f"client name {quote(client_name)}", str(exc))
            raise
        if identity is not None:
            principal = creds.by_cert_identity(identity)
        if principal is None:
            principal = creds.anonymous
        if principal is None:
            reason = "no token, and anonymous connections are not allowed"
            self.auth_failures.failed(conn.address, f"client name {quote(client_name)}", reason)
            raise AuthError(f"authentication failed: {reason}")
        return principal

    def _check_proof(self, conn: Session, credential: dict, client_name: str | None) -> tuple[Principal, bytes]:
        """The principal a client proof proves, and the server's proof; AuthError otherwise."""
        pending = self.server.limits.pending_proofs.pop(conn.session, None)
        if pending is None:
            raise ProtocolError("a proof without a challenge: send the handshake's first message first")
        principal: Principal | None = pending.principal
        server_proof = self.verifier.verify(pending, credential)
        first = pending.first
        reason = None
        if server_proof is None or principal is None:
            reason = "wrong proof, or an unknown principal"
        elif first.role is not None and first.role != principal.kind:
            reason = f"the principal is not {'an' if first.role == 'admin' else 'a'} {first.role}"
        elif first.expect_node is not None and first.expect_node != self.node:
            reason = "the client expected another node"
        elif principal.kind == "replica" and principal.name == self.own_replica:
            reason = (f"this node follows its primaries as replica {principal.name!r} itself: it never "
                      "authenticates that principal (a relayed handshake?)")
        if reason is not None or principal is None or server_proof is None:
            self.auth_failures.failed(conn.address, f"client name {quote(client_name)}", reason or "")
            raise AuthError(f"authentication failed: {reason}")
        self._replica_here(principal)  # only to a valid proof (anyone else learns nothing)
        return principal, server_proof

    def _check_endpoint(self, conn: Session, dialed: str | None, client_name: str | None) -> None:
        """Plain TCP: the endpoint a client's handshake says it dialed (and its proof
        binds) must be the one this connection arrived at, ``--advertise`` or one of
        ``--reachable-as``;
        else the client reached this node through a relay (a process on a dead node's
        port, an address a rogue etcd record names), which could act in its session.
        Refused with AuthError and logged (at most one line per 10 s), but not counted
        towards a ban: the client guessed nothing, and on one host the relay's address is
        every local client's.  Not checked over
        TLS (the certificate binds the server) nor for a handshake that binds no
        endpoint (a client that does not bind it only gives up its own protection)."""
        config = self.server.config
        allowed = (*config.reachable_as, config.advertise)  # --advertise: where others reach this node
        if dialed is None or "any" in allowed or conn.transport.get_extra_info("ssl_object") is not None:
            return
        here = endpoint(conn.transport.get_extra_info("sockname"))
        if dialed == here or dialed in allowed:
            return
        reason = (f"the client dialed {dialed} but reached this server at {here}: a relay in between (a process "
                  "on another node's address?), or address translation (serve --reachable-as)")
        _relayed_log("refusing HELLO from %s (client name %s): %s", conn.peer, quote(client_name), reason)
        raise AuthError(f"authentication failed: {reason}")

    def _replica_here(self, principal: Principal) -> None:
        """A replica principal authenticates only at a primary (or a promoting node): a
        standby or a deposed node answers NotPrimary, without a proof of its own.  The same
        rule for a token's proof and a certificate's identity."""
        roles = self.server.roles
        if principal.kind == "replica" and roles.role not in (Role.PRIMARY, Role.PROMOTING):
            raise NotPrimary(f"this node is {roles.role.value}, not primary: it authenticates no replica",
                             roles.primary_address if roles.role is Role.STANDBY else None)

    def hello_info(self, conn: Session) -> dict[str, Any]:
        """What a HELLO answers: this node, its role and epoch, and the connection's principal."""
        server = self.server
        roles = server.roles
        return {
            "server": "fastlock",
            "version": __version__,
            "protocol": P.PROTOCOL_VERSION,
            "session": conn.session,
            "node": self.node,
            "role": roles.role.value,
            "epoch": server.table.epoch,
            "primary": roles.primary_address if roles.role is Role.STANDBY else None,
            "fenced": roles.fenced,
            "clock_ms": monotonic_ms(),  # this node's monotonic clock: a standby echoes it in STEP_DOWN
            "max_frame_bytes": server.config.max_frame_bytes,
            "principal": conn.principal,
            "kind": conn.kind,
            "actors": True,  # ACQUIRE and ACQUIRE_MANY read the optional actor
            # ACQUIRE's optional sequencer flag is answered with a signed sequencer (fastlock.sequencer)
            "sequencers": self.credentials.sequencer_keys.signing is not None,
            **self._shard_info(),
        }

    def _shard_info(self) -> dict[str, Any]:
        """A sharded node's HELLO names its shard map's epoch and its group (SHARD_MAP reads the map)."""
        gate = self.server.shard_gate
        return {} if gate is None else {"shard_map_epoch": gate.shard_map.epoch, "shard_group": gate.group}
