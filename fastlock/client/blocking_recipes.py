"""The recipes for threads: :class:`SyncReentrantLock` and :class:`SyncOncePerWindow`, made by
:meth:`SyncClient.reentrant_lock <fastlock.client.blocking.SyncClient.reentrant_lock>` and
:meth:`SyncClient.once_per <fastlock.client.blocking.SyncClient.once_per>` (the blocking faces of
:mod:`fastlock.client.reentrant` and :mod:`fastlock.client.window`).  With the blocking
client the caller of a re-entrant lock is the calling thread."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from .barriers import CountDownLatch, DoubleBarrier
from .lease import Lease
from .ratelimit import RateDecision, RateLimiter
from .reentrant import ReentrantLock
from .window import OncePerWindow

if TYPE_CHECKING:  # pragma: no cover
    from .blocking import SyncClient, SyncLease

__all__ = ["SyncReentrantLock", "SyncOncePerWindow", "SyncRateLimiter", "SyncDoubleBarrier", "SyncCountDownLatch",
           "SyncRecipeMethods"]


class SyncReentrantLock:
    """:class:`~fastlock.client.reentrant.ReentrantLock` for threads: ``with lock as lease:``."""

    __slots__ = ("_blocking", "lock")

    def __init__(self, blocking: SyncClient, lock: ReentrantLock):
        self._blocking = blocking
        self.lock = lock

    @property
    def hold_count(self) -> int:
        """How many times the calling thread holds the lock now."""
        return self.lock.count_of(threading.current_thread())

    def acquire(self) -> SyncLease:
        """As :meth:`ReentrantLock.acquire <fastlock.client.reentrant.ReentrantLock.acquire>`."""
        lock = self.lock

        async def run() -> SyncLease:
            return self._blocking.wrap_lease(await lock.acquire())
        return self._blocking.call(run())

    def release(self) -> None:
        """As :meth:`ReentrantLock.release <fastlock.client.reentrant.ReentrantLock.release>`."""
        self._blocking.call(self.lock.release())

    def __enter__(self) -> SyncLease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self._blocking.call(self.lock.__aexit__())


class SyncOncePerWindow:
    """:class:`~fastlock.client.window.OncePerWindow` for threads: ``with run as lease:``."""

    __slots__ = ("_blocking", "run")

    def __init__(self, blocking: SyncClient, run: OncePerWindow):
        self._blocking = blocking
        self.run = run

    def start(self) -> SyncLease:
        """As :meth:`OncePerWindow.start <fastlock.client.window.OncePerWindow.start>`."""
        run = self.run

        async def go() -> SyncLease:
            return self._blocking.wrap_lease(await run.start())
        return self._blocking.call(go())

    def finish(self) -> None:
        """As :meth:`OncePerWindow.finish <fastlock.client.window.OncePerWindow.finish>`."""
        self._blocking.call(self.run.finish())

    def __enter__(self) -> SyncLease:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.finish()


class SyncRateLimiter:
    """:class:`~fastlock.client.ratelimit.RateLimiter` for threads."""

    __slots__ = ("_blocking", "limiter")

    def __init__(self, blocking: SyncClient, limiter: RateLimiter):
        self._blocking = blocking
        self.limiter = limiter

    def try_take(self, cost: int = 1) -> RateDecision:
        """As :meth:`RateLimiter.try_take <fastlock.client.ratelimit.RateLimiter.try_take>`."""
        return self._blocking.call(self.limiter.try_take(cost))

    def take(self, cost: int = 1, *, timeout: float | None = None) -> None:
        """As :meth:`RateLimiter.take <fastlock.client.ratelimit.RateLimiter.take>` (blocks the thread)."""
        self._blocking.call(self.limiter.take(cost, timeout=timeout))


class SyncDoubleBarrier:
    """:class:`~fastlock.client.barriers.DoubleBarrier` for threads: ``with barrier:`` enters and leaves."""

    __slots__ = ("_blocking", "barrier")

    def __init__(self, blocking: SyncClient, barrier: DoubleBarrier):
        self._blocking = blocking
        self.barrier = barrier

    def enter(self, *, timeout: float | None = None) -> None:
        """As :meth:`DoubleBarrier.enter <fastlock.client.barriers.DoubleBarrier.enter>`."""
        self._blocking.call(self.barrier.enter(timeout=timeout))

    def leave(self, *, timeout: float | None = None) -> None:
        """As :meth:`DoubleBarrier.leave <fastlock.client.barriers.DoubleBarrier.leave>`."""
        self._blocking.call(self.barrier.leave(timeout=timeout))

    def close(self) -> None:
        """As :meth:`DoubleBarrier.close <fastlock.client.barriers.DoubleBarrier.close>`."""
        self._blocking.call(self.barrier.close())

    def __enter__(self) -> SyncDoubleBarrier:
        self.enter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()


class SyncCountDownLatch:
    """:class:`~fastlock.client.barriers.CountDownLatch` for threads."""

    __slots__ = ("_blocking", "latch")

    def __init__(self, blocking: SyncClient, latch: CountDownLatch):
        self._blocking = blocking
        self.latch = latch

    def create(self, count: int) -> bool:
        """As :meth:`CountDownLatch.create <fastlock.client.barriers.CountDownLatch.create>`."""
        return self._blocking.call(self.latch.create(count))

    def count_down(self, party: str) -> bool:
        """As :meth:`CountDownLatch.count_down <fastlock.client.barriers.CountDownLatch.count_down>`."""
        return self._blocking.call(self.latch.count_down(party))

    def remaining(self) -> int:
        """As :meth:`CountDownLatch.remaining <fastlock.client.barriers.CountDownLatch.remaining>`."""
        return self._blocking.call(self.latch.remaining())

    def wait(self, *, timeout: float | None = None) -> None:
        """As :meth:`CountDownLatch.wait <fastlock.client.barriers.CountDownLatch.wait>`."""
        self._blocking.call(self.latch.wait(timeout=timeout))

    def delete(self) -> None:
        """As :meth:`CountDownLatch.delete <fastlock.client.barriers.CountDownLatch.delete>`."""
        self._blocking.call(self.latch.delete())


class SyncRecipeMethods:
    """The recipes' entry points, mixed into :class:`~fastlock.client.blocking.SyncClient`."""

    def wrap_lease(self, lease: Lease) -> SyncLease:  # pragma: no cover - SyncClient's
        """``lease`` as the blocking client's :class:`~fastlock.client.blocking.SyncLease`."""
        raise NotImplementedError

    def reentrant_lock(self, name: str, *, ttl: float, wait: float | None = None, acquire_limit: int | None = None,
                       lock_delay: float = 0.0, correlation_id: str | None = None,
                       renew: bool = True) -> SyncReentrantLock:
        """As :meth:`Client.reentrant_lock <fastlock.client.Client.reentrant_lock>`; the caller is the thread."""
        blocking: SyncClient = self  # type: ignore[assignment]
        return SyncReentrantLock(blocking, blocking.client.reentrant_lock(
            name, ttl=ttl, wait=wait, acquire_limit=acquire_limit, lock_delay=lock_delay,
            correlation_id=correlation_id, renew=renew))

    def once_per(self, name: str, window: float, *, ttl: float = 30.0,
                 correlation_id: str | None = None) -> SyncOncePerWindow:
        """As :meth:`Client.once_per <fastlock.client.Client.once_per>`."""
        blocking: SyncClient = self  # type: ignore[assignment]
        return SyncOncePerWindow(blocking, blocking.client.once_per(name, window, ttl=ttl,
                                                                    correlation_id=correlation_id))

    def limit(self, name: str, rate: int, burst: int, *, per: float = 1.0, cost: int = 1) -> RateDecision:
        """As :meth:`Client.limit <fastlock.client.Client.limit>`."""
        blocking: SyncClient = self  # type: ignore[assignment]
        return blocking.call(blocking.client.limit(name, rate, burst, per=per, cost=cost))

    def rate_limiter(self, name: str, rate: int, burst: int, *, per: float = 1.0) -> SyncRateLimiter:
        """As :meth:`Client.rate_limiter <fastlock.client.Client.rate_limiter>`."""
        blocking: SyncClient = self  # type: ignore[assignment]
        return SyncRateLimiter(blocking, blocking.client.rate_limiter(name, rate, burst, per=per))

    def double_barrier(self, name: str, count: int, *, participant: str | None = None,
                       ttl: float = 10.0) -> SyncDoubleBarrier:
        """As :meth:`Client.double_barrier <fastlock.client.Client.double_barrier>`."""
        blocking: SyncClient = self  # type: ignore[assignment]
        return SyncDoubleBarrier(blocking, blocking.client.double_barrier(name, count, participant=participant,
                                                                          ttl=ttl))

    def latch(self, name: str) -> SyncCountDownLatch:
        """As :meth:`Client.latch <fastlock.client.Client.latch>`."""
        blocking: SyncClient = self  # type: ignore[assignment]
        return SyncCountDownLatch(blocking, blocking.client.latch(name))
