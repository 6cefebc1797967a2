"""What the Prometheus histograms and the contention top-K count, observed on the loop.

:class:`Observer` is installed on a running server only with ``--metrics``
(:class:`fastlock.metrics.MetricsExporter`): it wraps the server's op handlers
(``Handlers.by_op``) and the WAL's ``log_grant`` / ``log_release`` / ``log_expire`` /
``log_revoke`` on those objects, so a server without metrics runs none of this.

Every histogram is a :class:`Log2Histogram`: power-of-two buckets of microseconds, so an
observation is a ``bit_length`` and one list increment - no search, no lock (the loop
is the only writer; a scrape on prometheus_client's thread reads a copy).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import protocol as P
from .auth import hash_owner
from .errors import LockNotAcquired

__all__ = ["Log2Histogram", "Observer", "TOP_CONTENDED"]

#: the most locks ``fastlock_lock_contention`` shows (the label's cardinality bound)
TOP_CONTENDED = 10
#: the most locks whose contention score is remembered between refreshes
_TRACKED = 10 * TOP_CONTENDED
#: the most queued acquires whose arrival time is kept for time-to-acquire
_MAX_PENDING = 100_000
#: the most leases whose grant time is kept for the hold time
_MAX_GRANTED = 1_000_000

_BUCKETS = 25  # upper bounds 1 µs, 2 µs, ... 2**23 µs (8.4 s), then +Inf


class Log2Histogram:
    """Counts of durations in power-of-two microsecond buckets (``le`` = 1 µs .. 2**23 µs, +Inf)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (_BUCKETS + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        """Count one duration (seconds)."""
        i = int(seconds * 1e6).bit_length()  # 0 µs -> bucket 0 (le 1 µs); 2**k.. µs -> k+1
        self.counts[i if i <= _BUCKETS else _BUCKETS] += 1
        self.sum += seconds

    def copy(self) -> Log2Histogram:
        """A copy (its counts no longer change with this one's)."""
        other = Log2Histogram()
        other.counts = list(self.counts)
        other.sum = self.sum
        return other

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative ``(le, count)`` pairs as Prometheus wants them (``le`` in seconds)."""
        out = []
        total = 0
        for i, c in enumerate(self.counts[:_BUCKETS]):
            total += c
            out.append((repr((1 << i) / 1e6), total))
        out.append(("+Inf", total + self.counts[_BUCKETS]))
        return out


class Observer:
    """The loop-side counting behind the histograms and the contention top-K of ``server``
    (a :class:`~fastlock.server.LockServer`)."""

    def __init__(self, server: Any):
        self.server = server
        self.requests: dict[str, Log2Histogram] = {}
        self.time_to_acquire = Log2Histogram()
        self.hold = Log2Histogram()
        self.fsync = Log2Histogram()
        #: (name, owner hash) -> perf_counter() at the arrival of an acquire that queued
        self.pending: dict[tuple[str, bytes], float] = {}
        #: (name, token) -> perf_counter() at its grant (fresh grants only)
        self.granted_at: dict[tuple[str, int], float] = {}
        self.contended: dict[str, int] = {}
        self.scores: dict[str, float] = {}
        handlers = server.handlers
        for op, (handler, fewest, most) in list(handlers.by_op.items()):
            hist = self.requests[P.OP_NAMES[op]] = Log2Histogram()
            wrapped = self._acquire(handler, hist) if op == P.OP_ACQUIRE else self._timed(handler, hist)
            handlers.by_op[op] = (wrapped, fewest, most)
        self._wrap_wal(server.wal)

    # -- requests -------------------------------------------------------------------------
    @staticmethod
    def _timed(handler: Callable, hist: Log2Histogram) -> Callable:
        """``handler``, timed into ``hist`` (inlined :meth:`Log2Histogram.observe`: this runs per request).
        A request the handler refuses (raises) is not timed."""
        clock = time.perf_counter
        counts = hist.counts

        def timed(conn: Any, req_id: int, msg: list) -> None:
            started = clock()
            handler(conn, req_id, msg)
            took = clock() - started
            i = int(took * 1e6).bit_length()
            counts[i if i <= _BUCKETS else _BUCKETS] += 1
            hist.sum += took

        return timed

    def _acquire(self, handler: Callable, hist: Log2Histogram) -> Callable:
        clock = time.perf_counter
        table = self.server.table
        pending = self.pending
        contended = self.contended
        ttl_hist = self.time_to_acquire

        def acquire(conn: Any, req_id: int, msg: list) -> None:
            started = clock()
            queued = table.waiter_count
            refused = False
            try:
                handler(conn, req_id, msg)
            except LockNotAcquired:
                refused = True
                raise
            finally:
                now = clock()
                hist.observe(now - started)
                name = msg[2]
                if refused or table.waiter_count > queued:  # it had to wait, or was refused: contention
                    contended[name] = contended.get(name, 0) + 1
                    if not refused and len(pending) < _MAX_PENDING:
                        pending[(name, hash_owner(msg[3]))] = started
                elif not refused:
                    ttl_hist.observe(now - started)

        return acquire

    # -- leases -------------------------------------------------------------------------------
    def _wrap_wal(self, wal: Any) -> None:
        """Time each lease from its grant's record to its release's, expiry's or revocation's: the
        log's compiled appends call :meth:`granted` and :meth:`ended` (its ``lease_observer``), and
        ``log_expire`` / ``log_revoke`` are wrapped."""
        wal.lease_observer = self
        ended = self.ended
        log_expire, log_revoke = wal.log_expire, wal.log_revoke

        def expired(name: str, token: int, *rest: Any) -> None:
            log_expire(name, token, *rest)
            ended(name, token)

        def revoked(name: str, token: int, *rest: Any) -> None:
            log_revoke(name, token, *rest)
            ended(name, token)

        wal.log_expire = expired
        wal.log_revoke = revoked

    def granted(self, name: str, token: int, owner: bytes) -> None:
        """A grant of ``name`` with ``token`` to the owner key hash ``owner`` was logged: its time
        to acquire (from the request's arrival) is observed and its hold starts."""
        now = time.perf_counter()
        arrived = self.pending.pop((name, owner), None)
        if arrived is not None:
            self.time_to_acquire.observe(now - arrived)
        if len(self.granted_at) < _MAX_GRANTED:
            self.granted_at[(name, token)] = now

    def ended(self, name: str, token: int) -> None:
        """The lease of ``name`` with ``token`` ended (released, expired, revoked): its hold is observed."""
        since = self.granted_at.pop((name, token), None)
        if since is not None:
            self.hold.observe(time.perf_counter() - since)

    # -- once per refresh -------------------------------------------------------------------
    def refresh(self) -> None:
        """Take the writer's fsync durations; decay and trim the contention scores."""
        for seconds in self.server.wal.take_fsync_seconds():
            self.fsync.observe(seconds)
        scores = self.scores
        for name in scores:
            scores[name] /= 2
        for name, n in self.contended.items():
            scores[name] = scores.get(name, 0.0) + n
        self.contended.clear()
        if len(scores) > _TRACKED:
            keep = heapq.nlargest(_TRACKED, scores.items(), key=lambda kv: kv[1])
            self.scores = dict(keep)
        if len(self.pending) >= _MAX_PENDING:  # waiters that timed out or were cancelled: start again
            self.pending.clear()
        if len(self.granted_at) >= _MAX_GRANTED:  # leases ended without a record (a promotion): start again
            self.granted_at.clear()

    def top_contended(self) -> list[tuple[str, float]]:
        """The :data:`TOP_CONTENDED` highest contention scores, highest first (scores below 0.01 dropped)."""
        return [kv for kv in heapq.nlargest(TOP_CONTENDED, list(self.scores.items()), key=lambda kv: kv[1])
                if kv[1] >= 0.01]

    def frozen_histograms(self) -> list[tuple[str, str, list[str], list[tuple[list[str], Log2Histogram]]]]:
        """:meth:`histograms` with a copy of each histogram, for another thread to read."""
        return [(name, doc, labels, [(values, hist.copy()) for values, hist in hists])
                for name, doc, labels, hists in self.histograms()]

    def histograms(self) -> Iterator[tuple[str, str, list[str], list[tuple[list[str], Log2Histogram]]]]:
        """``(metric name, help, label names, [(label values, histogram)])`` of every histogram."""
        yield ("fastlock_request_seconds", "Time to handle a request on the event loop, per op", ["op"],
               [([op], h) for op, h in sorted(self.requests.items())])
        yield ("fastlock_time_to_acquire_seconds",
               "Acquire request arrival to grant decision (queue time included; the fsync before the "
               "reply is in fastlock_wal_fsync_seconds)", [], [([], self.time_to_acquire)])
        yield ("fastlock_hold_seconds", "Lease grant to release, expiry or revocation", [], [([], self.hold)])
        yield ("fastlock_wal_fsync_seconds", "Duration of one WAL data fsync", [], [([], self.fsync)])

