# cython: language_level=3, nonecheck=True
"""The compiled request path of a server connection (see fastlock/server/session.py).

:class:`SessionWire` is the compiled base of :class:`fastlock.server.session.Session`,
the ``asyncio.Protocol`` of every accepted connection: its ``data_received`` decodes a
read (the connection's :class:`~fastlock.protocol.FrameDecoder`, under the same limits)
and dispatches a lone request at once; a read of several requests, a long read or one
before HELLO goes to the session's bounded backlog (``Session._dispatch_turn``).  Its
``send`` queues replies for the batch end's flush.

:func:`dispatch` runs one request with the checks of
:meth:`fastlock.server.handlers.Handlers.dispatch`, in the same order: the request's
shape, HELLO first, a known op, its arity, the principal's permission, then the op's
handler: every op (the lock operations and any op added to the handler table, wrapped
or not by the metrics) runs its handler from ``Handlers.by_op`` unchanged.  Errors go to
``Handlers.failed``.  Replies ``[id, 0, nil]`` and ``[id, 0, int]`` are written from
templates (:func:`ok_nil`, :func:`ok_int`) as msgpack's own packer writes them.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.set cimport PySet_Discard

cdef extern from "Python.h":
    bint PyUnicode_IS_ASCII(object)
from libc.stdint cimport int64_t, uint64_t

from .._core cimport (Event, table_acquire, table_drain_events, table_epoch, table_holder, table_last_token,
                      table_next_deadline, table_release, table_waiter_count)
from ..wal.commit cimport GroupCommit, LogAppender
from ..replication._wire cimport QueuesWire, SourceWire, SyncWire
from .._core import EV_GRANTED, GRANTED, LIMIT_CONFLICT, NOT_ACQUIRED, QUEUED, NotHolder
from ..auth import ANONYMOUS, hash_owner
from ..errors import InvalidArgument, ProtocolError, WrongArgumentType
from ..protocol.validation import (
    MAX_CORRELATION_ID_CHARS,
    MAX_LOCK_DELAY_MS,
    MAX_NAME_BYTES,
    MAX_TTL_MS,
    MAX_WAIT_MS,
    MIN_TTL_MS,
    check_actor,
    check_limit,
    check_lock_delay_ms,
    check_name,
    check_optional_str,
    check_owner,
    check_shared,
    check_token,
    check_ttl_ms,
    check_wait_ms,
)
from ..roles import Action
from ..protocol.ops import OP_HELLO
from ..protocol._wire cimport WireDecoder, feed_frames
from .shares import limit_exceeded

cdef object _ProtocolError = ProtocolError

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    cdef struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk_id, timespec *tp)
    int CLOCK_MONOTONIC


cdef inline object _monotonic_ms():
    """:func:`fastlock.units.monotonic_ms` in C: the same clock (CLOCK_MONOTONIC, as
    ``time.monotonic_ns``), integer milliseconds."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000 + ts.tv_nsec // 1000000

#: reads longer than this go to the backlog, a piece at a time (session.FEED_BYTES)
cdef Py_ssize_t FEED_BYTES = 16 << 10
#: replies queued in one loop turn beyond which they go to the transport at once (session.FLUSH_EARLY_BYTES)
cdef Py_ssize_t FLUSH_EARLY_BYTES = 256 << 10


cdef inline Py_ssize_t _put_c_int(unsigned char *buf, int64_t value) noexcept:
    """:func:`_put_int` of a C integer of 64 bits (signed)."""
    cdef uint64_t u
    cdef int64_t i
    cdef int k
    if value >= 0:
        u = <uint64_t>value
        if u < 0x80:
            buf[0] = <unsigned char>u
            return 1
        if u < 0x100:
            buf[0] = 0xCC
            buf[1] = <unsigned char>u
            return 2
        if u < 0x10000:
            buf[0] = 0xCD
            buf[1] = <unsigned char>(u >> 8)
            buf[2] = <unsigned char>u
            return 3
        if u < 0x100000000:
            buf[0] = 0xCE
            for k in range(4):
                buf[1 + k] = <unsigned char>(u >> (24 - 8 * k))
            return 5
        buf[0] = 0xCF
        for k in range(8):
            buf[1 + k] = <unsigned char>(u >> (56 - 8 * k))
        return 9
    i = value
    if i >= -32:
        buf[0] = <unsigned char>(i & 0xFF)
        return 1
    if i >= -128:
        buf[0] = 0xD0
        buf[1] = <unsigned char>(i & 0xFF)
        return 2
    if i >= -32768:
        buf[0] = 0xD1
        buf[1] = <unsigned char>((i >> 8) & 0xFF)
        buf[2] = <unsigned char>(i & 0xFF)
        return 3
    if i >= -2147483648:
        buf[0] = 0xD2
        for k in range(4):
            buf[1 + k] = <unsigned char>((i >> (24 - 8 * k)) & 0xFF)
        return 5
    buf[0] = 0xD3
    for k in range(8):
        buf[1 + k] = <unsigned char>((i >> (56 - 8 * k)) & 0xFF)
    return 9


cdef inline Py_ssize_t _put_int(unsigned char *buf, object value) except -1:
    """Write ``value`` (an int) as msgpack writes it (the shortest form); return its bytes."""
    cdef uint64_t u
    cdef int64_t i
    cdef int k
    if value >= 0:
        u = value
        if u <= <uint64_t>0x7FFFFFFFFFFFFFFF:
            return _put_c_int(buf, <int64_t>u)
        buf[0] = 0xCF
        for k in range(8):
            buf[1 + k] = <unsigned char>(u >> (56 - 8 * k))
        return 9
    i = value
    return _put_c_int(buf, i)


cpdef bytes ok_nil(object req_id):
    """``[req_id, 0, nil]``, the reply of PING and RELEASE (``req_id``: an int of 64 bits)."""
    cdef unsigned char buf[16]
    cdef Py_ssize_t n
    buf[0] = 0x93
    n = 1 + _put_int(buf + 1, req_id)
    buf[n] = 0x00
    buf[n + 1] = 0xC0
    return PyBytes_FromStringAndSize(<char *>buf, n + 2)


cpdef bytes ok_int(object req_id, object value):
    """``[req_id, 0, value]`` for an int ``value`` (EXTEND's TTL, ACQUIRE's token)."""
    cdef unsigned char buf[24]
    cdef Py_ssize_t n
    buf[0] = 0x93
    n = 1 + _put_int(buf + 1, req_id)
    buf[n] = 0x00
    n += 1 + _put_int(buf + n + 1, value)
    return PyBytes_FromStringAndSize(<char *>buf, n)


cdef class HandlersWire:
    """The compiled base of :class:`fastlock.server.handlers.Handlers`: the collaborators the
    lock operations read on every request, as slots (declared in ``_wire.pxd``; the
    handlers' ``__init__`` sets them): ``server`` (the
    :class:`~fastlock.server.lockserver.LockServer`, a :class:`BatchEnd`), ``table``,
    ``roles``, ``wal`` (a :class:`~fastlock.wal.commit.LogAppender`), ``config``, ``source``,
    ``quotas`` (a :class:`QuotaCounts`), ``watchers`` (lock name -> its watchers), ``keys``,
    ``sessions``, ``kinds``, and the op table ``by_op`` / ``need_by_op``;
    ``acquire_handler`` and ``release_handler`` are the table's own handlers of ACQUIRE and
    RELEASE: while ``by_op`` holds them unwrapped, :func:`dispatch` calls :func:`acquire` and
    :func:`release` by C calls."""


cpdef dispatch(HandlersWire handlers, SessionWire conn, object msg):
    """Run one decoded request ``msg`` from ``conn`` (its reply is queued on ``conn``);
    the checks and their order are those of ``Handlers.dispatch``."""
    cdef list req
    cdef Py_ssize_t nargs
    if type(msg) is not list:
        conn.fatal(_ProtocolError("a request must be an array [request_id >= 1, op, args...]"))
        return
    req = <list>msg
    if len(req) < 2 or type(req[0]) is not int or type(req[1]) is not int or req[0] < 1:
        conn.fatal(_ProtocolError("a request must be an array [request_id >= 1, op, args...]"))
        return
    req_id = req[0]
    op = req[1]
    if not conn.ready and op != OP_HELLO:
        conn.fatal(_ProtocolError("the first request must be HELLO"))
        return
    nargs = len(req) - 2
    entry = handlers.by_op.get(op)
    try:
        if entry is None:
            raise _ProtocolError(f"unknown operation {op}")
        handler, fewest, most = entry
        if not fewest <= nargs <= most:
            handlers.bad_arity(op, fewest, most, nargs)
        need = handlers.need_by_op.get(op, "admin")
        # grant.everywhere: what the principal may do on every name (no per-name check needed)
        if need is not None:
            if need not in conn.grant_everywhere and (not conn.grant_admin or need == "replica"):
                handlers.authorize(conn, op, need, msg)
        # the table's own ACQUIRE and RELEASE (not wrapped: by the metrics, a sharded node) by a C call
        if handler is handlers.acquire_handler:
            acquire(handlers, conn, req_id, req)
        elif handler is handlers.release_handler:
            release(handlers, conn, req_id, req)
        else:
            handler(conn, req_id, msg)
    except Exception as exc:
        handlers.failed(conn, req_id, op, exc)


cdef class IntakeWire:
    """The compiled base of :class:`fastlock.server.session.Intake`, a connection's request
    decoder and backlog: its fields as slots (declared in ``_wire.pxd``), read by
    :meth:`SessionWire.data_received` without a dictionary lookup: ``decoder`` (a
    :class:`~fastlock.protocol.WireDecoder`, None once closed), ``raw`` and ``raw_at`` (bytes
    received and the offset decoded up to), ``pending`` and ``next`` (requests decoded and
    the index dispatched up to), ``held`` (reading paused for the backlog) and ``scheduled``
    (a later turn's dispatch is queued)."""


cdef class ExpiryWire:
    """The compiled base of :class:`fastlock.server.lockserver.ExpiryTimer`: ``handle`` (the
    armed timer, None: none) and ``at_ms`` (monotonic ms it fires at), read at every batch end."""


cdef class ReclaimWire:
    """The compiled base of :class:`fastlock.server.reclaim.ReclaimGate`: ``queues`` (lock name ->
    its reclaim queue; empty while no reclaim window is open), read by every ACQUIRE."""


cdef class SessionsWire:
    """The compiled base of :class:`fastlock.server.sessions.SessionRegistry`: ``attached_to``
    ((lock name, fencing token) -> the client session the lease is attached to), read by every
    release."""


cdef class KeysWire:
    """The compiled base of :class:`fastlock.server.keys.KeyStore`: ``space`` (its
    :class:`~fastlock.wal.keyspace.KeySpace`, whose ``by_lease`` every release reads)."""


cdef class DelaysWire:
    """The compiled base of :class:`fastlock.server.lockdelays.RunningDelays`: ``per_principal``
    (principal -> how many of its lock-delays run; empty exactly when none runs), read by every
    ACQUIRE."""


cdef class LimitsWire:
    """The compiled base of :class:`fastlock.server.admission.ConnectionLimits`: the fields
    the request path reads, as slots (declared in ``_wire.pxd``): ``sessions`` (session id ->
    connection) and ``idle_timeout_ms`` (milliseconds; 0: connections never time out)."""


cdef class SessionWire:
    """The compiled part of a server connection: input, dispatch of a lone request,
    reply queueing and their flush (see the module docstring; the rest is ``Session``'s).

    ``server``: the :class:`~fastlock.server.lockserver.LockServer`; ``session``: the
    connection's id; ``intake``: its :class:`~fastlock.server.session.Intake`;
    ``transport``: the asyncio transport; ``out``/``out_bytes``: replies queued this
    turn and their bytes; ``closed``; ``ready``: HELLO is done; ``last_read_ms``:
    monotonic milliseconds of the last read (kept while an idle timeout is set);
    ``grant``: the :class:`~fastlock.auth.Principal` it authenticated as; ``recorded``:
    what its grants record as their client.
    """

    # (its slots are declared in _wire.pxd)

    @property
    def grant(self):
        """The :class:`~fastlock.auth.Principal` the connection authenticated as; setting it
        keeps what the request path reads of it (``grant_everywhere``, ``grant_admin``,
        ``grant_name``) as C fields of the connection (a principal is immutable)."""
        return self._grant

    @grant.setter
    def grant(self, principal):
        self.grant_everywhere = principal.everywhere
        self.grant_admin = principal.kind == "admin"
        self.grant_name = principal.name
        self._grant = principal

    cpdef bytes owner_hash(self, object owner):
        """:func:`fastlock.auth.hash_owner` of a checked owner key from this connection
        (:func:`fastlock.protocol.check_owner` raises for a bad one).  The last key's hash
        is kept: a client releases, extends or cancels with the key it acquired with, so
        that request does not hash it again."""
        if type(owner) is bytes and self.owner_key is not None and owner == self.owner_key:
            return self.owner_hashed
        hashed = _hash_owner(_check_owner(owner))
        self.owner_key = owner
        self.owner_hashed = hashed
        return hashed

    def data_received(self, object data):
        cdef IntakeWire intake = self.intake
        decoder = intake.decoder
        if self.closed or decoder is None:  # closed: the decoder was freed
            return
        cdef BatchEnd server = self.server
        if server.limits.idle_timeout_ms:
            self.last_read_ms = _monotonic_ms()
        if intake.held or intake.scheduled:
            intake.add(data)  # a backlog waits (a read that arrived while reading was pausing): these follow it
            return
        if len(data) > FEED_BYTES or (
                (<WireDecoder>decoder)._shape_all if type(decoder) is WireDecoder else decoder.shape_all):
            intake.add(data)
        else:  # the common case: a short read, decoded at once; one request is dispatched here
            try:
                messages = feed_frames(decoder, data)
            except _ProtocolError as exc:
                self.fatal(exc)
                server.after_batch()
                return
            if len(messages) != 1:
                intake.pending = messages
                intake.next = 0
            else:
                if server.source.fencing:
                    (<object>server.source).fence_if_due(_monotonic_ms())  # after a stall, see the clock first
                dispatch(server.handlers, self, messages[0])
                server.after_batch()
                return
        self._dispatch_turn()

    cpdef flush(self):
        """Hand the queued replies to the transport; while writing is paused
        (``Session.paused_write``) drop the peer if it leaves more than ``out_cap`` bytes unread."""
        cdef list out = self.out
        self.out_bytes = 0
        if out and not self.closed:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
            if self._drain is not None:  # the transport paused writing once: the output cap
                (<object>self).paused_write()
        out.clear()

    cpdef send(self, object data):
        """Queue ``data`` for this turn's flush (dropped if the connection is closing)."""
        if not self.closed:
            if not self.out:
                self.server.dirty.append(self)
            self.out.append(data)
            self.out_bytes += len(data)
            if self.out_bytes > FLUSH_EARLY_BYTES:
                # one read of small requests can ask for far larger replies: hand them to
                # the transport now, so the output cap applies within the batch too
                self.flush()


cdef inline Py_ssize_t _grant_head(unsigned char *buf, object req_id) except -1:
    """Write ``[req_id, 0, [`` of a grant's reply (a 3-array whose third item is a 3-array); return its bytes."""
    cdef Py_ssize_t n
    buf[0] = 0x93
    n = 1 + _put_int(buf + 1, req_id)
    buf[n] = 0x00
    buf[n + 1] = 0x93
    return n + 2


cpdef bytes ok_grant(object req_id, object token, object ttl_ms, object waited_ms):
    """``[req_id, 0, [token, ttl_ms, waited_ms]]``, the reply of a granted ACQUIRE (ints)."""
    cdef unsigned char buf[48]
    cdef Py_ssize_t n = _grant_head(buf, req_id)
    n += _put_int(buf + n, token)
    n += _put_int(buf + n, ttl_ms)
    n += _put_int(buf + n, waited_ms)
    return PyBytes_FromStringAndSize(<char *>buf, n)


cdef bytes _grant_reply(object req_id, int64_t token, int64_t ttl_ms, int64_t waited_ms):
    """:func:`ok_grant` of an event's C integers (no int objects made for them)."""
    cdef unsigned char buf[48]
    cdef Py_ssize_t n = _grant_head(buf, req_id)
    n += _put_c_int(buf + n, token)
    n += _put_c_int(buf + n, ttl_ms)
    n += _put_c_int(buf + n, waited_ms)
    return PyBytes_FromStringAndSize(<char *>buf, n)


# -- the lock operations ---------------------------------------------------------------
# ACQUIRE (every form, ACQUIRE_PRIORITY's too), RELEASE and EXTEND (with or without a
# sequencer) exist only here.  An argument's common case is checked inline; one that
# fails it goes through the shared validator (fastlock.protocol.validation), which
# accepts it or raises the error for it.

cdef object _check_name = check_name
cdef object _check_owner = check_owner
cdef object _hash_owner = hash_owner
cdef object _check_token = check_token
cdef object _check_ttl_ms = check_ttl_ms
cdef object _check_wait_ms = check_wait_ms
cdef object _check_lock_delay_ms = check_lock_delay_ms
cdef object _check_optional_str = check_optional_str
cdef object _check_shared = check_shared
cdef object _check_limit = check_limit
cdef object _check_actor = check_actor
cdef object _InvalidArgument = InvalidArgument
cdef object _WrongArgumentType = WrongArgumentType
cdef object _NotHolder = NotHolder
cdef object _limit_exceeded = limit_exceeded
cdef object _ACQUIRE = Action.ACQUIRE
cdef object _RELEASE = Action.RELEASE
cdef object _EXTEND = Action.EXTEND
cdef object _LIMIT_CONFLICT = LIMIT_CONFLICT
cdef object _NOT_ACQUIRED = NOT_ACQUIRED
cdef object _QUEUED = QUEUED
cdef Py_ssize_t _MAX_NAME_BYTES = MAX_NAME_BYTES
cdef long long _MIN_TTL_MS = MIN_TTL_MS
cdef long long _MAX_TTL_MS = MAX_TTL_MS
cdef long long _MAX_WAIT_MS = MAX_WAIT_MS
cdef long long _MAX_LOCK_DELAY_MS = MAX_LOCK_DELAY_MS
cdef Py_ssize_t _MAX_CORRELATION_ID_CHARS = MAX_CORRELATION_ID_CHARS


cdef inline object _name(object name):
    """A checked lock name (check_name's common case inline: ASCII, 1..512 bytes, no NUL)."""
    if (type(name) is str and PyUnicode_IS_ASCII(name) and 0 < len(<str>name) <= _MAX_NAME_BYTES
            and "\x00" not in <str>name):
        return name
    return _check_name(name)


cdef inline object _int_in(object value, long long low, long long high, object check):
    """``value`` if it is an int in ``low..high``, else what ``check(value)`` returns (or raises).
    (Compared as a C integer: one beyond 64 bits is out of range, for ``check`` to judge.)"""
    cdef int overflow = 0
    cdef long long v
    if type(value) is int:
        v = PyLong_AsLongLongAndOverflow(value, &overflow)
        if not overflow and low <= v <= high:
            return value
    return check(value)


cdef inline object _wait_ms(object wait_ms):
    """A checked wait in ms (-1: forever; check_wait_ms's common case inline, on a C integer)."""
    cdef int overflow = 0
    cdef long long v
    if type(wait_ms) is int:
        v = PyLong_AsLongLongAndOverflow(wait_ms, &overflow)
        if not overflow and (v == -1 or 0 <= v <= _MAX_WAIT_MS):
            return wait_ms
    return _check_wait_ms(wait_ms)


cdef inline bint _admits(BatchEnd server, object roles, object action) except -1:
    """``action in roles.admitted`` (NodeRole's set), read from the server's copy of it when it
    keeps one (``BatchEnd.admitted``, set by the roles' ``on_admitted``)."""
    admitted = server.admitted
    if admitted is None:
        return action in roles.admitted
    return action in <frozenset>admitted


cpdef acquire(HandlersWire handlers, SessionWire conn, object req_id, list msg, object priority=0):
    """ACQUIRE ``[id, op, name, owner, ttl_ms, wait_ms, lock_delay_ms, correlation_id[, shared[, limit[,
    actor[, sequencer]]]]]``, every form of it: ACQUIRE_PRIORITY's too, at queue ``priority`` (0..99,
    :mod:`fastlock.server.preemption`, which checked it).  An acquire of a lock in a promoted primary's
    reclaim window is parked there (:mod:`fastlock.server.reclaim`), any other enters the lock's queue
    (:func:`enter_acquire`).  The grant (now or later) is a table event, replied to at the batch end; a
    refusal raises its FastlockError."""
    name = _name(msg[2])
    owner = conn.owner_hash(msg[3])  # only the hash is kept, logged and replicated
    cdef ReclaimWire reclaim = handlers.server.reclaim
    queues = reclaim.queues
    if queues and name in queues:  # a promoted primary's reclaim window (server.reclaim)
        roles = handlers.roles
        if _ACQUIRE not in roles.admitted:  # (NodeRole.admit's own test: it raises the refusal)
            roles.admit(_ACQUIRE)
        (<object>reclaim).park(conn, req_id, msg, name, owner, _wait_ms(msg[5]), priority)
        return
    enter_acquire(handlers, conn, req_id, msg, name, owner, priority)


cpdef enter_acquire(HandlersWire handlers, SessionWire conn, object req_id, list msg, object name, bytes owner,
                    object priority=0):
    """The ACQUIRE ``msg`` of the checked ``name`` by ``owner`` (its hash) enters the lock's queue at
    ``priority`` or is granted: its other arguments are checked, then the node's role, the waiter
    limits, --max-leases and the principal's quotas, in that order (the reclaim window's parked
    acquires enter here when their place comes).  A true ``sequencer`` flag makes the request a
    :class:`fastlock.server.kinds.SequencedRequest` (its grant reply carries a signed sequencer)."""
    cdef Py_ssize_t n = len(msg)
    ttl_ms = _int_in(msg[4], _MIN_TTL_MS, _MAX_TTL_MS, _check_ttl_ms)
    wait_ms = _wait_ms(msg[5])
    delay_ms = _int_in(msg[6], 0, _MAX_LOCK_DELAY_MS, _check_lock_delay_ms)
    corr = msg[7]
    if corr is not None and not (type(corr) is str and len(<str>corr) <= _MAX_CORRELATION_ID_CHARS):
        corr = _check_optional_str(corr, "correlation id", _MAX_CORRELATION_ID_CHARS)
    shared = n > 8 and _check_shared(msg[8])  # a shared lease (absent: exclusive)
    limit = _check_limit(msg[9]) if n > 9 else 0  # a semaphore's limit (absent: a lock)
    actor = _check_actor(msg[10]) if n > 10 else 0  # who waits in the session (absent: all of it)
    # a signed sequencer in the grant reply (absent: none; fastlock.sequencer)
    request = handlers.sequenced_request(conn, req_id, msg[11]) if n > 11 else req_id
    if shared and limit:
        raise _InvalidArgument("a semaphore permit (limit > 0) cannot also be shared")
    table = handlers.table
    now = _monotonic_ms()
    roles = handlers.roles
    if not _admits(handlers.server, roles, _ACQUIRE):  # (NodeRole.admit's own test: it raises the refusal)
        roles.admit(_ACQUIRE)
    config = handlers.config
    quotas = handlers.quotas
    if wait_ms != 0:
        if table.session_waiters(conn.session) >= config.max_waiters_per_connection:
            raise _limit_exceeded(config.max_waiters_per_connection, "this connection", "waiting acquires",
                                  "max-waiters-per-connection")
        if table_waiter_count(table) >= config.max_waiters:
            raise _limit_exceeded(config.max_waiters, "the server", "waiting acquires", "max-waiters")
    # a retry of a held lease re-delivers it: it adds nothing
    retry = table_holder(table, name, now, owner) is not None
    # the global cap counts leases held: an exclusive request on a held name adds none now (it queues)
    # (running lock-delays count as leases: each keeps a lock entry until it ends)
    # (PrincipalQuotas.lock_delay_count's own first check inline: no lock-delay runs)
    if (not retry and len(table) + (quotas.lock_delay_count(now) if quotas.delays.per_principal else 0)
            >= config.max_leases
            and (shared or limit or not table.holders_of(name, now, 0, 1))):
        raise _limit_exceeded(config.max_leases, "the server", "leases", "max-leases")
    # the principal's quotas: a lease, granted now or reserved by a waiter (see PrincipalQuotas)
    usage = None if retry else quotas.check_acquire(conn.grant_name, 1, 1 if wait_ms != 0 else 0)
    server = handlers.server
    if ttl_ms > server.max_ttl_ms:
        server.max_ttl_ms = ttl_ms
        server.node_state.raise_ttl(ttl_ms)  # rare: only a new longest TTL writes
    try:
        status = table_acquire(table, name, owner, conn.session, request, ttl_ms, wait_ms, delay_ms,
                               (conn.recorded, corr), now, shared, limit, actor, priority)
    except ValueError as exc:  # the owner key waits on name in a multi-lock request
        raise _InvalidArgument(f"{name!r}: {exc}") from None
    if usage is not None:
        _acquired_one(quotas, usage, status, name, table_last_token(table))
    if status == _QUEUED:
        (<object>server.queues).touched(name)  # shipped to the standby (fastlock.replication.queues)
    elif status == _LIMIT_CONFLICT or status == _NOT_ACQUIRED:
        handlers.acquire_refused(conn, name, limit, status, now)


cpdef release(HandlersWire handlers, SessionWire conn, object req_id, list msg):
    """RELEASE ``[id, op, name, token, owner]``: Handlers.op_release compiled."""
    name = _name(msg[2])
    token = _int_in(msg[3], 1, 0x7FFFFFFFFFFFFFFF, _check_token)
    owner = conn.owner_hash(msg[4])
    # a fenced primary refuses too: the standby may have been promoted and would never
    # see this release (the client repeats it at whichever node is primary)
    roles = handlers.roles
    if not _admits(handlers.server, roles, _RELEASE):  # (NodeRole.admit's own test: it raises the refusal)
        roles.admit(_RELEASE)
    table = handlers.table
    now = _monotonic_ms()
    meta = None
    if name in handlers.watchers:  # watchers are told whose lease it was
        holder = table_holder(table, name, now, owner)
        meta = holder.meta if holder is not None else None
    cdef BatchEnd server = handlers.server
    if token > server.granted_logged:  # (log_decided_for's own test: granted in this batch, not logged yet)
        server.log_decided()
    try:
        table_release(table, name, token, owner, now)
    except _NotHolder:
        raise handlers.not_holder(name, token) from None
    server.released(name, token, meta, conn.grant_name)  # (the lease's principal, but for another's release)
    conn.send(ok_nil(req_id))


cpdef extend(HandlersWire handlers, SessionWire conn, object req_id, list msg):
    """EXTEND ``[id, op, name, token, owner, ttl_ms[, sequencer]]``: renews the lease ``token`` of
    ``name`` held by ``owner`` from this connection for ``ttl_ms``.  Replies ``ttl_ms``; with a true
    ``sequencer`` flag ``[ttl_ms, {"sequencer": bytes}]``, the lease's sequencer re-signed with the
    renewed expiry (``{}`` when this server holds no signing key: the lease is renewed all the same;
    :func:`fastlock.server.kinds.renewal_sequencer`).

    :raises WrongArgumentType: ``sequencer`` is not a bool (nothing renewed).
    :raises LeaseLost: not the holder."""
    name = _name(msg[2])
    token = _int_in(msg[3], 1, 0x7FFFFFFFFFFFFFFF, _check_token)
    owner = conn.owner_hash(msg[4])
    ttl_ms = _int_in(msg[5], _MIN_TTL_MS, _MAX_TTL_MS, _check_ttl_ms)
    flag = msg[6] if len(msg) > 6 else False
    if type(flag) is not bool:
        raise _WrongArgumentType(f"sequencer must be a bool, not {type(flag).__name__}")
    table = handlers.table
    now = _monotonic_ms()
    roles = handlers.roles
    if _EXTEND not in roles.admitted:  # (NodeRole.admit's own test: it raises the refusal)
        roles.admit(_EXTEND)
    cdef BatchEnd server = handlers.server
    if token > server.granted_logged:  # (log_decided_for's own test: its EXTEND record after its grant's)
        server.log_decided()
    holder = table_holder(table, name, now, owner)
    try:
        table.extend(name, token, owner, ttl_ms, now, conn.session)  # the lease is held from this connection
    except _NotHolder:
        raise handlers.not_holder(name, token) from None
    if ttl_ms > server.max_ttl_ms:  # only the holder's extend counts towards the grace period
        server.max_ttl_ms = ttl_ms
        server.node_state.raise_ttl(ttl_ms)
    if flag:
        reply = handlers.renewed_sequencer_reply(req_id, name, token, holder, ttl_ms)
    else:
        reply = ok_int(req_id, ttl_ms)
    # Every extend is logged: the standby keeps each lease's deadline from the
    # records it receives, and a promoted standby keeps that deadline.
    wal = <object>handlers.wal
    wal.log_extend(name, token, ttl_ms)
    # sync replication: every extend waits for the standby (it moves the deadline); recovery restores
    # the recorded TTL: a longer one must be durable before the holder relies on it (not a shorter one)
    # a longer TTL than the standbys know waits for their word (fastlock.replication.ttlbound)
    cdef SourceWire source = handlers.source
    if source.sync.enabled or ((holder is None or ttl_ms > holder.ttl_ms)
                               and ((source.fencing and not source.ttl.covers(ttl_ms)) or not wal.flush_now())):
        handlers.extend_when_durable(conn, req_id, name, token, reply, ttl_ms)
        return
    conn.send(reply)


# -- grant delivery ----------------------------------------------------------------------

cpdef list deliver_grants(dict sessions, list grants):
    """Queue the reply of each acknowledged ``EV_GRANTED`` event of ``grants`` whose request
    is a plain ACQUIRE (its request id, an int) on its live connection (``sessions``: session
    id -> connection), as :func:`ok_grant` writes it.  Returns the others, in order: a grant
    whose connection is gone or closing, or whose request is an object (a sequencer's, an
    ACQUIRE_MANY's), for :meth:`fastlock.server.lockserver.LockServer.deliver_grants` to
    handle."""
    rest = _deliver_grants(sessions, grants)
    return rest if rest is not None else []


cdef list _deliver_grants(dict sessions, list grants):
    """:func:`deliver_grants`, returning None when every grant was answered (no list made)."""
    cdef list rest = None
    cdef SessionWire conn
    cdef Event ev
    for ev in grants:
        request = ev.request
        wire = sessions.get(ev.session)
        if type(request) is not int or wire is None or not isinstance(wire, SessionWire) or (<SessionWire>wire).closed:
            if rest is None:
                rest = []
            rest.append(ev)
            continue
        conn = <SessionWire>wire
        conn.send(_grant_reply(request, ev.token, ev.ttl_ms, ev.waited_ms))
    return rest


# -- the batch end -----------------------------------------------------------------------



cdef class _GrantsDelivery:
    """A batch's ``grants`` (``EV_GRANTED`` events) acknowledged later: calling it runs
    ``server.deliver_granted(grants, refused)`` (``refused``: the error replication refused
    them with, or None) - the ``when_durable`` / ``sync.after`` callback of
    :meth:`BatchEnd.acknowledge`."""

    cdef BatchEnd server
    cdef list grants

    def __call__(self, refused=None):
        self.server.deliver_granted(self.grants, refused)


cdef inline int _flush_dirty(list dirty) except -1:
    """Flush every connection queued in ``dirty`` (the batch end's list), then empty it."""
    if dirty:
        for conn in dirty:  # (SessionWire.send queues a connection here; TypeError for anything else)
            (<SessionWire?>conn).flush()
        dirty.clear()
    return 0


cdef inline _GrantsDelivery _grants_delivery(BatchEnd server, list grants):
    """A :class:`_GrantsDelivery` of ``grants`` to ``server``, made without a Python call."""
    cdef _GrantsDelivery delivery = _GrantsDelivery.__new__(_GrantsDelivery)
    delivery.server = server
    delivery.grants = grants
    return delivery


cdef inline int _deliver_when_durable(BatchEnd server, GroupCommit commit, list grants) except -1:
    """``commit.when_durable(_grants_delivery(server, grants))``, unless the last waiter is a
    delivery of this server's whose records are all still pending (an earlier batch end's in
    this loop turn): that one then delivers ``grants`` too, after its own, and waits for their
    records as well (``GroupCommit.join_waiter``) - one callback per written batch, not one per
    batch end."""
    last = commit.pending_waiter()
    if type(last) is _GrantsDelivery and (<_GrantsDelivery>last).server is server:
        commit.join_waiter()
        (<_GrantsDelivery>last).grants.extend(grants)
    else:
        commit.when_durable(_grants_delivery(server, grants))
    return 0


cdef class BatchEnd:
    """The compiled base of :class:`fastlock.server.lockserver.LockServer`: the batch end
    (:meth:`after_batch`), the acknowledgement of a batch of grants (:meth:`deliver_granted`)
    and a release's bookkeeping (:meth:`released`).  The attributes they read are the
    server's (``table``, ``wal``, ``revisions``, ...); the uncommon cases are its Python
    methods (``_other_event``, ``_rearm``, ``_deliver_rest``).  The collaborators read on
    every batch are slots of this base (the server's ``__init__`` sets them as attributes), so
    compiled code reads them without a dictionary lookup."""

    # (its slots are declared in _wire.pxd)

    cpdef after_batch(self):
        """The batch end: log and deliver the table's events, re-arm the timer, flush replies."""
        if self.batch_end_owed:
            # owed by a delivery of grants whose records are now durable (a written batch's
            # callbacks, GroupCommit._io_done): their replies go out before this batch end's work
            _flush_dirty(self.dirty)
        server = <object>self
        table = self.table
        # grants acknowledged at once (a relaxed fsync mode) are delivered inside its loop and
        # leave their flush to this batch end; what their delivery changes is drained again
        BatchEnd.log_decided(self)
        wal = <object>self.wal
        cdef GroupCommit commit = self.commit
        # at every batch end (key puts make no table events); maybe_snapshot's own first check inline:
        # a snapshot is due from the snapshotter's next LSN or byte count on.  Its two marks are kept
        # here as C integers (read again whenever the log passes them): they only rise while the log
        # is open (a snapshot started), so marks kept below the snapshotter's are read again, never missed
        snaps = self.snapshots
        if (snaps is not self.snapshots_read or <long long>commit.next_lsn > self.snapshot_due_lsn
                or commit.io.bytes >= self.snapshot_due_bytes):
            due_lsn = snaps.next_due
            due_bytes = snaps.next_due_bytes
            self.snapshot_due_lsn = due_lsn
            self.snapshot_due_bytes = due_bytes
            self.snapshots_read = snaps
            if ((commit.next_lsn > due_lsn or commit.io.bytes >= due_bytes)
                    and wal.maybe_snapshot(server.snapshot_state)):
                from .lockdelays import relog_running  # (lockdelays imports this module: not at its start)
                relog_running(wal, table)
                server.revoke_deadlines.relog(wal, _monotonic_ms())
        nd = table_next_deadline(table)
        cdef ExpiryWire expiry = self.expiry
        if nd >= 0 and (expiry.handle is None or nd < expiry.at_ms) and self.roles.expires_leases:
            server._rearm()
        if table_waiter_count(table):
            self.handlers.kinds.deadlocks.poke()  # arms the deadlock check while anything waits
        # each collaborator is called only when it has work (its own first check, inline)
        cdef RevisionsWire revisions = self.revisions
        if revisions.log.pending:
            revisions.batch_end()  # the batch's holder changes reach the watchers once committed
        cdef CommittedWire key_revisions = self.key_revisions
        if key_revisions.log.pending:
            key_revisions.batch_end()  # and its key changes the prefix watchers
        cdef QueuesWire queues = self.queues
        if queues.dirty or queues.informed or self.source.replicas:
            (<object>queues).batch_end()  # changed waiter queues go to the standby
        # the replies queued so far go out first: none of them waits for a sync (a reply that does
        # is queued by its when_durable callback), and the poll below may block on one - a hand-off's
        # batch (the release's and the next grant's records) written and fdatasync'd on the loop -
        # while the clients read them
        _flush_dirty(self.dirty)
        # a batch the WAL thread finished meanwhile is acknowledged now, not after this turn
        # (WriteAheadLog.poll's own call); the replies its callbacks queue are flushed by the batch
        # end they owe (GroupCommit._io_done), else here
        commit.poll()
        _flush_dirty(self.dirty)
        self.batch_end_owed = False

    cpdef process_events(self, list events):
        """Log and deliver ``events`` (drained from the table by the caller), as a batch end does:
        each fresh grant is logged, recorded for the watchers and counted against its principal,
        and the batch's grants acknowledged (:meth:`acknowledge`); any other event is the
        server's ``_other_event`` (an expiry, a waiter that left)."""
        if not events:
            return
        server = <object>self
        cdef LogAppender wal = self.wal
        cdef QuotaCounts quotas = self.quotas
        cdef Event ev
        cdef RevisionsWire revisions = self.revisions
        cdef QueuesWire queues = self.queues
        grants = None
        for ev in events:
            if ev.kind == _EV_GRANTED:
                if ev.fresh:
                    meta = ev.meta
                    token = ev.token
                    wal.append_grant(ev.name, token, ev.owner, ev.ttl_ms, ev.lock_delay_ms, meta[0], meta[1],
                                     ev.shared, ev.limit)
                    revisions.logged(ev.name, "granted", token, meta)
                    quotas.grant_event(ev)
                    if ev.token > self.granted_logged:
                        self.granted_logged = ev.token
                if grants is None:
                    grants = []
                grants.append(ev)
                if queues.shipped:  # (a queue shipped to a standby may have changed)
                    (<object>queues).granted(ev.name)
            else:
                server._other_event(ev)
        if quotas.ended_early:
            (<object>quotas).batch_done()
        if grants is not None:
            self.acknowledge(grants)  # once durable (and replicated)

    cpdef acknowledge(self, list grants):
        """Acknowledge the batch's ``grants`` (``EV_GRANTED`` events, logged) with
        :meth:`deliver_granted` once their records are durable and, under synchronous
        replication, acknowledged by the standby (``source.sync``); a TTL longer than the
        standbys know waits for their word too (:mod:`fastlock.replication.ttlbound`).  In the
        relaxed fsync modes the first batch of a loop turn is written at once, and a lone
        request's grant delivered within this batch end (``WriteAheadLog.flush_first``)."""
        cdef SourceWire source = self.source
        sync = <object>source.sync
        cdef GroupCommit commit = self.commit
        if not source.fencing and not source.sync.enabled:  # (unpaired, no standby to wait for: the common case below)
            if commit.flush_first():
                self.deliver_granted(grants)
            else:
                _deliver_when_durable(self, commit, grants)
            return
        ttl_bound = source.ttl
        # unpaired (not fencing): nothing promotes on this primary's silence, no bound (TtlBound.covers's own answer)
        if not source.fencing or ttl_bound.covers(self.max_ttl_ms):
            if sync.enabled:
                deliver = sync.after(_grants_delivery(self, grants))
            else:  # (sync.after's own, without a standby)
                deliver = _grants_delivery(self, grants)
        else:  # rare: a TTL the standbys may not know yet waits for their word (replication/ttlbound.py)
            longest = 0
            for ev in grants:
                if ev.ttl_ms > longest:
                    longest = ev.ttl_ms
            deliver = sync.after(ttl_bound.after(_grants_delivery(self, grants), longest))
        # (the group commit's own calls: WriteAheadLog.flush_first's and when_durable's)
        if commit.flush_first():  # relaxed fsync modes: a lone request's grant is written and acked now
            deliver()
        else:  # acked once durable: in a burst, at the end of this turn with everything logged in it
            commit.when_durable(deliver)

    cpdef deliver_granted(self, list grants, refused_by=None):
        """Acknowledge a batch of grants (``EV_GRANTED`` events) once durable - if this node may
        still grant (``refused_by``: the error replication refused them with, or None).

        The fence is checked again here, at the acknowledgement, not only when the grants were
        decided: a primary frozen (SIGSTOP, a VM stall) between the two may find its standby
        promoted meanwhile.  Then every waiting request gets ``Unavailable`` instead of its token
        (the lease stays in this node's table); the client repeats the acquire with the same owner
        key at whichever node is primary, which hands it the lease if it was replicated, or queues
        it.  One check per batch: the normal path does not pay per grant.  The plain ACQUIREs to
        live connections are answered here (:func:`deliver_grants`); the others, and every grant
        when refused, by ``LockServer._deliver_rest``.
        """
        server = <object>self
        if self.source.fencing:  # (not paired: nothing to check)
            (<object>self.source).fence_if_due(_monotonic_ms())
        if refused_by is None and _admits(self, self.roles, _ACQUIRE):  # (NodeRole.may's own test)
            rest = _deliver_grants(self.limits.sessions, grants)
            if rest:
                server._deliver_rest(rest, None)
        else:
            server._deliver_rest(grants, refused_by)
        # inside after_batch, or among the callbacks of a written batch (GroupCommit.batch_end):
        # the batch end that follows flushes the replies
        if self.in_batch_end:
            self.batch_end_owed = True
        else:
            self.after_batch()

    cpdef log_decided(self):
        """Log and acknowledge the events the table made earlier in this batch (the batch end's
        :meth:`process_events`, before it): called before a request ends a lease (RELEASE, a
        cancel that releases, a hand-off, a revoke), so that a lease granted in the same batch
        has its grant record before its end's, in the log, on a standby and in recovery, and
        its watchers see the grant first; and before any other record that names a lease
        (:meth:`log_decided_for`).  RELEASE and EXTEND call it only for a token above
        ``granted_logged`` (the highest whose grant record is logged): a lease whose grant is
        logged needs nothing first."""
        table = self.table
        events = table_drain_events(table)
        if not events:
            return
        outer = self.in_batch_end
        self.in_batch_end = True  # (a delivery leaves its flush to the batch end that follows)
        try:
            while events:
                self.process_events(events)
                events = table_drain_events(table)
        finally:
            self.in_batch_end = outer

    cpdef log_decided_for(self, long long token):
        """:meth:`log_decided` when the lease of fencing ``token`` (int) may have been granted in this
        batch (a token above ``granted_logged``): called before a record that names a lease (an
        EXTEND, a KEY_PUT attached to it, a REVOKE_REQUEST, a session's attach), so that recovery
        and a standby, which ignore such a record for a lease they do not hold, find its grant
        first."""
        if token > self.granted_logged:
            self.log_decided()

    cpdef released(self, name, token, meta, principal=None):
        """Log a release and tell the lock's watchers (``meta``: the lease's (client, correlation id),
        None when not known); ``principal`` (str): the one the lease likely counts against (the
        releasing connection's), whose usage the quotas uncount it from when ``meta`` is None
        (:meth:`QuotaCounts.lease_ended`)."""
        self.wal.append_release(name, token)
        self.revisions.logged(name, "released", token, meta)
        handlers = self.handlers
        cdef KeysWire keys = handlers.keys
        if keys.space.by_lease:  # (keys attached to leases go with them)
            (<object>keys).lease_ended(name, token, "released")
        cdef SessionsWire sessions = handlers.sessions
        if sessions.attached_to:  # (leases attached to client sessions are detached)
            (<object>sessions).lease_ended(name, token)
        self.quotas.lease_ended(token, meta, principal, name)


# -- the per-principal quotas ---------------------------------------------------------------

cdef object _ANONYMOUS = ANONYMOUS
cdef object _GRANTED = GRANTED
cdef int _EV_GRANTED = EV_GRANTED


cdef class UsageWire:
    """The compiled base of :class:`fastlock.server.admission.Usage`: the counts the request
    path changes, as slots (declared in ``_wire.pxd``): ``leases`` (fencing token -> lock name)
    and ``waiting`` (acquires queued)."""


cdef inline _quota_check(object quota, object principal, object have, object adding):
    """:meth:`fastlock.server.shares.Quota.check`'s test inline: the method (which raises
    :class:`~fastlock.errors.LimitExceeded`) runs only when ``have + adding`` passes the quota."""
    limit = quota.anonymous_limit if principal == _ANONYMOUS else quota.limit
    if limit and have + adding > limit:
        quota.check(principal, have, adding)


cdef class QuotaCounts:
    """The compiled base of :class:`fastlock.server.admission.PrincipalQuotas`: the counts an
    acquire, a grant and a lease's end change on the request path (:meth:`check_acquire`,
    :meth:`lock_delay_count`, :meth:`acquired`, :meth:`grant_event`, :meth:`lease_ended`).
    The attributes they read are slots of this base, set by ``PrincipalQuotas.__init__`` and
    ``configure``; the rest (``sync``, ``of``, ``principal_of``) are its Python methods."""

    # (its slots are declared in _wire.pxd)

    cpdef check_acquire(self, principal, leases, waiters):
        """Refuse (:class:`~fastlock.errors.LimitExceeded`, nothing changed) a request of
        ``principal`` (str) that may add ``leases`` leases (int), of which ``waiters`` may
        wait; returns its :class:`~fastlock.server.admission.Usage`."""
        quotas = <object>self
        cdef DelaysWire delays
        if table_epoch(self.table) != self._epoch:
            quotas.sync()
        cdef UsageWire u = <UsageWire?>(self.usage.get(principal) or quotas.of(principal))
        if waiters:
            _quota_check(self.waiters, principal, u.waiting, waiters)
        if leases:
            held = len(u.leases) + u.waiting
            delays = self.delays
            if delays.per_principal:  # (empty exactly when no lock-delay runs)
                (<object>delays).ended(_monotonic_ms())
                held += delays.per_principal.get(principal, 0)
            _quota_check(self.leases, principal, held, leases)
        return u

    cpdef lock_delay_count(self, now):
        """Lock-delays running at ``now`` (monotonic ms): --max-leases counts them too."""
        cdef DelaysWire delays = self.delays
        if not delays.per_principal:  # (empty exactly when no lock-delay runs)
            return 0
        (<object>delays).ended(now)
        return len(delays)

    cpdef acquired(self, UsageWire u, status, names, last_token):
        """Count what an acquire of ``names`` (by ``u``'s principal) created: a lease per
        name granted now (tokens up to ``last_token``, one per name in order), or a
        waiter per name queued."""
        if status == _GRANTED:
            leases = u.leases
            counted_now = self.counted_now
            if type(names) is tuple and len(<tuple>names) == 1:  # (one lock: its lease is the last token)
                leases[last_token] = (<tuple>names)[0]
                counted_now.add(last_token)
                return
            token = last_token - len(names) + 1
            for name in names:
                leases[token] = name
                counted_now.add(token)
                token += 1
        elif status == _QUEUED:
            u.waiting += len(names)

    cpdef grant_event(self, Event ev):
        """A fresh EV_GRANTED: a waiter's grant moves it from waiting to holding
        (an immediate grant was counted by :meth:`acquired`, and is not counted again even
        when its lease ended before this event: released in the same batch)."""
        token = ev.token
        counted_now = self.counted_now
        if counted_now and PySet_Discard(counted_now, token) == 1:  # (it was there)
            return
        meta = ev.meta
        # principal_of's remembered answer, inline (the common case)
        principal = self._principal_of.get(meta[0]) if meta and type(meta[0]) is str else None
        if principal is None:
            principal = (<object>self).principal_of(meta)
        cdef UsageWire u = <UsageWire?>(self.usage.get(principal) or (<object>self).of(principal))
        if token in u.leases:
            return
        if u.waiting:
            u.waiting -= 1
        ended_early = self.ended_early
        if token in ended_early:
            ended_early.discard(token)
            return
        u.leases[token] = ev.name

    cpdef lease_ended(self, token, meta=None, principal=None, name=None):
        """The lease ``token`` (of lock ``name``, when known) was released, expired or revoked:
        uncount it.  Its principal from ``meta`` (the lease's), else ``principal`` (a likely
        one: a RELEASE's connection's), in O(1); searched among all only when that one did not
        count it (a lease released by another principal's connection, or ended before its grant
        event counted it).  With ``name`` a lease sharing its token with another lock's (a slot
        move imported one of them) is told apart."""
        if meta:
            # principal_of's remembered answer, inline (the common case)
            recorded = self._principal_of.get(meta[0]) if type(meta[0]) is str else None
            principal = recorded if recorded is not None else (<object>self).principal_of(meta)
        cdef UsageWire u
        if principal is not None:
            found = self.usage.get(principal)  # None: the principal has counted nothing here (a standby's)
            if found is not None and _uncount((<UsageWire?>found).leases, token, name):
                return
        for u in self.usage.values():
            if _uncount(u.leases, token, name):
                return
        self.ended_early.add(token)  # a waiter's grant not yet processed (grant_event)


cdef inline _acquired_one(QuotaCounts quotas, UsageWire u, object status, object name, object last_token):
    """:meth:`QuotaCounts.acquired` of one lock ``name`` (its lease, if granted now, is ``last_token``)."""
    if status == _GRANTED:
        u.leases[last_token] = name
        quotas.counted_now.add(last_token)
    elif status == _QUEUED:
        u.waiting += 1


cdef bint _uncount(dict leases, object token, object name):
    """Remove lease ``token`` of ``name`` (None: of any name) from a principal's counted
    ``leases`` (:class:`fastlock.server.admission.Usage`); whether it was counted there."""
    counted = leases.pop(token, None)
    if counted is None:
        return name is not None and len(leases) > 0 and leases.pop((token, name), None) is not None
    if name is None or counted == name:
        return True
    leases[token] = counted  # another lock's lease of this token: this one is under (token, name)
    return leases.pop((token, name), None) is not None
