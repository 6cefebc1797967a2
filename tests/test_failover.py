"""Failover against real processes: crash, pause and partition of the primary.

Issue 4's "done when" list, each on a primary and a standby started with
``--failover-after 1.0`` (small windows keep the file well under a minute):

- kill -9 under load: the standby promotes within failover-after + 1 s; the
  holders keep their locks and extend them on the new primary; every later
  token is greater than every earlier one; a fenced SQLite ledger written by
  all workers stays consistent.
- SIGSTOP past the window, promotion, SIGCONT: the old primary grants
  nothing (checked for 3 s through its own address only) and its stale
  holder's write is refused by the ledger.
- the replication link partitioned or reset (no process killed): the primary
  fences itself before the standby promotes, and no two nodes ever grant one
  lock at overlapping times, before or after the link heals.

Synchronous tests with their own ``asyncio.run`` (one loop): they are about
server processes.  Blocking waits on server logs run in a thread so the
clients' tasks keep running.  Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field

import pytest

import fastlock
from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock.errors import (
    ConnectionLost,
    FastlockError,
    LeaseLost,
    LockNotAcquired,
    NotPrimary,
    StaleFencingToken,
    Unavailable,
)
from fastlock.fencing import SQLiteFence

EPOCH_SHIFT = 40
FAILOVER = 1.0  # --failover-after, seconds
GRACE = 0.2  # --promotion-grace where the test is not about the grace period




def epoch(token: int) -> int:
    return token >> EPOCH_SHIFT


async def log_line(srv, pattern: str, timeout: float, start: int = 0) -> float:
    """Wait (in a thread) for a log line; return the monotonic time it was seen."""
    await asyncio.to_thread(srv.wait_for_log, pattern, timeout, start)
    return time.monotonic()


# --------------------------------------------------------------------------- the ledger


class Ledger:
    """An SQLite ledger; every write is fenced by the writer's token (SQLiteFence)."""

    def __init__(self, path):
        self.path = str(path)
        conn = sqlite3.connect(self.path, timeout=10)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE IF NOT EXISTS ledger (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                     "resource TEXT NOT NULL, token INTEGER NOT NULL, writer TEXT NOT NULL)")
        conn.commit()
        SQLiteFence(conn).ensure_schema()
        conn.close()
        self.committed: list[tuple[str, int, str]] = []
        self.stale: list[tuple[str, int, str, int | None]] = []

    def writer(self) -> LedgerWriter:
        return LedgerWriter(self)

    def rows(self) -> list[tuple[str, int, str]]:
        conn = sqlite3.connect(self.path, timeout=10)
        try:
            return [tuple(r) for r in conn.execute("SELECT resource, token, writer FROM ledger ORDER BY seq")]
        finally:
            conn.close()

    def check(self) -> int:
        """Tokens never decrease per resource in commit order, and the rows are
        exactly the writes reported committed (none lost, none stale applied)."""
        rows = self.rows()
        highest: dict[str, int] = {}
        for resource, token, writer in rows:
            assert token >= highest.get(resource, 0), (
                f"{resource}: token {token} by {writer} committed after {highest[resource]}")
            highest[resource] = token
        assert sorted(rows) == sorted(self.committed)
        for resource, token, writer, high in self.stale:
            assert high is not None and token < high, (resource, token, writer, high)
        return len(rows)


class LedgerWriter:
    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.conn = sqlite3.connect(ledger.path, timeout=10)
        self.fence = SQLiteFence(self.conn)

    def write(self, resource: str, token: int, writer: str) -> bool:
        """True if applied; False if refused as stale."""
        try:
            self.fence.execute(resource, token, "INSERT INTO ledger (resource, token, writer) VALUES (?, ?, ?)",
                               (resource, token, writer))
        except StaleFencingToken as exc:
            self.ledger.stale.append((resource, token, writer, exc.highest))
            return False
        self.ledger.committed.append((resource, token, writer))
        return True

    def close(self) -> None:
        self.conn.close()


# --------------------------------------------------------------------------- grant intervals per node


@dataclass
class Grant:
    node: str
    name: str
    token: int
    sent: float  # the acquire was sent (the grant happened after)
    received: float  # the grant arrived (the grant happened before)
    ttl: float
    released: float | None = None  # the release was sent (the lease ended after)

    def surely_held(self) -> tuple[float, float]:
        """An interval in which the node surely considered this lease held:
        from the reply until the release was sent or sent+ttl, whichever is first."""
        end = self.sent + self.ttl
        if self.released is not None:
            end = min(end, self.released)
        return self.received, end


@dataclass
class Hammer:
    """Acquire/hold/release on a few names on each node, over direct connections only."""

    names: list[str]
    ttl_ms: int = 400
    hold: float = 0.02
    grants: list[Grant] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, address: str, name: str) -> None:
        node: RawNode | None = None
        try:
            while not self.stop.is_set():
                if node is None or node.closed:
                    try:
                        node = await RawNode.open(address, name=f"hammer-{name}", timeout=1.0)
                    except (OSError, asyncio.TimeoutError, FastlockError):
                        node = None
                        await asyncio.sleep(0.02)
                        continue
                sent = time.monotonic()
                try:
                    token, ttl_ms, owner = await asyncio.wait_for(node.acquire(name, self.ttl_ms), 2.0)
                except (FastlockError, asyncio.TimeoutError) as exc:
                    key = type(exc).__name__
                    self.errors[key] = self.errors.get(key, 0) + 1
                    if isinstance(exc, asyncio.TimeoutError):
                        await node.close()
                        node = None
                    await asyncio.sleep(0.005)
                    continue
                g = Grant(address, name, token, sent, time.monotonic(), ttl_ms / 1000.0)
                self.grants.append(g)
                await asyncio.sleep(self.hold)
                g.released = time.monotonic()
                try:
                    await asyncio.wait_for(node.release(name, token, owner), 2.0)
                except (FastlockError, asyncio.TimeoutError):
                    pass
        finally:
            if node is not None:
                await node.close()

    def start(self, addresses: list[str]) -> list[asyncio.Task]:
        return [asyncio.ensure_future(self.run(a, n)) for a in addresses for n in self.names]

    def check_no_overlap_across_nodes(self) -> int:
        by_name: dict[str, list[Grant]] = {}
        for g in self.grants:
            by_name.setdefault(g.name, []).append(g)
        for name, grants in by_name.items():
            for i, a in enumerate(grants):
                for b in grants[i + 1:]:
                    if a.node == b.node:
                        continue
                    (s1, e1), (s2, e2) = a.surely_held(), b.surely_held()
                    assert not (s1 < e2 and s2 < e1), (
                        f"{name!r} granted by two nodes at once: {a.node} token {a.token} held "
                        f"[{s1:.3f}, {e1:.3f}] and {b.node} token {b.token} held [{s2:.3f}, {e2:.3f}]")
        tokens = [g.token for g in self.grants]
        assert len(tokens) == len(set(tokens)), "a token was handed out twice"
        return len(self.grants)


# --------------------------------------------------------------------------- kill -9


def test_kill9_under_load_standby_takes_over(cluster, tmp_path):
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)
    ledger = Ledger(tmp_path / "ledger.db")
    accounts = [f"acct/{i}" for i in range(3)]
    grants: list[tuple[float, int, str, float]] = []  # (received, token, name, sent)

    async def worker(i: int, stop: asyncio.Event) -> int:
        w = ledger.writer()
        n = 0
        async with fastlock.connect(p.address, s.address, client_name=f"w{i}", connect_timeout=1.0) as c:
            while not stop.is_set():
                name = accounts[(i + n) % len(accounts)]
                sent = time.monotonic()
                try:
                    lease = await c.acquire(name, ttl=2.0, wait=3.0)
                except (ConnectionLost, LockNotAcquired, NotPrimary, Unavailable):
                    await asyncio.sleep(0.02)
                    continue
                grants.append((time.monotonic(), lease.fencing_token, name, sent))
                n += 1
                w.write(name, lease.fencing_token, f"w{i}")
                # release with the lease we have, on whichever node is primary, until it is gone
                while lease.time_left() > 0:
                    try:
                        await c.release(lease)
                        break
                    except LeaseLost:
                        break
                    except (ConnectionLost, NotPrimary, Unavailable):
                        await asyncio.sleep(0.02)
        w.close()
        return n

    async def main():
        holders = [await fastlock.connect(p.address, s.address, client_name=f"h{i}", connect_timeout=1.0)
                   for i in range(3)]
        waiter_client = await fastlock.connect(p.address, s.address, client_name="waiter", connect_timeout=1.0)
        stop = asyncio.Event()
        workers = []
        try:
            # holders with auto-renewal (TTL 3 s), replicated before the crash
            ctxs = [h.lock(f"held/{i}", ttl=3.0, wait=1.0) for i, h in enumerate(holders)]
            leases = [await ctx.__aenter__() for ctx in ctxs]
            waiting = asyncio.ensure_future(waiter_client.acquire("held/0", ttl=3.0, wait=None))
            workers = [asyncio.ensure_future(worker(i, stop)) for i in range(6)]
            await poll(lambda: asyncio.sleep(0.05, len(grants)), lambda n: n >= 60, timeout=10,
                       what="load on the primary")
            pst = await status_of(p.address)
            await poll(lambda: status_of(s.address),
                       lambda st: st["replication"]["applied_lsn"] >= pst["wal"]["last_lsn"],
                       timeout=5, what="standby caught up")

            promoted = asyncio.ensure_future(log_line(s, r"PROMOTED", 10))
            killed_at = time.monotonic()
            await asyncio.to_thread(p.kill)
            dead_at = time.monotonic()  # an acquire sent after this can only be granted by the standby
            n_before = len(grants)

            promoted_at = await promoted
            first_new = await poll(lambda: asyncio.sleep(0.01, [g for g in grants if g[3] > dead_at]),
                                   lambda gs: len(gs) > 0, timeout=FAILOVER + 5, what="a grant after the crash")
            first_grant_at = min(g[0] for g in first_new)

            # the holders still hold, on the new primary, with the same tokens; they extend there
            node = await RawNode.open(s.address)
            try:
                for lease in leases:
                    assert not lease.lost.is_set(), f"{lease.name} lost across the failover"
                    assert (await node.holder(lease.name))["token"] == lease.fencing_token
            finally:
                await node.close()
            for h, lease in zip(holders, leases):
                assert (await h.extend(lease)).fencing_token == lease.fencing_token
                assert h.server_info["role"] == "primary" and h.server_info["epoch"] == 1
            # an acquire waiting (wait=None) at the crash rode through: it waits on the new
            # primary and is granted there when held/0 is released
            assert not waiting.done()
            await ctxs[0].__aexit__(None, None, None)
            handed = await asyncio.wait_for(waiting, 5.0)
            assert epoch(handed.fencing_token) == 1 and handed.fencing_token > leases[0].fencing_token
            assert waiter_client.server_info["epoch"] == 1
            await waiter_client.release(handed)

            # let every worker get through the new primary, then stop
            await poll(lambda: asyncio.sleep(0.05, len(grants)), lambda n: n >= n_before + 30, timeout=10,
                       what="load on the new primary")
            stop.set()
            await asyncio.wait_for(asyncio.gather(*workers), 10)
            for ctx in ctxs[1:]:
                await ctx.__aexit__(None, None, None)
        finally:
            stop.set()
            for t in workers:
                t.cancel()
            for c in [*holders, waiter_client]:
                await c.close()

        # an acquire sent before the crash may ride through and be granted by the new
        # primary; one sent after it can only be granted there
        before = [t for _, t, _, _ in grants if epoch(t) == 0]
        after = [t for _, t, _, _ in grants if epoch(t) == 1]
        assert len(before) + len(after) == len(grants)
        assert after and min(after) > max(before), "a token after the failover is not above every token before"
        assert all(epoch(t) == 1 for _, t, _, sent in grants if sent > dead_at)
        tokens = [t for _, t, _, _ in grants]
        assert len(tokens) == len(set(tokens)), "a token was handed out twice"
        assert ledger.check() == len(ledger.committed) > 0
        print(f"\nkill -9 -> PROMOTED {promoted_at - killed_at:.3f} s, -> first grant "
              f"{first_grant_at - killed_at:.3f} s; {len(grants)} grants, {len(ledger.committed)} "
              f"ledger rows, {len(ledger.stale)} stale writes refused")
        assert promoted_at - killed_at <= FAILOVER + 1.0  # issue 4: promotion within F + 1 s
        # The first grant also waits for a worker's retry to land on the new primary (client
        # reconnect and retry cadence), which a loaded CI machine stretches: measured in
        # benches/failover.py (median ~1.07 s); here only bounded.
        assert first_grant_at - killed_at <= FAILOVER + GRACE + 4.0

    run(main())


# --------------------------------------------------------------------------- SIGSTOP


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_paused_primary_grants_nothing_after_the_standby_promotes(cluster, tmp_path, loop):
    """SIGSTOP the primary past the failover window, then SIGCONT it.

    During the pause, one lease expires and another's release is queued in
    its socket, each with a waiter queued on the old primary: the hand-offs
    that a resumed primary could perform before noticing it is fenced (on the
    stdlib loop, I/O callbacks run before due timers; on uvloop, timers run in
    deadline order).
    """
    p = cluster.primary(args=[] if loop == "uvloop" else ["--no-uvloop"])
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)
    ledger = Ledger(tmp_path / "ledger.db")

    async def main():
        old = await RawNode.open(p.address, name="old-holders")
        waiters = await RawNode.open(p.address, name="old-waiters")
        # the old address only; its deadline (request_timeout) ends with the 3 s observation below
        stale = await fastlock.connect(p.address, client_name="stale-holder", request_timeout=3.0)
        new = w1 = w2 = released = refused_extend = None
        try:
            # the stale holder: it holds "ledger" from before the pause and wrote with its token
            lease = await stale.acquire("ledger", ttl=1.0)
            w = ledger.writer()
            assert w.write("ledger", lease.fencing_token, "stale")
            q1_token, _, q1_owner = await old.acquire("q1", 30_000)  # released during the pause
            await old.acquire("q2", 600)  # expires during the pause
            w1 = asyncio.ensure_future(waiters.acquire("q1", 5000, wait_ms=20_000))
            w2 = asyncio.ensure_future(waiters.acquire("q2", 5000, wait_ms=20_000))
            await poll(lambda: old.status(), lambda st: st["waiters"] == 2, timeout=5, what="two waiters")
            await poll(lambda: status_of(s.address),
                       lambda st: st["replication"]["lag_records"] == 0 and st["locks_held"] == 3,
                       timeout=5, what="standby caught up")
            last_token = (await old.status())["last_token"]

            promoted = asyncio.ensure_future(log_line(s, r"PROMOTED", 10))
            p.pause()
            paused_at = time.monotonic()
            released = asyncio.ensure_future(old.release("q1", q1_token, q1_owner))  # sits in the socket
            promoted_at = await promoted
            p.resume()
            assert promoted_at - paused_at <= FAILOVER + 1.0

            # the new primary grants "ledger" (once the replicated lease runs out) and a write lands
            new = await fastlock.connect(s.address, client_name="new-holder")
            new_lease = await new.acquire("ledger", ttl=2.0, wait=5.0)
            assert epoch(new_lease.fencing_token) == 1
            assert w.write("ledger", new_lease.fencing_token, "new")

            # the resumed old primary grants nothing for 3 s, to anybody, by any path
            try:
                await released
            except (Unavailable, NotPrimary, ConnectionLost):
                pass
            # meanwhile the stale holder tries to extend its lease there (awaited below)
            refused_extend = asyncio.ensure_future(stale.extend(lease))
            observe_until = time.monotonic() + 3.0
            old_grants = []
            while time.monotonic() < observe_until:
                try:
                    async with fastlock.connect(p.address, client_name="probe", connect_timeout=1.0) as c:
                        got = await c.acquire(f"fresh/{len(old_grants)}", ttl=1.0, wait=0)
                        old_grants.append(("probe via " + c.server_info.get("role", "?"), got.fencing_token))
                except (Unavailable, NotPrimary, ConnectionLost, LockNotAcquired):
                    pass
                await asyncio.sleep(0.1)
            for fut in (w1, w2):
                if fut.done() and fut.exception() is None:
                    old_grants.append(("waiter", fut.result()[0]))
            assert not [g for g in old_grants if epoch(g[1]) == 0], f"the old primary granted: {old_grants}"
            st = await status_of(p.address)
            if st["role"] == "primary":
                assert st["last_token"] == last_token, "the old primary issued a token after the pause"
                assert st["replication"]["fenced"]
            else:  # it rejoined the new primary as its standby: every token it knows is the new primary's
                assert st["role"] in ("standby", "deposed") and st["last_token"] >= last_token, st
            # it refuses to extend the stale lease too: the client, which knows no other
            # address, rides through until its deadline, then surfaces the refusal
            with pytest.raises((ConnectionLost, LeaseLost)) as refused:
                await refused_extend
            if refused.type is ConnectionLost:
                assert isinstance(refused.value.__cause__, (Unavailable, NotPrimary)), refused.value

            # the stale holder wakes and writes as if it still held: the ledger refuses
            assert not w.write("ledger", lease.fencing_token, "stale")
            w.close()
            assert ledger.check() == 2
            assert ledger.stale[0][:3] == ("ledger", lease.fencing_token, "stale")
        finally:
            for c in (stale, new):
                if c is not None:
                    await c.close()
            await old.close()
            await waiters.close()
            for fut in (w1, w2, released, refused_extend):
                if fut is not None and fut.done() and not fut.cancelled():
                    fut.exception()  # retrieved: a lost connection at the end is expected

    run(main())


# --------------------------------------------------------------------------- partitions


@pytest.mark.parametrize("how", ["partition", "reset"])
def test_replication_link_down_no_two_nodes_grant_at_once(cluster, how):
    """The replication link goes down with both processes alive: ``partition``
    (sockets stay open, nothing flows) or ``reset`` (the connection is closed
    and the standby cannot reconnect).  Both nodes are hammered directly the
    whole time; the link then comes back."""
    p = cluster.primary()
    px = cluster.proxy(p.address)
    s = cluster.standby(px.address, failover_after=FAILOVER, grace=GRACE)

    async def main():
        hammer = Hammer(["n/0", "n/1", "n/2"])
        tasks = hammer.start([p.address, s.address])
        try:
            await poll(lambda: asyncio.sleep(0.02, len(hammer.grants)), lambda n: n >= 20, timeout=5,
                       what="grants before the partition")
            down_at = time.monotonic()
            promoted = asyncio.ensure_future(log_line(s, r"PROMOTED", 10))
            px.pause()
            if how == "reset":
                assert px.cut() == 1
            fenced = await poll(lambda: status_of(p.address), lambda st: st["replication"]["fenced"],
                                timeout=FAILOVER + 1, what="the primary to fence itself", interval=0.005)
            fenced_at = time.monotonic()
            assert (await status_of(s.address))["role"] == "standby", "the standby promoted before the fence"
            with pytest.raises(Unavailable):
                node = await RawNode.open(p.address)
                try:
                    await node.acquire("n/9", 1000)
                finally:
                    await node.close()
            promoted_at = await promoted
            assert fenced_at < promoted_at
            assert fenced["last_token"] >= max(g.token for g in hammer.grants if g.node == p.address)

            # the new primary grants once its grace is over
            await poll(lambda: asyncio.sleep(0.02, [g for g in hammer.grants if g.node == s.address]),
                       lambda gs: len(gs) >= 10, timeout=5, what="grants by the new primary")
            px.resume()
            healed_at = time.monotonic()
            await asyncio.sleep(1.0)  # keep hammering both with the link back
        finally:
            hammer.stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)

        old_after = [g for g in hammer.grants if g.node == p.address and g.sent >= fenced_at]
        assert not old_after, f"the fenced old primary granted: {old_after}"
        new = [g for g in hammer.grants if g.node == s.address]
        assert all(epoch(g.token) == 1 for g in new)
        assert min(g.token for g in new) > max(g.token for g in hammer.grants if g.node == p.address)
        assert hammer.check_no_overlap_across_nodes() > 30
        st = await status_of(p.address)
        if st["role"] == "primary":
            assert st["replication"]["fenced"], "the old primary unfenced itself after the link healed"
            assert st["last_token"] == fenced["last_token"]
        else:  # it reached the new primary's own address (only the link was cut) and rejoined it
            assert st["role"] == "standby" and st["epoch"] == 1, st
        print(f"\n{how}: fenced {fenced_at - down_at:.3f} s after the link went down, promoted "
              f"{promoted_at - down_at:.3f} s; {len(hammer.grants)} grants; healed at +{healed_at - down_at:.1f} s")

    run(main())


def test_reset_link_primary_fences_itself_without_client_traffic(cluster):
    """With the replication connection reset and no standby attached, the
    primary must still fence itself on time: no request arrives to make it
    look at its clock, and once the standby may have promoted a release is
    refused (the new primary would never see it) and hands the lock to nobody;
    the waiter is sent away (its connection closed) to look for the new primary.
    The primary has no replica credential, so it cannot find the new primary and
    step down (which closes every connection): what it does while fenced is checked
    after the promotion without racing its rejoin."""
    p = cluster.primary(replica_credential=False)
    px = cluster.proxy(p.address)
    s = cluster.standby(px.address, failover_after=FAILOVER, grace=GRACE)

    async def main():
        holder = await RawNode.open(p.address, name="holder")
        waiter = await RawNode.open(p.address, name="waiter")
        watcher = await RawNode.open(p.address, name="status")
        try:
            token, _, owner = await holder.acquire("k", 10_000)
            queued = asyncio.ensure_future(waiter.acquire("k", 5000, wait_ms=20_000))
            await poll(lambda: watcher.status(), lambda st: st["waiters"] == 1, timeout=5, what="waiter queued")
            last_token = (await watcher.status())["last_token"]
            promoted = asyncio.ensure_future(log_line(s, r"PROMOTED", 10))
            px.pause()
            assert px.cut() == 1
            down_at = time.monotonic()
            # only STATUS requests from here: they must not be what fences it
            await poll(lambda: watcher.status(), lambda st: st["replication"]["fenced"], timeout=FAILOVER + 1,
                       what="the primary to fence itself with no standby attached", interval=0.02)
            fenced_at = time.monotonic()
            promoted_at = await promoted
            assert fenced_at < promoted_at
            with pytest.raises(Unavailable):
                await holder.release("k", token, owner)
            with pytest.raises(ConnectionLost):
                await asyncio.wait_for(queued, 2.0)
            assert (await watcher.status())["locks_held"] == 1
            assert (await watcher.status())["last_token"] == last_token
            print(f"\nreset: fenced {fenced_at - down_at:.3f} s, promoted {promoted_at - down_at:.3f} s")
        finally:
            for n in (holder, waiter, watcher):
                await n.close()

    run(main())


def test_delayed_replicate_from_a_promoted_standby_does_not_unfence_the_primary(cluster):
    """A REPLICATE the standby sent before it promoted, delivered late (after
    a partition heals), must not count as contact: only an echo of a
    heartbeat the primary sent after it may lift the fence.  Simulated by
    replaying the standby's HELLO + REPLICATE on a raw socket.  The primary has no
    replica credential, so it stays a fenced primary after the promotion rather than
    rejoining the new primary (found at its paired standby's own address)."""
    from fastlock import protocol as P

    p = cluster.primary(replica_credential=False)
    px = cluster.proxy(p.address)
    s = cluster.standby(px.address, failover_after=FAILOVER, grace=GRACE)

    async def main():
        promoted = asyncio.ensure_future(log_line(s, r"PROMOTED", 10))
        px.pause()
        await poll(lambda: status_of(p.address), lambda st: st["replication"]["fenced"], timeout=FAILOVER + 1,
                   what="the primary to fence itself")
        await promoted
        st = await status_of(p.address)
        last_token = st["last_token"]
        paired = st["replication"]["paired_standby"]  # "label@replica principal/node id"
        # the late message: [id, REPLICATE, from_lsn, incarnation, failover_after_ms, name], then gone,
        # over a connection authenticated with the real standby's credential
        ghost = await RawNode.open(p.address, name="standby:standby",
                                   token=cluster.creds.token(cluster.replica_of("standby")))
        await ghost.request(P.OP_REPLICATE, 0, None, int(FAILOVER * 1000),
                            f"standby@{paired.rpartition('/')[2]}")
        await ghost.close()
        probe = await RawNode.open(p.address)
        try:
            with pytest.raises(Unavailable):
                await probe.acquire("x", 1000)
            st = await probe.status()
            assert st["replication"]["fenced"] and st["last_token"] == last_token
        finally:
            await probe.close()

    run(main())


def test_old_primary_rejoins_as_standby_of_the_new_one_and_fails_back(cluster):
    """kill -9, promotion, then the old primary's data dir restarted with
    ``--standby-of`` the new primary: it resyncs (epoch 1, the new primary's
    leases), and when the new primary dies in turn it takes over with epoch 2."""
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)

    async def main():
        a = await RawNode.open(p.address)
        try:
            t0, _, o0 = await a.acquire("kept", 5000)
            await a.acquire("orphan", 5000)  # nobody will renew it: replicated all the same
            await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 2, timeout=5,
                       what="standby caught up")
        finally:
            await a.close()
        promoted = asyncio.ensure_future(log_line(s, r"PROMOTED", 10))
        await asyncio.to_thread(p.kill)
        await promoted
        b = await RawNode.open(s.address)
        try:
            t1, _, o1 = await asyncio.wait_for(b.acquire("new", 5000, wait_ms=3000), 5)
            assert epoch(t1) == 1 and t1 > t0
            assert await b.extend("kept", t0, o0, 5000) == 5000
        finally:
            await b.close()

        # the old primary comes back as a standby of the new one
        old = await asyncio.to_thread(
            lambda: cluster._start(type(p)(p.data_dir, args=["--standby-of", s.address, "--name", "old",
                                                             *cluster.auth_args("primary"),
                                                             "--failover-after", str(FAILOVER),
                                                             "--promotion-grace", str(GRACE)])))
        await asyncio.to_thread(old.wait_for_log, r"applied snapshot at primary LSN \d+: 3 leases, epoch 1", 10)
        await asyncio.to_thread(old.wait_for_log, r"paired: primary", 10)
        st = await poll(lambda: status_of(old.address),
                        lambda st: st["replication"]["lag_records"] == 0 and st["locks_held"] == 3,
                        timeout=5, what="old primary resynced as a standby")
        assert st["role"] == "standby" and st["epoch"] == 1
        with pytest.raises(NotPrimary) as info:
            n = await RawNode.open(old.address)
            try:
                await n.acquire("x", 1000)
            finally:
                await n.close()
        assert info.value.primary == s.address

        # fail back
        promoted = asyncio.ensure_future(log_line(old, r"PROMOTED", 10))
        await asyncio.to_thread(s.kill)
        await promoted
        c = await RawNode.open(old.address)
        try:
            assert c.hello["epoch"] == 2
            assert await c.extend("kept", t0, o0, 5000) == 5000
            assert await c.extend("new", t1, o1, 5000) == 5000
            t2, _, _ = await asyncio.wait_for(c.acquire("after", 5000, wait_ms=3000), 5)
            assert epoch(t2) == 2 and t2 > t1
        finally:
            await c.close()

    run(main())


def test_new_primary_restarted_during_its_promotion_grace_holds_grants_again(cluster):
    """kill -9 of the primary, promotion with a 3 s grace, then kill -9 of the new
    primary during that grace and a restart of its data dir: the old primary may
    have granted locks that never reached it, so the restarted node grants no free
    lock for a whole grace again (it cannot know how long it was down), and
    forgets the grace once it has run out."""
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=3.0)

    async def main():
        promoted = asyncio.ensure_future(log_line(s, r"PROMOTED", 10))
        await asyncio.to_thread(p.kill)
        await promoted
        await asyncio.to_thread(s.kill)
        restarting = time.monotonic()
        again = await asyncio.to_thread(lambda: cluster._start(type(s)(
            s.data_dir, args=["--name", "again", "--credentials", cluster.creds.file])))
        await asyncio.to_thread(again.wait_for_log, r"restarted during its promotion grace", 5)
        st = await status_of(again.address)
        assert st["role"] == "primary" and st["epoch"] == 1
        # the whole 3 s grace again, started after the restart began (whatever the restart took)
        since_ms = (time.monotonic() - restarting) * 1000
        assert 3000 - since_ms - 1 <= st["grace_remaining_ms"] <= 3000, (st["grace_remaining_ms"], since_ms)
        n = await RawNode.open(again.address)
        try:
            with pytest.raises(LockNotAcquired, match="promotion grace"):
                await n.acquire("free", 1000)
            token, _, _ = await asyncio.wait_for(n.acquire("free", 1000, wait_ms=5000), 6)
            assert epoch(token) == 1
        finally:
            await n.close()
        state = await poll(lambda: asyncio.to_thread(
            lambda: json.loads((again.data_dir / "node-state.json").read_text())),
            lambda st: st.get("grace_ms") == 0, timeout=2, what="grace forgotten once it ended")
        assert state["standby_of"] is None

    run(main())


def test_a_standby_paused_past_its_window_does_not_promote_over_a_live_primary(cluster):
    """SIGSTOP of the standby for 2.5 failover windows, then SIGCONT: the primary
    fenced itself meanwhile (it heard no echo), but it kept sending heartbeats.
    The standby's watchdog runs late on resume, before the heartbeats queued in
    its socket are read: it must read them rather than promote, so the pair
    comes back as it was (the primary unfenced, the standby following)."""
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)
    s.wait_for_log(r"paired: primary", 10)
    start_p, start_s = len(p.lines), len(s.lines)
    s.pause()
    p.wait_for_log(r"no word from the standby", 5, start_p)
    time.sleep(2.5 * FAILOVER)  # the fault itself: the standby stays frozen past its window
    s.resume()
    s.wait_for_log(r"stalled itself", 5, start_s)
    p.wait_for_log(r"fence lifted", 5, start_p)

    async def main():
        st = await status_of(s.address)
        assert st["role"] == "standby" and st["epoch"] == 0
        st = await status_of(p.address)
        assert st["role"] == "primary" and not st["replication"]["fenced"]

    run(main())
    assert not any("PROMOTED" in line for line in s.lines[start_s:])


def test_a_fence_margin_not_below_the_failover_window_is_reported_at_pairing(cluster):
    """--fence-margin 5 s on a primary whose standby has a 1 s window: the fence
    closes at once on every heartbeat, so the primary never grants; it says so,
    naming the flag, when it pairs, rather than only 'no word from the standby
    for 0 ms' lines."""
    p = cluster.primary(args=["--fence-margin", "5"])
    cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)
    line = p.wait_for_log(r"--fence-margin 5000 ms", 10)
    assert "failover window (1000 ms)" in line and "CRITICAL" in line


def test_short_partition_fences_then_unfences_without_promotion(cluster):
    """A partition shorter than the failover window: the primary stops granting
    and releasing (the holder's release is refused, to be repeated), the link
    heals before the standby may promote, the primary resumes, the repeated
    release hands the lock to the queued acquire; the standby stays a standby."""
    p = cluster.primary(args=["--fence-margin", "1.0"])
    px = cluster.proxy(p.address)
    s = cluster.standby(px.address, failover_after=2.0, grace=GRACE)

    async def main():
        a = await RawNode.open(p.address)
        b = await RawNode.open(p.address)
        try:
            token, _, owner = await a.acquire("y", 10_000)
            queued = asyncio.ensure_future(b.acquire("y", 5000, wait_ms=10_000))
            await poll(lambda: a.status(), lambda st: st["waiters"] == 1, timeout=5, what="waiter queued")
            px.pause()
            paused_at = time.monotonic()
            await poll(lambda: a.status(), lambda st: st["replication"]["fenced"], timeout=2.0,
                       what="the primary to fence itself")
            with pytest.raises(Unavailable):
                await a.acquire("x", 1000)
            with pytest.raises(Unavailable):
                await a.release("y", token, owner)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(queued), 0.1)
            await asyncio.sleep(max(0.0, paused_at + 1.3 - time.monotonic()))
            assert not queued.done()
            px.resume()
            await poll(lambda: a.status(), lambda st: not st["replication"]["fenced"], timeout=2.0,
                       what="the primary to unfence")
            assert not queued.done()
            await a.release("y", token, owner)  # repeated: now it takes effect
            t2, _, _ = await asyncio.wait_for(queued, 2)
            assert epoch(t2) == 0 and t2 > token
            t3, _, _ = await a.acquire("x", 1000)
            st = await status_of(s.address)
            assert st["role"] == "standby" and st["epoch"] == 0
        finally:
            await a.close()
            await b.close()
        assert not any("PROMOTED" in line for line in s.lines)

    run(main())


def test_standby_gone_primary_fences_until_serve_alone(cluster):
    """The standby dies (no promotion): the primary fences itself by its own
    timer, and a whole window later sends its waiter away (it may be needed at a
    promoted standby); ``fastlock serve-alone`` is the operator's override; a
    standby attaching again turns the fence back on."""
    import subprocess
    import sys

    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=FAILOVER)

    async def main():
        a = await RawNode.open(p.address)
        b = await RawNode.open(p.address)
        try:
            token, _, owner = await a.acquire("k", 10_000)
            queued = asyncio.ensure_future(b.acquire("k", 10_000, wait_ms=10_000))
            await poll(lambda: a.status(), lambda st: st["waiters"] == 1, timeout=5, what="queued")
            await asyncio.to_thread(s.kill)
            # the fence is due by the primary's own clock, and checked before every grant and
            # extend (fence_if_due), whenever its timer runs: the test waits with a generous bound
            await poll(lambda: a.status(), lambda st: st["replication"]["fenced"], timeout=10 * FAILOVER,
                       what="the primary to fence itself")
            with pytest.raises(Unavailable):
                await a.extend("k", token, owner, 10_000)
            with pytest.raises(Unavailable):
                await a.acquire("other", 1000)
            with pytest.raises(Unavailable):
                await a.release("k", token, owner)
            with pytest.raises(ConnectionLost):  # never granted: sent away a window after the last echo
                await asyncio.wait_for(queued, FAILOVER + 1)
            assert (await a.status())["last_token"] == token

            res = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "fastlock", "serve-alone",
                                                           "--server", p.address],
                                          capture_output=True, text=True, timeout=20,
                                          cwd=tempfile.gettempdir())
            assert res.returncode == 0, res.stderr
            await a.release("k", token, owner)  # repeated after serve-alone: takes effect
            t2, _, o2 = await a.acquire("k", 10_000)  # granted at once
            assert t2 > token
            st = await a.status()
            assert st["replication"]["serving_alone"] and not st["replication"]["fenced"]
            assert await a.extend("k", t2, o2, 10_000) == 10_000

            s2 = await asyncio.to_thread(cluster.standby, p.address, "standby2", failover_after=FAILOVER)
            st = await poll(lambda: a.status(), lambda st: len(st["replication"]["standbys"]) == 1, timeout=5,
                            what="the new standby attached")
            assert not st["replication"]["serving_alone"]
            assert st["replication"]["paired_window_ms"] == int(FAILOVER * 1000)
            await asyncio.to_thread(s2.kill)
            await poll(lambda: a.status(), lambda st: st["replication"]["fenced"], timeout=FAILOVER + 1,
                       what="the fence to apply again")
        finally:
            await a.close()
            await b.close()

    run(main())


# --------------------------------------------------------------------------- the client's part


def test_a_client_that_saw_the_new_epoch_does_not_depose_the_fenced_old_primary(cluster):
    """A client's HELLO epoch is a hint only (any client could send any epoch); the old
    primary stays safe because it stays fenced: its standby, now primary, never echoes again."""
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)

    async def main():
        # old primary paused past the window: the standby promotes; the old one resumes fenced
        promoted = asyncio.ensure_future(log_line(s, r"PROMOTED", 10))
        p.pause()
        await promoted
        p.resume()
        async with fastlock.connect(s.address, p.address, client_name="c", connect_timeout=1.0) as c:
            lease = await c.acquire("x", ttl=2.0, wait=2.0)
            assert epoch(lease.fencing_token) == 1
            await asyncio.to_thread(s.stop)  # the new primary goes away: the client reconnects to the old one
            with pytest.raises((ConnectionLost, Unavailable, NotPrimary)):
                await c.acquire("y", ttl=2.0, wait=0)
        st = await status_of(p.address)
        # fenced at its old epoch, or rejoined the new primary (found at its address) before it stopped:
        # never a primary the client's epoch hint unfenced or deposed
        assert (st["role"] == "primary" and st["epoch"] == 0 and st["replication"]["fenced"]) or (
            st["role"] == "standby" and st["replication"]["primary"] == s.address), st
        node = await RawNode.open(p.address, known_epoch=1)
        try:
            with pytest.raises((Unavailable, NotPrimary)):
                await node.acquire("y", 1000)
        finally:
            await node.close()

    run(main())
