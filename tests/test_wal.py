"""Tests of fastlock.wal on real files in tmp_path (no sleeps).

Each async test runs with both group-commit writers (dedicated thread and inline).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import io
import json
import logging
import os
import threading
import time
import types

import msgpack
import pytest

from fastlock import wal as W
from fastlock._testbase import power_cut
from fastlock.cli import main as cli_main
from fastlock.wal import (
    GRANT,
    RESERVE,
    Grant,
    HolderRecord,
    WalCompacted,
    WalCorruption,
    WalFatal,
    WriteAheadLog,
    decode_frames,
    dump,
)
from fastlock.wal import format as F
from fastlock.wal import snapshot as snapshot_module
from fastlock.wal import writer as writer_module
from fastlock.wal.commit import LONE_BATCHES
from fastlock.wal.writer import COMPILED_DISK

E1 = 1 << 40  # epoch 1


def tok(counter: int, epoch: int = 1) -> int:
    return (epoch << 40) | counter


@pytest.fixture(params=["thread", "inline", "auto"])
def writer(request):
    return request.param


def patch_disk(wal: WriteAheadLog, monkeypatch, **fns) -> None:
    """Substitute the segment writer's I/O primitives (``pwrite_all``, ``datasync``,
    ``zero_fill``) named in ``fns``; the others stay the compiled ones."""
    disk = types.SimpleNamespace(**vars(COMPILED_DISK))
    for name, fn in fns.items():
        setattr(disk, name, fn)
    monkeypatch.setattr(wal._commit.io, "disk", disk)


def make(path, writer="thread", **kw) -> WriteAheadLog:
    return WriteAheadLog(str(path), writer=writer, **kw)


async def started(path, writer="thread", **kw):
    wal = make(path, writer, **kw)
    state = wal.open()
    wal.start(asyncio.get_running_loop())
    return wal, state


async def durable(wal: WriteAheadLog) -> None:
    fut = asyncio.get_running_loop().create_future()
    wal.when_durable(lambda: fut.set_result(None))
    await fut


def reopen(path, **kw):
    wal = make(path, **kw)
    st = wal.open()
    wal.abort()
    return st


def grant(wal, name, counter, owner=b"o", ttl=10_000, epoch=1, client="c1", corr=None):
    wal.log_grant(name, tok(counter, epoch), owner, ttl, 0, client, corr)


async def write_batches(wal, nbatches, per_batch=3, start=1):
    """Log grants in separate loop turns (one batch each); return the last counter."""
    c = start
    for _ in range(nbatches):
        for _ in range(per_batch):
            grant(wal, f"l{c % 4}", c)
            c += 1
        await durable(wal)
    return c - 1


def segments(path):
    return sorted(f for f in os.listdir(path) if f.startswith("wal-"))


def last_segment(path):
    return os.path.join(str(path), segments(path)[-1])


# -- recovery of state ------------------------------------------------------------------
async def test_recover_holders_counter_epoch(tmp_path, writer):
    wal, st = await started(tmp_path, writer)
    assert st.next_lsn == 1 and st.counter == 0 and st.holders == [] and st.snapshot_lsn == 0
    grant(wal, "a", 1, owner=b"A", client="api-1", corr="req-1")
    grant(wal, "b", 2, owner=b"B")
    grant(wal, "c", 3)
    await durable(wal)
    wal.log_release("a", tok(1))
    wal.log_expire("b", tok(99))  # wrong token: no effect
    wal.log_extend("c", tok(3), 55_000)
    wal.log_extend("b", tok(7), 1)  # wrong token: no effect
    wal.log_epoch(2)
    grant(wal, "a", 4, epoch=2, owner=b"A2")
    wal.log_expire("c", tok(3))
    grant(wal, "c", 5, epoch=2, ttl=30_000)
    wal.log_extend("c", tok(5, 2), 31_000)
    await wal.close()

    st = reopen(tmp_path)
    assert st.epoch == 2
    assert st.counter == 5
    assert st.records_replayed == 12 and st.next_lsn == 13 and st.torn_bytes == 0
    by = {h.name: h for h in st.holders}
    assert set(by) == {"a", "b", "c"}
    assert by["a"][:7] == ("a", tok(4, 2), b"A2", 10_000, 0, "c1", None)
    assert by["b"].token == tok(2) and by["b"].owner == b"B"
    assert by["c"].ttl_ms == 31_000 and by["c"].token == tok(5, 2)
    assert isinstance(by["a"], HolderRecord) and by["a"].granted_wall_ms > 0


async def test_epoch_of_token_raises_epoch(tmp_path, writer):
    wal, _ = await started(tmp_path, writer)
    grant(wal, "a", 9, epoch=3)
    await wal.close()
    st = reopen(tmp_path)
    assert st.epoch == 3 and st.counter == 9


async def test_log_before_start_is_flushed(tmp_path, writer):
    wal = make(tmp_path, writer)
    wal.open()
    wal.log_epoch(1)
    grant(wal, "a", 1)
    calls = []
    wal.when_durable(lambda: calls.append(1))
    wal.start(asyncio.get_running_loop())
    await wal.close()
    assert calls == [1]
    assert reopen(tmp_path).counter == 1


async def test_close_without_start(tmp_path):
    wal = make(tmp_path)
    wal.open()
    grant(wal, "a", 1)
    await wal.close()
    assert reopen(tmp_path).holders[0].name == "a"


async def test_reopen_continues_lsns_in_a_new_segment(tmp_path, writer):
    for i in range(3):
        wal, st = await started(tmp_path, writer)
        assert st.next_lsn == 1 + 2 * i
        grant(wal, "a", 2 * i + 1)
        wal.log_release("a", tok(2 * i + 1))
        await wal.close()
    assert segments(tmp_path) == [F.seg_name(1), F.seg_name(3), F.seg_name(5)]
    assert reopen(tmp_path).counter == 5


# -- group commit -------------------------------------------------------------------------
async def test_one_turn_one_fsync(tmp_path, writer):
    wal, _ = await started(tmp_path, writer)
    s0 = wal.stats()
    for i in range(1, 201):
        grant(wal, f"n{i}", i)
    await durable(wal)
    s1 = wal.stats()
    assert s1["fsyncs"] - s0["fsyncs"] == 1
    assert s1["batches"] - s0["batches"] == 1
    assert s1["durable_lsn"] == s1["last_lsn"] == 200
    # 32 producer tasks each logging once per turn: one fsync per turn
    s0 = s1

    async def producer(k):
        for j in range(10):
            grant(wal, f"p{k}", 1000 + k * 100 + j)
            await durable(wal)

    await asyncio.gather(*(producer(k) for k in range(32)))
    s1 = wal.stats()
    assert s1["records"] - s0["records"] == 320
    assert s1["fsyncs"] - s0["fsyncs"] == s1["batches"] - s0["batches"] <= 20
    await wal.close()


async def test_when_durable_order_and_not_synchronous(tmp_path, writer):
    wal, _ = await started(tmp_path, writer)
    seen = []

    def cb(tag, lsn):
        def f():
            st = wal.stats()
            assert st["durable_lsn"] >= lsn
            seen.append(tag)
        return f

    wal.when_durable(cb("empty", 0))  # nothing logged: still asynchronous
    assert seen == []
    for i in range(1, 6):
        grant(wal, "x", i)
        wal.when_durable(cb(f"r{i}", i))
        assert f"r{i}" not in seen
        if i == 3:
            await asyncio.sleep(0)  # next loop turn: a new batch
    await durable(wal)
    assert seen == ["empty", "r1", "r2", "r3", "r4", "r5"]
    await wal.close()


async def test_auto_writer_syncs_a_lone_waiter_on_the_loop_and_concurrent_ones_on_the_thread(tmp_path, monkeypatch):
    wal, _ = await started(tmp_path, "auto")
    synced_on: list[str] = []

    def datasync(fd):
        synced_on.append(threading.current_thread().name)
        return COMPILED_DISK.datasync(fd)

    patch_disk(wal, monkeypatch, datasync=datasync)
    loop = asyncio.get_running_loop()
    main = threading.current_thread().name
    for c in range(1, LONE_BATCHES + 2):  # one client: each batch has one waiter
        grant(wal, f"n{c}", c)
        await durable(wal)
    # the thread until it has waited alone for LONE_BATCHES batches, then the loop
    assert synced_on == ["fastlock-wal"] * (LONE_BATCHES - 1) + [main] * 2
    synced_on.clear()
    c = LONE_BATCHES + 1
    for _ in range(3):  # two clients waiting together: their batches go to the writer thread
        futs = []
        for _ in range(2):
            c += 1
            grant(wal, f"n{c}", c)
            fut = loop.create_future()
            wal.when_durable(lambda fut=fut: fut.set_result(None))
            futs.append(fut)
        await asyncio.gather(*futs)
    assert synced_on == ["fastlock-wal"] * 3
    synced_on.clear()
    for _ in range(LONE_BATCHES):  # one client again: the thread, then the loop
        c += 1
        grant(wal, f"n{c}", c)
        await durable(wal)
    assert synced_on == ["fastlock-wal"] * (LONE_BATCHES - 1) + [main]
    await wal.close()
    assert reopen(tmp_path).counter == c


async def test_auto_writer_keeps_a_batch_formed_behind_the_thread_on_the_thread(tmp_path, monkeypatch):
    """A batch that formed while another was on the writer thread is not synced on the loop,
    even with one waiter after a batch of one: clients are waiting together, and the loop
    keeps reading them while the thread syncs."""
    wal, _ = await started(tmp_path, "auto")
    synced_on: list[str] = []
    gates = [threading.Event(), threading.Event()]  # hold the first two thread syncs
    entered = [threading.Event(), threading.Event()]

    def datasync(fd):
        n = len(synced_on)
        synced_on.append(threading.current_thread().name)
        if n < len(gates):
            entered[n].set()
            gates[n].wait(10)
        return COMPILED_DISK.datasync(fd)

    patch_disk(wal, monkeypatch, datasync=datasync)
    loop = asyncio.get_running_loop()

    def waiter() -> asyncio.Future:
        fut = loop.create_future()
        wal.when_durable(lambda: fut.set_result(None))
        return fut

    grant(wal, "a1", 1)
    grant(wal, "a2", 2)
    a = [waiter(), waiter()]  # batch A: two waiters, on the thread
    await asyncio.sleep(0)
    await loop.run_in_executor(None, entered[0].wait, 10)
    grant(wal, "b", 3)
    b = waiter()  # batch B: one waiter, behind A
    await asyncio.sleep(0)
    gates[0].set()
    await asyncio.gather(*a)
    await loop.run_in_executor(None, entered[1].wait, 10)  # B is on the thread now
    grant(wal, "c", 4)
    c = waiter()  # batch C: one waiter after a batch of one, but formed behind B
    await asyncio.sleep(0)
    gates[1].set()
    await asyncio.gather(b, c)
    assert synced_on == ["fastlock-wal"] * 3
    for n in range(5, 5 + LONE_BATCHES):  # nothing on the thread any more: one client waits alone
        grant(wal, "d", n)
        await durable(wal)
    assert synced_on[3:] == ["fastlock-wal"] * (LONE_BATCHES - 1) + [threading.current_thread().name]
    await wal.close()
    assert reopen(tmp_path).counter == 4 + LONE_BATCHES


async def test_poll_acknowledges_a_batch_the_thread_finished_before_its_wake_up(tmp_path):
    """WriteAheadLog.poll (called by the server after each read) runs a finished batch's
    callbacks at once; the wake-up the thread wrote for it is then a spurious one."""
    wal, _ = await started(tmp_path, "thread")
    seen: list[str] = []
    wal.poll()  # nothing in flight: nothing happens
    grant(wal, "a", 1)
    wal.when_durable(lambda: seen.append("a"))
    await asyncio.sleep(0)  # the turn ends: the batch goes to the thread
    worker = wal._commit.io._worker
    assert worker is not None and worker.job is not None
    deadline = time.monotonic() + 10
    while not worker.syncer.done:  # no loop turn meanwhile: the wake-up is not read
        assert time.monotonic() < deadline, "the writer thread did not finish the batch"
        time.sleep(0.001)
    assert seen == []
    wal.poll()
    assert seen == ["a"]
    assert worker.job is None
    wal.poll()  # taken already: nothing more
    assert seen == ["a"]
    grant(wal, "b", 2)  # the spurious wake-up does not disturb the next batch
    await durable(wal)
    await wal.close()
    assert reopen(tmp_path).counter == 2


async def test_after_a_thread_batch_the_next_is_handed_over_at_the_end_of_the_turn(tmp_path):
    """When ``poll`` (a batch end) acknowledges a batch the thread finished, the records waiting
    behind it are not handed over at once: the next batch goes to the thread at the end of the
    loop turn, with the records of the requests read later in that turn too (one sync for
    them all, not one for those logged before the completion and another for the rest)."""
    wal, _ = await started(tmp_path, "thread")
    written: list[tuple[int, int]] = []
    wal.add_listener(lambda first, last, data: written.append((first, last)))
    loop = asyncio.get_running_loop()
    seen: list[str] = []

    def waiter(name: str) -> asyncio.Future:
        fut = loop.create_future()
        wal.when_durable(lambda: (seen.append(name), fut.set_result(None)))
        return fut

    grant(wal, "a", 1)
    a = waiter("a")
    await asyncio.sleep(0)  # the turn ends: the batch goes to the thread
    worker = wal._commit.io._worker
    assert worker is not None and worker.job is not None
    grant(wal, "b", 2)  # behind it
    b = waiter("b")
    deadline = time.monotonic() + 10
    while not worker.syncer.done:  # no loop turn meanwhile
        assert time.monotonic() < deadline, "the writer thread did not finish the batch"
        time.sleep(0.001)
    wal.poll()  # a batch end: the finished batch is acknowledged now
    assert seen == ["a"] and a.done()
    assert worker.job is None  # the next batch waits for the end of the turn
    grant(wal, "c", 3)  # a request read later in the same turn
    c = waiter("c")
    await asyncio.gather(b, c)
    assert written == [(1, 1), (2, 3)]
    assert wal.stats()["thread_fsyncs"] == 2
    await wal.close()
    assert reopen(tmp_path).counter == 3


@pytest.mark.parametrize("fsync", ["never", "always"])
async def test_poll_does_nothing_without_a_batch_on_the_thread(tmp_path, fsync):
    wal, _ = await started(tmp_path, "inline", fsync=fsync)
    seen: list[str] = []
    grant(wal, "a", 1)
    wal.when_durable(lambda: seen.append("a"))
    wal.poll()
    assert seen == []  # acknowledged at the end of the turn, as without poll
    await durable(wal)
    assert seen == ["a"]
    await wal.close()


async def test_one_fsync_in_flight_and_next_batch_accumulates(tmp_path, monkeypatch):
    """Thread writer: while an fsync runs, records go into the next batch."""
    wal, _ = await started(tmp_path, "thread")
    real_fsync = COMPILED_DISK.datasync
    entered = threading.Event()
    release = threading.Event()
    lock = threading.Lock()
    active = [0, 0]  # current, max

    def slow_fsync(fd):
        with lock:
            active[0] += 1
            active[1] = max(active[1], active[0])
        entered.set()
        release.wait(10)
        with lock:
            active[0] -= 1
        real_fsync(fd)

    patch_disk(wal, monkeypatch, datasync=slow_fsync)
    loop = asyncio.get_running_loop()
    s0 = wal.stats()
    grant(wal, "a", 1)
    first = loop.create_future()
    wal.when_durable(lambda: first.set_result(None))
    await loop.run_in_executor(None, entered.wait, 10)  # fsync of batch 1 in progress
    entered.clear()
    for i in range(2, 12):
        grant(wal, "b", i)
        await asyncio.sleep(0)  # several loop turns while the fsync runs
    second = loop.create_future()
    wal.when_durable(lambda: second.set_result(None))
    assert not first.done()
    release.set()
    await first
    await second
    s1 = wal.stats()
    assert s1["fsyncs"] - s0["fsyncs"] == 2
    assert s1["batches"] - s0["batches"] == 2
    assert active[1] == 1
    await wal.close()


async def test_listener_gets_written_batches(tmp_path, writer):
    wal, _ = await started(tmp_path, writer)
    got = []
    wal.add_listener(lambda first, last, data: got.append((first, last, data)))
    await write_batches(wal, 3, per_batch=2)
    assert [(first, last) for first, last, _ in got] == [(1, 2), (3, 4), (5, 6)]
    decoded = [r for f, _l, d in got for r in decode_frames(d, f)]
    assert decoded == list(wal.read_from(1))
    assert [lsn for lsn, _ in wal.read_from(4)] == [4, 5, 6]
    assert decoded[0][1].kind == GRANT and isinstance(decoded[0][1], Grant)
    await wal.close()


# -- fsync modes, reservations, lost tails ----------------------------------------------------
async def test_always_mode_writes_no_reservations(tmp_path, writer):
    wal, _ = await started(tmp_path, writer)
    grant(wal, "a", 1)
    await durable(wal)
    assert [r.kind for _, r in wal.read_from(1)] == [GRANT]
    await wal.close()


@pytest.mark.parametrize("mode", ["interval", "never"])
async def test_reservation_fsynced_before_ack(tmp_path, writer, mode):
    wal, _ = await started(tmp_path, writer, fsync=mode, fsync_interval_ms=3_600_000, reserve_block=10)
    s0 = wal.stats()
    grant(wal, "a", 1)
    await durable(wal)
    s1 = wal.stats()
    assert s1["fsyncs"] - s0["fsyncs"] == 1 and s1["durable_lsn"] == 2
    first = next(r for _, r in wal.read_from(1))
    assert first.kind == RESERVE and first.counter == 11
    for c in range(2, 12):  # within the reservation: written, not fsynced
        grant(wal, "a", c)
        await durable(wal)
    s2 = wal.stats()
    assert s2["fsyncs"] == s1["fsyncs"] and s2["durable_lsn"] == 2 and s2["ack_lsn"] == s2["last_lsn"]
    grant(wal, "a", 12)  # beyond: new reservation, fsynced
    await durable(wal)
    assert wal.stats()["fsyncs"] == s1["fsyncs"] + 1
    await wal.close()


async def test_epoch_fsynced_in_never_mode(tmp_path, writer):
    wal, _ = await started(tmp_path, writer, fsync="never")
    wal.log_epoch(4)
    await durable(wal)
    assert wal.stats()["durable_lsn"] == 1
    await wal.close()


async def test_interval_timer_fsyncs(tmp_path, writer):
    wal, _ = await started(tmp_path, writer, fsync="interval", fsync_interval_ms=300, reserve_block=10**6)
    grant(wal, "a", 1)
    await durable(wal)
    for c in range(2, 20):
        grant(wal, "a", c)
    await durable(wal)
    assert wal.stats()["durable_lsn"] < wal.stats()["last_lsn"]
    await asyncio.wait_for(wal.wait_synced(), 10)  # the timer does it
    assert wal.stats()["durable_lsn"] == wal.stats()["last_lsn"]
    await wal.close()


def _crash_to_durable(wal: WriteAheadLog) -> int:
    """Simulate an OS crash: stop without flushing and cut the active segment back to
    its last fsynced size.  Returns the number of bytes lost."""
    st = wal.stats()
    wal.abort()
    path = st["active_segment"]
    size = os.path.getsize(path)
    os.truncate(path, st["durable_offset"])
    return size - st["durable_offset"]


@pytest.mark.parametrize("mode", ["interval", "never"])
async def test_lost_unsynced_tail_never_reuses_a_token(tmp_path, writer, mode):
    acked = []
    counter = 0
    for _round in range(3):
        wal, st = await started(tmp_path, writer, fsync=mode, fsync_interval_ms=3_600_000, reserve_block=7)
        assert st.counter >= max(acked, default=0)  # the invariant, at every restart
        counter = st.counter
        for _ in range(20):
            counter += 1
            grant(wal, f"n{counter % 3}", counter)
            await durable(wal)
            acked.append(counter)
        wal.log_release("n0", tok(counter))
        lost = _crash_to_durable(wal)
        assert lost > 0  # something acknowledged really was lost
    st = reopen(tmp_path)
    assert st.counter >= max(acked)
    # records were lost, yet the reserved counter covers every acknowledged token
    assert st.records_replayed < len(acked) + 2 * 3


async def test_always_mode_loses_nothing_acknowledged(tmp_path, writer):
    wal, _ = await started(tmp_path, writer)
    for c in range(1, 31):
        grant(wal, f"n{c}", c)
        await durable(wal)
    acknowledged_end = wal.stats()["durable_offset"]
    active = wal.stats()["active_segment"]
    grant(wal, "unacked", 31)  # logged but not yet durable: the crash may keep or lose it
    _crash_to_durable(wal)
    assert os.path.getsize(active) >= acknowledged_end  # the crash cut nothing acknowledged
    st = reopen(tmp_path)
    assert {f"n{c}" for c in range(1, 31)} <= {h.name for h in st.holders}
    assert st.counter >= 30


# -- torn tails and corruption -------------------------------------------------------------------
async def _log_some(tmp_path, writer, nbatches=5, per_batch=3):
    wal, _ = await started(tmp_path, writer)
    last = await write_batches(wal, nbatches, per_batch)
    await wal.close()
    return last


async def test_torn_tail_truncated_mid_record(tmp_path, writer, caplog):
    n = await _log_some(tmp_path, writer)
    seg = last_segment(tmp_path)
    size = os.path.getsize(seg)
    os.truncate(seg, size - 5)
    with caplog.at_level(logging.WARNING, logger="fastlock.wal"):
        st = reopen(tmp_path)
    assert st.records_replayed == n - 1 and st.counter == n - 1
    assert st.torn_bytes > 0 and st.next_lsn == n
    msg = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "torn tail" in msg and os.path.basename(seg) in msg and "offset" in msg and "bytes" in msg
    assert os.path.getsize(seg) == size - 5 - (st.torn_bytes)  # really cut
    st2 = reopen(tmp_path)  # idempotent, clean now
    assert st2.torn_bytes == 0 and st2.counter == n - 1


@pytest.mark.parametrize("tail", [b"\x01" + b"\x00" * 4095, os.urandom(777), b"\xff" * 9, b"\x01"])
async def test_torn_tail_garbage_or_zeros(tmp_path, writer, tail):
    n = await _log_some(tmp_path, writer)
    with open(last_segment(tmp_path), "ab") as f:
        f.write(tail)
    st = reopen(tmp_path)
    assert st.torn_bytes == len(tail)
    assert st.records_replayed == n and st.counter == n
    # logging continues after the cut
    wal, st = await started(tmp_path, writer)
    grant(wal, "z", n + 1)
    await wal.close()
    assert reopen(tmp_path).counter == n + 1


async def test_zero_tail_is_the_end_of_the_log_not_a_torn_tail(tmp_path, writer, caplog):
    """Zeros after the last record are preallocated space: trimmed quietly, nothing torn."""
    n = await _log_some(tmp_path, writer)
    seg = last_segment(tmp_path)
    size = os.path.getsize(seg)
    with open(seg, "ab") as f:
        f.write(b"\x00" * 5000)
    with caplog.at_level(logging.INFO, logger="fastlock.wal"):
        st = reopen(tmp_path)
    assert st.torn_bytes == 0 and st.records_replayed == n and st.counter == n
    assert os.path.getsize(seg) == size  # cut back to the last record
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "preallocated" in caplog.text


async def test_a_torn_record_followed_by_zeros_is_a_torn_tail(tmp_path, writer):
    n = await _log_some(tmp_path, writer)
    seg = last_segment(tmp_path)
    size = os.path.getsize(seg)
    with open(seg, "r+b") as f:  # the last record half-written, preallocated zeros after it
        f.seek(size - 5)
        f.write(b"\x00" * 5)
        f.write(b"\x00" * 4096)
    st = reopen(tmp_path)
    assert st.records_replayed == n - 1 and st.torn_bytes > 4096
    assert os.path.getsize(seg) < size - 5


async def test_a_preallocated_segment_after_a_crash_recovers_every_synced_record(tmp_path, writer):
    wal, _ = await started(tmp_path, writer)
    for c in range(1, 21):
        grant(wal, f"n{c}", c)
        await durable(wal)
    st = wal.stats()
    path = st["active_segment"]
    wal.abort()  # a crash: no trim
    assert os.path.getsize(path) > st["written_offset"]  # zero-filled ahead of the write offset
    power_cut(path, st["durable_offset"])
    state = reopen(tmp_path)
    assert state.torn_bytes == 0 and {f"n{c}" for c in range(1, 21)} <= {h.name for h in state.holders}
    assert os.path.getsize(path) == st["durable_offset"]


async def test_records_written_while_the_next_step_is_zero_filled_survive(tmp_path, writer, monkeypatch):
    """Releases written by the loop (no sync) right after a durable batch land where the
    writer thread zero-fills the next preallocation step when that batch went past the
    zero-filled space: the zeros never overwrite them."""
    monkeypatch.setattr(writer_module, "PREALLOC_STEP", 256 << 10)
    wal, _ = await started(tmp_path, writer, segment_bytes=64 << 20)
    big = "x" * 40_000
    c = 0
    for _ in range(30):
        for _ in range(5):  # ~200 KB: past the zero-filled space, the fill starts at the batch's end
            c += 1
            grant(wal, big + str(c), c)
        await durable(wal)
        for _ in range(3):
            wal.log_release(big + str(c), tok(c))  # written inline, at once
            await asyncio.sleep(0)
    st = wal.stats()
    path = st["active_segment"]
    wal.abort()  # a crash: every record was written, the tail is zero-filled
    state = reopen(tmp_path)
    assert state.records_replayed == 30 * 8 and state.torn_bytes == 0
    assert os.path.getsize(path) == st["written_offset"]


async def test_auto_keeps_the_thread_while_clients_wait_together(tmp_path):
    """The auto writer syncs on the loop only once one client has waited alone for
    ``LONE_BATCHES`` batches in a row: a batch three clients wait for goes to the writer thread,
    and so do the batches right after it that one client waits for (the others are between two
    requests) - a sync on the loop would hold back every other client's reads and replies."""
    wal, _ = await started(tmp_path, "auto")
    c = 0

    async def alone() -> None:
        nonlocal c
        c += 1
        grant(wal, "alone", c)
        await durable(wal)

    for _ in range(2 * LONE_BATCHES):
        await alone()
    assert wal.stats()["thread_fsyncs"] == LONE_BATCHES - 1  # then on the loop
    loop = asyncio.get_running_loop()
    together = [loop.create_future() for _ in range(3)]
    for fut in together:
        c += 1
        grant(wal, f"together-{c}", c)
        wal.when_durable(lambda fut=fut: fut.set_result(None))
    await asyncio.gather(*together)
    before = wal.stats()["thread_fsyncs"]
    for _ in range(3):  # (a client's next pair would be two of them)
        await alone()
    assert wal.stats()["thread_fsyncs"] - before == 3
    for _ in range(LONE_BATCHES - 3):
        await alone()  # one client alone for LONE_BATCHES batches: on the loop again from the last
    assert wal.stats()["thread_fsyncs"] - before == LONE_BATCHES - 1
    wal.abort()


async def alone_for_lone_batches(wal, start: int = 0) -> int:
    """One client's durable grants, each in its own batch, until the auto writer syncs them on
    the loop; returns the last counter."""
    c = start
    for _ in range(LONE_BATCHES):
        c += 1
        grant(wal, "alone", c)
        await durable(wal)
    return c


async def test_auto_writer_acknowledges_a_lone_waiter_at_its_batch_end(tmp_path):
    """Once one client waits alone, the batch its callback waits on is written and fdatasync'd
    inside ``poll`` (the server's batch end), compiled, on the loop: the callback has run when
    ``poll`` returns, not one loop turn later.  A second batch end with records in the same turn
    leaves them to the turn's end, and that batch goes to the writer thread (clients wait
    together)."""
    wal, _ = await started(tmp_path, "auto")
    c = await alone_for_lone_batches(wal)
    wal.take_fsync_seconds()
    before = wal.stats()
    acked: list[int] = []
    c += 1
    grant(wal, "alone", c)
    wal.when_durable(lambda c=c: acked.append(c))
    wal.poll()
    assert acked == [c]  # at the batch end
    after = wal.stats()
    assert after["fsyncs"] == before["fsyncs"] + 1 and after["thread_fsyncs"] == before["thread_fsyncs"]
    assert after["durable_offset"] == after["written_offset"] and len(wal.take_fsync_seconds()) == 1
    await asyncio.sleep(0)  # the turn's end
    # two clients in one turn: the first batch end syncs, the second waits for the turn's end
    fut = asyncio.get_running_loop().create_future()
    c += 1
    grant(wal, "first", c)
    wal.when_durable(lambda c=c: acked.append(c))
    wal.poll()
    c += 1
    grant(wal, "second", c)
    wal.when_durable(lambda: fut.set_result(None))
    wal.poll()
    assert acked[-1] == c - 1 and not fut.done()
    await fut
    assert wal.stats()["thread_fsyncs"] == before["thread_fsyncs"] + 1  # on the thread
    await wal.close()
    assert reopen(tmp_path).counter == c


async def test_a_lone_client_on_the_loop_keeps_preallocating(tmp_path, monkeypatch):
    """The compiled write and sync of a lone client's batches hands the batch after which a
    preallocation step falls due to ``SegmentWriter.write``, which zero-fills it: the segment
    stays zero-filled ahead of the write offset, and every record is recovered."""
    monkeypatch.setattr(writer_module, "PREALLOC_STEP", 8192)
    wal, _ = await started(tmp_path, "auto", segment_bytes=64 << 20)
    c = await alone_for_lone_batches(wal)
    before = wal.stats()
    for _ in range(300):  # ~24 KB of records: three steps
        c += 1
        grant(wal, "alone", c)
        await durable(wal)
    st = wal.stats()
    assert st["thread_fsyncs"] == before["thread_fsyncs"]  # all on the loop
    assert st["fsyncs"] - before["fsyncs"] == 300  # one per batch (a step's own sync is not counted)
    assert os.path.getsize(st["active_segment"]) > st["written_offset"] + 2048  # zero-filled ahead
    wal.abort()  # a crash: the tail after the records is zeros
    state = reopen(tmp_path)
    assert state.counter == c and state.torn_bytes == 0


@pytest.mark.parametrize("op", ["fdatasync", "pwrite"])
async def test_a_failed_write_or_sync_on_the_loop_is_fatal_and_never_acknowledges(tmp_path, op):
    """The compiled write and sync of a lone client's batch on the loop: a failed ``pwrite`` or
    ``fdatasync`` makes the log fatal, names the operation and the segment, and the callback
    never runs."""
    fatal = asyncio.get_running_loop().create_future()
    wal = make(tmp_path, "auto", on_fatal=lambda exc: fatal.set_result(exc))
    wal.open()
    wal.start(asyncio.get_running_loop())
    c = await alone_for_lone_batches(wal)
    io_ = wal._commit.io
    # the segment's descriptor now refers to /dev/null (writes succeed, fdatasync fails: EINVAL)
    # or to the segment opened read-only (pwrite fails: EBADF)
    fd = os.open(os.devnull, os.O_WRONLY) if op == "fdatasync" else os.open(io_.seg_path, os.O_RDONLY)
    os.dup2(fd, io_._fd)
    os.close(fd)
    acked: list[int] = []
    grant(wal, "alone", c + 1)
    wal.when_durable(lambda: acked.append(c + 1))
    wal.poll()
    exc = await asyncio.wait_for(fatal, 10)
    assert isinstance(exc, OSError) and exc.errno == (errno.EINVAL if op == "fdatasync" else errno.EBADF)
    assert f"WAL {op} failed on {io_.seg_path}" in str(exc), exc
    await asyncio.sleep(0)
    assert acked == [] and wal.stats()["fsyncs"] >= LONE_BATCHES
    with pytest.raises(WalFatal):
        grant(wal, "alone", c + 2)
    wal.abort()


async def test_a_clean_close_trims_the_preallocated_space(tmp_path, writer):
    wal, _ = await started(tmp_path, writer, segment_bytes=4 << 20)
    grant(wal, "a", 1)
    await durable(wal)
    path = wal.stats()["active_segment"]
    assert os.path.getsize(path) == 1 << 20  # one preallocation step
    await wal.close()
    assert os.path.getsize(path) == wal.stats()["written_offset"]


async def test_torn_final_batch_with_a_hole(tmp_path, writer):
    """The pages of the last (unacknowledged) batch written out of order: a zeroed
    record in its middle followed by the rest of that batch is still a torn tail."""
    wal, _ = await started(tmp_path, writer)
    await write_batches(wal, 3, per_batch=2)
    off = wal.stats()["written_offset"]
    for c in range(100, 110):  # one final batch of 10 records
        grant(wal, "big", c)
    await durable(wal)
    await wal.close()
    seg = last_segment(tmp_path)
    with open(seg, "r+b") as f:
        f.seek(off + 40)
        f.write(b"\x00" * 60)
    st = reopen(tmp_path)
    assert st.counter == 6 and st.torn_bytes > 0


async def test_mid_log_corruption_refused(tmp_path, writer):
    await _log_some(tmp_path, writer)
    seg = last_segment(tmp_path)
    with open(seg, "r+b") as f:
        f.seek(F.SEG_HEADER.size + 12)  # inside the first record's body
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(WalCorruption) as ei:
        reopen(tmp_path)
    e = ei.value
    assert e.path == seg and e.offset == F.SEG_HEADER.size and e.lsn == 1
    assert "mid-log corruption" in str(e) and seg in str(e) and "offset 24" in str(e) and "LSN 1" in str(e)
    # the operator may accept the loss explicitly
    st = make(tmp_path)
    state = st.open(repair=True)
    st.abort()
    assert state.records_replayed == 0 and state.torn_bytes > 0


async def test_corruption_in_non_last_segment_refused(tmp_path, writer):
    wal, _ = await started(tmp_path, writer, segment_bytes=200)
    await write_batches(wal, 10, per_batch=3)
    await wal.close()
    segs = segments(tmp_path)
    assert len(segs) >= 3
    path = os.path.join(str(tmp_path), segs[0])
    os.truncate(path, os.path.getsize(path) - 3)
    with pytest.raises(WalCorruption, match="non-last segment"):
        reopen(tmp_path)


async def test_bad_segment_header(tmp_path, writer):
    await _log_some(tmp_path, writer)
    seg = last_segment(tmp_path)
    with open(seg, "r+b") as f:
        f.write(b"NOTAWAL!")
    with pytest.raises(WalCorruption, match="bad segment header"):
        reopen(tmp_path)


async def test_missing_segment_refused(tmp_path, writer):
    wal, _ = await started(tmp_path, writer, segment_bytes=200)
    await write_batches(wal, 10, per_batch=3)
    await wal.close()
    segs = segments(tmp_path)
    os.unlink(os.path.join(str(tmp_path), segs[1]))
    with pytest.raises(WalCorruption, match="previous one ends"):
        reopen(tmp_path)
    os.unlink(os.path.join(str(tmp_path), segs[0]))
    with pytest.raises(WalCorruption, match="LSN 1"):
        reopen(tmp_path)


async def test_zero_filled_empty_segment(tmp_path, writer):
    n = await _log_some(tmp_path, writer)
    path = os.path.join(str(tmp_path), F.seg_name(n + 1))
    with open(path, "wb") as f:
        f.write(b"\x00" * 8192)  # created + preallocated, header never written
    st = reopen(tmp_path)
    assert st.counter == n and st.torn_bytes == 8192


# -- rotation, snapshots, compaction ---------------------------------------------------------
def model_state(holders: dict, epoch: int, counter: int):
    return lambda: (epoch, counter, [HolderRecord(*h) for h in holders.values()])


async def test_rotation_and_snapshot_deletes_covered_segments(tmp_path, writer):
    wal, _ = await started(tmp_path, writer, segment_bytes=300, keep_snapshots=1)
    holders = {}
    c = 0
    for _ in range(12):
        for _ in range(3):
            c += 1
            name = f"l{c % 5}"
            grant(wal, name, c)
            holders[name] = (name, tok(c), b"o", 10_000, 0, "c1", None, 0)
        await durable(wal)
    nseg = len(segments(tmp_path))
    assert nseg >= 4 and wal.stats()["segments"] == nseg
    assert wal.maybe_snapshot(model_state(holders, 1, c)) is False  # not due yet
    assert wal.maybe_snapshot(model_state(holders, 1, c), force=True) is True
    await wal.wait_snapshot()
    assert wal.stats()["snapshot_lsn"] == c
    assert segments(tmp_path) == [os.path.basename(wal.stats()["active_segment"])]
    assert os.listdir(tmp_path).count(F.snap_name(c)) == 1
    with pytest.raises(WalCompacted):
        list(wal.read_from(1))
    grant(wal, "after", c + 1)
    wal.log_release("l1", tok(c - 3 if (c - 3) % 5 == 1 else 0))
    await wal.close()
    st = reopen(tmp_path)
    assert st.snapshot_lsn == c and st.counter == c + 1
    expect = {h[0]: h[:7] for h in holders.values()}
    got = {h.name: tuple(h[:7]) for h in st.holders}
    assert got.pop("after")[1] == tok(c + 1)
    assert got == expect


async def test_snapshot_every_triggers(tmp_path, writer):
    wal, _ = await started(tmp_path, writer, snapshot_every=10)
    calls = []

    def get_state():
        calls.append(1)
        return (1, 9, [])

    for c in range(1, 10):
        grant(wal, "a", c)
        assert wal.maybe_snapshot(get_state) is False
    wal.log_release("a", tok(9))
    assert wal.maybe_snapshot(get_state) is True
    assert wal.maybe_snapshot(get_state) is False  # one at a time
    await wal.wait_snapshot()
    assert calls == [1] and wal.stats()["snapshot_lsn"] == 10
    await wal.close()
    st = reopen(tmp_path)
    assert st.snapshot_lsn == 10 and st.records_replayed == 0 and st.holders == []


async def test_corrupt_newest_snapshot_falls_back(tmp_path, writer, caplog):
    wal, _ = await started(tmp_path, writer, segment_bytes=200, keep_snapshots=2)
    h = {}
    c = 0
    for _round in range(3):
        for _ in range(4):
            c += 1
            grant(wal, f"l{c % 3}", c)
            h[f"l{c % 3}"] = (f"l{c % 3}", tok(c), b"o", 10_000, 0, "c1", None, 0)
            await durable(wal)
        wal.maybe_snapshot(model_state(h, 1, c), force=True)
        await wal.wait_snapshot()
    await wal.close()
    snaps = sorted(f for f in os.listdir(tmp_path) if f.startswith("snap-"))
    assert len(snaps) == 2
    newest = os.path.join(str(tmp_path), snaps[-1])
    with open(newest, "r+b") as f:
        f.seek(60)
        f.write(b"\x99\x99")
    with caplog.at_level(logging.ERROR, logger="fastlock.wal"):
        st = reopen(tmp_path)
    assert st.snapshot_lsn == 8 and st.counter == 12
    assert {x.name: x.token for x in st.holders} == {k: v[1] for k, v in h.items()}
    assert "falling back" in caplog.text and "CRC" in caplog.text
    # with the older snapshot gone too, the compacted log cannot be replayed: clear error
    os.unlink(os.path.join(str(tmp_path), snaps[0]))
    with pytest.raises(WalCorruption, match="compacted"):
        reopen(tmp_path)


async def test_snapshot_lsn_beyond_lost_tail(tmp_path, writer):
    """interval mode: a snapshot newer than the records that reached the disk."""
    wal, _ = await started(tmp_path, writer, fsync="interval", fsync_interval_ms=3_600_000,
                           reserve_block=1000, keep_snapshots=1)
    for c in range(1, 6):
        grant(wal, "a", c)
        await durable(wal)
    wal.maybe_snapshot(lambda: (1, 5, [HolderRecord("a", tok(5), b"o", 10_000, 0, None, None, 0)]), force=True)
    await wal.wait_snapshot()
    _crash_to_durable(wal)  # only the reservation batch survives in the segment
    st = reopen(tmp_path)
    assert st.next_lsn == 7 and st.snapshot_lsn == 6 and st.counter >= 5
    wal, st = await started(tmp_path, writer)
    grant(wal, "b", 1001)
    await wal.close()
    st = reopen(tmp_path)
    assert st.next_lsn == 8 and {h.name for h in st.holders} == {"a", "b"}


async def test_failed_snapshot_is_not_fatal(tmp_path, writer, monkeypatch, caplog):
    wal, _ = await started(tmp_path, writer)
    grant(wal, "a", 1)

    def boom(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snapshot_module, "snapshot_parts", boom)
    wal.maybe_snapshot(lambda: (1, 1, []), force=True)
    await wal.wait_snapshot()
    assert "snapshot at LSN 1 failed" in caplog.text
    assert wal.stats()["snapshot_lsn"] == 0
    grant(wal, "b", 2)
    await durable(wal)
    await wal.close()


# -- fatal I/O errors ---------------------------------------------------------------------------
async def one_durable_grant(tmp_path, writer) -> tuple[WriteAheadLog, asyncio.Future]:
    """A started log holding one durable grant, and the future its ``on_fatal`` sets."""
    fatal = asyncio.get_running_loop().create_future()
    wal = make(tmp_path, writer, on_fatal=lambda exc: fatal.set_result(exc))
    wal.open()
    wal.start(asyncio.get_running_loop())
    grant(wal, "a", 1)
    await durable(wal)
    return wal, fatal


@pytest.mark.parametrize("fn", ["datasync", "pwrite_all"])
async def test_failed_io_is_fatal_and_never_acknowledges(tmp_path, writer, monkeypatch, fn):
    wal, fatal = await one_durable_grant(tmp_path, writer)
    acked = []

    def broken(*a):
        raise OSError(errno.EIO, "Input/output error")

    patch_disk(wal, monkeypatch, **{fn: broken})
    grant(wal, "a", 2)
    wal.when_durable(lambda: acked.append(2))
    exc = await fatal
    assert isinstance(exc, OSError) and exc.errno == errno.EIO
    op = {"datasync": "fdatasync", "pwrite_all": "pwrite"}[fn]
    assert f"WAL {op} failed on {wal._commit.io.seg_path}: Input/output error" in str(exc), exc
    monkeypatch.undo()  # even if the disk "recovers", nothing more is acknowledged
    await asyncio.sleep(0)
    assert acked == []
    with pytest.raises(WalFatal):
        grant(wal, "a", 3)
    with pytest.raises(WalFatal):
        wal.when_durable(lambda: acked.append(3))
    with pytest.raises(WalFatal):
        await wal.close()
    assert acked == []


@pytest.mark.parametrize("writer", ["thread", "inline"])
async def test_a_full_disk_names_the_operation_and_the_segment_file(tmp_path, writer, caplog):
    """The compiled write on the loop and on the writer thread: the segment's descriptor
    turned into ``/dev/full`` (every write ENOSPC) -- the fatal error and the CRITICAL
    line name ``pwrite``, the segment file and the errno's text."""
    wal, fatal = await one_durable_grant(tmp_path, writer)
    io = wal._commit.io
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        os.dup2(full, io._fd)
    finally:
        os.close(full)
    grant(wal, "a", 2)
    exc = await asyncio.wait_for(fatal, 10)
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    told = f"WAL pwrite failed on {io.seg_path}: {os.strerror(errno.ENOSPC)}"
    assert told in str(exc), exc
    assert any(r.levelno == logging.CRITICAL and told in r.getMessage() for r in caplog.records), caplog.text
    wal.abort()


@pytest.mark.parametrize("writer", ["thread", "auto"])
async def test_a_full_disk_under_the_page_cache_write_cuts_the_batch_and_is_fatal(tmp_path, writer, caplog):
    """``fsync="never"``: a batch goes to the page cache by the compiled write on the loop
    (``SegmentFile.write_cached``); its descriptor turned into ``/dev/full`` -- the fatal
    error names ``pwrite``, the segment file and the errno's text, nothing is acknowledged,
    and the segment keeps only the records before the batch."""
    loop = asyncio.get_running_loop()
    fatal = loop.create_future()
    wal = make(tmp_path, writer, fsync="never", on_fatal=lambda exc: fatal.set_result(exc))
    wal.open()
    wal.start(loop)
    grant(wal, "a", 1)
    await durable(wal)
    io = wal._commit.io
    size, written = io.seg_size, io.bytes
    full = os.open("/dev/full", os.O_WRONLY)
    saved = os.dup(io._fd)
    try:
        os.dup2(full, io._fd)
        acked = []
        grant(wal, "a", 2)
        wal.when_durable(lambda: acked.append(2))
        exc = await asyncio.wait_for(fatal, 10)
    finally:
        os.dup2(saved, io._fd)
        os.close(saved)
        os.close(full)
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    assert f"WAL pwrite failed on {io.seg_path}: {os.strerror(errno.ENOSPC)}" in str(exc), exc
    await asyncio.sleep(0)
    assert acked == [] and (io.seg_size, io.bytes) == (size, written)
    wal.abort()
    assert [h.token for h in reopen(tmp_path).holders] == [tok(1)]


@pytest.mark.parametrize("owed", [True, False])
async def test_callbacks_of_a_written_batch_end_as_one_batch(tmp_path, writer, owed):
    """``GroupCommit.batch_end``: the ``when_durable`` callbacks one written batch releases run
    with the owner's ``in_batch_end`` set, and its ``after_batch`` runs once after the last of
    them when one left it owed (``batch_end_owed``), and not at all otherwise."""

    class Owner:
        in_batch_end = False
        batch_end_owed = False

        def __init__(self) -> None:
            self.seen: list = []

        def after_batch(self) -> None:
            self.seen.append(("after_batch", self.in_batch_end))
            self.batch_end_owed = False

    owner = Owner()
    wal, _ = await started(tmp_path, writer, fsync="never")
    wal.group_commit.batch_end = owner

    def cb(tag, owe=False):
        def f():
            owner.seen.append((tag, owner.in_batch_end))
            if owe:
                owner.batch_end_owed = True
        return f

    for i in range(1, 4):
        grant(wal, "x", i)
        wal.when_durable(cb(f"r{i}", owe=owed and i == 2))
    await durable(wal)
    assert owner.seen == [("r1", True), ("r2", True), ("r3", True)] + ([("after_batch", False)] if owed else [])
    assert not owner.in_batch_end and not owner.batch_end_owed
    await wal.close()


async def test_default_on_fatal_logs_critical(tmp_path, monkeypatch, caplog):
    loop = asyncio.get_running_loop()
    handled = loop.create_future()
    loop.set_exception_handler(lambda lp, ctx: handled.done() or handled.set_result(ctx))
    try:
        wal, _ = await started(tmp_path, "inline")
        patch_disk(wal, monkeypatch, datasync=lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
        grant(wal, "a", 1)
        ctx = await handled
        assert isinstance(ctx["exception"], OSError)
        assert any(r.levelno == logging.CRITICAL for r in caplog.records)
        wal.abort()
    finally:
        loop.set_exception_handler(None)


async def test_abort_with_a_batch_in_flight(tmp_path, writer):
    loop = asyncio.get_running_loop()
    fatal = []
    wal = make(tmp_path, writer, on_fatal=fatal.append)
    wal.open()
    wal.start(loop)
    grant(wal, "a", 1)
    await durable(wal)
    grant(wal, "a", 2)
    called = []
    wal.when_durable(lambda: called.append(1))
    await asyncio.sleep(0)  # batch handed to the writer thread (inline: already done)
    wal.abort()
    for _ in range(3):
        await asyncio.sleep(0)
    assert fatal == []
    assert called == ([1] if writer == "inline" else [])  # (auto: on the thread, not alone long enough)
    assert reopen(tmp_path).counter >= 1


# -- audit dump -----------------------------------------------------------------------------------
async def test_dump(tmp_path, writer):
    wal, _ = await started(tmp_path, writer, keep_snapshots=1, segment_bytes=100)
    grant(wal, "orders/1", 1, client="api-1", corr="req-1")
    grant(wal, "orders/2", 2, client="api-2", corr="req-2")
    await durable(wal)
    out = io.StringIO()
    assert dump(str(tmp_path), file=out) == 2  # whole history on disk: no snapshot needed
    assert [ln.split()[0] for ln in out.getvalue().splitlines()] == [f"{1:020d}", f"{2:020d}"]
    wal.log_release("orders/3", tok(99))  # rotates: the first segment becomes compactable
    await durable(wal)
    wal.maybe_snapshot(lambda: (1, 2, [
        HolderRecord("orders/1", tok(1), b"o", 10_000, 0, "api-1", "req-1", 1_700_000_000_000),
        HolderRecord("orders/2", tok(2), b"o", 10_000, 0, "api-2", "req-2", 0)]), force=True)
    await wal.wait_snapshot()
    assert len(segments(tmp_path)) == 1
    wal.log_release("orders/1", tok(1))
    wal.log_extend("orders/2", tok(2), 20_000)
    wal.log_epoch(2)
    grant(wal, "orders/1", 3, epoch=2, client="api-3", corr="req-3")
    await wal.close()
    out = io.StringIO()
    n = dump(str(tmp_path), file=out)
    lines = out.getvalue().splitlines()
    assert n == len(lines) == 7
    assert lines[0].startswith("00000000000000000003 - snapshot-state")
    assert "snapshot-holder lock=orders/1" in lines[1] and "2023-11-14T22:13:20.000Z" in lines[1]
    assert "token=1099511627777 (1/1)" in lines[1] and "client=api-1 corr=req-1 ttl_ms=10000" in lines[1]
    assert lines[3].split()[0] == "00000000000000000004" and " release lock=orders/1 " in lines[3]
    assert " extend lock=orders/2 " in lines[4] and "ttl_ms=20000" in lines[4]
    assert " epoch " in lines[5] and "epoch=2" in lines[5]
    assert " grant lock=orders/1 token=2199023255555 (2/3) client=api-3 corr=req-3" in lines[6]
    # the dump shows a short tag of the stored owner hash, never the stored value itself
    tag = hashlib.blake2b(b"o", digest_size=4, person=b"fastlock-dump").hexdigest()
    assert f"owner={tag} lock_delay_ms=" in lines[1]
    assert "owner=6f " not in out.getvalue() and "owner=o " not in out.getvalue()
    assert lines[6].split()[1].endswith("Z")
    out = io.StringIO()
    dump(str(tmp_path), lock="orders/1", file=out)
    kinds = [ln.split()[2] for ln in out.getvalue().splitlines()]
    assert kinds == ["snapshot-holder", "release", "grant"]


FORGED = "x token=1 (0/1) client=admin\n00000000000000000099 2025-01-01T00:00:00.000Z revoke lock=y"


async def test_dump_quotes_peer_chosen_text_so_it_cannot_forge_a_line_or_field(tmp_path, capsys):
    wal, _ = await started(tmp_path)
    grant(wal, FORGED, 1, client="api 1\u2028", corr="r\x1b[2J")
    grant(wal, "plain/name", 2, client="api-1", corr="-")
    wal.log_revoke("plain/name", tok(2), "admin", 'say "why"\nnext')
    await wal.close()
    out = io.StringIO()
    assert dump(str(tmp_path), file=out) == 3
    text = out.getvalue()
    lines = text.splitlines()
    assert len(lines) == 3 and text.isascii()
    assert f"lock={json.dumps(FORGED)} token=" in lines[0]
    assert 'client="api 1\\u2028" corr="r\\u001b[2J" ttl_ms=10000' in lines[0]
    assert " grant lock=plain/name " in lines[1] and 'client=api-1 corr="-" ' in lines[1]  # "-" is "none"
    assert lines[2].endswith('by=admin reason="say \\"why\\"\\nnext"')
    out = io.StringIO()
    assert dump(str(tmp_path), file=out, output="json") == 3
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["lsn"], r["type"], r["lock"], r["token"]) for r in records] == [
        (1, "grant", FORGED, tok(1)), (2, "grant", "plain/name", tok(2)), (3, "revoke", "plain/name", tok(2))]
    assert (records[0]["client"], records[0]["corr"], records[0]["ttl_ms"]) == ("api 1\u2028", "r\x1b[2J", 10_000)
    assert records[0]["shared"] is False and records[0]["time"].endswith("Z")
    assert (records[2]["by"], records[2]["reason"], records[2]["client"]) == ("admin", 'say "why"\nnext', None)
    capsys.readouterr()
    assert cli_main(["wal", "dump", "-o", "json", "--lock", "plain/name", str(tmp_path)]) == 0
    assert [json.loads(line)["type"] for line in capsys.readouterr().out.splitlines()] == ["grant", "revoke"]


async def test_dump_is_read_only_and_reports_torn_tail(tmp_path, writer):
    n = await _log_some(tmp_path, writer)
    seg = last_segment(tmp_path)
    with open(seg, "ab") as f:
        f.write(b"\x01" * 100)
    size = os.path.getsize(seg)
    out = io.StringIO()
    assert dump(str(tmp_path), file=out) == n
    assert "torn tail" in out.getvalue().splitlines()[-1]
    assert os.path.getsize(seg) == size
    assert cli_main(["wal", "dump", str(tmp_path)]) == 0


# -- arguments -----------------------------------------------------------------------------------
def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        WriteAheadLog(str(tmp_path), fsync="sometimes")
    with pytest.raises(ValueError):
        WriteAheadLog(str(tmp_path), segment_bytes=0)
    wal = WriteAheadLog(str(tmp_path))
    with pytest.raises(RuntimeError):
        wal.log_release("a", 1)
    wal.open()
    with pytest.raises(ValueError):
        wal.log_grant("a", 1, b"x" * (W.MAX_RECORD_BYTES + 1), 1, 0, None, None)
    with pytest.raises(TypeError):
        wal.log_grant("a", 1, object(), 1, 0, None, None)
    assert wal.stats()["last_lsn"] == 0  # nothing half-logged
    wal.abort()


async def test_flush_now_writes_inline_in_relaxed_modes_only(tmp_path):
    """flush_now(): relaxed modes write and acknowledge in the calling turn; `always` defers to fsync."""
    from fastlock.wal import WriteAheadLog

    for mode, expect in (("never", True), ("interval", True), ("always", False)):
        wal = WriteAheadLog(str(tmp_path / mode), fsync=mode, fsync_interval_ms=60_000)
        wal.open()
        wal.start(asyncio.get_running_loop())
        try:
            wal.log_grant("a", 1, b"o" * 16, 1000, 0, None, None)  # first grant: reservation -> fsync batch
            done = asyncio.Event()
            wal.when_durable(done.set)
            await asyncio.wait_for(done.wait(), 5)
            wal.log_release("a", 1)
            wal.log_grant("a", 2, b"p" * 16, 1000, 0, None, None)
            assert wal.flush_now() is expect
            if expect:
                assert wal.stats()["written_lsn"] == wal.stats()["last_lsn"]
        finally:
            await wal.close()


async def test_always_mode_fsyncs_only_batches_someone_waits_for(tmp_path):
    """A release-only batch is written, not fsynced; the next grant's single fsync covers both."""
    from fastlock.wal import WriteAheadLog

    wal = WriteAheadLog(str(tmp_path / "w"), fsync="always", fsync_interval_ms=60_000)
    wal.open()
    wal.start(asyncio.get_running_loop())
    try:
        wal.log_grant("a", 1, b"o" * 16, 1000, 0, None, None)
        done = asyncio.Event()
        wal.when_durable(done.set)
        await asyncio.wait_for(done.wait(), 5)
        before = wal.stats()
        wal.log_release("a", 1)
        await wal_written(wal, before["last_lsn"] + 1)
        after_release = wal.stats()
        assert after_release["fsyncs"] == before["fsyncs"]  # nobody waited: no fsync
        assert after_release["durable_lsn"] < after_release["written_lsn"]
        wal.log_grant("a", 2, b"p" * 16, 1000, 0, None, None)
        done = asyncio.Event()
        wal.when_durable(done.set)
        await asyncio.wait_for(done.wait(), 5)
        final = wal.stats()
        assert final["fsyncs"] == before["fsyncs"] + 1
        assert final["durable_lsn"] == final["last_lsn"]
        # a waiter on records already written (unsynced) still gets its fsync
        wal.log_release("a", 2)
        await wal_written(wal, final["last_lsn"] + 1)
        done = asyncio.Event()
        wal.when_durable(done.set)
        await asyncio.wait_for(done.wait(), 5)
        assert wal.stats()["durable_lsn"] == wal.stats()["last_lsn"]
    finally:
        await wal.close()


async def test_when_durable_later_rides_on_a_sync_asked_for_by_others(tmp_path):
    """``always``: a when_durable_later callback asks for no fsync of its own; it runs after the
    next sync a when_durable waiter (or request_sync) asks for, in LSN order with the others."""
    from fastlock.wal import WriteAheadLog

    wal = WriteAheadLog(str(tmp_path / "w"), fsync="always", fsync_interval_ms=60_000)
    wal.open()
    wal.start(asyncio.get_running_loop())
    try:
        ran: list[str] = []
        wal.log_release("a", 1)
        later = asyncio.Event()
        wal.when_durable_later(lambda: (ran.append("later"), later.set()))
        before = wal.stats()
        await wal_written(wal, before["last_lsn"])
        assert wal.stats()["fsyncs"] == before["fsyncs"] and not ran  # written, not synced, not run
        wal.log_grant("a", 2, b"o" * 16, 1000, 0, None, None)
        done = asyncio.Event()
        wal.when_durable(lambda: (ran.append("grant"), done.set()))
        await asyncio.wait_for(done.wait(), 5)
        assert ran == ["later", "grant"] and wal.stats()["fsyncs"] == before["fsyncs"] + 1
        # with nothing else to sync for, request_sync does it
        wal.log_release("a", 2)
        later.clear()
        wal.when_durable_later(lambda: (ran.append("later"), later.set()))
        await wal_written(wal, wal.stats()["last_lsn"])
        assert ran == ["later", "grant"]
        wal.request_sync()
        await asyncio.wait_for(later.wait(), 5)
        assert wal.stats()["durable_lsn"] == wal.stats()["last_lsn"]
    finally:
        await wal.close()


async def wal_written(wal, lsn: int, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while wal.stats()["written_lsn"] < lsn:
        assert loop.time() < deadline, "batch never written"
        await asyncio.sleep(0)


async def test_a_snapshot_keeps_a_shard_groups_imports_and_recovery_adds_the_records_after_it(tmp_path):
    # the slots a move imported and not yet taken ride in the snapshot (the SLOTS_ADOPTED records it covers are
    # not replayed); recovery merges every SLOTS_ADOPTED record after it, an owner known already keeping its place
    from fastlock.wal.records import ImportedSlots
    from fastlock.wal.snapshot import SnapshotState

    wal, _ = await started(tmp_path, snapshot_every=1000)
    wal.log_slots_adopted(5, 6, tok(3), 1, [["n", [b"a", b"b"]]])
    kept = ImportedSlots([5, 6], {"n": [b"a", b"b"]})
    assert wal.maybe_snapshot(lambda: SnapshotState(1, 3, [], None, kept), force=True)
    await wal.wait_snapshot()
    wal.log_slots_adopted(9, 9, tok(3), 1, [["m", [b"c"]], ["n", [b"b", b"d"]]])
    await durable(wal)
    await wal.close()
    st = reopen(tmp_path)
    assert st.snapshot_lsn == 1 and st.records_replayed == 1
    assert st.imports == ImportedSlots([5, 6, 9], {"n": [b"a", b"b", b"d"], "m": [b"c"]})


def test_a_snapshot_without_imports_reads_as_none_and_bad_imports_are_refused(tmp_path):
    from fastlock.wal.records import ImportedSlots
    from fastlock.wal.snapshot import encode_snapshot, load_snapshot

    holder = HolderRecord("x", tok(1), b"o" * 16, 1000, 0, None, None, 0, False, 0)
    plain = tmp_path / "plain.snap"
    plain.write_bytes(encode_snapshot(1, 1, 1, [holder]))  # the format before imports: holders only
    assert load_snapshot(str(plain)).imports is None
    both = tmp_path / "both.snap"
    both.write_bytes(encode_snapshot(1, 1, 1, [holder], None, ImportedSlots([7], {"q": [b"w"]})))
    back = load_snapshot(str(both))
    assert back.imports == ImportedSlots([7], {"q": [b"w"]}) and len(back.keys) == 0 and back.holders == [holder]
    for bad in ([[70_000], []], [[1], [["q", ["not bytes"]]]], [[1], [["q", [b"a"]], ["q", [b"b"]]]], [1, 2, 3]):
        with pytest.raises(ValueError):
            ImportedSlots.from_list(bad)
    raw = tmp_path / "raw.snap"  # a whole file (CRC right) whose imports are not of their shape
    body = msgpack.packb([]) + msgpack.packb([]) + msgpack.packb([[70_000], []])
    head = snapshot_module.SNAP_HEADER.pack(F.SNAP_MAGIC, F.FORMAT_VERSION, 1, 1, 1, len(body))
    raw.write_bytes(head + body + F.U32.pack(F.crc32(body, F.crc32(head))))
    with pytest.raises(WalCorruption):
        load_snapshot(str(raw))


async def test_a_waiter_joined_by_later_records_runs_once_after_their_sync(tmp_path, monkeypatch):
    """``GroupCommit.pending_waiter`` / ``join_waiter``: while the records of the last
    ``when_durable`` waiter are still pending, a caller may join it instead of keeping a waiter of
    its own; the callback then runs once, after the fsync of the batch holding the joined
    records too, never before.  A waiter whose records were handed over, or that asks for no
    sync (``when_durable_later``), is not offered; join_waiter without one raises."""
    wal, _ = await started(tmp_path, "thread")
    commit = wal.group_commit
    gate, entered = threading.Event(), threading.Event()

    def datasync(fd):
        entered.set()
        gate.wait(10)
        return COMPILED_DISK.datasync(fd)

    patch_disk(wal, monkeypatch, datasync=datasync)
    loop = asyncio.get_running_loop()
    assert commit.pending_waiter() is None  # no waiter
    with pytest.raises(RuntimeError):
        commit.join_waiter()
    runs: list[int] = []
    done = loop.create_future()

    def callback():
        runs.append(wal.stats()["durable_lsn"])
        done.set_result(None)

    grant(wal, "a", 1)
    wal.when_durable(callback)
    assert commit.pending_waiter() is callback
    for c in (2, 3):  # two later batch ends' records join it
        grant(wal, f"b{c}", c)
        assert commit.pending_waiter() is callback
        commit.join_waiter()
    await asyncio.sleep(0)  # the turn ends: the batch (1..3) goes to the thread, which waits at the gate
    await loop.run_in_executor(None, entered.wait, 10)
    assert commit.pending_waiter() is None  # handed over: a later record cannot join it
    grant(wal, "c", 4)
    assert commit.pending_waiter() is None
    with pytest.raises(RuntimeError):
        commit.join_waiter()
    assert runs == []
    gate.set()
    await done
    assert runs == [3]  # once, after the sync of all three records
    wal.when_durable_later(lambda: None)  # asks for no sync: not offered
    assert commit.pending_waiter() is None
    await durable(wal)
    assert runs == [3]
    await wal.close()
    assert reopen(tmp_path).counter == 4


async def test_each_join_counts_as_a_waiter_for_the_lone_batches(tmp_path):
    """The auto writer syncs a batch on the loop only when at most one ``when_durable`` waits on
    it: a waiter joined once (``join_waiter``) stands for two, so its batch goes to the thread
    and the lone run starts again."""
    wal, _ = await started(tmp_path, "auto")
    commit = wal.group_commit
    c = await alone_for_lone_batches(wal)
    assert wal.stats()["thread_fsyncs"] == LONE_BATCHES - 1  # the last one on the loop
    before = wal.stats()["thread_fsyncs"]
    c += 1
    grant(wal, "one", c)
    fut = asyncio.get_running_loop().create_future()
    wal.when_durable(lambda: fut.set_result(None))
    c += 1
    grant(wal, "two", c)
    commit.join_waiter()
    await fut
    assert wal.stats()["thread_fsyncs"] == before + 1  # two waiters: on the thread
    await alone_for_lone_batches(wal, c)
    assert wal.stats()["thread_fsyncs"] == before + LONE_BATCHES  # alone again: the thread, then the loop
    wal.abort()
