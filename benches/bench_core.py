"""Micro benches of the compiled lock table beside the reference model.

Run:  python -m pytest benches/bench_core.py --benchmark-group-by=group
Each workload is one benchmark group holding ``[core]`` and ``[model]``, so
pytest-benchmark's table shows the two side by side (see also
``python -m benches.core_ratio`` for plain ns/op and ratios).

Workloads
  pair       uncontended acquire + drain_events + release of one lock
  handoff    A acquires, B queues, A releases -> B granted, B releases
  expire-2k  2 000 leases with distinct deadlines expired by ONE expire() call
             (the model's linear scan makes it O(n^2): 2k keeps it bounded)
  expire-100k  100 000 leases, one expire() call (compiled core only)
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import refmodel

from fastlock import _core

IMPLS = {"core": _core.LockTable, "model": refmodel.RefLockTable}
TTL = 10_000


def pair_workload(table_cls):
    """One uncontended acquire + drain + release per call (time advances 1 ms per call)."""
    t = table_cls()
    acquire, release, drain = t.acquire, t.release, t.drain_events
    clock = [0]

    def run():
        now = clock[0] = clock[0] + 1
        acquire("orders/42", b"A", 1, None, TTL, 0, 0, None, now)
        token = drain()[0].token
        release("orders/42", token, b"A", now)

    return run


def handoff_workload(table_cls):
    """A acquires, B queues, A releases (B granted), B releases."""
    t = table_cls()
    acquire, release, drain = t.acquire, t.release, t.drain_events
    clock = [0]

    def run():
        now = clock[0] = clock[0] + 1
        acquire("orders/42", b"A", 1, None, TTL, -1, 0, None, now)
        acquire("orders/42", b"B", 2, None, TTL, -1, 0, None, now)
        ta = drain()[0].token
        release("orders/42", ta, b"A", now)
        tb = drain()[0].token
        release("orders/42", tb, b"B", now)

    return run


def expiry_setup(table_cls, n):
    """A table holding ``n`` leases with distinct deadlines 1..n ms (installed at now=0)."""
    t = table_cls()
    for i in range(n):
        t.install_holder(f"lock-{i}", i + 1, b"owner", i + 1, 0, None, 0)
    return t


@pytest.mark.benchmark(group="pair")
@pytest.mark.parametrize("impl", list(IMPLS))
def test_pair(benchmark, impl):
    benchmark(pair_workload(IMPLS[impl]))


@pytest.mark.benchmark(group="handoff")
@pytest.mark.parametrize("impl", list(IMPLS))
def test_handoff(benchmark, impl):
    benchmark(handoff_workload(IMPLS[impl]))


@pytest.mark.benchmark(group="expire-2k")
@pytest.mark.parametrize("impl", list(IMPLS))
def test_expire_2k(benchmark, impl):
    n = 2_000

    def setup():
        return (expiry_setup(IMPLS[impl], n),), {}

    def run(t):
        t.expire(n)
        assert len(t.drain_events()) == n

    benchmark.pedantic(run, setup=setup, rounds=3 if impl == "model" else 20, iterations=1)


@pytest.mark.benchmark(group="expire-100k")
def test_expire_100k_core(benchmark):
    n = 100_000

    def setup():
        return (expiry_setup(_core.LockTable, n),), {}

    def run(t):
        t.expire(n)
        assert len(t.drain_events()) == n and len(t) == 0

    benchmark.pedantic(run, setup=setup, rounds=5, iterations=1)
