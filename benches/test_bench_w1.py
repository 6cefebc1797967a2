"""pytest-benchmark of the W1 path: one client, sequential acquire+release.

    pytest benches/test_bench_w1.py --benchmark-only                      # run
    pytest benches/ --benchmark-only --benchmark-autosave                 # save a baseline (.benchmarks/)
    pytest benches/ --benchmark-only --benchmark-compare                  # compare with the last saved run
    pytest benches/ --benchmark-only --benchmark-compare=0001 --benchmark-compare-fail=median:25%

Each round runs ``PAIRS_PER_ROUND`` acquire+release pairs inside one
``run_until_complete`` (so the loop's entry cost is amortised); divide the
reported times by ``PAIRS_PER_ROUND`` for the per-pair latency, or read
``extra_info["us_per_pair"]``.  The echo floor is benchmarked beside it so a
regression in the machine can be told from one in fastlock.  The servers are
subprocesses on 127.0.0.1 (free port, throwaway data dir) stopped after the
module.  No timing is asserted: only that fencing tokens increase.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("pytest_benchmark")

from benches.echo import EchoTarget
from benches.load import FastlockTarget, fastlock_available

PAIRS_PER_ROUND = 50
ROUNDS = 40


@pytest.fixture(scope="module")
def loop():
    try:
        import uvloop
        lp = uvloop.new_event_loop()
    except ImportError:
        lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def _target(kind: str):
    if kind == "echo":
        return EchoTarget()
    why = fastlock_available()
    if why:
        pytest.skip(why)
    return FastlockTarget(fsync=kind.split("=", 1)[1])


@pytest.fixture(scope="module", params=["echo", "fastlock fsync=never", "fastlock fsync=always"])
def session(request, loop):
    target = _target(request.param)
    target.start()
    sess = None
    try:
        sess = loop.run_until_complete(asyncio.wait_for(target.open(0), 10))
        yield request.param, sess
    finally:
        if sess is not None:
            loop.run_until_complete(asyncio.wait_for(sess.close(), 10))
        target.stop()


def test_w1_acquire_release(benchmark, session, loop):
    kind, sess = session
    tokens: list[int] = []

    async def pairs() -> None:
        for _ in range(PAIRS_PER_ROUND):
            tok = await sess.acquire("bench/w1")
            if tok is not None:
                tokens.append(tok)
            await sess.release("bench/w1")

    def one_round() -> None:
        loop.run_until_complete(asyncio.wait_for(pairs(), 30))

    benchmark.group = "W1 acquire+release"
    benchmark.name = kind
    benchmark.extra_info["pairs_per_round"] = PAIRS_PER_ROUND
    benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=2, iterations=1)
    if benchmark.stats is not None:
        benchmark.extra_info["us_per_pair"] = benchmark.stats.stats.median / PAIRS_PER_ROUND * 1e6
    assert all(a < b for a, b in zip(tokens, tokens[1:])), "fencing tokens must strictly increase"


# -- sanity checks of the harness itself (no timing asserted; skipped by --benchmark-only) --

def test_statistics_helpers():
    from benches import harness
    s = list(range(1, 101))
    assert harness.percentile(s, 50) == 50
    assert harness.percentile(s, 99) == 99
    assert harness.percentile(s, 100) == 100
    assert harness.jain_index([5, 5, 5, 5]) == 1.0
    assert abs(harness.jain_index([1, 0, 0, 0]) - 0.25) < 1e-12


def test_harness_runs_each_workload_against_the_echo_floor():
    from benches import harness
    target = EchoTarget()
    wls = harness.standard_workloads(0.3, 0.1, w2_clients=4, w3_clients=3)
    with harness.running(target):
        pid = target.servers[0].pid
        rows = [harness.run_workload(target, wl) for wl in wls.values()]
    for row in rows:
        assert row["error_count"] == 0, row["errors"]
        assert row["pairs"] > 0
        assert row["round_trips_per_pair"] >= 2
    w3 = rows[2]
    assert sum(w3["per_client_acquisitions"]) == w3["handoffs"]
    import os

    import pytest as _pytest
    with _pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the server is gone after running()
