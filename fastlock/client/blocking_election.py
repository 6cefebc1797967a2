"""Elections for threads: :class:`SyncElection` and :class:`SyncTerm`, made by
:meth:`SyncClient.election <fastlock.client.blocking.SyncClient.election>` (the
blocking face of :class:`~fastlock.client.election.Election`)."""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

from ..errors import WrongArgumentType
from .election import Election, Leader, Proclamation, Term
from .forks import check_held_here

if TYPE_CHECKING:
    from .blocking import SyncClient

__all__ = ["SyncElection", "SyncTerm"]


class SyncElection:
    """:class:`~fastlock.election.Election` for threads (from :meth:`SyncClient.election`)."""

    __slots__ = ("_blocking", "election")

    def __init__(self, blocking: SyncClient, election: Election):
        self._blocking = blocking
        self.election = election

    def _current(self) -> Election:
        """The election, on this process's client (made anew after a fork)."""
        client = self._blocking.client
        e = self.election
        if e.client is not client:
            self.election = e = Election(client, e.name, e.candidate_id, lease_duration=e.lease_duration,
                                         renew_deadline=e.renew_deadline, retry_period=e.retry_period,
                                         jeopardy_fraction=e.jeopardy_fraction)
        return e

    def campaign(self, *, wait: float | None = None) -> SyncTerm:
        """Block until elected (or ``wait`` seconds; ``LockNotAcquired``)."""
        election = self._current()

        async def run() -> SyncTerm:
            return SyncTerm(await election.campaign(wait=wait))
        return self._blocking.call(run())

    def leadership(self, *, wait: float | None = None) -> _SyncLeadership:
        """``with election.leadership() as term:`` - campaign, lead, resign on exit."""
        return _SyncLeadership(self, wait)

    def resign(self, term: SyncTerm) -> None:
        if not isinstance(term, SyncTerm):
            raise WrongArgumentType(f"expected a SyncTerm, not {type(term).__name__}")
        check_held_here(term, "term")
        self._blocking.call(term.term.resign())

    def leader(self) -> Leader | None:
        """The current leader (candidate id, token), or None."""
        return self._blocking.call(self._current().leader())

    def candidates(self) -> list[str | None]:
        """The waiting candidates' ids in queue order (:meth:`Election.candidates`)."""
        return self._blocking.call(self._current().candidates())

    def proclaimed(self) -> Proclamation | None:
        """The current term's proclaimed value and token, or None (:meth:`Election.proclaimed`)."""
        return self._blocking.call(self._current().proclaimed())

    def proclaim(self, term: SyncTerm, value: bytes) -> None:
        """Publish ``value`` as ``term``'s (:meth:`Term.proclaim`; LeaseLost once it is over)."""
        if not isinstance(term, SyncTerm):
            raise WrongArgumentType(f"expected a SyncTerm, not {type(term).__name__}")
        check_held_here(term, "term")
        self._blocking.call(term.term.proclaim(value))

    def transfer(self, term: SyncTerm, to: str) -> None:
        """Hand leadership to the waiting candidate ``to`` (:meth:`Term.transfer`)."""
        if not isinstance(term, SyncTerm):
            raise WrongArgumentType(f"expected a SyncTerm, not {type(term).__name__}")
        check_held_here(term, "term")
        self._blocking.call(term.term.transfer(to))
        term.lost.set()


class _SyncLeadership:
    __slots__ = ("_election", "_wait", "_term")

    def __init__(self, election: SyncElection, wait: float | None):
        self._election = election
        self._wait = wait
        self._term: SyncTerm | None = None

    def __enter__(self) -> SyncTerm:
        self._term = self._election.campaign(wait=self._wait)
        return self._term

    def __exit__(self, *exc: object) -> None:
        term, self._term = self._term, None
        if term is not None:
            self._election.resign(term)


class SyncTerm:
    """A term as leader, for threads.  ``lost`` is a threading.Event;
    :meth:`is_leader` may be called from any thread."""

    __slots__ = ("term", "lost", "pid")

    def __init__(self, term: Term):
        self.term = term
        self.pid = os.getpid()
        self.lost = threading.Event()
        term.health.when_lost(self.lost.set)

    @property
    def fencing_token(self) -> int:
        return self.term.fencing_token

    @property
    def sequencer(self) -> str | None:
        """The term's signed sequencer (base64url text; :attr:`Term.sequencer`), or None
        when the client did not ask for sequencers.  Re-signed by each renewal: read it
        again before each fenced write."""
        return self.term.sequencer

    @property
    def health_state(self) -> str:
        return "lost" if self.lost.is_set() else self.term.health.state

    def is_leader(self) -> bool:
        """Not lost and the renew deadline not passed (checked on this thread's clock)."""
        return not self.lost.is_set() and time.monotonic() < self.term.deadline
