"""Moving slots between shard groups (`fastlock shard move|split`, fastlock.server.slotmove): real
servers following a map in etcd; held leases survive a move, tokens keep rising, moved waiters keep
their order, the destination keeps what it adopted across a restart, and a hostile SLOT_IMPORT
changes nothing."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
from conftest import wait_until
from etcdserver import unique_prefix

import fastlock
from fastlock._testbase.cluster import RawNode
from fastlock._testbase.proxy import free_port
from fastlock._testbase.servers import CredentialsDir, ServerProcess
from fastlock._testbase.shards import names_owned_by
from fastlock.cli import main
from fastlock.coordination.shardmap import load_from_etcd
from fastlock.errors import FastlockError, InvalidArgument, PermissionDenied, SlotMoving, WrongShard
from fastlock.protocol.ops import (
    OP_ACQUIRE,
    OP_SESSION_ATTACH,
    OP_SESSION_KEEPALIVE,
    OP_SESSION_OPEN,
    OP_SHARD_MAP,
    OP_SLOT_EXPORT,
    OP_SLOT_IMPORT,
)
from fastlock.server.sharded import MAX_HELD
from fastlock.sharding import ShardGroup, ShardMap, even_ranges, slot_of
from fastlock.sharding.moves import mark_moving


async def shard(argv: list[str]) -> int:
    """``fastlock shard ...`` in this process (on a thread: it runs its own event loop)."""
    return await asyncio.to_thread(main, argv)


class Groups:
    """Two shard groups g0, g1 (one server each) following a map in etcd, with credentials."""

    def __init__(self, etcd, tmp_path, monkeypatch):
        self.url = f"etcd://{etcd.address}{unique_prefix()}"
        self.creds = CredentialsDir(tmp_path / "credentials")
        monkeypatch.setenv("FASTLOCK_TOKEN_FILE", self.creds.token_file("admin"))  # the mover is an admin
        self.app = self.creds.token("app")
        self.tmp_path = tmp_path
        ports = [free_port(), free_port()]
        self.shard_map = ShardMap(1, tuple(ShardGroup(f"g{k}", (f"127.0.0.1:{ports[k]}",)) for k in range(2)),
                                  even_ranges(["g0", "g1"]))
        #: group -> more `fastlock serve` flags for its server (from its next (re)start)
        self.args: dict[str, list[str]] = {}
        self.servers = {f"g{k}": self._server(f"g{k}", ports[k]) for k in range(2)}

    def _server(self, group: str, port: int) -> ServerProcess:
        return ServerProcess(self.tmp_path / group, fsync="always", port=port,
                             args=["--shard-map", self.url, "--shard-group", group,
                                   *self.creds.server_args("node-1" if group == "g0" else "node-2"),
                                   *self.args.get(group, [])])

    async def start(self) -> None:
        stored = await load_from_etcd(self.url)
        try:
            await stored.create(self.shard_map)
        finally:
            await stored.gateway.close()
        for server in self.servers.values():
            server.start()

    def restart(self, group: str) -> None:
        old = self.servers[group]
        old.stop()
        self.servers[group] = self._server(group, old.port)
        self.servers[group].start()

    def stop(self) -> None:
        for server in self.servers.values():
            if server.proc is not None:
                server.stop()

    def connect(self) -> fastlock.connect:
        return fastlock.connect(self.servers["g0"].address, token=self.app, session=False)

    async def move(self, slots: str, to: str) -> dict:
        argv = ["shard", "move", "--coordinator", self.url, "--slots", slots, "--to", to, "-o", "json"]
        assert await shard(argv) == 0
        return argv


async def test_a_held_lease_survives_a_move_and_tokens_keep_rising(groups, capsys):
    name = names_owned_by(groups.shard_map, "g0", 1, "held")[0]
    idle = names_owned_by(groups.shard_map, "g0", 1, "idle")[0]
    async with groups.connect() as client:
        lease = await client.acquire(name, ttl=30)
        capsys.readouterr()
        await groups.move(str(slot_of(name)), "g1")
        report = json.loads(capsys.readouterr().out)
        assert report["steps"] == ["mark", "ship", "flip"] and report["leases"] == 1 and report["freeze_ms"] > 0
        # the old group redirects; the lease is held on g1 with its token and owner
        g1 = await RawNode.open(groups.servers["g1"].address, token=groups.app)
        try:
            assert (await g1.holder(name))["token"] == lease.fencing_token
        finally:
            await g1.close()
        lease = await client.extend(lease, ttl=20)  # a WrongShard from g0 re-routes it to g1
        await client.release(lease)
        again = await client.acquire(name, ttl=5)
        assert again.fencing_token > lease.fencing_token
        await client.release(again)
        # a slot with nothing in it moves too, and is served by g1 after
        await groups.move(str(slot_of(idle)), "g1")
        other = await client.acquire(idle, ttl=5)
        assert other.fencing_token > lease.fencing_token
        await client.release(other)
        # running the same move again finds it done and changes nothing
        capsys.readouterr()
        await groups.move(str(slot_of(idle)), "g1")
        assert json.loads(capsys.readouterr().out)["steps"] == []


@pytest.mark.parametrize("session", [True, False])
async def test_a_renewed_lock_keeps_renewing_on_its_new_group(groups, session):
    """``client.lock()`` renewed by the session (or by its own EXTENDs): after the move its
    renewals go to g1 and the lease outlives several TTLs there; the context's release is
    routed to g1."""
    name = names_owned_by(groups.shard_map, "g0", 1, f"renewed{session}")[0]
    async with fastlock.connect(groups.servers["g0"].address, token=groups.app, session=session) as client:
        async with client.lock(name, ttl=2) as lease:
            await groups.move(str(slot_of(name)), "g1")
            g1 = client.group_client("g1")
            started = asyncio.get_running_loop().time()
            # the lease outlives 3 TTLs after the move only if g1 renews it
            while asyncio.get_running_loop().time() - started < 6:
                assert not lease.lost.is_set()
                await asyncio.sleep(0.5)
            holder = await g1.holder(name)
            assert holder is not None and holder["token"] == lease.fencing_token
        assert not lease.lost.is_set()
        assert await g1.holder(name) is None  # released on g1 at the context's exit


@pytest.mark.parametrize("first_asks_again", ["first", "last"])
async def test_moved_waiters_get_the_lock_in_their_old_order(groups, first_asks_again):
    """Two waiters queued on g0 move with the slot and get the lock on g1 in their old order.
    ``last``: the first waiter's client asks g1 again only after the second's has; g1 knows both
    by the owner keys their acquires were queued with on g0 (a redirected acquire goes with its
    key), so the first still goes first."""
    name = names_owned_by(groups.shard_map, "g0", 1, f"queued-{first_asks_again}")[0]
    g1_lines = len(groups.servers["g1"].lines)
    admin = fastlock.connect(groups.servers["g0"].address, token=groups.creds.token("admin"), session=False)
    async with groups.connect() as holder, groups.connect() as first, groups.connect() as second, admin as operator:
        lease = await holder.acquire(name, ttl=30)
        order: list[str] = []
        if first_asks_again == "last":
            second_asked = asyncio.Event()
            refresh_first, refresh_second = first.refresh, second.refresh

            async def first_after_second(*args, **kwargs):
                await asyncio.wait_for(second_asked.wait(), 30)
                await asyncio.sleep(0.2)  # the second's acquire reaches g1 first
                return await refresh_first(*args, **kwargs)

            async def second_then_tell(*args, **kwargs):
                try:
                    return await refresh_second(*args, **kwargs)
                finally:
                    second_asked.set()

            first.refresh, second.refresh = first_after_second, second_then_tell

        async def wait_for(client, who: str):
            got = await client.acquire(name, ttl=30, wait=60)
            order.append(who)
            return got

        a = asyncio.ensure_future(wait_for(first, "first"))
        await wait_until(lambda: _queue_length(operator, name, 1), 10, "the first waiter to queue")
        b = asyncio.ensure_future(wait_for(second, "second"))
        await wait_until(lambda: _queue_length(operator, name, 2), 10, "the second waiter to queue")
        await groups.move(str(slot_of(name)), "g1")
        await holder.release(lease)  # on g1: the first waiter gets it
        got_a = await asyncio.wait_for(a, 30)
        assert order == ["first"] and got_a.fencing_token > lease.fencing_token
        await first.release(got_a)
        got_b = await asyncio.wait_for(b, 30)
        assert order == ["first", "second"] and got_b.fencing_token > got_a.fencing_token
        await second.release(got_b)
    assert not any("did not come back" in line for line in groups.servers["g1"].lines[g1_lines:])


async def _queue_length(client, name: str, n: int) -> bool:
    info = await client.lock_info(name)
    return info is not None and info.waiter_count >= n


async def test_the_destination_keeps_an_adopted_lease_across_a_restart(groups):
    name = names_owned_by(groups.shard_map, "g0", 1, "kept")[0]
    async with groups.connect() as client:
        lease = await client.acquire(name, ttl=60)
    await groups.move(str(slot_of(name)), "g1")
    groups.restart("g1")
    async with groups.connect() as client:
        g1 = client.group_client("g1")
        assert (await g1.holder(name))["token"] == lease.fencing_token
        lease = await client.extend(lease, ttl=30)
        await client.release(lease)
        assert (await client.acquire(name, ttl=5)).fencing_token > lease.fencing_token


async def test_a_move_stopped_after_its_mark_is_finished_by_running_it_again(groups, capsys):
    """The mover died right after writing the mark: the slot is frozen on g0 (a new request for
    it is held, not refused), and running the move again ships, flips and answers it."""
    tag = names_owned_by(groups.shard_map, "g0", 1, "resumed")[0]
    name, other = f"{{{tag}}}:a", f"{{{tag}}}:b"
    slot = slot_of(name)
    assert slot_of(other) == slot
    async with groups.connect() as client:
        lease = await client.acquire(name, ttl=30)
        stored = await load_from_etcd(groups.url)
        try:
            shard_map, revision = await stored.read()
            await stored.replace(revision, shard_map, mark_moving(shard_map, slot, slot, "g1"))
        finally:
            await stored.gateway.close()
        assert await shard(["shard", "status", "--coordinator", groups.url]) == 0
        assert f"slots {slot}..{slot}: g0 (moving to g1)" in capsys.readouterr().out

        async def g0_shard(key: str, n: int) -> bool:
            status = await asyncio.to_thread(groups.servers["g0"].status)
            return status["shard"][key] == n

        await wait_until(lambda: g0_shard("moving", 1), 20, "g0 to follow the mark")
        held = asyncio.ensure_future(client.acquire(other, ttl=30))
        await wait_until(lambda: g0_shard("held", 1), 10, "g0 to hold the acquire")
        assert not held.done()
        # ... and died again after shipping once: the rerun ships the same state again (no change)
        g1 = await RawNode.open(groups.servers["g1"].address, token=groups.creds.token("admin"))
        g0 = await RawNode.open(groups.servers["g0"].address, token=groups.creds.token("admin"))
        try:
            await wait_until(lambda: _serves_mark(g1, groups), 20, "g1 to follow the mark")
            page = await g0.request(OP_SLOT_EXPORT, slot, slot, None)
            assert [row[1] for row in page["leases"]] == [lease.fencing_token] and not page["more"]
            assert (await g1.request(OP_SLOT_IMPORT, slot, slot, msgpack.packb(page)))["leases"] == 1
        finally:
            await g0.close()
            await g1.close()
        await groups.move(str(slot), "g1")
        assert json.loads(capsys.readouterr().out)["steps"] == ["ship", "flip"]
        assert (await client.group_client("g1").holder(name))["token"] == lease.fencing_token
        second = await asyncio.wait_for(held, 30)  # answered WrongShard at the flip, granted by g1
        assert second.fencing_token > lease.fencing_token
        assert (await client.group_client("g1").holder(other))["token"] == second.fencing_token
        await client.release(second)
        await client.release(lease)


async def _mark(groups: Groups, slot: int) -> None:
    """Mark ``slot`` as moving from g0 to g1 in etcd (a mover's first step) and wait for g0 to freeze it."""
    stored = await load_from_etcd(groups.url)
    try:
        shard_map, revision = await stored.read()
        await stored.replace(revision, shard_map, mark_moving(shard_map, slot, slot, "g1"))
    finally:
        await stored.gateway.close()

    async def frozen() -> bool:
        return (await asyncio.to_thread(groups.servers["g0"].status))["shard"]["moving"] == 1

    await wait_until(frozen, 20, "g0 to follow the mark")


async def test_one_principal_cannot_fill_the_held_requests_of_a_move(groups):
    """The anonymous principal floods acquires on a frozen slot: past its share (a sixteenth of
    MAX_HELD) it is answered SlotMoving at once; app's acquire is still held, and granted by g1
    after the flip, while the anonymous principal's held ones are redirected."""
    tag = names_owned_by(groups.shard_map, "g0", 1, "flood")[0]
    slot = slot_of(tag)
    share = MAX_HELD // 4 // 4
    await _mark(groups, slot)
    flooder = await RawNode.open(groups.servers["g0"].address, token=None)  # the anonymous principal
    try:
        floods = [flooder.request(OP_ACQUIRE, f"{{{tag}}}:{k}", bytes(16), 30_000, 0, 0, None)
                  for k in range(share + 1)]
        with pytest.raises(SlotMoving, match="'anonymous' already has"):
            await asyncio.wait_for(floods[-1], 30)
        assert not any(f.done() for f in floods[:-1])
        async with groups.connect() as client:
            held = asyncio.ensure_future(client.acquire(f"{{{tag}}}:app", ttl=30))

            async def g0_holds(n: int) -> bool:
                return (await asyncio.to_thread(groups.servers["g0"].status))["shard"]["held"] == n

            await wait_until(lambda: g0_holds(share + 1), 20, "g0 to hold app's acquire")
            assert not held.done()
            await groups.move(str(slot), "g1")
            lease = await asyncio.wait_for(held, 30)
            assert (await client.group_client("g1").holder(f"{{{tag}}}:app"))["token"] == lease.fencing_token
            await client.release(lease)
        for f in floods[:-1]:  # the anonymous principal's held acquires: WrongShard naming g1
            with pytest.raises(WrongShard):
                await asyncio.wait_for(f, 30)
    finally:
        await flooder.close()


async def test_a_session_attach_naming_a_moved_lease_answers_it_lost_and_attaches_the_rest(groups):
    """A session on g0 attaches a lease whose slot moved to g1 with one g0 still owns (and
    detaches another moved one): no CrossShard; the moved lease is answered lost naming g1 (the
    routing client re-homes it), the other is attached; the routing client's session renews a
    lease taken just before a move on g1 without falling back to lone EXTENDs."""
    moved, stays = names_owned_by(groups.shard_map, "g0", 2, "attach")
    g0 = await RawNode.open(groups.servers["g0"].address, token=groups.app)
    try:
        token_m, _ttl, owner_m = await g0.acquire(moved, 30_000)
        token_s, _ttl, owner_s = await g0.acquire(stays, 30_000)
        await groups.move(str(slot_of(moved)), "g1")
        key = bytes(range(16))
        await g0.request(OP_SESSION_OPEN, key, 30_000)
        reply = await g0.request(OP_SESSION_ATTACH, key, [[moved, token_m, owner_m], [stays, token_s, owner_s]],
                                 [[moved, token_m]])
        assert reply["attached"] == 1
        assert [row[:2] for row in reply["lost"]] == [[moved, token_m]] and "g1" in reply["lost"][0][2]
    finally:
        await g0.close()
    later, here = names_owned_by(groups.shard_map, "g0", 2, "keeper")
    async with fastlock.connect(groups.servers["g0"].address, token=groups.app, session=True) as client:
        async with client.lock(later, ttl=2) as lease, client.lock(here, ttl=2) as other:
            await groups.move(str(slot_of(later)), "g1")
            started = asyncio.get_running_loop().time()
            while asyncio.get_running_loop().time() - started < 6:  # 3 TTLs: renewed only if g1 renews it
                assert not lease.lost.is_set() and not other.lost.is_set()
                await asyncio.sleep(0.5)
            assert (await client.group_client("g1").holder(later))["token"] == lease.fencing_token
            assert client.group_client("g0").session_keeper.supported is not False
            assert client.group_client("g1").session_keeper.supported is not False


async def test_a_session_keepalive_with_a_lease_in_a_frozen_slot_is_held_until_the_flip(groups):
    """A keep-alive of a session with a lease in a frozen slot is held (not renewing it at the
    source after its state may have been shipped); after the flip it answers that lease lost,
    naming the move, and renews the session's other lease."""
    moving, stays = names_owned_by(groups.shard_map, "g0", 2, "keepalive")
    g0 = await RawNode.open(groups.servers["g0"].address, token=groups.app)
    try:
        token_m, _ttl, owner_m = await g0.acquire(moving, 30_000)
        token_s, _ttl, owner_s = await g0.acquire(stays, 30_000)
        key = bytes(range(1, 17))
        await g0.request(OP_SESSION_OPEN, key, 30_000)
        attached = await g0.request(OP_SESSION_ATTACH, key, [[moving, token_m, owner_m], [stays, token_s, owner_s]],
                                    [])
        assert attached["attached"] == 2
        await _mark(groups, slot_of(moving))
        keepalive = g0.request(OP_SESSION_KEEPALIVE, key)

        async def g0_holds(n: int) -> bool:
            return (await asyncio.to_thread(groups.servers["g0"].status))["shard"]["held"] == n

        await wait_until(lambda: g0_holds(1), 20, "g0 to hold the keep-alive")
        assert not keepalive.done()
        await groups.move(str(slot_of(moving)), "g1")
        reply = await asyncio.wait_for(keepalive, 30)
        assert reply["renewed"] == 1
        assert [row[:2] for row in reply["lost"]] == [[moving, token_m]] and "g1" in reply["lost"][0][2]
    finally:
        await g0.close()


async def _serves_mark(node: RawNode, groups: Groups) -> bool:
    """Whether ``node`` serves the map with the mark (SHARD_MAP)."""
    reply = await node.request(OP_SHARD_MAP)
    return any(r.get("moving_to") == "g1" for r in reply["map"]["ranges"])


async def test_a_hostile_slot_import_is_refused_and_changes_nothing(groups):
    name = names_owned_by(groups.shard_map, "g1", 1, "target")[0]
    slot = slot_of(name)
    lease_row = [name, 1 << 50, b"x" * 32, 10_000, 0, False, 0, None, None]
    state = {"leases": [lease_row], "queues": [], "delays": [], "floor": 1 << 50}
    packed = msgpack.packb(state)
    app = await RawNode.open(groups.servers["g1"].address, token=groups.app)
    admin = await RawNode.open(groups.servers["g1"].address, token=groups.creds.token("admin"))
    try:
        with pytest.raises(PermissionDenied):  # a client principal may not import
            await app.request(OP_SLOT_IMPORT, slot, slot, packed)
        with pytest.raises(PermissionDenied):
            await app.request(OP_SLOT_EXPORT, slot, slot, None)
        bad_states = [
            {**state, "leases": [[*lease_row[:3], -5, *lease_row[4:]]]},  # a negative TTL
            {**state, "leases": [["a" * 10, *lease_row[1:]]]},  # a name outside the slots
            {**state, "leases": [lease_row[:5]]},  # too few fields
            {**state, "leases": [lease_row] * 21},  # more rows than a page
            {**state, "floor": "high"},
            {**state, "queues": [[name, 0, [b""]]]},
            {**state, "queues": [[name, 0, [b"x" * 32] * 21]]},  # a queue part too long
            {"leases": []},
            [1, 2, 3],
        ]
        for bad in [msgpack.packb(b) for b in bad_states] + [b"\xc1", state, b"x" * (61 << 10)]:
            with pytest.raises(InvalidArgument):
                await admin.request(OP_SLOT_IMPORT, slot, slot, bad)
        with pytest.raises(InvalidArgument):
            await admin.request(OP_SLOT_IMPORT, slot, -1, packed)
        # well formed, but the slot is not being moved to g1 (g1 owns it already): refused
        with pytest.raises(InvalidArgument, match="not marked moving"):
            await admin.request(OP_SLOT_IMPORT, slot, slot, packed)
        with pytest.raises(FastlockError):  # beyond a request's frame: the connection is closed
            await admin.request(OP_SLOT_IMPORT, slot, slot, b"x" * (1 << 20))
    finally:
        await app.close()
        await admin.close()
    check = await RawNode.open(groups.servers["g1"].address, token=groups.app)
    try:
        assert await check.holder(name) is None
        status = await check.status()
        assert status["epoch"] < 1 << 10  # no floor was raised
    finally:
        await check.close()


async def test_the_destination_standby_has_the_adopted_lease_and_the_source_standby_drops_it(groups):
    """The import's records (GRANT, RESERVE) and the source's drop (REVOKE) are replicated as
    every record is: each group's standby ends with the group's leases and token floor."""
    standbys = {}
    for k, group in enumerate(("g0", "g1")):
        standbys[group] = ServerProcess(groups.tmp_path / f"{group}-standby", fsync="always",
                                        args=["--standby-of", groups.servers[group].address,
                                              "--shard-map", groups.url, "--shard-group", group,
                                              *groups.creds.server_args(f"node-{3 + k}")])
    try:
        for standby in standbys.values():
            standby.start()
            standby.wait_for_log(r"replicating from", 20)
        name = names_owned_by(groups.shard_map, "g0", 1, "replicated")[0]
        async with groups.connect() as client:
            lease = await client.acquire(name, ttl=60)
            await groups.move(str(slot_of(name)), "g1")

            async def standby_has(group: str, held: int) -> bool:
                status = await asyncio.to_thread(standbys[group].status)
                return status["locks_held"] == held and status["last_token"] >= lease.fencing_token

            await wait_until(lambda: standby_has("g1", 1), 20, "g1's standby to hold the adopted lease")
            await wait_until(lambda: standby_has("g0", 0), 20, "g0's standby to drop the moved lease")
            await client.release(lease)
            await wait_until(lambda: standby_has("g1", 0), 20, "g1's standby to see the release")
    finally:
        for standby in standbys.values():
            if standby.proc is not None:
                standby.stop()


async def test_split_moves_the_upper_half_of_a_groups_largest_range(groups, capsys):
    name = names_owned_by(groups.shard_map, "g0", 200, "split")[-1]
    async with groups.connect() as client:
        lease = await client.acquire(name, ttl=30)
        assert await shard(["shard", "split", "g0", "--to", "g1", "--coordinator", groups.url, "-o", "json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["first"], report["last"], report["steps"]) == (4096, 8191, ["mark", "ship", "flip"])
        assert await shard(["shard", "status", "--coordinator", groups.url]) == 0
        out = capsys.readouterr().out
        # the moved range keeps its own line: it carries the move's token floor, the rest of g1's none
        assert "slots 0..4095: g0\n" in out and "slots 4096..8191: g1, token floor " in out
        assert "slots 8192..16383: g1\n" in out
        moved = slot_of(name) >= 4096
        assert report["leases"] == (1 if moved else 0)
        await client.release(lease)  # routed to whichever group owns it now


async def test_acquires_during_a_move_pause_and_tokens_never_go_backwards(groups):
    """Four clients acquire and release four names of the moving slot in a loop throughout a move:
    every call succeeds (held during the freeze, re-routed after it) and each name's tokens rise."""
    tag = names_owned_by(groups.shard_map, "g0", 1, "busy")[0]
    names = [f"{{{tag}}}:{i}" for i in range(4)]
    tokens: dict[str, list[int]] = {n: [] for n in names}
    done = asyncio.Event()

    async def worker(k: int) -> int:
        pairs = 0
        async with groups.connect() as client:
            while not done.is_set() and pairs < 100_000:
                name = names[(k + pairs) % len(names)]
                lease = await client.acquire(name, ttl=10, wait=30)
                tokens[name].append(lease.fencing_token)
                await client.release(lease)
                pairs += 1
        return pairs

    workers = [asyncio.ensure_future(worker(k)) for k in range(4)]
    try:
        await wait_until(lambda: all(len(t) >= 5 for t in tokens.values()), 20, "the workers to start")
        await groups.move(str(slot_of(names[0])), "g1")
        moved_at = {n: len(t) for n, t in tokens.items()}
        await wait_until(lambda: all(len(tokens[n]) >= moved_at[n] + 5 for n in names), 30,
                         "the workers to go on with g1")
    finally:
        done.set()
    assert all(p > 0 for p in await asyncio.wait_for(asyncio.gather(*workers), 60))
    for name, seen in tokens.items():
        assert seen == sorted(seen) and len(set(seen)) == len(seen), name
