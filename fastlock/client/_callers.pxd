# The C declarations of fastlock/client/_callers.pyx, for the compiled request path (_path.pyx).

cdef class Caller:
    cdef public object task
    cdef public Caller parent
    cdef public dict held
    cdef public object actor


cpdef Caller party(Caller who, object key)
cpdef current_caller(loop=*)


cdef class HeldLeases:
    cdef public dict by_name  # lock name -> its entry (a HeldLease); read by Client.acquire
    cdef Py_ssize_t _sweep_at
    cdef object _key  # the client, for party(): the id of its connector

    cpdef remember(self, lease, exclusive, loop=*, who=*)
    cdef remember_named(self, lease, name, exclusive, loop, who)
    cpdef forget(self, lease)
    cdef forget_named(self, lease, name, state)
