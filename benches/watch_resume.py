"""Watches that resume: every change seen once and in order across cut connections and a kill -9.

    python -m benches.watch_resume [--names 1000] [--rounds 50] [--cuts 3] [--workers 16] [--json PATH]

Starts a synchronous pair (``--replication sync``, ``--failover-after 1``), one
watcher client that watches ``--names`` locks through TCP proxies, and one writer
client that acquires and releases each name ``--rounds`` times (two changes each:
``names * rounds * 2`` changes, 100,000 by default).  While the changes flow it
cuts the watcher's connections ``--cuts`` times, then SIGKILLs the primary; the
standby promotes and the watches resume there (docs/watches.md).  Then it checks
each name's history change by change - it begins "free", alternates a grant and
its end with the same token, tokens and revisions strictly increase, every grant
the writer was told of is there - and prints the counts, the time and the rate.
Exit status 1 if any history is wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time

import fastlock
from fastlock._testbase.cluster import Cluster, poll, status_of
from fastlock.errors import FastlockError

from .harness import print_result


def problems(events: list, granted: list[int]) -> list[str]:
    """What is wrong with one name's history (empty: nothing)."""
    out = []
    if not events or events[0].kind != "free":
        out.append(f"does not begin free: {events[:1]}")
    revisions = [e.revision for e in events]
    if revisions != sorted(set(revisions)):
        out.append("revisions repeat or go back")
    tokens: list[int] = []
    for i, event in enumerate(events[1:]):
        want = ("granted",) if i % 2 == 0 else ("released", "expired")
        if event.kind not in want or (i % 2 and event.token != tokens[-1]):
            out.append(f"change {i + 1} is {event.kind} {event.token}, not {'/'.join(want)}")
            break
        if i % 2 == 0:
            tokens.append(event.token)
    if tokens != sorted(set(tokens)):
        out.append("a grant seen twice or out of order")
    missing = set(granted) - set(tokens)
    if missing:
        out.append(f"{len(missing)} acknowledged grants never seen")
    return out


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="fastlock-watch-resume-") as root:
        cluster = Cluster(root)
        try:
            primary = cluster.primary(args=["--replication", "sync"])
            standby = cluster.standby(primary.address, failover_after=1.0)
            proxies = [cluster.proxy(primary.address), cluster.proxy(standby.address)]
            names = [f"bench/{i}" for i in range(args.names)]
            events: dict[str, list] = {n: [] for n in names}
            granted: dict[str, list[int]] = {n: [] for n in names}
            counted = asyncio.Event()
            total = 0
            async with fastlock.connect(*(p.address for p in proxies), client_name="watcher",
                                        connect_timeout=1.0) as wc, \
                    fastlock.connect(primary.address, standby.address, client_name="writer",
                                     connect_timeout=1.0) as writer:
                async def watch(name: str) -> None:
                    nonlocal total
                    async for event in wc.watch(name):
                        events[name].append(event)
                        total += 1
                        counted.set()

                watches = [asyncio.ensure_future(watch(n)) for n in names]
                await poll(lambda: asyncio.sleep(0, all(events[n] for n in names)), timeout=120,
                           what="every watch started")

                async def work(part: list[str]) -> None:
                    for _ in range(args.rounds):
                        for n in part:
                            try:
                                lease = await writer.acquire(n, ttl=3.0, wait=60.0)
                            except FastlockError:
                                continue
                            granted[n].append(lease.fencing_token)
                            try:
                                await writer.release(lease)
                            except FastlockError:
                                pass  # lost with the primary: it expires on the promoted node

                expected = args.names * args.rounds * 2
                t0 = time.perf_counter()
                writing = asyncio.ensure_future(asyncio.gather(*(work(names[i::args.workers])
                                                                 for i in range(args.workers))))
                cut = 0
                for k in range(1, args.cuts + 2):
                    while total < expected * k // (args.cuts + 3) and not writing.done():
                        counted.clear()
                        await asyncio.wait_for(counted.wait(), 60)
                    if k <= args.cuts:
                        cut += sum(p.cut() for p in proxies)
                    else:
                        primary.kill()
                        killed = time.perf_counter() - t0
                await writing
                await poll(lambda: status_of(standby.address), lambda st: st["role"] == "primary", timeout=30,
                           what="the standby promoted")

                def settled() -> bool:
                    return all(not granted[n] or (events[n][-1].kind in ("released", "expired")
                                                  and events[n][-1].token == max(granted[n])) for n in names)

                deadline = time.monotonic() + 120
                while not settled() and time.monotonic() < deadline:
                    counted.clear()
                    try:
                        await asyncio.wait_for(counted.wait(), 5)
                    except asyncio.TimeoutError:
                        pass
                took = time.perf_counter() - t0
                for w in watches:
                    w.cancel()
                await asyncio.gather(*watches, return_exceptions=True)
            wrong = {n: p for n in names if (p := problems(events[n], granted[n]))}
            result = {"names": args.names, "changes_seen": total - args.names, "changes_expected": expected,
                      "grants_acknowledged": sum(len(g) for g in granted.values()),
                      "connections_cut": cut, "primary_killed_at_s": round(killed, 3), "seconds": round(took, 3),
                      "changes_per_s": round((total - args.names) / took), "names_wrong": len(wrong)}
            print_result(result, args.json, [f"{n}: {'; '.join(p)}" for n, p in list(wrong.items())[:10]])
            return 1 if wrong else 0
        finally:
            cluster.stop_all()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--names", type=int, default=1000, help="locks watched (default 1000)")
    ap.add_argument("--rounds", type=int, default=50, help="acquire+release of each name (default 50)")
    ap.add_argument("--cuts", type=int, default=3, help="times the watcher's connections are cut (default 3)")
    ap.add_argument("--workers", type=int, default=16, help="writer tasks (default 16)")
    ap.add_argument("--json", help="also write the result here")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
