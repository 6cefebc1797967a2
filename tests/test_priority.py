"""Priorities, cooperative preemption and directed hand-off against a real server
(fastlock.server.preemption): queue order by priority, the holder's revoke-requested
event, the revocation of a holder that does not yield, and transfer()."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import wait_until

import fastlock
from fastlock._testbase import CredentialsDir
from fastlock.errors import (
    ConnectionLost,
    InvalidArgument,
    LeaseLost,
    LockNotAcquired,
    PermissionDenied,
    WrongArgumentType,
)

TIMEOUT = 10.0


async def _waiting(client, name: str, n: int) -> None:
    async def queued():
        return len((await client.contenders(name))["waiters"]) >= n
    await wait_until(queued, TIMEOUT, f"{n} waiters on {name}")


async def _waiting_at_most(client, name: str, n: int) -> None:
    async def left():
        return len((await client.contenders(name))["waiters"]) <= n
    await wait_until(left, TIMEOUT, f"at most {n} waiters on {name}")


async def test_priority_waiter_behind_50_is_granted_next(connect):
    holder = await connect("holder")
    crowd = await connect("crowd")
    urgent = await connect("urgent")
    lease = await holder.acquire("job", ttl=30)
    tasks = [asyncio.create_task(crowd.acquire("job", ttl=30, correlation_id=f"low-{i}")) for i in range(50)]
    await _waiting(holder, "job", 50)
    high = asyncio.create_task(urgent.acquire("job", ttl=30, priority=10, correlation_id="high"))
    await _waiting(holder, "job", 51)
    waiters = (await holder.contenders("job"))["waiters"]
    assert (waiters[0]["correlation_id"], waiters[0]["priority"]) == ("high", 10)
    assert {w["priority"] for w in waiters[1:]} == {0}
    assert [w["correlation_id"] for w in waiters[1:]] == [f"low-{i}" for i in range(50)]
    await holder.release(lease)
    granted = await asyncio.wait_for(high, TIMEOUT)
    assert granted.fencing_token > lease.fencing_token
    assert not any(t.done() for t in tasks)
    # FIFO within a priority: the next 50 grants go in arrival order
    await urgent.release(granted)
    for i, task in enumerate(tasks):
        got = await asyncio.wait_for(task, TIMEOUT)
        info = await holder.holder("job")
        assert info["correlation_id"] == f"low-{i}"
        await crowd.release(got)


async def test_equal_priorities_keep_arrival_order(connect):
    holder = await connect("holder")
    lease = await holder.acquire("q", ttl=30)
    clients = [await connect(f"c{i}") for i in range(3)]
    order = [(0, 5), (1, 5), (2, 7)]
    tasks = []
    for i, prio in order:
        tasks.append(asyncio.create_task(clients[i].acquire("q", ttl=30, priority=prio, correlation_id=f"c{i}")))
        await _waiting(holder, "q", len(tasks))
    waiters = [w["correlation_id"] for w in (await holder.contenders("q"))["waiters"]]
    assert waiters == ["c2", "c0", "c1"]
    await holder.release(lease)
    for i in (2, 0, 1):
        got = await asyncio.wait_for(tasks[[o[0] for o in order].index(i)], TIMEOUT)
        await clients[i].release(got)


async def test_holder_sees_revoke_request_and_yields(connect):
    holder = await connect("holder")
    urgent = await connect("urgent")
    lease = await holder.acquire("res", ttl=30)
    want = asyncio.create_task(urgent.acquire("res", ttl=30, priority=5, preempt=30.0))
    await asyncio.wait_for(lease.revoke_requested.wait(), TIMEOUT)
    request = lease.revoke_request
    assert request.client == "urgent" and request.grace <= 30.0
    await holder.release(lease)
    granted = await asyncio.wait_for(want, TIMEOUT)
    assert granted.fencing_token > lease.fencing_token


async def test_holder_that_does_not_yield_is_fenced_at_its_deadline(connect):
    holder = await connect("holder")
    urgent = await connect("urgent")
    lease = await holder.acquire("db", ttl=60)
    await holder.put("db-row", b"v1", lease=lease)  # a fenced write while the lease holds
    granted = await asyncio.wait_for(urgent.acquire("db", ttl=30, priority=3, preempt=0.2), TIMEOUT)
    assert lease.revoke_requested.is_set()
    assert granted.fencing_token > lease.fencing_token
    with pytest.raises(LeaseLost):
        await holder.put("db-row", b"late", lease=lease)
    with pytest.raises(LeaseLost):
        await holder.release(lease)
    await urgent.put("db-row", b"v2", lease=granted)
    assert (await urgent.get("db-row")).value == b"v2"


@pytest.mark.parametrize("give_up", ["wait runs out", "cancelled", "connection closed"])
async def test_a_revoke_request_lapses_when_its_requester_stops_waiting(server, connect, give_up):
    holder = await connect("holder")
    urgent = await connect("urgent")
    plain = await connect("plain")
    lease = await holder.acquire("gpu", ttl=60)
    low = asyncio.create_task(plain.acquire("gpu", ttl=30, wait=60))  # priority 0, queued first
    await _waiting(holder, "gpu", 1)
    if give_up == "wait runs out":
        with pytest.raises(LockNotAcquired):
            await urgent.acquire("gpu", ttl=30, priority=50, preempt=1.0, wait=0.2)
    else:
        want = asyncio.create_task(urgent.acquire("gpu", ttl=30, priority=50, preempt=1.0))
        await asyncio.wait_for(lease.revoke_requested.wait(), TIMEOUT)
        if give_up == "cancelled":
            want.cancel()
            with pytest.raises(asyncio.CancelledError):
                await want
        else:
            await urgent.close()
            with pytest.raises(ConnectionLost):
                await want
    await asyncio.wait_for(lease.revoke_requested.wait(), TIMEOUT)
    await asyncio.to_thread(server.wait_for_log, r"revoke request on \S*gpu\S* \(token \d+\) lapsed", TIMEOUT)
    assert not lease.lost.is_set()
    assert (await holder.holder("gpu"))["token"] == lease.fencing_token
    assert not low.done()
    await holder.release(lease)
    await plain.release(await asyncio.wait_for(low, TIMEOUT))


async def test_revoke_request_needs_a_higher_priority_waiter(connect):
    holder = await connect("holder")
    other = await connect("other")
    lease = await holder.acquire("x", ttl=30, priority=5)
    # equal priority: queued, but the request is refused and the holder never asked
    waiting = asyncio.create_task(other.acquire("x", ttl=30, priority=5, preempt=0.05))
    await _waiting(holder, "x", 1)
    await holder.extend(lease, ttl=30)  # a round trip: the refused request came before it
    assert not lease.revoke_requested.is_set()
    assert (await holder.holder("x"))["token"] == lease.fencing_token
    await holder.release(lease)
    await other.release(await asyncio.wait_for(waiting, TIMEOUT))


@pytest.mark.parametrize("bad, error", [(-1, InvalidArgument), (100, InvalidArgument), (1.5, WrongArgumentType),
                                        (True, WrongArgumentType)])
async def test_bad_priority_is_refused_before_sending(client, bad, error):
    with pytest.raises(error):
        await client.acquire("p", ttl=5, priority=bad)
    with pytest.raises((InvalidArgument, WrongArgumentType)):
        await client.acquire("p", ttl=5, priority=1, preempt=0)


async def test_transfer_hands_the_lock_to_the_chosen_waiter(connect):
    leader = await connect("leader")
    a = await connect("a")
    b = await connect("b")
    lease = await leader.acquire("lead", ttl=30, correlation_id="leader")
    await leader.put("lead-state", b"x", lease=lease)
    ta = asyncio.create_task(a.acquire("lead", ttl=30, correlation_id="cand-a"))
    await _waiting(leader, "lead", 1)
    tb = asyncio.create_task(b.acquire("lead", ttl=30, correlation_id="cand-b"))
    await _waiting(leader, "lead", 2)
    with pytest.raises(InvalidArgument):
        await leader.transfer(lease, "nobody")
    await leader.transfer(lease, "cand-b")
    assert lease.lost.is_set()
    got = await asyncio.wait_for(tb, TIMEOUT)
    assert got.fencing_token > lease.fencing_token
    assert not ta.done()
    with pytest.raises(LeaseLost):
        await leader.put("lead-state", b"late", lease=lease)
    with pytest.raises(LeaseLost):
        await leader.transfer(lease, "cand-a")
    await b.release(got)
    await a.release(await asyncio.wait_for(ta, TIMEOUT))


async def test_a_transfer_to_an_id_two_waiters_carry_is_refused(connect):
    leader = await connect("leader")
    impostor = await connect("impostor")
    real = await connect("real")
    lease = await leader.acquire("lead2", ttl=30, correlation_id="leader")
    first = asyncio.create_task(impostor.acquire("lead2", ttl=30, correlation_id="n3"))
    await _waiting(leader, "lead2", 1)
    second = asyncio.create_task(real.acquire("lead2", ttl=30, correlation_id="n3"))
    await _waiting(leader, "lead2", 2)
    with pytest.raises(InvalidArgument, match="2 waiters .* carry the candidate id 'n3'"):
        await leader.transfer(lease, "n3")
    assert not lease.lost.is_set()
    assert (await leader.holder("lead2"))["token"] == lease.fencing_token
    assert not first.done() and not second.done()
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    await _waiting_at_most(leader, "lead2", 1)
    await leader.transfer(lease, "n3")  # one waiter carries the id: unambiguous
    got = await asyncio.wait_for(first, TIMEOUT)
    assert got.fencing_token > lease.fencing_token
    await impostor.release(got)


async def test_election_transfer_candidates_and_proclaim(connect):
    clients = {cid: await connect(cid) for cid in ("n1", "n2", "n3")}
    elections = {cid: c.election("sched", cid, lease_duration=5, renew_deadline=3, retry_period=1)
                 for cid, c in clients.items()}
    term1 = await elections["n1"].campaign()
    await term1.proclaim(b"http://n1")
    seen = await elections["n3"].proclaimed()
    assert seen == (b"http://n1", term1.fencing_token)
    t2 = asyncio.create_task(elections["n2"].campaign())
    await _waiting(clients["n1"], "sched", 1)
    t3 = asyncio.create_task(elections["n3"].campaign())
    await _waiting(clients["n1"], "sched", 2)
    assert await elections["n1"].candidates() == ["n2", "n3"]
    await term1.transfer("n3")
    assert term1.lost.is_set() and not term1.is_leader()
    term3 = await asyncio.wait_for(t3, TIMEOUT)
    assert term3.fencing_token > term1.fencing_token
    assert await elections["n2"].proclaimed() is None  # the old term's value went with it
    await term3.proclaim(b"http://n3")
    assert await elections["n1"].proclaimed() == (b"http://n3", term3.fencing_token)
    with pytest.raises(LeaseLost):
        await term1.proclaim(b"stale")
    await term3.resign()
    term2 = await asyncio.wait_for(t2, TIMEOUT)
    await term2.resign()


def _restrict(creds: CredentialsDir, ops: list[str]) -> None:
    """Give principal ``app`` only ``ops`` on every name."""
    with open(creds.file) as f:
        text = f.read()
    start = text.index("[principals.app]")
    full = 'acl = [{prefix = "", ops = ["*"]}]'
    at = text.index(full, start)
    quoted = ", ".join(f'"{op}"' for op in ops)
    with open(creds.file, "w") as f:
        f.write(text[:at] + f'acl = [{{prefix = "", ops = [{quoted}]}}]' + text[at + len(full):])


async def test_priority_and_preemption_need_their_acl_rights(tmp_path, server_factory, loop_errors):
    creds = CredentialsDir(tmp_path / "creds", anonymous=False)
    _restrict(creds, ["acquire", "release", "extend", "cancel", "check", "holder"])
    srv = server_factory(args=["--credentials", creds.file])
    app = await fastlock.connect(srv.address, auth=creds.token("app"), client_name="app")
    admin = await fastlock.connect(srv.address, auth=creds.token("admin"), client_name="admin")
    try:
        with pytest.raises(PermissionDenied):
            await app.acquire("n", ttl=5, priority=1)
        lease = await app.acquire("n", ttl=30)  # priority 0 needs no right
        prio = await admin.acquire("other", ttl=30, priority=99)  # an admin may use any priority
        await admin.release(prio)
        await app.release(lease)
    finally:
        await app.close()
        await admin.close()


def test_the_priority_range_is_the_cores():
    from fastlock import _core
    from fastlock.protocol.priority import MAX_PRIORITY

    assert _core.MAX_PRIORITY == MAX_PRIORITY


def test_blocking_client_priority_revoke_request_and_transfer(server):
    import threading

    from fastlock.sync import SyncClient

    with SyncClient(server.address, client_name="holder") as holder, \
            SyncClient(server.address, client_name="urgent") as urgent, \
            SyncClient(server.address, client_name="cand") as cand:
        lease = holder.acquire("b", ttl=30)
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("lease", urgent.acquire("b", ttl=30, priority=9,
                                                                                   preempt=30.0)))
        t.start()
        request = holder.wait_revoke_request(lease, timeout=TIMEOUT)
        assert request is not None and request.client == "urgent" and lease.revoke_request == request
        holder.release(lease)
        t.join(TIMEOUT)
        urgent_lease = got["lease"]
        assert urgent_lease.fencing_token > lease.fencing_token
        waiter = threading.Thread(target=lambda: got.setdefault("cand", cand.acquire("b", ttl=30,
                                                                                     correlation_id="c1")))
        waiter.start()
        deadline = time.monotonic() + TIMEOUT
        while not urgent.contenders("b")["waiters"] and time.monotonic() < deadline:
            time.sleep(0.01)
        urgent.transfer(urgent_lease, "c1")
        waiter.join(TIMEOUT)
        assert urgent_lease.lost.is_set()
        assert got["cand"].fencing_token > urgent_lease.fencing_token
        cand.release(got["cand"])


async def test_lock_context_carries_priority_and_preempt(connect):
    holder = await connect("holder")
    urgent = await connect("urgent")
    async with holder.lock("ctx", ttl=5) as lease:
        async def take():
            async with urgent.lock("ctx", ttl=5, priority=2, preempt=30.0) as mine:
                return mine.fencing_token
        task = asyncio.create_task(take())
        await asyncio.wait_for(lease.revoke_requested.wait(), TIMEOUT)
    assert await asyncio.wait_for(task, TIMEOUT) > lease.fencing_token


async def test_bad_revoke_requests_are_refused_and_change_nothing(connect):
    from fastlock.errors import LockNotHeld
    from fastlock.protocol.ops import OP_REQUEST_REVOKE, OP_TRANSFER

    holder = await connect("holder")
    other = await connect("other")
    owner = b"k" * 16
    with pytest.raises(LockNotHeld):  # nobody holds it
        await other._request(OP_REQUEST_REVOKE, "free", owner, 100)
    lease = await holder.acquire("held", ttl=30)
    with pytest.raises(InvalidArgument):  # the caller does not wait on it
        await other._request(OP_REQUEST_REVOKE, "held", owner, 100)
    for grace in (0, 600_001, -1, 1.5, "1", None):  # out of range, not an int (the wire says InvalidArgument)
        with pytest.raises(InvalidArgument):
            await other._request(OP_REQUEST_REVOKE, "held", owner, grace)
    with pytest.raises(InvalidArgument):  # no candidate named
        await holder._request(OP_TRANSFER, "held", lease.fencing_token, lease.owner, "")
    with pytest.raises(LeaseLost):  # not the holder's owner key
        await other._request(OP_TRANSFER, "held", lease.fencing_token, owner, "x")
    assert not lease.revoke_requested.is_set()
    assert (await holder.holder("held"))["token"] == lease.fencing_token
    await holder.release(lease)


def test_a_transfer_and_a_deadline_revocation_reach_the_standby(cluster):
    """The hand-off is logged as a release and a grant, the revocation at a revoke
    request's deadline as a REVOKE record: the standby holds what the primary holds."""
    import os
    import subprocess
    import sys

    from fastlock._testbase.cluster import poll, run, status_of

    p = cluster.primary()
    s = cluster.standby(p.address)
    token = cluster.creds.token("app")

    async def main() -> tuple[int, int, int, int]:
        async with fastlock.connect(p.address, token=token, client_name="old") as old, \
                fastlock.connect(p.address, token=token, client_name="new") as new:
            lease = await old.acquire("ho", ttl=60)
            want = asyncio.create_task(new.acquire("ho", ttl=60, correlation_id="c"))
            await _waiting(old, "ho", 1)
            await old.transfer(lease, "c")
            moved = await asyncio.wait_for(want, TIMEOUT)
            stuck = await old.acquire("pre", ttl=60)
            taken = await asyncio.wait_for(new.acquire("pre", ttl=60, priority=5, preempt=0.1), TIMEOUT)
            await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 2, timeout=TIMEOUT,
                       what="both new holders on the standby")
            return lease.fencing_token, moved.fencing_token, stuck.fencing_token, taken.fencing_token

    old_ho, new_ho, old_pre, new_pre = run(main())
    assert new_ho > old_ho and new_pre > old_pre
    s.stop()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}

    def dump(name: str) -> list[str]:
        out = subprocess.run([sys.executable, "-m", "fastlock", "wal", "dump", "--lock", name, str(s.data_dir)],
                             capture_output=True, text=True, timeout=TIMEOUT, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    ho = dump("ho")
    assert any(" release " in line and f"token={old_ho} " in line for line in ho), ho
    assert any(" grant " in line and f"token={new_ho} " in line and "corr=c " in line for line in ho), ho
    pre = dump("pre")
    assert any(" revoke " in line and f"token={old_pre} " in line for line in pre), pre
    assert any(" grant " in line and f"token={new_pre} " in line for line in pre), pre


def test_core_orders_by_priority_and_hands_off_under_a_grant_hold():
    from fastlock import _core

    t = _core.LockTable()
    assert t.acquire("a", b"h", 1, 0, 1000, -1, 0, None, 0) == _core.GRANTED
    for owner, prio in ((b"l0", 0), (b"m0", 5), (b"l1", 0), (b"m1", 5), (b"t", 9)):
        assert t.acquire("a", owner, 1, 0, 1000, -1, 0, None, 0, False, 0, 0, prio) == _core.QUEUED
    assert t.waiter_priorities("a") == [(b"t", 9), (b"m0", 5), (b"m1", 5), (b"l0", 0), (b"l1", 0)]
    assert t.waiter_priority("a", b"l1") == 0 and t.waiter_priority("a", b"x") == -1
    t.drain_events()
    holder = t.holder("a", 1)
    t.hold_grants_until(100)  # a failover's grant hold: the chosen waiter waits at the head
    t.release_to("a", holder.token, b"h", b"l1", 1)
    assert t.waiter_priorities("a")[0] == (b"l1", 9)  # the head's place and priority
    t.acquire("a", b"late", 1, 0, 1000, -1, 0, None, 2, False, 0, 0, 9)
    assert [o for o, _ in t.waiter_priorities("a")][:3] == [b"l1", b"t", b"late"]
    t.expire(100)
    granted = [e for e in t.drain_events() if e.kind == _core.EV_GRANTED]
    assert [e.owner for e in granted] == [b"l1"] and granted[0].token > holder.token
    assert t.holder_priority("a") == 9


def test_fastlock_run_waits_at_its_priority(server, tmp_path):
    """``fastlock run --priority 7`` queues ahead of an earlier priority-0 waiter, and runs first."""
    import subprocess
    import sys
    import threading

    from fastlock.sync import SyncClient

    order = tmp_path / "order"
    with SyncClient(server.address, client_name="holder") as holder, \
            SyncClient(server.address, client_name="plain") as plain:
        lease = holder.acquire("cli/prio", ttl=30)
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("plain", plain.acquire("cli/prio", ttl=30)))
        t.start()
        deadline = time.monotonic() + TIMEOUT
        while len(holder.contenders("cli/prio")["waiters"]) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        child = f"import os; open({str(order)!r}, 'a').write(os.environ['FASTLOCK_FENCING_TOKEN'])"
        proc = subprocess.Popen([sys.executable, "-m", "fastlock", "run", "cli/prio", "--priority", "7", "--ttl", "5",
                                 "--server", server.address, "--", sys.executable, "-c", child],
                                stderr=subprocess.PIPE, text=True)
        try:
            while len(holder.contenders("cli/prio")["waiters"]) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            waiters = holder.contenders("cli/prio")["waiters"]
            assert [w["priority"] for w in waiters] == [7, 0], waiters
            holder.release(lease)
            assert proc.wait(TIMEOUT) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(TIMEOUT)
        t.join(TIMEOUT)
        assert lease.fencing_token < int(order.read_text()) < got["plain"].fencing_token  # the run went first
        plain.release(got["plain"])
    bad = subprocess.run([sys.executable, "-m", "fastlock", "run", "cli/prio", "--priority", "100", "--server",
                          server.address, "--", "true"], capture_output=True, text=True, timeout=TIMEOUT)
    assert bad.returncode == 2 and "--priority" in bad.stderr
