"""Property tests of fastlock.wal (hypothesis), on real files.

1. Random grant/release/expire/extend/epoch sequences over a few names, with
   snapshots, batch boundaries and restarts at random points: what the log
   recovers equals a plain dict model of the replay rules.
2. A log cut at any byte recovers exactly the complete records before the cut.
3. A flipped byte is either refused (WalCorruption) or, only inside the final
   (never acknowledged) batch, cut as a torn tail -- never silently skipped.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastlock.wal import HolderRecord, WalCorruption, WriteAheadLog
from fastlock.wal import format as F

NAMES = ["a", "b", "c"]
OWNERS = [b"o1", b"o2"]

ops = st.one_of(
    st.tuples(st.just("grant"), st.sampled_from(NAMES), st.sampled_from(OWNERS), st.integers(1, 100_000)),
    st.tuples(st.just("release"), st.sampled_from(NAMES), st.booleans()),
    st.tuples(st.just("expire"), st.sampled_from(NAMES), st.booleans()),
    st.tuples(st.just("extend"), st.sampled_from(NAMES), st.booleans(), st.integers(1, 100_000)),
    st.tuples(st.just("epoch")),
    st.tuples(st.just("snapshot")),
    st.tuples(st.just("turn")),
    st.tuples(st.just("reopen")),
)

# WAL_PROP_EXAMPLES=600 for a longer run
EXAMPLES = int(os.environ.get("WAL_PROP_EXAMPLES", "60"))
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class Model:
    """The replay rules, written independently of the implementation."""

    def __init__(self):
        self.holders: dict[str, tuple] = {}  # name -> (token, owner, ttl_ms, client, corr)
        self.epoch = 1
        self.counter = 0  # highest counter issued
        self.issued: list[int] = []

    def state(self):
        return (self.epoch, self.counter,
                [HolderRecord(n, t, o, ttl, 0, cl, co, 0) for n, (t, o, ttl, cl, co) in self.holders.items()])


def token_for(model: Model, name: str, current: bool) -> int:
    h = model.holders.get(name)
    if current and h is not None:
        return h[0]
    stale = [t for t in model.issued if h is None or t != h[0]]
    return stale[-1] if stale else 12345


def recovered_view(state):
    return {h.name: (h.token, h.owner, h.ttl_ms, h.client_name, h.correlation_id) for h in state.holders}


async def run_sequence(d, seq, mode, writer, segment_bytes, keep_snapshots):
    loop = asyncio.get_running_loop()
    model = Model()
    kw = dict(fsync=mode, writer=writer, segment_bytes=segment_bytes, keep_snapshots=keep_snapshots,
              snapshot_every=7, reserve_block=5, fsync_interval_ms=3_600_000)

    def check(state):
        assert recovered_view(state) == model.holders
        assert state.epoch == model.epoch
        if mode == "always":
            assert state.counter == model.counter
        else:
            assert model.counter <= state.counter <= model.counter + 5 + 1

    def fresh():
        wal = WriteAheadLog(d, **kw)
        state = wal.open()
        wal.start(loop)
        return wal, state

    wal, state = fresh()
    wal.log_epoch(1)
    for op in seq:
        kind = op[0]
        if kind == "grant":
            _, name, owner, ttl = op
            model.counter += 1
            t = (model.epoch << 40) | model.counter
            wal.log_grant(name, t, owner, ttl, 0, "cl", f"r{model.counter}")
            model.holders[name] = (t, owner, ttl, "cl", f"r{model.counter}")
            model.issued.append(t)
        elif kind in ("release", "expire"):
            _, name, current = op
            t = token_for(model, name, current)
            (wal.log_release if kind == "release" else wal.log_expire)(name, t)
            if name in model.holders and model.holders[name][0] == t:
                del model.holders[name]
        elif kind == "extend":
            _, name, current, ttl = op
            t = token_for(model, name, current)
            wal.log_extend(name, t, ttl)
            h = model.holders.get(name)
            if h is not None and h[0] == t:
                model.holders[name] = (t, h[1], ttl, h[3], h[4])
        elif kind == "epoch":
            model.epoch += 1
            wal.log_epoch(model.epoch)
        elif kind == "snapshot":
            wal.maybe_snapshot(model.state, force=True)
            await wal.wait_snapshot()
        elif kind == "turn":
            fut = loop.create_future()
            wal.when_durable(functools.partial(fut.set_result, None))
            await fut
        elif kind == "reopen":
            await wal.close()
            wal, state = fresh()
            check(state)
            model.counter = max(model.counter, state.counter)  # as the server resumes
        wal.maybe_snapshot(model.state)
    await wal.close()
    wal, state = fresh()
    check(state)
    await wal.close()
    return model


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(
    seq=st.lists(ops, max_size=50),
    mode=st.sampled_from(["always", "interval", "never"]),
    writer=st.sampled_from(["thread", "inline"]),
    segment_bytes=st.sampled_from([120, 400, 1 << 20]),
    keep_snapshots=st.sampled_from([1, 2]),
)
def test_recovery_matches_model(seq, mode, writer, segment_bytes, keep_snapshots):
    d = tempfile.mkdtemp(prefix="walprop-")
    try:
        asyncio.run(run_sequence(d, seq, mode, writer, segment_bytes, keep_snapshots))
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def _write_batches(d, batches):
    """Write ``batches`` (list of record counts) as separate batches into one segment.

    Returns (segment path, frame boundaries [(start, end)], start offset of each batch)."""
    loop = asyncio.get_running_loop()
    wal = WriteAheadLog(d, writer="inline")
    wal.open()
    wal.start(loop)
    c = 0
    batch_starts = []
    for n in batches:
        batch_starts.append(wal.stats()["written_offset"])
        for _ in range(n):
            c += 1
            wal.log_grant(f"n{c % 3}", (1 << 40) | c, b"owner", 1000 + c, 0, "client", None)
        fut = loop.create_future()
        wal.when_durable(functools.partial(fut.set_result, None))
        await fut
    path = wal.stats()["active_segment"]
    await wal.close()
    data = open(path, "rb").read()
    frames = []
    off = F.SEG_HEADER.size
    while off < len(data):
        _crc, lw = F.FRAME.unpack_from(data, off)
        end = off + 8 + (lw & F.LEN_MASK)
        frames.append((off, end))
        off = end
    return path, frames, batch_starts


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(batches=st.lists(st.integers(1, 6), min_size=1, max_size=6), cut=st.floats(0, 1))
def test_cut_anywhere_recovers_the_complete_prefix(batches, cut):
    d = tempfile.mkdtemp(prefix="walcut-")
    try:
        path, frames, _ = asyncio.run(_write_batches(d, batches))
        size = frames[-1][1]
        at = int(cut * size)
        os.truncate(path, at)
        wal = WriteAheadLog(d)
        state = wal.open()
        wal.abort()
        complete = sum(1 for _s, e in frames if e <= at)
        assert state.records_replayed == complete
        assert state.counter == complete
        if at >= F.SEG_HEADER.size:
            boundary = max([F.SEG_HEADER.size] + [e for _s, e in frames if e <= at])
            assert state.torn_bytes == at - boundary
    finally:
        shutil.rmtree(d, ignore_errors=True)


@settings(max_examples=EXAMPLES + 20, **SETTINGS)
@given(batches=st.lists(st.integers(1, 5), min_size=2, max_size=5), where=st.floats(0, 1),
       bit=st.integers(0, 7))
def test_flipped_byte_is_never_silently_skipped(batches, where, bit):
    d = tempfile.mkdtemp(prefix="walflip-")
    try:
        path, frames, batch_starts = asyncio.run(_write_batches(d, batches))
        size = frames[-1][1]
        p = min(int(where * size), size - 1)
        with open(path, "r+b") as f:
            f.seek(p)
            b = f.read(1)[0]
            f.seek(p)
            f.write(bytes([b ^ (1 << bit)]))
        wal = WriteAheadLog(d)
        try:
            state = wal.open()
        except WalCorruption as exc:
            assert exc.path == path and exc.offset >= 0
            return
        wal.abort()
        # accepted only as a torn final batch: every record before that batch survives
        assert p >= batch_starts[-1]
        before = sum(1 for _s, e in frames if e <= batch_starts[-1])
        assert state.records_replayed >= before and state.torn_bytes > 0
    finally:
        shutil.rmtree(d, ignore_errors=True)
