"""Replies bounded by bytes with a cursor, and key events pushed once per connection
(issue 23, item 4), against real server processes.

KEY_LIST, CONTENDERS and LOCKS answer one page (about ``MAX_PAGE_BYTES``, 64 KiB) with a
cursor to the next; the clients follow it.  The server's peak RSS is read from
``/proc/PID/status`` (``VmHWM``, reset through ``/proc/PID/clear_refs`` before the
requests), other clients' PINGs are timed while the requests run.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from conftest import STALL_S

import fastlock
from fastlock import protocol as P
from fastlock.errors import InvalidArgument
from fastlock.protocol.ops import MAX_PAGE_BYTES, OP_KEY_LIST, OP_KEY_PUT, OP_KEY_WATCH

RSS_BOUND = 200 << 20  # the bound on the server's RSS growth (bytes)
OWNER = b"o" * 16


class Raw:
    """A raw protocol connection: HELLO, then pipelined requests and their replies."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.decoder = P.FrameDecoder(64 << 20, limits=P.REPLY_LIMITS)
        self.pushes: list = []
        self.next_id = 2

    @classmethod
    async def open(cls, address: str) -> Raw:
        host, _, port = address.rpartition(":")
        raw = cls(*await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5))
        raw.writer.write(P.packb([1, P.OP_HELLO, P.PROTOCOL_VERSION, "raw", None]))
        (hello,) = await raw.replies(1)
        assert hello[1] == 0, hello
        return raw

    def send(self, op: int, *args) -> int:
        rid = self.next_id
        self.next_id += 1
        self.writer.write(P.packb([rid, op, *args]))
        return rid

    async def replies(self, count: int, timeout: float = 60.0) -> list:
        """The next ``count`` replies (pushes kept in ``pushes``)."""
        out: list = []
        deadline = time.monotonic() + timeout
        while len(out) < count:
            data = await asyncio.wait_for(self.reader.read(1 << 20), max(0.001, deadline - time.monotonic()))
            assert data, "connection closed"
            for m in self.decoder.feed(data):
                (self.pushes if m[0] == 0 else out).append(m)
        return out

    async def call(self, op: int, *args):
        self.send(op, *args)
        (reply,) = await self.replies(1)
        return reply

    async def close(self) -> None:
        self.writer.close()


async def pipelined(address: str, requests: list[list], chunk: int = 5_000) -> None:
    """Send ``requests`` ([op, args...]) on one connection, ``chunk`` per write; every reply OK."""
    raw = await Raw.open(address)
    try:
        for start in range(0, len(requests), chunk):
            for op, *args in requests[start:start + chunk]:
                raw.send(op, *args)
            bad = [m for m in await raw.replies(len(requests[start:start + chunk])) if m[1] != 0]
            assert not bad, bad[:3]
    finally:
        await raw.close()


def vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def reset_peak_rss(pid: int) -> None:
    """Start a fresh ``VmHWM`` for ``pid`` (Linux: 5 > clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


#: another client, in its own process so that nothing the test does delays it: PINGs the
#: server until a line arrives on stdin (at most 1,000,000, at most 300 s); prints "ready"
#: after its first 3, and at the end (after 3 more) "<pings> <worst round trip in s>"
PINGER = r"""
import asyncio, sys, time
import fastlock

async def main():
    client = await fastlock.connect(sys.argv[1], client_name="pinger")
    stop = asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    rtts, stopped_at, deadline = [], None, time.monotonic() + 300
    while len(rtts) < 1_000_000 and time.monotonic() < deadline:
        if stop.done():
            stopped_at = len(rtts) if stopped_at is None else stopped_at
            if len(rtts) >= stopped_at + 3:
                break
        t0 = time.perf_counter()
        await client.ping()
        rtts.append(time.perf_counter() - t0)
        if len(rtts) == 3:
            print("ready", flush=True)
    await client.close()
    print(len(rtts), max(rtts), flush=True)

asyncio.run(main())
"""


class Pinger:
    """Another client pinging the server from its own process (:data:`PINGER`)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @classmethod
    async def start(cls, address: str) -> Pinger:
        proc = subprocess.Popen([sys.executable, "-c", PINGER, address], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        pinger = cls(proc)
        line = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline), 30)
        assert line.strip() == "ready", line
        return pinger

    async def finish(self) -> tuple[int, float]:
        """Stop it: ``(pings, the worst round trip in s)``."""
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        line = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, self.proc.stdout.readline), 30)
        self.close()
        count, worst = line.split()
        return int(count), float(worst)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()
        self.proc.stdin.close()


#: the load: ``connections`` connections each pipeline the request (hex of its msgpack
#: ``[op, args...]``) ``each`` times and read every reply; prints "ready" once connected
#: (then waits for a line on stdin), "done <ok replies>" at the end
FLOODER = r"""
import asyncio, sys
from fastlock import protocol as P
address, connections, each, request = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), bytes.fromhex(sys.argv[4])
op, *args = P.FrameDecoder(1 << 20).feed(request)[0]

async def one(reader, writer, go):
    decoder = P.FrameDecoder(64 << 20, limits=P.REPLY_LIMITS)
    writer.write(P.packb([1, P.OP_HELLO, P.PROTOCOL_VERSION, "flood", None]))
    await go.wait()
    writer.write(b"".join(P.packb([2 + i, op, *args]) for i in range(each)))
    ok = seen = 0
    while seen < each + 1:
        data = await reader.read(1 << 20)
        if not data:
            break
        for m in decoder.feed(data):
            if m[0] > 1:
                seen += 1
                ok += m[1] == 0
            elif m[0] == 1:
                seen += 1
    writer.close()
    return ok

async def main():
    host, _, port = address.rpartition(":")
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(connections)]
    go = asyncio.Event()
    tasks = [asyncio.ensure_future(one(r, w, go)) for r, w in conns]
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    go.set()
    print("done", sum(await asyncio.gather(*tasks)), flush=True)

asyncio.run(main())
"""


async def flood(server, request: list, connections: int, each: int) -> int:
    """``connections`` connections (another process) each pipeline ``request`` ``each`` times
    and read every reply: the server's RSS growth (bytes) meanwhile."""
    proc = subprocess.Popen([sys.executable, "-c", FLOODER, server.address, str(connections), str(each),
                             P.packb(request).hex()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    loop = asyncio.get_running_loop()
    try:
        line = await asyncio.wait_for(loop.run_in_executor(None, proc.stdout.readline), 30)
        assert line.strip() == "ready", line
        base = vm_kib(server.pid, "VmRSS")
        reset_peak_rss(server.pid)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = await asyncio.wait_for(loop.run_in_executor(None, proc.stdout.readline), 120)
        assert line.split() == ["done", str(connections * each)], line
        return (vm_kib(server.pid, "VmHWM") - base) << 10
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()
        proc.stdin.close()


@pytest.mark.one_loop
async def test_key_list_of_50k_keys_is_paged_bounded_and_complete(server_factory):
    """Finding: KEY_LIST(prefix, 10000) built a 77.5 MB reply in one packb; 20-60 of them took
    the RSS to 1-1.5 GB and stalled others for seconds.  Now 20 connections x 3 requests
    over 50,000 keys of 1,000 bytes keep the RSS growth under 200 MiB and other clients
    served (no PING stalls); the pages followed give every key once, in order.  Each request
    asks for 10,000 keys: unpaged, 10 MB a reply and 600 MB for the 60, three times the bound,
    however many more keys the prefix holds."""
    count, value = 50_000, b"v" * 1000
    srv = server_factory("keys", fsync="never", args=["--max-keys", str(count), "--max-keys-per-principal",
                                                       str(count)])
    keys = [f"k/{i:07d}" for i in range(count)]
    await asyncio.wait_for(pipelined(srv.address, [[OP_KEY_PUT, k, value, None, 0, None, 0] for k in keys]), 120)
    client = await fastlock.connect(srv.address, client_name="lister")
    pinger = await Pinger.start(srv.address)
    try:
        growth = await flood(srv, [OP_KEY_LIST, "k/", 10_000], 20, 3)
        assert growth < RSS_BOUND, f"RSS grew {growth >> 20} MiB"
        raw = await Raw.open(srv.address)
        page = (await raw.call(OP_KEY_LIST, "k/", 10_000))[2]
        assert page["more"] and page["cursor"] == page["keys"][-1][0]
        assert 1 <= len(page["keys"]) < 10_000
        assert len(P.packb(page)) < MAX_PAGE_BYTES + 2 * (len(value) + 64)
        bad = await raw.call(OP_KEY_LIST, "k/", 10, ["not", "a", "key"])
        assert bad[1] != 0 and (await raw.call(P.OP_PING))[1] == 0  # refused, connection kept
        await raw.close()
        listed: list[str] = []
        after = None
        for _ in range(count // 10_000 + 1):  # bounded: 10,000 keys per list_prefix at most
            part = await client.list_prefix("k/", limit=10_000, after=after)
            listed += [kv.key for kv in part]
            if not part.more:
                break
            after = part.cursor
        pings, worst = await pinger.finish()  # over the flood and the whole paged listing
        assert worst < STALL_S, f"worst PING {worst * 1000:.1f} ms over {pings} pings"
        assert listed == keys
    finally:
        pinger.close()
        await client.close()


@pytest.mark.one_loop
async def test_contenders_of_100k_waiters_is_paged_bounded_and_complete(server_factory):
    """Finding: CONTENDERS built a 41 MB reply in one packb.  Now 100,000 waiters with
    200-character correlation ids: 20 connections x 3 CONTENDERS keep the RSS growth under
    200 MiB and other clients served (no PING stalls); the client follows the pages and
    gets every waiter once, each connection's in the order it queued them."""
    connections, per_connection = 10, 10_000
    waiters = connections * per_connection
    # deadlock detection off: its walk of every waiter is bounded elsewhere (issue 23, item 5),
    # and this test measures the listing alone
    srv = server_factory("contenders", fsync="never", args=["--max-waiters", str(waiters), "--deadlock-timeout", "0"])
    client = await fastlock.connect(srv.address, client_name="holder")
    queuers = [await Raw.open(srv.address) for _ in range(connections)]
    pinger = None
    try:
        await client.acquire("queue", ttl=600.0)
        corr = "c" * 190
        for c, raw in enumerate(queuers):  # the acquires wait: no reply comes while the lock is held
            for i in range(per_connection):
                raw.send(P.OP_ACQUIRE, "queue", b"%08d" % (c * per_connection + i), 600_000, 600_000, 0,
                         f"{corr}{c:02d}/{i:05d}")
        deadline = time.monotonic() + 120
        while (await client.lock_info("queue")).waiter_count < waiters:
            assert time.monotonic() < deadline, "waiters not queued within 120 s"
            await asyncio.sleep(0.05)
        pinger = await Pinger.start(srv.address)
        growth = await flood(srv, [P.OP_CONTENDERS, "queue"], 20, 3)
        assert growth < RSS_BOUND, f"RSS grew {growth >> 20} MiB"
        page = (await queuers[0].call(P.OP_CONTENDERS, "queue"))[2]
        assert page["cursor"] is not None and len(P.packb(page)) < MAX_PAGE_BYTES + 1024
        bad = await queuers[0].call(P.OP_CONTENDERS, "queue", [7, 0])
        assert bad[1] == InvalidArgument.code
        info = await client.contenders("queue", most=waiters + 1)
        summary = await client.lock_info("queue")  # a bounded summary: about a page, the full count
        few = await client.contenders("queue", most=10)
        pings, worst = await pinger.finish()  # over the flood and the whole paged listing
        assert worst < STALL_S, f"worst PING {worst * 1000:.1f} ms over {pings} pings"
        assert not info["truncated"] and len(info["holders"]) == 1
        listed = [w["correlation_id"][len(corr):] for w in info["waiters"]]
        assert sorted(listed) == [f"{c:02d}/{i:05d}" for c in range(connections) for i in range(per_connection)]
        for c in range(connections):  # FIFO: each connection's waiters in the order they queued
            mine = [x for x in listed if x.startswith(f"{c:02d}/")]
            assert mine == sorted(mine)
        assert summary.waiter_count == waiters and 1 <= len(summary.waiters) < 1000
        assert summary.waiters[0].correlation_id == info["waiters"][0]["correlation_id"]
        assert few["truncated"] and len(few["holders"]) + len(few["waiters"]) == 10
    finally:
        for raw in queuers:
            await raw.close()
        await client.close()
        if pinger is not None:
            pinger.close()


async def test_a_key_event_reaches_a_connection_once_however_many_of_its_watches_match(server):
    """Finding: twenty connections watching every prefix of one key turned 160 KB of puts into
    1.7 GiB pushed (one push per matching watch).  Now a connection with a watch on every
    prefix of a key gets ONE push per put, and the client still hands each of its watches
    the event, under that watch's prefix."""
    key = "w/" + "k" * 62
    watcher = await Raw.open(server.address)
    writer = await fastlock.connect(server.address, client_name="writer")
    try:
        for n in range(len(key) + 1):
            watcher.send(OP_KEY_WATCH, key[:n])
        watches = await watcher.replies(len(key) + 1)
        assert all(m[1] == 0 and m[2] == {"once": True} for m in watches), watches[:2]
        for i in range(10):
            await writer.put(key, b"%d" % i)
        await writer.delete(key)
        await watcher.call(P.OP_PING)  # every push of the changes above precedes this reply
        pushes = [m for m in watcher.pushes if m[1] == "value"]
        assert [(p[2][1], p[2][2], p[2][3]) for p in pushes] == \
            [("put", key, b"%d" % i) for i in range(10)] + [("delete", key, None)]
        assert all(p[2][0] == "" for p in pushes)  # the connection's shortest matching prefix
        # the client: three overlapping watches on one connection each see every put once
        prefixes = ["", "w/", key]
        streams = [writer.watch_prefix(p) for p in prefixes]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        seen: list[list] = [[] for _ in streams]
        for i in range(100):  # until every watch has started and seen a put (bounded)
            await writer.put(key, b"warm %d" % i)
            done, _ = await asyncio.wait(firsts, timeout=0.05)
            if len(done) == len(firsts):
                break
        for events, first in zip(seen, firsts):
            events.append(first.result())
        await writer.put(key, b"last")
        for prefix, stream, events in zip(prefixes, streams, seen):
            while events[-1].value != b"last":
                events.append(await asyncio.wait_for(stream.__anext__(), 10))
            assert all(e.prefix == prefix and e.what == "put" and e.key == key for e in events)
            values = [e.value for e in events]
            assert len(values) == len(set(values)), values  # each put once
        for s in streams:
            await s.aclose()
    finally:
        await watcher.close()
        await writer.close()


async def test_locks_pages_are_bounded_by_bytes_and_cover_every_lock(server):
    """LOCKS of 600 locks with 500-character names: a page holds about 64 KiB (fewer locks
    than asked for), and following ``next`` lists every lock once, in name order."""
    client = await fastlock.connect(server.address, client_name="x" * 100)
    try:
        names = sorted(f"{i:04d}" + "n" * 496 for i in range(600))
        await pipelined(server.address, [[P.OP_ACQUIRE, n, OWNER + b"%04d" % i, 600_000, 0, 0, "c" * 200]
                                         for i, n in enumerate(names)])
        page = await client.locks(most=10_000)
        assert page.truncated and page.next == page.locks[-1].name and len(page.locks) < 600
        listed = [h.name for h in page.locks]
        for _ in range(600):  # bounded: each page lists at least one lock
            if not page.truncated:
                break
            page = await client.locks(most=10_000, after=page.next)
            listed += [h.name for h in page.locks]
        assert listed == names
    finally:
        await client.close()


def test_the_blocking_client_follows_the_pages_too(server):
    """SyncClient.list_prefix and SyncClient.contenders follow the server's pages: 300 keys of
    2 KiB (about 10 pages) listed whole and in order, the rest after ``cursor``; a free
    lock's contenders: none, not truncated."""
    from fastlock.sync import SyncClient

    keys = [f"s/{i:04d}" for i in range(300)]
    with SyncClient(server.address, client_name="sync") as c:
        for k in keys:
            c.put(k, b"v" * 2048)
        listed = c.list_prefix("s/", limit=10_000)
        assert [kv.key for kv in listed] == keys and not listed.more
        first = c.list_prefix("s/", limit=100)
        assert [kv.key for kv in first] == keys[:100] and first.more and first.cursor == keys[99]
        rest = c.list_prefix("s/", limit=10_000, after=first.cursor)
        assert [kv.key for kv in rest] == keys[100:]
        info = c.contenders("s/none")
        assert info == {"holders": [], "waiters": [], "truncated": False}


async def test_many_shared_holders_are_counted_and_paged(server):
    """A lock with 3,000 shared holders: HOLDER counts them without listing them, and
    CONTENDERS pages through the holders (then the waiter behind them) in grant order."""
    holders = 3_000
    await pipelined(server.address, [[P.OP_ACQUIRE, "shared", b"%08d" % i, 600_000, 0, 0, f"h{i:05d}", True]
                                     for i in range(holders)])
    client = await fastlock.connect(server.address, client_name="looker")
    raw = await Raw.open(server.address)
    try:
        raw.send(P.OP_ACQUIRE, "shared", b"exclusive", 600_000, 600_000, 0, "x")  # waits behind them
        info = await client.holder("shared")
        assert info is not None and info["holders"] == holders and info["correlation_id"] == "h00000"
        first = (await raw.call(P.OP_CONTENDERS, "shared"))[2]
        assert first["cursor"][0] == 0 and 1 <= len(first["holders"]) < holders and not first["waiters"]
        listed = await client.contenders("shared")
        assert [h["correlation_id"] for h in listed["holders"]] == [f"h{i:05d}" for i in range(holders)]
        assert [w["correlation_id"] for w in listed["waiters"]] == ["x"] and not listed["truncated"]
    finally:
        await raw.close()
        await client.close()
