# The compiled bases of fastlock/replication/_wire.pyx, declared for the server's request path
# (fastlock/server/_wire.pyx, fastlock/server/_watchlog.pyx), which reads their fields in C
# (both compiled with nonecheck, as _wire.pyx is for any code it comes to hold: a typed slot
# still None where it is read raises AttributeError).


cdef class SyncWire:
    cdef public bint enabled


cdef class QueuesWire:
    cdef public set dirty
    cdef public dict shipped
    cdef public set informed


cdef class SourceWire:
    cdef public bint fencing
    cdef public SyncWire sync
    cdef public object ttl
    cdef public dict replicas
