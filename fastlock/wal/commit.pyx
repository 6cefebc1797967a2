# cython: language_level=3, annotation_typing=False, nonecheck=True
"""Group commit on the event loop: batches, the one batch in flight, durability callbacks.

:class:`GroupCommit` collects the frames logged during a turn of the loop
into one batch, hands it to the :class:`~fastlock.wal.writer.SegmentWriter`
(at most one batch in flight; whatever is logged meanwhile forms the next),
and when the writer reports it done runs, in order, the listeners (with the
batch's bytes), the ``when_durable`` callbacks and the ``sync`` waiters whose
records are now durable.  In ``always`` mode a batch is fsynced when someone
waits on it; a batch nobody waits for (releases, expiries, acknowledged
without the disk) is only written and rides on the next fsync or the
interval timer.  A failed write or fsync is final: ``on_fatal`` is called
and nothing is acknowledged again (see :mod:`fastlock.wal`).

Compiled (Cython; its classes are extension types, declared in ``commit.pxd``, their
calls to one another C calls): what runs per record and per batch - a record's append, the hand-off to
the writer, the acknowledgement of a written batch - runs no Python frame.  The
annotations are for readers and ``commit.pyi``; they give no C types (first line).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

from ..errors import WalFatal
from ..tokens import COUNTER_MASK, TOKEN_EPOCH_SHIFT
from .records import GRANT, RELEASE, RESERVE
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_FromStringAndSize
from ._syncer cimport Batch, append_grant_record, append_lease_record, seal_batch
from ._syncer import append_frame
from .format import MAX_RECORD_BYTES

log = logging.getLogger("fastlock.wal")

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    cdef struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk_id, timespec *tp)
    int CLOCK_REALTIME

#: batches in a row, each with at most one waiter and none formed while a batch was on the writer
#: thread, before the auto writer syncs on the loop: one client waits alone (a lone client's pair
#: makes two, its grant's and its release's); clients that wait together, whose batches now and
#: then hold one waiter each, keep the thread
LONE_BATCHES = 8
cdef Py_ssize_t _LONE_BATCHES = LONE_BATCHES

cdef long long _COUNTER_MASK = COUNTER_MASK
cdef int _EPOCH_SHIFT = TOKEN_EPOCH_SHIFT
cdef int _GRANT = GRANT
cdef int _RELEASE = RELEASE
cdef object _RESERVE = RESERVE


cdef inline long long _wall_ms() noexcept:
    """:func:`fastlock.units.wall_ms` in C: the same clock (CLOCK_REALTIME, as ``time.time_ns``),
    integer milliseconds since the Unix epoch."""
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return <long long>ts.tv_sec * 1000 + ts.tv_nsec // 1000000


cdef class _Waiter:
    """A durability callback kept until the records logged before it are durable: ``lsn`` (the
    last of them), ``callback``, ``forcing``: the ``when_durable`` calls it stands for (1, and one
    more for each :meth:`GroupCommit.join_waiter`; 0: ``when_durable_later``'s, asking for no sync)."""

    cdef long long lsn
    cdef object callback
    cdef Py_ssize_t forcing


cdef class _Pending:
    """The batch being built: frames not yet handed to the writer."""


    def __init__(self, first_lsn: int):
        self.buf = bytearray()
        self.first_lsn = first_lsn  # LSN of the first record in buf
        self.last_frame = -1  # offset in buf of the last frame
        self.fsync = False  # the batch must be fsynced before its acks (epoch, reservation)
        self.fsync_requested = False  # fsync at the next hand-off even if nobody waits


cdef class Marks:
    """LSN progress: ``first`` (the next LSN at open), ``written`` to the OS,
    ``synced`` (fsynced), ``ack`` (durability callbacks released)."""


    def __init__(self, next_lsn: int):
        self.first = next_lsn
        self.written = self.synced = self.ack = next_lsn - 1


cdef class GroupCommit:
    """The loop side of the log's writes.

    :param io: the segment writer.
    :param always: ``fsync="always"`` (callbacks wait for an fsync) or not (for the write).
    :param interval_ms: fsync timer period (milliseconds); 0: no timer (``never``).
    :param on_fatal: called on the loop with the exception of a failed write or fsync.
    :param adaptive: sync a batch on the loop itself (not on the writer thread) when it and
        the :data:`LONE_BATCHES` - 1 batches before it each had at most one waiter and none of
        them formed while a batch was on the thread: one client waiting alone saves the two
        wake-ups of the hand-off; concurrent clients keep the thread (and the loop keeps
        reading them), also through a moment when only one of them waits.
    """


    def __init__(self, io: SegmentFile, always: bool, interval_ms: int, on_fatal: Callable[[BaseException], Any],
                 adaptive: bool = False):
        self.io = io
        self.always = always
        self.interval_ms = interval_ms
        self.on_fatal = on_fatal
        self.loop = None
        self.fatal = None
        self.stopped = False
        self.next_lsn = 1  # the LSN the next record gets
        self.marks = Marks(1)
        self._pending = _Pending(1)
        self._scheduled = False  # _kick_soon is scheduled on the loop (and has not run yet)
        self._flushed_in_turn = False  # flush_first wrote in this loop turn
        self._inflight = None
        self._waiters = collections.deque()  # _Waiter records, in LSN order
        self._last_waiter = None
        #: the waiters in ``_waiters`` that ask for a sync (``when_durable``'s; ``when_durable_later``'s do not)
        self._forcing = 0
        self._sync_waiters = []  # (lsn, future) resolved when synced >= lsn
        self.listeners = []
        self.progress = []  # fn(written_lsn, synced_lsn) after every batch (see add_progress_listener)
        self._timer = None
        self.adaptive = adaptive
        self._lone_batches = 0  # batches handed over in a row with at most one waiter, none concurrent
        self._after_thread = False  # the pending batch formed while a batch was on the thread
        #: the server (a ``fastlock.server._wire.BatchEnd``): the ``when_durable`` callbacks a written
        #: batch releases run as one batch of its, its ``in_batch_end`` set meanwhile, and its
        #: ``after_batch`` runs once after them when one of them left it owed (``batch_end_owed``:
        #: a delivery of grants whose replies wait for it); None: nothing around the callbacks
        self.batch_end = None

    def recovered(self, next_lsn: int) -> None:
        """The log on disk ends before ``next_lsn``: number from there."""
        self.next_lsn = next_lsn
        self._pending = _Pending(next_lsn)
        self.marks = Marks(next_lsn)

    def check(self) -> None:
        """:raises WalFatal: a write or fsync failed earlier."""
        if self.fatal is not None:
            raise WalFatal(f"write-ahead log failed earlier: {self.fatal!r}") from self.fatal

    @property
    def pending_bytes(self) -> int:
        return len(self._pending.buf)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Commit on ``loop`` from now on (starts the writer's thread and the fsync timer)."""
        self.loop = loop
        self.io.start(loop, self._thread_done, self._io_failed)
        if self.interval_ms:
            self._timer = loop.call_later(self.interval_ms / 1000.0, self._on_interval)
        if self._pending.buf or self._waiters:
            self._schedule_kick()

    def add(self, body: bytes, fsync: bool = False) -> None:
        """Append one record body as a frame of the pending batch (the next LSN);
        ``fsync``: the batch must be fsynced before its callbacks run.
        :raises ValueError: ``body`` is longer than ``MAX_RECORD_BYTES`` (nothing is logged)."""
        pending = self._pending
        pending.last_frame = append_frame(pending.buf, body, MAX_RECORD_BYTES)
        if fsync:
            pending.fsync = True
        self.next_lsn += 1
        self._schedule_kick()

    cpdef add_lease_record(self, kind: int, name: str, token: int, wall_ms: int):
        """:meth:`add` of the record ``[kind, name, token, wall_ms]`` (a RELEASE's, an EXPIRE's),
        encoded in C (:func:`~fastlock.wal._syncer.append_lease_record`): the same frame."""
        pending = self._pending
        pending.last_frame = append_lease_record(pending.buf, kind, name, token, wall_ms, MAX_RECORD_BYTES)
        self.next_lsn += 1
        self._schedule_kick()

    cpdef add_grant_record(self, kind: int, name: str, token: int, owner: bytes, ttl_ms: int, lock_delay_ms: int,
                           client_name: str | None, correlation_id: str | None, wall_ms: int):
        """:meth:`add` of a GRANT record of 9 fields, encoded in C
        (:func:`~fastlock.wal._syncer.append_grant_record`): the same frame.  Returns False,
        adding nothing, when a field is of a type only the general encoder writes."""
        pending = self._pending
        frame = append_grant_record(pending.buf, kind, name, token, owner, ttl_ms, lock_delay_ms, client_name,
                                    correlation_id, wall_ms, MAX_RECORD_BYTES)
        if frame < 0:
            return False
        pending.last_frame = frame
        self.next_lsn += 1
        self._schedule_kick()
        return True

    cdef inline void _schedule_kick(self):
        """Hand the pending batch over at the end of this loop turn (``_kick_soon``), unless that
        is scheduled already or a batch is in flight (its completion hands the next one over)."""
        if not self._scheduled and self._inflight is None and self.loop is not None:
            self._scheduled = True
            self.loop.call_soon(self._kick_soon)

    def _kick_soon(self) -> None:
        # one scheduled hand-off per loop turn at most: a batch written meanwhile by
        # flush_now leaves it pending, and what is logged after rides on it
        self._scheduled = False
        self._flushed_in_turn = False
        pending = self._pending
        if pending.buf or pending.fsync_requested:
            self._kick()

    cdef inline bint _lone_batch(self, bint concurrent, Py_ssize_t *run) noexcept:
        """Is a batch handed over now lone (synced on the loop by the auto writer)?  ``run``: set to
        the lone batches in a row counting it - one with at most one waiter, ``concurrent`` False
        (formed while no batch was on the thread), extends the run; any other starts it again."""
        if not concurrent and self._forcing + len(self._sync_waiters) <= 1:
            run[0] = self._lone_batches + 1
        else:
            run[0] = 0
        return (self.adaptive and run[0] >= _LONE_BATCHES
                and self.io.seg_size < self.io.segment_bytes)  # (no rotation due)

    cpdef _kick(self, bint concurrent=False):
        """Hand the pending batch to the writer (at most one in flight); ``concurrent``:
        it formed while a batch was on the thread (never synced on the loop then), as does
        a batch handed over after one the thread finished."""
        if self._inflight is not None or self.fatal is not None or self.stopped:
            return
        pending = self._pending
        buf = pending.buf
        if not buf and not pending.fsync_requested:
            return
        if self._after_thread:
            concurrent = True
            self._after_thread = False
        fsync = (pending.fsync or pending.fsync_requested
                or (self.always and bool(buf) and (self._forcing > 0 or bool(self._sync_waiters))))
        if buf:
            seal_batch(buf, pending.last_frame)  # batch marks on the first and last frames, their CRCs
        next_lsn = self.next_lsn
        # (Batch(bytes(buf), first_lsn, last_lsn, fsync), built without Python calls)
        cdef Batch batch = Batch.__new__(Batch)
        batch.data = PyBytes_FromStringAndSize(PyByteArray_AS_STRING(buf), PyByteArray_GET_SIZE(buf))
        batch.first_lsn = pending.first_lsn
        batch.last_lsn = next_lsn - 1
        batch.fsync = fsync
        # the next batch starts empty (as a new _Pending would)
        pending.buf = PyByteArray_FromStringAndSize(NULL, 0)
        pending.first_lsn = next_lsn
        pending.last_frame = -1
        pending.fsync = pending.fsync_requested = False
        self._inflight = batch
        # The thread earns its hand-off cost only when the batch blocks on the disk
        # (an fsync, or a rotation, which fsyncs); a write() to the page cache is done
        # here, so the relaxed modes acknowledge in the same loop turn.
        io = self.io
        lone = self._lone_batch(concurrent, &self._lone_batches)
        if (fsync or io.seg_size >= io.segment_bytes) and not lone and io.submit(batch):
            return
        try:
            # (the page-cache write or a lone batch's write and sync, compiled; any other batch:)
            if not (io.write_synced(batch) if fsync else io.write_cached(batch)):
                io.write(batch)
        except BaseException as exc:  # noqa: BLE001 - any write failure makes the log fatal (never acknowledged)
            self._io_failed(exc)
            return
        self._io_done(batch)

    def _thread_done(self, batch: Batch) -> None:
        # the batch was on the thread: clients wait together, so the next batch goes there too
        self._io_done(batch, concurrent=True)

    cpdef _io_done(self, Batch batch, bint concurrent=False):
        self._inflight = None
        if self.fatal is not None or self.stopped:
            return
        last = batch.last_lsn
        marks = self.marks
        marks.written = last
        if batch.fsync:
            marks.synced = last
        ack = marks.ack = marks.synced if self.always else last
        if batch.data:
            for fn in self.listeners:
                try:
                    fn(batch.first_lsn, last, batch.data)
                except Exception as exc:  # noqa: BLE001 - one failed listener must not stop the others
                    self._report(exc, "WAL listener failed")
        waiters = self._waiters
        owner = self.batch_end
        outer = True  # (no batch of callbacks opened here)
        cdef long long acked = ack
        cdef _Waiter entry
        if owner is not None and waiters and (<_Waiter>waiters[0]).lsn <= acked:
            outer = owner.in_batch_end
            owner.in_batch_end = True
        try:
            while waiters and (<_Waiter>waiters[0]).lsn <= acked:
                entry = <_Waiter>waiters.popleft()
                self._forcing -= entry.forcing
                cb = entry.callback
                try:
                    cb()
                except Exception as exc:  # noqa: BLE001 - reported; the other waiters still run
                    self._report(exc, "WAL when_durable callback failed")
        finally:
            if not outer:
                owner.in_batch_end = False
            if not waiters:
                self._last_waiter = None  # (keeps no callback that ran alive)
        if not outer and owner.batch_end_owed:  # the callbacks' batch end: their replies flushed
            try:
                owner.after_batch()
            except Exception as exc:  # noqa: BLE001 - reported as a failed callback would be
                self._report(exc, "WAL when_durable callback failed")
        if self._sync_waiters:
            synced = marks.synced
            keep = []
            for lsn, fut in self._sync_waiters:
                if lsn <= synced:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    keep.append((lsn, fut))
            self._sync_waiters = keep
        for fn in self.progress:
            try:
                fn(marks.written, marks.synced)
            except Exception as exc:  # noqa: BLE001 - reported; the other listeners still run
                self._report(exc, "WAL progress listener failed")
        if self._pending.buf or self._pending.fsync_requested:
            if not concurrent:
                self._kick()
            else:
                # a batch the thread finished: the next one is handed over at the end of this
                # loop turn, with the records of every request the turn reads (as the first
                # batch after an idle moment is), not with those read so far
                self._after_thread = True
                self._schedule_kick()

    def _report(self, exc: BaseException, message: str) -> None:
        if self.loop is None:  # not started: nobody else would hear of it
            log.error("%s", message, exc_info=exc)
        else:
            self.loop.call_exception_handler({"message": message, "exception": exc})

    def _io_failed(self, exc: BaseException) -> None:
        if self.fatal is not None or self.stopped:
            return
        self.fatal = exc
        self._inflight = None
        self._waiters.clear()  # never acknowledged
        self._forcing = 0
        self._cancel_timer()
        for _lsn, fut in self._sync_waiters:
            if not fut.done():
                fut.set_exception(WalFatal(f"write-ahead log failed: {exc!r}"))
        self._sync_waiters = []
        log.critical("write-ahead log stopped: %s", exc if isinstance(exc, OSError) else repr(exc))
        self.on_fatal(exc)

    def _on_interval(self) -> None:
        if self.loop is None:  # armed by start(), which sets the loop
            return
        self._timer = self.loop.call_later(self.interval_ms / 1000.0, self._on_interval)
        if self.marks.written > self.marks.synced or self._pending.buf:
            self._pending.fsync_requested = True
            self._schedule_kick()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    cpdef when_durable(self, callback: Callable[[], Any]):
        """See :meth:`fastlock.wal.WriteAheadLog.when_durable`."""
        if self._keep_waiter(callback, True):
            self._forcing += 1
            if self.always and self.next_lsn - 1 > self.marks.synced:
                self._pending.fsync_requested = True  # the records may be written already, unsynced
                self._schedule_kick()

    cpdef object pending_waiter(self):
        """The callback of the last :meth:`when_durable` waiter while every record it waits for is
        still pending (in the batch being built, not handed to the writer), else None.  Its
        caller may make that callback answer more (its own acknowledgements, after the ones it
        holds) and :meth:`join_waiter` instead of keeping a waiter of its own: the callback runs
        once, after the sync of the batch that holds both's records, as the two would."""
        if not self._waiters:
            return None
        cdef _Waiter last = self._last_waiter
        if last.forcing and last.lsn >= <long long>self._pending.first_lsn:
            return last.callback
        return None

    cpdef join_waiter(self):
        """The last waiter (:meth:`pending_waiter`'s) waits for the records logged so far too, as
        a :meth:`when_durable` would; it counts as one more waiter (``LONE_BATCHES``).
        :raises RuntimeError: there is no such waiter (nothing changed)."""
        if self.pending_waiter() is None:
            raise RuntimeError("GroupCommit.join_waiter: no when_durable waiter with pending records")
        cdef _Waiter last = self._last_waiter
        last.lsn = <long long>self.next_lsn - 1
        last.forcing += 1
        self._forcing += 1
        # (its batch's sync is asked for already - by the waiter's when_durable, in always mode -
        # and its hand-off scheduled by the records' add)

    cpdef when_durable_later(self, callback: Callable[[], Any]):
        """:meth:`when_durable` without asking for a sync: ``callback()`` runs on the loop once
        the records logged so far are durable, by the next sync something else asks for -- a
        :meth:`when_durable` waiter's batch, :meth:`request_sync`, :meth:`await_synced`, the
        interval timer (``interval_ms``, at the latest) or the close.  In the relaxed modes, as
        :meth:`when_durable`, once they are written.  For callbacks nobody waits on (the
        publication of a change history no watcher listens to): they cost no ``fdatasync``.

        :raises WalFatal: the log failed earlier (the callback is not kept).
        """
        self._keep_waiter(callback, False)

    cdef bint _keep_waiter(self, object callback, bint forcing) except -1:
        """Run ``callback`` soon if the records logged so far are durable and no waiter is ahead,
        else keep it with their last LSN (``forcing``: its batch asks for a sync).  Returns
        whether it was kept.  :raises WalFatal: the log failed earlier."""
        if self.fatal is not None:
            self.check()
        lsn = self.next_lsn - 1
        if lsn <= self.marks.ack and not self._waiters and self.loop is not None:
            self.loop.call_soon(callback)
            return False
        cdef _Waiter entry = _Waiter.__new__(_Waiter)
        entry.lsn = lsn
        entry.callback = callback
        entry.forcing = forcing
        self._waiters.append(entry)
        self._last_waiter = entry
        return True

    cpdef poll(self):
        """See :meth:`fastlock.wal.WriteAheadLog.poll`."""
        if self._inflight is not None:
            if self.io.job_finished():  # (one atomic load while the thread still works)
                self.io.poll_completed()
            return
        if not self._scheduled or self.fatal is not None or self.stopped:
            return
        pending = self._pending
        if not pending.buf:
            return
        # records logged since the last hand-off, whose hand-off waits for the end of this turn
        if self._flushed_in_turn:
            # a second batch end with records in one turn: clients are active together
            self._lone_batches = 0
            return
        cdef Py_ssize_t run
        if self._forcing + len(self._sync_waiters) == 1 and self._lone_batch(self._after_thread, &run):
            # the auto writer's lone client waits on these records: they are written (and synced)
            # at its batch end, not one loop turn later; a later batch end in this turn waits for
            # the turn's end.  (Records nobody waits on, a release's, are written after the
            # replies, at the turn's end.)
            self._flushed_in_turn = True
            self._kick()

    def request_sync(self) -> None:
        """Fsync at the next hand-off, whatever the mode (without waiting for it)."""
        if self.fatal is None:
            self._pending.fsync_requested = True
            self._schedule_kick()

    cpdef bint flush_now(self) except -1:
        """See :meth:`fastlock.wal.WriteAheadLog.flush_now`."""
        if self.fatal is not None:
            self.check()
        pending = self._pending
        if (self.always or self._inflight is not None or self.stopped or self.loop is None
                or pending.fsync or pending.fsync_requested or self.io.seg_size >= self.io.segment_bytes):
            return False
        if pending.buf:
            self._kick()
        return self.fatal is None and self.marks.ack >= self.next_lsn - 1

    cpdef bint flush_first(self) except -1:
        """See :meth:`fastlock.wal.WriteAheadLog.flush_first`."""
        if self._flushed_in_turn or not self._scheduled:
            return False
        if self.flush_now():
            self._flushed_in_turn = True  # until _kick_soon, at the end of this turn
            return True
        return False

    async def await_synced(self, lsn: int, force: bool) -> None:
        """Wait until records up to ``lsn`` are fsynced; ``force``: fsync now.

        :raises WalFatal: the log failed.
        :raises RuntimeError: :meth:`start` was not called.
        """
        self.check()
        if lsn <= self.marks.synced:
            return
        if self.loop is None:
            raise RuntimeError("WriteAheadLog.start() was not called")
        fut = self.loop.create_future()
        self._sync_waiters.append((lsn, fut))
        if force:
            self._pending.fsync_requested = True
            self._schedule_kick()
        await fut

    async def flush(self) -> None:
        """Write and fsync everything logged (at close); without :meth:`start`, inline.

        :raises WalFatal: the log failed.
        """
        self._cancel_timer()
        if self.fatal is not None:
            return
        if self.loop is None:
            self._pending.fsync_requested = True
            self.loop = asyncio.get_running_loop()
            self._kick()
        else:
            await self.await_synced(self.next_lsn - 1, force=True)

    def stop(self, drop: bool = False) -> None:
        """Stop committing (``drop``: forget what is pending and every callback)."""
        self._cancel_timer()
        if drop:
            self._waiters.clear()
            self._forcing = 0
            self._pending = _Pending(self.next_lsn)
        self.stopped = True
        self.io.stop(trim=not drop and self.fatal is None)


cdef class Reservation:
    """The fencing-counter bookkeeping of the log: the highest ``epoch`` and counter
    (``max_counter``) logged, and (``interval``/``never``) the counter ``reserved`` by
    RESERVE records, ``block`` values ahead at a time (ints, as C integers of 64 bits)."""

    def __init__(self, block: int):
        self.block = block
        self.reserved = 0
        self.max_counter = 0
        self.epoch = 0


cdef class LogAppender:
    """The compiled base of :class:`fastlock.wal.log.WriteAheadLog`: the two records every
    acquire+release pair logs (:meth:`log_grant`, :meth:`log_release`), encoded in C into the
    pending batch of ``_commit`` (the :class:`GroupCommit`).  ``_counters``: the
    :class:`Reservation`; ``_always``: ``fsync="always"``; ``appending``: the log is open
    (recovered, not closed).  A record these do not encode in C (a shared lease's, a
    semaphore permit's, a field of another type) and every error go through the log's
    ``_append``, as every other record does.  ``lease_observer``: None, or an object whose
    ``granted(name, token, owner)`` and ``ended(name, token)`` are called after each grant and
    release logged here (the metrics' hold and time-to-acquire histograms,
    :mod:`fastlock.observe`)."""


    def log_grant(self, name, token, owner, ttl_ms, lock_delay_ms, client_name, correlation_id,
                  shared=False, limit=0):
        """Log a grant of ``name`` (str) with fencing ``token`` (int; ``ttl_ms``/``lock_delay_ms``
        in milliseconds, ``owner``: the owner key's hash, bytes; ``client_name``,
        ``correlation_id``: str or None); ``shared``: a shared lease, ``limit``: a semaphore
        permit's limit (0: a lock).

        In ``interval``/``never`` mode, a counter beyond the reservation first logs a
        RESERVE record and makes this batch wait for an fsync.
        :raises WalFatal: after a failed write/fsync.  :raises TypeError: unencodable field.
        :raises OverflowError: ``token`` beyond 64 bits (nothing logged).
        """
        self.append_grant(name, token, owner, ttl_ms, lock_delay_ms, client_name, correlation_id, shared, limit)

    cdef int append_grant(self, object name, object token, object owner, object ttl_ms, object lock_delay_ms,
                   object client_name, object correlation_id, object shared, object limit) except -1:
        """:meth:`log_grant`, a C call for the batch end (``fastlock.server._wire.BatchEnd``)."""
        cdef Reservation c = self._counters
        cdef long long t = token
        cdef long long counter = t & _COUNTER_MASK
        cdef long long ep = t >> _EPOCH_SHIFT
        cdef GroupCommit commit = self._commit
        if counter > c.max_counter:
            c.max_counter = counter
        if ep > c.epoch:
            c.epoch = ep
        if counter > c.reserved and not self._always:
            c.reserved = counter + c.block
            self._append([_RESERVE, c.reserved, _wall_ms()], fsync=True)
        if shared or limit:
            self._append([_GRANT, name, token, owner, ttl_ms, lock_delay_ms, client_name, correlation_id,
                          _wall_ms(), shared, limit])
        elif (commit.fatal is not None or not self.appending or type(owner) is not bytes
              or not commit.add_grant_record(_GRANT, name, token, owner, ttl_ms, lock_delay_ms, client_name,
                                             correlation_id, _wall_ms())):
            self._append([_GRANT, name, token, owner, ttl_ms, lock_delay_ms, client_name, correlation_id,
                          _wall_ms()])
        if self.lease_observer is not None:
            self.lease_observer.granted(name, token, owner)
        return 0

    def log_release(self, name, token):
        """Log that the holder with ``token`` (int) released ``name`` (str)."""
        self.append_release(name, token)

    cdef int append_release(self, object name, object token) except -1:
        """:meth:`log_release`, a C call for a release's bookkeeping (``BatchEnd.released``)."""
        cdef GroupCommit commit = self._commit
        if commit.fatal is None and self.appending and type(name) is str:  # encoded in C
            commit.add_lease_record(_RELEASE, name, token, _wall_ms())
        else:
            self._append([_RELEASE, name, token, _wall_ms()])
        if self.lease_observer is not None:
            self.lease_observer.ended(name, token)
        return 0
