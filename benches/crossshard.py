"""Multi-locks across shards (issue 30 item 5): latency against the single-shard multi-lock,
and many overlapping multi-locks under wound-wait.

    python -m benches.crossshard [--sets 2000] [--count 100000] [--clients 48] [--names 300]
                                 [--max-seconds 900] [--fsync never] [--in-order] [--reference]
    python -m benches.crossshard --quick      # --sets 500 --count 5000

Starts three lone ``fastlock serve`` processes as the shards (free ports, throwaway data
dirs, stopped afterwards) and, from one client process (uvloop when installed):

1. **latency**: ``--sets`` times, one client, no contention: a 4-name multi-lock over the
   3 shards (:func:`fastlock.client.across.acquire_across` + ``release_across``; 2 names on
   one shard, 1 on each other) against ``acquire_many`` + ``release_many`` of 4 names on
   one shard; p50 and p99 (ms) of acquire+release and of the acquire alone, and the p99
   ratio (target: cross-shard p99 <= 3x the single shard's);
2. **overlap**: ``--count`` multi-locks of 2 to 4 names drawn from ``--names`` names spread
   over the 3 shards, from ``--clients`` concurrent workers (two connections per shard, shared
   by the workers); each takes its set, releases it at once and takes the next.  Every
   request has a wait of 120 s: one that does not finish in it counts as stuck (a deadlock
   or a starvation).  Reports: finished / stuck, multi-locks per second, the wait of each
   (acquire's duration) at p50 / p99 / max and max / median (target: 0 stuck, max <= 10x the
   median), attempts (wounds) per multi-lock, and wounds counted by the clients.  Stops
   starting new ones after ``--max-seconds``.  ``--reference`` runs the same workload as
   ``acquire_many`` on one server too (the same names, FIFO queues, no shards): how much of
   the tail is the workload's own.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
import zlib

import fastlock
from benches.harness import latency_stats, run_async
from fastlock._testbase import ServerProcess
from fastlock.client.across import acquire_across, release_across, shard_key
from fastlock.errors import LockNotAcquired


class HashRouter:
    """A name's shard: CRC-32 of its UTF-8 bytes, modulo the number of shards."""

    def __init__(self, clients: list[fastlock.Client]):
        self.clients = sorted(clients, key=shard_key)

    def client_for(self, name: str) -> fastlock.Client:
        return self.clients[zlib.crc32(name.encode()) % len(self.clients)]


def _names_per_shard(router: HashRouter, count: int, prefix: str) -> list[list[str]]:
    """``count`` names per shard (a bounded search: at most 100x as many tried)."""
    out: list[list[str]] = [[] for _ in router.clients]
    for i in range(count * len(out) * 100):
        name = f"{prefix}/{i}"
        bucket = out[router.clients.index(router.client_for(name))]
        if len(bucket) < count:
            bucket.append(name)
        if all(len(b) == count for b in out):
            return out
    raise RuntimeError("could not spread names over the shards")


async def latency(addresses: list[str], sets: int, in_order: bool) -> None:
    clients = [await fastlock.connect(a, client_name=f"lat-{i}") for i, a in enumerate(addresses)]
    try:
        router = HashRouter(clients)
        spread = _names_per_shard(router, 2, "lat")
        across_names = [spread[0][0], spread[0][1], spread[1][0], spread[2][0]]
        one = router.clients[0]
        single_names = [f"single/{k}" for k in range(4)]
        cross_pair, cross_acq, single_pair, single_acq = [], [], [], []
        for i in range(sets + sets // 10):  # the first tenth warms up
            t0 = time.perf_counter_ns()
            multi = await acquire_across(router, across_names, ttl=10.0, in_order=in_order)
            t1 = time.perf_counter_ns()
            await release_across(multi)
            t2 = time.perf_counter_ns()
            held = await one.acquire_many(single_names, ttl=10.0)
            t3 = time.perf_counter_ns()
            await one.release_many(held)
            t4 = time.perf_counter_ns()
            if i >= sets // 10:
                cross_acq.append(t1 - t0)
                cross_pair.append(t2 - t0)
                single_acq.append(t3 - t2)
                single_pair.append(t4 - t2)
        cp, ca, sp, sa = (latency_stats(s) for s in (cross_pair, cross_acq, single_pair, single_acq))
        print(f"1. 4-name multi-lock, {sets} sets, no contention (ms):")
        print(f"   across 3 shards: acquire+release p50 {cp['p50'] / 1e3:.3f} p99 {cp['p99'] / 1e3:.3f}; "
              f"acquire p50 {ca['p50'] / 1e3:.3f} p99 {ca['p99'] / 1e3:.3f}")
        print(f"   one shard (acquire_many): acquire+release p50 {sp['p50'] / 1e3:.3f} p99 {sp['p99'] / 1e3:.3f}; "
              f"acquire p50 {sa['p50'] / 1e3:.3f} p99 {sa['p99'] / 1e3:.3f}")
        print(f"   p99 ratio across/one: acquire+release {cp['p99'] / sp['p99']:.2f}x, "
              f"acquire {ca['p99'] / sa['p99']:.2f}x (target <= 3x)")
    finally:
        for c in clients:
            await c.close()


async def overlap(addresses: list[str], count: int, workers: int, names: int, max_seconds: float,
                  in_order: bool, one_shard: bool = False) -> None:
    """The overlap part (see the module); ``one_shard``: the same workload as ``acquire_many``
    on the first server alone, for reference."""
    routers = []
    for k in range(2):
        routers.append(HashRouter([await fastlock.connect(a, client_name=f"ov{k}-{i}")
                                   for i, a in enumerate(addresses)]))
    pool = [f"ov/{i}" for i in range(names)]
    waits: list[float] = []
    timed: list[float] = []  # the waits in the order of ``attempts``
    attempts: list[int] = []
    stuck = 0
    started = 0
    end = time.monotonic() + max_seconds

    async def worker(k: int) -> None:
        nonlocal stuck, started
        rng = random.Random(k)
        router = routers[k % 2]
        while started < count and time.monotonic() < end:
            started += 1
            chosen = rng.sample(pool, rng.randrange(2, 5))
            t0 = time.monotonic()
            try:
                if one_shard:
                    held = await router.clients[0].acquire_many(chosen, ttl=30.0, wait=120.0)
                else:
                    multi = await acquire_across(router, chosen, ttl=30.0, wait=120.0, in_order=in_order)
            except LockNotAcquired:
                stuck += 1
                continue
            waits.append(time.monotonic() - t0)
            timed.append(waits[-1])
            if one_shard:
                attempts.append(1)
                await router.clients[0].release_many(held)
            else:
                attempts.append(multi.attempts)
                await release_across(multi)

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(worker(k) for k in range(workers)))
    finally:
        for router in routers:
            for c in router.clients:
                await c.close()
    elapsed = time.monotonic() - t0
    waits.sort()
    median = statistics.median(waits)
    p99 = waits[int(len(waits) * 0.99)]
    where = "ONE shard (acquire_many, for reference)" if one_shard else "3 shards"
    print(f"{'2b' if one_shard else '2'}. {len(waits):,} multi-locks of 2-4 names over {names} names on {where}, "
          f"{workers} workers, "
          f"{elapsed:.1f} s ({len(waits) / elapsed:,.0f}/s): stuck {stuck} (target 0)")
    print(f"   wait p50 {median * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, max {waits[-1] * 1e3:.2f} ms; "
          f"max/median {waits[-1] / median:.1f}x (target <= 10x); p99/median {p99 / median:.1f}x")
    print(f"   attempts per multi-lock: mean {statistics.mean(attempts):.3f}, max {max(attempts)}; "
          f"wounded at least once: {sum(a > 1 for a in attempts):,}")
    # where the tail comes from: the slowest thousandth against the rest, by attempts
    ranked = sorted(zip(timed, attempts), reverse=True)
    tail = ranked[:max(1, len(ranked) // 1000)]
    print(f"   the slowest {len(tail)}: wait {tail[-1][0] * 1e3:.0f}-{tail[0][0] * 1e3:.0f} ms, attempts mean "
          f"{statistics.mean(a for _, a in tail):.2f} max {max(a for _, a in tail)}; "
          f"of those tried once, the slowest waited {max((w for w, a in ranked if a == 1), default=0) * 1e3:.0f} ms")


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="fastlock-across-") as tmp:
        servers = [ServerProcess(f"{tmp}/shard{i}", fsync=args.fsync).start() for i in range(3)]
        try:
            addresses = [s.address for s in servers]
            print(f"parts taken {'in the global order of shards' if args.in_order else 'from every shard at once'}")
            await latency(addresses, args.sets, args.in_order)
            await overlap(addresses, args.count, args.clients, args.names, args.max_seconds, args.in_order)
            if args.reference:
                await overlap(addresses, args.count, args.clients, args.names, args.max_seconds, False, True)
        finally:
            for s in servers:
                s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", type=int, default=2000, help="sets of the latency part (default 2000)")
    ap.add_argument("--count", type=int, default=100_000, help="multi-locks of the overlap part (default 100,000)")
    ap.add_argument("--clients", type=int, default=48, help="concurrent workers of the overlap part (default 48)")
    ap.add_argument("--names", type=int, default=300, help="names the overlap part draws from (default 300)")
    ap.add_argument("--max-seconds", type=float, default=900.0, help="the overlap part's time bound (default 900)")
    ap.add_argument("--fsync", default="never", choices=("always", "interval", "never"))
    ap.add_argument("--in-order", action="store_true",
                    help="take the shards' parts one after the other in the global order (default: all at once)")
    ap.add_argument("--reference", action="store_true",
                    help="also run the overlap workload as acquire_many on one server (the single-shard reference)")
    ap.add_argument("--quick", action="store_true", help="--sets 500 --count 5000")
    ap.add_argument("--no-uvloop", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.sets, args.count = 500, 5000
    run_async(main_async(args), use_uvloop=not args.no_uvloop)


if __name__ == "__main__":
    main()
