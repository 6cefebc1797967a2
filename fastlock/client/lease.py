"""Lease types: :class:`Lease` (immutable), its shared mutable :class:`LeaseState`,
:class:`LeaseHealth` (safe / in jeopardy / lost) and :class:`WatchEvent`.

A :class:`Lease` never changes once made: :meth:`Client.extend
<fastlock.client.Client.extend>` returns a new one when the TTL changes.  What
does change while a lease is held - the client's estimate of when the server
will expire it, whether it is lost, its health - lives in one
:class:`LeaseState` that every copy of the lease shares, so a renewal done by
the background :class:`~fastlock.client.renewer.Renewer` is seen through the
``Lease`` object the caller holds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ..errors import InvalidArgument, WrongArgumentType
from ..sequencer import to_text
from ..tokens import epoch_of
from ._lease_slots import LeaseSlots
from .bounded import DRIFT_BOUND, check_margin, stop_at

log = logging.getLogger(__name__)

__all__ = ["SAFE", "IN_JEOPARDY", "LOST", "Lease", "LeaseState", "LeaseHealth", "WatchEvent", "HolderInfo",
           "RevokeRequest", "check_fraction", "check_lease"]

SAFE = "safe"
IN_JEOPARDY = "in_jeopardy"
LOST = "lost"


def check_fraction(value: Any) -> float:
    """A jeopardy fraction: a number in the open interval (0, 1).

    Raises:
        WrongArgumentType: not a number.
        InvalidArgument: outside (0, 1) (or NaN).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WrongArgumentType(f"jeopardy_fraction must be a number, not {type(value).__name__}")
    if not 0.0 < value < 1.0:
        raise InvalidArgument(f"jeopardy_fraction must be in (0, 1), got {value!r}")
    return float(value)


class _LostEvent(asyncio.Event):
    """A lease's ``lost`` event: an ``asyncio.Event`` that also tells the
    lease's :class:`LeaseHealth` (if one exists) when it is set, so health
    listeners hear of a loss however it was found."""

    #: a weak reference to the lease's health, once someone asked for it (a class default:
    #: no ``__init__`` of its own, as one is made per grant).  Weak because the health holds
    #: this event: a strong reference back would make every lease whose health was read a
    #: reference cycle, freed only by the cyclic garbage collector, whose passes pause the
    #: client's event loop (the lease's :class:`LeaseState` keeps the health alive)
    _health_ref: weakref.ref[LeaseHealth] | None = None

    @property
    def health(self) -> LeaseHealth | None:
        ref = self._health_ref
        return None if ref is None else ref()

    @health.setter
    def health(self, health: LeaseHealth) -> None:
        self._health_ref = weakref.ref(health)

    def set(self) -> None:
        if not self.is_set():
            super().set()
            health = self.health
            if health is not None:
                health._on_lost()


class LeaseHealth:
    """The health of a held lease: ``"safe"``, ``"in_jeopardy"`` or ``"lost"``.

    After Chubby's session events (jeopardy / safe / expired) and the DynamoDB
    lock client's "danger zone": a lease goes **in jeopardy** when no renewal
    has succeeded and less than ``jeopardy_fraction`` of its TTL is left before
    the client's conservative expiry estimate; it is **safe** again as soon as a
    renewal succeeds; it is **lost** when ``lease.lost`` is set (a renewal was
    refused, or the TTL passed without one).  Jeopardy is a warning (finish or
    checkpoint the current write, stop starting new ones); lost is final.

    States are computed by the :class:`~fastlock.client.renewer.Renewer` of
    :meth:`Client.lock <fastlock.client.Client.lock>`, :meth:`Client.lock_many
    <fastlock.client.Client.lock_many>` and election terms; a lease renewed by
    hand stays ``"safe"`` until it is lost.  Shared by every copy of a lease
    (it belongs to the lease's :class:`LeaseState`).

    Attributes:
        state (str): the current state.
        safe (asyncio.Event): set while the state is ``"safe"``.
        jeopardy (asyncio.Event): set while the state is ``"in_jeopardy"``.
        lost (asyncio.Event): the lease's ``lost`` event (set once, for good).
        jeopardy_fraction (float): in (0, 1); default 0.5.

    Listeners (:meth:`add_listener`) are called with the new state, on the
    event loop's thread, at every transition.
    """

    __slots__ = ("lost", "safe", "jeopardy", "jeopardy_fraction", "_state", "_listeners", "_timer", "__weakref__")

    def __init__(self, lost: asyncio.Event, jeopardy_fraction: float = 0.5):
        self.lost = lost
        self.safe = asyncio.Event()
        self.jeopardy = asyncio.Event()
        self.jeopardy_fraction = check_fraction(jeopardy_fraction)
        self._listeners: list[Callable[[str], Any]] = []
        self._timer: asyncio.TimerHandle | None = None
        if lost.is_set():
            self._state = LOST
        else:
            self._state = SAFE
            self.safe.set()
        if isinstance(lost, _LostEvent) and lost.health is None:
            lost.health = self

    @property
    def state(self) -> str:
        """The current state.  Only reads: safe to call from any thread (a
        plain ``asyncio.Event`` set by hand reads as ``"lost"`` at once; its
        listeners hear of it at the next transition the loop drives)."""
        if self.lost.is_set():
            return LOST
        return self._state

    def add_listener(self, callback: Callable[[str], Any]) -> Callable[[], None]:
        """Call ``callback(state)`` at each transition; returns a function that
        removes it.  Exceptions from callbacks are logged, not raised."""
        self._listeners.append(callback)

        def remove() -> None:
            try:
                self._listeners.remove(callback)
            except ValueError:
                pass

        return remove

    def when_lost(self, callback: Callable[[], Any]) -> None:
        """Call ``callback()`` once, when the lease is lost (at once if it is
        already).  Used to mirror the loss into another event (a multi-lease's
        ``lost``, a ``threading.Event`` of the blocking client)."""
        if self.lost.is_set():
            callback()
            return

        def on_change(state: str) -> None:
            if state == LOST:
                callback()

        self.add_listener(on_change)

    def renewed(self, deadline: float, window: float) -> None:
        """A renewal succeeded (or the lease was just granted): the state is
        ``"safe"`` and turns ``"in_jeopardy"`` at ``deadline - jeopardy_fraction
        * window`` unless renewed again.  ``deadline``: the ``loop.time()`` by
        which the next renewal must succeed; ``window``: the full span in
        seconds (the TTL, or an election's renew deadline).  Called by the
        :class:`~fastlock.client.renewer.Renewer`, on the loop's thread."""
        if self._state == LOST:
            return
        self._transition(SAFE)
        self.stop_timer()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(deadline - self.jeopardy_fraction * window, self._transition, IN_JEOPARDY)

    def stop_timer(self) -> None:
        """Stop watching for jeopardy (renewal ended); the state stays as it is."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _transition(self, state: str) -> None:
        if state == self._state or self._state == LOST:
            return
        self._state = state
        if state == SAFE:
            self.jeopardy.clear()
            self.safe.set()
        else:
            self.safe.clear()
            if state == IN_JEOPARDY:
                self.jeopardy.set()
        for callback in list(self._listeners):
            try:
                callback(state)
            except Exception:  # a listener must not break renewal
                log.exception("lease health listener %r failed", callback)

    def _on_lost(self) -> None:
        self.stop_timer()
        self._transition(LOST)

    def __repr__(self) -> str:
        return f"<LeaseHealth {self.state}>"


#: held while a lease's ``lost`` event is made (first use only)
_MAKING_LOST = threading.Lock()


class LeaseState(LeaseSlots):
    """The mutable part of a lease, shared by every :class:`Lease` copy of it.

    Attributes:
        lost (asyncio.Event): set when the client learns, or must assume, that
            the lease is no longer held.  Set once, for good.  Made on first
            use (most leases are released without anyone asking).
        expires_at (float): the client's conservative estimate, in
            ``loop.time()`` seconds, of when the server will expire the lease;
            moved forward by every successful renewal.
        health (LeaseHealth): made on first use.
        sequencer (bytes | None): the lease's signed sequencer, when the client
            asked for one (``connect(sequencers=True)``): the grant's, replaced by the
            re-signed one each renewal brings (its renewed expiry).

    Written only on the event loop's thread (by the client and its renewer).  Its fields are
    the compiled slots of :class:`~fastlock.client._lease_slots.LeaseSlots` (which the client's
    compiled path sets by C stores).
    """

    __slots__ = ()

    def __init__(self, expires_at: float = 0.0, lost: asyncio.Event | None = None):
        self._lost = lost
        self.expires_at = expires_at
        self._health: LeaseHealth | None = None
        self.sequencer: bytes | None = None
        #: the first :class:`RevokeRequest` the server delivered for this lease, or None
        self.revoke_request: RevokeRequest | None = None
        self._revoke_requested: asyncio.Event | None = None

    @property
    def revoke_requested(self) -> asyncio.Event:
        """Set when a waiter of higher priority asked the holder to yield (see
        ``revoke_request``).  Made on first use."""
        event = self._revoke_requested
        if event is None:
            with _MAKING_LOST:
                event = self._revoke_requested
                if event is None:
                    event = self._revoke_requested = asyncio.Event()
        return event

    def on_revoke_request(self, request: RevokeRequest) -> None:
        """Record ``request`` (the first one counts: a later one never moves the
        server's deadline later) and set :attr:`revoke_requested`."""
        if self.revoke_request is None:
            self.revoke_request = request
        self.revoke_requested.set()

    @property
    def lost(self) -> asyncio.Event:
        lost = self._lost
        if lost is None:
            with _MAKING_LOST:  # one event, even if another thread asks at the same moment
                lost = self._lost
                if lost is None:
                    lost = self._lost = _LostEvent()
        return lost

    @property
    def health(self) -> LeaseHealth:
        health = self._health
        if health is None:
            lost = self.lost
            health = lost.health if isinstance(lost, _LostEvent) and lost.health is not None else LeaseHealth(lost)
            self._health = health
        return health

    def __repr__(self) -> str:
        return f"<LeaseState expires_at={self.expires_at:.3f}{' lost' if self.lost.is_set() else ''}>"


@dataclass(frozen=True)
class RevokeRequest:
    """A waiter of higher priority asks this lease's holder to yield (Curator's Revoker,
    Chubby's "conflicting lock request" event; see :mod:`fastlock.server.preemption`).

    Attributes:
        principal (str | None): the requester's principal.
        client (str | None): the requester's client name.
        grace (float): seconds the server gave from its sending of the request.
        deadline (float): ``loop.time()`` by which to release: after it (server's
            clock) the server revokes the lease and the next grant's token is
            higher, so a fenced write made after it is refused.
    """

    principal: str | None
    client: str | None
    grace: float
    deadline: float


@dataclass(frozen=True, eq=False, init=False)
class Lease:
    """A granted lock.  Immutable: :meth:`Client.extend
    <fastlock.client.Client.extend>` returns a new one (same token, owner and
    :class:`LeaseState`) when the TTL changes.

    Attributes:
        name (str): the lock's name.
        fencing_token (int): strictly increasing per grant across restarts and
            failovers; pass it to every write the lock protects.
        ttl (float): the lease's time to live in seconds, counted on the
            server's monotonic clock from the grant (or the extend that made
            this copy).
        owner (bytes): the secret key that proves ownership to the server.
        state (LeaseState): the part that changes while the lease is held,
            shared by every copy: ``lost``, ``expires_at``, ``health``.
        lost (asyncio.Event): ``state.lost``.
        expires_at (float): ``state.expires_at`` (``loop.time()`` seconds).
    """

    name: str
    fencing_token: int
    ttl: float
    owner: bytes = field(repr=False)
    state: LeaseState = field(default_factory=LeaseState, repr=False, compare=False)

    def __init__(self, name: str, fencing_token: int, ttl: float, owner: bytes, state: LeaseState | None = None):
        # one is made per grant: the fields go straight into the instance's dict (a frozen
        # dataclass's own __init__ calls object.__setattr__ once per field); ``state``
        # None makes a fresh LeaseState
        d = self.__dict__
        d["name"] = name
        d["fencing_token"] = fencing_token
        d["ttl"] = ttl
        d["owner"] = owner
        d["state"] = LeaseState() if state is None else state

    @property
    def lost(self) -> asyncio.Event:
        """Set when the lease is lost (see :class:`LeaseState`)."""
        return self.state.lost

    @property
    def sequencer(self) -> str | None:
        """The lease's signed sequencer as base64url text (:func:`fastlock.sequencer.to_text`;
        pass it to a fence or an ``If-Fencing-Sequencer`` header), or None when the client
        did not ask for one (``connect(sequencers=True)``).  Each renewal (session keep-alive
        or EXTEND) replaces it by one re-signed with the renewed expiry, the same token:
        read it again before each fenced write."""
        blob = self.state.sequencer
        return None if blob is None else to_text(blob)

    @property
    def revoke_requested(self) -> asyncio.Event:
        """Set when a waiter of higher priority asks the holder to yield; the
        request (who, deadline) is :attr:`revoke_request`."""
        return self.state.revoke_requested

    @property
    def revoke_request(self) -> RevokeRequest | None:
        """The :class:`RevokeRequest` delivered for this lease, or None."""
        return self.state.revoke_request

    @property
    def expires_at(self) -> float:
        """The client's conservative estimate of the server's expiry (``loop.time()`` seconds)."""
        return self.state.expires_at

    @property
    def epoch(self) -> int:
        """The fencing epoch (the token's high bits; raised by each promotion)."""
        return epoch_of(self.fencing_token)

    @property
    def health(self) -> LeaseHealth:
        """The lease's :class:`LeaseHealth` (shared by every copy)."""
        return self.state.health

    @property
    def in_jeopardy(self) -> bool:
        """True while renewals are failing and little of the TTL is left (see :class:`LeaseHealth`)."""
        return self.health.state == IN_JEOPARDY

    def time_left(self) -> float:
        """Seconds until the client's conservative estimate of the server's
        expiry (``expires_at - loop.time()``; negative once passed).  Unlike
        ``lost``, this needs no task to have run: a process that was frozen
        sees at once, on its own clock, that its lease may be gone."""
        return self.state.expires_at - asyncio.get_running_loop().time()

    def deadline(self, margin: float = 0.0, drift: float = DRIFT_BOUND) -> float:
        """The moment (``loop.time()`` seconds; ``time.monotonic()`` for the stdlib and
        uvloop loops) by which work protected by this lease must have stopped: the
        earliest moment the server could grant the lock to another holder, from the send
        time of the last grant or renewal it confirmed, less ``margin`` seconds (see
        :func:`fastlock.client.bounded.earliest_regrant`; ``drift``: the clock-rate bound,
        a fraction).  Moved forward by every renewal; -inf once the lease is known lost.

        Raises:
            InvalidArgument / WrongArgumentType: a bad margin or drift.
        """
        if self.state.lost.is_set():
            return -math.inf
        return stop_at(self, check_margin(margin, drift))

    def remaining(self, margin: float = 0.0, drift: float = DRIFT_BOUND) -> float:
        """Seconds left until :meth:`deadline` (negative once passed; -inf once known lost).
        Reads the clock itself: a process resumed after a freeze sees at once that it is
        past, before any timer or task has run."""
        return self.deadline(margin, drift) - asyncio.get_running_loop().time()

    def with_ttl(self, ttl: float) -> Lease:
        """A copy with TTL ``ttl`` seconds, sharing this lease's state."""
        return Lease(self.name, self.fencing_token, ttl, self.owner, self.state)


def check_lease(lease: Any) -> None:
    """Raise :class:`WrongArgumentType` unless ``lease`` is a :class:`Lease`."""
    if not isinstance(lease, Lease):
        raise WrongArgumentType(f"expected a fastlock Lease, not {type(lease).__name__}")


@dataclass(frozen=True)
class WatchEvent:
    """A change of a lock's holder, pushed by the server (see :meth:`Client.watch
    <fastlock.client.Client.watch>`).

    ``kind`` is ``"granted"``, ``"released"``, ``"expired"``, or, for the
    first event of a watch, ``"held"``/``"free"`` (the state when it began).
    ``token`` is the fencing token concerned (None for ``"free"``);
    ``client`` the holder's client name, if it gave one (self-declared: not
    verified); ``correlation_id`` the acquire's correlation id, if the server
    reports it (None otherwise); ``principal`` the authenticated principal
    that acquired the lease (None if the server does not report it).
    ``revision`` (int) is the change's revision (see docs/watches.md): the
    same on the primary and its standbys, growing with every change; the watch
    resumes after it if its connection drops.  A watch started with
    ``progress=True`` also yields ``"progress"`` events: no change of the lock
    up to ``revision``.  None from a server without revisions.
    """

    name: str
    kind: str
    token: int | None
    client: str | None
    correlation_id: str | None = None
    principal: str | None = None
    revision: int | None = None


class _HolderInfoExtras(TypedDict, total=False):
    """The keys of :class:`HolderInfo` that a server may leave out."""

    this_session: bool


class HolderInfo(_HolderInfoExtras):
    """A lock's current holder, as :meth:`Client.holder <fastlock.client.Client.holder>` reports it.

    ``token``: the holder's fencing token; ``principal``: the authenticated
    principal that acquired it (None in open mode); ``client``: the client
    name it gave (self-declared: not verified), or None; ``correlation_id``:
    the acquire's correlation id, or None; ``ttl_ms``: the lease's TTL in
    milliseconds; ``remaining_ms``: milliseconds until the server expires it
    unless renewed (on the server's monotonic clock); ``this_session``: this
    connection holds it (on a sync primary also its own grant that still waits for
    the standby's acknowledgement; absent from servers before it).
    """

    token: int
    principal: str | None
    client: str | None
    correlation_id: str | None
    ttl_ms: int
    remaining_ms: int
