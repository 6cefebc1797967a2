"""``protocol.WireDecoder`` (compiled) decodes every stream as ``protocol.FrameDecoder`` does.

The reference is the Python ``FrameDecoder``: for the same reads, under the same limits,
the compiled decoder returns the same messages after every read, counts the same bytes as
fed and raises the same ``ProtocolError`` (same message) at the same read - over random
msgpack frames, malformed and over-limit bytes, and random splits of the stream into reads.
"""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastlock import protocol as P
from fastlock.errors import ProtocolError

#: small limits, so random frames cross every one of them often
SMALL = P.DecodeLimits(max_frame_bytes=300, max_array_len=6, max_map_len=3, max_str_len=24, max_bin_len=24,
                       max_depth=4, max_items=40)
LIMITS = [P.REQUEST_LIMITS, P.REPLY_LIMITS, SMALL, P.stream_limits(4096, 16), P.request_limits(4096, 100)]

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                     st.floats(width=32), st.text(max_size=40), st.binary(max_size=40))
_keys = st.one_of(st.text(max_size=6), st.binary(max_size=4))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=8),
                                                         st.dictionaries(_keys, inner, max_size=5)),
                       max_leaves=24)

#: bytes that are not a frame msgpack decodes under the limits, or decodes only as msgpack does
ODD = [
    b"\xc1",  # never valid msgpack
    msgpack.packb(msgpack.ExtType(1, b"ab")),  # ext types are refused (max_ext_len=0)
    msgpack.packb(msgpack.ExtType(5, b"")),  # an empty ext
    b"\xc7\x00\x01",  # ext8 of no bytes
    b"\xd6\xff\x00\x00\x00\x01",  # a timestamp
    msgpack.packb([1, {1: 2}]),  # map keys must be str or bytes
    msgpack.packb({b"k": [1.5, None]}),  # a bytes key is allowed
    msgpack.packb({"k": 1, "k2": 2, "k3": 3, "k4": 4}),  # beyond SMALL's map bound
    msgpack.packb(list(range(7))),  # beyond SMALL's array bound
    msgpack.packb("x" * 25), msgpack.packb(b"x" * 25),  # beyond SMALL's str / bin bound
    msgpack.packb("x" * 24), msgpack.packb(b"x" * 24),  # at it
    b"\xa2\xff\xfe", b"\xd9\x03\xed\xa0\x80",  # not UTF-8 (a surrogate in the second)
    b"\xdd\xff\xff\xff\xff", b"\xdf\x7f\xff\xff\xff", b"\xdb\x00\x01\x00\x00",  # huge declared lengths
    b"\xc6\x00\x00\x00\x05ab",  # a bin longer than what follows
    b"\x91" * 40 + b"\x01", b"\x81\xa1k" * 40 + b"\xc0",  # nested deeper than any limit here
    b"\xca" + struct.pack(">f", 1.25), b"\xca\x7f\xc0\x00\x01", b"\xcb" + struct.pack(">d", -0.0),
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",
    b"\xcc\xff", b"\xcd\xff\xff", b"\xce\xff\xff\xff\xff", b"\xd0\x80", b"\xd1\x80\x00", b"\xd2\x80\x00\x00\x00",
    b"\xe0", b"\x7f", b"\xdc\x00\x00", b"\xde\x00\x00", b"\xde\x00\x01\xa1k\x91\x90",
]

_chunks = st.one_of(_values.map(lambda v: msgpack.packb(v, use_bin_type=True)), st.sampled_from(ODD),
                    st.binary(min_size=1, max_size=12))


def _feed(decoder, data: bytes):
    try:
        return "ok", repr(decoder.feed(data))  # repr: nan, -0.0 and True vs 1 compare as themselves
    except ProtocolError as exc:
        return "refused", str(exc)


def _check_same(limits, shape_all: bool, hello_after: int | None, reads: list[bytes]) -> None:
    compiled = P.WireDecoder(limits=limits, shape_all=shape_all)
    reference = P.FrameDecoder(limits=limits, shape_all=shape_all)
    for i, data in enumerate(reads):
        if i == hello_after:
            compiled.shape_all = reference.shape_all = False
        got, expected = _feed(compiled, data), _feed(reference, data)
        assert got == expected, (i, data)
        if expected[0] == "refused":
            return
        assert compiled.fed == reference.fed


@settings(max_examples=400, deadline=None)
@given(st.lists(_chunks, min_size=1, max_size=8), st.data())
def test_the_compiled_decoder_decodes_any_stream_in_any_reads_as_the_reference(chunks, data):
    stream = b"".join(chunks)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    limits = data.draw(st.sampled_from(LIMITS))
    shape_all = data.draw(st.booleans())
    hello_after = data.draw(st.none() | st.integers(0, len(reads)))
    _check_same(limits, shape_all, hello_after, reads)


@settings(max_examples=200, deadline=None)
@given(st.lists(_values, min_size=1, max_size=6), st.data())
def test_valid_frames_read_whole_or_split_give_the_same_messages(messages, data):
    stream = b"".join(msgpack.packb(m, use_bin_type=True) for m in messages)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    _check_same(P.REPLY_LIMITS, False, None, reads)
    dec = P.WireDecoder(limits=P.REPLY_LIMITS)
    assert repr([m for r in reads for m in dec.feed(r)]) == repr(messages)


@pytest.mark.parametrize("limits", LIMITS, ids=["request", "reply", "small", "stream", "sized"])
@pytest.mark.parametrize("odd", ODD)
def test_each_odd_frame_alone_after_and_before_a_good_one(limits, odd):
    good = msgpack.packb([1, P.OP_ACQUIRE, "k", b"o" * 16, 1000, 0, 0, None])
    for reads in ([odd], [good, odd], [good + odd], [odd + good], [good + odd[:2], odd[2:] + good],
                  [odd[i:i + 1] for i in range(len(odd))]):
        _check_same(limits, False, None, reads)
        _check_same(limits, True, 1, reads)


def test_a_read_of_whole_frames_is_decoded_without_the_reference():
    dec = P.WireDecoder(limits=P.REPLY_LIMITS)
    reply = msgpack.packb([7, 0, [123, 456789, {"fence": 1, "name": "jobs/a"}]])
    assert dec.feed(reply * 3) == [[7, 0, [123, 456789, {"fence": 1, "name": "jobs/a"}]]] * 3
    assert dec.reference.fed == 0 and dec.fed == 3 * len(reply)
    # a frame split across reads: the reference keeps its first part, the next read completes it
    assert dec.feed(reply + reply[:4]) == [[7, 0, [123, 456789, {"fence": 1, "name": "jobs/a"}]]]
    assert dec.reference.fed == 4
    assert dec.feed(reply[4:]) == [[7, 0, [123, 456789, {"fence": 1, "name": "jobs/a"}]]]
    assert dec.feed(reply) == [[7, 0, [123, 456789, {"fence": 1, "name": "jobs/a"}]]]
    assert dec.reference.fed == len(reply) and dec.fed == 6 * len(reply)


def test_shape_all_walks_every_frame_until_it_is_switched_off():
    """Before HELLO a server walks every frame (max_depth holds for whole frames too)."""
    deep = b"\x91" * 5 + b"\x01"  # depth 5 > REQUEST_LIMITS.max_depth (3)
    dec = P.WireDecoder(shape_all=True)
    with pytest.raises(ProtocolError, match="deeper than 3"):
        dec.feed(deep)
    dec = P.WireDecoder(shape_all=True)
    dec.shape_all = False
    assert dec.reference.shape_all is False and dec.feed(deep) == [[[[[[1]]]]]]


def test_feed_frames_feeds_either_decoder():
    frame = msgpack.packb([1, 0, "granted"])
    for dec in (P.WireDecoder(), P.FrameDecoder()):
        assert P.feed_frames(dec, frame) == [[1, 0, "granted"]] and dec.fed == len(frame)


def test_map_keys_are_interned_as_msgpack_interns_them():
    frame = msgpack.packb({"a-key-of-some-length": 1})
    one, two = P.WireDecoder(limits=P.REPLY_LIMITS).feed(frame)[0], msgpack.unpackb(frame)
    assert next(iter(one)) is next(iter(two))


def test_a_client_connection_decodes_its_replies_with_it():
    from fastlock.protocol.rpc import RpcConnection

    async def decoder_type():
        return type(RpcConnection()._decoder)

    assert asyncio.run(decoder_type()) is P.WireDecoder


async def test_a_server_session_decodes_its_requests_with_it(tmp_path):
    """Before HELLO every frame is walked (``shape_all``), after it the compiled path decodes."""
    from fastlock._testbase.cluster import RawNode
    from fastlock.server import LockServer, ServerConfig

    server = LockServer(ServerConfig(port=0, data_dir=str(tmp_path / "data"), fsync="never"))
    await server.start()
    node = await RawNode.open(f"{server.address[0]}:{server.address[1]}")
    try:
        [session] = server.sessions.values()
        decoder = session.decoder
        assert type(decoder) is P.WireDecoder and not decoder.shape_all and not decoder.reference.shape_all
        before = decoder.reference.fed
        for _ in range(3):
            assert await node.request(P.OP_PING) is None
        assert decoder.reference.fed == before and decoder.fed > before  # decoded without the reference
    finally:
        await node.close()
        await server.close()
