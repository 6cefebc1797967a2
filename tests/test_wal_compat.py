"""A data directory written by the previous build (``tests/data/wal-v1``) still recovers,
dumps and replicates the same: the typed records are a view of the same bytes.

The fixture was written by ``fastlock/wal.py`` and ``fastlock/replication.py`` as they
were before the log became a package (``interval`` fsync mode, so it holds every
record type, and a snapshot at LSN 8 that recovery starts from while ``wal dump``
starts from LSN 1).  ``expected.json`` is what that build recovered, ``dump.txt`` what
it printed, ``snapshot-push.bin`` the snapshot push it sent for two fixed holders.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import msgpack
import pytest

from fastlock.replication.messages import SnapshotHolder, encode_snapshot
from fastlock.wal import LogState, WriteAheadLog, apply, dump
from fastlock.wal import format as F
from fastlock.wal.records import decode, encode

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "wal-v1")
E1 = 1 << 40


@pytest.fixture
def old_dir(tmp_path):
    d = str(tmp_path / "data")
    shutil.copytree(os.path.join(FIXTURE, "data"), d)
    os.chmod(d, 0o700)
    return d


def expected() -> dict:
    with open(os.path.join(FIXTURE, "expected.json")) as f:
        return json.load(f)


async def test_a_log_of_the_previous_build_recovers_the_same_state(old_dir):
    wal = WriteAheadLog(old_dir)
    state = wal.open()
    await wal.close()
    want = expected()
    assert (state.epoch, state.counter, state.next_lsn, state.snapshot_lsn, state.records_replayed) == (
        want["epoch"], want["counter"], want["next_lsn"], want["snapshot_lsn"], want["records_replayed"])
    got = sorted([h.name, h.token, h.owner.hex(), h.ttl_ms, h.lock_delay_ms, h.client_name, h.correlation_id]
                 for h in state.holders)
    assert got == want["holders"]


def test_the_dump_of_a_log_of_the_previous_build_is_unchanged(old_dir):
    out = io.StringIO()
    dump(old_dir, file=out)
    with open(os.path.join(FIXTURE, "dump.txt")) as f:
        assert out.getvalue() == f.read()
    cli = subprocess.run([sys.executable, "-m", "fastlock.wal", "dump", old_dir], capture_output=True, text=True,
                         timeout=60, check=True)
    assert cli.stdout == out.getvalue()


def test_dump_state_applies_the_records_as_recovery_does(old_dir):
    out = io.StringIO()
    dump(old_dir, file=out, state=True)
    lines = out.getvalue().splitlines()
    want = expected()
    state_line = next(line for line in lines if " state " in line)
    assert f"epoch={want['epoch']} counter={want['counter']} holders={len(want['holders'])}" in state_line
    holders = [line.split()[3] for line in lines if line.split()[2] == "holder"]
    assert holders == [f"lock={h[0]}" for h in want["holders"]]


def test_typed_records_re_encode_to_the_bytes_on_disk():
    path = os.path.join(FIXTURE, "data", F.seg_name(1))
    with open(path, "rb") as f:
        data = f.read()
    off = F.SEG_HEADER.size
    kinds = set()
    while off < len(data):
        _crc, lw = F.FRAME.unpack_from(data, off)
        body = data[off + 8:off + 8 + (lw & F.LEN_MASK)]
        record = decode(msgpack.unpackb(body))
        kinds.add(type(record).__name__)
        assert msgpack.packb(encode(record)) == body
        off += 8 + len(body)
    assert kinds == {"Grant", "Release", "Expire", "Extend", "Epoch", "Reserve"}


class _Holder:
    """A lock table holder as the snapshot push reads it (an exclusive lease)."""

    shared = False
    limit = 0

    def __init__(self, name, token, owner, ttl_ms, lock_delay_ms, meta, deadline_ms):
        self.name, self.token, self.owner, self.ttl_ms = name, token, owner, ttl_ms
        self.lock_delay_ms, self.meta, self.deadline_ms = lock_delay_ms, meta, deadline_ms


def test_the_snapshot_push_is_byte_identical_to_the_previous_build():
    holders = [_Holder("a", E1 | 1, b"o" * 16, 5000, 0, ("app:c", "r1"), 1_003_000),
               _Holder("b", E1 | 2, b"p" * 16, 7000, 100, None, 999_000)]
    with open(os.path.join(FIXTURE, "snapshot-push.bin"), "rb") as f:
        old = f.read()
    assert encode_snapshot(9, 1, 2, holders, "inc-1", 1_000_000) == old
    _zero, _kind, (lsn, epoch, counter, items, incarnation) = msgpack.unpackb(old)
    decoded = [SnapshotHolder.decode(h) for h in items]
    assert [(h.name, h.remaining_ms) for h in decoded] == [("a", 3000), ("b", 0)]
    state = LogState()
    for h in decoded:
        apply(h.grant(), state)
    assert (state.epoch, state.counter, sorted(state.holders)) == (1, 2, ["a", "b"])


@pytest.mark.parametrize("body", [[1, "a", E1 | 1], [2, "a", E1 | 1, 0, "extra"], [9, 1], "grant", []])
def test_a_checksummed_record_of_the_wrong_shape_is_corruption(tmp_path, body):
    """A frame whose CRC matches but whose record has an unknown type or the wrong
    number of fields stops recovery with WalCorruption naming the LSN (nothing is
    guessed or skipped)."""
    from fastlock.errors import StorageError, WalCorruption

    packed = msgpack.packb(body)
    lenb = F.U32.pack(len(packed) | F.START | F.COMMIT)
    frame = F.U32.pack(F.crc32(packed, F.crc32(lenb))) + lenb + packed
    d = tmp_path / "data"
    d.mkdir(mode=0o700)
    (d / F.seg_name(1)).write_bytes(F.seg_header(1) + frame)
    wal = WriteAheadLog(str(d))
    with pytest.raises(WalCorruption, match="undecodable record") as info:
        wal.open()
    assert info.value.lsn == 1 and isinstance(info.value, StorageError)


def test_storage_errors_are_fastlock_errors_and_keep_their_old_bases_and_names():
    import fastlock.replication as R
    import fastlock.wal as W
    from fastlock import errors

    for name, builtin in (("WalCorruption", Exception), ("WalFatal", RuntimeError), ("DataDirInUse", RuntimeError),
                          ("WalCompacted", LookupError), ("NodeFileDamaged", RuntimeError)):
        cls = getattr(errors, name)
        assert issubclass(cls, errors.StorageError) and issubclass(cls, errors.FastlockError)
        assert issubclass(cls, builtin) and cls.code == 0
    assert (W.WalCorruption, W.WalFatal, W.DataDirInUse, W.WalCompacted) == (
        errors.WalCorruption, errors.WalFatal, errors.DataDirInUse, errors.WalCompacted)
    assert R.NodeFileDamaged is errors.NodeFileDamaged
