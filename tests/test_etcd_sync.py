"""Synchronous replication in an etcd group (fastlock.replication.groupsync), with real
``fastlock serve --coordinator --replication sync`` processes and a real etcd.

Three nodes, etcd lease TTL 1 s, ``--sync-standbys 1``: the primary acknowledges a
grant only once the standby of its in-sync set (``PREFIX/sync``) has it; killing the
primary promotes that standby without a grace period and every acknowledged grant is
there; a standby that stops acknowledging leaves the set and one that caught up joins
it; a standby outside the set keeps the grace.  Skipped without the etcd binary unless
FASTLOCK_REQUIRE_ETCD=1.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from test_etcd_failover import LOCK_TTL_MS, TTL_S, Group

from fastlock._testbase import ServerProcess
from fastlock._testbase.cluster import RawNode, poll, status_of
from fastlock.errors import Unavailable

pytest.importorskip("httpx")

#: the standbys' --sync-timeout (s): how long a reply waits for the in-sync set
SYNC_TIMEOUT_S = 1.0


class SyncGroup(Group):
    """A :class:`Group` whose nodes replicate synchronously (``extra`` flags for all)."""

    def __init__(self, cluster, etcd, extra: tuple[str, ...] = ()) -> None:
        super().__init__(cluster, etcd)
        self.extra = ["--replication", "sync", "--sync-timeout", str(SYNC_TIMEOUT_S), *extra]

    def start(self, name: str, etcd_address: str | None = None, **kw) -> ServerProcess:
        url = f"etcd://{etcd_address or self.etcd.address}{self.prefix}"
        srv = self.cluster._start(ServerProcess(
            self.cluster.root / name,
            args=["--name", name, *self.cluster.auth_args(name), "--coordinator", url, "--node-id", name,
                  "--coordinator-ttl", str(TTL_S), *self.etcd.serve_flags(self.user), *self.extra]))
        self.nodes[name] = srv
        return srv

    async def in_sync(self, primary: str, count: int = 1, timeout: float = 15.0) -> list[str]:
        """Wait until ``primary``'s published in-sync set has ``count`` members; their node names."""
        def named(s: dict) -> bool:  # the member keys the node read in etcd name each member
            members = s["replication"]["sync"]["members"]
            return len(members) == count and all(self.name_of(ident, s) for ident in members)

        st = await poll(lambda: status_of(self.nodes[primary].address), named, timeout=timeout,
                        what=f"{count} in-sync standbys of {primary}")
        return [self.name_of(ident, st) for ident in st["replication"]["sync"]["members"]]

    def name_of(self, ident: str, st: dict) -> str | None:
        """The node name (its etcd node id) of standby identity ``ident`` (principal/node id)."""
        found = [m["node"] for m in st["coordinator"]["members"] if m.get("ident") == ident.rpartition("/")[2]]
        return found[0] if found else None


@pytest.fixture
def sync_group(cluster, etcd):
    return SyncGroup(cluster, etcd)


@pytest.fixture(autouse=True)
def _one_loop(request):
    """These tests start processes: run them on one event loop only."""
    if "uvloop" in request.node.name:
        pytest.skip("process-level etcd tests run on the asyncio loop only")


async def started(group: SyncGroup) -> tuple[str, list[str]]:
    """Three nodes; the primary's name and its standbys, all synced, one in sync."""
    for name in ("a", "b", "c"):
        group.start(name)
    first, _ = await group.primary()
    rest = [n for n in ("a", "b", "c") if n != first]
    await group.followers_of(first, rest)
    await group.in_sync(first)
    return first, rest


async def take(address: str, names: list[str], ttl_ms: int = 60_000) -> dict[str, int]:
    """Acquire each free lock of ``names`` at ``address``; name -> acknowledged token."""
    node = await RawNode.open(address)
    try:
        return {name: (await node.acquire(name, ttl_ms, wait_ms=0))[0] for name in names}
    finally:
        await node.close()


async def holders(address: str, names) -> dict[str, int | None]:
    node = await RawNode.open(address)
    try:
        out = {}
        for name in names:
            h = await node.holder(name)
            out[name] = h["token"] if h else None
        return out
    finally:
        await node.close()


async def test_a_grant_is_acknowledged_only_once_an_in_sync_standby_has_it(sync_group):
    # strict: with degrade (the default) a grant no standby has is acknowledged once etcd confirmed
    # the set without its members (a paused standby's member key goes with its lease)
    sync_group.extra += ["--sync-on-timeout", "fence"]
    first, rest = await started(sync_group)
    primary = sync_group.nodes[first]
    assert (await take(primary.address, ["before"]))["before"] > 0
    for name in rest:
        sync_group.nodes[name].pause()
    try:
        node = await RawNode.open(primary.address)
        try:
            # no standby acknowledges: not acknowledged (fence: Unavailable after --sync-timeout)
            with pytest.raises(Unavailable, match="synchronous replication timed out"):
                await node.acquire("while-paused", LOCK_TTL_MS, wait_ms=0)
        finally:
            await node.close()
    finally:
        for name in rest:
            sync_group.nodes[name].resume()
    # the standbys are back: the same lock is granted and acknowledged
    await sync_group.in_sync(first)
    assert (await take(primary.address, ["after"]))["after"] > 0
    st = await status_of(primary.address)
    assert st["replication"]["sync"]["refusals"] >= 1


async def test_kill_promotes_the_in_sync_standby_without_grace_with_every_acknowledged_grant(sync_group):
    first, rest = await started(sync_group)
    (member,) = await sync_group.in_sync(first)
    names = [f"lock-{i}" for i in range(200)]
    tokens = await take(sync_group.nodes[first].address, names)
    sync_group.nodes[first].kill()
    second, st = await sync_group.primary(rest)
    assert second == member
    assert st["grace_remaining_ms"] == 0
    assert any("promotion without a grace period: in the in-sync set" in line
               for line in sync_group.nodes[second].lines)
    # every acknowledged grant is held on the new primary, by the same token
    assert await holders(sync_group.nodes[second].address, names) == tokens
    # and a free lock is granted at once, above every earlier token
    assert min((await take(sync_group.nodes[second].address, ["free"])).values()) > max(tokens.values())


async def test_a_lagging_standby_leaves_the_set_and_rejoins_once_caught_up(sync_group):
    first, rest = await started(sync_group)
    primary = sync_group.nodes[first]
    (member,) = await sync_group.in_sync(first)
    (other,) = [n for n in rest if n != member]
    sync_group.nodes[member].pause()
    try:
        # the member stops acknowledging: it leaves, the caught-up standby joins, the grant is acknowledged
        token = (await take(primary.address, ["while-member-paused"]))["while-member-paused"]
        assert token > 0
        assert await sync_group.in_sync(first) == [other]
    finally:
        sync_group.nodes[member].resume()
    assert any("left the in-sync set" in line for line in primary.lines)
    # the new member dies: the old one, caught up again, rejoins
    sync_group.nodes[other].kill()
    await poll(lambda: sync_group.in_sync(first), lambda m: m == [member], timeout=15,
               what=f"{member} to rejoin the in-sync set")
    assert (await take(primary.address, ["after-rejoin"]))["after-rejoin"] > token


async def test_a_standby_outside_the_set_keeps_the_grace(sync_group):
    first, rest = await started(sync_group)
    (member,) = await sync_group.in_sync(first)
    (other,) = [n for n in rest if n != member]
    await take(sync_group.nodes[first].address, ["held"])
    # the in-sync standby is frozen and the primary killed: only the other can take the key
    sync_group.nodes[member].pause()
    try:
        sync_group.nodes[first].kill()
        second, st = await sync_group.primary([other])
        assert second == other
        assert st["grace_remaining_ms"] > 0
        assert not any("promotion without a grace period" in line for line in sync_group.nodes[other].lines)
    finally:
        sync_group.nodes[member].resume()


async def test_status_all_shows_every_node_of_the_group(sync_group):
    first, rest = await started(sync_group)
    (member,) = await sync_group.in_sync(first)
    await take(sync_group.nodes[first].address, ["x"])
    # asked at a standby: the nodes come from the group's member keys in etcd, via the node
    argv = [sys.executable, "-m", "fastlock", "status", "--all", "--server", sync_group.nodes[rest[0]].address]
    done = await asyncio.get_running_loop().run_in_executor(None, lambda: subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env=os.environ.copy()))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = [c.strip() for c in lines[1].strip("|").split("|")]
    assert header == ["ADDRESS", "NODE", "ROLE", "EPOCH", "LAG RECORDS", "LAG MS", "IN SYNC"]
    rows = {}
    for line in lines[3:]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[1]] = dict(zip(header, cells))
    assert set(rows) == {"a", "b", "c"}
    assert rows[first]["ROLE"] == "primary" and rows[first]["ADDRESS"] == sync_group.nodes[first].address
    assert all(rows[n]["ROLE"] == "standby" for n in rest)
    assert rows[member]["IN SYNC"] == "true"
    assert [rows[n]["IN SYNC"] for n in rest if n != member] == ["false"]
    assert len({rows[n]["EPOCH"] for n in rows}) == 1


def test_status_all_of_a_pair_learns_the_standby_from_the_primary_or_the_primary_from_the_standby():
    """A pair has no etcd: asked at the primary, the standby comes from the address it announced
    (its replication peer entry); asked at the standby, the primary comes from the standby's
    primary address.  NODE is each node's --name, IN SYNC the sync primary's word."""
    from fastlock.cli.groupstatus import format_table, group_rows

    primary = {"role": "primary", "epoch": 3, "replication": {
        "fenced": False, "sync": {"mode": "sync", "state": "in_sync"}, "node_name": "a", "node_id": "ee00",
        "paired_standby": "b@node-2/ff00", "paired_standby_address": "127.0.0.1:7421",
        "standbys": [{"name": "b@node-2/ff00", "lag_records": 4, "lag_ms": 7, "address": "127.0.0.1:7421"}]}}
    standby = {"role": "standby", "epoch": 3, "replication": {
        "primary": "127.0.0.1:7420", "ident": "node-2/ff00", "lag_records": 9, "node_name": "b", "node_id": "ff00",
        "sync": {"in_sync": True}}}
    statuses = {"127.0.0.1:7420": primary, "127.0.0.1:7421": standby}

    def ask(address: str) -> dict:
        return statuses[address]

    rows = group_rows("127.0.0.1:7420", ask)
    assert [(r.address, r.node, r.role, r.lag_records, r.lag_ms, r.in_sync) for r in rows] == [
        ("127.0.0.1:7420", "a", "primary", 0, 0, None), ("127.0.0.1:7421", "b", "standby", 4, 7, True)]
    rows = group_rows("127.0.0.1:7421", ask)
    assert [(r.address, r.node, r.role, r.lag_records, r.lag_ms, r.in_sync) for r in rows] == [
        ("127.0.0.1:7421", "b", "standby", 4, 7, True), ("127.0.0.1:7420", "a", "primary", 0, 0, None)]
    table = format_table(rows).splitlines()
    assert table[1].split("|")[1].strip() == "ADDRESS" and len(table) == 6
    # a standby that announced no address: its row from the primary's peer entry, no name given
    del primary["replication"]["paired_standby_address"], primary["replication"]["standbys"][0]["address"]
    primary["replication"]["standbys"][0]["name"] = primary["replication"]["paired_standby"] = "node-2/ff00"
    rows = group_rows("127.0.0.1:7420", ask)
    assert [(r.address, r.node, r.in_sync) for r in rows] == [("127.0.0.1:7420", "a", None), ("?", "ff00", True)]


def test_status_all_shows_a_node_that_does_not_answer():
    from fastlock.cli.groupstatus import group_rows

    standby = {"role": "standby", "epoch": 2, "replication": {"primary": "127.0.0.1:7420", "ident": "r/x"}}

    def ask(address: str) -> dict:
        if address == "127.0.0.1:7420":
            raise ConnectionRefusedError("refused")
        return standby

    rows = group_rows("127.0.0.1:7421", ask)
    assert rows[1].address == "127.0.0.1:7420" and rows[1].role.startswith("unreachable: refused")


@pytest.mark.parametrize("value", [
    b"", b"not json", b"[]", b'{"node": "a", "epoch": 3}', b'{"node": "a", "epoch": -1, "members": []}',
    b'{"node": "a", "epoch": 8388608, "members": ["x"]}', b'{"node": 5, "epoch": 3, "members": ["x"]}',
    b'{"node": "a", "epoch": 3, "members": "x"}', b'{"node": "a", "epoch": 3, "members": [1]}',
    b'{"node": "a", "epoch": 3, "members": [""]}', b'{"node": "a", "epoch": true, "members": ["x"]}',
    b'{"node": "a", "epoch": 3, "members": ["' + b"x" * 129 + b'"]}',
    b'{"node": "a", "epoch": 3, "members": [' + b",".join([b'"x"'] * 65) + b']}',
    b'{"node": "a", "epoch": 3, "members": ["x"], "pad": "' + b"y" * 5000 + b'"}',
])
def test_a_sync_record_that_no_primary_wrote_names_no_member(value):
    """PREFIX/sync is untrusted input: anything but exactly what a primary writes names nobody
    (so no standby skips its grace because of it), and decoding never raises."""
    from fastlock.coordination.gateway import KeyValue
    from fastlock.coordination.records import SyncRecord

    record = SyncRecord.decode(KeyValue(b"/p/sync", value, 1, 7, 0))
    assert record.members == frozenset() and record.epoch == 0 and record.mod_revision == 7


def test_a_sync_record_round_trips():
    from fastlock.coordination.gateway import KeyValue
    from fastlock.coordination.records import SyncRecord

    record = SyncRecord("n1", 12, frozenset({"node-2/ab", "node-3/cd"}))
    assert SyncRecord.decode(KeyValue(b"/p/sync", record.encode(), 1, 9, 0)) == SyncRecord(
        "n1", 12, record.members, 9)
    assert SyncRecord.decode(None) == SyncRecord("", 0, frozenset(), 0)


async def test_status_all_of_a_real_pair_asked_at_the_standby(cluster):
    primary = cluster.primary("p")
    standby = cluster.standby(primary.address, "s")
    argv = [sys.executable, "-m", "fastlock", "status", "--all", "--server", standby.address, "-o", "json"]

    def rows_now():
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=os.environ.copy())
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    rows = await poll(lambda: asyncio.get_running_loop().run_in_executor(None, rows_now),
                      lambda rs: len(rs) == 2 and rs[0]["lag_ms"] is not None, timeout=20,
                      what="the pair's table with the primary's view of the standby")
    assert [(r["address"], r["role"]) for r in rows] == [(standby.address, "standby"), (primary.address, "primary")]
    assert rows[0]["epoch"] == rows[1]["epoch"] and rows[0]["lag_records"] == 0
