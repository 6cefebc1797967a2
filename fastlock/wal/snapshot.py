"""Snapshots of the lock table, and compaction of the log they cover.

``snap-<lsn:020d>.snap`` holds the lock table after applying every record up
to ``lsn``: a header (magic ``FLOCKSNP``, format version, lsn, epoch, counter,
body length), a msgpack array of holders (each the fields of
:class:`~fastlock.wal.records.HolderRecord`, in order: 8 for an exclusive lease,
10 for a shared lease or a semaphore permit), then (since the key
store) a msgpack array of keys (each the 7 items of
:meth:`fastlock.wal.keyspace.KeySpace.to_list`; absent in older snapshots,
which load with no keys), then (since shard groups record their imports there) the slots and
waiter queues the group imported by slot moves and has not taken yet
(:meth:`fastlock.wal.records.ImportedSlots.to_list`; written only when there are some, after an
empty key array if there are no keys; absent: none), and a CRC32 of everything before it.  It is written with
:func:`~fastlock.wal.files.write_atomically`, so it is either absent or whole.

A server's snapshot is encoded by its lock table, a slice per event-loop turn
(:class:`HolderSlices`): a lock whose holders change before its slice is encoded
just before the change, so the file still holds the table at ``lsn`` while
requests go on; the writer thread then gets the bytes without a copy.

After writing one, the :class:`Snapshotter` keeps the newest
``keep_snapshots`` snapshots and deletes the segments wholly covered by the
oldest snapshot it keeps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack

from ..errors import WalCorruption
from .files import fsync_dir, read_file, write_atomically
from .format import FORMAT_VERSION, SNAP_MAGIC, U32, crc32, list_dir, snap_name
from .keyspace import KeySpace
from .records import HolderRecord, ImportedSlots
from .writer import SegmentList

log = logging.getLogger(__name__)

SNAP_HEADER = struct.Struct("<8sIQQQQ")  # magic, version, lsn, epoch, counter, body_len


class PackedHolders:
    """Holders already encoded as a snapshot stores them: ``data`` (bytes or another
    buffer, e.g. a :class:`fastlock._core.Block`) is the msgpack array of ``count`` holders,
    as :meth:`fastlock._core.LockTable.pack_holders` gives it (the table encodes itself in
    C, with no Python object per holder)."""

    __slots__ = ("count", "data")

    def __init__(self, count: int, data: Any):
        self.count = count
        self.data = data

    def __len__(self) -> int:
        return self.count


class HolderSlices:
    """The holders of a lock table as they are when this is made, encoded by the table a
    slice per event-loop turn (:meth:`fastlock._core.LockTable.snapshot_begin`: a lock whose
    holders change before its slice is encoded just before the change), so that a big table
    does not hold the loop.  :meth:`Snapshotter.start` runs the slices.

    :param table: the :class:`~fastlock._core.LockTable`.
    :param pack: ``msgpack.Packer(use_bin_type=True).pack`` (a meta field that is not None,
        a str or bytes).
    :param per_slice: locks encoded per slice (a few ms for 10,000).
    :raises RuntimeError: a snapshot of the table is in progress already.
    """

    def __init__(self, table: Any, pack: Any, per_slice: int = 10_000):
        table.snapshot_begin(pack)
        self.table = table
        self.per_slice = per_slice

    def step(self) -> PackedHolders | None:
        """Encode the next slice: the holders once every slice is done, else None.
        :raises MemoryError: (the snapshot is over)."""
        if not self.table.snapshot_step(self.per_slice):
            return None
        return PackedHolders(*self.table.snapshot_end())

    def abort(self) -> None:
        """Stop: the table keeps no copy of anything."""
        self.table.snapshot_abort()


def encode_snapshot(lsn: int, epoch: int, counter: int, holders: Sequence[HolderRecord] | PackedHolders,
                    keys: list | None = None, imports: ImportedSlots | None = None) -> bytes:
    """The bytes of a snapshot file (``holders``: HolderRecord or equal 8- or 10-tuples,
    or :class:`PackedHolders`; ``keys``: :meth:`KeySpace.to_list`, written only when not
    empty so that a key-less snapshot stays readable by older builds; ``imports``: a shard
    group's slots imported and not taken yet, written only when there are some)."""
    return b"".join(snapshot_parts(lsn, epoch, counter, holders, keys, imports))


def snapshot_parts(lsn: int, epoch: int, counter: int, holders: Sequence[HolderRecord] | PackedHolders,
                   keys: list | None = None, imports: ImportedSlots | None = None) -> list:
    """:func:`encode_snapshot`'s bytes as the buffers they are made of, in order, not copied
    into one (a million holders are tens of MB: joining them would hold the GIL)."""
    packer = msgpack.Packer()
    pack = packer.pack
    if isinstance(holders, PackedHolders):
        parts = [holders.data]
    else:
        parts = [packer.pack_array_header(len(holders))]
        # Small chunks so that a snapshot thread gives the GIL back to the loop often.
        for i in range(0, len(holders), 1000):
            # an exclusive lease is stored as its first 8 fields (as every earlier fastlock)
            parts.append(b"".join([pack(tuple(h) if len(h) != 10 or h[8] or h[9] else tuple(h)[:8])
                                   for h in holders[i:i + 1000]]))
    if keys or imports:
        parts.append(pack(keys or []))
    if imports:
        parts.append(pack(imports.to_list()))
    head = SNAP_HEADER.pack(SNAP_MAGIC, FORMAT_VERSION, lsn, epoch, counter, sum(len(memoryview(p)) for p in parts))
    crc = crc32(head)
    for part in parts:
        crc = crc32(part, crc)  # (zlib lets the GIL go for a big buffer)
    return [head, *parts, U32.pack(crc)]


class SnapshotState(NamedTuple):
    """What a snapshot holds, as the server gives it to :meth:`WriteAheadLog.maybe_snapshot
    <fastlock.wal.WriteAheadLog.maybe_snapshot>`: consistent with every record logged so far."""

    epoch: int
    counter: int
    #: :class:`HolderRecord`s (or equal 8- or 10-tuples), :class:`PackedHolders`, or
    #: :class:`HolderSlices` (encoded a slice per loop turn before the snapshot is written)
    holders: Any
    #: the key store (:meth:`~fastlock.wal.keyspace.KeySpace.to_list`); None: no keys
    keys: list | None = None
    #: a shard group's slots and queues imported by moves and not taken yet; None: none
    imports: ImportedSlots | None = None


class Snapshot:
    """A snapshot read back: the table after LSN ``lsn``."""

    __slots__ = ("lsn", "epoch", "counter", "holders", "keys", "imports")

    def __init__(self, lsn: int, epoch: int, counter: int, holders: list[HolderRecord],
                 keys: KeySpace | None = None, imports: ImportedSlots | None = None):
        self.lsn = lsn
        self.epoch = epoch
        self.counter = counter
        self.holders = holders
        self.keys = keys if keys is not None else KeySpace()
        #: the slots and queues imported by moves and not taken yet (None: none, or an older snapshot)
        self.imports = imports


def load_snapshot(path: str) -> Snapshot:
    """Read and check a snapshot file.

    :raises WalCorruption: truncated, wrong magic or version, CRC mismatch, a
        holder that is not 8 or 10 fields, keys or imports not of their shape.
    :raises OSError: the file cannot be read.
    """
    data = read_file(path)
    hs = SNAP_HEADER.size
    if len(data) < hs + 4:
        raise WalCorruption(f"{path}: snapshot truncated ({len(data)} bytes)", path, 0)
    magic, version, lsn, epoch, counter, blen = SNAP_HEADER.unpack_from(data, 0)
    if magic != SNAP_MAGIC:
        raise WalCorruption(f"{path}: not a fastlock snapshot (magic {magic!r})", path, 0)
    if version != FORMAT_VERSION:
        raise WalCorruption(f"{path}: unsupported snapshot format version {version}", path, 0)
    if len(data) != hs + blen + 4:
        raise WalCorruption(f"{path}: snapshot length {len(data)} != {hs + blen + 4} (truncated?)", path, 0)
    mv = memoryview(data)
    try:
        if crc32(mv[hs:hs + blen], crc32(mv[:hs])) != U32.unpack_from(data, hs + blen)[0]:
            raise WalCorruption(f"{path}: snapshot CRC mismatch", path, 0)
        unpacker = msgpack.Unpacker()
        unpacker.feed(mv[hs:hs + blen])
        parts = list(unpacker)
    finally:
        mv.release()
    try:
        if not 1 <= len(parts) <= 3 or type(parts[0]) is not list:
            raise ValueError("the holders are not a list")
        holders = [HolderRecord.from_list(h) for h in parts[0]]
        keys = KeySpace.from_list(parts[1]) if len(parts) >= 2 else None
        imports = ImportedSlots.from_list(parts[2]) if len(parts) == 3 else None
    except ValueError as exc:
        raise WalCorruption(f"{path}: {exc}", path, 0) from None
    return Snapshot(lsn, epoch, counter, holders, keys, imports)


class Snapshotter:
    """Decides when a snapshot is due, writes it on a thread, and compacts.

    :param directory: the data directory.
    :param segments: the segments on disk (compaction removes covered ones).
    :param every: a snapshot is due once this many records were logged since the last one.
    :param keep: snapshots kept on disk (the segments after the oldest kept one stay).
    :param every_bytes: a snapshot is also due once this many bytes of records were
        written since the last one (0: records only), so that large records (key
        values) cannot grow the log without bound between snapshots.
    """

    def __init__(self, directory: str, segments: SegmentList, every: int, keep: int, every_bytes: int = 0):
        self.directory = directory
        self.segments = segments
        self.every = every
        self.every_bytes = every_bytes
        self._bytes_from = 0  # bytes written (since open) when the last snapshot started
        #: the bytes written (since open) from which a snapshot is due
        self.next_due_bytes = every_bytes if every_bytes else 1 << 62
        self.keep = keep
        self.lsn = 0  # LSN of the newest snapshot written (or recovered from)
        self._counted_from = 0  # records after this LSN count towards the next snapshot
        self.next_due = every  # the LSN from which a snapshot is due (unless running or forced)
        self._future: asyncio.Future | None = None
        self._thread: threading.Thread | None = None
        self._slices: HolderSlices | None = None  # being encoded on the loop, before the thread

    def recovered(self, snapshot_lsn: int, last_lsn: int) -> None:
        """Recovery started from the snapshot at ``snapshot_lsn`` (0: none) and found
        records up to ``last_lsn``; the next snapshot is due ``every`` records after it."""
        self.lsn = snapshot_lsn
        self._counted_from = last_lsn
        self.next_due = last_lsn + self.every
        self._bytes_from = 0
        self.next_due_bytes = self.every_bytes if self.every_bytes else 1 << 62

    @property
    def running(self) -> bool:
        return self._future is not None

    def due(self, last_lsn: int, force: bool, written_bytes: int = 0) -> bool:
        """Is a snapshot at ``last_lsn`` due (``force``: as soon as it covers anything new;
        ``written_bytes``: bytes of records written since the log was opened)?"""
        if self._future is not None or last_lsn <= self.lsn:
            return False
        return force or last_lsn - self._counted_from >= self.every or written_bytes >= self.next_due_bytes

    def start(self, loop: asyncio.AbstractEventLoop, lsn: int, epoch: int, counter: int,
              holders: Sequence[HolderRecord] | PackedHolders | HolderSlices, keys: list | None = None,
              written_bytes: int = 0, imports: ImportedSlots | None = None) -> None:
        """Write the snapshot at ``lsn`` on a thread (:class:`HolderSlices`: once their
        slices, one per loop turn, are done); the result is reported on ``loop``."""
        self._counted_from = lsn
        self.next_due = lsn + self.every
        if self.every_bytes:
            self._bytes_from = written_bytes
            self.next_due_bytes = written_bytes + self.every_bytes
        self._future = loop.create_future()
        if isinstance(holders, HolderSlices):
            self._slices = holders
            loop.call_soon(self._next_slice, loop, lsn, epoch, counter, holders, keys, imports)
        else:
            self._spawn(loop, lsn, epoch, counter, holders, keys, imports)

    def _next_slice(self, loop: asyncio.AbstractEventLoop, lsn: int, epoch: int, counter: int,
                    slices: HolderSlices, keys: list | None, imports: ImportedSlots | None = None) -> None:
        if self._slices is not slices:  # stopped meanwhile (join)
            return
        try:
            packed = slices.step()
        except Exception as exc:  # noqa: BLE001 - a failed snapshot is logged, the log is intact
            self._slices = None
            self._done(lsn, exc)
            return
        if packed is None:
            loop.call_soon(self._next_slice, loop, lsn, epoch, counter, slices, keys, imports)
        else:
            self._slices = None
            self._spawn(loop, lsn, epoch, counter, packed, keys, imports)

    def _spawn(self, loop: asyncio.AbstractEventLoop, lsn: int, epoch: int, counter: int,
               holders: Sequence[HolderRecord] | PackedHolders, keys: list | None,
               imports: ImportedSlots | None = None) -> None:
        def run() -> None:
            try:
                res: Any = self._write(lsn, epoch, counter, holders, keys, imports)
            except BaseException as exc:  # noqa: BLE001 - reported on the loop
                res = exc
            try:
                loop.call_soon_threadsafe(self._done, lsn, res)
            except RuntimeError:
                pass

        self._thread = threading.Thread(target=run, name="fastlock-wal-snapshot", daemon=True)
        self._thread.start()

    def _write(self, lsn: int, epoch: int, counter: int, holders: Sequence[HolderRecord] | PackedHolders,
               keys: list | None = None, imports: ImportedSlots | None = None) -> str:
        t0 = time.perf_counter()
        data = snapshot_parts(lsn, epoch, counter, holders, keys, imports)
        d = self.directory
        path = write_atomically(d, snap_name(lsn), data)
        # compaction: keep the newest `keep` snapshots and the segments after the oldest kept
        _segs, snaps = list_dir(d)
        kept = snaps[-self.keep:]
        for _l, p in snaps[:-self.keep]:
            os.unlink(p)
        # with fewer snapshots than `keep`, the fallback is a full replay: delete nothing
        cover = kept[0][0] if len(kept) >= self.keep else 0
        doomed = self.segments.remove_covered(cover)
        for _f, p in doomed:
            os.unlink(p)
        if doomed:
            fsync_dir(d)
        size = sum(len(memoryview(p)) for p in data)
        log.info("snapshot %s written: %d holders, %d bytes, %d segments deleted, %.1f ms",
                 path, len(holders), size, len(doomed), (time.perf_counter() - t0) * 1000)
        return path

    def _done(self, lsn: int, res: Any) -> None:
        fut = self._future
        self._future = None
        self._thread = None
        if isinstance(res, BaseException):
            log.error("WAL snapshot at LSN %d failed (log intact, will retry later): %r", lsn, res)
        else:
            self.lsn = max(self.lsn, lsn)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait(self) -> None:
        """Wait for a snapshot in progress (if any) to finish."""
        if self._future is not None:
            await asyncio.shield(self._future)

    def join(self) -> None:
        """Wait (blocking) for the snapshot thread, if one runs; a snapshot still being
        encoded on the loop is dropped (the log it would cover stays)."""
        if self._slices is not None:
            self._slices.abort()
            self._slices = None
            fut, self._future = self._future, None
            if fut is not None and not fut.done():
                fut.set_result(None)
        if self._thread is not None:
            self._thread.join()
            self._thread = None
