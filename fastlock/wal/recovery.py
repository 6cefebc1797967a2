"""Recovery: choose a snapshot, replay the segments after it, cut a torn tail.

:func:`recover` rebuilds the lock table's state from a data directory (a
:class:`~fastlock.wal.records.LogState`, each record applied with
:func:`~fastlock.wal.records.apply`) and repairs the last segment's torn tail;
:class:`LogFiles` chooses the snapshot to start from and the segments to
read, for recovery and for the read-only ``wal dump``.  The rules (what is a
torn tail, what is mid-log corruption, the fallback to an older snapshot) are
in :mod:`fastlock.wal`'s docstring.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import msgpack

from ..errors import WalCorruption
from .files import fsync_dir, read_file
from .format import FrameReader, list_dir, parse_segment
from .keyspace import KeySpace
from .records import HolderRecord, ImportedSlots, LogState, RevokeRequest, apply
from .snapshot import Snapshot, load_snapshot

log = logging.getLogger("fastlock.wal")


class RecoveredState(NamedTuple):
    """What :meth:`~fastlock.wal.WriteAheadLog.open` found on disk."""

    epoch: int
    counter: int  # highest fencing counter issued OR reserved; resume above it
    holders: list[HolderRecord]
    records_replayed: int  # records applied after the snapshot
    torn_bytes: int  # bytes cut from a torn tail (0 if none)
    next_lsn: int  # LSN the next record will get
    snapshot_lsn: int  # LSN of the snapshot used (0 if none)
    keys: KeySpace | None = None  # the key store (fastlock.wal.keyspace)
    #: (name, until_wall_ms): the latest lock-delay logged per name (wall clock ms; ended ones too)
    lock_delays: list[tuple[str, int]] = []
    #: the revoke requests to leases recovered as held (fastlock.server.preemption)
    revoke_requests: list[RevokeRequest] = []
    #: a shard group's slots and queues imported by moves (the snapshot's and the SLOTS_ADOPTED
    #: records' after it); None: none (fastlock.server.sharded takes off those already taken)
    imports: ImportedSlots | None = None


class LogFiles:
    """The segments and snapshots of a data directory, and the choice of where to start."""

    def __init__(self, directory: str):
        self.directory = directory
        self.segs, self.snaps = list_dir(directory)

    def choose_base(self, *, oldest: bool = False) -> tuple[int, Snapshot | None]:
        """Pick the snapshot to start from: ``(lsn, snapshot or None)``.

        The newest loadable snapshot whose following records still exist (or, with
        ``oldest``, the oldest such one, for the audit dump).

        :raises WalCorruption: none works.
        """
        first_seg = self.segs[0][0] if self.segs else None
        candidates: list[tuple[int, str | None]] = list(reversed(self.snaps)) + [(0, None)]
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
                snap = load_snapshot(path)
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


class Recovery(NamedTuple):
    """The result of :func:`recover`: the state, the segments left on disk, and
    whether ``repair`` cut records (acknowledged grants may be gone)."""

    state: RecoveredState
    segments: list[tuple[int, str]]
    repaired: bool


def recover(directory: str, *, repair: bool = False) -> Recovery:
    """Rebuild the state from ``directory`` (locked by the caller) and cut a torn tail.

    :raises WalCorruption: mid-log corruption, a damaged non-last segment, or
        no usable snapshot for a compacted log.
    :raises OSError: a file cannot be read, truncated or fsynced.
    """
    files = LogFiles(directory)
    base, snap = files.choose_base()
    state = LogState() if snap is None else LogState(snap.epoch, snap.counter, snap.holders, snap.keys, snap.imports)
    segs = files.segments_after(base)
    replayed = 0
    torn = 0
    repaired = False
    last_lsn = base
    expect: int | None = None  # next LSN the log must continue with
    for i, (first, path) in enumerate(segs):
        is_last = i == len(segs) - 1
        if expect is not None and first != expect and not (expect < first <= base + 1):
            raise WalCorruption(
                f"{path}: segment starts at LSN {first} but the previous one ends at LSN {expect - 1}",
                path, 0, first)
        data = read_file(path)
        start = parse_segment(path, data, first, is_last)
        if start < 0:
            if data:
                log.warning("WAL torn tail cut: segment %s has an incomplete header (%d bytes removed)",
                            path, len(data))
            torn += len(data)
            os.unlink(path)
            fsync_dir(directory)
            files.segs.remove((first, path))
            expect = max(expect or first, first)
            continue
        # records <= base are in the snapshot: checked, not decoded
        reader = FrameReader(data, start, path, first, last=is_last, repair=repair,
                             skip=max(0, base - first + 1))
        for record in reader:
            apply(record, state)
            replayed += 1
        if reader.zero_tail:
            # preallocated space after the last record (fastlock.wal.writer): cut it so that
            # this segment, no longer the last one after open(), ends at its last record
            log.info("WAL segment %s: %d bytes of preallocated space after offset %d trimmed",
                     path, reader.zero_tail, reader.end)
            with open(path, "r+b") as f:
                f.truncate(reader.end)
                os.fsync(f.fileno())
        if reader.torn_at >= 0:
            cut = len(data) - reader.torn_at
            torn += cut
            if repair and reader.reason:
                repaired = True  # records (maybe acknowledged ones) were cut
            log.log(logging.ERROR if repaired else logging.WARNING,
                    "WAL torn tail cut: segment %s offset %d, %d bytes removed (%s, LSN %d)",
                    path, reader.torn_at, cut, reader.reason, first + reader.count)
            with open(path, "r+b") as f:
                f.truncate(reader.torn_at)
                f.flush()
                os.fsync(f.fileno())
        expect = first + reader.count
        last_lsn = max(last_lsn, expect - 1)
    next_lsn = max(last_lsn, base) + 1
    recovered = RecoveredState(
        epoch=state.epoch,
        counter=state.counter,
        holders=state.holder_records(),
        records_replayed=replayed,
        torn_bytes=torn,
        next_lsn=next_lsn,
        snapshot_lsn=base,
        keys=state.keys,
        lock_delays=list(state.lock_delays.items()),
        revoke_requests=[r for r in state.revoke_requests.values() if state.holds(r.name, r.token)],
        imports=state.imports(),
    )
    return Recovery(recovered, list(files.segs), repaired)
