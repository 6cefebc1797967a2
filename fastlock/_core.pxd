# What compiled callers of fastlock/_core.pyx reach by C: the value objects' fields, read as C
# structs (the server's batch end reads every grant's event, fastlock/server/_wire.pyx; the
# fields are documented with the classes, fastlock/_core_records.pxi), and the table's calls on
# a server's request path.

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


# the table's calls on a server's request path, by C calls (_core.pyx, its end)
cdef object table_acquire(object table, object name, object owner, object session, object request,
                          object ttl_ms, object wait_ms, object lock_delay_ms, object meta, object now,
                          object shared, object limit, object actor, object priority)
cdef object table_release(object table, object name, object token, object owner, object now)
cdef object table_holder(object table, object name, object now, object owner)
cdef list table_drain_events(object table)
cdef object table_next_deadline(object table)
cdef int64_t table_waiter_count(object table) except -1
cdef int64_t table_epoch(object table) except -1
cdef int64_t table_last_token(object table) except -1
