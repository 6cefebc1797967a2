"""Failover time of a group whose primary etcd names (issue 16).

    python -m benches.etcd_failover [--kills 20] [--ttl 2] [--lock-ttl 1.0] [--promotion-grace G] [--json PATH]

One throwaway etcd member (tests/etcdserver.py: the ``etcd`` binary, Debian's
``etcd-server``) and three ``fastlock serve --coordinator`` nodes on 127.0.0.1,
always stopped in ``finally`` blocks; every wait has a deadline.  ``--kills``
times: take a lock of ``--lock-ttl`` on the primary, SIGKILL it, and measure on
this process's monotonic clock

- kill -> another node reports itself an unfenced primary (STATUS, polled every 10 ms);
- kill -> the first grant of a free lock by it (retried through its grace period);

then restart the killed node (it rejoins as a standby) before the next kill.
Expected: at most the etcd lease TTL (the dead primary's lease runs out, a
standby's next step a quarter TTL later at most takes the key) for the first,
plus the grace period (default: the longest TTL seen) for the second.  The
epoch of each new primary is checked to be above the previous one, and every
token above every earlier token.
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
from typing import Any

from fastlock._testbase.cluster import Cluster, RawNode, status_of
from fastlock._testbase.servers import ServerProcess
from fastlock.errors import FastlockError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "tests"))
from etcdserver import EtcdServer, unique_prefix


async def _statuses(nodes: dict[str, ServerProcess]) -> dict[str, dict]:
    out = {}
    for name, srv in nodes.items():
        if srv.alive:
            try:
                out[name] = await asyncio.wait_for(status_of(srv.address), 1.0)
            except (OSError, FastlockError, asyncio.TimeoutError):
                pass
    return out


async def _primary(nodes: dict[str, ServerProcess], deadline_s: float) -> tuple[str, dict]:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = [(n, st) for n, st in (await _statuses(nodes)).items()
                 if st["role"] == "primary" and not st["replication"]["fenced"]]
        if len(found) == 1:
            return found[0]
        await asyncio.sleep(0.01)
    raise TimeoutError(f"no single primary after {deadline_s} s")


async def _grant(address: str, name: str, ttl_ms: int, deadline_s: float) -> int:
    deadline = time.monotonic() + deadline_s
    node = await RawNode.open(address)
    try:
        while True:
            try:
                return (await node.acquire(name, ttl_ms, wait_ms=100))[0]
            except FastlockError:
                if time.monotonic() > deadline:
                    raise
    finally:
        await node.close()


async def _standbys_follow(nodes: dict[str, ServerProcess], primary: str, deadline_s: float) -> None:
    address = nodes[primary].address
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        sts = await _statuses({n: s for n, s in nodes.items() if n != primary})
        if len(sts) == len(nodes) - 1 and all(st["role"] == "standby" and st["replication"]["primary"] == address
                                              and st["replication"]["synced"] for st in sts.values()):
            return
        await asyncio.sleep(0.02)
    raise TimeoutError("the standbys did not follow the primary")


async def run(args: argparse.Namespace, log) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="fastlock-etcd-bench-")
    etcd = EtcdServer().start()
    cluster = Cluster(root)
    try:
        url = f"etcd://{etcd.address}{unique_prefix()}"
        extra = ["--promotion-grace", str(args.promotion_grace)] if args.promotion_grace is not None else []
        nodes = {}
        for name in ("a", "b", "c"):
            nodes[name] = cluster._start(ServerProcess(
                os.path.join(root, name), args=["--name", name, *cluster.auth_args(name), "--coordinator", url,
                                                "--node-id", name, "--coordinator-ttl", str(args.ttl), *extra]))
        ttl_ms = round(args.lock_ttl * 1000)
        to_primary, to_grant = [], []
        last_token = last_epoch = 0
        for i in range(args.kills):
            name, st = await _primary(nodes, 30)
            await _standbys_follow(nodes, name, 30)
            token = await _grant(nodes[name].address, f"held-{i}", ttl_ms, 30)
            assert token > last_token and st["epoch"] >= last_epoch, (token, last_token, st["epoch"], last_epoch)
            last_token, last_epoch = token, st["epoch"]
            nodes[name].kill()
            killed = time.monotonic()
            rest = {n: s for n, s in nodes.items() if n != name}
            new, st2 = await _primary(rest, 30)
            t_role = time.monotonic() - killed
            token2 = await _grant(nodes[new].address, f"free-{i}", ttl_ms, 30)
            t_grant = time.monotonic() - killed
            assert st2["epoch"] > last_epoch and token2 > last_token, (st2["epoch"], last_epoch, token2, last_token)
            last_token, last_epoch = token2, st2["epoch"]
            to_primary.append(t_role * 1000)
            to_grant.append(t_grant * 1000)
            log(f"kill {i + 1}: {name} -> {new} primary after {t_role * 1000:.0f} ms, first free grant after "
                f"{t_grant * 1000:.0f} ms (epoch {st2['epoch']})")
            nodes[name] = cluster.restart(nodes[name])
        return {
            "kills": args.kills, "etcd_ttl_s": args.ttl, "lock_ttl_s": args.lock_ttl,
            "promotion_grace_s": args.promotion_grace,
            "kill_to_primary_ms": {"median": statistics.median(to_primary), "max": max(to_primary)},
            "kill_to_first_grant_ms": {"median": statistics.median(to_grant), "max": max(to_grant)},
        }
    finally:
        cluster.stop_all()
        etcd.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.etcd_failover", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--ttl", type=int, default=2, help="etcd lease TTL, whole seconds (default 2)")
    ap.add_argument("--lock-ttl", type=float, default=1.0, help="TTL of the locks taken, seconds (default 1)")
    ap.add_argument("--promotion-grace", type=float, default=None,
                    help="the nodes' --promotion-grace (default: theirs, the longest TTL seen)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    result = asyncio.run(run(args, lambda msg: print(msg, flush=True)))
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
