"""The on-disk format of segments and frames: names, headers, and the frame reader.

A segment ``wal-<first-lsn:020d>.log`` is a 24-byte header (magic ``FLOCKWAL``,
format version, first LSN, CRC32 of the header) followed by frames::

    crc32 : u32 little-endian  -- zlib.crc32 of the next 4 bytes + body
    len   : u32 little-endian  -- body length (low 30 bits); bit 30 marks the
                                  first frame of a written batch, bit 31 its
                                  last frame ("commit")
    body  : msgpack array       -- a record (see :mod:`fastlock.wal.records`)

:class:`FrameReader` walks a buffer of frames, checks every CRC, decodes each
body into a typed record, and classifies a bad frame as a torn tail or as
mid-log corruption (the rules are in :mod:`fastlock.wal`'s docstring).  The
framing (length + CRC per record, numbered segments, torn-tail repair)
follows etcd's WAL.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import msgpack

from ..errors import WalCorruption
from .records import SHAPES, Record, decode

#: Largest record body accepted when writing or reading (bytes).
MAX_RECORD_BYTES = 1 << 20

SEG_MAGIC = b"FLOCKWAL"
SNAP_MAGIC = b"FLOCKSNP"
FORMAT_VERSION = 1
SEG_HEADER = struct.Struct("<8sIQI")  # magic, version, first_lsn, crc32 of the first 20 bytes
U32 = struct.Struct("<I")
FRAME = struct.Struct("<II")  # crc32, len|COMMIT
COMMIT = 0x80000000  # last frame of a batch
START = 0x40000000  # first frame of a batch
LEN_MASK = 0x3FFFFFFF
_SEG_RE = re.compile(r"^wal-(\d{20})\.log$")
_SNAP_RE = re.compile(r"^snap-(\d{20})\.snap$")
_NONZERO = re.compile(rb"[^\x00]")

crc32 = zlib.crc32


def seg_name(first_lsn: int) -> str:
    """File name of the segment whose first record has LSN ``first_lsn``."""
    return f"wal-{first_lsn:020d}.log"


def snap_name(lsn: int) -> str:
    """File name of the snapshot taken after LSN ``lsn``."""
    return f"snap-{lsn:020d}.snap"


def seg_header(first_lsn: int) -> bytes:
    """The 24-byte header of a new segment."""
    head = SEG_MAGIC + U32.pack(FORMAT_VERSION) + struct.pack("<Q", first_lsn)
    return head + U32.pack(crc32(head))


def list_dir(directory: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(segments, snapshots)`` of ``directory``, each a sorted list of ``(lsn, path)``."""
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


def parse_segment(path: str, data: bytes, expect_first: int, last: bool) -> int:
    """Validate a segment header; return the offset of its first frame, or -1 if torn-empty.

    :raises WalCorruption: a bad header in a non-last segment, a format version
        this build does not read, or a first LSN other than the file name's.
    """
    hs = SEG_HEADER.size
    if len(data) < hs or not data.strip(b"\0"):
        if last:
            return -1
        raise WalCorruption(f"{path}: truncated segment header", path, 0, expect_first)
    magic, version, first, crc = SEG_HEADER.unpack_from(data, 0)
    if magic != SEG_MAGIC or crc != crc32(data[:hs - 4]):
        if last and (len(data) <= hs or not data[hs:].strip(b"\0")):
            return -1  # a header torn before its first sync (with preallocated zeros after it)
        raise WalCorruption(f"{path}: bad segment header", path, 0, expect_first)
    if version != FORMAT_VERSION:
        raise WalCorruption(f"{path}: unsupported WAL format version {version}", path, 0, expect_first)
    if first != expect_first:
        raise WalCorruption(f"{path}: header says first LSN {first}, file name says {expect_first}",
                            path, 0, expect_first)
    return hs


def decode_frames(data: bytes, first_lsn: int) -> Iterator[tuple[int, Record]]:
    """Decode a run of frames (a listener batch or a segment body) into ``(lsn, record)``.

    :raises WalCorruption: any bad frame (a listener batch is never torn).
    """
    it = FrameReader(data, 0, "<batch>", first_lsn, last=False)
    lsn = first_lsn
    for rec in it:
        yield lsn, rec
        lsn += 1


class FrameReader:
    """Iterate the typed records of a buffer of frames, classifying a bad frame.

    After iteration: ``end`` = offset just past the last good frame, ``count``
    = records yielded, ``torn_at`` = offset of a torn tail (or -1),
    ``zero_tail`` = bytes of zeros after the last good frame of a last segment
    (preallocated space that was never written: the end of the log, not a torn
    tail).
    With ``last=False`` any bad frame raises WalCorruption; with ``last=True`` a
    torn tail (see :mod:`fastlock.wal`) stops iteration instead; ``repair``
    treats any bad frame of a last segment as a torn tail; ``lenient`` (for
    readers of a live segment) stops at any bad frame without raising;
    ``limit`` stops after that many records (-1: no limit); the first ``skip``
    records are checked but neither decoded nor yielded.
    """

    __slots__ = ("data", "start", "path", "first_lsn", "last", "repair", "lenient",
                 "end", "count", "torn_at", "zero_tail", "reason", "limit", "skip")

    def __init__(self, data: bytes, start: int, path: str, first_lsn: int, *, last: bool, repair: bool = False,
                 lenient: bool = False, limit: int = -1, skip: int = 0):
        self.data = data
        self.start = start
        self.path = path
        self.first_lsn = first_lsn
        self.last = last
        self.repair = repair
        self.lenient = lenient
        self.limit = limit
        self.skip = skip
        self.end = start
        self.count = 0
        self.torn_at = -1
        self.zero_tail = 0
        self.reason = ""

    def __iter__(self) -> Iterator[Record]:
        data = self.data
        mv = memoryview(data)
        n = len(data)
        off = self.start
        unpack_from = FRAME.unpack_from
        crc = crc32
        unpackb = msgpack.unpackb
        shapes = SHAPES
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
                want, lw = unpack_from(data, off)
                ln = lw & LEN_MASK
                end = off + 8 + ln
                if ln == 0 or ln > MAX_RECORD_BYTES or end > n:
                    self._bad(mv, off, count, f"bad frame length {ln}")
                    break
                if crc(mv[off + 4:end]) != want:
                    self._bad(mv, off, count, "CRC mismatch")
                    break
                if count < skip:
                    off = end
                    count += 1
                    continue
                try:
                    body = unpackb(mv[off + 8:end])
                    # decode() inlined (the recovery loop): a known shape becomes its record type
                    cls = shapes.get((body[0], len(body))) if type(body) is list and body else None
                    rec = tuple.__new__(cls, body[1:]) if cls is not None else decode(body)
                except Exception as exc:  # noqa: BLE001 - CRC matched but the body is not ours: any decode error
                    raise WalCorruption(
                        f"{self.path}: undecodable record at offset {off} (LSN {self.first_lsn + count}): {exc}",
                        self.path, off, self.first_lsn + count) from None
                off = end
                count += 1
                yield rec
        finally:
            self.end = off  # just past the last good frame
            self.count = count
            mv.release()

    def _bad(self, mv: memoryview, off: int, count: int, why: str) -> None:
        lsn = self.first_lsn + count
        if self.last and _NONZERO.search(self.data, off) is None:
            # nothing but zeros from here on: a frame's 8-byte header is never all
            # zeros (its length is >= 1), so this is preallocated space, never written
            self.zero_tail = len(self.data) - off
            return
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
            f"refusing to start. Start it with `fastlock serve --repair-wal` (WriteAheadLog.open(repair=True)) "
            f"to cut the log at this point (losing {len(self.data) - off} bytes).", self.path, off, lsn)


def _frame_ok(data: Any, mv: memoryview, p: int, n: int) -> tuple[bool, int, int]:
    """(valid, end, len word) for a frame starting at ``p``."""
    if p + 8 > n:
        return False, p, 0
    crc, lw = FRAME.unpack_from(data, p)
    ln = lw & LEN_MASK
    end = p + 8 + ln
    if ln == 0 or ln > MAX_RECORD_BYTES or end > n or crc32(mv[p + 4:end]) != crc:
        return False, p, 0
    return True, end, lw


def _find_valid_frame(data: Any, mv: memoryview, p: int, n: int) -> int:
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


def _is_torn_tail(data: Any, mv: memoryview, x: int, n: int) -> bool:
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
        if lw & START:
            return False
        if lw & COMMIT:
            return _find_valid_frame(data, mv, end, n) < 0
        p = end
        if p >= n:
            return True
    return True
