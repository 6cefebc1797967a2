"""Key prefix watches that resume from a position (docs/watches.md, fastlock/server/keyrevisions.py).

- the history: positions (revision, index within the record), Compacted inside a record,
  the byte bound, WatchDiverged by the lock history's lineage (no server);
- a prefix watch keeps an exact view of its keys across cut connections (a TCP proxy)
  and across kill -9 of the primary of a synchronous pair: positions strictly grow, every
  acknowledged put and delete and every key of an ended lease is seen, and the view built
  from the events equals the server's keys;
- KEY_WATCH_FROM refusals (Compacted with the oldest revision, WatchDiverged, bad
  arguments) change nothing; progress notices; the blocking client's watch.

Every wait has a deadline; servers are stopped by PID (the fixtures).
"""

from __future__ import annotations

import asyncio
import random

import pytest

import fastlock
from fastlock._testbase.cluster import RawNode, run
from fastlock._testbase.proxy import TcpProxy
from fastlock.errors import Compacted, FastlockError, InvalidArgument, WatchDiverged
from fastlock.protocol.ops import OP_KEY_WATCH_FROM
from fastlock.server.keyrevisions import WHOLE, KeyChangeLog, position
from fastlock.server.watchlog import revision
from fastlock.tokens import make_token

FAILOVER = 1.0  # --failover-after, seconds
SYNC = ["--replication", "sync"]


# --------------------------------------------------------------------------- the history alone

def test_positions_order_the_changes_of_one_record_by_index():
    log = KeyChangeLog(100)
    log.start(revision(0, 10))
    r11, r12 = revision(0, 11), revision(0, 12)
    log.record(r11, 0, "a/x", "put", b"1")
    for i, key in enumerate(["a/x", "a/y", "b/z"]):  # one lease's end deletes three keys
        log.record(r12, i, key, "released", None)
    assert log.progress(r12) == revision(0, 10)  # nothing published yet
    assert [c[2] for c in log.publish(r12)] == [0, 0, 1, 2]
    now = r12
    assert [(c.key, c.offset) for c in log.since("a/", r11, None, now)] == [("a/x", 0), ("a/y", 1)]
    assert [(c.key, c.offset) for c in log.since("", r12, 0, now)] == [("a/y", 1), ("b/z", 2)]
    assert log.since("", r12, None, now) == []
    assert position(r12, None) > position(r12, 2) > position(r12, 0) > position(r11, None)
    assert position(r12, None) & WHOLE == WHOLE


def test_compacted_inside_a_record_and_the_byte_bound():
    log = KeyChangeLog(3)
    log.start(revision(0, 1))
    r = revision(0, 2)
    for i in range(5):  # five keys of one lease: the first two leave the history
        log.record(r, i, f"k/{i}", "expired", None, published=True)
    now = r
    assert [c.offset for c in log.since("k/", r, 1, now)] == [2, 3, 4]
    with pytest.raises(Compacted) as info:
        log.since("k/", r, 0, now)  # (r, 1) is gone: resuming after (r, 0) would skip it
    assert info.value.oldest == r
    with pytest.raises(Compacted):
        log.since("k/", revision(0, 1), None, now)
    small = KeyChangeLog(1000, max_bytes=1000)
    for i in range(10):
        small.record(revision(0, 2 + i), 0, f"v/{i}", "put", b"x" * 300, published=True)
    assert small.bytes <= 1000 and len(small.changes) < 10
    with pytest.raises(Compacted):
        small.since("v/", revision(0, 2), None, revision(0, 11))


def test_a_revision_this_node_never_had_diverges():
    lineage = {0: 50}  # this node followed epoch 0 up to LSN 50, then was promoted (epoch 1)
    log = KeyChangeLog(100, lineage=lineage)
    log.start(revision(0, 40))
    now = revision(1, 5)
    assert log.since("", revision(0, 50), None, now) == []
    with pytest.raises(WatchDiverged):
        log.since("", revision(0, 51), None, now)
    with pytest.raises(WatchDiverged):
        log.since("", revision(2, 1), None, now)


# --------------------------------------------------------------------------- real processes

class View:
    """One prefix watch: every event kept, and the keys it says exist."""

    def __init__(self, client: fastlock.Client, prefix: str):
        self.events: list[fastlock.KeyEvent] = []
        self.keys: dict[str, bytes] = {}
        self.errors: list[BaseException] = []
        self.changed = asyncio.Event()
        self.started = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(client, prefix))

    async def _run(self, client: fastlock.Client, prefix: str) -> None:
        try:
            async for event in client.watch_prefix(prefix, progress=True):
                self.started.set()
                if event.what == "progress":
                    continue
                self.events.append(event)
                if event.what == "put":
                    self.keys[event.key] = event.value
                else:
                    self.keys.pop(event.key, None)
                self.changed.set()
        except BaseException as exc:
            self.errors.append(exc)
            self.changed.set()
            raise

    async def wait(self, done, timeout: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done(self):
            assert not self.errors, f"the watch failed: {self.errors[0]!r}"
            left = deadline - loop.time()
            assert left > 0, f"timed out after {timeout} s waiting for {what}"
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))
            except asyncio.TimeoutError:
                pass

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    def check_positions(self) -> None:
        at = [(e.revision, e.offset) for e in self.events]
        assert all(r is not None and i is not None for r, i in at)
        assert at == sorted(set(at)), "positions repeat or go back"


class Writer:
    """Rounds over disjoint groups: three keys on a lease, a plain key put and deleted, the lease
    released; every acknowledged change kept."""

    def __init__(self, client: fastlock.Client, prefix: str):
        self.client = client
        self.prefix = prefix
        self.acked: list[tuple[str, str, bytes | None]] = []  # (what, key, value)
        self.done_rounds = 0

    async def round(self, group: int, n: int) -> None:
        c, p = self.client, self.prefix
        lease = await c.acquire(f"lease/{p}{group}", ttl=3.0, wait=30.0)
        for part in "abc":
            value = f"{n}".encode()
            await c.put(f"{p}{group}/{part}", value, lease=lease)
            self.acked.append(("put", f"{p}{group}/{part}", value))
        await c.put(f"{p}{group}/plain", b"p%d" % n)
        self.acked.append(("put", f"{p}{group}/plain", b"p%d" % n))
        await c.delete(f"{p}{group}/plain")
        self.acked.append(("delete", f"{p}{group}/plain", None))
        await c.release(lease)
        for part in "abc":
            self.acked.append(("released", f"{p}{group}/{part}", None))
        self.done_rounds += 1

    async def churn(self, groups: int, rounds: int, tolerate: bool = False) -> None:
        async def work(group: int) -> None:
            for n in range(rounds):
                try:
                    await self.round(group, n)
                except FastlockError:  # in flight at a kill: judged by the view
                    if not tolerate:
                        raise

        await asyncio.gather(*(work(g) for g in range(groups)))


def check_seen(view: View, acked: list[tuple[str, str, bytes | None]], ended_ok: tuple[str, ...]) -> None:
    """Every acknowledged change is among the events (a lease end: any of ``ended_ok``)."""
    seen: dict[tuple[str, str], int] = {}
    for e in view.events:
        what = "ended" if e.what in ended_ok else e.what
        k = (what, e.key, e.value)
        seen[k] = seen.get(k, 0) + 1
    for what, key, value in acked:
        k = ("ended" if what in ended_ok else what, key, value)
        assert seen.get(k, 0) > 0, f"acknowledged change never seen: {what} {key} {value!r}"


async def server_keys(client: fastlock.Client, prefix: str) -> dict[str, bytes]:
    return {kv.key: kv.value for kv in await client.list_prefix(prefix, limit=10_000)}


def test_a_prefix_watch_keeps_an_exact_view_across_cut_connections(server):
    async def main() -> None:
        with TcpProxy(server.address) as proxy:
            async with fastlock.connect(proxy.address, client_name="watcher") as wc, \
                    fastlock.connect(server.address, client_name="writer") as c:
                view = View(wc, "k/")
                other = View(wc, "k/1/")  # a second, narrower watch on the same connection
                await asyncio.wait_for(asyncio.gather(view.started.wait(), other.started.wait()), 30)
                await c.put("k/0/before", b"x")
                writer = Writer(c, "k/")
                work = asyncio.ensure_future(writer.churn(8, 6))
                for cut in (1, 2, 3):
                    await view.wait(lambda v, cut=cut: len(v.events) > 60 * cut, 60, "changes before a cut")
                    assert proxy.cut() >= 1
                await asyncio.wait_for(work, 120)
                await c.put("k/end", b"e")
                await c.put("k/1/end", b"e")
                await view.wait(lambda v: "k/end" in v.keys, 60, "the last change")
                await other.wait(lambda v: "k/1/end" in v.keys, 60, "the last change (narrow watch)")
                await view.stop()
                await other.stop()
                view.check_positions()
                other.check_positions()
                assert len(view.events) == 1 + 8 * 6 * 8 + 2
                check_seen(view, writer.acked, ("released",))
                assert view.keys == await server_keys(c, "k/")
                assert other.keys == await server_keys(c, "k/1/")
                assert [e[1:] for e in view.events if e.key.startswith("k/1/")] == [e[1:] for e in other.events]

    run(main(), timeout=300)


def test_a_prefix_watch_resumes_on_the_promoted_standby_after_kill9_of_a_sync_primary(cluster):
    primary = cluster.primary(args=SYNC)
    standby = cluster.standby(primary.address, failover_after=FAILOVER)

    async def main() -> None:
        addresses = (primary.address, standby.address)
        async with fastlock.connect(*addresses, client_name="watcher", connect_timeout=1.0,
                                    request_timeout=30.0) as wc, \
                fastlock.connect(*addresses, client_name="writer", connect_timeout=1.0,
                                 request_timeout=30.0) as c:
            view = View(wc, "g/")
            await asyncio.wait_for(view.started.wait(), 30)
            await c.put("g/start", b"s")
            writer = Writer(c, "g/")
            await writer.churn(6, 2)
            work = asyncio.ensure_future(writer.churn(6, 6, tolerate=True))
            await view.wait(lambda v: len(v.events) > 6 * 2 * 8 + random.randint(20, 120), 60, "changes flowing")
            primary.kill()
            await asyncio.wait_for(work, 120)
            # a lease whose release was lost with the primary expires (ttl 3 s) on the promoted node
            await c.put("g/end", b"e")
            await view.wait(lambda v: "g/end" in v.keys and not any(k.endswith(("/a", "/b", "/c")) for k in v.keys),
                            90, "every lease's keys gone")
            await view.stop()
            view.check_positions()
            check_seen(view, writer.acked, ("released", "expired"))
            assert view.keys == await server_keys(c, "g/")
            st = await wc.status()
            assert st["epoch"] == 1, st
            assert max(e.revision for e in view.events) >> 40 == 1

    run(main(), timeout=300)


def test_key_watch_from_refusals_change_nothing(server_factory):
    server = server_factory(args=["--watch-history", "10"])

    async def main() -> None:
        async with fastlock.connect(server.address, client_name="c") as c:
            for i in range(8):  # 16 key changes: the first 6 leave a history of 10
                await c.put(f"h/{i}", b"v")
                await c.delete(f"h/{i}")
            node = await RawNode.open(server.address)
            try:
                reply = await node.request(OP_KEY_WATCH_FROM, "h/", None, None)
                now = reply["revision"]
                assert reply["once"] is True
                with pytest.raises(Compacted) as info:
                    await node.request(OP_KEY_WATCH_FROM, "h/", now - 12, None)
                assert info.value.oldest is not None and now - 12 < info.value.oldest <= now
                with pytest.raises(WatchDiverged):
                    await node.request(OP_KEY_WATCH_FROM, "h/", make_token((now >> 40) + 1, 1), None)
                with pytest.raises(WatchDiverged):
                    await node.request(OP_KEY_WATCH_FROM, "h/", now + 1000, 0)
                for rev, index in ((-1, None), ("1", None), (1 << 63, None), (now, -1), (now, "0"), (None, 0),
                                   (now, WHOLE)):
                    with pytest.raises(InvalidArgument):
                        await node.request(OP_KEY_WATCH_FROM, "h/", rev, index)
                st = await c.status()
                assert st["limits"]["watches"] == 1
                kh = st["key_watch_history"]
                assert kh["kept"] == kh["limit"] == 10
                # from the oldest kept it resumes
                assert (await node.request(OP_KEY_WATCH_FROM, "h/", info.value.oldest, None))["revision"] >= now
                assert (await c.status())["limits"]["watches"] == 1
            finally:
                await node.close()
            # the client's watch raises it: a watch that resumes from too old a position
            with TcpProxy(server.address) as proxy:
                async with fastlock.connect(proxy.address) as c2:
                    events = c2.watch_prefix("h/", progress=True)
                    assert (await asyncio.wait_for(anext(events), 30)).what == "progress"  # subscribed
                    await c.put("h/x", b"1")
                    assert (await asyncio.wait_for(anext(events), 30)).key == "h/x"
                    for i in range(12):  # the history moves past the watch's last position
                        await c.put("other", b"%d" % i)
                    assert proxy.cut() >= 1  # the connection drops: the watch resumes, too late
                    with pytest.raises(Compacted):
                        await asyncio.wait_for(anext(events), 30)

    run(main(), timeout=120)


def test_an_idle_prefix_watch_hears_progress_notices(server_factory):
    server = server_factory(args=["--watch-progress-interval", "0.2"])

    async def main() -> None:
        async with fastlock.connect(server.address, client_name="c") as c:
            await c.put("busy", b"1")
            first = None
            async for event in c.watch_prefix("idle/", progress=True):
                assert event.what == "progress" and event.offset is None
                if first is None:
                    first = event.revision
                    await c.put("busy", b"2")  # a change elsewhere moves the revision a later notice carries
                elif event.revision > first:
                    break

    run(main(), timeout=60)


def test_the_blocking_clients_prefix_watch(server):
    from fastlock.sync import SyncClient

    with SyncClient(server.address) as c:
        events = c.watch_prefix("b/", timeout=30, progress=True)
        first = next(events)  # the watch's start: every later change follows
        assert first.what == "progress" and first.revision is not None
        c.put("b/1", b"one")
        c.delete("b/1")
        got = [next(events), next(events)]
        events.close()
        assert [(e.what, e.key, e.value) for e in got] == [("put", "b/1", b"one"), ("delete", "b/1", None)]
        assert first.revision < got[0].revision < got[1].revision


def test_a_tooz_group_watcher_keeps_its_view_exact_across_kill9_of_the_primary(cluster):
    """tooz's join/leave watchers on a synchronous pair: members that join before and after a
    kill -9 of the primary, and one that leaves after it, are each seen once; the watcher's
    view equals the members listed on the promoted standby."""
    pytest.importorskip("tooz", reason="the tooz extra is part of the test extra")
    from tooz import coordination

    primary = cluster.primary(args=SYNC)
    standby = cluster.standby(primary.address, failover_after=FAILOVER)
    url = f"fastlock://{primary.address},{standby.address}?timeout=30&connect_timeout=1"
    coords = []

    def coordinator(member: bytes):
        c = coordination.get_coordinator(url, member)
        c.start()
        coords.append(c)
        return c

    try:
        watcher = coordinator(b"watcher")
        watcher.create_group(b"g").get(timeout=30)
        joined: list[bytes] = []
        left: list[bytes] = []
        watcher.watch_join_group(b"g", lambda event: joined.append(event.member_id))
        watcher.watch_leave_group(b"g", lambda event: left.append(event.member_id))
        members = [coordinator(b"m%d" % i) for i in range(3)]
        for m in members:
            m.join_group(b"g").get(timeout=30)
        watcher.run_watchers(timeout=30)
        assert sorted(joined) == [b"m0", b"m1", b"m2"] and left == []
        primary.kill()
        late = coordinator(b"late")  # connects to whichever node answers: the promoted standby
        late.join_group(b"g").get(timeout=60)
        members[0].leave_group(b"g").get(timeout=60)
        watcher.run_watchers(timeout=60)
        assert sorted(joined) == [b"late", b"m0", b"m1", b"m2"], joined
        assert left == [b"m0"], left
        assert watcher.get_members(b"g").get(timeout=30) == {b"m1", b"m2", b"late"}
        watcher.run_watchers(timeout=30)  # nothing changed: nothing more seen
        assert len(joined) == 4 and len(left) == 1
    finally:
        for c in coords:
            if c.is_started:
                c.stop()


def test_a_key_put_on_a_sync_primary_waits_for_the_standby_and_so_does_its_watcher(cluster):
    """Under synchronous replication a put is acknowledged, and pushed to a prefix watcher,
    only once the standby has it: with the standby stopped neither happens; the policy
    (fence) then refuses the put, and the watcher never hears of it."""
    from fastlock._testbase.cluster import poll, status_of
    from fastlock.errors import ConnectionLost, Unavailable

    primary = cluster.primary(args=[*SYNC, "--sync-timeout", "0.5", "--sync-on-timeout", "fence"])
    standby = cluster.standby(primary.address, args=SYNC)

    async def main() -> None:
        await poll(lambda: status_of(primary.address), lambda st: st["replication"]["sync"]["state"] == "in_sync",
                   timeout=10, what="in sync")
        async with fastlock.connect(primary.address, client_name="w") as wc, \
                fastlock.connect(primary.address, client_name="c", request_timeout=10.0) as c:
            view = View(wc, "s/")
            await asyncio.wait_for(view.started.wait(), 30)
            await c.put("s/1", b"in sync")  # acknowledged with the standby's ack
            await view.wait(lambda v: "s/1" in v.keys, 30, "the first put")
            standby.pause()
            try:
                async with fastlock.connect(primary.address, client_name="alone", request_timeout=2.0) as lone:
                    put = asyncio.ensure_future(lone.put("s/2", b"alone"))
                    done, _ = await asyncio.wait({put}, timeout=0.3)
                    assert not done, "a put was acknowledged while the synchronous standby was stopped"
                    # refused (Unavailable), retried until the client's deadline: never acknowledged
                    with pytest.raises((Unavailable, ConnectionLost)):
                        await asyncio.wait_for(put, 10)
            finally:
                standby.resume()
            await poll(lambda: status_of(primary.address),
                       lambda st: st["replication"]["sync"]["state"] == "in_sync", timeout=10, what="back in sync")
            await c.put("s/3", b"again")
            await view.wait(lambda v: "s/3" in v.keys, 30, "the put after the standby resumed")
            await view.stop()
            assert "s/2" not in view.keys and [e.key for e in view.events] == ["s/1", "s/3"]

    run(main(), timeout=60)


def test_both_walks_of_a_resume_give_the_same_changes():
    """A resume walks back from the newest change or through the keys under the prefix,
    whichever is cheaper: every prefix and position gives what a full scan gives."""
    rng = random.Random(7)
    log = KeyChangeLog(300)
    log.start(revision(0, 1))
    keys = [f"{a}/{b}" for a in "abc" for b in range(8)] + ["a", "ab/x", "b/1/deep"]
    lsn = 2
    kept_positions = []
    for _ in range(500):
        n = rng.choice([1, 1, 1, 3])
        for i, key in enumerate(rng.sample(keys, n)):
            log.record(revision(0, lsn), i, key, "put" if n == 1 else "released", None, published=rng.random() < 0.9)
            kept_positions.append((revision(0, lsn), i))
        if rng.random() < 0.8:
            log.publish(revision(0, lsn))
        lsn += 1
    now = revision(0, lsn - 1)
    first = log.pending[0][0] if log.pending else 1 << 127
    floor = log.floor
    for prefix in ["", "a", "a/", "a/1", "b/", "b/1", "c/7", "ab", "zz", "b/1/"]:
        for rev, index in rng.sample(kept_positions[-320:], 40) + [(now, None), (floor >> 32, None)]:
            if position(rev, index) < floor:
                continue
            since = position(rev, index)
            want = [c[1:] for c in log.changes if since < c[0] < first and c[3].startswith(prefix)]
            assert [tuple(c) for c in log.since(prefix, rev, index, now)] == want, (prefix, rev, index)
    assert sorted(log.keys) == log.keys == sorted(log.by_key)
    assert sum(len(d) for d in log.by_key.values()) == len(log.changes)


def test_a_long_key_replay_goes_out_a_page_per_turn_and_misses_nothing(server):
    """A prefix watch resumed behind megabytes of changes is replayed a page per loop turn (at
    most REPLAY_PAGE changes, about REPLAY_PAGE_BYTES of values): a PING sent right behind it is
    answered first, and every change still comes once, in order, before the reply."""
    import os
    import time

    from test_sessions import RawSocket

    from fastlock import protocol as P
    from fastlock.protocol.ops import KEY_UPSERT, OP_KEY_PUT, PUSH_KEY_BEGIN, PUSH_VALUE_REV
    from fastlock.server.watchlog import REPLAY_PAGE_BYTES

    raw = RawSocket(server.address)
    resumer = RawSocket(server.address)
    try:
        origin = raw.send([(OP_KEY_WATCH_FROM, "big/", None, None)])[0][2]["revision"]
        value = os.urandom(60_000)
        puts = 3 * REPLAY_PAGE_BYTES // len(value) + 2
        for i in range(puts):
            assert raw.send([(OP_KEY_PUT, f"big/{i % 3}", value, None, 0, None, KEY_UPSERT)])[0][1] == 0
        deadline = time.monotonic() + 30  # every change published (else the last may come live, after the reply)
        while raw.send([(P.OP_STATUS,)])[0][2]["key_watch_history"]["pending"]:
            assert time.monotonic() < deadline, "key changes still unpublished after 30 s"
            time.sleep(0.01)
        first = resumer.next_id
        resumer.sock.sendall(resumer.packb([first, OP_KEY_WATCH_FROM, "big/", origin, None])
                             + resumer.packb([first + 1, P.OP_PING]))
        resumer.next_id += 2
        frames: list[list] = []
        while not any(f[0] == first for f in frames):
            chunk = resumer.sock.recv(1 << 20)
            assert chunk, "the server closed the connection"
            resumer.unpacker.feed(chunk)
            frames.extend(resumer.unpacker)
        assert [f[0] for f in frames if f[0] != 0] == [first + 1, first]  # the PING between two pages
        assert frames[-1][1] == 0
        pushes = [f for f in frames if f[0] == 0 and f[1] in (PUSH_KEY_BEGIN, PUSH_VALUE_REV)]
        assert pushes[0][1] == PUSH_KEY_BEGIN
        positions = [(p[2][4], p[2][5]) for p in pushes[1:]]
        assert len(positions) == puts and positions == sorted(set(positions))
        assert all(p[2][3] == value for p in pushes[1:])
    finally:
        raw.close()
        resumer.close()
