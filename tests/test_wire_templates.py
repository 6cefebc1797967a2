"""The compiled request paths (fastlock/server/_wire.pyx, fastlock/protocol/_wire.pyx).

Replies written from templates are byte for byte what msgpack's packer writes for the
same reply, over the whole range of request ids, tokens and milliseconds the wire
carries; the compiled bases are what the server's and the client's connections are.
(Every check the compiled server path keeps is proven against a real server by
tests/test_request_path.py, test_security.py and test_bad_input.py.)
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastlock import protocol as P
from fastlock.errors import LeaseLost
from fastlock.protocol._wire import RpcWire, encode_request
from fastlock.protocol.framing import packb
from fastlock.protocol.rpc import RpcConnection
from fastlock.server._wire import SessionWire, ok_grant, ok_int, ok_nil
from fastlock.server.session import Session

#: a request id: what msgpack decodes as a positive int (the dispatch refuses ids below 1)
REQUEST_IDS = st.integers(min_value=1, max_value=(1 << 64) - 1)
#: an int of a reply: a token, a TTL, a wait (ms), or any int of 64 bits
VALUES = st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)


#: a request argument: every kind the compiled encoder writes itself, at and past its bounds,
#: and containers and values it leaves to msgpack's packer
ARGS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 64), max_value=(1 << 65)),
                 st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 63) - 1,
                                  1 << 63, (1 << 64) - 1, 1 << 64, -32, -33, -128, -129, -32768, -32769,
                                  -(1 << 31), -(1 << 31) - 1, -(1 << 63), -(1 << 63) - 1]),
                 st.floats(), st.text(max_size=300), st.binary(max_size=300),
                 st.sampled_from(["x" * 31, "x" * 32, "é" * 128, "x" * 65535, "x" * 65536, b"z" * 65535,
                                  b"z" * 65536, "\ud800", bytearray(b"ab"), object()]),
                 st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def _outcome(encode, *args):
    """``encode(*args)``'s frame, or the type of the error it raised (an error's message may
    name an object by its address)."""
    try:
        return encode(*args)
    except (TypeError, ValueError, OverflowError) as exc:  # UnicodeEncodeError is a ValueError
        return type(exc)


def _packb_request(req_id, op, args):
    return packb([req_id, op, *args])


@given(REQUEST_IDS, st.integers(min_value=0, max_value=200), st.lists(ARGS, max_size=20))
def test_a_request_is_encoded_as_msgpack_encodes_it(req_id, op, args):
    args = tuple(args)
    assert _outcome(encode_request, req_id, op, args) == _outcome(_packb_request, req_id, op, args)


@pytest.mark.parametrize("args", [("x" * 2040,), tuple(range(70000)), ("\ud800",), (1 << 64,)])
def test_a_request_past_the_encoders_bounds_is_msgpacks(args):
    assert _outcome(encode_request, 1, 2, args) == _outcome(_packb_request, 1, 2, args)


@given(REQUEST_IDS)
def test_ok_nil_is_what_msgpack_writes(req_id):
    assert ok_nil(req_id) == msgpack.packb([req_id, 0, None])


@given(REQUEST_IDS, VALUES)
def test_ok_int_is_what_msgpack_writes(req_id, value):
    assert ok_int(req_id, value) == msgpack.packb([req_id, 0, value])


@given(REQUEST_IDS, VALUES, VALUES, VALUES)
def test_ok_grant_is_what_msgpack_writes(req_id, token, ttl_ms, waited_ms):
    assert ok_grant(req_id, token, ttl_ms, waited_ms) == msgpack.packb([req_id, 0, [token, ttl_ms, waited_ms]])


def test_the_connections_are_the_compiled_protocols():
    assert issubclass(Session, SessionWire) and issubclass(Session, asyncio.Protocol)
    assert issubclass(RpcConnection, RpcWire) and issubclass(RpcConnection, asyncio.Protocol)
    assert Session.data_received is SessionWire.data_received
    assert RpcConnection.data_received is RpcWire.data_received
    assert RpcConnection.request is RpcWire.request


def test_a_reply_resolves_its_future_and_an_error_reply_raises():
    async def main() -> None:
        conn = RpcConnection(("127.0.0.1", 1))

        written: list[bytes] = []

        class Sink:
            def write(self, data: bytes) -> None:
                written.append(data)

        conn.connection_made(Sink())  # type: ignore[arg-type]
        ok = conn.request(P.OP_PING)
        bad = conn.request(P.OP_RELEASE, "x", 1, b"k")
        # the first at once (nothing was in flight), the second behind it at the end of the loop turn
        assert [msgpack.unpackb(w) for w in written] == [[1, P.OP_PING]]
        await asyncio.sleep(0)
        assert [msgpack.unpackb(w) for w in written] == [[1, P.OP_PING], [2, P.OP_RELEASE, "x", 1, b"k"]]
        # one read holding both replies, the later one first
        conn.data_received(msgpack.packb([2, LeaseLost.code, "not the holder", None]) + msgpack.packb([1, 0, "pong"]))
        assert await ok == "pong"
        with pytest.raises(LeaseLost, match="not the holder"):
            await bad
        assert not conn.pending

    asyncio.run(main())


def test_grant_delivery_queues_plain_acquires_and_returns_the_rest_in_order():
    """``deliver_grants``: a plain ACQUIRE's grant to a live connection is queued on it as
    msgpack writes ``[id, 0, [token, ttl_ms, waited_ms]]``; a grant to a closed or unknown
    connection, or one whose request is an object (sequencer, ACQUIRE_MANY), is returned
    for the Python path, in the order given."""
    from fastlock._core import LockTable
    from fastlock.server._wire import BatchEnd, deliver_grants

    server = BatchEnd()
    server.dirty = []

    def wire(session: int, closed: bool = False) -> SessionWire:
        conn = SessionWire()
        conn.server, conn.session, conn.out, conn.out_bytes, conn.closed = server, session, [], 0, closed
        return conn

    live, closed = wire(1), wire(2, closed=True)
    sessions = {1: live, 2: closed}

    # real grant events: five locks granted at once (tokens 1..5, waited 0 ms) to sessions 1, 2,
    # 3 (no connection), 1 (an object request) and 1
    table = LockTable()
    many = object()
    for i, (session, request) in enumerate([(1, 5), (2, 6), (3, 7), (1, many), (1, 8)]):
        table.acquire(f"lock{i}", b"owner", session, request, 10_000, 0, 0, None, 1_000)
    grants = table.drain_events()
    assert [ev.token for ev in grants] == [1, 2, 3, 4, 5] and [ev.waited_ms for ev in grants] == [0] * 5
    rest = deliver_grants(sessions, grants)
    assert [ev.token for ev in rest] == [2, 3, 4]
    assert live.out == [msgpack.packb([5, 0, [1, 10_000, 0]]), msgpack.packb([8, 0, [5, 10_000, 0]])]
    assert closed.out == [] and server.dirty == [live]
