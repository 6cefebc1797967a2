# The value objects of fastlock/_core.pyx that compiled callers read as C structs (the server's
# batch end reads every grant's event, fastlock/server/_wire.pyx).  Their fields are documented
# with the classes (fastlock/_core_records.pxi).

cimport cython
from libc.stdint cimport int64_t


@cython.final
cdef class Event:
    cdef readonly int kind
    cdef readonly str name
    cdef readonly int64_t token
    cdef readonly bytes owner
    cdef readonly int64_t session
    cdef readonly object request
    cdef readonly int64_t ttl_ms
    cdef readonly int64_t deadline_ms
    cdef readonly object meta
    cdef readonly bint fresh
    cdef readonly int64_t lock_delay_ms
    cdef readonly int64_t waited_ms
    cdef readonly bint shared
    cdef readonly int64_t limit
    cdef readonly object cycle


@cython.final
cdef class Holder:
    cdef readonly str name
    cdef readonly int64_t token
    cdef readonly bytes owner
    cdef readonly int64_t session
    cdef readonly int64_t ttl_ms
    cdef readonly int64_t deadline_ms
    cdef readonly int64_t lock_delay_ms
    cdef readonly object meta
    cdef readonly bint shared
    cdef readonly int64_t limit
