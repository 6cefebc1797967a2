"""An etcd group's primary acknowledges no lease TTL its attached standbys do not know
(replication/ttlbound.py): a promoted member's default grace is the longest TTL it heard of.

Both standbys cut off (a proxy in front of the primary's advertised address) after a
short-TTL grant: a long-TTL acquire on the primary is not acknowledged (Unavailable); the
primary killed, the member etcd elects grants the name after its (short) grace, and nobody
else holds it.  With the standbys attached the same acquire costs one round trip.  Real processes and a real etcd;
skipped without the etcd binary unless FASTLOCK_REQUIRE_ETCD=1.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from test_etcd_failover import Group
from throwaway import free_port

from fastlock._testbase.cluster import RawNode, poll, status_of
from fastlock._testbase.proxy import TcpProxy
from fastlock.errors import LockNotAcquired, NotPrimary, Unavailable

pytest.importorskip("httpx")

SHORT_MS = 1000
LONG_MS = 60_000


@pytest.fixture(autouse=True)
def _one_loop(request):
    """These tests start processes: run them on one event loop only."""
    if "uvloop" in request.node.name:
        pytest.skip("process-level etcd tests run on the asyncio loop only")


async def _bound(address: str, value: int) -> None:
    await poll(lambda: status_of(address), lambda st: st["replication"]["ttl_bound"]["bound_ms"] == value,
               timeout=10, what=f"the standbys to confirm a TTL of {value} ms")


async def test_a_group_primary_acknowledges_no_ttl_its_standbys_do_not_know(cluster, etcd):
    group = Group(cluster, etcd)
    port = free_port()
    # the standbys reach the primary "a" through a proxy (its advertised address): the cut
    with TcpProxy(f"127.0.0.1:{port}") as proxy:
        a = group.start("a", port=port, advertise=proxy.address)
        await group.primary(["a"])
        for name in ("b", "c"):
            group.start(name)
        await group.followers_of("a", ["b", "c"], address=proxy.address)
        node = await RawNode.open(a.address)
        try:
            await node.acquire("warm-up", SHORT_MS)
            await _bound(a.address, SHORT_MS)
            proxy.blackhole()  # etcd still renews a's lease: no fence
            acked_at = None
            try:
                await asyncio.wait_for(node.acquire("ledger", LONG_MS), 10)
                acked_at = time.monotonic()
            except (Unavailable, NotPrimary):
                pass
        finally:
            await node.close()
        a.kill()
        second, _ = await group.primary(["b", "c"], timeout=30)
        new = await RawNode.open(group.nodes[second].address)
        try:
            granted = False
            deadline = time.monotonic() + 15  # the grace of a member that knows SHORT_MS, with room
            while time.monotonic() < deadline and not granted:
                try:
                    await asyncio.wait_for(new.acquire("ledger", SHORT_MS), 5)
                    granted = True
                except (LockNotAcquired, Unavailable, NotPrimary):
                    await asyncio.sleep(0.1)
        finally:
            await new.close()
    assert not (acked_at is not None and granted and time.monotonic() < acked_at + LONG_MS / 1000), \
        "two holders: the promoted member granted a lease the old primary acknowledged for longer"
    assert acked_at is None and granted  # the rule: not acknowledged, so the name is free there


async def test_a_new_longest_ttl_costs_a_group_primary_one_round_trip(cluster, etcd):
    group = Group(cluster, etcd)
    for name in ("a", "b"):
        group.start(name)
    first, _ = await group.primary()
    rest = [n for n in ("a", "b") if n != first]
    await group.followers_of(first, rest)
    primary = group.nodes[first]
    node = await RawNode.open(primary.address)
    try:
        await node.acquire("warm-up", SHORT_MS)
        await _bound(primary.address, SHORT_MS)
        await asyncio.wait_for(node.acquire("long", LONG_MS), 10)
        st = (await status_of(primary.address))["replication"]["ttl_bound"]
        assert st["bound_ms"] == LONG_MS and st["waiting"] == 0  # the standby's echo came before the reply
    finally:
        await node.close()
