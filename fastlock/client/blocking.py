"""A blocking client for threaded code (Django views, Celery tasks, scripts).

:class:`SyncClient` runs the asyncio :class:`~fastlock.client.Client` on an
event loop in a background daemon thread and hands every call to it with
``asyncio.run_coroutine_threadsafe``; callers block on the result.  One
``SyncClient`` is safe to share between any number of threads: their
requests are pipelined on its one connection, and each thread waits only for
its own replies.  Leases are renewed by that background loop, so a thread
holding a lock can block in ``time.sleep`` or in I/O without losing it::

    from fastlock.sync import SyncClient

    with SyncClient("127.0.0.1:7420", client_name="billing-worker") as client:
        with client.lock("invoices/2024-06", ttl=10.0, wait=30.0) as lease:
            write_invoices(fencing_token=lease.fencing_token)
            if lease.lost.is_set():
                ...  # stop acting as the holder

The operations, arguments (float seconds) and errors are those of the asyncio
client.  Interrupting a blocked call (``KeyboardInterrupt`` in the main
thread) cancels the request on the server the same way cancelling an asyncio
task does: a waiting acquire is removed and a grant that raced is released.

**Fork safety**: a ``SyncClient`` made before ``fork()`` (Celery's prefork
pool, gunicorn ``--preload``, ``multiprocessing``'s ``fork`` start method)
opens its own loop and connection in the child at the child's first call,
and serves the call under its usual deadline - never a hang.  Leases do not
cross ``fork()``: one the child inherited is its parent's, and releasing,
extending or resigning it there raises :class:`~fastlock.errors.LeaseLost`
without sending anything.  See :mod:`fastlock.client.forks`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from typing import Any, Generic, TypeVar

from ..errors import ConnectionLost, FastlockError, WrongArgumentType
from .acquire import CALLER
from .across import Router, SyncCrossShardLease, acquire_across
from .admin import LeaseInfo, LockInfo, LockList, PrincipalRevocation
from .blocking_election import SyncElection
from .blocking_recipes import SyncRecipeMethods
from .bounded import DRIFT_BOUND, ProcessGuard, check_margin
from .client import Client
from .forks import check_held_here, fork_lock, keep_inherited
from .keys import SyncKeyMethods
from .kinds import MAX_CONTENDERS, SyncSemaphore
from .lease import HolderInfo, Lease, RevokeRequest, WatchEvent
from .multilock import MultiLease
from .sharded import ShardedClient, route_if_sharded
from .sweep import FAILOVER_TIMEOUT

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class SyncLease:
    """A held lock, for threads.  Wraps the asyncio :class:`~fastlock.client.Lease`.

    Attributes:
        name (str), fencing_token (int), ttl (float, seconds), epoch (int):
            as on :class:`~fastlock.client.Lease`.
        lost (threading.Event): set when the lease is lost (renewal refused,
            TTL passed without a renewal, release found it gone).  Wait on it
            from any thread.
    """

    __slots__ = ("lease", "lost", "pid")

    def __init__(self, lease: Lease):
        # built on the loop thread, so the listener is registered there
        self.lease = lease
        self.lost = threading.Event()
        self.pid = os.getpid()  # the process that holds it (see "Fork safety" in the module docstring)
        lease.health.when_lost(self.lost.set)

    @property
    def name(self) -> str:
        return self.lease.name

    @property
    def fencing_token(self) -> int:
        return self.lease.fencing_token

    @property
    def ttl(self) -> float:
        return self.lease.ttl

    @property
    def epoch(self) -> int:
        return self.lease.epoch

    @property
    def sequencer(self) -> str | None:
        """The lease's current signed sequencer (base64url text; re-signed by each renewal), or
        None: see :attr:`Lease.sequencer`."""
        return self.lease.sequencer

    @property
    def health_state(self) -> str:
        """``"safe"``, ``"in_jeopardy"`` or ``"lost"`` (see :class:`~fastlock.client.LeaseHealth`)."""
        return "lost" if self.lost.is_set() else self.lease.health.state

    @property
    def revoke_request(self) -> RevokeRequest | None:
        """The :class:`~fastlock.client.lease.RevokeRequest` a waiter of higher priority
        sent (who, deadline), or None (see :meth:`SyncClient.wait_revoke_request`)."""
        return self.lease.state.revoke_request

    @property
    def in_jeopardy(self) -> bool:
        return self.health_state == "in_jeopardy"

    def time_left(self) -> float:
        """Seconds until the client's conservative expiry estimate (negative once passed)."""
        return self.lease.expires_at - time.monotonic()

    def deadline(self, margin: float = 0.0, drift: float = DRIFT_BOUND) -> float:
        """The ``time.monotonic()`` moment by which work protected by this lease must have
        stopped: the server's earliest possible re-grant of the lock, from the send time of
        the last grant or renewal it confirmed, less ``margin`` seconds (-inf once known
        lost).  As :meth:`Lease.deadline <fastlock.client.Lease.deadline>`; moved forward
        by every renewal.  Raises InvalidArgument for a bad margin or drift."""
        return self.lease.deadline(margin, drift)

    def remaining(self, margin: float = 0.0, drift: float = DRIFT_BOUND) -> float:
        """Seconds left until :meth:`deadline` (negative once passed): check it before
        each step of the protected work and stop when it is not more than the step takes."""
        return self.lease.deadline(margin, drift) - time.monotonic()

    def guard_process(self, pid: int, *, margin: float = 0.0, grace: float = 1.0, group: bool = False,
                      drift: float = DRIFT_BOUND) -> ProcessGuard:
        """Stop process ``pid`` (with ``group=True`` its process group, which it leads) before
        the server could re-grant this lock: SIGTERM at ``deadline(margin) - grace``, SIGKILL
        at ``deadline(margin)`` seconds (or both at once when the lease is known lost), from a
        thread of its own.  Returns the started :class:`~fastlock.client.bounded.ProcessGuard`;
        call its ``stop()`` once the process has exited, before releasing the lease.

        Raises:
            InvalidArgument / WrongArgumentType: a bad margin, drift or grace.
        """
        bound = check_margin(margin, drift)
        check_margin(grace)
        return ProcessGuard(self.lease, pid, bound, float(grace), group=group).start()

    def __repr__(self) -> str:
        return f"<SyncLease {self.name!r} token {self.fencing_token} {self.health_state}>"


class SyncMultiLease:
    """The leases of :meth:`SyncClient.acquire_many` / :meth:`SyncClient.lock_many`.

    ``multi[name]`` is that name's :class:`SyncLease`; ``multi.lost``
    (threading.Event) is set as soon as any of them is lost.
    """

    __slots__ = ("multi", "leases", "lost", "pid", "_by_name")

    def __init__(self, multi: MultiLease):
        self.multi = multi
        self.pid = os.getpid()
        self.leases = tuple(SyncLease(lease) for lease in multi.leases)
        self._by_name = {s.name: s for s in self.leases}
        self.lost = threading.Event()
        for s in self.leases:
            s.lease.health.when_lost(self.lost.set)

    @property
    def names(self) -> tuple[str, ...]:
        return self.multi.names

    @property
    def fencing_tokens(self) -> dict[str, int]:
        return self.multi.fencing_tokens

    def __getitem__(self, name: str) -> SyncLease:
        return self._by_name[name]

    def __iter__(self) -> Iterator[SyncLease]:
        return iter(self.leases)

    def __len__(self) -> int:
        return len(self.leases)


class SyncClient(SyncKeyMethods, SyncRecipeMethods):
    """A blocking fastlock client, safe to share between threads.

    Args:
        *addresses: ``"host:port"`` strings or ``(host, port)`` tuples (as
            :func:`fastlock.connect`; default ``127.0.0.1:7420``).
        auth, token, token_file, client_name, connect_timeout, failover_timeout: as
            :func:`fastlock.connect` (connecting rides through a failover under way
            for at most ``failover_timeout`` seconds).
        tls, tls_ca, tls_cert, tls_key, server_hostname: TLS, as :func:`fastlock.connect`.
        sequencers: a signed sequencer with every grant (``lease.sequencer``), as
            :func:`fastlock.connect`.
        request_timeout: seconds of server silence, while any call is
            outstanding, after which the connection is dropped and the calls
            raise ``ConnectionLost`` (the next call reconnects); ``None``
            disables it.  As :func:`fastlock.connect`.

    :meth:`close` wakes every thread blocked in a call (it raises
    ``ConnectionLost``); calls after it raise ``ConnectionLost`` at once.

    Connects at once.  The background loop is the stdlib selector loop (its
    ``loop.time()`` is ``time.monotonic()``, so threads can compare deadlines).

    Raises:
        ConnectionLost: no address accepted a connection as primary
            (``NoPrimaryFound``: each address's answer is in it).
        AuthError: the token or secret was refused.
    """

    def __init__(self, *addresses: Any, auth: str | None = None, client_name: str | None = None,
                 connect_timeout: float = 5.0, request_timeout: float | None = 5.0, token: str | None = None,
                 token_file: Any = None,
                 tls: bool | ssl.SSLContext | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, server_hostname: str | None = None,
                 failover_timeout: float | None = FAILOVER_TIMEOUT, sequencers: bool = False):
        self._closed = False
        self._make_client: Callable[..., Client] = lambda group_addresses=addresses: Client(
            group_addresses, auth=auth, client_name=client_name, connect_timeout=connect_timeout,
            request_timeout=request_timeout, token=token, token_file=token_file, tls=tls, tls_ca=tls_ca,
            tls_cert=tls_cert, tls_key=tls_key, server_hostname=server_hostname, failover_timeout=failover_timeout,
            sequencers=sequencers)
        self._routed = False  # True: calls are routed over a sharded deployment (made again after a fork)
        self._open()
        try:  # a sharded deployment: calls are routed by name (fastlock.client.sharded)
            routed: Client = self.call(route_if_sharded(self._client, self._make_client))
            self._async_client = routed
            self._routed = isinstance(routed, ShardedClient)
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        """Make the loop, its thread and the asyncio client (in this process)."""
        self._pid = os.getpid()
        # The stdlib loop, whatever the policy: its loop.time() is
        # time.monotonic(), which other threads compare deadlines against.
        self._loop = asyncio.SelectorEventLoop()
        self._thread = threading.Thread(target=self._run_loop, name="fastlock-sync", daemon=True)
        self._close_lock = threading.Lock()  # guards _closed and _inflight
        self._inflight: set[concurrent.futures.Future[Any]] = set()  # calls submitted and not finished
        self._watch_queues: set[queue.Queue[Any]] = set()  # of the watch() generators being iterated
        try:
            self._async_client = self._make_client()
        except BaseException:  # bad arguments: no thread started
            self._closed = True
            self._loop.close()
            raise
        self._thread.start()

    def _check_process(self) -> None:
        """In a process forked since this client was opened, open it anew
        (see "Fork safety" in the module docstring)."""
        if self._pid == os.getpid():
            return
        with fork_lock():
            if self._pid == os.getpid():
                return
            parent = self._pid
            keep_inherited(self._loop, self._thread, self._async_client, self._close_lock, self._inflight)
            if self._closed:  # closed in the parent: stays closed, nothing to open
                self._pid = os.getpid()
                self._close_lock = threading.Lock()
                self._inflight = set()
                self._watch_queues = set()
                return
            log.info("SyncClient: running in process %d, a fork of %d: opening a new connection (the "
                     "parent's leases stay the parent's)", os.getpid(), parent)
            self._open()
            if self._routed:  # a sharded deployment: read the map again in this process
                self._async_client = self.call(route_if_sharded(self._async_client, self._make_client))

    @property
    def _client(self) -> Client:
        """The asyncio client of this process (opened anew after a fork)."""
        self._check_process()
        return self._async_client

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Schedule ``coro`` on the client's loop; raise ConnectionLost once closed."""
        self._check_process()
        with self._close_lock:
            if self._closed:
                coro.close()
                raise ConnectionLost("client is closed")
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._inflight.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._close_lock:
            self._inflight.discard(fut)

    def call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` on the client's loop (its background thread) and block for its
        result; a ``KeyboardInterrupt`` while blocked cancels it there.  The building
        block of every method here and of the blocking wrappers built on the client
        (elections, keys).

        :raises RuntimeError: called from the client's own loop thread.
        :raises ConnectionLost: the client was closed while the call waited."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a SyncClient cannot be called from its own event loop thread (callbacks)")
        caller = CALLER.set(threading.current_thread())  # the task copies this context when scheduled
        try:
            fut = self._submit(coro)
        finally:
            CALLER.reset(caller)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            if self._closed:  # cancelled by close()
                raise ConnectionLost("client is closed") from None
            raise
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt: the task is cancelled, its request withdrawn
            raise

    @property
    def client(self) -> Client:
        """The underlying asyncio client (use it only on :attr:`loop`)."""
        return self._client

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        self._check_process()
        return self._loop

    # -- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        """Stop renewals, close the connection and stop the background thread.

        Every thread blocked in a call (an acquire waiting in a queue, a
        watch) raises ``ConnectionLost`` ("client is closed"); later calls raise
        it at once.  Idempotent.  Held leases stay held on the server until
        their TTL.  Blocks for at most about 15 s (only a wedged loop takes that long).
        """
        self._check_process()
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            inflight = list(self._inflight)
        closed = ConnectionLost("client is closed")
        if self._thread.is_alive():
            try:
                # fails every pending request on the connection at once
                asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(10)
            except Exception:  # noqa: BLE001 - closing anyway: the pending calls fail below either way
                pass
            # Let the calls' tasks run to deliver those errors before the loop
            # stops; cancel any that still wait for something else (a sleep
            # between retries).
            _, not_done = concurrent.futures.wait(inflight, timeout=2)
            for fut in not_done:
                fut.cancel()
            concurrent.futures.wait(not_done, timeout=2)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
        for fut in inflight:  # belt and braces: nobody stays blocked on a stopped loop
            if not fut.done():
                try:
                    fut.set_exception(closed)
                except concurrent.futures.InvalidStateError:
                    pass
        for events in list(self._watch_queues):
            events.put(closed)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- operations ------------------------------------------------------------------
    def wrap_lease(self, lease: Lease) -> SyncLease:
        """``lease`` (of :attr:`client`) as a :class:`SyncLease`; call it on the client's loop thread."""
        return SyncLease(lease)

    def acquire(self, name: str, *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
                correlation_id: str | None = None, shared: bool = False, limit: int = 0,
                queue_behind_self: bool = False, priority: int = 0, preempt: float | None = None) -> SyncLease:
        """As :meth:`Client.acquire <fastlock.client.Client.acquire>` (not renewed);
        raises ``AlreadyHeld`` at once if the calling thread holds ``name``
        already through this client, unless ``queue_behind_self`` (other
        threads sharing the client queue as usual).  ``priority`` and ``preempt``
        as there (see :meth:`wait_revoke_request` for the holder's side)."""
        async def run() -> SyncLease:
            return SyncLease(await self._client.acquire(name, ttl=ttl, wait=wait, lock_delay=lock_delay,
                                                        correlation_id=correlation_id, shared=shared, limit=limit,
                                                        queue_behind_self=queue_behind_self, priority=priority,
                                                        preempt=preempt))
        return self.call(run())

    def transfer(self, lease: SyncLease, to: str) -> None:
        """As :meth:`Client.transfer <fastlock.client.Client.transfer>`: hand ``lease`` to
        the waiter whose correlation id is ``to``; ``lease.lost`` is set.

        Raises:
            LeaseLost: the lease was no longer held.  InvalidArgument: no such waiter.
        """
        _check(lease, SyncLease)
        check_held_here(lease, "lease")
        self.call(self._client.transfer(lease.lease, to))
        lease.lost.set()

    def wait_revoke_request(self, lease: SyncLease, timeout: float | None = None) -> RevokeRequest | None:
        """Block until a waiter of higher priority asks the holder of ``lease`` to yield,
        at most ``timeout`` seconds (None: no bound); the :class:`RevokeRequest` (its
        ``deadline`` is on the client's loop clock, ``time.monotonic()`` seconds), or
        None when none came in time.  ``lease.revoke_request`` reads it without waiting."""
        _check(lease, SyncLease)
        state = lease.lease.state

        async def run() -> RevokeRequest | None:
            try:
                await asyncio.wait_for(state.revoke_requested.wait(), timeout)
            except asyncio.TimeoutError:
                return None
            return state.revoke_request
        return self.call(run())

    def semaphore(self, name: str, limit: int) -> SyncSemaphore:
        """As :meth:`Client.semaphore <fastlock.client.Client.semaphore>`: ``acquire``/``lock`` take a permit."""
        return SyncSemaphore(self, name, limit)

    def contenders(self, name: str, *, most: int = MAX_CONTENDERS) -> dict[str, Any]:
        """As :meth:`Client.contenders <fastlock.client.Client.contenders>`."""
        return self.call(self._client.contenders(name, most=most))

    def release(self, lease: SyncLease) -> None:
        """As :meth:`Client.release <fastlock.client.Client.release>`.

        Raises:
            LeaseLost: the lease was no longer held; ``lease.lost`` is set.
        """
        _check(lease, SyncLease)
        check_held_here(lease, "lease")
        self.call(self._client.release(lease.lease))

    def extend(self, lease: SyncLease, *, ttl: float | None = None) -> SyncLease:
        """As :meth:`Client.extend <fastlock.client.Client.extend>`; returns ``lease`` (its ttl updated)."""
        _check(lease, SyncLease)
        check_held_here(lease, "lease")

        async def run() -> SyncLease:
            lease.lease = await self._client.extend(lease.lease, ttl=ttl)
            return lease
        return self.call(run())

    def check(self, name: str, fencing_token: int) -> bool:
        return self.call(self._client.check(name, fencing_token))

    def holder(self, name: str) -> HolderInfo | None:
        return self.call(self._client.holder(name))

    def status(self) -> dict[str, Any]:
        return self.call(self._client.status())

    def ping(self) -> float:
        return self.call(self._client.ping())

    def locks(self, prefix: str = "", *, most: int | None = None, after: str | None = None,
              order: str = "name") -> LockList:
        return self.call(self._client.locks(prefix, most=most, after=after, order=order))

    def lock_info(self, name: str) -> LockInfo:
        return self.call(self._client.lock_info(name))

    def revoke(self, name: str, *, fencing_token: int | None = None, reason: str | None = None) -> list[LeaseInfo]:
        return self.call(self._client.revoke(name, fencing_token=fencing_token, reason=reason))

    def revoke_principal(self, principal: str, *, reason: str | None = None) -> PrincipalRevocation:
        return self.call(self._client.revoke_principal(principal, reason=reason))

    def lock(self, name: str, *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
             correlation_id: str | None = None, jeopardy_fraction: float = 0.5, shared: bool = False,
             limit: int = 0, queue_behind_self: bool = False, priority: int = 0,
             preempt: float | None = None) -> SyncLockContext[SyncLease]:
        """``with client.lock(name, ttl=10.0) as lease:`` - acquire, renew in
        the background (about every ttl/3, with jitter), release on exit.

        ``lease = client.lock(...).acquire()`` holds and renews until
        :meth:`release`.  Arguments and errors are those of
        :meth:`Client.lock <fastlock.client.Client.lock>`.
        """
        return SyncLockContext(self, lambda client: client.lock(
            name, ttl=ttl, wait=wait, lock_delay=lock_delay, correlation_id=correlation_id,
            jeopardy_fraction=jeopardy_fraction, shared=shared, limit=limit, queue_behind_self=queue_behind_self,
            priority=priority, preempt=preempt))

    def acquire_many(self, names: Iterable[str], *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
                     correlation_id: str | None = None, shared: Iterable[str] = ()) -> SyncMultiLease:
        """As :meth:`Client.acquire_many <fastlock.client.Client.acquire_many>` (all or none, not renewed)."""
        names, shared = list(names), list(shared)
        async def run() -> SyncMultiLease:
            return SyncMultiLease(await self._client.acquire_many(names, ttl=ttl, wait=wait, lock_delay=lock_delay,
                                                                  correlation_id=correlation_id, shared=shared))
        return self.call(run())

    def lock_many(self, names: Iterable[str], *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
                  correlation_id: str | None = None, jeopardy_fraction: float = 0.5,
                  shared: Iterable[str] = ()) -> SyncLockContext[SyncMultiLease]:
        """``with client.lock_many(names, ttl=10.0) as multi:`` - all or none,
        each renewed in the background, all released on exit."""
        names, shared = list(names), list(shared)
        return SyncLockContext(self, lambda client: client.lock_many(
            names, ttl=ttl, wait=wait, lock_delay=lock_delay, correlation_id=correlation_id,
            jeopardy_fraction=jeopardy_fraction, shared=shared))

    def release_many(self, multi: SyncMultiLease) -> None:
        """As :meth:`Client.release_many <fastlock.client.Client.release_many>`."""
        _check(multi, SyncMultiLease)
        check_held_here(multi, "multi-lease")
        self.call(self._client.release_many(multi.multi))

    def lock_across(self, names: Iterable[str], *, ttl: float, wait: float | None = None,
                    correlation_id: str | None = None, jeopardy_fraction: float | None = None,
                    in_order: bool = False) -> SyncCrossShardLease:
        """``with client.lock_across(names, ttl=10.0, wait=30.0) as held:`` - every name, all or
        none, wherever a sharded deployment's map puts each (one server's names when not
        sharded), renewed in the background, all released on exit: as
        :func:`fastlock.client.across.lock_across` with this client's routing (``ttl`` and
        ``wait`` in seconds; its errors: ``LockNotAcquired``, ``ConnectionLost``)."""
        names = list(names)
        router: Router = self._client if isinstance(self._client, ShardedClient) else _OneServer(self._client)
        multi = self.call(acquire_across(router, names, ttl=ttl, wait=wait, correlation_id=correlation_id,
                                         jeopardy_fraction=jeopardy_fraction, in_order=in_order, renew=True))
        return SyncCrossShardLease(multi, self._loop)

    def watch(self, name: str, *, timeout: float | None = None) -> Iterator[WatchEvent]:
        """Yield :class:`~fastlock.client.WatchEvent` as :meth:`Client.watch
        <fastlock.client.Client.watch>` does; close the generator (or break
        out of the loop) to unsubscribe.

        Args:
            timeout: seconds to wait for each event; ``None`` waits forever.

        Raises:
            TimeoutError: no event within ``timeout``.
            ConnectionLost: the client was closed, or no primary answered in time (a
                dropped connection or a failover is ridden through: the watch resumes
                from its last revision, docs/watches.md).
            Compacted, WatchDiverged: the watch could not resume from its last revision.
        """
        return self._follow(lambda: self._client.watch(name), timeout, repr(name))

    def _follow(self, make: Callable[[], AsyncIterator[_T]], timeout: float | None, what: str) -> Iterator[_T]:
        """Iterate, in the calling thread, the async iterator ``make()`` runs on the client's
        loop (a watch); ``timeout``: seconds for each item (None: forever).
        :raises TimeoutError: no item within ``timeout``."""
        events: queue.Queue[Any] = queue.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for event in make():
                    events.put(event)
            except BaseException as exc:  # noqa: BLE001 - handed to the iterating thread
                events.put(exc)
            else:
                events.put(done)

        fut = self._submit(pump())
        self._watch_queues.add(events)
        try:
            while True:
                try:
                    item = events.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(f"no event on {what} within {timeout} s") from None
                if item is done:
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        return
                    raise item
                yield item
        finally:
            self._watch_queues.discard(events)
            if not self._loop.is_closed():  # a generator closed after the client is a no-op
                fut.cancel()

    def election(self, name: str, candidate_id: str, *, lease_duration: float = 15.0, renew_deadline: float = 10.0,
                 retry_period: float = 2.0, jeopardy_fraction: float = 0.5) -> SyncElection:
        """As :meth:`Client.election <fastlock.client.Client.election>`, for threads."""
        return SyncElection(self, self._client.election(
            name, candidate_id, lease_duration=lease_duration, renew_deadline=renew_deadline,
            retry_period=retry_period, jeopardy_fraction=jeopardy_fraction))


_Held = TypeVar("_Held", SyncLease, SyncMultiLease)


class SyncLockContext(Generic[_Held]):
    """Returned by :meth:`SyncClient.lock` (``SyncLockContext[SyncLease]``) and
    :meth:`SyncClient.lock_many` (``SyncLockContext[SyncMultiLease]``): a
    context manager, or call :meth:`acquire` to hold until released."""

    __slots__ = ("_blocking", "_make", "_ctx", "_ctx_client", "_held")

    def __init__(self, blocking: SyncClient, make: Callable[[Client], Any]):
        self._blocking = blocking
        self._make = make  # make(client): the asyncio context (arguments checked now)
        self._ctx_client = blocking.client
        self._ctx = make(self._ctx_client)
        self._held: Any = None

    def acquire(self) -> _Held:
        """Acquire and start renewing; returns a :class:`SyncLease` (or
        :class:`SyncMultiLease` for ``lock_many``)."""
        client = self._blocking.client
        if self._ctx_client is not client:  # made before a fork: make it on this process's client
            self._ctx, self._ctx_client = self._make(client), client
        ctx = self._ctx

        async def run() -> Any:
            held = await ctx
            return SyncMultiLease(held) if isinstance(held, MultiLease) else SyncLease(held)
        acquired: _Held = self._blocking.call(run())
        return acquired

    def __enter__(self) -> _Held:
        held = self.acquire()
        self._held = held
        return held

    def __exit__(self, *exc: object) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        try:
            if isinstance(held, SyncMultiLease):
                self._blocking.release_many(held)
            else:
                self._blocking.release(held)
        except FastlockError:  # as the asyncio lock(): never into the caller's code
            held.lost.set()


def _check(obj: Any, cls: type) -> None:
    if not isinstance(obj, cls):
        raise WrongArgumentType(f"expected a {cls.__name__}, not {type(obj).__name__}")


class _OneServer:
    """The router of a client that is not sharded: every name is its one server's."""

    def __init__(self, client: Client):
        self.client = client

    def client_for(self, name: str) -> Client:
        return self.client
