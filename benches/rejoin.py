"""A pair that heals itself: failover, first grant, and the old primary's rejoin (issue 24).

    python -m benches.rejoin [--runs 5] [--failover-after 1.0] [--replication sync|async]
        [--promotion-grace 1.0] [--fault kill|pause] [--json PATH]

Each run starts a primary ``a`` and a standby ``b`` (``--standby-of a
--failover-after F``; both with ``--replication R``, as the README's blocks
show), both real ``fastlock serve`` processes on 127.0.0.1 with throwaway data
directories, stopped by PID in ``finally``.  After one grant on ``a`` it
injects the fault into ``a``:

kill
    SIGKILL, then ``a`` restarted by a "supervisor" with its original flags
    once ``b`` has promoted;
pause
    SIGSTOP until ``b`` has promoted, then SIGCONT.

Measured on this process's monotonic clock (every wait bounded):

- fault -> ``b``'s ``PROMOTED`` log line;
- fault -> the first grant of a free lock on ``b`` (retried every 10 ms);
- restart (kill) or resume (pause) -> ``a``'s ``REJOINING`` log line;
- restart or resume -> ``a`` synced as ``b``'s standby (its status), and, with
  ``--replication sync``, ``b`` back ``in_sync``.

Prints one line per run and the median and max of each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time

from fastlock._testbase.cluster import Cluster, RawNode, poll, status_of
from fastlock.errors import LockNotAcquired, NotPrimary, Unavailable


async def _first_grant(address: str, name: str, deadline_s: float) -> int:
    node = await RawNode.open(address)
    try:
        end = time.monotonic() + deadline_s
        while True:
            try:
                return (await asyncio.wait_for(node.acquire(name, 10_000), 5))[0]
            except (LockNotAcquired, Unavailable, NotPrimary, asyncio.TimeoutError):
                if time.monotonic() > end:
                    raise
                await asyncio.sleep(0.01)
    finally:
        await node.close()


def _wait_log(srv, pattern: str, timeout: float) -> float:
    srv.wait_for_log(pattern, timeout)
    return time.monotonic()


async def one_run(root: str, args: argparse.Namespace) -> dict[str, float]:
    cluster = Cluster(root)
    try:
        flags = ["--replication", args.replication]
        a = cluster.primary("a", args=flags)
        b = cluster.standby(a.address, "b", failover_after=args.failover_after, grace=args.promotion_grace,
                            args=flags)
        await _first_grant(a.address, "warm", 10)
        if args.replication == "sync":
            await poll(lambda: status_of(a.address), lambda st: st["replication"]["sync"]["state"] == "in_sync",
                       timeout=10, what="in sync")
        t0 = time.monotonic()
        if args.fault == "kill":
            a.kill()
        else:
            a.pause()
        promoted = asyncio.ensure_future(asyncio.to_thread(_wait_log, b, r"PROMOTED to primary", 20))
        await _first_grant(b.address, "free", 30)
        granted = time.monotonic()
        promoted_at = await promoted
        if args.fault == "kill":
            t1 = time.monotonic()
            a = cluster.restart(a)  # the supervisor: the original flags
        else:
            a.resume()
            t1 = time.monotonic()
        rejoining = await asyncio.to_thread(_wait_log, a, r"REJOINING as a standby", 20)
        await poll(lambda: status_of(a.address), lambda st: st["role"] == "standby" and st["replication"]["synced"],
                   timeout=20, what="the old primary synced as a standby", interval=0.01)
        synced = time.monotonic()
        in_sync = synced
        if args.replication == "sync":
            await poll(lambda: status_of(b.address), lambda st: st["replication"]["sync"]["state"] == "in_sync",
                       timeout=20, what="the new primary in sync", interval=0.01)
            in_sync = time.monotonic()
        return {"promoted_s": promoted_at - t0, "first_grant_s": granted - t0, "rejoining_s": rejoining - t1,
                "synced_s": synced - t1, "in_sync_s": in_sync - t1}
    finally:
        cluster.stop_all()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.rejoin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--failover-after", type=float, default=1.0, help="the standby's --failover-after (s)")
    ap.add_argument("--promotion-grace", type=float, default=1.0, help="the standby's --promotion-grace (s)")
    ap.add_argument("--replication", choices=("sync", "async"), default="sync")
    ap.add_argument("--fault", choices=("kill", "pause"), default="kill")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    rows = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="fastlock-rejoin-") as root:
            row = asyncio.run(asyncio.wait_for(one_run(root, args), 120))
        rows.append(row)
        print(f"run {run + 1}: " + ", ".join(f"{k} {v * 1000:,.0f} ms" for k, v in row.items()), flush=True)
    print(f"{args.replication}, {args.fault}, --failover-after {args.failover_after:g}, "
          f"--promotion-grace {args.promotion_grace:g}, {args.runs} runs:")
    for key in rows[0]:
        values = [r[key] for r in rows]
        print(f"  {key:14s} median {statistics.median(values) * 1000:8,.0f} ms   max {max(values) * 1000:8,.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
