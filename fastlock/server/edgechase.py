"""One server's part of deadlock detection across shards (edge chasing):
``WAIT_IDENTITY`` and ``WAITS_FOR`` (op codes in :mod:`fastlock.protocol.ops`).

Each server breaks the wait-for cycles it sees whole (:class:`~fastlock.server.kinds.DeadlockTimer`).
A cycle across shards - a task holding ``a`` on shard 1 and waiting for ``b`` on shard 2, while
another holds ``b`` and waits for ``a`` - shows each server one edge only.  Servers do not talk
to each other, so the edges are chased by the waiting clients, as Chandy, Misra and Haas's probes
(1983) travel along the wait-for graph and CockroachDB's waiters push through their wait queues:

* **A waiter's identity across shards.**  A routing client
  (:class:`~fastlock.client.sharded.ShardedClient`) picks a random secret (16-64 bytes) and
  sends it on every group connection with ``WAIT_IDENTITY`` before its first acquire there.
  The server keeps, for that connection, the **wait id**: the first 16 bytes of
  SHA-256(``b"fastlock wait id\\0" + secret``) (:func:`wait_id`).  A party across shards is
  ``(wait id, actor)`` - the actor is the number the client already sends with each acquire
  for its task or thread (:class:`~fastlock.errors.DeadlockDetected`), the same on every
  group.  Only the wait id ever leaves a server; it cannot be turned back into the secret,
  so a client that learns another's wait id from an answer cannot claim it (registering
  needs the secret), and the id names no principal, client or lock.
* **One hop.**  ``WAITS_FOR [wait id, actor, hops]`` answers what that party waits for on
  this server: ``{"since_ms": …, "for": [[wait id, actor], ...]}`` - when its latest
  waiting request began (this server's wall clock, ms, fixed for the request: the same
  number to every asker) or None when it waits for nothing here, and the parties with a
  wait id that hold a conflicting lease of, or wait ahead of it on, a name it waits for
  (core :meth:`~fastlock._core.LockTable.party_waits`).  The answer is read-only: it
  changes nothing, whoever asks.
* **The probe** (:mod:`fastlock.client.edgechase`): a waiter whose acquire has waited for the
  deadlock timeout asks every group about itself, then about each party it found, hop by
  hop (at most :data:`MAX_PROBE_DEPTH` hops, :data:`MAX_PROBE_PARTIES` parties).
* **The victim** is the youngest party of a cycle: the one whose wait began last (by
  ``since_ms``, then the wait id and actor to break ties) - the wait that closed the cycle,
  as PostgreSQL fails the wait that finds it.  Every party of a cycle waits, so every one
  probes; each fails its own wait only if it finds a cycle through itself on which every
  other party is older.  The numbers every detector compares are the servers' (each
  party's ``since_ms`` comes from the one server where it waits), so two detectors agree;
  the youngest of any cycle finds it.  The victim's acquire is withdrawn and raises the
  existing :class:`~fastlock.errors.DeadlockDetected`; its held leases are unchanged.

**Limits.**  A secret has 16-64 bytes; one wait id per connection (sent again: the same id is
kept, another refused); ``hops`` is 0..:data:`MAX_PROBE_DEPTH` (``InvalidArgument`` past it);
an answer names at most :data:`MAX_PROBE_PARTIES` parties; a principal asks at most
:data:`PROBES_PER_SECOND` ``WAITS_FOR`` per second on one server (a token bucket of that
burst; ``LimitExceeded`` past it).  ``WAITS_FOR`` is open only to a connection that sent its
own ``WAIT_IDENTITY`` (``PermissionDenied``): the parties of cross-shard waits.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..errors import InvalidArgument, LimitExceeded, PermissionDenied, WrongArgumentType
from ..protocol.ops import OP_WAIT_IDENTITY, OP_WAITS_FOR
from ..units import monotonic_ms, wall_ms

if TYPE_CHECKING:  # pragma: no cover
    from .handlers import Handlers
    from .session import Session

#: the most hops one probe travels (WAITS_FOR's ``hops`` argument, and the client's bound)
MAX_PROBE_DEPTH = 16
#: the most parties one WAITS_FOR answer names (and one probe asks about)
MAX_PROBE_PARTIES = 64
#: WAITS_FOR requests one principal may make per second on one server (the burst too)
PROBES_PER_SECOND = 500
#: bytes of a wait id; the fewest and most bytes of its secret
WAIT_ID_BYTES = 16
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 16, 64
#: the most principals whose probe budgets are kept (the idle ones are forgotten first)
MAX_BUDGETS = 10_000

#: what each operation needs (an ACL right; see handlers.PERMISSION): neither names a lock -
#: WAIT_IDENTITY sets the caller's own connection's id, WAITS_FOR reads opaque ids only
PERMISSIONS: dict[int, str | None] = {OP_WAIT_IDENTITY: None, OP_WAITS_FOR: None}


def wait_id(secret: bytes) -> bytes:
    """The wait id of ``secret``: the first 16 bytes of SHA-256("fastlock wait id\\0" + secret)."""
    return hashlib.sha256(b"fastlock wait id\0" + secret).digest()[:WAIT_ID_BYTES]


def check_secret(value: Any) -> bytes:
    """A WAIT_IDENTITY secret: 16..64 bytes."""
    if type(value) is not bytes:
        raise WrongArgumentType(f"a wait identity secret must be bytes, not {type(value).__name__}")
    if not MIN_SECRET_BYTES <= len(value) <= MAX_SECRET_BYTES:
        raise InvalidArgument(f"a wait identity secret has {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, "
                              f"not {len(value)}")
    return value


def check_wait_id(value: Any) -> bytes:
    """A wait id: 16 bytes."""
    if type(value) is not bytes:
        raise WrongArgumentType(f"a wait id must be bytes, not {type(value).__name__}")
    if len(value) != WAIT_ID_BYTES:
        raise InvalidArgument(f"a wait id has {WAIT_ID_BYTES} bytes, not {len(value)}")
    return value


def check_hops(value: Any) -> int:
    """A probe's hop count so far: 0..MAX_PROBE_DEPTH."""
    if type(value) is not int:  # bool is refused on purpose
        raise WrongArgumentType(f"hops must be an int, not {type(value).__name__}")
    if not 0 <= value <= MAX_PROBE_DEPTH:
        raise InvalidArgument(f"a probe travels at most {MAX_PROBE_DEPTH} hops, not {value}")
    return value


class EdgeChase:
    """The wait ids of this server's connections and the handlers of WAIT_IDENTITY and WAITS_FOR."""

    def __init__(self, handlers: Handlers):
        self.server = handlers.server
        self.table = handlers.table
        #: session -> its wait id
        self.id_of: dict[int, bytes] = {}
        #: wait id -> the sessions that sent it (a client's connections over time)
        self.sessions_of: dict[bytes, set[int]] = {}
        #: principal -> (tokens left, monotonic ms of the last refill): WAITS_FOR's budget
        self.budgets: dict[str, tuple[float, int]] = {}
        #: ms to add to a monotonic ms to give this server's wall clock (fixed at start: one
        #: waiter's ``since_ms`` is the same number in every answer)
        self.wall_offset_ms = wall_ms() - monotonic_ms()
        #: WAITS_FOR requests answered (a figure for tests and benches)
        self.probes = 0

    def handlers_by_op(self) -> dict:
        """op code -> handler, for the server's handler table."""
        return {OP_WAIT_IDENTITY: self.op_wait_identity, OP_WAITS_FOR: self.op_waits_for}

    def op_wait_identity(self, conn: Session, req_id: int, msg: list) -> None:
        """WAIT_IDENTITY ``secret``: this connection's wait id (16 bytes, :func:`wait_id`) for
        deadlock detection across shards; the value is the wait id.
        :raises InvalidArgument: this connection sent another secret before."""
        wid = wait_id(check_secret(msg[2]))
        session = conn.session
        known = self.id_of.get(session)
        if known is not None and known != wid:
            raise InvalidArgument("this connection has another wait identity")
        self.id_of[session] = wid
        self.sessions_of.setdefault(wid, set()).add(session)
        conn.send(P.encode_ok(req_id, wid))

    def op_waits_for(self, conn: Session, req_id: int, msg: list) -> None:
        """WAITS_FOR ``wait_id, actor, hops``: ``{"since_ms": int | None, "for": [[wait id,
        actor], ...]}`` (see the module).  :raises PermissionDenied: this connection sent no
        WAIT_IDENTITY.  :raises LimitExceeded: over the principal's probes per second.
        :raises InvalidArgument: ``hops`` past MAX_PROBE_DEPTH, a bad id or actor."""
        wid = check_wait_id(msg[2])
        actor = P.check_actor(msg[3])
        check_hops(msg[4])
        if conn.session not in self.id_of:
            raise PermissionDenied("WAITS_FOR is for a connection that sent its own WAIT_IDENTITY")
        now = monotonic_ms()
        self._spend(conn.principal, now)
        self.probes += 1
        latest = -1
        found: dict[tuple[bytes, int], None] = {}
        id_of = self.id_of
        for session in self.sessions_of.get(wid, ()):
            since, parties = self.table.party_waits(session, actor, MAX_PROBE_PARTIES)
            latest = max(latest, since)
            for other_session, other_actor in parties:
                other = id_of.get(other_session)
                if other is not None and len(found) < MAX_PROBE_PARTIES:
                    found[(other, other_actor)] = None
        found.pop((wid, actor), None)
        reply = {"since_ms": None if latest < 0 else latest + self.wall_offset_ms,
                 "for": [[w, a] for w, a in found] if latest >= 0 else []}
        conn.send(P.encode_ok(req_id, reply))

    def _spend(self, principal: str, now: int) -> None:
        """One WAITS_FOR from ``principal``'s budget (PROBES_PER_SECOND, refilled continuously)."""
        tokens, last = self.budgets.pop(principal, (float(PROBES_PER_SECOND), now))
        tokens = min(float(PROBES_PER_SECOND), tokens + (now - last) * PROBES_PER_SECOND / 1000.0)
        if tokens < 1.0:
            self.budgets[principal] = (tokens, now)
            raise LimitExceeded(f"principal {principal!r} asks more than {PROBES_PER_SECOND} WAITS_FOR per second")
        self.budgets[principal] = (tokens - 1.0, now)  # (re-inserted: the dict's order is the idle order)
        while len(self.budgets) > MAX_BUDGETS:
            del self.budgets[next(iter(self.budgets))]

    def session_closed(self, session: int) -> None:
        """Connection ``session`` closed: its wait id goes."""
        wid = self.id_of.pop(session, None)
        if wid is not None:
            sessions = self.sessions_of.get(wid)
            if sessions is not None:
                sessions.discard(session)
                if not sessions:
                    del self.sessions_of[wid]
