"""The wire protocol: msgpack frames over TCP, sans-IO.

Nothing here touches a socket, a loop or a clock (the h11 pattern): a
:class:`FrameDecoder` turns received bytes into decoded messages, and the
``encode_*`` functions turn messages into bytes.  Both the server and the
client use the validators below, so a bad argument is refused by the client
before anything is sent and, should a client not check, by the server with the
same message.

Framing
-------
The stream is a plain sequence of msgpack objects (msgpack's own streaming
format, as its ``Unpacker`` reads it).  A frame beyond its
:class:`DecodeLimits` - more bytes than ``max_frame_bytes`` (a request: 64 KiB
by default), a declared str/bin/array/map length above msgpack's ``max_*_len``
limits, containers nested too deep - is a :class:`~fastlock.errors.ProtocolError`
and the connection is closed: after garbage there is no way to find the next
frame boundary.  Requests, replies and the replication stream each have their
own limits (:data:`REQUEST_LIMITS`, :data:`REPLY_LIMITS`, :func:`stream_limits`).

Messages (all positional arrays, for speed)
-------------------------------------------
request   ``[req_id, op, arg...]``   req_id: int >= 1, unique per connection while in flight
response  ``[req_id, 0, value]``      success
error     ``[req_id, code, message, extra]``  code from :mod:`fastlock.errors`
push      ``[0, kind, payload]``      server-initiated (watch events, notices)

Times on the wire are integer **milliseconds**; the Python API speaks float
seconds, like asyncio.

Operations and their arguments:

=========  ==  =====================================================  ======================
op         #   arguments                                              value
=========  ==  =====================================================  ======================
HELLO      1   version, client_name|None, secret|None[, known_epoch]  dict (session, role...)
ACQUIRE    2   name, owner, ttl_ms, wait_ms, lock_delay_ms, corr_id   [token, ttl_ms, waited_ms]
RELEASE    3   name, token, owner                                     None
EXTEND     4   name, token, owner, ttl_ms                             ttl_ms
CANCEL     5   name, owner                                            "cancelled"|"released"|None
CHECK      6   name, token                                            bool
STATUS     7   -                                                      dict
PING       8   -                                                      None
WATCH      9   name                                                   holder info|None
UNWATCH    10  name                                                   bool
HOLDER     11  name                                                   holder info|None
REPLICATE  12  from_lsn, incarnation, failover_after_ms, name         dict (see replication.py)
REPL_ACK   13  echoed_primary_ms, applied_lsn                         (no reply)
PROMOTE    14  force                                                  dict (new epoch...)
SERVE_ALONE 15 -                                                      None
STEP_DOWN  16  epoch, seen_primary_ms                                 {"role", "epoch"}
=========  ==  =====================================================  ======================

The number of arguments of every op is declared once in :data:`OP_ARITY`; the
server refuses any other count with ``ProtocolError`` before its handler runs.

holder info is ``{"token": int, "client": str|None, "correlation_id": str|None, "ttl_ms": int,
"remaining_ms": int}``.
After WATCH, every change of the lock's holder is pushed to the watching
connection, in the order the server applied them, as
``[0, "watch", [name, "granted"|"released"|"expired", token, client_name|None, correlation_id|None]]``
(client name and correlation id are the lease's, as given by the acquire that got it).
A grant is pushed when it is durable (when its holder is told), never before.

``waited_ms`` in an ACQUIRE reply is the grant's time minus the time the
server received that request, on the server's monotonic clock: 0 for an
immediate grant, the time spent in the queue for a queued one, and <= 0 for a
lease re-delivered to a retry (it was granted, or last extended, before the
retry arrived).  The client dates the grant no earlier than its own send time
plus ``waited_ms``, so it never mistakes a lease that ran out while the reply
sat unread for a live one (servers before this field sent ``[token, ttl_ms]``;
the client then assumes ``waited_ms`` = 0, which is as conservative).

Replication pushes (primary -> standby, kinds in :data:`REPLICATION_PUSH_KINDS`;
payloads described in :mod:`fastlock.replication`): ``"snap"`` a snapshot,
``"repl"`` a run of WAL frames (a live batch, or a chunk of the backlog a
standby catches up on), ``"rec"`` one record (sent by older primaries; still
applied), ``"hb"`` a heartbeat.

Roles and what a client gets from a node that is not the serving primary
(decided in one place, :mod:`fastlock.roles`; a client rides through by
trying the other addresses and repeating the request with the same owner key):

* a **standby** refuses every lock op (ACQUIRE, RELEASE, EXTEND, CANCEL, CHECK,
  HOLDER, WATCH) with ``NotPrimary`` whose extra is its primary's ``host:port``;
* a **promoting** or **deposed** node refuses them with ``NotPrimary`` and no
  primary (``None``): it does not know the new one; a node that steps down
  also closes its client connections, so queued waiters and renewers look
  for the new primary at once;
* a **fenced** primary (lost contact with its standby, which may be promoting)
  refuses ACQUIRE, EXTEND, RELEASE, CHECK, HOLDER and WATCH with
  ``Unavailable`` and changes nothing - a release it refuses is to be repeated
  at whichever node is primary, so no release is acknowledged that the new
  primary never sees; CHECK and HOLDER are refused because their answer may
  already be false on the new primary.  A CANCEL that only withdraws a queued
  waiter is served (it is local); a CANCEL that would release a grant that
  raced it is refused like a release.  Queued waiters stay queued while the
  fence may still lift; once a whole failover window has passed since the
  standby's last echo (it may have been promoted), the connections that have
  a queued acquire or a watch are closed, so those clients look for the
  primary (leases are not affected).
* HELLO's ``known_epoch`` is a hint only: it never changes a node's role.  A
  promoting standby asks its old primary to step down with STEP_DOWN, whose
  epoch must be exactly above the node's own (at most its epoch + 1, and at
  most ``MAX_EPOCH`` so that tokens stay below 2**63); any other epoch is
  refused with ``InvalidArgument`` and changes nothing.  ``seen_primary_ms``
  is the newest time of the primary's own monotonic clock the standby has
  heard (a heartbeat's, or HELLO's ``clock_ms``): the primary steps down only
  while that is at most ``STEP_DOWN_FRESH_MS`` old, so a request delayed past
  the standby's wait for the answer (a frozen primary) cannot depose it after
  the standby has given up and stayed a standby.

``wait_ms`` is -1 to wait forever, 0 to try once.  ``owner`` is a random
16-byte key the client makes per acquire; a retry of the same acquire (after a
lost reply) sends the same owner and finds its existing lease or waiter, as
ZooKeeper's lock recipe finds its own sequential node again.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import msgpack

from .errors import InvalidArgument, ProtocolError, WrongArgumentType

PROTOCOL_VERSION = 1

# operations
OP_HELLO = 1
OP_ACQUIRE = 2
OP_RELEASE = 3
OP_EXTEND = 4
OP_CANCEL = 5
OP_CHECK = 6
OP_STATUS = 7
OP_PING = 8
OP_WATCH = 9
OP_UNWATCH = 10
OP_HOLDER = 11
OP_REPLICATE = 12
OP_REPL_ACK = 13
OP_PROMOTE = 14
OP_SERVE_ALONE = 15
OP_STEP_DOWN = 16

#: (fewest, most) arguments of each op, after ``[req_id, op]``
OP_ARITY: dict[int, tuple[int, int]] = {
    OP_HELLO: (3, 4),
    OP_ACQUIRE: (6, 6),
    OP_RELEASE: (3, 3),
    OP_EXTEND: (4, 4),
    OP_CANCEL: (2, 2),
    OP_CHECK: (2, 2),
    OP_STATUS: (0, 0),
    OP_PING: (0, 0),
    OP_WATCH: (1, 1),
    OP_UNWATCH: (1, 1),
    OP_HOLDER: (1, 1),
    OP_REPLICATE: (4, 4),
    OP_REPL_ACK: (2, 2),
    OP_PROMOTE: (1, 1),
    OP_SERVE_ALONE: (0, 0),
    OP_STEP_DOWN: (2, 2),
}

# push kinds
PUSH_WATCH = "watch"
PUSH_SNAPSHOT = "snap"  # replication: [lsn, epoch, counter, holders, incarnation]
PUSH_RECORDS = "repl"  # replication: [first_lsn, last_lsn, frames] (a WAL batch's or a backlog chunk's bytes)
PUSH_RECORD = "rec"  # replication: [lsn, record] (one record: older primaries' backlog; still applied)
PUSH_HEARTBEAT = "hb"  # replication: [primary_ms, last_lsn, epoch, longest_ttl_ms, paired_id, paired_window_ms]
#: a STEP_DOWN is honoured only this long (ms, primary's clock) after the primary time it echoes;
#: the standby waits a little longer than this for the answer
STEP_DOWN_FRESH_MS = 1500

REPLICATION_PUSH_KINDS = frozenset({PUSH_SNAPSHOT, PUSH_RECORDS, PUSH_RECORD, PUSH_HEARTBEAT})

OP_NAMES = {
    OP_HELLO: "hello",
    OP_ACQUIRE: "acquire",
    OP_RELEASE: "release",
    OP_EXTEND: "extend",
    OP_CANCEL: "cancel",
    OP_CHECK: "check",
    OP_STATUS: "status",
    OP_PING: "ping",
    OP_WATCH: "watch",
    OP_UNWATCH: "unwatch",
    OP_HOLDER: "holder",
    OP_REPLICATE: "replicate",
    OP_REPL_ACK: "repl_ack",
    OP_PROMOTE: "promote",
    OP_SERVE_ALONE: "serve_alone",
    OP_STEP_DOWN: "step_down",
}

STATUS_OK = 0

#: the highest epoch: a fencing token is ``epoch << 40 | counter`` and must stay below 2**63
#: (equal to ``fastlock._core.MAX_EPOCH``; a test checks they agree)
MAX_EPOCH = (1 << 23) - 1

# limits (units in the names)
DEFAULT_MAX_FRAME_BYTES = 64 << 10  # a request; replies and the replication stream have their own
MIN_MAX_FRAME_BYTES = 4096  # holds every request with its names, keys and ids at their limits
MAX_NAME_BYTES = 512
MIN_TTL_MS = 1
MAX_TTL_MS = 24 * 3600 * 1000
MAX_WAIT_MS = 24 * 3600 * 1000
MAX_LOCK_DELAY_MS = 60_000
MAX_OWNER_BYTES = 64
MAX_CORRELATION_ID_CHARS = 256
MAX_CLIENT_NAME_CHARS = 128

_packer = msgpack.Packer(use_bin_type=True, autoreset=True)
packb = _packer.pack


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
#: for credentials and options (a small map or list inside the request).
REQUEST_LIMITS = DecodeLimits(
    max_frame_bytes=DEFAULT_MAX_FRAME_BYTES,
    max_array_len=32,
    max_map_len=16,
    max_str_len=8192,
    max_bin_len=8192,
    max_depth=3,
    max_items=256,
)


#: What a client accepts from a server: replies are small, STATUS is a map of a
#: few dozen entries; a server is trusted more than a client, not blindly.
REPLY_LIMITS = DecodeLimits(
    max_frame_bytes=64 << 20,
    max_array_len=1 << 16,
    max_map_len=1024,
    max_str_len=1 << 20,
    max_bin_len=1 << 20,
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

    def walk(self, data, pos: int = 0) -> int:
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
                hdr, hpos = head, 0
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

    __slots__ = ("_unpacker", "_limits", "_fed", "_frame_start", "_shape", "shape_all")

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

    @property
    def limits(self) -> DecodeLimits:
        return self._limits

    def feed(self, data: bytes) -> list[Any]:
        """Add received bytes; return every message now complete (maybe none).

        Raises ProtocolError on malformed msgpack or a frame beyond the limits.
        """
        up = self._unpacker
        limits = self._limits
        base = self._fed
        if self._shape is not None or (self.shape_all and limits.walk):
            self._check_shape(data)
        try:
            up.feed(data)
            self._fed = base + len(data)
            out = []
            append = out.append
            start = self._frame_start
            max_frame = limits.max_frame_bytes
            for msg in up:
                end = up.tell()
                if end - start > max_frame:  # a whole frame in one read, still too big
                    raise ProtocolError(f"frame exceeds the maximum frame size ({max_frame} bytes)")
                append(msg)
                start = end
            self._frame_start = start
        except msgpack.BufferFull:
            raise ProtocolError("frame exceeds the maximum frame size") from None
        except (ValueError, msgpack.UnpackException, TypeError) as exc:
            # ExtraData/FormatError/StackError and exceeded max_*_len are ValueError
            # subclasses; invalid UTF-8 in a str raises UnicodeDecodeError (a ValueError).
            raise ProtocolError(f"malformed msgpack: {exc.__class__.__name__}: {exc}"[:200]) from None
        pending = self._fed - self._frame_start
        if pending:
            if pending > limits.max_frame_bytes:
                raise ProtocolError(f"frame exceeds the maximum frame size ({limits.max_frame_bytes} bytes)")
            start = self._frame_start - base
            if self._shape is None and limits.walk and start >= 0:
                # a frame began in this piece and is not complete: walk what arrived of it
                shape = self._shape = _FrameShape(limits)
                shape.walk(memoryview(data)[start:])
        else:
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


# -- validators: shared by client (InvalidArgument before sending) and server ---


def _is_int(v: Any) -> bool:
    return type(v) is int  # bool is refused on purpose


def check_name(name: Any) -> str:
    """A lock name: non-empty str, at most 512 bytes of UTF-8, no NUL."""
    if type(name) is not str:
        raise WrongArgumentType(f"lock name must be str, not {type(name).__name__}")
    if not name:
        raise InvalidArgument("lock name must not be empty")
    try:
        n = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument("lock name must be valid UTF-8 (no lone surrogates)") from None
    if n > MAX_NAME_BYTES:
        raise InvalidArgument(f"lock name is {n} bytes of UTF-8; the limit is {MAX_NAME_BYTES}")
    if "\x00" in name:
        raise InvalidArgument("lock name must not contain NUL")
    return name


def check_ttl_ms(ttl_ms: Any) -> int:
    if not _is_int(ttl_ms):
        raise WrongArgumentType(f"ttl must be an integer number of milliseconds, not {type(ttl_ms).__name__}")
    if not MIN_TTL_MS <= ttl_ms <= MAX_TTL_MS:
        raise InvalidArgument(f"ttl must be between {MIN_TTL_MS} ms and {MAX_TTL_MS} ms (24 h), got {ttl_ms} ms")
    return ttl_ms


def check_wait_ms(wait_ms: Any) -> int:
    if not _is_int(wait_ms):
        raise WrongArgumentType(f"wait must be an integer number of milliseconds, not {type(wait_ms).__name__}")
    if not (wait_ms == -1 or 0 <= wait_ms <= MAX_WAIT_MS):
        raise InvalidArgument(f"wait must be -1 (forever) or 0..{MAX_WAIT_MS} ms, got {wait_ms}")
    return wait_ms


def check_lock_delay_ms(delay_ms: Any) -> int:
    if not _is_int(delay_ms):
        raise WrongArgumentType(f"lock_delay must be an integer number of milliseconds, not {type(delay_ms).__name__}")
    if not 0 <= delay_ms <= MAX_LOCK_DELAY_MS:
        raise InvalidArgument(f"lock_delay must be 0..{MAX_LOCK_DELAY_MS} ms, got {delay_ms}")
    return delay_ms


def check_owner(owner: Any) -> bytes:
    if type(owner) is not bytes:
        raise WrongArgumentType(f"owner key must be bytes, not {type(owner).__name__}")
    if not 1 <= len(owner) <= MAX_OWNER_BYTES:
        raise InvalidArgument(f"owner key must be 1..{MAX_OWNER_BYTES} bytes")
    return owner


def check_token(token: Any) -> int:
    if not _is_int(token):
        raise WrongArgumentType(f"fencing token must be int, not {type(token).__name__}")
    if not 0 < token < (1 << 63):
        raise InvalidArgument("fencing token out of range (1 .. 2**63-1)")
    return token


def check_epoch(epoch: Any, what: str = "epoch") -> int:
    """An epoch from the wire: an int in 0..MAX_EPOCH (so its tokens stay below 2**63)."""
    if not _is_int(epoch):
        raise WrongArgumentType(f"{what} must be int, not {type(epoch).__name__}")
    if not 0 <= epoch <= MAX_EPOCH:
        raise InvalidArgument(f"{what} {epoch} out of range (0 .. {MAX_EPOCH}: tokens must stay below 2**63)")
    return epoch


def check_optional_str(value: Any, what: str, limit: int) -> str | None:
    if value is None:
        return None
    if type(value) is not str:
        raise WrongArgumentType(f"{what} must be str or None, not {type(value).__name__}")
    if len(value) > limit:
        raise InvalidArgument(f"{what} is longer than {limit} characters")
    return value


def seconds_to_ms(value: Any, what: str, *, allow_none: bool = False, allow_zero: bool = False) -> int:
    """Convert a float/int number of seconds from the Python API to wire milliseconds.

    ``None`` becomes -1 (forever) when ``allow_none``.  NaN, infinities, bools,
    negatives and (unless ``allow_zero``) zero raise InvalidArgument; a
    positive value below 1 ms rounds up to 1 ms rather than to 0.
    """
    if value is None:
        if allow_none:
            return -1
        raise WrongArgumentType(f"{what} must be a number of seconds, not None")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WrongArgumentType(f"{what} must be a number of seconds, not {type(value).__name__}")
    if math.isnan(value) or math.isinf(value):
        raise InvalidArgument(f"{what} must be finite, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InvalidArgument(f"{what} must be {'>= 0' if allow_zero else '> 0'} seconds, got {value!r}")
    if value == 0:
        return 0
    return max(1, math.ceil(value * 1000))
