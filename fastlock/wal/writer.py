"""The segment writer: the one owner of the active segment's file descriptor.

It writes each batch the loop hands it (:class:`Batch`), fsyncs it when the
batch asks, rotates to a new segment once the active one holds
``segment_bytes`` (fsyncing the old one first, so only the last segment can
have an unsynced tail), and counts bytes, batches and fsyncs.  With
``threaded=True`` it runs a thread that does the blocking writes and fsyncs
(both release the GIL) and reports each completion on the loop with
``call_soon_threadsafe``; the loop still writes a batch itself when it needs
neither an fsync nor a rotation (a ``write()`` into the page cache costs less
than the hand-off).  :class:`SegmentList` is the list of segments on disk,
shared with compaction and with readers of the log.
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from .files import FILE_MODE, DirectoryLock, fsync_dir, write_all
from .format import SEG_HEADER, seg_header, seg_name

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


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


class Batch:
    """One batch of frames for the writer: LSNs ``first_lsn..last_lsn``; ``sync``:
    fsync it before it counts as done."""

    __slots__ = ("data", "first_lsn", "last_lsn", "sync")

    def __init__(self, data: bytes, first_lsn: int, last_lsn: int, sync: bool):
        self.data = data
        self.first_lsn = first_lsn
        self.last_lsn = last_lsn
        self.sync = sync


class SegmentWriter:
    """Writes batches to numbered segments in ``directory``.

    :param directory: the data directory.
    :param segment_bytes: rotate once the active segment holds this many bytes.
    :param segments: the segments on disk (the writer appends the ones it creates).
    :param threaded: do fsyncs and rotations on a writer thread (see :meth:`start`).

    Every method except :meth:`start`, :meth:`submit` and :meth:`stop` runs on
    whoever does the I/O: the writer thread, or the loop when no thread runs.
    """

    def __init__(self, directory: str, segment_bytes: int, segments: SegmentList, threaded: bool):
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.segments = segments
        self.threaded = threaded
        self._fd = -1
        self.seg_first = 0  # first LSN of the active segment
        self.seg_path = ""
        self.seg_size = 0  # bytes written to the active segment
        self.durable_offset = 0  # bytes of the active segment known fsynced
        self._dirty = False
        self.bytes = 0  # written since open
        self.fsyncs = 0  # data fsyncs, incl. rotation and segment creation
        #: the latest data fsyncs' durations (seconds), for the metrics (WriteAheadLog.take_fsync_seconds)
        self.fsync_seconds: collections.deque[float] = collections.deque(maxlen=4096)
        self.batches = 0
        self._queue: queue.SimpleQueue[Batch | None] | None = None
        self._thread: threading.Thread | None = None
        self._dir_lock: DirectoryLock | None = None

    def lock_directory(self) -> None:
        """Take the data directory's lock (held until :meth:`stop`).

        :raises DataDirInUse: another process holds it.
        """
        self._dir_lock = DirectoryLock(self.directory)

    def release_directory(self) -> None:
        if self._dir_lock is not None:
            self._dir_lock.release()
            self._dir_lock = None

    @property
    def rotation_due(self) -> bool:
        """Does the next batch start a new segment (an fsync and a create)?"""
        return self.seg_size >= self.segment_bytes

    def open_segment(self, first_lsn: int) -> None:
        """Create and switch to a new segment starting at ``first_lsn``.

        :raises OSError: the create, header write or fsync failed.
        """
        path = os.path.join(self.directory, seg_name(first_lsn))
        if self.segments.drop_last_if(first_lsn):
            os.unlink(path)  # an empty segment left by a previous open(): start it afresh
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, FILE_MODE)
        try:
            write_all(fd, seg_header(first_lsn))
            os.fsync(fd)
            fsync_dir(self.directory)
        except BaseException:
            os.close(fd)
            raise
        self.fsyncs += 1
        self._fd = fd
        self.seg_first = first_lsn
        self.seg_path = path
        self.seg_size = self.durable_offset = SEG_HEADER.size
        self._dirty = False
        self.segments.append(first_lsn, path)

    def write(self, batch: Batch) -> None:
        """Write (and, if ``batch.sync``, fsync) one batch; rotate first if due.

        :raises OSError: a write or fsync failed (the log must stop: see :mod:`fastlock.wal`).
        """
        data = batch.data
        if data:
            if self.seg_size >= self.segment_bytes and batch.first_lsn > self.seg_first:
                self._rotate(batch.first_lsn)
            write_all(self._fd, data)
            self.seg_size += len(data)
            self.bytes += len(data)
            self.batches += 1
            self._dirty = True
        if batch.sync and self._dirty:
            self._fsync()

    def _fsync(self) -> None:
        started = time.perf_counter()
        os.fsync(self._fd)
        self.fsync_seconds.append(time.perf_counter() - started)
        self.fsyncs += 1
        self._dirty = False
        self.durable_offset = self.seg_size

    def _rotate(self, first_lsn: int) -> None:
        if self._dirty:
            self._fsync()
        os.close(self._fd)
        self._fd = -1
        self.open_segment(first_lsn)

    # -- the thread ------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_done: Callable[[Batch], Any],
              on_failed: Callable[[BaseException], Any]) -> None:
        """Start the writer thread (when ``threaded``): it reports each batch done with
        ``on_done(batch)`` or a failure with ``on_failed(exc)``, on ``loop``, and stops
        after a failure."""
        if not self.threaded:
            return
        q: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._queue = q

        def run() -> None:
            while True:
                batch = q.get()
                if batch is None:
                    return
                try:
                    self.write(batch)
                except BaseException as exc:  # noqa: BLE001 - handed to the loop, which makes the log fatal
                    try:
                        loop.call_soon_threadsafe(on_failed, exc)
                    except RuntimeError:  # loop closed
                        pass
                    return
                try:
                    loop.call_soon_threadsafe(on_done, batch)
                except RuntimeError:
                    return

        self._thread = threading.Thread(target=run, name="fastlock-wal", daemon=True)
        self._thread.start()

    def submit(self, batch: Batch) -> bool:
        """Hand ``batch`` to the thread if it blocks on the disk (an fsync or a
        rotation) and the thread runs; return False if the caller must :meth:`write`
        it itself."""
        if self._queue is not None and (batch.sync or self.seg_size >= self.segment_bytes):
            self._queue.put(batch)
            return True
        return False

    def stop(self) -> None:
        """Stop the thread (after the batch it is writing), close the segment, release the directory."""
        if self._queue is not None:
            self._queue.put(None)
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join()
            self._queue = None
            self._thread = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.release_directory()
