"""Reading the log back while it is being written: for a standby catching up, and for tests.

:class:`BacklogReader` returns raw frame bytes from an LSN on, a chunk at a
time, off the event loop (the standby checks every CRC itself);
:func:`read_records` decodes typed records.  Both read the segments still on
disk (a :class:`~fastlock.wal.writer.SegmentList`) and raise
:class:`~fastlock.errors.WalCompacted` when compaction deleted what they ask for.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, NamedTuple

from ..errors import WalCompacted, WalCorruption
from .files import read_file
from .format import FRAME, LEN_MASK, MAX_RECORD_BYTES, SEG_HEADER, FrameReader, parse_segment
from .records import Record
from .writer import SegmentList

if TYPE_CHECKING:  # pragma: no cover
    from .log import WriteAheadLog


class FrameRun(NamedTuple):
    """Whole frames of consecutive records, as the log holds them (a standby checks each CRC)."""

    first_lsn: int
    last_lsn: int
    frames: bytes


class BacklogReader:
    """Reads the log's frames from an LSN on, in chunks of raw frame bytes, for a
    standby catching up (``REPLICATE`` with a position).

    Meant to run off the event loop (``loop.run_in_executor``): each
    :meth:`read` does file I/O and walks frame headers only - records are not
    decoded, the bytes go to the standby as written (it checks every CRC).
    Keeps its place between calls, so reading a whole log costs one pass.
    Not thread-safe: one call at a time.

    :param wal: the log (its ``segments`` are read).
    :param lsn: first LSN to return (>= 1).
    """

    def __init__(self, wal: WriteAheadLog, lsn: int):
        self._segments: SegmentList = wal.segments
        self.next_lsn = max(1, lsn)
        self._seg_first = 0  # first LSN of the segment being read (0: none yet)
        self._seg_path = ""
        self._offset = 0  # file offset of the frame of next_lsn in that segment
        self._seg_lsn = 0  # LSN at _offset

    def _seek(self) -> None:
        """Find the segment holding ``next_lsn`` and the offset of its frame."""
        segs = self._segments.copy()
        lsn = self.next_lsn
        if not segs or lsn < segs[0][0]:
            raise WalCompacted(f"LSN {lsn} is no longer in the log (oldest segment starts at "
                               f"{segs[0][0] if segs else None})")
        first, path = max((sf, sp) for sf, sp in segs if sf <= lsn)
        self._seg_first, self._seg_path = first, path
        self._offset, self._seg_lsn = SEG_HEADER.size, first

    def read(self, max_bytes: int, upto: int) -> FrameRun | None:
        """Return the :class:`FrameRun` of whole frames, about
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
            nxt = [(sf, sp) for sf, sp in self._segments.copy() if sf == self.next_lsn]
            if not nxt:
                raise WalCorruption(f"{self._seg_path}: ends before LSN {self.next_lsn} (<= {upto})",
                                    self._seg_path, self._offset, self.next_lsn)
            self._seg_first, self._seg_path = nxt[0]
            self._offset, self._seg_lsn = SEG_HEADER.size, self._seg_first

    def _read_segment(self, f: IO[bytes], max_bytes: int, upto: int) -> FrameRun | None:
        unpack_from = FRAME.unpack_from
        # skip the frames before next_lsn (headers only, a block at a time)
        while self._seg_lsn < self.next_lsn:
            f.seek(self._offset)
            block = f.read(MAX_RECORD_BYTES + (1 << 20))
            p = 0
            while self._seg_lsn < self.next_lsn and p + 8 <= len(block):
                end = p + 8 + (unpack_from(block, p)[1] & LEN_MASK)
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
            _crc, lw = unpack_from(data, pos)
            ln = lw & LEN_MASK
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
        return FrameRun(first, lsn - 1, data[:pos])


def read_records(segments: SegmentList, lsn: int, upto: int) -> Iterator[tuple[int, Record]]:
    """Iterate ``(lsn, record)`` for records ``lsn..upto`` in the segments on disk.

    :raises WalCompacted: ``lsn`` is older than the oldest segment on disk.
    :raises WalCorruption: a damaged record on the way.
    """
    segs = segments.copy()
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
            data = read_file(path)
        except FileNotFoundError:
            raise WalCompacted(f"segment {path} was deleted while reading") from None
        off = parse_segment(path, data, first, last=True)
        if off < 0:
            return
        skip = max(0, lsn - first)
        reader = FrameReader(data, off, path, first, last=False, limit=upto - first + 1,
                             lenient=(i == len(segs) - 1), skip=skip)
        cur = first + skip
        for rec in reader:
            yield cur, rec
            cur += 1
        if cur - 1 >= upto:
            return
