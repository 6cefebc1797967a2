"""How many ``fdatasync`` calls a durable (``--fsync always``) lock costs the server.

A grant is acknowledged only once its record is durable, so each acquire that is
answered alone costs one sync.  A release, an expiry and the publication of a
holder change to the watch history wait for nobody: their records ride on the
next sync (a grant's, the interval timer's), unless a watcher listens, whose
pushes then get a sync of their own.  Real ``fastlock serve`` processes; the
interval timer is set to 60 s, so a sync a test sees was asked for by a request.
"""

from __future__ import annotations

import asyncio

import fastlock
from fastlock._testbase.cluster import RawNode, poll, run
from fastlock.protocol.ops import OP_WATCH_FROM, PUSH_WATCH_REV

#: the interval timer's period (milliseconds): longer than any test here
QUIET_TIMER = ["--fsync-interval-ms", "60000"]
PAIRS = 40


async def _fsyncs(client: fastlock.Client) -> int:
    return (await client.status())["wal"]["fsyncs"]


def test_an_acquire_and_release_pair_costs_one_fdatasync(server_factory):
    """Nobody watches: each pair's release is written and synced by the next grant's batch."""
    server = server_factory(fsync="always", args=QUIET_TIMER)

    async def main() -> None:
        async with fastlock.connect(server.address) as c:
            await c.release(await c.acquire("pair", ttl=10.0))
            before = await _fsyncs(c)
            for _ in range(PAIRS):
                await c.release(await c.acquire("pair", ttl=10.0))
            assert await _fsyncs(c) - before == PAIRS
            st = await c.status()
            # the last release is written, not synced, and its change waits for that sync to be published
            assert st["wal"]["written_lsn"] == st["wal"]["last_lsn"] > st["wal"]["durable_lsn"]
            assert st["watch_history"]["pending"] == 1

    run(main())


def test_a_watched_release_is_synced_and_pushed_at_once(server_factory):
    """A watcher listens: the release's change is published without waiting for the timer."""
    server = server_factory(fsync="always", args=QUIET_TIMER)

    async def main() -> None:
        async with fastlock.connect(server.address) as c, fastlock.connect(server.address) as w:
            seen: list[str] = []
            changed = asyncio.Event()
            started = asyncio.Event()

            async def watch() -> None:
                async for event in w.watch("watched"):
                    started.set()
                    if event.kind in ("granted", "released"):
                        seen.append(event.kind)
                        changed.set()

            task = asyncio.ensure_future(watch())
            try:
                await asyncio.wait_for(started.wait(), 10)  # (the watch's first event: the holder now)
                for _ in range(3):
                    await c.release(await c.acquire("watched", ttl=10.0))
                while seen.count("released") < 3:
                    changed.clear()
                    await asyncio.wait_for(changed.wait(), 10)
                assert seen == ["granted", "released"] * 3
                st = await c.status()
                assert st["watch_history"]["pending"] == 0 and st["wal"]["durable_lsn"] == st["wal"]["last_lsn"]
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    run(main())


def test_a_watch_added_later_gets_the_unsynced_change_at_once(server_factory):
    """A release nobody watched waits for a sync; a watch resumed from before it asks for that
    sync, and hears the release without waiting for the timer."""
    server = server_factory(fsync="always", args=QUIET_TIMER)

    async def main() -> None:
        async with fastlock.connect(server.address) as c:
            origin = (await c.status())["watch_history"]["revision"]
            lease = await c.acquire("late", ttl=10.0)
            token = lease.fencing_token
            await c.release(lease)
            st = await c.status()
            assert st["watch_history"]["pending"] == 1  # the release, not synced yet
            pushes: list[list] = []
            released = asyncio.Event()

            def on_push(kind: int, payload: list) -> None:
                if kind == PUSH_WATCH_REV:
                    pushes.append(payload)
                    if payload[1] == "released":
                        released.set()

            node = await RawNode.open(server.address, on_push=on_push)
            try:
                await node.request(OP_WATCH_FROM, "late", origin)
                await asyncio.wait_for(released.wait(), 10)  # (the timer would take 60 s)
                assert [(p[1], p[2]) for p in pushes] == [("granted", token), ("released", token)]
                st = await poll(c.status, lambda st: st["watch_history"]["pending"] == 0, timeout=10,
                                what="the release published")
                assert st["wal"]["durable_lsn"] == st["wal"]["last_lsn"]
            finally:
                await node.close()

    run(main())


def test_changes_nobody_watches_from_many_batch_ends_are_published_by_one_later_sync(server_factory):
    """Releases of several connections, each its own batch end, nobody watching: none asks for
    a sync and all wait for one; the next sync (a grant's) publishes every one of them, in
    order, and a watch resumed from before them replays them all."""
    server = server_factory(fsync="always", args=QUIET_TIMER)
    names = [f"many-{i}" for i in range(6)]

    async def main() -> None:
        conns = [await fastlock.connect(server.address) for _ in names]
        try:
            c = conns[0]
            origin = (await c.status())["watch_history"]["revision"]
            leases = [await conn.acquire(name, ttl=10.0) for conn, name in zip(conns, names)]
            st = await c.status()
            assert st["watch_history"]["pending"] == 0  # each grant was synced and published
            before = await _fsyncs(c)
            for conn, lease in zip(conns, leases):
                await conn.release(lease)
            st = await c.status()
            assert st["watch_history"]["pending"] == len(names)  # no release asked for a sync
            assert st["wal"]["durable_lsn"] < st["wal"]["last_lsn"]
            assert await _fsyncs(c) == before
            last = await c.acquire("many-sync", ttl=10.0)  # its grant's sync covers every release
            st = await c.status()
            assert st["watch_history"]["pending"] == 0
            await c.release(last)
            pushes: list[list] = []

            def on_push(kind: int, payload: list) -> None:
                if kind == PUSH_WATCH_REV:
                    pushes.append(payload)

            for name, lease in zip(names, leases):
                pushes.clear()
                node = await RawNode.open(server.address, on_push=on_push)
                try:
                    await node.request(OP_WATCH_FROM, name, origin)  # (the replay's pushes come first)
                finally:
                    await node.close()
                assert [(p[1], p[2]) for p in pushes] == [("granted", lease.fencing_token),
                                                          ("released", lease.fencing_token)]
        finally:
            for conn in conns:
                await conn.close()

    run(main())


def test_concurrent_pairs_nobody_watches_are_all_published_by_the_next_sync(server_factory):
    """Many connections acquire and release at once (batches formed while others are on the
    writer thread), nobody watching: after a last grant's sync nothing is left unpublished."""
    server = server_factory(fsync="always", args=QUIET_TIMER)

    async def main() -> None:
        conns = [await fastlock.connect(server.address) for _ in range(8)]
        try:
            async def pairs(conn: fastlock.Client, i: int) -> None:
                for _ in range(25):
                    await conn.release(await conn.acquire(f"busy-{i}", ttl=10.0))

            await asyncio.gather(*(pairs(conn, i) for i, conn in enumerate(conns)))
            c = conns[0]
            await c.release(await c.acquire("busy-sync", ttl=10.0))
            st = await c.status()
            assert st["watch_history"]["pending"] == 1  # only the last release waits for a sync
            await c.acquire("busy-last", ttl=10.0)
            st = await c.status()
            assert st["watch_history"]["pending"] == 0
        finally:
            for conn in conns:
                await conn.close()

    run(main())


def test_changes_nobody_watches_are_replayed_and_a_later_watcher_hears_the_next_ones_live(server_factory):
    """``never``: changes nobody watches get no publication of their own; they are published
    once written (a batch end, or a reader of the history settles them).  A watch resumed from
    before them replays every one, in order with rising revisions; it then hears the next
    changes live, once each; changes made after it is closed are replayed to the next resume
    from where it stopped, none twice."""
    server = server_factory(fsync="never")

    async def main() -> None:
        async with fastlock.connect(server.address) as c:
            origin = (await c.status())["watch_history"]["revision"]
            tokens = []
            for _ in range(2):  # two pairs nobody watches
                lease = await c.acquire("between", ttl=10.0)
                tokens.append(lease.fencing_token)
                await c.release(lease)
            st = await c.status()
            # the last release was written after its batch end: the status read settles it
            assert st["watch_history"]["pending"] == 0
            assert st["watch_history"]["published"] == st["watch_history"]["revision"]
            pushes: list[list] = []
            arrived = asyncio.Event()

            def on_push(kind: int, payload: list) -> None:
                if kind == PUSH_WATCH_REV:
                    pushes.append(payload)
                    arrived.set()

            node = await RawNode.open(server.address, on_push=on_push)
            try:
                reply = await node.request(OP_WATCH_FROM, "between", origin)
                replayed = [(p[1], p[2]) for p in pushes]
                assert replayed == [("granted", tokens[0]), ("released", tokens[0]),
                                    ("granted", tokens[1]), ("released", tokens[1])]
                revs = [p[-1] for p in pushes]
                assert revs == sorted(set(revs)) and revs[-1] <= reply["revision"]
                lease = await c.acquire("between", ttl=10.0)
                tokens.append(lease.fencing_token)
                await c.release(lease)
                while len(pushes) < 6:
                    arrived.clear()
                    await asyncio.wait_for(arrived.wait(), 10)
                assert [(p[1], p[2]) for p in pushes[4:]] == [("granted", tokens[2]), ("released", tokens[2])]
                revs = [p[-1] for p in pushes]
                assert revs == sorted(set(revs)) and revs[4] > reply["revision"]
            finally:
                await node.close()
            last_seen = pushes[-1][-1]
            lease = await c.acquire("between", ttl=10.0)  # nobody watches again
            tokens.append(lease.fencing_token)
            await c.release(lease)
            pushes.clear()
            node = await RawNode.open(server.address, on_push=on_push)
            try:
                await node.request(OP_WATCH_FROM, "between", last_seen)
            finally:
                await node.close()
            assert [(p[1], p[2]) for p in pushes] == [("granted", tokens[3]), ("released", tokens[3])]
            assert pushes[0][-1] > last_seen

    run(main())
