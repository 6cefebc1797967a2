"""Attacks on sharding and the cross-shard multi-lock, each kept as a test: a hostile
client's raw RESERVE frames (fastlock.server.woundwait), hostile shard maps
(fastlock.sharding.shardmap) and a routing client's trust in the map it is served
(fastlock.client.sharded).  Real server processes on 127.0.0.1, raw msgpack peers
(:class:`test_limits.Raw`), bounded waits."""

from __future__ import annotations

import json
import os
import time

import pytest
from conftest import wait_until
from etcdserver import unique_prefix
from test_limits import Raw, error_of

import fastlock
from fastlock import protocol as P
from fastlock._testbase.cluster import RawNode
from fastlock._testbase.proxy import free_port
from fastlock._testbase.servers import ServerProcess
from fastlock._testbase.shards import names_owned_by
from fastlock.auth import generate
from fastlock.client.sharded import ShardedClient
from fastlock.coordination.shardmap import load_from_etcd
from fastlock.errors import AuthError, CrossShard, LimitExceeded, LockNotHeld, WrongShard, error_from_wire
from fastlock.protocol.ops import OP_RESERVE, OP_SHARD_MAP
from fastlock.server.woundwait import MAX_RESERVATIONS_PER_PRINCIPAL
from fastlock.sharding import SLOTS, ShardGroup, ShardMap, SlotRange, even_ranges, write_map_file

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


async def test_a_hostile_writer_of_the_map_in_etcd_cannot_crash_a_node_or_move_its_slots(etcd, tmp_path):
    """A writer of the map key only: garbage, JSON nested too deep, a map that gives slots to
    other groups, a map of a lower epoch, and one as large as a map can be (1024 groups of 16
    addresses).  The node logs and refuses each invalid one, keeps its slots, and serves on."""
    url = f"etcd://{etcd.address}{unique_prefix()}"
    ports = [free_port(), free_port()]
    first = ShardMap(1, tuple(ShardGroup(f"g{k}", (f"127.0.0.1:{ports[k]}",)) for k in range(2)),
                     even_ranges(["g0", "g1"]))
    stored = await load_from_etcd(url)
    try:
        await stored.create(first)
        node = ServerProcess(tmp_path / "g0", fsync="never", port=ports[0],
                             args=["--shard-map", url, "--shard-group", "g0"]).start()
        try:
            async def served() -> ShardMap:
                raw = await RawNode.open(node.address)
                try:
                    return ShardMap.from_wire((await raw.request(OP_SHARD_MAP))["map"])
                finally:
                    await raw.close()

            for garbage in (b"\xff not json", b"[" * 200_000, b'{"epoch": 2}'):
                start = len(node.lines)
                await stored.gateway.put(stored.key, garbage)
                node.wait_for_log("ignoring the shard map in etcd", timeout=20, start=start)
            swapped = ShardMap(5, first.groups, tuple(SlotRange(r.first, r.last, "g1" if r.group == "g0" else "g0")
                                                       for r in first.ranges))
            start = len(node.lines)
            await stored.gateway.put(stored.key, json.dumps(swapped.to_wire()).encode())
            node.wait_for_log("not applying shard map epoch 5", timeout=20, start=start)
            assert await served() == first
            many = tuple(ShardGroup(f"x{k}", tuple(f"127.0.0.{1 + a}:{1 + k}" for a in range(16)))
                         for k in range(1022))
            largest = ShardMap(6, first.groups + many, first.ranges)
            await stored.gateway.put(stored.key, json.dumps(largest.to_wire()).encode())
            await wait_until(lambda: _epoch_is(served, 6), 20, "the node to serve the largest map")
            lower = ShardMap(3, first.groups, first.ranges)
            await stored.gateway.put(stored.key, json.dumps(lower.to_wire()).encode())
            back = ShardMap(7, first.groups, first.ranges)  # a later valid map: the lower one was skipped
            await stored.gateway.put(stored.key, json.dumps(back.to_wire()).encode())
            await wait_until(lambda: _epoch_is(served, 7), 20, "the node to serve epoch 7")
            assert (await served()).slots_of("g0") == first.slots_of("g0")
            assert node.proc.poll() is None and not any("Traceback" in line for line in node.lines)
            # the slots given away while the node is down: it does not start with them
            node.stop()
            await stored.gateway.put(stored.key, json.dumps(swapped.with_epoch(8).to_wire()).encode())
            node = ServerProcess(tmp_path / "g0", fsync="never", port=ports[0],
                                 args=["--shard-map", url, "--shard-group", "g0"])
            with pytest.raises(RuntimeError, match="gives group g0 other slots than epoch 7"):
                node.start(timeout=20)
        finally:
            node.stop()
    finally:
        await stored.gateway.close()


async def _epoch_is(served, epoch: int) -> bool:
    return (await served()).epoch == epoch


def test_a_node_restarted_with_a_map_that_gives_its_slots_away_refuses_to_start(tmp_path):
    """A running node refuses a newer map that moves slots; a restarted one compares the map it is
    given with the last one it served by (kept in its data directory): a map changed while it was
    down (a hostile writer of the etcd key, a file edited by hand) that gives its slots to another
    group would have two groups grant the same names, so the node does not start (exit 1)."""
    port = free_port()
    groups = (ShardGroup("g0", (f"127.0.0.1:{port}",)), ShardGroup("g1", ("127.0.0.1:1",)))
    first = ShardMap(1, groups, even_ranges(["g0", "g1"]))
    swapped = ShardMap(2, groups, even_ranges(["g1", "g0"]))
    write_map_file(tmp_path / "map.json", first)
    args = ["--shard-map", str(tmp_path / "map.json"), "--shard-group", "g0"]
    node = ServerProcess(tmp_path / "g0", fsync="never", port=port, args=args).start()
    try:
        name = names_owned_by(first, "g0", 1)[0]
        with Raw(node.address) as peer:
            assert peer.call(P.OP_ACQUIRE, name, os.urandom(16), TTL_MS, 0, 0, None)[1] == 0
    finally:
        node.stop()
    write_map_file(tmp_path / "map.json", swapped)
    node = ServerProcess(tmp_path / "g0", fsync="never", port=port, args=args)
    try:
        with pytest.raises(RuntimeError, match="gives group g0 other slots than epoch 1"):
            node.start(timeout=20)
        assert node.proc.wait(timeout=20) == 1
    finally:
        node.stop()
    # the same slots at a later epoch (other addresses) start as before
    write_map_file(tmp_path / "map.json", first.with_addresses("g1", ("127.0.0.1:2",)))
    node = ServerProcess(tmp_path / "g0", fsync="never", port=port, args=args).start()
    try:
        with Raw(node.address) as peer:
            assert peer.call(P.OP_HOLDER, name)[2] is not None
    finally:
        node.stop()
    # a map that only takes slots away (a move that finished while the node was down) starts:
    # the node stops granting them, which two groups granting one name cannot come from
    fewer = ShardMap(3, groups, (SlotRange(0, 99, "g0"), SlotRange(100, SLOTS - 1, "g1")))
    write_map_file(tmp_path / "map.json", fewer)
    node = ServerProcess(tmp_path / "g0", fsync="never", port=port, args=args).start()
    try:
        with Raw(node.address) as peer:
            assert peer.call(P.OP_HOLDER, names_owned_by(fewer, "g0", 1)[0])[1] == 0
    finally:
        node.stop()


async def test_two_nodes_with_disagreeing_maps_redirect_a_client_once_not_forever(server_factory, tmp_path):
    """Node a's map gives a name to group b, node b's (a later epoch) gives it back to a: a routing
    client follows a bounded number of redirects (REDIRECT_HOPS, and a lagging node is asked again
    for at most REDIRECT_CATCH_UP_S), then raises WrongShard instead of bouncing."""
    ports = {"a": free_port(), "b": free_port()}
    groups = tuple(ShardGroup(g, (f"127.0.0.1:{p}",)) for g, p in ports.items())
    maps = {"a": ShardMap(1, groups, even_ranges(["a", "b"])), "b": ShardMap(2, groups, even_ranges(["b", "a"]))}
    for g in ("a", "b"):
        write_map_file(tmp_path / f"{g}.json", maps[g])
        server_factory(g, fsync="never", port=ports[g],
                       args=["--shard-map", str(tmp_path / f"{g}.json"), "--shard-group", g])
    name = names_owned_by(maps["a"], "b", 1)[0]  # a's map: b's; b's map: a's
    async with fastlock.connect(f"127.0.0.1:{ports['a']}", request_timeout=5.0) as client:
        with pytest.raises(WrongShard) as caught:
            await client.acquire(name, ttl=5)
        # the redirect named a group and an epoch of one of the two maps, and the call ended there
        assert (caught.value.group, caught.value.epoch) in {("a", 2), ("b", 1)}
        with pytest.raises(WrongShard):
            await client.acquire_across([name, names_owned_by(maps["a"], "a", 1)[0]], ttl=5, wait=5)
        for g in ("a", "b"):
            assert (await client.group_client(g).locks()).locks == []


async def test_a_map_naming_an_impostor_gets_no_request_from_a_client_with_a_token(server_factory, tmp_path):
    """A map (a hostile writer's) that gives a group the address of a server with other keys for
    the same principal: the client's handshake proves neither side's key to the other, the
    client refuses the impostor, and no acquire (no owner key) reaches it."""
    real = generate(tmp_path / "real", clients=[("app", "")], replicas=[], admins=["admin"])
    fake = generate(tmp_path / "fake", clients=[("app", "")], replicas=[], admins=["admin"])
    ports = {"g0": free_port(), "g1": free_port()}
    groups = tuple(ShardGroup(g, (f"127.0.0.1:{p}",)) for g, p in ports.items())
    shard_map = ShardMap(1, groups, even_ranges(["g0", "g1"]))
    write_map_file(tmp_path / "map.json", shard_map)
    for g, creds in (("g0", "real"), ("g1", "fake")):
        server_factory(g, fsync="never", port=ports[g],
                       args=["--credentials", str(tmp_path / creds / "credentials.toml"),
                             "--shard-map", str(tmp_path / "map.json"), "--shard-group", g])
    name = names_owned_by(shard_map, "g1", 1)[0]
    async with fastlock.connect(f"127.0.0.1:{ports['g0']}", token_file=real["app"], connect_timeout=1.0,
                                request_timeout=2.0, failover_timeout=2.0) as client:
        with pytest.raises(AuthError):
            await client.acquire(name, ttl=5)
    async with fastlock.connect(f"127.0.0.1:{ports['g1']}", token_file=fake["admin"]) as impostor_admin:
        assert (await impostor_admin.seed.locks()).locks == []
        assert not [s for s in await impostor_admin.seed.sessions() if s.principal == "app"]


def test_a_principal_at_its_reservation_limit_gets_room_back_as_its_reservations_end(server):
    """At MAX_RESERVATIONS_PER_PRINCIPAL a RESERVE looks at a bounded number of the principal's own
    reservations (round robin) to forget the ones that ended, not at every reservation of the
    server: ended ones still give their room back, live ones never."""
    with Raw(server.address, name="many", timeout=60) as peer:
        stamp = now_ms()
        owners, rids = {}, []
        for i in range(MAX_RESERVATIONS_PER_PRINCIPAL):
            owners[i] = os.urandom(16)
            rids.append(peer.send(OP_RESERVE, [f"r/{i}"], owners[i], TTL_MS, 0, None, stamp, b"m%d" % i))
        got: dict = {}
        while len(got) < len(rids):  # granted at once, each answered once its grant is logged
            msg = peer.recv()
            assert msg is not None, "connection closed"
            got[msg[0]] = msg
        assert all(got[rid][1] == 0 for rid in rids)
        code, message = error_of(peer.call(OP_RESERVE, ["r/x"], os.urandom(16), TTL_MS, 0, None, stamp, b"x"))
        assert code == LimitExceeded.code and "1000 uncommitted reservations" in message
        # half of them end (released without a commit): each RESERVE after finds room again
        for i in range(0, MAX_RESERVATIONS_PER_PRINCIPAL, 2):
            token = got[rids[i]][2][0][0]
            assert peer.call(P.OP_RELEASE, f"r/{i}", token, owners[i])[1] == 0
        for k in range(MAX_RESERVATIONS_PER_PRINCIPAL // 2):
            reply = peer.call(OP_RESERVE, [f"s/{k}"], os.urandom(16), TTL_MS, 0, None, stamp, b"n%d" % k)
            assert reply[1] == 0, (k, reply)
        code, _ = error_of(peer.call(OP_RESERVE, ["r/y"], os.urandom(16), TTL_MS, 0, None, stamp, b"y"))
        assert code == LimitExceeded.code


def test_a_parked_reservation_goes_on_when_the_older_one_ahead_stops_waiting_however_it_stops(server):
    """A wake looks only at the reservations parked on names an older one stopped waiting on (its
    cost does not grow with every parked one of the server), and after a connection closes at
    every parked one: a younger reservation parked behind an older waiter goes on whether the
    older one is granted, cancelled or its connection closes, and one parked on other names stays."""
    with Raw(server.address, name="holder") as holder, Raw(server.address, name="look") as look, \
            Raw(server.address, name="young") as young, Raw(server.address, name="other") as other:
        plain = {n: os.urandom(16) for n in ("x", "y", "z")}
        tokens = {n: holder.call(P.OP_ACQUIRE, n, plain[n], TTL_MS, 0, 0, None)[2][0] for n in plain}
        stamp = now_ms()
        # z: an older waiter, and a younger one parked behind it that must stay parked throughout
        older_z = Raw(server.address, name="older-z")
        older_z.send(OP_RESERVE, ["z"], os.urandom(16), TTL_MS, 60_000, None, stamp - 9_000, b"oz")
        assert older_z.call(P.OP_PING)[1] == 0
        rid_other = other.send(OP_RESERVE, ["z"], os.urandom(16), TTL_MS, 60_000, None, stamp, b"pz")
        for how, name in (("close", "x"), ("cancel", "y")):
            older = Raw(server.address, name=f"older-{name}")
            older_owner = os.urandom(16)
            older.send(OP_RESERVE, [name], older_owner, TTL_MS, 60_000, None, stamp - 5_000, b"o" + name.encode())
            assert older.call(P.OP_PING)[1] == 0
            rid = young.send(OP_RESERVE, [name], os.urandom(16), TTL_MS, 60_000, None, stamp, b"y" + name.encode())
            assert rid not in sent_until_ping(young, rid)  # parked: not answered, not in the queue
            assert [w["client"] for w in look.call(P.OP_CONTENDERS, name)[2]["waiters"]] == [f"older-{name}"]
            if how == "close":
                older.close()
            else:
                assert older.call(P.OP_CANCEL, name, older_owner)[1] == 0
                older.close()
            wait_for_waiters(look, name, ["young"])  # the younger one, in the queue now
            assert look.call(P.OP_RELEASE, name, tokens[name], plain[name])[1] == 0
            reply = young.recv()
            assert reply[0] == rid and reply[1] == 0, reply
        assert rid_other not in sent_until_ping(other, rid_other)  # still parked behind the older one on z
        assert [w["client"] for w in look.call(P.OP_CONTENDERS, "z")[2]["waiters"]] == ["older-z"]
        older_z.close()


def wait_for_waiters(peer: Raw, name: str, clients: list[str], timeout: float = 10.0) -> None:
    """Wait (bounded) until the waiters in ``name``'s queue are those of ``clients`` (HELLO names)."""
    deadline = time.monotonic() + timeout
    while True:
        waiting = [w["client"] for w in peer.call(P.OP_CONTENDERS, name)[2]["waiters"]]
        if waiting == clients:
            return
        assert time.monotonic() < deadline, f"{name!r} is waited on by {waiting}, not {clients}"
        time.sleep(0.02)


def test_a_redirect_past_a_shard_maps_limits_names_no_address():
    """A WrongShard's addresses are dialled by a routing client that does not know the group: a
    reply naming more addresses (or longer ones) than a shard map may is read as naming none, so
    the client reads the map from the group it knows instead."""
    ok = error_from_wire(WrongShard.code, "moved", {"slot": 1, "group": "b", "epoch": 2,
                                                    "addresses": [f"127.0.0.1:{p}" for p in range(1, 17)]})
    assert isinstance(ok, WrongShard) and len(ok.addresses) == 16 and ok.group == "b"
    for addresses in ([f"127.0.0.1:{p}" for p in range(1, 18)], ["h" * 300 + ":1"], [1]):
        exc = error_from_wire(WrongShard.code, "moved", {"slot": 1, "group": "b", "epoch": 2, "addresses": addresses})
        assert isinstance(exc, WrongShard) and exc.addresses == () and exc.group == "b"
    crossed = error_from_wire(CrossShard.code, "spans", {"groups": [f"g{k}" for k in range(1025)], "epoch": 2})
    assert isinstance(crossed, CrossShard) and crossed.groups == ()
