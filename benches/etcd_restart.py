"""The window without grants around an etcd restart, in a group whose primary etcd names.

    python -m benches.etcd_restart [--restarts 10] [--ttl 2] [--down S] [--replication sync] [--load 4]
                                   [--json PATH]

One throwaway etcd member (tests/etcdserver.py) and three ``fastlock serve
--coordinator`` nodes on 127.0.0.1, always stopped in ``finally`` blocks; every
wait has a deadline.  ``--load`` clients take fresh locks (60 s TTL) on the
primary without pause and note the time of every grant (this process's monotonic
clock).  ``--restarts`` times: once grants flow, etcd is killed and started again
(``--down`` seconds later) on the same ports with the same data (keys and leases
survive), and after it
answers the bench waits until ``--settle`` seconds of grants have followed.  Each
restart's line gives, in ms: ``down`` (etcd killed -> it answers again), the
longest ``gap`` between two grants from 1 s before the kill to the end of the
settle time, and where that gap ends relative to etcd answering again; and
whether the primary kept its epoch (an etcd restart must not depose a live
primary: the group's key and the primary's lease survive it).  A primary cut
off from etcd fences itself ``TTL - margin`` after its last renewal (a quarter
TTL of margin by default): the expected gap is at most about ``down`` minus
that margin plus one step (a quarter TTL) to renew and heartbeat again.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from fastlock._testbase.cluster import Cluster, RawNode, status_of
from fastlock._testbase.servers import ServerProcess
from fastlock.errors import FastlockError

from .harness import print_result

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "tests"))
from etcdserver import EtcdServer, unique_prefix


class Grants:
    """``workers`` clients taking fresh locks on ``address`` until stopped; the time of each grant."""

    def __init__(self, address: str, workers: int) -> None:
        self.times: list[float] = []
        self.refusals = 0
        self._stop = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._worker(address, f"restart-{w}")) for w in range(workers)]

    async def _worker(self, address: str, prefix: str) -> None:
        node = await RawNode.open(address)
        try:
            for seq in range(10_000_000):
                if self._stop.is_set():
                    return
                try:
                    await asyncio.wait_for(node.acquire(f"{prefix}-{seq}", 60_000, wait_ms=0), 10.0)
                    self.times.append(time.monotonic())
                except (FastlockError, asyncio.TimeoutError):
                    self.refusals += 1  # fenced while etcd is away: asked again after a short pause
                    await asyncio.sleep(0.005)
        finally:
            await node.close()

    def longest_gap(self, start: float, end: float) -> tuple[float, float]:
        """``(gap, end of the gap)`` (seconds) between two grants within ``[start, end]``."""
        inside = [t for t in self.times if start <= t <= end]
        gaps = [(b - a, b) for a, b in zip(inside, inside[1:])]
        return max(gaps) if gaps else (end - start, end)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait(self._tasks, timeout=15)


async def _primary(nodes: dict[str, ServerProcess], deadline_s: float) -> tuple[str, dict]:
    """The one node reporting itself an unfenced primary (STATUS every 20 ms, up to ``deadline_s``)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = []
        for name, srv in nodes.items():
            try:
                st = await asyncio.wait_for(status_of(srv.address), 1.0)
            except (OSError, FastlockError, asyncio.TimeoutError):
                continue
            if st["role"] == "primary" and not st["replication"]["fenced"]:
                found.append((name, st))
        if len(found) == 1:
            return found[0]
        await asyncio.sleep(0.02)
    raise TimeoutError(f"no single unfenced primary within {deadline_s} s")


async def _grants_after(grants: Grants, since: float, count: int, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while sum(t > since for t in grants.times) < count:
        if time.monotonic() > end:
            raise TimeoutError(f"fewer than {count} grants within {deadline_s} s")
        await asyncio.sleep(0.02)


async def run(args: argparse.Namespace, log) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="fastlock-etcd-restart-")
    etcd = EtcdServer().start()
    cluster = Cluster(root)
    grants: Grants | None = None
    try:
        url = f"etcd://{etcd.address}{unique_prefix()}"
        extra = ["--replication", "sync"] if args.replication == "sync" else []
        nodes = {}
        for name in ("a", "b", "c"):
            nodes[name] = cluster._start(ServerProcess(
                os.path.join(root, name), args=["--name", name, *cluster.auth_args(name), "--coordinator", url,
                                                "--node-id", name, "--coordinator-ttl", str(args.ttl), *extra]))
        name, st = await _primary(nodes, 30)
        grants = Grants(nodes[name].address, args.load)
        gaps, downs, kept = [], [], 0
        for i in range(args.restarts):
            await _grants_after(grants, time.monotonic(), 50, 30)
            await asyncio.sleep(1.0)  # the window before the kill: grants at their usual pace
            killed = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(None, etcd.restart, args.down)
            back = time.monotonic()
            await asyncio.sleep(args.settle)
            await _grants_after(grants, back, 20, 30)
            gap, gap_end = grants.longest_gap(killed - 1.0, time.monotonic())
            now_name, st2 = await _primary(nodes, 30)
            same = now_name == name and st2["epoch"] == st["epoch"]
            kept += same
            gaps.append(gap * 1000)
            downs.append((back - killed) * 1000)
            log(f"restart {i + 1}: down {(back - killed) * 1000:.0f} ms, longest gap {gap * 1000:.0f} ms ending "
                f"{(gap_end - back) * 1000:+.0f} ms from etcd answering, primary "
                + ("kept" if same else f"CHANGED {name}@{st['epoch']} -> {now_name}@{st2['epoch']}"))
            if not same:
                name, st = now_name, st2
                await grants.stop()
                grants = Grants(nodes[name].address, args.load)
        return {
            "restarts": args.restarts, "etcd_ttl_s": args.ttl, "replication": args.replication,
            "load_clients": args.load, "down_s": args.down, "primary_kept": kept,
            "etcd_down_ms": {"median": statistics.median(downs), "max": max(downs)},
            "longest_gap_ms": {"median": statistics.median(gaps), "max": max(gaps)},
            "refusals": grants.refusals,
        }
    except BaseException:
        for name, srv in (locals().get("nodes") or {}).items():  # what each node said, for the post-mortem
            log(f"--- node {name} ({srv.address}), last 60 log lines:\n" + "\n".join(srv.lines[-60:]))
        raise
    finally:
        if grants is not None:
            await grants.stop()
        cluster.stop_all()
        etcd.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.etcd_restart", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--restarts", type=int, default=10)
    ap.add_argument("--ttl", type=int, default=2, help="etcd lease TTL, whole seconds (default 2)")
    ap.add_argument("--replication", choices=("async", "sync"), default="sync",
                    help="the nodes' --replication (default sync)")
    ap.add_argument("--load", type=int, default=4, metavar="N", help="clients taking locks (default 4)")
    ap.add_argument("--down", type=float, default=0.0,
                    help="seconds etcd stays killed before it is started again (default 0: at once)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds watched after etcd answers (default 3)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    result = asyncio.run(run(args, lambda msg: print(msg, flush=True)))
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
