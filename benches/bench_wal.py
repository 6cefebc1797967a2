"""Benchmarks of the write-ahead log (``fastlock.wal``); a plain script, bounded runtime.

    python benches/bench_wal.py                    # everything (~30-60 s)
    python benches/bench_wal.py --compare-writers  # group commit: writer thread vs inline
    python benches/bench_wal.py --throughput       # records/s and fsyncs/s per fsync mode
    python benches/bench_wal.py --recovery         # recovery of 1M records / 100k live locks
    python benches/bench_wal.py --size             # WAL bytes per grant+release
    options: --dir DIR (default: a temp dir; use the data disk you care about),
             --duration S (per throughput run, default 1.5), --producers N (default 32),
             --repeat N (writer comparison: median of N runs, default 3),
             --uvloop, --json

Throughput runs are closed loops: N producer tasks each log one grant (after
``--work-us`` of CPU standing in for request handling), wait for
``when_durable``, and repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastlock.wal import HolderRecord, WriteAheadLog

EPOCH1 = 1 << 40


def burn(us: float) -> None:
    if us <= 0:
        return
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


async def _throughput(d, mode, writer, producers, duration, work_us, stagger=0):
    loop = asyncio.get_running_loop()
    wal = WriteAheadLog(d, fsync=mode, writer=writer, fsync_interval_ms=1000)
    wal.open()
    wal.start(loop)
    stop = False
    counter = [0]
    lat = []

    async def producer(k):
        name = f"bench/{k}"
        turns = k % stagger if stagger else 0
        while not stop:
            # staggered: producers come back in different loop turns, as requests from
            # independent connections do; each costs work_us of CPU on the loop
            for _ in range(turns):
                await asyncio.sleep(0)
            burn(work_us)
            counter[0] += 1
            t0 = time.perf_counter()
            wal.log_grant(name, EPOCH1 | counter[0], b"owner-%d" % k, 10_000, 0, "bench", None)
            fut = loop.create_future()
            wal.when_durable(lambda f=fut: f.set_result(None))
            await fut
            lat.append(time.perf_counter() - t0)

    lag = []

    async def ticker():
        # how late does a 1 ms timer fire?  (a blocked loop delays every client)
        while not stop:
            t = loop.time()
            await asyncio.sleep(0.001)
            lag.append(loop.time() - t - 0.001)

    # warm-up
    tasks = [asyncio.ensure_future(producer(k)) for k in range(producers)]
    tasks.append(asyncio.ensure_future(ticker()))
    await asyncio.sleep(0.2)
    s0 = wal.stats()
    n0 = len(lat)
    l0 = len(lag)
    t0 = time.perf_counter()
    await asyncio.sleep(duration)
    elapsed = time.perf_counter() - t0
    s1 = wal.stats()
    n1 = len(lat)
    lags = sorted(lag[l0:])
    stop = True
    await asyncio.gather(*tasks)
    await wal.close()
    window = sorted(lat[n0:n1])
    recs = s1["records"] - s0["records"]
    return {
        "mode": mode,
        "writer": writer,
        "producers": producers,
        "work_us": work_us,
        "stagger": stagger,
        "records_per_s": round(recs / elapsed),
        "fsyncs_per_s": round((s1["fsyncs"] - s0["fsyncs"]) / elapsed),
        "records_per_batch": round(recs / max(1, s1["batches"] - s0["batches"]), 1),
        "p50_us": round(window[len(window) // 2] * 1e6) if window else None,
        "p99_us": round(window[int(len(window) * 0.99)] * 1e6) if window else None,
        "timer_lag_p99_us": round(lags[int(len(lags) * 0.99)] * 1e6) if lags else None,
    }


def run_throughput(base, mode, writer, producers, duration, work_us, use_uvloop, stagger=0):
    d = tempfile.mkdtemp(dir=base, prefix=f"tp-{mode}-{writer}-")
    try:
        coro = _throughput(d, mode, writer, producers, duration, work_us, stagger)
        if use_uvloop:
            import uvloop
            return uvloop.run(coro)
        return asyncio.run(coro)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def fsync_cost(base, n=300):
    fd, path = tempfile.mkstemp(dir=base)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, b"x" * 64)
            os.fsync(fd)
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        os.close(fd)
        os.unlink(path)


async def _fill(d, pairs_or_grants, *, live_locks=False, snapshot=False):
    """Write a log quickly (fsync=never, 10k records per batch)."""
    loop = asyncio.get_running_loop()
    wal = WriteAheadLog(d, fsync="never")
    wal.open()
    wal.start(loop)
    c = 0
    holders = []
    for i in range(pairs_or_grants):
        c += 1
        name = f"orders/{i if live_locks else i % 10_000}"
        wal.log_grant(name, EPOCH1 | c, b"owner-%08d" % (i % 997), 10_000, 0, "client-a", f"req-{c}")
        if live_locks:
            holders.append(HolderRecord(name, EPOCH1 | c, b"owner-%08d" % (i % 997), 10_000, 0,
                                        "client-a", f"req-{c}", 0))
        else:
            wal.log_release(name, EPOCH1 | c)
        if c % 10_000 == 0:
            await asyncio.sleep(0)
    if snapshot:
        wal.maybe_snapshot(lambda: (1, c, holders), force=True)
        await wal.wait_snapshot()
    await wal.close()
    return wal.stats()


def timed_recovery(d):
    t0 = time.perf_counter()
    wal = WriteAheadLog(d)
    st = wal.open()
    dt = time.perf_counter() - t0
    wal.abort()
    return dt, st


def bench_recovery(base, out):
    res = []
    for label, n, kw in (
        ("1,000,000 records (500k grant+release pairs, 10k names)", 500_000, {}),
        ("100,000 live locks, replayed from segments", 100_000, {"live_locks": True}),
        ("100,000 live locks, from a snapshot", 100_000, {"live_locks": True, "snapshot": True}),
    ):
        d = tempfile.mkdtemp(dir=base, prefix="rec-")
        try:
            t0 = time.perf_counter()
            st = asyncio.run(_fill(d, n, **kw))
            fill = time.perf_counter() - t0
            size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
            dt, rs = timed_recovery(d)
            r = {"case": label, "recovery_s": round(dt, 3), "records_replayed": rs.records_replayed,
                 "holders": len(rs.holders), "snapshot_lsn": rs.snapshot_lsn, "dir_bytes": size,
                 "fill_s": round(fill, 1), "records": st["last_lsn"]}
            res.append(r)
            out(f"  recovery  {label}: {dt:.3f} s  (records replayed {rs.records_replayed:,}, "
                f"holders {len(rs.holders):,}, {size / 1e6:.1f} MB on disk; written in {fill:.1f} s)")
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return res


def bench_size(base, out):
    d = tempfile.mkdtemp(dir=base, prefix="size-")
    try:
        async def go():
            loop = asyncio.get_running_loop()
            wal = WriteAheadLog(d, fsync="never")
            wal.open()
            wal.start(loop)
            b0 = wal.stats()
            for c in range(1, 10_001):
                name = f"orders/{c % 1000}"
                wal.log_grant(name, EPOCH1 | c, os.urandom(16), 10_000, 0, "billing-worker-3", None)
                wal.log_release(name, EPOCH1 | c)
            await wal.close()
            return (wal.stats()["bytes"] - b0["bytes"]) / 10_000
        per = asyncio.run(go())
        out(f"  size      {per:.1f} WAL bytes per grant+release (name 'orders/NNN', 16-byte owner, "
            f"client name 'billing-worker-3', no correlation id, 8-byte frame header each)")
        return {"bytes_per_grant_release": round(per, 1)}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare-writers", action="store_true")
    ap.add_argument("--throughput", action="store_true")
    ap.add_argument("--recovery", action="store_true")
    ap.add_argument("--size", action="store_true")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--duration", type=float, default=1.5)
    ap.add_argument("--producers", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="runs per writer comparison (median shown)")
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    everything = not (args.compare_writers or args.throughput or args.recovery or args.size)
    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    out = print if not args.json else (lambda *a: print(*a, file=sys.stderr))
    results: dict = {"command": "python " + " ".join([sys.argv[0]] + list(argv or sys.argv[1:])),
                     "dir": base, "cpus": os.cpu_count()}
    out(f"$ {results['command']}")
    results["fsync_us"] = round(fsync_cost(base), 1)
    out(f"  fsync of a 64-byte append on {base}: {results['fsync_us']} us")
    t_start = time.perf_counter()
    if everything or args.compare_writers:
        rows = []
        # (work_us, stagger): all producers in one turn, no work; and arrivals spread over
        # 4 loop turns with 20 us of CPU each (closer to a server reading many sockets)
        for work, stagger in ((0, 0), (20, 4)):
            runs: dict = {"thread": [], "inline": []}
            for _ in range(args.repeat):  # interleaved, median shown: the machine is shared
                for writer in ("thread", "inline"):
                    runs[writer].append(run_throughput(base, "always", writer, args.producers, args.duration,
                                                       work, args.uvloop, stagger))
            for writer in ("thread", "inline"):
                rs = runs[writer]
                r = sorted(rs, key=lambda x: x["records_per_s"])[len(rs) // 2]
                r["all_records_per_s"] = [x["records_per_s"] for x in rs]
                rows.append(r)
                out(f"  group commit  writer={writer:6s} work={work:2d}us stagger={stagger}  "
                    f"{r['records_per_s']:>7,} rec/s  {r['fsyncs_per_s']:>5,} fsync/s  "
                    f"{r['records_per_batch']:>5} rec/batch  p50 {r['p50_us']} us  p99 {r['p99_us']} us  "
                    f"timer lag p99 {r['timer_lag_p99_us']} us  (runs: {r['all_records_per_s']})")
        results["writers"] = rows
    if everything or args.throughput:
        rows = []
        for mode in ("always", "interval", "never"):
            r = run_throughput(base, mode, "thread", args.producers, args.duration, 0, args.uvloop)
            rows.append(r)
            out(f"  mode {mode:8s} (writer=thread, {args.producers} producers)  {r['records_per_s']:>7,} rec/s  "
                f"{r['fsyncs_per_s']:>5,} fsync/s  {r['records_per_batch']:>6} rec/batch  "
                f"p50 {r['p50_us']} us  p99 {r['p99_us']} us")
        results["modes"] = rows
    if everything or args.size:
        results["size"] = bench_size(base, out)
    if everything or args.recovery:
        results["recovery"] = bench_recovery(base, out)
    out(f"  (total {time.perf_counter() - t_start:.1f} s)")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
