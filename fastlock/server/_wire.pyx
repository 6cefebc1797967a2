# cython: language_level=3
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
from libc.stdint cimport int64_t, uint64_t

from ..errors import ProtocolError
from ..protocol.ops import OP_HELLO
from ..units import monotonic_ms

cdef object _ProtocolError = ProtocolError
cdef object _monotonic_ms = monotonic_ms

#: reads longer than this go to the backlog, a piece at a time (session.FEED_BYTES)
cdef Py_ssize_t FEED_BYTES = 16 << 10
#: replies queued in one loop turn beyond which they go to the transport at once (session.FLUSH_EARLY_BYTES)
cdef Py_ssize_t FLUSH_EARLY_BYTES = 256 << 10


cdef inline Py_ssize_t _put_int(unsigned char *buf, object value) except -1:
    """Write ``value`` (an int) as msgpack writes it (the shortest form); return its bytes."""
    cdef uint64_t u
    cdef int64_t i
    cdef int k
    if value >= 0:
        u = value
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


cpdef dispatch(object handlers, SessionWire conn, object msg):
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
            grant = conn.grant
            if need not in grant.everywhere and (grant.kind != "admin" or need == "replica"):
                handlers.authorize(conn, op, need, msg)
        handler(conn, req_id, msg)
    except Exception as exc:
        handlers.failed(conn, req_id, op, exc)


cdef class SessionWire:
    """The compiled part of a server connection: input, dispatch of a lone request,
    reply queueing (see the module docstring; the rest is ``Session``'s).

    ``server``: the :class:`~fastlock.server.lockserver.LockServer`; ``session``: the
    connection's id; ``intake``: its :class:`~fastlock.server.session.Intake`;
    ``transport``: the asyncio transport; ``out``/``out_bytes``: replies queued this
    turn and their bytes; ``closed``; ``ready``: HELLO is done; ``last_read_ms``:
    monotonic milliseconds of the last read (kept while an idle timeout is set).
    """

    cdef public object server
    cdef public object session
    cdef public object intake
    cdef public object transport
    cdef public list out
    cdef public Py_ssize_t out_bytes
    cdef public bint closed
    cdef public bint ready
    cdef public object last_read_ms

    def data_received(self, bytes data):
        intake = self.intake
        decoder = intake.decoder
        if self.closed or decoder is None:  # closed: the decoder was freed
            return
        server = self.server
        if server.limits.idle_timeout_ms:
            self.last_read_ms = _monotonic_ms()
        if intake.held or intake.scheduled:
            intake.add(data)  # a backlog waits (a read that arrived while reading was pausing): these follow it
            return
        if len(data) > FEED_BYTES or decoder.shape_all:
            intake.add(data)
        else:  # the common case: a short read, decoded at once; one request is dispatched here
            try:
                messages = decoder.feed(data)
            except _ProtocolError as exc:
                self.fatal(exc)
                server.after_batch()
                return
            if len(messages) != 1:
                intake.pending = messages
                intake.next = 0
            else:
                source = server.source
                if source.fencing:
                    source.fence_if_due(_monotonic_ms())  # after a stall, see the clock first
                dispatch(server.handlers, self, messages[0])
                server.after_batch()
                return
        self._dispatch_turn()

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


cpdef bytes ok_grant(object req_id, object token, object ttl_ms, object waited_ms):
    """``[req_id, 0, [token, ttl_ms, waited_ms]]``, the reply of a granted ACQUIRE (ints)."""
    cdef unsigned char buf[48]
    cdef Py_ssize_t n
    buf[0] = 0x93
    n = 1 + _put_int(buf + 1, req_id)
    buf[n] = 0x00
    buf[n + 1] = 0x93
    n += 2
    n += _put_int(buf + n, token)
    n += _put_int(buf + n, ttl_ms)
    n += _put_int(buf + n, waited_ms)
    return PyBytes_FromStringAndSize(<char *>buf, n)
