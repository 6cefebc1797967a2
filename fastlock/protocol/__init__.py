"""The wire protocol: msgpack frames over TCP.

The package holds the protocol's parts, each readable alone:

- :mod:`fastlock.protocol.ops` - op codes, the arity of every op, push kinds;
- :mod:`fastlock.protocol.framing` - :class:`FrameDecoder`, :class:`DecodeLimits`,
  the ``encode_*`` functions (sans-IO, the h11 pattern: no socket, loop or clock);
- :mod:`fastlock.protocol.validation` - the argument validators the client
  and the server share, so a bad argument is refused by the client before
  anything is sent and, should a client not check, by the server with the
  same message;
- :mod:`fastlock.protocol.rpc` - :class:`RpcConnection`, the request/reply
  layer under every party that sends requests to a server;
- ``fastlock.protocol._wire`` (compiled) - ``RpcConnection``'s base, :class:`WireDecoder`
  (:class:`FrameDecoder` compiled: the same frames and errors; both sides decode with it) and
  :func:`feed_frames` (``feed`` of either).

This module re-exports their public names (``from fastlock import protocol as
P``; ``P.OP_ACQUIRE``, ``P.check_name``...) and describes the protocol.

Framing
-------
The stream is a plain sequence of msgpack objects (msgpack's own streaming
format, as its ``Unpacker`` reads it).  A frame beyond its
:class:`DecodeLimits` - more bytes than ``max_frame_bytes`` (a request: 64 KiB
by default), a declared str/bin/array/map length above msgpack's ``max_*_len``
limits, containers nested too deep - is a :class:`~fastlock.errors.ProtocolError`
and the connection is closed: after garbage there is no way to find the next
frame boundary.  Requests, replies and the replication stream each have their
own limits (:func:`request_limits` - :data:`REQUEST_LIMITS` sized to the
server's ``--max-frame-bytes`` and ``--max-value-bytes`` -, :data:`REPLY_LIMITS`,
:func:`stream_limits`).

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
HELLO      1   version, client_name|None, credential[, known_epoch]   challenge, or dict (session, role, principal...)
ACQUIRE    2   name, owner, ttl_ms, wait_ms, lock_delay_ms, corr_id   [token, ttl_ms, waited_ms
               [, shared[, limit[, actor[, sequencer]]]]              [, {"sequencer": bytes}]]
RELEASE    3   name, token, owner                                     None
EXTEND     4   name, token, owner, ttl_ms[, sequencer]                ttl_ms; with sequencer true:
                                                                      [ttl_ms, {"sequencer": bytes}]
CANCEL     5   name, owner                                            "cancelled"|"released"|None
CHECK      6   name, token                                            bool
STATUS     7   -                                                      dict
PING       8   -                                                      None
WATCH      9   name                                                   holder info|None
UNWATCH    10  name                                                   bool
HOLDER     11  name                                                   holder info|None
REPLICATE  12  from_lsn, incarnation, failover_after_ms, name[, addr[, witness]] dict (see replication.py)
REPL_ACK   13  echoed_primary_ms, applied_lsn                         (no reply)
PROMOTE    14  force                                                  dict (new epoch...)
SERVE_ALONE 15 -                                                      None
STEP_DOWN  16  epoch, seen_primary_ms                                 {"role", "epoch"}
LOCKS      20  prefix, most|None[, after, order]                      {"locks", "matched", "truncated", "next"}
LOCK_INFO  21  name                                                   {"name", "holders", "waiters", ...}
REVOKE     22  name, token|None, reason|None                          {"name", "revoked"}
ACQUIRE_MANY 30 [[name, shared], ...], owner, ttl_ms, wait_ms,        [[token, ...], ttl_ms, waited_ms
               lock_delay_ms, corr_id[, actor[, sequencer]]           [, {"sequencers": [bytes, ...]}]]
CONTENDERS 31  name[, cursor]                                         {"holders", "waiters", "cursor"}
SYNC_ACK   50  lsn (the primary's, at the sync ack point)             (no reply)
RATE_LIMIT 80  name, rate, period_ms, burst, cost                     [admitted, retry_after_ms, remaining]
ACQUIRE_PRIORITY 90 ACQUIRE's 9 arguments, priority (0..99)[, seq.]   as ACQUIRE
REQUEST_REVOKE 91 name, owner (of a waiting request), grace_ms        {"token", "deadline_ms", "delivered"}
TRANSFER   92  name, token, owner, candidate (a correlation id)       None
WATCH_FROM 70  name, revision|None                                    {"holder", "revision"}
SHARD_MAP  100 -                                                      {"group", "map"}|None
RESERVE   120  [name, ...], owner, ttl_ms, wait_ms, corr_id,         as ACQUIRE_MANY
               stamp_ms, multi_id
COMMIT_RESERVATION 121 multi_id                                       None
WAIT_IDENTITY 122 secret (16-64 bytes)                                 wait id (16 bytes)
WAITS_FOR 123  wait_id, actor, hops                                   {"since_ms", "for"}
SLOT_EXPORT 101 first, last, after ([name, token]|None)               {"leases", "queues", "delays", "floor", "more"}
SLOT_IMPORT 102 first, last, state (a SLOT_EXPORT page)               {"leases", "queues", "delays"}
SHARD_MAP_NOTICE 103 epoch (read the shard map in etcd now)           {"epoch"}
SLOT_ADOPT 108 first, last, floor (a fencing token)                   {"epoch", "adopted"}
=========  ==  =====================================================  ======================

ACQUIRE's optional ``shared`` (bool: a shared lease) and ``limit`` (int: the
name is a counting semaphore with at most ``limit`` holders; 0: a lock) are
sent only when set, so a request for an exclusive lock is the 6-argument one
every fastlock server reads.  The optional ``actor`` of ACQUIRE and ACQUIRE_MANY
(int 0..2**63-1: who waits within the session, a client's task or thread; 0 or
absent: the session as a whole) only tells deadlock detection's parties apart
(see :class:`~fastlock.errors.DeadlockDetected`); a server that reads it says
``"actors": True`` in its HELLO reply, and a client sends it only to such a
server.  ACQUIRE's optional ``sequencer`` (bool) asks for a signed sequencer
(:mod:`fastlock.sequencer`) in the reply's fourth element, ``{"sequencer": bytes}``;
a server with a signing key says ``"sequencers": True`` in its HELLO reply, and one
without refuses the flag with InvalidArgument.  ACQUIRE_MANY's ``sequencer`` asks the
same for every name: ``{"sequencers": [...]}``, in the tokens' order.  ACQUIRE_MANY
takes up to 64 distinct names atomically: all are granted together (one token
per name, in request order, one lease per name, all with ``owner``) or none;
while it waits it holds none of them.  CONTENDERS lists a lock's holders (token, shared, limit, principal,
client, correlation_id, remaining_ms) and its waiters in FIFO order (shared,
limit, principal, client, correlation_id, many, priority), as kazoo's ``contenders()``.
RATE_LIMIT takes ``cost`` from the rate limiter ``name`` (``rate`` per ``period_ms``,
``burst`` at once; :mod:`fastlock.server.ratelimit`), or says when it could.
ACQUIRE_PRIORITY queues ahead of every waiter of a lower priority (FIFO within one);
REQUEST_REVOKE asks the exclusive holder to yield within ``grace_ms`` (pushed to it as
``[0, "revoke_req", [name, token, principal, client, grace_ms]]``; revoked by the server
at the deadline); TRANSFER releases to the waiter whose correlation id is ``candidate``
in one step (:mod:`fastlock.server.preemption`).
RESERVE takes this shard's part of a cross-shard multi-lock as ACQUIRE_MANY does (exclusive
names only), tagged with the multi-lock's age stamp (the client's wall clock, ms: at most
``MAX_STAMP_SKEW_MS`` ahead and ``MAX_STAMP_AGE_MS`` behind the server's) and id (1-32 bytes);
an older reservation wounds a younger uncommitted one (its leases revoked, its waiting request
answered Wounded, its connection told ``[0, "wounded", [multi_id, stamp, wounder's stamp]]``);
COMMIT_RESERVATION makes the connection's held reservation of that id ordinary leases
(:mod:`fastlock.server.woundwait`).
WAIT_IDENTITY and WAITS_FOR carry deadlock detection across shards: a connection's wait id
(a hash of its secret) and, for a party ``(wait id, actor)``, when its wait here began and
the parties it waits for here (:mod:`fastlock.server.edgechase`).

Lists are paged by bytes: a reply of CONTENDERS, LOCKS or KEY_LIST (key store, ops
40-45: :mod:`fastlock.server.keys`) carries at most about ``MAX_PAGE_BYTES`` (64 KiB,
:mod:`fastlock.protocol.ops`; one row alone always goes) and a cursor to the next page:
CONTENDERS' ``cursor`` (``[part, position]``, None on the last page) goes back as its
second argument, LOCKS' ``next`` as ``after``, KEY_LIST's ``cursor`` (the page's last
key) as its third argument ``after``.  A cursor is checked like any argument and names
a position, never state the server keeps.  A key change reaches a connection once
however many of its key watches match (KEY_WATCH replies ``{"once": True}``).

Work per connection is bounded per loop turn: a read is decoded a piece at a time and
its requests are dispatched at most 64 (or about 1 ms, less when many connections
pipeline) per turn, in order, with reading paused until they are done
(:mod:`fastlock.server.session`), so a pipelining connection never holds the others.

The number of arguments of every op is declared once, in :data:`OPS` (and so
:data:`OP_ARITY`); the server refuses any other count with ``ProtocolError``
before its handler runs.

holder info is ``{"token": int, "principal": str|None, "client": str|None, "correlation_id": str|None,
"ttl_ms": int, "remaining_ms": int}`` (``principal``: who acquired the lease, authenticated;
``client``: the name it declared in HELLO, not verified).
After WATCH, every change of the lock's holder is pushed to the watching
connection, in the order the server applied them, as
``[0, "watch", [name, "granted"|"released"|"expired"|"revoked", token, client_name|None, correlation_id|None,
principal|None]]``
(client name and correlation id are the lease's, as given by the acquire that got it).
LOCKS, LOCK_INFO and REVOKE are the operator's (admins only, or anyone in open mode): see
:mod:`fastlock.server.lockadmin`; "revoked" is pushed when an operator revokes the lease.
A grant is pushed when it is durable (when its holder is told), never before.
WATCH_FROM is WATCH with revisions (:mod:`fastlock.server.watchlog`): its connection
hears each change as ``[0, "wrev", [the six fields above..., revision]]`` once the
change is committed (durable, and under synchronous replication on the standby);
given a revision, the committed changes of the lock after it are pushed first, then
the reply, whose ``revision`` says every change up to it was sent; too old a
revision is refused with ``Compacted`` (extra: the oldest revision kept), one the
node never had with ``WatchDiverged``.  Such a connection also hears
``[0, "wprog", [revision]]`` at least every ``--watch-progress-interval`` seconds.
SHARD_MAP returns a sharded node's map and group (:mod:`fastlock.sharding`), None from a
node that is not sharded; a sharded node refuses a name another group owns with
``WrongShard`` (extra: ``{"slot", "group", "addresses", "epoch"}``) and names that span
groups with ``CrossShard`` (extra: ``{"groups", "epoch"}``): :mod:`fastlock.server.sharded`.

HELLO's ``credential`` is None (a verified mTLS certificate's identity, or the
anonymous principal: one round trip) or a handshake message: first
``{"principal", "nonce", "role", "node", "from"}``, answered with
``{"challenge": {"nonce", "node"}}`` (the connection stays unauthenticated), then
``{"proof"}``, answered with the HELLO reply plus ``"server_proof"``, which the
client checks before anything else (:mod:`fastlock.auth.handshake`).  A token
is never sent: a str credential is refused (``AuthError``), as is protocol
version 1 (``ProtocolError``).  Operations the
principal is not granted get ``PermissionDenied``; a failed HELLO gets
``AuthError`` and the connection is closed.

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
applied), ``"hb"`` a heartbeat.  Beside them, ``"queues"`` carries the primary's
waiter queues (owner-key hashes in FIFO order: :mod:`fastlock.replication.queues`),
which a promoted standby keeps in place for its reclaim window; an older standby
ignores it.

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
ZooKeeper's lock recipe finds its own sequential node again.  The owner key is
also the proof of ownership (for CANCEL of a held lease): the server keeps
only its hash, never sends it to anyone, and hashes whatever it receives.
"""

from ._wire import WireDecoder, feed_frames
from .framing import (
    DEFAULT_MAX_FRAME_BYTES,
    MIN_MAX_FRAME_BYTES,
    REPLY_LIMITS,
    REQUEST_LIMITS,
    REQUEST_OVERHEAD_BYTES,
    DecodeLimits,
    FrameDecoder,
    encode_error,
    encode_ok,
    encode_push,
    encode_request,
    packb,
    request_limits,
    stream_limits,
)
from .ops import (
    MAX_EPOCH,
    OP_ACQUIRE,
    OP_ACQUIRE_MANY,
    OP_ARITY,
    OP_CANCEL,
    OP_CHECK,
    OP_CONTENDERS,
    OP_EXTEND,
    OP_HELLO,
    OP_HOLDER,
    OP_LOCK_INFO,
    OP_LOCKS,
    OP_NAMES,
    OP_PING,
    OP_PROMOTE,
    OP_RELEASE,
    OP_REPL_ACK,
    OP_REPLICATE,
    OP_REVOKE,
    OP_SERVE_ALONE,
    OP_SESSION_ATTACH,
    OP_SESSION_CLOSE,
    OP_SESSION_KEEPALIVE,
    OP_SESSION_OPEN,
    OP_SESSION_REVOKE,
    OP_SESSIONS,
    OP_STATUS,
    OP_STEP_DOWN,
    OP_SYNC_ACK,
    OP_UNWATCH,
    OP_WATCH,
    OPS,
    PROTOCOL_VERSION,
    PUSH_HEARTBEAT,
    PUSH_RECORD,
    PUSH_RECORDS,
    PUSH_SNAPSHOT,
    PUSH_SYNC,
    PUSH_WATCH,
    REPLICATION_PUSH_KINDS,
    STATUS_OK,
    STEP_DOWN_FRESH_MS,
    WATCH_REVOKED,
    Op,
)
from .validation import (
    MAX_ACTOR,
    MAX_CLIENT_NAME_CHARS,
    MAX_CORRELATION_ID_CHARS,
    MAX_LIMIT,
    MAX_LOCK_DELAY_MS,
    MAX_MANY,
    MAX_NAME_BYTES,
    MAX_OWNER_BYTES,
    MAX_RECORDED_TTL_MS,
    MAX_TTL_MS,
    MAX_WAIT_MS,
    MIN_TTL_MS,
    check_actor,
    check_bytes,
    check_epoch,
    check_limit,
    check_lock_delay_ms,
    check_many_items,
    check_name,
    check_optional_str,
    check_owner,
    check_recorded_ttl_ms,
    check_shared,
    check_token,
    check_ttl_ms,
    check_wait_ms,
    seconds_to_ms,
)

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES", "MAX_CLIENT_NAME_CHARS", "MAX_CORRELATION_ID_CHARS", "MAX_EPOCH",
    "MAX_LOCK_DELAY_MS", "MAX_NAME_BYTES", "MAX_OWNER_BYTES", "MAX_TTL_MS", "MAX_WAIT_MS",
    "MIN_MAX_FRAME_BYTES", "MIN_TTL_MS", "OPS", "OP_ACQUIRE", "OP_ACQUIRE_MANY", "OP_ARITY", "OP_CONTENDERS",
    "MAX_ACTOR", "MAX_LIMIT", "MAX_MANY", "check_actor", "check_limit", "check_many_items", "check_shared",
    "OP_CANCEL", "OP_CHECK",
    "OP_EXTEND", "OP_HELLO", "OP_HOLDER", "OP_LOCKS", "OP_LOCK_INFO", "OP_NAMES", "OP_PING", "OP_PROMOTE", "OP_RELEASE",
    "OP_REPLICATE", "OP_REPL_ACK", "OP_REVOKE", "OP_SERVE_ALONE", "OP_STATUS", "OP_STEP_DOWN", "OP_UNWATCH",
    "OP_WATCH", "PROTOCOL_VERSION", "PUSH_HEARTBEAT", "PUSH_RECORD", "PUSH_RECORDS", "PUSH_SNAPSHOT",
    "PUSH_WATCH", "REPLICATION_PUSH_KINDS", "REPLY_LIMITS", "REQUEST_LIMITS", "REQUEST_OVERHEAD_BYTES", "STATUS_OK",
    "STEP_DOWN_FRESH_MS", "WATCH_REVOKED", "DecodeLimits", "FrameDecoder", "Op", "check_epoch", "check_lock_delay_ms",
    "check_name", "check_optional_str", "check_owner", "check_token", "check_ttl_ms", "check_wait_ms",
    "encode_error", "encode_ok", "encode_push", "encode_request", "packb", "seconds_to_ms",
    "request_limits", "stream_limits", "OP_SYNC_ACK", "PUSH_SYNC", "MAX_RECORDED_TTL_MS", "check_recorded_ttl_ms",
    "OP_SESSION_OPEN", "OP_SESSION_ATTACH", "OP_SESSION_KEEPALIVE", "OP_SESSION_CLOSE", "OP_SESSIONS",
    "OP_SESSION_REVOKE", "check_bytes", "feed_frames", "WireDecoder",
]
