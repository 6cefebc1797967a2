"""The disk's price of one durable write: 4 KiB write + sync, appended vs preallocated.

    python -m benches.fsync_probe [--dir PATH] [--count 2000] [--json PATH]

In a throwaway file under ``--dir`` (default: a temporary directory in the
current directory, so run it from the data dir's filesystem), ``--count``
times each, interleaved in rounds of 100 so that a change in the machine's
load hits every mode alike:

- ``append fsync`` / ``append fdatasync``: write 4 KiB at the end of a growing
  file, then ``fsync`` / ``fdatasync`` (every sync also commits the new size and
  the allocated blocks: a journal commit on ext4/xfs);
- ``prealloc fdatasync``: overwrite 4 KiB of a file zero-filled and synced
  beforehand (1 MiB steps, as the WAL's segments are), then ``fdatasync``
  (data pages only -- what ``--fsync always`` pays per batch).

Prints p50 / p99 in microseconds per mode and the ratio preallocated/append.
The W1 target of issue 12 is W1 p50 (``always``) <= W1 p50 (``never``) +
1.0 x the ``prealloc fdatasync`` p50 of the same run: ``benches.durability
--only w1`` runs both and this probe side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

BLOCK = 4096
STEP = 1 << 20
MODES = ("append fsync", "append fdatasync", "prealloc fdatasync")
_sync = getattr(os, "fdatasync", os.fsync)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def probe(directory: str, count: int = 2000) -> dict[str, dict[str, float]]:
    """Measure each mode ``count`` times in ``directory``; ``{mode: {"p50_us", "p99_us", "mean_us"}}``.

    :raises OSError: the directory is not writable.
    """
    d = tempfile.mkdtemp(prefix="fsync-probe-", dir=directory)
    block = os.urandom(BLOCK)
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    fds = {}
    try:
        for m in MODES:
            fds[m] = os.open(os.path.join(d, m.replace(" ", "-")), os.O_WRONLY | os.O_CREAT, 0o600)
        pre = fds["prealloc fdatasync"]
        offsets = {m: 0 for m in MODES}
        allocated = 0
        done = 0
        while done < count:
            for m in MODES:
                fd = fds[m]
                for _ in range(min(100, count - done)):
                    off = offsets[m]
                    if fd == pre and off + BLOCK > allocated:  # the next zero-filled step, synced
                        os.pwrite(fd, bytes(STEP), allocated)
                        os.fsync(fd)
                        allocated += STEP
                    t0 = time.perf_counter()
                    os.pwrite(fd, block, off)
                    (os.fsync if m == "append fsync" else _sync)(fd)
                    samples[m].append(time.perf_counter() - t0)
                    offsets[m] = off + BLOCK
            done += min(100, count - done)
    finally:
        for fd in fds.values():
            os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
    return {m: {"p50_us": round(statistics.median(xs) * 1e6, 1), "p99_us": round(_pct(xs, 0.99) * 1e6, 1),
                "mean_us": round(statistics.fmean(xs) * 1e6, 1)} for m, xs in samples.items()}


def format_probe(result: dict[str, dict[str, float]]) -> str:
    lines = [f"  {m:20s} p50 {r['p50_us']:8.1f} us   p99 {r['p99_us']:8.1f} us" for m, r in result.items()]
    a, p = result["append fdatasync"]["p50_us"], result["prealloc fdatasync"]["p50_us"]
    lines.append(f"  preallocated / append (fdatasync p50): {p / a:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.fsync_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".", help="where to put the throwaway file (default: .)")
    ap.add_argument("--count", type=int, default=2000, help="syncs per mode (default 2000)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = ap.parse_args(argv)
    result = probe(args.dir, args.count)
    print(f"fsync probe in {os.path.abspath(args.dir)}: 4 KiB write + sync, {args.count} each")
    print(format_probe(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
