"""W2 with and without ``--metrics``, alternating rounds on one machine.

    python -m benches.metrics_ab [--rounds 5] [--duration 2]

Each round starts a ``fastlock serve --fsync never`` without, then with ``--metrics``
(throwaway data dirs, stopped after), and runs W2 against it from this process: 32
tasks on distinct locks, acquire + release in a loop for ``--duration`` seconds,
requests/s counting a pair as 2.  Prints both series, their medians and the per-round
ratio (on a shared machine the rounds' spread is the figure to read first).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import fastlock
from fastlock._testbase import ServerProcess


async def w2(address: str, duration: float, clients: int = 32) -> float:
    async with fastlock.connect(address) as client:
        stop = time.perf_counter() + duration
        count = 0

        async def worker(i: int) -> None:
            nonlocal count
            while time.perf_counter() < stop:
                lease = await client.acquire(f"w2/{i}", ttl=10.0)
                await client.release(lease)
                count += 2

        await asyncio.gather(*(worker(i) for i in range(clients)))
        return count / duration


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=2.0)
    args = ap.parse_args()
    results: dict[str, list[float]] = {"plain": [], "metrics": []}
    for _ in range(args.rounds):
        for mode in ("plain", "metrics"):
            with tempfile.TemporaryDirectory() as d:
                flags = ["--metrics", "127.0.0.1:0"] if mode == "metrics" else []
                srv = ServerProcess(f"{d}/data", fsync="never", args=flags).start()
                try:
                    results[mode].append(asyncio.run(w2(srv.address, args.duration)))
                finally:
                    srv.stop()
    for mode, values in results.items():
        print(mode, [round(v) for v in values], "median", round(statistics.median(values)))
    print("per-round ratio metrics/plain", [round(m / p, 2) for p, m in zip(results["plain"], results["metrics"])])


if __name__ == "__main__":
    main()
