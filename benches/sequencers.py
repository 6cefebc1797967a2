"""What signed sequencers cost: verification per core (Ed25519 and HMAC-SHA256), signing,
and the grant path (W1 and W2 with and without sequencers) in one run.

    python -m benches.sequencers [--seconds 2] [--rounds 3] [--duration 3] [--warmup 1]
                                 [--concurrency 32] [--fsync never] [--fuzz N] [--skip-load]
                                 [--uvloop | --no-uvloop] [--json PATH]

1. **Verify and sign, one core**: ``fastlock.sequencer.verify`` (decode, key lookup,
   signature, name and expiry checks) and ``fastlock.sequencer.sign`` in a loop on this
   thread for ``--seconds`` each, for Ed25519 and HMAC-SHA256: operations per second and
   µs per operation.
2. **The grant path**: two ``fastlock serve`` subprocesses with the same flags and a
   credentials file holding an Ed25519 key; the clients of one ask for a sequencer with
   every grant (``connect(sequencers=True)``), those of the other do not.  Each round runs
   W1 (one client, acquire+release: pair latency) and W2 (``--concurrency`` clients, each on
   its own lock: pairs/s) on both, the order swapped every round; the report gives the
   median over rounds and the with/without ratio, and the server CPU µs per pair.
3. ``--fuzz N``: N mutated sequencers through ``verify``
   (:mod:`fastlock._testbase.sequencer_fuzz`): how many were accepted (must be 0), refused
   by error class, and the time taken.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from benches import harness
from benches.load import FastlockSession, FastlockTarget


def per_core(seconds: float) -> dict[str, dict[str, float]]:
    """Verify and sign in a loop for ``seconds`` each: ops/s and µs/op per algorithm."""
    from fastlock import sequencer as S
    from fastlock.tokens import make_token

    out: dict[str, dict[str, float]] = {}
    for algorithm in ("ed25519", "hmac-sha256"):
        key = S.SigningKey.of(algorithm, bytes(range(32)))
        keys = {key.key_id: key.verify_key}
        expires = int(time.time() * 1000) + 3_600_000
        blob = S.encode(key, name="orders/42", token=make_token(1, 7), principal="app", expires_at_ms=expires)
        steps = (("verify", functools.partial(S.verify, blob, keys, name="orders/42")),
                 ("sign", functools.partial(S.sign, key, "orders/42", make_token(1, 7), "app", 0, 10_000)))
        for what, step in steps:
            n = 0
            end = time.perf_counter() + seconds
            started = time.perf_counter()
            while True:
                for _ in range(200):
                    step()
                n += 200
                if time.perf_counter() >= end:
                    break
            took = time.perf_counter() - started
            out[f"{what} {algorithm}"] = {"ops_per_s": n / took, "us_per_op": took / n * 1e6}
    return out


class SequencerTarget(FastlockTarget):
    """A fastlock server with a sequencer key; its clients ask for sequencers or not."""

    def __init__(self, credentials: str, *, sequencers: bool, fsync: str) -> None:
        super().__init__(fsync=fsync, extra_args=("--credentials", credentials))
        self.sequencers = sequencers
        self.name = f"fastlock fsync={fsync} {'with' if sequencers else 'without'} sequencers"

    async def open(self, idx: int) -> harness.Session:
        import fastlock
        client = await fastlock.connect(f"127.0.0.1:{self.port}", client_name=f"bench-{idx}",
                                        sequencers=self.sequencers)
        return FastlockSession(client, owned=True)


def _median(rows: list[dict], key) -> float:
    values = [key(r) for r in rows if "pair_us" in r]
    return statistics.median(values) if values else float("nan")


def grant_path(args: argparse.Namespace) -> tuple[dict, dict]:
    """W1/W2 with and without sequencers, alternating rounds: (rows, summary)."""
    from fastlock.auth import generate

    wls = [w for w in harness.workloads_from_args(args) if w.name in ("W1", "W2")]
    rows: dict[str, list[dict]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory(prefix="fastlock-seq-bench-") as d:
        generate(os.path.join(d, "c"), anonymous_prefix="")  # the bench's clients are the anonymous principal
        creds = os.path.join(d, "c", "credentials.toml")
        targets = {key: SequencerTarget(creds, sequencers=key == "with", fsync=args.fsync) for key in rows}
        try:
            for t in targets.values():
                t.start()
            for rnd in range(args.rounds):
                order = ["without", "with"] if rnd % 2 == 0 else ["with", "without"]
                for key in order:
                    for wl in wls:
                        row = harness.run_workload(targets[key], wl, use_uvloop=args.uvloop)
                        row["round"] = rnd
                        rows[key].append(row)
                        print(f"  round {rnd + 1} {targets[key].name:<40} {wl.name}: {harness.one_line(row)}",
                              flush=True)
        finally:
            for t in targets.values():
                t.stop()
    summary: dict[str, Any] = {}
    for wl in wls:
        for key in rows:
            mine = [r for r in rows[key] if r.get("workload") == wl.name]
            summary[f"{wl.name} {key}"] = {
                "pair_p50_us": _median(mine, lambda r: r["pair_us"]["p50"]),
                "pairs_per_s": _median(mine, lambda r: r["pairs_per_s"]),
                "server_cpu_us_per_pair": _median(mine, lambda r: r["server_cpu_pct"] * 1e4 / r["pairs_per_s"]),
                "errors": sum(r.get("error_count", 0) for r in mine),
            }
    return rows, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.sequencers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(ap)
    ap.set_defaults(workloads="W1,W2")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per verify/sign measurement (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of W1/W2 (default 3)")
    ap.add_argument("--fsync", default="never", choices=("never", "interval", "always"),
                    help="both servers' --fsync (default never: leave the disk out)")
    ap.add_argument("--fuzz", type=int, default=0, metavar="N", help="also verify N mutated sequencers")
    ap.add_argument("--skip-load", action="store_true", help="only the per-core and fuzz parts (no servers)")
    args = ap.parse_args(argv)
    payload: dict[str, Any] = {"machine": harness.machine_info(), "args": vars(args)}
    print(f"benches.sequencers: verify/sign {args.seconds:g} s each on one core", flush=True)
    core = per_core(args.seconds)
    payload["per_core"] = core
    for what, r in core.items():
        print(f"  {what:<22} {r['ops_per_s']:>12,.0f} ops/s  {r['us_per_op']:>8.2f} us/op", flush=True)
    failed = False
    if args.fuzz:
        from fastlock._testbase.sequencer_fuzz import fuzz
        started = time.perf_counter()
        result = fuzz(args.fuzz)
        took = time.perf_counter() - started
        payload["fuzz"] = {**result._asdict(), "seconds": took}
        print(f"fuzz: {args.fuzz:,} mutants in {took:.1f} s: accepted {result.accepted}, refused "
              f"{result.refused:,}, unchanged {result.unchanged:,}; refusals {result.by_error}", flush=True)
        failed = result.accepted != 0
    if not args.skip_load:
        busy = harness.wait_for_quiet(args.quiet_wait, log=lambda s: print(s, flush=True))
        print(f"grant path: W1/W2 x {args.rounds} alternating rounds, {args.duration:g} s each after "
              f"{args.warmup:g} s warmup; fsync={args.fsync}; machine busy before start: {busy:.0f}% of a core",
              flush=True)
        rows, summary = grant_path(args)
        payload.update(rows=rows, summary=summary)
        print(f"\nmedian of {args.rounds} rounds         without        with   with/without")
        for wl in ("W1", "W2"):
            if f"{wl} without" not in summary:
                continue
            a, b = summary[f"{wl} without"], summary[f"{wl} with"]
            if wl == "W1":
                print(f"W1 pair p50 (us)          {a['pair_p50_us']:>10.0f}  {b['pair_p50_us']:>10.0f}  "
                      f"{b['pair_p50_us'] / a['pair_p50_us']:>8.2f}")
            else:
                print(f"W2 pairs/s                {a['pairs_per_s']:>10,.0f}  {b['pairs_per_s']:>10,.0f}  "
                      f"{b['pairs_per_s'] / a['pairs_per_s']:>8.2f}")
            print(f"{wl} server CPU us/pair      {a['server_cpu_us_per_pair']:>10.1f}  "
                  f"{b['server_cpu_us_per_pair']:>10.1f}  "
                  f"{b['server_cpu_us_per_pair'] / a['server_cpu_us_per_pair']:>8.2f}")
        failed = failed or any(s["errors"] for s in summary.values())
    if args.json:
        harness.write_json(args.json, payload)
        print(f"\nwrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
