"""Re-entrant locks (issue 29, item 1): what a re-entry costs and how fast the acquire
limit refuses one.

    python -m benches.reentrant [--iterations 2000] [--json PATH]

One ``fastlock serve`` on 127.0.0.1 (throwaway data dir, stopped in a ``finally`` block)
and one client.  Measured on this process's monotonic clock, over ``--iterations``:

- ``first_ms``: the first acquire (a round trip) and its release, p50 / p99;
- ``reenter_us``: a re-entry and its release (local: nothing sent), p50 / p99;
- ``limit_refusal_us``: a re-entry refused by ``acquire_limit=1``
  (``AcquireLimitReached``), p50 / p99 / max - the issue's target: under 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import fastlock
from fastlock._testbase.servers import ServerProcess

from .harness import print_result


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100.0 * len(s)))] if s else 0.0


async def _measure(address: str, n: int) -> dict:
    first: list[float] = []
    reenter: list[float] = []
    refusal: list[float] = []
    async with await fastlock.connect(address) as client:
        lock = client.reentrant_lock("bench/reentrant", ttl=10.0, renew=False)
        limited = client.reentrant_lock("bench/limited", ttl=10.0, acquire_limit=1, renew=False)
        await limited.acquire()
        for _ in range(n):
            t0 = time.monotonic()
            await lock.acquire()
            t1 = time.monotonic()
            await lock.acquire()
            await lock.release()
            t2 = time.monotonic()
            await lock.release()
            t3 = time.monotonic()
            try:
                await limited.acquire()
            except fastlock.AcquireLimitReached:
                pass
            t4 = time.monotonic()
            first.append((t1 - t0 + t3 - t2) * 1e3)
            reenter.append((t2 - t1) * 1e6)
            refusal.append((t4 - t3) * 1e6)
        await limited.release()
    return {"iterations": n,
            "first_ms_p50": round(_pct(first, 50), 3), "first_ms_p99": round(_pct(first, 99), 3),
            "reenter_us_p50": round(_pct(reenter, 50), 1), "reenter_us_p99": round(_pct(reenter, 99), 1),
            "limit_refusal_us_p50": round(_pct(refusal, 50), 1), "limit_refusal_us_p99": round(_pct(refusal, 99), 1),
            "limit_refusal_us_max": round(max(refusal), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benches.reentrant", description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fastlock-bench-reentrant-") as root:
        server = ServerProcess(Path(root) / "data", fsync="never").start()
        try:
            result = asyncio.run(_measure(server.address, args.iterations))
        finally:
            server.stop()
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
