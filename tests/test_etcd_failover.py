"""Failover arbitrated by etcd, with real ``fastlock serve --coordinator`` processes and a real etcd.

Three nodes share one etcd (tests/etcdserver.py) under a prefix of their own,
with a 1 s etcd lease TTL: one takes the primary key and the others follow it;
after SIGKILL or SIGSTOP of the primary another one is primary (about one TTL
later: benches.etcd_failover measures it), at a higher epoch, and tokens never
go backwards; a primary that was frozen or cut off from etcd grants nothing
after it lost its lease; an etcd restart changes nothing.  Skipped without the etcd binary unless
FASTLOCK_REQUIRE_ETCD=1.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter

import pytest
from etcdserver import unique_prefix
from throwaway import free_port

import fastlock
from fastlock import protocol as P
from fastlock._testbase import HistoryChecker, ServerProcess
from fastlock._testbase.cluster import RawNode, poll, status_of
from fastlock._testbase.proxy import CLASSIFY_BYTES, TcpProxy, classify_fastlock
from fastlock.errors import ConnectionLost, FastlockError, InvalidArgument, NotPrimary, Unavailable
from fastlock.protocol import FrameDecoder
from fastlock.tokens import epoch_of

pytest.importorskip("httpx")

TTL_S = 1
LOCK_TTL_MS = 1000


class Group:
    """Coordinated nodes of one test, on one etcd prefix."""

    def __init__(self, cluster, etcd) -> None:
        self.cluster = cluster
        self.etcd = etcd
        self.prefix = unique_prefix()
        self.nodes: dict[str, ServerProcess] = {}
        # a secured etcd (TLS, authentication): the nodes log in as a user confined to the prefix
        self.user = etcd.confine(self.prefix) if etcd.secured else None

    def start(self, name: str, etcd_address: str | None = None, *, port: int = 0,
              advertise: str | None = None, node_id: str | None = None, ttl_s: int = TTL_S) -> ServerProcess:
        url = f"etcd://{etcd_address or self.etcd.address}{self.prefix}"
        extra = ["--advertise", advertise] if advertise else []
        srv = self.cluster._start(ServerProcess(
            self.cluster.root / name, port=port,
            args=["--name", name, *self.cluster.auth_args(name), "--coordinator", url, "--node-id", node_id or name,
                  "--coordinator-ttl", str(ttl_s), *self.etcd.serve_flags(self.user), *extra]))
        self.nodes[name] = srv
        return srv

    async def roles(self, names=None) -> dict[str, dict]:
        out = {}
        for name in names or self.nodes:
            srv = self.nodes[name]
            if not srv.alive:
                continue
            try:
                out[name] = await asyncio.wait_for(status_of(srv.address), 1.0)
            except (OSError, FastlockError, asyncio.TimeoutError):
                continue
        return out

    async def primary(self, among=None, timeout: float = 10.0) -> tuple[str, dict]:
        """Wait until exactly one of ``among`` is an unfenced primary; ``(name, status)``."""
        async def ask():
            found = [(n, st) for n, st in (await self.roles(among)).items()
                     if st["role"] == "primary" and not st["replication"]["fenced"]]
            return found[0] if len(found) == 1 else None
        return await poll(ask, timeout=timeout, what="one primary", interval=0.02)

    async def followers_of(self, primary: str, names, timeout: float = 30.0, address: str | None = None) -> None:
        """Wait until ``names`` are synced standbys of ``primary`` (reached at ``address``, default its own);
        the bound is generous: a standby's start and first snapshot on a loaded machine (TLS to etcd
        in the secured group) took more than 10 s in CI-like runs."""
        address = address or self.nodes[primary].address

        async def ask():
            sts = await self.roles(names)
            return len(sts) == len(names) and all(
                st["role"] == "standby" and st["replication"]["primary"] == address and st["replication"]["synced"]
                for st in sts.values())
        await poll(ask, timeout=timeout, what=f"{names} to follow {primary}")


async def grant(address: str, name: str, timeout: float = 10.0) -> int:
    """Acquire free lock ``name`` at ``address`` (retrying through a grace period); its token."""
    node = await RawNode.open(address)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                token, _, _ = await node.acquire(name, LOCK_TTL_MS, wait_ms=200)
                return token
            except FastlockError:
                if time.monotonic() > deadline:
                    raise
    finally:
        await node.close()


async def refuses(address: str, name: str, *, or_closes: bool = False) -> FastlockError:
    """Exactly ``address`` refuses to grant free lock ``name``; the error.  ``or_closes``: the
    node may instead close the connection (it is stepping down: it grants nothing either)."""
    node = await RawNode.open(address)
    try:
        with pytest.raises((NotPrimary, Unavailable, ConnectionLost) if or_closes else
                           (NotPrimary, Unavailable)) as info:
            await node.acquire(name, LOCK_TTL_MS)
        return info.value
    finally:
        await node.close()


@pytest.fixture
def group(cluster, etcd):
    return Group(cluster, etcd)


@pytest.fixture
def secure_group(cluster, secure_etcd):
    """A group whose nodes reach etcd over TLS and log in as a user confined to its prefix."""
    return Group(cluster, secure_etcd)


def three(group: Group) -> list[str]:
    names = ["a", "b", "c"]
    for name in names:
        group.start(name)
    return names


async def test_sigkill_of_the_primary(group):
    await sigkill_of_the_primary(group)


async def test_sigkill_of_the_primary_over_tls_as_a_confined_etcd_user(secure_group):
    """The same failover with etcd serving client TLS with authentication on, the nodes
    logged in as a user whose role allows readwrite on the group's prefix only."""
    await sigkill_of_the_primary(secure_group)
    st = await status_of(next(srv for srv in secure_group.nodes.values() if srv.alive).address)
    assert st["coordinator"]["last_error"] is None


async def sigkill_of_the_primary(group: Group) -> None:
    names = three(group)
    first, st = await group.primary()
    rest = [n for n in names if n != first]
    await group.followers_of(first, rest)
    assert st["coordinator"]["holding"] and st["coordinator"]["epoch"] == st["epoch"]
    before = await grant(group.nodes[first].address, "k1")
    group.nodes[first].kill()
    killed = time.monotonic()
    second, st2 = await group.primary(rest)
    # a generous bound (the failover's time is measured by python -m benches.etcd_failover): the
    # key goes about one TTL after the kill, here with STATUS polled on a possibly loaded machine
    assert time.monotonic() - killed <= 3 * TTL_S + 5.0
    assert st2["epoch"] > st["epoch"]
    after = await grant(group.nodes[second].address, "k2")
    assert after > before
    (third,) = [n for n in rest if n != second]
    await group.followers_of(second, [third])
    # a client at the standby is redirected to the new primary
    err = await refuses(group.nodes[third].address, "k3")
    assert isinstance(err, NotPrimary) and err.primary == group.nodes[second].address
    # etcd decides: an operator's promotion is refused, and changes nothing
    node = await RawNode.open(group.nodes[third].address)
    try:
        with pytest.raises(InvalidArgument, match="--coordinator"):
            await node.request(P.OP_PROMOTE, True)
    finally:
        await node.close()
    assert (await status_of(group.nodes[third].address))["role"] == "standby"
    # the old primary, restarted, rejoins as a standby of the new one
    group.nodes[first] = group.cluster.restart(group.nodes[first])
    await group.followers_of(second, [first, third])
    st3 = await status_of(group.nodes[first].address)
    assert st3["epoch"] == st2["epoch"] and not st3["coordinator"]["holding"]


async def test_sigstop_of_the_primary(group):
    names = three(group)
    first, st = await group.primary()
    rest = [n for n in names if n != first]
    await group.followers_of(first, rest)
    before = await grant(group.nodes[first].address, "k1")
    old = group.nodes[first]
    old.pause()
    try:
        second, st2 = await group.primary(rest)
        assert st2["epoch"] > st["epoch"]
    finally:
        old.resume()
    # at once after the resume, before or while it hears from etcd that it was deposed: no grant
    # (a node that sees the changed primary key steps down and closes its client connections)
    await refuses(old.address, "fresh", or_closes=True)
    await poll(lambda: status_of(old.address), lambda s: s["role"] in ("deposed", "standby"), timeout=5,
               what="the old primary to step down")
    assert any("stepping down" in line for line in old.lines)
    await refuses(old.address, "fresh")
    assert await grant(group.nodes[second].address, "k2") > before
    # it rejoins as a standby of the new primary, without a restart
    await group.followers_of(second, [n for n in names if n != second])


async def test_primary_cut_off_from_etcd_stops_granting_first(group, etcd):
    with TcpProxy(etcd.address) as proxy:
        old = group.start("a", etcd_address=proxy.address)
        await group.primary(["a"])
        for name in ("b", "c"):
            group.start(name)
        await group.followers_of("a", ["b", "c"])
        before = await grant(old.address, "k1")
        mark = len(old.lines)
        proxy.blackhole()
        second, _ = await group.primary(["b", "c"])
        # by the time another node is primary, the old one had already fenced itself
        assert any("lease not renewed in time" in line for line in old.lines[mark:])
        await refuses(old.address, "fresh")
        proxy.heal()
        await poll(lambda: status_of(old.address), lambda s: s["role"] in ("deposed", "standby"), timeout=5,
                   what="the old primary to step down")
        assert any("stepping down" in line for line in old.lines)
        assert await grant(group.nodes[second].address, "k2") > before
        await group.followers_of(second, [n for n in ("a", "b", "c") if n != second])


async def test_etcd_restart_keeps_the_primary(group, etcd):
    names = three(group)
    first, st = await group.primary()
    before = await grant(group.nodes[first].address, "k1")
    await asyncio.get_running_loop().run_in_executor(None, etcd.restart)
    again, st2 = await group.primary()
    assert again == first and st2["epoch"] == st["epoch"]
    assert await grant(group.nodes[first].address, "k2") > before
    await group.followers_of(first, [n for n in names if n != first])


@pytest.fixture(autouse=True)
def _one_loop(request):
    """These tests start processes: run them on one event loop only."""
    if "uvloop" in request.node.name:
        pytest.skip("process-level etcd tests run on the asyncio loop only")


async def test_history_across_a_kill_and_a_freeze(group):
    """Clients riding through two failovers (SIGKILL, then SIGSTOP of the next primary):
    never two holders of a lock at once, tokens only grow, and grants resume after each."""
    names = three(group)
    first, _ = await group.primary()
    await group.followers_of(first, [n for n in names if n != first])
    addresses = [srv.address for srv in group.nodes.values()]
    history = HistoryChecker()
    epochs: Counter[int] = Counter()  # grants per epoch
    stop = asyncio.Event()

    async def grants_in_epochs(n: int, what: str) -> None:
        """Wait until ``n`` epochs have had at least 10 grants each."""
        await poll(lambda: asyncio.sleep(0, sum(c >= 10 for c in epochs.values())), lambda k: k >= n,
                   timeout=10, what=what)

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
                    pass  # not replicated before the failover: the new primary lets it expire

    workers = [asyncio.ensure_future(worker(i)) for i in range(6)]
    try:
        await grants_in_epochs(1, "grants")
        group.nodes[first].kill()
        second, _ = await group.primary([n for n in names if n != first])
        await grants_in_epochs(2, "grants after the kill")
        group.nodes[second].pause()
        try:
            (third,) = [n for n in names if n not in (first, second)]
            await group.primary([third])
            await grants_in_epochs(3, "grants after the freeze")
        finally:
            group.nodes[second].resume()
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), 20)
    assert history.check() >= 30
    assert len(epochs) == 3


def by_standby(first_bytes: bytes) -> str:
    """A proxy label: the ``--name`` of the standby whose replication connection this is."""
    label = classify_fastlock(first_bytes)
    if label != "replication":
        return label
    (hello,) = FrameDecoder(CLASSIFY_BYTES).feed(first_bytes)[:1]
    return hello[3].removeprefix("standby:").split("@")[0]


async def test_lagging_standby_not_chosen_while_a_caught_up_one_lives(group):
    port = free_port()
    # every node reaches the primary "a" through a proxy that can stall one standby's stream
    with TcpProxy(f"127.0.0.1:{port}", classify=by_standby) as proxy:
        a = group.start("a", port=port, advertise=proxy.address)
        await group.primary(["a"])
        for name in ("b", "c"):
            group.start(name)
        await group.followers_of("a", ["b", "c"], address=proxy.address)
        proxy.blackhole("c")
        for i in range(5):
            await grant(a.address, f"k{i}")
        last = (await status_of(a.address))["wal"]["last_lsn"]
        await poll(lambda: status_of(group.nodes["b"].address),
                   lambda st: st["replication"]["applied_lsn"] >= last, timeout=5, what="b to catch up")
        behind = (await status_of(group.nodes["c"].address))["replication"]["applied_lsn"]
        assert behind < last
        mark = len(group.nodes["c"].lines)
        a.kill()
        second, _ = await group.primary(["b", "c"])
        assert second == "b"
        # c never bid before it waited for b (ahead of it) - or it saw b's key first.  Its wait is
        # bounded (behind_delay_ms): on a loaded machine b may take the key only after it, and c's
        # bid then loses (b is the primary above)
        lines = group.nodes["c"].lines[mark:]
        bids = [i for i, line in enumerate(lines) if "bid for epoch" in line]
        waits = [i for i, line in enumerate(lines) if "ahead of this node" in line]
        assert not bids or (waits and waits[0] < bids[0]), lines


async def test_etcd_unavailable_stops_grants_until_it_is_back(group, etcd):
    names = three(group)
    first, st = await group.primary()
    before = await grant(group.nodes[first].address, "k1")
    etcd.pause()
    try:
        # no node can renew: the primary fences itself within the TTL, and nobody else is promoted
        await poll(lambda: status_of(group.nodes[first].address), lambda s: s["replication"]["fenced"],
                   timeout=TTL_S + 2, what="the primary to fence itself")
        err = await refuses(group.nodes[first].address, "fresh")
        assert isinstance(err, Unavailable)
        roles = await group.roles()
        assert [n for n, s in roles.items() if s["role"] == "primary" and not s["replication"]["fenced"]] == []
    finally:
        etcd.resume()
    again, _ = await group.primary()
    assert await grant(group.nodes[again].address, "k2") > before
    await group.followers_of(again, [n for n in names if n != again])


async def test_the_only_node_of_a_group_takes_the_key_again_after_losing_it(group):
    """A lone primary frozen past its etcd lease loses the key and steps down; with no
    other node alive it must stand again (DEPOSED -> STANDBY) and take the key at a
    higher epoch, not stay down while it runs."""
    group.start("solo")
    _, st = await group.primary()
    before = await grant(group.nodes["solo"].address, "solo/k1")
    solo = group.nodes["solo"]
    solo.pause()
    try:
        await asyncio.sleep(TTL_S + 1.5)  # the frozen node's etcd lease runs out meanwhile
    finally:
        solo.resume()
    solo.wait_for_log(r"lost the primary role", 10)
    _, st2 = await group.primary(timeout=TTL_S + 8)
    assert st2["epoch"] > st["epoch"] and st2["coordinator"]["holding"]
    assert await grant(solo.address, "solo/k2", timeout=10) > before


async def test_a_data_directory_stays_in_its_group(group, etcd):
    """A node's data directory remembers its group's prefix: restarted under another
    prefix, or without --coordinator, it refuses to start (it could become a second
    primary of the same locks at an epoch its group has used)."""
    srv = group.start("member")
    await group.primary()
    srv.stop()
    for args in (["--coordinator", f"etcd://{etcd.address}/another-group", "--node-id", "member",
                  "--coordinator-ttl", "1", *group.cluster.auth_args("member")], []):
        again = ServerProcess(srv.data_dir, args=args)
        with pytest.raises(RuntimeError, match="belongs to the etcd-arbitrated group"):
            again.start()
        again.stop()


async def test_tokens_stay_above_history_when_etcd_loses_its_data(group, etcd):
    """etcd loses the group's keys; a node with an empty data directory takes the key at a
    low epoch; when a node with history comes back it does not follow it but raises the
    group's epoch: the low primary steps down, and every token granted afterwards is above
    the tokens granted before the loss."""
    from fastlock.coordination import EtcdGateway
    from fastlock.coordination.gateway import b64

    gw = EtcdGateway([("127.0.0.1", etcd.port)])
    try:
        await gw.put(group.prefix + "/epoch", b"10")  # a group with some history
        old = group.start("old")
        await group.primary()
        before = await grant(old.address, "loss/k1")
        assert epoch_of(before) == 11
        old.stop()
        end = group.prefix[:-1] + chr(ord(group.prefix[-1]) + 1)
        await gw.call("kv/deleterange", {"key": b64(group.prefix), "range_end": b64(end)})
    finally:
        await gw.close()
    fresh = group.start("fresh")
    _, st = await group.primary(["fresh"])
    assert st["epoch"] < epoch_of(before)  # the loss: a primary below the old history
    group.nodes["old"] = again = ServerProcess(old.data_dir, port=0, args=old.args)
    group.cluster._start(again)
    again.wait_for_log(r"below epoch \d+ this node has seen", 10)
    fresh.wait_for_log(r"a node has seen a newer history", 10)
    name, st2 = await group.primary(timeout=10)
    assert st2["epoch"] > epoch_of(before)
    assert await grant(group.nodes[name].address, "loss/k2", timeout=10) > before


async def test_a_second_node_under_a_live_nodes_id_refuses_to_start(group):
    """Another data directory started with a live node's --node-id: exit status 1 with one
    line naming the id and the live node's address; the live node stays the primary."""
    a = group.start("a")
    await group.primary(["a"])
    dup = group.start("a-again", node_id="a")
    assert await asyncio.to_thread(dup.proc.wait, 10 * TTL_S + 10) == 1
    line = dup.wait_for_log("cannot start")
    assert f"node id 'a' is in use by another live node at {a.address}" in line, line
    assert not any("Traceback" in ln for ln in dup.lines)
    assert (await group.primary(["a"]))[0] == "a"
    assert await grant(a.address, "after-the-duplicate") > 0


async def test_a_primary_whose_id_another_live_node_took_steps_down_and_exits(group, etcd):
    """The primary's member key is taken by another live process (here the test itself: the
    key rewritten under a lease of its own, with another data directory's identity and
    address): the primary sees its id held by another live node for twice the TTL, steps
    down and exits with status 1, naming that node's address."""
    from fastlock.coordination import EtcdGateway

    a = group.start("a")
    await group.primary(["a"])
    gw = EtcdGateway([("127.0.0.1", etcd.port)])
    try:
        lease, _ = await gw.grant(60)  # alive for the whole test
        await gw.put(f"{group.prefix}/members/a", json.dumps(
            {"node": "a", "address": "127.0.0.1:7999", "position": 0, "epoch": 0, "lease": lease,
             "ident": "another-data-directory"}).encode(), lease)
        assert await asyncio.to_thread(a.proc.wait, 10 * TTL_S + 10) == 1
        await gw.revoke(lease)
    finally:
        await gw.close()
    line = a.wait_for_log("in use by another live node")
    assert "node id 'a' is in use by another live node at 127.0.0.1:7999" in line, line
    assert not any("Traceback" in ln for ln in a.lines)


async def test_a_node_restarted_after_sigkill_comes_back_under_its_id(group):
    """SIGKILL leaves the member key (and the primary key) under a live lease: the same
    data directory waits for that lease to run out (it revokes no lease it did not take)
    and is primary again.  Its etcd lease lasts 5 s, and the test renews it until the
    restarted process says it waits for it: starting a process on a loaded machine can take
    longer than any lease."""
    from fastlock.coordination import EtcdGateway

    a = group.start("a", ttl_s=5)
    await group.primary(["a"])
    gw = EtcdGateway([("127.0.0.1", group.etcd.port)], timeout_s=2.0)
    try:
        member = await gw.get(group.prefix + "/members/a")
        assert member is not None and member.lease
        a.kill()
        again = ServerProcess(a.data_dir, port=0, args=a.args)
        # started on a thread: the renewals go on while the process starts
        starting = asyncio.ensure_future(asyncio.to_thread(group.cluster._start, again))
        waiting = asyncio.ensure_future(asyncio.to_thread(again.wait_for_log,
                                                          "held by this data directory's previous run", 60))
        for _ in range(300):  # bounded: 60 s of renewals at most
            if waiting.done():
                break
            assert await gw.keepalive(member.lease) > 0
            await asyncio.wait([waiting], timeout=0.2)
        await waiting
        await starting
    finally:
        await gw.close()
    group.nodes["a"] = again
    await group.primary(["a"], timeout=30)


# -- what a node believes of etcd, against a secured etcd -------------------------------------------


async def _etcd_epoch(gw, group: Group) -> bytes | None:
    kv = await gw.get(group.prefix + "/epoch")
    return None if kv is None else kv.value


async def test_a_rogue_epoch_in_etcd_neither_stops_the_group_nor_takes_tokens_back(secure_group):
    """Someone with write access to the group's prefix (here the group's own etcd user) puts
    ``PREFIX/epoch = 8388607`` before the group starts, then that and other garbage
    (negative, not a number, a huge string) while it runs, and once more just before the
    primary is killed: no node believes any of it; the primary rewrites each value to its own
    epoch (no election), the survivor of the kill takes the epoch after what it knows, etcd's
    key ends up holding it, and every grant's token is above the previous one."""
    from fastlock.coordination import EtcdGateway
    from fastlock.protocol import MAX_EPOCH

    etcd = secure_group.etcd
    gw = EtcdGateway([("127.0.0.1", etcd.port)], timeout_s=2.0, access=etcd.access(secure_group.user))

    async def settled() -> tuple[str, dict] | None:
        """One unfenced primary, and etcd's epoch key holding its epoch."""
        name, st = await secure_group.primary()
        return (name, st) if await _etcd_epoch(gw, secure_group) == str(st["epoch"]).encode() else None

    try:
        await gw.put(secure_group.prefix + "/epoch", str(MAX_EPOCH).encode())
        for name in ("a", "b"):
            secure_group.start(name)
        first, st = await poll(settled, timeout=10, what="a primary and etcd's epoch to agree")
        assert st["epoch"] == 1
        tokens = [await grant(secure_group.nodes[first].address, "rogue/k0")]
        rogues = [str(MAX_EPOCH).encode(), b"-5", b"not a number", b"9" * 5000]
        for i, rogue in enumerate(rogues):
            await gw.put(secure_group.prefix + "/epoch", rogue)
            name, st = await poll(settled, timeout=15, what=f"the group to settle after {rogue[:20]!r}")
            assert name == first and st["epoch"] == 1  # refused and rewritten: no election
            tokens.append(await grant(secure_group.nodes[name].address, f"rogue/k{i + 1}"))
        await gw.put(secure_group.prefix + "/epoch", str(MAX_EPOCH).encode())
        secure_group.nodes[name].kill()
        name, st = await poll(settled, timeout=15, what="the survivor to be primary")
        tokens.append(await grant(secure_group.nodes[name].address, "rogue/after-the-kill"))
    finally:
        await gw.close()
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert st["epoch"] == 2
    assert any("refusing" in line and "/epoch" in line for line in secure_group.nodes[name].lines)


class Listener:
    """A TCP listener at an address etcd is made to name, as an attacker would run it: it
    relays each connection to ``target`` (a real node, which proves itself for the attacker)
    and records the bytes the connecting side sends, and which connections that side closed."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.received: list[bytearray] = []
        self.closed = 0
        self.changed = asyncio.Event()
        self.server: asyncio.AbstractServer | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = bytearray()
        self.received.append(data)
        self.writers.append(writer)
        self.changed.set()
        host, port = self.target.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        self.writers.append(up_writer)

        async def down() -> None:
            while chunk := await up_reader.read(65536):
                writer.write(chunk)

        relay = asyncio.ensure_future(down())
        try:
            while chunk := await reader.read(65536):
                data += chunk
                up_writer.write(chunk)
                self.changed.set()
        except OSError:
            pass
        finally:
            relay.cancel()
            self.closed += 1
            self.changed.set()
            writer.close()
            up_writer.close()

    async def wait(self, predicate, timeout: float, what: str) -> None:
        async def until():
            while not predicate():
                self.changed.clear()
                await self.changed.wait()
        try:
            await asyncio.wait_for(until(), timeout)
        except asyncio.TimeoutError:
            pytest.fail(f"{what} within {timeout} s: {len(self.received)} connections, {self.closed} closed")

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in self.writers:
            writer.close()


async def test_a_rogue_primary_key_stops_the_group_only_while_it_lives(secure_group):
    """Someone with write access to the prefix puts a ``PREFIX/primary`` of their own, at epoch
    8388607 under a lease they keep, naming an address where nothing listens: the primary steps
    down and nobody grants while the record lives (clients are told the address it names); once
    its lease is gone the group elects again at an epoch from what the nodes know, and tokens
    keep rising."""
    from fastlock.coordination import EtcdGateway
    from fastlock.protocol import MAX_EPOCH

    etcd = secure_group.etcd
    for name in ("a", "b"):
        secure_group.start(name)
    first, st = await secure_group.primary()
    (other,) = [n for n in ("a", "b") if n != first]
    await secure_group.followers_of(first, [other])
    before = await grant(secure_group.nodes[first].address, "rogue/k1")
    nowhere = f"127.0.0.1:{free_port()}"
    gw = EtcdGateway([("127.0.0.1", etcd.port)], timeout_s=2.0, access=etcd.access(secure_group.user))
    try:
        lease, _ = await gw.grant(60)
        await gw.put(secure_group.prefix + "/primary", json.dumps(
            {"node": "rogue", "address": nowhere, "epoch": MAX_EPOCH}).encode(), lease)
        await poll(lambda: status_of(secure_group.nodes[first].address), lambda s: s["role"] != "primary",
                   timeout=10, what="the primary to step down")
        for name in ("a", "b"):
            await poll(lambda n=name: status_of(secure_group.nodes[n].address),
                       lambda s: s["role"] == "standby" and s["replication"]["primary"] == nowhere, timeout=10,
                       what=f"{name} to follow the record")
            err = await refuses(secure_group.nodes[name].address, "rogue/k2")
            assert isinstance(err, NotPrimary) and err.primary == nowhere
        await gw.revoke(lease)
    finally:
        await gw.close()
    name, st2 = await secure_group.primary(timeout=15)
    assert st["epoch"] < st2["epoch"] <= st["epoch"] + 2
    assert await grant(secure_group.nodes[name].address, "rogue/k3") > before
    for srv in secure_group.nodes.values():
        assert (await status_of(srv.address))["epoch"] <= st2["epoch"]


async def test_a_rogue_primary_key_gets_no_token(secure_group):
    """Someone with write access to the prefix replaces ``PREFIX/primary`` with a record of
    their own (under a lease of their own) naming the address of a relay they run to a real
    node: the nodes that follow the record connect there, and no replica token's bytes cross
    the relay (a token is proved, never sent, and the node behind is not the one etcd named);
    the group is unavailable only while the record lives."""
    from fastlock.coordination import EtcdGateway

    etcd = secure_group.etcd
    for name in ("a", "b"):
        secure_group.start(name)
    first, st = await secure_group.primary()
    (other,) = [n for n in ("a", "b") if n != first]
    await secure_group.followers_of(first, [other])
    tokens = {}
    for name, srv in secure_group.nodes.items():
        path = srv.args[srv.args.index("--standby-token-file") + 1]
        tokens[name] = open(path, "rb").read().strip()
    listener = Listener(secure_group.nodes[first].address)
    rogue = await listener.start()
    gw = EtcdGateway([("127.0.0.1", etcd.port)], timeout_s=2.0, access=etcd.access(secure_group.user))
    try:
        lease, _ = await gw.grant(60)
        await gw.put(secure_group.prefix + "/primary", json.dumps(
            {"node": "rogue", "address": rogue, "epoch": st["epoch"] + 1}).encode(), lease)
        await listener.wait(lambda: listener.closed >= 1 or any(t in b"".join(listener.received) for t in
                                                               tokens.values()),
                            30, "a node to connect to the rogue address and send a token or give up")
        # a client at the other node is redirected to the address etcd names
        await poll(lambda: status_of(secure_group.nodes[other].address),
                   lambda st: st["replication"]["primary"] == rogue, timeout=10, what=f"{other} to follow the record")
        tokens["client"] = open(os.environ["FASTLOCK_TOKEN_FILE"], "rb").read().strip()
        connections = len(listener.received)
        try:
            async with fastlock.connect(secure_group.nodes[other].address, connect_timeout=2.0) as client:
                await client.acquire("rogue/client", ttl=1.0, wait=0)
        except (FastlockError, OSError, asyncio.TimeoutError):
            pass  # nothing at the rogue address may serve it
        await listener.wait(lambda: len(listener.received) > connections, 10, "the client to be redirected there")
        await gw.revoke(lease)
    finally:
        await gw.close()
        await listener.close()
    arrived = b"".join(listener.received)
    assert arrived  # the nodes did connect: the test saw what they send
    for name, token in tokens.items():
        assert token not in arrived, f"{name}'s replica token reached the rogue address"
    # once the rogue record is gone the group elects again and grants
    name, _ = await secure_group.primary(timeout=15)
    assert await grant(secure_group.nodes[name].address, "after-the-rogue") > 0
