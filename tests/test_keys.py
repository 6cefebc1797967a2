"""The key store (fastlock.server.keys): keys attached to leases, prefix listing and watches,
limits, ACLs, recovery from the WAL and snapshots, replication to a standby."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from conftest import wait_until

import fastlock
from fastlock import protocol as P
from fastlock.client import KeyEvent
from fastlock.errors import InvalidArgument, KeyExists, KeyNotFound, LeaseLost, LimitExceeded, PermissionDenied
from fastlock.wal.keyspace import KeySpace
from fastlock.wal.records import KeyDelete, KeyPut, LogState, Release, apply, decode, encode


async def test_put_get_list_delete(client):
    assert await client.put("cfg/a", b"1") is True
    assert await client.put("cfg/a", b"2") is False
    await client.put("cfg/b", b"3")
    await client.put("other", b"4")
    got = await client.get("cfg/a")
    assert got.value == b"2" and got.lease is None and got.token == 0
    assert [kv.key for kv in await client.list_prefix("cfg/")] == ["cfg/a", "cfg/b"]
    assert [kv.key for kv in await client.list_prefix("", limit=2)] == ["cfg/a", "cfg/b"]
    with pytest.raises(KeyExists):
        await client.put("cfg/a", b"x", create=True)
    with pytest.raises(KeyNotFound):
        await client.put("cfg/zzz", b"x", replace=True)
    assert await client.delete("cfg/a") is True
    assert await client.delete("cfg/a") is False
    assert await client.get("cfg/a") is None


async def test_a_listing_says_whether_it_was_cut_at_its_limit(client, server):
    """list_prefix returns a list with ``more``: True when keys beyond ``limit`` matched (the
    server's flag), so a caller never takes part of the keys for all of them."""
    from fastlock.sync import SyncClient

    for name in ("cut/a", "cut/b", "cut/c"):
        await client.put(name, b"")
    cut = await client.list_prefix("cut/", limit=2)
    assert [kv.key for kv in cut] == ["cut/a", "cut/b"] and cut.more is True
    whole = await client.list_prefix("cut/", limit=3)
    assert len(whole) == 3 and whole.more is False
    with SyncClient(server.address) as c:
        assert c.list_prefix("cut/", limit=1).more is True and c.list_prefix("cut/").more is False


async def test_key_lives_with_its_lease(client):
    events = client.watch_prefix("members/")
    first = asyncio.ensure_future(events.__anext__())
    # the watch counts on its connection once the server answered it: later changes are pushed
    await wait_until(lambda: client._connector.proto.subscriptions == 1, timeout=5.0,
                     what="the server to answer the prefix watch")
    lease = await client.acquire("sess/1", ttl=0.5)
    await client.put("members/1", b"caps", lease=lease)
    assert (await client.get("members/1")).lease == "sess/1"
    assert (await asyncio.wait_for(first, 5)).what == "put"
    expired = await asyncio.wait_for(events.__anext__(), 5)
    assert expired[:4] == KeyEvent("members/", "expired", "members/1", None)[:4]
    assert expired.revision is not None and expired.offset == 0  # the position of its change
    assert await client.get("members/1") is None
    await events.aclose()


async def test_release_deletes_keys_and_watchers_hear_it(client, connect):
    other = await connect("watcher")
    events = other.watch_prefix("grp/")
    put_seen = asyncio.ensure_future(events.__anext__())
    # the watch counts on its connection once the server answered it (the put below is then pushed)
    await wait_until(lambda: other._connector.proto is not None and other._connector.proto.subscriptions == 1,
                     timeout=5.0, what="the server to answer the prefix watch")
    async with client.lock("sess/2", ttl=5.0) as lease:
        await client.put("grp/m", b"v", lease=lease, create=True)
        assert (await asyncio.wait_for(put_seen, 5)).what == "put"
    ev = await asyncio.wait_for(events.__anext__(), 5)
    assert (ev.what, ev.key) == ("released", "grp/m")
    assert await client.get("grp/m") is None
    await events.aclose()


async def test_put_on_a_lost_lease_is_refused(client):
    lease = await client.acquire("sess/3", ttl=5.0)
    await client.release(lease)
    with pytest.raises(LeaseLost):
        await client.put("k", b"v", lease=lease)
    assert await client.get("k") is None


async def test_bad_arguments_and_limits(server_factory, loop_errors):
    srv = server_factory(args=["--max-keys", "3", "--max-value-bytes", "8"])
    async with fastlock.connect(srv.address) as c:
        with pytest.raises(InvalidArgument):
            await c.put("k", b"123456789")
        with pytest.raises(TypeError):
            await c.put("k", "text")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            await c.put("", b"")
        for i in range(3):
            await c.put(f"k{i}", b"v")
        with pytest.raises(LimitExceeded, match="max-keys"):
            await c.put("k3", b"v")
        await c.put("k0", b"w")  # replacing is not a new key
        # malformed requests straight on the wire: an error each, nothing changes
        from fastlock.protocol.ops import OP_KEY_LIST, OP_KEY_PUT
        for args in ([1, b"v", None, 0, None, 0], ["k", b"v", None, 0, None, 9], ["k", b"v", "lk", "t", b"o", 0]):
            with pytest.raises(fastlock.FastlockError):
                await c._request(OP_KEY_PUT, *args)
        with pytest.raises(fastlock.FastlockError):
            await c._request(OP_KEY_LIST, "", 0)
        assert [kv.value for kv in await c.list_prefix("")] == [b"w", b"v", b"v"]


async def test_acl_on_keys(server_factory, tmp_path, loop_errors):
    from fastlock._testbase.handshake import key_lines
    from fastlock.auth import make_token

    token = make_token("app")
    creds = tmp_path / "creds.toml"
    creds.write_text('version = 2\n[principals.app]\nkind = "client"\n' + "\n".join(key_lines(token)) + "\n"
                     'acl = [{prefix = "app/", ops = ["put", "get", "delete", "acquire", "release"]}]\n')
    srv = server_factory(args=["--credentials", str(creds)])
    async with fastlock.connect(srv.address, auth=token) as c:
        await c.put("app/x", b"1")
        with pytest.raises(PermissionDenied):
            await c.put("other/x", b"1")
        with pytest.raises(PermissionDenied):
            await c.list_prefix("")
        assert len(await c.list_prefix("app/")) == 1


async def test_keys_survive_restart_and_snapshot(server_factory, tmp_path, loop_errors):
    srv = server_factory(args=["--snapshot-every", "5"])
    async with fastlock.connect(srv.address) as c:
        lease = await c.acquire("sess/r", ttl=30.0)
        for i in range(8):
            await c.put(f"r/{i}", bytes([i]), lease=lease if i % 2 else None)
        await c.delete("r/0")
    srv.stop()
    srv.start()
    async with fastlock.connect(srv.address) as c:
        keys = await c.list_prefix("r/")
        assert [kv.key for kv in keys] == [f"r/{i}" for i in range(1, 8)]
        assert {kv.key for kv in keys if kv.lease == "sess/r"} == {"r/1", "r/3", "r/5", "r/7"}


def test_apply_rules_for_keys():
    state = LogState()
    grant = decode([1, "s", 5, b"o" * 16, 1000, 0, None, None, 0])
    apply(grant, state)
    assert apply(KeyPut("a", b"1", "s", 5, "p", 0), state)
    assert not apply(KeyPut("b", b"1", "s", 4, "p", 0), state)  # not the holder's token
    assert apply(KeyPut("c", b"1", None, 0, "p", 0), state)
    assert decode(encode(KeyDelete("c", 7))) == KeyDelete("c", 7)
    assert apply(Release("s", 5, 0), state)
    assert state.keys.get("a") is None and state.keys.get("c") is not None
    assert apply(KeyDelete("c", 0), state) and not apply(KeyDelete("c", 0), state)
    assert len(state.keys) == 0 and state.keys.per_principal == {}


def test_keyspace_snapshot_round_trip():
    space = KeySpace()
    space.put("b", b"2", "lease", 9, "p", 10)
    space.put("a", b"1", None, 0, None, 11)
    back = KeySpace.from_list(space.to_list())
    assert back.entries == space.entries and list(back.with_prefix("")) == list(space.with_prefix(""))
    assert back.by_lease == {("lease", 9): {"b"}}
    with pytest.raises(ValueError):
        KeySpace.from_list([["a", "not bytes", None, 0, None, 0, 0]])


def test_standby_keeps_keys_and_a_promoted_standby_serves_them(cluster):
    """Keys reach a late standby in its snapshot and a following one in the stream; after
    promotion they are there, and a key whose lease then ends goes with it."""
    import json

    from test_replication import caught_up, cli

    from fastlock._testbase.cluster import poll, run, status_of

    p = cluster.primary()

    async def main():
        async with fastlock.connect(p.address) as c:
            # the client renews its lease (its session's keep-alives, replicated as EXTEND records)
            # until it closes, however long the standby's start and the promotion take
            short = await c.lock("sess/short", ttl=6.0)  # a renewed lease
            await c.put("svc/early", b"e")  # before the standby: in its snapshot
            s = await asyncio.to_thread(cluster.standby, p.address, grace=0.1)
            await asyncio.to_thread(s.wait_for_log, r"applied snapshot", 5)
            await c.put("svc/late", b"l", lease=short)  # streamed
            await c.put("svc/gone", b"g")
            await c.delete("svc/gone")
            await caught_up(s.address, p.address)
            res = await asyncio.to_thread(cli, "promote", "--server", s.address)
            assert res.returncode == 0, res.stderr
            assert json.loads(res.stdout)["epoch"] == 1
            await poll(lambda: status_of(s.address), lambda st: st["role"] == "primary", timeout=5,
                       what="promotion")
            async with fastlock.connect(s.address) as c2:
                assert [kv.key for kv in await c2.list_prefix("svc/")] == ["svc/early", "svc/late"]
                assert (await c2.get("svc/late")).lease == "sess/short"
        # the client is gone: its lease ends (released or expired) and takes its key along
        async with fastlock.connect(s.address) as c2:
            await poll(lambda: c2.get("svc/late"), lambda kv: kv is None, timeout=20,
                       what="the key of the ended lease to go")
            assert (await c2.get("svc/early")).value == b"e"

    run(main())


def test_sync_client_keys(server):
    from fastlock.sync import SyncClient

    with SyncClient(server.address) as c:
        with c.lock("sess/sync", ttl=5.0) as lease:
            assert c.put("sync/a", b"1", lease=lease) is True
            assert c.get("sync/a").lease == "sess/sync"
            assert [kv.key for kv in c.list_prefix("sync/")] == ["sync/a"]
        assert c.get("sync/a") is None  # released with its lease
        c.put("sync/b", b"2")
        assert c.delete("sync/b") and not c.delete("sync/b")


def test_snapshot_files_with_and_without_keys(tmp_path):
    """A snapshot written before the key store (no keys part) still loads, with no keys."""
    from fastlock.wal.records import HolderRecord
    from fastlock.wal.snapshot import encode_snapshot, load_snapshot

    holder = HolderRecord("s", 7, b"o" * 16, 1000, 0, None, None, 0)
    old = tmp_path / "old.snap"
    old.write_bytes(encode_snapshot(5, 0, 7, [holder]))
    snap = load_snapshot(str(old))
    assert snap.holders == [holder] and len(snap.keys) == 0
    space = KeySpace()
    space.put("k", b"v", "s", 7, "p", 1)
    new = tmp_path / "new.snap"
    new.write_bytes(encode_snapshot(5, 0, 7, [holder], space.to_list()))
    assert load_snapshot(str(new)).keys.entries == space.entries


async def test_a_value_at_the_max_value_bytes_limit_is_stored_and_one_over_it_is_refused(server, loop_errors):
    """The request decoder follows ``--max-value-bytes`` (default 64 KiB): a value at the limit
    is put and got back whole; one byte over it gets InvalidArgument, changes nothing, and the
    same connection goes on serving."""
    limit = 64 << 10
    async with fastlock.connect(server.address) as c:
        at_limit = bytes(range(256)) * (limit // 256)
        assert len(at_limit) == limit
        assert await c.put("big/v", at_limit) is True
        assert (await c.get("big/v")).value == at_limit
        with pytest.raises(InvalidArgument, match="max-value-bytes"):
            await c.put("big/v", b"x" * (limit + 1))
        with pytest.raises(InvalidArgument, match="max-value-bytes"):
            await c.put("big/other", b"y" * (limit + 1))
        assert (await c.get("big/v")).value == at_limit
        assert await c.get("big/other") is None
        assert await c.put("big/small", b"s") is True  # the connection is still usable
        assert [kv.key for kv in await c.list_prefix("big/")] == ["big/small", "big/v"]


async def test_max_value_bytes_above_the_frame_limit_raises_the_request_frame_bound(server_factory, loop_errors):
    """``--max-value-bytes`` larger than ``--max-frame-bytes``: a value at the limit still fits one
    request; a request larger than the raised bound closes only that connection."""
    from fastlock.protocol import REQUEST_OVERHEAD_BYTES
    from fastlock.protocol.ops import OP_KEY_PUT

    limit = 200_000
    srv = server_factory(args=["--max-value-bytes", str(limit), "--max-frame-bytes", "8192"])
    async with fastlock.connect(srv.address) as c:
        value = b"v" * limit
        await c.put("wide", value)
        assert (await c.get("wide")).value == value
        with pytest.raises(InvalidArgument, match="max-value-bytes"):
            await c.put("wide", value + b"!")
    # past the raised bound: a ProtocolError reply (request id 0) and that connection closed
    host, port = srv.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    hello = msgpack.packb([1, P.OP_HELLO, P.PROTOCOL_VERSION, "raw", None], use_bin_type=True)
    big = msgpack.packb([2, OP_KEY_PUT, "wide", b"w" * (limit + REQUEST_OVERHEAD_BYTES), None, 0, None, 0],
                        use_bin_type=True)
    writer.write(hello + big)
    unpacker = msgpack.Unpacker(raw=False)
    replies = []
    while data := await asyncio.wait_for(reader.read(1 << 16), 10):
        unpacker.feed(data)
        replies.extend(unpacker)
    writer.close()
    assert replies[0][:2] == [1, P.STATUS_OK]
    assert replies[-1][0] == 0 and "frame" in replies[-1][2], replies
    async with fastlock.connect(srv.address) as c:
        assert (await c.get("wide")).value == value
