"""Prefix watches that resume: every key change seen once and in order across cut connections and a kill -9.

    python -m benches.key_watch_resume [--keys 1000] [--rounds 50] [--cuts 3] [--workers 16] [--json PATH]

Starts a synchronous pair (``--replication sync``, ``--failover-after 1``), one
watcher client with one prefix watch over ``--keys`` keys through TCP proxies, and
one writer client that, ``--rounds`` times for each group of four keys, takes a
lease, puts the four keys on it and releases it: eight key changes, the last four
under one record (``keys * rounds * 2`` changes, 100,000 by default).  While the
changes flow it cuts the watcher's connections ``--cuts`` times, then SIGKILLs the
primary; the standby promotes and the watch resumes there (docs/watches.md).  Then it
checks: positions (revision, offset) strictly increase (no change delivered twice or
out of order), every put the writer was told of and every key of a released lease is
there, and the keys the events leave equal the keys the promoted node lists.  Prints
the counts, the time and the rate; exit status 1 if anything is wrong.
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

GROUP = 4  # keys on one lease


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="fastlock-key-watch-resume-") as root:
        cluster = Cluster(root)
        try:
            primary = cluster.primary(args=["--replication", "sync"])
            standby = cluster.standby(primary.address, failover_after=1.0)
            proxies = [cluster.proxy(primary.address), cluster.proxy(standby.address)]
            groups = args.keys // GROUP
            events: list = []
            view: dict[str, bytes] = {}
            acked: set[tuple[str, str, bytes | None]] = set()
            counted = asyncio.Event()
            started = asyncio.Event()
            async with fastlock.connect(*(p.address for p in proxies), client_name="watcher", connect_timeout=1.0,
                                        request_timeout=30.0) as wc, \
                    fastlock.connect(primary.address, standby.address, client_name="writer", connect_timeout=1.0,
                                     request_timeout=30.0) as writer:
                async def watch() -> None:
                    async for event in wc.watch_prefix("kb/", progress=True):
                        started.set()
                        if event.what == "progress":
                            continue
                        events.append(event)
                        if event.what == "put":
                            view[event.key] = event.value
                        else:
                            view.pop(event.key, None)
                        counted.set()

                watching = asyncio.ensure_future(watch())
                await asyncio.wait_for(started.wait(), 60)

                async def work(part: range) -> None:
                    for r in range(args.rounds):
                        for g in part:
                            try:
                                lease = await writer.acquire(f"kb-lease/{g}", ttl=3.0, wait=60.0)
                            except FastlockError:
                                continue
                            try:
                                for k in range(GROUP):
                                    key, value = f"kb/{g}/{k}", b"%d" % r
                                    await writer.put(key, value, lease=lease)
                                    acked.add(("put", key, value))
                                await writer.release(lease)
                                acked.update(("ended", f"kb/{g}/{k}", None) for k in range(GROUP))
                            except FastlockError:
                                pass  # lost with the primary: the lease expires on the promoted node

                expected = groups * args.rounds * GROUP * 2
                t0 = time.perf_counter()
                writing = asyncio.ensure_future(asyncio.gather(*(work(range(i, groups, args.workers))
                                                                 for i in range(args.workers))))
                cut = 0
                killed = 0.0
                for k in range(1, args.cuts + 2):
                    while len(events) < expected * k // (args.cuts + 3) and not writing.done():
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
                deadline = time.monotonic() + 120
                while view and time.monotonic() < deadline:  # every lease ends: its keys go
                    counted.clear()
                    try:
                        await asyncio.wait_for(counted.wait(), 5)
                    except asyncio.TimeoutError:
                        pass
                took = time.perf_counter() - t0
                listed = {kv.key: kv.value for kv in await writer.list_prefix("kb/", limit=10_000)}
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)
            at = [(e.revision, e.offset) for e in events]
            seen = {("ended" if e.what in ("released", "expired") else e.what, e.key, e.value) for e in events}
            problems = []
            if at != sorted(set(at)):
                problems.append("positions repeat or go back")
            missing = acked - seen
            if missing:
                problems.append(f"{len(missing)} acknowledged changes never seen, e.g. {sorted(missing)[:3]}")
            if view != listed:
                problems.append(f"the view has {len(view)} keys, the server {len(listed)}")
            result = {"keys": groups * GROUP, "changes_seen": len(events), "changes_expected": expected,
                      "changes_acknowledged": len(acked), "records_with_several_changes":
                      len({r for r, o in at if o}), "connections_cut": cut,
                      "primary_killed_at_s": round(killed, 3), "seconds": round(took, 3),
                      "changes_per_s": round(len(events) / took), "problems": len(problems)}
            print_result(result, args.json, problems)
            return 1 if problems else 0
        finally:
            cluster.stop_all()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1000, help="keys watched, in groups of 4 on a lease (default 1000)")
    ap.add_argument("--rounds", type=int, default=50, help="lease, 4 puts, release of each group (default 50)")
    ap.add_argument("--cuts", type=int, default=3, help="times the watcher's connections are cut (default 3)")
    ap.add_argument("--workers", type=int, default=16, help="writer tasks (default 16)")
    ap.add_argument("--json", help="also write the result here")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
