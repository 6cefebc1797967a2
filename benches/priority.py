"""Priorities and cooperative preemption against a real server.

    python -m benches.priority [--trials 200] [--duration 10] [--clients 16] [--json PATH]

Starts a ``fastlock serve`` subprocess (``--fsync always``) and measures, on this
process's monotonic clock (every client is in this process, each on its own
connection):

- ``jump``: a priority-10 waiter queued behind 50 priority-0 waiters is the next one
  granted (``--jumps`` runs; every run must say yes);
- ``revoke notice``: a waiter's ``acquire(priority=10, preempt=...)`` sent -> the
  holder's ``lease.revoke_requested`` is set; p50/p99/max over ``--trials`` (target:
  within 50 ms);
- ``fenced at deadline``: a holder that does not yield within ``preempt`` loses the
  lock to the waiter at the deadline; its fenced write (a key put with its lease) is
  refused (``--trials`` / 10 runs; every one must be refused);
- ``fairness``: ``--clients`` clients at ONE priority level contend for one lock for
  ``--duration`` s, each holding it 1 ms and asking again at once (W3's shape);
  Jain's index over their grants (target >= 0.99: FIFO within a level).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time

import fastlock
from fastlock._testbase import ServerProcess
from fastlock.errors import LeaseLost

from .harness import jain_index

STEP_TIMEOUT = 10.0


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


async def _queued(client: fastlock.Client, name: str, n: int) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT
    while len((await client.contenders(name))["waiters"]) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} waiters never queued on {name}")
        await asyncio.sleep(0.001)


async def _jump(address: str, runs: int) -> int:
    holder = await fastlock.connect(address, client_name="holder")
    crowd = await fastlock.connect(address, client_name="crowd")
    urgent = await fastlock.connect(address, client_name="urgent")
    ok = 0
    try:
        for run in range(runs):
            name = f"jump-{run}"
            lease = await holder.acquire(name, ttl=30)
            low = [asyncio.ensure_future(crowd.acquire(name, ttl=30)) for _ in range(50)]
            await _queued(holder, name, 50)
            high = asyncio.ensure_future(urgent.acquire(name, ttl=30, priority=10))
            await _queued(holder, name, 51)
            await holder.release(lease)
            first = await asyncio.wait_for(high, STEP_TIMEOUT)
            ok += not any(t.done() for t in low)
            await urgent.release(first)
            for t in low:
                await crowd.release(await asyncio.wait_for(t, STEP_TIMEOUT))
    finally:
        for c in (holder, crowd, urgent):
            await c.close()
    return ok


async def _notice(address: str, trials: int) -> list[float]:
    holder = await fastlock.connect(address, client_name="holder")
    urgent = await fastlock.connect(address, client_name="urgent")
    samples = []
    try:
        for trial in range(trials):
            name = f"notice-{trial}"
            lease = await holder.acquire(name, ttl=30)
            started = time.monotonic()
            want = asyncio.ensure_future(urgent.acquire(name, ttl=30, priority=10, preempt=30.0))
            await asyncio.wait_for(lease.revoke_requested.wait(), STEP_TIMEOUT)
            samples.append((time.monotonic() - started) * 1000)
            await holder.release(lease)
            await urgent.release(await asyncio.wait_for(want, STEP_TIMEOUT))
    finally:
        await holder.close()
        await urgent.close()
    return samples


async def _fenced(address: str, runs: int, grace: float) -> tuple[int, list[float]]:
    holder = await fastlock.connect(address, client_name="holder")
    urgent = await fastlock.connect(address, client_name="urgent")
    refused = 0
    taken_after: list[float] = []
    try:
        for run in range(runs):
            name = f"fenced-{run}"
            lease = await holder.acquire(name, ttl=60)
            await holder.put(f"{name}-row", b"v", lease=lease)
            started = time.monotonic()
            granted = await asyncio.wait_for(urgent.acquire(name, ttl=30, priority=10, preempt=grace), STEP_TIMEOUT)
            taken_after.append((time.monotonic() - started) * 1000)
            try:
                await holder.put(f"{name}-row", b"late", lease=lease)
            except LeaseLost:
                refused += granted.fencing_token > lease.fencing_token
            await urgent.release(granted)
    finally:
        await holder.close()
        await urgent.close()
    return refused, taken_after


async def _fairness(address: str, clients: int, duration: float) -> tuple[float, list[int]]:
    conns = [await fastlock.connect(address, client_name=f"f{i}") for i in range(clients)]
    counts = [0] * clients
    stop = time.monotonic() + duration

    async def worker(i: int) -> None:
        c = conns[i]
        while time.monotonic() < stop:
            lease = await c.acquire("fair", ttl=30, priority=5)
            counts[i] += 1
            await asyncio.sleep(0.001)
            await c.release(lease)

    try:
        await asyncio.gather(*(worker(i) for i in range(clients)))
    finally:
        for c in conns:
            await c.close()
    return jain_index(counts), counts


async def _all(address: str, args: argparse.Namespace) -> dict:
    jumps = await _jump(address, args.jumps)
    notice = await _notice(address, args.trials)
    runs = max(1, args.trials // 10)
    refused, taken = await _fenced(address, runs, args.grace)
    jain, counts = await _fairness(address, args.clients, args.duration)
    return {"jump_runs": args.jumps, "jump_granted_next": jumps,
            "notice_ms_p50": statistics.median(notice), "notice_ms_p99": _pct(notice, 99),
            "notice_ms_max": max(notice), "fenced_runs": runs, "fenced_refused": refused,
            "grace_ms": args.grace * 1000, "taken_after_ms_p50": statistics.median(taken),
            "taken_after_ms_max": max(taken), "jain": jain, "grants": sum(counts),
            "grants_min": min(counts), "grants_max": max(counts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benches.priority", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--jumps", type=int, default=5)
    parser.add_argument("--grace", type=float, default=0.1, help="seconds the non-yielding holder is given")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.jumps < 1 or args.clients < 2 or not 0 < args.duration <= 600:
        parser.error("--trials, --jumps >= 1, --clients >= 2, 0 < --duration <= 600")
    with tempfile.TemporaryDirectory(prefix="fastlock-priority-") as tmp:
        server = ServerProcess(tmp, fsync="always")
        server.start()
        try:
            r = asyncio.run(_all(server.address, args))
        finally:
            server.stop()
    print(f"priority-10 behind 50 priority-0 granted next: {r['jump_granted_next']}/{r['jump_runs']}")
    print(f"revoke notice: p50 {r['notice_ms_p50']:.2f} ms  p99 {r['notice_ms_p99']:.2f} ms  "
          f"max {r['notice_ms_max']:.2f} ms  (target <= 50 ms)")
    print(f"non-yielding holder fenced at its deadline: {r['fenced_refused']}/{r['fenced_runs']} "
          f"(grace {r['grace_ms']:.0f} ms; lock taken after p50 {r['taken_after_ms_p50']:.1f} ms, "
          f"max {r['taken_after_ms_max']:.1f} ms)")
    print(f"fairness within one level: Jain {r['jain']:.4f} over {r['grants']} grants "
          f"(min {r['grants_min']}, max {r['grants_max']} per client; target >= 0.99)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    ok = (r["jump_granted_next"] == r["jump_runs"] and r["notice_ms_p99"] <= 50
          and r["fenced_refused"] == r["fenced_runs"] and r["jain"] >= 0.99)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
