"""Red team of the sharded deployment (issue 30): each finding that is a fault is kept here as a
test against real servers following a map in etcd (``test_shard_move.Groups``: two groups g0, g1
with credentials), on 127.0.0.1, with bounded waits."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import time

import msgpack
import pytest
from conftest import wait_until
from test_across import TTL_MS, contenders, holder_token, now_ms, peers, reply_to, reserve
from test_cli import fastlock as fastlock_cli
from test_shard_gain_floor import HIGH, _granted_on_g0, _granted_within, _mark_and_flip_by_hand
from test_shard_move import _mark, _serves_mark, shard
from test_shard_move_tokens import EtcdGroups, _rising, _status

import fastlock
from fastlock import protocol as P
from fastlock._testbase.cluster import RawNode
from fastlock._testbase.proxy import TcpProxy
from fastlock._testbase.shards import ShardSet, names_owned_by
from fastlock.cli.shardmove import abort_slots, move_slots
from fastlock.coordination.shardmap import load_from_etcd
from fastlock.errors import FastlockError, InvalidArgument, LeaseLost, LockNotHeld, Unavailable
from fastlock.protocol.ops import OP_COMMIT_RESERVATION, OP_RESERVE, OP_SHARD_MAP, OP_SLOT_EXPORT, OP_SLOT_IMPORT
from fastlock.sharding import ShardMap, ShardMapError, slot_of
from fastlock.sharding.moves import mark_moving
from fastlock.tokens import epoch_of, format_token


async def _ship(groups, slot: int) -> dict:
    """The first two steps of a move of ``slot`` from g0 to g1, as a mover stopped after the ship
    leaves them: the mark, and one export page of g0 imported into g1.  Returns the page."""
    await _mark(groups, slot)
    admin = groups.creds.token("admin")
    source = await RawNode.open(groups.servers["g0"].address, token=admin)
    dest = await RawNode.open(groups.servers["g1"].address, token=admin)
    try:
        await wait_until(lambda: _serves_mark(dest, groups), 20, "g1 to follow the mark")
        page = await source.request(OP_SLOT_EXPORT, slot, slot, None)
        assert not page["more"]
        await dest.request(OP_SLOT_IMPORT, slot, slot, msgpack.packb(page))
    finally:
        await source.close()
        await dest.close()
    return page


async def _ship_then_abort(groups, slot: int) -> dict:
    """A move of ``slot`` from g0 to g1 that ships and is then aborted (a mover stopped after the
    ship and ``fastlock shard move --abort`` run): :func:`_ship`, then the mark cleared; returns
    once both primaries serve the cleared map.  Returns the page shipped."""
    page = await _ship(groups, slot)
    admin = groups.creds.token("admin")
    source = await RawNode.open(groups.servers["g0"].address, token=admin)
    dest = await RawNode.open(groups.servers["g1"].address, token=admin)
    try:
        stored = await load_from_etcd(groups.url)
        try:
            aborted = await abort_slots(stored, slot, slot, "g1")
        finally:
            await stored.gateway.close()

        async def serve_abort(node: RawNode) -> bool:
            return (await node.request(OP_SHARD_MAP))["map"]["epoch"] >= aborted.epoch

        await wait_until(lambda: serve_abort(source), 20, "g0 to follow the abort")
        await wait_until(lambda: serve_abort(dest), 20, "g1 to follow the abort")
    finally:
        await source.close()
        await dest.close()
    return page


async def test_a_lease_imported_by_an_aborted_move_is_not_served_after_a_later_move(groups):
    """A move ships a held lease to g1 and is aborted; its holder releases it on g0; the slot
    is then moved to g1 for good.  g1 must not hold the released lease: its name is free there,
    the released lease's token is no longer valid and its owner cannot extend it.  On the code
    before, g1 kept the lease of the aborted import (unreachable while g1 did not own the slot)
    and served it after the second move: a released lease held again, passing ``check`` with
    its old token and blocking every acquire of the name until its TTL ran out."""
    name = names_owned_by(groups.shard_map, "g0", 1, "abortleft")[0]
    slot = slot_of(name)
    async with groups.connect() as client:
        lease = await client.acquire(name, ttl=60)
        page = await _ship_then_abort(groups, slot)
        assert [row[0] for row in page["leases"]] == [name]
        await client.release(lease)  # on g0, which serves the slot again
        assert await client.holder(name) is None
        await groups.move(str(slot), "g1")
        assert await client.holder(name) is None, "g1 holds a lease its holder released on g0"
        assert not await client.check(name, lease.fencing_token)
        with pytest.raises((LockNotHeld, LeaseLost)):  # LeaseLost: revoked on g1 when the move was aborted
            await client.extend(lease, ttl=5)
        again = await client.acquire(name, ttl=5, wait=0.5)
        assert again.fencing_token > lease.fencing_token
        await client.release(again)


async def test_locks_across_the_map_list_a_lease_once_while_a_move_is_shipped(groups):
    """Between a move's ship and its flip both groups hold the moved lease (the source frozen,
    the destination its imported copy).  ``ShardedClient.locks()`` (``fastlock locks``,
    ``fastlock top``) lists each lease from the group that owns its slot in the client's map, as
    ``list_prefix`` lists keys: once.  On the code before it listed the lease twice, as if two
    groups granted it."""
    name = names_owned_by(groups.shard_map, "g0", 1, "listedonce")[0]
    admin = fastlock.connect(groups.servers["g0"].address, token=groups.creds.token("admin"), session=False)
    async with groups.connect() as client, admin as operator:
        lease = await client.acquire(name, ttl=60)
        await _ship(groups, slot_of(name))
        listed = await operator.locks()
        assert [(x.name, x.fencing_token) for x in listed.locks] == [(name, lease.fencing_token)]
        assert listed.matched == 1
        await groups.move(str(slot_of(name)), "g1")  # the move finishes: g1 alone holds it
        listed = await operator.locks()
        assert [(x.name, x.fencing_token) for x in listed.locks] == [(name, lease.fencing_token)]
        await client.release(lease)


async def test_top_counts_a_lease_once_while_a_move_is_shipped(groups, tmp_path):
    """Between a move's ship and its flip the destination holds an imported copy of each moved
    lease.  Its status leaves those out of ``locks_held`` (``shard.imported_held`` names them), so
    ``fastlock top``'s total over the groups counts the lease once; after the flip the
    destination counts it.  On the code before, top showed 2 held (one per group)."""
    name = names_owned_by(groups.shard_map, "g0", 1, "topcount")[0]
    async with groups.connect() as client:
        lease = await client.acquire(name, ttl=60)
        await _ship(groups, slot_of(name))
        g1 = await asyncio.to_thread(groups.servers["g1"].status)
        assert g1["locks_held"] == 0 and g1["shard"]["imported_held"] == 1, g1
        top = fastlock_cli("top", "-o", "json", "--server", groups.servers["g0"].address, cwd=tmp_path)
        assert top.returncode == 0, top.stderr
        whole = json.loads(top.stdout)
        assert whole["locks_held"] == 1, whole
        assert {g: st["locks_held"] for g, st in whole["groups"].items()} == {"g0": 1, "g1": 0}, whole
        await groups.move(str(slot_of(name)), "g1")
        g1 = await asyncio.to_thread(groups.servers["g1"].status)
        assert g1["locks_held"] == 1 and g1["shard"]["imported_held"] == 0, g1
        await client.release(lease)


async def test_a_move_whose_destination_is_down_after_the_mark_fails_within_seconds(groups, capsys):
    """The slot is marked and the destination's only node is SIGKILLed; the move, run again, tells
    the destination of the mark first: no node answers, so it fails within seconds, naming the
    silent addresses and saying the slot stays frozen and how out.  The code before rode through
    for the notice's 30 s and a map read's 5 s more (36 s measured) before it said anything."""
    name = names_owned_by(groups.shard_map, "g0", 1, "destdown")[0]
    slot = slot_of(name)
    await _mark(groups, slot)
    groups.servers["g1"].kill()
    capsys.readouterr()
    argv = ["shard", "move", "--coordinator", groups.url, "--slots", str(slot), "--to", "g1"]
    started = time.monotonic()
    assert await shard(argv) == 1
    elapsed = time.monotonic() - started
    assert elapsed < 15, f"the move reported its dead destination after {elapsed:.1f} s"
    err = capsys.readouterr().err
    assert "did not answer within 5 s" in err and "is that group down?" in err, err
    assert f"slots {slot}..{slot} are still marked moving from g0 to g1" in err, err
    assert await shard([*argv, "--abort"]) == 0


async def test_a_move_that_fails_after_its_mark_says_the_slots_stay_frozen_and_how_out(groups, capsys):
    """A move whose destination refuses the ship (here: the page would pass g1's ``--max-keys``)
    fails after the mark, which stays in the map: g0 holds every request for the slots and grants
    none until the move is run again or aborted.  The command says so on stderr and names both
    ways out; on the code before it printed only the destination's refusal, which does not say
    the slots are still frozen (a destination killed after the mark printed only "no fastlock
    primary could serve the request before its deadline")."""
    groups.args["g1"] = ["--max-keys", "1"]
    groups.restart("g1")
    tag = names_owned_by(groups.shard_map, "g0", 1, "stuck")[0]
    slot = slot_of(tag)
    async with groups.connect() as client:
        for i in range(2):
            await client.put(f"{{{tag}}}:{i}", b"v")
        capsys.readouterr()
        argv = ["shard", "move", "--coordinator", groups.url, "--slots", str(slot), "--to", "g1"]
        assert await shard(argv) == 1
        err = capsys.readouterr().err
        assert "--max-keys" in err  # the refusal itself
        assert f"slots {slot}..{slot} are still marked moving from g0 to g1" in err, err
        assert f"fastlock shard move --slots {slot}-{slot} --to g1 --abort" in err, err
        assert await shard([*argv, "--abort"]) == 0
        assert await client.get(f"{{{tag}}}:0") is not None  # g0 serves the slot again


async def test_a_page_exported_before_an_abort_is_not_imported_under_a_later_mark(groups):
    """Two movers of one slot on an operator's bad day: the first exports a page holding a lease
    and stalls; the operator aborts the move, the lease's holder releases it on g0, and a second
    move of the slot starts.  The first mover's late import of its stale page must not bring the
    released lease to g1.  On the code before, g1 accepted the page (it checked only that the
    slots were marked moving to it) and served the released lease after the flip; a page now
    names the map epoch it was exported at, older than the mark g1 serves."""
    name = names_owned_by(groups.shard_map, "g0", 1, "stalepage")[0]
    slot = slot_of(name)
    async with groups.connect() as client:
        lease = await client.acquire(name, ttl=60)
        await _mark(groups, slot)
        admin = groups.creds.token("admin")
        source = await RawNode.open(groups.servers["g0"].address, token=admin)
        try:
            stale = await source.request(OP_SLOT_EXPORT, slot, slot, None)
        finally:
            await source.close()
        assert [row[0] for row in stale["leases"]] == [name]
        stored = await load_from_etcd(groups.url)
        try:
            await abort_slots(stored, slot, slot, "g1")
        finally:
            await stored.gateway.close()
        await wait_until(lambda: _moving_on_g0(groups, 0), 20, "g0 to follow the abort")
        await client.release(lease)
        await _mark(groups, slot)  # the second mover's mark
        dest = await RawNode.open(groups.servers["g1"].address, token=admin)
        try:
            await wait_until(lambda: _serves_mark(dest, groups), 20, "g1 to follow the second mark")
            with pytest.raises(InvalidArgument, match="before slots .* were marked moving here"):
                await dest.request(OP_SLOT_IMPORT, slot, slot, msgpack.packb(stale))  # the first mover's, late
        finally:
            await dest.close()
        await groups.move(str(slot), "g1")  # the second mover resumes: ship and flip
        assert await client.holder(name) is None, "g1 serves a lease released on g0 before the second mark"


async def test_a_page_exported_before_an_abort_is_refused_by_a_destination_that_missed_the_abort(groups):
    """As above, but g1 is stopped (SIGSTOP) from before the abort until after the second mark:
    its watch never sees the abort, so g1 itself cannot tell the second mark from the first.  The
    mark's epoch is in the map (``marked_epoch``): g1 refuses the stale page all the same.  On the
    code before, g1 imported it (the slot had been marked moving to it since the first mark, as
    far as it knew) and, after the second mover's flip, held the lease released on g0."""
    name = names_owned_by(groups.shard_map, "g0", 1, "skippedabort")[0]
    slot = slot_of(name)
    async with groups.connect() as client:
        lease = await client.acquire(name, ttl=60)
        await _mark(groups, slot)
        admin = groups.creds.token("admin")
        source = await RawNode.open(groups.servers["g0"].address, token=admin)
        dest = await RawNode.open(groups.servers["g1"].address, token=admin)
        try:
            await wait_until(lambda: _serves_mark(dest, groups), 20, "g1 to follow the first mark")
            stale = await source.request(OP_SLOT_EXPORT, slot, slot, None)
            assert [row[0] for row in stale["leases"]] == [name]
            stopped = groups.servers["g1"].proc.pid
            os.kill(stopped, signal.SIGSTOP)
            try:
                stored = await load_from_etcd(groups.url)
                try:
                    aborted = await abort_slots(stored, slot, slot, "g1")
                finally:
                    await stored.gateway.close()
                await wait_until(lambda: _moving_on_g0(groups, 0), 20, "g0 to follow the abort")
                await client.release(lease)
                await _mark(groups, slot)  # the second mover's mark
            finally:
                os.kill(stopped, signal.SIGCONT)

            async def takes_second_mark() -> bool:
                return (await dest.request(OP_SHARD_MAP))["map"]["epoch"] > aborted.epoch

            await wait_until(takes_second_mark, 20, "g1 to follow the second mark")
            with pytest.raises(InvalidArgument, match="before slots .* were marked moving here"):
                await dest.request(OP_SLOT_IMPORT, slot, slot, msgpack.packb(stale))  # the first mover's, late
        finally:
            await source.close()
            await dest.close()
        await groups.move(str(slot), "g1")  # the second mover resumes: ship and flip
        assert await client.holder(name) is None, "g1 serves a lease released on g0 before the second mark"


async def _moving_on_g0(groups, n: int) -> bool:
    return (await asyncio.to_thread(groups.servers["g0"].status))["shard"]["moving"] == n


def test_a_stopped_shard_is_named_as_stalled_not_as_a_foreign_port(tmp_path):
    """One shard process stopped (SIGSTOP: a pause, a debugger, a swapped-out host): `fastlock
    status --all` names its address as not answering HELLO, "not a fastlock server, or a stalled
    one", and `fastlock top -o json` says how many of the groups answered ("1 of 2 shard groups")
    and exits 3.  On the code before, status called the stopped shard "not a fastlock server" and
    top's role said "1 shard groups", as if the deployment had one group."""
    with ShardSet.start(tmp_path / "shards", 2) as shards:
        stopped = shards.servers["g0"]
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        try:
            status = fastlock_cli("status", "--all", "--server", shards.address("g1"), "--connect-timeout", "1",
                                  cwd=tmp_path)
            assert status.returncode == 1, status.stderr
            row = next(line for line in status.stdout.splitlines() if stopped.address in line)
            assert "or a stalled one" in row, row
            top = fastlock_cli("top", "-o", "json", "--server", shards.address("g1"), "--connect-timeout", "1",
                               cwd=tmp_path)
            assert top.returncode == 3, top.stderr
            whole = json.loads(top.stdout)
            assert whole["role"] == "1 of 2 shard groups" and list(whole["unreachable"]) == ["g0"], whole
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)


@pytest.fixture
async def etcd_groups(etcd, tmp_path, monkeypatch):
    """g0 (one node) and g1 (a primary and a standby), etcd-arbitrated, the map in etcd
    (``test_shard_move_tokens.EtcdGroups``); stopped after the test."""
    groups = EtcdGroups(etcd, tmp_path, monkeypatch, (1, 2))
    try:
        await groups.start()
        yield groups
    finally:
        groups.stop()


async def test_leases_of_a_move_aborted_while_the_destination_failed_over_are_dropped_by_its_new_primary(
        etcd_groups):
    """The destination's primary dies after an import; the move is aborted; its standby, which
    replicated the imported lease and saw the abort as a standby, is promoted.  The lease's holder
    releases it on g0 and the slot then moves to g1 for good: g1's new primary must not serve the
    released lease.  On the code before, only a primary that took the abort (or started after it)
    dropped what the aborted move had imported, so the promoted standby kept it and served it after
    the second move's flip."""
    groups = etcd_groups
    name = names_owned_by(groups.shard_map, "g0", 1, "abortfailover")[0]
    slot = slot_of(name)
    admin = groups.creds.token("admin")
    source = await RawNode.open(groups.servers["g0-0"].address, token=groups.app)
    try:
        token, _ttl, owner = await source.acquire(name, 60_000)
    finally:
        await source.close()
    stored = await load_from_etcd(groups.url)
    try:
        shard_map, revision = await stored.read()
        marked = mark_moving(shard_map, slot, slot, "g1")
        await stored.replace(revision, shard_map, marked)
        for node in ("g0-0", "g1-0", "g1-1"):
            await wait_until(lambda node=node: groups.serves_epoch(node, marked.epoch), 20,
                             f"{node} to follow the mark")
        exporter = await RawNode.open(groups.servers["g0-0"].address, token=admin)
        importer = await RawNode.open(groups.servers["g1-0"].address, token=admin)
        try:
            page = await exporter.request(OP_SLOT_EXPORT, slot, slot, None)
            assert [row[0] for row in page["leases"]] == [name]
            await importer.request(OP_SLOT_IMPORT, slot, slot, msgpack.packb(page))  # g1-1 has applied it
        finally:
            await exporter.close()
            await importer.close()
        groups.servers["g1-0"].proc.send_signal(signal.SIGKILL)
        groups.servers["g1-0"].proc.wait()
        aborted = await abort_slots(stored, slot, slot, "g1")
    finally:
        await stored.gateway.close()
    await wait_until(lambda: groups.serves_epoch("g1-1", aborted.epoch), 20, "g1-1 to follow the abort")
    await wait_until(lambda: groups.is_role("g1-1", "primary"), 60, "g1-1 to be promoted")
    source = await RawNode.open(groups.servers["g0-0"].address, token=groups.app)
    try:
        await wait_until(lambda: groups.serves_epoch("g0-0", aborted.epoch), 20, "g0-0 to follow the abort")
        await source.release(name, token, owner)
    finally:
        await source.close()
    await groups.move(slot, "g1")
    dest = await RawNode.open(groups.servers["g1-1"].address, token=groups.app)
    try:
        assert await dest.holder(name) is None, "g1's new primary serves a lease released on g0"
    finally:
        await dest.close()


async def test_a_stalled_movers_flip_does_not_flip_a_later_mark_it_never_shipped(groups):
    """Two movers of one slot on an operator's bad day: the first (``move_slots``) marks and
    ships, then stalls before its flip; the operator aborts the move; g0 serves the slot again and
    grants its name (an acknowledged lease, a token above the first ship's floor); a second move
    marks the slot.  Then the first mover goes on, and the second runs to the end.  The lease
    granted on g0 between the abort and the second mark must be held on g1 with its token, and the
    next grant there must be above it.  On the code before, the first mover's flip met a changed
    map, read it again, found the slot marked moving to g1 and flipped it: g1 got the slot without
    g0's state since the abort, g0 dropped the lease (an acknowledged lease lost) and g1 granted the
    name again with a lower token (1 after 2).  Now a flip compares the map read before its ship,
    and the mover ships again under a changed map."""
    name = names_owned_by(groups.shard_map, "g0", 1, "stallflip")[0]
    slot = slot_of(name)
    shipped, go_on = threading.Event(), threading.Event()

    def progress(text: str) -> None:  # the first mover's thread stalls after its first ship
        if text.startswith("shipped") and not shipped.is_set():
            shipped.set()
            go_on.wait(60)

    async def first_mover() -> object:
        stored = await load_from_etcd(groups.url)
        try:
            return await move_slots(stored, slot, slot, "g1", progress=progress)
        finally:
            await stored.gateway.close()

    mover = asyncio.ensure_future(asyncio.to_thread(asyncio.run, first_mover()))
    try:
        await wait_until(shipped.is_set, 30, "the first mover to ship")
        stored = await load_from_etcd(groups.url)
        try:
            await abort_slots(stored, slot, slot, "g1")  # the operator gives up on the stalled mover
        finally:
            await stored.gateway.close()
        await wait_until(lambda: _moving_on_g0(groups, 0), 20, "g0 to follow the abort")
        holder = await RawNode.open(groups.servers["g0"].address, token=groups.app)
        try:
            await wait_until(lambda: _granted(holder, name), 20, "g0 to grant the name again")
            token, _ttl, owner = await holder.acquire(name, 60_000)  # acknowledged by g0
        finally:
            await holder.close()
        await _mark(groups, slot)  # the second mover's mark
    finally:
        go_on.set()
    try:
        await mover
    except FastlockError:
        pass  # the first mover may fail: it must not flip what it did not ship
    await groups.move(str(slot), "g1")  # the second mover runs to the end (or finds the move done)
    dest = await RawNode.open(groups.servers["g1"].address, token=groups.app)
    try:
        held = await dest.holder(name)
        assert held is not None and held["token"] == token, f"the lease granted on g0 ({token}) is {held} on g1"
        await dest.release(name, token, owner)
        again, _ttl, _owner = await dest.acquire(name, 5_000)
        assert again > token
    finally:
        await dest.close()


async def _granted(node: RawNode, name: str) -> bool:
    """Whether ``node`` grants ``name`` now (a probe acquired and released at once)."""
    try:
        token, _ttl, owner = await node.acquire(name, 1_000)
    except FastlockError:
        return False
    await node.release(name, token, owner)
    return True


async def test_a_destination_node_killed_before_the_mark_starts_again_after_the_flip(etcd_groups):
    """g1's primary is killed (kill -9) before a move to g1 is marked; its standby is promoted and
    the move runs to its flip.  The killed node then starts again: the map in etcd gives its group
    slots that the map it last served by neither gave it nor marked as moving to it.  It starts by
    that older map, follows its new primary, and takes the flip once replication brings its group's
    import of the slots.  On the code before it refused to start (exit 1, "slots change owner only
    by a move"), so a node killed at the wrong moment of a move could not rejoin its group
    (``python -m benches.shard_nemesis``'s move-kill met it)."""
    groups = etcd_groups
    slot = slot_of(names_owned_by(groups.shard_map, "g0", 1, "killedbefore")[0])
    killed = groups.servers["g1-0"]
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait()
    await wait_until(lambda: groups.is_role("g1-1", "primary"), 60, "g1-1 to be promoted")
    await groups.move(slot, "g1")
    stored = await load_from_etcd(groups.url)
    try:
        flipped, _revision = await stored.read_existing()
    finally:
        await stored.gateway.close()
    assert flipped.owner_of_slot(slot).name == "g1"
    groups.servers["g1-0"] = groups._server("g1-0").start()  # on the code before: exit 1
    await wait_until(lambda: groups.is_role("g1-0", "standby"), 60, "g1-0 to follow g1-1")
    await wait_until(lambda: groups.serves_epoch("g1-0", flipped.epoch), 30, "g1-0 to take the flip")


async def test_a_token_raised_above_a_maps_floor_is_not_issued_again_by_the_next_fresh_primary(groups_of):
    """g1 gains a name's slot by a real move from g0 (epoch 41); both of g1's nodes are then wiped.
    g1-0 starts alone on an empty data directory and grants the name above the map's floor (the
    epoch after the floor's, raised in etcd first); it is killed (kill -9) and g1-1 starts on an
    empty data directory in its place.  Its grant must be above g1-0's: a fencing token is never
    issued twice.  On the code before, etcd's ``PREFIX/epoch`` (42, raised by g1-0) was not credible
    to g1-1 (it had seen no epoch: at most 16 above is believed), so g1-1 bid at 1, wrote that over
    42, and raised its epoch to the same 42 for the same floor: it granted 42/1 a second time."""
    g = await groups_of((1, 2), **HIGH)
    name = names_owned_by(g.shard_map, "g0", 1, "twice")[0]
    tokens = [await _granted_on_g0(g, name)]
    await g.move(slot_of(name), "g1")
    for node in ("g1-1", "g1-0"):
        g.servers[node].stop()
        shutil.rmtree(g.tmp_path / node)
    g.servers["g1-0"] = g._server("g1-0").start()
    await wait_until(lambda: g.is_role("g1-0", "primary"), 60, "g1-0 to be the primary on an empty data directory")
    tokens.append(await _granted_within(g.servers["g1-0"].address, g.app, name))
    g.servers["g1-0"].kill()
    g.servers["g1-1"] = g._server("g1-1").start()
    await wait_until(lambda: g.is_role("g1-1", "primary"), 60, "g1-1 to be the primary on an empty data directory")
    tokens.append(await _granted_within(g.servers["g1-1"].address, g.app, name))
    _rising(name, tokens)


def _waiters(look, name: str) -> list[str]:
    """The client names of ``name``'s waiters, in queue order."""
    return [w["client"] for w in contenders(look, name)["waiters"]]


def test_a_parked_reservation_enters_the_queue_when_its_older_waiters_connection_closes(server):
    """A reservation parked behind an older one waiting on a name enters the queue when the older
    one's connection closes (its request ended without a word to the wound-wait table).  A
    close looks only at the reservations parked on the names the closed connection's reservations
    waited on: the code before looked at every parked one on every connection's close
    (``python -m benches.reserve_abuse``: 3.0 ms of server CPU a close with 1,000 reservations of
    64 names parked, 0.25 ms now)."""
    with peers(server.address, 4) as (old, young, other, look):
        plain_owner = os.urandom(16)
        assert look.call(P.OP_ACQUIRE, "w/1", plain_owner, TTL_MS, 0, 0, None)[1] == 0
        assert look.call(P.OP_ACQUIRE, "w/2", os.urandom(16), TTL_MS, 0, 0, None)[1] == 0
        stamp = now_ms()
        reserve(old, ["w/1", "w/2"], stamp - 5_000, b"old", wait_ms=30_000)
        assert old.call(P.OP_PING)[1] == 0
        young_owner = os.urandom(16)
        rid_young = reserve(young, ["w/3", "w/1"], stamp, b"young", wait_ms=30_000, owner=young_owner)
        assert young.call(P.OP_PING)[1] == 0
        assert _waiters(look, "w/1") == ["peer-0"]  # the young one (peer-1) is parked behind the old one
        old.close()
        deadline = time.monotonic() + 5.0
        while _waiters(look, "w/1") != ["peer-1"]:
            assert time.monotonic() < deadline, "the parked reservation never entered the queue"
            time.sleep(0.01)
        rid_other = reserve(other, ["w/2"], stamp + 1, b"other", wait_ms=30_000)  # parked on nothing older
        assert other.call(P.OP_PING)[1] == 0
        token = holder_token(look, "w/1")
        assert look.call(P.OP_RELEASE, "w/1", token, plain_owner)[1] == 0
        granted = reply_to(young, rid_young)
        assert granted[1] == 0 and granted[2][0][1] > token, granted
        assert young.call(OP_COMMIT_RESERVATION, b"young")[1] == 0
        assert rid_other  # still waiting on w/2's holder, untouched by the closes
        assert _waiters(look, "w/2") == ["peer-2"]


def _bad_maps(good: dict) -> list[tuple[str, bytes]]:
    """Values of the map's etcd key that are no valid map, each with what is wrong: floors out of
    range or of the wrong type, without their epoch, on overlapping ranges or a group the map does
    not name, and values that are not maps at all."""
    def with_floor(**fields) -> bytes:
        value = json.loads(json.dumps(good))
        value["epoch"] = good["epoch"] + 1
        value["ranges"][1].update(fields)
        return json.dumps(value).encode()

    overlapping = json.loads(json.dumps(good))
    overlapping["epoch"] += 1
    overlapping["ranges"][1].update(first=overlapping["ranges"][0]["last"], floor=5, floor_epoch=1)
    stranger = json.loads(json.dumps(good))
    stranger["epoch"] += 1
    stranger["ranges"][1].update(group="nobody", floor=5, floor_epoch=1)
    return [("a negative floor", with_floor(floor=-1, floor_epoch=1)),
            ("a floor of 2**63", with_floor(floor=2 ** 63, floor_epoch=1)),
            ("a floor of 2**64 + 1", with_floor(floor=2 ** 64 + 1, floor_epoch=1)),
            ("a floor above the last epoch's", with_floor(floor=(2 ** 63 - 1) >> 40 << 40, floor_epoch=1)),
            ("a string floor", with_floor(floor="5", floor_epoch=1)),
            ("a bool floor", with_floor(floor=True, floor_epoch=1)),
            ("a float floor", with_floor(floor=5.0, floor_epoch=1)),
            ("a floor without its epoch", with_floor(floor=5)),
            ("a floor epoch without its floor", with_floor(floor_epoch=1)),
            ("a floor epoch above the map's", with_floor(floor=5, floor_epoch=good["epoch"] + 2)),
            ("a floor epoch of 0", with_floor(floor=5, floor_epoch=0)),
            ("a bool floor epoch", with_floor(floor=5, floor_epoch=True)),
            ("a marked epoch without a move", with_floor(marked_epoch=1)),
            ("a floor of 5,000 digits",
             with_floor(floor=7, floor_epoch=1).replace(b'"floor": 7', b'"floor": ' + b"9" * 5000)),
            ("a floor on an overlapping range", json.dumps(overlapping).encode()),
            ("a floor on a group the map does not name", json.dumps(stranger).encode()),
            ("not JSON", b"{\"epoch\": 2, \"groups\": ["),
            ("nested too deep", b"[" * 100_000 + b"]" * 100_000)]


async def test_bad_maps_with_floors_written_to_etcd_are_refused_and_a_hostile_floor_is_served_above(groups):
    """Values written straight to the map's etcd key that are no valid map (floors negative, above
    2**63, of 5,000 digits, strings, bools, floats, without their epoch, on an overlapping range or a
    group the map does not name; not JSON; nested too deep): every node logs each as ignored with
    its reason, keeps serving the last good map and grants as before.  Then a valid map whose range
    of g0 carries a floor far above g0's tokens (as a hostile writer may write): g0 takes it and grants
    the range's names above that floor at once, never below.  Held on the code this was written against."""
    name = names_owned_by(groups.shard_map, "g0", 1, "badmaps")[0]
    good = groups.shard_map.to_wire()
    stored = await load_from_etcd(groups.url)
    tokens = []
    try:
        async with groups.connect() as client:
            for what, value in _bad_maps(good):
                starts = {g: len(s.lines) for g, s in groups.servers.items()}
                await stored.gateway.put(stored.key, value)
                for g, server in groups.servers.items():
                    await asyncio.to_thread(server.wait_for_log, "ignoring the shard map in etcd", 20, starts[g])
                    assert server.proc.poll() is None, f"{g} died of {what}"
                    st = await asyncio.to_thread(server.status)
                    assert st["shard"]["epoch"] == good["epoch"], (what, st["shard"])
                lease = await client.acquire(name, ttl=5)
                tokens.append(lease.fencing_token)
                await client.release(lease)
            hostile = json.loads(json.dumps(good))
            floor = 30 << 40 | 5  # 30/5: far above g0's tokens
            hostile["epoch"] += 1
            hostile["ranges"][0].update(floor=floor, floor_epoch=hostile["epoch"])
            await stored.gateway.put(stored.key, json.dumps(hostile).encode())
            await wait_until(lambda: _serves_epoch(groups.servers["g0"], hostile["epoch"]), 20,
                             "g0 to take the map with a floor")
            lease = await client.acquire(name, ttl=5)
            tokens.append(lease.fencing_token)
            await client.release(lease)
    finally:
        await stored.gateway.close()
    _rising(name, tokens)
    assert tokens[-1] > floor, tokens


async def _serves_epoch(server, epoch: int) -> bool:
    return (await asyncio.to_thread(server.status))["shard"]["epoch"] >= epoch


class _SlowFenceGroups(EtcdGroups):
    """:class:`EtcdGroups` whose nodes hold the primary key for 10 s (``--coordinator-ttl 10``): a
    primary cut off from etcd serves about 7 s more before it fences itself."""

    def _server(self, node: str):
        server = super()._server(node)
        server.args[server.args.index("--coordinator-ttl") + 1] = "10"
        return server


async def test_a_waiter_queued_before_a_floor_above_its_primary_is_not_granted_below_it(etcd, tmp_path, monkeypatch):
    """g0 (one etcd-arbitrated node) has a holder (a 1.5 s lease) and a waiter queued on a name when
    a map whose range of g0 carries a floor far above g0's tokens arrives (a hostile or hand-written
    map), while g0's link to its etcd is black-holed: g0 owes the floor (its epoch must be raised in
    etcd first) and refuses new requests for the range.  The holder's lease then runs out: the
    queued waiter must not be granted a token below the floor.  It is answered Unavailable (its
    client asks again), and the name is granted above the floor once the link is back.  On the code
    before, the expiry handed the waiter the name at g0's old epoch, below the floor 30/5."""
    groups = _SlowFenceGroups(etcd, tmp_path, monkeypatch, (1, 1))
    link = TcpProxy(etcd.address).start()
    groups.coordinators["g0"] = groups.coordinators["g0"].replace(etcd.address, link.address)
    floor = 30 << 40 | 5
    try:
        await groups.start()
        name = names_owned_by(groups.shard_map, "g0", 1, "owedwaiter")[0]
        address = groups.servers["g0-0"].address
        holder = await RawNode.open(address, token=groups.app)
        waiter = await RawNode.open(address, token=groups.app)
        try:
            await holder.acquire(name, 1_500)
            waiting = asyncio.ensure_future(waiter.acquire(name, 60_000, 30_000))

            async def queued() -> bool:
                return len((await holder.request(P.OP_CONTENDERS, name))["waiters"]) == 1

            await wait_until(queued, 10, "the waiter to queue")
            link.blackhole()
            hostile = groups.shard_map.to_wire()
            hostile["epoch"] += 1
            hostile["ranges"][0].update(floor=floor, floor_epoch=hostile["epoch"])
            stored = await load_from_etcd(groups.url)
            try:
                await stored.gateway.put(stored.key, json.dumps(hostile).encode())
            finally:
                await stored.gateway.close()

            async def owes() -> bool:
                st = await _status(groups.servers["g0-0"])
                return st is not None and st["shard"]["below_floor"] > 0

            await wait_until(owes, 10, "g0 to owe the floor")
            try:  # the holder's lease runs out within 1.5 s
                got = await asyncio.wait_for(waiting, 30)
            except FastlockError as exc:
                got = exc
            assert isinstance(got, Unavailable) or got[0] > floor, f"granted {format_token(got[0])} below the floor"
        finally:
            await holder.close()
            await waiter.close()
        link.heal()
        await wait_until(lambda: groups.is_role("g0-0", "primary"), 60, "g0-0 to be the primary again")
        assert await _granted_within(address, groups.app, name) > floor
    finally:
        groups.stop()
        link.close()


def test_reserves_of_names_another_group_owns_are_redirected_and_change_nothing(tmp_path):
    """A raw msgpack peer sends g0 RESERVEs of names g1 owns (waiting, parked behind an older one
    of g0's, and mixing both groups' names): each is answered WrongShard or CrossShard naming the
    map's epoch, nothing is held or queued on g0, and g0 serves its own names as before.
    Held on the code this was written against."""
    with ShardSet.start(tmp_path / "shards", 2) as shards:
        mine = names_owned_by(shards.shard_map, "g0", 2, "own")
        theirs = names_owned_by(shards.shard_map, "g1", 2, "foreign")
        with peers(shards.address("g0"), 2) as (older, hostile):
            assert older.call(P.OP_ACQUIRE, mine[0], os.urandom(16), TTL_MS, 0, 0, None)[1] == 0
            stamp = now_ms()
            reserve(older, [mine[0]], stamp - 5_000, b"older", wait_ms=30_000)
            assert older.call(P.OP_PING)[1] == 0
            for names, multi_id, code in (([theirs[0]], b"f1", 60), (theirs, b"f2", 60),
                                          ([mine[0], theirs[0]], b"f3", 61), ([theirs[1], mine[1]], b"f4", 61)):
                reply = hostile.call(OP_RESERVE, names, os.urandom(16), TTL_MS, 30_000, None, stamp, multi_id)
                assert reply[1] == code, (names, reply)
            st = hostile.call(P.OP_STATUS)[2]
            assert hostile.call(P.OP_HOLDER, mine[1])[2] is None
            assert _waiters(hostile, mine[0]) == ["peer-0"]  # the older one alone: nothing queued
            assert st["locks_held"] == 1, st
            assert hostile.call(P.OP_ACQUIRE, mine[1], os.urandom(16), TTL_MS, 0, 0, None)[1] == 0


def test_a_map_of_the_python_api_with_an_integer_too_long_to_print_is_refused_as_a_bad_map():
    """``ShardMap.from_wire`` of a plain form (built in Python: JSON and msgpack cannot carry one)
    whose floor, slot or epoch is an int of more digits than Python turns into text raises
    ShardMapError, as any other bad map.  On the code before, the refusal's own message (which
    names the value) raised a bare ValueError."""
    huge = 10 ** 5000
    for field, value in (("floor", huge), ("floor_epoch", huge), ("first", huge), ("last", -huge)):
        wire = {"epoch": 3, "groups": [{"name": "a", "addresses": ["127.0.0.1:1"]}],
                "ranges": [{"first": 0, "last": 16383, "group": "a", "floor": 5, "floor_epoch": 1}]}
        wire["ranges"][0][field] = value
        with pytest.raises(ShardMapError):
            ShardMap.from_wire(wire)


async def test_a_floor_adopted_by_hand_is_recorded_in_the_map_and_kept_by_a_group_restarted_empty(groups_of):
    """g0 grants a name at epoch 41; its slot is flipped to g1 by hand (no import) and ``fastlock
    shard adopt --from g0`` gives g1 the slot's floor; g1 grants the name above g0's token.  g1's
    only node is then restarted on an empty data directory: it must grant the name above its own
    token before.  ``shard adopt`` now records the floor it adopted on the slot in the map, so the
    node bids above it.  On the code before, the map kept no floor for the slot: the node, which had
    seen no epoch, did not believe etcd's 41, bid at 1 and granted the name at 1/1 after 41/2."""
    g = await groups_of((1, 1), **HIGH)
    name = names_owned_by(g.shard_map, "g0", 1, "adoptwiped")[0]
    slot = slot_of(name)
    tokens = [await _granted_on_g0(g, name)]
    await _mark_and_flip_by_hand(g, slot, ("g0-0", "g1-0"))
    assert await shard(["shard", "adopt", "--coordinator", g.url, "--slots", str(slot), "--from", "g0"]) == 0
    tokens.append(await _granted_within(g.servers["g1-0"].address, g.app, name))
    stored = await load_from_etcd(g.url)
    try:
        recorded = (await stored.read_existing())[0]
    finally:
        await stored.gateway.close()
    assert recorded.floor_of_slot(slot) == tokens[0], recorded.floor_of_slot(slot)
    g.servers["g1-0"].stop()
    shutil.rmtree(g.tmp_path / "g1-0")
    g.servers["g1-0"] = g._server("g1-0").start()
    await wait_until(lambda: g.is_role("g1-0", "primary"), 60, "g1-0 to be the primary on an empty data directory")
    tokens.append(await _granted_within(g.servers["g1-0"].address, g.app, name))
    _rising(name, tokens)


async def test_a_slot_moved_there_and_back_keeps_its_tokens_rising_on_a_source_restarted_empty(groups_of):
    """A name's slot moves g0 (epoch 41) -> g1 -> g0; g1 grants the name and other names of its own
    in between.  The second move's floor in the map covers every token g1 issued (its high-water
    mark when it shipped); g0 grants above it, and so does g0's only node restarted on an empty data
    directory (it bids above the floor's epoch).  Held on the code this was written against."""
    g = await groups_of((1, 1), **HIGH)
    name = names_owned_by(g.shard_map, "g0", 1, "backforth")[0]
    slot = slot_of(name)
    tokens = [await _granted_on_g0(g, name)]
    await g.move(slot, "g1")
    g1 = g.servers["g1-0"].address
    tokens.append(await _granted_within(g1, g.app, name))
    others = [await _granted_within(g1, g.app, other) for other in names_owned_by(g.shard_map, "g1", 3, "g1own")]
    await g.move(slot, "g0")
    stored = await load_from_etcd(g.url)
    try:
        back = (await stored.read_existing())[0]
    finally:
        await stored.gateway.close()
    assert back.owner_of_slot(slot).name == "g0" and back.floor_of_slot(slot) >= max(tokens[-1], *others), back
    tokens.append(await _granted_within(g.servers["g0-0"].address, g.app, name))
    assert tokens[-1] > max(others)
    g.servers["g0-0"].stop()
    shutil.rmtree(g.tmp_path / "g0-0")
    g.seen = {}  # nothing written there before it starts
    g.servers["g0-0"] = g._server("g0-0").start()
    await wait_until(lambda: g.is_role("g0-0", "primary"), 60, "g0-0 to be the primary on an empty data directory")
    tokens.append(await _granted_within(g.servers["g0-0"].address, g.app, name))
    _rising(name, tokens)


async def test_a_standby_that_missed_its_primarys_raise_above_a_floor_is_promoted_above_it(groups_of):
    """g1 (a primary and a standby, epoch 2) is given a map whose range of g1 carries a floor of
    epoch 30 (a hostile or hand-written map) while its standby's replication link is cut: the
    primary raises the group's epoch to 31 in etcd and in its log (which the standby never
    receives) and grants a name at epoch 31; it is then killed (kill -9).  The standby, promoted,
    must grant in an epoch above 31: the dead primary's counter in epoch 31 is known to it only up
    to the last counter reservation it replicated (a block of 100,000), and a primary that granted
    past it before dying issued the tokens that follow.  It took the map from its own watch, so it
    counts epoch 31 as one its group may have reached: etcd's 31 is credible to it and it bids
    above.  On the code before, etcd's 31 was 29 above what it had seen (at most 16 is believed), so
    it bid at 3 and raised its epoch to the same 31 for the same floor, granting 31/100002."""
    g = await groups_of((1, 2), relayed=("g1-0",), **HIGH)
    name = names_owned_by(g.shard_map, "g1", 1, "missedraise")[0]
    relay = g.relays["g1-0"]
    await wait_until(lambda: asyncio.to_thread(relay.count, "replication"), 30,
                     "g1's standby to replicate through the relay")
    tokens = [await _granted_within(g.servers["g1-0"].address, g.app, name)]
    relay.blackhole("replication")
    relay.cut("replication")  # detached: its attempts to attach again are held
    floor = 30 << 40
    stored = await load_from_etcd(g.url)
    try:
        shard_map, revision = await stored.read_existing()
        wire = shard_map.to_wire()
        wire["epoch"] += 1
        wire["ranges"][1].update(floor=floor, floor_epoch=wire["epoch"])
        await stored.replace(revision, shard_map, ShardMap.from_wire(wire))
    finally:
        await stored.gateway.close()
    await wait_until(lambda: g.serves_epoch("g1-1", wire["epoch"]), 30, "g1's standby to take the map")
    tokens.append(await _granted_within(g.servers["g1-0"].address, g.app, name))
    assert tokens[-1] > floor, format_token(tokens[-1])
    g.servers["g1-0"].kill()
    await wait_until(lambda: g.is_role("g1-1", "primary"), 60, "g1's standby to be promoted")
    tokens.append(await _granted_within(g.servers["g1-1"].address, g.app, name))
    _rising(name, tokens)
    assert epoch_of(tokens[-1]) > epoch_of(tokens[-2]), [format_token(t) for t in tokens]


async def _detach_g1s_standby(g, own: str, moved: str) -> list[int]:
    """Once g1's standby replicates through its relay, grant ``own`` on g1 and ``moved`` on g0, then
    detach the standby (its replication link cut, its attempts to attach again held): the tokens
    of ``own`` so far."""
    relay = g.relays["g1-0"]
    await wait_until(lambda: asyncio.to_thread(relay.count, "replication"), 30,
                     "g1's standby to replicate through the relay")
    tokens = [await _granted_within(g.servers["g1-0"].address, g.app, own)]
    await _granted_on_g0(g, moved)
    relay.blackhole("replication")
    relay.cut("replication")
    return tokens


async def test_a_detached_standby_promoted_after_a_move_keeps_its_groups_own_tokens_rising(groups_of):
    """g1's standby is detached (its replication link cut) while a slot moves from g0 (epoch 41) to
    g1 (epoch 2): g1's primary adopts epoch 41 with the import and grants a name of its own at 41;
    it is then killed.  The standby, promoted, must grant that name above 41: it took the flip,
    whose floor on the moved range names epoch 41, so etcd's 41 is credible to it and it bids
    above the floor's epoch.  Held on the code before too, though by a narrower margin: it did not
    believe etcd's 41 (it had seen 2) and was promoted at epoch 3, serving the group's own names
    there until its settle of the moved range's floor raised it to 42 (16 ms later, inside the
    promotion grace that holds new grants)."""
    g = await groups_of((1, 2), relayed=("g1-0",), **HIGH)
    moved = names_owned_by(g.shard_map, "g0", 1, "detachedmove")[0]
    own = names_owned_by(g.shard_map, "g1", 1, "detachedown")[0]
    tokens = await _detach_g1s_standby(g, own, moved)
    await g.move(slot_of(moved), "g1")
    tokens.append(await _granted_within(g.servers["g1-0"].address, g.app, own))
    assert epoch_of(tokens[-1]) == 41, format_token(tokens[-1])
    stored = await load_from_etcd(g.url)
    try:
        flipped = (await stored.read_existing())[0]
    finally:
        await stored.gateway.close()
    await wait_until(lambda: g.serves_epoch("g1-1", flipped.epoch), 30, "g1's standby to take the flip")
    g.servers["g1-0"].kill()
    await wait_until(lambda: g.is_role("g1-1", "primary"), 60, "g1's standby to be promoted")
    tokens.append(await _granted_within(g.servers["g1-1"].address, g.app, own))
    _rising(own, tokens)


async def test_a_standby_detached_over_an_import_and_promoted_before_the_flip_keeps_its_groups_own_tokens_rising(
        groups_of):
    """g1's standby is detached (its replication link cut); a slot of g0 (epoch 41) is marked moving
    to g1 (epoch 2) and one page exported and imported (a mover stopped before its flip): g1's
    primary adopts epoch 41 and grants a name of its own at 41.  It is killed; the standby, which
    never heard of 41, is promoted.  It must grant the group's own name above 41: the map marks a
    move into its group, so etcd's epoch (41, raised by the import) is credible to it whatever its
    size, and it bids above.  On the code before, etcd's 41 was more than 16 above what it had seen:
    it bid at 3 and granted the name at 3/100002 after 41/2."""
    g = await groups_of((1, 2), relayed=("g1-0",), **HIGH)
    moved = names_owned_by(g.shard_map, "g0", 1, "preflipmove")[0]
    slot = slot_of(moved)
    own = names_owned_by(g.shard_map, "g1", 1, "preflipown")[0]
    tokens = await _detach_g1s_standby(g, own, moved)
    stored = await load_from_etcd(g.url)
    try:
        shard_map, revision = await stored.read_existing()
        marked = mark_moving(shard_map, slot, slot, "g1")
        await stored.replace(revision, shard_map, marked)
    finally:
        await stored.gateway.close()
    for node in ("g0-0", "g1-0", "g1-1"):
        await wait_until(lambda node=node: g.serves_epoch(node, marked.epoch), 20, f"{node} to follow the mark")
    admin = g.creds.token("admin")
    exporter = await RawNode.open(g.servers["g0-0"].address, token=admin)
    importer = await RawNode.open(g.servers["g1-0"].address, token=admin)
    try:
        page = await exporter.request(OP_SLOT_EXPORT, slot, slot, None)
        await importer.request(OP_SLOT_IMPORT, slot, slot, msgpack.packb(page))
    finally:
        await exporter.close()
        await importer.close()
    tokens.append(await _granted_within(g.servers["g1-0"].address, g.app, own))
    assert epoch_of(tokens[-1]) == 41, format_token(tokens[-1])
    g.servers["g1-0"].kill()
    await wait_until(lambda: g.is_role("g1-1", "primary"), 60, "g1's standby to be promoted")
    tokens.append(await _granted_within(g.servers["g1-1"].address, g.app, own))
    _rising(own, tokens)
