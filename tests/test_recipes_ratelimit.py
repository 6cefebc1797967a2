"""Rate limits (issue 29, item 3): the GCRA of fastlock.server.ratelimit against its bound
(property test, on explicit clocks), drained at a node's start and at a new epoch, the
limits on how many limiters exist, and the RATE_LIMIT operation through real clients."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastlock
from fastlock.errors import InvalidArgument, LimitConflict, LimitExceeded, WrongArgumentType
from fastlock.server import ratelimit as RL
from fastlock.server.ratelimit import RateLimits, check_rate_args

TIMEOUT = 20.0

#: (ms since the previous take, cost)
TAKES = st.lists(st.tuples(st.integers(0, 300), st.integers(1, 4)), min_size=1, max_size=200)


@settings(max_examples=200, deadline=None)
@given(takes=TAKES, rate=st.integers(1, 50), period_ms=st.sampled_from([100, 1000, 5000]), burst=st.integers(4, 20))
def test_admissions_never_exceed_burst_plus_rate_over_any_span(takes, rate, period_ms, burst):
    limits = RateLimits(now=0)
    now = burst * period_ms  # past the start's drain
    admitted: list[tuple[int, int]] = []
    for gap, cost in takes:
        now += gap
        decision = limits.take("n", rate, period_ms, burst, cost, "p", now)
        if decision.admitted:
            admitted.append((now, cost))
            assert decision.retry_after_ms == 0
        else:
            assert decision.retry_after_ms >= 1
            # the server's retry_after is honest: the same take then is admitted
            probe = RateLimits(now=0)
            probe.by_name = {"n": _copy(limits.by_name["n"])} if "n" in limits.by_name else {}
            probe.per_principal = dict(limits.per_principal)
            assert probe.take("n", rate, period_ms, burst, cost, "p", now + decision.retry_after_ms).admitted
    for i, (start, _) in enumerate(admitted):
        total = 0
        for t, cost in admitted[i:]:
            total += cost
            assert total <= burst + rate * (t - start) / period_ms + 1e-6, (start, t, total)


def _copy(limiter):
    return RL.RateLimiter(limiter.rate, limiter.period_ms, limiter.burst, limiter.tat, limiter.principal)


def test_a_full_bucket_admits_burst_at_once_then_the_rate():
    limits = RateLimits(now=0)
    now = 100_000
    got = [limits.take("n", 100, 1000, 10, 1, "p", now).admitted for _ in range(12)]
    assert got == [True] * 10 + [False] * 2
    refused = limits.take("n", 100, 1000, 10, 1, "p", now)
    assert refused.retry_after_ms == 10 and refused.remaining == 0
    assert limits.take("n", 100, 1000, 10, 1, "p", now + 10).admitted
    assert not limits.take("n", 100, 1000, 10, 1, "p", now + 10).admitted


def test_a_node_starts_its_limiters_drained_and_again_at_a_new_epoch():
    limits = RateLimits(now=1_000, epoch=1)
    # 10 per second, burst 5: drained at 1_000, one more every 100 ms
    assert not limits.take("n", 10, 1000, 5, 1, "p", 1_050).admitted
    assert limits.take("n", 10, 1000, 5, 1, "p", 1_100).admitted
    assert not limits.take("n", 10, 1000, 5, 1, "p", 1_100).admitted
    limits.serving(1, 50_000)  # the same epoch: nothing changes
    assert limits.take("n", 10, 1000, 5, 5, "p", 50_000).admitted
    limits.serving(2, 60_000)  # promoted: drained again from now
    assert not limits.take("n", 10, 1000, 5, 1, "p", 60_000).admitted
    assert limits.take("n", 10, 1000, 5, 1, "p", 60_100).admitted


def test_a_promoted_node_drains_its_limiters_from_when_the_old_primary_stopped():
    limits = RateLimits(now=1_000, epoch=1)
    # promoted to epoch 2 at 60_000; the old primary stopped admitting by 59_000 (its fence):
    # 10 per second, burst 5 refilled in 500 ms, so the bucket is full at the first take
    limits.serving(2, 60_000, (2, 59_000))
    assert [limits.take("n", 10, 1000, 5, 1, "p", 60_000).admitted for _ in range(6)] == [True] * 5 + [False]
    # a mark of another epoch (an earlier promotion) is not this one's: drained from now
    limits.serving(3, 70_000, (2, 59_000))
    assert not limits.take("n", 10, 1000, 5, 1, "p", 70_000).admitted
    # a mark later than the first request served counts from that request
    limits.serving(4, 80_000, (4, 90_000))
    assert not limits.take("n", 10, 1000, 5, 1, "p", 80_050).admitted
    assert limits.take("n", 10, 1000, 5, 1, "p", 80_100).admitted


def test_conflicting_configuration_and_bounds(monkeypatch):
    limits = RateLimits(now=0)
    limits.take("n", 10, 1000, 5, 1, "p", 10_000)
    with pytest.raises(LimitConflict):
        limits.take("n", 20, 1000, 5, 1, "p", 10_000)
    monkeypatch.setattr(RL, "MAX_LIMITERS_PER_PRINCIPAL", 2)
    monkeypatch.setattr(RL, "MAX_LIMITERS", 3)
    limits.take("m", 10, 1000, 5, 1, "p", 10_000)
    with pytest.raises(LimitExceeded):
        limits.take("o", 10, 1000, 5, 1, "p", 10_000)
    limits.take("q", 10, 1000, 5, 1, "other", 10_000)
    with pytest.raises(LimitExceeded):
        limits.take("r", 10, 1000, 5, 1, "third", 10_000)
    # once their buckets are full again, limiters are the same as none: room again (the
    # table is swept at most every SWEEP_EVERY_MS)
    assert limits.take("o", 10, 1000, 5, 1, "p", 20_000).admitted
    assert limits.take("n", 10, 1000, 5, 5, "p", 20_000).admitted  # "p" at its 2 again, both live
    with pytest.raises(LimitExceeded):  # and no pass over the table until SWEEP_EVERY_MS has passed
        limits.take("s", 10, 1000, 5, 1, "p", 20_000 + RL.SWEEP_EVERY_MS - 1)
    assert len(limits) <= 3


def test_arguments_are_checked():
    assert check_rate_args(1, 1, 1, 1) == (1, 1, 1, 1)
    for bad in [(0, 1000, 1, 1), (1, 0, 1, 1), (1, 1000, 0, 1), (1, 1000, 2, 3), (RL.MAX_RATE + 1, 1000, 1, 1),
                (1, RL.MAX_PERIOD_MS + 1, 1, 1)]:
        with pytest.raises(InvalidArgument):
            check_rate_args(*bad)
    for bad in [(1.0, 1000, 1, 1), (1, "1000", 1, 1), (True, 1000, 1, 1), (1, 1000, None, 1)]:
        with pytest.raises(WrongArgumentType):
            check_rate_args(*bad)


async def test_clients_share_one_limiter_on_the_server(client, connect):
    other = await connect("other")
    limiter = client.rate_limiter("api/calls", 1, 1, per=5.0)  # one per 5 s, drained at the server's start
    async with asyncio.timeout(TIMEOUT):
        await limiter.take(timeout=TIMEOUT)
    refused = await other.limit("api/calls", 1, 1, per=5.0)
    assert not refused.admitted and 0 < refused.retry_after <= 5.0
    with pytest.raises(fastlock.LimitConflict):
        await other.limit("api/calls", 2, 1, per=5.0)
    with pytest.raises(fastlock.LockNotAcquired):
        await other.rate_limiter("api/calls", 1, 1, per=5.0).take(timeout=0.01)
    with pytest.raises(fastlock.InvalidArgument):
        await client.limit("api/x", 1, 1, cost=2)
    with pytest.raises(fastlock.InvalidArgument):
        await client.limit("", 1, 1)


async def test_bad_arguments_on_the_wire_change_nothing(server):
    from fastlock._testbase.cluster import RawNode
    from fastlock.protocol.ops import OP_RATE_LIMIT

    node = await RawNode.open(server.address)
    try:
        for args in [("n", 0, 1000, 1, 1), ("n", 1, 1000, 1, 2), ("n", 1.5, 1000, 1, 1), (b"n", 1, 1000, 1, 1)]:
            with pytest.raises(fastlock.InvalidArgument):
                await node.request(OP_RATE_LIMIT, *args)
        with pytest.raises(fastlock.ProtocolError):
            await node.request(OP_RATE_LIMIT, "n", 1, 1000, 1)
        assert await node.request(OP_RATE_LIMIT, "n", 1000, 1000, 1000, 1) is not None
    finally:
        await node.close()


def test_blocking_client(server):
    from fastlock.sync import SyncClient

    with SyncClient(server.address) as c:
        first = c.limit("api/sync", 1000, 5)
        assert first.admitted or first.retry_after > 0
        limiter = c.rate_limiter("api/sync", 1000, 5)
        limiter.take(timeout=TIMEOUT)
        decision = limiter.try_take()
        assert decision.admitted or decision.retry_after > 0
        c.limit("api/slow", 1, 2, per=60.0)  # live for minutes (drained at the server's start)
        with pytest.raises(fastlock.LimitConflict):
            c.limit("api/slow", 2, 2, per=60.0)
