"""Revoke requests survive a restart and a failover (fastlock.server.preemption):
the REVOKE_REQUEST record, its replay rule, its recovery, the standby's copy, and a
promoted standby that revokes a holder still holding at the deadline."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import sys
import time

import pytest
from fakehost import FakeHost
from test_replication import caught_up

import fastlock
from fastlock._testbase.cluster import run
from fastlock._testbase.proxy import TcpProxy
from fastlock.errors import LeaseLost
from fastlock.roles import Role
from fastlock.server.preemption import RevokeDeadline, RevokeDeadlines
from fastlock.units import monotonic_ms
from fastlock.wal import WriteAheadLog, apply
from fastlock.wal.records import REVOKE_REQUEST, Grant, LogState, Release, RevokeRequest, decode, encode

TIMEOUT = 30.0
TOKEN = (1 << 40) | 7


def _request(name: str = "db", token: int = TOKEN, until: int = 2_000_000, grace_ms: int = 500) -> RevokeRequest:
    return RevokeRequest(name, token, "urgent", until, grace_ms, 1_000)


def test_the_record_round_trips_and_applies_only_to_a_holding_lease():
    record = _request()
    assert encode(record) == [REVOKE_REQUEST, "db", TOKEN, "urgent", 2_000_000, 500, 1_000]
    assert decode(encode(record)) == record
    with pytest.raises(ValueError, match="revoke_request record with 5 fields"):
        decode(encode(record)[:-1])
    state = LogState()
    assert not apply(record, state)  # no such lease: nothing kept
    assert state.revoke_requests == {}
    apply(Grant("db", TOKEN, b"o", 60_000, 0, "app:h", None, 0), state)
    assert apply(record, state)
    assert state.revoke_requests == {("db", TOKEN): record}
    apply(Release("db", TOKEN, 0), state)  # the lease ended: its request with it
    assert state.revoke_requests == {}


async def test_recovery_returns_the_requests_of_leases_still_held(tmp_path):
    wal = WriteAheadLog(str(tmp_path))
    wal.open()
    wal.start(asyncio.get_running_loop())
    wall = int(time.time() * 1000)
    for i, name in enumerate(("held", "released")):
        wal.log_grant(name, TOKEN + i, b"o", 60_000, 0, "app:h", None)
        wal.log_revoke_request(name, TOKEN + i, "urgent", wall + 3_000, 3_000)
    wal.log_release("released", TOKEN + 1)
    await wal.sync()
    await wal.close()
    again = WriteAheadLog(str(tmp_path))
    state = again.open()
    again.abort()
    assert [(r.name, r.token, r.principal, r.until_wall_ms) for r in state.revoke_requests] == \
        [("held", TOKEN, "urgent", wall + 3_000)]


def test_recovered_requests_keep_what_is_left_capped_at_the_longest_grace():
    deadlines = RevokeDeadlines(lambda: None, lambda d: None)
    wall = int(time.time() * 1000)
    past = _request("past", TOKEN, wall - 5_000)
    far = _request("far", TOKEN + 1, wall + 10_000_000)
    assert deadlines.recovered([past, far], 1_000, armed=False) == 2
    assert deadlines.get("past", TOKEN).due_ms == 1_000  # already due: revoked as soon as armed
    assert deadlines.get("far", TOKEN + 1).due_ms == 1_000 + 600_000  # MAX_REVOKE_GRACE_MS
    assert deadlines.by_principal == {"urgent": 2}


def test_one_deadline_per_lease_and_dropping_uncounts_it():
    deadlines = RevokeDeadlines(lambda: None, lambda d: None)
    assert deadlines.add(RevokeDeadline("db", TOKEN, "a", 500), armed=False)
    assert not deadlines.add(RevokeDeadline("db", TOKEN, "b", 9_000), armed=False)  # never moved later
    assert deadlines.get("db", TOKEN).due_ms == 500 and deadlines.by_principal == {"a": 1}
    assert deadlines.drop("db", TOKEN).principal == "a"
    assert deadlines.drop("db", TOKEN) is None
    assert len(deadlines) == 0 and deadlines.by_principal == {}


def test_a_standby_keeps_a_replicated_request_until_its_lease_ends(tmp_path):
    from fastlock.replication.follower import StandbyFollower

    host = FakeHost(str(tmp_path), Role.STANDBY)
    follower = StandbyFollower(host, ("127.0.0.1", 1))
    grant = Grant("db", TOKEN, b"o", 60_000, 0, "app:h", None, 0)
    before = monotonic_ms()
    for lsn, record in enumerate((grant, _request(grace_ms=700), _request("other", TOKEN + 1)), 1):
        follower.on_push("rec", [lsn, encode(record)])
    kept = host.revoke_deadlines.get("db", TOKEN)
    assert kept is not None and kept.principal == "urgent"
    assert kept.due_ms >= before + 700  # counted from the record's arrival: never before the primary's
    assert host.revoke_deadlines.get("other", TOKEN + 1) is None  # not a lease it holds
    assert ("revoke_request", "db", TOKEN, "urgent", 2_000_000, 700) in host.wal.records
    follower.on_push("rec", [4, encode(Release("db", TOKEN, 0))])
    assert len(host.revoke_deadlines) == 0


async def test_an_acquire_that_rides_through_a_lost_connection_asks_again(server, connect):
    """The revoke request goes with every attempt of the acquire that may wait: after its
    connection is lost (its waiter dropped with it) the retry asks whoever holds now."""
    first = await connect("first")
    second = await connect("second")
    with TcpProxy(server.address) as proxy:
        urgent = await connect("urgent", proxy.address)
        lease = await first.acquire("q", ttl=60)
        want = asyncio.ensure_future(urgent.acquire("q", ttl=60, priority=5, preempt=60.0))
        await asyncio.wait_for(lease.revoke_requested.wait(), TIMEOUT)
        proxy.blackhole()  # new connections are held too, until heal()
        proxy.cut()
        async with asyncio.timeout(TIMEOUT):  # the server dropped the waiter with its connection
            while (await first.contenders("q"))["waiters"]:
                await asyncio.sleep(0.02)
        await first.release(lease)
        now_held = await second.acquire("q", ttl=60, wait=0)
        proxy.heal()
        await asyncio.wait_for(now_held.revoke_requested.wait(), TIMEOUT)
        assert now_held.revoke_request.client == "urgent"
        await second.release(now_held)
        granted = await asyncio.wait_for(want, TIMEOUT)
        assert granted.fencing_token > now_held.fencing_token
        await urgent.release(granted)


def _dump_json(data_dir: str, lock: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
    out = subprocess.run([sys.executable, "-m", "fastlock", "wal", "dump", "--lock", lock, "-o", "json", data_dir],
                         capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert out.returncode == 0, out.stderr
    entries = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return [e for e in entries if "type" in e]  # not the notes


def test_a_promoted_standby_revokes_a_holder_that_does_not_yield(cluster):
    """Ask the holder to yield, SIGKILL the primary: the promoted standby takes the
    lease at the replicated deadline (the waiter's retried acquire asks nothing
    again), hands it on with a higher token, and the old holder's fenced write fails."""
    grace_s = 4.0
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=1.0, grace=0.2)
    token = cluster.creds.token("app")

    async def main() -> tuple[int, int, float]:
        async with await fastlock.connect(p.address, s.address, token=token, client_name="holder",
                                          connect_timeout=1.0) as holder, \
                await fastlock.connect(p.address, s.address, token=token, client_name="urgent",
                                       connect_timeout=1.0) as urgent:
            lease = await holder.acquire("db", ttl=120)
            await holder.put("db-row", b"v1", lease=lease)
            asked = time.time()
            want = asyncio.ensure_future(urgent.acquire("db", ttl=60, priority=5, preempt=grace_s))
            await asyncio.wait_for(lease.revoke_requested.wait(), TIMEOUT)
            await caught_up(s.address, p.address, timeout=TIMEOUT)
            p.kill()
            granted = await asyncio.wait_for(want, TIMEOUT + grace_s)
            assert granted.fencing_token > lease.fencing_token
            with pytest.raises(LeaseLost):
                await holder.put("db-row", b"late", lease=lease)
            await urgent.put("db-row", b"v2", lease=granted)
            assert (await urgent.get("db-row")).value == b"v2"
            return lease.fencing_token, granted.fencing_token, asked

    old, new, asked = run(main(), timeout=90.0)
    s.stop()
    entries = _dump_json(str(s.data_dir), "db")
    kinds = [(e["type"], e["token"]) for e in entries]
    assert ("revoke_request", old) in kinds and ("revoke", old) in kinds and ("grant", new) in kinds, kinds
    revoked = next(e for e in entries if e["type"] == "revoke" and e["token"] == old)
    assert revoked["by"] == "app"
    revoked_at = datetime.datetime.fromisoformat(revoked["time"].replace("Z", "+00:00")).timestamp()
    assert revoked_at >= asked + grace_s - 0.01  # not before the deadline (one wall clock: this machine's)


async def test_a_fenced_primary_keeps_a_due_deadline_and_revokes_once_it_may():
    """At a deadline a fenced primary may not revoke: it keeps the deadline and tries again
    (every REVOKE_RETRY_MS) until it may, or until the lease is gone.  A deadline nobody
    asked for on this node (replicated or recovered) stands while a waiter of a priority
    above the holder's waits."""
    from types import SimpleNamespace

    from fastlock._core import LockTable
    from fastlock.roles import NodeRole
    from fastlock.server.preemption import Preemption

    table = LockTable()
    now = monotonic_ms()
    table.acquire("db", b"h", 1, 0, 60_000, -1, 0, None, now)
    token = table.holder("db", now).token
    table.acquire("db", b"w", 2, 0, 60_000, -1, 0, None, now, False, 0, 0, 5)  # waits at priority 5
    roles = NodeRole(Role.PRIMARY, hold_grants_until=table.hold_grants_until, now_ms=monotonic_ms)
    roles.set_fenced(True)
    revoked: list[tuple[str, int, str]] = []
    server = SimpleNamespace(loop=asyncio.get_running_loop(), source=SimpleNamespace(fence_if_due=lambda now: None),
                             after_batch=lambda: None)
    lock_admin = SimpleNamespace(revoke_lease=lambda name, h, principal, *rest: revoked.append((name, h.token,
                                                                                                 principal)))
    preemption = Preemption(SimpleNamespace(table=table, roles=roles, server=server, lock_admin=lock_admin))
    preemption.deadlines.add(RevokeDeadline("db", token, "urgent", now), armed=True)
    async with asyncio.timeout(TIMEOUT):  # due at once, refused, kept for a later try
        while (kept := preemption.deadlines.get("db", token)) is None or kept.due_ms <= now:
            await asyncio.sleep(0.01)
    assert revoked == []
    roles.set_fenced(False)
    async with asyncio.timeout(TIMEOUT):
        while not revoked:
            await asyncio.sleep(0.01)
    assert revoked == [("db", token, "urgent")] and len(preemption.deadlines) == 0


async def test_a_deadline_nobody_here_asked_for_lapses_when_no_waiter_ranks_above_the_holder():
    """A replicated or recovered deadline (no requester known on this node) revokes only
    while a waiter of a priority above the holder's waits: with none, it lapses."""
    from types import SimpleNamespace

    from fastlock._core import LockTable
    from fastlock.roles import NodeRole
    from fastlock.server.preemption import Preemption

    table = LockTable()
    now = monotonic_ms()
    table.acquire("db", b"h", 1, 0, 60_000, -1, 0, None, now)
    token = table.holder("db", now).token
    table.acquire("db", b"w", 2, 0, 60_000, -1, 0, None, now)  # waits at priority 0: not above the holder
    roles = NodeRole(Role.PRIMARY, hold_grants_until=table.hold_grants_until, now_ms=monotonic_ms)
    revoked: list[tuple[str, int, str]] = []
    server = SimpleNamespace(loop=asyncio.get_running_loop(), source=SimpleNamespace(fence_if_due=lambda now: None),
                             after_batch=lambda: None)
    lock_admin = SimpleNamespace(revoke_lease=lambda name, h, principal, *rest: revoked.append((name, h.token,
                                                                                                 principal)))
    preemption = Preemption(SimpleNamespace(table=table, roles=roles, server=server, lock_admin=lock_admin))
    preemption.deadlines.add(RevokeDeadline("db", token, "urgent", now), armed=True)
    async with asyncio.timeout(TIMEOUT):
        while len(preemption.deadlines):
            await asyncio.sleep(0.01)
    assert revoked == [] and table.holder("db", monotonic_ms()).token == token


def test_repeated_revoke_requests_tell_the_holder_once(server):
    """One waiting request that asks again and again (50 times) gets the same deadline each
    time, and the holder's connection is told once: a principal cannot flood another's
    connection (or the server's log) with revoke notices."""
    from test_sessions import RawSocket

    from fastlock import protocol as P
    from fastlock.protocol.ops import OP_ACQUIRE_PRIORITY, OP_REQUEST_REVOKE, PUSH_REVOKE_REQUESTED

    holder, asker = RawSocket(server.address), RawSocket(server.address)
    try:
        token = holder.send([(P.OP_ACQUIRE, "contested", os.urandom(16), 60_000, 0, 0, None)])[0][2][0]
        waiter = os.urandom(16)
        asker.sock.sendall(asker.packb([asker.next_id, OP_ACQUIRE_PRIORITY, "contested", waiter, 60_000, 30_000, 0,
                                        None, False, 0, 0, 5]))
        asker.next_id += 1
        replies = asker.send([(OP_REQUEST_REVOKE, "contested", waiter, 20_000) for _ in range(50)])
        assert all(r[1] == 0 and r[2]["token"] == token and r[2]["delivered"] for r in replies)
        assert len({r[2]["deadline_ms"] // 1000 for r in replies}) <= 2  # one deadline, counting down
        ping = holder.next_id
        holder.sock.sendall(holder.packb([ping, P.OP_PING]))  # the notices came before its reply
        frames: list[list] = []
        while not any(f[0] == ping for f in frames):
            chunk = holder.sock.recv(1 << 20)
            assert chunk, "the server closed the connection"
            holder.unpacker.feed(chunk)
            frames.extend(holder.unpacker)
        notices = [f for f in frames if f[0] == 0 and f[1] == PUSH_REVOKE_REQUESTED]
        assert len(notices) == 1 and notices[0][2][:2] == ["contested", token]
    finally:
        holder.close()
        asker.close()
