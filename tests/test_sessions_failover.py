"""Client sessions under failover in an etcd group and in a pair with ``--replication sync``
(fastlock.client.session, fastlock.server.sessions, docs/sessions.md).

Real server processes: a client holding leases through its session rides a SIGKILL of the
primary; the promoted node gets the same session (same id) re-opened by proof, its leases
re-attached and renewed by keep-alives there, none lost (each lease's TTL covers the failover)
and each still held under its own token.  The etcd group is skipped without the etcd binary
unless FASTLOCK_REQUIRE_ETCD=1.  The nemesis (``python -m benches.nemesis``) runs the same
under a cycle of faults.
"""

from __future__ import annotations

import asyncio

import pytest
from test_etcd_failover import Group, three
from test_sessions import lock_all

import fastlock
from fastlock._testbase.cluster import poll, status_of

#: leases the client holds through the failover
LEASES = 100
#: their TTL (seconds): above the etcd lease (1 s) or --failover-after (1 s) plus the client's request_timeout
LEASE_TTL = 5.0
#: the client's request_timeout (seconds)
REQUEST_TIMEOUT = 2.0


@pytest.fixture
def group(cluster, etcd):
    return Group(cluster, etcd)


async def ride_a_kill(client, old_primary, promoted) -> None:
    """Hold LEASES leases through ``client``'s session, SIGKILL ``old_primary``, await
    ``promoted()`` (the new primary's address), and check the session and every lease there."""
    leases = await lock_all(client, [f"ride/{i}" for i in range(LEASES)], LEASE_TTL)
    await poll(lambda: status_of(old_primary.address), lambda st: st["client_sessions"]["leases"] == LEASES,
               timeout=30, what="every lease attached to the session")
    session_id = client.session_keeper.id
    old_primary.kill()
    address = await promoted()
    st = await poll(lambda: status_of(address), lambda st: st["client_sessions"]["leases"] == LEASES,
                    timeout=30, what="the session re-opened on the new primary, every lease attached again")
    # two TTLs of keep-alives there, each renewing every lease
    await poll(lambda: status_of(address),
               lambda x: x["client_sessions"]["keepalives"] >= st["client_sessions"]["keepalives"] + 6,
               timeout=60, what="keep-alives on the new primary")
    assert client.session_keeper.id == session_id
    assert [lease.fencing_token for lease in leases if lease.lost.is_set()] == []
    for i in (0, 42, LEASES - 1):
        holder = await client.holder(f"ride/{i}")
        assert holder is not None and holder["token"] == leases[i].fencing_token
    sessions = await client.sessions()
    assert [(s.id, s.leases) for s in sessions] == [(session_id, LEASES)]


@pytest.mark.one_loop
async def test_session_leases_ride_a_sigkill_of_the_etcd_groups_primary(group, loop_errors):
    names = three(group)
    first, _ = await group.primary()
    rest = [n for n in names if n != first]
    await group.followers_of(first, rest)
    client = await fastlock.connect(*(group.nodes[n].address for n in names), client_name="group-rider",
                                    request_timeout=REQUEST_TIMEOUT)

    async def promoted() -> str:
        second, _ = await group.primary(rest, timeout=15)
        return group.nodes[second].address

    try:
        await group.followers_of(first, rest)  # caught up before the kill
        await ride_a_kill(client, group.nodes[first], promoted)
    finally:
        await client.close()


@pytest.mark.one_loop
async def test_session_leases_ride_a_sigkill_of_a_sync_pairs_primary(cluster, loop_errors):
    p = cluster.primary("a", args=["--replication", "sync"])
    s = cluster.standby(p.address, "b", failover_after=1.0, grace=0.2, args=["--replication", "sync"])
    await poll(lambda: status_of(p.address), lambda st: st["replication"]["sync"].get("state") == "in_sync",
               timeout=30, what="the pair in sync")
    client = await fastlock.connect(p.address, s.address, client_name="sync-rider", request_timeout=REQUEST_TIMEOUT)

    async def promoted() -> str:
        await asyncio.to_thread(s.wait_for_log, r"PROMOTED", 15)
        return s.address

    try:
        await ride_a_kill(client, p, promoted)
    finally:
        await client.close()


@pytest.mark.one_loop
async def test_a_session_left_on_a_node_that_is_primary_again_is_not_resumed_stale(group, loop_errors):
    """A primary frozen while a client's session is open there rejoins as a standby without a
    restart, so it still has the session, with the leases attached then.  When it is primary
    again (a later epoch), that session is stale: the client's keep-alive must not find it, or
    a lease attached on the other node meanwhile would not be renewed while the client believes
    it is.  The client opens the session again there and attaches every lease it holds."""
    names = three(group)
    first, _ = await group.primary()
    rest = [n for n in names if n != first]
    await group.followers_of(first, rest)
    client = await fastlock.connect(*(group.nodes[n].address for n in names), client_name="stale-rider",
                                    request_timeout=REQUEST_TIMEOUT)
    try:
        early = await client.lock("stale/early", ttl=LEASE_TTL)
        await poll(lambda: status_of(group.nodes[first].address),
                   lambda st: st["client_sessions"]["leases"] == 1, timeout=30, what="the lease attached")
        old = group.nodes[first]
        old.pause()
        try:
            second, _ = await group.primary(rest, timeout=15)
        finally:
            old.resume()
        (third,) = [n for n in rest if n != second]
        await poll(lambda: status_of(group.nodes[second].address),
                   lambda st: st["client_sessions"]["leases"] == 1, timeout=30,
                   what="the session re-opened on the second primary")
        late = await client.lock("stale/late", ttl=LEASE_TTL)
        await poll(lambda: status_of(group.nodes[second].address),
                   lambda st: st["client_sessions"]["leases"] == 2, timeout=30, what="the late lease attached")
        await group.followers_of(second, [first, third], timeout=30)  # the first node follows, unrestarted
        # the first node is the only one left to take the key: primary again, at a later epoch
        group.nodes[third].kill()
        group.nodes[second].kill()
        back, _ = await group.primary([first], timeout=15)
        assert back == first
        st = await poll(lambda: status_of(old.address), lambda st: st["client_sessions"]["leases"] == 2,
                        timeout=30, what="the session re-opened on the first node with both leases attached")
        # keep-alives there for longer than a TTL: both leases stay held under their tokens
        await poll(lambda: status_of(old.address),
                   lambda x: x["client_sessions"]["keepalives"] >= st["client_sessions"]["keepalives"] + 6,
                   timeout=60, what="keep-alives on the first node")
        assert not early.lost.is_set() and not late.lost.is_set()
        for lease in (early, late):
            holder = await client.holder(lease.name)
            assert holder is not None and holder["token"] == lease.fencing_token
    finally:
        await client.close()
