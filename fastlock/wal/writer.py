"""The segment writer: the one owner of the active segment's file descriptor.

It writes each batch the loop hands it (:class:`Batch`) at the segment's
write offset (``pwrite``), makes it durable with ``fdatasync`` when the batch
asks, rotates to a new segment once the active one holds ``segment_bytes``
(syncing the old one first, so only the last segment can have an unsynced
tail), and counts bytes, batches and fsyncs.

Preallocation: a segment is zero-filled (and synced) ahead of the write
offset in steps of :data:`PREALLOC_STEP` (up to ``segment_bytes``), so a
durable batch overwrites blocks that already exist and its ``fdatasync``
writes data pages only -- no block allocation, no size change, no journal
commit.  A batch that goes past the zero-filled space simply extends the file;
``fdatasync`` then also persists the new size (it writes the metadata needed
to read the data back, which includes ``st_size``), so nothing is weaker
there either.  The zero-filled tail is cut back to the last record at
rotation and at a clean close (``ftruncate`` + ``fsync``); after a crash,
recovery treats zeros after the last record as the end of the log
(:mod:`fastlock.wal.format`).

With ``threaded=True`` a thread does the blocking writes and syncs: the
compiled :class:`~fastlock.wal._syncer.Syncer` runs its loop without the GIL
and reports each completion through an eventfd (a pipe where there is none)
that the event loop watches with ``add_reader`` -- one thread wake-up and one
loop wake-up per batch.  The zero-fill of the next step runs on that thread
after the completion is reported; a batch the loop writes itself meanwhile
first waits until those zeros are written (not synced), so they can never
overwrite a record.  The loop still writes a batch itself when
it needs neither a sync nor a rotation (a write into the page cache costs
less than the hand-off).  :class:`SegmentList` is the list of segments on
disk, shared with compaction and with readers of the log.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from ._syncer import COMPILED_DISK, Batch, SegmentFile, Syncer
from .files import FILE_MODE, DirectoryLock, fsync_dir, io_error
from .format import SEG_HEADER, seg_header, seg_name

log = logging.getLogger(__name__)

#: zero-fill errors that only mean "no room to preallocate" (preallocation stops; records go on)
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

#: zero-fill a segment this many bytes ahead of its write offset (bytes)
PREALLOC_STEP = 1 << 20


def _io(op: str, path: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; its OSError raised as :func:`io_error` naming ``op`` and ``path``."""
    try:
        return fn(*args)
    except OSError as exc:
        raise io_error(op, path, exc) from exc


class SegmentList:
    """``(first_lsn, path)`` of every segment on disk, oldest first; thread-safe."""

    def __init__(self, items: list[tuple[int, str]]):
        self._lock = threading.Lock()
        self._items = list(items)

    def reset(self, items: list[tuple[int, str]]) -> None:
        """Replace the list (recovery found these segments)."""
        with self._lock:
            self._items = list(items)

    def copy(self) -> list[tuple[int, str]]:
        with self._lock:
            return list(self._items)

    def oldest(self) -> int | None:
        """The first LSN of the oldest segment, or None if there is none."""
        with self._lock:
            return self._items[0][0] if self._items else None

    def __len__(self) -> int:
        return len(self._items)

    def append(self, first_lsn: int, path: str) -> None:
        with self._lock:
            self._items.append((first_lsn, path))

    def drop_last_if(self, first_lsn: int) -> bool:
        """Forget the last segment if it starts at ``first_lsn`` (an empty one to start afresh)."""
        with self._lock:
            if self._items and self._items[-1][0] == first_lsn:
                self._items.pop()
                return True
            return False

    def remove_covered(self, cover: int) -> list[tuple[int, str]]:
        """Forget (and return) the segments whose records are all <= ``cover``,
        never the active (last) one."""
        with self._lock:
            segs = self._items
            i = 0
            while i + 1 < len(segs) and segs[i + 1][0] <= cover + 1:
                i += 1
            doomed = segs[:i]
            del segs[:i]
            return doomed


class SyncResult(NamedTuple):
    """How the writer thread's job ended (``_syncer.Syncer.take_result``)."""

    errno: int  #: 0: done
    operation: str | None  #: the operation that failed (``"pwrite"``, ``"fdatasync"``, ...), None if none did
    fdatasync_seconds: float  #: how long the job's fdatasync took (seconds; -1.0: none ran)
    error: BaseException | None  #: what a call job (a Python function run on the thread) raised


class FinishedJob(NamedTuple):
    """A batch the writer thread is done with, and how it ended."""

    batch: Batch
    result: SyncResult


class SegmentWriter(SegmentFile):
    """Writes batches to numbered segments in ``directory``.

    :param directory: the data directory.
    :param segment_bytes: rotate once the active segment holds this many bytes.
    :param segments: the segments on disk (the writer appends the ones it creates).
    :param threaded: do syncs and rotations on a writer thread (see :meth:`start`).
    :param preallocate: zero-fill segments ahead of the write offset (see the module docstring).

    Every method except :meth:`start`, :meth:`submit` and :meth:`stop` runs on
    whoever does the I/O: the writer thread, or the loop when no thread runs.  The state
    every batch changes is kept in the slots of the compiled base
    (:class:`~fastlock.wal._syncer.SegmentFile`), whose ``write_cached`` is :meth:`write`
    compiled for a batch written to the page cache (group commit's common case) and
    ``write_synced`` for a durable batch the loop writes and syncs itself (a lone client's);
    :meth:`write` does every other batch (a rotation, a preallocation step, test disks).
    """

    def __init__(self, directory: str, segment_bytes: int, segments: SegmentList, threaded: bool,
                 preallocate: bool = True):
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.segments = segments
        self.threaded = threaded
        self.preallocate = preallocate
        self.prealloc_step = PREALLOC_STEP  # (bytes; read here, so a test may change the module's)
        self._fd = -1
        self.seg_first = 0  # first LSN of the active segment
        self.seg_path = ""
        self.seg_size = 0  # bytes written to the active segment (its write offset)
        self.alloc_end = 0  # the active segment's zero-filled (or written) bytes
        self.durable_offset = 0  # bytes of the active segment known synced
        self._dirty = False
        self.bytes = 0  # written since open
        self.fsyncs = 0  # data fsyncs, incl. rotation and segment creation
        self.thread_fsyncs = 0  # of them, batches the writer thread synced (the others: on the loop)
        #: the latest data fsyncs' durations (seconds), for the metrics (WriteAheadLog.take_fsync_seconds)
        self.fsync_seconds: collections.deque[float] = collections.deque(maxlen=4096)
        self.batches = 0
        self._worker: WriterThread | None = None
        self._on_done: Callable[[Batch], Any] | None = None  # the thread's reports (see start)
        self._on_failed: Callable[[BaseException], Any] | None = None
        self._dir_lock: DirectoryLock | None = None
        #: the I/O primitives (``pwrite_all``, ``datasync``, ``zero_fill``): the compiled ones;
        #: tests substitute slow or failing ones, and the thread then runs :meth:`write` for them
        self.disk: Any = COMPILED_DISK

    def lock_directory(self) -> None:
        """Take the data directory's lock (held until :meth:`stop`).

        :raises DataDirInUse: another process holds it.
        """
        self._dir_lock = DirectoryLock(self.directory)

    def release_directory(self) -> None:
        if self._dir_lock is not None:
            self._dir_lock.release()
            self._dir_lock = None

    def open_segment(self, first_lsn: int) -> None:
        """Create and switch to a new segment starting at ``first_lsn`` (header, first
        preallocation step, fsync of the file and of the directory).

        :raises OSError: the create, a write or an fsync failed (:func:`io_error`).
        """
        path = os.path.join(self.directory, seg_name(first_lsn))
        if self.segments.drop_last_if(first_lsn):
            os.unlink(path)  # an empty segment left by a previous open(): start it afresh
        fd = _io("open", path, os.open, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, FILE_MODE)
        hs = SEG_HEADER.size
        try:
            _io("pwrite", path, self.disk.pwrite_all, fd, seg_header(first_lsn), 0)
            zero_to = self._zero_range(hs, hs)[1]
            if zero_to and not self._zero_fill(fd, path, hs, zero_to):
                zero_to = hs
            _io("fsync", path, os.fsync, fd)  # the header, the zeros and the new file's size
            _io("fsync", self.directory, fsync_dir, self.directory)
        except BaseException:
            os.close(fd)
            raise
        self.fsyncs += 1
        self._fd = fd
        self.seg_first = first_lsn
        self.seg_path = path
        self.seg_size = self.durable_offset = hs
        self.alloc_end = max(hs, zero_to)
        self._dirty = False
        self.segments.append(first_lsn, path)

    def _zero_range(self, offset: int, alloc_end: int) -> tuple[int, int]:
        """``(start, end)`` to zero-fill once the write offset is ``offset``: up to the
        next step boundary at least half a step ahead, when less than half a step is
        left; never past ``segment_bytes``."""
        if not self.preallocate:
            return 0, 0
        step = self.prealloc_step
        start = max(offset, alloc_end)
        half = step // 2
        if start - offset >= half:
            return 0, 0
        end = min(-(-(offset + half) // step) * step, self.segment_bytes)
        return (start, end) if end > start else (0, 0)

    def write(self, batch: Batch) -> None:
        """Write (and, if ``batch.fsync``, fdatasync) one batch; rotate first if due.
        After a sync, zero-fill the next step if one is due.

        :raises OSError: a write or sync failed (the log must stop: see :mod:`fastlock.wal`);
            its text names the operation and the segment file (:func:`io_error`).
        """
        data = batch.data
        if data:
            if self.seg_size >= self.segment_bytes and batch.first_lsn > self.seg_first:
                self._rotate(batch.first_lsn)
            if self._worker is not None:  # zeros being written where this batch goes must land first
                self._worker.syncer.wait_fill()
            try:
                self.disk.pwrite_all(self._fd, data, self.seg_size)
            except OSError as exc:
                self.cut_failed_batch()
                raise io_error("pwrite", self.seg_path, exc) from exc
            self.seg_size += len(data)
            self.alloc_end = max(self.alloc_end, self.seg_size)
            self.bytes += len(data)
            self.batches += 1
            self._dirty = True
        if batch.fsync and self._dirty:
            try:
                self._fsync()
            except OSError:
                self.seg_size -= len(data)
                self.cut_failed_batch()
                raise
            start, end = self._zero_range(self.seg_size, self.alloc_end)
            if end and self._zero_fill(self._fd, self.seg_path, start, end):
                _io("fdatasync", self.seg_path, self.disk.datasync, self._fd)
                self.alloc_end = end

    def cut_failed_batch(self) -> None:
        """After a batch's write or sync failed: cut the segment back to where the batch began
        (``seg_size``), so that recovery cannot replay a record of it -- a grant nobody was
        told of would come back held until its TTL.  The failure stays fatal; a cut that
        fails too is logged (those grants may then come back)."""
        try:
            os.ftruncate(self._fd, self.seg_size)
            self.disk.datasync(self._fd)
        except OSError as exc:
            log.error("WAL: the failed batch could not be cut from %s (%s): its grants, never "
                      "acknowledged, may be recovered and held until their TTL", self.seg_path, exc)
            return
        self.alloc_end = self.durable_offset = self.seg_size

    def _zero_fill(self, fd: int, path: str, start: int, end: int) -> bool:
        """Zero-fill ``[start, end)`` of ``fd``.  If the file system has no room for it,
        cut the file back to ``start`` (the records before it are untouched; the space
        goes back to them), preallocate no more and return False: a record's own write
        still reports ENOSPC when the records themselves do not fit.

        :raises OSError: any other failure of the write or of the cut (:func:`io_error`).
        """
        try:
            self.disk.zero_fill(fd, start, end)
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise io_error("zero-fill", path, exc) from exc
            _io("ftruncate", path, os.ftruncate, fd, start)
            self._stop_preallocating(exc.errno)
            return False
        return True

    def _stop_preallocating(self, err: int) -> None:
        if self.preallocate:
            self.preallocate = False
            log.warning("WAL preallocation stopped: no room on the file system (%s) in %s; "
                        "records are appended and synced as before", os.strerror(err), self.directory)

    def _fsync(self) -> None:
        # fdatasync: within the zero-filled space only data pages change; past it,
        # fdatasync also writes the new size (needed to read the data back)
        seconds = _io("fdatasync", self.seg_path, self.disk.datasync, self._fd)
        self.fsyncs += 1  # counted before its duration is shown: a reader of both sees count >= durations
        self.fsync_seconds.append(seconds)
        self._dirty = False
        self.durable_offset = self.seg_size

    def _trim(self) -> None:
        """Cut the zero-filled space after the last record and fsync (size included)."""
        if self.alloc_end > self.seg_size:
            _io("ftruncate", self.seg_path, os.ftruncate, self._fd, self.seg_size)
            _io("fsync", self.seg_path, os.fsync, self._fd)
            self.alloc_end = self.seg_size
            self._dirty = False
            self.durable_offset = self.seg_size
        elif self._dirty:
            self._fsync()

    def _rotate(self, first_lsn: int) -> None:
        self._trim()
        os.close(self._fd)
        self._fd = -1
        self.open_segment(first_lsn)

    # -- the thread ------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_done: Callable[[Batch], Any],
              on_failed: Callable[[BaseException], Any]) -> None:
        """Start the writer thread (when ``threaded``): it reports each batch done with
        ``on_done(batch)`` or a failure with ``on_failed(exc)``, on ``loop``; after a
        failure nothing more is submitted."""
        if not self.threaded:
            return
        self._on_done, self._on_failed = on_done, on_failed
        self._worker = WriterThread(loop, self._on_wake)
        self.fill = self._worker.syncer  # (write_cached and write_synced wait for its zero-fill)

    def submit(self, batch: Batch) -> bool:
        """Hand ``batch`` to the thread if it blocks on the disk (a sync or a rotation)
        and the thread runs; return False if the caller must :meth:`write` it itself
        (also when there is nothing to sync)."""
        worker = self._worker
        if worker is None or worker.job is not None:
            return False
        data = batch.data
        if (data and self.seg_size >= self.segment_bytes and batch.first_lsn > self.seg_first
                or self.disk is not COMPILED_DISK):
            worker.job, worker.job_call = batch, True
            worker.syncer.submit_call(lambda: self.write(batch))
            return True
        if not batch.fsync or not (data or self._dirty):
            return False
        if worker.syncer.zero_full:
            self._stop_preallocating(errno.ENOSPC)
        end = self.seg_size + len(data)
        start, stop = self._zero_range(end, max(self.alloc_end, end))
        worker.job, worker.job_call, worker.job_zero_end = batch, False, stop
        worker.syncer.submit(self._fd, data, self.seg_size, True, start, stop)
        return True

    def poll_completed(self) -> None:
        """Report a batch the thread has finished now, without waiting for its wake-up
        (the loop calls this between requests: the next batch is handed over sooner)."""
        worker = self._worker
        if worker is not None:
            self._completed(worker.poll())

    def _on_wake(self) -> None:
        worker = self._worker
        if worker is not None:
            self._completed(worker.take())

    def _completed(self, done: FinishedJob | None) -> None:
        """Account for a batch the thread finished and report it on the loop."""
        worker = self._worker
        on_done, on_failed = self._on_done, self._on_failed
        if worker is None or done is None or on_done is None or on_failed is None:
            return
        batch, result = done
        exc = result.error
        if result.errno:
            exc = io_error(result.operation or "write", self.seg_path, result.errno)
            if not worker.job_call:  # (a call job is SegmentWriter.write, which cuts for itself)
                self.cut_failed_batch()
        if exc is not None:
            on_failed(exc)
            return
        if not worker.job_call:
            n = len(batch.data)
            if n:
                self.seg_size += n
                self.bytes += n
                self.batches += 1
            self.alloc_end = max(self.alloc_end, self.seg_size, worker.job_zero_end)
            self.fsyncs += 1
            self.thread_fsyncs += 1
            self.fsync_seconds.append(result.fdatasync_seconds)
            self._dirty = False
            self.durable_offset = self.seg_size
        on_done(batch)

    def stop(self, trim: bool = False) -> None:
        """Stop the thread (after the job it is doing), close the segment, release the
        directory; ``trim``: first cut the zero-filled space after the last record
        (a clean close: everything is synced)."""
        if self._worker is not None:
            self.fill = None
            self._worker.stop()
            self._worker = None
        if self._fd >= 0:
            try:
                if trim:
                    self._trim()
            finally:
                os.close(self._fd)
                self._fd = -1
        self.release_directory()


class WriterThread:
    """The writer thread of a :class:`SegmentWriter` and its one job slot.

    The thread runs :meth:`Syncer.run <fastlock.wal._syncer.Syncer.run>` (compiled,
    without the GIL); it signals each finished job on an eventfd (a pipe where
    there is none) that ``loop`` watches: ``on_wake()`` then runs on the loop and
    collects the outcome with :meth:`take`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_wake: Callable[[], Any]):
        if hasattr(os, "eventfd"):
            self.wake_r = self.wake_w = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        else:  # pragma: no cover - platforms without eventfd (macOS)
            self.wake_r, self.wake_w = os.pipe()
            for fd in (self.wake_r, self.wake_w):
                os.set_blocking(fd, False)
        self.loop = loop
        self.syncer = Syncer(self.wake_w)
        self.job: Batch | None = None  # the batch in the slot
        self.job_call = False  # ... handed as a call (a rotation), accounted by SegmentWriter.write
        self.job_zero_end = 0  # ... and the end of the zero-fill the thread does after it
        loop.add_reader(self.wake_r, on_wake)
        self.thread = threading.Thread(target=self.syncer.run, name="fastlock-wal", daemon=True)
        self.thread.start()

    def take(self) -> FinishedJob | None:
        """The finished job, or None (a spurious wake-up: the job is still running, or :meth:`poll` took it);
        empties the slot."""
        try:
            os.read(self.wake_r, 4096)
        except BlockingIOError:
            return None
        return self._take_job()

    def poll(self) -> FinishedJob | None:
        """:meth:`take` without waiting for the wake-up: the finished job, if the thread is
        done with it (its wake-up, when it comes, is then a spurious one)."""
        if self.job is None or not self.syncer.done:
            return None
        try:
            os.read(self.wake_r, 4096)
        except BlockingIOError:
            pass  # the thread has not written it yet
        return self._take_job()

    def _take_job(self) -> FinishedJob | None:
        batch = self.job
        result = self.syncer.take_result() if batch is not None else None
        if batch is None or result is None:
            return None
        self.job = None
        return FinishedJob(batch, SyncResult(*result))

    def stop(self) -> None:
        """Stop the thread after the job it is doing; stop watching and close the wake-up fds."""
        self.syncer.stop()
        if self.thread is not threading.current_thread():
            self.thread.join()
        if not self.loop.is_closed():
            self.loop.remove_reader(self.wake_r)
        for fd in {self.wake_r, self.wake_w}:
            os.close(fd)
        self.job = None

