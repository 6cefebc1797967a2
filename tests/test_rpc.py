"""The request/reply layer (fastlock.protocol.rpc) against a real server: ids, error
replies decoded into exceptions, pushes in order, raw frames, fail-all on close,
the liveness watchdog, and a malformed reply closing only that connection."""

from __future__ import annotations

import asyncio
import os

import msgpack
import pytest

from fastlock import protocol as P
from fastlock.errors import ConnectionLost, InvalidArgument, LeaseLost
from fastlock.protocol import rpc


async def _open(server, **kwargs) -> rpc.RpcConnection:
    host, _, port = server.address.rpartition(":")
    conn = await rpc.open_connection(host, int(port), timeout=5.0, **kwargs)
    info = await asyncio.wait_for(conn.request(P.OP_HELLO, P.PROTOCOL_VERSION, "rpc-test", None), 5)
    assert info["role"] == "primary"
    return conn


async def test_replies_errors_and_pipelining(server, loop_errors):
    conn = await _open(server)
    owner = os.urandom(16)
    futs = [conn.request(P.OP_PING) for _ in range(50)]
    acq = conn.request(P.OP_ACQUIRE, "rpc/a", owner, 5000, 0, 0, None)
    bad = conn.request(P.OP_RELEASE, "rpc/a", 1, b"x" * 16)
    assert await asyncio.gather(*futs) == [None] * 50
    reply = await acq
    assert reply[1] == 5000 and reply[0] > 0
    with pytest.raises(LeaseLost):
        await bad
    with pytest.raises(InvalidArgument):
        await conn.request(P.OP_ACQUIRE, "", owner, 5000, 0, 0, None)
    # a raw pre-encoded frame with a reserved id
    rid = conn.next_id()
    fut = conn.expect(rid)
    conn.write_raw(P.encode_request(rid, P.OP_RELEASE, "rpc/a", reply[0], owner))
    assert await fut is None
    conn.close()
    with pytest.raises(ConnectionLost):
        await conn.request(P.OP_PING)


async def test_pushes_reach_the_callback_in_order(server, loop_errors):
    seen: list = []
    reads: list = []
    conn = await _open(server, on_push=lambda kind, payload: seen.append((kind, payload)),
                       on_read_end=lambda: reads.append(len(seen)))
    other = await _open(server)
    assert await conn.request(P.OP_WATCH, "rpc/w") is None
    tokens = []
    for _ in range(3):
        owner = os.urandom(16)
        token, _ttl, _waited = await other.request(P.OP_ACQUIRE, "rpc/w", owner, 5000, 0, 0, None)
        await other.request(P.OP_RELEASE, "rpc/w", token, owner)
        tokens.append(token)
    # a watcher hears a change once its record is committed: maybe after other replies
    expected = [(k, t) for t in tokens for k in ("granted", "released")]
    async with asyncio.timeout(10):
        while len([p for kind, p in seen if kind == P.PUSH_WATCH]) < len(expected):
            await conn.request(P.OP_PING)
    kinds = [(p[1], p[2]) for kind, p in seen if kind == P.PUSH_WATCH]
    assert kinds == expected
    assert reads and reads[-1] == len(seen)
    conn.close()
    other.close()


async def test_close_fails_every_pending_request_and_calls_on_close(server, loop_errors):
    closed: list = []
    conn = await _open(server, on_close=lambda c, err: closed.append(err))
    holder = await _open(server)
    owner = os.urandom(16)
    await holder.request(P.OP_ACQUIRE, "rpc/c", owner, 5000, 0, 0, None)
    waiting = [conn.request(P.OP_ACQUIRE, "rpc/c", os.urandom(16), 5000, -1, 0, None) for _ in range(3)]
    await conn.request(P.OP_PING)
    conn.abort(ConnectionLost("test abort"))
    for fut in waiting:
        with pytest.raises(ConnectionLost, match="test abort"):
            await fut
    assert len(closed) == 1
    conn.close()  # idempotent
    assert len(closed) == 1
    holder.close()


async def test_silent_server_is_dropped_by_the_liveness_watchdog(server, loop_errors):
    conn = await _open(server, liveness_timeout=0.3)
    holder = await _open(server)
    await holder.request(P.OP_ACQUIRE, "rpc/s", os.urandom(16), 5000, 0, 0, None)
    waiting = conn.request(P.OP_ACQUIRE, "rpc/s", os.urandom(16), 5000, -1, 0, None)
    await conn.request(P.OP_PING)
    server.pause()
    try:
        with pytest.raises(ConnectionLost, match="no reply"):
            await asyncio.wait_for(waiting, 5)
        assert conn.silent and conn.pings >= 1
    finally:
        server.resume()
    holder.close()


async def test_malformed_reply_closes_only_that_connection(loop_errors):
    async def handle(reader, writer):
        await reader.read(100)
        writer.write(b"\xc1" * 8)  # never valid msgpack
        await writer.drain()
        await reader.read(100)
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        conn = await rpc.open_connection("127.0.0.1", port, timeout=5.0)
        with pytest.raises(ConnectionLost, match="bad data"):
            await asyncio.wait_for(conn.request(P.OP_PING), 5)
        assert conn.closed
    finally:
        srv.close()
        await srv.wait_closed()


async def test_a_batch_goes_out_in_order_behind_the_frames_kept_for_the_turn(server, loop_errors):
    """request_batch with requests in flight: its frames join the turn's one write, after the
    frames written before it (a RELEASE never overtakes the ACQUIRE it follows); with nothing
    in flight it is written at once."""
    conn = await _open(server)
    try:
        owner = os.urandom(16)
        writes = conn.writes
        alone = conn.request_batch([(P.OP_PING,), (P.OP_PING,)])  # nothing in flight: at once
        assert conn.writes == writes + 1 and conn.out is None
        assert await asyncio.wait_for(asyncio.gather(*alone), 10) == [None, None]
        first = conn.request(P.OP_PING)  # at once
        acq = conn.request(P.OP_ACQUIRE, "rpc/batch", owner, 5000, 0, 0, None)  # kept for the turn's write
        # CANCEL by owner releases the grant it follows (before it, it would find nothing)
        futs = conn.request_batch([(P.OP_CANCEL, "rpc/batch", owner), (P.OP_PING,)])
        assert conn.writes == writes + 2 and len(conn.out) == 2  # behind the acquire, not ahead of it
        await asyncio.sleep(0)  # the end of the turn: one write
        assert conn.writes == writes + 3 and conn.out is None
        assert await asyncio.wait_for(first, 10) is None
        assert (await asyncio.wait_for(acq, 10))[0] > 0
        await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 10)
        assert await asyncio.wait_for(conn.request(P.OP_HOLDER, "rpc/batch"), 10) is None
    finally:
        conn.close()


async def test_requests_behind_one_in_flight_go_out_in_one_write_per_loop_turn(server, loop_errors):
    conn = await _open(server)
    owner = os.urandom(16)
    writes = conn.writes
    first = conn.request(P.OP_PING)  # nothing in flight: written at once
    assert conn.writes == writes + 1 and conn.out is None
    behind = [conn.request(P.OP_PING) for _ in range(20)]
    rid = conn.next_id()
    raw = conn.expect(rid)
    conn.write_raw(P.encode_request(rid, P.OP_PING))  # after the 20 requests, not ahead of them
    acq = conn.request(P.OP_ACQUIRE, "rpc/turn", owner, 5000, 0, 0, None)
    rel = conn.request(P.OP_RELEASE, "rpc/turn", 1, b"x" * 16)
    assert conn.writes == writes + 1 and len(conn.out) == 23
    kept = [msgpack.unpackb(frame) for frame in conn.out]  # in the order written
    assert [m[0] for m in kept] == [*range(kept[0][0], kept[0][0] + 20), rid, rid + 1, rid + 2]
    assert [m[1] for m in kept[-3:]] == [P.OP_PING, P.OP_ACQUIRE, P.OP_RELEASE]
    await asyncio.sleep(0)  # the end of the turn: one write for the 23 frames
    assert conn.writes == writes + 2 and conn.out is None
    assert await asyncio.wait_for(asyncio.gather(first, *behind, raw), 10) == [None] * 22
    assert (await asyncio.wait_for(acq, 10))[0] > 0
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(rel, 10)
    # requests written in the turn of a close go out before it: their replies are lost with
    # the connection, but the server took them (a released lock is free for the next owner)
    lease = await asyncio.wait_for(conn.request(P.OP_ACQUIRE, "rpc/turn2", owner, 60000, 0, 0, None), 10)
    pending = conn.request(P.OP_PING)  # the first in flight: at once
    release = conn.request(P.OP_RELEASE, "rpc/turn2", lease[0], owner)  # kept for the turn's write
    assert conn.out is not None
    conn.close()
    for fut in (pending, release):
        with pytest.raises(ConnectionLost):
            await fut
    other = await _open(server)
    try:
        granted = await asyncio.wait_for(other.request(P.OP_ACQUIRE, "rpc/turn2", os.urandom(16), 5000, 10000, 0,
                                                       None), 15)
        assert granted[0] > lease[0]
    finally:
        other.close()


async def test_requests_of_tasks_one_read_wakes_go_out_in_one_write(loop_errors):
    """A read that answers several requests wakes their tasks in one loop turn: the requests
    they write then go out in one write after them, not the first at once and the rest in a
    second write."""
    tasks_n = 4
    reads: list[list[int]] = []

    async def answer_in_fours(reader, writer):
        # replies only when four requests are in: all four in one write (so in one read)
        unpacker = msgpack.Unpacker()
        ids: list[int] = []
        while data := await reader.read(65536):
            unpacker.feed(data)
            got = [req[0] for req in unpacker]
            reads.append(got)
            ids += got
            if len(ids) >= tasks_n:
                writer.write(b"".join(msgpack.packb([i, 0, None]) for i in ids))
                ids = []
        writer.close()

    srv = await asyncio.start_server(answer_in_fours, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    conn = await rpc.open_connection("127.0.0.1", port, timeout=5.0)
    try:
        async def two_requests() -> None:
            await conn.request(P.OP_PING)
            await conn.request(P.OP_PING)  # written in the turn the one read woke the four tasks

        writes = conn.writes
        await asyncio.wait_for(asyncio.gather(*(two_requests() for _ in range(tasks_n))), 10)
        # the first round: one at once, three kept for the turn's write; the second: one write
        assert conn.writes == writes + 3
        assert sorted(i for got in reads for i in got) == list(range(1, 2 * tasks_n + 1))
        assert reads[-1] == list(range(tasks_n + 1, 2 * tasks_n + 1))  # the second round in one read
        assert conn.out is None and not conn.pending
    finally:
        conn.close()
        srv.close()
        await srv.wait_closed()
