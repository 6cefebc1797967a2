"""Framing: msgpack frames over a byte stream, sans-IO, with bounds.

Nothing here touches a socket, a loop or a clock (the h11 pattern): a
:class:`FrameDecoder` turns received bytes into decoded messages, and the
``encode_*`` functions turn messages into bytes.  The stream is a plain
sequence of msgpack objects (msgpack's own streaming format, as its
``Unpacker`` reads it).  A frame beyond its :class:`DecodeLimits` is a
:class:`~fastlock.errors.ProtocolError` and the connection must be closed:
after garbage there is no way to find the next frame boundary.  Requests,
replies and the replication stream each have their own limits
(:data:`REQUEST_LIMITS`, :data:`REPLY_LIMITS`, :func:`stream_limits`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import msgpack

from ..errors import ProtocolError
from .ops import STATUS_OK
from .validation import MAX_MANY, MAX_NAME_BYTES

#: bound of one request frame, bytes; replies and the replication stream have their own
DEFAULT_MAX_FRAME_BYTES = 64 << 10
#: the smallest frame bound a server accepts: it holds every request with its
#: names, keys and ids at their limits
MIN_MAX_FRAME_BYTES = 4096

_packer = msgpack.Packer(use_bin_type=True, autoreset=True)
packb = _packer.pack
_unpackb = msgpack.unpackb
#: reads that go to the streaming decoder after one that was not exactly one whole frame
WHOLE_SKIP = 16


class DecodeLimits(NamedTuple):
    """Bounds on one received frame, so a peer cannot make the decoder hold much.

    msgpack's ``Unpacker`` allocates a container as soon as it reads its
    header (an ``array16(65535)`` header of 3 bytes preallocates 512 KiB) and
    keeps a frame's partial objects until the frame completes, so every length
    a peer can declare is bounded here - as msgpack's own docstring advises for
    untrusted input.

    ``max_frame_bytes``: bytes of one frame (all of it, including parts already
    decoded while the rest is still in flight).  ``max_array_len`` /
    ``max_map_len``: elements of one array / pairs of one map.  ``max_str_len``
    / ``max_bin_len``: bytes of one str / bin.  ``max_depth``: containers
    nested in one frame (a request ``[id, op, args...]`` is depth 1).
    ``max_items``: elements and pairs of all containers of one frame together.
    ``walk``: check ``max_depth`` and ``max_items`` on frames that arrive in
    pieces (see :class:`FrameDecoder`); without it only msgpack's own limits
    and ``max_frame_bytes`` apply.  ``max_depth`` and ``max_items`` bound what a
    frame can make the decoder *hold*: a frame that arrives whole in one read
    is decoded at once and freed with the request, bounded by the other limits.
    Exceeding any of them raises :class:`~fastlock.errors.ProtocolError`.
    """

    max_frame_bytes: int
    max_array_len: int
    max_map_len: int
    max_str_len: int
    max_bin_len: int
    max_depth: int
    max_items: int
    walk: bool = True


#: What a server accepts from a client (sized to the protocol): a request is a
#: short flat array of scalars - names <= 512 bytes, owner keys <= 64 bytes,
#: client names and correlation ids <= 1 KiB of UTF-8; the rest is headroom
#: for credentials and options (a small map or list inside the request).  The
#: longest array is ACQUIRE_MANY's list of up to ``MAX_MANY`` ``[name, shared]``
#: pairs (1 + 3 * MAX_MANY elements with the request's own, within ``max_items``).
REQUEST_LIMITS = DecodeLimits(
    max_frame_bytes=DEFAULT_MAX_FRAME_BYTES,
    max_array_len=max(32, MAX_MANY),
    max_map_len=16,
    max_str_len=8192,
    max_bin_len=8192,
    max_depth=3,
    max_items=256,
)


#: bytes of a request beside its largest bin (a key's value): the request's array, op,
#: key, lease name, token and owner key at their limits, with room to spare
REQUEST_OVERHEAD_BYTES = MIN_MAX_FRAME_BYTES


@functools.lru_cache(maxsize=8)
def request_limits(max_frame_bytes: int, max_value_bytes: int) -> DecodeLimits:
    """What a server accepts from a client, sized to its configuration.

    ``max_frame_bytes`` (bytes, ``--max-frame-bytes``) bounds one request frame;
    ``max_value_bytes`` (bytes, ``--max-value-bytes``) is the largest key value
    the server stores.  The frame bound is raised to hold a value at that limit
    with the rest of its request (:data:`REQUEST_OVERHEAD_BYTES`), and one bin
    may fill the frame: a value over ``max_value_bytes`` that still fits the
    frame is decoded, so the key store refuses it with ``InvalidArgument`` and
    the connection stays usable; a frame beyond the bound is a
    :class:`~fastlock.errors.ProtocolError` that closes the connection.  The
    other limits are those of :data:`REQUEST_LIMITS`.
    """
    frame = max(max_frame_bytes, max_value_bytes + REQUEST_OVERHEAD_BYTES)
    return REQUEST_LIMITS._replace(max_frame_bytes=frame, max_bin_len=frame)


#: What a client accepts from a server: replies are small, STATUS is a map of a
#: few dozen entries; a server is trusted more than a client, not blindly.
REPLY_LIMITS = DecodeLimits(
    max_frame_bytes=64 << 20,
    max_array_len=1 << 16,
    max_map_len=1024,
    max_str_len=1 << 20,
    max_bin_len=64 << 20,  # a key's value: a server's --max-value-bytes may exceed a request's default frame
    max_depth=8,
    max_items=1 << 20,
)


def stream_limits(max_frame_bytes: int, max_leases: int) -> DecodeLimits:
    """Limits for a standby reading its primary's stream: a snapshot is one frame
    holding every lease (``max_leases`` arrays of 8), a record batch is one bin.

    Frames are not walked header by header: a snapshot of a million leases
    would cost seconds of loop time, and the primary is a peer the standby
    chose (and authenticates); its frames stay bounded by ``max_frame_bytes``
    and msgpack's limits."""
    return DecodeLimits(
        max_frame_bytes=max_frame_bytes,
        max_array_len=max(1024, max_leases),
        max_map_len=1024,
        max_str_len=max(8192, MAX_NAME_BYTES * 4),
        max_bin_len=max_frame_bytes,
        max_depth=6,
        max_items=9 * max(1024, max_leases) + 1024,
        walk=False,
    )


# msgpack first bytes: (payload bytes that follow directly, bytes of a length/count
# field, what the length counts: 0 = payload bytes, 1 = array elements, 2 = map pairs)
def _byte_table() -> list[tuple[int, int, int]]:
    table = [(0, 0, 0)] * 256
    for b in range(0x80, 0x90):
        table[b] = (0, 0, 2)  # fixmap, count in the low nibble (handled below)
    for b in range(0x90, 0xA0):
        table[b] = (0, 0, 1)  # fixarray
    for b in range(0xA0, 0xC0):
        table[b] = (b & 0x1F, 0, 0)  # fixstr
    fixed = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xCA: 4, 0xCB: 8,
             0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
    for b, n in fixed.items():
        table[b] = (n, 0, 0)
    for b, n in {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}.items():
        table[b] = (0, n, 0)  # bin8/16/32, str8/16/32
    for b, n in {0xC7: 1, 0xC8: 2, 0xC9: 4}.items():
        table[b] = (1, n, 0)  # ext8/16/32: a type byte after the length
    table[0xDC], table[0xDD] = (0, 2, 1), (0, 4, 1)  # array16/32
    table[0xDE], table[0xDF] = (0, 2, 2), (0, 4, 2)  # map16/32
    return table


_BYTES = _byte_table()


class _FrameShape:
    """Walks the msgpack headers of ONE frame that arrives in pieces, checking its
    nesting depth and total element count before the rest of it arrives.

    Incremental (its state survives between pieces) and header-only: payload
    bytes are skipped, not copied.  Byte validity is msgpack's business.
    """

    __slots__ = ("limits", "stack", "skip", "head", "items", "ending")

    def __init__(self, limits: DecodeLimits):
        self.limits = limits
        self.stack: list[int] = []  # elements still expected by each open container
        self.skip = 0  # payload bytes still to skip
        self.head = b""  # the first bytes of a header split across pieces
        self.items = 0
        self.ending = False  # the skipped payload is the frame's last element

    def walk(self, data: bytes | memoryview, pos: int = 0) -> int:
        """Walk ``data[pos:]``; return the offset just past the frame's end, or -1
        if the frame continues in a later piece.  Raises ProtocolError."""
        n = len(data)
        stack = self.stack
        limits = self.limits
        table = _BYTES
        while True:
            if self.skip:
                take = min(self.skip, n - pos)
                self.skip -= take
                pos += take
                if self.skip:
                    return -1
            if self.ending:
                return pos
            if pos >= n:
                return -1
            head = self.head
            if head:  # complete a header begun in an earlier piece
                need = 1 + table[head[0]][1] - len(head)
                head += bytes(data[pos:pos + need])
                pos += min(need, n - pos)
                if len(head) < need + len(self.head):
                    self.head = head
                    return -1
                self.head = b""
                hdr: bytes | memoryview = head
                hpos = 0
            else:
                hdr, hpos = data, pos
            b = hdr[hpos]
            direct, lenbytes, kind = table[b]
            if lenbytes:
                if hdr is data and pos + 1 + lenbytes > n:
                    self.head = bytes(data[pos:])
                    return -1
                count = int.from_bytes(hdr[hpos + 1:hpos + 1 + lenbytes], "big")
            else:
                count = b & 0x0F if kind else 0
            if hdr is data:
                pos += 1 + lenbytes
            if kind:
                if len(stack) >= limits.max_depth:
                    raise ProtocolError(f"frame nests containers deeper than {limits.max_depth}")
                count = count * 2 if kind == 2 else count
                self.items += count
                if self.items > limits.max_items:
                    raise ProtocolError(f"frame holds more than {limits.max_items} elements")
                if count:
                    stack.append(count)
                    continue
            else:
                self.skip = direct + (count if lenbytes else 0)
            # one element complete (its payload, if any, is skipped next): close finished containers
            while stack:
                stack[-1] -= 1
                if stack[-1]:
                    break
                stack.pop()
            if not stack:
                self.ending = True


class FrameDecoder:
    """Incremental decoder: ``feed(data)`` returns the messages now complete.

    ``limits`` (:class:`DecodeLimits`) bounds each frame; the default,
    :data:`REQUEST_LIMITS`, is what a server accepts from a client.  For
    compatibility ``max_frame`` (bytes) alone may be given: it replaces the
    frame limit of ``limits``.  A frame that exceeds a limit, or bytes that are
    not msgpack, raise :class:`ProtocolError`; the decoder is then unusable and
    the connection must be closed.

    A frame that is still incomplete at the end of a piece is walked header by
    header (:class:`_FrameShape`) while the rest arrives, so a peer cannot park
    deeply nested or oversized partial frames in memory; complete frames - the
    common case - cost nothing extra.  ``shape_all`` walks every byte first
    (for peers that have not authenticated yet: they send one small HELLO).
    """

    __slots__ = ("_unpacker", "_limits", "_fed", "_frame_start", "_shape", "shape_all", "_whole_max", "_whole_skip",
                 "_whole_bytes")

    def __init__(self, max_frame: int | None = None, *, limits: DecodeLimits | None = None,
                 shape_all: bool = False):
        limits = limits or REQUEST_LIMITS
        if max_frame is not None:
            limits = limits._replace(max_frame_bytes=max_frame)
        self._limits = limits
        self._unpacker = msgpack.Unpacker(
            raw=False,
            use_list=True,
            strict_map_key=True,
            # the internal buffer holds at most one read (<= 256 KiB) beyond a frame
            max_buffer_size=limits.max_frame_bytes + (1 << 20),
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_bin_len,
            max_ext_len=0,
        )
        self._fed = 0  # bytes fed so far
        self._frame_start = 0  # stream offset where the incomplete frame (if any) starts
        self._shape: _FrameShape | None = None  # walker of the incomplete frame
        self.shape_all = shape_all
        # the largest read decoded as one whole frame by msgpack.unpackb, whose default
        # str/bin bounds are the read's length: within every limit of this decoder
        self._whole_max = min(limits.max_frame_bytes, limits.max_str_len, limits.max_bin_len)
        self._whole_skip = 0  # reads left before unpackb is tried again
        self._whole_bytes = 0  # bytes decoded by unpackb (never fed to the streaming decoder)

    @property
    def limits(self) -> DecodeLimits:
        return self._limits

    @property
    def fed(self) -> int:
        """Bytes fed so far (0: nothing has arrived)."""
        return self._fed + self._whole_bytes

    @property
    def between_frames(self) -> bool:
        """No frame is in flight: every byte fed so far belongs to a complete frame."""
        return self._fed == self._frame_start and self._shape is None

    def feed(self, data: bytes) -> list[Any]:
        """Add received bytes; return every message now complete (maybe none).

        Raises ProtocolError on malformed msgpack or a frame beyond the limits.
        """
        base = self._fed
        if base == self._frame_start and self._shape is None and not self.shape_all:
            # the common case: no frame in flight, nothing to walk.
            n = len(data)
            if n <= self._whole_max:
                if self._whole_skip:
                    self._whole_skip -= 1
                else:
                    # Most reads hold exactly one whole frame: decode it in one call.  unpackb
                    # bounds every str, bin and array by len(data), within the limits here;
                    # ext types, maps and arrays are bounded as the streaming decoder bounds them.
                    try:
                        frame = _unpackb(data, max_ext_len=0, max_map_len=self._limits.max_map_len,
                                         max_array_len=self._limits.max_array_len)
                        self._whole_bytes += n
                        return [frame]
                    except Exception:  # noqa: BLE001 - several frames, part of one, or bad bytes: the
                        # streaming decoder below decides (and raises the error, if any); a peer
                        # that sends several frames per read is not tried again for a while
                        self._whole_skip = WHOLE_SKIP
            # Every frame that completes in ``data`` lies within it, so a ``data`` within
            # the frame bound needs no per-frame size check.
            if n <= self._limits.max_frame_bytes:
                up = self._unpacker
                try:
                    up.feed(data)
                    frames: list[Any] = []
                    append = frames.append
                    tell = up.tell
                    start = base
                    for msg in up:
                        append(msg)
                        start = tell()
                except msgpack.BufferFull:
                    raise ProtocolError("frame exceeds the maximum frame size") from None
                except (ValueError, msgpack.UnpackException, TypeError) as exc:
                    raise ProtocolError(f"malformed msgpack: {exc.__class__.__name__}: {exc}"[:200]) from None
                fed = self._fed = base + n
                self._frame_start = start
                if start != fed and self._limits.walk:
                    # a frame began in this piece and is not complete: walk what arrived of it
                    self._shape = _FrameShape(self._limits)
                    self._shape.walk(memoryview(data)[start - base:])
                return frames
        up = self._unpacker
        limits = self._limits
        if self._shape is not None or (self.shape_all and limits.walk):
            self._check_shape(data)
        fed = self._fed = base + len(data)
        start = self._frame_start
        max_frame = limits.max_frame_bytes
        try:
            up.feed(data)
            out: list[Any] = []
            # (tell() after the last complete frame: past it, it counts a partial frame's bytes too)
            for msg in up:
                end = up.tell()
                if end - start > max_frame:  # a whole frame in one read, still too big
                    raise ProtocolError(f"frame exceeds the maximum frame size ({max_frame} bytes)")
                out.append(msg)
                start = end
            self._frame_start = start
        except msgpack.BufferFull:
            raise ProtocolError("frame exceeds the maximum frame size") from None
        except (ValueError, msgpack.UnpackException, TypeError) as exc:
            # ExtraData/FormatError/StackError and exceeded max_*_len are ValueError
            # subclasses; invalid UTF-8 in a str raises UnicodeDecodeError (a ValueError).
            raise ProtocolError(f"malformed msgpack: {exc.__class__.__name__}: {exc}"[:200]) from None
        pending = fed - start
        if pending:
            if pending > max_frame:
                raise ProtocolError(f"frame exceeds the maximum frame size ({max_frame} bytes)")
            start -= base
            if self._shape is None and limits.walk and start >= 0:
                # a frame began in this piece and is not complete: walk what arrived of it
                shape = self._shape = _FrameShape(limits)
                shape.walk(memoryview(data)[start:])
        elif self._shape is not None:
            self._shape = None
        return out

    def _check_shape(self, data: bytes) -> None:
        mv = memoryview(data)
        pos = 0
        n = len(data)
        while pos < n:
            shape = self._shape
            if shape is None:
                if not self.shape_all:
                    return
                shape = self._shape = _FrameShape(self._limits)
            end = shape.walk(mv, pos)
            if end < 0:
                return
            self._shape = None
            pos = end


# -- encoders ------------------------------------------------------------------


def encode_request(req_id: int, op: int, *args: Any) -> bytes:
    return packb([req_id, op, *args])


def encode_ok(req_id: int, value: Any) -> bytes:
    return packb([req_id, STATUS_OK, value])


def encode_error(req_id: int, code: int, message: str, extra: Any = None) -> bytes:
    return packb([req_id, code, message, extra])


def encode_push(kind: str, payload: Any) -> bytes:
    return packb([0, kind, payload])
