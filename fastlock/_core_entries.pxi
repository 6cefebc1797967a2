# The lock table's internal entries (included by fastlock/_core.pyx): _Lock, its leases
# and waiters, multi-lock groups (every one an _Entry of the one deadline heap), and the
# deadlock detection's parties and searches (_Node).

cdef class _Node:
    """A node of the wait-for graph (see LockTable.break_deadlocks): a waiter, a
    multi-lock request, a lock or a party.  Its search fields are valid while
    ``dl_search`` is the number of the current search."""
    cdef int64_t dl_search
    cdef int64_t dl_mark  # a lock: the search that found it has a waiter
    cdef int dl_index
    cdef int dl_low
    cdef int dl_comp      # its deadlocked component (numbered from 1), 0 if none
    cdef bint dl_on_stack


@cython.final
cdef class _Party(_Node):
    """A party of the wait-for graph: ``(session, actor)`` and its waiting requests."""
    cdef int64_t session
    cdef int64_t actor
    cdef list requests   # _Waiter or _Group, ascending by _request_key once ``ordered``
    cdef bint ordered


@cython.final
cdef class _Search:
    """A deadlock search (Tarjan's algorithm, iterative) that can stop after any node
    and go on at a later call while the wait-for graph is unchanged (its ``gen``)."""
    cdef int64_t search      # its number (_Node.dl_search)
    cdef int64_t gen         # LockTable._graph_gen when it began
    cdef int64_t t           # its ``now`` and ``min_wait`` (ms)
    cdef int64_t min_wait
    cdef dict holders        # keys of the parties holding a name somebody waits for
    cdef bint marked         # holders is complete
    cdef bint changed        # the graph changed while the parties were being made
    cdef list pending        # every waiter (to find holders), then the waiters of the holders' sessions
    cdef Py_ssize_t j        # the next of them
    cdef dict parties
    cdef list keys           # the parties' keys (None until they are made)
    cdef Py_ssize_t start    # the first root, an index into keys
    cdef Py_ssize_t i        # the root searched from, as an offset from start
    cdef list stack
    cdef list path
    cdef list todo
    cdef list positions
    cdef int counter         # nodes entered
    cdef int n_comp


cdef class _Entry(_Node):
    """A heap entry: keyed by (deadline, seq); ``index`` is its heap slot or -1."""
    cdef int64_t deadline
    cdef int64_t seq
    cdef Py_ssize_t index
    cdef int kind


@cython.final
cdef class _Waiter(_Entry):
    cdef _Lock lock
    cdef bytes owner
    cdef int64_t session
    cdef int64_t actor        # who waits within the session (0: the session as a whole)
    cdef object request
    cdef int64_t ttl_ms
    cdef int64_t lock_delay_ms
    cdef int64_t enqueued_ms  # ``now`` of the acquire this waiter answers
    cdef object meta
    cdef bint shared          # asks for a shared lease (a permit when lock.limit > 0)
    cdef _Group group         # the multi-lock request this waiter is part of, or None
    cdef int64_t priority     # 0..MAX_PRIORITY: queued ahead of every waiter of a lower one
    cdef _Waiter prev
    cdef _Waiter next


@cython.final
cdef class _Group(_Entry):
    """A waiting acquire_many() request: one waiter per name, granted together; the
    group is the heap entry of its wait timeout."""
    cdef list members   # its _Waiter per name, in request order


@cython.final
cdef class _Lease(_Entry):
    """A non-exclusive lease: a shared holder or a semaphore permit (its own heap entry)."""
    cdef _Lock lock
    cdef int64_t token
    cdef bytes owner
    cdef int64_t session
    cdef int64_t actor
    cdef int64_t ttl_ms
    cdef int64_t lock_delay_ms
    cdef object meta
    cdef bint shared


@cython.final
cdef class _Lock(_Entry):
    cdef str name
    # holder (valid while held)
    cdef bint held
    cdef int64_t token
    cdef bytes owner
    cdef int64_t session
    cdef int64_t actor   # the holder's actor (see acquire())
    cdef int64_t ttl_ms
    cdef int64_t lock_delay_ms
    cdef object meta
    # no grant before this (lock-delay after an expiry); 0 when none
    cdef int64_t delay_until
    cdef int64_t priority  # the holder's request priority (0 unless granted to one)
    # waiter queue: by priority, highest first, FIFO within a priority
    cdef _Waiter head
    cdef _Waiter tail
    cdef dict by_owner   # owner -> _Waiter; None until the first waiter
    # non-exclusive holders (shared leases or semaphore permits), in grant order
    cdef dict leases     # owner -> _Lease; None until the first non-exclusive grant
    cdef int64_t n_leases
    # semaphore limit (0: a lock); meaningful while the name has holders or waiters
    cdef int64_t limit
    # the snapshot in progress (LockTable._snap_gen) that has its holders already
    cdef int64_t snap_gen


cdef inline bint _before(_Entry a, _Entry b):
    return a.deadline < b.deadline or (a.deadline == b.deadline and a.seq < b.seq)


cdef inline bint _holds(_Lock lock, int64_t tok, bytes o):
    """True iff (tok, o) is the exclusive holder of ``lock`` (None: no lock)."""
    return lock is not None and lock.held and lock.token == tok and lock.owner == o


cdef inline int64_t _max(int64_t a, int64_t b):
    return a if a > b else b
