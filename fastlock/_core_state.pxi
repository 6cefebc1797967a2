# The lock table's state, its deadline heap and its events (included by fastlock/_core.pyx).

cdef class _TableState:
    """The lock table's state: its locks, sessions, counters and fencing counter, the one
    deadline heap (every lease, waiter timeout and lock block, indexed so that a reschedule
    or a removal is O(log n)) and the event queue.  The base of :class:`LockTable`."""
    cdef dict _locks
    cdef dict _delayed           # name -> _Lock: every lock whose lock-delay was set (lock_delays())
    cdef list _heap
    cdef list _events
    cdef dict _sessions          # session -> {_Waiter: None} in arrival order
    cdef int64_t _seq
    cdef int64_t _epoch
    cdef int64_t _counter
    cdef int64_t _hold_until
    cdef int64_t _n_held
    cdef int64_t _n_waiters
    cdef int64_t _grants
    cdef int64_t _releases
    cdef int64_t _expiries
    cdef int64_t _wait_timeouts
    cdef int64_t _cancels
    cdef int64_t _deadlocks
    cdef int64_t _graph_gen      # bumped by every change of waiters or holders (a stopped search's check)

    def __cinit__(self):
        self._locks = {}
        self._delayed = {}
        self._heap = []
        self._events = []
        self._sessions = {}

    # -- heap ------------------------------------------------------------------

    cdef inline void _sift_up(self, Py_ssize_t i, _Entry e):
        cdef list heap = self._heap
        cdef Py_ssize_t p
        cdef _Entry pe
        while i > 0:
            p = (i - 1) >> 1
            pe = <_Entry>heap[p]
            if not _before(e, pe):
                break
            heap[i] = pe
            pe.index = i
            i = p
        heap[i] = e
        e.index = i

    cdef inline void _sift_down(self, Py_ssize_t i, _Entry e):
        cdef list heap = self._heap
        cdef Py_ssize_t n = len(heap)
        cdef Py_ssize_t c
        cdef _Entry ce, re
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            ce = <_Entry>heap[c]
            if c + 1 < n:
                re = <_Entry>heap[c + 1]
                if _before(re, ce):
                    c += 1
                    ce = re
            if not _before(ce, e):
                break
            heap[i] = ce
            ce.index = i
            i = c
        heap[i] = e
        e.index = i

    cdef inline void _schedule(self, _Entry e, int64_t deadline):
        """(Re)schedule ``e`` at ``deadline`` with a fresh seq: O(log n)."""
        cdef Py_ssize_t i = e.index
        self._seq += 1
        e.seq = self._seq
        if i < 0:
            e.deadline = deadline
            self._heap.append(e)
            self._sift_up(len(self._heap) - 1, e)
        elif deadline < e.deadline:
            e.deadline = deadline
            self._sift_up(i, e)
        else:
            e.deadline = deadline
            self._sift_down(i, e)

    cdef inline void _unschedule(self, _Entry e):
        """Remove ``e`` from the heap (no-op if not scheduled): O(log n)."""
        cdef Py_ssize_t i = e.index
        cdef list heap = self._heap
        cdef _Entry last
        if i < 0:
            return
        e.index = -1
        last = <_Entry>heap.pop()
        if last is e:
            return
        if i > 0 and _before(last, <_Entry>heap[(i - 1) >> 1]):
            self._sift_up(i, last)
        else:
            self._sift_down(i, last)

    cdef inline _Entry _pop_top(self):
        cdef list heap = self._heap
        cdef _Entry top = <_Entry>heap[0]
        cdef _Entry last = <_Entry>heap.pop()
        top.index = -1
        if last is not top:
            self._sift_down(0, last)
        return top

    # -- events ----------------------------------------------------------------

    cdef inline Event _event(self, int kind, str name, int64_t token, bytes owner, int64_t session,
                             object request, int64_t ttl_ms, int64_t deadline_ms, object meta,
                             bint fresh, int64_t lock_delay_ms):
        cdef Event ev = Event.__new__(Event)
        ev.kind = kind
        ev.name = name
        ev.token = token
        ev.owner = owner
        ev.session = session
        ev.request = request
        ev.ttl_ms = ttl_ms
        ev.deadline_ms = deadline_ms
        ev.meta = meta
        ev.fresh = fresh
        ev.lock_delay_ms = lock_delay_ms
        ev.waited_ms = 0
        ev.shared = False
        ev.limit = 0
        ev.cycle = None
        self._events.append(ev)
        return ev

    cdef inline Event _waiter_event(self, int kind, _Waiter w):
        """EV_WAIT_TIMEOUT / EV_WAIT_CANCELLED for ``w`` (still linked to its lock)."""
        cdef Event ev = self._event(kind, w.lock.name, 0, w.owner, w.session, w.request, w.ttl_ms, 0,
                                    w.meta, False, w.lock_delay_ms)
        ev.shared = w.shared
        ev.limit = w.lock.limit
        return ev
