"""Planned leader hand-off: ``Term.transfer(to=candidate)`` over many hand-offs.

    python -m benches.handoff [--transfers 100] [--candidates 4] [--json PATH]

Starts a ``fastlock serve`` subprocess (``--fsync always``) and ``--candidates``
candidates, each its own client and connection, campaigning in one election.  The
leader hands its term to a randomly chosen waiting candidate (never the first in
line when there is a choice, so the hand-off is directed, not FIFO); the old leader
then campaigns again.  Per hand-off, on the one monotonic clock of this process:

- ``gap``: the leader's ``transfer()`` call -> the chosen candidate's ``campaign()``
  returns (the time without a leader that knows it leads);
- the new term's token must be higher than the old one's;
- the old leader's next fenced write (a key put with its old lease) must be refused.

Prints the gap's p50/p99/max (target: p99 under 100 ms) and the counts of tokens
that did not grow and fenced writes that were accepted (both must be 0).  Exit
status 0 when the targets hold, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time

import fastlock
from fastlock._testbase import ServerProcess
from fastlock.errors import LeaseLost

#: seconds: the most one hand-off (or a candidate's queueing) may take before the run is abandoned
STEP_TIMEOUT = 10.0


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


async def _run(address: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    ids = [f"cand-{i}" for i in range(args.candidates)]
    clients = {cid: await fastlock.connect(address, client_name=cid) for cid in ids}
    elections = {cid: clients[cid].election("handoff", cid, lease_duration=30, renew_deadline=20, retry_period=5)
                 for cid in ids}
    try:
        term = await elections[ids[0]].campaign()
        leader = ids[0]
        campaigns = {cid: asyncio.ensure_future(elections[cid].campaign()) for cid in ids[1:]}
        gaps: list[float] = []
        not_higher = accepted_fenced = 0
        for _ in range(args.transfers):
            deadline = time.monotonic() + STEP_TIMEOUT
            while True:  # every other candidate queued
                waiting = await elections[leader].candidates()
                if len(waiting) == args.candidates - 1:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"candidates never all queued: {waiting}")
                await asyncio.sleep(0.001)
            to = rng.choice(waiting[1:] if len(waiting) > 1 else waiting)
            old_term, old_leader = term, leader
            started = time.monotonic()
            await old_term.transfer(to)
            term = await asyncio.wait_for(campaigns.pop(to), STEP_TIMEOUT)
            gaps.append(time.monotonic() - started)
            leader = to
            if term.fencing_token <= old_term.fencing_token:
                not_higher += 1
            try:
                await clients[old_leader].put("handoff-state", b"stale", lease=old_term.lease)
                accepted_fenced += 1
            except LeaseLost:
                pass
            campaigns[old_leader] = asyncio.ensure_future(elections[old_leader].campaign())
        await term.resign()
        for task in campaigns.values():
            task.cancel()
        await asyncio.gather(*campaigns.values(), return_exceptions=True)
        ms = [g * 1000 for g in gaps]
        return {"transfers": len(gaps), "gap_ms_p50": statistics.median(ms), "gap_ms_p99": _pct(ms, 99),
                "gap_ms_max": max(ms), "tokens_not_higher": not_higher, "fenced_writes_accepted": accepted_fenced}
    finally:
        for c in clients.values():
            await c.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benches.handoff", description=__doc__.split("\n")[0])
    parser.add_argument("--transfers", type=int, default=100)
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.candidates < 2 or args.transfers < 1:
        parser.error("--candidates >= 2 and --transfers >= 1")
    with tempfile.TemporaryDirectory(prefix="fastlock-handoff-") as tmp:
        server = ServerProcess(tmp, fsync="always")
        server.start()
        try:
            result = asyncio.run(_run(server.address, args))
        finally:
            server.stop()
    print(f"hand-offs: {result['transfers']}  gap p50 {result['gap_ms_p50']:.2f} ms  "
          f"p99 {result['gap_ms_p99']:.2f} ms  max {result['gap_ms_max']:.2f} ms  (target p99 < 100 ms)")
    print(f"new term's token not higher: {result['tokens_not_higher']}  "
          f"old leader's fenced writes accepted: {result['fenced_writes_accepted']}  (both must be 0)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    ok = result["gap_ms_p99"] < 100 and not result["tokens_not_higher"] and not result["fenced_writes_accepted"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
