# cython: language_level=3
"""The compiled reply path of a connection to a server (see fastlock/protocol/rpc.py).

:class:`RpcWire` is the compiled base of :class:`fastlock.protocol.rpc.RpcConnection`,
the ``asyncio.Protocol`` under the client, the CLI and the standby's link: its
``request`` gives a request the connection's next id, remembers one future for it and
writes the frame (at once on an idle connection; behind requests still in flight, into one
write per event-loop turn: :meth:`RpcWire.write_frame`); its ``data_received`` decodes a read (the connection's
:class:`WireDecoder`, under the reply limits) and resolves each
reply's future from the decoded reply (``[id, 0, value]``: the value; ``[id, code,
message, extra]``: the error :func:`~fastlock.errors.error_from_wire` builds).  A read that
resolves several replies opens the turn's write itself: the requests of the tasks those replies
wake go out in one write after them, not the first at once and the rest in a second one.  Pushes
(request id 0), bad bytes and the liveness watchdog are ``RpcConnection``'s.

:func:`feed_frames` is :meth:`FrameDecoder.feed <fastlock.protocol.FrameDecoder.feed>`
with its common case compiled (a read that is one whole frame, decoded by one
``msgpack.unpackb`` under the decoder's limits); every other read goes to ``feed``.
Both connection sides decode their reads with it.

:class:`WireDecoder` is :class:`~fastlock.protocol.FrameDecoder` compiled: the same
``feed``, limits and errors, with msgpack's objects built straight from the read's bytes
while no frame is in flight (see the class).  Both connection sides decode with it.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_SetItem
from cpython.float cimport PyFloat_FromDouble
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_FromLongLong, PyLong_FromUnsignedLongLong
from cpython.ref cimport PyObject, Py_DECREF, Py_INCREF
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcpy

from msgpack import unpackb

from ..errors import ConnectionLost, ProtocolError, error_from_wire
from .framing import WHOLE_SKIP, FrameDecoder, packb

cdef extern from "Python.h":
    PyObject* PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)
    void PyUnicode_InternInPlace(PyObject** p)
    void PyErr_Clear()

cdef object _ProtocolError = ProtocolError
cdef object _ConnectionLost = ConnectionLost
cdef object _error_from_wire = error_from_wire
cdef object _packb = packb
cdef object _unpackb = unpackb


cpdef list feed_frames(object decoder, object data):
    """``decoder.feed(data)`` (a :class:`WireDecoder` or a
    :class:`~fastlock.protocol.FrameDecoder`): every message now complete.  A
    :class:`WireDecoder`'s ``feed`` is called directly.  For a ``FrameDecoder``, a read
    that is one whole frame while none is in flight is decoded here as ``feed`` decodes it
    (``msgpack.unpackb`` bounded by the read's length and the decoder's limits); ``feed``
    takes any other read, and one that is not a single whole frame (which it then decodes
    with its streaming decoder, as its own first try would).

    :raises ProtocolError: malformed msgpack or a frame beyond the limits (from ``feed``).
    """
    cdef Py_ssize_t n
    if type(decoder) is WireDecoder:
        return (<WireDecoder>decoder).feed(data)
    n = len(data)
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


cdef enum:
    NEST_MAX = 32  # containers nested deeper than this in one frame are left to msgpack (WireDecoder)


cdef inline uint32_t _be16(const unsigned char* p) noexcept:
    return (<uint32_t>p[0] << 8) | p[1]


cdef inline uint32_t _be32(const unsigned char* p) noexcept:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef inline uint64_t _be64(const unsigned char* p) noexcept:
    return (<uint64_t>_be32(p) << 32) | _be32(p + 4)


cdef class WireDecoder:
    """:class:`~fastlock.protocol.FrameDecoder` compiled: ``feed(data)`` returns the messages
    now complete, under the same :class:`~fastlock.protocol.DecodeLimits`, raising the same
    :class:`~fastlock.errors.ProtocolError` for the same bytes.

    ``max_frame`` (bytes), ``limits`` and ``shape_all`` are ``FrameDecoder``'s; the decoder
    holds a ``FrameDecoder`` (``reference``) built from them.  While no frame is in flight
    and frames are not walked first (``shape_all`` false), a read (``bytes`` of at most
    ``max_frame_bytes``) is decoded here frame after frame, each msgpack object built
    straight from the read's bytes as msgpack's ``Unpacker(raw=False, strict_map_key=True)``
    builds it (nil, bool, int, float, str as UTF-8, bin as bytes, array as list, map as
    dict).  At the first byte that is anything else - an ext type, a declared length beyond
    a limit, a str that is not UTF-8, a map key that is not str or bytes, containers nested
    deeper than 32, a frame that does not end in the read - the rest of the read from that
    frame's first byte goes to ``reference.feed``, which decodes it, keeps a partial frame or
    raises exactly as it does for any read; every read while a frame is in flight (or with
    ``shape_all``) goes to it whole.  ``tests/test_wire_decoder.py`` checks this against
    ``FrameDecoder`` over random frames, malformed bytes and random splits.

    :raises ProtocolError: malformed msgpack or a frame beyond the limits; the decoder is
        then unusable and the connection must be closed (as ``FrameDecoder``'s).
    """

    # (its slots are declared in _wire.pxd)

    def __init__(self, max_frame=None, *, limits=None, shape_all=False):
        reference = FrameDecoder(max_frame, limits=limits, shape_all=shape_all)
        self.reference = reference
        limits = reference.limits
        self._shape_all = bool(shape_all)
        self.idle = True
        self.max_frame = limits.max_frame_bytes
        self.max_array_len = limits.max_array_len
        self.max_map_len = limits.max_map_len
        self.max_str_len = limits.max_str_len
        self.max_bin_len = limits.max_bin_len
        self.whole_bytes = 0

    @property
    def limits(self):
        """The :class:`~fastlock.protocol.DecodeLimits` of every frame."""
        return self.reference.limits

    @property
    def fed(self):
        """Bytes fed so far (0: nothing has arrived)."""
        return self.whole_bytes + self.reference.fed

    @property
    def shape_all(self):
        """Walk every frame's headers before decoding it (``FrameDecoder.shape_all``)."""
        return self._shape_all

    @shape_all.setter
    def shape_all(self, value):
        self.reference.shape_all = bool(value)
        self._shape_all = bool(value)

    cpdef list feed(self, object data):
        """Add received bytes (``bytes``); return every message now complete (maybe none).

        :raises ProtocolError: malformed msgpack or a frame beyond the limits.
        """
        cdef Py_ssize_t n, done
        cdef const unsigned char* first
        cdef const unsigned char* start
        cdef list frames
        if self.idle and not self._shape_all and type(data) is bytes:
            n = PyBytes_GET_SIZE(data)
            if 0 < n <= self.max_frame:
                first = <const unsigned char*>PyBytes_AS_STRING(data)
                self.pos = first
                self.end = first + n
                self.stop = False
                frames = []
                while True:
                    start = self.pos
                    value = self._value(0)
                    if self.stop:
                        break
                    frames.append(value)
                    if self.pos == self.end:
                        self.whole_bytes += n
                        return frames
                done = start - first
                self.whole_bytes += done
                self.idle = False
                frames.extend(self.reference.feed(data[done:] if done else data))
                self.idle = self.reference.between_frames
                return frames
        self.idle = False
        frames = self.reference.feed(data)
        self.idle = self.reference.between_frames
        return frames

    cdef object _value(self, int depth):
        """The msgpack object at ``pos`` (``pos`` moves past it); None with ``stop`` set if it
        is left to the reference."""
        cdef const unsigned char* p = self.pos
        cdef Py_ssize_t left = self.end - p
        cdef unsigned int b
        cdef uint32_t f32
        cdef uint64_t u64
        cdef float f
        cdef double d
        if left < 1:
            self.stop = True
            return None
        b = p[0]
        if b <= 0x7F:
            self.pos = p + 1
            return <long>b
        if b >= 0xE0:
            self.pos = p + 1
            return <long>(<int8_t>b)
        if b >= 0xA0 and b <= 0xBF:
            return self._str(p + 1, b & 0x1F)
        if b >= 0x90 and b <= 0x9F:
            return self._array(p + 1, b & 0x0F, depth)
        if b >= 0x80 and b <= 0x8F:
            return self._map(p + 1, b & 0x0F, depth)
        if b == 0xC0:
            self.pos = p + 1
            return None
        if b == 0xC2:
            self.pos = p + 1
            return False
        if b == 0xC3:
            self.pos = p + 1
            return True
        if b == 0xCC or b == 0xD0:
            if left < 2:
                self.stop = True
                return None
            self.pos = p + 2
            return <long>p[1] if b == 0xCC else <long>(<int8_t>p[1])
        if b == 0xCD or b == 0xD1:
            if left < 3:
                self.stop = True
                return None
            self.pos = p + 3
            return <long>_be16(p + 1) if b == 0xCD else <long>(<int16_t>_be16(p + 1))
        if b == 0xCE or b == 0xD2:
            if left < 5:
                self.stop = True
                return None
            self.pos = p + 5
            return PyLong_FromLongLong(<long long>_be32(p + 1) if b == 0xCE else <long long>(<int32_t>_be32(p + 1)))
        if b == 0xCF or b == 0xD3:
            if left < 9:
                self.stop = True
                return None
            self.pos = p + 9
            u64 = _be64(p + 1)
            if b == 0xCF:
                return PyLong_FromUnsignedLongLong(u64)
            return PyLong_FromLongLong(<int64_t>u64)
        if b == 0xCA:
            if left < 5:
                self.stop = True
                return None
            self.pos = p + 5
            f32 = _be32(p + 1)
            memcpy(&f, &f32, 4)
            return PyFloat_FromDouble(<double>f)
        if b == 0xCB:
            if left < 9:
                self.stop = True
                return None
            self.pos = p + 9
            u64 = _be64(p + 1)
            memcpy(&d, &u64, 8)
            return PyFloat_FromDouble(d)
        if b == 0xD9 or b == 0xC4:  # str8, bin8
            if left < 2:
                self.stop = True
                return None
            return self._str(p + 2, p[1]) if b == 0xD9 else self._bin(p + 2, p[1])
        if b == 0xDA or b == 0xC5:  # str16, bin16
            if left < 3:
                self.stop = True
                return None
            return self._str(p + 3, _be16(p + 1)) if b == 0xDA else self._bin(p + 3, _be16(p + 1))
        if b == 0xDB or b == 0xC6:  # str32, bin32
            if left < 5:
                self.stop = True
                return None
            return self._str(p + 5, _be32(p + 1)) if b == 0xDB else self._bin(p + 5, _be32(p + 1))
        if b == 0xDC or b == 0xDE:  # array16, map16
            if left < 3:
                self.stop = True
                return None
            if b == 0xDC:
                return self._array(p + 3, _be16(p + 1), depth)
            return self._map(p + 3, _be16(p + 1), depth)
        if b == 0xDD or b == 0xDF:  # array32, map32
            if left < 5:
                self.stop = True
                return None
            if b == 0xDD:
                return self._array(p + 5, _be32(p + 1), depth)
            return self._map(p + 5, _be32(p + 1), depth)
        self.stop = True  # ext types and 0xC1: the reference's
        return None

    cdef object _str(self, const unsigned char* p, Py_ssize_t size):
        cdef PyObject* text
        if size > self.max_str_len or size > self.end - p:
            self.stop = True
            return None
        text = PyUnicode_DecodeUTF8(<const char*>p, size, NULL)
        if text == NULL:  # not UTF-8: the reference raises msgpack's error
            PyErr_Clear()
            self.stop = True
            return None
        self.pos = p + size
        value = <object>text
        Py_DECREF(value)  # (the new reference PyUnicode_DecodeUTF8 returned)
        return value

    cdef object _bin(self, const unsigned char* p, Py_ssize_t size):
        if size > self.max_bin_len or size > self.end - p:
            self.stop = True
            return None
        self.pos = p + size
        return PyBytes_FromStringAndSize(<const char*>p, size)

    cdef object _array(self, const unsigned char* p, Py_ssize_t count, int depth):
        cdef Py_ssize_t i
        cdef list items
        # every element is one byte at least: a count beyond the bytes left ends past the read
        if count > self.max_array_len or count > self.end - p or depth >= NEST_MAX:
            self.stop = True
            return None
        self.pos = p
        items = PyList_New(count)
        for i in range(count):
            value = self._value(depth + 1)
            if self.stop:
                return None
            Py_INCREF(value)
            PyList_SET_ITEM(items, i, value)
        return items

    cdef object _map(self, const unsigned char* p, Py_ssize_t count, int depth):
        cdef Py_ssize_t i
        cdef dict pairs
        cdef PyObject* interned
        if count > self.max_map_len or count > (self.end - p) // 2 or depth >= NEST_MAX:
            self.stop = True
            return None
        self.pos = p
        pairs = {}
        for i in range(count):
            key = self._value(depth + 1)
            if self.stop:
                return None
            if type(key) is str:  # msgpack interns str keys
                interned = <PyObject*>key
                Py_INCREF(key)
                PyUnicode_InternInPlace(&interned)
                key = <object>interned
                Py_DECREF(key)
            elif type(key) is not bytes:  # strict_map_key: the reference raises
                self.stop = True
                return None
            value = self._value(depth + 1)
            if self.stop:
                return None
            PyDict_SetItem(pairs, key, value)
        return pairs


cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object o, Py_ssize_t* size) except NULL

cdef enum:
    ENCODE_MAX = 2048  # a request frame longer than this is left to msgpack (encode_request)


cdef inline unsigned char* _put_be(unsigned char* p, uint64_t value, int size) noexcept:
    """``value``'s low ``size`` bytes at ``p``, big-endian; the byte after them."""
    cdef int i
    for i in range(size - 1, -1, -1):
        p[i] = <unsigned char>(value & 0xFF)
        value >>= 8
    return p + size


cdef inline unsigned char* _put_uint(unsigned char* p, uint64_t value) noexcept:
    """An unsigned int as msgpack's packer writes it (the smallest form)."""
    if value < 0x80:
        p[0] = <unsigned char>value
        return p + 1
    if value < 0x100:
        p[0] = 0xCC
        return _put_be(p + 1, value, 1)
    if value < 0x10000:
        p[0] = 0xCD
        return _put_be(p + 1, value, 2)
    if value < 0x100000000:
        p[0] = 0xCE
        return _put_be(p + 1, value, 4)
    p[0] = 0xCF
    return _put_be(p + 1, value, 8)


cdef inline unsigned char* _put_int(unsigned char* p, int64_t value) noexcept:
    """A signed int as msgpack's packer writes it (the smallest form)."""
    if value >= 0:
        return _put_uint(p, <uint64_t>value)
    if value >= -32:
        p[0] = <unsigned char>(<int8_t>value)
        return p + 1
    if value >= -0x80:
        p[0] = 0xD0
        return _put_be(p + 1, <uint64_t>value, 1)
    if value >= -0x8000:
        p[0] = 0xD1
        return _put_be(p + 1, <uint64_t>value, 2)
    if value >= -(<int64_t>0x80000000):
        p[0] = 0xD2
        return _put_be(p + 1, <uint64_t>value, 4)
    p[0] = 0xD3
    return _put_be(p + 1, <uint64_t>value, 8)


cdef unsigned char* _put_value(unsigned char* p, unsigned char* end, object value):
    """``value`` (None, a bool, an int of 64 bits, a float, a str, bytes) at ``p`` as
    :data:`~fastlock.protocol.framing.packb` writes it; NULL for any other value, or one
    that does not fit before ``end`` (msgpack's packer takes it)."""
    cdef int overflow = 0
    cdef long long whole
    cdef Py_ssize_t size
    cdef const char* data
    cdef double d
    cdef uint64_t bits
    cdef type kind = type(value)
    if end - p < 9:
        return NULL
    if value is None:
        p[0] = 0xC0
        return p + 1
    if kind is int:
        whole = PyLong_AsLongLongAndOverflow(value, &overflow)
        if overflow:
            return NULL
        return _put_int(p, whole)
    if kind is str:
        data = PyUnicode_AsUTF8AndSize(value, &size)  # (not UTF-8-encodable: raises, the caller falls back)
        if size < 32:
            p[0] = 0xA0 | <unsigned char>size
            p += 1
        elif size < 0x100:
            p[0] = 0xD9
            p = _put_be(p + 1, size, 1)
        elif size < 0x10000:
            p[0] = 0xDA
            p = _put_be(p + 1, size, 2)
        else:
            return NULL
        if end - p < size:
            return NULL
        memcpy(p, data, size)
        return p + size
    if kind is bytes:
        size = PyBytes_GET_SIZE(value)
        if size < 0x100:
            p[0] = 0xC4
            p = _put_be(p + 1, size, 1)
        elif size < 0x10000:
            p[0] = 0xC5
            p = _put_be(p + 1, size, 2)
        else:
            return NULL
        if end - p < size:
            return NULL
        memcpy(p, PyBytes_AS_STRING(value), size)
        return p + size
    if value is True:
        p[0] = 0xC3
        return p + 1
    if value is False:
        p[0] = 0xC2
        return p + 1
    if kind is float:
        d = value
        memcpy(&bits, &d, 8)
        p[0] = 0xCB
        return _put_be(p + 1, bits, 8)
    return NULL


cpdef bytes encode_request(object req_id, object op, tuple args):
    """The frame ``[req_id, op, *args]`` as :data:`~fastlock.protocol.framing.packb` encodes
    it, byte for byte: written here when every element is None, a bool, an int of 64 bits,
    a float, a str or bytes (fewer than 65,536 bytes each, 2,048 in all), by ``packb``
    otherwise (which raises for a value msgpack cannot encode).

    :raises TypeError, ValueError, UnicodeEncodeError: ``packb``'s, for a value it cannot encode.
    """
    cdef unsigned char buf[ENCODE_MAX]
    cdef unsigned char* p = buf
    cdef unsigned char* end = buf + ENCODE_MAX
    cdef Py_ssize_t n = len(args) + 2
    cdef Py_ssize_t i
    if n < 16:
        p[0] = 0x90 | <unsigned char>n
        p += 1
    elif n < 0x10000:
        p[0] = 0xDC
        p = _put_be(p + 1, n, 2)
    else:
        return _packb([req_id, op, *args])
    try:
        p = _put_value(p, end, req_id)
        if p != NULL:
            p = _put_value(p, end, op)
        i = 0
        while p != NULL and i < n - 2:
            p = _put_value(p, end, args[i])
            i += 1
    except UnicodeError:  # a str with a lone surrogate: packb raises its error
        p = NULL
    if p == NULL:
        return _packb([req_id, op, *args])
    return PyBytes_FromStringAndSize(<const char*>buf, p - buf)


cdef class RpcWire:
    """The compiled part of a protocol connection to a server (see the module docstring).

    ``transport`` (None before ``connection_made``); ``closed``; ``pending``: request id
    -> future of the requests without a reply yet; ``loop``: the event loop;
    ``last_recv``: ``loop.time()`` when bytes last arrived; ``liveness_timeout``
    (seconds, None: no watchdog); ``_decoder``: the reply decoder (a :class:`WireDecoder`);
    ``_next_id``: the next request id; ``_watchdog``: the liveness timer while armed; ``out``: the frames
    written in this loop turn and not yet handed to the transport (None: no write of this turn is
    open; a list, empty or not: one is, and :meth:`flush` is due in this turn), see
    :meth:`write_frame` and ``data_received``; ``writes``: transport writes made (an int, for tests and benches).
    """

    # (its slots are declared in _wire.pxd)

    def data_received(self, object data):
        self.last_recv = self.loop.time()  # at or after _ping_sent: the ping is answered
        try:
            messages = feed_frames(self._decoder, data)
        except _ProtocolError as exc:
            self._bad_data(exc, data)
            return
        cdef dict pending = self.pending
        cdef bint pushed = False
        cdef Py_ssize_t resolved = 0
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
            resolved += 1
            if status == 0:
                fut.set_result(msg[2])
            else:
                fut.set_exception(_error_from_wire(status, msg[2], msg[3] if len(msg) > 3 else None))
        if resolved > 1 and self.out is None and not self.closed:
            # the tasks these replies wake run next, in this loop turn: the requests they write
            # are kept and go out together, after them (flush), in one write
            self.out = []
            self.loop.call_soon(self.flush)
        if pushed:
            self._read_end()

    def request(self, op, *args):
        """Send ``[id, op, *args]``; return a future for its reply's value.

        The future raises the server's error (a :class:`~fastlock.errors.FastlockError`
        subclass), or :class:`~fastlock.errors.ConnectionLost` if the connection ends
        first (at once if it has ended already).
        """
        return self.send(op, args)

    cdef object send(self, object op, tuple args):
        """:meth:`request` ``(op, *args)`` by a C call (the client's compiled request path)."""
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
        frame = encode_request(req_id, op, args)
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
        if not out or self.closed or transport is None:
            return
        self.writes += 1
        transport.write(out[0] if len(out) == 1 else b"".join(out))
