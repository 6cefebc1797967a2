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

from ..logsafe import text_value
from ..tokens import format_token
from .files import read_file
from .format import FrameReader, parse_segment
from .records import (
    RECORD_NAMES,
    Epoch,
    Extend,
    Grant,
    HolderRecord,
    KeyDelete,
    KeyMoved,
    KeyPut,
    LockDelay,
    LogState,
    Record,
    Reserve,
    Revoke,
    RevokeRequest,
    SlotsAdopted,
    SlotsUnadopted,
    apply,
)
from .recovery import LogFiles


def _iso(ms: int | None) -> str:
    if not ms:
        return "-"
    dt = datetime.datetime.fromtimestamp(ms / 1000.0, tz=datetime.timezone.utc)
    return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _tok(token: int) -> str:
    return format_token(token)


#: record keys left out of a text line when None (the others show ``-``)
_OPTIONAL = frozenset({"limit"})
#: free text (a revocation's reason): always a JSON string in a text line
_FREE_TEXT = frozenset({"reason"})
#: the fields of every record, in line order (``token`` and ``time`` are formatted apart)
_COLUMNS = ("lock", "token", "client", "corr", "ttl_ms")


def _entry(lsn: int, wall: int | None, kind: str, name: str | None = None, token: int | None = None,
           client: str | None = None, corr: str | None = None, ttl: int | None = None,
           **extra: Any) -> dict[str, Any]:
    """One dump record: the fields of a JSON line (see :func:`dump`)."""
    return {"lsn": lsn, "time": _iso(wall) if wall else None, "type": kind, "lock": name, "token": token,
            "client": client, "corr": corr, "ttl_ms": ttl, **extra}


def _text(entry: dict[str, Any]) -> str:
    """``entry`` as an audit line (LSN, time, type, then ``key=value`` tokens)."""
    parts = [f"{entry['lsn']:020d}", entry["time"] or "-", entry["type"]]
    for key in _COLUMNS:
        value = entry[key]
        if key == "token":
            parts.append(f"token={_tok(value)}" if value is not None else "token=-")
        else:
            parts.append(f"{key}={text_value(value)}")
    for key, value in entry.items():
        if key in _COLUMNS or key in ("lsn", "time", "type"):
            continue
        if isinstance(value, bool):
            if value:
                parts.append(key)  # a flag: present or absent
        elif key in _FREE_TEXT and value is not None:
            parts.append(f"{key}={json.dumps(value)}")
        elif value is not None or key not in _OPTIONAL:
            parts.append(f"{key}={text_value(value)}")
    return " ".join(parts)


def _owner_tag(owner: bytes) -> str:
    """8 hex digits that tell leases apart in the dump without showing the stored owner
    hash (or, in a log written before owner hashing, the key itself)."""
    return hashlib.blake2b(owner, digest_size=4, person=b"fastlock-dump").hexdigest()


def _shown_client(recorded: str | None) -> str | None:
    """A grant's recorded client (``principal:client name``) with the principal alone for a
    client that gave no name (recorded as ``principal:``)."""
    return recorded[:-1] if recorded is not None and recorded.endswith(":") else recorded


def _holder_entry(lsn: int, kind: str, h: HolderRecord) -> dict[str, Any]:
    return _entry(lsn, h.granted_wall_ms, kind, h.name, h.token, _shown_client(h.client_name), h.correlation_id,
                  h.ttl_ms, owner=_owner_tag(h.owner), lock_delay_ms=h.lock_delay_ms, shared=bool(h.shared),
                  limit=h.limit or None)


def _record_entry(lsn: int, r: Record) -> dict[str, Any]:
    if isinstance(r, Grant):
        return _holder_entry(lsn, RECORD_NAMES[r.kind], HolderRecord.from_grant(r))
    if isinstance(r, Epoch):
        return _entry(lsn, r.wall_ms, "epoch", epoch=r.epoch)
    if isinstance(r, Extend):
        return _entry(lsn, r.wall_ms, "extend", r.name, r.token, ttl=r.ttl_ms)
    if isinstance(r, Reserve):
        return _entry(lsn, r.wall_ms, "reserve", counter=r.counter)
    if isinstance(r, LockDelay):
        return _entry(lsn, r.wall_ms, "lock_delay", r.name, until=r.until_wall_ms)
    if isinstance(r, KeyPut):  # the value is not shown (it may be anything a client stored)
        return _entry(lsn, r.wall_ms, "key_put", r.lease_name, r.token, key=r.key, bytes=len(r.value))
    if isinstance(r, KeyDelete):
        return _entry(lsn, r.wall_ms, "key_delete", key=r.key)
    if isinstance(r, KeyMoved):
        return _entry(lsn, r.wall_ms, "key_moved", key=r.key, to=r.to_group)
    if isinstance(r, SlotsAdopted):
        return _entry(lsn, r.wall_ms, "slots_adopted", slots=f"{r.first}..{r.last}", floor=r.floor, epoch=r.epoch,
                      queues=len(r.queues))
    if isinstance(r, SlotsUnadopted):
        return _entry(lsn, r.wall_ms, "slots_unadopted", slots=f"{r.first}..{r.last}")
    if isinstance(r, Revoke):
        return _entry(lsn, r.wall_ms, "revoke", r.name, r.token, by=r.principal, reason=r.reason)
    if isinstance(r, RevokeRequest):
        return _entry(lsn, r.wall_ms, "revoke_request", r.name, r.token, by=r.principal, until=r.until_wall_ms)
    return _entry(lsn, r.wall_ms, RECORD_NAMES[r.kind], r.name, r.token)  # release, expire


def dump(directory: str | os.PathLike, *, lock: str | None = None, file: TextIO = sys.stdout,
         state: bool = False, output: str = "text") -> int:
    """Print the log as audit lines, in LSN order; return the number of lines printed.

    Starts from the oldest usable snapshot (its holders first, marked ``snapshot``
    and shown with the snapshot's LSN), then every later record still on disk.
    Columns: LSN, wall time (ISO-8601 UTC, ``-`` if unknown), type, ``lock=``,
    ``token=`` value (epoch/counter), ``client=`` (``principal:client name``, the principal
    alone when the client gave no name), ``corr=`` (correlation id),
    ``ttl_ms=``; grants add ``owner=`` (an 8-hex-digit tag derived from the stored
    owner hash: it tells grants of one acquire apart, and shows neither the key
    nor its stored hash), ``lock_delay_ms=`` and, for a shared or counted lease,
    ``shared`` and ``limit=``; a revocation adds ``by=`` (the principal) and
    ``reason=`` (always a JSON string).  Names, client names, correlation ids, keys and reasons are chosen
    by peers: each is printed bare only when it is printable ASCII without a space,
    ``"`` or ``\\``, otherwise as a JSON string (:func:`text_value`), so no value can
    split a line or forge a field.  ``lock`` keeps only that lock's lines (epoch
    and reserve records have no lock and are left out).  ``state``: then print the
    state the records add up to (``state`` and ``holder`` lines).  Read-only: a torn
    tail is reported as a ``#`` comment line, not cut.

    ``output="json"``: one JSON object per line instead, with the keys ``lsn`` (int),
    ``time`` (ISO-8601 UTC or null), ``type``, ``lock``, ``token`` (int), ``client``,
    ``corr``, ``ttl_ms`` (null where a record has none) and the record's own keys as
    above (``shared`` a boolean); a ``#`` line becomes ``{"note": TEXT}``.

    Example (``fastlock wal dump --lock a DIR``)::

        00000000000000000007 2025-11-30T10:10:00.123Z grant lock=a token=1099511627783 (1/7) client=c corr=r ttl_ms=5000

    :raises ValueError: ``output`` is neither ``"text"`` nor ``"json"``.
    :raises WalCorruption: mid-log corruption (after printing what precedes it).
    :raises FileNotFoundError: ``directory`` does not exist.
    """
    if output not in ("text", "json"):
        raise ValueError(f"output must be 'text' or 'json', not {output!r}")
    d = os.fspath(directory)
    if not os.path.isdir(d):
        raise FileNotFoundError(d)
    files = LogFiles(d)
    base, snap = files.choose_base(oldest=True)
    applied = LogState()
    lines = 0
    as_json = output == "json"

    def emit(entry: dict[str, Any]) -> None:
        nonlocal lines
        file.write((json.dumps(entry) if as_json else _text(entry)) + "\n")
        lines += 1

    def note(text: str) -> None:
        file.write((json.dumps({"note": text}) if as_json else f"# {text}") + "\n")

    if snap is not None:
        applied = LogState(snap.epoch, snap.counter, snap.holders, snap.keys)
        if lock is None:
            emit(_entry(snap.lsn, None, "snapshot-state", epoch=snap.epoch, counter=snap.counter,
                        holders=len(snap.holders)))
        for h in sorted(snap.holders, key=lambda h: h.name):
            if lock is None or h.name == lock:
                emit(_holder_entry(snap.lsn, "snapshot-holder", h))
    last = base
    segs = files.segments_after(base)
    for i, (first, path) in enumerate(segs):
        data = read_file(path)
        start = parse_segment(path, data, first, i == len(segs) - 1)
        if start < 0:
            note(f"{path}: incomplete segment header ({len(data)} bytes), ignored")
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
            emit(_record_entry(cur, r))
        if reader.zero_tail:
            note(f"{path}: {reader.zero_tail} bytes of preallocated space after offset {reader.end}")
        if reader.torn_at >= 0:
            note(f"{path}: torn tail at offset {reader.torn_at} ({len(data) - reader.torn_at} bytes, "
                 f"{reader.reason}), ignored")
    if state:
        if lock is None:
            emit(_entry(last, None, "state", epoch=applied.epoch, counter=applied.counter,
                        holders=applied.lease_count()))
        for h in sorted(applied.holder_records()):
            if lock is None or h.name == lock:
                emit(_holder_entry(last, "holder", h))
    return lines
