# The C declarations of fastlock/client/_lease_slots.pyx, for the compiled request path (_path.pyx).

cdef class LeaseSlots:
    cdef public object _lost
    cdef public object expires_at
    cdef public object _health
    cdef public object sequencer
    cdef public object revoke_request
    cdef public object _revoke_requested
