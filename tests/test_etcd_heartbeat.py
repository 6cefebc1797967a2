"""The heartbeat rule of an etcd group (fastlock/coordination/etcd.py, module docstring).

A standby deletes the primary key once the primary's heartbeat (``PREFIX/heartbeat``) has
stood for one TTL on its own clock, by a transaction comparing the heartbeat's revision;
the primary counts its validity from its last successful heartbeat as well as from its
lease.  To show the rule alone frees the key, several tests keep the silent primary's etcd
lease alive from the test (as a renewal still in flight would): only a standby's delete can
then free it.  Arbiters in this process and real ``fastlock serve`` processes, against the
session's etcd (tests/etcdserver.py).  Skipped without the etcd binary unless
FASTLOCK_REQUIRE_ETCD=1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter

import pytest
from conftest import wait_until
from etcdserver import unique_prefix
from test_coordination_etcd import TTL_MS, Events, arbiter, gateway_to, pair, primary_and_standby, silence
from test_etcd_failover import LOCK_TTL_MS, Group, grant, refuses, three

import fastlock
from fastlock._testbase import HistoryChecker
from fastlock._testbase.cluster import poll, status_of
from fastlock._testbase.proxy import TcpProxy
from fastlock.coordination import EtcdArbiter, EtcdGateway
from fastlock.errors import FastlockError
from fastlock.tokens import epoch_of
from fastlock.units import monotonic_ms, parse_address

pytest.importorskip("httpx")


@pytest.fixture(autouse=True)
def _one_loop(request):
    """These tests start processes or time etcd leases: run them on one event loop only."""
    if "uvloop" in request.node.name:
        pytest.skip("etcd heartbeat tests run on the asyncio loop only")


@contextlib.asynccontextmanager
async def lease_kept_alive(gateway: EtcdGateway, lease: int):
    """Renew ``lease`` every 200 ms while the block runs (bounded: at most 300 renewals)."""
    async def renew() -> None:
        for _ in range(300):
            await gateway.keepalive(lease)
            await asyncio.sleep(0.2)

    task = asyncio.ensure_future(renew())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


class Clock:
    """A monotonic clock (ms) a test can move forward."""

    def __init__(self) -> None:
        self.offset = 0

    def __call__(self) -> int:
        return monotonic_ms() + self.offset


async def test_a_silent_primary_whose_lease_lives_is_deleted_after_one_ttl(etcd):
    """Primary a stops (its steps end) while its etcd lease is kept alive: standby b deletes
    the key once a's heartbeat has stood for a TTL and takes it; a had stopped granting by
    then (its validity is the earlier of its lease's and its last heartbeat's)."""
    a, ea, b, eb = pair(etcd.address, etcd.address)
    try:
        await primary_and_standby(a, b)
        silence(a)
        async with lease_kept_alive(b.gateway, a.lease):
            await wait_until(lambda: b.holding, 10, "b to take the key")
        assert b.heartbeat_deletes == 1 and b.epoch == a.epoch + 1
        assert not a.may_grant()
        assert ea.first("fenced") is not None and ea.first("fenced") <= eb.first("elected")
        st = b.status()["heartbeat"]
        assert st["rule"] and st["deletes"] == 1
        await a.step()  # a wakes up: its heartbeat fails, the key is b's
        assert not a.holding and a.stepped_down and ea.first("lost") is not None
    finally:
        await a.close(revoke=False)
        await b.close()


async def test_a_primary_whose_heartbeats_fail_stops_granting_though_its_lease_is_renewed(etcd):
    """The primary's validity is the earlier of its lease's and its last heartbeat's: with its
    heartbeats failing (its transaction compares another create_revision, as after its key was
    deleted and taken again) and its lease still renewed, it stops granting while its lease
    alone would still let it."""
    a, ea = arbiter(etcd.address, unique_prefix(), "a")
    try:
        a.start()
        await wait_until(lambda: a.holding and a.may_grant(), 5, "a to take the key")
        a._primary_rev += 1_000_000
        # (its listener hears of the fence from the fence timer, which may run a moment after
        # may_grant turned False on a loaded machine: the wait includes it)
        await wait_until(lambda: not a.may_grant() and ea.first("fenced") is not None
                         and a.clock() < a._renewed_at + a.ttl_ms - a.margin_ms, 10,
                         "a to stop granting, and say so, with its lease still valid")
        assert a.holding
    finally:
        await a.close()


async def test_a_primary_cut_off_from_etcd_stops_before_a_standby_deletes_its_key(etcd):
    """Primary a reaches etcd through a proxy that goes silent while its lease is kept alive
    (from the test, straight to etcd): its heartbeats fail, it fences itself, and only then
    does standby b delete the key and take it."""
    with TcpProxy(etcd.address) as proxy:
        a, ea, b, eb = pair(proxy.address, etcd.address)
        try:
            await primary_and_standby(a, b)
            proxy.blackhole()
            async with lease_kept_alive(b.gateway, a.lease):
                await wait_until(lambda: b.holding, 10, "b to take the key")
            assert b.heartbeat_deletes == 1
            fenced_at, elected_at = ea.first("fenced"), eb.first("elected")
            assert fenced_at is not None and fenced_at < elected_at
            assert not a.may_grant()
            proxy.heal()
            await wait_until(lambda: a.stepped_down, 10, "a to learn it lost the key")
            assert not a.holding and b.epoch == a.epoch + 1
        finally:
            await a.close(revoke=False)
            await b.close()


async def test_a_heartbeat_racing_the_delete_exactly_one_wins(etcd):
    """b's sighting of the heartbeat is made one TTL old (its clock moved on), then a's
    heartbeat and b's delete are sent at once, five times: each time exactly one of them
    lands, and a holds the key exactly when its heartbeat landed."""
    for _ in range(5):
        clock = Clock()
        prefix = unique_prefix()
        a, _ = arbiter(etcd.address, prefix, "a")
        eb = Events()
        b = EtcdArbiter(gateway_to(etcd.address), prefix, "b", "127.0.0.1:7001",
                        eb, ttl_ms=TTL_MS, clock=clock)
        try:
            await a.step()
            assert a.holding
            await b.step()  # b sees a's heartbeat
            assert b.primary is not None and b.primary.node == "a" and b._beat is not None
            clock.offset = TTL_MS
            beat_before = a._beat_at
            await asyncio.gather(a.step(), b._delete_silent(await b.gateway.get(b.primary_key)))
            beat_landed = a._beat_at != beat_before
            deleted = b.heartbeat_deletes == 1
            assert beat_landed != deleted, (beat_landed, deleted)
            await a.step()
            assert a.holding == beat_landed
        finally:
            await a.close()
            await b.close()


async def test_a_primary_without_the_rule_is_left_to_its_lease(etcd):
    """A primary that writes no heartbeat (heartbeat=False, as a version before the rule):
    its key states no heartbeat TTL, so a standby never deletes it while the lease lives,
    however long its heartbeat stands; once the lease goes the standby takes the key."""
    prefix = unique_prefix()
    a, _ = arbiter(etcd.address, prefix, "a", heartbeat=False)
    b, _ = arbiter(etcd.address, prefix, "b")
    try:
        await primary_and_standby(a, b)
        silence(a)
        async with lease_kept_alive(b.gateway, a.lease):
            await wait_until(lambda: b._beat is not None and b.clock() - b._beat.seen_at > 3 * TTL_MS, 10,
                             "b to have seen the heartbeat stand for three TTLs")
            assert not b.holding and b.primary is not None and b.primary.node == "a"
        await wait_until(lambda: b.holding, 10, "b to take the key once a's lease runs out")
        assert b.heartbeat_deletes == 0
    finally:
        await a.close(revoke=False)
        await b.close()


async def test_a_standby_without_the_rule_never_deletes(etcd):
    """A standby with heartbeat=False (as a version before the rule) waits for the lease."""
    prefix = unique_prefix()
    a, _ = arbiter(etcd.address, prefix, "a")
    b, _ = arbiter(etcd.address, prefix, "b", heartbeat=False)
    try:
        await primary_and_standby(a, b)
        silence(a)
        async with lease_kept_alive(a.gateway, a.lease):
            for _ in range(3 * TTL_MS // 250):  # as many steps as three TTLs hold
                await b.step()
            assert not b.holding
        await wait_until(lambda: b.holding, 10, "b to take the key once a's lease runs out")
        assert b.heartbeat_deletes == 0
    finally:
        await a.close(revoke=False)
        await b.close()


async def test_a_standby_waits_the_primarys_longer_ttl(etcd):
    """The primary key states its TTL: a standby with a shorter TTL of its own waits the
    primary's before it deletes."""
    prefix = unique_prefix()
    clock = Clock()
    a = EtcdArbiter(gateway_to(etcd.address), prefix, "a", "127.0.0.1:7000",
                    Events(), ttl_ms=4000)
    b = EtcdArbiter(gateway_to(etcd.address), prefix, "b", "127.0.0.1:7001",
                    Events(), ttl_ms=TTL_MS, clock=clock)
    try:
        await a.step()
        assert json.loads((await b.gateway.get(b.primary_key)).value)["heartbeat"] == 4000
        await b.step()
        clock.offset = 2 * TTL_MS  # past b's own TTL, not past a's
        assert not await b._delete_silent(await b.gateway.get(b.primary_key))
        clock.offset = 4000
        assert await b._delete_silent(await b.gateway.get(b.primary_key))
    finally:
        await a.close(revoke=False)
        await b.close()


# -- real processes ---------------------------------------------------------------------------

@pytest.fixture
def group(cluster, etcd):
    return Group(cluster, etcd)


async def _primary_lease(group: Group) -> int:
    kv = await group_gateway(group).get(group.prefix + "/primary")
    assert kv is not None and kv.lease
    return kv.lease


def group_gateway(group: Group) -> EtcdGateway:
    if not hasattr(group, "_test_gateway"):
        group._test_gateway = EtcdGateway([parse_address(group.etcd.address)], timeout_s=1.0)
    return group._test_gateway


async def test_sigkill_of_the_primary_a_standby_deletes_its_key(group):
    """kill -9 of the primary while its etcd lease is kept alive: a standby deletes the key
    by the heartbeat rule (its log says so) and another node is primary at a higher epoch."""
    names = three(group)
    first, st = await group.primary()
    rest = [n for n in names if n != first]
    await group.followers_of(first, rest)
    before = await grant(group.nodes[first].address, "k1")
    gw = group_gateway(group)
    try:
        async with lease_kept_alive(gw, await _primary_lease(group)):
            group.nodes[first].kill()
            second, st2 = await group.primary(rest, timeout=20)
        assert st2["epoch"] > st["epoch"]
        assert any("its heartbeat stood at revision" in line for n in rest for line in group.nodes[n].lines)
        assert await grant(group.nodes[second].address, "k2") > before
    finally:
        await gw.close()


async def test_sigstop_of_the_primary_beyond_the_ttl_it_grants_nothing_after(group):
    """SIGSTOP of the primary for longer than the TTL (its lease kept alive): a standby
    deletes its key and is primary; after SIGCONT the old primary grants nothing and steps
    down.  Clients taking locks throughout: never two holders of a lock at once, tokens only
    grow, and grants resume at the new epoch."""
    names = three(group)
    first, st = await group.primary()
    rest = [n for n in names if n != first]
    await group.followers_of(first, rest)
    before = await grant(group.nodes[first].address, "k1")
    old = group.nodes[first]
    addresses = [srv.address for srv in group.nodes.values()]
    history = HistoryChecker()
    epochs: Counter[int] = Counter()
    stop = asyncio.Event()

    async def worker(i: int) -> None:
        async with fastlock.connect(*addresses, request_timeout=2.0) as client:
            while not stop.is_set():
                try:
                    lease = await client.acquire(f"h{i % 3}", ttl=LOCK_TTL_MS / 1000, wait=5.0)
                except FastlockError:
                    continue
                history.held(lease.name, lease.fencing_token, time.monotonic())
                epochs[epoch_of(lease.fencing_token)] += 1
                await asyncio.sleep(0.005)
                history.released(lease.name, lease.fencing_token, time.monotonic())
                try:
                    await client.release(lease)
                except FastlockError:
                    pass  # not replicated before the freeze: the new primary lets it expire

    async def grants_in_epochs(n: int, what: str) -> None:
        await poll(lambda: asyncio.sleep(0, sum(c >= 10 for c in epochs.values())), lambda k: k >= n,
                   timeout=20, what=what)

    gw = group_gateway(group)
    workers = [asyncio.ensure_future(worker(i)) for i in range(4)]
    try:
        await grants_in_epochs(1, "grants")
        async with lease_kept_alive(gw, await _primary_lease(group)):
            old.pause()
            try:
                second, st2 = await group.primary(rest, timeout=20)
                assert st2["epoch"] > st["epoch"]
                await grants_in_epochs(2, "grants at the new epoch")
            finally:
                old.resume()
            await refuses(old.address, "fresh", or_closes=True)
            await poll(lambda: status_of(old.address), lambda s: s["role"] in ("deposed", "standby"), timeout=10,
                       what="the old primary to step down")
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), 20)
        await gw.close()
    assert history.check() >= 20
    assert any("its heartbeat stood at revision" in line for n in rest for line in group.nodes[n].lines)
    await refuses(old.address, "fresh")
    assert await grant(group.nodes[second].address, "k2") > before


def stopped_for(srv, seconds: float) -> float:
    """SIGSTOP ``srv``, SIGCONT it ``seconds`` later (in a thread: not delayed by the test's
    loop); the time between the two signals (seconds)."""
    srv.pause()
    stopped = time.monotonic()
    try:
        time.sleep(seconds)
    finally:
        srv.resume()
    return time.monotonic() - stopped


async def test_a_stall_under_the_ttl_keeps_the_primary_a_stall_of_three_ttls_deposes_it(group):
    """Under load (four clients taking locks), SIGSTOP of the primary for 0.6 TTL, five times:
    each time its next heartbeat (sent as it resumes, between its steps) lands on the primary
    key its bid created, no standby deletes the key, and it grants again at its epoch.  Then
    SIGSTOP for three TTLs: a standby deletes its key and is primary at a higher epoch, and
    the old primary steps down.  TTL 2 s: a stall and the etcd requests after it stay in
    proportion on a loaded machine (a request there can take a few hundred ms)."""
    ttl_s = 2
    names = ["a", "b", "c"]
    for name in names:
        group.start(name, ttl_s=ttl_s)
    first, st = await group.primary(timeout=20)
    rest = [n for n in names if n != first]
    await group.followers_of(first, rest, timeout=20)
    old = group.nodes[first]
    addresses = [srv.address for srv in group.nodes.values()]
    epochs: Counter[int] = Counter()
    stop = asyncio.Event()

    async def worker(i: int) -> None:
        async with fastlock.connect(*addresses, request_timeout=2.0) as client:
            while not stop.is_set():
                try:
                    lease = await client.acquire(f"s{i}", ttl=LOCK_TTL_MS / 1000, wait=5.0)
                    epochs[epoch_of(lease.fencing_token)] += 1
                    await client.release(lease)
                except FastlockError:
                    await asyncio.sleep(0.01)

    async def grants_at(epoch: int, more: int, what: str) -> None:
        target = epochs[epoch] + more
        await poll(lambda: asyncio.sleep(0, epochs[epoch]), lambda n: n >= target, timeout=20, what=what)

    gw = group_gateway(group)
    workers = [asyncio.ensure_future(worker(i)) for i in range(4)]
    try:
        await grants_at(st["epoch"], 20, "grants before the stalls")
        key = await gw.get(group.prefix + "/primary")
        assert key is not None
        stalls = []
        for trial in range(5):
            beat = await gw.get(group.prefix + "/heartbeat")
            assert beat is not None
            stalls.append(await asyncio.to_thread(stopped_for, old, 0.6 * ttl_s))
            # the first heartbeat after the stall: on the same primary key, or a new key (deposed)
            await poll(lambda: gw.get(group.prefix + "/heartbeat"),
                       lambda kv, seen=beat.mod_revision: kv is not None and kv.mod_revision > seen, timeout=10,
                       what="a heartbeat after the stall")
            now = await gw.get(group.prefix + "/primary")
            assert now is not None and now.create_revision == key.create_revision, (
                f"trial {trial}: the primary was deposed by a stall of {stalls[-1]:.3f} s (stalls {stalls})")
            await grants_at(st["epoch"], 5, f"grants after stall {trial}")
        deletes = [(await status_of(group.nodes[n].address))["coordinator"]["heartbeat"]["deletes"] for n in rest]
        assert deletes == [0, 0]
        assert (await status_of(old.address))["role"] == "primary"
        assert len(epochs) == 1, epochs

        async with lease_kept_alive(gw, key.lease):  # only the heartbeat rule can free the key
            long_stall = await asyncio.to_thread(stopped_for, old, 3.0 * ttl_s)
            second, st2 = await group.primary(rest, timeout=20)
        assert st2["epoch"] > st["epoch"], long_stall
        await poll(lambda: status_of(old.address), lambda s: s["role"] in ("deposed", "standby"), timeout=10,
                   what="the old primary to step down")
        await grants_at(st2["epoch"], 5, "grants at the new epoch")
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), 20)
        await gw.close()
    assert any("its heartbeat stood at revision" in line for n in rest for line in group.nodes[n].lines)
