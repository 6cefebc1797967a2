"""Deadlock detection: the time of one ``LockTable.break_deadlocks`` call (issue 13).

    python -m benches.deadlock [--sizes 1000,2000,4000,8000,16000] [--repeat 3] [--max-quadratic 4000]

For each size N (waiters) it builds a table and times ONE ``break_deadlocks(now, 0,
WHOLE)`` call - a whole search, with a work bound above any size here (the server's
deadlock tick calls it with the default bound, ``DEADLOCK_WORK`` steps, and goes on
with a larger search at its next ticks) - best of ``--repeat``, in four shapes:

* ``one-lock``: session 1 holds one lock, N sessions wait on it (no deadlock: the
  whole queue is searched and nothing is failed);
* ``one-lock-cycle``: as ``one-lock``, and the holder also waits for a second lock
  held by the last waiter's session (one deadlock through the whole queue: one
  victim is failed);
* ``many-locks``: N locks, each held by one session and waited on by another (no
  deadlock);
* ``many-pairs``: N/2 two-session deadlocks on N locks (N/2 victims);
* ``one-session``: N locks, each held by its own session and all waited on by ONE
  session that sends no actor (one party with N waits; no deadlock).

Each row also shows ms per 1 000 waiters: a linear search keeps it about constant
as N doubles.  ``--old PATH`` runs the same shapes against another build of
``fastlock._core`` (e.g. a checkout of main's installed package directory), side by
side, for the sizes up to ``--max-quadratic`` (its quadratic graph takes seconds).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

TTL = 3_600_000
#: a work bound above every search here: one call is a whole search
WHOLE = 1 << 50


def _acq(t, name, owner, session, now):
    t.acquire(name, owner, session, None, TTL, -1, 0, None, now)


def one_lock(core, n, cycle):
    t = core.LockTable()
    _acq(t, "L", b"h", 1, 0)
    for i in range(n):
        _acq(t, "L", b"w%d" % i, 10 + i, 1)
    if cycle:
        _acq(t, "M", b"m", 10 + n - 1, 1)  # the last waiter's session holds M ...
        _acq(t, "M", b"hm", 1, 2)           # ... which the holder of L waits for
    t.drain_events()
    return t


def many_locks(core, n, pairs):
    t = core.LockTable()
    if pairs:
        for i in range(0, n, 2):
            a, b = f"a{i}", f"b{i}"
            _acq(t, a, b"ha%d" % i, 10 + i, 0)
            _acq(t, b, b"hb%d" % i, 11 + i, 0)
            _acq(t, b, b"wb%d" % i, 10 + i, 1)
            _acq(t, a, b"wa%d" % i, 11 + i, 2)
    else:
        for i in range(n):
            _acq(t, f"l{i}", b"h%d" % i, 10 + 2 * i, 0)
            _acq(t, f"l{i}", b"w%d" % i, 11 + 2 * i, 1)
    t.drain_events()
    return t


def one_session(core, n):
    t = core.LockTable()
    for i in range(n):
        _acq(t, f"l{i}", b"h%d" % i, 10 + i, 0)
        _acq(t, f"l{i}", b"w%d" % i, 2, 1)
    t.drain_events()
    return t


SHAPES = {
    "one-lock": lambda core, n: one_lock(core, n, False),
    "one-lock-cycle": lambda core, n: one_lock(core, n, True),
    "many-locks": lambda core, n: many_locks(core, n, False),
    "many-pairs": lambda core, n: many_locks(core, n, True),
    "one-session": one_session,
}


def time_once(core, shape, n, repeat):
    """(best seconds of one break_deadlocks call, cycles it broke)."""
    best, broken = None, 0
    for _ in range(repeat):
        t = SHAPES[shape](core, n)
        t0 = time.perf_counter()
        broken = len(t.break_deadlocks(10, 0, WHOLE))
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best, broken


def _load_core(path):
    """``fastlock._core`` from the compiled module file(s) in directory ``path``."""
    for fname in os.listdir(path):
        if fname.startswith("_core.") and fname.endswith((".so", ".pyd")):
            spec = importlib.util.spec_from_file_location("_core", os.path.join(path, fname))
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    raise SystemExit(f"no compiled _core module in {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,2000,4000,8000,16000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--old", metavar="PATH", help="a directory holding another build's compiled _core module")
    ap.add_argument("--max-quadratic", type=int, default=4000, help="largest size run against --old")
    args = ap.parse_args(argv)
    from fastlock import _core
    old = _load_core(args.old) if args.old else None
    sizes = [int(s) for s in args.sizes.split(",")]
    head = f"{'shape':<15} {'waiters':>8} {'ms':>9} {'ms/1k':>7} {'broken':>7}"
    if old is not None:
        head += f" {'old ms':>9} {'old/new':>8}"
    print(head)
    for shape in SHAPES:
        for n in sizes:
            dt, broken = time_once(_core, shape, n, args.repeat)
            row = f"{shape:<15} {n:>8} {dt * 1e3:>9.2f} {dt * 1e6 / n:>7.2f} {broken:>7}"
            if old is not None and n <= args.max_quadratic:
                odt, _ = time_once(old, shape, n, 1)
                row += f" {odt * 1e3:>9.1f} {odt / dt:>8.0f}"
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
