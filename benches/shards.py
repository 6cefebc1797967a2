"""W2 over 1, 2 and 3 shard processes in one run: pairs/s and server CPU per pair per shard.

    python -m benches.shards [--shards 1,2,3] [--clients 48] [--procs 2] [--seconds 5] [--fsync never]

For each shard count N a ``fastlock serve --shards N`` parent (free ports, a throwaway data
directory, stopped by PID afterwards) runs N shard processes; ``--procs`` client processes
each run ``--clients / --procs`` routing clients (``fastlock.connect``, one connection per
shard each), every client acquiring and releasing its own lock (W2: acquire+release pairs,
many clients) for ``--seconds`` after a 1 s warm-up, at most ``--max-pairs`` pairs per
client.  Printed per N: pairs/s, the shards' CPU microseconds per pair (user + system, from
``/proc``; all shards together), and each shard's CPU per pair of its own names.  The
client processes share the machine's cores with the shards: on a small machine the
clients, not the shards, set the ceiling, which the CPU per pair shows apart from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from fastlock._testbase.servers import ServerProcess
from fastlock.sharding import load_map_file


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_process(address: str, names: list[str], warmup: float, seconds: float, max_pairs: int,
                    start_at: float, out: multiprocessing.Queue) -> None:
    """Run one W2 client per name; put {name: pairs in the measured window} on ``out``."""
    import fastlock

    async def main() -> dict[str, int]:
        clients = [await fastlock.connect(address) for _ in names]
        counts = dict.fromkeys(names, 0)
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        measure_from = loop.time() + warmup
        end = measure_from + seconds

        async def worker(client, name: str) -> None:
            done = 0
            while done < max_pairs:
                await client.release(await client.acquire(name, ttl=10))
                now = loop.time()
                if now >= end:
                    break
                if now >= measure_from:
                    done += 1
            counts[name] = done

        await asyncio.gather(*(worker(c, n) for c, n in zip(clients, names)))
        for c in clients:
            await c.close()
        return counts

    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    out.put(asyncio.run(main()))


def measure(shards: int, clients: int, procs: int, seconds: float, max_pairs: int, fsync: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        parent = ServerProcess(Path(tmp) / "data", fsync=fsync, args=["--shards", str(shards)], log_level="INFO")
        parent.start(timeout=60)
        try:
            shard_map = load_map_file(Path(tmp) / "data" / "shard-map.json")
            for group in shard_map.groups:
                parent.wait_for_log(f"listening on {re.escape(group.addresses[0])}", timeout=60)
            pids = {m.group(1): int(m.group(2)) for line in list(parent.lines)
                    for m in [re.search(r"(shard-\d+) \(pid (\d+)\)", line)] if m}
            names = [f"w2-{i}" for i in range(clients)]
            context = multiprocessing.get_context("spawn")
            out: multiprocessing.Queue = context.Queue()
            warmup = 1.0
            start_at = time.time() + 3.0  # every process connected before the warm-up begins
            workers = [context.Process(target=_client_process,
                                       args=(shard_map.groups[0].addresses[0], names[k::procs], warmup, seconds,
                                             max_pairs, start_at, out)) for k in range(procs)]
            for w in workers:
                w.start()
            time.sleep(max(0.0, start_at + warmup - time.time()))
            cpu0 = {g: _cpu_seconds(pid) for g, pid in pids.items()}
            time.sleep(seconds)
            cpu1 = {g: _cpu_seconds(pid) for g, pid in pids.items()}
            counts: dict[str, int] = {}
            for _ in workers:
                counts.update(out.get(timeout=seconds + 120))
            for w in workers:
                w.join(30)
        finally:
            parent.stop()
    total = sum(counts.values())
    per_shard = {}
    for group in shard_map.groups:
        pairs = sum(n for name, n in counts.items() if shard_map.owner(name).name == group.name)
        cpu = cpu1[group.name] - cpu0[group.name]
        per_shard[group.name] = {"pairs": pairs, "cpu_s": round(cpu, 3),
                                 "cpu_us_per_pair": round(cpu * 1e6 / pairs, 1) if pairs else None}
    cpu_total = sum(cpu1[g] - cpu0[g] for g in cpu0)
    return {"shards": shards, "clients": clients, "procs": procs, "seconds": seconds, "pairs": total,
            "pairs_per_s": round(total / seconds), "server_cpu_us_per_pair": round(cpu_total * 1e6 / max(total, 1), 1),
            "per_shard": per_shard}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.shards", description=__doc__.splitlines()[0])
    ap.add_argument("--shards", default="1,2,3", help="shard counts to run, in order (default 1,2,3)")
    ap.add_argument("--clients", type=int, default=48, help="W2 clients, each on its own lock (default 48)")
    ap.add_argument("--procs", type=int, default=2, help="client processes (default 2)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per shard count (default 5)")
    ap.add_argument("--max-pairs", type=int, default=1_000_000, help="most pairs per client (default 1,000,000)")
    ap.add_argument("--fsync", default="never", choices=("never", "always", "interval"))
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.shards.split(",")):
        row = measure(n, args.clients, args.procs, args.seconds, args.max_pairs, args.fsync)
        rows.append(row)
        shards = "  ".join(f"{g}: {s['pairs']} pairs, {s['cpu_us_per_pair']} us/pair"
                           for g, s in row["per_shard"].items())
        print(f"{n} shard(s): {row['pairs_per_s']:>7} pairs/s  server CPU {row['server_cpu_us_per_pair']} us/pair  "
              f"[{shards}]", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"machine: {os.cpu_count()} cores; fsync {args.fsync}; {args.clients} clients in {args.procs} processes",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
