"""Attacks on the high-availability path (issue 24's second red team), against real processes.

- in an etcd group, a peer holding some replica credential attaches under the node id of a
  live member (a standby that reaches etcd but not the primary: here a member key the test
  writes, as such a standby's would be) and acknowledges every LSN. The standby it names may
  be promoted without a grace period; a grant acknowledged on the peer's word alone is on no
  node that could take over. Only the replica principal the member key names may speak for
  that node id;
- in an etcd group (any number of standbys), one replica credential asks for standbys in a
  burst: every ``REPLICATE`` costs the primary a copy of its table and a snapshot. Pipelined on
  one connection (150 of them, 12,000 leases) they held its event loop for seconds: it missed
  its etcd lease renewal and was deposed. A connection replicates once, and one replica
  principal has at most ``MAX_STANDBYS_PER_PRINCIPAL`` standbys attached; beyond, a clear error
  and no snapshot;
- a sync pair after a failover whose promoted node then died: the old primary, restarted with
  its flags, starts fenced and logs that its standby may have been promoted, offering
  ``fastlock serve-alone``. It accepted ``serve-alone`` at once and granted again at its old
  epoch: a lock the promoted node granted and acknowledged (synchronously) was granted a second
  time with a lower fencing token. A fenced node's ``serve-alone`` moves its epoch two above the
  highest it knows, so the second grant's token is above the promoted node's;
- an etcd group cut apart between the primary and its standbys only (a TCP proxy in front of
  the primary, which still reaches etcd): the in-sync member that stopped acknowledging must
  leave the set (written to etcd), and with ``degrade`` the primary acknowledges alone. It
  rejoined at once instead (it had every *released* reply, the bar to join), so the set never
  changed and every grant failed after twice ``--sync-timeout``, ``degrade`` or not.

Every wait has a deadline; servers are stopped by PID (the ``cluster`` fixture).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from test_redteam_ha import etcd_sync, grant_while_a_peer_acks_everything

from fastlock import protocol as P
from fastlock._testbase import ServerProcess
from fastlock._testbase.cluster import RawNode, poll, run
from fastlock._testbase.proxy import TcpProxy, free_port
from fastlock.errors import InvalidArgument, LimitExceeded, Unavailable


@pytest.fixture
def sync_group(request, cluster, etcd):
    if "uvloop" in request.node.name:
        pytest.skip("process-level etcd tests run on the asyncio loop only")
    return etcd_sync.SyncGroup(cluster, etcd, ("--sync-on-timeout", "fence"))


async def test_a_replica_credential_cannot_speak_for_another_members_node_id(sync_group, cluster, etcd):
    # One node (the primary, --sync-standbys 1, strict: fence) and a live member "ghost" that
    # never attaches (it reaches etcd, not the primary). A peer with the replica credential of
    # another node attaches under ghost's node id and acknowledges everything.
    sync_group.start("a")
    await sync_group.primary(["a"])
    address = sync_group.nodes["a"].address
    ghost = {"node": "ghost", "address": "127.0.0.1:9", "position": [0, 0], "epoch": 0, "lease": 0,
             "ident": "ghost-ident", "principal": cluster.replica_of("ghost")}
    etcd.etcdctl(f"etcdctl put {sync_group.prefix}/members/ghost '{json.dumps(ghost)}'")
    admin = await RawNode.open(address)
    await poll(admin.status, lambda s: any(m.get("ident") == "ghost-ident" for m in s["coordinator"]["members"]),
               timeout=15, what="the primary reads ghost's member key")
    hostile = await RawNode.open(address, token=cluster.creds.token(cluster.replica_of("evil")), name="evil")
    await asyncio.wait_for(hostile.request(P.OP_REPLICATE, 0, None, 0, "ghost-ident"), 10)
    outcome, members = await grant_while_a_peer_acks_everything(admin, hostile)
    assert outcome.startswith("refused") and not members, (
        f"a grant was {outcome} with the in-sync set {members}: a peer with another node's replica "
        f"credential counted as member ghost's synchronous copy (ghost would be promoted without a grace "
        f"period, without the grant)")


async def test_one_replica_credential_gets_a_bounded_number_of_snapshots(request, cluster, etcd):
    from fastlock.replication.source import MAX_STANDBYS_PER_PRINCIPAL

    if "uvloop" in request.node.name:
        pytest.skip("process-level etcd tests run on the asyncio loop only")
    group = etcd_sync.Group(cluster, etcd)
    group.start("a")
    await group.primary(["a"])
    srv = group.nodes["a"]
    token = cluster.creds.token(cluster.replica_of("evil"))
    conns = [await RawNode.open(srv.address, token=token, name="evil")
             for _ in range(MAX_STANDBYS_PER_PRINCIPAL + 1)]
    try:
        first = conns[0]
        await asyncio.wait_for(first.request(P.OP_REPLICATE, 0, None, 0, "n-0"), 10)
        # a second REPLICATE on an attached connection: refused, no second snapshot
        with pytest.raises(InvalidArgument, match="already"):
            await asyncio.wait_for(first.request(P.OP_REPLICATE, 0, None, 0, "n-1"), 10)
        for i, conn in enumerate(conns[1:MAX_STANDBYS_PER_PRINCIPAL], start=1):
            await asyncio.wait_for(conn.request(P.OP_REPLICATE, 0, None, 0, f"n-{i}"), 10)
        # one more standby of the same replica principal, under yet another node id: over the limit
        with pytest.raises(LimitExceeded, match="standbys"):
            await asyncio.wait_for(conns[-1].request(P.OP_REPLICATE, 0, None, 0, "n-extra"), 10)
        # the primary still serves its clients; only the admitted standbys are attached
        admin = await RawNode.open(srv.address)
        try:
            standbys = (await admin.status())["replication"]["standbys"]
            assert sorted(s["name"].rpartition("/")[2] for s in standbys) == [
                f"n-{i}" for i in range(MAX_STANDBYS_PER_PRINCIPAL)], standbys
            token, _, _ = await asyncio.wait_for(admin.acquire("still-granting", 60_000), 10)
            assert token > 0
        finally:
            await admin.close()
    finally:
        for conn in conns:
            await conn.close()


def test_serve_alone_on_a_restarted_old_primary_never_grants_below_the_promoted_nodes_tokens(cluster):
    from test_pair_rejoin import grant

    from fastlock._testbase import ServerProcess

    sync = ["--replication", "sync"]
    a = cluster.primary("a", args=[*sync, "--failover-after", "1"])
    b = cluster.standby(a.address, "b", failover_after=1.0, args=sync)

    async def main() -> None:
        await grant(a.address, "x", 600_000)
        a.kill()
        promoted = await grant(b.address, "y", 600_000, timeout=20)  # b promoted; acknowledged
        b.kill()  # and gone (its machine lost): the supervisor restarts a with its flags
        old = cluster._start(ServerProcess(a.data_dir, port=a.port, args=a.args))
        old.wait_for_log(r"restarted while paired", 10)
        # the operator follows the restarted node's own log line
        done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "fastlock", "serve-alone",
                                                        "--server", old.address],
                                       capture_output=True, text=True, timeout=60)
        node = await RawNode.open(old.address)
        try:
            token = (await asyncio.wait_for(node.acquire("y", 600_000), 10))[0]
        except Exception as exc:  # noqa: BLE001 - refused: what the test expects
            token = f"refused ({type(exc).__name__})"
        finally:
            await node.close()
        assert done.returncode != 0 or not isinstance(token, int) or token > promoted, (
            f"serve-alone (rc {done.returncode}) let the old primary grant 'y' again with token {token}, "
            f"below the promoted node's {promoted} for the same lock")

    run(main(), timeout=120)


async def test_a_member_cut_off_from_the_primary_leaves_the_set_and_the_primary_degrades(cluster, etcd):
    # two nodes, each reached by the other through a proxy (its --advertise); the test talks to them directly
    from test_etcd_failover import TTL_S

    group = etcd_sync.SyncGroup(cluster, etcd)  # --sync-on-timeout degrade (the default)
    proxies: dict[str, TcpProxy] = {}
    for name in ("a", "b"):
        port, relay = free_port(), free_port()
        proxies[name] = TcpProxy(f"127.0.0.1:{port}", port=relay).start()
        group.nodes[name] = cluster._start(ServerProcess(cluster.root / name, port=port, args=[
            "--name", name, *cluster.auth_args(name), "--coordinator", f"etcd://{etcd.address}{group.prefix}",
            "--node-id", name, "--coordinator-ttl", str(TTL_S), *etcd.serve_flags(group.user), *group.extra,
            "--advertise", f"127.0.0.1:{relay}", "--reachable-as", f"127.0.0.1:{relay},127.0.0.1:{port}"]))
        if name == "a":
            await group.primary(["a"])
    try:
        await group.followers_of("a", ["b"], address=f"127.0.0.1:{proxies['a'].port}")
        assert await group.in_sync("a") == ["b"]
        primary = group.nodes["a"]
        warm = await RawNode.open(primary.address)  # the standby learns the TTL (a longer one would wait for it)
        try:
            await asyncio.wait_for(warm.acquire("before", 60_000), 10)
        finally:
            await warm.close()
        proxies["a"].blackhole()  # b's link to a hangs; both still reach etcd
        node = await RawNode.open(primary.address)
        owner = b"o" * 16  # a refused reply leaves the lease decided: the same owner key finds it
        try:
            async def attempt() -> int | None:
                try:
                    return (await asyncio.wait_for(node.acquire("while-cut-off", 60_000, owner=owner), 10))[0]
                except Unavailable:
                    return None

            token = await poll(attempt, lambda t: t is not None, timeout=30,
                               what="a grant acknowledged by the primary without the cut-off member")
            st = await node.status()
        finally:
            await node.close()
        assert token > 0
        assert st["replication"]["sync"]["members"] == [], st["replication"]["sync"]
        assert any("left the in-sync set" in line for line in primary.lines)
    finally:
        for proxy in proxies.values():
            proxy.close()
