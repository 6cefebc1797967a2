"""The cost of the longest-TTL rule (``fastlock/replication/ttlbound.py``): a primary
acknowledges a lease whose TTL its standby has not confirmed knowing only after the
standby's echo of a heartbeat that carries it.

    python -m benches.ttl_bound [--count 200] [--fsync always] [--failover-after 2.0]

Runs a primary alone and a pair (``--failover-after``, async replication, the standby
attached directly), both on 127.0.0.1 with throwaway data dirs, stopped in ``finally``
blocks.  On each, one connection times ``--count`` ACQUIREs (each released after) of:

- ``known``: a TTL the standby knows (no wait);
- ``new longest``: each ACQUIRE asks 1 ms more than the one before (every one waits).

Prints the median and p90 of each, in microseconds, and the pair's counter of replies
that waited.  Every loop is bounded by ``--count`` and every request by a 10 s timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from fastlock._testbase.cluster import Cluster, RawNode, poll, status_of

BASE_TTL_MS = 10_000


async def _timed(address: str, count: int, new_longest: bool, first_ttl_ms: int) -> list[float]:
    node = await RawNode.open(address)
    try:
        out = []
        for i in range(count):
            ttl_ms = first_ttl_ms + i + 1 if new_longest else BASE_TTL_MS
            started = time.perf_counter()
            token, _, owner = await asyncio.wait_for(node.acquire(f"bench-{i}", ttl_ms), 10)
            out.append((time.perf_counter() - started) * 1e6)
            await asyncio.wait_for(node.release(f"bench-{i}", token, owner), 10)
        return out
    finally:
        await node.close()


def _line(label: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return f"  {label:<14} p50 {statistics.median(samples):9.0f} us   p90 {p90:9.0f} us   (n={len(samples)})"


async def _measure(address: str, count: int) -> tuple[list[float], list[float]]:
    known = await _timed(address, count, False, BASE_TTL_MS)
    fresh = await _timed(address, count, True, BASE_TTL_MS)
    return known, fresh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200, help="acquires per kind (default 200)")
    parser.add_argument("--fsync", default="always", choices=("always", "interval", "never"))
    parser.add_argument("--failover-after", type=float, default=2.0, help="the standby's window, seconds")
    args = parser.parse_args()
    count = max(1, min(args.count, 10_000))
    with tempfile.TemporaryDirectory(prefix="fastlock-bench-ttl-") as root:
        cluster = Cluster(os.path.join(root, "lone"))
        try:
            lone = cluster.primary(fsync=args.fsync)
            known, fresh = asyncio.run(_measure(lone.address, count))
            print(f"primary alone (fsync={args.fsync}):")
            print(_line("known TTL", known))
            print(_line("new longest", fresh))
        finally:
            cluster.stop_all()
        cluster = Cluster(os.path.join(root, "pair"))
        try:
            primary = cluster.primary(fsync=args.fsync)
            cluster.standby(primary.address, failover_after=args.failover_after, fsync=args.fsync)

            async def pair() -> tuple[list[float], list[float], dict]:
                node = await RawNode.open(primary.address)
                try:
                    await node.acquire("warm-up", BASE_TTL_MS)
                finally:
                    await node.close()
                await poll(lambda: status_of(primary.address),
                           lambda st: (st["replication"]["ttl_bound"]["bound_ms"] or 0) >= BASE_TTL_MS,
                           timeout=10, what="the standby to confirm the base TTL")
                known, fresh = await _measure(primary.address, count)
                return known, fresh, (await status_of(primary.address))["replication"]["ttl_bound"]

            known, fresh, bound = asyncio.run(pair())
            print(f"pair, async, --failover-after {args.failover_after:g} (fsync={args.fsync}):")
            print(_line("known TTL", known))
            print(_line("new longest", fresh))
            print(f"  replies that waited for the standby: {bound['waited']}, bound now {bound['bound_ms']} ms")
        finally:
            cluster.stop_all()


if __name__ == "__main__":
    main()
