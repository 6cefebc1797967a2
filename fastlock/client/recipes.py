"""Coordination recipes, mixed into :class:`~fastlock.client.Client`: re-entrant locks
(:mod:`fastlock.client.reentrant`) and once-per-window runs (:mod:`fastlock.client.window`),
each handing out the fencing token of a server lease, and rate limits
(:mod:`fastlock.client.ratelimit`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..protocol.ops import OP_RATE_LIMIT
from .barriers import CountDownLatch, DoubleBarrier
from .ratelimit import RateDecision, RateLimiter, rate_args
from .reentrant import ReentrantLock
from .window import OncePerWindow

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

__all__ = ["RecipeMethods"]


class RecipeMethods:
    """The recipes' entry points, mixed into :class:`~fastlock.client.Client`."""

    async def _request(self, op: int, *args: Any) -> Any:  # pragma: no cover - Client's
        raise NotImplementedError

    def reentrant_lock(self, name: str, *, ttl: float, wait: float | None = None, acquire_limit: int | None = None,
                       lock_delay: float = 0.0, correlation_id: str | None = None,
                       renew: bool = True) -> ReentrantLock:
        """A re-entrant lock on ``name`` (opt-in; see :mod:`fastlock.client.reentrant`).

        ``async with lock as lease:`` acquires, or re-enters when the calling task (or a
        task it created) holds it, returning the same lease and fencing token and
        counting; the lease is released on the server when the count is back at zero.

        Args:
            ttl: the lease's TTL in seconds, renewed in the background while held (``renew``).
            wait: seconds the first acquire waits (None: forever, 0: try once).
            acquire_limit: the largest hold count (1 .. 2**31 - 1; None: no limit but that);
                a re-entry at the limit raises :class:`~fastlock.errors.AcquireLimitReached`
                at once.
            lock_delay, correlation_id: as :meth:`Client.acquire <fastlock.client.Client.acquire>`.

        Raises (at once, nothing sent): InvalidArgument / WrongArgumentType for a bad argument.
        """
        client: Client = self  # type: ignore[assignment]
        return ReentrantLock(client, name, ttl=ttl, wait=wait, acquire_limit=acquire_limit,
                             lock_delay=lock_delay, correlation_id=correlation_id, renew=renew)

    def once_per(self, name: str, window: float, *, ttl: float = 30.0,
                 correlation_id: str | None = None) -> OncePerWindow:
        """At most one run per ``window`` seconds of the job ``name``, across every client
        (ShedLock's ``lockAtLeastFor``; see :mod:`fastlock.client.window`).

        ``async with client.once_per("reports/daily", 900.0) as lease:`` enters only if no
        run of ``name`` started in the last ``window`` seconds (by the server's clock),
        else raises :class:`~fastlock.errors.LockNotAcquired` at once.  The lease stays
        held after the body ends until ``window`` seconds after its grant; while the body
        runs past that, it is renewed with ``ttl`` (seconds) and released on exit.

        Raises (at once, nothing sent): InvalidArgument / WrongArgumentType for a bad argument.
        """
        client: Client = self  # type: ignore[assignment]
        return OncePerWindow(client, name, window, ttl=ttl, correlation_id=correlation_id)

    async def limit(self, name: str, rate: int, burst: int, *, per: float = 1.0, cost: int = 1) -> RateDecision:
        """Take ``cost`` from the rate limiter ``name`` (``rate`` takes per ``per`` seconds,
        ``burst`` at once; shared by every client; the server's clock only), now or not at
        all: one request, never waits.  See :mod:`fastlock.server.ratelimit`.

        Returns:
            a :class:`~fastlock.client.ratelimit.RateDecision`: ``admitted``, ``retry_after``
            (seconds), ``remaining``.

        Raises:
            LimitConflict: the limiter is live with another rate, period or burst.
            LimitExceeded: too many live limiters (the server's or this principal's).
            InvalidArgument / WrongArgumentType: a bad argument (nothing sent).
        """
        P.check_name(name)
        admitted, retry_ms, remaining = await self._request(OP_RATE_LIMIT, name, *rate_args(rate, per, burst, cost))
        return RateDecision(bool(admitted), retry_ms / 1000.0, remaining)

    def rate_limiter(self, name: str, rate: int, burst: int, *, per: float = 1.0) -> RateLimiter:
        """The rate limiter ``name`` as an object: ``try_take()`` (as :meth:`limit`) and
        ``take()``, which waits until admitted."""
        client: Client = self  # type: ignore[assignment]
        return RateLimiter(client, name, rate, burst, per)

    def double_barrier(self, name: str, count: int, *, participant: str | None = None,
                       ttl: float = 10.0) -> DoubleBarrier:
        """This client as one participant of the double barrier ``name`` of ``count``
        participants (:mod:`fastlock.client.barriers`): ``await b.enter()`` waits until
        all have entered, ``await b.leave()`` until all have left; a participant whose
        lease (``ttl`` seconds, renewed) ends breaks the round for the others
        (:class:`~fastlock.errors.BrokenBarrier`).  ``participant``: its id (default random)."""
        client: Client = self  # type: ignore[assignment]
        return DoubleBarrier(client, name, count, participant=participant, ttl=ttl)

    def latch(self, name: str) -> CountDownLatch:
        """The countdown latch ``name`` (:mod:`fastlock.client.barriers`): ``create(count)``,
        ``count_down(party)``, ``wait()``; kept on the server across failovers and restarts."""
        client: Client = self  # type: ignore[assignment]
        return CountDownLatch(client, name)
