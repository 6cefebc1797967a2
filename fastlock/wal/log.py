"""The loop-side write-ahead log: appending records, group commit, durability callbacks.

:class:`WriteAheadLog` is what the server holds.  It encodes each record into
the pending batch, hands one batch at a time to the
:class:`~fastlock.wal.writer.SegmentWriter` (at most one in flight; whatever is
logged meanwhile forms the next batch), and runs the durability callbacks,
listeners and ``sync`` waiters when the writer reports the batch written (and
fsynced, when the mode asks).  Recovery is :mod:`fastlock.wal.recovery`,
snapshots :mod:`fastlock.wal.snapshot`; the fsync modes, the counter
reservation and the failure rules are described in :mod:`fastlock.wal`.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import gc
import logging
import os
from typing import Any, Callable, Iterator, Optional, Sequence

import msgpack

from ..errors import WalFatal
from ..units import wall_ms
from .backlog import read_records
from .files import secure_directory
from .format import LEN_MASK, MAX_RECORD_BYTES, U32, crc32
from .records import COUNTER_MASK, EPOCH, EXPIRE, EXTEND, GRANT, RELEASE, RESERVE, TOKEN_EPOCH_SHIFT, Record
from .recovery import RecoveredState, recover
from .snapshot import Snapshotter
from .writer import Batch, SegmentList, SegmentWriter

log = logging.getLogger("fastlock.wal")

FSYNC_MODES = ("always", "interval", "never")


class _Phase(enum.Enum):
    NEW = "new"  # before open()
    OPEN = "open"  # recovered, appending
    CLOSED = "closed"  # close() or abort() called


def _default_on_fatal(exc: BaseException) -> None:
    log.critical("write-ahead log failed, nothing more will be acknowledged: %r", exc)
    raise exc


class _Reservation:
    """The fencing-counter bookkeeping of the log: the highest epoch and counter
    logged, and (``interval``/``never``) the counter reserved by RESERVE records."""

    __slots__ = ("block", "reserved", "max_counter", "epoch")

    def __init__(self, block: int):
        self.block = block
        self.reserved = 0
        self.max_counter = 0
        self.epoch = 0


class _Pending:
    """The batch being built on the loop: frames not yet handed to the writer."""

    __slots__ = ("buf", "first_lsn", "last_frame", "sync", "sync_requested")

    def __init__(self, first_lsn: int):
        self.buf = bytearray()
        self.first_lsn = first_lsn  # LSN of the first record in buf
        self.last_frame = -1  # offset in buf of the last frame
        self.sync = False  # the batch must be fsynced before its acks (epoch, reservation)
        self.sync_requested = False  # fsync at the next hand-off even if nobody waits


class _Marks:
    """LSN progress: ``first`` (the next LSN at open), ``written`` to the OS,
    ``synced`` (fsynced), ``ack`` (durability callbacks released)."""

    __slots__ = ("first", "written", "synced", "ack")

    def __init__(self, next_lsn: int):
        self.first = next_lsn
        self.written = self.synced = self.ack = next_lsn - 1


class WriteAheadLog:
    """The write-ahead log of one server.

    :param directory: data directory (created by :meth:`open` if missing).
    :param fsync: ``"always"`` (default), ``"interval"`` or ``"never"``; see
        :mod:`fastlock.wal` for what each can lose.
    :param fsync_interval_ms: ``interval`` mode: fsync period in milliseconds (default 1000).
    :param segment_bytes: rotate a segment once it holds at least this many bytes (default 64 MiB).
    :param snapshot_every: :meth:`maybe_snapshot` writes a snapshot once this many
        records were logged since the last one (default 200,000).
    :param reserve_block: ``interval``/``never``: counter values reserved ahead per
        reservation record (default 100,000).
    :param on_fatal: called on the loop with the exception when a write or fsync
        fails; default: log CRITICAL and re-raise (the loop's exception handler sees it).
    :param keep_snapshots: snapshots kept on disk, with the segments needed to replay
        from the oldest of them (default 2, so a damaged newest snapshot has a fallback).
    :param writer: ``"thread"`` (default) or ``"inline"`` group commit; see :mod:`fastlock.wal`.
    :raises ValueError: on a bad mode or non-positive size.

    Typical use (by the server)::

        wal = WriteAheadLog("data", fsync="always")
        state = wal.open()              # recover
        wal.start(loop)
        wal.log_grant("orders/42", token, b"owner", 10_000, 0, "api-1", "req-7")
        wal.when_durable(lambda: reply_to_client())
        ...
        await wal.close()
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        fsync: str = "always",
        fsync_interval_ms: int = 1000,
        segment_bytes: int = 64 << 20,
        snapshot_every: int = 200_000,
        reserve_block: int = 100_000,
        on_fatal: Optional[Callable[[BaseException], Any]] = None,
        keep_snapshots: int = 2,
        writer: str = "thread",
    ):
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {FSYNC_MODES}, not {fsync!r}")
        if writer not in ("thread", "inline"):
            raise ValueError(f"writer must be 'thread' or 'inline', not {writer!r}")
        for label, v in (("fsync_interval_ms", fsync_interval_ms), ("segment_bytes", segment_bytes),
                         ("snapshot_every", snapshot_every), ("reserve_block", reserve_block),
                         ("keep_snapshots", keep_snapshots)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{label} must be a positive integer, not {v!r}")
        self.directory = os.fspath(directory)
        self.fsync_mode = fsync
        self.fsync_interval_ms = fsync_interval_ms
        self._always = fsync == "always"
        self._on_fatal = on_fatal or _default_on_fatal
        self._io = SegmentWriter(self.directory, segment_bytes, SegmentList([]), writer == "thread")
        self._snapshots = Snapshotter(self.directory, self._io.segments, snapshot_every, keep_snapshots)
        self._counters = _Reservation(reserve_block)
        #: open(repair=True) cut records: acknowledged grants may be gone, and with
        #: them the evidence of the tokens they used (the server raises the epoch)
        self.repaired = False
        self._phase = _Phase.NEW
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._fatal: Optional[BaseException] = None
        self._pending = _Pending(1)
        self._scheduled = False  # a hand-off is scheduled on the loop
        self._inflight: Optional[Batch] = None
        self._next_lsn = 1  # the LSN the next record gets
        self._marks = _Marks(1)
        self._waiters: collections.deque = collections.deque()  # (lsn, callback)
        self._sync_waiters: list = []  # (lsn, future) resolved when synced_lsn >= lsn
        self._listeners: list = []
        self._timer: Optional[asyncio.TimerHandle] = None

    # -- recovery ------------------------------------------------------------------------
    def open(self, *, repair: bool = False) -> RecoveredState:
        """Create the directory if needed, recover, and open a new segment for appending.

        Synchronous.  A torn tail is cut and logged as a WARNING.
        :param repair: cut the last segment at its first bad frame even if valid
            data follows (logged at ERROR) instead of raising.
        :raises WalCorruption: mid-log corruption, a damaged non-last segment, or
            no usable snapshot for a compacted log.
        :raises OSError: the directory cannot be read or written.
        :raises DataDirInUse: another process has this directory open.
        """
        if self._phase is not _Phase.NEW:
            raise RuntimeError("WriteAheadLog.open() called twice")
        # Recovery allocates millions of small containers that all survive: the cyclic
        # GC would rescan them again and again (3x slower for 100k holders).
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._open(repair)
        except BaseException:
            self._io.release_directory()
            raise
        finally:
            if was_enabled:
                gc.enable()

    def _open(self, repair: bool) -> RecoveredState:
        d = self.directory
        secure_directory(d)
        self._io.lock_directory()
        for fn in os.listdir(d):
            if fn.startswith("snap-") and fn.endswith(".tmp"):
                os.unlink(os.path.join(d, fn))
        result = recover(d, repair=repair)
        state = result.state
        self.repaired = result.repaired
        next_lsn = state.next_lsn
        self._next_lsn = next_lsn
        self._pending = _Pending(next_lsn)
        self._marks = _Marks(next_lsn)
        c = self._counters
        c.epoch = state.epoch
        c.reserved = c.max_counter = state.counter
        self._io.segments.reset(result.segments)
        self._snapshots.recovered(state.snapshot_lsn, next_lsn - 1)
        self._io.open_segment(next_lsn)
        self._phase = _Phase.OPEN
        return state

    # -- group commit ----------------------------------------------------------------------
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Start group commit on ``loop`` (default: the running loop). Call after :meth:`open`."""
        if self._phase is _Phase.NEW:
            raise RuntimeError("WriteAheadLog.start() before open()")
        if self._loop is not None:
            raise RuntimeError("WriteAheadLog.start() called twice")
        self._loop = loop or asyncio.get_running_loop()
        self._io.start(self._loop, self._io_done, self._io_failed)
        # `always`: records nobody waited for (releases, expiries) are fsynced by the
        # next grant's batch, or by this timer at the latest
        if self.fsync_mode in ("interval", "always"):
            self._timer = self._loop.call_later(self.fsync_interval_ms / 1000.0, self._on_interval)
        if self._pending.buf or self._waiters:
            self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and self._inflight is None and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._kick)

    def _kick(self) -> None:
        """Hand the pending batch to the writer (at most one in flight)."""
        self._scheduled = False
        if self._inflight is not None or self._fatal is not None or self._phase is _Phase.CLOSED:
            return
        pending = self._pending
        buf = pending.buf
        if not buf and not pending.sync_requested:
            return
        # In `always` mode a batch is fsynced when someone waits on it; a batch
        # nobody waits for (releases, expiries: acknowledged without the disk)
        # is only written, and rides on the next fsync (or the interval timer).
        # So an acquire after a release costs one fsync, not two.
        sync = (pending.sync or pending.sync_requested
                or (self._always and bool(buf) and (bool(self._waiters) or bool(self._sync_waiters))))
        if buf:
            # batch marks on the first and last frames (recompute their CRCs)
            off = pending.last_frame
            buf[off + 7] |= 0x80
            with memoryview(buf) as mv:
                U32.pack_into(buf, off, crc32(mv[off + 4:]))
                buf[7] |= 0x40
                if off:
                    first_end = 8 + (U32.unpack_from(buf, 4)[0] & LEN_MASK)
                    U32.pack_into(buf, 0, crc32(mv[4:first_end]))
                else:
                    U32.pack_into(buf, 0, crc32(mv[4:]))
        batch = Batch(bytes(buf), pending.first_lsn, self._next_lsn - 1, sync)
        self._pending = _Pending(self._next_lsn)
        self._inflight = batch
        # The thread earns its hand-off cost only when the batch blocks on the disk
        # (an fsync, or a rotation, which fsyncs); a write() to the page cache is done
        # here, so the relaxed modes acknowledge in the same loop turn.
        if self._io.submit(batch):
            return
        try:
            self._io.write(batch)
        except BaseException as exc:
            self._io_failed(exc)
            return
        self._io_done(batch)

    def _io_done(self, batch: Batch) -> None:
        self._inflight = None
        if self._fatal is not None or self._phase is _Phase.CLOSED:
            return
        last = batch.last_lsn
        marks = self._marks
        marks.written = last
        if batch.sync:
            marks.synced = last
        ack = marks.ack = marks.synced if self._always else last
        if batch.data:
            for fn in self._listeners:
                try:
                    fn(batch.first_lsn, last, batch.data)
                except Exception as exc:
                    self._report(exc, "WAL listener failed")
        waiters = self._waiters
        while waiters and waiters[0][0] <= ack:
            cb = waiters.popleft()[1]
            try:
                cb()
            except Exception as exc:
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
        if self._pending.buf or self._pending.sync_requested:
            self._kick()

    def _report(self, exc: BaseException, message: str) -> None:
        self._loop.call_exception_handler({"message": message, "exception": exc})

    def _io_failed(self, exc: BaseException) -> None:
        if self._fatal is not None or self._phase is _Phase.CLOSED:
            return
        self._fatal = exc
        self._inflight = None
        self._waiters.clear()  # never acknowledged
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for _lsn, fut in self._sync_waiters:
            if not fut.done():
                fut.set_exception(WalFatal(f"write-ahead log failed: {exc!r}"))
        self._sync_waiters = []
        log.critical("WAL %s failed on %s: %r", "write/fsync", self._io.seg_path, exc)
        self._on_fatal(exc)

    def _on_interval(self) -> None:
        self._timer = self._loop.call_later(self.fsync_interval_ms / 1000.0, self._on_interval)
        if self._marks.written > self._marks.synced or self._pending.buf:
            self._pending.sync_requested = True
            self._schedule()

    # -- appending ------------------------------------------------------------------------
    def _append(self, rec: list) -> None:
        if self._fatal is not None:
            raise WalFatal(f"write-ahead log failed earlier: {self._fatal!r}") from self._fatal
        if self._phase is not _Phase.OPEN:
            raise RuntimeError("write-ahead log is not open")
        body = _pack(rec)
        if len(body) > MAX_RECORD_BYTES:
            raise ValueError(f"WAL record of {len(body)} bytes exceeds {MAX_RECORD_BYTES}")
        lenb = U32.pack(len(body))
        pending = self._pending
        buf = pending.buf
        pending.last_frame = len(buf)
        buf += U32.pack(crc32(body, crc32(lenb)))
        buf += lenb
        buf += body
        self._next_lsn += 1
        if not self._scheduled and self._inflight is None and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._kick)

    # Each log_* method appends one record, ``[type, field, ...]`` in the order of the
    # fields of its type in fastlock.wal.records (built inline: this is the hot path).
    def log_grant(self, name: str, token: int, owner: bytes, ttl_ms: int, lock_delay_ms: int,
                  client_name: Optional[str], correlation_id: Optional[str]) -> None:
        """Log a grant of ``name`` with fencing ``token`` (ttl/lock-delay in milliseconds).

        In ``interval``/``never`` mode, a counter beyond the reservation first logs a
        RESERVE record and makes this batch wait for an fsync.
        :raises WalFatal: after a failed write/fsync.  :raises TypeError: unencodable field.
        """
        c = self._counters
        counter = token & COUNTER_MASK
        if counter > c.max_counter:
            c.max_counter = counter
        ep = token >> TOKEN_EPOCH_SHIFT
        if ep > c.epoch:
            c.epoch = ep
        if counter > c.reserved and not self._always:
            c.reserved = counter + c.block
            self._append([RESERVE, c.reserved, wall_ms()])
            self._pending.sync = True
        self._append([GRANT, name, token, owner, ttl_ms, lock_delay_ms, client_name, correlation_id, wall_ms()])

    def log_release(self, name: str, token: int) -> None:
        """Log that the holder with ``token`` released ``name``."""
        self._append([RELEASE, name, token, wall_ms()])

    def log_expire(self, name: str, token: int) -> None:
        """Log that the lease with ``token`` on ``name`` expired."""
        self._append([EXPIRE, name, token, wall_ms()])

    def log_extend(self, name: str, token: int, ttl_ms: int) -> None:
        """Log a new TTL (milliseconds) for the lease ``token`` on ``name`` (only when it changes)."""
        self._append([EXTEND, name, token, ttl_ms, wall_ms()])

    def log_epoch(self, epoch: int) -> None:
        """Log a new epoch; always fsynced before this batch's callbacks run, in every mode."""
        if epoch > self._counters.epoch:
            self._counters.epoch = epoch
        self._append([EPOCH, epoch, wall_ms()])
        self._pending.sync = True

    def when_durable(self, callback: Callable[[], Any]) -> None:
        """Call ``callback()`` on the loop once every record logged so far is durable.

        "Durable" per the fsync mode: fsynced (``always``), written to the OS
        (``interval``/``never``, plus any reservation/epoch fsync).  Callbacks run in
        registration order, never synchronously inside this call, and never after a
        fatal I/O error.
        :raises WalFatal: after a failed write/fsync.
        """
        if self._fatal is not None:
            raise WalFatal(f"write-ahead log failed earlier: {self._fatal!r}") from self._fatal
        lsn = self._next_lsn - 1
        if lsn <= self._marks.ack and not self._waiters and self._loop is not None:
            self._loop.call_soon(callback)
        else:
            self._waiters.append((lsn, callback))
            if self._always and lsn > self._marks.synced:
                self._pending.sync_requested = True  # the records may be written already, unsynced
                self._schedule()

    def flush_now(self) -> bool:
        """``interval``/``never`` only: write the pending batch now, on the calling thread.

        Returns True when every record logged so far is then acknowledged (written
        to the OS), so the caller may acknowledge at once instead of waiting for
        :meth:`when_durable`'s next loop turn.  Returns False, doing nothing, in
        ``always`` mode, while a batch is in flight, or when the batch needs an
        fsync (reservation, epoch) or a segment rotation.  Earlier
        ``when_durable`` callbacks that become due run inside this call.
        :raises WalFatal: after a failed write/fsync.
        """
        if self._fatal is not None:
            raise WalFatal(f"write-ahead log failed earlier: {self._fatal!r}") from self._fatal
        if (self._always or self._inflight is not None or self._phase is _Phase.CLOSED or self._loop is None
                or self._pending.sync or self._pending.sync_requested or self._io.rotation_due):
            return False
        if self._pending.buf:
            self._kick()
        return self._fatal is None and self._marks.ack >= self._next_lsn - 1

    def add_listener(self, fn: Callable[[int, int, bytes], Any]) -> None:
        """Register ``fn(first_lsn, last_lsn, data)``, called on the loop with each written batch.

        ``data`` is the batch exactly as written to the segment (decode with
        :func:`~fastlock.wal.decode_frames`).  Called after the batch is written, and
        after its fsync when the mode requires one.  Exceptions go to the loop's handler.
        """
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[int, int, bytes], Any]) -> None:
        """Unregister a listener added with :meth:`add_listener`."""
        self._listeners.remove(fn)

    # -- reading back ----------------------------------------------------------------------
    @property
    def written_lsn(self) -> int:
        """The last LSN written to a segment (readable by :class:`~fastlock.wal.BacklogReader`)."""
        return self._marks.written

    @property
    def segments(self) -> SegmentList:
        """The segments on disk (for :class:`~fastlock.wal.BacklogReader`)."""
        return self._io.segments

    def has_lsn(self, lsn: int) -> bool:
        """Is ``lsn`` still in the segments on disk, or not yet written (True), or
        compacted away (False)?"""
        oldest = self.segments.oldest()
        return lsn >= (self._next_lsn if oldest is None else oldest) or lsn > self._marks.written

    def read_from(self, lsn: int) -> Iterator[tuple[int, Record]]:
        """Iterate ``(lsn, record)`` for records >= ``lsn`` written so far (segments on disk).

        Records are typed (:mod:`fastlock.wal.records`).  Stops at the last record
        written when the call was made.
        :raises WalCompacted: ``lsn`` is older than the oldest segment on disk.
        :raises WalCorruption: a damaged record on the way.
        """
        return read_records(self.segments, lsn, self._marks.written)

    # -- snapshots ------------------------------------------------------------------------
    def maybe_snapshot(self, get_state: Callable[[], tuple], *, force: bool = False) -> bool:
        """Write a snapshot if ``snapshot_every`` records were logged since the last one.

        ``get_state()`` is called synchronously and must return ``(epoch, counter,
        holders)`` consistent with every record logged so far (``holders``: a list of
        :class:`~fastlock.wal.HolderRecord` or equal 8-tuples, not mutated afterwards).
        Encoding, writing (temp file, fsync, rename, directory fsync) and deleting the
        covered segments happen on a background thread.  Returns True if a snapshot
        was started.  A failed snapshot is logged at ERROR and retried after another
        ``snapshot_every`` records (the log itself is intact, so it is not fatal).
        """
        snaps = self._snapshots
        if self._fatal is not None or self._phase is not _Phase.OPEN or self._loop is None:
            return False
        lsn = self._next_lsn - 1
        if not snaps.due(lsn, force):
            return False
        epoch, counter, holders = get_state()
        c = self._counters
        snaps.start(self._loop, lsn, max(epoch, c.epoch), max(counter, c.max_counter, c.reserved), holders)
        return True

    async def wait_snapshot(self) -> None:
        """Wait for a snapshot in progress (if any) to finish."""
        await self._snapshots.wait()

    async def sync(self) -> None:
        """Write and fsync every record logged so far, now, whatever the mode; wait for it.

        :raises WalFatal: the log failed.
        """
        await self._await_synced(self._next_lsn - 1, force=True)

    async def wait_synced(self, lsn: Optional[int] = None) -> None:
        """Wait (without forcing an fsync) until records up to ``lsn`` (default: all
        logged so far) are fsynced -- e.g. by the ``interval`` timer.

        :raises WalFatal: the log failed.
        """
        await self._await_synced(self._next_lsn - 1 if lsn is None else lsn, force=False)

    async def _await_synced(self, lsn: int, force: bool) -> None:
        if self._fatal is not None:
            raise WalFatal(f"write-ahead log failed earlier: {self._fatal!r}") from self._fatal
        if lsn <= self._marks.synced:
            return
        if self._loop is None:
            raise RuntimeError("WriteAheadLog.start() was not called")
        fut = self._loop.create_future()
        self._sync_waiters.append((lsn, fut))
        if force:
            self._pending.sync_requested = True
            self._schedule()
        await fut

    # -- shutdown ------------------------------------------------------------------------
    async def close(self) -> None:
        """Write and fsync everything logged, wait for a snapshot in progress, stop the writer.

        Durability callbacks of the flushed records run before this returns.
        :raises WalFatal: if the log failed (earlier or during the final fsync).
        """
        if self._phase is _Phase.CLOSED:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            if self._fatal is None and self._phase is _Phase.OPEN:
                if self._loop is None:
                    # never started: flush inline
                    self._pending.sync_requested = True
                    self._loop = asyncio.get_running_loop()
                    self._kick()
                else:
                    await self._await_synced(self._next_lsn - 1, force=True)
                await self.wait_snapshot()
            if self._fatal is not None:
                raise WalFatal(f"write-ahead log failed: {self._fatal!r}") from self._fatal
        finally:
            self._stop_io()

    def abort(self) -> None:
        """Stop at once without flushing (after a fatal error, or to simulate a crash in tests).

        Records not yet written are lost; callbacks never run.
        """
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._waiters.clear()
        self._pending = _Pending(self._next_lsn)
        self._stop_io()

    def _stop_io(self) -> None:
        self._phase = _Phase.CLOSED
        self._io.stop()  # closes the segment, releases the directory lock
        self._snapshots.join()

    # -- introspection --------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters: ``records`` logged since open, ``bytes`` written, ``fsyncs``
        (data fsyncs incl. rotation/segment creation), ``batches`` written,
        ``last_lsn`` logged, ``written_lsn``, ``durable_lsn`` (fsynced),
        ``ack_lsn`` (callbacks released), ``snapshot_lsn``, ``segments`` on disk,
        ``pending_bytes`` (not yet handed to the writer), ``active_segment`` (path),
        ``durable_offset``/``written_offset`` (bytes in the active segment),
        ``reserved_counter``, ``fsync_mode``."""
        io = self._io
        marks = self._marks
        return {
            "records": self._next_lsn - marks.first,
            "bytes": io.bytes,
            "fsyncs": io.fsyncs,
            "batches": io.batches,
            "last_lsn": self._next_lsn - 1,
            "written_lsn": marks.written,
            "durable_lsn": marks.synced,
            "ack_lsn": marks.ack,
            "snapshot_lsn": self._snapshots.lsn,
            "segments": len(io.segments),
            "pending_bytes": len(self._pending.buf),
            "active_segment": io.seg_path,
            "durable_offset": io.durable_offset,
            "written_offset": io.seg_size,
            "reserved_counter": self._counters.reserved,
            "fsync_mode": self.fsync_mode,
        }


_pack = msgpack.Packer().pack
