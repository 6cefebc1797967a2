"""A node's role, declared once: the state machine and the one place that says what the node may do.

A fastlock node is in exactly one :class:`Role` at a time:

``PRIMARY``
    Serves lock operations, expires leases, streams its WAL to a standby.
``STANDBY``
    Follows a primary; refuses every lock operation with
    ``NotPrimary(primary=<address>)``; its table runs on frozen time.
``PROMOTING``
    A standby between deciding to promote and its new epoch being durable
    (it may wait out the old primary's fence); refuses lock operations with
    ``NotPrimary(primary=None)``.
``DEPOSED``
    A former primary that learned of a newer epoch; refuses every lock
    operation with ``NotPrimary(primary=None)``, for good (it is restarted as a
    standby of the new primary) - or, run with ``--coordinator``, until etcd
    names the primary it then follows as a standby; or, in a pair, at once when
    it found its paired standby promoted (it follows it).

Two conditions qualify a primary:

*fenced*
    a paired primary without a recent heartbeat echo from its standby (the
    standby may be promoting, see :mod:`fastlock.replication`): it grants,
    extends and releases nothing until the echo returns or an operator runs
    ``fastlock serve-alone``.
*sync-held*
    a primary with synchronous replication whose standby has not acknowledged
    within ``--sync-timeout`` (``--sync-on-timeout fence``, see
    :mod:`fastlock.replication.syncrep`): it takes no new acquire and hands no
    lock to a waiter until the standby acknowledges again; extends and
    releases go on.
*in grace*
    after a promotion, until ``grace_until_ms``: the new primary keeps every
    replicated lease but hands out no lock that was free, as Chubby's new
    master waits out the old master's leases.

Changes go through :meth:`NodeRole.transition`, which checks
:data:`TRANSITIONS` (the only legal moves, as data that tests and docs
enumerate), logs every change, and raises :class:`IllegalTransition` on any
other move - never silently, as asyncpg's protocol ``_set_state`` refuses a
state change it does not expect.  :data:`ADMITTED` says, per role and fence,
which :class:`Action` a request may take; :meth:`NodeRole.admit` raises the
error a refused client sees.  The lock table's grant hold (no hand-off to
waiters) is derived here too and pushed to the table on every change, so no
other module sets it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

from .errors import NotPrimary, Unavailable

log = logging.getLogger(__name__)

#: the grace period of a promoted primary, as a refused acquire names it
PROMOTION_GRACE = "the promotion grace period (leases the old primary granted may still be held)"

#: far enough in the future (ms) to mean "never" for a grant hold, within the table's range
HOLD_FOREVER_MS = 10 * 365 * 24 * 3600 * 1000


class Role(enum.Enum):
    """The role of a node (the value is the name shown in STATUS, HELLO and metrics)."""

    PRIMARY = "primary"
    STANDBY = "standby"
    PROMOTING = "promoting"
    DEPOSED = "deposed"


#: Every legal move, with why it happens.  Anything else is a bug in the caller.
TRANSITIONS: dict[tuple[Role, Role], str] = {
    (Role.STANDBY, Role.PROMOTING): "promotion begins (operator command, or the primary went silent)",
    (Role.PROMOTING, Role.PRIMARY): "promotion done: the new epoch is durable",
    (Role.PROMOTING, Role.STANDBY): "promotion refused or failed: back to following",
    (Role.PRIMARY, Role.DEPOSED):
        "stepped down: a newer epoch exists (a standby's STEP_DOWN, deposed.json at start, or the "
        "etcd primary key lost)",
    (Role.DEPOSED, Role.STANDBY):
        "rejoining: the coordinator (--coordinator) names the primary to follow, or none (it may bid again); "
        "or, in a pair, the paired standby answers as the primary at a higher epoch",
}


class Action(enum.IntEnum):
    """What a request asks of the node (several ops map to one action).

    An ``IntEnum`` so that the per-request membership test hashes in C.
    """

    ACQUIRE = 1        # ACQUIRE: queue or grant
    EXTEND = 2         # EXTEND
    RELEASE = 3        # RELEASE, and a CANCEL that releases a grant that raced it
    CANCEL_WAITER = 4  # CANCEL of a still queued waiter (local: no lease changes hands)
    READ = 5           # CHECK, HOLDER, WATCH: answers about the current holder
    SERVE_STANDBY = 6  # REPLICATE: stream the log to a standby


_LOCK_OPS = frozenset(Action)

#: Which actions each (role, fenced) admits.  A fenced primary still serves its standby
#: (its echo is what unfences it) and lets a client withdraw a queued waiter; it refuses
#: everything whose answer or effect the newly promoted standby might contradict.
ADMITTED: dict[tuple[Role, bool], frozenset[Action]] = {
    (Role.PRIMARY, False): _LOCK_OPS,
    (Role.PRIMARY, True): frozenset({Action.CANCEL_WAITER, Action.SERVE_STANDBY}),
    (Role.STANDBY, False): frozenset(),
    (Role.PROMOTING, False): frozenset(),
    (Role.DEPOSED, False): frozenset(),
}


class IllegalTransition(RuntimeError):
    """A role change not in :data:`TRANSITIONS`, or a fence on a node that is not
    a primary: a bug in fastlock, never a client's fault (the server logs it as an
    internal error)."""


class NodeRole:
    """The node's role, its fence and grace, and every "may this node ... now?" answer.

    Args:
        initial: the role at start (``PRIMARY`` or ``STANDBY``).
        hold_grants_until: called with a monotonic-ms deadline whenever the
            grant hold changes (the server passes ``LockTable.hold_grants_until``).
        now_ms: the server's monotonic clock in milliseconds.
        primary_address: for a standby, the ``host:port`` of its primary, named
            in the ``NotPrimary`` redirect.
        on_admitted: None, or called with :attr:`admitted` at the start and on every
            change (the server keeps it where its compiled request path reads it).

    Attributes:
        expires_leases (bool): does this node expire leases itself?  Only a
            primary does (fenced or not: it extends nothing while fenced, so its
            leases run out as the standby's would).  Read at every batch end.
        admitted (frozenset[Action]): the actions admitted in the current role, fence
            and sync hold (:data:`ADMITTED`), kept on every change: the compiled request
            path tests membership itself and calls :meth:`admit` only for a refusal.
    """

    __slots__ = ("_role", "_fenced", "_sync_held", "_grace_until_ms", "_hold", "_now_ms", "admitted",
                 "primary_address", "expires_leases", "grace_reason", "alone_since", "_on_admitted")

    def __init__(self, initial: Role, *, hold_grants_until: Callable[[int], None],
                 now_ms: Callable[[], int], primary_address: str | None = None,
                 on_admitted: Callable[[frozenset[Action]], None] | None = None):
        if initial not in (Role.PRIMARY, Role.STANDBY):
            raise IllegalTransition(f"a node starts as primary or standby, not {initial.value}")
        self._role: Role = initial
        self._fenced = False
        self._sync_held = False
        self._grace_until_ms = 0
        #: what the grace period in force is, as a refused acquire names it
        self.grace_reason = ""
        self._hold = hold_grants_until
        self._now_ms = now_ms
        self.primary_address = primary_address
        #: ``(epoch, monotonic ms)`` set by a promotion to ``epoch``: from that time on no other
        #: node serves (the old primary's fence had closed, or it confirmed its step-down);
        #: None when unknown (fastlock.server.ratelimit starts its limiters from it)
        self.alone_since: tuple[int, int] | None = None
        self._on_admitted = on_admitted
        self._changed()

    # -- state ---------------------------------------------------------------------------------
    @property
    def role(self) -> Role:
        return self._role

    @property
    def fenced(self) -> bool:
        """Is this primary fenced (no recent standby echo)?"""
        return self._fenced

    @property
    def grace_until_ms(self) -> int:
        """Monotonic ms until which a promoted primary grants no free lock (0: no grace)."""
        return self._grace_until_ms

    def grace_remaining_ms(self, now: int) -> int:
        return max(0, self._grace_until_ms - now) if self._role is Role.PRIMARY else 0

    def transition(self, to: Role, why: str, *, grace_until_ms: int | None = None) -> None:
        """Move to role ``to`` (logged with ``why``); ``grace_until_ms`` (monotonic ms)
        starts a grace period on becoming primary.

        Raises:
            IllegalTransition: the move is not in :data:`TRANSITIONS`; nothing changes.
        """
        frm = self._role
        if (frm, to) not in TRANSITIONS:
            raise IllegalTransition(f"illegal role change {frm.value} -> {to.value} ({why})")
        self._role = to
        if to is not Role.PRIMARY:
            self._fenced = self._sync_held = False  # the fence and the sync hold qualify a primary only
        if grace_until_ms is not None:
            self._grace_until_ms = grace_until_ms
            self.grace_reason = PROMOTION_GRACE
        log.warning("role: %s -> %s (%s)", frm.value, to.value, why)
        self._changed()

    def hold_grace(self, until_ms: int, why: str, *, reason: str = PROMOTION_GRACE) -> None:
        """Hold this primary's grants of free locks until ``until_ms`` (monotonic
        ms) at least: a grace period on a node that is already the primary (one
        restarted during its promotion grace, or after an unclean stop of a relaxed
        fsync run).  ``why`` is logged; ``reason`` names the grace period in the
        refusals of acquires while it lasts (:attr:`grace_reason`).

        Raises:
            IllegalTransition: this node is not the primary.
        """
        if self._role is not Role.PRIMARY:
            raise IllegalTransition(f"only a primary has a grace period (this node is {self._role.value})")
        if until_ms > self._grace_until_ms:
            self._grace_until_ms = until_ms
            self.grace_reason = reason
            log.warning("role: primary in grace for %d ms (%s)", until_ms - self._now_ms(), why)
            self._changed()

    def set_fenced(self, fenced: bool) -> None:
        """Fence or unfence this primary (the replication source decides when).

        Raises:
            IllegalTransition: fencing a node that is not the primary.
        """
        if fenced == self._fenced:
            return
        if fenced and self._role is not Role.PRIMARY:
            raise IllegalTransition(f"only a primary can be fenced (this node is {self._role.value})")
        self._fenced = fenced
        log.info("role: primary %s", "fenced" if fenced else "unfenced")
        self._changed()

    @property
    def sync_held(self) -> bool:
        """Does this primary hold grants until its synchronous standby acknowledges again?"""
        return self._sync_held

    def set_sync_held(self, held: bool) -> None:
        """Hold (or stop holding) new acquires and hand-offs for the synchronous standby
        (the replication's sync gate decides when); a no-op on a node that is not the primary."""
        if held == self._sync_held or (held and self._role is not Role.PRIMARY):
            return
        self._sync_held = held
        log.warning("role: primary %s", "holding grants for its synchronous standby" if held
                    else "no longer holding grants for its synchronous standby")
        self._changed()

    # -- the answers ---------------------------------------------------------------------------
    def grants_held_until(self) -> int:
        """The lock table's grant hold (monotonic ms): forever unless an unfenced primary."""
        if self._role is not Role.PRIMARY or self._fenced or self._sync_held:
            return self._now_ms() + HOLD_FOREVER_MS
        return self._grace_until_ms

    def may_grant(self, now: int) -> bool:
        """May a free lock be handed to a client at ``now`` (monotonic ms)?"""
        return (self._role is Role.PRIMARY and not self._fenced and not self._sync_held
                and now >= self._grace_until_ms)

    def may(self, action: Action) -> bool:
        """Is ``action`` admitted in the current role and fence?"""
        return action in self.admitted


    def admit(self, action: Action) -> None:
        """Raise the error a client gets if ``action`` is refused now; return if admitted.

        Raises:
            NotPrimary: a standby (naming its primary), promoting or deposed node
                (naming none) - the client looks for the primary.
            Unavailable: a fenced primary - the client tries the other nodes and
                repeats the request at whichever is primary.
        """
        if action in self.admitted:
            return
        if self._sync_held and not self._fenced and self._role is Role.PRIMARY:  # only ACQUIRE is refused then
            raise Unavailable(f"this primary's synchronous standby has not acknowledged within --sync-timeout "
                              f"(strict: --sync-on-timeout fence): {action.name.lower()} refused, nothing "
                              f"changed; retry")
        role = self._role
        if role is Role.STANDBY:
            raise NotPrimary(f"this node is a standby (primary: {self.primary_address})", self.primary_address)
        if role is not Role.PRIMARY:
            raise NotPrimary(f"this node is {role.value}; the primary is unknown to it", None)
        raise Unavailable(f"this primary lost contact with its standby (fenced): {action.name.lower()} refused, "
                          f"nothing changed; the standby may have been promoted")

    def _changed(self) -> None:
        self.admitted = ADMITTED[(self._role, self._fenced)]
        if self._sync_held and self._role is Role.PRIMARY:
            self.admitted = self.admitted - {Action.ACQUIRE}
        self.expires_leases = self._role is Role.PRIMARY
        if self._on_admitted is not None:
            self._on_admitted(self.admitted)
        self._hold(self.grants_held_until())

    def __repr__(self) -> str:
        return f"<NodeRole {self._role.value}{' fenced' if self._fenced else ''} grace_until={self._grace_until_ms}>"
