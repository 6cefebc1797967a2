"""The WAL's records for shared leases, semaphore permits and running lock-delays:
their encoding (an exclusive grant stays the 8-field record of earlier logs), the
replay rules of the one ``apply``, snapshots and recovery."""

from __future__ import annotations

import asyncio
import random
import time

import msgpack
import pytest

from fastlock._core import LockTable
from fastlock.wal import HolderSlices, PackedHolders, WriteAheadLog, apply
from fastlock.wal.records import (
    GRANT,
    LOCK_DELAY,
    Expire,
    Grant,
    HolderRecord,
    LeaseMeta,
    LockDelay,
    LogState,
    Release,
    decode,
    encode,
)
from fastlock.wal.snapshot import encode_snapshot, load_snapshot


def tok(counter: int, epoch: int = 1) -> int:
    return (epoch << 40) | counter


def g(name, counter, owner=b"o", shared=False, limit=0):
    return Grant(name, tok(counter), owner, 10_000, 0, "app:c", None, 0, shared, limit)


def test_an_exclusive_grant_is_the_record_of_earlier_logs_and_a_shared_one_has_two_more_fields():
    assert encode(g("a", 1)) == [GRANT, "a", tok(1), b"o", 10_000, 0, "app:c", None, 0]
    assert encode(g("a", 2, shared=True)) == [GRANT, "a", tok(2), b"o", 10_000, 0, "app:c", None, 0, True, 0]
    assert encode(g("a", 3, limit=4))[-2:] == [False, 4]
    for rec in (g("a", 1), g("a", 2, shared=True), g("a", 3, limit=4), LockDelay("a", 123, 5)):
        assert decode(msgpack.unpackb(msgpack.packb(encode(rec)))) == rec
    assert decode([GRANT, "a", tok(1), b"o", 10_000, 0, None, None, 0]).shared is False
    with pytest.raises(ValueError):
        decode([GRANT, "a", tok(1), b"o", 10_000, 0, None, None, 0, True])  # 9 fields: neither shape
    assert encode(LockDelay("a", 123, 5)) == [LOCK_DELAY, "a", 123, 5]


def test_replay_rules_for_shared_leases_and_permits():
    state = LogState()
    for rec in (g("a", 1, b"r1", shared=True), g("a", 2, b"r2", shared=True)):
        assert apply(rec, state)
    assert sorted(state.holders["a"]) == [tok(1), tok(2)]  # readers share
    apply(g("a", 3, b"r1", shared=True), state)  # the same owner's lease is replaced
    assert sorted(state.holders["a"]) == [tok(2), tok(3)]
    apply(Release("a", tok(2), 0), state)
    assert apply(Release("a", tok(2), 0), state) is False  # gone: changes nothing
    assert sorted(state.holders["a"]) == [tok(3)]
    apply(g("a", 4, b"w"), state)  # an exclusive grant replaces every holder
    assert list(state.holders["a"]) == [tok(4)]
    apply(g("a", 5, b"p1", limit=2), state)  # a permit replaces an exclusive holder
    apply(g("a", 6, b"p2", limit=2), state)
    assert sorted(state.holders["a"]) == [tok(5), tok(6)] and state.lease_count() == 2
    apply(g("a", 7, b"p3", limit=3), state)  # another limit replaces the permits
    assert list(state.holders["a"]) == [tok(7)]
    apply(Expire("a", tok(7), 0), state)
    assert "a" not in state.holders and state.counter == 7
    apply(LockDelay("b", 100, 0), state)
    apply(LockDelay("b", 50, 0), state)  # the latest end is kept
    assert state.lock_delays == {"b": 100}


def test_a_snapshot_keeps_shared_leases_and_permits(tmp_path):
    holders = [HolderRecord("a", tok(1), b"r1", 5000, 0, "c", None, 0, True, 0),
               HolderRecord("a", tok(2), b"r2", 5000, 0, "c", None, 0, True, 0),
               HolderRecord("s", tok(3), b"p", 5000, 0, None, None, 0, False, 3),
               HolderRecord("x", tok(4), b"w", 5000, 0, None, None, 0)]
    path = tmp_path / "snap"
    data = encode_snapshot(4, 1, 4, holders)
    path.write_bytes(data)
    assert load_snapshot(str(path)).holders == holders
    # an exclusive lease is stored as the 8 fields every earlier fastlock reads
    assert msgpack.packb(list(holders[3][:8])) in data


async def test_recovery_restores_shared_leases_permits_and_running_lock_delays(tmp_path):
    wal = WriteAheadLog(str(tmp_path))
    wal.open()
    wal.start(asyncio.get_running_loop())
    wal.log_grant("doc", tok(1), b"r1", 10_000, 0, "c", None, True, 0)
    wal.log_grant("doc", tok(2), b"r2", 10_000, 0, "c", None, True, 0)
    wal.log_grant("pool", tok(3), b"p", 10_000, 0, "c", None, False, 2)
    until = int(time.time() * 1000) + 5000
    wal.log_lock_delay("job", until)
    logged_from = int(time.time() * 1000)
    wal.log_lock_delays([("gone", 10), ("late", 1500)], 1000)  # (name, until_ms) at monotonic now 1000
    logged_to = int(time.time() * 1000)
    await wal.sync()
    await wal.close()
    again = WriteAheadLog(str(tmp_path))
    state = again.open()
    again.abort()
    by = sorted((h.name, h.token, h.shared, h.limit) for h in state.holders)
    assert by == [("doc", tok(1), True, 0), ("doc", tok(2), True, 0), ("pool", tok(3), False, 2)]
    delays = dict(state.lock_delays)
    assert delays["job"] == until and "gone" not in delays
    # 500 ms left at the log call, recorded as a wall-clock deadline then
    assert logged_from + 500 - 1 <= delays["late"] <= logged_to + 500 + 1  # (1 ms: rounding)


def _table_with_every_kind(n_exclusive: int) -> LockTable:
    """A table with exclusive leases (meta None, ASCII, non-ASCII, an int field), shared
    leases, permits, long names and owners, and tokens/TTLs of every msgpack int width."""
    t = LockTable()
    metas = [None, LeaseMeta("app:c", None), LeaseMeta("ñamé ☃", "corr-1"), LeaseMeta(None, "x" * 40),
             LeaseMeta("n", 7)]
    for i in range(n_exclusive):
        name = f"e{i}" + ("é" if i % 5 == 1 else "") + "x" * (300 if i % 97 == 3 else i % 40)
        owner = bytes([i % 256]) * (300 if i == 5 else 16)
        t.install_holder(name, tok(i + 1, epoch=i % 3) + (i % 4) * (1 << 33), owner,
                         1 + (i % 7) * 70_000 ** (i % 3), (i % 3) * 200, metas[i % len(metas)], 0)
    for r in range(3):
        t.install_holder("doc", tok(n_exclusive + 1 + r), f"r{r}".encode(), 10_000, 0, metas[r], 0, shared=True)
    for p in range(2):
        t.install_holder("pool", tok(n_exclusive + 9 + p), f"p{p}".encode(), 10_000, 0, None, 0, limit=3)
    return t


def _as_records(t: LockTable) -> list[HolderRecord]:
    return [HolderRecord(h.name, h.token, h.owner, h.ttl_ms, h.lock_delay_ms, h.meta[0] if h.meta else None,
                         h.meta[1] if h.meta else None, 0, h.shared, h.limit) for h in t.holders()]


@pytest.mark.parametrize("n", [0, 10, 11, 300, 70_000])  # array headers: fixarray, array16, array32
def test_the_table_packs_its_holders_into_the_bytes_a_snapshot_of_its_records_holds(tmp_path, n):
    t = _table_with_every_kind(n)
    records = _as_records(t)
    count, data = t.pack_holders(msgpack.Packer(use_bin_type=True).pack)
    assert count == len(records) == n + 5
    packed = encode_snapshot(4, 1, 4, PackedHolders(count, data))
    assert packed == encode_snapshot(4, 1, 4, records)
    path = tmp_path / "snap"
    path.write_bytes(packed)
    assert load_snapshot(str(path)).holders == records


def _wal_granting(tmp_path, t: LockTable) -> WriteAheadLog:
    """A started WAL (one snapshot kept) that logged a grant of every holder of ``t``."""
    wal = WriteAheadLog(str(tmp_path), keep_snapshots=1)
    wal.open()
    wal.start(asyncio.get_running_loop())
    for h in _as_records(t):
        wal.log_grant(h.name, h.token, h.owner, h.ttl_ms, h.lock_delay_ms, h.client_name, h.correlation_id,
                      h.shared, h.limit)
    return wal


async def test_a_snapshot_of_packed_holders_is_what_recovery_restores(tmp_path):
    t = _table_with_every_kind(50)
    wal = _wal_granting(tmp_path, t)
    state = (t.epoch, t.counter, PackedHolders(*t.pack_holders(msgpack.Packer(use_bin_type=True).pack)))
    assert wal.maybe_snapshot(lambda: state, force=True)
    await wal.wait_snapshot()
    gone = _as_records(t)[1]
    wal.log_release(gone.name, gone.token)  # after the snapshot: replayed on top of it
    assert t.remove_holder(gone.name, gone.token, 0)
    await wal.close()
    again = WriteAheadLog(str(tmp_path))
    recovered = again.open()
    again.abort()
    assert recovered.snapshot_lsn > 0 and recovered.records_replayed == 1
    assert sorted(recovered.holders) == sorted(_as_records(t))


@pytest.mark.parametrize("seed", range(6))
def test_a_snapshot_taken_in_slices_is_the_table_when_it_began_whatever_changes_meanwhile(seed):
    """Random grants (exclusive, shared, permits, many at once, from waiters), releases,
    expiries, extends, installs and removals between the slices: the snapshot is the
    holders of the moment it began, each once."""
    rng = random.Random(seed)
    pack = msgpack.Packer(use_bin_type=True).pack
    t = LockTable()
    now = 1
    names = [f"n{i}" for i in range(60)]

    def change() -> None:
        nonlocal now
        name = rng.choice(names)
        owner = rng.choice([b"a", b"b", b"c", b"d"])
        op = rng.randrange(8)
        kind = rng.randrange(3)  # exclusive, shared, permit
        if op <= 2:
            t.acquire(name, owner, 1, None, rng.randint(5, 400), rng.choice([0, 50]), rng.choice([0, 30]),
                      LeaseMeta("c", str(now)), now, shared=kind == 1, limit=3 if kind == 2 else 0)
        elif op == 3:
            t.acquire_many([(n, rng.random() < 0.5) for n in rng.sample(names, 3)], rng.randbytes(8), 2, None,
                           200, 0, 0, None, now)
        elif op == 4:
            for h in t.holders_of(name, now):
                t.release(name, h.token, h.owner, now)
        elif op == 5:
            for h in t.holders_of(name, now):
                t.extend(name, h.token, h.owner, rng.randint(5, 900), now)
        elif op == 6:
            t.install_holder(name, tok(t.counter + 1, t.epoch), owner, 300, 0, None, now,
                             shared=kind == 1, limit=3 if kind == 2 else 0)
        else:
            for h in t.holders_of(name, now)[:1]:
                t.remove_holder(name, h.token, now)
        now += rng.randint(0, 6)
        t.expire(now)
        t.drain_events()

    for _ in range(400):
        change()
    for _ in range(3):  # one after the other on the same table
        before = sorted(_as_records(t))
        t.snapshot_begin(pack)
        with pytest.raises(RuntimeError):
            t.snapshot_begin(pack)  # one at a time
        done = False
        while not done:
            for _ in range(rng.randrange(6)):
                change()
            done = t.snapshot_step(rng.randint(1, 7))
        count, data = t.snapshot_end()
        got = [HolderRecord.from_list(h) for h in msgpack.unpackb(data)]
        assert count == len(got) == len(before) and sorted(got) == before
        assert count > 5  # the random table had holders to snapshot


def test_an_aborted_snapshot_leaves_the_table_ready_for_the_next():
    pack = msgpack.Packer(use_bin_type=True).pack
    t = _table_with_every_kind(20)
    with pytest.raises(RuntimeError):
        t.snapshot_step(10)
    t.snapshot_begin(pack)
    t.snapshot_step(3)
    with pytest.raises(RuntimeError):
        t.snapshot_end()  # not complete
    t.snapshot_abort()
    gone = _as_records(t)[0]
    t.remove_holder(gone.name, gone.token, 0)
    count, data = t.pack_holders(pack)
    assert sorted(HolderRecord.from_list(h) for h in msgpack.unpackb(data)) == sorted(_as_records(t))


async def test_a_snapshot_in_slices_covers_its_lsn_while_the_table_changes_and_recovery_restores_the_end(tmp_path):
    """The WAL snapshot of HolderSlices: slices run on later loop turns while grants and
    releases go on (each logged); the snapshot holds the table at its LSN and recovery
    replays the rest on top of it.  A WAL stopped mid-snapshot leaves the table free."""
    pack = msgpack.Packer(use_bin_type=True).pack
    t = _table_with_every_kind(40)
    wal = _wal_granting(tmp_path, t)
    at = wal.logged_lsn
    assert wal.maybe_snapshot(lambda: (t.epoch, t.counter, HolderSlices(t, pack, per_slice=4)), force=True)
    for turn, h in enumerate(_as_records(t)[:12]):  # changes between the slices, each logged
        assert t.remove_holder(h.name, h.token, 0)
        wal.log_release(h.name, h.token)
        token = tok(t.counter + 1, t.epoch)
        t.install_holder(f"new{turn}", token, b"n", 5000, 0, None, 0)
        wal.log_grant(f"new{turn}", token, b"n", 5000, 0, None, None)
        await asyncio.sleep(0)
    await wal.wait_snapshot()
    assert wal.stats()["snapshot_lsn"] == at
    await wal.close()
    again = WriteAheadLog(str(tmp_path))
    recovered = again.open()
    again.abort()
    assert recovered.snapshot_lsn == at and recovered.records_replayed == 24
    assert sorted(h._replace(granted_wall_ms=0) for h in recovered.holders) == sorted(_as_records(t))

    wal = WriteAheadLog(str(tmp_path / "b"))
    wal.open()
    wal.start(asyncio.get_running_loop())
    wal.log_grant("x", tok(999), b"o", 5000, 0, None, None)
    assert wal.maybe_snapshot(lambda: (t.epoch, t.counter, HolderSlices(t, pack, per_slice=1)), force=True)
    wal.abort()  # before any slice ran
    await wal.wait_snapshot()
    t.snapshot_begin(pack)  # the aborted one is over
    t.snapshot_abort()


def test_install_holders_installs_each_record_as_install_holder_does_and_gives_the_longest_ttl():
    records = _as_records(_table_with_every_kind(30))
    one_by_one, at_once = LockTable(), LockTable()
    for h in records:
        one_by_one.install_holder(h.name, h.token, h.owner, h.ttl_ms, h.lock_delay_ms,
                                  (h.client_name, h.correlation_id), 5, h.shared, h.limit)
    assert at_once.install_holders(records, 5) == max(h.ttl_ms for h in records)
    assert sorted(_as_records(at_once)) == sorted(_as_records(one_by_one)) == sorted(records)
    assert (at_once.counter, at_once.epoch) == (one_by_one.counter, one_by_one.epoch)
    assert LockTable().install_holders([], 5) == 0
    with pytest.raises(ValueError):
        at_once.install_holders([records[0]._replace(token=0)], 5)
