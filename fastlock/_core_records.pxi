# The public value objects of fastlock._core (included by _core.pyx): Event, what the
# table tells its caller happened, and Holder, a snapshot of one lease.

@cython.freelist(256)
cdef class Event:
    """Something that happened to a party other than the caller.

    Attributes (all read-only):
      kind: EV_GRANTED, EV_EXPIRED, EV_WAIT_TIMEOUT or EV_WAIT_CANCELLED.
      name: the lock name.
      token: EV_GRANTED / EV_EXPIRED: the lease's fencing token; else 0.
      owner: the owner key given to acquire().
      session: session of the waiter, or of the holder (EV_EXPIRED), or of the
        request a lease is (re-)delivered to (EV_GRANTED).
      request: the opaque object given to acquire() (None for EV_EXPIRED).
      ttl_ms: lease TTL in ms (EV_GRANTED/EV_EXPIRED) or the TTL the waiter asked for.
      deadline_ms: EV_GRANTED: lease deadline (grant time + ttl_ms);
        EV_EXPIRED: the deadline that was reached; else 0.
      meta: the opaque object given to acquire() (the lease's for EV_GRANTED/EV_EXPIRED).
      fresh: EV_GRANTED: False when an idempotent retry re-delivers an existing lease.
      waited_ms: EV_GRANTED: the grant's time minus the time the request being
        answered arrived (acquire()'s ``now``), in ms: 0 for an immediate grant,
        how long it waited in the queue for a queued one, and <= 0 for a
        re-delivered lease (its grant - or last extend - came before the
        request).  The requester can date the grant no earlier than its own
        send time plus this, whatever happened between (see the client).
      lock_delay_ms: the lock-delay stored with the lease / asked by the waiter
        (extra field, so a WAL record of a grant can be replayed with install_holder()).
      shared: True for a shared (read) lease or a waiter asking for one.
      limit: the semaphore limit of the lease / waiter (0: not a semaphore permit).
      cycle: EV_DEADLOCK: the wait-for cycle as a tuple of ``(session, name)``
        steps, the failed waiter's first: each session waits on that name for the
        next session (the last for the first); None for every other kind.
    """
    # (its fields are declared in _core.pxd)

    def __repr__(self):
        kinds = {1: "GRANTED", 2: "EXPIRED", 3: "WAIT_TIMEOUT", 4: "WAIT_CANCELLED", 5: "DEADLOCK"}
        return (f"<Event {kinds.get(self.kind, self.kind)} name={self.name!r} token={self.token} "
                f"owner={self.owner!r} session={self.session} ttl_ms={self.ttl_ms} "
                f"deadline_ms={self.deadline_ms} fresh={self.fresh} waited_ms={self.waited_ms} "
                f"shared={self.shared} limit={self.limit}>")


cdef class Holder:
    """A snapshot of a lock's holder (read-only; later calls do not change it).

    Attributes: name (str), token (int), owner (bytes), session (int; 0 for a
    holder installed by install_holder()), ttl_ms (ms), deadline_ms (monotonic
    ms), lock_delay_ms (ms), meta (opaque), shared (bool: a shared/read lease),
    limit (int: the semaphore limit of a permit, 0 otherwise).
    """
    # (its fields are declared in _core.pxd)

    def __repr__(self):
        return (f"<Holder name={self.name!r} token={self.token} owner={self.owner!r} "
                f"session={self.session} ttl_ms={self.ttl_ms} deadline_ms={self.deadline_ms} "
                f"shared={self.shared} limit={self.limit}>")
