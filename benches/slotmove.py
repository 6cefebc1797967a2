"""How long a slot move freezes its slots, by the number of leases in them (issue 30).

    python -m benches.slotmove [--leases 0,100,1000] [--runs 3]

One throwaway etcd member (tests/etcdserver.py) holds the shard map of two lone groups
(``fastlock serve --shard-map etcd://... --fsync never``, open mode).  Per run, one client
takes N leases on names of one slot of g0 (hash-tagged: ``{bench-K}:i``), then
``fastlock.cli.shardmove.move_slots`` moves that slot to g1 and reports ``freeze_ms``: from the
mark written to etcd to the flip written (the time a request for the slot is held).  Then one of
the moved leases is extended through the routing client (re-routed to g1, timed too).  Prints one
line per run and a JSON summary.  Every wait has a deadline; servers and etcd are stopped in a
``finally`` block.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import fastlock
from fastlock._testbase.proxy import free_port
from fastlock._testbase.servers import ServerProcess
from fastlock.cli.shardmove import move_slots
from fastlock.coordination.shardmap import load_from_etcd
from fastlock.sharding import ShardGroup, ShardMap, even_ranges, slot_of

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "tests"))
from etcdserver import EtcdServer, unique_prefix


async def one_run(url: str, address: str, tag: str, leases: int) -> dict:
    stored = await load_from_etcd(url)
    try:
        async with fastlock.connect(address, session=False) as client:
            names = [f"{{{tag}}}:{i}" for i in range(leases)]
            held = []
            for k in range(0, leases, 200):
                held += await asyncio.gather(*(client.acquire(n, ttl=600) for n in names[k:k + 200]))
            slot = slot_of(f"{{{tag}}}:x")
            started = time.monotonic()
            report = await asyncio.wait_for(move_slots(stored, slot, slot, "g1"), 120)
            total_ms = (time.monotonic() - started) * 1000.0
            extend_ms = None
            if held:
                t = time.monotonic()
                await client.extend(held[0], ttl=600)
                extend_ms = (time.monotonic() - t) * 1000.0
            for lease in held:
                await client.release(lease)
            return {"leases": leases, "shipped": report.leases, "freeze_ms": round(report.freeze_ms or 0, 1),
                    "command_ms": round(total_ms, 1), "first_extend_ms": extend_ms and round(extend_ms, 1)}
    finally:
        await stored.gateway.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", default="0,100,1000", help="lease counts, comma-separated")
    parser.add_argument("--runs", type=int, default=3, help="runs per lease count")
    args = parser.parse_args()
    counts = [int(x) for x in args.leases.split(",")]
    etcd = EtcdServer().start()
    servers: list[ServerProcess] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            url = f"etcd://{etcd.address}{unique_prefix()}"
            ports = [free_port(), free_port()]
            shard_map = ShardMap(1, tuple(ShardGroup(f"g{k}", (f"127.0.0.1:{ports[k]}",)) for k in range(2)),
                                 even_ranges(["g0", "g1"]))

            async def create() -> None:
                stored = await load_from_etcd(url)
                try:
                    await stored.create(shard_map)
                finally:
                    await stored.gateway.close()

            asyncio.run(create())
            for k in range(2):
                server = ServerProcess(Path(tmp) / f"g{k}", fsync="never", port=ports[k],
                                       args=["--shard-map", url, "--shard-group", f"g{k}"])
                servers.append(server)
                server.start()
            results = []
            run = 0
            for count in counts:
                for _ in range(args.runs):
                    run += 1
                    tag = next(f"bench-{run}-{i}" for i in range(100_000)
                               if shard_map.owner(f"{{bench-{run}-{i}}}:x").name == "g0")
                    result = asyncio.run(one_run(url, servers[0].address, tag, count))
                    print(json.dumps(result), flush=True)
                    results.append(result)
            summary = {str(c): {"freeze_ms_median": statistics.median(r["freeze_ms"] for r in results
                                                                      if r["leases"] == c),
                                "freeze_ms_max": max(r["freeze_ms"] for r in results if r["leases"] == c)}
                       for c in counts}
            print(json.dumps({"summary": summary}))
    finally:
        for server in servers:
            if server.proc is not None:
                server.stop()
        etcd.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
