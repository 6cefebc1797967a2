"""A shared rate limit across a failover (issue 29, item 3).

    python -m benches.ratelimit [--clients 64] [--rate 100] [--burst 10] [--duration 60]
        [--failover-after 1.0] [--no-failover] [--json PATH]

A primary and a standby (``--failover-after``) on 127.0.0.1 with throwaway data dirs.
``--clients`` clients (one connection each, through ``fastlock.connect(primary,
standby)``, all connected before the clock starts) take from one limiter (``--rate`` per
second, ``--burst``) in a closed
loop: a refused take waits the ``retry_after`` the server gave (at most 0.1 s).
Halfway through, the primary is SIGKILLed; the clients ride through to the promoted
standby.  Counted on this process's clock from the first take sent to the end:

- ``admitted``: takes the clients saw admitted;
- ``bound``: ``burst + rate * span`` - the most one limiter may admit over the span;
- ``ratio``: admitted / bound (the issue's target: admitted <= bound and >= 98 % of it);
- ``outage_s``: the longest time no take was admitted (the failover).

Every server is stopped in a ``finally`` block; every wait has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time

import fastlock
from fastlock._testbase.cluster import Cluster

from .harness import print_result

RETRYABLE = (fastlock.ConnectionLost, fastlock.NotPrimary, fastlock.Unavailable)


async def _client(c: fastlock.Client, args: argparse.Namespace, stop: float, admitted: list[float]) -> None:
    async with c:
        while time.monotonic() < stop:
            try:
                d = await c.limit("bench/limit", args.rate, args.burst)
            except RETRYABLE:
                await asyncio.sleep(0.02)
                continue
            if d.admitted:
                admitted.append(time.monotonic())
            else:
                await asyncio.sleep(min(0.1, d.retry_after))


async def _run(args: argparse.Namespace, cluster: Cluster) -> dict:
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=args.failover_after, grace=0.0)
    addresses = [p.address, s.address]
    await asyncio.sleep(1.0)  # the standby attached (a take needs none)
    admitted: list[float] = []
    clients = [await fastlock.connect(*addresses, connect_timeout=2.0, request_timeout=2.0)
               for _ in range(args.clients)]  # every client connected before the clock starts
    start = time.monotonic()
    stop = start + args.duration
    tasks = [asyncio.ensure_future(_client(c, args, stop, admitted)) for c in clients]
    killed_at = None
    if args.failover:
        await asyncio.sleep(args.duration / 2)
        p.kill()
        killed_at = time.monotonic() - start
    await asyncio.wait_for(asyncio.gather(*tasks), args.duration + 60.0)
    span = stop - start
    bound = args.burst + args.rate * span
    times = sorted(admitted)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"clients": args.clients, "rate": args.rate, "burst": args.burst, "span_s": round(span, 3),
            "killed_at_s": None if killed_at is None else round(killed_at, 3), "admitted": len(admitted),
            "bound": round(bound, 1), "ratio": round(len(admitted) / bound, 4),
            "within_bound": len(admitted) <= bound, "outage_s": round(max(gaps, default=0.0), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benches.ratelimit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rate", type=int, default=100, help="takes per second")
    parser.add_argument("--burst", type=int, default=10)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds")
    parser.add_argument("--failover-after", type=float, default=1.0, help="the standby's --failover-after (s)")
    parser.add_argument("--no-failover", dest="failover", action="store_false", help="no SIGKILL of the primary")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fastlock-bench-ratelimit-") as root:
        cluster = Cluster(root)
        try:
            result = asyncio.run(_run(args, cluster))
        finally:
            cluster.stop_all()
    print_result(result, args.json)
    return 0 if result["within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
