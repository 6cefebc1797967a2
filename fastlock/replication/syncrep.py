"""Synchronous replication: a grant waits for the standby (``--replication sync``).

With ``--replication async`` (the default) the primary never waits for its
standby: a grant is acknowledged once the local log has it (``--fsync``), and a
promoted standby waits a grace period because it may lack grants the old
primary acknowledged.  With ``--replication sync`` a reply that tells a client
it holds a lease - a grant, and every extend (an extend moves the lease's
deadline even at the same TTL) - is also held until the standby says it has
the record at the operator's *ack point*:

``written`` (:attr:`SyncAck.WRITTEN`)
    the standby has applied the record and written it to its own WAL file
    (``write(2)``, in its page cache): it survives the primary's death and the
    standby *process'* death, not a power loss of the standby's machine.
``fsynced`` (:attr:`SyncAck.FSYNCED`, the default)
    the standby has also fsynced it: it survives a power loss of the standby
    too.  Costs one standby fsync per batch on top of the primary's.

("received" - in the standby's memory only - is not offered: it differs from
``written`` by one ``write(2)`` on the standby, and loses the record if the
standby process dies too.)

Group commit carries over: the WAL already streams each written batch to the
standby as one push, the standby applies every push a read holds, writes (and
fsyncs) them as one batch of its own WAL and sends one ``SYNC_ACK`` with the
primary LSN it now has; that acknowledgement releases every waiting reply up
to that LSN - one round trip per batch, not per grant.  Releases, expiries,
revocations and key writes are not waited for: a release the standby lacks
leaves the lock held there until the lease's deadline (never two holders).

When the standby does not acknowledge
-------------------------------------
The oldest waiting reply has waited ``--sync-timeout`` (milliseconds on the
wire and here, seconds on the command line); then, per ``--sync-on-timeout``:

``degrade`` (:attr:`SyncOnTimeout.DEGRADE`, the default, as Patroni's
``synchronous_mode`` without ``synchronous_mode_strict``)
    the primary switches to asynchronous replication, loudly (one CRITICAL log
    per switch, ``sync.degradations`` and ``sync.degraded_because`` in the
    status, ``fastlock_sync_degraded`` and ``fastlock_sync_degradations_total``,
    ``sync.state = "degraded"``), tells the standby it is no longer in sync,
    and acknowledges the waiting replies - once the standby has *heard* that
    it is no longer in sync, when it may promote without a grace period (see
    below); it returns to ``in_sync`` by itself once the standby has
    acknowledged everything acknowledged meanwhile.  A primary with **no
    standby attached** (at start, after a promotion, after its standby left)
    degrades at the first grant instead of waiting ``--sync-timeout``.
``fence`` (:attr:`SyncOnTimeout.FENCE`, the *strict* mode, as Patroni's
``synchronous_mode_strict``)
    every waiting reply fails with ``Unavailable`` (retryable: the lease stays
    with its owner key, and the same acquire gets it once the standby is back),
    and the primary is *sync-held* (:mod:`fastlock.roles`): new acquires get
    ``Unavailable`` at once (its message names ``--sync-on-timeout fence``) and
    no lock is handed to a waiter, until the standby acknowledges everything
    logged up to the hold.  A primary with no standby attached waits the same
    way: it grants nothing until a standby attaches and catches up.  A client
    retries ``Unavailable`` within its deadline: one with a deadline gets
    ``ConnectionLost`` naming that refusal when it runs out; one that waits
    without a deadline (``wait=None``) keeps waiting, and the reason is the
    primary's CRITICAL log, ``sync.state = "held"`` with ``sync.held_because``
    in ``fastlock status``, and ``fastlock_sync_held`` in the metrics.

When a degrading primary waits for its standby to hear it: only when a paired
standby with a failover window may be told "in sync" (the last status sent
said so and the heartbeat fence applies).  The replies then wait until the
standby echoes a heartbeat sent after the "not in sync" status (the link is
ordered, so it has read the status by then), or fail with ``Unavailable`` a
further ``--sync-timeout`` later (a standby that is silent is fenced against
anyway).  So neither policy ever acknowledges a grant the standby lacks while
the standby's last word from the primary is "in sync".

At most :data:`MAX_WAITING` batches wait at once; beyond that a reply fails
with ``Unavailable`` at once (memory stays bounded).

The in-sync promise and the promotion grace
-------------------------------------------
The primary tells its standby, in a ``"sync"`` push on attach, on every change
and with every heartbeat, ``[ack_point, in_sync, on_timeout]``: ``in_sync``
is true when this standby connection has acknowledged every LSN the primary
has acknowledged to a client (and everything logged before this node became
the primary), the primary has not degraded, and it is not in a grace period
itself (its own table may then lack grants a client holds).  A standby forgets it on every
new connection (it sends ``REPLICATE`` not in sync) and on a restart.

A promoted standby starts with **no grace period** when its primary's latest
status said ``in_sync`` and either

* the old primary confirmed it stepped down (``fastlock promote`` answered by
  ``STEP_DOWN``: every status it sent before is read by then), or
* the promotion was automatic (``--failover-after``) or waited for the old
  primary's fence: neither policy acknowledges a grant the standby lacks while
  the standby's last word is "in sync", whenever the primary dies.

Both only for the primary's one *paired* standby (the pairing the primary's
heartbeats confirm): the primary never pairs with a second standby while the
first may come back (only ``serve-alone``, which degrades, unpairs it), so no
other standby's acknowledgement can release a reply this one lacks.

Otherwise - asynchronous replication, a standby that was catching up or never
told it was in sync, a standby that is not the confirmed pair, a forced
promotion (``--force``) of an unconfirmed primary - the grace period applies as with asynchronous replication.  The
epoch is raised at every promotion either way, so tokens never go backwards;
replicated leases are kept to their replicated deadlines, so a lock whose
holder was acknowledged is never granted to another before its lease ends.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..errors import FastlockError, ProtocolError, Unavailable
from ..roles import Role
from ..units import monotonic_ms
from ._wire import SyncWire

if TYPE_CHECKING:  # pragma: no cover
    from .follower import StandbyFollower
    from .host import ReplicaConnection, ReplicationHost
    from .source import ReplicationSource

log = logging.getLogger("fastlock.replication")

#: batches of replies that may wait for the standby at once; beyond, a reply fails at once
MAX_WAITING = 65_536


class ReplicationMode(str, enum.Enum):
    """``--replication``: does an acknowledged grant wait for the standby?"""

    #: no: the primary never waits (a promoted standby waits a grace period)
    ASYNC = "async"
    #: yes: grants and extends are acknowledged once the standby has them
    SYNC = "sync"


class SyncAck(str, enum.Enum):
    """``--sync-ack``: where the standby has a record when it acknowledges it."""

    #: applied and written to its WAL file (survives the standby process' death)
    WRITTEN = "written"
    #: also fsynced (survives a power loss of the standby's machine)
    FSYNCED = "fsynced"


class SyncOnTimeout(str, enum.Enum):
    """``--sync-on-timeout``: what the primary does when the standby stops acknowledging."""

    #: strict: fail the waiting replies (Unavailable) and hold grants until the standby is back
    FENCE = "fence"
    #: the default: acknowledge without the standby (asynchronous) until it catches up, loudly
    DEGRADE = "degrade"


@dataclass(frozen=True)
class SyncSettings:
    """The synchronous replication settings of a primary.

    Args:
        ack: the standby's ack point.
        timeout_ms: how long the oldest reply may wait for the standby (milliseconds, > 0).
        on_timeout: what happens then.

    Raises:
        ValueError: a value out of its range or naming no choice.
    """

    ack: SyncAck = SyncAck.FSYNCED
    timeout_ms: int = 2000
    on_timeout: SyncOnTimeout = SyncOnTimeout.DEGRADE

    def __post_init__(self) -> None:
        object.__setattr__(self, "ack", _choice(SyncAck, self.ack, "sync_ack"))
        object.__setattr__(self, "on_timeout", _choice(SyncOnTimeout, self.on_timeout, "sync_on_timeout"))
        if type(self.timeout_ms) is not int or self.timeout_ms <= 0:
            raise ValueError(f"sync_timeout_ms must be a positive integer (milliseconds), not {self.timeout_ms!r}")


def _choice(cls: type[enum.Enum], value: Any, field_name: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{field_name} must be one of {choices}, not {value!r}") from None


def parse_mode(value: Any) -> ReplicationMode:
    """``"async"`` or ``"sync"`` as a :class:`ReplicationMode`.  :raises ValueError: anything else."""
    return _choice(ReplicationMode, value, "replication")


#: what a held reply is called with: None (acknowledge) or the error to answer instead
Deliver = Callable[..., Any]


def _call(deliver: Deliver, *error: FastlockError) -> None:
    """Run one held reply; a failure is logged and the others still run (none is left waiting)."""
    try:
        deliver(*error)
    except Exception:
        log.exception("delivering a reply held for the synchronous standby failed")


class SyncGate(SyncWire):
    """The primary's side: hold grant and extend replies until the standby has their LSN.

    ``settings`` None: asynchronous replication, and :meth:`after` returns its
    callback unchanged (nothing costs anything).  ``enabled`` is a slot of its compiled
    base (:class:`~fastlock.replication._wire.SyncWire`).

    Args:
        host: the server.
        source: the replication source (its attached standby and its pushes).
        settings: the synchronous settings, or None.
    """

    def __init__(self, host: ReplicationHost, source: ReplicationSource, settings: SyncSettings | None):
        self.host = host
        self.source = source
        self.settings = settings
        self.enabled = settings is not None
        self.acked_lsn = 0  # the primary LSN the standby's current connection has at the ack point
        self._acked_session = -1  # that connection's session
        self.released_lsn = 0  # the highest LSN whose reply went out (with or without the standby)
        self._floor: int | None = None  # the LSN logged when this node became the primary
        self.waiting: deque[tuple[int, Deliver, int]] = deque()  # (lsn, deliver, since ms)
        self.degraded = False
        self.degraded_because: str | None = None
        #: degraded, and the paired standby may still believe it is in sync: replies wait until it
        #: echoes a heartbeat sent after this time (primary monotonic ms); None: nothing to wait for
        self.unheard_since_ms: int | None = None
        self.held_upto = 0  # fence policy: held until the standby acknowledges this LSN (0: not held)
        self.held_because: str | None = None
        self.degradations = 0
        self.holds = 0
        self.acks_rejected = 0  # SYNC_ACKs of an LSN their connection never carried
        self._timer: Any = None
        self._sent_in_sync: bool | None = None

    # -- what the server calls ------------------------------------------------------------------
    def after(self, deliver: Deliver) -> Deliver:
        """``deliver`` wrapped to run once the standby has every record logged so far.

        Call it right after logging the records the reply depends on; call what
        it returns once they are durable locally (``WriteAheadLog.when_durable``).
        ``deliver()`` runs when the standby acknowledges; ``deliver(error)``
        (an :class:`~fastlock.errors.Unavailable`) when the reply must fail.
        Asynchronous replication: ``deliver`` itself.
        """
        if not self.enabled:
            return deliver
        lsn = self.host.wal.logged_lsn
        return lambda: self._hold(lsn, deliver)

    def _hold(self, lsn: int, deliver: Deliver) -> None:
        if self.host.roles.role is not Role.PRIMARY:
            _call(deliver)  # refused there: this node does not grant
            return
        self._must_have()
        if lsn <= self.acked_lsn or (self.degraded and self.unheard_since_ms is None):
            self._release(lsn, deliver)
        elif self.held_upto:
            _call(deliver, self._refusal("is held: the standby has not caught up since it stopped acknowledging"))
        elif len(self.waiting) >= MAX_WAITING:
            _call(deliver, Unavailable(f"{MAX_WAITING} batches of replies already wait for the synchronous "
                                       f"standby: not acknowledged; retry"))
        else:
            now = monotonic_ms()
            self.waiting.append((lsn, deliver, now))
            if not self.degraded and not self.source.replicas and self._degrades():
                self._degrade("no standby is attached")  # Patroni's default: serve without one, loudly
            if self.waiting and self._timer is None:
                self._arm(now + self._timeout_ms())

    def _degrades(self) -> bool:
        return self.settings is not None and self.settings.on_timeout is SyncOnTimeout.DEGRADE

    def _release(self, lsn: int, deliver: Deliver) -> None:
        if lsn > self.released_lsn:
            self.released_lsn = lsn
        _call(deliver)

    def on_ack(self, conn: ReplicaConnection, lsn: Any) -> None:
        """The standby's ``SYNC_ACK``: it has every record up to ``lsn`` at the ack point.

        Counted only when its connection carried ``lsn``
        (:meth:`ReplicationSource.admit_sync_ack <fastlock.replication.source.ReplicationSource.admit_sync_ack>`),
        and only forward on one connection; another ack is ignored (``acks_rejected``).

        Raises:
            ProtocolError: not an attached standby, or ``lsn`` not an int in
                ``0..`` the last LSN logged (the connection is dropped).
        """
        if conn.session not in self.source.replicas:
            raise ProtocolError("SYNC_ACK before REPLICATE")
        last = self.host.wal.logged_lsn  # a snapshot's LSN may be logged and not yet written
        if type(lsn) is not int or not 0 <= lsn <= last:
            raise ProtocolError(f"SYNC_ACK takes an LSN in 0..{last}, not {lsn!r}")
        if not self.source.admit_sync_ack(conn, lsn):
            self.acks_rejected += 1  # an LSN its connection never carried counts nothing (logged there)
            return
        if conn.session != self._acked_session:
            self._acked_session = conn.session  # a new connection: it has only what it says
            self.acked_lsn = lsn
        elif lsn > self.acked_lsn:
            self.acked_lsn = lsn
        if not self.enabled:
            return
        waiting = self.waiting
        while waiting and waiting[0][0] <= self.acked_lsn:
            held_lsn, deliver, _ = waiting.popleft()
            self._release(held_lsn, deliver)
        if self.held_upto and self.acked_lsn >= self.held_upto:
            self.held_upto = 0
            self.held_because = None
            self.host.roles.set_sync_held(False)
            log.warning("synchronous standby acknowledged LSN %d: granting again", self.acked_lsn)
            if self.host.roles.expires_leases:
                self.host.table.expire(monotonic_ms())  # hand held locks to their waiters
            self.host.after_batch()
        if self.degraded and self.acked_lsn >= self._must_have():
            self.degraded = False
            self.degraded_because = None
            self.unheard_since_ms = None
            log.warning("synchronous standby caught up (LSN %d): replication is synchronous again", self.acked_lsn)
        self._push_if_changed()

    def serve_alone(self) -> None:
        """The operator's ``serve-alone``: stop waiting for the standby (as a degrade, without
        waiting for the standby to hear it: the operator says it is gone)."""
        if self.enabled:
            self._degrade("the operator ran `fastlock serve-alone`", operator=True)

    def on_contact(self, echoed_ms: int) -> None:
        """The standby echoed a heartbeat the primary sent at ``echoed_ms`` (its monotonic ms):
        if that was after the "not in sync" status of a degrade, the standby has read it, and
        the replies that waited for that are acknowledged."""
        since = self.unheard_since_ms
        if since is None or echoed_ms <= since:
            return
        self.unheard_since_ms = None
        log.warning("synchronous standby heard that it is no longer in sync: acknowledging %d waiting "
                    "replies without it", len(self.waiting))
        self._release_all()

    def on_witness_out_of_sync(self) -> None:
        """The pair's witness recorded that this primary's standby may lack grants it
        acknowledged (:mod:`fastlock.replication.witness`): the standby can be promoted
        only with the witness's vote, which then tells it to take the grace period, so a
        degrade no longer waits for the standby to hear it (a dead standby never does)."""
        if self.unheard_since_ms is None:
            return
        self.unheard_since_ms = None
        log.warning("the witness recorded that the standby is no longer in sync: acknowledging %d waiting "
                    "replies without it", len(self.waiting))
        self._release_all()

    # -- timing out ---------------------------------------------------------------------------
    def _timeout_ms(self) -> int:
        return self.settings.timeout_ms if self.settings is not None else 0

    def _arm(self, at_ms: int) -> None:
        self._timer = self.host.loop.call_later(max(0, at_ms - monotonic_ms()) / 1000.0, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if not self.waiting:
            return
        now = monotonic_ms()
        lsn, _, since = self.waiting[0]
        unheard = self.degraded and self.unheard_since_ms is not None
        # degraded and not yet heard: a reply waits a whole timeout from the degrade at least
        deadline = (max(since, self.unheard_since_ms or 0) if unheard else since) + self._timeout_ms()
        if now < deadline:
            self._arm(deadline)
            return
        if self.source.replicas:
            why = (f"the standby has not acknowledged LSN {lsn} within --sync-timeout {self._timeout_ms()} ms "
                   f"(it has LSN {self.acked_lsn})")
        else:
            why = (f"no standby is attached: nothing acknowledged LSN {lsn} within --sync-timeout "
                   f"{self._timeout_ms()} ms")
        if unheard:
            # the standby has not heard of the degrade: what waited a whole timeout fails (it is
            # silent, and the heartbeat fence stops this primary soon), what is younger waits on
            error = self._refusal("degraded, and the standby has not confirmed it heard so")
            while self.waiting and self.waiting[0][2] + self._timeout_ms() <= now:
                _call(self.waiting.popleft()[1], error)
        elif self._degrades():
            self._degrade(why)
        else:
            self._fence(why)
        if self.waiting and self._timer is None:  # still unheard: the next check
            self._arm(max(self.waiting[0][2], self.unheard_since_ms or 0) + self._timeout_ms())

    def _fence(self, why: str) -> None:
        self.held_upto = self.host.wal.logged_lsn
        self.held_because = why
        self.holds += 1
        self.host.roles.set_sync_held(True)
        log.critical("synchronous replication: %s; refusing new grants until it has LSN %d "
                     "(--sync-on-timeout fence: strict)", why, self.held_upto)
        error = self._refusal("timed out")
        while self.waiting:
            _call(self.waiting.popleft()[1], error)

    def _degrade(self, why: str, *, operator: bool = False) -> None:
        if not self.degraded:
            # a paired standby that fails over by itself and was last told "in sync" may promote
            # without a grace period: nothing goes out without it until it has heard otherwise
            unheard = bool(self._sent_in_sync) and self.source.fencing and not operator
            self.degraded = True
            self.degraded_because = why
            self.degradations += 1
            self.unheard_since_ms = monotonic_ms() if unheard else None
            log.critical("synchronous replication DEGRADED to asynchronous: %s; grants are acknowledged "
                         "without the standby%s until it catches up (--sync-on-timeout degrade)", why,
                         " (once it has heard it is no longer in sync)" if unheard else "")
        if operator:
            self.unheard_since_ms = None
        self._push_if_changed()  # the standby hears it before any unreplicated reply goes out
        if self.held_upto:
            self.held_upto = 0
            self.held_because = None
            self.host.roles.set_sync_held(False)
        if self.unheard_since_ms is None:
            self._release_all()

    def _release_all(self) -> None:
        """Acknowledge every waiting reply without the standby (degraded, and heard)."""
        while self.waiting:
            lsn, deliver, _ = self.waiting.popleft()
            self._release(lsn, deliver)
        self._release(self.host.wal.logged_lsn, lambda: None)

    def _refusal(self, what: str) -> FastlockError:
        return Unavailable(f"synchronous replication {what} (--sync-timeout {self._timeout_ms()} ms): "
                           f"not acknowledged, nothing lost; retry (the same owner key finds its lease)")

    # -- the in-sync promise ------------------------------------------------------------------
    def _must_have(self) -> int:
        """The LSN a standby must have acknowledged to be in sync."""
        if self._floor is None:
            if self.host.roles.role is not Role.PRIMARY:
                return 1 << 62  # not a primary (yet): nobody is in sync with it
            self._floor = self.host.wal.logged_lsn  # everything before may have been acknowledged
        return max(self._floor, self.released_lsn)

    @property
    def in_sync(self) -> bool:
        """Has the attached standby every record any client was told about, with no degrade since?

        Never while this primary is in a grace period itself (after its own promotion,
        or a restart that may have lost acknowledged records): its own table may lack
        grants a client holds, so neither it nor its standby may skip the grace."""
        return (self.enabled and not self.degraded and self._acked_session in self.source.replicas
                and self.acked_lsn >= self._must_have()
                and self.host.roles.grace_remaining_ms(monotonic_ms()) == 0)

    def status_push(self) -> bytes | None:
        """The ``"sync"`` push for the standby (sent with every heartbeat); None: asynchronous."""
        if self.settings is None:
            return None
        in_sync = self.in_sync
        self._sent_in_sync = in_sync
        return P.encode_push(P.PUSH_SYNC, [self.settings.ack.value, in_sync, self.settings.on_timeout.value])

    def _push_if_changed(self) -> None:
        if self.in_sync == self._sent_in_sync:
            return
        msg = self.status_push()
        if msg is None:
            return
        for replica in self.source.replicas.values():
            if not replica.conn.closed:
                replica.conn.send(msg)
                replica.conn.flush()

    def handlers(self) -> dict[int, Callable[[Any, int, list], None]]:
        """The server's handler for ``SYNC_ACK`` (a replica principal's op; no reply)."""
        return {P.OP_SYNC_ACK: lambda conn, req_id, msg: self.on_ack(conn, msg[2])}

    def status(self) -> dict:
        """``replication.sync`` of STATUS."""
        if self.settings is None:
            return {"mode": ReplicationMode.ASYNC.value}
        state = ("degraded" if self.degraded else "held" if self.held_upto
                 else "in_sync" if self.in_sync else "not_in_sync")
        return {"mode": ReplicationMode.SYNC.value, "ack": self.settings.ack.value,
                "on_timeout": self.settings.on_timeout.value, "timeout_ms": self.settings.timeout_ms,
                "state": state, "standby_acked_lsn": self.acked_lsn, "waiting": len(self.waiting),
                "degradations": self.degradations, "holds": self.holds, "acks_rejected": self.acks_rejected,
                "degraded_because": self.degraded_because, "held_because": self.held_because,
                "standby_heard_degrade": self.unheard_since_ms is None}

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


#: the permission SYNC_ACK needs (joins the server's PERMISSION table)
SYNC_PERMISSIONS = {P.OP_SYNC_ACK: "replica"}


class SyncStatus:
    """The standby's side: acknowledge at the primary's ack point, remember whether it is in sync.

    Args:
        follower: the standby's follower (its WAL, its link, its applied LSN).
    """

    def __init__(self, follower: StandbyFollower):
        self.follower = follower
        self.ack: SyncAck | None = None  # the primary's ack point (None: asynchronous)
        self.in_sync = False
        self.on_timeout: SyncOnTimeout | None = None
        self.acked_lsn = -1  # the primary LSN acknowledged on this connection (-1: none yet)
        self._pending: deque[tuple[int, int]] = deque()  # (own logged LSN, primary LSN)
        self._listening = False

    def reset(self) -> None:
        """A new connection to a primary: not in sync until it says so."""
        self.ack = None
        self.in_sync = False
        self.on_timeout = None
        self.acked_lsn = -1
        self._pending.clear()

    def on_status(self, payload: Any) -> None:
        """The primary's ``"sync"`` push ``[ack_point or None, in_sync, on_timeout]``.

        :raises ProtocolError: not that shape.
        """
        if type(payload) is not list or len(payload) != 3 or type(payload[1]) is not bool:
            raise ProtocolError("a sync status is [ack_point, in_sync, on_timeout]")
        try:
            ack = None if payload[0] is None else SyncAck(payload[0])
            on_timeout = None if payload[2] is None else SyncOnTimeout(payload[2])
        except ValueError:
            raise ProtocolError(f"unknown sync ack point or timeout policy: {payload[0]!r}, {payload[2]!r}") from None
        if payload[1] != self.in_sync:
            log.info("primary says this standby is %s", "in sync" if payload[1] else "not in sync")
        self.ack, self.in_sync, self.on_timeout = ack, payload[1], on_timeout
        if ack is not None:
            if not self._listening:
                self._listening = True
                self.follower.host.wal.add_progress_listener(self._on_progress)
            self.applied(self.follower.applied_lsn)

    def applied(self, primary_lsn: int) -> None:
        """Records up to ``primary_lsn`` are applied and logged: acknowledge them at the ack point.

        Nothing is acknowledged before the follower has synced with this primary (a snapshot
        or records of its stream applied): until then its applied LSN may be a position in
        another primary's log (a group standby that follows a new primary, whose snapshot of
        more than :data:`~fastlock.replication.source.INLINE_SNAPSHOT_LEASES` leases comes
        after the ``"sync"`` push).  The new primary would not count it, and this side would
        withhold every acknowledgement up to it.
        """
        if self.ack is None or primary_lsn <= self.acked_lsn or not self.follower.synced:
            return
        wal = self.follower.host.wal
        self._pending.append((wal.logged_lsn, primary_lsn))
        if self.ack is SyncAck.FSYNCED:
            wal.request_sync()
        self._on_progress(wal.written_lsn, wal.synced_lsn)

    def _on_progress(self, written: int, synced: int) -> None:
        mark = synced if self.ack is SyncAck.FSYNCED else written
        pending = self._pending
        lsn = -1
        while pending and pending[0][0] <= mark:
            lsn = pending.popleft()[1]
        if lsn > self.acked_lsn:
            self.acked_lsn = lsn
            self.follower.link.send_sync_ack(lsn)

    def covers_promotion(self, *, confirmed: bool, forced: bool, automatic: bool) -> str | None:
        """Why a promotion needs no grace period (see the module docstring), or None if it does."""
        if not self.in_sync or self.ack is None or not self.follower.synced:
            return None
        if not self.follower.pair_confirmed:
            # the promise holds for the one paired standby only: a primary that several
            # standbys follow (none paired) may acknowledge with another one's copy
            return None
        if confirmed:
            return "in sync with a primary that confirmed it stepped down"
        if automatic or not forced:
            # fence: it never acknowledges a grant its standby lacks; degrade: not before this
            # standby has heard that it is no longer in sync (it would not be in sync then)
            policy = self.on_timeout.value if self.on_timeout is not None else "sync"
            return f"in sync with a primary that acknowledges no grant its standby lacks while it says so ({policy})"
        return None
