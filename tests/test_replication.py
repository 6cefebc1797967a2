"""Replication against real processes: a primary streams its WAL to a standby.

Covers issue 4, items 1 and 2 (manual promotion) and the step-down rule:
leases, releases and expiries reach the standby; the standby redirects
clients with NotPrimary; a restarted or late standby resyncs from a snapshot;
``fastlock promote`` starts a new epoch, refuses a never-synced standby
without ``--force``; a node that sees a higher epoch steps down.

The tests are synchronous and run their own ``asyncio.run`` (one loop, not
both): they are about processes and the wire, not about the client's loop.
Every wait is on a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile

import pytest

import fastlock
from fastlock import protocol as P
from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock.errors import LockNotAcquired, NotPrimary, PermissionDenied

EPOCH_SHIFT = 40
LONG = 30_000  # ms: a TTL that does not run out during a test




def cli(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastlock", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=tempfile.gettempdir())  # outside the source tree


async def caught_up(standby: str, primary: str, timeout: float = 5.0) -> tuple[dict, dict]:
    """Wait until ``standby`` has applied everything ``primary`` has logged; return both statuses."""
    pst = await status_of(primary)
    last = pst["wal"]["last_lsn"]
    sst = await poll(lambda: status_of(standby), lambda st: st["replication"]["applied_lsn"] >= last,
                     timeout=timeout, what=f"standby to apply LSN {last}")
    return pst, sst


# --------------------------------------------------------------------------- streaming


def test_grants_releases_and_expiries_reach_the_standby(cluster):
    p = cluster.primary()
    s = cluster.standby(p.address)

    async def main():
        a = await RawNode.open(p.address)
        try:
            held = {}
            for i in range(6):
                held[f"r/{i}"] = await a.acquire(f"r/{i}", LONG)
            _, sst = await caught_up(s.address, p.address)
            assert sst["role"] == "standby"
            assert sst["locks_held"] == 6
            assert sst["last_token"] == held["r/5"][0]

            for name in ("r/0", "r/1"):
                token, _, owner = held.pop(name)
                await a.release(name, token, owner)
            mark = len(p.lines)
            await a.acquire("short", 300)  # expires on the primary; the expiry is a record
            await asyncio.to_thread(p.wait_for_log, r"lease expired: 'short'", 5, mark)
            pst, sst = await caught_up(s.address, p.address)
            assert pst["locks_held"] == 4
            assert sst["locks_held"] == 4
            assert sst["last_token"] == pst["last_token"]
            assert sst["replication"]["lag_records"] == 0
            assert sst["replication"]["connected"] is True and sst["replication"]["synced"] is True

            # the primary reports the standby's position once it has acked
            def acked(st):
                sb = st["replication"]["standbys"]
                return len(sb) == 1 and sb[0]["acked_lsn"] == st["wal"]["last_lsn"]

            pst = await poll(lambda: status_of(p.address), acked, timeout=5, what="standby ack")
            sb = pst["replication"]["standbys"][0]
            assert sb["name"].startswith("standby@") and sb["lag_records"] == 0
            # the lag's units: the standby's status gives records only; the primary's gives each
            # standby's lag in records and in milliseconds (0: nothing sent is unacknowledged)
            assert "lag_ms" not in sst["replication"]
            assert type(sb["lag_ms"]) is int and sb["lag_ms"] == 0
            assert not pst["replication"]["fenced"]
        finally:
            await a.close()

    run(main())


def test_standby_answers_not_primary_with_the_primary_address(cluster):
    p = cluster.primary()
    s = cluster.standby(p.address)

    async def main():
        b = await RawNode.open(s.address)
        try:
            assert b.hello["role"] == "standby"
            assert b.hello["primary"] == p.address
            owner = os.urandom(16)
            for op in (b.acquire("x", LONG), b.release("x", 1, owner), b.extend("x", 1, owner, LONG),
                       b.holder("x")):
                with pytest.raises(NotPrimary) as info:
                    await op
                assert info.value.primary == p.address
            st = await b.status()  # status is answered by every role
            assert st["role"] == "standby" and st["locks_held"] == 0
        finally:
            await b.close()
        # the client follows the redirect: its lease is the primary's
        async with fastlock.connect(s.address, client_name="redirected") as c:
            lease = await c.acquire("x", ttl=10.0, wait=0)
            assert c.server_info["role"] == "primary"
            assert await c.check("x", lease.fencing_token)
        a = await RawNode.open(p.address)
        try:
            assert (await a.holder("x"))["token"] == lease.fencing_token
        finally:
            await a.close()

    run(main())


def test_restarted_standby_resyncs(cluster):
    p = cluster.primary()
    s = cluster.standby(p.address)

    async def main():
        a = await RawNode.open(p.address)
        try:
            held = {f"k/{i}": await a.acquire(f"k/{i}", LONG) for i in range(5)}
            await caught_up(s.address, p.address)
            s.stop()
            # while the standby is down: release two it knows, grant three it does not
            for name in ("k/0", "k/1"):
                token, _, owner = held.pop(name)
                await a.release(name, token, owner)
            for i in range(5, 8):
                held[f"k/{i}"] = await a.acquire(f"k/{i}", LONG)
            s2 = await asyncio.to_thread(cluster.restart, s)
            # it recovers what it had persisted, then resyncs from the primary
            await asyncio.to_thread(s2.wait_for_log, r"recovered 5 leases", 10)
            await asyncio.to_thread(s2.wait_for_log, r"applied snapshot at primary LSN \d+: 6 leases", 10)
            pst, sst = await caught_up(s2.address, p.address)
            assert sst["locks_held"] == pst["locks_held"] == 6
            assert sst["last_token"] == pst["last_token"]
            # and it keeps following the live stream
            token, _, owner = held.pop("k/7")
            await a.release("k/7", token, owner)
            _, sst = await caught_up(s2.address, p.address)
            assert sst["locks_held"] == 5
        finally:
            await a.close()

    run(main())


def test_late_standby_gets_a_snapshot_of_existing_leases(cluster):
    p = cluster.primary()

    async def main():
        a = await RawNode.open(p.address)
        try:
            tokens = [(await a.acquire(f"early/{i}", LONG))[0] for i in range(7)]
            token, _, owner = await a.acquire("gone", LONG)
            await a.release("gone", token, owner)
            s = await asyncio.to_thread(cluster.standby, p.address)
            line = await asyncio.to_thread(s.wait_for_log, r"applied snapshot", 5)
            assert "7 leases" in line
            pst, sst = await caught_up(s.address, p.address)
            assert sst["locks_held"] == 7
            assert sst["last_token"] == pst["last_token"] == token > max(tokens)
        finally:
            await a.close()

    run(main())


# --------------------------------------------------------------------------- manual promotion


def test_manual_promotion_new_epoch_holders_keep_their_leases(cluster):
    p = cluster.primary()
    s = cluster.standby(p.address, grace=1.0)  # no --failover-after: promotion on command only

    async def main():
        a = await RawNode.open(p.address)
        try:
            # leases far longer than the two CLI processes below take to start on a loaded machine
            held = {f"h/{i}": await a.acquire(f"h/{i}", 60_000) for i in range(3)}
            before = max(t for t, _, _ in held.values())
            await caught_up(s.address, p.address)
        finally:
            await a.close()
        # a standby must not be promoted twice, nor a primary at all
        res = await asyncio.to_thread(cli, "promote", "--server", p.address)
        assert res.returncode == 1 and "already the primary" in res.stderr

        res = await asyncio.to_thread(cli, "promote", "--server", s.address)
        assert res.returncode == 0, res.stderr
        info = json.loads(res.stdout)
        assert info == {"epoch": 1, "grace_ms": 1000, "leases": 3, "primary_confirmed": True}
        b = await RawNode.open(s.address)
        try:
            assert b.hello["role"] == "primary" and b.hello["epoch"] == 1
            # the holders extend on the new primary with the lease they have
            for name, (token, _, owner) in held.items():
                assert await b.extend(name, token, owner, 60_000) == 60_000
                assert (await b.holder(name))["token"] == token
            # a free lock is not granted during the grace period
            with pytest.raises(LockNotAcquired, match=r"during the promotion grace period \(leases the old primary"):
                await b.acquire("free", 3000)
            # but a waiter is, once it ends; with a token of the new epoch
            token, _, _ = await asyncio.wait_for(b.acquire("free", 3000, wait_ms=5000), 5)
            assert token >> EPOCH_SHIFT == 1
            assert token > before
            st = await b.status()
            assert st["epoch"] == 1 and st["grace_remaining_ms"] == 0
        finally:
            await b.close()
        res = await asyncio.to_thread(cli, "promote", "--server", s.address)
        assert res.returncode == 1 and "already the primary" in res.stderr

    run(main())


def test_promote_refuses_a_never_synced_standby_without_force(cluster, tmp_path):
    # a primary address that nothing listens on: the standby never synchronises
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sk.getsockname()[1]}"
    s = cluster.standby(dead, wait_sync=False, failover_after=0.2)

    async def main():
        st = await status_of(s.address)
        assert st["role"] == "standby" and st["replication"]["synced"] is False
        res = await asyncio.to_thread(cli, "promote", "--server", s.address)
        assert res.returncode == 1
        assert "never synchronised" in res.stderr
        # nor does --failover-after promote it: it never heard a primary to lose
        await asyncio.sleep(0.6)
        st = await status_of(s.address)
        assert st["role"] == "standby" and st["epoch"] == 0
        res = await asyncio.to_thread(cli, "promote", "--server", s.address, "--force")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["epoch"] == 1
        st = await status_of(s.address)
        assert st["role"] == "primary" and st["epoch"] == 1

    run(main())


# --------------------------------------------------------------------------- stepping down


def test_a_primary_steps_down_on_step_down_for_the_next_epoch_only(cluster):
    """A client's HELLO epoch is a hint that never deposes; STEP_DOWN for epoch + 1 does -
    from a replica principal only (issue 9: one HELLO deposed a primary)."""
    p = cluster.primary()
    replica = cluster.creds.token(cluster.replica_of("peer"))

    async def main():
        a = await RawNode.open(p.address)
        try:
            token, _, owner = await a.acquire("held", LONG)
        finally:
            await a.close()
        for hint in (0, 1, 5, 2**63 - 1):
            hinted = await RawNode.open(p.address, known_epoch=hint)
            try:
                assert hinted.hello["role"] == "primary"
                await hinted.acquire(f"after-hint-{hint}", LONG)
            finally:
                await hinted.close()
        for credential in (None, cluster.creds.token("app"), cluster.creds.token("admin")):
            other = await RawNode.open(p.address, token=credential)
            try:
                with pytest.raises(PermissionDenied):
                    await other.request(P.OP_STEP_DOWN, 1, other.hello["clock_ms"])
                assert (await other.request(P.OP_PING)) is None
            finally:
                await other.close()
        peer = await RawNode.open(p.address, name="standby:b", token=replica)
        try:
            assert await peer.request(P.OP_STEP_DOWN, 1, peer.hello["clock_ms"]) == {"role": "deposed", "epoch": 0}
        finally:
            await peer.close()
        await asyncio.to_thread(p.wait_for_log,
                                r"stepping down: replica node-\d+ \('standby:b' at .*\) is promoting to epoch 1", 5)
        # for good: every later connection finds it deposed, and no lock op names a primary
        again = await RawNode.open(p.address)
        try:
            assert again.hello["role"] == "deposed"
            for op in (again.acquire("x", LONG), again.extend("held", token, owner, LONG),
                       again.release("held", token, owner)):
                with pytest.raises(NotPrimary) as info:
                    await op
                assert info.value.primary is None
            assert (await again.status())["role"] == "deposed"
        finally:
            await again.close()
        # a deposed node authenticates no replica any more: asking again changes nothing
        with pytest.raises(NotPrimary, match="not primary: it authenticates no replica"):
            await RawNode.open(p.address, name="standby:b", token=replica)
        assert (await status_of(p.address))["role"] == "deposed"
        # and the client does not take it for a primary
        with pytest.raises(fastlock.ConnectionLost):
            await fastlock.connect(p.address, connect_timeout=2.0)

    run(main())
