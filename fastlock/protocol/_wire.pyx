# cython: language_level=3
"""The compiled reply path of a connection to a server (see fastlock/protocol/rpc.py).

:class:`RpcWire` is the compiled base of :class:`fastlock.protocol.rpc.RpcConnection`,
the ``asyncio.Protocol`` under the client, the CLI and the standby's link: its
``request`` gives a request the connection's next id, remembers one future for it and
writes the frame (at once on an idle connection; behind requests still in flight, into one
write per event-loop turn: :meth:`RpcWire.write_frame`); its ``data_received`` decodes a read (the connection's
:class:`~fastlock.protocol.FrameDecoder`, under the same limits) and resolves each
reply's future from the decoded reply (``[id, 0, value]``: the value; ``[id, code,
message, extra]``: the error :func:`~fastlock.errors.error_from_wire` builds).  Pushes
(request id 0), bad bytes and the liveness watchdog are ``RpcConnection``'s.

:func:`feed_frames` is :meth:`FrameDecoder.feed <fastlock.protocol.FrameDecoder.feed>`
with its common case compiled (a read that is one whole frame, decoded by one
``msgpack.unpackb`` under the decoder's limits); every other read goes to ``feed``.
Both connection sides decode their reads with it.
"""

from msgpack import unpackb

from ..errors import ConnectionLost, ProtocolError, error_from_wire
from .framing import WHOLE_SKIP, packb

cdef object _ProtocolError = ProtocolError
cdef object _ConnectionLost = ConnectionLost
cdef object _error_from_wire = error_from_wire
cdef object _packb = packb
cdef object _unpackb = unpackb


cpdef list feed_frames(object decoder, object data):
    """``decoder.feed(data)`` (a :class:`~fastlock.protocol.FrameDecoder`): every message now
    complete.  A read that is one whole frame while none is in flight is decoded here as
    ``feed`` decodes it (``msgpack.unpackb`` bounded by the read's length and the decoder's
    limits); ``feed`` takes any other read, and one that is not a single whole frame (which
    it then decodes with its streaming decoder, as its own first try would).

    :raises ProtocolError: malformed msgpack or a frame beyond the limits (from ``feed``).
    """
    cdef Py_ssize_t n = len(data)
    if (decoder._fed == decoder._frame_start and decoder._shape is None and not decoder.shape_all
            and not decoder._whole_skip and n <= decoder._whole_max):
        limits = decoder._limits
        try:
            frame = _unpackb(data, max_ext_len=0, max_map_len=limits.max_map_len,
                             max_array_len=limits.max_array_len)
        except Exception:  # several frames, part of one, or bad bytes: feed's streaming decoder
            decoder._whole_skip = WHOLE_SKIP + 1  # (feed counts this read as one it skips)
            return decoder.feed(data)
        decoder._whole_bytes += n
        return [frame]
    return decoder.feed(data)


cdef class RpcWire:
    """The compiled part of a protocol connection to a server (see the module docstring).

    ``transport`` (None before ``connection_made``); ``closed``; ``pending``: request id
    -> future of the requests without a reply yet; ``loop``: the event loop;
    ``last_recv``: ``loop.time()`` when bytes last arrived; ``liveness_timeout``
    (seconds, None: no watchdog); ``_decoder``: the reply decoder; ``_next_id``: the
    next request id; ``_watchdog``: the liveness timer while armed; ``out``: the frames
    written in this loop turn and not yet handed to the transport (None: none), see
    :meth:`write_frame`; ``writes``: transport writes made (an int, for tests and benches).
    """

    cdef public object transport
    cdef public bint closed
    cdef public dict pending
    cdef public object loop
    cdef public object last_recv
    cdef public object liveness_timeout
    cdef public object _decoder
    cdef public object _next_id
    cdef public object _watchdog
    cdef public list out
    cdef public long long writes

    def data_received(self, object data):
        self.last_recv = self.loop.time()  # at or after _ping_sent: the ping is answered
        try:
            messages = feed_frames(self._decoder, data)
        except _ProtocolError as exc:
            self._bad_data(exc, data)
            return
        cdef dict pending = self.pending
        cdef bint pushed = False
        cdef list reply
        for msg in messages:
            if type(msg) is list and len(<list>msg) >= 2:
                reply = <list>msg
                req_id = reply[0]
                status = reply[1]
            else:
                try:
                    req_id = msg[0]
                    status = msg[1]
                except (TypeError, IndexError, KeyError):
                    self._malformed(data)
                    return
                reply = None
            if req_id == 0:
                if not self._push(msg):
                    return
                if type(status) is not int:
                    pushed = True
                continue
            fut = pending.pop(req_id, None)
            if fut is None or fut.done():
                continue
            if status == 0:
                fut.set_result(msg[2])
            else:
                fut.set_exception(_error_from_wire(status, msg[2], msg[3] if len(msg) > 3 else None))
        if pushed:
            self._read_end()

    def request(self, op, *args):
        """Send ``[id, op, *args]``; return a future for its reply's value.

        The future raises the server's error (a :class:`~fastlock.errors.FastlockError`
        subclass), or :class:`~fastlock.errors.ConnectionLost` if the connection ends
        first (at once if it has ended already).
        """
        fut = self.loop.create_future()
        transport = self.transport
        if self.closed or transport is None:
            fut.set_exception(_ConnectionLost(f"connection to {self._where()} is closed"))
            return fut
        req_id = self._next_id
        self._next_id = req_id + 1
        cdef dict pending = self.pending
        cdef bint idle = not pending
        pending[req_id] = fut
        frame = _packb([req_id, op, *args])
        if idle and self.out is None:
            self.writes += 1
            transport.write(frame)  # nothing in flight: at once (one system call, as before)
        else:
            self.write_frame(frame)
        if self._watchdog is None and self.liveness_timeout is not None:
            self._arm_watchdog(self.liveness_timeout)
        return fut

    cpdef write_frame(self, object frame):
        """Write ``frame`` (bytes) behind the requests in flight: frames written in one turn of
        the event loop go to the transport together, in the order written, in one
        ``transport.write`` at the end of the turn (``loop.call_soon`` of :meth:`flush`, armed
        by the first of them), so that many tasks pipelining on one connection cost one
        system call per turn, not one each.  Dropped if the connection has ended."""
        if self.closed or self.transport is None:
            return
        cdef list out = self.out
        if out is None:
            self.out = [frame]
            self.loop.call_soon(self.flush)
        else:
            out.append(frame)

    cpdef flush(self):
        """Hand the frames :meth:`write_frame` kept to the transport now, in one write (none
        if the connection has ended)."""
        cdef list out = self.out
        if out is None:
            return
        self.out = None
        transport = self.transport
        if self.closed or transport is None:
            return
        self.writes += 1
        transport.write(out[0] if len(out) == 1 else b"".join(out))
