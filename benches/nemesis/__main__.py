"""``python -m benches.nemesis``: see :mod:`benches.nemesis`."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

from benches.nemesis.cluster import GROUP_KINDS, GROUPS, KINDS, NemesisConfig, report_again, run_nemesis
from benches.nemesis.report import print_report
from benches.nemesis.workers import worker_main


def _package_doc() -> str:
    import benches.nemesis

    return benches.nemesis.__doc__.split("\n")[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.nemesis", description=_package_doc())
    ap.add_argument("--duration", type=float, default=60.0, help="seconds during which faults are started")
    ap.add_argument("--seed", type=int, default=NemesisConfig.seed)
    ap.add_argument("--failover-after", type=float, default=1.0, help="the standby's --failover-after, seconds")
    ap.add_argument("--promotion-grace", type=float, default=2.0, help="seconds")
    ap.add_argument("--workers", type=int, default=6, help="worker processes")
    ap.add_argument("--locks", type=int, default=0, help="lock names (default: twice as many as workers)")
    ap.add_argument("--ttl", type=float, default=8.0, help="lock() TTL, seconds")
    ap.add_argument("--wait", type=float, default=20.0, help="lock() wait, seconds")
    ap.add_argument("--request-timeout", type=float, default=5.0, help="the clients' request_timeout, seconds")
    ap.add_argument("--group", default="pair", choices=GROUPS,
                    help="pair: primary + standby (default); etcd: three nodes arbitrated by a throwaway etcd")
    ap.add_argument("--coordinator-ttl", type=int, default=NemesisConfig.coordinator_ttl,
                    help="--group etcd: the nodes' --coordinator-ttl, whole seconds")
    ap.add_argument("--kinds", default="", help=f"fault kinds to cycle through (default: all of the group's: "
                    f"pair {','.join(KINDS)}; etcd {','.join(GROUP_KINDS)})")
    ap.add_argument("--max-faults", type=int, default=0)
    ap.add_argument("--heal-timeout", type=float, default=30.0, help="seconds to become healthy after a fault")
    ap.add_argument("--fsync", default="always", choices=("always", "interval", "never"))
    ap.add_argument("--server-args", default="", metavar="FLAGS",
                    help="more `fastlock serve` flags for every node, one string (e.g. \"--replication sync\")")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    ap.add_argument("--keep", metavar="DIR", help="keep data dirs, logs and event logs in DIR")
    ap.add_argument("--report", metavar="DIR", help="only print the report of a run kept with --keep DIR")
    ap.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.index)
    if args.report:
        report = report_again(args.report)
        print_report(report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        return 0 if report["safety"]["violations"] == 0 and not report["aborted"] else 1
    known = GROUP_KINDS if args.group == "etcd" else KINDS
    kinds = tuple(k for k in args.kinds.split(",") if k) or known
    bad = [k for k in kinds if k not in known]
    if bad:
        ap.error(f"--kinds: unknown {bad}; choose from {','.join(known)}")
    cfg = NemesisConfig(duration=args.duration, seed=args.seed, failover_after=args.failover_after,
                        promotion_grace=args.promotion_grace, workers=args.workers, locks=args.locks,
                        ttl=args.ttl, wait=args.wait, request_timeout=args.request_timeout, kinds=kinds,
                        heal_timeout=args.heal_timeout, fsync=args.fsync, max_faults=args.max_faults,
                        server_args=tuple(shlex.split(args.server_args)), group=args.group,
                        coordinator_ttl=args.coordinator_ttl)
    if cfg.ttl <= cfg.failover_s + cfg.request_timeout:
        print(f"note: ttl {cfg.ttl} s is not above failover + request_timeout; lost leases are expected",
              file=sys.stderr)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report = run_nemesis(cfg, args.keep)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["safety"]["violations"] == 0 and not report["aborted"] else 1


if __name__ == "__main__":
    sys.exit(main())
