"""The asyncio client.

One :class:`Client` holds one TCP connection to the primary and pipelines every
request of every task over it (requests carry ids; replies may come back in
any order).  Typical use::

    async with fastlock.connect("127.0.0.1:7420", "127.0.0.1:7421") as client:
        async with client.lock("orders/42", ttl=10.0, wait=5.0) as lease:
            await write_with_fencing(lease.fencing_token)
            if lease.lost.is_set():
                ...  # stop acting as the holder

Times in this API are float **seconds** (as asyncio); the wire carries
integer milliseconds.  Arguments are checked before anything is sent:
a bad one raises :class:`~fastlock.errors.InvalidArgument` (a ValueError) or
:class:`~fastlock.errors.WrongArgumentType` (a TypeError).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import ssl
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from .. import protocol as P
from ..errors import ConnectionLost, InvalidArgument, LeaseLost, WrongArgumentType, WrongShard
from ..protocol.ops import OP_TRANSFER
from ..tls import client_ssl_context
from ..tokens import epoch_of
from ..units import check_seconds
from ._path import grant_lease, send_acquire, send_release, take_grant
from .acquire import (
    AcquireRequest,
    HeldLeases,
    acquire_retry,
    extend_args,
    extended_ms,
    verify_late_grant,
)
from .admin import LockAdminMethods
from .bounded import lock_bound
from .calls import call
from .connection import (
    BACKOFF_FIRST,
    BACKOFF_MAX,
    RETRYABLE,
    ClientConnection,
    Connector,
    RideThrough,
    resolve_credential,
)
from .election import Election
from .environment import addresses_from_env, tls_from_env
from .keys import KeyMethods
from .kinds import MAX_CONTENDERS, Semaphore, kind_args, list_contenders
from .lease import HolderInfo, Lease, WatchEvent, check_fraction, check_lease
from .multilock import LockManyContext, MultiLease, acquire_many, release_many, sorted_names
from .preempt import deliver_revoke_request
from .recipes import RecipeMethods
from .renewer import LockContext, Renewer, Renewers
from .session import DEFAULT_SESSION_TTL, SessionAdminMethods, SessionKeeper
from .sweep import FAILOVER_TIMEOUT, find_primary
from .watch import watch_events

log = logging.getLogger(__name__)

__all__ = ["Client", "LockContext", "LATE_GRANT_FRACTION"]

#: a grant read with less than this fraction of its TTL left (by the client's
#: conservative estimate) is verified with an EXTEND before it is returned
LATE_GRANT_FRACTION = 0.5


class Client(KeyMethods, LockAdminMethods, RecipeMethods, SessionAdminMethods):
    """A connection to a fastlock primary.  Create it with :func:`connect`.

    Many tasks may share one client; their requests are pipelined on one
    connection.  Held leases survive a dropped connection until their TTL.

    **Riding through a failover.**  Every operation runs under one deadline:
    ``wait`` plus ``connect_timeout`` for an acquire (none when ``wait`` is
    None), ``request_timeout`` (or ``connect_timeout`` when that is None) for
    every other call, and the lease's own expiry for a renewal.  Within it, a
    lost connection, a ``NotPrimary`` refusal (a standby, a deposed primary)
    or ``Unavailable`` (a fenced primary, a server shutting down) makes the
    client drop that connection, look for the current primary - every
    address, redirects followed first, an address that went silent or
    answered "deposed"/"fenced"/``Unavailable`` tried last, with backoff and
    jitter (20 ms doubling to 0.5 s) between sweeps - and send the request
    again.  A retried acquire carries the same owner key, so the server finds
    its existing lease (or waiter) instead of granting the lock twice, as
    ZooKeeper's lock recipe finds its own node again.  Only when the deadline
    passes with no primary able to serve does :class:`ConnectionLost` reach
    the caller (its ``__cause__`` is the last refusal).  See the table in
    ``docs/client-features.md``.

    **Liveness.**  A server that stops answering while its TCP connection
    stays open (a frozen process, a stalled VM, a black-holed network) is
    detected by a per-connection watchdog (:class:`fastlock.protocol.rpc.RpcConnection`),
    not by per-request timers: while any request (including a waiting
    acquire) or watch is outstanding, a ``PING`` is sent after
    ``request_timeout / 3`` seconds without a byte from the server, and after
    ``request_timeout`` seconds of silence the connection is aborted and that
    address is tried last from then on; the operations pending on it ride
    through as above.  An idle connection is never pinged nor aborted.  A
    waiting acquire is therefore never failed by its own ``wait`` being long:
    only by the server going silent.

    **Session.**  With ``session=True`` (the default) every lease the client
    renews - :meth:`lock`, :meth:`lock_many`, semaphores, election terms - is
    kept alive by one ``SESSION_KEEPALIVE`` per renewal interval instead of one
    EXTEND per lease (:mod:`fastlock.client.session`, docs/sessions.md);
    ``session_ttl`` (seconds, default 10) is how long the server keeps the
    session with no lease attached.  ``session=False``: each lease renews itself.

    **Processes.**  A client belongs to the event loop, and so to the
    process, that uses it: after ``fork()`` a child must make its own (the
    blocking :class:`~fastlock.sync.SyncClient` does so by itself).  Leases
    stay with the process that acquired them.
    """

    def __init__(self, addresses: Iterable[Any], *, auth: str | None = None, client_name: str | None = None,
                 connect_timeout: float = 5.0, request_timeout: float | None = 5.0, token: str | None = None,
                 token_file: str | os.PathLike[str] | None = None,
                 tls: bool | ssl.SSLContext | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, server_hostname: str | None = None,
                 failover_timeout: float | None = FAILOVER_TIMEOUT, sequencers: bool = False,
                 session: bool = True, session_ttl: float = DEFAULT_SESSION_TTL):
        addresses = addresses_from_env(addresses)
        tls, files = tls_from_env(tls, {"tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key,
                                        "server_hostname": server_hostname})
        tls_ca, tls_cert, tls_key, server_hostname = (files["tls_ca"], files["tls_cert"], files["tls_key"],
                                                      files["server_hostname"])
        auth = resolve_credential(token=token, token_file=token_file, auth=auth)
        client_name = P.check_optional_str(client_name, "client name", P.MAX_CLIENT_NAME_CHARS)
        self._connect_timeout = check_seconds(connect_timeout, "connect_timeout")
        self._request_timeout = check_seconds(request_timeout, "request_timeout", allow_none=True)
        self._failover_timeout = check_seconds(failover_timeout, "failover_timeout", allow_none=True, allow_zero=True)
        ssl_context = client_ssl_context(tls, tls_ca, tls_cert, tls_key)
        if server_hostname is not None:
            if type(server_hostname) is not str or not server_hostname:
                raise WrongArgumentType(f"server_hostname must be a non-empty str, not {server_hostname!r}")
            if ssl_context is None:
                raise InvalidArgument("server_hostname is only meaningful with TLS")
        self._connector = Connector(addresses, auth=auth, client_name=client_name,
                                    connect_timeout=self._connect_timeout, request_timeout=self._request_timeout,
                                    ssl_context=ssl_context, server_hostname=server_hostname)
        if type(sequencers) is not bool:
            raise WrongArgumentType(f"sequencers must be a bool, not {type(sequencers).__name__}")
        self._connector.sequencers = sequencers  # with_actor asks for one in every ACQUIRE
        # the deadline of every call but acquire and renewals (seconds)
        self._op_timeout = self._request_timeout if self._request_timeout is not None else self._connect_timeout
        #: the auto-renewals this client runs (stopped by release and close)
        self.renewers = Renewers()
        #: a routing client's hook for a lease whose slot moved to another shard group
        #: (``lease_moved(renewer, why)``: True if it takes the renewer over; fastlock.client.sharded)
        self.lease_moved: Callable[[Any, str], bool] | None = None
        #: the last lease this client was granted per lock name, and the task
        #: (or blocking client's thread) it was granted to: the self-wait check
        #: of :meth:`acquire`; dropped on release
        self._held = HeldLeases(self._connector)
        self._connector.on_revoke_request = functools.partial(deliver_revoke_request, self._held)
        #: the client's session: one keep-alive renews every auto-renewed lease (None: session=False)
        self.session_keeper = (SessionKeeper(self, check_seconds(session_ttl, "session_ttl")) if session
                               else None)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._connector.closed

    @property
    def server_info(self) -> dict[str, Any]:
        """The primary's HELLO reply on the current (or last) connection:
        ``role``, ``epoch``, ``session``, ``principal``, ..."""
        return self._connector.server_info

    @property
    def max_epoch(self) -> int:
        """The highest fencing epoch this client has seen; sent in every HELLO
        so that a deposed primary that still runs learns it and steps down."""
        return self._connector.max_epoch

    @property
    def connector(self) -> Connector:
        """Finds the primary and rides requests through failovers (see :mod:`fastlock.client.connection`)."""
        return self._connector

    @property
    def connection(self) -> ClientConnection | None:
        """The current connection to the primary, or None (for diagnostics)."""
        return self._connector.proto

    @property
    def request_timeout(self) -> float | None:
        """Seconds of server silence, while something is outstanding, after
        which the connection is declared dead (None: never)."""
        return self._request_timeout

    async def ensure_connected(self, deadline: float | None = None) -> ClientConnection:
        """Connect to the primary now if not connected (:func:`connect` does this), riding through
        a failover under way until ``deadline`` (``loop.time()`` s; default: ``failover_timeout``
        from now) as :func:`fastlock.client.sweep.find_primary` says (its errors: ``NoPrimaryFound``,
        a ``ConnectionLost`` giving each address's answer; ``AuthError``)."""
        return await find_primary(self._connector, deadline, self._failover_timeout, BACKOFF_FIRST, BACKOFF_MAX)

    async def _request(self, op: int, *args: Any) -> Any:
        """Send one request and return its reply's value, riding through a
        failover within ``request_timeout`` (see :class:`Client` and :mod:`fastlock.client.calls`)."""
        return await call(self._connector, op, args, self._op_timeout)

    async def close(self) -> None:
        """Stop auto-renewals and close the connection.

        Every request still pending (a waiting acquire included) raises
        :class:`ConnectionLost` ("client is closed") at once, and so does any
        later call.  Held leases stay held on the server until their TTL
        (release them first if you want them freed now).  The client's session, if
        it opened one, is closed on the server (``SESSION_CLOSE``, best effort, at
        most 1 s), so ``fastlock sessions`` no longer lists it."""
        self.renewers.stop_all()
        if self.session_keeper is not None:
            await self.session_keeper.end()
        self._connector.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- lock operations ----------------------------------------------------------------
    async def acquire(self, name: str, *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
                      correlation_id: str | None = None, shared: bool = False, limit: int = 0,
                      queue_behind_self: bool = False, priority: int = 0, preempt: float | None = None,
                      _owner: bytes | None = None) -> Lease:
        """Acquire ``name`` and return its :class:`Lease`.

        ``shared=True`` asks for a shared (read) lease: any number of shared
        holders, or one exclusive holder; FIFO across both kinds (a reader that
        arrives behind a waiting writer queues behind it).  ``limit=N`` takes a
        permit of the counting semaphore ``name`` (at most N holders; see
        :meth:`semaphore`).  Every lease, of every kind, has its own fencing token.

        Args:
            name: lock name, non-empty, at most 512 bytes of UTF-8.
            ttl: lease time to live in seconds (1 ms .. 1 hour), counted on the
                server's monotonic clock from the grant.
            wait: seconds to wait in the lock's FIFO queue; ``0`` tries once,
                ``None`` waits forever.  The whole call, failovers included,
                runs under one deadline: ``wait + connect_timeout`` seconds
                (none when ``wait`` is None).
            lock_delay: seconds (0 .. 60) during which the lock stays
                unavailable after this lease *expires* (not after a clean
                release), as Chubby's lock-delay and Consul's session lock-delay.
            correlation_id: free text (<= 256 chars) recorded with the grant in
                the server's WAL, for audits (``fastlock wal dump``).
            queue_behind_self: queue even if the calling task holds ``name``
                already through this client (see below), for a task that
                waits for a lease another task will release.
            priority: 0 (default) .. 99: a waiting request is queued ahead of
                every waiter of a lower priority, FIFO within a priority (as
                Apache Helix's priority lock); above 0 it needs the ACL right
                ``prioritize`` on the name (``PermissionDenied``).  See
                ``preempt`` to ask the holder to yield.
            preempt: seconds (0.001 .. 600); with a priority, ask the exclusive
                holder to yield within that long (it sees
                ``lease.revoke_requested``); if it has not released by then the
                server revokes its lease.  Needs the ACL right ``preempt``; sent
                with the first attempt only, and refused (silently) when the
                request was granted at once or its priority is not above the
                holder's.

        **No waiting for yourself**: a waiting acquire (``wait`` not 0) by a task, or a task it
        created (``wait_for``, ``gather``...; a ``SyncClient`` thread), that holds a live exclusive
        lease on ``name`` through this client, or asks for one while holding a shared lease or a
        permit, raises :class:`AlreadyHeld` at once (see there); unrelated tasks queue.

        A lost connection, a standby or deposed node (``NotPrimary``) or a
        fenced primary (``Unavailable``) does not end the call: the client
        finds the current primary and asks again with the same owner key, so
        a grant that was made before the failure is found again, never made
        twice (see :class:`Client`).  A request that waited in the queue asks
        again for the wait that is left (its place in the queue is lost: a
        waiter goes with its connection).

        **No dead lease returned as granted** (the fault of etcd issue 11456,
        found by Jepsen).  The server reports how long the request waited in
        its queue (``waited_ms``, on its own monotonic clock).  The grant
        cannot have happened before ``sent + waited`` on this client's clock
        (``sent``: when this client sent the request), so the lease's
        ``expires_at`` is ``sent + waited + ttl`` - an estimate that is never
        later than the server's expiry, assuming the two monotonic clocks run
        at the same rate (quartz drift, about 1e-4, is far inside the margin
        below).  If, when the reply is read, less than half of the TTL is left
        by that estimate (this process was frozen, or its loop stalled, while
        the grant waited unread), the lease is not returned on trust: one
        EXTEND verifies it with the server (renewing it from now) and the
        lease is returned only if that succeeds and leaves time.  Otherwise the
        lock is released (best effort) and, while ``wait`` has time left, the
        acquire queues again with a new owner key; when it has none,
        :class:`LeaseLost` is raised - not a lease already marked lost, so that
        no code path can act on it by mistake.  On the normal path this costs
        no extra round trip.

        Raises:
            LockNotAcquired: the wait ran out (or ``wait=0`` and it was held).
            AlreadyHeld: (a ``LockNotAcquired``) a waiting acquire by a task
                that holds ``name`` already through this client, and
                ``queue_behind_self`` is false; nothing was sent.
            LeaseLost: a grant arrived too late to be proven alive, and the
                wait had no time left to queue again (see above).
            ConnectionLost: the deadline passed with no primary reachable,
                or the client was closed.
            LimitExceeded: too many waiting acquires on this connection.
            LimitConflict: ``limit`` disagrees with the name's current kind
                (a lock, or a semaphore with another limit).
            DeadlockDetected: this waiter was failed to break a deadlock.
            InvalidArgument / WrongArgumentType: bad arguments (nothing sent).

        Cancelling the awaiting task (``task.cancel()``, ``asyncio.timeout``)
        removes the waiter on the server; if the grant raced with the cancel,
        the server releases it (never a ghost holder).

        ``_owner`` is the routing client's (:mod:`fastlock.client.sharded`): a
        :class:`WrongShard` raised here carries the owner key the request was
        sent with (``exc.owner``), and the call it sends to the name's new
        group passes that key back, so a waiter a slot move shipped there keeps
        its place in the queue (the new group's reclaim window knows it by key).
        """
        # the self-wait check, every argument checked, the owner key drawn, the request sent on the
        # open connection (compiled: fastlock/client/_path.pyx); this coroutine awaits the
        # connection's future itself
        attempt = send_acquire(self, name, ttl, wait, lock_delay, correlation_id, shared, limit, priority, preempt,
                               _owner, queue_behind_self)
        fut = attempt.fut
        try:
            if fut is not None:
                try:
                    reply = await fut
                except asyncio.CancelledError:
                    self._connector.withdraw(attempt.proto, name, attempt.request.owner)
                    raise
                except RETRYABLE as exc:
                    reply, attempt.sent = await acquire_retry(self._connector, self._connect_timeout,
                                                              attempt.request, attempt.sent, attempt.proto, exc)
            else:
                reply, attempt.sent = await acquire_retry(self._connector, self._connect_timeout, attempt.request,
                                                          attempt.started)
        except WrongShard as exc:
            exc.owner = attempt.request.owner
            raise
        # The grant happened no earlier than `sent + waited` on our clock (the server received
        # the request after we sent it, then it waited): the lease's expires_at counts from there
        exclusive = not shared and not limit
        lease = take_grant(self, attempt, reply, exclusive, LATE_GRANT_FRACTION)
        if lease is None:  # less than LATE_GRANT_FRACTION of its TTL left: verified first
            request = attempt.request
            lease = grant_lease(name, request.owner, reply, attempt.sent, self._connector)
            lease = await verify_late_grant(self, lease, AcquireRequest(*request[:8]), attempt.started)
            self._held.remember(lease, exclusive, attempt.loop, attempt.who)
        return lease

    async def transfer(self, lease: Lease, to: str) -> None:
        """Hand the exclusive ``lease`` to the waiter whose correlation id is ``to``, in
        one server step (Kubernetes' coordinated leader election): the lease is released
        and that waiter granted at once, with a higher fencing token; no other waiter
        can come between.  The lease's renewals stop and ``lease.lost`` is set.

        Raises:
            LeaseLost: the lease no longer holds (nothing changed).
            InvalidArgument: no waiter ``to`` (among the first 1,000), or it waits for a
                shared lease or in a multi-lock request (nothing changed).
        """
        check_lease(lease)
        P.check_optional_str(to, "to", P.MAX_CORRELATION_ID_CHARS)
        if not to:
            raise InvalidArgument("transfer needs the candidate's correlation id")
        await self._request(OP_TRANSFER, lease.name, lease.fencing_token, lease.owner, to)
        self.renewers.stop(lease)
        self._held.forget(lease)
        lease.lost.set()

    async def release(self, lease: Lease) -> None:
        """Release ``lease``; the next waiter (if any) is granted at once.

        Rides through a failover within ``request_timeout``: a release refused
        by a node that is not (or no longer) the serving primary - a deposed
        node (``NotPrimary``), a fenced one (``Unavailable``; it changes
        nothing) - is sent again to the current primary, so an acknowledged
        release takes effect on whichever node is primary afterwards.

        Raises:
            LeaseLost: the lease is no longer the holder (expired, or released
                already); nothing changed on the server.  ``lease.lost`` is set.
                (After an attempt whose outcome is unknown, a ``LeaseLost``
                from the retry counts as released.)
            ConnectionLost: no primary could be reached within ``request_timeout``;
                the lease expires by its TTL.
        """
        # checked, renewal stopped, forgotten, sent (compiled: fastlock/client/_path.pyx)
        attempt = send_release(self, lease, self._op_timeout)
        try:
            fut = attempt.fut
            if fut is None:
                await attempt.ride_through()
                return
            try:
                await fut
                return
            except RETRYABLE as exc:
                if self._connector.closed:
                    raise
                failed = exc
            finally:
                attempt.end()
            await attempt.ride_through(failed)
        except LeaseLost:
            lease.lost.set()
            raise

    async def extend(self, lease: Lease, *, ttl: float | None = None) -> Lease:
        """Renew ``lease`` for ``ttl`` seconds from now (default: its current TTL).

        Returns the lease (a new object if the TTL changed).  An expired lease
        is never revived.  Rides through a failover within ``request_timeout``.

        Raises:
            LeaseLost: the lease expired or was released; ``lease.lost`` is set.
            ConnectionLost: no primary could be reached within ``request_timeout``.
        """
        check_lease(lease)
        ttl_ms = P.check_ttl_ms(P.seconds_to_ms(lease.ttl if ttl is None else ttl, "ttl"))
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            granted = await self._request(P.OP_EXTEND, *extend_args(lease, ttl_ms))
        except LeaseLost:
            lease.lost.set()
            raise
        return self._extended(lease, granted, sent)

    def _extended(self, lease: Lease, granted: Any, sent: float) -> Lease:
        # the server's TTL counts from when it handled the extend: after `sent`
        new_ttl = extended_ms(lease, granted) / 1000.0
        lease.state.expires_at = sent + new_ttl  # shared by every copy of the lease
        epoch = epoch_of(lease.fencing_token)
        connector = self._connector
        if epoch > connector.max_epoch:
            connector.max_epoch = epoch
        if new_ttl == lease.ttl:
            return lease
        return lease.with_ttl(new_ttl)

    async def renew_before(self, lease: Lease, deadline: float, *, ttl: float | None = None,
                     attempt_timeout: float | None = None) -> Lease:
        """One renewal that must succeed before ``deadline`` (``loop.time()``):
        EXTEND (for ``ttl`` seconds, default the lease's) through the
        ride-through path, each attempt bounded by ``attempt_timeout`` seconds
        (default a third of the TTL) so a silent server leaves time to find the
        next primary.  Used by :class:`~fastlock.client.renewer.Renewer`.

        Raises:
            LeaseLost: the server refused the renewal, or none succeeded
                before ``deadline`` (``lease.lost`` is set by the caller).
        """
        ttl_s = lease.ttl if ttl is None else ttl
        ttl_ms = P.check_ttl_ms(P.seconds_to_ms(ttl_s, "ttl"))
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            pacing = RideThrough(self._connector, deadline, max_backoff=min(BACKOFF_MAX, ttl_s / 10.0))
            granted = await pacing.send(P.OP_EXTEND, extend_args(lease, ttl_ms),
                                        attempt_timeout=attempt_timeout or ttl_s / 3.0)
        except ConnectionLost as exc:
            if self._connector.closed:
                raise
            raise LeaseLost(f"no renewal of {lease.name!r} succeeded before the lease's deadline: {exc}") from exc
        # the successful attempt was sent at or after `sent`: conservative
        return self._extended(lease, granted, sent)

    async def check(self, name: str, fencing_token: int) -> bool:
        """Is ``fencing_token`` the current, unexpired holder's token of ``name``?

        The server-side half of Chubby's sequencer check: a downstream service
        may call it before acting on a request that carries a token.  Rides
        through a failover within ``request_timeout``.
        """
        P.check_name(name)
        P.check_token(fencing_token)
        return bool(await self._request(P.OP_CHECK, name, fencing_token))

    async def status(self) -> dict[str, Any]:
        """The primary's status: role, epoch, counters, sessions, WAL stats."""
        status: dict[str, Any] = await self._request(P.OP_STATUS)
        return status

    async def ping(self) -> float:
        """Round trip to the primary, in seconds."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await self._request(P.OP_PING)
        return loop.time() - t0

    async def holder(self, name: str) -> HolderInfo | None:
        """The current holder of ``name`` (a :class:`~fastlock.client.lease.HolderInfo`), or None if free."""
        P.check_name(name)
        holder: HolderInfo | None = await self._request(P.OP_HOLDER, name)
        return holder

    def watch(self, name: str, *, progress: bool = False) -> AsyncIterator[WatchEvent]:
        """Yield :class:`WatchEvent` for every change of ``name``'s holder.

        Pushed by the server (no polling), in the order it applied them.  The
        first event is the state when the watch began (``"held"`` with the
        token, or ``"free"``).  A change is reported once it is committed
        (durable, and with synchronous replication on the standby too).  Every
        event carries its ``revision``: if the connection drops, or the primary
        fails over, the watch subscribes again on the connection the client
        rides to (within the client's operation timeout, seconds) from the last
        revision it delivered, and goes on with no change lost or repeated (see
        docs/watches.md).  ``progress`` (bool): also yield ``"progress"`` events,
        sent by the server at least every ``--watch-progress-interval`` seconds.
        Breaking out of the loop unsubscribes.

        :raises Compacted: on a resume, the server no longer keeps the changes
            since the last revision (``--watch-history``).
        :raises WatchDiverged: on a resume, the server never had the last revision:
            the old primary delivered changes its standby never received
            (asynchronous replication).
        :raises ConnectionLost: the client was closed, or no primary answered in time.

        Example::

            async for event in client.watch("leader"):
                print(event.kind, event.token, event.client)
        """
        return watch_events(self._connector, name, self._op_timeout, progress)

    def lock(self, name: str, *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
             correlation_id: str | None = None, renew: bool = True,
             jeopardy_fraction: float = 0.5, shared: bool = False, limit: int = 0,
             queue_behind_self: bool = False, bounded: bool = False, margin: float | None = None, drift: float = 1e-3,
             priority: int = 0, preempt: float | None = None, session: bool = True) -> LockContext:
        """Acquire ``name`` and keep renewing it.

        ``async with client.lock(...) as lease:`` acquires, renews at about a
        third of the TTL (minus 10-20 % random jitter, so many holders do not
        renew in step) and releases on exit.  ``lease = await client.lock(...)``
        acquires and renews until :meth:`release`.  If a renewal is refused or
        the TTL passes without one succeeding, ``lease.lost`` is set and
        renewal stops; the body is not interrupted - check ``lease.lost``
        (or pass the fencing token to your writes) before acting.

        ``lease.health`` (:class:`LeaseHealth`) turns ``"in_jeopardy"`` when
        renewals have failed and less than ``jeopardy_fraction`` (0 < f < 1,
        default 0.5) of the TTL is left, and ``"safe"`` again when one succeeds.  ``bounded=True``: the
        body is cancelled ``margin`` s (default ttl/10) before a possible re-grant (:mod:`.bounded`).
        ``session`` (default True): renewed by the client's one session keep-alive (the lease keeps
        its TTL); False: by its own EXTENDs (docs/sessions.md).

        Arguments and errors are those of :meth:`acquire` (``AlreadyHeld``
        when this client holds ``name`` already, unless ``queue_behind_self``).
        """
        P.check_name(name)
        check_fraction(jeopardy_fraction)
        kind_args(shared, limit)
        return LockContext(self, name, dict(ttl=ttl, wait=wait, lock_delay=lock_delay, correlation_id=correlation_id,
                                            shared=shared, limit=limit, queue_behind_self=queue_behind_self,
                                            priority=priority, preempt=preempt), renew,
                           jeopardy_fraction, lock_bound(bounded, margin, drift, ttl), session)

    def semaphore(self, name: str, limit: int) -> Semaphore:
        """The counting semaphore ``name`` with at most ``limit`` holders (1 .. 2**31-1):
        ``acquire``/``lock`` take a permit as :meth:`acquire`/:meth:`lock` take a lock
        (Curator's InterProcessSemaphoreV2, kazoo's Semaphore, ``consul lock -n``).
        Raises InvalidArgument / WrongArgumentType for a bad name or limit."""
        return Semaphore(self, name, limit)

    async def contenders(self, name: str, *, most: int = MAX_CONTENDERS) -> dict[str, Any]:
        """The holders and the FIFO-ordered waiters of lock or semaphore ``name``
        (kazoo's ``contenders()``): ``{"holders": [...], "waiters": [...], "truncated":
        bool}``, each a dict (see :mod:`fastlock.protocol`, CONTENDERS), at most ``most``
        (int >= 1, default 100,000) of them, the server's pages followed
        (:func:`~fastlock.client.kinds.list_contenders`).  Raises InvalidArgument for a
        bad name or ``most``."""
        return await list_contenders(self._request, name, most)

    # -- several locks at once --------------------------------------------------------
    async def acquire_many(self, names: Iterable[str], *, ttl: float, wait: float | None = None,
                           lock_delay: float = 0.0, correlation_id: str | None = None,
                           shared: Iterable[str] = ()) -> MultiLease:
        """Acquire every lock in ``names``, or none of them: one request, one round trip.

        The server grants the set atomically (one lease and one fencing token per
        name, all with one owner key) and, while it waits, holds none of them; the
        request queues FIFO on every name (behind earlier waiters, ahead of later
        ones), so sets taken this way never deadlock with each other.  More than
        64 names, or a server without the op (an older fastlock), fall back to
        taking them one by one in the global order of their UTF-8 bytes (ordered
        two-phase locking), releasing what was taken on failure.

        Args:
            names: distinct lock names (at least one; each checked as in :meth:`acquire`).
            ttl: each lease's time to live in seconds (:meth:`acquire_many` does
                not renew: use :meth:`lock_many` for that).
            wait: one deadline in seconds for the set; ``0`` tries once; ``None`` waits forever.
            lock_delay, correlation_id: as :meth:`acquire`, for every lease.
            shared: the names among ``names`` to take as shared (read) locks.

        Returns:
            a :class:`MultiLease`.

        Raises:
            LockNotAcquired: the deadline passed (nothing is held).
            DeadlockDetected: (one-by-one path only) a lock wait was failed to break a deadlock.
            InvalidArgument / WrongArgumentType: no names, a duplicate name, a
                semaphore among them (LimitConflict), or a bad argument.
            ConnectionLost: no primary reachable within the deadline.

        Cancelling the awaiting task withdraws the request (or releases what was granted).
        """
        return await acquire_many(self, names, dict(ttl=ttl, lock_delay=lock_delay, correlation_id=correlation_id,
                                                    shared=shared), wait, None)

    def lock_many(self, names: Iterable[str], *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
                  correlation_id: str | None = None, jeopardy_fraction: float = 0.5,
                  shared: Iterable[str] = ()) -> LockManyContext:
        """:meth:`acquire_many` plus auto-renewal of every lease, as :meth:`lock`.

        ``async with client.lock_many(["a", "b"], ttl=10.0) as locks:`` holds
        all of them in the body and releases them on exit; ``await
        client.lock_many(...)`` holds them until :meth:`release_many`.
        ``locks.lost`` is set as soon as any one of them is lost.
        """
        checked = sorted_names(names)
        check_fraction(jeopardy_fraction)
        return LockManyContext(self, checked, dict(ttl=ttl, lock_delay=lock_delay, correlation_id=correlation_id,
                                                   shared=tuple(shared)), wait, jeopardy_fraction)

    def release_nowait(self, lease: Lease) -> None:
        """Release ``lease`` without waiting for the reply (best effort; for
        cancellation paths and a leader stepping down): its renewal stops, and
        if the connection is, or turns out to be, dead the release is sent as a
        cancel-by-owner on the next connection."""
        self.renewers.stop(lease)
        self._held.forget(lease)
        connector = self._connector
        connector.withdraw(connector.proto, lease.name, lease.owner, P.OP_RELEASE, lease.fencing_token, lease.owner)

    def start_renewing(self, lease: Lease, jeopardy_fraction: float | None = None, *,
                       session: bool = True) -> Renewer:
        """Renew ``lease`` in the background, as :meth:`lock` does (about every
        third of the TTL, with jitter), until :meth:`release`, :meth:`close` or
        its loss (``lease.lost``).  ``jeopardy_fraction``: see :meth:`lock`.
        ``session``: renewed by the client's session keep-alive (the default, when
        the client has a session); False: by its own EXTENDs.
        Returns the running :class:`~fastlock.client.renewer.Renewer`."""
        if jeopardy_fraction is not None:
            lease.health.jeopardy_fraction = check_fraction(jeopardy_fraction)
        return Renewer(self, lease, session=session).start()

    async def release_many(self, multi: MultiLease) -> None:
        """Release every lease of ``multi`` (all of them, even if one fails).

        Raises:
            LeaseLost: at least one lease was no longer held (after trying to
                release the others); ``multi.lost`` is set.
        """
        await release_many(self, multi)

    # -- leader election --------------------------------------------------------------

    def election(self, name: str, candidate_id: str, *, lease_duration: float = 15.0, renew_deadline: float = 10.0,
                 retry_period: float = 2.0, jeopardy_fraction: float = 0.5) -> Election:
        """A leader election on lock ``name`` for candidate ``candidate_id``.

        See :class:`fastlock.election.Election` (Kubernetes' leaderelection
        semantics and defaults: 15 s lease, 10 s renew deadline, 2 s retry).
        """
        return Election(self, name, candidate_id, lease_duration=lease_duration, renew_deadline=renew_deadline,
                        retry_period=retry_period, jeopardy_fraction=jeopardy_fraction)
