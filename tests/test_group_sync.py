"""The in-sync set rules of fastlock.replication.groupsync, on the gate alone (no process):
a standby is waited for before the set naming it is written, and a member is waited for
until etcd confirmed the set without it (the invariant the promotion without grace rests on)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from fastlock.errors import Unavailable
from fastlock.replication.groupsync import GroupSyncGate
from fastlock.replication.syncrep import SyncOnTimeout, SyncSettings, SyncStatus
from fastlock.roles import Role


class Conn:
    def __init__(self, session: int):
        self.session, self.closed, self.sent = session, False, []

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def flush(self) -> None:
        pass


class Etcd:
    """The publisher: each write waits until the test answers it."""

    def __init__(self):
        self.writes: list[tuple[frozenset, asyncio.Future]] = []

    async def __call__(self, members: frozenset) -> bool:
        fut = asyncio.get_running_loop().create_future()
        self.writes.append((members, fut))
        return await fut

    async def answer(self, ok: bool) -> frozenset:
        members, fut = self.writes[-1]
        fut.set_result(ok)
        for _ in range(3):
            await asyncio.sleep(0)
        return members


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def gate(timeout_ms: int = 60_000, on_timeout: SyncOnTimeout = SyncOnTimeout.FENCE, k: int = 1):
    host = SimpleNamespace(roles=SimpleNamespace(role=Role.PRIMARY, grace_remaining_ms=lambda now: 0),
                           wal=SimpleNamespace(logged_lsn=0), table=SimpleNamespace(epoch=1),
                           loop=asyncio.get_running_loop())
    source = SimpleNamespace(replicas={}, admit_sync_ack=lambda conn, lsn: True)  # window: test_sync_ack_guard.py
    g = GroupSyncGate(host, source, SyncSettings(timeout_ms=timeout_ms, on_timeout=on_timeout), k)
    g.publisher = etcd = Etcd()
    return g, host, source, etcd


def attach(source, session: int, ident: str) -> Conn:
    conn = Conn(session)
    source.replicas[session] = SimpleNamespace(name=f"label@{ident}", conn=conn)
    return conn


def reply(g: GroupSyncGate, host, lsn: int) -> list:
    """Log up to ``lsn`` and hold a reply for it; the list gets "ok" or the error when it goes."""
    host.wal.logged_lsn = lsn
    out: list = []
    g.after(lambda error=None: out.append(error or "ok"))()
    return out


async def test_a_standby_is_waited_for_before_the_set_naming_it_is_written():
    g, host, source, etcd = gate()
    g.status_push()  # the term starts: nothing logged yet
    s1 = attach(source, 1, "r/1")
    g.on_ack(s1, 0)
    await settle()
    assert g.required == {"r/1"} and etcd.writes[-1][0] == {"r/1"}  # waited for before etcd has it
    out = reply(g, host, 5)
    assert out == []  # the set's member lacks LSN 5
    assert await etcd.answer(True) == {"r/1"} and g.published == {"r/1"}
    g.on_ack(s1, 5)
    assert out == ["ok"] and g.status()["state"] == "in_sync"


async def test_a_member_is_waited_for_until_etcd_confirmed_the_set_without_it():
    g, host, source, etcd = gate()
    g.status_push()
    s1, s2 = attach(source, 1, "r/1"), attach(source, 2, "r/2")
    g.on_ack(s1, 0)
    await settle()
    await etcd.answer(True)
    out = reply(g, host, 3)
    g.on_ack(s2, 3)  # another standby has it: k copies, but the member does not
    assert out == []
    s1.closed = True
    del source.replicas[1]  # the member detaches
    g.status_push()  # (every heartbeat) the member leaves, the caught-up standby joins: one write
    await settle()
    assert etcd.writes[-1][0] == {"r/2"} and g.required == {"r/1", "r/2"}
    await etcd.answer(False)  # not confirmed (the primary key is no longer this node's): still waiting
    assert out == [] and "r/1" in g.required
    g.status_push()
    await settle()
    await etcd.answer(True)
    assert out == ["ok"] and g.required == {"r/2"} and g.published == {"r/2"}


async def test_fewer_than_k_copies_fail_at_the_timeout_with_fence_and_degrade_acknowledges():
    for policy in (SyncOnTimeout.FENCE, SyncOnTimeout.DEGRADE):
        g, host, source, etcd = gate(timeout_ms=50, on_timeout=policy)
        g.status_push()
        out = reply(g, host, 1)  # no standby at all
        await asyncio.sleep(0.2)
        if policy is SyncOnTimeout.FENCE:
            assert len(out) == 1 and isinstance(out[0], Unavailable) and g.refusals == 1
        else:
            assert out == ["ok"] and g.degraded and g.degradations == 1
            s1 = attach(source, 1, "r/1")
            g.on_ack(s1, 1)  # a standby has everything again: synchronous again
            assert not g.degraded


async def test_a_primary_in_its_grace_adds_nobody():
    g, host, source, etcd = gate()
    host.roles.grace_remaining_ms = lambda now: 1000
    g.status_push()
    g.on_ack(attach(source, 1, "r/1"), 0)
    await settle()
    assert g.required == set() and etcd.writes == []
    host.roles.grace_remaining_ms = lambda now: 0
    g.status_push()
    assert g.required == {"r/1"}


async def test_with_two_sync_standbys_a_reply_waits_for_both_members():
    g, host, source, etcd = gate(k=2)
    g.status_push()
    s1, s2, s3 = attach(source, 1, "r/1"), attach(source, 2, "r/2"), attach(source, 3, "r/3")
    g.on_ack(s1, 0)
    g.on_ack(s2, 0)
    await settle()
    assert etcd.writes[-1][0] in ({"r/1", "r/2"}, {"r/1"})  # one write at a time
    await etcd.answer(True)
    g.status_push()
    await settle()
    if g.published != {"r/1", "r/2"}:
        await etcd.answer(True)
    assert g.published == {"r/1", "r/2"}  # at most k members: r/3 (no ack yet) stays asynchronous
    out = reply(g, host, 4)
    g.on_ack(s3, 4)
    g.on_ack(s1, 4)
    assert out == []  # one member still lacks it, though two standbys have it
    g.on_ack(s2, 4)
    assert out == ["ok"]


class StandbyWal:
    """The standby's WAL as :class:`SyncStatus` sees it: everything logged is written and fsynced."""

    def __init__(self, lsn: int):
        self.logged_lsn = self.written_lsn = self.synced_lsn = lsn

    def log_up_to(self, lsn: int) -> None:
        self.logged_lsn = self.written_lsn = self.synced_lsn = lsn

    def add_progress_listener(self, listener) -> None:
        pass

    def request_sync(self) -> None:
        pass


def test_a_standby_acknowledges_to_a_new_primary_only_positions_in_that_primarys_log():
    """A standby that follows a new primary still has the applied LSN of the old primary's
    log until the new primary's snapshot arrives, and the ``"sync"`` push can come first (a
    table of more than 10,000 leases is streamed after the attach): acknowledging that LSN
    would make the standby withhold its acknowledgements of the snapshot and of every record
    up to it, so the new primary's first grants would wait for a later record or the
    sync timeout.  It acknowledges nothing until the snapshot, then the snapshot's LSN."""
    acks: list[int] = []
    wal = StandbyWal(12627)
    follower = SimpleNamespace(host=SimpleNamespace(wal=wal), link=SimpleNamespace(send_sync_ack=acks.append),
                               applied_lsn=12625, synced=False)  # LSN 12625 of the old primary's log
    status = SyncStatus(follower)
    status.reset()  # the new connection
    status.on_status(["fsynced", False, "degrade"])
    assert acks == []
    # the new primary's snapshot, at its LSN 12624, applied and logged
    follower.applied_lsn, follower.synced = 12624, True
    wal.log_up_to(12640)
    status.applied(follower.applied_lsn)
    assert acks == [12624]
    follower.applied_lsn = 12625
    wal.log_up_to(12641)
    status.applied(follower.applied_lsn)
    assert acks == [12624, 12625]
