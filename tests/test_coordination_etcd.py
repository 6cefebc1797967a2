"""The etcd arbiter (fastlock.coordination.etcd) against a real etcd member.

Each test runs arbiters in this process against the session's etcd
(tests/etcdserver.py) under its own key prefix, with a 1 s lease TTL: who
takes the primary key, with which epoch, when a holder stops granting, and
that a node cut off from etcd stops granting before any other node can take
the key.  Skipped without the etcd binary unless FASTLOCK_REQUIRE_ETCD=1.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import types

import pytest
from conftest import wait_until
from etcdserver import unique_prefix

from fastlock._testbase.proxy import TcpProxy
from fastlock.coordination import EtcdArbiter, EtcdGateway, NodeIdInUse, PrimaryRecord, parse_coordinator
from fastlock.coordination.gateway import b64
from fastlock.errors import InvalidArgument
from fastlock.roles import Role
from fastlock.units import monotonic_ms, parse_address

pytest.importorskip("httpx")

TTL_MS = 1000
#: seconds one etcd request of a test's arbiter may take: the gateway's default, as for a node with
#: a 2 s TTL.  A loaded machine's etcd can take longer than 0.3 s to answer, and a test calling
#: ``step()`` would see that as etcd unavailable; a test that needs etcd unreachable cuts the
#: path with a TcpProxy
GATEWAY_TIMEOUT_S = 1.0


class Events:
    """An arbiter listener that records what it is told, with the time (monotonic ms)."""

    def __init__(self, position=lambda: 0, min_epoch=lambda: 0, candidate=lambda: True) -> None:
        self.log: list[tuple[int, str, object]] = []
        self.position, self.min_epoch, self.candidate = position, min_epoch, candidate

    def on_elected(self, epoch: int) -> None:
        self.log.append((monotonic_ms(), "elected", epoch))

    def on_fenced(self, fenced: bool) -> None:
        self.log.append((monotonic_ms(), "fenced", fenced))

    def on_lost(self, why: str) -> None:
        self.log.append((monotonic_ms(), "lost", why))

    def on_primary(self, primary: PrimaryRecord | None) -> None:
        self.log.append((monotonic_ms(), "primary", primary))

    def on_refused(self, why: str) -> None:
        self.log.append((monotonic_ms(), "refused", why))

    def first(self, kind: str) -> int | None:
        return next((t for t, k, _ in self.log if k == kind), None)


def gateway_to(address: str) -> EtcdGateway:
    """A gateway to etcd at ``address`` (``host:port``) whose requests may take :data:`GATEWAY_TIMEOUT_S`."""
    return EtcdGateway([parse_address(address)], timeout_s=GATEWAY_TIMEOUT_S)


def arbiter(address: str, prefix: str, node: str, position=lambda: 0, min_epoch=lambda: 0, candidate=lambda: True,
            ttl_ms: int = TTL_MS, **kwargs) -> tuple[EtcdArbiter, Events]:
    events = Events(position, min_epoch, candidate)
    arb = EtcdArbiter(gateway_to(address),
                      prefix, node, f"127.0.0.1:{7000 + len(node)}", events, ttl_ms=ttl_ms, **kwargs)
    return arb, events


def pair(a_address: str, b_address: str) -> tuple[EtcdArbiter, Events, EtcdArbiter, Events]:
    """Nodes "a" and "b" on a fresh prefix, reaching etcd at the addresses given."""
    prefix = unique_prefix()
    return (*arbiter(a_address, prefix, "a"), *arbiter(b_address, prefix, "b"))


def silence(a: EtcdArbiter) -> None:
    """``a`` stops talking to etcd as a dead node would: its steps (renewals) and its
    heartbeats between steps end (no revoke)."""
    for task in (a._task, a._pulse_task):
        if task is not None:
            task.cancel()


async def primary_and_standby(a: EtcdArbiter, b: EtcdArbiter) -> None:
    """Start ``a``, wait until it holds the key, then start ``b`` and wait until it sees ``a``."""
    a.start()
    await wait_until(lambda: a.holding, 5, "a to take the key")
    b.start()
    await wait_until(lambda: b.primary is not None and b.primary.node == a.node, 5, "b to see a")


def test_parse_coordinator():
    url = parse_coordinator("etcd://10.0.0.1:2379,10.0.0.2/fastlock/prod/")
    assert url.endpoints == (("10.0.0.1", 2379), ("10.0.0.2", 2379))
    assert url.prefix == "/fastlock/prod"
    assert str(url) == "etcd://10.0.0.1:2379,10.0.0.2:2379/fastlock/prod"
    for bad in ("http://h:1/p", "etcd://h:1", "etcd://h:1/", "etcd:///p", "etcd://h:x/p", 5, "etcd://h:1/a b"):
        with pytest.raises(InvalidArgument):
            parse_coordinator(bad)


async def test_racing_nodes_one_wins_and_epochs_grow(etcd):
    prefix = unique_prefix()
    bidding = False
    nodes = [arbiter(etcd.address, prefix, f"n{i}", min_epoch=lambda: 6, candidate=lambda: bidding)
             for i in range(3)]
    try:
        for arb, _ in nodes:
            await arb.step()  # each has its lease, none bids yet (the bids race below)
        bidding = True
        results = await asyncio.gather(*(arb.bid() for arb, _ in nodes))
        assert sorted(results) == [False, False, True]
        winner = next(arb for arb, _ in nodes if arb.holding)
        assert winner.epoch == 7  # above every epoch the node has seen
        assert winner.may_grant()
        for arb, _ in nodes:
            await arb.step()
        assert all(arb.primary == winner.primary for arb, _ in nodes)
        # the winner stops cleanly (revokes): the next one takes the key at once, one epoch up
        await winner.close()
        rest = [arb for arb, _ in nodes if arb is not winner]
        for arb in rest:
            await arb.step()
        assert [arb.holding for arb in rest].count(True) == 1
        assert next(arb for arb in rest if arb.holding).epoch == 8
    finally:
        for arb, _ in nodes:
            await arb.close()


async def test_a_step_between_two_regular_ones_skips_a_fresh_renewal(etcd):
    """A standby's step right after one that renewed its lease (as its watch or a hurry runs
    one) sends no lease renewal and no member write, only the read of the primary key; the
    next regular step renews again.  Node b's TTL is 4 s (a quarter: 1 s) so that "right
    after" holds on a loaded machine; a dead primary is still replaced."""
    prefix = unique_prefix()
    a, _ = arbiter(etcd.address, prefix, "a")
    eb = Events()
    b = EtcdArbiter(gateway_to(etcd.address), prefix, "b", "127.0.0.1:7001", eb,
                    ttl_ms=4000)
    paths: list[str] = []
    call = b.gateway.call

    async def counted(path: str, body: dict) -> dict:
        paths.append(path)
        return await call(path, body)

    b.gateway.call = counted  # type: ignore[method-assign]
    try:
        a.start()
        await wait_until(lambda: a.holding, 5, "a to take the key")
        for _ in range(50):  # until a step renews (the first one does: b has no lease yet)
            paths.clear()
            await b.step()
            if "lease/keepalive" in paths or "lease/grant" in paths:
                break
        else:
            raise AssertionError("no step of b renewed its lease")
        paths.clear()
        await b.step()
        assert paths == ["kv/txn"], paths  # the primary key and its heartbeat: no renewal, no member write
        assert b.primary is not None and b.primary.node == "a"
        silence(a)  # a dies: its lease runs out in etcd
        b.start()
        await wait_until(lambda: b.holding, 10, "b to take the key")
        assert b.may_grant() and eb.first("elected") is not None
    finally:
        await a.close()
        await b.close()


async def test_dead_primary_replaced_within_ttl(etcd):
    a, ea, b, eb = pair(etcd.address, etcd.address)
    try:
        await primary_and_standby(a, b)
        # a dies: it renews no more (no revoke)
        silence(a)
        await wait_until(lambda: b.holding, 5, "b to take the key")  # how soon: python -m benches.etcd_failover
        assert b.epoch > a.epoch
        # a's own clock had closed its fence before b could take the key
        assert not a.may_grant()
        assert ea.first("fenced") is not None and ea.first("fenced") <= eb.first("elected")
        # a wakes up (as after SIGSTOP): its next step finds the role lost
        await a.step()
        assert ea.first("lost") is not None and not a.holding and a.stepped_down
    finally:
        await a.close(revoke=False)
        await b.close()


async def test_caught_up_standby_preferred(etcd):
    prefix = unique_prefix()
    positions = {"ahead": 100, "behind": 40}
    p, _ = arbiter(etcd.address, prefix, "p")
    ahead, _ = arbiter(etcd.address, prefix, "ahead", position=lambda: positions["ahead"])
    behind, eb = arbiter(etcd.address, prefix, "behind", position=lambda: positions["behind"],
                         behind_delay_ms=3000)
    try:
        await p.step()
        assert p.holding
        for arb in (behind, ahead):  # both advertise; "behind" steps first at every turn
            await arb.step()
        await p.close()  # the key is free now
        await behind.step()
        assert not behind.holding  # it waits for the caught-up one
        await ahead.step()
        assert ahead.holding
        await behind.step()
        assert behind.primary is not None and behind.primary.node == "ahead"
    finally:
        for arb in (p, ahead, behind):
            await arb.close()


async def test_behind_standby_takes_over_after_its_delay(etcd):
    prefix = unique_prefix()
    ahead, _ = arbiter(etcd.address, prefix, "ahead", position=lambda: 100, candidate=lambda: False)
    behind, _ = arbiter(etcd.address, prefix, "behind", position=lambda: 1, behind_delay_ms=300)
    try:
        await ahead.step()  # advertises, never bids (not a candidate)
        behind.start()
        t0 = time.monotonic()
        await wait_until(lambda: behind.holding, 5, "the behind standby to bid after its delay")
        assert time.monotonic() - t0 >= 0.3
    finally:
        await ahead.close()
        await behind.close()


async def test_partitioned_primary_stops_granting_before_another_takes_over(etcd):
    with TcpProxy(etcd.address) as proxy:
        a, ea, b, eb = pair(proxy.address, etcd.address)
        try:
            await primary_and_standby(a, b)
            proxy.blackhole()
            await wait_until(lambda: b.holding, 5, "b to take the key")
            fenced_at, elected_at = ea.first("fenced"), eb.first("elected")
            assert fenced_at is not None and fenced_at < elected_at
            assert not a.may_grant() and a.holding  # it cannot know yet that it lost the key
            proxy.heal()
            await wait_until(lambda: a.stepped_down, 5, "a to learn it lost the key")
            assert not a.holding and ea.first("lost") is not None
            assert b.epoch == a.epoch + 1
        finally:
            await a.close(revoke=False)
            await b.close()


async def test_etcd_restart_keeps_the_primary(etcd):
    a, ea, b, eb = pair(etcd.address, etcd.address)
    try:
        await primary_and_standby(a, b)
        epoch = a.epoch
        await asyncio.get_running_loop().run_in_executor(None, etcd.restart)
        # etcd keeps leases across a restart (and renews them): a keeps the key, nobody else bids
        await wait_until(lambda: a.last_error is None and a.may_grant(), 5, "a to renew after the restart")
        await a.step()
        await b.step()
        assert a.holding and a.epoch == epoch and not b.holding and b.primary.node == "a"
        assert eb.first("elected") is None and ea.first("lost") is None
    finally:
        await a.close()
        await b.close()


async def test_etcd_paused_fences_the_primary(etcd):
    prefix = unique_prefix()
    a, ea = arbiter(etcd.address, prefix, "a")
    try:
        a.start()
        await wait_until(lambda: a.holding, 5, "a to take the key")
        etcd.pause()
        try:
            # may_grant() turns False by the clock; the listener hears of it from the fence timer
            await wait_until(lambda: not a.may_grant() and ea.first("fenced") is not None,
                             a.ttl_ms / 1000 + 1, "a to fence itself and tell its listener")
        finally:
            etcd.resume()
        # whether etcd kept its lease or not, a either grants again with the key or has stepped down
        await wait_until(lambda: a.may_grant() or a.stepped_down, 10, "a to recover or step down")
        await a.step()
        assert a.may_grant() != a.stepped_down
    finally:
        await a.close()


async def test_garbage_in_etcd_is_not_trusted(etcd):
    prefix = unique_prefix()
    gw = EtcdGateway([("127.0.0.1", etcd.port)])
    a, _ = arbiter(etcd.address, prefix, "a")
    try:
        await gw.put(prefix + "/epoch", b"not a number")
        await gw.put(prefix + "/members/x", b"\xff" * 10)
        await a.step()
        assert a.holding and a.epoch == 1
        await a.close()
        # garbage under a live lease: followed by nobody, left to expire with its lease
        lease, _ = await gw.grant(30)
        await gw.put(prefix + "/primary", b"[1, 2", lease)
        b, eb = arbiter(etcd.address, prefix, "b")
        try:
            await b.step()
            assert not b.holding and b.primary is not None and b.primary.node == "?" and b.primary.address == ""
            # a primary key attached to no lease would never expire: removed, then the key is bid for
            await gw.revoke(lease)
            await gw.put(prefix + "/primary", b'{"node": "b", "address": "127.0.0.1:1", "epoch": 9}')
            await b.step()
            assert b.holding and b.epoch == 2
        finally:
            await b.close()
    finally:
        await a.close()
        await gw.close()


async def test_an_oversized_answer_is_refused(etcd, monkeypatch):
    from fastlock.coordination import gateway as module
    from fastlock.coordination.gateway import EtcdUnavailable

    prefix = unique_prefix()
    gw = EtcdGateway([("127.0.0.1", etcd.port)])
    try:
        await gw.put(prefix + "/big", b"x" * 20_000)
        monkeypatch.setattr(module, "MAX_RESPONSE_BYTES", 10_000)
        with pytest.raises(EtcdUnavailable, match="longer than 10000 bytes"):
            await gw.get(prefix + "/big")
    finally:
        await gw.close()


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "etcd://127.0.0.1:2379"], "needs at least one HOST:PORT and a key prefix"),
    (["--coordinator", "etcd://127.0.0.1:2379/p", "--standby-of", "127.0.0.1:1"], "exclude each other"),
    (["--coordinator", "etcd://127.0.0.1:2379/p", "--sync-standbys", "2"], "only with --replication sync"),
    (["--replication", "sync", "--sync-standbys", "2"], "only with --replication sync and --coordinator"),
    (["--node-id", "n1"], "only apply with --coordinator"),
    (["--coordinator", "etcd://127.0.0.1:2379/p", "--listen", "0.0.0.0:7420"], "needs --advertise"),
    (["--coordinator", "etcd://127.0.0.1:2379/p", "--node-id", ""], "--node-id must be printable"),
    (["--coordinator", "etcd://127.0.0.1:2379/p", "--node-id", "a\nb"], "--node-id must be printable"),
    (["--coordinator", "etcd://127.0.0.1:2379/p", "--coordinator-ttl", "1.5"], "whole seconds"),
])
def test_serve_refuses_coordinator_flags_that_cannot_work(tmp_path, flags, message):
    argv = [sys.executable, "-m", "fastlock", "serve", "--data-dir", str(tmp_path / "d"),
            "--standby-token-file", str(tmp_path / "t"), *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "d").exists()


async def test_resign_frees_the_key_at_once(etcd):
    a, ea, b, eb = pair(etcd.address, etcd.address)
    try:
        await a.step()
        assert a.holding
        await b.step()
        assert not b.holding and b.primary.node == "a"
        await a.resign()  # as after a promotion that failed
        assert not a.holding and not a.may_grant()
        await b.step()
        assert b.holding and b.epoch == a.epoch + 1
        await a.step()
        assert not a.holding and a.primary.node == "b" and ea.first("lost") is None
    finally:
        await a.close()
        await b.close()


async def test_a_watch_reports_each_change_of_the_key(etcd):
    prefix = unique_prefix()
    gw = EtcdGateway([("127.0.0.1", etcd.port)])
    seen: list[str] = []
    watch = asyncio.ensure_future(gw.watch(prefix + "/primary", seen.append))
    try:
        for _ in range(50):  # a change before the watch is created is not reported: put until one is
            await gw.put(prefix + "/primary", b"x")
            if seen:
                break
            await asyncio.sleep(0.1)
        await wait_until(lambda: "PUT" in seen, 5, "the put to be seen")
        await gw.txn([], [{"request_delete_range": {"key": b64(prefix + "/primary")}}])
        await wait_until(lambda: "DELETE" in seen, 5, "the delete to be seen")
        assert seen[-1] == "DELETE" and set(seen) == {"PUT", "DELETE"}
    finally:
        watch.cancel()
        await gw.close()


async def test_a_standby_sees_the_primary_key_freed_without_waiting_for_its_next_step(etcd):
    """Steps every quarter TTL (15 s here): the watch of the primary key runs the next step
    as soon as etcd frees it (how soon: python -m benches.etcd_failover)."""
    a, ea, b, eb = pair(etcd.address, etcd.address)
    a.timing = a.timing._replace(ttl_ms=60_000, margin_ms=15_000)
    b.timing = b.timing._replace(ttl_ms=60_000, margin_ms=15_000)
    try:
        await primary_and_standby(a, b)
        await asyncio.sleep(0.5)  # b's watch is open (its first step is over: the next one is 15 s away)
        await a.resign()  # the key is free at once
        await wait_until(lambda: b.holding, 10, "b to take the key before its next regular step")
        assert b.epoch == a.epoch + 1
    finally:
        await a.close()
        await b.close()


async def test_a_primary_below_an_epoch_another_node_has_seen_steps_down(etcd):
    """etcd lost its data: a node with no history took the key at epoch 1 while another
    node had seen epoch 11.  That node raises the group's epoch; the primary steps down
    and frees the key at its next step, and the next bid is above 11 (tokens never go
    back below what was granted before the loss)."""
    prefix = unique_prefix()
    a, ea = arbiter(etcd.address, prefix, "a")
    b, eb = arbiter(etcd.address, prefix, "b", min_epoch=lambda: 11)
    try:
        await a.step()
        assert a.holding and a.epoch == 1
        await b.raise_epoch(11)
        await b.raise_epoch(5)  # never lowers it
        await a.step()
        assert not a.holding and a.stepped_down and ea.first("lost") is not None
        await b.step()
        assert b.holding and b.epoch == 12
    finally:
        await a.close()
        await b.close()


def same_id(etcd, prefix: str, ident: str, address: str, ttl_ms: int = TTL_MS) -> EtcdArbiter:
    """An arbiter of node "n1" with data directory identity ``ident``, advertising ``address``."""
    return EtcdArbiter(gateway_to(etcd.address), prefix, "n1", address, Events(),
                       ttl_ms=ttl_ms, ident=ident)


async def live_a_and_b(etcd) -> tuple[str, EtcdArbiter, EtcdArbiter]:
    """``(prefix, a, b)``: node "n1" from data directories "dir-a" (claimed, running, the
    primary, at 127.0.0.1:7001) and "dir-b" (not started, at 127.0.0.1:7002)."""
    prefix = unique_prefix()
    a = same_id(etcd, prefix, "dir-a", "127.0.0.1:7001")
    b = same_id(etcd, prefix, "dir-b", "127.0.0.1:7002")
    await a.claim()
    a.start()
    await wait_until(lambda: a.holding, 5, "a to take the key")
    # the step its election's watch event runs rewrites its member key (its epoch): a test
    # that changes the key by hand does so after it, not racing it
    for _ in range(250):
        member = await a.gateway.get(f"{prefix}/members/n1")
        if member is not None and json.loads(member.value).get("epoch") == a.epoch:
            break
        await asyncio.sleep(0.02)
    return prefix, a, b


async def test_a_node_id_held_by_another_live_node_is_refused(etcd):
    """A second process under a live node's id (another data directory) waits twice the
    TTL for the member key's lease to run out, then refuses, naming the other node's
    address; the live node keeps its keys."""
    prefix, a, b = await live_a_and_b(etcd)
    try:
        started = monotonic_ms()
        with pytest.raises(NodeIdInUse, match=r"node id 'n1' is in use by another live node at 127\.0\.0\.1:7001"):
            await b.claim()
        assert monotonic_ms() - started >= 2 * b.ttl_ms  # it gave the key's lease a chance to run out
        member = await b.gateway.get(f"{prefix}/members/n1")
        assert member is not None and member.lease == a.lease and json.loads(member.value)["ident"] == "dir-a"
        await a.step()
        assert a.holding and a.may_grant() and not b.holding
    finally:
        await b.close()
        await a.close()


async def test_a_restart_after_a_crash_waits_for_its_own_leftover_key_to_run_out(etcd):
    """The same data directory after a crash: the new process does not revoke the old run's
    lease (a copy of the directory may be the one running); it waits for it to run out,
    then takes the member key, and the primary key the old run left is gone with that lease."""
    prefix = unique_prefix()
    old = same_id(etcd, prefix, "dir-a", "127.0.0.1:7001", ttl_ms=2_000)
    new = same_id(etcd, prefix, "dir-a", "127.0.0.1:7003", ttl_ms=2_000)
    try:
        await old.claim()
        await old.step()
        assert old.holding
        await old.close(revoke=False)  # a crash: the lease lives on
        claiming = asyncio.ensure_future(new.claim())
        await asyncio.sleep(0.3)  # a moment of the new run's waiting: the old lease is left alone
        member = await new.gateway.get(f"{prefix}/members/n1")
        assert member is not None and member.lease == old.lease and not claiming.done()
        await asyncio.wait_for(claiming, 3 * 2.0)
        member = await new.gateway.get(f"{prefix}/members/n1")
        assert member is not None and member.lease == new.lease
        assert await new.gateway.get(f"{prefix}/primary") is None  # went with the old lease
        await new.step()
        assert new.holding and new.epoch == old.epoch + 1
    finally:
        await new.close()


async def test_a_live_copy_of_a_data_directory_is_refused_and_revokes_nothing(etcd):
    """A second process from a copy of a live node's data directory (the same identity):
    the live node's lease is never revoked; the copy waits twice the TTL, then refuses,
    saying the directory looks copied."""
    prefix, a, _ = await live_a_and_b(etcd)
    copy = same_id(etcd, prefix, "dir-a", "127.0.0.1:7009")
    try:
        with pytest.raises(NodeIdInUse, match=r"in use by another live node at 127\.0\.0\.1:7001.*a copy\?"):
            await copy.claim()
        member = await copy.gateway.get(f"{prefix}/members/n1")
        assert member is not None and member.lease == a.lease
        await a.step()
        assert a.holding and a.may_grant()
    finally:
        await copy.close()
        await a.close()


async def test_another_data_directory_takes_a_dead_nodes_id_once_its_lease_runs_out(etcd):
    prefix = unique_prefix()
    old = same_id(etcd, prefix, "dir-a", "127.0.0.1:7001")
    new = same_id(etcd, prefix, "dir-b", "127.0.0.1:7002")
    try:
        await old.claim()
        await old.close(revoke=False)  # died without revoking
        await asyncio.wait_for(new.claim(), 10)
        member = await new.gateway.get(f"{prefix}/members/n1")
        assert member is not None and member.lease == new.lease and json.loads(member.value)["ident"] == "dir-b"
    finally:
        await new.close()


async def test_a_running_node_whose_id_another_live_node_took_stops(etcd):
    """The member key of a running node is deleted by hand and another data directory takes
    the id: the running node sees it held by another live lease for twice the TTL, tells
    its listener (the server stops with exit status 1) and stops stepping."""
    prefix, a, b = await live_a_and_b(etcd)
    try:
        await a.gateway.call("kv/deleterange", {"key": b64(f"{prefix}/members/n1")})
        await b.claim()
        b.start()  # renews its lease: a live node
        await wait_until(lambda: a.listener.first("refused") is not None, 10, "a to be refused")
        why = next(w for _, k, w in a.listener.log if k == "refused")
        assert "node id 'n1' is in use by another live node at 127.0.0.1:7002" in why, why
        await wait_until(lambda: a._task is None or a._task.done(), 5, "a to stop stepping")
    finally:
        await b.close()
        await a.close()


class FakeFollower:
    """A standby's follower as ``CoordinatedNode.on_primary`` drives it: where its link points,
    whether it runs, whether it synced with that primary and how far it applied."""

    def __init__(self) -> None:
        self.link = types.SimpleNamespace(primary=None)
        self.stopped = True
        self.synced = False
        self.refused = None
        self.applied_lsn = 0
        self.primary_epoch = 0

    def stop(self) -> None:
        self.stopped = True

    def start(self) -> None:
        self.stopped = False


def test_a_standby_following_the_same_primary_again_keeps_its_position():
    """A standby whose link to the primary ended follows the same primary again (etcd still
    names it): its position stays its applied LSN in that primary's log, so an in-sync standby
    does not look behind the others when it bids; a new primary's log starts it at 0 until it
    has synced there."""
    from fastlock.server.coordinated import CoordinatedNode

    follower = FakeFollower()
    server = types.SimpleNamespace(
        roles=types.SimpleNamespace(role=Role.STANDBY, primary_address=None), follower=follower,
        table=types.SimpleNamespace(epoch=3), node_state=types.SimpleNamespace(max_epoch_seen=3))
    node = CoordinatedNode.__new__(CoordinatedNode)
    node.server, node.node, node.arbiter, node.following, node._low_primary = server, "b", None, None, None
    first = PrimaryRecord("a", "127.0.0.1:7001", 3, 11)
    node.on_primary(first)
    assert not follower.stopped and follower.link.primary == ("127.0.0.1", 7001) and node.position() == 0
    follower.synced, follower.applied_lsn, follower.primary_epoch = True, 2155, 3
    assert node.position() == 2155
    follower.stopped = True  # the link ended (the primary died; etcd still names it)
    node.on_primary(first)
    assert not follower.stopped and follower.synced and node.position() == 2155
    node.on_primary(PrimaryRecord("c", "127.0.0.1:7003", 4, 12))
    assert follower.link.primary == ("127.0.0.1", 7003) and not follower.synced and node.position() == 0


async def test_a_bid_judges_the_groups_epoch_by_the_map_read_just_before_it(etcd):
    """A shard group's import raised ``PREFIX/epoch`` to 41 while this node saw only epoch 0 (its
    watch had not yet delivered the move's mark): more than 16 above, etcd's 41 is not credible.
    A bid reads the map first (``before_bid``), finds the move into its group (``moving_in``) and
    then believes 41: it bids 42, not 1 (the group's own names would go below 41)."""
    prefix = unique_prefix()
    gw = gateway_to(etcd.address)
    marked = {"moving_in": False, "reads": 0}

    async def read_map() -> None:        # the map in etcd marks a move into this node's group
        marked["reads"] += 1
        marked["moving_in"] = True

    b, _ = arbiter(etcd.address, prefix, "b")
    b.moving_in = lambda: marked["moving_in"]
    b.before_bid = read_map
    try:
        await gw.put(prefix + "/epoch", b"41")
        await b.step()
        assert marked["reads"] >= 1
        assert b.holding and b.epoch == 42
    finally:
        await b.close()
        await gw.close()
    # without the move into its group, the same 41 stays refused: the bid comes from what the node knows
    prefix = unique_prefix()
    gw = gateway_to(etcd.address)
    c, _ = arbiter(etcd.address, prefix, "c")
    try:
        await gw.put(prefix + "/epoch", b"41")
        await c.step()
        assert c.holding and c.epoch == 1
    finally:
        await c.close()
        await gw.close()


def _map_of_b(epoch: int, marked: bool):
    """Groups ``a`` and ``b`` at ``epoch``; ``marked``: slots 0..99 moving from ``a`` to ``b``."""
    from fastlock.sharding import SLOTS, ShardGroup, ShardMap, SlotRange

    groups = (ShardGroup("a", ("127.0.0.1:7420",)), ShardGroup("b", ("127.0.0.1:7421",)))
    head = (SlotRange(0, 99, "a", moving_to="b", marked_epoch=epoch), SlotRange(100, 8191, "a")) if marked \
        else (SlotRange(0, 8191, "a"),)
    return ShardMap(epoch, groups, (*head, SlotRange(8192, SLOTS - 1, "b")))


@pytest.mark.parametrize("map_read", ["unreachable", "no map", "not a map", "a map it cannot take"])
async def test_no_bid_when_the_map_read_just_before_it_fails(etcd, map_read):
    """A shard group's import raised ``PREFIX/epoch`` to 41 while this node's map (epoch 1) has no
    move into its group: the bid's read of the map in etcd is what makes 41 credible.  When that read
    fails (etcd unreachable for the map, no map, a value that is not a map, a map this node cannot
    take), the node does not bid (a bid would go from epoch 0 to 1, below the import's 41, and the
    promotion's later read of the map would not raise it again): it bids at the next step that
    reads the map, above 41."""
    from fastlock._testbase.proxy import free_port
    from fastlock.coordination.gateway import EtcdUnavailable
    from fastlock.coordination.shardmap import EtcdShardMap, _encode
    from fastlock.server.sharded import ShardGate
    from fastlock.sharding import SLOTS, ShardMap, SlotRange

    prefix = unique_prefix()
    gw = gateway_to(etcd.address)
    gate = ShardGate(_map_of_b(1, marked=False), "b")
    stored = EtcdShardMap(gw, prefix)
    nowhere = EtcdGateway([("127.0.0.1", free_port())], timeout_s=0.5)  # nothing listens there
    gate.stored = EtcdShardMap(nowhere, prefix) if map_read == "unreachable" else stored
    if map_read == "not a map":
        await gw.put(stored.key, b'{"epoch": 2}')
    elif map_read == "a map it cannot take":  # gives b slots 0..99 with no move: refused by offer
        await gw.put(stored.key, _encode(ShardMap(2, _map_of_b(1, False).groups, (
            SlotRange(0, 99, "b"), SlotRange(100, 8191, "a"), SlotRange(8192, SLOTS - 1, "b")))))
    b, _ = arbiter(etcd.address, prefix, "b")
    b.known_epoch = gate.floors_epoch
    b.moving_in = gate.moving_in
    b.before_bid = gate.read_before_bid
    try:
        await gw.put(prefix + "/epoch", b"41")
        with pytest.raises(EtcdUnavailable, match="shard map"):
            await b.step()
        assert not b.holding and (await gw.get(prefix + "/primary")) is None
        assert (await gw.get(prefix + "/epoch")).value == b"41"
        # the map in etcd marks the move into b, and b reads it: 41 is believed, the bid goes above it
        gate.stored = stored
        await gw.put(stored.key, _encode(_map_of_b(3, marked=True)))
        await b.step()
        assert b.holding and b.epoch == 42
        assert gate.moving_in()
    finally:
        await b.close()
        await nowhere.close()
        await gw.close()
