"""Attacks on the high-availability path (issue 24's red team), against real processes.

- a peer holding a replica credential acknowledges (``SYNC_ACK``) records the primary has
  not sent it yet: its snapshot of more than ``INLINE_SNAPSHOT_LEASES`` leases is still being
  prepared. A primary that counts that acknowledgement says it is in sync with a standby that
  holds nothing, and acknowledges grants no standby holds;
- in an etcd group, a replica that no member key names (a plain ``--standby-of`` node, or a
  peer with a replica credential under an unknown node id) is no in-sync copy: no election
  can promote it;
- in an etcd group, a peer with a replica credential cannot depose the primary (``STEP_DOWN``):
  etcd alone decides who is primary;
- a sync pair whose two nodes went down after a failover and are restarted with their original
  flags (the promoted node with its ``--standby-of`` the old primary) grants again with no
  operator: the promoted node finds the old primary deposed below its epoch and promotes again.

Every wait has a deadline; servers are stopped by PID (the ``cluster`` fixture).
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import pytest

from fastlock import protocol as P
from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock.errors import PermissionDenied, Unavailable
from fastlock.replication.source import INLINE_SNAPSHOT_LEASES

SYNC = ["--replication", "sync"]
SHORT_TTL_MS = 2_000  # the grants' TTL: a promotion's grace (the longest TTL seen) stays short


def no_reply(request: asyncio.Future) -> None:
    """``SYNC_ACK`` has no reply: its future ends only when the connection closes."""
    request.add_done_callback(lambda f: f.cancelled() or f.exception())


def sync_of(status: dict) -> dict:
    return status["replication"]["sync"]


class AckedGrant(NamedTuple):
    """What a grant came to while a hostile peer acknowledged every LSN."""
    outcome: str  #: "acknowledged", or "refused: <the error>"
    members: list  #: the primary's in-sync set then


async def grant_while_a_peer_acks_everything(admin, hostile) -> AckedGrant:
    """``hostile`` (a replica connection that asked to replicate) acknowledges the primary's last
    LSN every 25 ms (400 at most) while ``admin`` asks for a grant on the primary; both
    connections are closed after it."""
    stop = asyncio.Event()

    async def ack_everything() -> None:
        for _ in range(400):  # bounded: 400 acks, 25 ms apart
            if stop.is_set() or hostile.closed:
                return
            no_reply(hostile.request(P.OP_SYNC_ACK, (await admin.status())["wal"]["last_lsn"]))
            await asyncio.sleep(0.025)

    acking = asyncio.ensure_future(ack_everything())
    try:
        outcome = "acknowledged"
        try:
            await asyncio.wait_for(admin.acquire("only-on-the-primary", 60_000), 10)
        except Unavailable as exc:
            outcome = f"refused: {exc}"
        st = await admin.status()
    finally:
        stop.set()
        await acking
        await hostile.close()
        await admin.close()
    return AckedGrant(outcome, st["replication"]["sync"]["members"])


def test_an_ack_before_the_snapshot_was_sent_is_not_counted(cluster):
    # the primary degrades (no standby attached) and keeps granting: fill its table past the
    # size whose snapshot is prepared off the loop and streamed after the REPLICATE reply
    primary = cluster.primary(args=SYNC)

    async def main() -> None:
        admin = await RawNode.open(primary.address)
        leases = INLINE_SNAPSHOT_LEASES + 1
        for start in range(0, leases, 2_000):
            batch = [admin.acquire(f"fill/{i}", 600_000) for i in range(start, min(leases, start + 2_000))]
            await asyncio.wait_for(asyncio.gather(*batch), 60)
        st = await admin.status()
        last = st["wal"]["last_lsn"]
        assert last >= leases, st["wal"]
        hostile = await RawNode.open(primary.address, token=cluster.creds.token(cluster.replica_of("evil")),
                                     name="evil")
        # REPLICATE from nothing (a snapshot), and in the same write an ack of every LSN logged:
        # the primary has not sent the snapshot (it is encoded on a worker thread after the reply)
        attach = hostile.request(P.OP_REPLICATE, 0, None, 0, "evil-node")
        no_reply(hostile.request(P.OP_SYNC_ACK, last))
        info = await asyncio.wait_for(attach, 10)
        assert info["mode"] == "snapshot", info
        st = await status_of(primary.address)
        sync = sync_of(st)
        await hostile.close()
        await admin.close()
        assert sync["standby_acked_lsn"] < last and sync["state"] != "in_sync", (
            f"the primary counted an acknowledgement of LSN {last} from a standby it had sent nothing "
            f"(its snapshot was still being prepared): {sync}")

    run(main(), timeout=120)


# -- an etcd group: only a member of the group counts as an in-sync copy ---------------------------

etcd_sync = pytest.importorskip("test_etcd_sync")


@pytest.fixture
def sync_group(request, cluster, etcd):
    if "uvloop" in request.node.name:
        pytest.skip("process-level etcd tests run on the asyncio loop only")
    return etcd_sync.SyncGroup(cluster, etcd, ("--sync-on-timeout", "fence"))


@pytest.mark.parametrize("claimed", ["unknown", "the-primarys-own"])
async def test_a_replica_that_is_no_group_member_is_no_in_sync_copy(sync_group, cluster, claimed):
    # One node (the primary, --sync-standbys 1, strict: fence): no standby, so no grant is acknowledged.
    # A peer holding a replica credential attaches under a node id no member key names and
    # acknowledges every LSN the primary logs. No etcd election can ever promote it: a grant
    # acknowledged on its word alone is on no node that could take over.
    sync_group.start("a")
    await sync_group.primary(["a"])
    address = sync_group.nodes["a"].address
    admin = await RawNode.open(address)
    hostile = await RawNode.open(address, token=cluster.creds.token(cluster.replica_of("evil")), name="evil")
    # a node id no member key names, or the primary's own (its member key is live; no standby has it)
    node_id = (await admin.status())["coordinator"]["ident"] if claimed == "the-primarys-own" else "not-a-member"
    await asyncio.wait_for(hostile.request(P.OP_REPLICATE, 0, None, 0, node_id), 10)
    outcome, members = await grant_while_a_peer_acks_everything(admin, hostile)
    assert outcome.startswith("refused") and not members, (
        f"a grant was {outcome} with the in-sync set {members}: a replica with no member key in etcd "
        f"counted as the group's synchronous copy")


async def test_a_replica_cannot_depose_the_groups_primary(request, cluster, etcd):
    # etcd alone decides a group's primary: a STEP_DOWN from a peer holding a replica credential
    # (the pair's way to depose its primary) would leave the group with a deposed primary that
    # still holds the etcd key, and so with no primary at all, until someone restarts it
    if "uvloop" in request.node.name:
        pytest.skip("process-level etcd tests run on the asyncio loop only")
    group = etcd_sync.Group(cluster, etcd)
    for name in ("a", "b", "c"):
        group.start(name)
    first, st = await group.primary()
    hostile = await RawNode.open(group.nodes[first].address, token=cluster.creds.token(cluster.replica_of("evil")),
                                 name="evil")
    try:
        with pytest.raises(PermissionDenied, match="etcd"):
            await asyncio.wait_for(hostile.request(P.OP_STEP_DOWN, st["epoch"] + 1, hostile.hello["clock_ms"]), 5)
    finally:
        await hostile.close()
    after = await status_of(group.nodes[first].address)
    assert (after["role"], after["epoch"]) == ("primary", st["epoch"]), after["role"]


# -- a pair whose two nodes both went down after a failover -------------------------------------

def test_a_sync_pair_restarted_with_its_flags_after_a_failover_grants_again(cluster):
    from test_pair_rejoin import grant

    from fastlock._testbase import ServerProcess

    a = cluster.primary("a", args=[*SYNC, "--failover-after", "1"])
    b = cluster.standby(a.address, "b", failover_after=1.0, args=SYNC)

    def same_flags(srv: ServerProcess) -> ServerProcess:  # a supervisor's restart: same port, same flags
        return cluster._start(ServerProcess(srv.data_dir, port=srv.port, args=srv.args))

    async def main() -> None:
        before = await grant(a.address, "before", SHORT_TTL_MS)
        a.kill()
        promoted = await grant(b.address, "after-failover", SHORT_TTL_MS, timeout=20)  # b promoted
        b.kill()  # the new primary goes down too; then both machines come back
        nodes = [same_flags(a), same_flags(b)]

        async def any_grant() -> int | None:
            for srv in nodes:
                try:
                    return await grant(srv.address, "after-both", SHORT_TTL_MS, timeout=1)
                except AssertionError:
                    continue
            return None

        # b (at the higher epoch) is the primary again, after its grace (the longest TTL seen)
        token = await poll(any_grant, lambda t: t is not None, timeout=30, what="a grant by either node")
        assert token > promoted > before
        st = await poll(lambda: status_of(nodes[0].address), lambda st: st["role"] == "standby"
                        and st["replication"]["primary"] == nodes[1].address and st["replication"]["synced"],
                        timeout=20, what="the old primary a following b")
        assert st["epoch"] == token >> 40, st["epoch"]

    run(main(), timeout=90)
