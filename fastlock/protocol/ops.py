"""The protocol's vocabulary: op codes, the arity of every op, push kinds.

Each op is declared once, in :data:`OPS` (code, name, fewest and most
arguments); :data:`OP_ARITY` and :data:`OP_NAMES` are derived from it.  Error
codes are registered once, on their exception classes in
:mod:`fastlock.errors` (:func:`fastlock.errors.error_from_wire` maps a code
back); a reply's status is :data:`STATUS_OK` or one of them.  The messages and
the meaning of every argument are described in :mod:`fastlock.protocol`.
"""

from __future__ import annotations

from typing import NamedTuple

from .. import tokens

PROTOCOL_VERSION = 2  # 2: tokens are proved, never sent (fastlock.auth.handshake)

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
OP_LOCKS = 20
OP_LOCK_INFO = 21
OP_REVOKE = 22

# the key/value store (fastlock.server.keys): small values, optionally attached to a lease
OP_KEY_PUT = 40  # key, value, lease name or None, token, owner key, mode (KEY_UPSERT/KEY_CREATE/KEY_REPLACE)
OP_KEY_GET = 41  # key
OP_KEY_LIST = 42  # prefix, limit[, after]
OP_KEY_DELETE = 43  # key
OP_KEY_WATCH = 44  # prefix
OP_KEY_UNWATCH = 45  # prefix

#: OP_KEY_PUT modes: write whatever is there, only create, only replace
KEY_UPSERT = 0
KEY_CREATE = 1
KEY_REPLACE = 2
OP_ACQUIRE_MANY = 30
OP_CONTENDERS = 31
OP_SYNC_ACK = 50  # synchronous replication (ops 50-54 are reserved for it)
OP_RATE_LIMIT = 80  # name, rate, period_ms, burst, cost (recipes: ops 80-89)
# priorities, cooperative preemption and directed hand-off (fastlock.server.preemption)
OP_ACQUIRE_PRIORITY = 90  # the 9 ACQUIRE arguments (shared, limit, actor given), priority[, sequencer]
OP_REQUEST_REVOKE = 91  # name, owner key of the caller's waiting request, grace_ms
OP_TRANSFER = 92  # name, token, owner key, candidate (the waiter's correlation id)
OP_WATCH_FROM = 70  # name, revision to resume after (None: a new watch) - fastlock.server.watchlog
OP_KEY_WATCH_FROM = 71  # prefix, revision, offset to resume after (None, None: a new watch) - server.keyrevisions
# client sessions (fastlock.server.sessions; ops 60-69 are reserved for them)
OP_SESSION_OPEN = 60  # session key, ttl_ms
OP_SESSION_ATTACH = 61  # session key, [[name, token, owner key[, sequencer]]...], [[name, token]...] (detach)
OP_SESSION_KEEPALIVE = 62  # session key
OP_SESSION_CLOSE = 63  # session key
OP_SESSIONS = 64  # principal or None (an operator's list)
OP_SESSION_REVOKE = 65  # session id, reason or None (an operator's close)
# sharding (fastlock.sharding; ops 100-119 are reserved for it)
OP_SHARD_MAP = 100  # no arguments: the shard map this node serves by (None: not sharded)
OP_SLOT_EXPORT = 101  # first, last, after (None or [name, token]): a page of a moving slot range's state
OP_SLOT_IMPORT = 102  # first, last, state (a page of SLOT_EXPORT's): the destination adopts it
OP_SHARD_MAP_NOTICE = 103  # epoch: read the shard map in etcd now (a move's driver; fastlock.server.mapnotice)
OP_SLOT_ADOPT = 108  # first, last, floor (a fencing token): the owner adopts the slots' token floor (shard adopt)
# cross-shard multi-locks, wound-wait (fastlock.server.woundwait; ops 120-129 are reserved for them)
OP_RESERVE = 120  # [name, ...], owner, ttl_ms, wait_ms, corr_id, age stamp (wall ms), multi-lock id
OP_COMMIT_RESERVATION = 121  # multi-lock id
# deadlock detection across shards, edge chasing (fastlock.server.edgechase)
OP_WAIT_IDENTITY = 122  # secret (16-64 bytes): this connection's wait id
OP_WAITS_FOR = 123  # wait id, actor, hops: what that party waits for here
#: ms: how far ahead of a server's wall clock a RESERVE's age stamp may be (clock skew between hosts)
MAX_STAMP_SKEW_MS = 1_000
#: ms: how far behind a server's wall clock a RESERVE's age stamp may be (the most seniority a multi-lock claims)
MAX_STAMP_AGE_MS = 60_000


class Op(NamedTuple):
    """One operation: its wire code, its name (in logs, metrics and ACLs) and
    the fewest and most arguments it takes after ``[req_id, op]``."""

    code: int
    name: str
    min_args: int
    max_args: int


#: every operation of the protocol, by code
OPS: tuple[Op, ...] = (
    Op(OP_HELLO, "hello", 3, 4),
    Op(OP_ACQUIRE, "acquire", 6, 10),  # [, shared[, limit[, actor[, sequencer]]]]
    Op(OP_RELEASE, "release", 3, 3),
    Op(OP_EXTEND, "extend", 4, 5),
    Op(OP_CANCEL, "cancel", 2, 2),
    Op(OP_CHECK, "check", 2, 2),
    Op(OP_STATUS, "status", 0, 0),
    Op(OP_PING, "ping", 0, 0),
    Op(OP_WATCH, "watch", 1, 1),
    Op(OP_UNWATCH, "unwatch", 1, 1),
    Op(OP_HOLDER, "holder", 1, 1),
    Op(OP_REPLICATE, "replicate", 4, 6),
    Op(OP_REPL_ACK, "repl_ack", 2, 2),
    Op(OP_PROMOTE, "promote", 1, 1),
    Op(OP_SERVE_ALONE, "serve_alone", 0, 0),
    Op(OP_STEP_DOWN, "step_down", 2, 2),
    Op(OP_KEY_PUT, "key_put", 6, 6),
    Op(OP_KEY_GET, "key_get", 1, 1),
    Op(OP_KEY_LIST, "key_list", 2, 3),  # prefix, limit[, after (the cursor of the previous page)]
    Op(OP_KEY_DELETE, "key_delete", 1, 1),
    Op(OP_KEY_WATCH, "key_watch", 1, 1),
    Op(OP_KEY_UNWATCH, "key_unwatch", 1, 1),
    Op(OP_LOCKS, "locks", 2, 4),  # prefix, most entries (None: the server's limit)[, after, order]
    Op(OP_LOCK_INFO, "lock_info", 1, 1),  # name
    Op(OP_REVOKE, "revoke", 3, 4),  # name, token (None: every holder), reason (None or text)[, principal]
    Op(OP_ACQUIRE_MANY, "acquire_many", 6, 8),  # [, actor[, sequencer]]
    Op(OP_CONTENDERS, "contenders", 1, 2),  # name[, cursor (the previous page's)]
    Op(OP_SYNC_ACK, "sync_ack", 1, 1),  # standby -> primary: primary LSN at the sync ack point
    Op(OP_RATE_LIMIT, "rate_limit", 5, 5),  # name, rate, period_ms, burst, cost
    Op(OP_ACQUIRE_PRIORITY, "acquire_priority", 10, 11),
    Op(OP_REQUEST_REVOKE, "request_revoke", 3, 3),
    Op(OP_TRANSFER, "transfer", 4, 4),
    Op(OP_WATCH_FROM, "watch_from", 2, 2),  # name, revision or None
    Op(OP_SESSION_OPEN, "session_open", 2, 2),
    Op(OP_SESSION_ATTACH, "session_attach", 3, 3),
    Op(OP_SESSION_KEEPALIVE, "session_keepalive", 1, 1),
    Op(OP_SESSION_CLOSE, "session_close", 1, 1),
    Op(OP_SESSIONS, "sessions", 1, 1),
    Op(OP_SESSION_REVOKE, "session_revoke", 2, 2),
    Op(OP_KEY_WATCH_FROM, "key_watch_from", 3, 3),  # prefix, revision or None, offset or None
    Op(OP_SHARD_MAP, "shard_map", 0, 0),
    Op(OP_RESERVE, "reserve", 7, 7),
    Op(OP_COMMIT_RESERVATION, "commit_reservation", 1, 1),
    Op(OP_WAIT_IDENTITY, "wait_identity", 1, 1),
    Op(OP_WAITS_FOR, "waits_for", 3, 3),
    Op(OP_SLOT_EXPORT, "slot_export", 3, 3),  # fastlock.server.slotmove
    Op(OP_SLOT_IMPORT, "slot_import", 3, 3),
    Op(OP_SLOT_ADOPT, "slot_adopt", 3, 3),
    Op(OP_SHARD_MAP_NOTICE, "shard_map_notice", 1, 1),  # fastlock.server.mapnotice
)

#: (fewest, most) arguments of each op, after ``[req_id, op]``
OP_ARITY: dict[int, tuple[int, int]] = {op.code: (op.min_args, op.max_args) for op in OPS}

#: the name of each op
OP_NAMES: dict[int, str] = {op.code: op.name for op in OPS}

#: about the most bytes of rows one list reply (KEY_LIST, CONTENDERS, LOCKS) carries: a
#: page stops at the first row beyond it (one row alone always goes), far under any output
#: cap, and the reply names the cursor of the next page
MAX_PAGE_BYTES = 64 << 10

#: the status of a successful reply ``[req_id, 0, value]``; errors carry their
#: class's code from :mod:`fastlock.errors`
STATUS_OK = 0

# push kinds
PUSH_WATCH = "watch"
#: the ``what`` of a PUSH_WATCH event when an operator revoked the lease (``fastlock revoke``)
WATCH_REVOKED = "revoked"
PUSH_VALUE = "value"  # key watch: [prefix, what ("put", "delete", "expired"), key, value or None]
PUSH_SNAPSHOT = "snap"  # replication: [lsn, epoch, counter, holders, incarnation]
PUSH_RECORDS = "repl"  # replication: [first_lsn, last_lsn, frames] (a WAL batch's or a backlog chunk's bytes)
PUSH_RECORD = "rec"  # replication: [lsn, record] (one record: older primaries' backlog; still applied)
PUSH_HEARTBEAT = "hb"  # replication: [primary_ms, last_lsn, epoch, longest_ttl_ms, paired_id, paired_window_ms]
PUSH_SYNC = "sync"  # synchronous replication status: [ack_point or None, in_sync, on_timeout]
#: to a holder: a waiter asks it to yield: [name, token, principal, client, correlation id, grace_ms]
PUSH_REVOKE_REQUESTED = "revoke_req"
#: a WATCH_FROM watch's change: PUSH_WATCH's payload and the change's revision (fastlock.server.watchlog)
PUSH_WATCH_REV = "wrev"
#: a progress notice to a connection with WATCH_FROM watches: [revision] (every change up to it was sent)
PUSH_WATCH_PROGRESS = "wprog"
#: replication, beside REPLICATION_PUSH_KINDS (not part of the log's stream): the primary's waiter
#: queues, [whole, [[name, [owner hash, ...]], ...]] (fastlock.replication.queues)
PUSH_QUEUES = "queues"

#: a KEY_WATCH_FROM connection's key change: [prefix, what, key, value, revision, offset]
#: (fastlock.server.keyrevisions)
PUSH_VALUE_REV = "vrev"
#: before a KEY_WATCH_FROM's replay: [prefix] (what the connection received before it is in the replay)
PUSH_KEY_BEGIN = "vbeg"
#: a progress notice to a connection with KEY_WATCH_FROM watches: [revision] (every key change up to it was sent)
PUSH_KEY_PROGRESS = "vprog"
#: to the holder of a cross-shard reservation an older one wounded: [multi-lock id, its age stamp,
#: the wounding one's age stamp] (fastlock.server.woundwait)
PUSH_WOUNDED = "wounded"
#: to every client connection of a sharded node whose shard map changed: [the new map's epoch]
#: (a routing client reads the map again: fastlock.client.sharded)
PUSH_SHARD_MAP = "shardmap"

REPLICATION_PUSH_KINDS = frozenset({PUSH_SNAPSHOT, PUSH_RECORDS, PUSH_RECORD, PUSH_HEARTBEAT, PUSH_SYNC})

#: a STEP_DOWN is honoured only this long (ms, primary's clock) after the primary time it echoes;
#: the standby waits a little longer than this for the answer
STEP_DOWN_FRESH_MS = 1500

#: the highest epoch: a fencing token (:mod:`fastlock.tokens`) must stay below 2**63
#: (equal to ``fastlock._core.MAX_EPOCH``; a test checks they agree)
MAX_EPOCH = tokens.MAX_EPOCH
