"""Deadlock detection across shard groups for incremental acquires (edge chasing):
fastlock.server.edgechase (WAIT_IDENTITY, WAITS_FOR) and fastlock.client.edgechase (the
probes a ShardedClient's waiting acquires run).  Real shard servers on free ports."""

from __future__ import annotations

import asyncio
import os

import pytest
from conftest import wait_until
from test_limits import Raw, error_of

import fastlock
from fastlock import protocol as P
from fastlock._testbase.shards import ShardSet, names_owned_by
from fastlock.auth import generate
from fastlock.client.acquire import actor_id
from fastlock.client.sharded import ShardedClient
from fastlock.errors import (
    DeadlockDetected,
    InvalidArgument,
    LimitExceeded,
    PermissionDenied,
    WrongArgumentType,
)
from fastlock.protocol.ops import OP_WAIT_IDENTITY, OP_WAITS_FOR
from fastlock.server.edgechase import MAX_PROBE_DEPTH, PROBES_PER_SECOND, wait_id

#: generous bounds: a cycle is broken about one deadlock timeout (1 s) after it closes
BOUND = 30.0


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three lone shard servers, g0, g1 and g2."""
    with ShardSet.start(tmp_path_factory.mktemp("edges"), 3) as shard_set:
        yield shard_set


#: seconds between two waits whose order a test checks: a wait's start is a server's wall-clock
#: millisecond (each server's from its own monotonic clock and an offset fixed at its start, so two
#: servers' numbers for one instant can differ by a millisecond or two), and waits that start in the
#: same millisecond are ordered by their wait ids, which are random
APART_S = 0.02


def owned(shards: ShardSet, group: str, prefix: str) -> str:
    return names_owned_by(shards.shard_map, group, 1, prefix)[0]


async def waiting_on(client: ShardedClient, name: str, count: int = 1) -> None:
    """Until ``name`` has ``count`` waiters (asked of its group's server)."""
    async def queued() -> bool:
        return len((await client.contenders(name))["waiters"]) >= count
    await wait_until(queued, BOUND, f"{count} waiter(s) on {name}")


async def hold_then_wait(client: ShardedClient, first: str, second: str, holding: asyncio.Event,
                         actors: list[int] | None = None, go: asyncio.Event | None = None):
    """One task: hold ``first``, then (once ``go`` is set) wait for ``second`` (an incremental
    acquire); its actor (the party's number within the client) appended to ``actors``."""
    held = await client.acquire(first, ttl=60.0)
    if actors is not None:
        actors.append(actor_id(client.client_for(second).connector))
    holding.set()
    if go is not None:
        await go.wait()
    try:
        return await client.acquire(second, ttl=60.0, wait=BOUND * 2)
    finally:
        await client.release(held)


async def failed_first(tasks: set[asyncio.Task]) -> set[asyncio.Task]:
    """Wait (at most BOUND) until one of ``tasks`` ends; the tasks that have ended with an
    exception by then.  A victim's release can grant the older wait in the same loop turn, so
    the older task may have ended too -- with a lease, never with an error."""
    await asyncio.wait(tasks, timeout=BOUND, return_when=asyncio.FIRST_COMPLETED)
    return {t for t in tasks if t.done() and t.exception() is not None}


async def test_a_two_group_cycle_fails_the_youngest_wait_only(shards, loop_errors):
    a, b = owned(shards, "g0", "two/a"), owned(shards, "g1", "two/b")
    async with fastlock.connect(shards.address("g0"), client_name="one") as one, \
            fastlock.connect(shards.address("g1"), client_name="two") as two:
        assert isinstance(one, ShardedClient) and isinstance(two, ShardedClient)
        held_a, held_b = asyncio.Event(), asyncio.Event()
        go_first, go_second = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(hold_then_wait(one, a, b, held_a, go=go_first))
        second = asyncio.create_task(hold_then_wait(two, b, a, held_b, go=go_second))
        await held_a.wait()
        await held_b.wait()
        go_first.set()
        await waiting_on(one, b)  # the first waits; the second's wait, later, closes the cycle
        await asyncio.sleep(APART_S)
        go_second.set()
        assert await failed_first({first, second}) == {second}
        with pytest.raises(DeadlockDetected, match="deadlock across shard groups"):
            second.result()
        # the victim let go of b (its task's finally): the older wait is granted
        lease = await asyncio.wait_for(first, BOUND)
        assert lease.name == b
        await one.release(lease)
        assert (one.edges.victims, two.edges.victims) == (0, 1)


async def test_a_three_group_cycle_is_broken_once(shards, loop_errors):
    names = [owned(shards, f"g{k}", f"three/{k}/") for k in range(3)]
    clients = [await fastlock.connect(shards.address(f"g{k}"), client_name=f"c{k}") for k in range(3)]
    try:
        tasks, go = [], [asyncio.Event() for _ in range(3)]
        for k in range(3):
            holding = asyncio.Event()
            tasks.append(asyncio.create_task(hold_then_wait(clients[k], names[k], names[(k + 1) % 3], holding,
                                                            go=go[k])))
            await holding.wait()
        for k in range(3):  # the waits in turn: c0's first, c2's last
            go[k].set()
            if k < 2:
                await waiting_on(clients[k], names[k + 1])
                await asyncio.sleep(APART_S)
        assert await failed_first(set(tasks)) == {tasks[2]}  # the last wait closed the cycle: the youngest
        with pytest.raises(DeadlockDetected):
            tasks[2].result()
        for k in (1, 0):  # c2 let go of names[2]: c1 gets it, then lets go of names[1] for c0
            lease = await asyncio.wait_for(tasks[k], BOUND)
            await clients[k].release(lease)
        assert [c.edges.victims for c in clients] == [0, 0, 1]
    finally:
        for c in clients:
            await c.close()


async def test_a_plain_chain_across_groups_is_no_deadlock(shards, loop_errors):
    names = [owned(shards, f"g{k}", f"chain/{k}/") for k in range(3)]
    clients = [await fastlock.connect(shards.address(f"g{k}"), client_name=f"c{k}") for k in range(3)]
    try:
        last = await clients[2].acquire(names[2], ttl=60.0)  # held; its holder waits for nothing
        tasks, go = [], [asyncio.Event() for _ in range(2)]
        for k in range(2):
            holding = asyncio.Event()
            tasks.append(asyncio.create_task(hold_then_wait(clients[k], names[k], names[k + 1], holding, go=go[k])))
            await holding.wait()
        for k in range(2):
            go[k].set()
            await waiting_on(clients[k], names[k + 1])
        probes = [c.edges.probes for c in clients[:2]]
        # both waiters probe (each saw the chain, hop by hop) three times: no victim
        await wait_until(lambda: all(c.edges.probes >= p + 3 for c, p in zip(clients, probes)), BOUND, "probes")
        assert not any(t.done() for t in tasks)
        await clients[2].release(last)
        for k in (1, 0):
            lease = await asyncio.wait_for(tasks[k], BOUND)
            await clients[k].release(lease)
        assert [c.edges.victims for c in clients] == [0, 0, 0]
    finally:
        for c in clients:
            await c.close()


@pytest.fixture(scope="module")
def acl_shards(tmp_path_factory):
    """Two shard servers with credentials: principals "alice" (names a/...) and "mallory" (m/...)."""
    root = tmp_path_factory.mktemp("edges-acl")
    paths = generate(root / "creds", clients=[("alice", "a/"), ("mallory", "m/")], replicas=[], admins=["admin"])
    tokens = {who: open(paths[who]).read().strip() for who in ("alice", "mallory")}
    with ShardSet.start(root / "shards", 2, args=["--credentials", str(root / "creds" / "credentials.toml")]) as s:
        yield s, tokens


def test_bad_identities_and_probes_are_refused_and_change_nothing(acl_shards):
    shards, tokens = acl_shards
    with Raw(shards.address("g0"), credential=tokens["mallory"]) as peer:
        code, _ = error_of(peer.call(OP_WAITS_FOR, b"x" * 16, 1, 0))
        assert code == PermissionDenied.code  # no identity of its own: no probes
        for bad, err in ((b"short", InvalidArgument), (b"x" * 65, InvalidArgument), ("text" * 8, WrongArgumentType),
                         (None, WrongArgumentType)):
            assert error_of(peer.call(OP_WAIT_IDENTITY, bad))[0] == err.code
        secret = os.urandom(32)
        assert peer.call(OP_WAIT_IDENTITY, secret)[1:] == [0, wait_id(secret)]
        assert peer.call(OP_WAIT_IDENTITY, secret)[1:] == [0, wait_id(secret)]  # the same again: kept
        assert error_of(peer.call(OP_WAIT_IDENTITY, os.urandom(32)))[0] == InvalidArgument.code
        for bad_hops, err in ((MAX_PROBE_DEPTH + 1, InvalidArgument), (10**12, InvalidArgument),
                              (-1, InvalidArgument), (True, WrongArgumentType), ("1", WrongArgumentType)):
            assert error_of(peer.call(OP_WAITS_FOR, wait_id(secret), 1, bad_hops))[0] == err.code
        for bad_id in (b"x" * 15, b"x" * 17, "x" * 16, None):
            assert error_of(peer.call(OP_WAITS_FOR, bad_id, 1, 0))[0] in (InvalidArgument.code,
                                                                         WrongArgumentType.code)
        # an unknown party waits for nothing
        assert peer.call(OP_WAITS_FOR, os.urandom(16), 1, 0)[1:] == [0, {"since_ms": None, "for": []}]
        # a principal's probes per second are bounded (pipelined past the burst: some refused)
        count = PROBES_PER_SECOND + 50
        for _ in range(count):
            peer.send(OP_WAITS_FOR, os.urandom(16), 1, 0)
        statuses = [peer.recv()[1] for _ in range(count)]
        assert LimitExceeded.code in statuses and 0 in statuses
        assert peer.call(P.OP_PING)[1] == 0


async def test_another_principals_probe_reads_only(acl_shards, loop_errors):
    """Mallory probes alice's waiting party (its wait id, learned here from the client), with
    every hop count allowed: the answers name opaque ids only, and alice's cycle is still
    broken once, by alice's own youngest wait."""
    shards, tokens = acl_shards
    a, b = owned(shards, "g0", "a/x"), owned(shards, "g1", "a/y")
    async with fastlock.connect(shards.address("g0"), auth=tokens["alice"], client_name="one") as one, \
            fastlock.connect(shards.address("g0"), auth=tokens["alice"], client_name="two") as two:
        held_a, held_b = asyncio.Event(), asyncio.Event()
        actors: list[int] = []
        go_first, go_second = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(hold_then_wait(one, a, b, held_a, actors, go_first))
        second = asyncio.create_task(hold_then_wait(two, b, a, held_b, go=go_second))
        await held_a.wait()
        await held_b.wait()
        go_first.set()
        await wait_until(lambda: one.edges.wait_id is not None, BOUND, "alice's wait id")
        await waiting_on(one, b)
        with Raw(shards.address("g1"), credential=tokens["mallory"]) as peer:
            peer.call(OP_WAIT_IDENTITY, os.urandom(32))
            for hops in range(MAX_PROBE_DEPTH + 1):
                status, reply = peer.call(OP_WAITS_FOR, one.edges.wait_id, actors[0], hops)[1:]
                assert status == 0 and type(reply["since_ms"]) is int
                assert reply["for"] == [[two.edges.wait_id, reply["for"][0][1]]]  # b's holder: opaque ids only
            assert error_of(peer.call(OP_WAITS_FOR, one.edges.wait_id, actors[0], MAX_PROBE_DEPTH + 1))[0] \
                == InvalidArgument.code
        assert not first.done() and not second.done()
        go_second.set()
        assert await failed_first({first, second}) == {second}
        with pytest.raises(DeadlockDetected):
            second.result()
        lease = await asyncio.wait_for(first, BOUND)
        await one.release(lease)
