"""How fast a standby's arbiter takes a dead primary's etcd key (issue 24).

    python -m benches.etcd_bid [--runs 12] [--ttl 1]

One throwaway etcd member (tests/etcdserver.py) and, per run, two in-process
:class:`~fastlock.coordination.insync.SyncArbiter` nodes on a fresh prefix: ``a`` takes
the primary key, ``b`` stands by.  Then ``a`` dies (its steps and watch stop; its
lease is not revoked), and this process measures, on its monotonic clock, from etcd's
deletion of the key (seen by the bench's own watch) to ``b``'s election, and counts
the etcd requests ``b`` sent in between.  This is the part of a group failover after
etcd frees the key and before the promotion (docs/runbooks/group.md).  Every wait
has a deadline; etcd is stopped in a ``finally`` block.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

from fastlock.coordination.gateway import EtcdGateway
from fastlock.coordination.insync import SyncArbiter
from fastlock.coordination.records import PrimaryRecord
from fastlock.units import parse_address

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "tests"))
from etcdserver import EtcdServer, unique_prefix


class Listener:
    """An arbiter listener: a standby at position 0 that records its election (monotonic s)."""

    def __init__(self) -> None:
        self.elected: float | None = None

    def position(self) -> int:
        return 0

    def min_epoch(self) -> int:
        return 0

    def candidate(self) -> bool:
        return True

    def on_elected(self, epoch: int) -> None:
        self.elected = time.monotonic()

    def on_fenced(self, fenced: bool) -> None:
        pass

    def on_lost(self, why: str) -> None:
        pass

    def on_primary(self, primary: PrimaryRecord | None) -> None:
        pass

    def on_refused(self, why: str) -> None:
        pass


async def _until(check, deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {deadline_s} s")
        await asyncio.sleep(0.005)


async def one_run(etcd_address: str, ttl_ms: int) -> tuple[float, int]:
    """``(ms from the key's deletion to b's election, etcd requests b sent in between)``."""
    prefix = unique_prefix()
    endpoint = [parse_address(etcd_address)]
    nodes = {}
    for name in ("a", "b"):
        listener = Listener()
        nodes[name] = (SyncArbiter(EtcdGateway(endpoint, timeout_s=1.0), prefix, name, f"127.0.0.1:{7000 + len(name)}",
                                   listener, ttl_ms=ttl_ms, ident=name), listener)
    (a, _), (b, b_events) = nodes["a"], nodes["b"]
    watcher = EtcdGateway(endpoint, timeout_s=1.0)
    deleted: list[float] = []
    sent: list[float] = []
    call = b.gateway.call

    async def counted(path: str, body: dict) -> dict:
        sent.append(time.monotonic())
        return await call(path, body)

    def on_event(kind: str) -> None:
        if kind == "DELETE":
            deleted.append(time.monotonic())

    watch = asyncio.ensure_future(watcher.watch(f"{prefix}/primary", on_event))
    try:
        await a.claim()
        a.start()
        await _until(lambda: a.holding, 10, "primary")
        await b.claim()
        b.start()
        await asyncio.sleep(ttl_ms / 1000.0)  # b settles as a standby
        b.gateway.call = counted  # type: ignore[method-assign]
        await a.close(revoke=False)  # dies: no more renewals, the lease runs out in etcd
        await _until(lambda: b_events.elected is not None, 4 * ttl_ms / 1000.0 + 5, "election of b")
        await _until(lambda: bool(deleted), 5, "deletion seen by the bench's watch")
        assert b_events.elected is not None
        return (b_events.elected - deleted[0]) * 1000, sum(1 for t in sent if deleted[0] <= t <= b_events.elected)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await b.close(revoke=True)
        await a.close(revoke=False)
        await watcher.close()


async def run(args: argparse.Namespace, log) -> dict[str, Any]:
    etcd = EtcdServer().start()
    try:
        times, requests = [], []
        for i in range(args.runs):
            ms, count = await one_run(etcd.address, args.ttl * 1000)
            times.append(ms)
            requests.append(count)
            log(f"run {i + 1}: deletion -> b elected {ms:.0f} ms, {count} etcd requests by b")
        return {"runs": args.runs, "etcd_ttl_s": args.ttl,
                "deletion_to_elected_ms": {"median": statistics.median(times), "max": max(times)},
                "requests": {"median": statistics.median(requests), "min": min(requests), "max": max(requests)}}
    finally:
        etcd.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.etcd_bid", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--ttl", type=int, default=1, help="etcd lease TTL, whole seconds (default 1)")
    args = ap.parse_args(argv)
    print(json.dumps(asyncio.run(run(args, lambda msg: print(msg, flush=True))), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
