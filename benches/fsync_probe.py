"""What one durable 4 KiB write costs on a directory's file system.

    python -m benches.fsync_probe [--dir DIR] [--count N]

Two shapes, each ``count`` times, timed per operation (write + ``os.fdatasync``):

append
    each 4 KiB block is written at the end of a new file, so every fdatasync
    also commits the file's new size and block allocation (what a log that grows
    its file pays).
overwrite
    the file is first filled with zeros (real writes, synced), then each 4 KiB
    block overwrites one zero block in order: the fdatasync commits data only
    (what a log writing into preallocated segments pays).

The files live in a fresh sub-directory of ``path`` and are removed afterwards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any

from benches.harness import latency_stats

BLOCK = 4096
MAX_COUNT = 1_000_000


def _timed_writes(fd: int, count: int, *, append: bool) -> list[int]:
    """Nanoseconds of each write + fdatasync; ``append`` writes at the end, else at block i."""
    block = bytes((i * 7 + 1) & 0xFF for i in range(BLOCK))   # not zeros: an overwrite changes the data
    samples: list[int] = []
    for i in range(count):
        t0 = time.perf_counter_ns()
        if append:
            written = os.write(fd, block)
        else:
            written = os.pwrite(fd, block, i * BLOCK)
        os.fdatasync(fd)
        samples.append(time.perf_counter_ns() - t0)
        if written != BLOCK:
            raise OSError(f"short write: {written} of {BLOCK} bytes")
    return samples


def _preallocate(fd: int, count: int) -> None:
    """Write ``count`` zero blocks for real (not a hole, not fallocate) and sync them."""
    zeros = bytes(BLOCK * 64)
    left = count * BLOCK
    while left > 0:
        left -= os.write(fd, zeros[:min(left, len(zeros))])
    os.fsync(fd)


def probe(path: str, count: int) -> dict[str, Any]:
    """Time ``count`` 4 KiB write + fdatasync operations in the directory ``path``.

    :param path: an existing directory, on the file system to measure (a server's data dir's parent).
    :param count: operations per shape, 1 to 1,000,000.
    :returns: ``{"dir", "count", "block_bytes", "append": stats, "overwrite": stats}`` where each
        ``stats`` is ``{"n", "p50", "p90", "p99", "max", "mean"}`` in microseconds per operation.
    :raises ValueError: ``count`` out of range.
    :raises OSError: ``path`` is not a writable directory, or a write or sync failed.
    """
    if not isinstance(count, int) or not 1 <= count <= MAX_COUNT:
        raise ValueError(f"count must be an integer from 1 to {MAX_COUNT:,}, not {count!r}")
    work = tempfile.mkdtemp(prefix="fsync-probe-", dir=path)
    try:
        fd = os.open(os.path.join(work, "append"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            append = _timed_writes(fd, count, append=True)
        finally:
            os.close(fd)
        fd = os.open(os.path.join(work, "overwrite"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            _preallocate(fd, count)
            overwrite = _timed_writes(fd, count, append=False)
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"dir": os.path.abspath(path), "count": count, "block_bytes": BLOCK,
            "append": latency_stats(append), "overwrite": latency_stats(overwrite)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.fsync_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir(),
                    help="directory on the file system to measure (default: the temp dir, where the benches "
                         "put fastlock's data dir)")
    ap.add_argument("--count", type=int, default=2000, help="operations per shape (default 2000)")
    args = ap.parse_args(argv)
    r = probe(args.dir, args.count)
    for shape in ("append", "overwrite"):
        s = r[shape]
        print(f"{shape:<9} 4 KiB write + fdatasync in {r['dir']}: p50 {s['p50']:.0f} µs, p90 {s['p90']:.0f} µs, "
              f"p99 {s['p99']:.0f} µs, max {s['max']:.0f} µs ({s['n']} ops)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
