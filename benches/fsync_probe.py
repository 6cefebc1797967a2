"""The disk's price of one durable write: 4 KiB write + sync, appended vs preallocated.

    python -m benches.fsync_probe [--dir PATH] [--count 2000] [--wakeup] [--json PATH]

In a throwaway file under ``--dir`` (default: a temporary directory in the
current directory, so run it from the data dir's filesystem), ``--count``
times each, interleaved in rounds of 100 so that a change in the machine's
load hits every mode alike:

- ``append fsync`` / ``append fdatasync``: write 4 KiB at the end of a growing
  file, then ``fsync`` / ``fdatasync`` (every sync also commits the new size and
  the allocated blocks: a journal commit on ext4/xfs);
- ``prealloc fdatasync``: overwrite 4 KiB of a file zero-filled and synced
  beforehand (1 MiB steps, as the WAL's segments are), then ``fdatasync``
  (data pages only);
- ``prealloc direct fdatasync`` (where the file system takes ``O_DIRECT``): the
  same overwrite from an aligned buffer through a descriptor opened with
  ``O_DIRECT``, then ``fdatasync`` (no page of the cache to write back, only the
  device's cache to flush -- what ``--fsync always`` pays per batch where the
  log writes directly).

Prints p50 / p99 in microseconds per mode and the ratio preallocated/append.

``--wakeup`` also measures what waiting for a sync costs beyond the sync
itself: a client process does blocking round trips over a local socket with
a server process that, per request, (a) does nothing, (b) spins for the
preallocated sync's p50, (c) does a preallocated 100-byte write + fdatasync.
``round trip - server time`` is the price of the two process wake-ups; on a
virtual machine it grows once the client waits longer than the hypervisor
polls an idle vCPU, which no server-side change removes.
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
from typing import Any

from benches.harness import latency_stats

BLOCK = 4096
MAX_COUNT = 1_000_000
STEP = 1 << 20
MODES = ("append fsync", "append fdatasync", "prealloc fdatasync")
#: the direct mode, measured where the file system takes O_DIRECT
DIRECT = "prealloc direct fdatasync"
_sync = getattr(os, "fdatasync", os.fsync)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _samples(directory: str, count: int) -> dict[str, list[int]]:
    """Nanoseconds of each write + sync, ``count`` per mode, interleaved in rounds of 100."""
    import mmap

    d = tempfile.mkdtemp(prefix="fsync-probe-", dir=directory)
    block = os.urandom(BLOCK)
    aligned = mmap.mmap(-1, BLOCK)  # (page-aligned: what an O_DIRECT write needs)
    aligned.write(block)
    modes = list(MODES)
    fds = {}
    try:
        for m in MODES:
            fds[m] = os.open(os.path.join(d, m.replace(" ", "-")), os.O_WRONLY | os.O_CREAT, 0o600)
        direct_path = os.path.join(d, "direct")
        if hasattr(os, "O_DIRECT"):
            fd = os.open(direct_path, os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)
            try:
                fds[DIRECT] = os.open(direct_path, os.O_WRONLY | os.O_DIRECT)
                os.pwrite(fds[DIRECT], aligned, 0)  # (refused here by a file system without O_DIRECT)
                modes.append(DIRECT)
            except OSError:
                fds.pop(DIRECT, None)
        samples: dict[str, list[int]] = {m: [] for m in modes}
        preallocated = {fds["prealloc fdatasync"]: 0}
        if DIRECT in fds:
            preallocated[fds[DIRECT]] = 0
        offsets = {m: 0 for m in modes}
        done = 0
        while done < count:
            for m in modes:
                fd = fds[m]
                data = aligned if m == DIRECT else block
                for _ in range(min(100, count - done)):
                    off = offsets[m]
                    allocated = preallocated.get(fd)
                    if allocated is not None and off + BLOCK > allocated:  # the next zero-filled step, synced
                        with open(direct_path if m == DIRECT else os.path.join(d, m.replace(" ", "-")), "r+b") as f:
                            f.seek(allocated)
                            f.write(bytes(STEP))
                            f.flush()
                            os.fsync(f.fileno())
                        preallocated[fd] = allocated + STEP
                    t0 = time.perf_counter_ns()
                    os.pwrite(fd, data, off)
                    (os.fsync if m == "append fsync" else _sync)(fd)
                    samples[m].append(time.perf_counter_ns() - t0)
                    offsets[m] = off + BLOCK
            done += min(100, count - done)
    finally:
        for fd in fds.values():
            os.close(fd)
        aligned.close()
        shutil.rmtree(d, ignore_errors=True)
    return samples


def _check_count(count: object) -> int:
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_COUNT:
        raise ValueError(f"count must be an integer from 1 to {MAX_COUNT:,}, not {count!r}")
    return count


def probe_modes(directory: str, count: int = 2000) -> dict[str, dict[str, float]]:
    """Measure each of :data:`MODES` (and :data:`DIRECT` where the file system takes
    ``O_DIRECT``) ``count`` times in ``directory``:
    ``{mode: {"p50_us", "p99_us", "mean_us"}}`` (microseconds per write + sync).

    :raises ValueError: ``count`` is not an integer from 1 to :data:`MAX_COUNT`.
    :raises OSError: the directory is not writable, or a write or sync failed.
    """
    samples = _samples(directory, _check_count(count))
    return {m: {"p50_us": round(statistics.median(xs) / 1e3, 1), "p99_us": round(_pct(xs, 0.99) / 1e3, 1),
                "mean_us": round(statistics.fmean(xs) / 1e3, 1)} for m, xs in samples.items()}


def probe(path: str, count: int) -> dict[str, Any]:
    """The probe as :mod:`benches.peers` reports it: ``{"dir", "count", "block_bytes",
    "append", "overwrite", "append_fsync"}``, each shape's stats
    (:func:`benches.harness.latency_stats`: n, p50, p90, p99, max, mean in microseconds):
    ``append`` = 4 KiB appended + fdatasync, ``overwrite`` = 4 KiB into preallocated,
    zero-filled space + fdatasync (what the WAL pays per durable batch),
    ``append_fsync`` = appended + fsync.

    :raises ValueError: ``count`` is not an integer from 1 to :data:`MAX_COUNT`.
    :raises OSError: ``path`` is not a writable directory, or a write or sync failed.
    """
    samples = _samples(path, _check_count(count))
    return {"dir": os.path.abspath(path), "count": count, "block_bytes": BLOCK,
            "append": latency_stats(samples["append fdatasync"]),
            "overwrite": latency_stats(samples["prealloc fdatasync"]),
            "append_fsync": latency_stats(samples["append fsync"])}


def _wakeup_server(conn, mode: str, spin_s: float, directory: str) -> None:
    import socket
    sock = socket.socket(fileno=conn)
    fd = -1
    if mode == "sync":
        fd, path = tempfile.mkstemp(dir=directory)
        os.unlink(path)
        os.pwrite(fd, bytes(STEP), 0)
        os.fsync(fd)
    off = 0
    spent = []
    while True:
        msg = sock.recv(64)
        if not msg:
            break
        t0 = time.perf_counter()
        if mode == "sync":
            os.pwrite(fd, b"r" * 100, off)
            off = (off + 100) % (STEP - 100)
            _sync(fd)
        elif mode == "spin":
            while time.perf_counter() - t0 < spin_s:
                pass
        spent.append(time.perf_counter() - t0)
        sock.send(msg)
    sock.send(json.dumps(statistics.median(spent) if spent else 0.0).encode())
    sock.close()


def wakeup(directory: str, spin_s: float, seconds: float = 2.0) -> dict[str, dict[str, float]]:
    """Round trips to a server process that idles, spins ``spin_s`` or syncs, per request:
    ``{mode: {"round_trip_p50_us", "server_p50_us", "extra_us"}}``."""
    import multiprocessing
    import socket
    out = {}
    for mode in ("none", "spin", "sync"):
        a, b = socket.socketpair()
        proc = multiprocessing.get_context("fork").Process(target=_wakeup_server,
                                                           args=(b.fileno(), mode, spin_s, directory))
        proc.start()
        b.close()
        rts = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            a.send(b"x" * 50)
            a.recv(64)
            rts.append(time.perf_counter() - t0)
        a.shutdown(socket.SHUT_WR)
        server = float(a.recv(64) or b"0")
        a.close()
        proc.join()
        rt = statistics.median(rts)
        out[mode] = {"round_trip_p50_us": round(rt * 1e6, 1), "server_p50_us": round(server * 1e6, 1),
                     "extra_us": round((rt - server) * 1e6, 1)}
    return out


def format_probe(result: dict[str, dict[str, float]]) -> str:
    lines = [f"  {m:26s} p50 {r['p50_us']:8.1f} us   p99 {r['p99_us']:8.1f} us" for m, r in result.items()]
    a, p = result["append fdatasync"]["p50_us"], result["prealloc fdatasync"]["p50_us"]
    lines.append(f"  preallocated / append (fdatasync p50): {p / a:.2f}")
    if DIRECT in result:
        lines.append(f"  direct / preallocated (fdatasync p50): {result[DIRECT]['p50_us'] / p:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.fsync_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".", help="where to put the throwaway file (default: .)")
    ap.add_argument("--count", type=int, default=2000, help="syncs per mode (default 2000)")
    ap.add_argument("--wakeup", action="store_true", help="also measure the wake-up cost of waiting for a sync")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = ap.parse_args(argv)
    result: dict = probe_modes(args.dir, args.count)
    print(f"fsync probe in {os.path.abspath(args.dir)}: 4 KiB write + sync, {args.count} each")
    print(format_probe(result))
    if args.wakeup:
        wake = wakeup(args.dir, result["prealloc fdatasync"]["p50_us"] / 1e6)
        print("round trip to a server process that, per request, ... (extra = round trip - server time):")
        for mode, r in wake.items():
            print(f"  {mode:5s} server {r['server_p50_us']:8.1f} us  round trip {r['round_trip_p50_us']:8.1f} us"
                  f"  extra {r['extra_us']:6.1f} us")
        result = {"probe": result, "wakeup": wake}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
