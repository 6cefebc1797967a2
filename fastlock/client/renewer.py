"""The one renewal loop: :class:`Renewer`, used by :meth:`Client.lock
<fastlock.client.Client.lock>`, :meth:`Client.lock_many
<fastlock.client.Client.lock_many>` and election terms.

A renewer keeps one lease alive until it is stopped or the lease is lost.
Every renewal is an EXTEND sent through the client's ride-through path (a
lost connection, a deposed or fenced node: find the primary and send again),
and must succeed before a **deadline** on this process's monotonic clock:

- for a lock, the deadline is the client's conservative estimate of the
  server's expiry (``lease.expires_at``: the TTL counted from the *sending* of
  the last successful renewal), and renewals go out at about a third of the
  TTL (minus 10-20 % random jitter, so that many holders do not renew in
  step);
- for an election term, the deadline is Kubernetes' renew deadline (counted
  from the sending of the last successful renewal; shorter than the lease),
  and renewals go out every retry period (minus up to 10 % jitter).

When the deadline passes without a successful renewal - noticed by a timer,
so even a renewal stuck on a silent server cannot delay it - or the server
refuses one (``LeaseLost``), the lease is **lost**: ``on_lost(why)`` runs
once (by default: log and set ``lost``), and renewal stops.  The lease's
:class:`~fastlock.client.lease.LeaseHealth` is driven from here: safe after
each success, in jeopardy when less than ``jeopardy_fraction`` of the window is
left without one.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from ..errors import ConnectionLost, FastlockError, InvalidArgument, LeaseLost, WrongShard
from ..logsafe import quote
from .bounded import BoundedWork, WorkBound
from .lease import Lease, LeaseState

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

log = logging.getLogger(__name__)

__all__ = ["Renewer", "Renewers", "LockContext"]


class Renewers:
    """The renewers a client runs, one per lease (keyed by the lease's shared
    :class:`~fastlock.client.lease.LeaseState`): a release stops the
    lease's renewer, closing the client stops them all."""

    __slots__ = ("by_state",)

    def __init__(self) -> None:
        #: ``id`` of a lease's state -> its renewer (read by a release: one test when it is empty)
        self.by_state: dict[int, Renewer] = {}

    def add(self, renewer: Renewer) -> None:
        old = self.by_state.get(id(renewer.lease.state))
        if old is not None and old is not renewer:
            old.stop()
        self.by_state[id(renewer.lease.state)] = renewer

    def discard(self, renewer: Renewer) -> None:
        key = id(renewer.lease.state)
        if self.by_state.get(key) is renewer:
            del self.by_state[key]

    def stop(self, lease: Lease) -> None:
        """Stop renewing ``lease`` (any copy of it), if it is being renewed."""
        renewer = self.by_state.pop(id(lease.state), None)
        if renewer is not None:
            renewer.stop()

    def stop_all(self) -> None:
        renewers = list(self.by_state.values())
        self.by_state.clear()
        for renewer in renewers:
            renewer.stop()

    def __len__(self) -> int:
        return len(self.by_state)


class Renewer:
    """Renew ``lease`` until stopped or lost (see the module docstring).

    Args:
        client: the :class:`~fastlock.client.Client` that holds the lease.
        lease: the lease to renew.
        state: the state whose ``expires_at`` is the renewal deadline, whose
            ``lost`` is set and whose health is driven (default: the lease's
            own; an election term passes its own, whose deadline is the renew
            deadline).
        period: seconds between renewals (minus up to 10 % jitter); default
            (None) a third of the TTL minus 10-20 % jitter, sooner when the
            jeopardy threshold or a short remaining time needs it.
        window: seconds from the sending of a successful renewal to the next
            deadline (default: the renewed lease's TTL).
        ttl: seconds each renewal asks for (default: the lease's TTL).
        on_lost: ``on_lost(why)``, called once when the lease is lost
            (default: log a warning and set ``state.lost``).
        session: renew through the client's session (one keep-alive for all its
            leases, :mod:`fastlock.client.session`) when the client has one and
            ``ttl`` is the lease's own; False: this lease sends its own EXTENDs.

    :meth:`start` it on the event loop; the client's :class:`Renewers` stops
    it on release and on close.
    """

    __slots__ = ("client", "lease", "state", "_period", "_window", "_ttl", "_on_lost", "_task", "_timer", "_loop",
                 "_done", "_session", "_keeper")

    def __init__(self, client: Client, lease: Lease, *, state: LeaseState | None = None,
                 period: float | None = None, window: float | None = None, ttl: float | None = None,
                 on_lost: Callable[[str], None] | None = None, session: bool = True):
        self.client = client
        self.lease = lease
        self.state = lease.state if state is None else state
        self._period = period
        self._window = window
        self._ttl = ttl
        self._on_lost = self._lost_by_default if on_lost is None else on_lost
        self._task: asyncio.Future[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = False
        self._session = session and (ttl is None or ttl == lease.ttl)
        self._keeper: Any = None  # the client's SessionKeeper while it renews this lease

    @property
    def window(self) -> float:
        return self.lease.ttl if self._window is None else self._window

    def start(self) -> Renewer:
        """Start renewing (on the running loop); returns self."""
        self._loop = asyncio.get_running_loop()
        self.state.health.renewed(self.state.expires_at, self.window)
        self._arm_deadline()
        keeper = getattr(self.client, "session_keeper", None) if self._session else None
        if keeper is not None and keeper.add(self):
            self._keeper = keeper
        else:
            self._task = asyncio.ensure_future(self._run())
        self.client.renewers.add(self)
        return self

    def run_alone(self) -> None:
        """Leave the session: send this lease's own EXTENDs from now on."""
        self._keeper = None
        if not self._done and self._task is None:
            self._task = asyncio.ensure_future(self._run())

    def session_interval(self) -> float:
        """Seconds until this lease wants its next renewal (with jitter): the session's round comes then."""
        return self._interval()

    def renewed_by_session(self, sent: float) -> None:
        """The session's keep-alive sent at ``sent`` (``loop.time()``) renewed the lease."""
        if self._done or self.state.lost.is_set():
            return
        state = self.state
        state.expires_at = sent + self.window
        self._arm_deadline()
        state.health.renewed(state.expires_at, self.window)

    def lose_by_session(self, why: str) -> None:
        """The server said the lease is no longer held: it is lost, unless its slot moved to
        another shard group (the routing client's ``lease_moved`` takes the renewer over)."""
        self._keeper = None
        moved = self.client.lease_moved
        if moved is not None and moved(self, why):
            return
        self._lose(why)

    def lose(self, why: str) -> None:
        """The lease is lost (``on_lost(why)`` runs once) and renewal stops."""
        self._lose(why)

    def move_to(self, client: Client) -> None:
        """Renew from ``client`` from now on: the lease's slot moved to ``client``'s shard group,
        which adopted the lease (its owner key proves it there).  The deadline is unchanged."""
        if self._done or self.state.lost.is_set():
            return
        self.client.renewers.discard(self)
        self.client = client
        client.renewers.add(self)
        keeper = getattr(client, "session_keeper", None) if self._session else None
        self._task = None
        if keeper is not None and keeper.add(self):
            self._keeper = keeper
        else:
            self._keeper = None
            self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        """Stop renewing (the lease is not released, nor marked lost).  Idempotent."""
        if self._done:
            return
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task = self._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.discard(self)
        self.state.health.stop_timer()
        self.client.renewers.discard(self)

    def check_deadline(self) -> bool:
        """True while the deadline has not passed; once it has, the lease is
        lost (``on_lost`` runs, if it has not yet) and this returns False.
        Reads the clock itself, so a process that was frozen past its deadline
        sees it at once on resuming, before any timer or task has run."""
        if self.state.lost.is_set():
            return False
        if self._loop is not None and self._loop.time() >= self.state.expires_at:
            self._lose("the renewal deadline passed without a successful renewal")
            return False
        return True

    def _arm_deadline(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer = self._loop.call_at(self.state.expires_at, self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer = None
        if self._done or self.state.lost.is_set():
            return
        if self.check_deadline():  # timers may fire a little early (uvloop rounds to ms): look again
            self._arm_deadline()

    def _lose(self, why: str) -> None:
        if self.state.lost.is_set() and self._done:
            return
        self.stop()
        self._on_lost(why)

    def _lost_by_default(self, why: str) -> None:
        lease = self.lease
        if not self.state.lost.is_set():
            log.warning("lease %s token %d lost: %s", quote(lease.name), lease.fencing_token, why)
        self.state.lost.set()

    def _interval(self) -> float:
        if self._period is not None:
            return self._period * (1.0 - random.uniform(0.0, 0.1))
        ttl = self.lease.ttl
        interval = ttl / 3.0 * (1.0 - random.uniform(0.10, 0.20))
        # renew well before the jeopardy threshold, however high it is set
        interval = min(interval, ttl * (1.0 - self.state.health.jeopardy_fraction) * 0.6)
        # a lease that has little left (a late grant) is renewed sooner
        assert self._loop is not None
        remaining = self.state.expires_at - self._loop.time()
        return max(0.0, min(interval, remaining / 2.0))

    async def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        state = self.state
        try:
            while not self._done:
                await asyncio.sleep(self._interval())
                if not self.check_deadline():
                    return
                window = self.window
                sent = loop.time()
                try:
                    renewed = await self.client.renew_before(self.lease, state.expires_at, ttl=self._ttl,
                                                             attempt_timeout=window / 3.0)
                except LeaseLost as exc:
                    self._lose(f"no renewal: {exc}")
                    return
                except WrongShard as exc:
                    moved = self.client.lease_moved
                    if moved is not None and moved(self, str(exc)):
                        self._task = None  # the routing client moves this renewer (move_to) or loses it
                        return
                    self._lose(f"no renewal: {exc}")
                    return
                if self._done or state.lost.is_set():
                    return
                self.lease = renewed
                state.expires_at = sent + self.window
                self._arm_deadline()
                state.health.renewed(state.expires_at, self.window)
        except asyncio.CancelledError:
            raise
        except ConnectionLost as exc:  # the client was closed
            log.info("renewal of %s stopped: %s", quote(self.lease.name), exc)
            self._lose(f"renewal stopped: {exc}")
        except Exception:
            log.exception("renewal of %s token %d failed unexpectedly; the lease is treated as lost",
                          quote(self.lease.name), self.lease.fencing_token)
            self._lose("renewal failed unexpectedly")
        finally:
            if self._task is not None:  # not handed to a routing client (a moved slot)
                self.stop()


class LockContext:
    """Returned by :meth:`Client.lock`: awaitable and an async context manager
    (as asyncpg's ``pool.acquire()``)."""

    __slots__ = ("_client", "_name", "_kwargs", "_renew", "_lease", "_jeopardy_fraction", "_bound", "_work",
                 "_session")

    def __init__(self, client: Client, name: str, kwargs: dict[str, Any], renew: bool, jeopardy_fraction: float = 0.5,
                 bound: WorkBound | None = None, session: bool = True):
        self._client = client
        self._name = name
        self._kwargs = kwargs
        self._renew = renew
        self._lease: Lease | None = None
        self._jeopardy_fraction = jeopardy_fraction
        #: stop the body at the lease's earliest re-grant less a margin (``bounded=True``)
        self._bound = bound
        self._work: BoundedWork | None = None
        self._session = session  # renewed by the client's session keep-alive (False: by its own EXTENDs)

    async def _acquire(self) -> Lease:
        lease = await self._client.acquire(self._name, **self._kwargs)
        if self._renew:
            self._client.start_renewing(lease, self._jeopardy_fraction, session=self._session)
        return lease

    def __await__(self) -> Generator[Any, None, Lease]:
        if self._bound is not None:
            raise InvalidArgument("bounded=True stops the body of `async with client.lock(...)`: it cannot be awaited "
                                  "(check lease.remaining(margin) in the work instead)")
        return self._acquire().__await__()

    async def __aenter__(self) -> Lease:
        self._lease = await self._acquire()
        if self._bound is not None:
            task = asyncio.current_task()
            assert task is not None  # async with runs in a task
            self._work = BoundedWork(self._lease, task, self._bound).start()
        return self._lease

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> None:
        work, self._work = self._work, None
        expiring = None if work is None else await work.settle(exc_type)
        try:
            await self._release()
        finally:
            if expiring is not None:
                raise expiring from exc

    async def _release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            await self._client.release(lease)
        except FastlockError as err:
            # never into the caller's code: the lease is given up either way
            # (it expires by its TTL if no primary could be reached)
            if not lease.lost.is_set():
                log.warning("could not release %s token %d: %s", quote(lease.name), lease.fencing_token, err)
            lease.lost.set()
