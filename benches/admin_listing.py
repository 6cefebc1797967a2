"""The loop time of one LOCKS request on a large table: the whole listing vs one page.

Run:  python -m benches.admin_listing [--leases N] [--repeat R] [--json]

A :class:`~fastlock._core.LockTable` holds ``--leases`` exclusive leases (default
200 000; every 100th lock has two waiters).  Each variant builds the rows a LOCKS reply
carries (:func:`fastlock.server.lockadmin.lease_info` plus the waiter count), on the
thread that would be the server's event loop, and is timed with time.perf_counter; the
best of ``--repeat`` runs is reported (noise only ever adds time):

  full-10k    what LOCKS did before paging: a Holder for every lease, filtered, sorted
              by name, then the rows of the first 10 000
  page-1k     LockTable.held_page by name (1 000 names), then their rows: what each
              request of ``fastlock locks`` costs now
  page-10k    the same with 10 000 names (the largest page a client may ask for)
  top-15      LockTable.held_page ranked by waiters (15 rows): what ``fastlock top``
              asks for each frame

The ratio column is full-10k's time over the variant's, measured in the same process.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable

from fastlock import _core
from fastlock.server.lockadmin import lease_info

TTL = 3_600_000
NOW = 1_000


def build(leases: int) -> _core.LockTable:
    table = _core.LockTable()
    for i in range(leases):
        name = f"jobs/{i:07d}"
        table.acquire(name, i.to_bytes(8, "big"), 1, None, TTL, 0, 0, None, 0)
        if i % 100 == 0:
            for w in (1, 2):
                table.acquire(name, (leases * 10 + i * 2 + w).to_bytes(8, "big"), 2, None, TTL, -1, 0, None, 0)
    table.drain_events()
    return table


def full_listing(table: _core.LockTable, most: int = 10_000) -> int:
    held = [h for h in table.holders() if h.name.startswith("") and h.deadline_ms > NOW]
    held.sort(key=lambda h: (h.name, h.token))
    waiting: dict[str, int] = {}
    rows = []
    for h in held[:most]:
        n = waiting.get(h.name)
        if n is None:
            n = waiting[h.name] = len(table.waiters(h.name))
        rows.append({**lease_info(h, NOW), "waiters": n})
    return len(rows)


def paged(table: _core.LockTable, most: int, by_waiters: bool) -> int:
    page, _matched = table.held_page("", None, most, by_waiters, NOW)
    rows = []
    for name, waiters in page:
        rows += [{**lease_info(h, NOW), "waiters": waiters} for h in table.holders_of(name, NOW)]
    return len(rows)


def best_ms(fn: Callable[[], int], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000.0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benches.admin_listing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--leases", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()
    table = build(args.leases)
    variants = {
        "full-10k": lambda: full_listing(table),
        "page-1k": lambda: paged(table, 1_000, False),
        "page-10k": lambda: paged(table, 10_000, False),
        "top-15": lambda: paged(table, 15, True),
    }
    results = {name: best_ms(fn, args.repeat) for name, fn in variants.items()}
    base = results["full-10k"]
    if args.json:
        print(json.dumps({"leases": args.leases, "ms": results,
                          "ratio": {k: base / v for k, v in results.items()}}))
        return
    print(f"{args.leases} leases, best of {args.repeat}")
    for name, ms in results.items():
        print(f"  {name:9s} {ms:8.1f} ms   {base / ms:5.1f}x")


if __name__ == "__main__":
    main()
