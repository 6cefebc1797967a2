"""Lock kinds end to end (issue 13): shared vs exclusive, readers on one lock, the atomic multi-lock.

    python -m benches.lock_kinds [--pairs 2000] [--duration 3] [--clients 32] [--fsync always]

Starts one ``fastlock serve`` (free port, throwaway data dir, stopped afterwards)
and measures, from one client process (uvloop when installed):

1. **shared vs exclusive**: acquire+release pairs of one client on one lock,
   p50/p99 per pair (µs), ``--pairs`` of each kind;
2. **W2 with readers on ONE lock**: ``--clients`` clients (one connection each)
   in a loop of acquire+release for ``--duration`` s, (a) all shared on one lock,
   (b) each exclusive on its own lock (W2 of :mod:`benches.load`); pairs/s;
3. **multi-lock of 4 names**: ``acquire_many`` + ``release_many`` of 4 free names,
   (a) ONE ACQUIRE_MANY request, (b) one by one (the fallback an older server
   gets: 4 sequential ACQUIREs); p50 per set and the acquire's round trips.

Every loop is bounded by a count or a duration.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import fastlock
from benches.harness import latency_stats, run_async
from fastlock._testbase import ServerProcess


async def _pairs(client: fastlock.Client, name: str, n: int, shared: bool) -> dict[str, float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        lease = await client.acquire(name, ttl=10.0, shared=shared)
        await client.release(lease)
        samples.append(time.perf_counter_ns() - t0)
    return latency_stats(samples)


async def _throughput(address: str, clients: int, duration: float, shared_one_lock: bool) -> float:
    conns = [await fastlock.connect(address, client_name=f"w2-{i}") for i in range(clients)]
    done = [0] * clients
    end = time.monotonic() + duration

    async def loop(i: int, client: fastlock.Client) -> None:
        name = "readers" if shared_one_lock else f"w2/{i}"
        while time.monotonic() < end:
            lease = await client.acquire(name, ttl=10.0, wait=10.0, shared=shared_one_lock)
            await client.release(lease)
            done[i] += 1

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(loop(i, c) for i, c in enumerate(conns)))
    finally:
        for c in conns:
            await c.close()
    return sum(done) / (time.monotonic() - t0)


async def _sets(client: fastlock.Client, n: int) -> dict[str, float]:
    names = [f"set/{k}" for k in range(4)]
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        multi = await client.acquire_many(names, ttl=10.0)
        await client.release_many(multi)
        samples.append(time.perf_counter_ns() - t0)
    return latency_stats(samples)


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="fastlock-kinds-") as tmp:
        srv = ServerProcess(tmp, fsync=args.fsync).start()
        try:
            client = await fastlock.connect(srv.address, client_name="bench")
            try:
                await _pairs(client, "warm", min(200, args.pairs), False)
                ex = await _pairs(client, "excl", args.pairs, False)
                sh = await _pairs(client, "shrd", args.pairs, True)
                print(f"1. acquire+release, one client: exclusive p50 {ex['p50']:.1f} us p99 {ex['p99']:.1f} us; "
                      f"shared p50 {sh['p50']:.1f} us p99 {sh['p99']:.1f} us "
                      f"(shared/exclusive {sh['p50'] / ex['p50']:.2f})")
                atomic = await _sets(client, args.pairs // 4)
                client.connector.no_acquire_many = True  # as against an older server: one by one
                single = await _sets(client, args.pairs // 4)
                print(f"3. 4-name multi-lock + release: ONE ACQUIRE_MANY p50 {atomic['p50']:.1f} us "
                      f"(acquire: 1 round trip); one by one p50 {single['p50']:.1f} us (acquire: 4 round trips); "
                      f"speed-up {single['p50'] / atomic['p50']:.2f}x")
            finally:
                await client.close()
            readers = await _throughput(srv.address, args.clients, args.duration, True)
            distinct = await _throughput(srv.address, args.clients, args.duration, False)
            print(f"2. W2, {args.clients} clients, {args.duration:g} s: shared on ONE lock {readers:,.0f} pairs/s; "
                  f"exclusive on distinct locks {distinct:,.0f} pairs/s (ratio {readers / distinct:.2f})")
        finally:
            srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2000, help="acquire+release pairs per kind (default 2000)")
    ap.add_argument("--duration", type=float, default=3.0, help="seconds of each W2 run (default 3)")
    ap.add_argument("--clients", type=int, default=32, help="W2 clients (default 32)")
    ap.add_argument("--fsync", default="always", choices=("always", "interval", "never"))
    ap.add_argument("--no-uvloop", action="store_true")
    args = ap.parse_args()
    run_async(main_async(args), use_uvloop=not args.no_uvloop)


if __name__ == "__main__":
    main()
