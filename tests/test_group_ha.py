"""An etcd group's failover as a client and an operator meet it, with real processes and etcd.

- a client that *starts* right after ``kill -9`` of the group's primary (no primary yet)
  finds the promoted node and gets its lock within ``wait`` (the first connect rides
  through as a connected client does);
- with an etcd TTL of 3 s (a failover longer than the client's 50 fast pauses) such a
  client still finds the new primary, its pauses doubling from 0.1 s after the fast ones;
- ``--sync-standbys 2`` (three nodes, both standbys in the in-sync set): ``kill -9`` of
  the primary promotes a standby without a grace period, and every acknowledged grant
  is held there by the same token.

Skipped without the etcd binary unless FASTLOCK_REQUIRE_ETCD=1.
"""

from __future__ import annotations

import asyncio

import pytest
from test_etcd_failover import Group
from test_etcd_sync import SyncGroup, holders, started, take
from test_first_connect import WaitingLines

import fastlock

pytest.importorskip("httpx")


@pytest.fixture(autouse=True)
def _one_loop(request):
    """These tests start processes: run them on one event loop only."""
    if "uvloop" in request.node.name:
        pytest.skip("process-level etcd tests run on the asyncio loop only")


async def test_a_client_started_during_a_group_failover_gets_its_lock(cluster, etcd):
    group = SyncGroup(cluster, etcd)
    first, rest = await started(group)
    addresses = [group.nodes[n].address for n in ("a", "b", "c")]
    tokens = await take(group.nodes[first].address, ["before"])
    group.nodes[first].kill()
    # no primary at this moment: the first connect waits for the promotion, within its deadline
    async with fastlock.connect(*addresses, failover_timeout=30) as client:
        lease = await client.acquire("started-mid-failover", ttl=30, wait=20)
        assert lease.fencing_token > tokens["before"]
        held = await client.holder("before")
        assert held is not None and held["token"] == tokens["before"]
    second, _ = await group.primary(rest)
    assert second in rest


async def test_a_client_started_during_a_ttl_3_failover_finds_the_new_primary(cluster, etcd):
    """TTL 3 s: the failover outlasts the client's fast pauses (about 4 s of sweeps); a client
    started right after ``kill -9`` (it logs that no node is the primary yet) gets its lock
    from the promoted node.  The bound (three TTLs and 5 s from the kill) is generous: the
    deletion of the key comes one TTL after the last heartbeat, the promotion and the
    client's next sweep (at most 0.5 s after it) follow."""
    group = Group(cluster, etcd)
    ttl_s = 3
    for name in ("a", "b", "c"):
        group.start(name, ttl_s=ttl_s)
    first, st = await group.primary(timeout=20)
    rest = [n for n in ("a", "b", "c") if n != first]
    await group.followers_of(first, rest, timeout=20)
    addresses = [group.nodes[n].address for n in ("a", "b", "c")]
    loop = asyncio.get_running_loop()
    group.nodes[first].kill()
    killed = loop.time()
    with WaitingLines() as seen:
        async with fastlock.connect(*addresses, failover_timeout=30, connect_timeout=1.0) as client:
            lease = await client.acquire("started-mid-failover", ttl=30, wait=20)
            got = loop.time()
            assert client.server_info["role"] == "primary" and client.server_info["epoch"] > st["epoch"]
    assert seen.lines, "the client found a primary at once: it did not start during the failover"
    assert lease.fencing_token >> 40 > st["epoch"]
    assert got - killed <= 3 * ttl_s + 5.0
    second, _ = await group.primary(rest)
    assert second in rest


async def test_two_sync_standbys_kill_promotes_without_grace_with_every_acknowledged_grant(cluster, etcd):
    group = SyncGroup(cluster, etcd, extra=("--sync-standbys", "2"))
    for name in ("a", "b", "c"):
        group.start(name)
    first, _ = await group.primary()
    rest = [n for n in ("a", "b", "c") if n != first]
    await group.followers_of(first, rest)
    members = await group.in_sync(first, count=2)
    assert sorted(members) == sorted(rest)
    names = [f"lock-{i}" for i in range(100)]
    tokens = await take(group.nodes[first].address, names)
    group.nodes[first].kill()
    second, st = await group.primary(rest)
    assert st["grace_remaining_ms"] == 0
    assert any("promotion without a grace period" in line for line in group.nodes[second].lines)
    assert await holders(group.nodes[second].address, names) == tokens  # none lost, none changed
