"""The shard map kept in etcd (fastlock.coordination.shardmap): `fastlock shard init|status|addresses`,
nodes started from it that follow a new epoch, and the transactions that refuse a lost race."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator

import pytest
from conftest import wait_until
from etcdserver import unique_prefix

import fastlock
from fastlock._testbase.cluster import RawNode
from fastlock._testbase.proxy import free_port
from fastlock._testbase.servers import ServerProcess
from fastlock._testbase.shards import names_owned_by
from fastlock.cli import main
from fastlock.client.sharded import ShardedClient
from fastlock.coordination.shardmap import MapConflict, load_from_etcd
from fastlock.sharding import ShardMap, ShardMapError


async def shard(argv: list[str]) -> int:
    """``fastlock shard ...`` in this process (on a thread: it runs its own event loop)."""
    return await asyncio.to_thread(main, argv)


@contextlib.contextmanager
def nodes_of(url: str, ports: list[int], directory) -> Iterator[list[ServerProcess]]:
    """One node per group ``g{k}`` on ``ports[k]``, serving the map at ``url``; stopped by PID after."""
    servers = [ServerProcess(directory / f"g{k}", fsync="never", port=port,
                             args=["--shard-map", url, "--shard-group", f"g{k}"]) for k, port in enumerate(ports)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            if server.proc is not None:
                server.stop()


async def test_init_status_addresses_and_nodes_that_follow(etcd, tmp_path, capsys):
    url = f"etcd://{etcd.address}{unique_prefix()}"
    ports = [free_port(), free_port()]
    groups = [f"--group=g{k}=127.0.0.1:{ports[k]}" for k in range(2)]
    assert await shard(["shard", "status", "--coordinator", url]) == 1
    assert "no shard map in etcd" in capsys.readouterr().err
    assert await shard(["shard", "init", "--coordinator", url, *groups]) == 0
    assert await shard(["shard", "init", "--coordinator", url, *groups]) == 1  # created once only
    assert "already holds a shard map" in capsys.readouterr().err
    assert await shard(["shard", "status", "--coordinator", url, "-o", "json"]) == 0
    shard_map = ShardMap.from_wire(json.loads(capsys.readouterr().out))
    assert shard_map.epoch == 1 and shard_map.slot_count("g0") == shard_map.slot_count("g1") == 8192

    with nodes_of(url, ports, tmp_path) as servers:
        async with fastlock.connect(servers[0].address) as client:
            assert isinstance(client, ShardedClient) and client.shard_map == shard_map
            name = names_owned_by(shard_map, "g1", 1)[0]
            await client.release(await client.acquire(name, ttl=5))

        # a new epoch (g1 gets a second address): every node follows it
        assert await shard(["shard", "addresses", "--coordinator", url, f"g1=127.0.0.1:{ports[1]},127.0.0.1:1"]) == 0
        capsys.readouterr()

        async def serves_epoch_2(address: str) -> bool:
            node = await RawNode.open(address)
            try:
                return node.hello["shard_map_epoch"] == 2
            finally:
                await node.close()

        for server in servers:
            await wait_until(lambda server=server: serves_epoch_2(server.address), 20, "the node to follow epoch 2")


async def test_a_change_from_a_stale_read_is_refused(etcd):
    stored = await load_from_etcd(f"etcd://{etcd.address}{unique_prefix()}")
    try:
        from fastlock.sharding import ShardGroup, SlotRange

        first = ShardMap(1, (ShardGroup("a", ("127.0.0.1:1",)),), (SlotRange(0, 16383, "a"),))
        await stored.create(first)
        with pytest.raises(MapConflict):
            await stored.create(first)
        found = await stored.read()
        assert found is not None and found[0] == first
        revision = found[1]
        await stored.replace(revision, first, first.with_addresses("b", ("127.0.0.1:2",)))
        with pytest.raises(MapConflict):  # the same read again: another change came first
            await stored.replace(revision, first, first.with_addresses("c", ("127.0.0.1:3",)))
        with pytest.raises(ShardMapError, match="must be above"):
            await stored.replace(revision, first, first)
        now = await stored.read()
        assert now is not None and [g.name for g in now[0].groups] == ["a", "b"] and now[0].epoch == 2
    finally:
        await stored.gateway.close()


async def test_the_map_in_a_secured_etcd_as_a_confined_user(secure_etcd, tmp_path, capsys):
    """TLS and an etcd user confined to the prefix: `fastlock shard` and `serve` take the same flags."""
    prefix = unique_prefix()
    user = secure_etcd.confine(prefix)
    flags = secure_etcd.serve_flags(user)
    url = f"etcd://{secure_etcd.address}{prefix}"
    port = free_port()
    assert await shard(["shard", "init", "--coordinator", url, f"--group=a=127.0.0.1:{port}", *flags]) == 0
    assert await shard(["shard", "status", "--coordinator", url]) == 1  # plain HTTP to a TLS etcd: refused
    capsys.readouterr()
    server = ServerProcess(tmp_path / "a", fsync="never", port=port,
                           args=["--shard-map", url, "--shard-group", "a", *flags])
    try:
        server.start()
        node = await RawNode.open(server.address)
        try:
            assert node.hello["shard_map_epoch"] == 1
        finally:
            await node.close()
    finally:
        server.stop()


def test_serve_without_a_map_in_etcd_does_not_start(etcd, tmp_path):
    server = ServerProcess(tmp_path / "a", fsync="never",
                           args=["--shard-map", f"etcd://{etcd.address}{unique_prefix()}", "--shard-group", "a"])
    with pytest.raises(RuntimeError, match="no map at .*shard-map"):
        server.start(timeout=20)
    assert server.stop() == 1


async def test_a_client_reads_a_new_map_a_node_pushes_before_any_redirect(etcd, tmp_path, capsys):
    url = f"etcd://{etcd.address}{unique_prefix()}"
    ports = [free_port(), free_port()]
    assert await shard(["shard", "init", "--coordinator", url,
                        *(f"--group=g{k}=127.0.0.1:{ports[k]}" for k in range(2))]) == 0
    with nodes_of(url, ports, tmp_path) as servers:
        async with fastlock.connect(servers[0].address) as client:
            assert isinstance(client, ShardedClient) and client.shard_map.epoch == 1
            g1 = client.group_client("g1")
            await g1.ensure_connected()  # open connections to both groups, then no call at all
            spare = free_port()
            assert await shard(["shard", "addresses", "--coordinator", url,
                                f"g1=127.0.0.1:{ports[1]},127.0.0.1:{spare}"]) == 0
            capsys.readouterr()
            await wait_until(lambda: client.shard_map.epoch == 2, 20, "the client to read epoch 2 pushed by a node")
            assert client.shard_map.group("g1").addresses == (f"127.0.0.1:{ports[1]}", f"127.0.0.1:{spare}")
            assert ("127.0.0.1", spare) in g1.connector.addresses  # its next connection attempt sweeps it
            name = names_owned_by(client.shard_map, "g1", 1)[0]
            await client.release(await client.acquire(name, ttl=5))
