"""A sharded deployment: lone shard servers with a static map (fastlock.server.sharded), the
SHARD_MAP op, WrongShard / CrossShard for every op that names names, and the routing client
(fastlock.client.sharded), asyncio and blocking."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from conftest import wait_until

import fastlock
from fastlock import protocol as P
from fastlock._testbase.cluster import RawNode
from fastlock._testbase.servers import ServerProcess
from fastlock._testbase.shards import ShardSet, names_owned_by
from fastlock.client.connection import RETRYABLE
from fastlock.client.sharded import ShardedClient
from fastlock.errors import CrossShard, WrongShard
from fastlock.protocol import ops
from fastlock.protocol.ops import OP_SHARD_MAP
from fastlock.sharding import ShardGroup, ShardMap, SlotRange, slot_of
from fastlock.sharding.scope import NAMES_OF_OP
from fastlock.sync import SyncClient

OWNER = b"o" * 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two lone shard servers, g0 and g1, serving the map at epoch 2."""
    with ShardSet.start(tmp_path_factory.mktemp("shards"), 2, epoch=2) as shard_set:
        yield shard_set


def owned(shards: ShardSet, group: str, count: int = 1, prefix: str = "n") -> list[str]:
    return names_owned_by(shards.shard_map, group, count, prefix)


async def test_hello_names_the_epoch_and_shard_map_returns_the_map(shards):
    node = await RawNode.open(shards.address("g0"))
    try:
        assert node.hello["shard_map_epoch"] == 2 and node.hello["shard_group"] == "g0"
        reply = await node.request(OP_SHARD_MAP)
        assert reply["group"] == "g0"
        assert ShardMap.from_wire(reply["map"]) == shards.shard_map
    finally:
        await node.close()


async def test_a_name_of_another_group_is_redirected_and_changes_nothing(shards):
    foreign = owned(shards, "g1")[0]
    node = await RawNode.open(shards.address("g0"))
    try:
        with pytest.raises(WrongShard) as caught:
            await node.request(P.OP_ACQUIRE, foreign, OWNER, 5000, 0, 0, None)
        exc = caught.value
        assert (exc.slot, exc.group, exc.addresses, exc.epoch) == (
            slot_of(foreign), "g1", (shards.address("g1"),), 2)
        assert (await node.request(P.OP_LOCKS, "", None))["locks"] == []
        mine = owned(shards, "g0")[0]
        token, _, _ = await node.request(P.OP_ACQUIRE, mine, OWNER, 5000, 0, 0, None)
        await node.request(P.OP_RELEASE, mine, token, OWNER)
    finally:
        await node.close()


def _request_naming(op: int, name: str) -> list:
    """Arguments for ``op`` with ``name`` wherever it takes names, None elsewhere (the check runs first)."""
    where = NAMES_OF_OP[op]
    assert where is not None
    fewest = P.OP_ARITY[op][0]
    args: list = [None] * max(fewest, *(i + 1 for i in (*where.names, *where.rows, *where.lists)))
    for i in where.names:
        args[i] = name
    for i in where.rows:
        args[i] = [[name, 1, OWNER]]
    for i in where.lists:
        args[i] = [name]
    return args


async def test_every_op_that_names_a_name_checks_it(shards):
    """Enumerates the ops: a new op that takes a name cannot skip the check (see NAMES_OF_OP)."""
    foreign = owned(shards, "g1")[0]
    node = await RawNode.open(shards.address("g0"))
    try:
        checked = [op for op, where in NAMES_OF_OP.items() if where is not None]
        assert {P.OP_ACQUIRE, P.OP_RELEASE, P.OP_EXTEND, P.OP_ACQUIRE_MANY, ops.OP_KEY_PUT} <= set(checked)
        for op in checked:
            if op == P.OP_SESSION_ATTACH:  # answers another group's leases as lost (below)
                continue
            with pytest.raises(WrongShard, match="owned by shard group g1"):
                await node.request(op, *_request_naming(op, foreign))
        key = bytes(range(16))
        await node.request(P.OP_SESSION_OPEN, key, 30_000)
        reply = await node.request(P.OP_SESSION_ATTACH, key, [[foreign, 1, OWNER]], [[foreign, 1]])
        assert reply["attached"] == 0 and reply["lost"][0][:2] == [foreign, 1]
        assert "owned by shard group g1" in reply["lost"][0][2]
        # the compiled EXTEND's and ACQUIRE's longer forms too
        with pytest.raises(WrongShard):
            await node.request(P.OP_EXTEND, foreign, 1, OWNER, 5000, True)
        with pytest.raises(WrongShard):
            await node.request(P.OP_ACQUIRE, foreign, OWNER, 5000, 0, 0, None, False, 0, 1)
        assert (await node.request(P.OP_LOCKS, "", None))["locks"] == []
    finally:
        await node.close()


async def test_names_that_span_groups_are_refused_as_cross_shard(shards):
    here, there = owned(shards, "g0")[0], owned(shards, "g1")[0]
    node = await RawNode.open(shards.address("g0"))
    try:
        with pytest.raises(CrossShard) as caught:
            await node.request(P.OP_ACQUIRE_MANY, [[here, False], [there, False]], OWNER, 5000, 0, 0, None)
        assert caught.value.groups == ("g0", "g1") and caught.value.epoch == 2
        with pytest.raises(CrossShard):  # a key attached to a lease in another group
            await node.request(ops.OP_KEY_PUT, here, b"v", there, 1, OWNER, ops.KEY_UPSERT)
        with pytest.raises(WrongShard):  # every name in one other group: a redirect to it
            await node.request(P.OP_ACQUIRE_MANY, [[there, False]], OWNER, 5000, 0, 0, None)
        assert (await node.request(P.OP_LOCKS, "", None))["locks"] == []
        # names with one hash tag share a slot, so a multi-lock over them is one group's
        tagged = [f"{{{here}}}:a", f"{{{here}}}:b"]
        tokens, _, _ = await node.request(P.OP_ACQUIRE_MANY, [[n, False] for n in tagged], OWNER, 5000, 0, 0, None)
        for name, token in zip(tagged, tokens):
            await node.request(P.OP_RELEASE, name, token, OWNER)
    finally:
        await node.close()


async def test_the_client_routes_each_name_to_its_group(shards):
    g0_names, g1_names = owned(shards, "g0", 3), owned(shards, "g1", 3)
    async with fastlock.connect(shards.address("g0"), client_name="router") as client:
        assert isinstance(client, ShardedClient)
        leases = [await client.acquire(n, ttl=10) for n in g0_names + g1_names]
        for group, names in (("g0", g0_names), ("g1", g1_names)):
            node = await RawNode.open(shards.address(group))
            try:
                held = {row["name"] for row in (await node.request(P.OP_LOCKS, "", None))["locks"]}
                assert held == set(names)
            finally:
                await node.close()
        assert (await client.holder(g1_names[0]))["token"] == leases[3].fencing_token
        assert await client.check(g1_names[1], leases[4].fencing_token)
        for lease in leases:
            await client.release(lease)
        async with client.lock(g1_names[2], ttl=5) as lease:
            assert await client.client_for(g1_names[2]).check(g1_names[2], lease.fencing_token)
        await client.put(g1_names[0], b"value")
        assert (await client.get(g1_names[0])).value == b"value"
        with pytest.raises(CrossShard, match="span shard groups g0, g1"):
            await client.acquire_many([g0_names[0], g1_names[0]], ttl=5)
        tag = f"{{{g1_names[0]}}}"
        multi = await client.acquire_many([f"{tag}:x", f"{tag}:y"], ttl=5)
        await client.release_many(multi)
        assert set(client.group_clients()) == {"g0", "g1"}


async def test_a_stale_map_is_refreshed_on_the_first_redirect(shards):
    """A client whose map (epoch 1) gives every slot to g0 learns the servers' map (epoch 2)."""
    stale = ShardMap(1, shards.shard_map.groups, (SlotRange(0, 16383, "g0"),))
    seed = fastlock.Client([shards.address("g0")])
    await seed.ensure_connected()
    client = ShardedClient(seed, "g0", stale, lambda addresses: fastlock.Client(addresses))
    try:
        name = owned(shards, "g1")[0]
        lease = await client.acquire(name, ttl=5)
        assert client.shard_map.epoch == 2 and client.client_for(name) is client.group_clients()["g1"]
        await client.release(lease)
    finally:
        await client.close()


async def test_an_unsharded_server_gives_a_plain_client(server):
    node = await RawNode.open(server.address)
    try:
        assert "shard_map_epoch" not in node.hello
        assert await node.request(OP_SHARD_MAP) is None
    finally:
        await node.close()
    async with fastlock.connect(server.address) as client:
        assert type(client) is fastlock.Client


def test_the_blocking_client_routes(shards):
    name = owned(shards, "g1")[0]
    with SyncClient(shards.address("g0")) as client:
        lease = client.acquire(name, ttl=5)
        assert client.check(name, lease.fencing_token)
        client.release(lease)
        assert client.holder(name) is None


def test_serve_refuses_a_bad_shard_configuration(tmp_path):
    shard_map = ShardMap(1, (ShardGroup("a", ("127.0.0.1:1",)),), (SlotRange(0, 16383, "a"),))
    (tmp_path / "map.json").write_text(json.dumps(shard_map.to_wire()))
    server = ServerProcess(tmp_path / "d", args=["--shard-map", str(tmp_path / "map.json"), "--shard-group", "zz"])
    with pytest.raises(RuntimeError, match="no group 'zz'"):
        server.start(timeout=20)
    server.stop()
    (tmp_path / "bad.json").write_text('{"epoch": 1, "groups": [], "ranges": []}')
    server = ServerProcess(tmp_path / "d", args=["--shard-map", str(tmp_path / "bad.json"), "--shard-group", "a"])
    with pytest.raises(RuntimeError, match="1 to 1024 groups"):
        server.start(timeout=20)
    server.stop()


async def test_concurrent_calls_over_groups(shards):
    names = owned(shards, "g0", 20, "c") + owned(shards, "g1", 20, "c")
    async with fastlock.connect(shards.address("g1")) as client:
        leases = await asyncio.gather(*(client.acquire(n, ttl=10) for n in names))
        assert len({lease.name for lease in leases}) == 40
        await asyncio.gather(*(client.release(lease) for lease in leases))


async def test_locks_lists_every_group_page_by_page(shards):
    names = sorted(owned(shards, "g0", 5, "L") + owned(shards, "g1", 5, "L"))
    async with fastlock.connect(shards.address("g0")) as client:
        leases = [await client.acquire(n, ttl=10) for n in names]
        try:
            everything = await client.locks("L")
            assert [lease.name for lease in everything.locks] == names and not everything.truncated
            seen: list[str] = []
            page = await client.locks("L", most=3)
            for _ in range(20):  # bounded: 10 names, at most 3 a page
                assert len(page.locks) <= 3
                seen += [lease.name for lease in page.locks]
                if not page.truncated:
                    break
                page = await client.locks("L", most=3, after=page.next)
            assert seen == names
            by_waiters = await client.locks("L", most=4, order="contended")
            assert len(by_waiters.locks) == 4 and by_waiters.truncated
        finally:
            for lease in leases:
                await client.release(lease)


def test_the_locks_command_lists_every_group(shards, capsys):
    from fastlock.cli import main

    names = owned(shards, "g0", 1, "cli") + owned(shards, "g1", 1, "cli")
    with SyncClient(shards.address("g1")) as client:
        leases = [client.acquire(n, ttl=10) for n in names]
        try:
            assert main(["locks", "cli", "--server", shards.address("g0"), "-o", "json"]) == 0
            listed = {row["name"] for row in json.loads(capsys.readouterr().out)["locks"]}
            assert listed == set(names)
        finally:
            for lease in leases:
                client.release(lease)


async def test_a_group_failover_is_ridden_through_by_its_client(cluster, tmp_path):
    """Group g1 is a primary and a standby: the routing client's g1 connection follows the promotion."""
    from fastlock._testbase.proxy import free_port
    from fastlock.sharding import even_ranges, write_map_file

    ports = {"g0": free_port(), "g1p": free_port(), "g1s": free_port()}
    shard_map = ShardMap(1, (ShardGroup("g0", (f"127.0.0.1:{ports['g0']}",)),
                             ShardGroup("g1", (f"127.0.0.1:{ports['g1p']}", f"127.0.0.1:{ports['g1s']}"))),
                         even_ranges(["g0", "g1"]))
    write_map_file(tmp_path / "map.json", shard_map)

    def shard_args(group: str) -> list[str]:
        return ["--shard-map", str(tmp_path / "map.json"), "--shard-group", group]

    cluster.primary("g0", port=ports["g0"], args=shard_args("g0"), fsync="never")
    g1 = cluster.primary("g1p", port=ports["g1p"], args=shard_args("g1"), fsync="never")
    cluster.standby(g1.address, "g1s", failover_after=1.0, grace=0.0, port=ports["g1s"], args=shard_args("g1"),
                    fsync="never")
    names = names_owned_by(shard_map, "g1", 2)
    async with fastlock.connect(f"127.0.0.1:{ports['g0']}", connect_timeout=2.0, failover_timeout=30) as client:
        first = await client.acquire(names[0], ttl=5)
        g1.kill()
        second = await client.acquire(names[1], ttl=5, wait=30)  # rides through to the promoted standby
        assert second.epoch > first.epoch
        assert (await client.group_clients()["g1"].status())["role"] == "primary"
        await client.release(second)


def test_a_forked_blocking_client_routes_again(shards):
    """A SyncClient made before fork(): the child's own client reads the map and routes too."""
    from test_sync import _run_in_fork

    name = owned(shards, "g1", 1, "fork")[0]
    with SyncClient(shards.address("g0")) as client:
        assert isinstance(client.client, ShardedClient)

        def child() -> dict:
            lease = client.acquire(name, ttl=5, wait=10)
            client.release(lease)
            return {"routed": isinstance(client.client, ShardedClient), "token": lease.fencing_token}

        result = _run_in_fork(child, 60)
        assert result.get("routed") is True and result["token"] > 0, result


def test_top_ranks_the_locks_of_every_group(shards, capsys):
    from fastlock.cli import main

    names = owned(shards, "g0", 1, "top") + owned(shards, "g1", 1, "top")
    with SyncClient(shards.address("g1")) as client:
        leases = [client.acquire(n, ttl=10) for n in names]
        try:
            assert main(["top", "--server", shards.address("g0"), "-o", "json"]) == 0
            shown = json.dumps(json.loads(capsys.readouterr().out))
            assert all(n in shown for n in names)
        finally:
            for lease in leases:
                client.release(lease)


async def test_a_latch_with_a_hash_tag_keeps_its_keys_in_one_group(shards):
    async with fastlock.connect(shards.address("g0")) as client:
        tag = "{" + owned(shards, "g1", 1, "latch")[0] + "}"
        latch = client.latch(tag)  # made by g1's client; its keys NAME/... hash to the tag's slot, g1's
        assert await latch.create(2)
        assert await latch.count_down("a") and await latch.count_down("b")
        assert await latch.remaining() == 0
        await latch.wait(timeout=10)
        await latch.delete()


async def test_bad_multi_lock_arguments_are_refused_as_without_shards(shards):
    from fastlock.errors import InvalidArgument

    async with fastlock.connect(shards.address("g0")) as client:
        with pytest.raises(InvalidArgument):
            await client.acquire_many([], ttl=5)
        with pytest.raises(TypeError):
            await client.acquire_many([5], ttl=5)


async def test_bad_names_and_leases_are_refused_as_without_shards(shards):
    from fastlock.errors import WrongArgumentType

    async with fastlock.connect(shards.address("g0")) as client:
        with pytest.raises(WrongArgumentType):
            await client.acquire(5, ttl=5)
        with pytest.raises(TypeError):
            await client.release("not a lease")
        with pytest.raises(TypeError):
            client.lock(b"bytes", ttl=5)


async def test_operator_calls_reach_every_group(shards):
    from fastlock.errors import LockNotHeld

    names = owned(shards, "g0", 2, "op") + owned(shards, "g1", 2, "op")
    async with fastlock.connect(shards.address("g1"), client_name="holder") as holder, \
            fastlock.connect(shards.address("g0"), client_name="operator") as operator:
        async with holder.lock(names[0], ttl=10), holder.lock(names[2], ttl=10):  # a session in each group
            async def both_sessions() -> list:
                mine = [s for s in await operator.sessions() if s.client == "holder" and s.leases]
                return mine if len(mine) == 2 else []

            listed = await wait_until(both_sessions, 20, "a session with a lease in each group")
            assert listed[0].id == listed[1].id  # one session key, so one id, in every group
            with pytest.raises(LockNotHeld):
                await operator.close_session("0" * 16)
            closed = await operator.close_session(listed[0].id)  # closed in every group that has it
            assert closed.revoked == 2
        leases = [await holder.acquire(n, ttl=10) for n in names]
        revoked = await operator.revoke_principal("anonymous", reason="test")
        assert revoked.revoked == 4
        for lease in leases:
            assert not await operator.check(lease.name, lease.fencing_token)


def test_shard_status_reads_the_map_a_node_serves(shards, server, capsys):
    from fastlock.cli import main

    assert main(["shard", "status", "--server", shards.address("g1"), "-o", "json"]) == 0
    assert ShardMap.from_wire(json.loads(capsys.readouterr().out)) == shards.shard_map
    assert main(["shard", "status", "--server", server.address]) == 1
    assert "is not sharded" in capsys.readouterr().err
    assert main(["shard", "status"]) == 1
    assert "either --coordinator or --server" in capsys.readouterr().err


async def test_a_multi_lock_across_groups_through_the_routing_client(shards):
    """ShardedClient.lock_across takes names of both groups all or none (wound-wait
    reservations, fastlock.client.across) with the map as its router; a RESERVE that names
    another group's name is redirected and holds nothing."""
    g0_names, g1_names = owned(shards, "g0", 2, "x"), owned(shards, "g1", 2, "x")
    names = g0_names + g1_names
    async with fastlock.connect(shards.address("g0"), client_name="across") as client:
        async with client.lock_across(names, ttl=10, wait=10) as multi:
            assert set(multi.names) == set(names)
            for name in names:  # each group holds its own names under the tokens returned
                assert await client.client_for(name).check(name, multi.fencing_tokens[name])
            async with fastlock.connect(shards.address("g1"), client_name="other") as other:
                with pytest.raises(fastlock.LockNotAcquired):
                    await other.acquire_across([g0_names[0], g1_names[1]], ttl=5, wait=0)
        for group in ("g0", "g1"):
            node = await RawNode.open(shards.address(group))
            try:
                assert (await node.request(P.OP_LOCKS, "", None))["locks"] == []
            finally:
                await node.close()
    node = await RawNode.open(shards.address("g0"))
    try:
        with pytest.raises((WrongShard, CrossShard)):
            await node.request(ops.OP_RESERVE, [g0_names[0], g1_names[0]], OWNER, 5000, 0, None,
                               int(time.time() * 1000), b"m" * 16)
        with pytest.raises(WrongShard):
            await node.request(ops.OP_RESERVE, [g1_names[0]], OWNER, 5000, 0, None, int(time.time() * 1000),
                               b"m" * 16)
        assert (await node.request(P.OP_LOCKS, "", None))["locks"] == []
    finally:
        await node.close()


def test_the_blocking_client_locks_names_across_shards(shards):
    """SyncClient against a sharded deployment: lock_across takes every group's names, all or none."""
    names = owned(shards, "g0", 2, "sync-across") + owned(shards, "g1", 2, "sync-across")
    with SyncClient(shards.address("g0")) as client:
        with client.lock_across(names, ttl=10, wait=10) as held:
            assert set(held.fencing_tokens) == set(names) and not held.lost.is_set()
            for name in names:
                assert client.holder(name)["token"] == held.fencing_tokens[name]
        for name in names:
            assert client.holder(name) is None


def test_the_blocking_clients_lock_across_on_one_unsharded_server(server):
    with SyncClient(server.address) as client:
        with client.lock_across(["x/1", "x/2"], ttl=10, wait=10) as held:
            assert client.holder("x/1")["token"] == held.fencing_tokens["x/1"]
        assert client.holder("x/1") is None and client.holder("x/2") is None


async def test_a_map_read_from_an_unreachable_redirect_closes_the_client_it_opened(shards):
    """A redirect naming a group this client has no connection to opens one for the map read;
    when that read fails the client is closed all the same (nothing left reconnecting)."""
    from fastlock._testbase import free_port

    async with fastlock.connect(shards.address("g0"), client_name="stale", connect_timeout=1.0,
                                failover_timeout=1.0) as client:
        made = []
        make = client._make_client

        def recording(addresses):
            made.append(make(addresses))
            return made[-1]

        client._make_client = recording
        redirect = WrongShard("moved", 1, "elsewhere", (f"127.0.0.1:{free_port()}",), 3)
        with pytest.raises(fastlock.FastlockError):
            await client.refresh(redirect)
        assert len(made) == 1 and made[0].closed
        assert client.shard_map.epoch == 2


async def test_calls_over_every_group_answer_for_the_live_groups_and_name_an_unreachable_one(tmp_path, capsys,
                                                                                           monkeypatch):
    """With one group's server killed (SIGKILL), ``locks``, ``sessions``, ``revoke_principal`` and
    ``top`` answer for the other group and name the dead group as unreachable (the API's
    ``unreachable``; a line on stderr from the CLI, which exits EXIT_PARTIAL) instead of failing
    whole; ``close_session`` of a session no live group has raises the dead group's error."""
    from fastlock.cli import main
    from fastlock.cli.locks import EXIT_PARTIAL

    with ShardSet.start(tmp_path / "shards", 2) as shard_set:
        names = owned(shard_set, "g0", 2, "live")
        async with fastlock.connect(shard_set.address("g0"), client_name="lister", connect_timeout=1.0,
                                    failover_timeout=1.0, request_timeout=2.0) as client:
            leases = [await client.acquire(n, ttl=600) for n in names]
            assert client.group_client("g1") is not None
            shard_set.servers["g1"].kill()
            listing = await client.locks("")
            assert sorted(lease.name for lease in listing.locks) == sorted(names)
            assert set(listing.unreachable) == {"g1"}
            loop = asyncio.get_running_loop()
            status = await loop.run_in_executor(None, main, ["locks", "--server", shard_set.address("g0")])
            assert status == EXIT_PARTIAL == 3
            captured = capsys.readouterr()
            assert all(n in captured.out for n in names)
            assert "shard group g1 could not be reached" in captured.err

            keys = await client.list_prefix("")
            assert set(keys.unreachable) == {"g1"}
            sessions = await client.sessions()
            assert set(sessions.unreachable) == {"g1"} and all(s.client != "lister" for s in sessions)
            with pytest.raises(RETRYABLE):  # not in g0, and g1 may have it
                await client.close_session("0" * 16)
            server = ["--server", shard_set.address("g0"), "--connect-timeout", "1"]
            monkeypatch.setenv("COLUMNS", "200")  # top's table is as wide as the console: names in full
            printed = {}
            for argv, shown in ((["sessions", *server], "PRINCIPAL"), (["top", "--once", *server], "live"),
                                (["top", "-o", "json", *server], '"unreachable": {"g1"')):
                status = await loop.run_in_executor(None, main, argv)
                captured = capsys.readouterr()
                assert status == EXIT_PARTIAL and shown in captured.out, (argv, captured)
                assert "shard group g1 could not be reached" in captured.err, argv
                printed[argv[1]] = captured.out
            snapshot = json.loads(printed["-o"])
            assert set(snapshot["groups"]) == {"g0"} and snapshot["locks_held"] == len(names)

            revoked = await client.revoke_principal("anonymous", reason="test")
            assert revoked.revoked == len(names) and set(revoked.unreachable) == {"g1"}
            for lease in leases:
                assert not await client.check(lease.name, lease.fencing_token)
            status = await loop.run_in_executor(None, main, ["revoke", "--principal", "anonymous", *server])
            assert status == EXIT_PARTIAL and "revoked 0 leases" in capsys.readouterr().out



def test_status_all_lists_the_nodes_of_every_group(shards, capsys):
    from fastlock.cli import main

    assert main(["status", "--all", "--server", shards.address("g1"), "-o", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["epoch"] == shards.shard_map.epoch and set(shown["groups"]) == {"g0", "g1"}
    for group, rows in shown["groups"].items():
        assert [(row["address"], row["role"]) for row in rows] == [(shards.address(group), "primary")]
    assert main(["status", "--all", "--server", shards.address("g0")]) == 0
    table = capsys.readouterr().out
    assert "shard group g0" in table and "shard group g1" in table and shards.address("g1") in table


async def test_prefix_lists_and_watches_span_every_group(shards):
    keys = owned(shards, "g0", 3, "kp/") + owned(shards, "g1", 3, "kp/")
    async with fastlock.connect(shards.address("g0")) as client:
        watch = client.watch_prefix("kp/", progress=True)
        seen: list[str] = []
        started = asyncio.Event()
        starts = 0

        async def follow() -> None:
            nonlocal starts
            async for event in watch:
                if event.what == "progress":  # each group's watch begins with one
                    starts += 1
                    if starts == 2:
                        started.set()
                    continue
                seen.append(event.key)
                if len(seen) == len(keys):
                    return

        follower = asyncio.ensure_future(follow())
        await asyncio.wait_for(started.wait(), 20)
        try:
            for key in keys:
                await client.put(key, key.encode())
            listed = await client.list_prefix("kp/")
            assert [kv.key for kv in listed] == sorted(keys) and not listed.more and not listed.unreachable
            paged: list[str] = []
            after = None
            while True:  # pages of 2 over both groups: every key once, in order
                page = await client.list_prefix("kp/", limit=2, after=after)
                paged += [kv.key for kv in page]
                if not page.more:
                    break
                after = page.cursor
            assert paged == sorted(keys)
            tagged = [f"{{{keys[0]}}}:k{i}" for i in range(3)]
            for key in tagged:
                await client.put(key, b"t")
            assert [kv.key for kv in await client.list_prefix(f"{{{keys[0]}}}:")] == sorted(tagged)
            await asyncio.wait_for(follower, 20)
        finally:
            follower.cancel()
        assert sorted(seen) == sorted(keys)


def test_principals_lists_every_group(shards, capsys):
    from fastlock.cli import main

    assert main(["principals", "--server", shards.address("g0"), "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(row["group"], row["principal"]) for row in rows} >= {("g0", "anonymous"), ("g1", "anonymous")}
    assert main(["principals", "--server", shards.address("g1")]) == 0
    assert capsys.readouterr().out.startswith("GROUP")


async def test_a_merged_watch_raises_a_group_s_error_and_closes_every_group_s_watch():
    from fastlock.client.sharded import merge_streams
    from fastlock.errors import ConnectionLost

    closed: list[str] = []

    async def failing():
        try:
            yield "a1"
            raise ConnectionLost("group a is gone")
        finally:
            closed.append("a")

    async def quiet():
        try:
            yield "b1"
            await asyncio.Event().wait()  # no further change
            yield "never"
        finally:
            closed.append("b")

    seen = []
    with pytest.raises(ConnectionLost, match="group a is gone"):
        async for item in merge_streams([failing(), quiet()]):
            seen.append(item)
    assert seen[0] == "a1" and set(seen) <= {"a1", "b1"}  # b1 may come after a's error
    assert sorted(closed) == ["a", "b"]
