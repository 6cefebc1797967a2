"""Leader failover time: SIGKILL the leader -> a new leader is elected.

    python -m benches.election_failover [--runs 10] [--candidates 3]
        [--lease-duration 1.0] [--renew-deadline 0.7] [--retry-period 0.2] [--json PATH]

Starts a ``fastlock serve`` subprocess and ``--candidates`` candidate processes
(``python -m fastlock.election``, each its own client).  Each run waits a
random fraction of ``retry_period`` (so the kill lands anywhere in the renewal
cycle), SIGKILLs the current leader's process and measures, on the one
monotonic clock all local processes share:

- ``granted``: kill -> the server's grant to the next candidate, as pushed to an
  observer's watch (the hand-off itself);
- ``elected``: kill -> the new leader's own process knows it leads.

A replacement candidate is started after each run, so there are always
``--candidates`` of them.  Kubernetes' bound for this is lease_duration +
retry_period (a waiting candidate retries every retry_period); fastlock's
waiting candidates are queued on the server and granted at the lease's expiry,
so the expected figure is lease_duration minus the time since the dead
leader's last renewal (i.e. between lease_duration - retry_period and
lease_duration), plus a round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import fastlock
from fastlock._testbase import ServerProcess


class Candidate:
    def __init__(self, proc: asyncio.subprocess.Process, cid: str):
        self.proc = proc
        self.cid = cid
        self.events: list[dict] = []
        self.changed = asyncio.Event()
        self.reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, address: str, cid: str, args: argparse.Namespace, cwd: str) -> Candidate:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fastlock.election", "--server", address, "--name", args.name, "--id", cid,
            "--lease-duration", str(args.lease_duration), "--renew-deadline", str(args.renew_deadline),
            "--retry-period", str(args.retry_period), "--act-every", "0.1",
            stdout=asyncio.subprocess.PIPE, cwd=cwd,
        )
        return cls(proc, cid)

    async def _read(self) -> None:
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                return
            self.events.append(json.loads(line))
            self.changed.set()

    async def wait_event(self, kind: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for ev in self.events:
                if ev["event"] == kind:
                    return ev
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.cid}: no {kind!r} within {timeout} s")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        await self.reader


async def measure(address: str, args: argparse.Namespace, cwd: str) -> list[dict]:
    rng = random.Random(args.seed)
    observer = await fastlock.connect(address, client_name="bench-observer")
    election = observer.election(args.name, "bench-observer", lease_duration=args.lease_duration,
                                 renew_deadline=args.renew_deadline, retry_period=args.retry_period)
    grants: asyncio.Queue = asyncio.Queue()

    async def watch() -> None:
        async for event in observer.watch(args.name):
            if event.kind in ("granted", "held"):
                grants.put_nowait((time.monotonic(), event.token, event.client))

    watcher = asyncio.ensure_future(watch())
    cands: dict[str, Candidate] = {}
    serial = 0

    async def add_candidate() -> None:
        nonlocal serial
        cid = f"c{serial}"
        serial += 1
        cands[cid] = await Candidate.start(address, cid, args, cwd)
        await cands[cid].wait_event("ready", 30)

    results = []
    try:
        for _ in range(args.candidates):
            await add_candidate()
        _, token, leader_id = await asyncio.wait_for(grants.get(), 30)
        for run in range(args.runs):
            leader = await election.leader()
            assert leader is not None and leader.fencing_token == token, (leader, token)
            old = cands.pop(leader.candidate_id)
            await old.wait_event("elected", 10)
            # hold for a while, then kill at a random phase of the renewal cycle
            await asyncio.sleep(args.retry_period * 2 + rng.uniform(0, args.retry_period))
            killed_at = time.monotonic()
            os.kill(old.proc.pid, signal.SIGKILL)
            granted_at, new_token, new_id = await asyncio.wait_for(grants.get(), args.lease_duration * 5)
            elected = await cands[new_id].wait_event("elected", 10)
            assert new_token > token, (new_token, token)
            results.append({
                "run": run, "granted_s": granted_at - killed_at, "elected_s": elected["t"] - killed_at,
                "old_token": token, "new_token": new_token,
            })
            print(f"run {run}: {leader.candidate_id} killed -> {new_id} granted after "
                  f"{(granted_at - killed_at) * 1000:.1f} ms, knows it leads after "
                  f"{(elected['t'] - killed_at) * 1000:.1f} ms (token {token} -> {new_token})", flush=True)
            token = new_token
            await old.stop()
            await add_candidate()
    finally:
        watcher.cancel()
        for c in cands.values():
            await c.stop()
        await observer.close()
    return results


def summarize(results: list[dict], args: argparse.Namespace) -> dict:
    out = {"runs": len(results), "lease_duration_s": args.lease_duration, "renew_deadline_s": args.renew_deadline,
           "retry_period_s": args.retry_period, "candidates": args.candidates,
           "bound_s": args.lease_duration + args.retry_period}
    for key in ("granted_s", "elected_s"):
        xs = [r[key] for r in results]
        out[key] = {"median": statistics.median(xs), "max": max(xs), "min": min(xs), "mean": statistics.fmean(xs)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benches.election_failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--candidates", type=int, default=3)
    p.add_argument("--lease-duration", type=float, default=1.0)
    p.add_argument("--renew-deadline", type=float, default=0.7)
    p.add_argument("--retry-period", type=float, default=0.2)
    p.add_argument("--name", default="bench-leader")
    p.add_argument("--fsync", default="always", choices=("always", "interval", "never"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="PATH", help="also write the summary and every run as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fastlock-failover-") as tmp:
        with ServerProcess(Path(tmp) / "data", fsync=args.fsync) as srv:
            results = asyncio.run(measure(srv.address, args, tmp))
    summary = summarize(results, args)
    g, e = summary["granted_s"], summary["elected_s"]
    print(f"\nleader failover (SIGKILL -> new leader), {len(results)} runs, lease_duration={args.lease_duration} s "
          f"renew_deadline={args.renew_deadline} s retry_period={args.retry_period} s, {args.candidates} candidates:")
    print(f"  granted by the server : median {g['median'] * 1000:.1f} ms, max {g['max'] * 1000:.1f} ms, "
          f"min {g['min'] * 1000:.1f} ms")
    print(f"  new leader knows      : median {e['median'] * 1000:.1f} ms, max {e['max'] * 1000:.1f} ms, "
          f"min {e['min'] * 1000:.1f} ms")
    print(f"  bound (lease_duration + retry_period): {summary['bound_s'] * 1000:.0f} ms; "
          f"within it: {all(r['elected_s'] <= summary['bound_s'] for r in results)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
