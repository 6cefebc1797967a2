"""A primary counts a standby's ``SYNC_ACK`` only for LSNs that standby's connection carried.

- :class:`~fastlock.replication.source.SentWindow`: what one replication connection was sent
  (nothing before its snapshot; from the snapshot's LSN to the last batch sent after it);
- the pair's :class:`~fastlock.replication.syncrep.SyncGate` and the group's
  :class:`~fastlock.replication.groupsync.GroupSyncGate` ignore an acknowledgement before the
  snapshot, above what was sent, or below the snapshot's LSN (a position in another primary's
  log), count it in ``sync.acks_rejected`` and log it once per connection; an acknowledgement
  that goes backwards changes nothing;
- against a real primary, a fake standby (the replication protocol, with the replica
  credentials the test server is started with) that acknowledges a position it was never
  sent gets no grant acknowledged, and one that claims to resume after records never sent to
  it gets a snapshot.

Every wait has a deadline; servers are stopped by PID (the ``cluster`` fixture).
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from fastlock import protocol as P
from fastlock._testbase.cluster import RawNode, poll, run
from fastlock.errors import ProtocolError
from fastlock.replication.groupsync import GroupSyncGate
from fastlock.replication.source import ReplicationSource, SentWindow, _Replica
from fastlock.replication.syncrep import SyncGate, SyncOnTimeout, SyncSettings
from fastlock.roles import Role
from fastlock.units import monotonic_ms

REJECTED = "never carried"  # the primary's warning


def test_a_window_admits_only_what_its_connection_carried():
    window = SentWindow()
    assert not window.admits(0) and window.describe() == "nothing yet"  # before the snapshot: nothing
    window.snapshot(100)
    assert window.admits(100) and not window.admits(99) and not window.admits(101)
    window.records(110)
    assert window.admits(105) and window.admits(110) and not window.admits(111)
    window.snapshot(200)  # a second snapshot (compaction during catch-up): what came between was carried
    assert window.admits(100) and window.admits(200) and not window.admits(99) and not window.admits(201)
    assert window.describe() == "LSNs 100..200"
    resumed = SentWindow()
    resumed.resumed(50)  # a stream resumed after LSN 50 of this primary's log
    assert resumed.admits(0) and resumed.admits(50) and not resumed.admits(51)


# -- the gates alone (no process) --------------------------------------------------------------

class Conn:
    def __init__(self, session: int):
        self.session, self.closed, self.peer, self.sent = session, False, f"peer{session}", []

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def flush(self) -> None:
        pass


def primary_host() -> SimpleNamespace:
    loop = asyncio.get_running_loop()
    return SimpleNamespace(
        wal=SimpleNamespace(logged_lsn=0), table=SimpleNamespace(epoch=1, expire=lambda now: None),
        roles=SimpleNamespace(role=Role.PRIMARY, grace_remaining_ms=lambda now: 0, expires_leases=True,
                              set_sync_held=lambda held: None),
        loop=loop, after_batch=lambda: None)


def attach(source: ReplicationSource, session: int, name: str) -> tuple[Conn, SentWindow]:
    conn = Conn(session)
    replica = _Replica(conn, name, 0)
    source.replicas[session] = replica
    return conn, replica.window


def held(gate, host, lsn: int) -> list:
    """Log up to ``lsn`` and hold a reply for it; the list gets "ok" or the error when it goes."""
    host.wal.logged_lsn = lsn
    out: list = []
    gate.after(lambda error=None: out.append(error or "ok"))()
    return out


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if REJECTED in r.getMessage()]


async def test_a_pair_counts_no_ack_its_connection_did_not_carry(caplog):
    caplog.set_level(logging.WARNING, "fastlock.replication")
    host = primary_host()
    source = ReplicationSource(host)
    gate = SyncGate(host, source, SyncSettings(timeout_ms=60_000, on_timeout=SyncOnTimeout.FENCE))
    conn, window = attach(source, 7, "r/standby")
    out = held(gate, host, 10)  # a grant logged at LSN 10 waits for the standby
    gate.on_ack(conn, 10)  # before its snapshot was sent: it cannot have LSN 10
    assert out == [] and gate.acked_lsn == 0 and gate.acks_rejected == 1
    window.snapshot(12)  # the snapshot (at LSN 12) carries the grant
    host.wal.logged_lsn = 20
    gate.on_ack(conn, 11)  # below the snapshot: a position in another primary's log
    gate.on_ack(conn, 13)  # above what was sent (records 13..20 are logged, not sent yet)
    assert out == [] and gate.acked_lsn == 0 and not gate.in_sync and gate.acks_rejected == 3
    assert gate.status()["acks_rejected"] == 3
    gate.on_ack(conn, 12)  # the snapshot's LSN: counted
    assert out == ["ok"] and gate.acked_lsn == 12
    window.records(15)
    gate.on_ack(conn, 15)
    gate.on_ack(conn, 14)  # backwards on the same connection: nothing changes
    assert gate.acked_lsn == 15 and gate.acks_rejected == 3
    (line,) = warnings(caplog)  # once per connection, with the numbers
    assert "acknowledged LSN 10" in line and "nothing yet" in line and "r/standby" in line
    # a new connection of the same standby starts with nothing carried
    del source.replicas[7]
    again, window = attach(source, 8, "r/standby")
    out = held(gate, host, 21)
    gate.on_ack(again, 21)
    assert out == [] and gate.acks_rejected == 4 and len(warnings(caplog)) == 2


class Etcd:
    """The group's publisher: each write of the in-sync set is confirmed at once."""

    def __init__(self):
        self.writes: list[frozenset] = []

    async def __call__(self, members: frozenset) -> bool:
        self.writes.append(members)
        return True


async def test_a_group_counts_no_ack_its_connection_did_not_carry_nor_lets_that_standby_join(caplog):
    caplog.set_level(logging.WARNING, "fastlock.replication")
    host = primary_host()
    source = ReplicationSource(host)
    gate = GroupSyncGate(host, source, SyncSettings(timeout_ms=60_000, on_timeout=SyncOnTimeout.FENCE), 1)
    gate.publisher = etcd = Etcd()
    gate.status_push()  # the term starts: nothing logged yet
    conn, window = attach(source, 1, "label@r/1")
    out = held(gate, host, 5)
    gate.on_ack(conn, 5)  # before its snapshot
    window.snapshot(7)
    host.wal.logged_lsn = 9
    gate.on_ack(conn, 6)  # below its snapshot
    gate.on_ack(conn, 8)  # above what was sent
    for _ in range(3):
        await asyncio.sleep(0)
    assert out == [] and gate.acked == {} and gate.acks_rejected == 3 and len(warnings(caplog)) == 1
    assert all("r/1" not in str(sorted(members)) for members in etcd.writes)  # it joined no in-sync set
    gate.on_ack(conn, 7)  # the snapshot's LSN: counted, and the standby joins the set
    for _ in range(3):
        await asyncio.sleep(0)
    assert out == ["ok"] and gate.acked["r/1"].lsn == 7 and etcd.writes[-1] == frozenset({"r/1"})
    assert gate.status()["acks_rejected"] == 3


# -- a fake standby against a real primary -------------------------------------------------------

SYNC_STRICT = ["--replication", "sync", "--sync-on-timeout", "fence", "--sync-timeout", "60"]


class FakeStandby:
    """The replication protocol as a standby speaks it, driven by the test: it attaches,
    keeps every push, and sends ``SYNC_ACK``s of whatever the test says."""

    def __init__(self, node: RawNode, pushes: list):
        self.node, self.pushes = node, pushes

    @classmethod
    async def open(cls, cluster, address: str) -> FakeStandby:
        pushes: list = []
        node = await RawNode.open(address, name="standby:fake", token=cluster.creds.token(cluster.replica_of("fake")),
                                  on_push=lambda kind, payload: pushes.append((kind, payload)))
        return cls(node, pushes)

    async def replicate(self, from_lsn: int = 0, incarnation: str | None = None) -> dict:
        return await asyncio.wait_for(self.node.request(P.OP_REPLICATE, from_lsn, incarnation, 0, "fake"), 5)

    def ack(self, lsn: int) -> None:
        self.node.request(P.OP_SYNC_ACK, lsn)  # no reply: acknowledgements stream

    async def snapshot(self) -> list:
        """The snapshot push's ``[lsn, epoch, counter, holders, ...]`` once it has arrived."""
        async def look() -> list | None:
            return next((payload for kind, payload in self.pushes if kind == P.PUSH_SNAPSHOT), None)
        return await poll(look, timeout=10, what="the snapshot push")


async def last_lsn_above(node: RawNode, lsn: int) -> int:
    st = await poll(node.status, lambda st: st["wal"]["last_lsn"] > lsn, timeout=10, what=f"an LSN above {lsn}")
    return st["wal"]["last_lsn"]


def test_an_ack_below_the_standbys_snapshot_acknowledges_no_grant(cluster):
    """The stale acknowledgement of a standby that follows a new primary: a number of the old
    primary's log, below this primary's snapshot to it.  A strict sync primary with no standby
    holds two grants; the fake standby attaches and acknowledges the first grant's LSN, which is
    below the snapshot it was sent: neither grant is acknowledged, until it acknowledges the
    snapshot's LSN.  (Before the guard, the first grant was acknowledged on that number.)"""
    primary = cluster.primary(args=SYNC_STRICT)

    async def main() -> None:
        client = await RawNode.open(primary.address)
        base = (await client.status())["wal"]["last_lsn"]
        first = asyncio.ensure_future(client.acquire("guard/first", 60_000))
        stale = await last_lsn_above(client, base)  # the first grant is logged, and held
        second = asyncio.ensure_future(client.acquire("guard/second", 60_000))
        await last_lsn_above(client, stale)
        fake = await FakeStandby.open(cluster, primary.address)
        assert (await fake.replicate())["mode"] == "snapshot"
        snap = await fake.snapshot()
        assert snap[0] > stale and {h[0] for h in snap[3]} >= {"guard/first", "guard/second"}
        fake.ack(stale)
        st = await poll(client.status, lambda st: st["replication"]["sync"].get("acks_rejected", 0) >= 1,
                        timeout=10, what="the stale acknowledgement refused")
        assert not first.done() and not second.done()
        assert st["replication"]["sync"]["standby_acked_lsn"] == 0, st["replication"]["sync"]
        line = await asyncio.to_thread(primary.wait_for_log, rf"acknowledged LSN {stale}, which its connection "
                                                             rf"never carried", 10)
        assert "/fake" in line and f"it was sent LSNs {snap[0]}.." in line, line
        fake.ack(snap[0])  # what it was sent: both grants are acknowledged
        tokens = await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert tokens[0][0] < tokens[1][0]
        metrics = (await client.status())["replication"]["sync"]
        assert metrics["acks_rejected"] == 1 and metrics["standby_acked_lsn"] == snap[0]
        await fake.node.close()
        await client.close()

    run(main(), timeout=60)


def test_a_standby_resuming_after_records_never_sent_to_it_gets_a_snapshot(cluster):
    """A peer with this primary's incarnation that asks to resume after the last LSN claims
    every record so far, none of which this primary sent it; before the guard it was streamed
    from there (nothing), and its acknowledgement of the held grant's LSN acknowledged a grant
    no standby was sent.  It gets a snapshot, which carries the grant."""
    primary = cluster.primary(args=SYNC_STRICT)

    async def main() -> None:
        client = await RawNode.open(primary.address)
        st = await client.status()
        base, incarnation = st["wal"]["last_lsn"], st["replication"]["incarnation"]
        first = asyncio.ensure_future(client.acquire("guard/resume", 60_000))
        logged = await last_lsn_above(client, base)
        fake = await FakeStandby.open(cluster, primary.address)
        assert (await fake.replicate(logged + 1, incarnation))["mode"] == "snapshot"
        await asyncio.to_thread(primary.wait_for_log, rf"asks to resume after LSN {logged}, but this primary sent "
                                                      rf"it only up to LSN 0: sending a snapshot", 10)
        snap = await fake.snapshot()
        assert snap[0] >= logged and "guard/resume" in {h[0] for h in snap[3]}
        assert not first.done()
        fake.ack(snap[0])
        token, _, _ = await asyncio.wait_for(first, 10)
        assert token > 0
        await fake.node.close()
        await client.close()

    run(main(), timeout=60)


@pytest.mark.parametrize("lsn", [10**12, -1])
def test_an_ack_outside_the_log_is_a_protocol_error_and_acknowledges_nothing(cluster, lsn):
    """An acknowledgement of a huge number (or a negative one) is answered with a protocol
    error and the held grant stays held (refused before the guard too: above the last LSN)."""
    primary = cluster.primary(args=SYNC_STRICT)

    async def main() -> None:
        client = await RawNode.open(primary.address)
        base = (await client.status())["wal"]["last_lsn"]
        first = asyncio.ensure_future(client.acquire("guard/huge", 60_000))
        await last_lsn_above(client, base)
        fake = await FakeStandby.open(cluster, primary.address)
        await fake.replicate()
        await fake.snapshot()
        with pytest.raises(ProtocolError, match="SYNC_ACK takes an LSN in 0"):
            await asyncio.wait_for(fake.node.request(P.OP_SYNC_ACK, lsn), 10)
        st = await client.status()
        assert not first.done() and st["replication"]["sync"]["standby_acked_lsn"] == 0
        first.cancel()
        await fake.node.close()
        await client.close()

    run(main(), timeout=60)


def test_a_standbys_reported_applied_lsn_counts_only_within_what_it_was_sent(cluster):
    """The applied LSN of a heartbeat echo (``REPL_ACK``) is the standby's lag in STATUS, in
    ``fastlock status --all`` and in ``fastlock_replication_lag_records``: one above what its
    connection carried is not its progress (before the guard a standby could show no lag with
    an echo of 10**9)."""
    primary = cluster.primary()  # asynchronous replication: the grant needs no standby

    async def main() -> None:
        client = await RawNode.open(primary.address)
        await client.acquire("guard/lag", 60_000)  # the snapshot's LSN is above 0
        fake = await FakeStandby.open(cluster, primary.address)
        await fake.replicate()
        snap = await fake.snapshot()
        assert snap[0] > 0
        fake.node.request(P.OP_REPL_ACK, 0, 10**9)  # no reply: echoes stream
        fake.node.request(P.OP_REPL_ACK, 0, snap[0])  # what it was sent: its progress

        async def acked() -> int | None:
            standbys = (await client.status())["replication"]["standbys"]
            return standbys[0]["acked_lsn"] if standbys else None

        assert await poll(acked, lambda lsn: lsn == snap[0], timeout=10, what="the snapshot's LSN acknowledged")
        await fake.node.close()
        await client.close()

    run(main(), timeout=60)


async def test_an_echo_of_a_heartbeat_never_sent_on_the_connection_proves_no_contact(tmp_path):
    """The heartbeat echo (``REPL_ACK``'s first number) pairs a standby, keeps the primary
    unfenced and confirms the TTLs its heartbeats carried (ttlbound.py): one naming a time after
    the last heartbeat sent on that connection proves nothing."""
    host = primary_host()
    host.data_dir = tmp_path
    host.max_ttl_ms = 5000
    host.wal.stats = lambda: {"last_lsn": 0}
    host.roles.fenced = False
    source = ReplicationSource(host)
    conn, _ = attach(source, 7, "r/standby")
    replica = source.replicas[7]
    replica.contact_ms = 0  # as attach sets it: no contact yet
    try:
        source.on_ack(conn, monotonic_ms(), 0)  # no heartbeat was sent on this connection yet
        assert source.paired_id is None and replica.contact_ms == 0
        source._heartbeat()  # one heartbeat (TTL 5000 ms) goes out on the connection
        sent = replica.hb_sent_ms
        assert sent > 0 and conn.sent
        source.on_ack(conn, sent + 1, 0)  # a time after it: not heard
        assert source.paired_id is None and replica.contact_ms == 0 and replica.unconfirmed
        source.on_ack(conn, sent, 0)  # the heartbeat's own time: heard
        assert source.paired_id == "r/standby" and replica.contact_ms == sent and not replica.unconfirmed
    finally:
        source.close()
