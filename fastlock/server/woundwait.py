"""One shard's part of a cross-shard multi-lock: age-stamped reservations with
wound-wait, ``RESERVE`` and ``COMMIT_RESERVATION`` (op codes in :mod:`fastlock.protocol.ops`).

A multi-lock over several shards (:func:`fastlock.client.across.lock_across`) takes its
names on each shard with one ``RESERVE``: the names of this shard, atomically, as
``ACQUIRE_MANY`` does (the core's ``acquire_many``: FIFO per name, holding none while it
waits), tagged with the multi-lock's **age stamp** (the client's wall clock, milliseconds,
when the multi-lock began; kept across its retries) and its **id** (random bytes, the same
on every shard).  Ranks are ``(stamp, id)``: a smaller rank is older.  While a part is
held and not committed it is a **reservation**; ``COMMIT_RESERVATION`` (sent once every
shard's part is held) turns it into ordinary leases that nobody can wound.

**The wound-wait rule** (Rosenkrantz, Stearns and Lewis, 1978; Spanner's lock table):
a reservation that needs a name

* held by a *younger uncommitted* reservation, or waited on (in the name's queue) by one,
  **wounds** it: that reservation's leases on this shard are revoked (a ``REVOKE``
  record, replicated, as ``fastlock revoke`` does; its quota given back, watchers told
  ``"revoked"``), its waiting request is withdrawn (answered :class:`~fastlock.errors.Wounded`),
  and its connection is told at once with a ``PUSH_WOUNDED`` frame
  ``[multi-lock id, its stamp, the wounder's stamp]``; the older one proceeds;
* held by an older reservation, a committed part or a plain lease **waits** (FIFO, as
  ``ACQUIRE_MANY``, no polling).

A younger reservation that arrives while an older one waits on one of its names waits
before the queue (it is *parked* here, holding nothing) until no older one waits on its
names, then enters the queues; and a younger one granted while an older one waits on one
of its names (a grant decided before the older arrived) is wounded at once.  So no
reservation ever waits on a younger one: every wait goes from younger to older.

**Untrusted stamps.**  The stamp comes from the client.  The server refuses (``InvalidArgument``)
a stamp more than :data:`MAX_STAMP_SKEW_MS` (1 s) ahead of its own wall clock or more than
:data:`MAX_STAMP_AGE_MS` (60 s) behind it.  A principal that lies can therefore rank itself
at most 60 s ahead of a multi-lock begun now - the rank an honest multi-lock has after
trying for 60 s (and, as an honest one takes a fresh stamp after 55 s, ahead of every honest
one while it keeps asking: no more than holding the names with plain leases gives, which its
right ``acquire`` allows); and every reservation counts against
its principal's quotas (leases and waiters, as ``ACQUIRE_MANY``) plus at most
:data:`MAX_RESERVATIONS_PER_PRINCIPAL` uncommitted ones, so a liar can only ever hold a
bounded set of names ahead of others.  The client takes a fresh stamp when its own is
about to be refused (a multi-lock trying for longer than 55 s loses its seniority once).

**Leases, TTLs and failover.**  A reservation's parts are ordinary leases with the
request's TTL: a dead client's parts end by their TTL like any lease, and its waiting
request and its held uncommitted parts end with its connection (:meth:`WoundWait.session_closed`).
The reservation table (who is a reservation, with
which rank, committed or not) lives in the primary's memory only and is not logged
(records 90-94 are reserved for it and stay unused), because nothing the issue promises
needs it after a failover:

* *safety* rests on the leases (granted, released, revoked - logged and replicated as
  usual; a wound is a ``REVOKE`` record);
* *no deadlock*: a new primary sees an uncommitted part as a plain lease, which it cannot
  wound, so an older multi-lock waiting for it could close a cycle with the part's holder
  if that holder waited elsewhere for the older one.  But the holder's client lost its
  connection to this shard in the failover (a new primary is a new connection; a fenced
  old one refuses the part's renewal, which drops the connection), and the client counts a
  lost connection as a wound of the part it held there
  (:func:`fastlock.client.across.lock_across`): it releases the part at the new primary
  and reserves it again, now in the new primary's table with its rank, woundable.  The
  cycle ends within the client's ride-through, with no record;
* *no starvation*: a rank is the client's (stamp and id, kept across retries and sent with
  every ``RESERVE``), so the new primary learns each live multi-lock's rank from its next
  ``RESERVE``; a ``COMMIT_RESERVATION`` at the new primary finds no reservation and fails
  with :class:`~fastlock.errors.Wounded`, and the multi-lock tries again with its stamp;
* *a dead client blocks nobody beyond a TTL*: its parts are leases, whose TTL a new
  primary keeps.

What a log would add is only speed: a new primary could wound a held part at once instead
of after its client reconnects, at the cost of a WAL record per part and per commit.

**Limits.**  At most :data:`MAX_RESERVATIONS_PER_PRINCIPAL` live reservations (parked,
waiting or held uncommitted) per principal and :data:`MAX_PARKED` parked ones per
server (``LimitExceeded``); a parked reservation's names count against its principal's
lease and waiter quotas as a queued request's do; a multi-lock id is at most :data:`MAX_MULTI_ID_BYTES` bytes and
one connection has at most one reservation per id.  Names only: reservations are
exclusive (no shared parts, no semaphores).  ``RESERVE`` needs the right ``"acquire"`` on
every name; ``COMMIT_RESERVATION`` acts only on the calling connection's own reservation.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import protocol as P
from .._core import QUEUED
from ..auth import hash_owner
from ..errors import (
    Cancelled,
    FastlockError,
    InvalidArgument,
    LeaseLost,
    LimitExceeded,
    LockNotAcquired,
    PermissionDenied,
    Wounded,
    WrongArgumentType,
)
from ..protocol.ops import MAX_STAMP_AGE_MS, MAX_STAMP_SKEW_MS, OP_COMMIT_RESERVATION, OP_RESERVE, PUSH_WOUNDED
from ..roles import Action
from ..units import monotonic_ms, wall_ms
from .kinds import ManyRequest

if TYPE_CHECKING:  # pragma: no cover
    import asyncio

    from .handlers import Handlers
    from .session import Session

log = logging.getLogger(__name__)

#: the most live reservations (parked, waiting or held uncommitted) of one principal on one server
MAX_RESERVATIONS_PER_PRINCIPAL = 1_000
#: the most reservations parked on one server (waiting for an older one to stop waiting)
MAX_PARKED = 10_000
#: the longest multi-lock id, in bytes
MAX_MULTI_ID_BYTES = 32
#: how many reservations each RESERVE looks at to forget the ones that ended (released or expired)
SWEEP_PER_REQUEST = 4
#: how many of its own reservations a RESERVE of a principal at its limit looks at to forget the ones
#: that ended (round robin: a refused request costs a bounded amount of work, not one per reservation)
PURGE_PER_REQUEST = 64

#: what each operation needs (an ACL right checked on the name; see handlers.PERMISSION):
#: RESERVE's names are checked by the handler, COMMIT_RESERVATION touches the caller's own only
PERMISSIONS: dict[int, str | None] = {OP_RESERVE: "acquire", OP_COMMIT_RESERVATION: None}

PARKED, WAITING, HELD = "parked", "waiting", "held"


class Rank(NamedTuple):
    """A multi-lock's place in the wound-wait order: ``stamp_ms`` (its age stamp, wall
    clock milliseconds), then its ``multi_id`` (bytes) to break ties; smaller is older."""

    stamp_ms: int
    multi_id: bytes


class Reservation:
    """One multi-lock's part on this shard: its ``rank``, the core request's ``owner``
    (hash), the connection (``session``, ``principal``), its ``names``, its request
    (``req_id``, ``ttl_ms``, ``wait_until_ms`` on the monotonic clock or None, ``corr``),
    ``state`` (:data:`PARKED`, :data:`WAITING`, :data:`HELD`), ``tokens`` once held,
    ``received_ms`` (monotonic clock, when its RESERVE arrived) and ``parked_ms`` (how long it
    waited parked before it entered the queues, milliseconds)."""

    __slots__ = ("rank", "owner", "session", "principal", "names", "req_id", "ttl_ms", "wait_until_ms", "corr",
                 "state", "tokens", "wounded", "request", "timer", "received_ms", "parked_ms")

    def __init__(self, rank: Rank, owner: bytes, session: int, principal: str, names: tuple[str, ...], req_id: int,
                 ttl_ms: int, wait_until_ms: int | None, corr: str | None, received_ms: int = 0):
        self.rank = rank
        self.owner = owner
        self.session = session
        self.principal = principal
        self.names = names
        self.req_id = req_id
        self.ttl_ms = ttl_ms
        self.wait_until_ms = wait_until_ms
        self.corr = corr
        self.state = PARKED
        self.tokens: list[int] = []
        self.wounded = False
        self.request: ReserveRequest | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.received_ms = received_ms
        self.parked_ms = 0


class ReserveRequest(ManyRequest):
    """The core request of a reservation: an ACQUIRE_MANY's, which also tells the
    :class:`WoundWait` table when the set is granted or stops waiting.  Its reply's waited
    milliseconds count the time the reservation was parked too (from its RESERVE's arrival
    to the grant), from which the client dates each lease's expiry."""

    __slots__ = ("reservation", "wound_wait")

    def __init__(self, reservation: Reservation, wound_wait: WoundWait):
        super().__init__(reservation.req_id, len(reservation.names))
        self.reservation = reservation
        self.wound_wait = wound_wait

    def granted(self, token: int, ttl_ms: int, waited_ms: int) -> bytes | None:
        reply = super().granted(token, ttl_ms, waited_ms + self.reservation.parked_ms)
        if reply is not None:
            self.wound_wait.granted(self.reservation, list(self.tokens))
        return reply

    def error_id(self) -> int | None:
        rid = super().error_id()
        if rid is not None:
            self.wound_wait.left(self.reservation)
        return rid


def _drop(index: dict[int, set[Reservation]], session: int, r: Reservation) -> None:
    """``r`` out of ``index``'s set of connection ``session`` (the set dropped once empty)."""
    mine = index.get(session)
    if mine is not None:
        mine.discard(r)
        if not mine:
            del index[session]


def _rank_of(r: Reservation) -> Rank:
    return r.rank


def check_multi_id(value: Any) -> bytes:
    """A multi-lock id: 1..MAX_MULTI_ID_BYTES bytes (:func:`fastlock.protocol.check_bytes`)."""
    return P.check_bytes(value, "multi-lock id", MAX_MULTI_ID_BYTES)


def check_stamp(value: Any, now_wall_ms: int) -> int:
    """An age stamp (wall clock ms): at most MAX_STAMP_SKEW_MS ahead of ``now_wall_ms`` and
    at most MAX_STAMP_AGE_MS behind it."""
    if type(value) is not int:  # bool is refused on purpose
        raise WrongArgumentType(f"an age stamp must be an integer number of milliseconds, not {type(value).__name__}")
    if value > now_wall_ms + MAX_STAMP_SKEW_MS:
        raise InvalidArgument(f"the age stamp is {value - now_wall_ms} ms ahead of this server's clock "
                              f"(at most {MAX_STAMP_SKEW_MS} ms)")
    if value < now_wall_ms - MAX_STAMP_AGE_MS:
        raise InvalidArgument(f"the age stamp is {now_wall_ms - value} ms old (at most {MAX_STAMP_AGE_MS} ms: "
                              f"take a fresh one)")
    return value


def check_reserve_names(value: Any) -> tuple[str, ...]:
    """RESERVE's names: a list of 1..MAX_MANY distinct lock names."""
    if type(value) is not list:
        raise WrongArgumentType(f"names must be a list of lock names, not {type(value).__name__}")
    if not 1 <= len(value) <= P.MAX_MANY:
        raise InvalidArgument(f"a reservation takes 1 to {P.MAX_MANY} names, not {len(value)}")
    names = tuple(P.check_name(n) for n in value)
    if len(set(names)) != len(names):
        raise InvalidArgument("a name is listed twice (locks are not re-entrant)")
    return names


class WoundWait:
    """The reservations of this server and the handlers of RESERVE and COMMIT_RESERVATION."""

    def __init__(self, handlers: Handlers):
        self.handlers = handlers
        self.server = handlers.server
        self.table = handlers.table
        self.roles = handlers.roles
        #: core owner hash -> its reservation (every live one but the parked)
        self.by_owner: dict[bytes, Reservation] = {}
        #: (session, multi-lock id) -> its reservation (insertion order: the sweep's order)
        self.by_key: dict[tuple[int, bytes], Reservation] = {}
        #: name -> the reservations whose request waits in that name's queue (checked when read)
        self.waiting_on: dict[str, set[Reservation]] = {}
        #: the parked reservations, in arrival order
        self.parked: dict[tuple[int, bytes], Reservation] = {}
        #: name -> the parked reservations that name it
        self.parked_on: dict[str, set[Reservation]] = {}
        #: names an older reservation stopped waiting on since the last wake (only their parked
        #: reservations are looked at again; a closed connection's waiting ones add their names)
        self._stopped_waiting: set[str] = set()
        #: session -> its reservations of ``by_key`` (those a closed connection takes away)
        self.keyed_of: dict[int, set[Reservation]] = {}
        #: session -> its parked reservations
        self.parked_of: dict[int, set[Reservation]] = {}
        #: session -> its reservations listed in ``waiting_on`` since they were queued (until
        #: :meth:`_unwait`): the names a closed connection stopped waiting on
        self.waiting_of: dict[int, set[Reservation]] = {}
        #: principal -> how many live reservations it has
        self.per_principal: dict[str, int] = {}
        #: principal -> its reservations of ``by_key`` (insertion order: its purge's order)
        self.of_principal: dict[str, dict[tuple[int, bytes], Reservation]] = {}
        #: principal -> how many names its parked reservations name (counted against its quotas)
        self.parked_names: dict[str, int] = {}
        self._wake_pending = False
        #: how many reservations were wounded (a figure for benches and tests)
        self.wounds = 0

    def handlers_by_op(self) -> dict:
        """op code -> handler, for the server's handler table."""
        return {OP_RESERVE: self.op_reserve, OP_COMMIT_RESERVATION: self.op_commit}

    # -- the operations -------------------------------------------------------------------------
    def op_reserve(self, conn: Session, req_id: int, msg: list) -> None:
        """RESERVE ``[name, ...], owner, ttl_ms, wait_ms, corr_id, stamp_ms, multi_id``: this
        shard's part of a multi-lock, granted as ACQUIRE_MANY's reply ``[[token, ...], ttl_ms,
        waited_ms]``.  :raises InvalidArgument: a bad stamp (see the module), or the id already
        has a reservation on this connection.  :raises LimitExceeded: over a limit or quota.
        :raises Wounded: an older reservation wounded this one before it was granted."""
        names = check_reserve_names(msg[2])
        owner = hash_owner(P.check_owner(msg[3]))
        ttl_ms = P.check_ttl_ms(msg[4])
        wait_ms = P.check_wait_ms(msg[5])
        corr = P.check_optional_str(msg[6], "correlation id", P.MAX_CORRELATION_ID_CHARS)
        stamp = check_stamp(msg[7], wall_ms())
        multi_id = check_multi_id(msg[8])
        if conn.kind == "client":
            grant = conn.grant
            for name in names:
                if grant is None or not grant.allows("acquire", name):
                    raise PermissionDenied(f"principal {conn.principal!r} may not acquire {name!r}")
        self.roles.admit(Action.ACQUIRE)
        now = monotonic_ms()
        self._sweep(now)
        key = (conn.session, multi_id)
        old = self.by_key.get(key) or self.parked.get(key)
        if old is not None:
            if old.state == PARKED or self._alive(old, now):
                raise InvalidArgument("this multi-lock id has a reservation on this connection already")
            self._forget(old)
        principal = conn.principal
        if self.per_principal.get(principal, 0) >= MAX_RESERVATIONS_PER_PRINCIPAL:
            self._purge_principal(principal, now)
            if self.per_principal.get(principal, 0) >= MAX_RESERVATIONS_PER_PRINCIPAL:
                raise LimitExceeded(f"principal {principal!r} already has {MAX_RESERVATIONS_PER_PRINCIPAL} "
                                    f"uncommitted reservations of multi-locks on this server")
        if owner in self.by_owner:
            raise InvalidArgument("this owner key holds or awaits another reservation")
        r = Reservation(Rank(stamp, multi_id), owner, conn.session, principal, names, req_id, ttl_ms,
                        None if wait_ms < 0 else now + wait_ms, corr, now)
        self._wound_younger(r, now)
        if self._older_waiter(r, now) is not None and wait_ms != 0:
            if len(self.parked) >= MAX_PARKED:
                raise LimitExceeded(f"the server already has {MAX_PARKED} reservations waiting behind older ones")
            # the quotas a queued request would need, with the principal's parked ones counted as queued
            wanted = len(names) + self.parked_names.get(principal, 0)
            self.server.quotas.check_acquire(principal, wanted, wanted)
            self._park(r)
            return
        self._submit(conn, r, now)

    def op_commit(self, conn: Session, req_id: int, msg: list) -> None:
        """COMMIT_RESERVATION ``multi_id``: the calling connection's held reservation of that
        multi-lock becomes ordinary leases (no longer woundable).  Value: None.
        :raises Wounded: no uncommitted reservation of that id on this connection (wounded,
        or never made here).  :raises LeaseLost: a part ended (released, expired).
        :raises InvalidArgument: not granted yet."""
        multi_id = check_multi_id(msg[2])
        key = (conn.session, multi_id)
        r = self.by_key.get(key)
        if r is None or r.wounded:
            if key in self.parked:
                raise InvalidArgument("this reservation is not granted yet")
            raise Wounded("no uncommitted reservation of this multi-lock on this connection: "
                          "wounded by an older one, or never made here")
        now = monotonic_ms()
        if r.state != HELD:
            if self._alive(r, now):
                raise InvalidArgument("this reservation is not granted yet")
            self._forget(r)
            raise Wounded("this reservation ended before it was committed")
        table = self.table
        for name, token in zip(r.names, r.tokens):
            h = table.holder(name, now, r.owner)
            if h is None or h.token != token:
                self._forget(r)
                raise LeaseLost(f"{name!r}: this reservation's lease ended before it was committed (token {token})")
        self._forget(r)
        conn.send(P.encode_ok(req_id, None))

    # -- the core's news ---------------------------------------------------------------------------
    def granted(self, r: Reservation, tokens: list[int]) -> None:
        """Every name of ``r`` was granted and is being delivered."""
        self._unwait(r)
        if r.wounded:
            return
        r.state = HELD
        r.tokens = tokens
        # a grant decided before an older reservation came to wait on one of its names: wound it
        self.server.loop.call_soon(self._check_granted, r)
        self._wake_soon()

    def left(self, r: Reservation) -> None:
        """``r``'s request stopped waiting without a grant (timeout, cancel, deadlock, refusal)."""
        self._unwait(r)
        if not r.wounded:
            self._forget(r)
        self._wake_soon()

    def cancel_parked(self, session: int, name: str, owner: bytes) -> bool:
        """CANCEL of a parked reservation (``owner``: its hash) of connection ``session``
        naming ``name``: withdrawn, answered Cancelled; True if there was one.  Looks at that
        connection's parked reservations only (a CANCEL from any connection comes here while any is parked)."""
        for r in self.parked_of.get(session, ()):
            if r.owner == owner and name in r.names:
                self._forget(r)
                conn = self.server.limits.sessions.get(session)
                if conn is not None:
                    conn.send(P.encode_error(r.req_id, Cancelled.code, f"{name!r}: acquire cancelled"))
                return True
        return False

    def session_closed(self, session: int) -> None:
        """Connection ``session`` closed: its parked reservations go (its waiting ones went
        with its waiters), and so do its held uncommitted parts: a reservation is committed
        only on its own connection, so none of them can become a lease its client uses (the
        client counts the lost connection as a wound and reserves the part again); their
        leases are taken away as a wound's are (a REVOKE record each).  A fenced node leaves
        them to their TTL.  Committed parts are ordinary leases and stay until their TTL."""
        for r in list(self.parked_of.get(session, ())):
            self._forget(r)
        orphaned = [r for r in self.keyed_of.get(session, ()) if r.state == HELD and not r.wounded]
        if orphaned:
            self._take_orphaned(orphaned)
        # its waiting requests ended without a word to this table: the reservations parked on their
        # names are looked at again (a wake costs those, not every parked one: any connection's close)
        parked_on = self.parked_on
        for r in self.waiting_of.pop(session, ()):
            self._stopped_waiting.update(name for name in r.names if name in parked_on)
        if self._stopped_waiting:
            self._wake_soon()

    def _take_orphaned(self, orphaned: list[Reservation]) -> None:
        """Take away the leases of held uncommitted reservations whose connection closed."""
        try:
            self.roles.admit(Action.RELEASE)
        except FastlockError:
            return
        now = monotonic_ms()
        self.server.source.fence_if_due(now)
        table = self.table
        lock_admin = self.handlers.lock_admin
        for r in orphaned:
            for name in r.names:
                h = table.holder(name, now, r.owner)
                if h is not None:
                    lock_admin.take_lease(name, h.token, h.meta, r.principal,
                                          "its connection closed before the multi-lock's commit", now)
            self._unwait(r)
            self._forget(r)
        self._wake_soon()

    # -- the rule ----------------------------------------------------------------------------------
    def _alive(self, r: Reservation, now: int) -> bool:
        """Whether ``r``'s request still waits, or its first part is still held."""
        if r.state == PARKED:
            return True
        name = r.names[0]
        return self.table.waiter_priority(name, r.owner) >= 0 or self.table.holder(name, now, r.owner) is not None

    def _waits(self, r: Reservation, name: str) -> bool:
        return self.table.waiter_priority(name, r.owner) >= 0

    def _older_waiter(self, r: Reservation, now: int) -> Reservation | None:
        """An older reservation whose request waits on one of ``r``'s names, or None."""
        waiting_on = self.waiting_on
        for name in r.names:
            waiters = waiting_on.get(name)
            if not waiters:
                continue
            for w in list(waiters):
                if not self._waits(w, name):
                    waiters.discard(w)  # it stopped waiting: the reservations parked on the name may go
                    if name in self.parked_on:
                        self._stopped_waiting.add(name)
                        self._wake_soon()
                    continue
                if w.rank < r.rank and w is not r:
                    return w
            if not waiters:
                del waiting_on[name]
        return None

    def _wound_younger(self, r: Reservation, now: int) -> None:
        """Wound every younger uncommitted reservation holding or waiting on a name of ``r``."""
        table = self.table
        victims: dict[bytes, Reservation] = {}
        for name in r.names:
            h = table.holder(name, now)
            if h is not None:
                y = self.by_owner.get(h.owner)
                if y is not None and y.rank > r.rank and not y.wounded:
                    victims[y.owner] = y
            for w in self.waiting_on.get(name, ()):
                if w.rank > r.rank and not w.wounded and self._waits(w, name):
                    victims[w.owner] = w
        for y in victims.values():
            self._wound(y, r, now)

    def _wound(self, y: Reservation, by: Reservation, now: int) -> None:
        """Take ``y``'s parts away for the older ``by``: its leases revoked, its request withdrawn,
        its connection told.  Nothing when this node may not release (fenced): ``by`` waits."""
        try:
            self.roles.admit(Action.RELEASE)
        except FastlockError:
            return
        self.server.source.fence_if_due(now)
        y.wounded = True
        self.wounds += 1
        table = self.table
        conn = self.server.limits.sessions.get(y.session)
        request = y.request
        if request is not None and not request.done and self._waits(y, y.names[0]):
            request.done = True  # its reply is the Wounded error below, not the core's Cancelled
            if conn is not None:
                conn.send(P.encode_error(y.req_id, Wounded.code, "wounded by an older multi-lock"))
            table.cancel(y.names[0], y.owner, now)
        lock_admin = self.handlers.lock_admin
        taken = 0
        for name in y.names:
            h = table.holder(name, now, y.owner)
            if h is not None:
                lock_admin.take_lease(name, h.token, h.meta, by.principal, "wounded by an older multi-lock", now)
                taken += 1
        self._unwait(y)
        self._forget(y)
        self._wake_soon()  # reservations parked behind it may go now
        if conn is not None:
            conn.send(P.encode_push(PUSH_WOUNDED, [y.rank.multi_id, y.rank.stamp_ms, by.rank.stamp_ms]))
        log.debug("reservation of %s (stamp %d) wounded by stamp %d: %d leases taken", y.principal,
                  y.rank.stamp_ms, by.rank.stamp_ms, taken, extra={"session": y.session})

    def _check_granted(self, r: Reservation) -> None:
        if r.wounded or r.state != HELD or self.by_key.get((r.session, r.rank.multi_id)) is not r:
            return
        now = monotonic_ms()
        older = self._older_waiter(r, now)
        if older is not None:
            self._wound(r, older, now)
            self.server.after_batch()

    # -- queues before the queue -----------------------------------------------------------------
    def _submit(self, conn: Session, r: Reservation, now: int) -> None:
        """``r`` enters the names' queues (the core's acquire_many) or is granted."""
        wait_ms = -1 if r.wait_until_ms is None else max(0, r.wait_until_ms - now)
        request = ReserveRequest(r, self)
        # the multi-lock is its own party for deadlock detection (many share one connection)
        actor = int.from_bytes(r.rank.multi_id[:8], "big") & P.MAX_ACTOR
        status = self.handlers.kinds.take_many(conn, request, [(n, False) for n in r.names], r.owner, r.ttl_ms,
                                               wait_ms, 0, r.corr, actor)
        r.request = request
        r.state = WAITING if not request.done else r.state
        self._remember(r)
        if status == QUEUED:
            for name in r.names:
                self.waiting_on.setdefault(name, set()).add(r)
            self.waiting_of.setdefault(r.session, set()).add(r)

    def _park(self, r: Reservation) -> None:
        key = (r.session, r.rank.multi_id)
        self.parked[key] = r
        for name in r.names:
            self.parked_on.setdefault(name, set()).add(r)
        self.parked_of.setdefault(r.session, set()).add(r)
        self.per_principal[r.principal] = self.per_principal.get(r.principal, 0) + 1
        self.parked_names[r.principal] = self.parked_names.get(r.principal, 0) + len(r.names)
        if r.wait_until_ms is not None:
            delay = max(0, r.wait_until_ms - monotonic_ms()) / 1000.0
            r.timer = self.server.loop.call_later(delay, self._park_timeout, r)

    def _unpark(self, r: Reservation) -> None:
        if self.parked.pop((r.session, r.rank.multi_id), None) is r:
            for name in r.names:
                on = self.parked_on.get(name)
                if on is not None:
                    on.discard(r)
                    if not on:
                        del self.parked_on[name]
            left = self.parked_names.get(r.principal, 0) - len(r.names)
            if left > 0:
                self.parked_names[r.principal] = left
            else:
                self.parked_names.pop(r.principal, None)
            _drop(self.parked_of, r.session, r)
        if r.timer is not None:
            r.timer.cancel()
            r.timer = None

    def _park_timeout(self, r: Reservation) -> None:
        r.timer = None
        self._forget(r)
        conn = self.server.limits.sessions.get(r.session)
        if conn is not None:
            conn.send(P.encode_error(r.req_id, LockNotAcquired.code,
                                     f"{r.names[0]!r}: wait ran out (behind an older multi-lock)"))
            self.server.after_batch()

    def _wake_soon(self) -> None:
        if self.parked and not self._wake_pending:
            self._wake_pending = True
            self.server.loop.call_soon(self._wake)

    def _wake(self) -> None:
        """Move every parked reservation that no older one blocks any more into the queues: the
        ones parked on a name an older one stopped waiting on (all of them after a connection
        closed), so a wake costs the reservations it may free, not every one; oldest first, so
        an older one (a wounded multi-lock taking its part again keeps its stamp) enters a queue
        before a younger one parked earlier, which then stays parked behind it instead of being
        let in and wounded."""
        self._wake_pending = False
        touched: set[Reservation] = set()
        for name in self._stopped_waiting:
            touched.update(self.parked_on.get(name, ()))
        candidates = sorted(touched, key=_rank_of)  # (parked_on lists parked reservations only)
        self._stopped_waiting.clear()
        now = monotonic_ms()
        sessions = self.server.limits.sessions
        for r in candidates:
            if self.parked.get((r.session, r.rank.multi_id)) is not r:
                continue  # gone meanwhile (withdrawn by a wound this wake made)
            if self._older_waiter(r, now) is not None:
                continue
            self._unpark(r)
            r.parked_ms = max(0, now - r.received_ms)
            self.per_principal[r.principal] = max(0, self.per_principal.get(r.principal, 1) - 1)
            conn = sessions.get(r.session)
            if conn is None or conn.closed:
                continue
            gate = self.server.shard_gate  # a name may have left this group, or be moving, while it was parked
            refused = gate.refusal(r.names) if gate is not None else None
            if refused is not None:
                self.handlers.failed(conn, r.req_id, OP_RESERVE, refused)
                continue
            try:
                self.roles.admit(Action.ACQUIRE)
                self._wound_younger(r, now)
                self._submit(conn, r, now)
            except FastlockError as exc:
                conn.send(P.encode_error(r.req_id, exc.code or LockNotAcquired.code, str(exc)))
        self.server.after_batch()

    # -- bookkeeping -------------------------------------------------------------------------------
    def _remember(self, r: Reservation) -> None:
        self.by_owner[r.owner] = r
        self.by_key[(r.session, r.rank.multi_id)] = r
        self.keyed_of.setdefault(r.session, set()).add(r)
        self.of_principal.setdefault(r.principal, {})[(r.session, r.rank.multi_id)] = r
        self.per_principal[r.principal] = self.per_principal.get(r.principal, 0) + 1

    def _forget(self, r: Reservation) -> None:
        """Drop ``r`` from the table (committed, wounded, ended)."""
        if self.parked.get((r.session, r.rank.multi_id)) is r:
            self._unpark(r)
            self.per_principal[r.principal] = max(0, self.per_principal.get(r.principal, 1) - 1)
        key = (r.session, r.rank.multi_id)
        if self.by_key.get(key) is r:
            del self.by_key[key]
            _drop(self.keyed_of, r.session, r)
            own = self.of_principal.get(r.principal)
            if own is not None:
                own.pop(key, None)
                if not own:
                    del self.of_principal[r.principal]
            left = self.per_principal.get(r.principal, 1) - 1
            if left > 0:
                self.per_principal[r.principal] = left
            else:
                self.per_principal.pop(r.principal, None)
        if self.by_owner.get(r.owner) is r:
            del self.by_owner[r.owner]

    def _unwait(self, r: Reservation) -> None:
        """``r`` waits no more: out of ``waiting_on``, and each of its names that has parked
        reservations is looked at by a wake - whether or not ``r`` was still listed in
        ``waiting_on`` (:meth:`_older_waiter` drops a waiter the table no longer has, which it
        may do before the table's grant or withdrawal of ``r`` reaches this method)."""
        parked_on = self.parked_on
        for name in r.names:
            if name in parked_on:
                self._stopped_waiting.add(name)
                self._wake_soon()
            waiters = self.waiting_on.get(name)
            if waiters is not None:
                waiters.discard(r)
                if not waiters:
                    del self.waiting_on[name]
        _drop(self.waiting_of, r.session, r)

    def _sweep(self, now: int) -> None:
        """Forget up to SWEEP_PER_REQUEST reservations that ended (their parts released or
        expired without a commit); the live ones go to the back of the line."""
        by_key = self.by_key
        for _ in range(min(SWEEP_PER_REQUEST, len(by_key))):
            key = next(iter(by_key))
            r = by_key[key]
            if self._alive(r, now):
                del by_key[key]
                by_key[key] = r
            else:
                self._unwait(r)
                self._forget(r)

    def _purge_principal(self, principal: str, now: int) -> None:
        """Forget up to PURGE_PER_REQUEST of ``principal``'s reservations that ended; the live
        ones it looks at go to the back of its line."""
        own = self.of_principal.get(principal)
        for _ in range(min(PURGE_PER_REQUEST, len(own) if own else 0)):
            assert own is not None
            key = next(iter(own))
            r = own[key]
            if self._alive(r, now):
                del own[key]
                own[key] = r
            else:
                self._unwait(r)
                self._forget(r)
                if not own:
                    return
