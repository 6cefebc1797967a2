"""Slot moves under load: acquire latency before and during ``fastlock shard move``, and the
history checked (issue 30's acceptance: a move under W2+W3 load, 0 violations, no token
going backwards for any name, acquire p99 during the move under 50 ms).

    python -m benches.shard_move [--moves 3] [--before 8] [--after 4] [--workers 4]
        [--pair-workers 4] [--pair-pause 0.005] [--fsync always] [--seed N] [--json PATH] [--keep DIR]

The deployment and the workers are :mod:`benches.shard_nemesis`'s (three etcd groups of a
primary and a standby, the map in etcd, W3 contended ``lock()`` hand-offs with fenced
writes, W2 ``acquire``+``release`` pairs on names of their own, the prober), with no fault
but the moves: after ``--before`` s of load, ``--moves`` moves one after the other, move K
from group ``g{K mod 3}`` to the next group, each of the shortest run of the source's slots
that holds two of the W3 names (leases held, waiters queued:
:meth:`benches.shard_nemesis.ShardNemesis.plan_move`), then ``--after`` s of load.

Printed:

* per move: its slots, source and destination, the leases and waiter queues shipped, the
  freeze (ms from the mark to the flip, the move's report) and the move's duration, and when
  each step of the freeze ended (ms after the mark's transaction was sent: the mark's and the
  flip's transactions, each primary serving the mark and the flip, the ship; the report's
  ``phases_ms``);
* acquire latency (ms, from the acquire sent to the grant received) of the W2 pairs and of the
  prober, p50 / p99 / max and the count, over the load before the first move and during the
  moves (while a move runs, from before its mark to after its flip), all names and the names of moved slots apart;
* the checks of :mod:`benches.nemesis` over every grant and the fenced store: safety
  violations (tokens per name never backwards across groups and moves, no token twice, no
  overlapping critical sections), lost leases, errors surfaced to workers; and how many
  names were granted in two groups (their grants crossed a move).

Bounds: at most ``--moves`` moves (each given 90 s), every wait bounded as in the nemesis.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benches.harness import latency_stats
from benches.nemesis.cluster import NemesisConfig
from benches.nemesis.report import _read_events
from benches.shard_nemesis import ShardNemesis, SlotMove, _report
from fastlock.sharding import slot_of


@dataclasses.dataclass
class Latency:
    """Acquire latencies of one window, milliseconds."""

    count: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    @classmethod
    def of(cls, seconds: list[float]) -> Latency:
        if not seconds:
            return cls(0, None, None, None)
        st = latency_stats([int(s * 1e9) for s in seconds])  # ns in, µs out
        return cls(len(seconds), st["p50"] / 1e3, st["p99"] / 1e3, max(seconds) * 1e3)

    def line(self) -> str:
        if not self.count:
            return "no acquires"
        return f"p50 {self.p50_ms:.2f}  p99 {self.p99_ms:.2f}  max {self.max_ms:.2f} ms  ({self.count} acquires)"


def latencies(events: list[dict], moves: list[SlotMove], before: tuple[float, float]) -> dict[str, Latency]:
    """W2 and prober acquire latencies by window: before the moves, during any move (all
    names), during any move for names in a moved slot."""
    moved = set()
    for m in moves:
        moved.update(range(m.first, m.last + 1))
    spans = [(m.started, m.ended) for m in moves]

    def during(t: float) -> bool:
        return any(a <= t <= b for a, b in spans)

    out: dict[str, list[float]] = {"before": [], "during": [], "during_moved_slots": [], "before_moved_slots": []}
    for e in events:
        if e["ev"] != "grant" or not (e.get("probe") or "p#" in e["holding"]):
            continue
        took = e["at"] - e["sent"]
        in_moved = slot_of(e["lock"]) in moved
        if before[0] <= e["sent"] < before[1]:
            out["before"].append(took)
            if in_moved:
                out["before_moved_slots"].append(took)
        elif during(e["sent"]) or during(e["at"]):
            out["during"].append(took)
            if in_moved:
                out["during_moved_slots"].append(took)
    return {k: Latency.of(v) for k, v in out.items()}


def run_shard_move(cfg: NemesisConfig, moves: int, before: float, after: float, root: str | None) -> dict:
    own = root is None
    base = Path(tempfile.mkdtemp(prefix="fastlock-shard-move-") if own else root)
    base.mkdir(parents=True, exist_ok=True)
    nem = ShardNemesis(cfg, base)
    t0 = time.monotonic()
    load_from = 0.0
    try:
        nem.started = time.monotonic()
        nem.start_cluster()
        nem.start_workers()
        if nem.wait_healthy(nem.started, cfg.heal_timeout) is not None:
            load_from = time.monotonic()
            time.sleep(before)  # the load before the moves (the experiment)
            groups = sorted(nem.shard_groups)
            names = [f"acct/{i}" for i in range(cfg.locks)]
            for k in range(moves):
                source, to = groups[k % len(groups)], groups[(k + 1) % len(groups)]
                nem.read_map()
                first, last = nem.plan_move(source, names)
                record = nem.move(first, last, to)
                logging.getLogger("shard_move").info("move %d: %s", k + 1, record.summary())
                if record.error:
                    nem.aborted = f"move {k + 1} failed: {record.error}"
                    break
                time.sleep(1.0)  # load between moves
            time.sleep(after)
    except Exception as exc:
        nem.aborted = f"{type(exc).__name__}: {exc}"
        logging.getLogger("shard_move").exception("shard move run failed")
    finally:
        nem.nodes = nem.all_nodes
        nem.stop_all()
    elapsed = time.monotonic() - t0
    report = _report(nem, elapsed)
    events = _read_events(nem.root, cfg.workers + 1 + cfg.pair_workers)
    first_move = nem.moves[0].started if nem.moves else nem.stopped_at
    report["latency"] = {k: dataclasses.asdict(v) for k, v in
                         latencies(events, nem.moves, (load_from + 1.0, first_move)).items()}
    groups_of: dict[str, set] = {}
    for e in events:
        if e["ev"] == "grant" and e.get("group"):
            groups_of.setdefault(e["lock"], set()).add(e["group"])
    report["names_granted_in_two_groups"] = sorted(n for n, g in groups_of.items() if len(g) > 1)
    report["run_dir"] = str(base)
    if own:
        shutil.rmtree(base, ignore_errors=True)
    return report


def print_move_report(r: dict) -> None:
    a, s = r["availability"], r["safety"]
    print(f"\nshard move: {len(r['moves'])} moves in {r['elapsed_s']} s, 3 groups (a primary and a standby each); "
          f"W3 {r['config']['workers']} workers, W2 {r['config']['pair_workers']} workers")
    if r["aborted"]:
        print(f"  ABORTED: {r['aborted']}")
    for m in r["moves"]:
        print(f"  move: {SlotMove(**m).summary()}; whole move {m['ended'] - m['started']:.2f} s")
        phases = (m.get("report") or {}).get("phases_ms") or {}
        if phases:
            print("    freeze steps, ms after the mark was sent: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sorted(phases.items(), key=lambda x: x[1])))
    lat = r["latency"]
    print("  acquire latency (W2 pairs and the prober):")
    for key, label in (("before", "before the moves, all names"), ("during", "during the moves, all names"),
                       ("before_moved_slots", "before, names of moved slots"),
                       ("during_moved_slots", "during, names of moved slots")):
        print(f"    {label:32s} {Latency(**lat[key]).line()}")
    p99 = lat["during"]["p99_ms"]
    print(f"  p99 during the moves: {'-' if p99 is None else f'{p99:.2f}'} ms (target < 50 ms)")
    print(f"  grants {r['grants']} ({', '.join(f'{g} {n}' for g, n in r['grants_by_group'].items())}); "
          f"names granted in two groups (across a move): {len(r['names_granted_in_two_groups'])}")
    print(f"  SAFETY violations: {s['violations']} (tokens per name never backwards, no token twice, no overlapping "
          f"critical sections)")
    for v in s["store"] + s["grants"]:
        print(f"    - {v}")
    print(f"  leases lost {a['leases_lost']}, releases failed {a['releases_failed_at_exit']}, errors surfaced "
          f"{a['errors_surfaced']}, waits ran out {a['waits_ran_out']}, "
          f"held after stop {a['held_after_workers_stopped']}")
    for key, v in a["errors_by_op_and_type"].items():
        print(f"    {key}: {v['count']}  e.g. {v['messages'][0][0] if v['messages'] else ''}")
    print(f"  promotions after the start: {r['promotions_after_start']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.shard_move", description=__doc__.split("\n")[0])
    ap.add_argument("--moves", type=int, default=3, help="moves, one after the other (1 to 20)")
    ap.add_argument("--before", type=float, default=8.0, help="seconds of load before the first move")
    ap.add_argument("--after", type=float, default=4.0, help="seconds of load after the last move")
    ap.add_argument("--workers", type=int, default=4, help="W3 worker processes")
    ap.add_argument("--pair-workers", type=int, default=4, help="W2 worker processes")
    ap.add_argument("--pair-pause", type=float, default=0.005, help="seconds between a W2 worker's pairs")
    ap.add_argument("--ttl", type=float, default=8.0, help="lock() TTL, seconds")
    ap.add_argument("--fsync", default="always", choices=("always", "interval", "never"))
    ap.add_argument("--seed", type=int, default=NemesisConfig.seed)
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    ap.add_argument("--keep", metavar="DIR", help="keep data dirs, logs and event logs in DIR")
    args = ap.parse_args(argv)
    if not 1 <= args.moves <= 20:
        ap.error("--moves: 1 to 20")
    cfg = NemesisConfig(seed=args.seed, workers=args.workers, locks=3 * args.workers, ttl=args.ttl, fsync=args.fsync,
                        group="etcd", coordinator_ttl=2, shards=3, pair_workers=args.pair_workers,
                        pair_pause=args.pair_pause, kinds=("move",))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = run_shard_move(cfg, args.moves, args.before, args.after, args.keep)
    print_move_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["safety"]["violations"] == 0 and not report["aborted"] else 1


if __name__ == "__main__":
    sys.exit(main())
