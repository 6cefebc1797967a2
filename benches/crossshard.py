"""Multi-locks across shards (issue 30 item 5): latency against the single-shard multi-lock,
and many overlapping multi-locks under wound-wait.

    python -m benches.crossshard [--sets 2000] [--count 100000] [--clients 48] [--names 300]
                                 [--max-seconds 900] [--fsync never] [--in-order] [--reference]
                                 [--processes 1] [--show-slowest 0]
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
   the tail is the workload's own.  ``--processes N`` splits the workers over N client
   processes (each its own loop and connections).

   **Leases left held**: each request carries ``<process>.<worker>.<n>`` as its correlation id;
   every second each shard's held leases are listed and any lease of a multi-lock that already
   ended (released, or given up) and is older than ``LEAK_AGE`` is printed as ``LEAK:`` with the
   multi-lock's timeline (each part's send, grant, queue time and reserves; the token the client
   had; when it ended), and once every worker has finished every lease still held is one
   (target 0).  A lease held longer than ``STUCK_AGE`` (10 s) by a multi-lock still being taken
   (a part held while another part waits that long: a stall) counts too, and is printed as
   ``LEAK:`` with the timeline once its multi-lock ends.  And any lease that ran out its TTL on
   a shard (the shards' log) is counted and printed as ``EXPIRED:``: such a lease may end before
   the sweeps see its multi-lock end.  The client process's CPU time per multi-lock is printed
   too (microseconds).

   **What a wait is made of**: for the slowest thousandth and for the middle tenth, the mean
   of: the wait; the longest time one part waited in a shard (parked behind an older
   multi-lock, then queued: the shard's figure); the longest send-to-grant of a part beyond
   that (the wire, the client's loop); first to last part granted; the time before the last
   try (wounds); from the last grant to the commits sent; the commit; how late the client's
   event loop ran inside the wait (a 5 ms timer's lateness) and its GC pauses
   (``gc.callbacks``); the waits by how many shards a multi-lock spans; and with
   ``--show-slowest N`` the N slowest one by one (each part's send, grant, wait in the shard
   and reserves, seconds from the multi-lock's start).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import concurrent.futures
import gc
import multiprocessing
import random
import re
import statistics
import tempfile
import time
import zlib
from typing import NamedTuple

import fastlock
from benches.harness import latency_stats, run_async
from fastlock._testbase import ServerProcess
from fastlock.client.across import acquire_across, release_across, shard_key
from fastlock.errors import LeaseLost, LockNotAcquired


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


class Done(NamedTuple):
    """One finished multi-lock of the overlap part, and what its wait was made of (seconds)."""

    wait: float           # acquire's duration, as the worker saw it
    attempts: int         # tries, counting a part reserved again after a wound (1: never wounded)
    queued: float         # the longest time one of its parts waited in a shard, parked behind an older multi-lock
                          # and in the names' queues (the shard's figure)
    wire: float           # the longest send-to-grant of a part less its wait in the shard: on the wire, and in
                          # the client's loop before the request was written and the reply was read
    spread: float         # from its first part granted to its last (a part held while another waits)
    retries: float        # from the start to the first RESERVE of its last try (wounds, earlier tries)
    commit: float         # the commit round trip
    stall: float          # the client's event-loop lag (late timers) inside its wait
    gc: float             # the client's GC pauses inside its wait
    names: int            # how many names it took
    to_commit: float      # from its last part granted to its commits sent (the client's own delay)
    parts: tuple          # per shard: (sent, granted, queued, reserves), seconds from its start (queued: the shard's
                          # figure); () for the one-shard reference


class LoopWatch:
    """The client loop's lag (a 5 ms timer's lateness) and GC pauses, with their times, so a
    request's share of them can be summed over its wait."""

    TICK = 0.005

    def __init__(self) -> None:
        self.lag_end: list[float] = []
        self.lag_sum: list[float] = [0.0]
        self.gc_end: list[float] = []
        self.gc_sum: list[float] = [0.0]
        self._gc_start = 0.0
        self._stop = False
        #: per generation: collections, and the longest pause (seconds)
        self.gc_count = [0, 0, 0]
        self.gc_longest = [0.0, 0.0, 0.0]

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.monotonic()
        else:
            now = time.monotonic()
            self.gc_end.append(now)
            self.gc_sum.append(self.gc_sum[-1] + now - self._gc_start)
            generation = info.get("generation", 0)
            self.gc_count[generation] += 1
            self.gc_longest[generation] = max(self.gc_longest[generation], now - self._gc_start)

    async def run(self) -> None:
        gc.callbacks.append(self._on_gc)
        try:
            while not self._stop:
                t = time.monotonic()
                await asyncio.sleep(self.TICK)
                now = time.monotonic()
                lag = now - t - self.TICK
                if lag > 0.001:
                    self.lag_end.append(now)
                    self.lag_sum.append(self.lag_sum[-1] + lag)
        finally:
            gc.callbacks.remove(self._on_gc)

    def stop(self) -> None:
        self._stop = True

    @staticmethod
    def _within(ends: list[float], sums: list[float], t0: float, t1: float) -> float:
        i, j = bisect.bisect_left(ends, t0), bisect.bisect_right(ends, t1)
        return sums[j] - sums[i]

    def stall(self, t0: float, t1: float) -> float:
        return self._within(self.lag_end, self.lag_sum, t0, t1)

    def gc_time(self, t0: float, t1: float) -> float:
        return self._within(self.gc_end, self.gc_sum, t0, t1)


class ProcessResult(NamedTuple):
    done: list[tuple]  # Done's fields
    stuck: int
    lost: int      # multi-locks a lease of which had ended by its release
    leaked: int    # leases still held after their multi-lock was released or gave up, or held over STUCK_AGE
                   # while it was being taken
    elapsed: float
    stall: float   # the client loop's total lag, seconds
    gc: float      # the client's total GC pauses, seconds
    cpu: float     # the client process's CPU time over its workers' run, seconds (user + system)
    gc_count: tuple    # the client's collections per generation
    gc_longest: tuple  # the client's longest collection per generation, seconds


#: seconds a lease of a multi-lock must have been held before the leak watch looks at it
LEAK_AGE = 2.0
#: how many ended multi-locks a client process remembers for the leak watch's reports
ENDED_KEPT = 10_000
#: seconds a lease of a multi-lock still being taken may be held before the leak watch reports it: a part
#: held that long while another waits is stuck (a third of the bench's 30 s TTL)
STUCK_AGE = 10.0


class Ended(NamedTuple):
    """How a multi-lock of the overlap part ended, for the leak watch (loop times, seconds).
    Kept as a plain tuple of numbers and strings (``Ended(*row)`` to read one), which the
    collector stops tracking: the kept records add nothing to the client's collections."""

    how: str                   # "released", or why it gave up
    started: float
    acquired: float            # 0.0: never acquired
    ended: float
    attempts: int
    timings: tuple             # per shard (sent, granted, waited_ms, reserves), as PartTiming; () if not acquired
    tokens: tuple              # (name, the token the client held) pairs


class LeakWatch:
    """Leases of this process's multi-locks that the servers still hold after the multi-lock
    was released or gave up (each request carries ``<seed>.<worker>.<n>`` as its correlation
    id): every second, and once at the end for every lease left, each shard's held leases
    (``locks``) are read and every lease of an ended multi-lock (held longer than
    :data:`LEAK_AGE` while the run goes on) is reported with the multi-lock's timeline."""

    def __init__(self, clients: list[fastlock.Client], prefix: str, loop: asyncio.AbstractEventLoop):
        self.clients = clients
        self.prefix = prefix
        self.loop = loop
        self.active: dict[str, float] = {}
        self.ended: collections.OrderedDict[str, tuple] = collections.OrderedDict()  # Ended's fields
        self.reported: set[tuple[str, int]] = set()
        self.leaked = 0
        #: correlation id -> what the sweeps saw of its leases held past STUCK_AGE while it was being taken
        self.stuck: dict[str, list[str]] = {}
        self._stop = asyncio.Event()

    def end(self, corr: str, how: str, started: float, acquired: float, attempts: int, timings: tuple,
            tokens: dict) -> None:
        self.active.pop(corr, None)
        row = (how, started, acquired, self.loop.time(), attempts, tuple(tuple(t) for t in timings),
               tuple(tokens.items()))
        self.ended[corr] = row
        for seen in self.stuck.pop(corr, ()):
            print(f"   LEAK: {seen}; then {self.describe(Ended(*row), seen.split(' ', 1)[0], self.loop.time())}")
        if len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    async def sweep(self, min_age: float) -> None:
        for shard, client in enumerate(self.clients):
            try:
                page = await client.locks("ov/", most=10_000)
            except fastlock.FastlockError as exc:
                print(f"   leak watch: shard {shard} could not be read: {exc}")
                continue
            now = self.loop.time()
            for info in page.locks:
                corr = info.correlation_id or ""
                age = info.ttl - info.remaining
                key = (info.name, info.fencing_token)
                if not corr.startswith(self.prefix) or age < min_age or key in self.reported:
                    continue
                row = self.ended.get(corr)
                record = None if row is None else Ended(*row)
                if record is None and corr in self.active:
                    # its multi-lock is still being taken: a part held while another waits - for at most
                    # STUCK_AGE, else it is reported (with the timeline once the multi-lock ends)
                    if age >= STUCK_AGE:
                        self.reported.add(key)
                        self.leaked += 1
                        self.stuck.setdefault(corr, []).append(
                            f"{info.name} token {info.fencing_token} on shard {shard} held {age:.1f} s "
                            f"({info.remaining:.1f} s of its TTL left, client {info.client}) while its multi-lock "
                            f"{corr} was still being taken ({now - self.active[corr]:.1f} s so far)")
                    continue
                self.reported.add(key)
                self.leaked += 1
                print(f"   LEAK: {info.name} token {info.fencing_token} on shard {shard} held {age:.1f} s "
                      f"({info.remaining:.1f} s of its TTL left, client {info.client}) by multi-lock {corr}: "
                      + ("not remembered" if record is None else self.describe(record, info.name, now)))

    @staticmethod
    def describe(r: Ended, name: str, now: float) -> str:
        parts = "; ".join(f"sent +{(sent - r.started) * 1e3:.0f} granted +{(granted - r.started) * 1e3:.0f} ms, "
                          f"queued {waited_ms} ms, {reserves} reserves"
                          for sent, granted, waited_ms, reserves in r.timings)
        acquired = "never acquired" if not r.acquired else f"acquired +{(r.acquired - r.started) * 1e3:.0f} ms"
        return (f"{r.how} +{(r.ended - r.started) * 1e3:.0f} ms ({(now - r.ended):.1f} s ago), {acquired}, "
                f"{r.attempts} attempts, the client's token for it {dict(r.tokens).get(name)}; parts: {parts or '-'}")

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), 1.0)
            except asyncio.TimeoutError:
                await self.sweep(LEAK_AGE)

    def stop(self) -> None:
        self._stop.set()


async def overlap_one_process(addresses: list[str], count: int, workers: int, names: int, max_seconds: float,
                              in_order: bool, one_shard: bool, seed: int) -> ProcessResult:
    """``workers`` workers of one client process taking ``count`` multi-locks between them."""
    routers = []
    for k in range(2):
        routers.append(HashRouter([await fastlock.connect(a, client_name=f"ov{seed}-{k}-{i}")
                                   for i, a in enumerate(addresses)]))
    pool = [f"ov/{i}" for i in range(names)]
    #: each a plain tuple of a Done's fields (plain tuples of numbers leave the collector's view: 100,000
    #: tracked records would make every full collection of this process scan them)
    done: list[tuple] = []
    stuck = 0
    lost = 0  # multi-locks a lease of which had ended by its release (a safety figure: must be 0)
    started = 0
    end = time.monotonic() + max_seconds
    watch = LoopWatch()
    loop = asyncio.get_running_loop()
    leaks = LeakWatch(routers[0].clients, f"{seed}.", loop)

    async def worker(k: int) -> None:
        nonlocal stuck, started, lost
        rng = random.Random(seed + k)
        router = routers[k % 2]
        n = 0
        while started < count and time.monotonic() < end:
            started += 1
            n += 1
            chosen = rng.sample(pool, rng.randrange(2, 5))
            corr = f"{seed}.{k}.{n}"
            t0, l0 = time.monotonic(), loop.time()
            leaks.active[corr] = l0
            try:
                if one_shard:
                    held = await router.clients[0].acquire_many(chosen, ttl=30.0, wait=120.0, correlation_id=corr)
                else:
                    multi = await acquire_across(router, chosen, ttl=30.0, wait=120.0, in_order=in_order,
                                                 correlation_id=corr)
            except LockNotAcquired as exc:
                stuck += 1
                leaks.end(corr, f"gave up ({exc})", l0, 0.0, 0, (), {})
                continue
            t1, l1 = time.monotonic(), loop.time()
            if one_shard:
                done.append((t1 - t0, 1, 0.0, 0.0, 0.0, 0.0, 0.0, watch.stall(t0, t1), watch.gc_time(t0, t1),
                             len(chosen), 0.0, ()))
                how = "released"
                try:
                    await router.clients[0].release_many(held)
                except LeaseLost:
                    lost += 1
                    how = "released (a lease lost)"
                leaks.end(corr, how, l0, l1, 1, (), held.fencing_tokens)
            else:
                ts = multi.timings
                done.append((
                    t1 - t0, multi.attempts,
                    max(p.waited_ms for p in ts) / 1e3,
                    max(max(0.0, p.granted - p.sent - p.waited_ms / 1e3) for p in ts),
                    max(p.granted for p in ts) - min(p.granted for p in ts),
                    max(0.0, min(p.sent for p in ts) - l0),
                    max(0.0, l1 - multi.commit_sent),
                    watch.stall(t0, t1), watch.gc_time(t0, t1), len(chosen),
                    max(0.0, multi.commit_sent - max(p.granted for p in ts)),
                    tuple((round(p.sent - l0, 4), round(p.granted - l0, 4), p.waited_ms / 1e3, p.reserves)
                          for p in ts)))
                how = "released"
                try:
                    await release_across(multi)
                except LeaseLost as exc:
                    lost += 1
                    how = "released (a lease lost)"
                    print(f"   a lease was lost before its release: {exc}; this multi-lock waited "
                          f"{(t1 - t0) * 1e3:.0f} ms, {multi.attempts} attempts, parts granted "
                          f"{', '.join(f'{(l1 - p.granted) * 1e3:.0f}' for p in multi.timings)} ms before the end")
                leaks.end(corr, how, l0, l1, multi.attempts, ts, multi.fencing_tokens)

    # what the process holds before its workers start (modules, connections) leaves the collector's
    # view: a full collection then scans only what the run made, not every object of the process
    gc.collect()
    gc.freeze()
    watcher = asyncio.ensure_future(watch.run())
    leak_watcher = asyncio.ensure_future(leaks.run())
    t0, cpu0 = time.monotonic(), time.process_time()
    try:
        await asyncio.gather(*(worker(k) for k in range(workers)))
        elapsed, cpu = time.monotonic() - t0, time.process_time() - cpu0
        leaks.stop()
        await leak_watcher
        await leaks.sweep(0.0)  # every multi-lock has ended: any lease of this process left is a leak
    finally:
        watch.stop()
        leaks.stop()
        await watcher
        await leak_watcher
        for router in routers:
            for c in router.clients:
                await c.close()
    return ProcessResult(done, stuck, lost, leaks.leaked, elapsed, watch.lag_sum[-1], watch.gc_sum[-1], cpu,
                         tuple(watch.gc_count), tuple(watch.gc_longest))


def _overlap_in_child(addresses: list[str], count: int, workers: int, names: int, max_seconds: float,
                      in_order: bool, one_shard: bool, seed: int, use_uvloop: bool) -> ProcessResult:
    return run_async(overlap_one_process(addresses, count, workers, names, max_seconds, in_order, one_shard, seed),
                     use_uvloop=use_uvloop)


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


async def overlap(addresses: list[str], count: int, workers: int, names: int, max_seconds: float,
                  in_order: bool, one_shard: bool = False, processes: int = 1, use_uvloop: bool = True,
                  show_slowest: int = 0) -> None:
    """The overlap part (see the module); ``one_shard``: the same workload as ``acquire_many``
    on the first server alone, for reference; ``processes`` > 1: the workers split over that
    many client processes (each its own event loop and connections); ``show_slowest``: print that many of
    the slowest multi-locks one by one (each part's send, grant and queue time)."""
    t0 = time.monotonic()
    if processes <= 1:
        results = [await overlap_one_process(addresses, count, workers, names, max_seconds, in_order, one_shard, 0)]
    else:
        ctx = multiprocessing.get_context("spawn")
        loop = asyncio.get_running_loop()
        with concurrent.futures.ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as ex:
            futs = [loop.run_in_executor(ex, _overlap_in_child, addresses, c, w, names, max_seconds, in_order,
                                         one_shard, 1000 * i, use_uvloop)
                    for i, (c, w) in enumerate(zip(_split(count, processes), _split(workers, processes)))]
            results = await asyncio.gather(*futs)
    elapsed = time.monotonic() - t0
    done = sorted((Done._make(d) for r in results for d in r.done), key=lambda d: d.wait)
    stuck = sum(r.stuck for r in results)
    waits = [d.wait for d in done]
    median = statistics.median(waits)
    p99 = waits[int(len(waits) * 0.99)]
    attempts = [d.attempts for d in done]
    where = "ONE shard (acquire_many, for reference)" if one_shard else "3 shards"
    print(f"{'2b' if one_shard else '2'}. {len(waits):,} multi-locks of 2-4 names over {names} names on {where}, "
          f"{workers} workers in {processes} client process{'es' if processes > 1 else ''}, "
          f"{elapsed:.1f} s ({len(waits) / elapsed:,.0f}/s): stuck {stuck} (target 0), a lease lost before "
          f"its release {sum(r.lost for r in results)} (target 0), leases left held after their multi-lock "
          f"ended or held over {STUCK_AGE:.0f} s while it was taken {sum(r.leaked for r in results)} (target 0)")
    print(f"   wait p50 {median * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, max {waits[-1] * 1e3:.2f} ms; "
          f"max/median {waits[-1] / median:.1f}x (target <= 10x); p99/median {p99 / median:.1f}x")
    print(f"   attempts per multi-lock: mean {statistics.mean(attempts):.3f}, max {max(attempts)}; "
          f"wounded at least once: {sum(a > 1 for a in attempts):,}")
    print(f"   client loop lag {sum(r.stall for r in results):.1f} s and GC {sum(r.gc for r in results):.2f} s "
          f"over the run (per process: {', '.join(f'{r.stall:.1f}/{r.gc:.2f}' for r in results)}); client CPU "
          f"{sum(r.cpu for r in results) / len(waits) * 1e6:.0f} us per multi-lock")
    print("   client collections per generation (the longest, ms): " + "; ".join(
        ", ".join(f"{n:,} ({longest * 1e3:.0f})" for n, longest in zip(r.gc_count, r.gc_longest)) for r in results))
    # where the tail comes from: each component's mean, for the slowest thousandth against the middle
    tail = done[-max(1, len(done) // 1000):]
    middle = done[len(done) * 45 // 100: len(done) * 55 // 100] or done
    fields = ("wait", "queued", "wire", "spread", "retries", "to_commit", "commit", "stall", "gc")
    print(f"   mean ms of {', '.join(fields)}; attempts:")
    for label, rows in ((f"the slowest {len(tail)}", tail), ("p45-p55", middle)):
        means = [statistics.mean(getattr(d, f) for d in rows) * 1e3 for f in fields]
        print(f"     {label:>16}: {' '.join(f'{m:8.1f}' for m in means)}; "
              f"{statistics.mean(d.attempts for d in rows):.2f} (max {max(d.attempts for d in rows)})")
    if not one_shard:
        by_shards = collections.defaultdict(list)
        for d in done:
            by_shards[len(d.parts)].append(d.wait)
        print("   by shards spanned: " + "; ".join(
            f"{k}: {len(w):,} ({len(w) / len(done):.0%}), p50 {statistics.median(w) * 1e3:.1f} ms, "
            f"of the slowest {len(tail)} {sum(len(d.parts) == k for d in tail)}"
            for k, w in sorted(by_shards.items())))
    for d in done[-show_slowest:] if show_slowest else ():
        parts = "; ".join(f"sent +{sent * 1e3:.0f} granted +{granted * 1e3:.0f} in the shard {queued * 1e3:.0f} ms "
                          f"x{reserves}" for sent, granted, queued, reserves in d.parts)
        print(f"   slow: {d.wait * 1e3:.0f} ms, {d.names} names, {d.attempts} attempts, to commit "
              f"{d.to_commit * 1e3:.1f} ms, commit {d.commit * 1e3:.1f} ms, loop lag {d.stall * 1e3:.0f} ms, "
              f"gc {d.gc * 1e3:.0f} ms; parts: {parts or '-'}")
    net = sorted(max(0.0, d.wait - d.stall) for d in done)
    print(f"   wait less the client's loop lag inside it: max/median {net[-1] / statistics.median(net):.1f}x; "
          f"the slowest: wait {done[-1].wait * 1e3:.0f} ms = queued {done[-1].queued * 1e3:.0f} + wire "
          f"{done[-1].wire * 1e3:.0f} + retries {done[-1].retries * 1e3:.0f} + commit "
          f"{done[-1].commit * 1e3:.0f} ms (parts overlap), loop lag {done[-1].stall * 1e3:.0f} ms, "
          f"attempts {done[-1].attempts}")


#: the shards' log line of a lease that ran out its TTL, and the count of such lines it stands for
_EXPIRED = re.compile(r"lease expired: (.*?)(?: \((\d+) more like this in the last [0-9.]+ s\))?$")


def expired_report(servers: list[ServerProcess], since: list[int]) -> None:
    """Print the leases that ran out their TTL on the shards since ``since`` (each shard's count
    of log lines then): the bench releases every lease it takes, so an expiry is a lease nobody
    released in time - a part held by a multi-lock that stalled, or a leak - even when it ended
    before the leak watch saw its multi-lock end.  The shards' log of expiries is rate-limited:
    the count includes the lines it left out, the listing does not."""
    expired: list[tuple[int, str]] = []
    count = 0
    for k, server in enumerate(servers):
        for line in server.lines[since[k]:]:
            m = _EXPIRED.search(line)
            if m is not None:
                expired.append((k, m.group(1)))
                count += 1 + int(m.group(2) or 0)
    print(f"   leases that ran out their TTL on a shard (nobody released them): {count} (target 0)")
    for k, what in expired[:10]:
        print(f"   EXPIRED on shard {k}: {what}")
    if len(expired) > 10:
        print(f"   ... and {count - 10} more")


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="fastlock-across-") as tmp:
        servers = [ServerProcess(f"{tmp}/shard{i}", fsync=args.fsync).start() for i in range(3)]
        try:
            addresses = [s.address for s in servers]
            print(f"parts taken {'in the global order of shards' if args.in_order else 'from every shard at once'}")
            await latency(addresses, args.sets, args.in_order)
            uv = not args.no_uvloop
            since = [len(s.lines) for s in servers]
            await overlap(addresses, args.count, args.clients, args.names, args.max_seconds, args.in_order,
                          False, args.processes, uv, args.show_slowest)
            expired_report(servers, since)
            if args.reference:
                await overlap(addresses, args.count, args.clients, args.names, args.max_seconds, False, True,
                              args.processes, uv)
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
    ap.add_argument("--processes", type=int, default=1,
                    help="client processes the overlap part's workers are split over (default 1, at most 16)")
    ap.add_argument("--show-slowest", type=int, default=0, metavar="N",
                    help="print the N slowest multi-locks of the overlap part one by one (default 0)")
    ap.add_argument("--quick", action="store_true", help="--sets 500 --count 5000")
    ap.add_argument("--no-uvloop", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.sets, args.count = 500, 5000
    if not 1 <= args.processes <= 16:
        ap.error("--processes must be 1 to 16")
    run_async(main_async(args), use_uvloop=not args.no_uvloop)


if __name__ == "__main__":
    main()
