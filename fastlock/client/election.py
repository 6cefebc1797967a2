"""Leader election on fastlock leases, with Kubernetes' leaderelection semantics.

One lock per election; the leader is its holder.  Candidates wait for it in the
server's FIFO queue (no polling: the next candidate is granted the moment the
leader's lease is released or expires), and the leader renews its lease::

    async with fastlock.connect(address, client_name="node-a") as client:
        election = client.election("scheduler", "node-a")
        async with election.leadership() as term:      # blocks until elected
            while term.is_leader():
                await do_leader_work(fencing_token=term.fencing_token)

The three durations are those of Kubernetes' ``leaderelection`` package (and
its defaults):

``lease_duration`` (15 s)
    the lease's TTL on the server: how long the other candidates wait after the
    leader stops renewing (crash, freeze, partition) before one of them takes
    over.
``renew_deadline`` (10 s)
    how long the leader keeps trying to renew before it gives up and steps
    down, measured on its own clock from the *sending* of its last successful
    renewal.  Being shorter than ``lease_duration``, the leader always stops
    (``term.lost``) before the server can hand the lease to someone else -
    even if it was frozen and has not run a single line since.
``retry_period`` (2 s)
    the interval between renewals (and between campaign retries after a lost
    connection).

Unlike Kubernetes, fastlock gives every term a fencing token that strictly
increases across terms (and server restarts and failovers): pass
``term.fencing_token`` to every side effect so that a deposed leader's late
writes are refused (see :mod:`fastlock.fencing`).  A client that asks for signed
sequencers (``connect(sequencers=True)``) gets ``term.sequencer`` too, for fences that
check signatures (see docs/sequencers.md).

``python -m fastlock.election`` runs one candidate process (see
:mod:`fastlock.election`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import protocol as P
from ..errors import (
    Compacted,
    ConnectionLost,
    FastlockError,
    InvalidArgument,
    NotPrimary,
    Unavailable,
    WatchDiverged,
    WrongArgumentType,
)
from ..logsafe import quote
from ..units import check_seconds
from .lease import Lease, LeaseHealth, LeaseState, check_fraction
from .renewer import Renewer

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

log = logging.getLogger(__name__)

__all__ = ["Election", "Term", "Leader", "Proclamation"]


class Proclamation(NamedTuple):
    """What the leader proclaimed (etcd's ``Proclaim``): its value and the fencing token
    of the term that proclaimed it."""

    value: bytes
    fencing_token: int


class Leader(NamedTuple):
    """Who leads: the candidate id (None if the holder declared neither a
    correlation id nor a client name) and the fencing token of its term."""

    candidate_id: str | None
    fencing_token: int


class Election:
    """A leader election on lock ``name`` (make it with :meth:`Client.election`).

    Args:
        client: the :class:`~fastlock.client.Client` to campaign through.
        name: the election's lock name.
        candidate_id: this candidate's id (<= 256 characters), recorded with
            the grant.  Others learn it through :meth:`leader` and
            :meth:`observe` - see the note there.
        lease_duration: seconds; the lease TTL (Kubernetes' LeaseDuration).
        renew_deadline: seconds; the leader steps down when it has not renewed
            for this long (Kubernetes' RenewDeadline).  Must be less than
            ``lease_duration``.
        retry_period: seconds between renewals (Kubernetes' RetryPeriod).
            Must be less than ``renew_deadline``.
        jeopardy_fraction: a term's health turns ``"in_jeopardy"`` when less
            than this fraction of ``renew_deadline`` is left without a
            successful renewal (see :class:`~fastlock.client.LeaseHealth`).

    Raises:
        InvalidArgument / WrongArgumentType: bad durations or names.
    """

    def __init__(self, client: Client, name: str, candidate_id: str, *, lease_duration: float = 15.0,
                 renew_deadline: float = 10.0, retry_period: float = 2.0, jeopardy_fraction: float = 0.5):
        self.client = client
        self.name = P.check_name(name)
        if not isinstance(candidate_id, str) or not candidate_id:
            raise WrongArgumentType("candidate_id must be a non-empty string")
        P.check_optional_str(candidate_id, "candidate_id", P.MAX_CORRELATION_ID_CHARS)  # its length
        self.candidate_id = candidate_id
        self.lease_duration = check_seconds(lease_duration, "lease_duration")
        self.renew_deadline = check_seconds(renew_deadline, "renew_deadline")
        self.retry_period = check_seconds(retry_period, "retry_period")
        # As Kubernetes' NewLeaderElector: LeaseDuration > RenewDeadline > RetryPeriod.
        if not self.renew_deadline < self.lease_duration:
            raise InvalidArgument("renew_deadline must be less than lease_duration")
        if not self.retry_period < self.renew_deadline:
            raise InvalidArgument("retry_period must be less than renew_deadline")
        P.check_ttl_ms(P.seconds_to_ms(self.lease_duration, "lease_duration"))
        self.jeopardy_fraction = check_fraction(jeopardy_fraction)

    def __repr__(self) -> str:
        return f"<Election {self.name!r} candidate {self.candidate_id!r}>"

    # -- campaigning ----------------------------------------------------------------
    async def campaign(self, *, wait: float | None = None) -> Term:
        """Wait in line until elected; return the :class:`Term` (renewing).

        Args:
            wait: seconds to wait at most; ``None`` (default) waits forever,
                ``0`` tries once.

        A dropped connection does not end the campaign: it retries every
        ``retry_period`` (reconnecting) until elected or ``wait`` runs out.
        Closing the client does (``ConnectionLost``).

        Raises:
            LockNotAcquired: not elected within ``wait``.
        """
        loop = asyncio.get_running_loop()
        deadline = None if wait is None else loop.time() + wait
        while True:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            sent = loop.time()
            try:
                lease = await self.client.acquire(self.name, ttl=self.lease_duration, wait=left,
                                                  correlation_id=self.candidate_id)
            except (ConnectionLost, NotPrimary, Unavailable, OSError) as exc:
                if self.client.closed or (deadline is not None and loop.time() + self.retry_period >= deadline):
                    raise
                log.info("election %s: campaign interrupted (%s); retrying", quote(self.name), exc)
                await asyncio.sleep(self.retry_period)
                continue
            # The grant happened after we sent; when we queued, estimate it by
            # the lease's own conservative start (expires_at - ttl).
            granted_at = max(sent, lease.expires_at - lease.ttl)
            term = Term(self, lease, granted_at)
            log.info("election %s: %s elected (token %d)", quote(self.name), quote(self.candidate_id),
                     lease.fencing_token)
            return term

    def leadership(self, *, wait: float | None = None) -> _Leadership:
        """``async with election.leadership() as term:`` - campaign, lead in the
        body, resign on exit.  The body is not interrupted when leadership is
        lost: check ``term.is_leader()`` / ``term.lost`` before acting."""
        return _Leadership(self, wait)

    # -- observing --------------------------------------------------------------------
    async def candidates(self) -> list[str | None]:
        """The waiting candidates' ids in queue order (the next leader first; the
        leader itself is :meth:`leader`), from the server's CONTENDERS pages (at most
        100,000).  An id is the candidate's correlation id (None if it gave none)."""
        listing = await self.client.contenders(self.name)
        return [w.get("correlation_id") for w in listing["waiters"]]

    async def proclaimed(self) -> Proclamation | None:
        """The current leader's proclaimed value with its term's fencing token, or None
        (nothing proclaimed in the current term: the value is attached to the term's
        lease and goes with it).  See :meth:`Term.proclaim`."""
        kv = await self.client.get(self.name)
        if kv is None or kv.lease != self.name:
            return None
        return Proclamation(kv.value, kv.token)

    async def leader(self) -> Leader | None:
        """The current leader, or None when nobody leads.

        The candidate id is the holder's correlation id when the server
        reports it, else the holder's client name: until the server exposes
        correlation ids, connect each candidate's client with
        ``client_name=candidate_id``.
        """
        info = await self.client.holder(self.name)
        if info is None:
            return None
        return Leader(info.get("correlation_id") or info.get("client"), info["token"])

    async def observe(self, on_retry: Callable[[BaseException, int], Any] | None = None
                      ) -> AsyncIterator[Leader | None]:
        """Yield the leader (a :class:`Leader`, or None) each time it changes,
        starting with the current one.  Pushed by the server through
        :meth:`Client.watch` (no polling).  A dropped connection is retried
        every ``retry_period``; the new watch starts with the state then, so a
        change that happened meanwhile is still reported (intermediate terms
        may be skipped).  Break out of the loop to stop.

        ``on_retry(error, failures)``, if given, is called before each retry
        with the error and the number of failed attempts in a row (1 for the
        first since the watch last worked), e.g. to tell a user it is retrying."""
        last: Any = object()  # nothing yielded yet
        failures = 0
        while True:
            current: Leader | None = None
            try:
                async for event in self.client.watch(self.name):
                    failures = 0
                    if event.kind in ("held", "granted") and event.token is not None:
                        current = Leader(event.correlation_id or event.client, event.token)
                    elif event.kind == "free" or (current is not None and event.token == current.fencing_token):
                        current = None
                    else:
                        continue
                    if current != last:
                        last = current
                        yield current
            except (ConnectionLost, NotPrimary, Unavailable, OSError, Compacted, WatchDiverged) as exc:
                failures += 1
                log.info("election %s: watch interrupted (%s); retrying", quote(self.name), exc)
                if on_retry is not None:
                    on_retry(exc, failures)
                await asyncio.sleep(self.retry_period)


class _Leadership:
    __slots__ = ("_election", "_wait", "_term")

    def __init__(self, election: Election, wait: float | None):
        self._election = election
        self._wait = wait
        self._term: Term | None = None

    async def __aenter__(self) -> Term:
        self._term = await self._election.campaign(wait=self._wait)
        return self._term

    async def __aexit__(self, *exc: object) -> None:
        term, self._term = self._term, None
        if term is not None:
            await term.resign()


class Term:
    """One candidate's term as leader (from :meth:`Election.campaign`).

    Renews the lease every ``retry_period`` (with up to 10 % jitter); steps
    down - sets ``lost`` and releases the lease - when a renewal is refused or
    none has succeeded within ``renew_deadline`` (Kubernetes' leaderelection;
    the deadline runs on this process's monotonic clock from the sending of
    the last successful renewal, so it passes before the server's lease can).
    The renewals are those of :class:`~fastlock.client.renewer.Renewer`, the
    loop that renews :meth:`Client.lock <fastlock.client.Client.lock>` too,
    with the renew deadline as its window.

    Attributes:
        election (Election): the election.
        lease (Lease): the underlying lease.
        fencing_token (int): this term's token; strictly greater than every
            earlier term's.
        sequencer (str | None): this term's signed sequencer, when the client asked
            for sequencers (re-signed by each renewal).
        lost (asyncio.Event): set when this candidate is no longer leader
            (stepped down, resigned, or the lease was lost).
        health (LeaseHealth): ``"safe"`` / ``"in_jeopardy"`` (less than
            ``jeopardy_fraction`` of ``renew_deadline`` left without a renewal)
            / ``"lost"``.
        deadline (float): ``loop.time()`` until which this process may act as
            leader unless it renews.
    """

    def __init__(self, election: Election, lease: Lease, granted_at: float):
        self.election = election
        self.lease = lease
        self.fencing_token = lease.fencing_token
        # the term's own state: its deadline is the renew deadline, not the lease's expiry
        self._state = LeaseState(granted_at + election.renew_deadline)
        self.health = LeaseHealth(self._state.lost, election.jeopardy_fraction)
        self.resigned = False
        self._loop = asyncio.get_running_loop()
        self._renewer = Renewer(election.client, lease, state=self._state, period=election.retry_period,
                                window=election.renew_deadline, ttl=election.lease_duration,
                                on_lost=self._step_down).start()

    def __repr__(self) -> str:
        return (f"<Term {self.election.name!r} {self.election.candidate_id!r} token {self.fencing_token} "
                f"{self.health.state}>")

    @property
    def candidate_id(self) -> str:
        return self.election.candidate_id

    @property
    def lost(self) -> asyncio.Event:
        """Set when this candidate is no longer leader."""
        return self._state.lost

    @property
    def sequencer(self) -> str | None:
        """The term's signed sequencer (base64url text, :mod:`fastlock.sequencer`) when the
        client asked for sequencers (``connect(sequencers=True)``), else None: the lease's
        :attr:`~fastlock.client.lease.Lease.sequencer`, re-signed by every renewal with the
        renewed expiry (the same token all term long).  Read it again before each fenced
        write: an old one expires with the renewal it came from."""
        return self.lease.sequencer

    @property
    def deadline(self) -> float:
        """``loop.time()`` until which this process may act as leader unless it renews."""
        return self._state.expires_at

    def is_leader(self) -> bool:
        """True while this process may act as leader: not lost, and its own
        renew deadline not passed.  Checks the clock itself, so a process that
        was frozen past its deadline sees False at once on resuming, before any
        task (or the server) has told it."""
        return self._renewer.check_deadline()

    def time_left(self) -> float:
        """Seconds of leadership left unless a renewal succeeds (negative once passed)."""
        return self.deadline - self._loop.time()

    async def proclaim(self, value: bytes) -> None:
        """Publish ``value`` as this term's (etcd's ``Proclaim``): a key named like the
        election, attached to the term's lease, so it carries the term's fencing token
        and goes when the term ends; observers read it with :meth:`Election.proclaimed`
        (or watch the key).  Raises LeaseLost when the term is over (nothing written)."""
        await self.election.client.put(self.election.name, value, lease=self.lease)

    async def transfer(self, to: str) -> None:
        """Hand leadership to the waiting candidate ``to`` (its candidate id) in one
        server step (Kubernetes' coordinated leader election): it is elected at once,
        with a higher fencing token, and no other candidate can come between.  This
        term ends (``lost`` set, renewals stopped) once the server has done it.

        Raises:
            LeaseLost: this term was already over (nothing changed).
            InvalidArgument: ``to`` is not waiting (see :meth:`Election.candidates`),
                or several waiters carry the id ``to`` (a candidate id is chosen by
                its client: the hand-off is refused rather than guessed).
        """
        await self.election.client.transfer(self.lease, to)
        self.resigned = True
        self._renewer.stop()
        self.lost.set()

    async def resign(self) -> None:
        """Step down now: stop renewing and release the lease (next candidate
        elected at once).  Idempotent; never raises for a lease already lost
        or a dropped connection."""
        self.resigned = True
        self._renewer.stop()
        if not self.lost.is_set():
            self.lost.set()
            try:
                await self.election.client.release(self.lease)
            except FastlockError:
                pass

    def _step_down(self, why: str) -> None:
        """The renewer found the term lost (deadline passed, renewal refused)."""
        if self.lost.is_set():
            return
        log.warning("election %s: %s steps down (token %d): %s", quote(self.election.name), quote(self.candidate_id),
                    self.fencing_token, why)
        self.lost.set()  # first: nobody may act as leader from here on
        # Release so the next candidate need not wait for the TTL; the
        # server refuses it harmlessly if the lease already expired.
        self.election.client.release_nowait(self.lease)
