"""A/B: W1, W2 and W3 of two fastlock installs, side by side in one run.

    python -m benches.ab [--base main] [--rounds 3] [--duration 2] [--warmup 0.5]
                         [--fsync never] [--workloads W1,W2,W3] [--current-python PATH]
                         [--keep DIR]

"current" is this tree as installed in its own venv (``.venv/bin/python`` by
default, as ``make`` builds it; ``--current-python`` names another).  "base"
is the git revision ``--base`` (default ``main``), checked out with ``git
worktree add --detach`` into a temporary directory and ``pip install``-ed into
a fresh venv there (msgpack and uvloop come with it; psutil is added for the
harness's CPU meter).  Both run the same benchmark code - this tree's
:mod:`benches.load` - as a subprocess each, client and server from their own
install, so each install is measured whole (the client's normal path and the
server's).

Rounds alternate the order (current first, then base first, ...), so drift in
the machine's load over the run hits both alike.  Each round prints its
figures; the summary prints, per workload, the median over rounds of each side
and the ratio current / base:

- W1: p50 of one acquire+release pair, microseconds (lower is better);
- W2: requests/s with ``--concurrency`` clients on distinct locks (higher is better);
- W3: hand-offs/s with N clients on one lock (higher is better).

The temporary worktree and venv are removed at the end (``--keep DIR`` builds
them under DIR and keeps them, so a second run skips the build).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


def build_base(rev: str, where: Path) -> str:
    """Check ``rev`` out under ``where`` and install it into a venv there; return its python."""
    src = where / "src"
    venv = where / "venv"
    py = venv / "bin" / "python"
    stamp = where / f"installed-{_run(['git', '-C', str(ROOT), 'rev-parse', rev]).stdout.strip()}"
    if stamp.exists() and py.exists():
        return str(py)
    if src.exists():
        _run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src)])
    _run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(src), rev])
    _run([sys.executable, "-m", "venv", str(venv)])
    _run([str(py), "-m", "pip", "install", "-q", str(src), "psutil"])
    stamp.touch()
    return str(py)


def run_load(python: str, args: argparse.Namespace, out: Path, bench_dir: Path) -> dict[str, float]:
    """One ``benches.load`` run with ``python``; returns the fastlock figures."""
    cmd = [python, "-m", "benches.load", "--no-floor", "--fsync", args.fsync, "--duration", str(args.duration),
           "--warmup", str(args.warmup), "--workloads", args.workloads, "--json", str(out)]
    if args.concurrency:
        cmd += ["--concurrency", str(args.concurrency)]
    # cwd is a directory holding only `benches`: the install's fastlock is imported, never a source tree
    env = dict(os.environ, PYTHONPATH=str(bench_dir))
    _run(cmd, cwd=bench_dir, env=env, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    figures: dict[str, float] = {}
    for r in rows:
        if "pair_us" not in r:
            continue
        if r["workload"] == "W1":
            figures["W1"] = r["pair_us"]["p50"]
        elif r["workload"] == "W2":
            figures["W2"] = r["requests_per_s"]
        elif r["workload"] == "W3":
            figures["W3"] = r["handoffs_per_s"]
    return figures


UNITS = {"W1": "pair p50 us (lower is better)", "W2": "req/s (higher is better)",
         "W3": "hand-offs/s (higher is better)"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main", help="git revision to compare against (default main)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs both installs (default 3)")
    ap.add_argument("--duration", type=float, default=2.0, help="seconds measured per workload (default 2)")
    ap.add_argument("--warmup", type=float, default=0.5, help="seconds before measuring (default 0.5)")
    ap.add_argument("--concurrency", type=int, default=None, help="W2 clients (default 32; W3 half)")
    ap.add_argument("--fsync", default="never", help="the servers' --fsync mode (default never)")
    ap.add_argument("--workloads", default="W1,W2,W3")
    ap.add_argument("--current-python", default=str(ROOT / ".venv" / "bin" / "python"),
                    help="python of the venv this tree is installed in (default ./.venv, as make builds it)")
    ap.add_argument("--keep", metavar="DIR", help="build the base under DIR and keep it")
    args = ap.parse_args(argv)
    if not Path(args.current_python).exists():
        print(f"no {args.current_python}: run `make .venv/.fastlock-installed` first", file=sys.stderr)
        return 2
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fastlock-ab-"))
    tmp.mkdir(parents=True, exist_ok=True)
    bench_dir = tmp / "bench"
    bench_dir.mkdir(exist_ok=True)
    link = bench_dir / "benches"
    if not link.exists():
        link.symlink_to(ROOT / "benches")
    try:
        print(f"building base {args.base} under {tmp} ...", flush=True)
        base_py = build_base(args.base, tmp / "base")
        sides = {"current": args.current_python, "base": base_py}
        results: dict[str, list[dict[str, float]]] = {"current": [], "base": []}
        for i in range(args.rounds):
            order = ["current", "base"] if i % 2 == 0 else ["base", "current"]
            for side in order:
                figs = run_load(sides[side], args, tmp / f"{side}-{i}.json", bench_dir)
                results[side].append(figs)
                print(f"round {i + 1} {side:<7} " + "  ".join(f"{w} {v:,.0f}" for w, v in sorted(figs.items())),
                      flush=True)
        print()
        print(f"median of {args.rounds} rounds, fsync={args.fsync}, {args.duration:g} s per workload; "
              f"current = {ROOT} ({_run(['git', '-C', str(ROOT), 'rev-parse', '--short', 'HEAD']).stdout.strip()}),"
              f" base = {args.base}")
        for w in [w.strip().upper() for w in args.workloads.split(",") if w.strip()]:
            cur = [r[w] for r in results["current"] if w in r]
            base = [r[w] for r in results["base"] if w in r]
            if not cur or not base:
                continue
            c, b = statistics.median(cur), statistics.median(base)
            print(f"  {w}  current {c:>12,.1f}  base {b:>12,.1f}  current/base {c / b:6.3f}   {UNITS[w]}")
        return 0
    finally:
        if not args.keep:
            src = tmp / "base" / "src"
            if src.exists():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(src)],
                               capture_output=True)
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
