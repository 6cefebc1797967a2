"""Client sessions: one keep-alive renews every lease a client attached to its session.

A client session (see docs/sessions.md) is server state kept per client process and
node connection: an id, the principal, the client's name and address, a TTL, when it
was last heard and the leases attached to it.  The leases keep their own TTLs and
their own durable deadlines (every renewal is an EXTEND record, replicated and
recovered as today); what a session adds is the fan-out: one ``SESSION_KEEPALIVE``
renews each attached lease for its own TTL, so a client holding 10,000 leases sends
one request per renewal interval instead of 10,000.

Proof, not trust: a session is named by the hash of a 16-byte session key the client
draws (as an owner key, :func:`fastlock.auth.hash_owner`); every session op sends the
key, and the session must belong to the same principal.  A lease is attached only with
its own owner key (``SESSION_ATTACH``), checked against the table exactly as an EXTEND
is, and only on names the principal may extend.  Nothing else can renew a lease.

Sessions are soft state rebuilt by proof: after a failover or a restart the client opens
the same session (same key, so the same id) on the new primary and attaches its leases
again with their owner keys; until then every lease keeps the deadline its last EXTEND
record gave it (a promoted standby keeps it; recovery gives a full TTL).  So there are
no session WAL records: the leases are the durable state, the session is how they are
renewed.

Signed sequencers follow the renewals: a lease attached with its ``sequencer`` flag (a
client that asked for sequencers, :mod:`fastlock.sequencer`) gets its sequencer re-signed
by every renewal the session gives it (attach and keep-alive), with the renewed expiry
(:func:`fastlock.server.kinds.renewal_sequencer`), in the reply: ``"sequencers": [[name,
token, bytes], ...]``.  At most :data:`MAX_SEQUENCED_PER_SESSION` such leases per session
(each keep-alive signs them all: a bound on the loop time one request costs).

A slot move (:mod:`fastlock.server.slotmove`) ships each moved lease's session share
(:class:`SessionShare`) and the destination attaches the lease to the session of the same key
there (:meth:`SessionRegistry.adopt`, opening it if absent) as ``moved``: listed, and revoked
with the session, but renewed by its keep-alives only once the client attaches it there itself
(the client's deadline for a lease moves only with renewals it knows of; a renewal it never
heard of would keep a lease it already counts lost, or stopped renewing, from its next holder).
These sessions are soft state too: a restart or failover of the destination forgets them, and
the client's re-homing (an EXTEND and an attach on the new group) attaches each lease again.

Operators list sessions (``SESSIONS``) and close one (``SESSION_REVOKE``): every lease
attached to it is revoked at once (REVOKE records; each next grant gets a higher token),
as ``fastlock revoke`` does by name.

Limits (each with a clear :class:`~fastlock.errors.LimitExceeded`):
:data:`MAX_SESSIONS_PER_PRINCIPAL`, :data:`MAX_SESSIONS_PER_CONNECTION`,
:data:`MAX_SESSIONS`, :data:`MAX_ATTACH_PER_REQUEST`; a session's attached leases are
bounded by the leases the principal holds: each must be held to be attached, a lease is
attached to one session at a time (attaching it to another moves it), and a lease that
ends (released, expired, revoked) is detached at once (:meth:`SessionRegistry.lease_ended`),
its key kept in the session's list of ended leases (at most :data:`MAX_LOST_LISTED`, the
oldest dropped) until a keep-alive names it as lost.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import protocol as P
from .._core import NotHolder
from ..auth import hash_owner
from ..errors import (
    FastlockError,
    InvalidArgument,
    LeaseLost,
    LimitExceeded,
    LockNotHeld,
    PermissionDenied,
    WrongArgumentType,
)
from ..logsafe import quote
from ..roles import Action
from ..units import monotonic_ms
from ._wire import SessionsWire
from .kinds import SequencedAs, renewal_sequencer, sequenced_as
from .lockadmin import MAX_REASON_CHARS, check_lock_admin, not_the_holder

if TYPE_CHECKING:  # pragma: no cover
    from .handlers import Handlers
    from .session import Session

log = logging.getLogger(__name__)

__all__ = ["ClientSession", "SessionRegistry", "SessionShare", "NO_CONNECTION", "MAX_SESSIONS_PER_PRINCIPAL",
           "MAX_SESSIONS_PER_CONNECTION",
           "MAX_SESSIONS", "MAX_ATTACH_PER_REQUEST", "MAX_LOST_LISTED", "MAX_SESSIONS_LISTED",
           "MAX_SEQUENCED_PER_SESSION", "KEEPALIVE_PAGE"]

#: the most open sessions of one principal (a client keeps one per node connection)
MAX_SESSIONS_PER_PRINCIPAL = 1_024
#: the most sessions one connection may open
MAX_SESSIONS_PER_CONNECTION = 4
#: the most open sessions of the server
MAX_SESSIONS = 65_536
#: the most leases one SESSION_ATTACH request names (attach and detach together; a
#: request's decoder takes at most 256 items, fastlock.protocol.REQUEST_LIMITS)
MAX_ATTACH_PER_REQUEST = 60
#: the most lost leases one SESSION_KEEPALIVE or SESSION_ATTACH reply names (``more`` says there are others)
MAX_LOST_LISTED = 1_000
#: the most sessions one SESSIONS reply lists (the reply gives the total)
MAX_SESSIONS_LISTED = 1_000
#: the most leases of one session whose sequencers its renewals re-sign (the client's
#: fastlock.client.session.MAX_SEQUENCED: its other leases send their own EXTENDs); one
#: Ed25519 signature costs about 0.1 ms, so a keep-alive signs for at most about 30 ms
MAX_SEQUENCED_PER_SESSION = 256
#: the attached leases one SESSION_KEEPALIVE renews per loop turn (the rest in later turns)
KEEPALIVE_PAGE = 1_000
#: the connection of a session a slot move brought here, until its client is heard from
NO_CONNECTION = -1


class SessionShare(NamedTuple):
    """A session's share of a lease a slot move ships (:mod:`fastlock.server.slotmove`): the
    session's key hash (what the server keeps; the key itself never leaves the client), its
    principal, its TTL (ms) and the lease's TTL as attached to it (ms)."""

    key_hash: bytes
    principal: str
    ttl_ms: int
    lease_ttl_ms: int


def session_id(key_hash: bytes) -> str:
    """The public id of the session whose key hashes to ``key_hash``: 16 hex digits of
    BLAKE2b (person ``fastlock-sessid``) of the hash.  The same key gives the same id on
    every node, so a session keeps its id across failover; the id proves nothing."""
    return hashlib.blake2b(key_hash, digest_size=8, person=b"fastlock-sessid").hexdigest()


class AttachedLease:
    """A lease attached to a session: its owner key's hash, its TTL (ms), when its sequencer
    is re-signed at each renewal what that sequencer carries (else None), and ``moved``: a
    slot move attached it here (:meth:`SessionRegistry.adopt`) and the client has not
    attached it here itself yet (a keep-alive does not renew it until then)."""

    __slots__ = ("owner", "ttl_ms", "signed_as", "moved")

    def __init__(self, owner: bytes, ttl_ms: int, signed_as: SequencedAs | None = None, moved: bool = False):
        self.owner = owner
        self.ttl_ms = ttl_ms
        self.signed_as = signed_as
        self.moved = moved


class ClientSession:
    """One client session (module docstring).  Times are this server's monotonic ms."""

    __slots__ = ("id", "key_hash", "principal", "client", "address", "ttl_ms", "opened_ms", "last_heard_ms",
                 "connection", "leases", "sequenced", "epoch", "ended", "longest_ms")

    def __init__(self, key_hash: bytes, principal: str, client: str | None, address: str, ttl_ms: int,
                 now: int, connection: int, epoch: int):
        self.id = session_id(key_hash)
        self.key_hash = key_hash
        self.principal = principal
        self.client = client
        self.address = address
        self.ttl_ms = ttl_ms
        self.opened_ms = now
        self.last_heard_ms = now
        #: the connection (server session number) last heard from
        self.connection = connection
        #: (lock name, token) -> AttachedLease
        self.leases: dict[tuple[str, int], AttachedLease] = {}
        #: the keys of ``leases`` whose sequencers are re-signed (at most MAX_SEQUENCED_PER_SESSION)
        self.sequenced: set[tuple[str, int]] = set()
        #: the node's epoch when the session was opened: a session of an earlier epoch is stale
        #: (this node stopped being the primary since, and the leases may have changed elsewhere)
        self.epoch = epoch
        #: the (name, token) of attached leases that ended since the last keep-alive, oldest first
        #: (at most MAX_LOST_LISTED): the next keep-alive names them as lost
        self.ended: deque[tuple[str, int]] = deque(maxlen=MAX_LOST_LISTED)
        #: the longest TTL (ms) of the leases attached to it since it was opened
        self.longest_ms = 0

    def drop(self, key: tuple[str, int]) -> bool:
        """Detach lease ``key`` (name, token), if attached; True if it was."""
        if self.leases.pop(key, None) is None:
            return False
        self.sequenced.discard(key)
        return True

    def deadline_ms(self) -> int:
        """When the session ends unless heard from: last heard + the longest of its TTL and
        the TTLs of the leases attached to it since it was opened (O(1): a sweep looks at
        every session, whatever their leases)."""
        return self.last_heard_ms + max(self.ttl_ms, self.longest_ms)

    def row(self, now: int) -> dict:
        """The session as ``fastlock sessions`` lists it (times in ms)."""
        return {"id": self.id, "principal": self.principal, "client": self.client, "address": self.address,
                "leases": len(self.leases), "ttl_ms": self.ttl_ms, "last_heard_ms": now - self.last_heard_ms,
                "ttl_left_ms": max(0, self.deadline_ms() - now), "age_ms": now - self.opened_ms}


class SessionRegistry(SessionsWire):
    """The client sessions of one server and their ops (SESSION_OPEN, SESSION_ATTACH,
    SESSION_KEEPALIVE, SESSION_CLOSE, SESSIONS, SESSION_REVOKE).

    ``keepalives``: SESSION_KEEPALIVE requests handled to their last page (in STATUS
    ``client_sessions`` and the metrics), ``renewals``: leases renewed by them."""

    def __init__(self, handlers: Handlers):
        self.handlers = handlers
        self.table = handlers.table
        self.roles = handlers.roles
        self.by_hash: dict[bytes, ClientSession] = {}
        self.by_id: dict[str, ClientSession] = {}
        self.per_principal: dict[str, int] = {}
        #: connection (server session number) -> the sessions last heard from it
        self.per_connection: dict[int, int] = {}
        #: (name, token) -> the session the lease is attached to (one at a time)
        self.attached_to: dict[tuple[str, int], ClientSession] = {}
        self.keepalives = 0
        self.renewals = 0

    def handlers_table(self) -> dict[int, Any]:
        """op code -> handler, for :class:`~fastlock.server.handlers.Handlers`."""
        return {P.OP_SESSION_OPEN: self.op_open, P.OP_SESSION_ATTACH: self.op_attach,
                P.OP_SESSION_KEEPALIVE: self.op_keepalive, P.OP_SESSION_CLOSE: self.op_close,
                P.OP_SESSIONS: self.op_sessions, P.OP_SESSION_REVOKE: self.op_revoke}

    def status(self) -> dict:
        """``client_sessions`` in STATUS: open sessions, leases attached, keep-alives received."""
        self.sweep(monotonic_ms())
        return {"open": len(self.by_id), "leases": sum(len(s.leases) for s in self.by_id.values()),
                "keepalives": self.keepalives, "renewals": self.renewals}

    # -- bookkeeping -----------------------------------------------------------------------
    def _remove(self, s: ClientSession) -> None:
        if self.by_id.pop(s.id, None) is None:
            return
        del self.by_hash[s.key_hash]
        attached_to = self.attached_to
        for key in s.leases:
            if attached_to.get(key) is s:
                del attached_to[key]
        left = self.per_principal.get(s.principal, 1) - 1
        if left > 0:
            self.per_principal[s.principal] = left
        else:
            self.per_principal.pop(s.principal, None)
        self._left_connection(s.connection)

    def _left_connection(self, connection: int) -> None:
        if connection == NO_CONNECTION:
            return
        left = self.per_connection.get(connection, 1) - 1
        if left > 0:
            self.per_connection[connection] = left
        else:
            self.per_connection.pop(connection, None)

    def sweep(self, now: int, most: int = 10_000) -> None:
        """Remove sessions not heard from past their deadline, and stale ones (at most ``most`` looked at)."""
        epoch = self.table.epoch
        for s in [s for _, s in zip(range(most), self.by_id.values(), strict=False)
                  if s.deadline_ms() <= now or s.epoch != epoch]:
            if s.epoch != epoch:
                self._stale(s)
                continue
            log.info("client session %s of %s ended: not heard from for %d ms", s.id, s.principal,
                     now - s.last_heard_ms)
            self._remove(s)

    def _stale(self, s: ClientSession) -> None:
        """Remove ``s``, opened at an earlier epoch: this node was not the primary for a while (a
        failover away and back), so the leases attached to it may have been released, and others
        attached, on another node.  Its client opens it again and attaches what it holds."""
        log.info("client session %s of %s dropped: opened at epoch %d, this node is at epoch %d", s.id,
                 s.principal, s.epoch, self.table.epoch)
        self._remove(s)

    def _current(self, s: ClientSession | None) -> ClientSession | None:
        """``s`` unless it is None or stale (then removed): see :meth:`_stale`."""
        if s is not None and s.epoch != self.table.epoch:
            self._stale(s)
            return None
        return s

    def _find(self, conn: Session, key: Any) -> ClientSession:
        if conn.kind == "replica":
            raise PermissionDenied(f"sessions are for clients and admins; {conn.principal!r} is a replica")
        s = self._current(self.by_hash.get(hash_owner(P.check_owner(key))))
        if s is None:
            raise LeaseLost("no such session (closed, ended, or opened on another node or epoch): open it again")
        if s.principal != conn.principal:
            raise PermissionDenied("this session belongs to another principal")
        return s

    def leases_of(self, key: Any) -> list[tuple[str, int]]:
        """The ``(name, token)`` of each lease attached to the session of owner key ``key``
        (none if there is no such session or ``key`` is not an owner key)."""
        try:
            found = self.by_hash.get(hash_owner(P.check_owner(key)))
        except FastlockError:
            return []
        found = self._current(found)
        return [] if found is None else list(found.leases)

    def _detach(self, s: ClientSession, key: tuple[str, int]) -> None:
        """Detach lease ``key`` (name, token) from session ``s``."""
        if s.drop(key) and self.attached_to.get(key) is s:
            del self.attached_to[key]

    def _attach(self, s: ClientSession, key: tuple[str, int], lease: AttachedLease) -> None:
        """Attach lease ``key`` (name, token) to session ``s``, detaching it from any other session."""
        before = self.attached_to.get(key)
        if before is not None and before is not s:
            before.drop(key)
        self.attached_to[key] = s
        s.leases[key] = lease
        if lease.ttl_ms > s.longest_ms:
            s.longest_ms = lease.ttl_ms

    def lease_ended(self, name: str, token: int) -> None:
        """The lease (``name``, ``token``) was released, expired or revoked: detach it from its
        session, which names it as lost at its next keep-alive (the last MAX_LOST_LISTED ended)."""
        s = self.attached_to.pop((name, token), None)
        if s is not None and s.drop((name, token)):
            s.ended.append((name, token))

    # -- a slot move's share of the sessions (fastlock.server.slotmove) ------------------------
    def share_of(self, name: str, token: int) -> SessionShare | None:
        """The share of the session lease (``name``, ``token``) is attached to, for a slot
        move's export; None if it is attached to none (or to a stale one)."""
        s = self.attached_to.get((name, token))
        if s is None or s.epoch != self.table.epoch:
            return None
        lease = s.leases[(name, token)]
        return SessionShare(s.key_hash, s.principal, s.ttl_ms, lease.ttl_ms)

    def adopt(self, share: SessionShare, name: str, token: int, owner: bytes, client: str | None, origin: str,
              now: int) -> bool:
        """Attach the lease (``name``, ``token``, owner-key hash ``owner``) a slot move imported
        here to its session (``share``), opening a session of that key and principal if this
        node has none (``client``: its declared name; ``origin``: what its address shows until
        its client is heard from).  The lease is attached as ``moved``: listed, counted, and
        revoked with the session (``SESSION_REVOKE``), renewed by the session's keep-alives only
        once the client attaches it here itself.  False (nothing changed) if this node's session
        of that key belongs to another principal, or a new one would pass
        :data:`MAX_SESSIONS` or :data:`MAX_SESSIONS_PER_PRINCIPAL`."""
        s = self._current(self.by_hash.get(share.key_hash))
        if s is None:
            if len(self.by_id) >= MAX_SESSIONS or \
                    self.per_principal.get(share.principal, 0) >= MAX_SESSIONS_PER_PRINCIPAL:
                return False
            s = ClientSession(share.key_hash, share.principal, client, origin, share.ttl_ms, now, NO_CONNECTION,
                              self.table.epoch)
            self.by_hash[share.key_hash] = s
            self.by_id[s.id] = s
            self.per_principal[share.principal] = self.per_principal.get(share.principal, 0) + 1
        elif s.principal != share.principal:
            return False
        key = (name, token)
        if key not in s.leases:  # (imported again: attached already, by the move or by the client)
            self._attach(s, key, AttachedLease(owner, share.lease_ttl_ms, moved=True))
        return True

    def epoch_raised(self, old: int, new: int) -> None:
        """This primary raised its epoch from ``old`` to ``new`` without stopping being the primary
        (a slot move's import adopting the source's epoch): its sessions of ``old`` stay current."""
        for s in self.by_id.values():
            if s.epoch == old:
                s.epoch = new

    def _heard(self, s: ClientSession, conn: Session, now: int) -> None:
        s.last_heard_ms = now
        if s.connection != conn.session:
            self._left_connection(s.connection)
            self.per_connection[conn.session] = self.per_connection.get(conn.session, 0) + 1
            s.connection = conn.session
            s.address = conn.peer
            s.client = conn.client_name

    def _why_lost(self, name: str, token: int) -> str:
        """Why lease ``token`` of ``name`` is not held: revoked (by whom, why), or the general case."""
        return str(not_the_holder(self.handlers.lock_admin.revocations, name, token))

    # -- client ops ------------------------------------------------------------------------
    def op_open(self, conn: Session, req_id: int, msg: list) -> None:
        """SESSION_OPEN key, ttl_ms: open (or resume, with the same key) the session.
        Value: ``{"id": str, "ttl_ms": int, "resumed": bool, "leases": int}``."""
        if conn.kind == "replica":
            raise PermissionDenied(f"sessions are for clients and admins; {conn.principal!r} is a replica")
        key_hash = hash_owner(P.check_owner(msg[2]))
        ttl_ms = P.check_ttl_ms(msg[3])
        self.roles.admit(Action.EXTEND)
        now = monotonic_ms()
        self.sweep(now)
        s = self._current(self.by_hash.get(key_hash))
        if s is not None:
            if s.principal != conn.principal:
                raise PermissionDenied("this session belongs to another principal")
            s.ttl_ms = ttl_ms
            self._heard(s, conn, now)
            conn.send(P.encode_ok(req_id, {"id": s.id, "ttl_ms": ttl_ms, "resumed": True, "leases": len(s.leases)}))
            return
        mine = self.per_connection.get(conn.session, 0)
        if mine >= MAX_SESSIONS_PER_CONNECTION:
            raise LimitExceeded(f"this connection has {mine} sessions open, the most allowed "
                                f"({MAX_SESSIONS_PER_CONNECTION}): close one first")
        if self.per_principal.get(conn.principal, 0) >= MAX_SESSIONS_PER_PRINCIPAL:
            raise LimitExceeded(f"principal {conn.principal!r} has {MAX_SESSIONS_PER_PRINCIPAL} sessions open, "
                                f"the most allowed: close some, or wait for idle ones to end")
        if len(self.by_id) >= MAX_SESSIONS:
            raise LimitExceeded(f"the server has {MAX_SESSIONS} sessions open, the most allowed")
        s = ClientSession(key_hash, conn.principal, conn.client_name, conn.peer, ttl_ms, now, conn.session,
                          self.table.epoch)
        self.by_hash[key_hash] = s
        self.by_id[s.id] = s
        self.per_principal[conn.principal] = self.per_principal.get(conn.principal, 0) + 1
        self.per_connection[conn.session] = self.per_connection.get(conn.session, 0) + 1
        conn.send(P.encode_ok(req_id, {"id": s.id, "ttl_ms": ttl_ms, "resumed": False, "leases": 0}))

    def op_attach(self, conn: Session, req_id: int, msg: list) -> None:
        """SESSION_ATTACH key, leases, detach: attach each ``[name, token, owner key[,
        sequencer]]`` of ``leases`` that is the current holder (proved by its owner key; on a
        name the principal may extend), renewing it for its own TTL (an EXTEND record), and
        detach each ``[name, token]`` of ``detach``.  Together at
        most :data:`MAX_ATTACH_PER_REQUEST`.  Value: ``{"attached": int, "lost": [[name,
        token, why], ...]}`` (the leases of ``leases`` that are not held, and why: revoked
        by whom, or not the current holder), with ``"sequencers": [[name, token, bytes],
        ...]`` when a lease was attached with ``sequencer`` true and this server holds a
        signing key: its sequencer re-signed with the renewed expiry, and re-signed by
        every keep-alive after.

        :raises LimitExceeded: more than :data:`MAX_SEQUENCED_PER_SESSION` leases with
            ``sequencer`` true would be attached (nothing changed)."""
        s = self._find(conn, msg[2])
        leases, detach = msg[3], msg[4]
        if type(leases) is not list or type(detach) is not list:
            raise WrongArgumentType("leases and detach must be arrays")
        if len(leases) + len(detach) > MAX_ATTACH_PER_REQUEST:
            raise InvalidArgument(f"at most {MAX_ATTACH_PER_REQUEST} leases per SESSION_ATTACH")
        checked = []
        for item in leases:
            if type(item) is not list or not 3 <= len(item) <= 4:
                raise InvalidArgument("each lease to attach is [name, token, owner key[, sequencer]]")
            name = P.check_name(item[0])
            if conn.grant is None or not conn.grant.allows("extend", name):
                raise PermissionDenied(f"principal {conn.principal!r} may not extend {name!r}")
            flag = item[3] if len(item) == 4 else False
            if type(flag) is not bool:
                raise WrongArgumentType(f"sequencer must be a bool, not {type(flag).__name__}")
            checked.append((name, P.check_token(item[1]), hash_owner(P.check_owner(item[2])), flag))
        gone = []
        for item in detach:
            if type(item) is not list or len(item) != 2:
                raise InvalidArgument("each lease to detach is [name, token]")
            gone.append((P.check_name(item[0]), P.check_token(item[1])))
        key = self.handlers.credentials.sequencer_keys.signing
        if key is not None:
            asked = {(name, token) for name, token, _, flag in checked if flag} - s.sequenced
            if asked and len(s.sequenced - set(gone)) + len(asked) > MAX_SEQUENCED_PER_SESSION:
                raise LimitExceeded(f"a session re-signs the sequencers of at most {MAX_SEQUENCED_PER_SESSION} "
                                    f"leases: renew the others with EXTEND")
        self.roles.admit(Action.EXTEND)
        now = monotonic_ms()
        self._heard(s, conn, now)
        for gone_key in gone:
            self._detach(s, gone_key)
        lost = []
        signed: list[list] = []
        table = self.table
        wal = self.handlers.wal
        server = self.handlers.server
        gate = server.shard_gate
        for name, token, owner, flag in checked:
            moved = None if gate is None else gate.owns(name)
            if moved is not None:  # another shard group's name (its slot moved): not held here
                lost.append([name, token, str(moved)])
                continue
            holder = table.holder(name, now, owner)
            if holder is None or holder.token != token:
                lost.append([name, token, self._why_lost(name, token)])
                continue
            # attaching renews it (as a keep-alive would): proved by its owner key, as an EXTEND is
            table.extend(name, token, owner, holder.ttl_ms, now, conn.session)
            server.log_decided_for(token)  # the lease's grant record first, if it was granted in this batch
            wal.log_extend(name, token, holder.ttl_ms)
            if flag and key is not None:
                signed_as = sequenced_as(holder)
                self._attach(s, (name, token), AttachedLease(owner, holder.ttl_ms, signed_as))
                s.sequenced.add((name, token))
                signed.append([name, token, renewal_sequencer(key, name, token, signed_as, holder.ttl_ms)])
            else:
                self._attach(s, (name, token), AttachedLease(owner, holder.ttl_ms))
                s.sequenced.discard((name, token))
        value: dict[str, Any] = {"attached": len(checked) - len(lost), "lost": lost}
        if signed:
            value["sequencers"] = signed
        self._reply_renewed(conn, req_id, value)

    def _reply_renewed(self, conn: Session, req_id: int, value: dict) -> None:
        """Send ``value``, the reply of a request that renewed leases: with synchronous
        replication once the standby has the EXTEND records, as an EXTEND's reply."""
        handlers = self.handlers
        reply = P.encode_ok(req_id, value)
        sync = handlers.source.sync
        if not sync.enabled:
            conn.send(reply)
            return
        server = handlers.server

        def ack(refused: FastlockError | None = None) -> None:
            handlers.source.fence_if_due(monotonic_ms())
            if refused is None and self.roles.may(Action.EXTEND):
                conn.send(reply)
            else:
                refused = refused or FastlockError("this node may no longer extend leases")
                conn.send(P.encode_error(req_id, refused.code or 0, f"session: {refused}",
                                         getattr(refused, "primary", None)))
            server.after_batch()

        handlers.wal.when_durable(sync.after(ack))

    def op_keepalive(self, conn: Session, req_id: int, msg: list) -> None:
        """SESSION_KEEPALIVE key: renew every attached lease for its own TTL from now (an
        EXTEND record each, as an EXTEND request writes), :data:`KEEPALIVE_PAGE` leases
        per loop turn (other clients are served between pages, as between the pages of a
        revoke).  Value: ``{"renewed": int, "lost": [[name, token, why], ...], "more":
        bool}``: the attached leases that are no longer held (detached now), at most
        :data:`MAX_LOST_LISTED` (``more``: others were not looked at; ask again), and
        ``"sequencers": [[name, token, bytes], ...]`` for the renewed leases attached with
        their ``sequencer`` flag: each re-signed with the renewed expiry.  With synchronous
        replication the reply waits for the standby, as an EXTEND's does.

        :raises LeaseLost: no such session, or it was closed or ended before its last page.
        """
        s = self._find(conn, msg[2])
        self.roles.admit(Action.EXTEND)
        self._heard(s, conn, monotonic_ms())
        handlers = self.handlers
        server = handlers.server
        attached = list(s.leases.items())
        lost: list[list] = []
        signed: list[list] = []
        signing = handlers.credentials.sequencer_keys.signing if s.sequenced else None
        renewed = 0
        session = conn.session

        def page(start: int) -> None:
            nonlocal renewed
            if start:  # a later turn: the node may have stepped down, the session ended meanwhile
                refused: FastlockError | None = None
                try:
                    self.roles.admit(Action.EXTEND)
                except FastlockError as exc:
                    refused = exc
                if refused is None and self.by_id.get(s.id) is not s:
                    refused = LeaseLost("the session was closed or ended during its keep-alive: open it again")
                if refused is not None:
                    self.keepalives += 1
                    self.renewals += renewed
                    conn.send(P.encode_error(req_id, refused.code or 0, f"session keep-alive: {refused}",
                                             getattr(refused, "primary", None)))
                    server.after_batch()
                    return
            now = monotonic_ms()
            table = self.table
            wal = handlers.wal
            leases = s.leases
            more = False
            for key, lease in attached[start:start + KEEPALIVE_PAGE]:
                if leases.get(key) is not lease or lease.moved:
                    continue  # detached since the keep-alive came (released by the client), or not attached by it
                name, token = key
                try:
                    table.extend(name, token, lease.owner, lease.ttl_ms, now, session)
                except NotHolder:
                    if len(lost) >= MAX_LOST_LISTED:
                        more = True
                        break
                    self._detach(s, key)
                    lost.append([name, token, self._why_lost(name, token)])
                    continue
                wal.log_extend(name, token, lease.ttl_ms)
                renewed += 1
                if lease.signed_as is not None and signing is not None:
                    signed.append([name, token, renewal_sequencer(signing, name, token, lease.signed_as,
                                                                  lease.ttl_ms)])
            if not more and start + KEEPALIVE_PAGE < len(attached):
                server.loop.call_soon(page, start + KEEPALIVE_PAGE)
                if start:
                    server.after_batch()
                return
            ended = s.ended
            while ended and len(lost) < MAX_LOST_LISTED:  # the attached leases that ended meanwhile
                name, token = ended.popleft()
                lost.append([name, token, self._why_lost(name, token)])
            more = more or bool(ended)
            self.keepalives += 1
            self.renewals += renewed
            value: dict[str, Any] = {"renewed": renewed, "lost": lost, "more": more}
            if signed:
                value["sequencers"] = signed
            self._reply_renewed(conn, req_id, value)
            if start:
                server.after_batch()

        page(0)

    def op_close(self, conn: Session, req_id: int, msg: list) -> None:
        """SESSION_CLOSE key: end the session (its leases stay held until released or
        expired by their own TTLs).  Value: None."""
        self._remove(self._find(conn, msg[2]))
        conn.send(P.encode_ok(req_id, None))

    # -- operator ops ----------------------------------------------------------------------
    def op_sessions(self, conn: Session, req_id: int, msg: list) -> None:
        """SESSIONS principal: the open sessions (of ``principal``, None: of everyone),
        most recently heard first, at most :data:`MAX_SESSIONS_LISTED`.  Value:
        ``{"sessions": [row...], "total": int}`` (rows: :meth:`ClientSession.row`)."""
        check_lock_admin(self.handlers, conn, "sessions")
        principal = msg[2]
        if principal is not None and type(principal) is not str:
            raise WrongArgumentType("principal must be a str or None")
        now = monotonic_ms()
        self.sweep(now)
        chosen = [s for s in self.by_id.values() if principal is None or s.principal == principal]
        chosen.sort(key=lambda s: -s.last_heard_ms)
        rows = [s.row(now) for s in chosen[:MAX_SESSIONS_LISTED]]
        conn.send(P.encode_ok(req_id, {"sessions": rows, "total": len(chosen)}))

    def op_revoke(self, conn: Session, req_id: int, msg: list) -> None:
        """SESSION_REVOKE id, reason: close session ``id`` and revoke every lease attached
        to it (REVOKE records, as ``fastlock revoke``: watchers told, the first waiter of
        each lock granted with a higher token), :data:`~.lockadmin.REVOKE_PAGE` per loop
        turn.  Value, once the records are durable: ``{"id", "principal", "revoked": int}``.
        :raises LockNotHeld: no such session."""
        check_lock_admin(self.handlers, conn, "sessions close")
        sid = msg[2]
        if type(sid) is not str:
            raise WrongArgumentType("a session id is a str")
        reason = P.check_optional_str(msg[3], "reason", MAX_REASON_CHARS)
        s = self._current(self.by_id.get(sid))
        if s is None:
            raise LockNotHeld(f"no session {quote(sid)} on this node")
        self.roles.admit(Action.RELEASE)
        self._remove(s)
        leases = list(s.leases.items())
        why = reason if reason is not None else f"session {sid} closed"
        log.warning("closing session %s of %s (%d leases), asked by %s: %s", sid, s.principal, len(leases),
                    conn.principal, quote(reason), extra={"session": conn.session, "principal": conn.principal})
        self.handlers.lock_admin.revoke_paged(
            conn, req_id, [key for key, _ in leases], why, f"the {len(leases)} leases of session {sid}",
            lambda revoked: {"id": sid, "principal": s.principal, "revoked": revoked})
