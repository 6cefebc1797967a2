"""Attacks on sharding and the cross-shard multi-lock, each kept as a test: a hostile
client's raw RESERVE frames (fastlock.server.woundwait), hostile shard maps
(fastlock.sharding.shardmap) and a routing client's trust in the map it is served
(fastlock.client.sharded).  Real server processes on 127.0.0.1, raw msgpack peers
(:class:`test_limits.Raw`), bounded waits."""

from __future__ import annotations

import os
import time

import pytest
from test_limits import Raw, error_of

import fastlock
from fastlock import protocol as P
from fastlock._testbase.proxy import free_port
from fastlock._testbase.shards import names_owned_by
from fastlock.client.sharded import ShardedClient
from fastlock.errors import LimitExceeded, LockNotHeld
from fastlock.protocol.ops import OP_RESERVE
from fastlock.sharding import ShardGroup, ShardMap, even_ranges, write_map_file

TTL_MS = 60_000


def now_ms() -> int:
    return int(time.time() * 1000)


def test_reservations_parked_behind_an_older_one_count_against_the_waiter_quota(server_factory):
    """A younger reservation parked behind an older waiter holds nothing in the queues, yet the
    server keeps it: it counts against its principal's waiter and lease quotas like a queued one,
    so one principal cannot park past its quota (up to the server's shared MAX_PARKED)."""
    srv = server_factory("quota", fsync="never", args=["--max-waiters-per-principal", "3",
                                                       "--max-leases-per-principal", "6"])
    with Raw(srv.address, name="holder") as holder, Raw(srv.address, name="older") as older, \
            Raw(srv.address, name="parker") as parker:
        assert holder.call(P.OP_ACQUIRE, "x", os.urandom(16), TTL_MS, 0, 0, None)[1] == 0
        stamp = now_ms()
        older.send(OP_RESERVE, ["x"], os.urandom(16), TTL_MS, 30_000, None, stamp - 5_000, b"older")
        assert older.call(P.OP_PING)[1] == 0
        # every connection here is the anonymous principal: 1 waiter so far, quota 3
        parked = 0
        for i in range(10):
            rid = parker.send(OP_RESERVE, ["x"], os.urandom(16), TTL_MS, 30_000, None, stamp, b"young-%d" % i)
            answers = sent_until_ping(parker, rid)
            if rid in answers:
                break
            parked += 1
        assert parked == 2, f"parked {parked} reservations past a waiter quota of 3 (1 already waiting)"
        code, message = error_of(answers[rid])
        assert code == LimitExceeded.code and "--max-waiters-per-principal" in message


def sent_until_ping(peer: Raw, *rids: int) -> dict:
    """The replies to ``rids`` that come before the reply to a PING sent now (a parked
    reservation is answered only when it is woken: it has none by then)."""
    ping = peer.send(P.OP_PING)
    got: dict = {}
    while True:
        msg = peer.recv()
        assert msg is not None, "connection closed"
        if msg[0] == ping:
            return got
        if msg[0] in rids:
            got[msg[0]] = msg


async def test_a_group_that_owns_no_slot_is_not_dialled_by_calls_over_every_group(server_factory, tmp_path):
    """A map may name a group that owns no slot yet (``fastlock shard addresses`` adds one before
    its nodes run; a map writer may add any address): it holds no lease or session, so the calls
    that reach every group (sessions, revoke_principal, close_session, locks) do not dial it,
    and an unreachable one fails none of them."""
    ports = {"g0": free_port(), "g1": free_port(), "new": free_port()}  # nothing listens on "new"'s
    groups = tuple(ShardGroup(g, (f"127.0.0.1:{p}",)) for g, p in ports.items())
    shard_map = ShardMap(1, groups, even_ranges(["g0", "g1"]))
    write_map_file(tmp_path / "map.json", shard_map)
    for g in ("g0", "g1"):
        server_factory(g, fsync="never", port=ports[g],
                       args=["--shard-map", str(tmp_path / "map.json"), "--shard-group", g])
    async with fastlock.connect(f"127.0.0.1:{ports['g0']}", connect_timeout=1.0, request_timeout=2.0,
                                failover_timeout=2.0) as client:
        assert isinstance(client, ShardedClient)
        name = names_owned_by(shard_map, "g1", 1)[0]
        lease = await client.acquire(name, ttl=30)
        assert set(client.group_clients()) == {"g0", "g1"}
        assert isinstance(await client.sessions(), list)  # both groups answer; "new" is not dialled
        listing = await client.locks()
        assert [entry.name for entry in listing.locks] == [name] and not listing.unreachable
        with pytest.raises(LockNotHeld):
            await client.close_session("no-such-session")
        revoked = await client.revoke_principal("nobody")
        assert revoked.revoked == 0
        await client.release(lease)
