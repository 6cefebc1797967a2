"""A primary acknowledges no lease whose TTL its standby does not know (replication/ttlbound.py).

The promoted standby's default grace is the longest TTL it heard of.  A pair with
asynchronous replication is cut after a short-TTL grant; before the old primary fences
itself, a client asks it for a lease with a much longer TTL (an ACQUIRE, or an EXTEND of
the short lease).  The promoted standby must not grant that name while a lease the old
primary acknowledged could be live: so the old primary must not acknowledge it (it waits
for the standby's echo of a heartbeat carrying the new TTL, which never comes, and fails
with Unavailable when it fences).  With the link up the same request costs one round trip.

Real processes (the ``cluster`` fixture), a ``TcpProxy`` between the pair; every wait is
bounded.  The etcd group's case: ``test_ttl_bound_group.py``.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock._testbase.servers import WitnessProcess
from fastlock.auth import Credentials
from fastlock.errors import InvalidArgument, LockNotAcquired, NotPrimary, Unavailable
from fastlock.replication.witness import Witness, read_vote

SHORT_MS = 1000  # the TTL the standby hears of before the cut
LONG_MS = 60_000  # the TTL asked of the old primary after the cut
FAILOVER = 2.0  # --failover-after, seconds


def _cut_pair(cluster, args=()):
    """A primary and its paired standby (default grace), the standby attached through a proxy."""
    p = cluster.primary(args=args)
    px = cluster.proxy(p.address)
    s = cluster.standby(px.address, failover_after=FAILOVER, args=args)
    return p, px, s


async def _long_lease_on_the_old_primary(node: RawNode, op: str) -> float | None:
    """Ask the cut-off primary for a ``LONG_MS`` lease on "ledger"; the monotonic time it
    was acknowledged, or None when it was refused."""
    try:
        if op == "acquire":
            await node.acquire("ledger", LONG_MS)
        else:
            token, _, owner = await node.acquire("ledger", SHORT_MS)  # a TTL the standby knows
            assert await node.extend("ledger", token, owner, LONG_MS) == LONG_MS
        return time.monotonic()
    except (Unavailable, NotPrimary):
        return None


async def _granted_on(address: str, name: str, wait_s: float) -> bool:
    """Is ``name`` granted at ``address`` within ``wait_s`` seconds (retrying through the grace)?"""
    node = await RawNode.open(address)
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(node.acquire(name, SHORT_MS), 5)
                return True
            except (LockNotAcquired, Unavailable, NotPrimary):
                await asyncio.sleep(0.05)
        return False
    finally:
        await node.close()


@pytest.mark.parametrize("op", ["acquire", "extend"])
def test_a_cut_off_primary_acknowledges_no_ttl_longer_than_its_standby_knows(cluster, op):
    p, px, s = _cut_pair(cluster)

    async def main():
        old = await RawNode.open(p.address)
        try:
            await old.acquire("warm-up", SHORT_MS)  # the standby hears of SHORT_MS
            await poll(lambda: status_of(p.address),
                       lambda st: st["replication"]["ttl_bound"]["bound_ms"] == SHORT_MS,
                       timeout=10, what="the standby to confirm the short TTL")
            px.blackhole()  # the cut: before the primary's fence (failover window minus its margin)
            acked_at = await _long_lease_on_the_old_primary(old, op)
        finally:
            await old.close()
        await asyncio.to_thread(s.wait_for_log, r"PROMOTED to primary", 30)
        # the safety property: a lease the old primary acknowledged keeps the name from the new one
        granted = await _granted_on(s.address, "ledger", 10.0)
        assert not (acked_at is not None and granted and time.monotonic() < acked_at + LONG_MS / 1000), \
            "two holders: the promoted standby granted a lease the old primary acknowledged for longer"
        # and the rule that gives it: the old primary refused (it fenced before the standby's word)
        assert acked_at is None
        assert granted  # nothing acknowledged: the new primary grants after its (short) grace

    run(main(), 90)


def test_a_new_longest_ttl_costs_one_round_trip_with_the_link_up(cluster):
    """The standby echoes the heartbeat that carries the new TTL: the reply goes out once it
    did; a TTL it knows does not wait again."""
    p, _px, s = _cut_pair(cluster)

    async def main():
        node = await RawNode.open(p.address)
        try:
            await node.acquire("a", SHORT_MS)
            await poll(lambda: status_of(p.address),
                       lambda st: st["replication"]["ttl_bound"]["bound_ms"] == SHORT_MS,
                       timeout=10, what="the standby to confirm the short TTL")
            waited = (await status_of(p.address))["replication"]["ttl_bound"]["waited"]
            await asyncio.wait_for(node.acquire("b", LONG_MS), 10)
            st = (await status_of(p.address))["replication"]["ttl_bound"]
            # the echo came before the reply (it waited, unless the echo beat the fsync)
            assert st["bound_ms"] == LONG_MS and st["waited"] in (waited, waited + 1) and st["waiting"] == 0
            waited = st["waited"]
            token, _, owner = await node.acquire("c", LONG_MS)  # known now: no wait
            assert await node.extend("c", token, owner, LONG_MS - 1) == LONG_MS - 1
            assert (await status_of(p.address))["replication"]["ttl_bound"]["waited"] == waited
            # the standby's node state keeps it: its grace after a promotion covers the lease
            st = await status_of(s.address)
            assert st["role"] == "standby"
        finally:
            await node.close()

    run(main(), 60)


def test_a_lone_primary_has_no_bound(cluster):
    p = cluster.primary()

    async def main():
        node = await RawNode.open(p.address)
        try:
            await asyncio.wait_for(node.acquire(os.urandom(4).hex(), LONG_MS), 10)
            st = (await status_of(p.address))["replication"]["ttl_bound"]
            assert st == {"bound_ms": None, "witness_ms": 0, "waiting": 0, "waited": 0}
        finally:
            await node.close()

    run(main(), 30)


# -- a pair with a witness: the primary keeps granting while its standby is silent ----------

@pytest.fixture
def witness(cluster, tmp_path):
    w = WitnessProcess(tmp_path / "witness", cluster.creds.file)
    cluster.servers.append(w)  # stopped with the cluster
    return w.start()


def test_a_witness_pair_cut_off_primary_reports_the_long_ttl_and_the_promotion_keeps_it(cluster, witness):
    """The link cut, the witness reachable: the primary keeps granting on the witness's lease,
    and a new longest TTL is acknowledged only once the witness recorded it; killed, its
    standby promotes with the witness's vote, which hands it that TTL as its grace."""
    p = cluster.primary(args=["--witness", witness.address])
    px = cluster.proxy(p.address)
    s = cluster.standby(px.address, failover_after=1.0, args=["--witness", witness.address])
    p.wait_for_log(r"holding its lease for epoch", 10)

    async def main():
        old = await RawNode.open(p.address)
        try:
            await old.acquire("warm-up", SHORT_MS)
            await poll(lambda: status_of(p.address),
                       lambda st: st["replication"]["ttl_bound"]["bound_ms"] == SHORT_MS,
                       timeout=10, what="the standby to confirm the short TTL")
            px.blackhole()
            await asyncio.to_thread(s.wait_for_log, r"did not grant the lease of epoch", 30)
            # the standby cannot be told: the witness records the TTL before the reply goes out
            await asyncio.wait_for(old.acquire("ledger", LONG_MS), 10)
            acked_at = time.monotonic()
            st = (await status_of(p.address))["replication"]["ttl_bound"]
            assert st["witness_ms"] >= LONG_MS and st["bound_ms"] >= LONG_MS
        finally:
            await old.close()
        p.kill()
        line = await asyncio.to_thread(s.wait_for_log, r"PROMOTED to primary", 40)
        grace_ms = int(line.rsplit(" ms (grace)", 1)[0].rsplit(" ", 1)[1])
        assert grace_ms >= LONG_MS, line  # the witness's word: the old primary's longest TTL
        if time.monotonic() < acked_at + LONG_MS / 1000 - 5:
            assert not await _granted_on(s.address, "ledger", 3.0)

    run(main(), 120)


# -- the witness's record of the longest TTL (its rule, on a fake clock) ----------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1_000

    def __call__(self) -> int:
        return self.now


def test_the_witness_keeps_the_longest_ttl_reported_and_hands_it_to_the_next_vote(tmp_path):
    clock = Clock()
    w = Witness(str(tmp_path), Credentials.open_mode(), clock=clock)
    assert w.lease("r1/a", 1, 1000, False, SHORT_MS)["max_ttl_ms"] == SHORT_MS
    assert w.lease("r1/a", 1, 1000, False, LONG_MS)["max_ttl_ms"] == LONG_MS
    assert read_vote(str(tmp_path)).max_ttl_ms == LONG_MS  # on disk before the answer
    assert w.lease("r1/a", 1, 1000, False, SHORT_MS)["max_ttl_ms"] == LONG_MS  # never lowered
    clock.now += 1000
    vote = w.lease("r2/b", 2, 1000)  # a promotion's vote: it learns the old primary's longest TTL
    assert vote["granted"] and vote["previous_max_ttl_ms"] == LONG_MS and vote["max_ttl_ms"] == 0
    clock.now += 1000
    # voted in but never heard from again (it died promoting): the next one still learns it
    assert w.lease("r3/c", 3, 1000)["previous_max_ttl_ms"] == LONG_MS
    again = Witness(str(tmp_path), Credentials.open_mode(), clock=clock)
    assert again.vote.previous_max_ttl_ms == LONG_MS


@pytest.mark.parametrize("max_ttl_ms", [-1, "1000", 1.5, 10**12, True])
def test_a_bad_longest_ttl_is_refused_and_changes_nothing(tmp_path, max_ttl_ms):
    w = Witness(str(tmp_path), Credentials.open_mode(), clock=Clock())
    with pytest.raises(InvalidArgument):
        w.lease("r1/a", 1, 1000, False, max_ttl_ms)
    assert w.vote.epoch == 0 and w.vote.holder is None
