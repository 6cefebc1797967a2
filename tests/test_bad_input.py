"""Invariant 8: bad input gets a clear error or a closed connection; the server
keeps serving everyone else and its state is unchanged."""

from __future__ import annotations

import asyncio
import os
import random

import msgpack
import pytest

import fastlock
from fastlock import protocol as P
from fastlock.errors import InvalidArgument, LeaseLost, ProtocolError

#: the subject is the server process: the test loop only drives a client (see conftest.py)
pytestmark = pytest.mark.one_loop


class RawConnection:
    """A hand-driven client: raw msgpack frames on a plain stream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.unpacker = msgpack.Unpacker(raw=False)

    @classmethod
    async def open(cls, address: str, hello: bool = True) -> RawConnection:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        conn = cls(reader, writer)
        if hello:
            reply = await conn.call([1, P.OP_HELLO, P.PROTOCOL_VERSION, "raw", None])
            assert reply[1] == 0, reply
        return conn

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self, timeout: float = 5.0):
        while True:
            for msg in self.unpacker:
                return msg
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
            if not data:
                return None  # closed by the server
            self.unpacker.feed(data)

    async def call(self, msg) -> list:
        await self.send(msgpack.packb(msg, use_bin_type=True))
        return await self.recv()

    async def closed_by_server(self, timeout: float = 10.0) -> bool:
        """Drain until EOF; True if the server closed the connection."""
        async def drain():
            while await self.reader.read(1 << 20):
                pass
        try:
            await asyncio.wait_for(drain(), timeout)
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.writer.close()


async def _state(client) -> tuple:
    st = await client.status()
    return st["locks_held"], st["waiters"], st["last_token"]


async def test_garbage_stream_closes_only_that_connection(client, server, loop_errors):
    lease = await client.acquire("survivor", ttl=60.0)
    before = await _state(client)
    rng = random.Random(1234)
    raw = await RawConnection.open(server.address)
    chunk = 1 << 20
    sent = 0
    try:
        while sent < 50 * chunk:  # 50 MiB of random bytes
            raw.writer.write(rng.randbytes(chunk))
            sent += chunk
            await raw.writer.drain()
            if sent % (8 * chunk) == 0:
                assert await client.check("survivor", lease.fencing_token)  # others keep working
    except (ConnectionResetError, BrokenPipeError):
        pass  # the server closed us mid-stream: expected
    finally:
        raw.close()
    assert await client.check("survivor", lease.fencing_token)
    assert await _state(client) == before
    other = await fastlock.connect(server.address)
    try:
        l2 = await other.acquire("fresh", ttl=5.0, wait=0)
        await other.release(l2)
    finally:
        await other.close()
    await client.release(lease)


@pytest.mark.parametrize(
    "message, needle",
    [
        ([1, P.OP_ACQUIRE, 123, os.urandom(16), 1000, 0, 0, None], "lock name must be str"),
        ([1, P.OP_ACQUIRE, "", os.urandom(16), 1000, 0, 0, None], "must not be empty"),
        ([1, P.OP_ACQUIRE, "x" * 513, os.urandom(16), 1000, 0, 0, None], "limit is 512"),
        ([1, P.OP_ACQUIRE, "x", "not-bytes", 1000, 0, 0, None], "owner key must be bytes"),
        ([1, P.OP_ACQUIRE, "x", os.urandom(16), 0, 0, 0, None], "ttl must be at least 1 ms"),
        ([1, P.OP_ACQUIRE, "x", os.urandom(16), -5, 0, 0, None], "ttl must be at least 1 ms"),
        ([1, P.OP_ACQUIRE, "x", os.urandom(16), 1.5, 0, 0, None], "ttl must be an integer"),
        ([1, P.OP_ACQUIRE, "x", os.urandom(16), float("nan"), 0, 0, None], "ttl must be an integer"),
        ([1, P.OP_ACQUIRE, "x", os.urandom(16), True, 0, 0, None], "ttl must be an integer"),
        ([1, P.OP_ACQUIRE, "x", os.urandom(16), 10**12, 0, 0, None], "above the longest lease TTL"),
        ([1, P.OP_ACQUIRE, "x", os.urandom(16), 1000, -2, 0, None], "wait must be"),
        ([1, P.OP_ACQUIRE, "x", os.urandom(16), 1000, 0, 60_001, None], "lock_delay must be"),
        ([1, P.OP_ACQUIRE, "x", os.urandom(16), 1000, 0, 0, 5], "correlation id must be str"),
        ([1, P.OP_ACQUIRE, "x"], "acquire takes 6 to 10 arguments"),
        ([1, P.OP_ACQUIRE, "x", os.urandom(16), 1000, 0, 0, None, False, 0, 1, True, 2],
         "acquire takes 6 to 10 arguments"),
        ([1, P.OP_ACQUIRE, "x", os.urandom(16), 1000, 0, 0, None, False, 0, 1, 2], "sequencer must be a bool"),
        ([1, P.OP_ACQUIRE, "x", os.urandom(16), 1000, 0, 0, None, False, 0, 1.5], "actor must be an int"),
        ([1, P.OP_ACQUIRE_MANY, [["x", False]], os.urandom(16), 1000, 0, 0, None, 1, True, 2],
         "acquire_many takes 6 to 8 arguments"),
        ([1, P.OP_ACQUIRE_MANY, [["x", False]], os.urandom(16), 1000, 0, 0, None, 1, 2], "sequencer must be a bool"),
        ([1, P.OP_RELEASE, "x", "1", os.urandom(16)], "fencing token must be int"),
        ([1, P.OP_RELEASE, "x", -1, os.urandom(16)], "fencing token out of range"),
        ([1, P.OP_EXTEND, "x", 1, os.urandom(16), 0], "ttl must be at least 1 ms"),
        # Redis's PX habit (milliseconds where seconds are meant) lands above the longest TTL
        ([1, P.OP_ACQUIRE, "x", os.urandom(16), 10_000_000, 0, 0, None],
         "ttl 10000 s (2.8 hours) is above the longest lease TTL, 3600 s (1 hour)"),
        ([1, P.OP_EXTEND, "x", 1, os.urandom(16), 3_600_001], "is above the longest lease TTL"),
        ([1, P.OP_ACQUIRE_MANY, [["x", False]], os.urandom(16), 3_600_001, 0, 0, None],
         "is above the longest lease TTL"),
        ([1, P.OP_CHECK, {"a": 1}, 1], "lock name must be str"),
        ([1, 99], "unknown operation 99"),
        ([1, P.OP_PING, "extra"], "ping takes 0 arguments"),
        ([1, P.OP_HELLO, 1], "hello takes 3 or 4 arguments"),
        ([1, P.OP_STEP_DOWN], "step_down takes 2 arguments"),
    ],
)
async def test_wrong_types_get_an_error_reply_and_change_nothing(client, server, message, needle):
    before = await _state(client)
    raw = await RawConnection.open(server.address)
    try:
        reply = await raw.call(message)
        if needle is None:
            assert reply[1] == 0  # ping ignores nothing harmful... but must answer
        else:
            assert reply[0] == 1 and reply[1] != 0, reply
            assert needle in reply[2], reply
        # the connection stays usable after a well-framed bad request
        pong = await raw.call([2, P.OP_PING])
        assert pong == [2, 0, None]
    finally:
        raw.close()
    assert await _state(client) == before


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb({"not": "an array"}),
        msgpack.packb([0, P.OP_PING]),  # request id 0 is reserved for pushes
        msgpack.packb(["1", P.OP_PING]),
        msgpack.packb(42),
        b"\xc1",  # never-used msgpack byte
    ],
)
async def test_malformed_frames_close_the_connection_with_a_reason(client, server, payload):
    before = await _state(client)
    raw = await RawConnection.open(server.address)
    try:
        await raw.send(payload)
        reply = await raw.recv()
        assert reply is not None and reply[0] == 0 and reply[1] == ProtocolError.code, reply
        assert await raw.closed_by_server()
    finally:
        raw.close()
    assert await _state(client) == before
    assert await client.ping() >= 0


async def test_a_flood_of_malformed_connections_logs_one_line_not_one_per_connection(client, server):
    """Each garbage connection is refused with its reason, but the log gets one
    line per 10 s (with the count of the rest), so a peer looping on garbage
    cannot fill the disk through the server's log."""
    start = len(server.lines)
    for _ in range(50):
        raw = await RawConnection.open(server.address, hello=False)
        try:
            await raw.send(b"\xc1")
            reply = await raw.recv()
            assert reply is not None and reply[0] == 0 and reply[1] == ProtocolError.code, reply
            assert await raw.closed_by_server()
        finally:
            raw.close()
    # a line logged after the flood: every line before it has been read too
    marker = await RawConnection.open(server.address)
    try:
        reply = await marker.call([2, P.OP_ACQUIRE, "marker", os.urandom(16), 1, 0, 0, None])
        assert reply[1] == 0, reply
    finally:
        marker.close()
    await asyncio.to_thread(server.wait_for_log, r"lease expired: 'marker'", 5, start)
    closing = [line for line in server.lines[start:] if "closing connection" in line]
    assert len(closing) == 1, closing
    assert "malformed msgpack" in closing[0]


async def test_oversized_frame_is_refused(client, server):
    raw = await RawConnection.open(server.address)
    try:
        # a str header declaring 4 GiB, then data that keeps coming
        await raw.send(b"\x92\x01\xdb\xff\xff\xff\xff" + b"a" * (2 << 20))
    except (ConnectionResetError, BrokenPipeError):
        pass
    try:
        reply = await raw.recv()
        assert reply is None or (reply[0] == 0 and "maximum frame size" in reply[2])
        assert await raw.closed_by_server()
    finally:
        raw.close()
    assert await client.ping() >= 0


async def test_requests_before_hello_are_refused(server, client):
    raw = await RawConnection.open(server.address, hello=False)
    try:
        reply = await raw.call([1, P.OP_ACQUIRE, "x", os.urandom(16), 1000, 0, 0, None])
        assert reply[0] == 0 and "HELLO" in reply[2]
        assert await raw.closed_by_server()
    finally:
        raw.close()
    assert (await client.status())["grants"] == 0


async def test_wrong_protocol_version_is_refused(server):
    raw = await RawConnection.open(server.address, hello=False)
    try:
        reply = await raw.call([1, P.OP_HELLO, 999, "x", None])
        assert reply[1] == ProtocolError.code and "version" in reply[2]
    finally:
        raw.close()


async def test_auth_secret(server_factory, tmp_path, loop_errors):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    srv = server_factory("authdata", args=["--auth-secret-file", str(secret)])
    with pytest.raises(fastlock.AuthError):
        await fastlock.connect(srv.address, auth="wrong")
    with pytest.raises(fastlock.AuthError):
        await fastlock.connect(srv.address)
    async with fastlock.connect(srv.address, auth="s3cret") as c:
        lease = await c.acquire("a", ttl=1.0)
        await c.release(lease)
        # the legacy secret is a client of every lock, never an operator or a replica
        assert c.server_info["principal"] == "shared-secret" and c.server_info["kind"] == "client"
    from fastlock._testbase.cluster import RawNode

    raw = await RawNode.open(srv.address, token="s3cret")
    try:
        for op, args in ((P.OP_SERVE_ALONE, ()), (P.OP_PROMOTE, (True,)), (P.OP_REPLICATE, (0, None, 0, "x@y")),
                         (P.OP_STEP_DOWN, (1, raw.hello["clock_ms"]))):
            with pytest.raises(fastlock.PermissionDenied):
                await raw.request(op, *args)
    finally:
        await raw.close()


async def test_release_of_a_released_lease_is_lease_lost_and_changes_nothing(client, connect):
    lease = await client.acquire("twice", ttl=30.0)
    await client.release(lease)
    other = await connect("other")
    lease2 = await other.acquire("twice", ttl=30.0, wait=0)
    with pytest.raises(LeaseLost):
        await client.release(lease)  # must never free someone else's lock
    assert await other.check("twice", lease2.fencing_token)
    await other.release(lease2)


def test_frame_decoder_is_sans_io_and_streams():
    dec = P.FrameDecoder(max_frame=1024)
    data = P.encode_request(1, P.OP_PING) + P.encode_request(2, P.OP_STATUS)
    assert dec.feed(data[:2]) == []
    assert dec.feed(data[2:5]) == [[1, P.OP_PING]]
    assert dec.feed(data[5:]) == [[2, P.OP_STATUS]]
    with pytest.raises(ProtocolError):
        P.FrameDecoder(max_frame=1024).feed(b"\xdb\x00\x00\x10\x00" + b"x" * 2000)
    with pytest.raises(ProtocolError):
        P.FrameDecoder().feed(b"\xc1")


def _decode(dec, pieces):
    out = []
    try:
        for piece in pieces:
            out += dec.feed(piece)
    except ProtocolError:
        return out, "refused"
    return out, "ok"


@pytest.mark.parametrize("frame", [
    msgpack.packb([1, P.OP_PING, msgpack.ExtType(1, b"ab")]),  # ext types are refused
    msgpack.packb([1, P.OP_PING, {1: 2}]),  # map keys must be str
    msgpack.packb([1, P.OP_PING, {str(i): i for i in range(17)}]),  # map beyond max_map_len
    msgpack.packb([1, P.OP_PING, list(range(P.REQUEST_LIMITS.max_array_len + 1))]),  # array beyond its bound
    msgpack.packb([1, P.OP_PING, "x" * 9000]),  # str beyond max_str_len (8192)
    b"\x93\x01\x05\xa2\xff\xfe",  # invalid UTF-8
    msgpack.packb([1, P.OP_PING]) + b"\xc1",  # a good frame, then garbage
    msgpack.packb([1, P.OP_PING]) + msgpack.packb([2, P.OP_STATUS]),  # two frames in one read
    msgpack.packb([1, P.OP_PING]) + msgpack.packb([2, P.OP_STATUS])[:2],  # one and a half
    msgpack.packb([1, P.OP_ACQUIRE, "a", b"k" * 16, 1000, -1, 0, None]),
])
def test_a_frame_read_whole_is_decoded_or_refused_as_read_byte_by_byte(frame):
    """A read that holds one whole frame takes a one-call path: it must keep every limit."""
    whole = _decode(P.FrameDecoder(), [frame])
    bytewise = _decode(P.FrameDecoder(), [frame[i:i + 1] for i in range(len(frame))])
    assert whole[1] == bytewise[1]
    if whole[1] == "ok":
        assert whole[0] == bytewise[0]
    two = msgpack.packb([7, P.OP_PING]) * 2  # after a read of several frames (the one-call path paused)
    assert _decode(P.FrameDecoder(), [two, frame])[1] == whole[1]


def test_seconds_to_ms_rounds_up_and_refuses_nonsense():
    assert P.seconds_to_ms(0.0001, "ttl") == 1
    assert P.seconds_to_ms(1.5, "ttl") == 1500
    assert P.seconds_to_ms(None, "wait", allow_none=True) == -1
    assert P.seconds_to_ms(0, "wait", allow_zero=True) == 0
    for bad in (0, -1, float("nan"), float("-inf"), True, "1", None):
        with pytest.raises((InvalidArgument, TypeError)):
            P.seconds_to_ms(bad, "ttl")


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_pipelining_client_that_never_reads_cannot_grow_server_memory(server):
    """Flow control: the server stops reading a connection whose replies pile up unread
    (each STATUS reply is ~1 KiB, so 9-byte requests would otherwise make it buffer
    ~100x what the client sends), or drops it once more than its output cap is unread (when
    one turn's requests already ask for more than the cap): either way its memory stays
    bounded."""
    import socket
    import time

    before = _rss_kib(server.pid)
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(0.2)
    try:
        sock.sendall(msgpack.packb([1, P.OP_HELLO, P.PROTOCOL_VERSION, "no-reader", None]))
        chunk = msgpack.packb([2, P.OP_STATUS]) * 1000
        sent = 0
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and sent < 1_500_000:  # bounded: ~13 MB of requests
            try:
                sock.sendall(chunk)
                sent += 1000
            except TimeoutError:
                continue  # blocked for now; keep pushing until the deadline
            except (ConnectionResetError, BrokenPipeError):  # dropped: its replies were over the cap
                server.wait_for_log(r"bytes of replies unread \(limit", timeout=10)
                break
        grown_mib = (_rss_kib(server.pid) - before) / 1024
        assert grown_mib < 100, f"server RSS grew by {grown_mib:.0f} MiB after {sent} unread requests"
        assert sent < 1_500_000, "the server read every request of a client that never reads"
    finally:
        sock.close()
