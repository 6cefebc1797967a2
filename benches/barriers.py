"""Double barriers across processes (issue 29, item 2).

    python -m benches.barriers [--processes 50] [--rounds 100] [--kill] [--ttl 2.0] [--json PATH]

One ``fastlock serve`` on 127.0.0.1 (throwaway data dir, stopped in a ``finally``
block).  ``--processes`` participant processes, each with its own client, pass
``--rounds`` rounds of one double barrier (enter, then leave).  Each records, per round,
on the machine's monotonic clock (shared by processes): when it called ``enter`` and
when it returned, when it called ``leave`` and when it returned.  Reported:

- ``early_leavers``: returns from ``enter`` before the last participant called it, plus
  returns from ``leave`` before the last called it (the issue's target: 0);
- ``round_ms`` p50 / p99: from the last ``enter`` call of a round to the last ``leave``
  return;
- ``rounds_per_s``.

``--kill``: instead, the processes enter a round of a barrier of one more participant
than there are (it never completes), with leases of ``--ttl`` seconds; one is killed
with SIGKILL; every other reports when it got ``BrokenBarrier``.  Reported: the latest
``detect_s`` after the kill, against the target ``ttl + 0.5`` s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fastlock._testbase.servers import ServerProcess

from .harness import print_result

PARTICIPANT = r"""
import asyncio, json, sys, time
import fastlock

async def main():
    address, count, rounds, me = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    rows = []
    async with await fastlock.connect(address, request_timeout=30.0) as c:
        barrier = c.double_barrier("bench/barrier", count, participant=me, ttl=10.0)
        print("ready", flush=True)
        sys.stdin.readline()
        for _ in range(rounds):
            a = time.monotonic()
            await barrier.enter()
            b = time.monotonic()
            await barrier.leave()
            rows.append((a, b, b, time.monotonic()))
        await barrier.close()
    print(json.dumps(rows), flush=True)

asyncio.run(main())
"""


WAITER = r"""
import asyncio, sys, time
import fastlock

async def main():
    address, count, me, ttl = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    async with await fastlock.connect(address) as c:
        barrier = c.double_barrier("bench/broken", count, participant=me, ttl=ttl)
        entering = asyncio.ensure_future(barrier.enter())
        for _ in range(6000):  # at most a minute: entered (or already failed)
            if entering.done() or (barrier.lease is not None and await c.list_prefix(f"bench/broken/1/{me}")):
                break
            await asyncio.sleep(0.01)
        print("ready", flush=True)
        try:
            await entering
            print("passed", flush=True)
        except fastlock.BrokenBarrier:
            print(time.monotonic(), flush=True)

asyncio.run(main())
"""


def run_kill(args: argparse.Namespace) -> dict:
    """The ``--kill`` measurement (see the module's text)."""
    with tempfile.TemporaryDirectory(prefix="fastlock-bench-barriers-") as root:
        server = ServerProcess(Path(root) / "data", fsync="never").start()
        procs: list[subprocess.Popen] = []
        try:
            for i in range(args.processes):
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", WAITER, server.address, str(args.processes + 1), f"p{i}", str(args.ttl)],
                    stdout=subprocess.PIPE, text=True))
            for p in procs:  # each says "ready" within a minute (its entry written, or its enter failed)
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            killed_at = time.monotonic()
            procs[0].kill()
            outs = [p.communicate(timeout=60 + 10 * args.ttl)[0].strip() for p in procs[1:]]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            server.stop()
    detect = [float(out) - killed_at for out in outs if out and out != "passed"]
    # a participant broken before the kill (its own or another's lease lost to a stall) is not counted
    detect = [d for d in detect if d > 0]
    return {"processes": args.processes, "ttl_s": args.ttl, "broken": len(detect), "others": len(outs),
            "detect_s_max": round(max(detect, default=float("nan")), 3),
            "detect_s_p50": round(_pct(detect, 50), 3), "target_s": args.ttl + 0.5}


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100.0 * len(s)))] if s else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benches.barriers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--kill", action="store_true", help="measure how fast a SIGKILLed participant breaks a round")
    parser.add_argument("--ttl", type=float, default=2.0, help="--kill: the participants' lease TTL (s)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    if args.kill:
        result = run_kill(args)
        print_result(result, args.json)
        return 0 if result["broken"] == result["others"] else 1
    with tempfile.TemporaryDirectory(prefix="fastlock-bench-barriers-") as root:
        server = ServerProcess(Path(root) / "data", fsync="never").start()
        procs: list[subprocess.Popen] = []
        try:
            for i in range(args.processes):
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", PARTICIPANT, server.address, str(args.processes), str(args.rounds),
                     f"p{i}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            for p in procs:
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            start = time.monotonic()
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            rows = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
            elapsed = time.monotonic() - start
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            server.stop()
    early = 0
    round_ms = []
    for r in range(args.rounds):
        this = [proc_rows[r] for proc_rows in rows]
        last_enter_call = max(row[0] for row in this)
        last_leave_call = max(row[2] for row in this)
        early += sum(row[1] < last_enter_call for row in this)
        early += sum(row[3] < last_leave_call for row in this)
        round_ms.append((max(row[3] for row in this) - last_enter_call) * 1000.0)
    result = {"processes": args.processes, "rounds": args.rounds, "early_leavers": early,
              "round_ms_p50": round(_pct(round_ms, 50), 1), "round_ms_p99": round(_pct(round_ms, 99), 1),
              "rounds_per_s": round(args.rounds / elapsed, 2)}
    print_result(result, args.json)
    return 0 if early == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
