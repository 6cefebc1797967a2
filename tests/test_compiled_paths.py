"""The compiled helpers of the request path give what their Python definitions give.

- ``wal._syncer.append_frame`` / ``seal_batch``: the frames and batch marks of
  :mod:`fastlock.wal.format`, byte for byte as a reference built here from ``struct`` and
  ``zlib`` writes them, read back by :func:`fastlock.wal.decode_frames`.
- ``wal._syncer.append_grant_record`` / ``append_lease_record``: the frame ``append_frame``
  writes for msgpack's encoding of the same record, byte for byte, at every width of every
  int, str and bin field (and nothing appended for a record they leave to the general encoder).
- ``protocol.feed_frames``: the messages and errors of ``FrameDecoder.feed`` for the same
  reads, and the decoder left in the same state (what it counts as fed).
"""

from __future__ import annotations

import struct
import zlib

import msgpack
import pytest

from fastlock import protocol as P
from fastlock.errors import ProtocolError
from fastlock.wal import MAX_RECORD_BYTES, decode_frames
from fastlock.wal._syncer import append_frame, append_grant_record, append_lease_record, seal_batch
from fastlock.wal.records import EXPIRE, GRANT, KEY_PUT, RELEASE

U32 = struct.Struct("<I")


def _reference_batch(bodies: list[bytes]) -> bytes:
    """The batch as the format describes it: crc32 | len (START on the first, COMMIT on the last) | body."""
    frames = []
    for i, body in enumerate(bodies):
        length = len(body) | (0x40000000 if i == 0 else 0) | (0x80000000 if i == len(bodies) - 1 else 0)
        lenb = U32.pack(length)
        frames.append(U32.pack(zlib.crc32(lenb + body)) + lenb + body)
    return b"".join(frames)


RECORDS = [  # as WriteAheadLog.log_grant / log_release / log_key_put build them
    [[GRANT, "a", 1 << 40 | 1, b"o" * 16, 10_000, 0, None, None, 1_700_000_000_000]],
    [[GRANT, "a", 1, b"o", 10, 0, "c", "x", 1], [RELEASE, "a", 1, 2], [RELEASE, "\u00e9" * 300, 5, 7]],
    [[KEY_PUT, "k", b"v" * 70_000, None, 0, None, 3]],
]


@pytest.mark.parametrize("records", RECORDS)
def test_append_frame_and_seal_batch_write_the_format(records):
    bodies = [msgpack.packb(r) for r in records]
    buf = bytearray()
    last = -1
    for body in bodies:
        last = append_frame(buf, body, MAX_RECORD_BYTES)
    seal_batch(buf, last)
    assert bytes(buf) == _reference_batch(bodies)
    decoded = list(decode_frames(bytes(buf), 7))
    assert [lsn for lsn, _ in decoded] == list(range(7, 7 + len(records)))
    assert len(decoded) == len(records)


def test_append_frame_refuses_a_record_over_the_bound_and_appends_nothing():
    buf = bytearray(b"abc")
    with pytest.raises(ValueError, match="exceeds 10"):
        append_frame(buf, b"x" * 11, 10)
    assert buf == bytearray(b"abc")
    assert append_frame(buf, b"x" * 10, 10) == 3


#: ints at each edge of msgpack's forms (fixint, u8, u16, u32, u64; negative fixint, i8, i16, i32, i64)
INTS = [0, 1, 127, 128, 255, 256, 65_535, 65_536, (1 << 32) - 1, 1 << 32, (1 << 63) - 1,
        -1, -32, -33, -128, -129, -32_768, -32_769, -(1 << 31), -(1 << 31) - 1, -(1 << 63)]
#: strs at each edge of msgpack's forms (fixstr, str8, str16, str32), ASCII and not
STRS = ["", "a", "x" * 31, "x" * 32, "x" * 255, "x" * 256, "x" * 65_535, "x" * 65_536,
        "\u00e9" * 20, "\u4e2d\U0001f512"]
#: owner keys at each edge of bin8, bin16, bin32
OWNERS = [b"", b"o" * 16, b"o" * 255, b"o" * 256, b"o" * 65_535, b"o" * 65_536]


def _framed(record: list) -> bytes:
    buf = bytearray(b"head")
    append_frame(buf, msgpack.packb(record), MAX_RECORD_BYTES)
    return bytes(buf)


@pytest.mark.parametrize("kind", [RELEASE, EXPIRE])
def test_append_lease_record_writes_what_msgpack_and_append_frame_write(kind):
    cases = [(name, token, wall) for name in STRS for token, wall in ((1, 1_700_000_000_000), (2, 0))]
    cases += [("a", i, j) for i in INTS for j in (INTS[0], INTS[-1], INTS[8])]
    for name, token, wall in cases:
        buf = bytearray(b"head")
        assert append_lease_record(buf, kind, name, token, wall, MAX_RECORD_BYTES) == 4
        assert bytes(buf) == _framed([kind, name, token, wall]), (name[:40], token, wall)


def test_append_grant_record_writes_what_msgpack_and_append_frame_write():
    cases = [(name, 1 << 40 | 7, b"o" * 16, 10_000, 0, client, corr, 1_700_000_000_000)
             for name in STRS for client in (None, "c", STRS[5]) for corr in (None, "", STRS[7])]
    cases += [("n", 5, owner, 1, 2, None, "x", 3) for owner in OWNERS]
    cases += [("n", i, b"o", i, -i if i > -(1 << 63) else 0, None, None, i) for i in INTS]
    for case in cases:
        buf = bytearray(b"head")
        assert append_grant_record(buf, GRANT, *case, MAX_RECORD_BYTES) == 4
        assert bytes(buf) == _framed([GRANT, *case]), [str(f)[:40] for f in case]


def test_the_record_encoders_refuse_what_the_general_path_writes_or_refuses():
    buf = bytearray(b"head")
    for client, corr in ((1, None), (None, b"x"), (None, 2.5)):  # only str or None is encoded here
        assert append_grant_record(buf, GRANT, "n", 1, b"o", 1, 0, client, corr, 1, MAX_RECORD_BYTES) == -1
    assert append_grant_record(buf, GRANT, None, 1, b"o", 1, 0, None, None, 1, MAX_RECORD_BYTES) == -1
    with pytest.raises(ValueError, match="exceeds 100"):
        append_grant_record(buf, GRANT, "n" * 100, 1, b"o", 1, 0, None, None, 1, 100)
    with pytest.raises(ValueError, match="exceeds 100"):
        append_lease_record(buf, RELEASE, "n" * 100, 1, 1, 100)
    with pytest.raises(UnicodeEncodeError):  # as msgpack refuses a lone surrogate
        append_lease_record(buf, RELEASE, "\ud800", 1, 1, MAX_RECORD_BYTES)
    with pytest.raises(UnicodeEncodeError):
        msgpack.packb("\ud800")
    assert buf == bytearray(b"head")  # nothing appended by any of them


def test_seal_batch_refuses_an_offset_with_no_frame():
    with pytest.raises(ValueError):
        seal_batch(bytearray(b"short"), 0)
    buf = bytearray()
    append_frame(buf, b"body", 100)
    with pytest.raises(ValueError):
        seal_batch(buf, len(buf))


def _reads() -> list[list[bytes]]:
    one = msgpack.packb([1, P.OP_ACQUIRE, "k", b"o" * 16, 1000, 0, 0, None])
    two = msgpack.packb([2, P.OP_RELEASE, "k", 5, b"o" * 16])
    return [
        [one],  # one whole frame per read: the compiled case
        [one, two, one],
        [one + two],  # two frames in one read
        [one[:5], one[5:] + two],  # a frame split across reads
        [b"\xc1"],  # never valid msgpack
        [one, b"\x92\x01"],  # an incomplete frame after a whole one
        [msgpack.packb("x" * 70_000)],  # beyond REPLY_LIMITS's string bound
        [msgpack.packb({i: i for i in range(5000)})],  # beyond the map bound
    ] + [[one] * 20 + [one + two] + [one] * 20]  # a peer that pipelines, then does not


@pytest.mark.parametrize("limits", [P.REQUEST_LIMITS, P.REPLY_LIMITS], ids=["request", "reply"])
@pytest.mark.parametrize("reads", _reads())
def test_feed_frames_decodes_as_feed(reads, limits):
    compiled, reference = P.FrameDecoder(limits=limits), P.FrameDecoder(limits=limits)
    for data in reads:
        try:
            expected = reference.feed(data)
        except ProtocolError as exc:
            with pytest.raises(ProtocolError) as got:
                P.feed_frames(compiled, data)
            assert str(got.value) == str(exc)
            return
        assert P.feed_frames(compiled, data) == expected
        assert compiled.fed == reference.fed
