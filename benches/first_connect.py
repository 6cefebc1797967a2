"""New clients that start in the middle of a kill -9 failover (issue 24).

    python -m benches.first_connect [--trials 100] [--run-trials 20] [--failover-after 1] [--grace 1]
    python -m benches.first_connect --group [--coordinator-ttl 2] [--trials 20] [--run-trials 5]
    (either) [--wait 20] [--seed N] [--json PATH]

Pair (default): each trial starts a new primary and standby (empty data dirs) (``fastlock serve``
on 127.0.0.1, free ports, ``--failover-after F --promotion-grace G`` on the standby,
through :class:`fastlock._testbase.cluster.Cluster`), SIGKILLs the primary, waits a
random moment in [0, F + 1 s] (the failover window plus a second; seeded), then starts
a NEW client listing both addresses - ``fastlock.connect(A, B)`` + ``acquire(wait=W)``
- and times it: client start -> lock granted, and kill -> lock granted.  Both
servers are stopped by PID after each trial.  ``--run-trials`` more trials start
``fastlock run NAME --wait W --server A --server B -- true`` instead (a process:
its time includes the interpreter's start) and record its exit status.

Group (``--group``): one throwaway etcd member (tests/etcdserver.py) and three
``fastlock serve --coordinator`` nodes, started once; each trial waits until one node
is an unfenced primary with both others following it, SIGKILLs that primary, waits
a random moment in [0, TTL + 2 s] (the lease TTL, a standby's next step, a second),
starts the new client listing all three addresses, then restarts the killed node
with the same flags (it rejoins by itself) before the next trial.

Printed: successes out of trials, time to the lock (median, p99, max) and every
failure's error.  Bounds: every wait has a deadline (a trial's client at most W +
the connect timeout + 5 s; a cluster that does not settle within 30 s ends the
run); every process is stopped in ``finally`` blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import fastlock
from fastlock._testbase.cluster import Cluster, status_of
from fastlock._testbase.servers import ServerProcess
from fastlock.errors import FastlockError

CONNECT_TIMEOUT = 1.0  # seconds, the new client's per-address connect and handshake timeout
SETTLE_TIMEOUT = 30.0  # seconds a group may take to have one primary followed by both others


@dataclass
class Trial:
    """One new client started during a failover."""

    index: int
    how: str  # "client" (connect + acquire) or "run" (fastlock run)
    delay_s: float  # the client started this long after the kill
    ok: bool
    to_lock_s: float | None  # client start -> lock granted (run: -> the command ran and exited 0)
    error: str = ""


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100.0 * len(ordered)) - 1))]


async def _client_trial(addresses: list[str], name: str, wait: float) -> None:
    async with fastlock.connect(*addresses, client_name="first-connect", connect_timeout=CONNECT_TIMEOUT) as client:
        lease = await client.acquire(name, ttl=5.0, wait=wait)
        await client.release(lease)


def _run_trial(addresses: list[str], name: str, wait: float, env: dict[str, str]) -> None:
    argv = [sys.executable, "-m", "fastlock", "run", name, "--wait", f"{wait:g}", "--ttl", "5"]
    for a in addresses:
        argv += ["--server", a]
    out = subprocess.run([*argv, "--", "true"], capture_output=True, text=True, timeout=wait + 30,
                         cwd=tempfile.gettempdir(), env=env)
    if out.returncode != 0:
        raise RuntimeError(f"fastlock run exited {out.returncode}: {out.stderr.strip()[-300:]}")


async def _one(index: int, how: str, delay: float, killed_at: float, addresses: list[str], wait: float) -> Trial:
    """Start the new client ``delay`` s after ``killed_at`` (monotonic) and time it."""
    await asyncio.sleep(max(0.0, killed_at + delay - time.monotonic()))
    started = time.monotonic()
    name = f"first-connect-{index}"
    try:
        if how == "client":
            await asyncio.wait_for(_client_trial(addresses, name, wait), wait + CONNECT_TIMEOUT + 5.0)
        else:
            await asyncio.to_thread(_run_trial, addresses, name, wait, dict(os.environ))
    except (FastlockError, OSError, RuntimeError, asyncio.TimeoutError, subprocess.TimeoutExpired) as exc:
        return Trial(index, how, delay, False, None, f"{type(exc).__name__}: {exc}"[:400])
    return Trial(index, how, delay, True, time.monotonic() - started)


async def run_pair(args: argparse.Namespace, rng: random.Random, log) -> list[Trial]:
    root = tempfile.mkdtemp(prefix="fastlock-first-connect-")
    cluster = Cluster(root)
    trials: list[Trial] = []
    try:
        plan = ["client"] * args.trials + ["run"] * args.run_trials
        for i, how in enumerate(plan):
            p = cluster.primary("primary")
            s = cluster.standby(p.address, "standby", failover_after=args.failover_after, grace=args.grace)
            try:
                delay = rng.uniform(0.0, args.failover_after + 1.0)
                p.kill()
                trial = await _one(i, how, delay, time.monotonic(), [p.address, s.address], args.wait)
            finally:
                for srv in (p, s):
                    srv.stop(5)
                    shutil.rmtree(srv.data_dir, ignore_errors=True)  # the next trial's pair starts afresh
            trials.append(trial)
            log(f"{how} {i + 1}: started {delay:.2f} s after the kill, "
                + (f"lock after {trial.to_lock_s:.3f} s" if trial.ok else f"FAILED {trial.error}"))
    finally:
        cluster.stop_all()
    return trials


async def _settled(nodes: dict[str, ServerProcess], deadline_s: float) -> str:
    """The name of the one unfenced primary, once both other nodes follow it synced."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        sts = {}
        for name, srv in nodes.items():
            if srv.alive:
                try:
                    sts[name] = await asyncio.wait_for(status_of(srv.address), 1.0)
                except (OSError, FastlockError, asyncio.TimeoutError):
                    pass
        primaries = [n for n, st in sts.items() if st["role"] == "primary" and not st["replication"]["fenced"]]
        if len(primaries) == 1 and len(sts) == len(nodes):
            address = nodes[primaries[0]].address
            if all(st["role"] == "standby" and st["replication"].get("primary") == address
                   and st["replication"].get("synced") for n, st in sts.items() if n != primaries[0]):
                return primaries[0]
        await asyncio.sleep(0.05)
    raise TimeoutError(f"the group did not settle within {deadline_s} s")


async def run_group(args: argparse.Namespace, rng: random.Random, log) -> list[Trial]:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "tests"))
    from etcdserver import EtcdServer, unique_prefix

    root = tempfile.mkdtemp(prefix="fastlock-first-connect-group-")
    etcd = EtcdServer().start()
    cluster = Cluster(root)
    trials: list[Trial] = []
    try:
        url = f"etcd://{etcd.address}{unique_prefix()}"
        nodes: dict[str, ServerProcess] = {}
        for name in ("a", "b", "c"):
            flags = ["--coordinator", url, "--node-id", name, "--coordinator-ttl", str(args.coordinator_ttl),
                     "--promotion-grace", f"{args.grace:g}"]
            nodes[name] = cluster.primary(name, args=flags)
        plan = ["client"] * args.trials + ["run"] * args.run_trials
        for i, how in enumerate(plan):
            primary = await _settled(nodes, SETTLE_TIMEOUT)
            addresses = [srv.address for srv in nodes.values()]
            delay = rng.uniform(0.0, args.coordinator_ttl + 2.0)
            nodes[primary].kill()
            trial = await _one(i, how, delay, time.monotonic(), addresses, args.wait)
            nodes[primary] = cluster.restart(nodes[primary])
            trials.append(trial)
            log(f"{how} {i + 1}: killed {primary}, started {delay:.2f} s after the kill, "
                + (f"lock after {trial.to_lock_s:.3f} s" if trial.ok else f"FAILED {trial.error}"))
    finally:
        cluster.stop_all()
        etcd.stop()
    return trials


def _figures(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 3), "p99": round(_pct(values, 99), 3),
            "max": round(max(values), 3)}


def summary(trials: list[Trial]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for how in ("client", "run"):
        mine = [t for t in trials if t.how == how]
        if not mine:
            continue
        times = [t.to_lock_s for t in mine if t.ok and t.to_lock_s is not None]
        since_kill = [t.delay_s + t.to_lock_s for t in mine if t.ok and t.to_lock_s is not None]
        out[how] = {
            "trials": len(mine), "successes": len(times),
            "to_lock_s": _figures(times), "kill_to_lock_s": _figures(since_kill),
            "failures": [asdict(t) for t in mine if not t.ok],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.first_connect", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=100, help="new asyncio clients (default 100)")
    ap.add_argument("--run-trials", type=int, default=20, help="`fastlock run` processes (default 20)")
    ap.add_argument("--group", action="store_true", help="an etcd-arbitrated group of three instead of a pair")
    ap.add_argument("--failover-after", type=float, default=1.0, help="pair: the standby's --failover-after (1)")
    ap.add_argument("--coordinator-ttl", type=int, default=2, help="group: --coordinator-ttl, whole seconds (2)")
    ap.add_argument("--grace", type=float, default=1.0, help="--promotion-grace, seconds (default 1)")
    ap.add_argument("--wait", type=float, default=20.0, help="the new client's acquire wait, seconds (20)")
    ap.add_argument("--seed", type=int, default=24)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.trials < 0 or args.run_trials < 0 or args.trials + args.run_trials == 0:
        ap.error("--trials and --run-trials must be >= 0, not both 0")
    rng = random.Random(args.seed)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    trials = asyncio.run((run_group if args.group else run_pair)(args, rng, log))
    result = {"shape": "group" if args.group else "pair", "wait_s": args.wait, "grace_s": args.grace,
              "failover_after_s": None if args.group else args.failover_after,
              "coordinator_ttl_s": args.coordinator_ttl if args.group else None, **summary(trials)}
    for how in ("client", "run"):
        r = result.get(how)
        if r:
            t, k = r["to_lock_s"] or {}, r["kill_to_lock_s"] or {}
            print(f"{result['shape']} {how}: {r['successes']}/{r['trials']} got the lock; client start -> lock "
                  f"median {t.get('median')} s, p99 {t.get('p99')} s, max {t.get('max')} s; kill -> lock median "
                  f"{k.get('median')} s, max {k.get('max')} s")
            for f in r["failures"][:10]:
                print(f"  failed: trial {f['index']} (started {f['delay_s']:.2f} s after the kill): {f['error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(result[h]["successes"] == result[h]["trials"] for h in ("client", "run") if h in result) else 1


if __name__ == "__main__":
    sys.exit(main())
