"""The audit dump: the log as one line per record, and ``python -m fastlock.wal dump``.

Read-only: it never cuts a torn tail (it reports it as a ``#`` line).  With
``state=True`` it also applies every record (:func:`~fastlock.wal.records.apply`,
the rules recovery and the standby use) and prints the holders, epoch and
counter that a restart would recover.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from typing import Any, TextIO

from ..logsafe import quote
from .files import read_file
from .format import FrameReader, parse_segment
from .records import (
    COUNTER_MASK,
    RECORD_NAMES,
    TOKEN_EPOCH_SHIFT,
    Epoch,
    Extend,
    Grant,
    HolderRecord,
    KeyDelete,
    KeyPut,
    LockDelay,
    LogState,
    Record,
    Reserve,
    Revoke,
    apply,
)
from .recovery import LogFiles


def _iso(ms: int | None) -> str:
    if not ms:
        return "-"
    dt = datetime.datetime.fromtimestamp(ms / 1000.0, tz=datetime.timezone.utc)
    return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _tok(token: int) -> str:
    return f"{token} ({token >> TOKEN_EPOCH_SHIFT}/{token & COUNTER_MASK})"


def _fmt(lsn: str, wall: int | None, kind: str, name: Any = "-", token: int | None = None,
         client: Any = None, corr: Any = None, ttl: Any = None, extra: str = "") -> str:
    parts = [lsn, _iso(wall), kind, f"lock={name}" if name != "-" else "lock=-",
             f"token={_tok(token)}" if token is not None else "token=-",
             f"client={client if client is not None else '-'}",
             f"corr={corr if corr is not None else '-'}",
             f"ttl_ms={ttl if ttl is not None else '-'}"]
    if extra:
        parts.append(extra)
    return " ".join(parts)


def _quoted(text: str | None) -> str:
    """Free text (a revocation's reason) as one token of a dump line: JSON-quoted, ``-`` if none."""
    return "-" if text is None else json.dumps(text)


def _owner_tag(owner: bytes) -> str:
    """8 hex digits that tell leases apart in the dump without showing the stored owner
    hash (or, in a log written before owner hashing, the key itself)."""
    return hashlib.blake2b(owner, digest_size=4, person=b"fastlock-dump").hexdigest()


def _holder_line(lsn: str, kind: str, h: HolderRecord) -> str:
    return _fmt(lsn, h.granted_wall_ms, kind, h.name, h.token, h.client_name, h.correlation_id, h.ttl_ms,
                extra=f"owner={_owner_tag(h.owner)} lock_delay_ms={h.lock_delay_ms}"
                      + (" shared" if h.shared else "") + (f" limit={h.limit}" if h.limit else ""))


def _record_line(lsn: int, r: Record) -> str:
    label = f"{lsn:020d}"
    if isinstance(r, Grant):
        return _holder_line(label, RECORD_NAMES[r.kind], HolderRecord.from_grant(r))
    if isinstance(r, Epoch):
        return _fmt(label, r.wall_ms, "epoch", extra=f"epoch={r.epoch}")
    if isinstance(r, Extend):
        return _fmt(label, r.wall_ms, "extend", r.name, r.token, ttl=r.ttl_ms)
    if isinstance(r, Reserve):
        return _fmt(label, r.wall_ms, "reserve", extra=f"counter={r.counter}")
    if isinstance(r, LockDelay):
        return _fmt(label, r.wall_ms, "lock_delay", r.name, extra=f"until={r.until_wall_ms}")
    if isinstance(r, KeyPut):  # the value is not shown (it may be anything a client stored)
        return _fmt(label, r.wall_ms, "key_put", r.lease_name, r.token,
                    extra=f"key={quote(r.key)} bytes={len(r.value)}")
    if isinstance(r, KeyDelete):
        return _fmt(label, r.wall_ms, "key_delete", extra=f"key={quote(r.key)}")
    if isinstance(r, Revoke):
        return _fmt(label, r.wall_ms, "revoke", r.name, r.token,
                    extra=f"by={r.principal} reason={_quoted(r.reason)}")
    return _fmt(label, r.wall_ms, RECORD_NAMES[r.kind], r.name, r.token)  # release, expire


def dump(directory: str | os.PathLike, *, lock: str | None = None, file: TextIO = sys.stdout,
         state: bool = False) -> int:
    """Print the log as audit lines, in LSN order; return the number of lines printed.

    Starts from the oldest usable snapshot (its holders first, marked ``snapshot``
    and shown with the snapshot's LSN), then every later record still on disk.
    Columns: LSN, wall time (ISO-8601 UTC, ``-`` if unknown), type, ``lock=``,
    ``token=`` value (epoch/counter), ``client=``, ``corr=`` (correlation id),
    ``ttl_ms=``; grants add ``owner=`` (an 8-hex-digit tag derived from the stored
    owner hash: it tells grants of one acquire apart, and shows neither the key
    nor its stored hash) and ``lock_delay_ms=``.  ``lock`` keeps only that lock's
    lines (epoch and reserve records have no lock and are left out).  ``state``:
    then print the state the records add up to (``state`` and ``holder`` lines).
    Read-only: a torn tail is reported as a ``#`` comment line, not cut.

    Example (``fastlock wal dump --lock a DIR``)::

        00000000000000000007 2025-11-30T10:10:00.123Z grant lock=a token=1099511627783 (1/7) client=c corr=r ttl_ms=5000

    :raises WalCorruption: mid-log corruption (after printing what precedes it).
    :raises FileNotFoundError: ``directory`` does not exist.
    """
    d = os.fspath(directory)
    if not os.path.isdir(d):
        raise FileNotFoundError(d)
    files = LogFiles(d)
    base, snap = files.choose_base(oldest=True)
    applied = LogState()
    lines = 0
    w = file.write
    if snap is not None:
        applied = LogState(snap.epoch, snap.counter, snap.holders, snap.keys)
        label = f"{snap.lsn:020d}"
        if lock is None:
            w(f"{label} - snapshot-state lock=- token=- client=- corr=- ttl_ms=- "
              f"epoch={snap.epoch} counter={snap.counter} holders={len(snap.holders)}\n")
            lines += 1
        for h in sorted(snap.holders, key=lambda h: h.name):
            if lock is None or h.name == lock:
                w(_holder_line(label, "snapshot-holder", h) + "\n")
                lines += 1
    last = base
    segs = files.segments_after(base)
    for i, (first, path) in enumerate(segs):
        data = read_file(path)
        start = parse_segment(path, data, first, i == len(segs) - 1)
        if start < 0:
            w(f"# {path}: incomplete segment header ({len(data)} bytes), ignored\n")
            continue
        skip = max(0, base - first + 1)
        reader = FrameReader(data, start, path, first, last=i == len(segs) - 1, skip=skip)
        lsn = first + skip
        for r in reader:
            cur = lsn
            lsn += 1
            apply(r, applied)
            last = cur
            if lock is not None and getattr(r, "name", None) != lock:
                continue
            w(_record_line(cur, r) + "\n")
            lines += 1
        if reader.zero_tail:
            w(f"# {path}: {reader.zero_tail} bytes of preallocated space after offset {reader.end}\n")
        if reader.torn_at >= 0:
            w(f"# {path}: torn tail at offset {reader.torn_at} ({len(data) - reader.torn_at} bytes, "
              f"{reader.reason}), ignored\n")
    if state:
        label = f"{last:020d}"
        if lock is None:
            w(f"{label} - state lock=- token=- client=- corr=- ttl_ms=- "
              f"epoch={applied.epoch} counter={applied.counter} holders={applied.lease_count()}\n")
            lines += 1
        for h in sorted(applied.holder_records()):
            if lock is None or h.name == lock:
                w(_holder_line(label, "holder", h) + "\n")
                lines += 1
    return lines
