"""Write-ahead log: append, group commit, recovery, snapshots/compaction, audit dump.

Everything the lock server must remember across a restart goes through this log:
grants, releases, expiries, TTL changes, epoch changes and fencing-counter
reservations.  Recovery loads the newest valid snapshot and replays the records
after it.

On disk (one directory)
-----------------------
``wal-<first-lsn:020d>.log``
    A segment: a 24-byte header (magic ``FLOCKWAL``, format version, first LSN,
    CRC32 of the header) followed by frames.  Each frame is::

        crc32 : u32 little-endian  -- zlib.crc32 of the next 4 bytes + body
        len   : u32 little-endian  -- body length in bytes (low 30 bits);
                                      bit 30 marks the first frame of a written
                                      batch, bit 31 its last frame ("commit")
        body  : msgpack array       -- [type, field, ...] (positional, see below)

    Record *i* of a segment has LSN ``first_lsn + i`` (LSNs are implicit, start
    at 1 and never repeat).  A segment is rotated once it holds at least
    ``segment_bytes``; a batch never spans two segments, and the old segment is
    fsynced before the next one is created, so only the last segment can ever
    have an unsynced tail, whatever the fsync mode.  Every :meth:`~WriteAheadLog.open`
    starts a new segment at the next LSN.
``snap-<lsn:020d>.snap``
    A snapshot of the lock table after applying every record up to ``lsn``:
    a header (magic ``FLOCKSNP``, version, lsn, epoch, counter, body length),
    a msgpack array of holders, and a trailing CRC32 of everything before it.
    Written to ``*.tmp``, fsynced, renamed, directory fsynced (so a snapshot
    is either absent or complete).

Record bodies (``[type, ...]``; times are wall-clock milliseconds since the Unix
epoch, kept for the audit dump only -- expiry never looks at them):

========  ==  ==================================================================
GRANT      1  name, token, owner, ttl_ms, lock_delay_ms, client_name, correlation_id, wall_ms
RELEASE    2  name, token, wall_ms
EXPIRE     3  name, token, wall_ms
EXTEND     4  name, token, ttl_ms, wall_ms
EPOCH      5  epoch, wall_ms
RESERVE    6  counter, wall_ms         (counter values up to ``counter`` may be issued)
========  ==  ==================================================================

Replay rules: GRANT installs the holder (replacing any); RELEASE/EXPIRE remove
the holder when its token matches; EXTEND sets the holder's ``ttl_ms`` when its
token matches; EPOCH raises the epoch; RESERVE raises the counter.  The
recovered epoch is the highest of every EPOCH record and every token's epoch;
the recovered counter is the highest of every token's counter and every
reservation.  ``token = (epoch << 40) | counter`` (see ``_core.pyi``).

The framing (length + CRC per record, numbered segments, torn-tail repair on
recovery) follows etcd's WAL.

Recovery and corruption
-----------------------
A bad frame (short, zero length, length beyond the file, CRC mismatch) in the
*last* segment followed by nothing valid is a torn tail: a write that the
crash interrupted.  It is cut (the file is truncated and fsynced) and reported
as a WARNING naming the segment, the offset and the number of bytes removed.
Valid frames may follow the bad one only if they are the rest of the same
batch (no batch-start mark among them, nothing after a commit mark): that is
the one batch whose fsync never completed in ``always`` mode, with its pages
written out of order.  Anything else -- valid data from a later batch, or any
bad frame in a non-last segment -- is mid-log corruption: :class:`WalCorruption` is raised with
the segment path, the byte offset and the LSN -- nothing is silently skipped.
An operator who accepts the loss can reopen with ``open(repair=True)``, which
cuts the last segment at its first bad frame (logged at ERROR).

If the newest snapshot is unreadable (CRC, truncation), an older one is used
when the segments needed to replay from it still exist (``keep_snapshots=2``
keeps them by default); otherwise :class:`WalCorruption` explains which.

fsync modes and what each can lose
----------------------------------
``always`` (default)
    Group commit: the records logged during one turn of the event loop are
    written with one ``os.write`` and made durable with ONE ``os.fsync``; only
    then do their :meth:`~WriteAheadLog.when_durable` callbacks run.  At most
    one fsync is in flight; everything logged meanwhile forms the next batch.
    A batch that nobody waits for (only releases and expiries, which the
    server acknowledges without the disk) is written but not fsynced: the next
    waited-for batch's fsync covers it, or the ``fsync_interval_ms`` timer does.
    So a grant that follows a release pays one fsync, not two.
    Loses nothing that was acknowledged after a durability wait.  A crash may leave records that were
    written but never acknowledged (the in-flight batch); replay keeps them if
    they are intact, which is harmless (a grant nobody heard of expires after
    its TTL; its token is simply never used).  No reservation records are
    written in this mode: every grant is durable before its ack, so the
    replayed counter already covers every acknowledged token.
``interval``
    Callbacks run once the batch is written to the OS (``os.write`` returned);
    a timer fsyncs every ``fsync_interval_ms`` (as Redis ``appendfsync
    everysec``).  An OS crash or power loss loses up to the last
    ``fsync_interval_ms`` of acknowledged records (a process crash loses
    nothing: the OS has the data).  Lost grants/releases/extends mean a lock may
    come back free or held after a restart -- but fencing tokens are never
    reused: see counter reservation below.
``never``
    As ``interval`` without the timer: the OS decides when to write back.
    An OS crash can lose any amount of acknowledged records, with the same
    token guarantee.

In every mode, EPOCH records and counter reservations are fsynced before the
callbacks of their batch run (epochs are rare and a lost epoch would let tokens
go backwards); segment rotation and :meth:`~WriteAheadLog.close` fsync too.

Counter reservation (``interval``/``never``), as databases cache sequences:
when a grant's counter exceeds the reserved counter, a RESERVE record for
``counter + reserve_block`` is logged before it and that batch is fsynced
before its callbacks run.  So after any crash, the recovered counter is at
least every acknowledged token's counter, and the server resumes above it.
Each restart may skip up to ``reserve_block`` counter values (2**40 of them).

Failed writes and fsyncs are fatal, as in PostgreSQL since "fsyncgate" (2018):
after a failed fsync the kernel may have dropped the dirty pages, so retrying
cannot tell what reached the disk.  The log calls ``on_fatal(exc)`` on the
loop, never runs another durability callback, and every later ``log_*`` raises
:class:`WalFatal`.  The process should stop and recover from disk.

Group commit implementation: writer thread vs inline
----------------------------------------------------
Two implementations exist (``writer="thread"`` or ``"inline"``):

* ``thread``: a dedicated thread does ``os.write`` + ``os.fsync`` (both release
  the GIL) while the loop keeps serving and accumulating the next batch;
  completion comes back through ``loop.call_soon_threadsafe``.
* ``inline``: the batch is written and fsynced in a ``loop.call_soon`` callback
  on the loop thread, which blocks the loop for the fsync.

Measured on this machine (2 vCPUs shared with other jobs; a 64-byte append +
fsync costs 0.13-0.5 ms, 1-3 ms when the disk is busy) with
``python benches/bench_wal.py --compare-writers --repeat 7 --duration 1 [--uvloop]``:
32 producer tasks each log a grant and await ``when_durable`` (``always``
mode); median of 7 interleaved runs, records/s::

                                         uvloop    asyncio (disk busy)
    all producers in one turn, no work
        thread                           85,288    51,376
        inline                          104,599    56,262
    arrivals over 4 turns, 20 us CPU each
        thread                           25,998    11,775
        inline                           23,906     5,490
    1 ms timer lateness p99 (asyncio)      --      thread 3.5-4.5 ms, inline 7-18 ms

Inline wins only the synthetic case where every producer logs in the same
loop turn, by 10-20% (handing a batch to a thread costs a wake-up and a
``call_soon_threadsafe`` on a CPU-bound 2-vCPU box).  When requests arrive
over several loop turns with real work per request -- what a server reading
many sockets does -- the thread is as fast or faster, because the loop keeps
parsing, replying and expiring leases during the fsync; and when fsync is slow
(it varied 25x here within minutes) inline stalls every client and every timer
for the whole fsync.  So the default is ``writer="thread"``; ``"inline"`` is
kept for benchmarks and for platforms where threads are undesirable.  Even
with the thread, a batch that needs no fsync (``interval``/``never`` modes,
no reservation, no rotation) is written inline: a ``write()`` into the page
cache costs microseconds, less than the hand-off to the thread and back.

Replication hooks
-----------------
:meth:`WriteAheadLog.read_from` iterates ``(lsn, record)`` over the segments
still on disk; :meth:`WriteAheadLog.add_listener` registers ``fn(first_lsn,
last_lsn, data)`` called on the loop with the exact bytes of each written batch
(frames as on disk; decode with :func:`decode_frames`).  A standby can stream
those and append them verbatim to its own log.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import fcntl
import datetime
import gc
import hashlib
import logging
import os
import queue
import re
import stat
import struct
import sys
import threading
import time
import zlib
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence, TextIO

import msgpack

__all__ = [
    "WriteAheadLog",
    "RecoveredState",
    "HolderRecord",
    "WalCorruption",
    "WalFatal",
    "WalCompacted",
    "DataDirInUse",
    "dump",
    "decode_frames",
    "GRANT",
    "RELEASE",
    "EXPIRE",
    "EXTEND",
    "EPOCH",
    "RESERVE",
]

log = logging.getLogger(__name__)

# -- record types ------------------------------------------------------------------
GRANT = 1
RELEASE = 2
EXPIRE = 3
EXTEND = 4
EPOCH = 5
RESERVE = 6
RECORD_NAMES = {GRANT: "grant", RELEASE: "release", EXPIRE: "expire", EXTEND: "extend",
                EPOCH: "epoch", RESERVE: "reserve"}

#: token = (epoch << TOKEN_EPOCH_SHIFT) | counter (mirrors fastlock._core, kept
#: here so that the WAL and its tools do not need the compiled core).
TOKEN_EPOCH_SHIFT = 40
COUNTER_MASK = (1 << TOKEN_EPOCH_SHIFT) - 1

#: Largest record body accepted when writing or reading (bytes).
MAX_RECORD_BYTES = 1 << 20

FSYNC_MODES = ("always", "interval", "never")

_SEG_MAGIC = b"FLOCKWAL"
_SNAP_MAGIC = b"FLOCKSNP"
_FORMAT_VERSION = 1
_SEG_HEADER = struct.Struct("<8sIQI")  # magic, version, first_lsn, crc32 of the first 20 bytes
_SNAP_HEADER = struct.Struct("<8sIQQQQ")  # magic, version, lsn, epoch, counter, body_len
_U32 = struct.Struct("<I")
_FRAME = struct.Struct("<II")  # crc32, len|COMMIT
_COMMIT = 0x80000000  # last frame of a batch
_START = 0x40000000  # first frame of a batch
_LEN_MASK = 0x3FFFFFFF
_SEG_RE = re.compile(r"^wal-(\d{20})\.log$")
_SNAP_RE = re.compile(r"^snap-(\d{20})\.snap$")
_NONZERO = re.compile(rb"[^\x00]")

_crc32 = zlib.crc32


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


# -- public types --------------------------------------------------------------------
class WalCorruption(Exception):
    """The log or a snapshot is damaged in a way recovery must not paper over.

    Attributes: ``path`` (file), ``offset`` (byte offset of the bad frame or -1),
    ``lsn`` (LSN the bad frame would have had, or -1).
    """

    def __init__(self, message: str, path: str = "", offset: int = -1, lsn: int = -1):
        super().__init__(message)
        self.path = path
        self.offset = offset
        self.lsn = lsn


class WalFatal(RuntimeError):
    """A write or fsync failed earlier: the log accepts nothing more (see ``on_fatal``)."""


class DataDirInUse(RuntimeError):
    """Another process holds the data directory's lock: two servers must never
    append to one log (they would overwrite each other's records and hand out
    the same tokens).  As etcd and ZooKeeper, the directory is locked with
    ``flock`` on its ``LOCK`` file for as long as the log is open."""


class WalCompacted(LookupError):
    """:meth:`WriteAheadLog.read_from` asked for an LSN whose segment was deleted after a snapshot."""


class HolderRecord(NamedTuple):
    """A lease as the WAL remembers it (snapshot entry / recovered holder)."""

    name: str
    token: int  # (epoch << 40) | counter
    owner: bytes
    ttl_ms: int  # lease duration, milliseconds
    lock_delay_ms: int  # milliseconds
    client_name: Optional[str]
    correlation_id: Optional[str]
    granted_wall_ms: int  # wall clock at grant, ms since the Unix epoch; audit only (0 if unknown)


class RecoveredState(NamedTuple):
    """What :meth:`WriteAheadLog.open` found on disk."""

    epoch: int
    counter: int  # highest fencing counter issued OR reserved; resume above it
    holders: list  # list[HolderRecord]
    records_replayed: int  # records applied after the snapshot
    torn_bytes: int  # bytes cut from a torn tail (0 if none)
    next_lsn: int  # LSN the next record will get
    snapshot_lsn: int  # LSN of the snapshot used (0 if none)


# -- frames --------------------------------------------------------------------------
def _frame(body: bytes) -> bytes:
    lenb = _U32.pack(len(body))
    return _U32.pack(_crc32(body, _crc32(lenb))) + lenb + body


def decode_frames(data: bytes, first_lsn: int) -> Iterator[tuple[int, list]]:
    """Decode a run of frames (a listener batch or a segment body) into ``(lsn, record)``.

    Raises :class:`WalCorruption` on any bad frame (a listener batch is never torn).
    """
    it = _FrameReader(data, 0, "<batch>", first_lsn, last=False)
    lsn = first_lsn
    for rec in it:
        yield lsn, rec
        lsn += 1


class _FrameReader:
    """Iterate the records of a buffer of frames, classifying a bad frame.

    After iteration: ``end`` = offset just past the last good frame, ``count``
    = records yielded, ``torn_at`` = offset of a torn tail (or -1).
    With ``last=False`` any bad frame raises WalCorruption; with ``last=True`` a
    torn tail (see the module docstring) stops iteration instead; ``repair``
    treats any bad frame of a last segment as a torn tail; ``lenient`` (for
    readers of a live segment) stops at any bad frame without raising.
    """

    __slots__ = ("data", "start", "path", "first_lsn", "last", "repair", "lenient",
                 "end", "count", "torn_at", "reason", "limit", "skip")

    def __init__(self, data, start, path, first_lsn, *, last, repair=False, lenient=False, limit=-1, skip=0):
        self.data = data
        self.start = start
        self.path = path
        self.first_lsn = first_lsn
        self.last = last
        self.repair = repair
        self.lenient = lenient
        self.limit = limit  # stop after this many records (-1: no limit)
        self.skip = skip  # check but neither decode nor yield the first ``skip`` records
        self.end = start
        self.count = 0
        self.torn_at = -1
        self.reason = ""

    def __iter__(self):
        data = self.data
        mv = memoryview(data)
        n = len(data)
        off = self.start
        unpack_from = _FRAME.unpack_from
        crc32 = _crc32
        unpackb = msgpack.unpackb
        count = 0
        limit = self.limit
        skip = self.skip
        try:
            while off < n:
                if count == limit:
                    break
                if off + 8 > n:
                    self._bad(mv, off, count, "incomplete frame header")
                    break
                crc, lw = unpack_from(data, off)
                ln = lw & _LEN_MASK
                end = off + 8 + ln
                if ln == 0 or ln > MAX_RECORD_BYTES or end > n:
                    self._bad(mv, off, count, "bad frame length %d" % ln)
                    break
                if crc32(mv[off + 4:end]) != crc:
                    self._bad(mv, off, count, "CRC mismatch")
                    break
                if count < skip:
                    off = end
                    count += 1
                    continue
                try:
                    rec = unpackb(mv[off + 8:end])
                except Exception as exc:  # CRC matched but the body is not ours
                    raise WalCorruption(
                        f"{self.path}: undecodable record at offset {off} (LSN {self.first_lsn + count}): {exc}",
                        self.path, off, self.first_lsn + count) from None
                if type(rec) is not list or not rec or rec[0] not in RECORD_NAMES:
                    raise WalCorruption(
                        f"{self.path}: unknown record at offset {off} (LSN {self.first_lsn + count}): {rec!r:.80}",
                        self.path, off, self.first_lsn + count)
                off = end
                count += 1
                yield rec
        finally:
            self.end = off  # just past the last good frame
            self.count = count
            mv.release()

    def _bad(self, mv, off, count, why):
        lsn = self.first_lsn + count
        self.reason = why
        if self.lenient:
            return
        where = f"{self.path}: {why} at offset {off} (LSN {lsn})"
        if not self.last:
            raise WalCorruption(f"corrupt record in a non-last segment: {where}", self.path, off, lsn)
        if self.repair or _is_torn_tail(self.data, mv, off, len(self.data)):
            self.torn_at = off
            return
        raise WalCorruption(
            f"corrupt record followed by valid data (mid-log corruption): {where}; "
            f"refusing to start. Reopen with repair=True to cut the log at this point "
            f"(losing {len(self.data) - off} bytes).", self.path, off, lsn)


def _frame_ok(data, mv, p, n):
    """(valid, end, commit) for a frame starting at ``p``."""
    if p + 8 > n:
        return False, p, False
    crc, lw = _FRAME.unpack_from(data, p)
    ln = lw & _LEN_MASK
    end = p + 8 + ln
    if ln == 0 or ln > MAX_RECORD_BYTES or end > n or _crc32(mv[p + 4:end]) != crc:
        return False, p, False
    return True, end, lw


def _find_valid_frame(data, mv, p, n):
    """Offset of the first valid frame at or after ``p``, or -1 (resynchronising scan)."""
    while p + 9 <= n:
        if data[p] == 0:
            m = _NONZERO.search(data, p)
            if m is None:
                return -1
            # a frame at p' needs a non-zero byte among its first 8 (crc, len)
            q = m.start() - 7
            if q > p:
                p = q
                continue
        ok, _end, _c = _frame_ok(data, mv, p, n)
        if ok:
            return p
        p += 1
    return -1


def _is_torn_tail(data, mv, x, n):
    """True if everything from the bad frame at ``x`` on may be one torn final batch.

    Valid frames after the bad one must belong to its batch: none may carry a
    batch-start mark, and none may follow a commit mark.
    """
    p = _find_valid_frame(data, mv, x + 1, n)
    while p >= 0:
        ok, end, lw = _frame_ok(data, mv, p, n)
        if not ok:
            p = _find_valid_frame(data, mv, p + 1, n)
            continue
        if lw & _START:
            return False
        if lw & _COMMIT:
            return _find_valid_frame(data, mv, end, n) < 0
        p = end
        if p >= n:
            return True
    return True


# -- files -----------------------------------------------------------------------------
def _seg_name(first_lsn: int) -> str:
    return f"wal-{first_lsn:020d}.log"


def _snap_name(lsn: int) -> str:
    return f"snap-{lsn:020d}.snap"


def _seg_header(first_lsn: int) -> bytes:
    head = _SEG_MAGIC + _U32.pack(_FORMAT_VERSION) + struct.pack("<Q", first_lsn)
    return head + _U32.pack(_crc32(head))


def _list_dir(directory: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    segs, snaps = [], []
    for fn in os.listdir(directory):
        m = _SEG_RE.match(fn)
        if m:
            segs.append((int(m.group(1)), os.path.join(directory, fn)))
            continue
        m = _SNAP_RE.match(fn)
        if m:
            snaps.append((int(m.group(1)), os.path.join(directory, fn)))
    segs.sort()
    snaps.sort()
    return segs, snaps


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


#: a data directory holds owner keys (in grants and snapshots): only its owner may read it
DIR_MODE = 0o700
FILE_MODE = 0o600


def secure_directory(directory: str) -> None:
    """Create ``directory`` with mode 0700 if missing; tighten an existing one to
    0700 and every file in it to 0600 (each change logged at WARNING).

    :raises OSError: the directory cannot be created or changed.
    """
    os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
    st = os.stat(directory)
    if st.st_mode & 0o777 != DIR_MODE:
        os.chmod(directory, DIR_MODE)
        log.warning("data directory %s was mode %o: tightened to %o", directory, st.st_mode & 0o777, DIR_MODE)
    loose = []
    for fn in os.listdir(directory):
        path = os.path.join(directory, fn)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o777 != FILE_MODE:
            os.chmod(path, FILE_MODE)
            loose.append(fn)
    if loose:
        log.warning("data directory %s: tightened %d files to mode %o (%s%s)", directory, len(loose), FILE_MODE,
                    ", ".join(sorted(loose)[:5]), ", ..." if len(loose) > 5 else "")


class BacklogReader:
    """Reads the log's frames from an LSN on, in chunks of raw frame bytes, for a
    standby catching up (``REPLICATE`` with a position).

    Meant to run off the event loop (``loop.run_in_executor``): each
    :meth:`read` does file I/O and walks frame headers only - records are not
    decoded, the bytes go to the standby as written (it checks every CRC).
    Keeps its place between calls, so reading a whole log costs one pass.
    Not thread-safe: one call at a time.

    :param wal: the log.
    :param lsn: first LSN to return (>= 1).
    """

    def __init__(self, wal: "WriteAheadLog", lsn: int):
        self.wal = wal
        self.next_lsn = max(1, lsn)
        self._seg_first = 0  # first LSN of the segment being read (0: none yet)
        self._seg_path = ""
        self._offset = 0  # file offset of the frame of next_lsn in that segment
        self._seg_lsn = 0  # LSN at _offset

    def _segments(self) -> list[tuple[int, str]]:
        with self.wal._seg_lock:
            return list(self.wal._segments)

    def _seek(self) -> None:
        """Find the segment holding ``next_lsn`` and the offset of its frame."""
        segs = self._segments()
        lsn = self.next_lsn
        if not segs or lsn < segs[0][0]:
            raise WalCompacted(f"LSN {lsn} is no longer in the log (oldest segment starts at "
                               f"{segs[0][0] if segs else None})")
        first, path = max((sf, sp) for sf, sp in segs if sf <= lsn)
        self._seg_first, self._seg_path = first, path
        self._offset, self._seg_lsn = _SEG_HEADER.size, first

    def read(self, max_bytes: int, upto: int) -> tuple[int, int, bytes] | None:
        """Return ``(first_lsn, last_lsn, frames)`` - whole frames, about
        ``max_bytes`` of them, from ``next_lsn`` and at most up to LSN ``upto`` -
        or None when ``next_lsn > upto``.

        :raises WalCompacted: the records were deleted by compaction.
        :raises WalCorruption: a damaged frame on the way.
        """
        if self.next_lsn > upto:
            return None
        if not self._seg_first:
            self._seek()
        while True:
            try:
                with open(self._seg_path, "rb") as f:
                    out = self._read_segment(f, max_bytes, upto)
            except FileNotFoundError:
                raise WalCompacted(f"segment {self._seg_path} was deleted while a standby read it") from None
            if out is not None:
                return out
            # this segment holds nothing more: move to the one starting at next_lsn
            nxt = [(sf, sp) for sf, sp in self._segments() if sf == self.next_lsn]
            if not nxt:
                raise WalCorruption(f"{self._seg_path}: ends before LSN {self.next_lsn} (<= {upto})",
                                    self._seg_path, self._offset, self.next_lsn)
            self._seg_first, self._seg_path = nxt[0]
            self._offset, self._seg_lsn = _SEG_HEADER.size, self._seg_first

    def _read_segment(self, f, max_bytes: int, upto: int) -> tuple[int, int, bytes] | None:
        unpack_from = _FRAME.unpack_from
        # skip the frames before next_lsn (headers only, a block at a time)
        while self._seg_lsn < self.next_lsn:
            f.seek(self._offset)
            block = f.read(MAX_RECORD_BYTES + (1 << 20))
            p = 0
            while self._seg_lsn < self.next_lsn and p + 8 <= len(block):
                end = p + 8 + (unpack_from(block, p)[1] & _LEN_MASK)
                if end > len(block):
                    break
                p = end
                self._seg_lsn += 1
            if p == 0:
                return None  # the segment ends here
            self._offset += p
        f.seek(self._offset)
        data = f.read(max_bytes + MAX_RECORD_BYTES + 8)
        pos = 0
        n = len(data)
        lsn = self._seg_lsn
        while lsn <= upto and pos + 8 <= n and (pos < max_bytes or pos == 0):
            crc, lw = unpack_from(data, pos)
            ln = lw & _LEN_MASK
            end = pos + 8 + ln
            if ln == 0 or ln > MAX_RECORD_BYTES or end > n:
                break  # the end of what is written (upto bounds us to written records)
            pos = end
            lsn += 1
        if lsn == self._seg_lsn:
            return None
        first = self._seg_lsn
        self._offset += pos
        self._seg_lsn = self.next_lsn = lsn
        return first, lsn - 1, data[:pos]


def _encode_snapshot(lsn: int, epoch: int, counter: int, holders: Sequence) -> bytes:
    packer = msgpack.Packer()
    parts = [packer.pack_array_header(len(holders))]
    pack = packer.pack
    # Small chunks so that a snapshot thread gives the GIL back to the loop often.
    for i in range(0, len(holders), 1000):
        parts.append(b"".join([pack(tuple(h)) for h in holders[i:i + 1000]]))
    body = b"".join(parts)
    head = _SNAP_HEADER.pack(_SNAP_MAGIC, _FORMAT_VERSION, lsn, epoch, counter, len(body))
    crc = _crc32(body, _crc32(head))
    return head + body + _U32.pack(crc)


def _load_snapshot(path: str) -> tuple[int, int, int, list]:
    """Return (lsn, epoch, counter, holders as lists); raise WalCorruption if damaged."""
    data = _read_file(path)
    hs = _SNAP_HEADER.size
    if len(data) < hs + 4:
        raise WalCorruption(f"{path}: snapshot truncated ({len(data)} bytes)", path, 0)
    magic, version, lsn, epoch, counter, blen = _SNAP_HEADER.unpack_from(data, 0)
    if magic != _SNAP_MAGIC:
        raise WalCorruption(f"{path}: not a fastlock snapshot (magic {magic!r})", path, 0)
    if version != _FORMAT_VERSION:
        raise WalCorruption(f"{path}: unsupported snapshot format version {version}", path, 0)
    if len(data) != hs + blen + 4:
        raise WalCorruption(f"{path}: snapshot length {len(data)} != {hs + blen + 4} (truncated?)", path, 0)
    mv = memoryview(data)
    try:
        if _crc32(mv[hs:hs + blen], _crc32(mv[:hs])) != _U32.unpack_from(data, hs + blen)[0]:
            raise WalCorruption(f"{path}: snapshot CRC mismatch", path, 0)
        holders = msgpack.unpackb(mv[hs:hs + blen])
    finally:
        mv.release()
    return lsn, epoch, counter, holders


class _Recovery:
    """Shared by open() (truncates torn tails) and dump() (reads only)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.segs, self.snaps = _list_dir(directory)

    def choose_base(self, *, oldest: bool = False) -> tuple[int, Optional[tuple]]:
        """Pick the snapshot to start from: (lsn, (lsn, epoch, counter, holders) or None).

        Newest loadable snapshot whose following records still exist (or, with
        ``oldest``, the oldest such one, for the audit dump).  Raise WalCorruption
        if none works.
        """
        first_seg = self.segs[0][0] if self.segs else None
        candidates = list(reversed(self.snaps)) + [(0, None)]
        if oldest:
            candidates = [(0, None)] + list(self.snaps)
        problems = []
        for lsn, path in candidates:
            if first_seg is not None and first_seg > lsn + 1:
                problems.append(f"{path or 'no snapshot'}: the log before LSN {first_seg} was compacted")
                continue
            if path is None and first_seg is None and self.snaps:
                problems.append("no segment reaches back to LSN 1")
                continue
            if path is None:
                if problems and not oldest:
                    log.error("no usable snapshot (%s); replaying the whole log", "; ".join(problems))
                return 0, None
            try:
                snap = _load_snapshot(path)
            except (WalCorruption, OSError, ValueError, msgpack.UnpackException) as exc:
                problems.append(str(exc))
                continue
            if problems and not oldest:
                log.error("falling back to snapshot %s: %s", path, "; ".join(problems))
            return lsn, snap
        raise WalCorruption(
            f"{self.directory}: no usable snapshot and the log does not reach back to LSN 1: "
            + "; ".join(problems), self.directory)

    def segments_after(self, base: int) -> list[tuple[int, str]]:
        """Segments that may hold records > base (skip those wholly covered)."""
        segs = self.segs
        out = []
        for i, (first, path) in enumerate(segs):
            if i + 1 < len(segs) and segs[i + 1][0] <= base + 1:
                continue
            out.append((first, path))
        return out


def _parse_segment(path: str, data: bytes, expect_first: int, last: bool) -> int:
    """Validate a segment header; return the offset of its first frame, or -1 if torn-empty."""
    hs = _SEG_HEADER.size
    if len(data) < hs or not data.strip(b"\0"):
        if last:
            return -1
        raise WalCorruption(f"{path}: truncated segment header", path, 0, expect_first)
    magic, version, first, crc = _SEG_HEADER.unpack_from(data, 0)
    if magic != _SEG_MAGIC or crc != _crc32(data[:hs - 4]):
        if last and len(data) <= hs:
            return -1
        raise WalCorruption(f"{path}: bad segment header", path, 0, expect_first)
    if version != _FORMAT_VERSION:
        raise WalCorruption(f"{path}: unsupported WAL format version {version}", path, 0, expect_first)
    if first != expect_first:
        raise WalCorruption(f"{path}: header says first LSN {first}, file name says {expect_first}",
                            path, 0, expect_first)
    return hs


# -- the log -----------------------------------------------------------------------------
class _Job:
    __slots__ = ("data", "first_lsn", "last_lsn", "sync", "records")

    def __init__(self, data, first_lsn, last_lsn, sync, records):
        self.data = data
        self.first_lsn = first_lsn
        self.last_lsn = last_lsn
        self.sync = sync
        self.records = records


def _default_on_fatal(exc: BaseException) -> None:
    log.critical("write-ahead log failed, nothing more will be acknowledged: %r", exc)
    raise exc


class WriteAheadLog:
    """The write-ahead log of one server.

    :param directory: data directory (created by :meth:`open` if missing).
    :param fsync: ``"always"`` (default), ``"interval"`` or ``"never"``; see the
        module docstring for what each can lose.
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
    :param writer: ``"thread"`` (default) or ``"inline"`` group commit; see module docstring.
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
        self.segment_bytes = segment_bytes
        self.snapshot_every = snapshot_every
        self.reserve_block = reserve_block
        self.keep_snapshots = keep_snapshots
        self.writer = writer
        self._on_fatal = on_fatal or _default_on_fatal
        self._always = fsync == "always"
        self._packer = msgpack.Packer()

        # loop-side state
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._opened = False
        self._closed = False
        self._stopped = False  # the I/O side is shut down (close/abort)
        self._fatal: Optional[BaseException] = None
        self._buf = bytearray()
        self._buf_first = 1  # LSN of the first record in _buf
        self._buf_last_frame = -1  # offset in _buf of the last frame
        self._buf_sync = False  # the pending batch must be fsynced before its acks
        self._sync_requested = False
        self._next_lsn = 1
        self._scheduled = False
        self._inflight: Optional[_Job] = None
        self._written_lsn = 0
        self._synced_lsn = 0
        self._ack_lsn = 0
        self._waiters: collections.deque = collections.deque()
        self._sync_waiters: list = []  # (lsn, future) resolved when synced_lsn >= lsn
        self._listeners: list = []
        self._timer: Optional[asyncio.TimerHandle] = None
        self._reserved = 0  # counter reserved (interval/never)
        self._max_counter = 0
        self._epoch = 0
        self._records = 0
        self._since_snapshot = 0
        self._snapshot_lsn = 0
        self._snapshotting: Optional[asyncio.Future] = None
        self._snap_thread: Optional[threading.Thread] = None

        # I/O-side state (touched only by whoever runs _do_io: the writer thread or the loop)
        self._fd = -1
        self._lock_fd = -1  # flock on <dir>/LOCK while open
        #: open(repair=True) cut records: acknowledged grants may be gone, and with
        #: them the evidence of the tokens they used (the server raises the epoch)
        self.repaired = False
        self._seg_first = 0
        self._seg_path = ""
        self._seg_size = 0
        self._dirty = False
        self._durable_offset = 0
        self._bytes = 0
        self._fsyncs = 0
        self._batches = 0
        self._segments: list[tuple[int, str]] = []
        self._seg_lock = threading.Lock()
        self._queue: Optional[queue.SimpleQueue] = None
        self._thread: Optional[threading.Thread] = None

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
        if self._opened:
            raise RuntimeError("WriteAheadLog.open() called twice")
        # Recovery allocates millions of small containers that all survive: the cyclic
        # GC would rescan them again and again (3x slower for 100k holders).
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._open(repair)
        except BaseException:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
            raise
        finally:
            if was_enabled:
                gc.enable()

    def _lock_directory(self) -> None:
        path = os.path.join(self.directory, "LOCK")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.read(fd, 64).decode("ascii", "replace").strip() or "?"
            finally:
                os.close(fd)
            raise DataDirInUse(
                f"data directory {self.directory} is in use by another fastlock process (pid {holder})"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _open(self, repair: bool) -> RecoveredState:
        d = self.directory
        secure_directory(d)
        self._lock_directory()
        for fn in os.listdir(d):
            if fn.startswith("snap-") and fn.endswith(".tmp"):
                os.unlink(os.path.join(d, fn))
        rec = _Recovery(d)
        base, snap = rec.choose_base()
        holders: dict = {}
        epoch = counter = 0
        if snap is not None:
            _lsn, epoch, counter, sh = snap
            for h in sh:
                holders[h[0]] = [0, *h]
        segs = rec.segments_after(base)
        replayed = 0
        torn = 0
        last_lsn = base
        expect = None  # next LSN the log must continue with
        for i, (first, path) in enumerate(segs):
            is_last = i == len(segs) - 1
            if expect is not None and first != expect and not (expect < first <= base + 1):
                raise WalCorruption(
                    f"{path}: segment starts at LSN {first} but the previous one ends at LSN {expect - 1}",
                    path, 0, first)
            data = _read_file(path)
            start = _parse_segment(path, data, first, is_last)
            if start < 0:
                if data:
                    log.warning("WAL torn tail cut: segment %s has an incomplete header (%d bytes removed)",
                                path, len(data))
                torn += len(data)
                os.unlink(path)
                _fsync_dir(d)
                rec.segs.remove((first, path))
                expect = max(expect or first, first)
                continue
            # records <= base are in the snapshot: checked, not decoded
            reader = _FrameReader(data, start, path, first, last=is_last, repair=repair,
                                  skip=max(0, base - first + 1))
            epoch, counter, n = _replay(reader, holders, epoch, counter)
            replayed += n
            if reader.torn_at >= 0:
                cut = len(data) - reader.torn_at
                torn += cut
                lvl = logging.ERROR if (repair and reader.reason) else logging.WARNING
                if repair and reader.reason:
                    self.repaired = True  # records (maybe acknowledged ones) were cut
                log.log(lvl, "WAL torn tail cut: segment %s offset %d, %d bytes removed (%s, LSN %d)",
                        path, reader.torn_at, cut, reader.reason, first + reader.count)
                with open(path, "r+b") as f:
                    f.truncate(reader.torn_at)
                    f.flush()
                    os.fsync(f.fileno())
            expect = first + reader.count
            last_lsn = max(last_lsn, expect - 1)
        next_lsn = max(last_lsn, base) + 1

        self._next_lsn = next_lsn
        self._buf_first = next_lsn
        self._written_lsn = self._synced_lsn = self._ack_lsn = next_lsn - 1
        self._epoch = epoch
        self._reserved = self._max_counter = counter
        self._snapshot_lsn = base
        self._segments = list(rec.segs)
        self._open_segment(next_lsn)
        self._opened = True
        return RecoveredState(
            epoch=epoch,
            counter=counter,
            holders=[HolderRecord(*h[1:9]) for h in holders.values()],
            records_replayed=replayed,
            torn_bytes=torn,
            next_lsn=next_lsn,
            snapshot_lsn=base,
        )

    def _open_segment(self, first_lsn: int) -> None:
        """Create and switch to a new segment (I/O side)."""
        path = os.path.join(self.directory, _seg_name(first_lsn))
        with self._seg_lock:
            if self._segments and self._segments[-1][0] == first_lsn:
                # an empty segment left by a previous open(): start it afresh
                self._segments.pop()
                os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
        try:
            self._write_all(fd, _seg_header(first_lsn))
            os.fsync(fd)
            _fsync_dir(self.directory)
        except BaseException:
            os.close(fd)
            raise
        self._fsyncs += 1
        self._fd = fd
        self._seg_first = first_lsn
        self._seg_path = path
        self._seg_size = self._durable_offset = _SEG_HEADER.size
        self._dirty = False
        with self._seg_lock:
            self._segments.append((first_lsn, path))

    # -- async machinery ---------------------------------------------------------------
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Start group commit on ``loop`` (default: the running loop). Call after :meth:`open`."""
        if not self._opened:
            raise RuntimeError("WriteAheadLog.start() before open()")
        if self._loop is not None:
            raise RuntimeError("WriteAheadLog.start() called twice")
        self._loop = loop or asyncio.get_running_loop()
        if self.writer == "thread":
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._writer_main, name="fastlock-wal", daemon=True)
            self._thread.start()
        if self.fsync_mode in ("interval", "always"):
            # `always`: records nobody waited for (releases, expiries) are fsynced
            # by the next grant's batch, or by this timer at the latest
            self._timer = self._loop.call_later(self.fsync_interval_ms / 1000.0, self._on_interval)
        if self._buf or self._waiters:
            self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and self._inflight is None and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._kick)

    def _kick(self) -> None:
        """Hand the pending batch to the writer (at most one in flight)."""
        self._scheduled = False
        if self._inflight is not None or self._fatal is not None or self._stopped:
            return
        buf = self._buf
        if not buf and not self._sync_requested:
            return
        # In `always` mode a batch is fsynced when someone waits on it; a batch
        # nobody waits for (releases, expiries: acknowledged without the disk)
        # is only written, and rides on the next fsync (or the interval timer).
        # So an acquire after a release costs one fsync, not two.
        sync = (self._buf_sync or self._sync_requested
                or (self._always and bool(buf) and (bool(self._waiters) or bool(self._sync_waiters))))
        if buf:
            # batch marks on the first and last frames (recompute their CRCs)
            off = self._buf_last_frame
            buf[off + 7] |= 0x80
            with memoryview(buf) as mv:
                _U32.pack_into(buf, off, _crc32(mv[off + 4:]))
                buf[7] |= 0x40
                if off:
                    first_end = 8 + (_U32.unpack_from(buf, 4)[0] & _LEN_MASK)
                    _U32.pack_into(buf, 0, _crc32(mv[4:first_end]))
                else:
                    _U32.pack_into(buf, 0, _crc32(mv[4:]))
        job = _Job(bytes(buf), self._buf_first, self._next_lsn - 1, sync, self._next_lsn - self._buf_first)
        self._buf = bytearray()
        self._buf_first = self._next_lsn
        self._buf_last_frame = -1
        self._buf_sync = False
        self._sync_requested = False
        self._inflight = job
        # The thread earns its hand-off cost only when the batch blocks on the
        # disk (an fsync, or a segment rotation, which fsyncs).  A plain write()
        # to the page cache takes microseconds: do it here, so the relaxed
        # modes acknowledge in the same loop turn instead of after a thread
        # round trip (W1 acquire p50 ~110 us -> ~60 us with --fsync never).
        if self._queue is not None and (sync or self._seg_size >= self.segment_bytes):
            self._queue.put(job)
            return
        try:
            self._do_io(job)
        except BaseException as exc:
            self._io_failed(exc)
            return
        self._io_done(job)

    def _writer_main(self) -> None:
        q = self._queue
        loop = self._loop
        while True:
            job = q.get()
            if job is None:
                return
            try:
                self._do_io(job)
            except BaseException as exc:
                try:
                    loop.call_soon_threadsafe(self._io_failed, exc)
                except RuntimeError:  # loop closed
                    pass
                return
            try:
                loop.call_soon_threadsafe(self._io_done, job)
            except RuntimeError:
                return

    @staticmethod
    def _write_all(fd: int, data) -> None:
        mv = memoryview(data)
        while mv:
            n = os.write(fd, mv)
            mv = mv[n:]

    def _do_io(self, job: _Job) -> None:
        """Write (and maybe fsync) one batch.  Runs on the writer thread or inline."""
        data = job.data
        if data:
            if self._seg_size >= self.segment_bytes and job.first_lsn > self._seg_first:
                self._rotate(job.first_lsn)
            self._write_all(self._fd, data)
            self._seg_size += len(data)
            self._bytes += len(data)
            self._batches += 1
            self._dirty = True
        if job.sync and self._dirty:
            os.fsync(self._fd)
            self._fsyncs += 1
            self._dirty = False
            self._durable_offset = self._seg_size

    def _rotate(self, first_lsn: int) -> None:
        if self._dirty:
            os.fsync(self._fd)
            self._fsyncs += 1
            self._dirty = False
            self._durable_offset = self._seg_size
        os.close(self._fd)
        self._fd = -1
        self._open_segment(first_lsn)

    def _io_done(self, job: _Job) -> None:
        self._inflight = None
        if self._fatal is not None or self._stopped:
            return
        last = job.last_lsn
        self._written_lsn = last
        if job.sync:
            self._synced_lsn = last
        self._ack_lsn = self._synced_lsn if self._always else last
        if job.data:
            for fn in self._listeners:
                try:
                    fn(job.first_lsn, last, job.data)
                except Exception as exc:
                    self._report(exc, "WAL listener failed")
        ack = self._ack_lsn
        waiters = self._waiters
        while waiters and waiters[0][0] <= ack:
            cb = waiters.popleft()[1]
            try:
                cb()
            except Exception as exc:
                self._report(exc, "WAL when_durable callback failed")
        if self._sync_waiters:
            synced = self._synced_lsn
            keep = []
            for lsn, fut in self._sync_waiters:
                if lsn <= synced:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    keep.append((lsn, fut))
            self._sync_waiters = keep
        if self._buf or self._sync_requested:
            self._kick()

    def _report(self, exc: BaseException, message: str) -> None:
        self._loop.call_exception_handler({"message": message, "exception": exc})

    def _io_failed(self, exc: BaseException) -> None:
        if self._fatal is not None or self._stopped:
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
        log.critical("WAL %s failed on %s: %r", "write/fsync", self._seg_path, exc)
        self._on_fatal(exc)

    def _on_interval(self) -> None:
        self._timer = self._loop.call_later(self.fsync_interval_ms / 1000.0, self._on_interval)
        if self._written_lsn > self._synced_lsn or self._buf:
            self._sync_requested = True
            self._schedule()

    # -- appending ------------------------------------------------------------------------
    def _append(self, rec: list) -> None:
        if self._fatal is not None:
            raise WalFatal(f"write-ahead log failed earlier: {self._fatal!r}") from self._fatal
        if self._closed or not self._opened:
            raise RuntimeError("write-ahead log is not open")
        body = self._packer.pack(rec)
        if len(body) > MAX_RECORD_BYTES:
            raise ValueError(f"WAL record of {len(body)} bytes exceeds {MAX_RECORD_BYTES}")
        lenb = _U32.pack(len(body))
        buf = self._buf
        self._buf_last_frame = len(buf)
        buf += _U32.pack(_crc32(body, _crc32(lenb)))
        buf += lenb
        buf += body
        self._next_lsn += 1
        self._records += 1
        self._since_snapshot += 1
        if not self._scheduled and self._inflight is None and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._kick)

    def log_grant(self, name: str, token: int, owner: bytes, ttl_ms: int, lock_delay_ms: int,
                  client_name: Optional[str], correlation_id: Optional[str]) -> None:
        """Log a grant of ``name`` with fencing ``token`` (ttl/lock-delay in milliseconds).

        In ``interval``/``never`` mode, a counter beyond the reservation first logs a
        RESERVE record and makes this batch wait for an fsync.
        :raises WalFatal: after a failed write/fsync.  :raises TypeError: unencodable field.
        """
        counter = token & COUNTER_MASK
        if counter > self._max_counter:
            self._max_counter = counter
        ep = token >> TOKEN_EPOCH_SHIFT
        if ep > self._epoch:
            self._epoch = ep
        if counter > self._reserved and not self._always:
            self._reserved = counter + self.reserve_block
            self._append([RESERVE, self._reserved, _wall_ms()])
            self._buf_sync = True
        self._append([GRANT, name, token, owner, ttl_ms, lock_delay_ms, client_name, correlation_id,
                      _wall_ms()])

    def log_release(self, name: str, token: int) -> None:
        """Log that the holder with ``token`` released ``name``."""
        self._append([RELEASE, name, token, _wall_ms()])

    def log_expire(self, name: str, token: int) -> None:
        """Log that the lease with ``token`` on ``name`` expired."""
        self._append([EXPIRE, name, token, _wall_ms()])

    def log_extend(self, name: str, token: int, ttl_ms: int) -> None:
        """Log a new TTL (milliseconds) for the lease ``token`` on ``name`` (only when it changes)."""
        self._append([EXTEND, name, token, ttl_ms, _wall_ms()])

    def log_epoch(self, epoch: int) -> None:
        """Log a new epoch; always fsynced before this batch's callbacks run, in every mode."""
        if epoch > self._epoch:
            self._epoch = epoch
        self._append([EPOCH, epoch, _wall_ms()])
        self._buf_sync = True

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
        if lsn <= self._ack_lsn and not self._waiters and self._loop is not None:
            self._loop.call_soon(callback)
        else:
            self._waiters.append((lsn, callback))
            if self._always and lsn > self._synced_lsn:
                self._sync_requested = True  # the records may be written already, unsynced
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
        if (self._always or self._inflight is not None or self._stopped or self._loop is None
                or self._buf_sync or self._sync_requested or self._seg_size >= self.segment_bytes):
            return False
        if self._buf:
            self._kick()
        return self._fatal is None and self._ack_lsn >= self._next_lsn - 1

    def add_listener(self, fn: Callable[[int, int, bytes], Any]) -> None:
        """Register ``fn(first_lsn, last_lsn, data)``, called on the loop with each written batch.

        ``data`` is the batch exactly as written to the segment (decode with
        :func:`decode_frames`).  Called after the batch is written, and after its
        fsync when the mode requires one.  Exceptions go to the loop's handler.
        """
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[int, int, bytes], Any]) -> None:
        self._listeners.remove(fn)

    # -- reading back ----------------------------------------------------------------------
    @property
    def written_lsn(self) -> int:
        """The last LSN written to a segment (readable by :class:`BacklogReader`)."""
        return self._written_lsn

    def has_lsn(self, lsn: int) -> bool:
        """Is ``lsn`` still in the segments on disk, or not yet written (True), or
        compacted away (False)?"""
        with self._seg_lock:
            oldest = self._segments[0][0] if self._segments else self._next_lsn
        return lsn >= oldest or lsn > self._written_lsn

    def read_from(self, lsn: int) -> Iterator[tuple[int, list]]:
        """Iterate ``(lsn, record)`` for records >= ``lsn`` written so far (segments on disk).

        Records are the positional lists described in the module docstring.
        Stops at the last record written when the call was made.
        :raises WalCompacted: ``lsn`` is older than the oldest segment on disk.
        :raises WalCorruption: a damaged record on the way.
        """
        with self._seg_lock:
            segs = list(self._segments)
        upto = self._written_lsn
        if lsn < 1:
            lsn = 1
        if not segs or lsn < segs[0][0]:
            if lsn > upto:
                return
            raise WalCompacted(f"LSN {lsn} is no longer in the log (oldest segment starts at "
                               f"{segs[0][0] if segs else None})")
        start = 0
        for i, (first, _p) in enumerate(segs):
            if first <= lsn:
                start = i
        for i in range(start, len(segs)):
            first, path = segs[i]
            if first > upto:
                return
            try:
                data = _read_file(path)
            except FileNotFoundError:
                raise WalCompacted(f"segment {path} was deleted while reading") from None
            off = _parse_segment(path, data, first, last=True)
            if off < 0:
                return
            skip = max(0, lsn - first)
            reader = _FrameReader(data, off, path, first, last=False, limit=upto - first + 1,
                                  lenient=(i == len(segs) - 1), skip=skip)
            cur = first + skip
            for rec in reader:
                yield cur, rec
                cur += 1
            if cur - 1 >= upto:
                return

    # -- snapshots ------------------------------------------------------------------------
    def maybe_snapshot(self, get_state: Callable[[], tuple], *, force: bool = False) -> bool:
        """Write a snapshot if ``snapshot_every`` records were logged since the last one.

        ``get_state()`` is called synchronously and must return ``(epoch, counter,
        holders)`` consistent with every record logged so far (``holders``: a list of
        :class:`HolderRecord` or equal 8-tuples, not mutated afterwards).  Encoding,
        writing (temp file, fsync, rename, directory fsync) and deleting the covered
        segments happen on a background thread.  Returns True if a snapshot was started.
        A failed snapshot is logged at ERROR and retried after another ``snapshot_every``
        records (the log itself is intact, so it is not fatal).
        """
        if self._snapshotting is not None or self._fatal is not None or self._closed or self._loop is None:
            return False
        if not force and self._since_snapshot < self.snapshot_every:
            return False
        lsn = self._next_lsn - 1
        if lsn <= self._snapshot_lsn:
            return False
        epoch, counter, holders = get_state()
        epoch = max(epoch, self._epoch)
        counter = max(counter, self._max_counter, self._reserved)
        self._since_snapshot = 0
        loop = self._loop
        self._snapshotting = loop.create_future()

        def run():
            try:
                path = self._write_snapshot(lsn, epoch, counter, holders)
                res: Any = path
            except BaseException as exc:  # noqa: BLE001 - reported on the loop
                res = exc
            try:
                loop.call_soon_threadsafe(self._snapshot_done, lsn, res)
            except RuntimeError:
                pass

        t = self._snap_thread = threading.Thread(target=run, name="fastlock-wal-snapshot", daemon=True)
        t.start()
        return True

    def _write_snapshot(self, lsn: int, epoch: int, counter: int, holders: Sequence) -> str:
        t0 = time.perf_counter()
        data = _encode_snapshot(lsn, epoch, counter, holders)
        d = self.directory
        path = os.path.join(d, _snap_name(lsn))
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
        try:
            self._write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(d)
        # compaction: keep the newest keep_snapshots snapshots and the segments after the oldest kept
        _segs, snaps = _list_dir(d)
        kept = snaps[-self.keep_snapshots:]
        for _l, p in snaps[:-self.keep_snapshots]:
            os.unlink(p)
        # with fewer snapshots than keep_snapshots, the fallback is a full replay: delete nothing
        cover = kept[0][0] if len(kept) >= self.keep_snapshots else 0
        doomed = []
        with self._seg_lock:
            segs = self._segments
            i = 0
            # never the active (last) segment
            while i + 1 < len(segs) and segs[i + 1][0] <= cover + 1:
                i += 1
            doomed = segs[:i]
            del segs[:i]
        for _f, p in doomed:
            os.unlink(p)
        if doomed:
            _fsync_dir(d)
        log.info("snapshot %s written: %d holders, %d bytes, %d segments deleted, %.1f ms",
                 path, len(holders), len(data), len(doomed), (time.perf_counter() - t0) * 1000)
        return path

    def _snapshot_done(self, lsn: int, res: Any) -> None:
        fut = self._snapshotting
        self._snapshotting = None
        self._snap_thread = None
        if isinstance(res, BaseException):
            log.error("WAL snapshot at LSN %d failed (log intact, will retry later): %r", lsn, res)
        else:
            self._snapshot_lsn = max(self._snapshot_lsn, lsn)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait_snapshot(self) -> None:
        """Wait for a snapshot in progress (if any) to finish."""
        if self._snapshotting is not None:
            await asyncio.shield(self._snapshotting)

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
        if lsn <= self._synced_lsn:
            return
        if self._loop is None:
            raise RuntimeError("WriteAheadLog.start() was not called")
        fut = self._loop.create_future()
        self._sync_waiters.append((lsn, fut))
        if force:
            self._sync_requested = True
            self._schedule()
        await fut

    # -- shutdown ------------------------------------------------------------------------
    async def close(self) -> None:
        """Write and fsync everything logged, wait for a snapshot in progress, stop the writer.

        Durability callbacks of the flushed records run before this returns.
        :raises WalFatal: if the log failed (earlier or during the final fsync).
        """
        if self._closed:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            if self._fatal is None and self._opened:
                if self._loop is None:
                    # never started: flush inline
                    self._sync_requested = True
                    self._loop = asyncio.get_running_loop()
                    self._kick()
                else:
                    await self._await_synced(self._next_lsn - 1, force=True)
                if self._snapshotting is not None:
                    await asyncio.shield(self._snapshotting)
            if self._fatal is not None:
                raise WalFatal(f"write-ahead log failed: {self._fatal!r}") from self._fatal
        finally:
            self._closed = True
            self._stop_io()

    def abort(self) -> None:
        """Stop at once without flushing (after a fatal error, or to simulate a crash in tests).

        Records not yet written are lost; callbacks never run.
        """
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._closed = True
        self._waiters.clear()
        self._buf = bytearray()
        self._stop_io()

    def _stop_io(self) -> None:
        self._stopped = True
        if self._queue is not None:
            self._queue.put(None)
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join()
            self._queue = None
            self._thread = None
        if self._snap_thread is not None:
            self._snap_thread.join()
            self._snap_thread = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    # -- introspection --------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters: ``records`` logged since open, ``bytes`` written, ``fsyncs``
        (data fsyncs incl. rotation/segment creation), ``batches`` written,
        ``last_lsn`` logged, ``written_lsn``, ``durable_lsn`` (fsynced),
        ``ack_lsn`` (callbacks released), ``snapshot_lsn``, ``segments`` on disk,
        ``pending_bytes`` (not yet handed to the writer), ``active_segment`` (path),
        ``durable_offset``/``written_offset`` (bytes in the active segment),
        ``reserved_counter``, ``fsync_mode``."""
        return {
            "records": self._records,
            "bytes": self._bytes,
            "fsyncs": self._fsyncs,
            "batches": self._batches,
            "last_lsn": self._next_lsn - 1,
            "written_lsn": self._written_lsn,
            "durable_lsn": self._synced_lsn,
            "ack_lsn": self._ack_lsn,
            "snapshot_lsn": self._snapshot_lsn,
            "segments": len(self._segments),
            "pending_bytes": len(self._buf),
            "active_segment": self._seg_path,
            "durable_offset": self._durable_offset,
            "written_offset": self._seg_size,
            "reserved_counter": self._reserved,
            "fsync_mode": self.fsync_mode,
        }


def _replay(reader: Iterable, holders: dict, epoch: int, counter: int) -> tuple[int, int, int]:
    """Apply records to ``holders`` (name -> record list); return (epoch, counter, applied)."""
    n = 0
    it = iter(reader)
    mask = COUNTER_MASK
    shift = TOKEN_EPOCH_SHIFT
    get = holders.get
    for r in it:
        t = r[0]
        n += 1
        if t == GRANT:
            holders[r[1]] = r
            tok = r[2]
            c = tok & mask
            if c > counter:
                counter = c
            e = tok >> shift
            if e > epoch:
                epoch = e
        elif t == RELEASE or t == EXPIRE:
            h = get(r[1])
            if h is not None and h[2] == r[2]:
                del holders[r[1]]
        elif t == EXTEND:
            h = get(r[1])
            if h is not None and h[2] == r[2]:
                h[4] = r[3]
        elif t == EPOCH:
            if r[1] > epoch:
                epoch = r[1]
        elif t == RESERVE:
            if r[1] > counter:
                counter = r[1]
    return epoch, counter, n


# -- audit dump ---------------------------------------------------------------------------
def _iso(ms: Optional[int]) -> str:
    if not ms:
        return "-"
    dt = datetime.datetime.fromtimestamp(ms / 1000.0, tz=datetime.timezone.utc)
    return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _tok(token: int) -> str:
    return f"{token} ({token >> TOKEN_EPOCH_SHIFT}/{token & COUNTER_MASK})"


def _fmt(lsn: str, wall: Optional[int], kind: str, name: Any = "-", token: Optional[int] = None,
         client: Any = None, corr: Any = None, ttl: Any = None, extra: str = "") -> str:
    parts = [lsn, _iso(wall), kind, f"lock={name}" if name != "-" else "lock=-",
             f"token={_tok(token)}" if token is not None else "token=-",
             f"client={client if client is not None else '-'}",
             f"corr={corr if corr is not None else '-'}",
             f"ttl_ms={ttl if ttl is not None else '-'}"]
    if extra:
        parts.append(extra)
    return " ".join(parts)


def _owner_fingerprint(owner: bytes) -> str:
    return hashlib.sha256(owner).hexdigest()[:16]


def dump(directory: str | os.PathLike, *, lock: Optional[str] = None, file: TextIO = sys.stdout) -> int:
    """Print the log as audit lines, in LSN order; return the number of lines printed.

    Starts from the oldest usable snapshot (its holders first, marked ``snapshot``
    and shown with the snapshot's LSN), then every later record still on disk.
    Columns: LSN, wall time (ISO-8601 UTC, ``-`` if unknown), type, ``lock=``,
    ``token=`` value (epoch/counter), ``client=``, ``corr=`` (correlation id),
    ``ttl_ms=``; grants add ``owner_sha256=`` (the first 16 hex digits of the
    SHA-256 of the owner key: it tells grants of one acquire apart, but is not
    the key, which lets whoever presents it extend or release the lease) and
    ``lock_delay_ms=``.  ``lock`` keeps only that lock's lines (epoch and reserve records
    have no lock and are left out).  Read-only: a torn tail is reported as a ``#``
    comment line, not cut.

    Example (``fastlock wal dump --lock orders/42 DIR``)::

        00000000000000000007 2025-11-30T10:10:00.123Z grant lock=orders/42 token=1099511627783 (1/7) client=api-1 corr=req-9 ttl_ms=10000

    :raises WalCorruption: mid-log corruption (after printing what precedes it).
    :raises FileNotFoundError: ``directory`` does not exist.
    """
    d = os.fspath(directory)
    if not os.path.isdir(d):
        raise FileNotFoundError(d)
    rec = _Recovery(d)
    base, snap = rec.choose_base(oldest=True)
    lines = 0
    w = file.write
    if snap is not None:
        slsn, epoch, counter, holders = snap
        if lock is None:
            w(f"{slsn:020d} - snapshot-state lock=- token=- client=- corr=- ttl_ms=- "
              f"epoch={epoch} counter={counter} holders={len(holders)}\n")
            lines += 1
        for h in sorted(holders, key=lambda h: h[0]):
            if lock is not None and h[0] != lock:
                continue
            w(_fmt(f"{slsn:020d}", h[7], "snapshot-holder", h[0], h[1], h[5], h[6], h[3],
                     extra=f"owner_sha256={_owner_fingerprint(h[2])} lock_delay_ms={h[4]}") + "\n")
            lines += 1
    segs = rec.segments_after(base)
    for i, (first, path) in enumerate(segs):
        data = _read_file(path)
        is_last = i == len(segs) - 1
        start = _parse_segment(path, data, first, is_last)
        if start < 0:
            w(f"# {path}: incomplete segment header ({len(data)} bytes), ignored\n")
            continue
        skip = max(0, base - first + 1)
        reader = _FrameReader(data, start, path, first, last=is_last, skip=skip)
        lsn = first + skip
        for r in reader:
            cur = lsn
            lsn += 1
            t = r[0]
            kind = RECORD_NAMES[t]
            if t in (EPOCH, RESERVE):
                if lock is not None:
                    continue
                key = "epoch" if t == EPOCH else "counter"
                line = _fmt(f"{cur:020d}", r[2], kind, extra=f"{key}={r[1]}")
            else:
                if lock is not None and r[1] != lock:
                    continue
                if t == GRANT:
                    line = _fmt(f"{cur:020d}", r[8], kind, r[1], r[2], r[6], r[7], r[4],
                                extra=f"owner_sha256={_owner_fingerprint(r[3])} lock_delay_ms={r[5]}")
                elif t == EXTEND:
                    line = _fmt(f"{cur:020d}", r[4], kind, r[1], r[2], ttl=r[3])
                else:
                    line = _fmt(f"{cur:020d}", r[3], kind, r[1], r[2])
            w(line + "\n")
            lines += 1
        if reader.torn_at >= 0:
            w(f"# {path}: torn tail at offset {reader.torn_at} ({len(data) - reader.torn_at} bytes, "
              f"{reader.reason}), ignored\n")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m fastlock.wal dump [--lock NAME] DIR`` (the CLI wires ``fastlock wal dump``)."""
    ap = argparse.ArgumentParser(prog="fastlock wal", description="Inspect a fastlock write-ahead log.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    dp = sub.add_parser("dump", help="print every record (audit trail)")
    dp.add_argument("--lock", default=None, help="only this lock name")
    dp.add_argument("directory")
    args = ap.parse_args(argv)
    try:
        dump(args.directory, lock=args.lock)
    except WalCorruption as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
