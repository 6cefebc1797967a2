"""Synchronous replication: W1/W2/W3 with no standby, an async standby and a sync standby,
and failover time (kill -9 -> first grant of a free lock) with sync vs async replication.

    python -m benches.sync [--rounds 2] [--duration 2] [--warmup 0.5] [--fsync always]
        [--sync-ack fsynced] [--workloads W1,W2,W3] [--runs 5] [--failover-after 1.0]
        [--only load,failover] [--json PATH]

Everything runs on 127.0.0.1: ``fastlock serve`` subprocesses on free ports with
throwaway data dirs, stopped in ``finally`` blocks; every wait has a deadline.

load
    The workloads of :mod:`benches.harness` (the same code :mod:`benches.load`
    and :mod:`benches.ab` run) against three set-ups, in one run, rotating the
    order each round: ``none`` (a primary alone), ``async`` (with a standby,
    ``--replication async``, the default) and ``sync`` (with a standby,
    ``--replication sync --sync-ack ACK``).  Medians over rounds, and each set-up
    as a ratio of ``none``:

    - W1: p50 of one acquire+release pair, microseconds (lower is better);
    - W2: acquire+release pairs/s with ``--concurrency`` clients on distinct locks;
    - W3: hand-offs/s with half as many clients on one lock.

failover
    ``--runs`` kills per mode with :func:`benches.failover._one_failover` (8
    clients under load through ``fastlock.connect(primary, standby)``, SIGKILL of
    the primary, then every client asks for a fresh lock until one is granted),
    the standby with ``--failover-after F`` and its default grace: the longest
    TTL it has seen (5 s here) after async replication, none after sync.
    Reported: kill -> ``PROMOTED`` and kill -> first grant, medians and maxima.
    Target for sync: F + 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from typing import Any

from benches import harness
from benches.failover import FastlockWithStandby, _one_failover
from benches.load import FastlockTarget

SETUPS = ("none", "async", "sync")
FIGURE = {"W1": ("pair_us", "p50"), "W2": ("pairs_per_s", None), "W3": ("handoffs_per_s", None)}
UNITS = {"W1": "pair p50 us (lower is better)", "W2": "pairs/s (higher is better)",
         "W3": "hand-offs/s (higher is better)"}


def _target(setup: str, args: argparse.Namespace) -> harness.Target:
    if setup == "none":
        return FastlockTarget(fsync=args.fsync)
    target = FastlockWithStandby(fsync=args.fsync, failover_after=args.failover_after)
    if setup == "sync":
        target.extra_args = ("--replication", "sync", "--sync-ack", args.sync_ack)
        target.name = f"fastlock fsync={args.fsync} + sync standby ({args.sync_ack})"
    return target


def _figure(row: dict[str, Any], workload: str) -> float:
    key, sub = FIGURE[workload]
    value = row.get(key, float("nan"))
    return value.get(sub, float("nan")) if sub else value


def run_load(args: argparse.Namespace, log) -> dict[str, Any]:
    workloads = harness.workloads_from_args(args)
    figures: dict[str, dict[str, list[float]]] = {s: {w.name: [] for w in workloads} for s in SETUPS}
    errors: dict[str, int] = dict.fromkeys(SETUPS, 0)
    for r in range(args.rounds):
        order = SETUPS[r % 3:] + SETUPS[:r % 3]
        for setup in order:
            target = _target(setup, args)
            with harness.running(target):
                for wl in workloads:
                    row = harness.run_workload(target, wl, use_uvloop=args.uvloop)
                    value = _figure(row, wl.name)
                    figures[setup][wl.name].append(value)
                    errors[setup] += row.get("error_count", 0) or 0
                    log(f"  round {r + 1} {setup:<5} {wl.name} {value:>12,.1f}  errors {row.get('error_count')}  "
                        f"cpu % client/servers/other {row.get('client_cpu_pct', float('nan')):.0f}/"
                        f"{row.get('server_cpu_pct', float('nan')):.0f}/{row.get('other_cpu_pct', float('nan')):.0f}")
    medians = {s: {w: statistics.median(v) for w, v in ws.items() if v} for s, ws in figures.items()}
    return {"figures": figures, "medians": medians, "errors": errors}


def run_failover(args: argparse.Namespace, log) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="bench-sync-failover-")
    ns = argparse.Namespace(fsync=args.fsync, failover_after=args.failover_after, promotion_grace=None)
    out: dict[str, Any] = {}
    try:
        runs: dict[str, list[dict]] = {"sync": [], "async": []}
        for i in range(args.runs):
            for mode in ("sync", "async") if i % 2 == 0 else ("async", "sync"):
                extra = ("--replication", "sync", "--sync-ack", args.sync_ack) if mode == "sync" else ()
                r = harness.run_async(_one_failover(len(runs["sync"]) + len(runs["async"]), root, ns, extra),
                                      use_uvloop=args.uvloop)
                assert r["epoch"] >= 1, r
                runs[mode].append(r)
                log(f"  {mode:<5} run {len(runs[mode]):>2}: kill -> PROMOTED {r['promoted_s'] * 1000:7.1f} ms, "
                    f"-> first grant {r['first_grant_s'] * 1000:7.1f} ms")
        for mode, rs in runs.items():
            prom = [r["promoted_s"] for r in rs]
            grant = [r["first_grant_s"] for r in rs]
            out[mode] = {"runs": rs,
                         "promoted_s": {"median": statistics.median(prom), "max": max(prom)},
                         "first_grant_s": {"median": statistics.median(grant), "max": max(grant)}}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.sync", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(ap)
    ap.set_defaults(duration=2.0, warmup=0.5)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the three set-ups, rotating (default 2)")
    ap.add_argument("--fsync", choices=("always", "interval", "never"), default="always")
    ap.add_argument("--sync-ack", choices=("written", "fsynced"), default="fsynced")
    ap.add_argument("--runs", type=int, default=5, help="kills per replication mode (default 5)")
    ap.add_argument("--failover-after", type=float, default=1.0, help="the standby's --failover-after (s)")
    ap.add_argument("--only", default="load,failover", help="comma list of load, failover")
    args = ap.parse_args(argv)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    if only - {"load", "failover"}:
        ap.error(f"unknown --only parts: {sorted(only - {'load', 'failover'})}")

    def log(msg: str) -> None:
        print(msg, flush=True)

    out: dict[str, Any] = {"args": vars(args), "machine": harness.machine_info()}
    if "load" in only:
        log(f"load: {args.workloads} x none/async/sync standby, fsync={args.fsync}, sync-ack={args.sync_ack}, "
            f"{args.duration}+{args.warmup} s each, {args.rounds} rounds")
        out["load"] = run_load(args, log)
    if "failover" in only:
        log(f"failover: {args.runs} kills per mode, --failover-after {args.failover_after}, default grace")
        out["failover"] = run_failover(args, log)
    log("")
    log("summary")
    if "load" in only:
        med = out["load"]["medians"]
        for w in med["none"]:
            none = med["none"][w]
            log(f"  {w}  none {none:>12,.1f}  async {med['async'][w]:>12,.1f} ({med['async'][w] / none:5.2f}x)  "
                f"sync {med['sync'][w]:>12,.1f} ({med['sync'][w] / none:5.2f}x)   {UNITS[w]}")
        log(f"  errors: {out['load']['errors']}")
    if "failover" in only:
        for mode, f in out["failover"].items():
            log(f"  failover {mode:<5} kill -> PROMOTED median {f['promoted_s']['median'] * 1000:.0f} ms "
                f"(max {f['promoted_s']['max'] * 1000:.0f}); kill -> first free grant median "
                f"{f['first_grant_s']['median'] * 1000:.0f} ms (max {f['first_grant_s']['max'] * 1000:.0f}) "
                f"over {len(f['runs'])} kills")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
