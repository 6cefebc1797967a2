"""Watches that resume from a revision (docs/watches.md), on real server processes.

- a watch over many names sees every holder change once and in order across a
  killed connection (a TCP proxy cuts it) and across kill -9 of the primary of a
  synchronous pair (the standby promotes; the watches resume there);
- a resume from a revision older than the history kept gets ``Compacted`` with
  the oldest revision kept, one the node never had gets ``WatchDiverged``;
- an idle watch hears progress notices carrying the revision;
- bad WATCH_FROM arguments are refused and change nothing.

Every wait has a deadline; servers are stopped by PID (the fixtures).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import tempfile

import pytest

import fastlock
from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock._testbase.proxy import TcpProxy
from fastlock.errors import Compacted, FastlockError, InvalidArgument, WatchDiverged
from fastlock.protocol.ops import OP_WATCH_FROM, PUSH_WATCH_REV
from fastlock.tokens import make_token

FAILOVER = 1.0  # --failover-after, seconds
SYNC = ["--replication", "sync"]


class Watcher:
    """One watch per name on one client; every event kept per name."""

    def __init__(self, client: fastlock.Client, names: list[str]):
        self.events: dict[str, list[fastlock.WatchEvent]] = {n: [] for n in names}
        self.errors: list[BaseException] = []
        self.changed = asyncio.Event()
        self.started = 0
        self.all_started = asyncio.Event()
        self.tasks = [asyncio.ensure_future(self._run(client, n)) for n in names]

    async def _run(self, client: fastlock.Client, name: str) -> None:
        try:
            async for event in client.watch(name):
                if not self.events[name]:
                    self.started += 1
                    if self.started == len(self.events):
                        self.all_started.set()
                self.events[name].append(event)
                self.changed.set()
        except BaseException as exc:
            self.errors.append(exc)
            self.changed.set()
            raise

    async def wait(self, done, timeout: float, what: str) -> None:
        """Until ``done(self)`` (checked at each event), at most ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done(self):
            assert not self.errors, f"a watch failed: {self.errors[0]!r}"
            left = deadline - loop.time()
            assert left > 0, f"timed out after {timeout} s waiting for {what}"
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def check_history(events: list[fastlock.WatchEvent], granted: list[int]) -> None:
    """One name's events: begins free, then alternates a grant and its end, each token once,
    revisions strictly increasing; every token in ``granted`` (acknowledged grants) is there."""
    assert events[0].kind == "free", events[:3]
    revisions = [e.revision for e in events]
    assert all(r is not None for r in revisions)
    assert revisions == sorted(set(revisions)), f"revisions repeat or go back: {revisions}"
    tokens = []
    for i, event in enumerate(events[1:]):
        if i % 2 == 0:
            assert event.kind == "granted", (i, events)
            tokens.append(event.token)
        else:
            assert event.kind in ("released", "expired"), (i, events)
            assert event.token == tokens[-1], (i, events)
    assert tokens == sorted(set(tokens)), f"a grant seen twice or out of order: {tokens}"
    missing = set(granted) - set(tokens)
    assert not missing, f"acknowledged grants never seen by the watch: {sorted(missing)}"


def ended(names: list[str], last: dict[str, int]):
    """``done`` for :meth:`Watcher.wait`: each name's last event ends the lease ``last[name]``."""
    def done(w: Watcher) -> bool:
        for n in names:
            ev = w.events[n]
            if not ev or ev[-1].kind not in ("released", "expired") or ev[-1].token != last.get(n):
                return False
        return True
    return done


async def churn(client: fastlock.Client, names: list[str], rounds: int, granted: dict[str, list[int]],
                last: dict[str, int], workers: int = 8, ttl: float = 30.0) -> None:
    """Acquire and release each name ``rounds`` times (``workers`` tasks), keeping the tokens."""
    async def work(part: list[str]) -> None:
        for _ in range(rounds):
            for n in part:
                lease = await client.acquire(n, ttl=ttl, wait=30.0)
                granted[n].append(lease.fencing_token)
                last[n] = lease.fencing_token
                await client.release(lease)

    await asyncio.gather(*(work(names[i::workers]) for i in range(workers)))


def test_a_watch_over_many_names_sees_every_change_once_across_a_killed_connection(server):
    names = [f"w/{i}" for i in range(1000)]

    async def main() -> None:
        with TcpProxy(server.address) as proxy:
            async with fastlock.connect(proxy.address, client_name="watcher") as wc, \
                    fastlock.connect(server.address, client_name="writer") as writer:
                watcher = Watcher(wc, names)
                await asyncio.wait_for(watcher.all_started.wait(), 60)
                granted: dict[str, list[int]] = {n: [] for n in names}
                last: dict[str, int] = {}
                work = asyncio.ensure_future(churn(writer, names, 3, granted, last))
                # cut the watcher's connection twice while the changes flow
                for cut in (1, 2):
                    await watcher.wait(lambda w, cut=cut: sum(len(e) for e in w.events.values()) > 2000 * cut,
                                       60, "changes before the cut")
                    assert proxy.cut() >= 1
                await asyncio.wait_for(work, 120)
                await watcher.wait(ended(names, last), 60, "every release seen")
                await watcher.stop()
                for n in names:
                    check_history(watcher.events[n], granted[n])
                    assert len(watcher.events[n]) == 1 + 2 * 3
                assert sum(len(e) for e in watcher.events.values()) == 1000 * 7

    run(main(), timeout=300)


def test_watches_resume_on_the_promoted_standby_after_kill9_of_a_sync_primary(cluster):
    primary = cluster.primary(args=SYNC)
    standby = cluster.standby(primary.address, failover_after=FAILOVER)
    names = [f"f/{i}" for i in range(300)]

    async def main() -> None:
        addresses = (primary.address, standby.address)
        async with fastlock.connect(*addresses, client_name="watcher", connect_timeout=1.0,
                                    request_timeout=30.0) as wc, \
                fastlock.connect(*addresses, client_name="writer", connect_timeout=1.0) as writer:
            watcher = Watcher(wc, names)
            await asyncio.wait_for(watcher.all_started.wait(), 60)
            granted: dict[str, list[int]] = {n: [] for n in names}
            last: dict[str, int] = {}
            await churn(writer, names, 2, granted, last, ttl=3.0)
            await watcher.wait(ended(names, last), 60, "the changes before the kill")
            # the kill lands while grants and releases flow
            work = asyncio.ensure_future(churn(writer, names, 4, granted, last, ttl=3.0))
            await watcher.wait(lambda w: sum(len(e) for e in w.events.values()) > 300 * 5 + random.randint(0, 200),
                               60, "changes flowing")
            primary.kill()
            try:
                await asyncio.wait_for(work, 120)
            except FastlockError:  # the acquire or release in flight at the kill may fail: judged by the watch
                pass
            # a lease whose release was lost with the primary expires (ttl 3 s) on the promoted node
            await watcher.wait(lambda w: all(w.events[n][-1].kind in ("released", "expired") and
                                             w.events[n][-1].token == max(granted[n]) for n in names
                                             if granted[n]), 90, "every lease ended")
            await watcher.stop()
            status = await wc.status()
            assert status["epoch"] == 1, status
            for n in names:
                check_history(watcher.events[n], granted[n])

    run(main(), timeout=300)


def test_compacted_diverged_and_bad_revisions(server_factory):
    server = server_factory(args=["--watch-history", "10"])

    async def main() -> None:
        async with fastlock.connect(server.address, client_name="c") as c:
            for _ in range(8):  # 16 changes: the first 6 are dropped from a history of 10
                await c.release(await c.acquire("x", ttl=10.0))
            node = await RawNode.open(server.address)
            try:
                reply = await node.request(OP_WATCH_FROM, "x", None)
                now = reply["revision"]
                assert reply["holder"] is None
                with pytest.raises(Compacted) as info:
                    await node.request(OP_WATCH_FROM, "x", now - 12)
                assert info.value.oldest is not None and now - 12 < info.value.oldest <= now
                epoch_now = now >> 40
                with pytest.raises(WatchDiverged, match="ahead of this node's history"):  # a later epoch
                    await node.request(OP_WATCH_FROM, "x", make_token(epoch_now + 1, 1))
                with pytest.raises(WatchDiverged, match="ahead of this node's history") as ahead:  # an LSN not logged
                    await node.request(OP_WATCH_FROM, "x", now + 1000)
                assert "lost changes" not in str(ahead.value)
                for bad in (-1, "1", 1 << 63, 1.5):
                    with pytest.raises(InvalidArgument):
                        await node.request(OP_WATCH_FROM, "x", bad)
                # the refusals changed nothing: the one watch of the first request (the status read
                # once the last release is published: its record's fsync may still be under way)
                st = await poll(c.status, lambda st: st["watch_history"]["pending"] == 0, timeout=30,
                                what="the last change published")
                assert st["limits"]["watches"] == 1
                assert st["watch_history"]["kept"] == st["watch_history"]["limit"] == 10
                assert st["watch_history"]["floor"] >= info.value.oldest
                # from the oldest kept it resumes (its changes are replayed first); its revision is the
                # published one (every change is, from the status read above)
                assert (await node.request(OP_WATCH_FROM, "x", st["watch_history"]["floor"]))["revision"] >= now
                assert (await c.status())["limits"]["watches"] == 1
            finally:
                await node.close()

    run(main())


def test_an_idle_watch_hears_progress_notices(server_factory):
    server = server_factory(args=["--watch-progress-interval", "0.2"])

    async def main() -> None:
        async with fastlock.connect(server.address, client_name="c") as c:
            await c.release(await c.acquire("busy", ttl=10.0))
            seen = []
            async for event in c.watch("idle", progress=True):
                seen.append(event)
                if event.kind == "progress" or len(seen) > 3:
                    break
            assert [e.kind for e in seen] == ["free", "progress"], seen
            assert seen[1].revision >= seen[0].revision
            # a change elsewhere moves the revision a later notice carries
            await c.release(await c.acquire("busy", ttl=10.0))
            async for event in c.watch("idle", progress=True):
                if event.kind == "progress" and event.revision > seen[1].revision:
                    break

    run(main(), timeout=60)


# --------------------------------------------------------------------------- FIFO through a failover

def test_sixteen_waiters_keep_their_order_through_kill9_of_the_primary(cluster):
    primary = cluster.primary(args=SYNC)
    # a window long enough for 16 clients to come back on a loaded machine (it ends once all are back)
    standby = cluster.standby(primary.address, failover_after=FAILOVER, args=["--queue-reclaim-window", "30"])

    async def main() -> None:
        addresses = (primary.address, standby.address)
        clients = []
        try:
            holder = await fastlock.connect(*addresses, client_name="holder", connect_timeout=1.0)
            clients.append(holder)
            lease = await holder.acquire("fifo", ttl=30.0)
            order: list[int] = []

            async def wait_turn(i: int, c: fastlock.Client) -> None:
                mine = await c.acquire("fifo", ttl=30.0, wait=60.0)
                order.append(i)
                await c.release(mine)

            tasks = []
            for i in range(16):
                c = await fastlock.connect(*addresses, client_name=f"w{i}", connect_timeout=1.0)
                clients.append(c)
                tasks.append(asyncio.ensure_future(wait_turn(i, c)))
                await poll(lambda: status_of(primary.address), lambda st, n=i + 1: st["waiters"] == n,
                           timeout=20, what=f"waiter {i} queued")
            # the standby mirrors the queue before the primary dies
            await poll(lambda: status_of(standby.address),
                       lambda st: st["replication"].get("mirrored_waiters") == 16, timeout=20,
                       what="the queue mirrored on the standby")
            primary.kill()
            await poll(lambda: status_of(standby.address), lambda st: st["role"] == "primary", timeout=30,
                       what="the standby promoted")
            await holder.release(lease)  # rides through to the promoted standby
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert order == list(range(16)), f"grants after the failover in the order {order}"
        finally:
            for c in clients:
                await c.close()

    run(main(), timeout=180)


def test_a_change_the_promoted_standby_never_had_gives_watch_diverged(cluster):
    """Asynchronous replication: a release the old primary published but never sent to its
    standby (the link black-holed) is not on the promoted standby; the watch that saw it is told."""
    primary = cluster.primary()
    link = cluster.proxy(primary.address)
    standby = cluster.standby(link.address)  # promoted on command below

    async def main() -> None:
        addresses = (primary.address, standby.address)
        async with fastlock.connect(*addresses, client_name="watcher", connect_timeout=1.0,
                                    request_timeout=20.0) as wc, \
                fastlock.connect(primary.address, client_name="writer") as writer:
            events = wc.watch("d")
            assert (await anext(events)).kind == "free"
            lease = await writer.acquire("d", ttl=30.0)
            granted = await anext(events)
            assert granted.kind == "granted"
            last = (await status_of(primary.address))["wal"]["last_lsn"]
            await poll(lambda: status_of(standby.address), lambda st: st["replication"]["applied_lsn"] >= last,
                       timeout=20, what="the grant on the standby")
            assert link.blackhole() >= 1
            await writer.release(lease)
            released = await anext(events)  # published by the primary alone
            assert released.kind == "released" and released.revision > granted.revision
            primary.kill()
            res = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "fastlock", "promote", "--server", standby.address, "--force"],
                capture_output=True, text=True, timeout=60, cwd=tempfile.gettempdir())
            assert res.returncode == 0, res.stderr
            with pytest.raises(WatchDiverged):
                await asyncio.wait_for(anext(events), 60)
            st = await status_of(standby.address)
            assert st["role"] == "primary" and st["watch_history"]["revision"] >> 40 == 1

    run(main(), timeout=120)


def published_all(raw) -> None:
    """Wait (at most 30 s) until the server has published every change it logged."""
    import time

    from fastlock import protocol as P

    deadline = time.monotonic() + 30
    while raw.send([(P.OP_STATUS,)])[0][2]["watch_history"]["pending"]:
        assert time.monotonic() < deadline, "changes still unpublished after 30 s"
        time.sleep(0.01)


def test_a_long_replay_goes_out_a_page_per_turn_and_misses_nothing(server):
    """A resume from an old revision is replayed REPLAY_PAGE pushes per loop turn: a PING sent
    right behind it in the same write is answered before its reply, every change still comes
    once and in order, and a change made while the pages go out arrives after them."""
    import os

    from test_sessions import RawSocket

    from fastlock import protocol as P
    from fastlock.server.watchlog import REPLAY_PAGE

    raw = RawSocket(server.address)
    resumer = RawSocket(server.address)
    try:
        origin = raw.send([(OP_WATCH_FROM, "hot", None)])[0][2]["revision"]
        owner = os.urandom(16)
        changes = 2 * REPLAY_PAGE + 100
        for _ in range(changes // 2):
            token = raw.send([(P.OP_ACQUIRE, "hot", owner, 60_000, 0, 0, None)])[0][2][0]
            assert raw.send([(P.OP_RELEASE, "hot", token, owner)])[0][1] == 0
        published_all(raw)
        first = resumer.next_id
        resumer.sock.sendall(resumer.packb([first, OP_WATCH_FROM, "hot", origin])
                             + resumer.packb([first + 1, P.OP_PING]))
        resumer.next_id += 2
        frames: list[list] = []
        while not any(f[0] == first for f in frames):
            chunk = resumer.sock.recv(1 << 20)
            assert chunk, "the server closed the connection"
            resumer.unpacker.feed(chunk)
            frames.extend(resumer.unpacker)
        replies = [f[0] for f in frames if f[0] != 0]
        assert replies == [first + 1, first]  # the PING between two pages
        assert frames[-1][1] == 0  # the resume succeeded
        revisions = [f[2][-1] for f in frames if f[0] == 0 and f[1] == PUSH_WATCH_REV]
        assert len(revisions) == changes and revisions == sorted(set(revisions)) and revisions[0] > origin
        # the live watch follows: the next change is pushed once
        token = raw.send([(P.OP_ACQUIRE, "hot", owner, 60_000, 0, 0, None)])[0][2][0]
        live: list[list] = []
        while not live:
            resumer.unpacker.feed(resumer.sock.recv(1 << 20))
            live.extend(f for f in resumer.unpacker if f[0] == 0 and f[1] == PUSH_WATCH_REV)
        assert live[0][2][2] == token and live[0][2][-1] > revisions[-1]
    finally:
        raw.close()
        resumer.close()


def test_resumes_waiting_behind_a_long_replay_are_bounded_per_connection(server):
    """Resumes pipelined behind a long replay wait their turn, at most MAX_QUEUED_RESUMES of them:
    the others get LimitExceeded at once, the waiting ones are answered in order, and the
    server goes on serving."""
    import os

    from test_sessions import RawSocket

    from fastlock import protocol as P
    from fastlock.errors import LimitExceeded
    from fastlock.server.watchlog import MAX_QUEUED_RESUMES, REPLAY_PAGE

    raw = RawSocket(server.address)
    resumer = RawSocket(server.address)
    try:
        origin = raw.send([(OP_WATCH_FROM, "long", None)])[0][2]["revision"]
        owner = os.urandom(16)
        for _ in range(4 * REPLAY_PAGE):
            token = raw.send([(P.OP_ACQUIRE, "long", owner, 60_000, 0, 0, None)])[0][2][0]
            assert raw.send([(P.OP_RELEASE, "long", token, owner)])[0][1] == 0
        latest = raw.send([(OP_WATCH_FROM, "long", None)])[0][2]["revision"]
        behind = 2 * MAX_QUEUED_RESUMES
        requests = [(OP_WATCH_FROM, "long", origin)] + [(OP_WATCH_FROM, f"short/{i}", latest) for i in range(behind)]
        replies = {r[0]: r for r in resumer.send(requests)}
        assert len(replies) == 1 + behind
        codes = [r[1] for _, r in sorted(replies.items())]
        assert codes[0] == 0
        refused = [r for r in replies.values() if r[1] == LimitExceeded.code]
        assert refused and all("watch resumes waiting" in r[2] for r in refused)
        assert codes.count(0) >= MAX_QUEUED_RESUMES
        assert resumer.send([(P.OP_PING,)])[0][1] == 0
    finally:
        raw.close()
        resumer.close()
