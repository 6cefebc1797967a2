# The compiled decoder of fastlock/protocol/_wire.pyx, declared for the server's connection
# (fastlock/server/_wire.pyx), which feeds it a read by a C call; and the compiled base of a
# connection to a server, declared for the client's request path (fastlock/client/_path.pyx),
# which sends a request by a C call.

from libc.stdint cimport uint32_t, uint64_t


cdef class WireDecoder:
    cdef readonly object reference
    cdef bint _shape_all
    cdef bint idle  # the reference has no frame in flight (and has raised nothing)
    cdef Py_ssize_t max_frame
    cdef Py_ssize_t max_array_len
    cdef Py_ssize_t max_map_len
    cdef Py_ssize_t max_str_len
    cdef Py_ssize_t max_bin_len
    cdef long long whole_bytes  # bytes decoded here (never fed to the reference)
    # the read being decoded: the next byte and the end
    cdef const unsigned char* pos
    cdef const unsigned char* end
    cdef bint stop  # the value at pos is left to the reference

    cpdef list feed(self, object data)
    cdef object _value(self, int depth)
    cdef object _str(self, const unsigned char* p, Py_ssize_t size)
    cdef object _bin(self, const unsigned char* p, Py_ssize_t size)
    cdef object _array(self, const unsigned char* p, Py_ssize_t count, int depth)
    cdef object _map(self, const unsigned char* p, Py_ssize_t count, int depth)


cpdef list feed_frames(object decoder, object data)


cdef class RpcWire:
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

    cdef object send(self, object op, tuple args)
    cpdef write_frame(self, object frame)
    cpdef flush(self)
