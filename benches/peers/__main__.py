"""fastlock against Redis, etcd, ZooKeeper and PostgreSQL advisory locks (issues 6 and 12).

    python -m benches.peers [--all] [--rounds 2] [--quick] [--no-install] [--out DIR] [--markdown [PATH]]
    python -m benches.peers --only redis,postgres --quick

Installs what is missing (Debian packages and Python clients, see
``benches/peers/install.py``), starts every server itself on 127.0.0.1 with a
throwaway data dir and a free port, runs the same closed-loop workloads
(``benches/harness.py``) from ONE client process, stops the servers, and writes
``benches/results/<timestamp>/`` with results.md, results.json and PNG plots.

Rows (systems): echo floor (calibration), fastlock (fsync=always, the default;
fsync=never), redis SET NX and redis-py Lock (no persistence), etcd with a lease
per acquisition and with one lease per client, ZooKeeper via kazoo's Lock
(threads), PostgreSQL advisory locks.  W4 (durability-matched, W1+W2): fastlock
fsync=always vs Redis appendfsync=always vs etcd; fastlock fsync=interval (1 s)
vs Redis appendfsync=everysec.

``--rounds N`` (default 2) measures every system N times, interleaved: each
round runs every system once (fresh servers), in an order rotated by the round
number; the tables show the median of the rounds, results.json keeps each
round's rows (``round_rows``) and each figure's min, max and values
(``spread``).  Each round starts with the fsync probe (``benches/fsync_probe.py``)
in the directory where fastlock's data dir is made.  The verdicts of issue 12's and
issue 27's targets (``benches/peers/goals.py``) are printed last and stored under
``verdicts``; ``--markdown`` prints (or writes) the README's comparison table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import logging
import os
import sys
import tempfile
import time

from benches import fsync_probe, harness
from benches.echo import EchoTarget
from benches.load import FastlockTarget, fastlock_available
from benches.peers import goals, install, report, rounds

SYSTEMS = ("fastlock", "redis", "etcd", "zookeeper", "postgres")


def _targets(systems: list[str], args) -> tuple[list[harness.Target], list[harness.Target]]:
    """(main targets for W1-W3, extra targets for W4 only)."""
    from benches.peers.etcd_peer import EtcdTarget
    from benches.peers.postgres_peer import PostgresTarget
    from benches.peers.redis_peer import RedisTarget
    from benches.peers.zookeeper_peer import ZookeeperTarget

    retry = args.redis_retry_ms / 1e3
    main: list[harness.Target] = []
    w4: list[harness.Target] = []
    if "fastlock" in systems:
        main += [FastlockTarget(fsync="always"), FastlockTarget(fsync="never")]
        w4 += [FastlockTarget(fsync="interval")]
    if "redis" in systems:
        main += [RedisTarget(recipe="setnx", retry=retry), RedisTarget(recipe="redis-py", retry=retry)]
        w4 += [RedisTarget(recipe="setnx", persistence="always", retry=retry),
               RedisTarget(recipe="setnx", persistence="everysec", retry=retry)]
    if "etcd" in systems:
        main += [EtcdTarget(per_client_lease=False), EtcdTarget(per_client_lease=True)]
    if "zookeeper" in systems:
        main += [ZookeeperTarget()]
    if "postgres" in systems:
        main += [PostgresTarget()]
    return main, w4


def _plan(systems: list[str], args, wls: dict[str, harness.Workload]) -> list[tuple[harness.Target, list]]:
    """Fresh targets for one round, each with the workloads it runs (W4 targets: W1 and W2 only)."""
    main_targets, w4_targets = _targets(systems, args)
    plan: list[tuple[harness.Target, list]] = [(EchoTarget(use_uvloop=args.uvloop), list(wls.values()))]
    plan += [(t, list(wls.values())) for t in main_targets]
    if args.w4:
        plan += [(t, [wls["W1"], wls["W2"]]) for t in w4_targets]
    return plan


def _probe(count: int, log) -> dict:
    """The fsync probe in the directory where the targets make their data dirs."""
    where = tempfile.gettempdir()
    try:
        p = fsync_probe.probe(where, count)
    except OSError as e:
        log(f"  fsync probe in {where} failed: {e}")
        return {"dir": where, "error": f"{type(e).__name__}: {e}"}
    log(f"  fsync probe in {where}: 4 KiB write + fdatasync p50/p99 append {p['append']['p50']:.0f}/"
        f"{p['append']['p99']:.0f} µs, overwrite (preallocated) {p['overwrite']['p50']:.0f}/"
        f"{p['overwrite']['p99']:.0f} µs")
    return p


def _write_markdown(dest: str, text: str) -> None:
    if dest == "-":
        print(text)
    else:
        with open(dest, "w") as f:
            f.write(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sel = ap.add_mutually_exclusive_group()
    sel.add_argument("--all", action="store_true", help="fastlock and all four peers (the default)")
    sel.add_argument("--only", help=f"comma list of {','.join(SYSTEMS)} (the echo floor always runs)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="measure every system this many times, interleaved; tables show medians (default 2)")
    ap.add_argument("--probe-count", type=int, default=2000,
                    help="4 KiB write + fdatasync operations per shape in each round's fsync probe (default 2000)")
    ap.add_argument("--quick", action="store_true", help="3 s per workload after 1 s warmup (~4-5 min a round)")
    ap.add_argument("--duration", type=float, default=None, help="seconds measured per workload (default 10; "
                    "--quick 3)")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before measuring (default 2; --quick 1)")
    ap.add_argument("--concurrency", type=int, default=32, help="W2 clients (default 32); W3 uses 16")
    ap.add_argument("--w3-clients", type=int, default=16)
    ap.add_argument("--hold", type=float, default=1.0, help="W3 hold in ms (default 1)")
    ap.add_argument("--redis-retry-ms", type=float, default=1.0,
                    help="retry sleep of the Redis recipes while waiting (default 1 ms)")
    ap.add_argument("--no-w4", dest="w4", action="store_false", help="skip the durability-matched runs")
    ap.add_argument("--no-install", dest="install", action="store_false",
                    help="do not apt-get/pip install anything; skip what is missing")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--uvloop", dest="uvloop", action="store_true", default=True)
    g.add_argument("--no-uvloop", dest="uvloop", action="store_false")
    ap.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                    help="wait up to S seconds for other processes to go idle before starting (default 0)")
    ap.add_argument("--out", help="results folder (default benches/results/<timestamp>)")
    ap.add_argument("--json", metavar="PATH", help="also write results.json to PATH")
    ap.add_argument("--markdown", nargs="?", const="-", metavar="PATH",
                    help="print the README's comparison table and the verdicts as markdown (or write them to PATH)")
    args = ap.parse_args(argv)
    if not 1 <= args.rounds <= 20:
        ap.error(f"--rounds must be from 1 to 20, not {args.rounds}")
    if not 1 <= args.probe_count <= fsync_probe.MAX_COUNT:
        ap.error(f"--probe-count must be from 1 to {fsync_probe.MAX_COUNT}, not {args.probe_count}")

    systems = list(SYSTEMS) if not args.only else [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown system(s) {bad}; choose from {SYSTEMS}")
    duration = args.duration if args.duration is not None else (3.0 if args.quick else 10.0)
    warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 2.0)
    out = args.out or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                                   _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    say = lambda s: print(s, flush=True)  # noqa: E731
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("kazoo").setLevel(logging.ERROR)   # it logs every reconnect during server start-up

    t0 = time.monotonic()
    skipped: dict[str, str] = {}
    peer_systems = [s for s in systems if s != "fastlock"]
    skipped.update(install.ensure(peer_systems, log=say, allow_install=args.install))
    if "fastlock" in systems:
        why = fastlock_available()
        if why:
            skipped["fastlock"] = why
    for s, why in skipped.items():
        say(f"skipping {s}: {why}")
    systems = [s for s in systems if s not in skipped]

    wls = harness.standard_workloads(duration, warmup, w2_clients=args.concurrency, w3_clients=args.w3_clients,
                                     hold=args.hold / 1e3)
    busy = harness.wait_for_quiet(args.quiet_wait, log=say)
    say(f"W1/W2/W3: {duration:g} s each after {warmup:g} s warmup; {args.rounds} round(s) interleaved; "
        f"uvloop={args.uvloop}; results -> {out}")
    raw: list[dict] = []
    probes: list[dict] = []
    plan: list[tuple[harness.Target, list]] = []
    current = -1
    for r, i in rounds.schedule(list(range(len(_plan(systems, args, wls)))), args.rounds):
        if r != current:                 # a new round: fresh targets, a fresh probe
            current = r
            say(f"round {r + 1}/{args.rounds}")
            plan = _plan(systems, args, wls)
            probes.append(dict(_probe(args.probe_count, say), round=r))
        target, workloads = plan[i]
        raw += [dict(row, round=r) for row in harness.run_target(target, workloads, use_uvloop=args.uvloop, log=say)]
    elapsed = time.monotonic() - t0
    payload = {
        "command": "python -m benches.peers " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": harness.machine_info(), "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "elapsed_s": round(elapsed, 1), "duration_s": duration, "warmup_s": warmup, "hold_ms": args.hold,
        "w2_clients": args.concurrency, "w3_clients": args.w3_clients, "redis_retry_ms": args.redis_retry_ms,
        "uvloop": args.uvloop, "skipped": skipped, "busy_before_pct": busy, "rounds": args.rounds,
        "rows": rounds.merge_rows(raw), "round_rows": raw,
        "fsync_probe": rounds.merge_probes([p for p in probes if "error" not in p]), "fsync_probes": probes,
    }
    payload["verdicts"] = goals.verdicts(payload, goals.ALL_GOALS)
    harness.write_json(os.path.join(out, "results.json"), payload)
    if args.json:
        harness.write_json(args.json, payload)
    md = report.markdown(payload)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md)
    pngs = report.plots(payload, out)
    comparison = goals.comparison_markdown(payload) + "\n" + goals.verdict_markdown(payload["verdicts"])
    with open(os.path.join(out, "comparison.md"), "w") as f:
        f.write(comparison)
    print()
    print(md)
    say("Targets (issue 12):")
    for line in goals.verdict_lines(payload["verdicts"]):
        say("  " + line)
    if args.markdown:
        _write_markdown(args.markdown, comparison)
    say(f"\nwrote {out}/results.md, comparison.md, results.json"
        f"{', ' + ', '.join(os.path.basename(p) for p in pngs) if pngs else ''} in {elapsed:.0f} s")
    return 0 if not any(r.get("workload") == "start" for r in raw) else 1

if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # servers were stopped by the finally blocks on the way out
        print("interrupted", file=sys.stderr)
        sys.exit(130)
