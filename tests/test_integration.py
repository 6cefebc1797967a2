"""Integration tests against a real `fastlock serve` process (mutual exclusion, fencing, FIFO,
holder-only release, server-clock leases, waiter removal)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import wait_until

import fastlock
from fastlock._testbase import HistoryChecker


async def queued(client, n: int) -> bool:
    return (await client.status())["waiters"] == n


async def test_acquire_release_and_tokens_strictly_increase(client):
    tokens = []
    for _ in range(20):
        lease = await client.acquire("tok", ttl=5.0)
        tokens.append(lease.fencing_token)
        assert await client.check("tok", lease.fencing_token)
        await client.release(lease)
        assert not await client.check("tok", lease.fencing_token)
    assert tokens == sorted(set(tokens))
    assert len(tokens) == 20


async def test_mutual_exclusion_50_clients(connect):
    clients = [await connect(f"c{i}") for i in range(50)]
    history = HistoryChecker()
    inside = 0
    max_inside = 0

    async def worker(c):
        nonlocal inside, max_inside
        for _ in range(6):
            lease = await c.acquire("shared", ttl=10.0, wait=30.0)
            history.held("shared", lease.fencing_token, time.monotonic())
            inside += 1
            max_inside = max(max_inside, inside)
            await asyncio.sleep(0)  # let others run while we "hold"
            inside -= 1
            history.released("shared", lease.fencing_token, time.monotonic())
            await c.release(lease)

    await asyncio.wait_for(asyncio.gather(*(worker(c) for c in clients)), 60)
    assert max_inside == 1
    assert history.check() == 300


async def test_fifo_order_of_12_waiters(connect, client):
    holder = await client.acquire("fifo", ttl=30.0)
    waiters = [await connect(f"w{i}") for i in range(12)]
    order: list[int] = []

    async def wait_turn(i, c):
        lease = await c.acquire("fifo", ttl=30.0, wait=30.0)
        order.append(i)
        await c.release(lease)

    tasks = []
    for i, c in enumerate(waiters):
        tasks.append(asyncio.ensure_future(wait_turn(i, c)))
        await wait_until(lambda i=i: queued(client, i + 1), what=f"waiter {i} queued")
    await client.release(holder)
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert order == list(range(12))


async def test_try_lock_and_wait_timeout(connect, client):
    other = await connect("other")
    lease = await client.acquire("try", ttl=30.0, wait=0)
    with pytest.raises(fastlock.LockNotAcquired):
        await other.acquire("try", ttl=30.0, wait=0)
    t0 = time.monotonic()
    with pytest.raises(fastlock.LockNotAcquired) as info:
        await other.acquire("try", ttl=30.0, wait=0.3)
    assert time.monotonic() - t0 >= 0.29
    assert isinstance(info.value, TimeoutError)
    assert (await client.status())["waiters"] == 0
    await client.release(lease)
    lease2 = await other.acquire("try", ttl=30.0, wait=0)
    assert lease2.fencing_token > lease.fencing_token


async def test_extend_keeps_the_lease_past_its_ttl(client, connect):
    other = await connect("other")
    lease = await client.acquire("ext", ttl=0.4)
    for _ in range(4):
        lease = await client.extend(lease, ttl=0.4)
        await asyncio.sleep(0.2)  # hold: half a TTL between renewals
    with pytest.raises(fastlock.LockNotAcquired):
        await other.acquire("ext", ttl=1.0, wait=0)
    assert await client.check("ext", lease.fencing_token)
    longer = await client.extend(lease, ttl=5.0)
    assert longer.ttl == 5.0 and longer.fencing_token == lease.fencing_token
    await client.release(longer)


async def test_expiry_hands_off_to_the_next_waiter(client, connect):
    other = await connect("other")
    dead = await client.acquire("exp", ttl=0.3)
    t0 = time.monotonic()
    lease = await other.acquire("exp", ttl=5.0, wait=5.0)
    assert time.monotonic() - t0 >= 0.25
    assert lease.fencing_token > dead.fencing_token
    with pytest.raises(fastlock.LeaseLost):
        await client.extend(dead)  # an expired lease is never revived
    with pytest.raises(fastlock.LeaseLost):
        await client.release(dead)
    assert dead.lost.is_set()
    assert await other.check("exp", lease.fencing_token)
    await other.release(lease)


async def test_non_holder_release_and_extend_are_refused(client, connect):
    other = await connect("other")
    lease = await client.acquire("own", ttl=30.0)
    forged = fastlock.Lease(lease.name, lease.fencing_token, lease.ttl, os.urandom(16))
    old = fastlock.Lease(lease.name, lease.fencing_token - 1 if lease.fencing_token > 1 else 1 << 30,
                         lease.ttl, lease.owner)
    for bad in (forged, old):
        with pytest.raises(fastlock.LeaseLost):
            await other.release(bad)
        with pytest.raises(fastlock.LeaseLost):
            await other.extend(bad)
    assert await client.check("own", lease.fencing_token)
    # ownership goes by lease, not by connection: another connection may release it
    await other.release(lease)
    assert not await client.check("own", lease.fencing_token)


async def test_lock_delay_after_expiry_but_not_after_release(client, connect):
    other = await connect("other")
    lease = await client.acquire("delay", ttl=0.1, lock_delay=0.5)
    await client.release(lease)
    quick = await other.acquire("delay", ttl=0.1, wait=0, lock_delay=0.5)  # clean release: no delay
    t_expiry = time.monotonic() + 0.1
    got = await client.acquire("delay", ttl=5.0, wait=5.0)
    assert time.monotonic() - t_expiry >= 0.45
    assert got.fencing_token > quick.fencing_token
    await client.release(got)


async def test_a_try_once_acquire_during_a_lock_delay_is_told_so(client, connect):
    """The lock is free (no holder) while its lock-delay runs: a refused try-once acquire
    says lock-delay, not "is held"."""
    other = await connect("other")
    await client.acquire("delayed", ttl=0.1, lock_delay=30.0)  # never released: it expires

    async def expired() -> bool:
        return await other.holder("delayed") is None

    await wait_until(expired, what="the lease to expire")
    with pytest.raises(fastlock.LockNotAcquired, match="'delayed' is in its lock-delay"):
        await other.acquire("delayed", ttl=1.0, wait=0)


async def test_cancelled_acquire_leaves_no_waiter(client, connect):
    other = await connect("other")
    lease = await client.acquire("cancel", ttl=30.0)
    task = asyncio.ensure_future(other.acquire("cancel", ttl=30.0, wait=None))
    await wait_until(lambda: queued(client, 1), what="waiter queued")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: queued(client, 0), what="waiter removed")
    await client.release(lease)
    st = await client.status()
    assert st["locks_held"] == 0


async def test_asyncio_timeout_around_acquire_removes_waiter(client, connect):
    other = await connect("other")
    lease = await client.acquire("to", ttl=30.0)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await other.acquire("to", ttl=30.0)
    await wait_until(lambda: queued(client, 0), what="waiter removed")
    await client.release(lease)
    assert (await client.status())["locks_held"] == 0


async def test_grant_racing_with_cancel_is_released_not_leaked(client, connect):
    """Release and cancel at the same instant, many times: the lock must end free."""
    other = await connect("other")
    for i in range(40):
        lease = await client.acquire("race", ttl=30.0)
        task = asyncio.ensure_future(other.acquire("race", ttl=30.0, wait=None))
        await wait_until(lambda: queued(client, 1), what="waiter queued")
        release = asyncio.ensure_future(client.release(lease))
        for _ in range(i % 4):
            await asyncio.sleep(0)
        task.cancel()
        await release
        try:
            won = await task
        except asyncio.CancelledError:
            won = None
        if won is not None:
            await other.release(won)
        await wait_until(lambda: _free(client, "race"), what="lock free after the race")


async def _free(client, name):
    st = await client.status()
    return st["locks_held"] == 0 and st["waiters"] == 0


async def test_disconnect_removes_waiters_but_keeps_leases(client, connect, server):
    other = await connect("other")
    held = await other.acquire("held-by-other", ttl=30.0)
    blocker = await client.acquire("blocked", ttl=30.0)
    waiter = asyncio.ensure_future(other.acquire("blocked", ttl=30.0))
    await wait_until(lambda: queued(client, 1), what="waiter queued")
    await other.close()
    with pytest.raises(fastlock.ConnectionLost):
        await waiter
    await wait_until(lambda: queued(client, 0), what="waiter removed on disconnect")
    # the lease outlives its connection, and any connection holding it may release it
    assert await client.check("held-by-other", held.fencing_token)
    await client.release(held)
    await client.release(blocker)


async def test_killed_client_process_waiter_removed(client, server, tmp_path):
    lease = await client.acquire("kill", ttl=30.0)
    code = (
        "import asyncio, fastlock\n"
        "async def main():\n"
        f"    c = await fastlock.connect({server.address!r})\n"
        "    await c.acquire('kill', ttl=30.0)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path)
    try:
        await wait_until(lambda: queued(client, 1), timeout=15, what="child waiting")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        await wait_until(lambda: queued(client, 0), what="dead child's waiter removed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    await client.release(lease)
    assert (await client.status())["locks_held"] == 0


async def test_auto_renew_keeps_the_lock_for_5x_ttl(client, connect):
    other = await connect("other")
    ttl = 0.4
    async with client.lock("renew", ttl=ttl) as lease:
        end = time.monotonic() + 5 * ttl
        while time.monotonic() < end:
            with pytest.raises(fastlock.LockNotAcquired):
                await other.acquire("renew", ttl=1.0, wait=0)
            await asyncio.sleep(ttl / 4)
        assert not lease.lost.is_set()
        assert await other.check("renew", lease.fencing_token)
    assert not await other.check("renew", lease.fencing_token)
    free = await other.acquire("renew", ttl=1.0, wait=0)
    await other.release(free)


async def test_lock_sets_lost_when_the_lease_is_taken_away(client, connect):
    other = await connect("other")
    async with client.lock("stolen", ttl=0.5) as lease:
        # anyone presenting the lease may release it; the renewer then learns it is gone
        await other.release(lease)
        await asyncio.wait_for(lease.lost.wait(), 3)
    assert lease.lost.is_set()


async def test_lock_is_awaitable_and_renews_until_released(client):
    lease = await client.lock("await", ttl=0.3)
    await asyncio.sleep(0.9)
    assert await client.check("await", lease.fencing_token)
    await client.release(lease)


async def test_same_client_is_not_reentrant(client):
    lease = await client.acquire("reent", ttl=30.0)
    with pytest.raises(fastlock.LockNotAcquired):   # the server says so (same connection)
        await client.acquire("reent", ttl=30.0, wait=0)
    with pytest.raises(fastlock.AlreadyHeld):   # a waiting one: the client says so, sending nothing
        await client.acquire("reent", ttl=30.0, wait=10)
    second = asyncio.ensure_future(client.acquire("reent", ttl=30.0, wait=10, queue_behind_self=True))
    await wait_until(lambda: queued(client, 1), what="second acquire queued")
    await client.release(lease)
    lease2 = await second
    assert lease2.fencing_token > lease.fencing_token
    await client.release(lease2)


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(name="", ttl=1.0), ValueError),
        (dict(name="x" * 513, ttl=1.0), ValueError),
        (dict(name=b"x", ttl=1.0), TypeError),
        (dict(name="x", ttl=0), ValueError),
        (dict(name="x", ttl=-1.0), ValueError),
        (dict(name="x", ttl=float("nan")), ValueError),
        (dict(name="x", ttl=float("inf")), ValueError),
        (dict(name="x", ttl=True), TypeError),
        (dict(name="x", ttl="1"), TypeError),
        (dict(name="x", ttl=3600.001), ValueError),
        (dict(name="x", ttl=1.0, wait=-0.5), ValueError),
        (dict(name="x", ttl=1.0, lock_delay=61), ValueError),
    ],
)
async def test_bad_arguments_raise_before_sending(client, kwargs, exc):
    kwargs = dict(kwargs)
    name = kwargs.pop("name")
    with pytest.raises(exc) as info:
        await client.acquire(name, **kwargs)
    assert isinstance(info.value, fastlock.FastlockError)
    st = await client.status()
    assert st["grants"] == 0 and st["waiters"] == 0


async def test_a_ttl_in_milliseconds_is_refused_naming_the_units(client, connect):
    """acquire(ttl=10000) (the Redis PX habit) would be a 2.8-hour lease: it is refused before
    anything is sent, saying that a TTL is in seconds; one hour is the longest."""
    with pytest.raises(fastlock.InvalidArgument) as refused:
        await client.acquire("px", ttl=10000)
    assert str(refused.value) == ("ttl 10000 s (2.8 hours) is above the longest lease TTL, 3600 s (1 hour): a TTL "
                                  "is in seconds in the Python API and the command line (ttl=10 is 10 s); hold a "
                                  "lock longer by renewing it (lock(), extend())")
    lease = await client.acquire("px", ttl=3600)
    with pytest.raises(fastlock.InvalidArgument, match="above the longest lease TTL"):
        await client.extend(lease, ttl=3601)
    with pytest.raises(fastlock.InvalidArgument, match="above the longest lease TTL"):
        await client.acquire_many(["px2", "px3"], ttl=5000)
    await client.release(lease)


async def test_watch_delivers_every_holder_change_in_order(client, connect):
    watcher = await connect("watcher")
    worker = await connect("worker")
    events = []
    seen = asyncio.Event()
    expected = 1 + 3 * 2 + 2  # initial state, 3 grant/release pairs, one grant + expiry

    async def watch():
        async for ev in watcher.watch("w"):
            events.append(ev)
            if len(events) == expected:
                seen.set()
                return

    task = asyncio.ensure_future(watch())
    await wait_until(lambda: len(events) == 1, what="watch started")
    tokens = []
    for _ in range(3):
        lease = await worker.acquire("w", ttl=10.0)
        tokens.append(lease.fencing_token)
        await worker.release(lease)
    short = await worker.acquire("w", ttl=0.1)
    await asyncio.wait_for(seen.wait(), 5)
    await task
    assert events[0].kind == "free"
    assert [(e.kind, e.token) for e in events[1:7]] == [
        (k, t) for t in tokens for k in ("granted", "released")
    ]
    assert [(e.kind, e.token) for e in events[7:]] == [("granted", short.fencing_token),
                                                       ("expired", short.fencing_token)]
    assert all(e.client == "worker" for e in events[1:])
    assert await watcher.holder("w") is None


async def test_holder_reports_the_current_holder(client):
    assert await client.holder("h") is None
    lease = await client.acquire("h", ttl=10.0)
    info = await client.holder("h")
    assert info["token"] == lease.fencing_token and info["client"] == "test-client"
    assert 0 < info["remaining_ms"] <= 10_000
    await client.release(lease)


@pytest.mark.parametrize("mode", ["never", "interval"])
async def test_relaxed_fsync_modes_grant_and_hand_off(server_factory, loop_errors, mode):
    srv = server_factory(f"data-{mode}", fsync=mode)
    async with fastlock.connect(srv.address) as a, fastlock.connect(srv.address) as b:
        tokens = []
        for _ in range(50):
            lease = await a.acquire("relaxed", ttl=5.0)
            tokens.append(lease.fencing_token)
            waiter = asyncio.ensure_future(b.acquire("relaxed", ttl=5.0, wait=5.0))
            await wait_until(lambda: queued(a, 1), what="waiter queued")
            await a.release(lease)
            handed = await waiter
            tokens.append(handed.fencing_token)
            await b.release(handed)
        assert tokens == sorted(set(tokens))


async def test_holder_and_watch_carry_the_lease_owners_names(client, connect):
    other = await connect("releaser")
    events = []
    got = asyncio.Event()

    async def watch():
        async for ev in client.watch("names"):
            events.append(ev)
            if len(events) == 3:
                got.set()
                return

    task = asyncio.ensure_future(watch())
    await wait_until(lambda: len(events) == 1, what="watch started")
    lease = await client.acquire("names", ttl=10.0, correlation_id="req-7")
    info = await client.holder("names")
    assert (info["client"], info["correlation_id"]) == ("test-client", "req-7")
    await other.release(lease)  # released by another connection: still the holder's names
    await asyncio.wait_for(got.wait(), 5)
    await task
    assert [(e.kind, e.client, e.correlation_id) for e in events[1:]] == [
        ("granted", "test-client", "req-7"), ("released", "test-client", "req-7")]


def test_cli_run_is_wired(tmp_path, server):
    out = subprocess.run(
        [sys.executable, "-m", "fastlock", "run", "cli-run", "--ttl", "5", "--server", server.address, "--",
         sys.executable, "-c", "import os; print(os.environ['FASTLOCK_FENCING_TOKEN'])"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 0
