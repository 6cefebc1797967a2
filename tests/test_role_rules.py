"""What a node that is not the serving primary does with each request, against real
processes: the rules clients rely on to ride through a failover (see protocol.py).

* a peer's epoch never deposes a node unless it is exactly the next one, sent as STEP_DOWN;
* a fenced primary refuses RELEASE (and CHECK, HOLDER, a releasing CANCEL) and changes nothing;
* a promotion that is refused or fails leaves the node a standby that follows again;
* a node that steps down closes its client connections, so waiters look elsewhere at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile

import pytest

from fastlock import protocol as P
from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock.errors import Cancelled, ConnectionLost, InvalidArgument, NotPrimary, PermissionDenied, Unavailable

FAILOVER = 1.0
GRACE = 0.2
LONG = 30_000


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastlock", *args], capture_output=True, text=True,
                          timeout=30, cwd=tempfile.gettempdir())


def test_step_down_with_any_other_epoch_than_the_next_changes_nothing(cluster):
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)

    async def main():
        await poll(lambda: status_of(p.address), lambda st: st["replication"]["paired_standby"],
                   timeout=5, what="pairing")
        node = await RawNode.open(p.address, name="standby:impostor")
        # the standby's own credential: only the paired replica principal may send STEP_DOWN
        peer = await RawNode.open(p.address, name="standby:impostor",
                                  token=cluster.creds.token(cluster.replica_of("standby")))
        try:
            token, _, owner = await node.acquire("held", LONG)
            clock = node.hello["clock_ms"]  # the primary's own clock, as a real standby echoes it
            with pytest.raises(PermissionDenied):  # an admin (or a client) may not, even for the right epoch
                await node.request(P.OP_STEP_DOWN, 1, clock)
            for epoch, seen_ms in ((0, clock), (2, clock), (5, clock), (2**63 - 1, clock), (-1, clock),
                                   ("1", clock), (None, clock),
                                   (1, clock - P.STEP_DOWN_FRESH_MS - 1000),  # delayed: the standby gave up
                                   (1, clock + 60_000), (1, None)):          # not the primary's clock
                with pytest.raises(InvalidArgument):
                    await peer.request(P.OP_STEP_DOWN, epoch, seen_ms)
            assert node.hello["role"] == "primary"
            st = await node.status()
            assert st["role"] == "primary" and st["epoch"] == 0 and not st["replication"]["fenced"]
            await node.extend("held", token, owner, LONG)
            await node.acquire("still-granting", LONG)
        finally:
            await node.close()
            await peer.close()
        assert not os.path.exists(p.data_dir / "deposed.json")
        # the standby was not disturbed: still following, still a standby
        st = await status_of(s.address)
        assert st["role"] == "standby" and st["replication"]["connected"]

    run(main())


def test_a_fenced_primary_refuses_release_check_holder_and_a_releasing_cancel(cluster):
    """Fenced 0.5 s after the standby's last echo (window 3 s, margin 2.5 s): lock ops are
    refused and change nothing, a queued waiter can still withdraw; once the whole window
    has passed (the standby may have promoted) the connections that wait are closed."""
    p = cluster.primary(args=["--fence-margin", "2.5"])
    s = cluster.standby(p.address, failover_after=3.0, grace=GRACE)

    async def main():
        await poll(lambda: status_of(p.address), lambda st: st["replication"]["paired_standby"],
                   timeout=5, what="pairing")
        holder = await RawNode.open(p.address, name="holder")
        w1 = await RawNode.open(p.address, name="waiter-1")
        w2 = await RawNode.open(p.address, name="waiter-2")
        try:
            token, _, owner = await holder.acquire("k", LONG)
            w1_owner = os.urandom(16)
            q1 = asyncio.ensure_future(w1.acquire("k", LONG, wait_ms=LONG, owner=w1_owner))
            q2 = asyncio.ensure_future(w2.acquire("k", LONG, wait_ms=LONG))
            await poll(lambda: holder.status(), lambda st: st["waiters"] == 2, timeout=5, what="queued")
            await asyncio.to_thread(s.kill)  # no promotion: the primary just loses its standby
            await poll(lambda: holder.status(), lambda st: st["replication"]["fenced"], timeout=2,
                       what="the primary to fence itself")
            before = await holder.status()
            for request in (holder.release("k", token, owner), holder.extend("k", token, owner, LONG),
                            holder.request(P.OP_CHECK, "k", token), holder.holder("k"),
                            holder.request(P.OP_CANCEL, "k", owner),  # would release the holder's lease
                            holder.request(P.OP_WATCH, "k"), holder.acquire("free", LONG)):
                with pytest.raises(Unavailable, match="fenced"):
                    await request
            after = await holder.status()
            assert after["locks_held"] == before["locks_held"] == 1
            assert after["last_token"] == token and after["waiters"] == 2
            # withdrawing a queued waiter is local, so it is served
            assert await w1.request(P.OP_CANCEL, "k", w1_owner) == "cancelled"
            with pytest.raises(Cancelled):
                await q1
            assert (await holder.status())["waiters"] == 1
            # a whole window after the last echo the standby may have promoted: the waiting
            # connection is closed (never granted), the holder's idle connection stays
            with pytest.raises(ConnectionLost):
                await asyncio.wait_for(q2, 5)
            st = await holder.status()
            assert st["waiters"] == 0 and st["locks_held"] == 1 and st["last_token"] == token
        finally:
            for node in (holder, w1, w2):
                await node.close()

    run(main())


def test_a_promotion_refused_for_an_out_of_range_epoch_leaves_a_following_standby(cluster):
    """A standby that has heard of the last encodable epoch cannot promote: it says so,
    stays a standby and keeps following (it never sticks in 'promoting')."""
    p = cluster.primary()
    s = cluster.standby(p.address)

    async def main():
        a = await RawNode.open(p.address)
        await a.acquire("x", LONG)
        await poll(lambda: status_of(s.address), lambda st: st["replication"]["applied_lsn"] >= 1,
                   timeout=5, what="standby caught up")
        s.stop()
        state_file = s.data_dir / "node-state.json"
        state = json.loads(state_file.read_text())
        state["max_epoch_seen"] = P.MAX_EPOCH
        state_file.write_text(json.dumps(state))
        s2 = cluster.restart(s)
        await poll(lambda: status_of(s2.address), lambda st: st["replication"]["connected"], timeout=10,
                   what="the standby following again")
        res = await asyncio.to_thread(cli, "promote", "--force", "--server", s2.address)
        assert res.returncode == 1 and "exceed" in res.stderr, res.stderr
        st = await status_of(s2.address)
        assert st["role"] == "standby" and st["replication"]["connected"]
        await a.acquire("y", LONG)  # the primary is untouched and the standby still follows it
        await poll(lambda: status_of(s2.address), lambda st: st["locks_held"] == 2, timeout=5,
                   what="the standby applying the new grant")
        assert (await status_of(p.address))["role"] == "primary"
        await a.close()

    run(main())


def test_a_refused_promotion_goes_back_to_standby_and_follows_again(cluster):
    p = cluster.primary()
    s = cluster.standby(p.address)  # no --failover-after: an unconfirmed promotion is refused

    async def main():
        a = await RawNode.open(p.address)
        await a.acquire("x", LONG)
        await poll(lambda: status_of(s.address), lambda st: st["replication"]["applied_lsn"] >= 1,
                   timeout=5, what="standby caught up")
        p.pause()
        try:
            res = await asyncio.to_thread(cli, "promote", "--server", s.address)
        finally:
            p.resume()
        assert res.returncode == 1 and "did not confirm" in res.stderr, res.stderr
        assert any("role: promoting -> standby (promotion refused" in line for line in s.lines)
        await a.acquire("y", LONG)
        st = await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 2, timeout=5,
                        what="the standby following again")
        assert st["role"] == "standby"
        await a.close()

    run(main())


def test_a_manual_promotion_deposes_a_live_primary_which_drops_its_clients(cluster):
    """The old primary confirms STEP_DOWN, then closes its client connections: a waiter
    queued there learns at once that it must look elsewhere; the lease survives on the new primary."""
    p = cluster.primary()
    s = cluster.standby(p.address)

    async def main():
        holder = await RawNode.open(p.address, name="holder")
        waiter = await RawNode.open(p.address, name="waiter")
        try:
            token, _, owner = await holder.acquire("k", LONG)
            queued = asyncio.ensure_future(waiter.acquire("k", LONG, wait_ms=LONG))
            await poll(lambda: holder.status(), lambda st: st["waiters"] == 1, timeout=5, what="queued")
            await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 1, timeout=5,
                       what="standby caught up")
            res = await asyncio.to_thread(cli, "promote", "--server", s.address)
            assert res.returncode == 0, res.stderr
            assert json.loads(res.stdout)["primary_confirmed"] is True
            with pytest.raises(ConnectionLost):
                await asyncio.wait_for(queued, 5)
            old = await RawNode.open(p.address)
            try:
                # deposed, or already rejoined as the new primary's standby (its peer check may run first)
                assert old.hello["role"] in ("deposed", "standby")
                with pytest.raises(NotPrimary) as info:
                    await old.release("k", token, owner)
                assert info.value.primary in (None, s.address)
            finally:
                await old.close()
            new = await RawNode.open(s.address)
            try:
                assert await new.extend("k", token, owner, LONG) == LONG  # the holder keeps its lease
                await new.release("k", token, owner)
            finally:
                await new.close()
        finally:
            await holder.close()
            await waiter.close()

    run(main())
