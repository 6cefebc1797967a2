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
format, as its ``Unpacker`` reads it).  A frame larger than ``max_frame``
bytes (default 1 MiB) - or a declared string/array length that would need
more - is a :class:`~fastlock.errors.ProtocolError` and the connection is
closed: after garbage there is no way to find the next frame boundary.

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
``"repl"`` a batch of WAL frames, ``"rec"`` one backlog record, ``"hb"`` a heartbeat.

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
from typing import Any

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
PUSH_RECORDS = "repl"  # replication: [first_lsn, last_lsn, frames] (a WAL batch's bytes)
PUSH_RECORD = "rec"  # replication: [lsn, record] (one record of a backlog read from the log)
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
DEFAULT_MAX_FRAME_BYTES = 1 << 20
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


class FrameDecoder:
    """Incremental decoder: ``feed(data)`` then iterate to get whole messages.

    ``max_frame`` (bytes, default 1 MiB) bounds the buffered, not yet decoded
    data; exceeding it raises :class:`ProtocolError`.  A byte sequence that is
    not msgpack raises :class:`ProtocolError` too.  After either, the decoder is
    unusable and the connection must be closed.
    """

    __slots__ = ("_unpacker",)

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME_BYTES):
        self._unpacker = msgpack.Unpacker(
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_buffer_size=max_frame,
        )

    def feed(self, data: bytes) -> list[Any]:
        """Add received bytes; return every message now complete (maybe none).

        Raises ProtocolError on malformed msgpack or an oversized frame.
        """
        up = self._unpacker
        try:
            up.feed(data)
            return list(up)
        except msgpack.BufferFull:
            raise ProtocolError("frame exceeds the maximum frame size") from None
        except (ValueError, msgpack.UnpackException, TypeError) as exc:
            # ExtraData/FormatError/StackError are ValueError subclasses;
            # invalid UTF-8 in a str raises UnicodeDecodeError (a ValueError).
            raise ProtocolError(f"malformed msgpack: {exc.__class__.__name__}") from None


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
