"""Shared locks, semaphores, the atomic multi-lock and deadlock detection against real
server processes (issue 13); the core's own rules are in test_core_kinds.py."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time

import pytest
from conftest import STALL_S, wait_until

import fastlock
from fastlock import protocol as P
from fastlock._testbase import HistoryChecker
from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock.errors import DeadlockDetected, InvalidArgument, LimitConflict, LockNotAcquired

TIMEOUT = 10.0


async def _loop_holders(clients, run_for: float, pick):
    """Every client acquires, holds a moment and releases in a loop for ``run_for``
    seconds; ``pick(i)`` -> (acquire coroutine factory, shared, limit).  Records every
    holding in a HistoryChecker, which is returned with the peak overlap."""
    history = HistoryChecker()
    inside = {"now": 0, "peak": 0}
    end = time.monotonic() + run_for

    async def worker(i, client):
        rnd = random.Random(i)
        while time.monotonic() < end:
            acquire, shared, limit = pick(client, rnd)
            lease = await acquire()
            history.held(lease.name, lease.fencing_token, time.monotonic(), shared, limit)
            inside["now"] += 1
            inside["peak"] = max(inside["peak"], inside["now"])
            await asyncio.sleep(rnd.uniform(0, 0.004))
            inside["now"] -= 1
            history.released(lease.name, lease.fencing_token, time.monotonic())
            await client.release(lease)

    await asyncio.wait_for(asyncio.gather(*(worker(i, c) for i, c in enumerate(clients))), run_for + TIMEOUT)
    return history, inside["peak"]


async def test_readers_share_and_writers_exclude(connect):
    clients = [await connect(f"rw-{i}") for i in range(16)]
    peak_readers = {"now": 0, "peak": 0}
    history = HistoryChecker()
    end = time.monotonic() + 1.5

    async def worker(i, client):
        rnd = random.Random(i)
        while time.monotonic() < end:
            shared = rnd.random() < 0.75
            lease = await client.acquire("rw", ttl=5.0, wait=TIMEOUT, shared=shared)
            history.held("rw", lease.fencing_token, time.monotonic(), shared)
            if shared:
                peak_readers["now"] += 1
                peak_readers["peak"] = max(peak_readers["peak"], peak_readers["now"])
            await asyncio.sleep(rnd.uniform(0, 0.004))
            if shared:
                peak_readers["now"] -= 1
            history.released("rw", lease.fencing_token, time.monotonic())
            await client.release(lease)

    await asyncio.wait_for(asyncio.gather(*(worker(i, c) for i, c in enumerate(clients))), TIMEOUT + 2)
    assert history.check() > 100  # no writer overlapped anyone; tokens grow across every writer
    assert peak_readers["peak"] >= 2  # readers did hold together


async def test_a_stream_of_readers_does_not_starve_a_queued_writer(connect):
    reader, writer, late = await connect("reader"), await connect("writer"), await connect("late")
    first = await reader.acquire("doc", ttl=5.0, shared=True)
    second = await late.acquire("doc", ttl=5.0, wait=0, shared=True)  # readers share
    pending = asyncio.ensure_future(writer.acquire("doc", ttl=5.0, wait=TIMEOUT))
    await wait_until(lambda: _waiting(late, "doc", 1), what="the writer to queue")
    # a reader arriving behind the waiting writer is not let in past it
    with pytest.raises(LockNotAcquired):
        await late.acquire("doc", ttl=5.0, wait=0, shared=True)
    queued_reader = asyncio.ensure_future(late.acquire("doc", ttl=5.0, wait=TIMEOUT, shared=True))
    await wait_until(lambda: _waiting(late, "doc", 2), what="the second reader to queue")
    seen = await late.contenders("doc")
    assert sorted(h["token"] for h in seen["holders"]) == [first.fencing_token, second.fencing_token]
    assert [h["shared"] for h in seen["holders"]] == [True, True]
    assert [(w["shared"], w["client"]) for w in seen["waiters"]] == [(False, "writer"), (True, "late")]
    await reader.release(first)
    await late.release(second)
    w = await asyncio.wait_for(pending, TIMEOUT)
    assert not queued_reader.done()
    await writer.release(w)
    r = await asyncio.wait_for(queued_reader, TIMEOUT)
    assert r.fencing_token > w.fencing_token > second.fencing_token
    await late.release(r)


async def _waiting(client, name, n):
    return len((await client.contenders(name))["waiters"]) == n


async def test_a_semaphore_of_three_never_has_four_holders(connect):
    clients = [await connect(f"sem-{i}") for i in range(20)]

    def pick(client, rnd):
        sem = client.semaphore("pool", 3)
        return (lambda: sem.acquire(ttl=5.0, wait=TIMEOUT)), False, 3

    history, peak = await _loop_holders(clients, 1.5, pick)
    assert history.check() > 100  # never 4 permits at once; tokens unique and increasing
    assert peak == 3
    # the limit is kept while the semaphore is held: another limit, or a lock, is refused
    held = await clients[0].semaphore("pool", 3).acquire(ttl=5.0)
    with pytest.raises(LimitConflict, match="limit 3"):
        await clients[1].semaphore("pool", 4).acquire(ttl=5.0, wait=0)
    with pytest.raises(LimitConflict):
        await clients[1].acquire("pool", ttl=5.0, wait=0)
    await clients[0].release(held)
    again = await clients[1].semaphore("pool", 4).acquire(ttl=5.0, wait=0)  # free: a new limit is fine
    assert again.fencing_token > held.fencing_token


async def test_semaphore_and_shared_arguments_are_checked_before_sending(client):
    with pytest.raises(InvalidArgument):
        client.semaphore("s", 0)
    with pytest.raises(InvalidArgument):
        await client.acquire("s", ttl=1.0, shared=True, limit=2)
    with pytest.raises(TypeError):
        await client.acquire("s", ttl=1.0, shared="yes")


async def test_the_server_refuses_bad_kind_arguments(server):
    node = await RawNode.open(server.address)
    try:
        for args, match in [((1, 0), "shared must be a bool"), ((False, -1), "limit must be"),
                            ((True, 3), "cannot also be shared"), ((False, 1 << 40), "limit must be")]:
            with pytest.raises(InvalidArgument, match=match):
                await node.request(P.OP_ACQUIRE, "k", b"o" * 16, 1000, 0, 0, None, *args)
        for items, match in [([], "1..64"), ([["a", False], ["a", True]], "once"), ("a", "list"),
                             ([["a"]], "pair"), ([["", False]], "empty")]:
            with pytest.raises(InvalidArgument, match=match):
                await node.request(P.OP_ACQUIRE_MANY, items, b"o" * 16, 1000, 0, 0, None)
        for actor, match in [(True, "actor must be an int"), (-1, "actor must be 0"), (1 << 63, "actor must be 0"),
                             ("t", "actor must be an int")]:
            with pytest.raises(InvalidArgument, match=match):
                await node.request(P.OP_ACQUIRE, "k", b"o" * 16, 1000, 0, 0, None, False, 0, actor)
            with pytest.raises(InvalidArgument, match=match):
                await node.request(P.OP_ACQUIRE_MANY, [["k", False]], b"o" * 16, 1000, 0, 0, None, actor)
        assert (await node.status())["locks_held"] == 0
        # an actor is optional, announced in HELLO, and a valid one is taken
        assert node.hello["actors"] is True
        token, _, _ = await node.request(P.OP_ACQUIRE, "k", b"o" * 16, 1000, 0, 0, None, False, 0, (1 << 63) - 1)
        await node.request(P.OP_RELEASE, "k", token, b"o" * 16)
    finally:
        await node.close()


async def test_atomic_multi_lock_never_deadlocks_nor_holds_a_partial_set(connect):
    names = [f"m{i}" for i in range(8)]
    clients = [await connect(f"multi-{i}") for i in range(4)]
    history = HistoryChecker()
    end = time.monotonic() + 3.0
    counts = {"sets": 0}

    async def task(i):
        rnd = random.Random(100 + i)
        client = clients[i % len(clients)]
        while time.monotonic() < end:
            chosen = rnd.sample(names, rnd.randint(2, 4))
            multi = await client.acquire_many(chosen, ttl=5.0, wait=TIMEOUT)
            assert sorted(multi.names) == sorted(chosen)  # the whole set, never part of it
            now = time.monotonic()
            for lease in multi:
                history.held(lease.name, lease.fencing_token, now)
            await asyncio.sleep(rnd.uniform(0, 0.003))
            now = time.monotonic()
            for lease in multi:
                history.released(lease.name, lease.fencing_token, now)
            await client.release_many(multi)
            counts["sets"] += 1

    await asyncio.wait_for(asyncio.gather(*(task(i) for i in range(20))), 3.0 + TIMEOUT)
    assert history.check() > 0 and counts["sets"] > 50


async def test_multi_lock_waits_holding_nothing_and_is_one_request(connect):
    a, b = await connect("a"), await connect("b")
    held = await a.acquire("y", ttl=5.0)
    pending = asyncio.ensure_future(b.acquire_many(["x", "y"], ttl=5.0, wait=TIMEOUT, shared=["x"]))
    await wait_until(lambda: _waiting(a, "y", 1), what="the multi-lock to queue")
    # while it waits it holds none of its names (x has no holder), and it keeps its
    # place on each: a later acquire of x queues behind it (FIFO per name)
    info = await a.contenders("x")
    assert info["holders"] == [] and [w["many"] for w in info["waiters"]] == [True]
    with pytest.raises(LockNotAcquired):
        await a.acquire("x", ttl=5.0, wait=0)
    await a.release(held)
    multi = await asyncio.wait_for(pending, TIMEOUT)
    assert multi.fencing_tokens["x"] != multi.fencing_tokens["y"]
    assert (await a.contenders("x"))["holders"][0]["shared"] is True
    with pytest.raises(LockNotAcquired):
        await a.acquire_many(["x", "y"], ttl=5.0, wait=0)
    await b.release_many(multi)


@pytest.mark.parametrize("n", [2, 3])
async def test_a_deadlock_is_broken_with_deadlock_detected(server_factory, n):
    srv = server_factory(f"dl{n}", args=["--deadlock-timeout", "0.5"])
    clients = [await fastlock.connect(srv.address, client_name=f"dl-{i}") for i in range(n)]
    names = [f"d{i}" for i in range(n)]
    holding = []
    all_hold = asyncio.Event()
    failed = []
    one_failed = asyncio.Event()

    async def worker(i):
        # one task holds its own lock and then waits for the next client's: a real cycle
        client = clients[i]
        first = await client.acquire(names[i], ttl=10.0)
        holding.append(i)
        if len(holding) == n:
            all_hold.set()
        await all_hold.wait()
        try:
            lease = await client.acquire(names[(i + 1) % n], ttl=10.0, wait=TIMEOUT)
        except DeadlockDetected as exc:
            failed.append((i, exc))
            one_failed.set()
            await client.release(first)  # the victim gives up what it holds: the others proceed
            return
        await client.release(lease)
        await client.release(first)

    try:
        tasks = [asyncio.ensure_future(worker(i)) for i in range(n)]
        await asyncio.wait_for(all_hold.wait(), TIMEOUT)
        started = time.monotonic()
        await asyncio.wait_for(one_failed.wait(), 0.5 + 1.0)  # within --deadlock-timeout + 1 s
        assert time.monotonic() - started >= 0.4  # not before the cycle was --deadlock-timeout old
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
        ((_victim, err),) = failed
        assert "deadlock detected" in str(err) and all(name in str(err) for name in names)
    finally:
        for c in clients:
            await c.close()


async def _no_deadlock_for(seconds: float, waits) -> None:
    """None of ``waits`` ends for ``seconds`` (longer than detection's worst case,
    1.5 x --deadlock-timeout)."""
    done, _ = await asyncio.wait(waits, timeout=seconds)
    assert not done, [w.exception() for w in done]


async def _queued(client, name: str, n: int) -> None:
    async def waiting():
        return len((await client.contenders(name))["waiters"]) == n
    await wait_until(waiting, TIMEOUT, f"{n} waiters on {name}")


async def _take_in_turn(client, waits) -> None:
    """Each of ``waits`` (acquires of one lock) is granted once the one before it is released."""
    pending = set(waits)
    while pending:
        done, pending = await asyncio.wait(pending, timeout=TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        assert done, "a waiter was never granted"
        for w in done:
            await client.release(w.result())


@pytest.fixture
async def two_clients(server_factory):
    """Clients a and b of a server with --deadlock-timeout 0.2 s."""
    srv = server_factory("dl-two", args=["--deadlock-timeout", "0.2"])
    a = await fastlock.connect(srv.address, client_name="a")
    b = await fastlock.connect(srv.address, client_name="b")
    yield a, b
    await a.close()
    await b.close()


async def test_tasks_of_one_client_waiting_behind_another_clients_holder_are_no_deadlock(two_clients):
    a, b = two_clients
    held = await a.acquire("q", ttl=10.0)
    waits = [asyncio.ensure_future(b.acquire("q", ttl=10.0, wait=TIMEOUT)) for _ in range(2)]
    await _queued(a, "q", 2)
    await _no_deadlock_for(0.6, waits)
    await a.release(held)
    await _take_in_turn(b, waits)


async def test_a_client_holding_in_one_task_and_waiting_in_another_is_no_deadlock(two_clients):
    # a's main task holds x; another task of a, a caller of its own (made with
    # new_caller(): not acting for the task that created it), waits for y, held by b,
    # which waits for x: a's main task can still release x, so nobody is failed
    a, b = two_clients
    x = await a.acquire("x", ttl=10.0)
    y = await b.acquire("y", ttl=10.0)

    async def on_its_own():
        fastlock.client.new_caller()
        return await a.acquire("y", ttl=10.0, wait=TIMEOUT)

    a_waits = asyncio.ensure_future(on_its_own())
    await _queued(a, "y", 1)
    b_waits = asyncio.ensure_future(b.acquire("x", ttl=10.0, wait=TIMEOUT))
    await _queued(a, "x", 1)
    await _no_deadlock_for(0.6, [a_waits, b_waits])
    await a.release(x)
    await b.release(await asyncio.wait_for(b_waits, TIMEOUT))
    await b.release(y)
    await a.release(await asyncio.wait_for(a_waits, TIMEOUT))


async def test_two_tasks_of_one_client_in_a_cycle_are_broken(server_factory):
    srv = server_factory("dl-self", args=["--deadlock-timeout", "0.2"])
    a = await fastlock.connect(srv.address, client_name="a")
    holding = []
    both_hold = asyncio.Event()
    outcomes = []

    async def task(mine, other):
        first = await a.acquire(mine, ttl=10.0)
        holding.append(mine)
        if len(holding) == 2:
            both_hold.set()
        await both_hold.wait()
        try:
            lease = await a.acquire(other, ttl=10.0, wait=TIMEOUT)
        except DeadlockDetected:
            outcomes.append("failed")
        else:
            outcomes.append("granted")
            await a.release(lease)
        await a.release(first)

    try:
        await asyncio.wait_for(asyncio.gather(task("m", "n"), task("n", "m")), TIMEOUT)
        assert sorted(outcomes) == ["failed", "granted"]
    finally:
        await a.close()


async def test_shared_leases_and_permits_survive_a_restart(server_factory):
    srv = server_factory("restart")
    a = await fastlock.connect(srv.address, client_name="a")
    r1 = await a.acquire("doc", ttl=30.0, shared=True)
    r2 = await a.acquire("doc", ttl=30.0, shared=True)
    p1 = await a.semaphore("pool", 2).acquire(ttl=30.0)
    await a.close()
    srv.stop()
    srv = server_factory("restart")
    b = await fastlock.connect(srv.address, client_name="b")
    try:
        info = await b.contenders("doc")
        assert sorted(h["token"] for h in info["holders"]) == sorted([r1.fencing_token, r2.fencing_token])
        assert all(h["shared"] for h in info["holders"])
        with pytest.raises(LockNotAcquired):
            await b.acquire("doc", ttl=1.0, wait=0)
        r3 = await b.acquire("doc", ttl=1.0, wait=0, shared=True)  # readers still share
        assert r3.fencing_token > p1.fencing_token
        await b.semaphore("pool", 2).acquire(ttl=1.0, wait=0)  # one permit was left
        with pytest.raises(LockNotAcquired):
            await b.semaphore("pool", 2).acquire(ttl=1.0, wait=0)
        with pytest.raises(LimitConflict):
            await b.semaphore("pool", 5).acquire(ttl=1.0, wait=0)
    finally:
        await b.close()


def test_a_standby_keeps_shared_leases_and_permits_through_promotion(cluster):
    from fastlock._testbase.cluster import run

    p = cluster.primary()
    s = cluster.standby(p.address, grace=0.5)

    async def main():
        a = await RawNode.open(p.address)
        try:
            owners = [os.urandom(16) for _ in range(3)]
            shared = [await a.request(P.OP_ACQUIRE, "doc", o, 30_000, 0, 0, None, True) for o in owners[:2]]
            permit = await a.request(P.OP_ACQUIRE, "pool", owners[2], 30_000, 0, 0, None, False, 2)
            last = (await a.status())["wal"]["last_lsn"]
            await poll(lambda: status_of(s.address), lambda st: st["replication"]["applied_lsn"] >= last,
                       timeout=5.0, what="the standby to catch up")
        finally:
            await a.close()
        from test_replication import cli

        res = await asyncio.to_thread(cli, "promote", "--server", s.address)
        assert res.returncode == 0, res.stderr
        b = await RawNode.open(s.address)
        try:
            info = await b.request(P.OP_CONTENDERS, "doc")
            assert sorted(h["token"] for h in info["holders"]) == sorted(t[0] for t in shared)
            assert all(h["shared"] for h in info["holders"])
            info = await b.request(P.OP_CONTENDERS, "pool")
            assert [(h["token"], h["limit"]) for h in info["holders"]] == [(permit[0], 2)]
            # the holders extend on the new primary with the leases they have
            for (token, _, _), owner in zip(shared, owners):
                assert await b.extend("doc", token, owner, 30_000) == 30_000
        finally:
            await b.close()

    run(main())


def test_fastlock_run_limit_runs_at_most_n_commands_at_once(server, tmp_path):
    """``fastlock run --limit 2``: two commands hold permits together, a third waits
    (as ``consul lock -n 2``); a different limit meanwhile is refused (exit 2)."""
    import subprocess
    import sys

    from fastlock.sync import SyncClient

    def run(*args, command):
        return [sys.executable, "-m", "fastlock", "run", "jobs", *args, "--server", server.address, "--", *command]

    gate = tmp_path / "go"
    child = ("import os, pathlib, sys, time\n"
             "pathlib.Path(sys.argv[1]).write_text(os.environ['FASTLOCK_FENCING_TOKEN'] + '\\n')\n"
             "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.01)\n")
    procs = [subprocess.Popen(run("--limit", "2", command=[sys.executable, "-c", child, str(tmp_path / f"r{i}"),
                                                           str(gate)]), cwd=tmp_path) for i in range(2)]
    try:
        with SyncClient(server.address, client_name="observer") as sync:
            deadline = time.monotonic() + TIMEOUT
            while not all((tmp_path / f"r{i}").exists() for i in range(2)):
                assert time.monotonic() < deadline, "the two permit holders did not start"
                assert all(p.poll() is None for p in procs)
                time.sleep(0.01)
            info = sync.contenders("jobs")
            assert [h["limit"] for h in info["holders"]] == [2, 2]
            out = subprocess.run(run("--limit", "2", "--wait", "0", command=["true"]), cwd=tmp_path,
                                 capture_output=True, text=True, timeout=TIMEOUT)
            assert out.returncode == 73, out.stderr  # no third permit
            out = subprocess.run(run("--limit", "3", "--wait", "0", command=["true"]), cwd=tmp_path,
                                 capture_output=True, text=True, timeout=TIMEOUT)
            assert out.returncode == 2 and "limit 2" in out.stderr
            gate.touch()
            assert [p.wait(TIMEOUT) for p in procs] == [0, 0]
            permit = sync.semaphore("jobs", 5).acquire(ttl=1.0, wait=0)  # free again: any limit
            reader = sync.acquire("doc", ttl=1.0, shared=True)
            assert sync.acquire("doc", ttl=1.0, wait=0, shared=True).fencing_token > reader.fencing_token
            sync.release(permit)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


async def _expired_with_delay(address: str, name: str, delay_ms: int) -> float:
    """Take ``name`` with a 200 ms lease and a lock-delay of ``delay_ms``; return the
    monotonic time by which it had expired (seen by polling its holders)."""
    node = await RawNode.open(address)
    try:
        await node.request(P.OP_ACQUIRE, name, os.urandom(16), 200, 0, delay_ms, None)
        started = time.monotonic()
        await poll(lambda: node.request(P.OP_CONTENDERS, name), lambda info: not info["holders"],
                   timeout=5.0, what="the lease to expire")
        return started + 0.2
    finally:
        await node.close()


@pytest.mark.one_loop  # the subject is the restarted server process
@pytest.mark.parametrize("how", ["stop", "kill"])  # SIGTERM, or SIGKILL: a crash
async def test_a_running_lock_delay_survives_a_restart(server_factory, how):
    srv = server_factory("delay")
    expired = await _expired_with_delay(srv.address, "job", 2500)
    # the expiry is seen in memory before its record is durable: a kill before that would
    # restart with the lease still held (it expires again, its delay starting then)
    logged = (await status_of(srv.address))["wal"]["last_lsn"]
    await poll(lambda: status_of(srv.address), lambda st: st["wal"]["durable_lsn"] >= logged,
               timeout=5.0, what="the expiry record to be durable")
    getattr(srv, how)()
    srv = server_factory("delay")
    await asyncio.to_thread(srv.wait_for_log, r"1 running lock-delays", 5)
    node = await RawNode.open(srv.address)
    try:
        with pytest.raises(LockNotAcquired):
            await node.request(P.OP_ACQUIRE, "job", os.urandom(16), 1000, 0, 0, None)
        await node.request(P.OP_ACQUIRE, "job", os.urandom(16), 1000, 5000, 0, None)
        assert time.monotonic() >= expired + 2.5 - 0.1  # not granted before the delay ran out
    finally:
        await node.close()


def test_a_running_lock_delay_survives_a_promotion(cluster):
    from fastlock._testbase.cluster import run

    p = cluster.primary()
    s = cluster.standby(p.address, grace=0.0)

    async def main():
        expired = await _expired_with_delay(p.address, "job", 3000)
        last = (await status_of(p.address))["wal"]["last_lsn"]
        await poll(lambda: status_of(s.address), lambda st: st["replication"]["applied_lsn"] >= last,
                   timeout=5.0, what="the standby to catch up")
        await asyncio.to_thread(p.kill)
        from test_replication import cli

        res = await asyncio.to_thread(cli, "promote", "--server", s.address, "--force")
        assert res.returncode == 0, res.stderr
        node = await RawNode.open(s.address)
        try:
            with pytest.raises(LockNotAcquired):
                await node.request(P.OP_ACQUIRE, "job", os.urandom(16), 1000, 0, 0, None)
            await node.request(P.OP_ACQUIRE, "job", os.urandom(16), 1000, 6000, 0, None)
            assert time.monotonic() >= expired + 3.0 - 0.1
        finally:
            await node.close()

    run(main())


async def test_multi_lock_one_by_one_path_for_an_older_server(connect):
    """A client that has learnt its server has no ACQUIRE_MANY (an older fastlock)
    takes the set one lock at a time in the global order, shared names included."""
    client, other = await connect("old-path"), await connect("other")
    client.connector.no_acquire_many = True
    multi = await client.acquire_many(["b", "a"], ttl=5.0, shared=["b"])
    assert (await other.contenders("b"))["holders"][0]["shared"] is True
    assert multi.fencing_tokens["a"] < multi.fencing_tokens["b"]  # taken in name order
    await client.release_many(multi)


async def test_the_actor_is_sent_only_to_a_server_that_reads_it():
    from fastlock.client.acquire import actor_id, kind_pair, with_actor

    class Connector:
        server_info: dict = {}
        sequencers = False

    old, new = Connector(), Connector()
    new.server_info = {"actors": True}
    assert [with_actor(old, k) for k in [(), (True,), (False, 3)]] == [(), (True,), (False, 3)]
    me = actor_id()
    assert me >= 1 and actor_id() == me  # one number per task, kept
    assert [with_actor(new, k) for k in [(), (True,), (False, 3)]] == [(False, 0, me), (True, 0, me), (False, 3, me)]
    assert kind_pair((True,)) == (True, 0)  # a late grant of a shared lease queues again as shared
    signed = Connector()
    signed.sequencers = True
    signed.server_info = {"actors": True, "sequencers": True}
    assert with_actor(signed, ()) == (False, 0, me, True)  # then ACQUIRE's sequencer flag

    async def in_another_task():
        return actor_id()

    other = await asyncio.ensure_future(in_another_task())
    assert other not in (0, me)


async def test_a_lease_renewed_from_a_new_connection_counts_as_held_by_it(server_factory):
    # a client holding x reconnects (its lease outlives the connection) and renews x from
    # the new one, then waits for y, held by b, which waits for x: a deadlock
    srv = server_factory("dl-reconnect", args=["--deadlock-timeout", "0.2"])
    owner_x, actor = os.urandom(16), 7
    first = await RawNode.open(srv.address)
    token, _, _ = await first.request(P.OP_ACQUIRE, "x", owner_x, 10_000, 0, 0, None, False, 0, actor)
    await first.close()
    a, b = await RawNode.open(srv.address), await RawNode.open(srv.address)
    try:
        await a.request(P.OP_EXTEND, "x", token, owner_x, 10_000)
        await b.request(P.OP_ACQUIRE, "y", os.urandom(16), 10_000, 0, 0, None)
        b_waits = asyncio.ensure_future(b.request(P.OP_ACQUIRE, "x", os.urandom(16), 10_000, 5_000, 0, None))
        a_waits = asyncio.ensure_future(
            a.request(P.OP_ACQUIRE, "y", os.urandom(16), 10_000, 5_000, 0, None, False, 0, actor))
        done, _ = await asyncio.wait([a_waits, b_waits], timeout=0.2 + 1.0, return_when=asyncio.FIRST_COMPLETED)
        assert done, "the deadlock was not broken within --deadlock-timeout + 1 s"
        with pytest.raises(DeadlockDetected):
            done.pop().result()
    finally:
        for node in (a, b):
            await node.close()


def _pipeline(address: str, frames: list[bytes]) -> socket.socket:
    """A raw connection that says HELLO and writes ``frames`` in one go (their replies are
    left unread: a queued acquire has none until it is granted)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(P.packb([1, P.OP_HELLO, P.PROTOCOL_VERSION, "waiters", None]) + b"".join(frames))
    return sock


class PingLag:
    """PINGs the server from a thread on its own connection, one at a time, and keeps the
    worst round trip (seconds): what a stall of the server's loop costs a client."""

    def __init__(self, address: str):
        import threading

        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.decoder = P.FrameDecoder(limits=P.REPLY_LIMITS)
        self.worst = 0.0
        self.pings = 0
        self._call(P.OP_HELLO, P.PROTOCOL_VERSION, "pinger", None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ping-lag", daemon=True)

    def _call(self, op: int, *args) -> None:
        self.sock.sendall(P.packb([7, op, *args]))
        while True:
            data = self.sock.recv(65536)
            assert data, "the server closed the pinging connection"
            if self.decoder.feed(data):
                return

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            t0 = time.perf_counter()
            self._call(P.OP_PING)
            self.worst = max(self.worst, time.perf_counter() - t0)
            self.pings += 1

    def __enter__(self) -> PingLag:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close()


def test_eighty_thousand_waiters_cost_the_loop_no_stall_and_a_deadlock_among_them_is_broken(server_factory):
    """Finding: with 81,000 waiters the deadlock detector walked all of them twice a second
    (114 ms stalls).  80,000 waiters (8 connections x 10,000, each its own party - a distinct
    actor - behind 1,000 held names), all older than --deadlock-timeout: a client's PINGs
    meanwhile never wait 50 ms, and a real deadlock among them is still broken."""
    n_names, per_conn, conns = 1000, 10_000, 8
    srv = server_factory("dl-many", args=["--deadlock-timeout", "0.5", "--max-waiters", "100000",
                                          "--max-waiters-per-principal", "100000"])
    holder = _pipeline(srv.address, [P.packb([2 + i, P.OP_ACQUIRE, f"busy/{i}", b"holder-%d" % i, 600_000, 0, 0,
                                              None]) for i in range(n_names)])
    waiters = []

    async def main():
        async with fastlock.connect(srv.address) as watcher:
            await poll(watcher.status, lambda st: st["locks_held"] == n_names, timeout=30, what="the holder's names")
            for c in range(conns):
                waiters.append(_pipeline(srv.address, [
                    P.packb([2 + k, P.OP_ACQUIRE, f"busy/{(c * per_conn + k) % n_names}", b"w%d-%d" % (c, k),
                             600_000, P.MAX_WAIT_MS, 0, None, False, 0, k + 1]) for k in range(per_conn)]))
            total = conns * per_conn
            await poll(watcher.status, lambda st: st["waiters"] == total, timeout=60, what=f"{total} waiters")
            a = await fastlock.connect(srv.address, client_name="dl-a")
            b = await fastlock.connect(srv.address, client_name="dl-b")
            both_hold = asyncio.Event()
            holding = []

            async def cross(client, mine: str, theirs: str):
                # one task holds its name and then waits for the other's: a real cycle
                lease = await client.acquire(mine, ttl=30.0)
                holding.append(mine)
                if len(holding) == 2:
                    both_hold.set()
                await both_hold.wait()
                try:
                    other = await client.acquire(theirs, ttl=30.0, wait=TIMEOUT)
                except DeadlockDetected:
                    await client.release(lease)
                    return "victim"
                await client.release(other)
                await client.release(lease)
                return "served"

            try:
                with PingLag(srv.address) as lag:
                    outcomes = await asyncio.wait_for(
                        asyncio.gather(cross(a, "dl/a", "dl/b"), cross(b, "dl/b", "dl/a")), TIMEOUT + 5)
                    # a few more detector rounds over the 80,000 old waiters (one every 0.25 s)
                    deadline = time.monotonic() + 1.0
                    while time.monotonic() < deadline:
                        await watcher.ping()
                        await asyncio.sleep(0.05)
                return sorted(outcomes), lag.worst, lag.pings, (await watcher.status())
            finally:
                await a.close()
                await b.close()

    try:
        outcomes, worst, pings, st = run(main(), timeout=150)
    finally:
        for sock in (holder, *waiters):
            sock.close()
    assert outcomes == ["served", "victim"]
    assert st["deadlocks"] == 1 and st["waiters"] == conns * per_conn
    assert pings > 50
    assert worst < STALL_S, f"a PING waited {worst * 1000:.1f} ms"


async def test_a_full_semaphore_says_its_permits_are_held_and_how_many_are_this_connections(connect):
    """The refusal of a try-acquire names what holds the name: all of a semaphore's permits
    (not "held by this same connection" because the first permit happens to be its own)."""
    mine, other = await connect("mine"), await connect("other")
    first = await mine.semaphore("pool2", 2).acquire(ttl=30.0)
    await other.semaphore("pool2", 2).acquire(ttl=30.0)
    with pytest.raises(LockNotAcquired) as refused:
        await mine.semaphore("pool2", 2).acquire(ttl=30.0, wait=0)
    assert str(refused.value) == (f"all 2 permits of semaphore 'pool2' are held, 1 of them by this same "
                                  f"connection (token {first.fencing_token})")
    with pytest.raises(LockNotAcquired, match=r"^all 2 permits of semaphore 'pool2' are held$"):
        await (await connect("third")).semaphore("pool2", 2).acquire(ttl=30.0, wait=0)
    await other.acquire("rw", ttl=30.0, shared=True)
    with pytest.raises(LockNotAcquired, match=r"^'rw' is held shared by 1 lease$"):
        await mine.acquire("rw", ttl=30.0, wait=0)
