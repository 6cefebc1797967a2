# msgpack written straight from the lock table (included by fastlock/_core.pyx): the same bytes
# as msgpack.Packer(use_bin_type=True) gives for these types, without a Python object per
# holder (LockTable.pack_holders, the snapshots of _core_snapshot.pxi).

cdef struct _Out:
    char* data
    Py_ssize_t size
    Py_ssize_t cap


@cython.final
cdef class Block:
    """Bytes encoded in C, handed over without a copy: a read-only buffer (``bytes(block)``,
    ``memoryview(block)``, ``len(block)``) that frees its memory when collected."""
    cdef char* data
    cdef Py_ssize_t start
    cdef Py_ssize_t size

    def __dealloc__(self):
        free(self.data)

    def __len__(self):
        return self.size

    def __getbuffer__(self, Py_buffer* view, int flags):
        PyBuffer_FillInfo(view, self, self.data + self.start, self.size, 1, flags)

    def __releasebuffer__(self, Py_buffer* view):
        pass


cdef int _reserve(_Out* o, Py_ssize_t extra) except -1:
    cdef Py_ssize_t cap
    cdef char* p
    if o.size + extra <= o.cap:
        return 0
    cap = o.cap * 2
    if cap < o.size + extra:
        cap = o.size + extra
    if cap < 65536:
        cap = 65536
    p = <char*>realloc(o.data, cap)
    if p == NULL:
        raise MemoryError()
    o.data = p
    o.cap = cap
    return 0


cdef inline void _be(_Out* o, uint64_t v, int n):
    """``v`` as ``n`` big-endian bytes (room reserved by the caller)."""
    cdef int i
    for i in range(n):
        o.data[o.size + i] = <char>((v >> (8 * (n - 1 - i))) & 0xff)
    o.size += n


cdef inline void _head(_Out* o, unsigned char code, uint64_t v, int n):
    o.data[o.size] = <char>code
    o.size += 1
    _be(o, v, n)


cdef int _pack_int(_Out* o, int64_t v) except -1:
    _reserve(o, 9)
    if v >= 0:
        if v < 128:
            _be(o, <uint64_t>v, 1)
        elif v < 0x100:
            _head(o, 0xcc, <uint64_t>v, 1)
        elif v < 0x10000:
            _head(o, 0xcd, <uint64_t>v, 2)
        elif v < 0x100000000:
            _head(o, 0xce, <uint64_t>v, 4)
        else:
            _head(o, 0xcf, <uint64_t>v, 8)
    elif v >= -32:
        _be(o, <uint64_t>v & 0xff, 1)
    elif v >= -0x80:
        _head(o, 0xd0, <uint64_t>v & 0xff, 1)
    elif v >= -0x8000:
        _head(o, 0xd1, <uint64_t>v & 0xffff, 2)
    elif v >= -0x80000000:
        _head(o, 0xd2, <uint64_t>v & 0xffffffff, 4)
    else:
        _head(o, 0xd3, <uint64_t>v, 8)
    return 0


cdef int _pack_raw(_Out* o, const char* p, Py_ssize_t n, bint text) except -1:
    """A str (``text``: its UTF-8 bytes) or a bin of ``n`` bytes at ``p``."""
    _reserve(o, n + 5)
    if text and n < 32:
        _be(o, 0xa0 | <uint64_t>n, 1)
    elif n < 0x100:
        _head(o, 0xd9 if text else 0xc4, <uint64_t>n, 1)
    elif n < 0x10000:
        _head(o, 0xda if text else 0xc5, <uint64_t>n, 2)
    else:
        _head(o, 0xdb if text else 0xc6, <uint64_t>n, 4)
    memcpy(o.data + o.size, p, n)
    o.size += n
    return 0


cdef int _pack_obj(_Out* o, object x, object pack) except -1:
    """None, a str or bytes here; anything else through ``pack`` (msgpack's)."""
    cdef bytes b
    if x is None:
        _reserve(o, 1)
        _be(o, 0xc0, 1)
    elif type(x) is str:
        if PyUnicode_IS_COMPACT_ASCII(x):  # its characters are its UTF-8 bytes
            _pack_raw(o, <const char*>PyUnicode_DATA(x), PyUnicode_GET_LENGTH(x), True)
        else:  # (a temporary copy: no UTF-8 cache is left on the str)
            b = (<str>x).encode("utf-8")
            _pack_raw(o, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b), True)
    elif type(x) is bytes:
        _pack_raw(o, PyBytes_AS_STRING(x), PyBytes_GET_SIZE(x), False)
    else:
        b = pack(x)
        _reserve(o, PyBytes_GET_SIZE(b))
        memcpy(o.data + o.size, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))
        o.size += PyBytes_GET_SIZE(b)
    return 0


cdef int _pack_holder(_Out* o, str name, int64_t token, bytes owner, int64_t ttl_ms, int64_t lock_delay_ms,
                      object meta, bint shared, int64_t limit, object pack) except -1:
    """A holder as a WAL snapshot stores it (fastlock.wal.records.HolderRecord): 8 fields
    for an exclusive lease, 10 for a shared lease or a permit; granted_wall_ms 0."""
    cdef bint wide = shared or limit != 0
    _reserve(o, 1)
    _be(o, 0x9a if wide else 0x98, 1)
    _pack_obj(o, name, pack)
    _pack_int(o, token)
    _pack_obj(o, owner, pack)
    _pack_int(o, ttl_ms)
    _pack_int(o, lock_delay_ms)
    if meta:
        _pack_obj(o, meta[0], pack)
        _pack_obj(o, meta[1], pack)
    else:
        _reserve(o, 2)
        _be(o, 0xc0c0, 2)
    _pack_int(o, 0)
    if wide:
        _reserve(o, 1)
        _be(o, 0xc3 if shared else 0xc2, 1)
        _pack_int(o, limit)
    return 0
