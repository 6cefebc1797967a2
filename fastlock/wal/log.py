"""The loop-side write-ahead log: what the server holds and calls.

:class:`WriteAheadLog` recovers the directory (:mod:`fastlock.wal.recovery`),
encodes each record the server logs (``log_grant`` ...) and passes it to
group commit (:mod:`fastlock.wal.commit`, which hands batches to the segment
writer of :mod:`fastlock.wal.writer`), keeps the fencing-counter reservation,
and starts snapshots (:mod:`fastlock.wal.snapshot`).  The fsync modes, the
counter reservation and the failure rules are described in :mod:`fastlock.wal`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

from ..errors import WalFatal
from ..units import wall_ms
from .backlog import read_records
from .commit import GroupCommit, LogAppender, Reservation
from .files import fsync_dir, secure_directory, write_atomically
from .records import (
    EPOCH,
    EXPIRE,
    EXTEND,
    KEY_DELETE,
    KEY_MOVED,
    KEY_PUT,
    LOCK_DELAY,
    RESERVE,
    REVOKE,
    REVOKE_REQUEST,
    SLOTS_ADOPTED,
    SLOTS_UNADOPTED,
    Record,
)
from .recovery import RecoveredState, recover
from .snapshot import SnapshotState, Snapshotter
from .writer import SegmentList, SegmentWriter

log = logging.getLogger("fastlock.wal")

FSYNC_MODES = ("always", "interval", "never")
#: where group commit syncs: a writer thread, the event loop, or the loop while one client waits
WRITERS = ("thread", "inline", "auto")


#: a file in the data directory while acknowledged records may exist only in the OS's
#: page cache (a run in ``interval``/``never`` mode), and while the restart grace that
#: follows an unclean stop of such a run lasts (see :attr:`WriteAheadLog.unsynced_before`)
UNSYNCED_MARKER = "unsynced-run"


class _Phase(enum.Enum):
    NEW = "new"  # before open()
    OPEN = "open"  # recovered, appending
    CLOSED = "closed"  # close() or abort() called


def _default_on_fatal(exc: BaseException) -> None:
    log.critical("write-ahead log failed, nothing more will be acknowledged: %r", exc)
    raise exc


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside (restored after, if it was enabled): for code that
    makes millions of objects that all survive, which each collection would scan again."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class WriteAheadLog(LogAppender):
    """The write-ahead log of one server.

    :param directory: data directory (created by :meth:`open` if missing).
    :param fsync: ``"always"`` (default), ``"interval"`` or ``"never"``; see
        :mod:`fastlock.wal` for what each can lose.
    :param fsync_interval_ms: ``interval`` mode: fsync period in milliseconds (default 1000).
    :param segment_bytes: rotate a segment once it holds at least this many bytes (default 64 MiB).
    :param snapshot_every: :meth:`maybe_snapshot` writes a snapshot once this many
        records were logged since the last one (default 200,000).
    :param snapshot_every_bytes: :meth:`maybe_snapshot` also writes one once this many
        bytes of records were written since the last one, whichever comes first
        (default 128 MiB; 0: by records only).
    :param reserve_block: ``interval``/``never``: counter values reserved ahead per
        reservation record (default 100,000).
    :param on_fatal: called on the loop with the exception when a write or fsync
        fails; default: log CRITICAL and re-raise (the loop's exception handler sees it).
    :param keep_snapshots: snapshots kept on disk, with the segments needed to replay
        from the oldest of them (default 2, so a damaged newest snapshot has a fallback).
    :param writer: ``"auto"`` (default), ``"thread"`` or ``"inline"`` group commit; see :mod:`fastlock.wal`.
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
        snapshot_every_bytes: int = 128 << 20,
        reserve_block: int = 100_000,
        on_fatal: Callable[[BaseException], Any] | None = None,
        keep_snapshots: int = 2,
        writer: str = "auto",
    ):
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {FSYNC_MODES}, not {fsync!r}")
        if writer not in WRITERS:
            raise ValueError(f"writer must be one of {WRITERS}, not {writer!r}")
        for label, v in (("fsync_interval_ms", fsync_interval_ms), ("segment_bytes", segment_bytes),
                         ("snapshot_every", snapshot_every), ("reserve_block", reserve_block),
                         ("keep_snapshots", keep_snapshots)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{label} must be a positive integer, not {v!r}")
        if not isinstance(snapshot_every_bytes, int) or snapshot_every_bytes < 0:
            raise ValueError(f"snapshot_every_bytes must be an integer >= 0, not {snapshot_every_bytes!r}")
        self.directory = os.fspath(directory)
        self.fsync_mode = fsync
        self.fsync_interval_ms = fsync_interval_ms
        self._always = fsync == "always"
        io = SegmentWriter(self.directory, segment_bytes, SegmentList([]), writer != "inline")
        # `always`: records nobody waited for (releases, expiries) are fsynced by the
        # next grant's batch, or by the interval timer at the latest
        self._commit = GroupCommit(io, self._always, 0 if fsync == "never" else fsync_interval_ms,
                                   on_fatal or _default_on_fatal, adaptive=writer == "auto")
        #: the group commit itself, for the server's compiled batch end (its ``next_lsn`` and
        #: ``marks``, read without a property call; see :mod:`fastlock.wal.commit`)
        self.group_commit = self._commit
        self._snapshots = Snapshotter(self.directory, io.segments, snapshot_every, keep_snapshots,
                                      snapshot_every_bytes)
        #: the snapshotter, for the server's compiled batch end (its ``next_due`` and ``next_due_bytes``,
        #: :meth:`maybe_snapshot`'s first check, read without a call)
        self.snapshotter = self._snapshots
        self._counters = Reservation(reserve_block)
        #: open(repair=True) cut records: acknowledged grants may be gone, and with
        #: them the evidence of the tokens they used (the server raises the epoch)
        self.repaired = False
        #: open() found :data:`UNSYNCED_MARKER`: the previous run, in a relaxed mode (or in
        #: the restart grace that followed one), did not close cleanly, so an OS crash may
        #: have taken acknowledged grants with it that recovery cannot see
        self.unsynced_before = False
        #: keep :data:`UNSYNCED_MARKER` at close (the server sets it while that grace runs)
        self.keep_unsynced_marker = False
        self._phase = _Phase.NEW

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
        with paused_gc():
            try:
                return self._open(repair)
            except BaseException:
                self._commit.io.release_directory()
                raise

    def _open(self, repair: bool) -> RecoveredState:
        d = self.directory
        secure_directory(d)
        self._commit.io.lock_directory()
        for fn in os.listdir(d):
            if fn.startswith("snap-") and fn.endswith(".tmp"):
                os.unlink(os.path.join(d, fn))
        result = recover(d, repair=repair)
        state = result.state
        self.repaired = result.repaired
        next_lsn = state.next_lsn
        self._commit.recovered(next_lsn)
        c = self._counters
        c.epoch = state.epoch
        c.reserved = c.max_counter = state.counter
        self._commit.io.segments.reset(result.segments)
        self._snapshots.recovered(state.snapshot_lsn, next_lsn - 1)
        self._commit.io.open_segment(next_lsn)
        self.unsynced_before = os.path.exists(os.path.join(d, UNSYNCED_MARKER))
        if not self._always and not self.unsynced_before:
            write_atomically(d, UNSYNCED_MARKER, f"fsync={self.fsync_mode}\n".encode())
        self._phase = _Phase.OPEN
        self.appending = True
        return state

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start group commit on ``loop`` (default: the running loop). Call after :meth:`open`."""
        if self._phase is _Phase.NEW:
            raise RuntimeError("WriteAheadLog.start() before open()")
        if self._commit.loop is not None:
            raise RuntimeError("WriteAheadLog.start() called twice")
        self._commit.start(loop or asyncio.get_running_loop())

    # -- appending ------------------------------------------------------------------------
    def _append(self, rec: list, fsync: bool = False) -> None:
        commit = self._commit
        if commit.fatal is not None or self._phase is not _Phase.OPEN:
            commit.check()
            raise RuntimeError("write-ahead log is not open")
        commit.add(_pack(rec), fsync)  # :raises ValueError: a record over MAX_RECORD_BYTES

    # Each log_* method appends one record, ``[type, field, ...]`` in the order of the
    # fields of its type in fastlock.wal.records; log_grant and log_release (every pair's
    # records) are the compiled base's (commit.LogAppender), encoded in C.

    def log_expire(self, name: str, token: int) -> None:
        """Log that the lease with ``token`` on ``name`` expired."""
        self._append([EXPIRE, name, token, wall_ms()])

    def log_revoke(self, name: str, token: int, principal: str, reason: str | None) -> None:
        """Log that ``principal`` force-released the lease ``token`` on ``name`` (``reason``: free text)."""
        self._append([REVOKE, name, token, principal, reason, wall_ms()])

    def log_extend(self, name: str, token: int, ttl_ms: int) -> None:
        """Log a new TTL (milliseconds) for the lease ``token`` on ``name`` (only when it changes)."""
        self._append([EXTEND, name, token, ttl_ms, wall_ms()])

    def log_lock_delay(self, name: str, until_wall_ms: int) -> None:
        """Log that no grant of ``name`` may happen before ``until_wall_ms`` (wall clock ms)."""
        self._append([LOCK_DELAY, name, until_wall_ms, wall_ms()])

    def log_lock_delays(self, delays: list[tuple[str, int]], now_ms: int) -> None:
        """Log every running lock-delay of ``delays`` (``(name, until_ms)`` on the monotonic
        clock whose time is ``now_ms``, as ``LockTable.lock_delays()``) on the wall clock."""
        wall = wall_ms()
        for name, until_ms in delays:
            if until_ms > now_ms:
                self._append([LOCK_DELAY, name, wall + until_ms - now_ms, wall])

    def log_revoke_request(self, name: str, token: int, principal: str, until_wall_ms: int, grace_ms: int) -> None:
        """Log that ``principal`` asked the lease ``token`` on ``name`` to yield by ``until_wall_ms``
        (wall clock ms), ``grace_ms`` (milliseconds) from now."""
        self._append([REVOKE_REQUEST, name, token, principal, until_wall_ms, grace_ms, wall_ms()])

    def log_key_put(self, key: str, value: bytes, lease_name: str | None, token: int,
                    principal: str | None) -> None:
        """Log that ``key`` holds ``value``, attached to the lease ``(lease_name, token)`` or to none."""
        self._append([KEY_PUT, key, value, lease_name, token, principal, wall_ms()])

    def log_key_delete(self, key: str) -> None:
        """Log that ``key`` was deleted."""
        self._append([KEY_DELETE, key, wall_ms()])

    def log_key_moved(self, key: str, to_group: str) -> None:
        """Log that ``key`` left this shard group for group ``to_group`` (a slot move)."""
        self._append([KEY_MOVED, key, to_group, wall_ms()])

    def log_slots_adopted(self, first: int, last: int, floor: int, epoch: int, queues: list) -> None:
        """Log that this shard group imported a page of slots ``first..last`` (a slot move) above
        the token ``floor`` at ``epoch``, with ``queues`` (``[name, [owner-key hash, ...]]``);
        always fsynced before this batch's callbacks run, in every mode (the log is where a
        restart finds the import)."""
        self._append([SLOTS_ADOPTED, first, last, floor, epoch, queues, wall_ms()], fsync=True)

    def log_slots_unadopted(self, first: int, last: int) -> None:
        """Log that this shard group owns slots ``first..last`` without their token floor (its
        standbys answer their names Unavailable too until a SLOTS_ADOPTED record of them)."""
        self._append([SLOTS_UNADOPTED, first, last, wall_ms()], fsync=True)

    def log_epoch(self, epoch: int) -> None:
        """Log a new epoch; always fsynced before this batch's callbacks run, in every mode."""
        if epoch > self._counters.epoch:
            self._counters.epoch = epoch
        self._append([EPOCH, epoch, wall_ms()], fsync=True)

    def log_counter_floor(self, counter: int) -> None:
        """Log that the grant counter is at least ``counter`` (a RESERVE record, fsynced before
        this batch's callbacks run): recovery and a standby raise the counter to it, as they do
        for every reservation.  A slot move's import raises the destination's tokens above the
        source's this way (:mod:`fastlock.server.slotmove`)."""
        c = self._counters
        if counter > c.max_counter:
            c.max_counter = counter
        if counter > c.reserved:
            c.reserved = counter
        self._append([RESERVE, c.reserved, wall_ms()], fsync=True)

    def when_durable(self, callback: Callable[[], Any]) -> None:
        """Call ``callback()`` on the loop once every record logged so far is durable.

        "Durable" per the fsync mode: fsynced (``always``), written to the OS
        (``interval``/``never``, plus any reservation/epoch fsync).  Callbacks run in
        registration order, never synchronously inside this call, and never after a
        fatal I/O error.
        :raises WalFatal: after a failed write/fsync.
        """
        self._commit.when_durable(callback)

    def when_durable_later(self, callback: Callable[[], Any]) -> None:
        """:meth:`when_durable` without asking for a sync: ``callback()`` runs once the records
        logged so far are durable by a sync something else asks for (a :meth:`when_durable`
        waiter's batch, :meth:`request_sync`, the interval timer -- ``fsync_interval_ms`` at the
        latest -- or the close); in the relaxed modes once they are written.  For a callback
        nobody waits on: it costs no ``fdatasync`` of its own.
        :raises WalFatal: after a failed write/fsync.
        """
        self._commit.when_durable_later(callback)

    def poll(self) -> None:
        """Acknowledge a batch the writer thread has finished, now rather than at the loop's
        next turn: its ``when_durable`` callbacks run inside this call, and the batch logged
        meanwhile goes to the thread at once.  The server calls it after each read, so that
        while clients keep the loop busy a finished fsync does not wait for the turn to end.
        Does nothing while the batch in flight is not done, or without a writer thread.

        With the ``auto`` writer, once one client waits alone (``commit.LONE_BATCHES``), the
        records logged since the last hand-off that one ``when_durable`` callback waits on are
        written (and, in ``always`` mode, synced) inside this call, on the loop, and the callback
        runs: the caller's batch end acknowledges its grant without waiting for the loop's next
        turn.  A second call
        in the same turn that finds records leaves them to the turn's end and counts the clients
        as waiting together (the next batches go to the writer thread).
        :raises WalFatal: never; a failed write or fsync is reported through ``on_fatal``.
        """
        self._commit.poll()

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
        return self._commit.flush_now()

    def flush_first(self) -> bool:
        """:meth:`flush_now` for the first caller of a loop turn only.

        Returns what :meth:`flush_now` returns for the first call in a turn of the
        loop (a lone request's records are written, and may be acknowledged, at
        once); later calls in the same turn return False, doing nothing, so a
        burst of requests read in one turn shares one write at the turn's end
        (:meth:`when_durable` callbacks run after it).
        :raises WalFatal: after a failed write/fsync.
        """
        return self._commit.flush_first()

    def add_listener(self, fn: Callable[[int, int, bytes], Any]) -> None:
        """Register ``fn(first_lsn, last_lsn, data)``, called on the loop with each written batch.

        ``data`` is the batch exactly as written to the segment (decode with
        :func:`~fastlock.wal.decode_frames`).  Called after the batch is written, and
        after its fsync when the mode requires one.  Exceptions go to the loop's handler.
        """
        self._commit.listeners.append(fn)

    def add_progress_listener(self, fn: Callable[[int, int], Any]) -> None:
        """Register ``fn(written_lsn, synced_lsn)``, called on the loop after every batch
        the writer finishes (one with records, or an fsync alone), with the log's marks
        then: the last LSN written to the OS and the last fsynced."""
        self._commit.progress.append(fn)

    def request_sync(self) -> None:
        """Fsync every record logged so far at the next hand-off, in any fsync mode,
        without waiting (progress listeners hear when it is done)."""
        self._commit.request_sync()

    @property
    def synced_lsn(self) -> int:
        """The last LSN fsynced."""
        return self._commit.marks.synced

    @property
    def acked_lsn(self) -> int:
        """The last LSN durable per the fsync mode (fsynced in ``always``, written to the OS
        otherwise): ``when_durable`` callbacks registered before it was logged are due."""
        return self._commit.marks.ack

    @property
    def logged_lsn(self) -> int:
        """The LSN of the last record logged (maybe not yet written)."""
        return self._commit.next_lsn - 1

    def remove_listener(self, fn: Callable[[int, int, bytes], Any]) -> None:
        """Unregister a listener added with :meth:`add_listener`."""
        self._commit.listeners.remove(fn)

    # -- reading back ----------------------------------------------------------------------
    @property
    def written_lsn(self) -> int:
        """The last LSN written to a segment (readable by :class:`~fastlock.wal.BacklogReader`)."""
        return self._commit.marks.written

    @property
    def segments(self) -> SegmentList:
        """The segments on disk (for :class:`~fastlock.wal.BacklogReader`)."""
        return self._commit.io.segments

    def has_lsn(self, lsn: int) -> bool:
        """Is ``lsn`` still in the segments on disk, or not yet written (True), or
        compacted away (False)?"""
        oldest = self.segments.oldest()
        return lsn >= (self._commit.next_lsn if oldest is None else oldest) or lsn > self._commit.marks.written

    def read_from(self, lsn: int) -> Iterator[tuple[int, Record]]:
        """Iterate ``(lsn, record)`` for records >= ``lsn`` written so far (segments on disk).

        Records are typed (:mod:`fastlock.wal.records`).  Stops at the last record
        written when the call was made.
        :raises WalCompacted: ``lsn`` is older than the oldest segment on disk.
        :raises WalCorruption: a damaged record on the way.
        """
        return read_records(self.segments, lsn, self._commit.marks.written)

    # -- snapshots ------------------------------------------------------------------------
    def maybe_snapshot(self, get_state: Callable[[], SnapshotState | tuple], *, force: bool = False) -> bool:
        """Write a snapshot if ``snapshot_every`` records were logged since the last one,
        or ``snapshot_every_bytes`` bytes of records written.

        ``get_state()`` is called synchronously and must return a
        :class:`~fastlock.wal.SnapshotState` (or a tuple of its fields, ``keys`` optional)
        consistent with every record logged so far, not mutated afterwards.
        Encoding, writing (temp file, fsync, rename, directory fsync) and deleting the
        covered segments happen on a background thread.  Returns True if a snapshot
        was started.  A failed snapshot is logged at ERROR and retried after another
        ``snapshot_every`` records (the log itself is intact, so it is not fatal).
        """
        snaps = self._snapshots
        commit = self._commit
        lsn = commit.next_lsn - 1
        written = commit.io.bytes
        if not force and lsn < snaps.next_due and written < snaps.next_due_bytes:  # the common case
            return False
        if commit.fatal is not None or self._phase is not _Phase.OPEN or commit.loop is None:
            return False
        if not snaps.due(lsn, force, written):
            return False
        state = SnapshotState(*get_state())
        c = self._counters
        snaps.start(commit.loop, lsn, max(state.epoch, c.epoch), max(state.counter, c.max_counter, c.reserved),
                    state.holders, state.keys, written, state.imports)
        return True

    async def wait_snapshot(self) -> None:
        """Wait for a snapshot in progress (if any) to finish."""
        await self._snapshots.wait()

    async def sync(self) -> None:
        """Write and fsync every record logged so far, now, whatever the mode; wait for it.

        :raises WalFatal: the log failed.
        """
        await self._commit.await_synced(self._commit.next_lsn - 1, force=True)

    async def wait_synced(self, lsn: int | None = None) -> None:
        """Wait (without forcing an fsync) until records up to ``lsn`` (default: all
        logged so far) are fsynced -- e.g. by the ``interval`` timer.

        :raises WalFatal: the log failed.
        """
        await self._commit.await_synced(self._commit.next_lsn - 1 if lsn is None else lsn, force=False)

    # -- shutdown ------------------------------------------------------------------------
    async def close(self) -> None:
        """Write and fsync everything logged, wait for a snapshot in progress, stop the writer.

        Durability callbacks of the flushed records run before this returns.
        :raises WalFatal: if the log failed (earlier or during the final fsync).
        """
        if self._phase is _Phase.CLOSED:
            return
        commit = self._commit
        try:
            if commit.fatal is None and self._phase is _Phase.OPEN:
                await commit.flush()
                await self._snapshots.wait()
            if commit.fatal is not None:
                raise WalFatal(f"write-ahead log failed: {commit.fatal!r}") from commit.fatal
            marker = os.path.join(self.directory, UNSYNCED_MARKER)
            if not self.keep_unsynced_marker and os.path.exists(marker):
                os.unlink(marker)  # everything logged is fsynced now: nothing can be lost
                fsync_dir(self.directory)
        finally:
            self._stop()

    def abort(self) -> None:
        """Stop at once without flushing (after a fatal error, or to simulate a crash in tests).

        Records not yet written are lost; callbacks never run.
        """
        self._stop(drop=True)

    def _stop(self, drop: bool = False) -> None:
        self._phase = _Phase.CLOSED
        self.appending = False
        self._commit.stop(drop)  # stops the writer: closes the segment, releases the directory lock
        self._snapshots.join()

    # -- introspection --------------------------------------------------------------------
    def take_fsync_seconds(self) -> list[float]:
        """The durations (seconds) of the data fsyncs done since the last call (at most the
        latest 4096), oldest first; the writer thread appends, this takes them away."""
        durations = self._commit.io.fsync_seconds
        taken = []
        while durations:
            taken.append(durations.popleft())
        return taken

    def stats(self) -> dict:
        """Counters: ``records`` logged since open, ``bytes`` written, ``fsyncs``
        (data fsyncs incl. rotation/segment creation; ``thread_fsyncs`` of them batches synced
        on the writer thread, the others on the loop), ``batches`` written,
        ``last_lsn`` logged, ``written_lsn``, ``durable_lsn`` (fsynced),
        ``ack_lsn`` (callbacks released), ``snapshot_lsn``, ``segments`` on disk,
        ``pending_bytes`` (not yet handed to the writer), ``active_segment`` (path),
        ``durable_offset``/``written_offset`` (bytes in the active segment),
        ``reserved_counter``, ``fsync_mode``."""
        commit = self._commit
        io = commit.io
        marks = commit.marks
        return {
            "records": commit.next_lsn - marks.first,
            "bytes": io.bytes,
            "fsyncs": io.fsyncs,
            "thread_fsyncs": io.thread_fsyncs,
            "batches": io.batches,
            "last_lsn": commit.next_lsn - 1,
            "written_lsn": marks.written,
            "durable_lsn": marks.synced,
            "ack_lsn": marks.ack,
            "snapshot_lsn": self._snapshots.lsn,
            "segments": len(io.segments),
            "pending_bytes": commit.pending_bytes,
            "active_segment": io.seg_path,
            "durable_offset": io.durable_offset,
            "written_offset": io.seg_size,
            "reserved_counter": self._counters.reserved,
            "fsync_mode": self.fsync_mode,
        }


_pack = msgpack.Packer().pack
