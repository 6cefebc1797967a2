# The lock table's transitions (included by fastlock/_core.pyx).

cdef class _Transitions(_SnapshotTable):
    """What changes a lock: expiry at the due deadlines, grants (exclusive, shared, permits,
    a multi-lock group at once), hand-off to the head waiter, waiters joining and leaving."""

    cdef inline int _advance(self, int64_t now) except -1:
        """Fast check before every operation: expire only if something is due."""
        cdef list heap = self._heap
        if len(heap) > 0 and (<_Entry>heap[0]).deadline <= now:
            self._expire(now)
        return 0

    cdef int _expire(self, int64_t now) except -1:
        cdef list heap = self._heap
        cdef _Entry e
        cdef _Lock lock
        cdef _Lease lease
        cdef int64_t tau
        while len(heap) > 0:
            e = <_Entry>heap[0]
            if e.deadline > now:
                break
            tau = e.deadline
            self._pop_top()
            if e.kind == K_LEASE:
                lock = <_Lock>e
                self._cow(lock)
                lock.held = False
                self._n_held -= 1
                self._expiries += 1
                self._event(_EV_EXPIRED, lock.name, lock.token, lock.owner, lock.session, None,
                            lock.ttl_ms, tau, lock.meta, False, lock.lock_delay_ms)
                if lock.lock_delay_ms > 0:
                    lock.delay_until = _max(lock.delay_until, tau + lock.lock_delay_ms)
                    self._delayed[lock.name] = lock
                lock.owner = None
                lock.meta = None
                self._settle(lock, tau, now)
            elif e.kind == K_WAIT:
                self._wait_timeouts += self._withdraw(<_Waiter>e, _EV_WAIT_TIMEOUT, None, None, tau, now)
            elif e.kind == K_GROUP:
                self._wait_timeouts += self._remove_group(<_Group>e, _EV_WAIT_TIMEOUT, None, None,
                                                          tau, now)
            elif e.kind == K_SHARED:
                lease = <_Lease>e
                lock = lease.lock
                self._drop_lease(lock, lease)
                self._expiries += 1
                self._lease_event(_EV_EXPIRED, lease, lease.session, None, tau, False)
                if lease.lock_delay_ms > 0:
                    lock.delay_until = _max(lock.delay_until, tau + lease.lock_delay_ms)
                    self._delayed[lock.name] = lock
                self._settle(lock, tau, now)
            else:
                self._settle(<_Lock>e, tau, now)
        return 0

    cdef inline int _grant(self, _Lock lock, bytes owner, int64_t session, object request,
                           int64_t ttl_ms, int64_t lock_delay_ms, object meta, int64_t now,
                           int64_t waited_ms, int64_t actor) except -1:
        """Make a fresh grant (caller checked the counter has room); ``waited_ms``
        is how long its request waited (Event.waited_ms)."""
        cdef int64_t token
        self._counter += 1
        token = (self._epoch << _SHIFT) | self._counter
        self._hold(lock, token, owner, session, ttl_ms, lock_delay_ms, meta, now)
        lock.actor = actor
        self._n_held += 1
        self._grants += 1
        self._event(_EV_GRANTED, lock.name, token, owner, session, request, ttl_ms,
                    now + ttl_ms, meta, True, lock_delay_ms).waited_ms = waited_ms
        return 0

    cdef inline void _hold(self, _Lock lock, int64_t token, bytes owner, int64_t session,
                           int64_t ttl_ms, int64_t lock_delay_ms, object meta, int64_t now):
        """Make (token, owner) the exclusive holder of ``lock`` until ``now + ttl_ms``
        (the caller counts it in _n_held if the lock was not held)."""
        self._cow(lock)
        lock.held = True
        lock.token = token
        lock.owner = owner
        lock.session = session
        lock.actor = 0
        lock.priority = 0
        lock.ttl_ms = ttl_ms
        lock.lock_delay_ms = lock_delay_ms
        lock.meta = meta
        lock.delay_until = 0
        lock.kind = K_LEASE
        self._schedule(lock, now + ttl_ms)

    cdef inline int _grant_waiter(self, _Lock lock, _Waiter w, int64_t now) except -1:
        """Grant ``lock`` exclusively to the (unlinked) waiter ``w``."""
        self._grant(lock, w.owner, w.session, w.request, w.ttl_ms, w.lock_delay_ms,
                    w.meta, now, now - w.enqueued_ms, w.actor)
        lock.priority = w.priority
        return 0

    cdef inline int _grant_waiter_lease(self, _Lock lock, _Waiter w, int64_t now) except -1:
        """Grant the (unlinked) waiter ``w`` a non-exclusive lease on ``lock``."""
        return self._grant_lease(lock, w.owner, w.session, w.request, w.ttl_ms, w.lock_delay_ms,
                                 w.meta, w.shared, now, now - w.enqueued_ms, w.actor)

    cdef int _grant_lease(self, _Lock lock, bytes owner, int64_t session, object request,
                          int64_t ttl_ms, int64_t lock_delay_ms, object meta, bint shared,
                          int64_t now, int64_t waited_ms, int64_t actor) except -1:
        """A fresh non-exclusive grant (shared lease or permit); the caller checked
        the counter has room and the lock is not held exclusively."""
        cdef int64_t token
        cdef _Lease lease
        self._counter += 1
        token = (self._epoch << _SHIFT) | self._counter
        if lock.index >= 0:
            self._unschedule(lock)  # the end of a block: the lock is not held
        lease = self._install_lease(lock, token, owner, session, ttl_ms, lock_delay_ms, meta, shared,
                                    now)
        lease.actor = actor
        self._grants += 1
        self._lease_event(_EV_GRANTED, lease, session, request, now + ttl_ms, True).waited_ms = waited_ms
        return 0

    cdef inline Event _lease_event(self, int kind, _Lease lease, int64_t session, object request,
                                   int64_t deadline_ms, bint fresh):
        """An event about the non-exclusive ``lease`` (for ``session``/``request``)."""
        cdef Event ev = self._event(kind, lease.lock.name, lease.token, lease.owner, session, request,
                                    lease.ttl_ms, deadline_ms, lease.meta, fresh, lease.lock_delay_ms)
        ev.shared = lease.shared
        ev.limit = lease.lock.limit
        return ev

    cdef inline Event _redeliver(self, _Lock lock, bytes o, int64_t s, object request, int64_t t):
        """EV_GRANTED (fresh=False) re-delivering ``o``'s lease on ``lock`` to a retry
        (``s``, ``request``) made at ``t``: granted (or last extended) at deadline - ttl."""
        cdef _Lease lease
        cdef Event ev
        if lock.held:
            ev = self._event(_EV_GRANTED, lock.name, lock.token, o, s, request, lock.ttl_ms,
                             lock.deadline, lock.meta, False, lock.lock_delay_ms)
            ev.waited_ms = lock.deadline - lock.ttl_ms - t
        else:
            lease = <_Lease>lock.leases[o]
            ev = self._lease_event(_EV_GRANTED, lease, s, request, lease.deadline, False)
            ev.waited_ms = lease.deadline - lease.ttl_ms - t
        return ev

    cdef inline void _drop_lease(self, _Lock lock, _Lease lease):
        self._cow(lock)
        del lock.leases[lease.owner]
        lock.n_leases -= 1
        self._n_held -= 1
        self._unschedule(lease)

    cdef inline int _check_counter(self) except -1:
        return self._check_counter_room(1)

    cdef inline int _check_counter_room(self, Py_ssize_t grants) except -1:
        """Raise OverflowError unless the fencing counter has room for ``grants`` more tokens."""
        if self._counter + grants > _MAX_COUNTER:
            raise OverflowError(
                "fencing counter exhausted (2**40 - 1 grants); tokens never wrap")
        return 0

    cdef void _unlink(self, _Waiter w):
        """Take ``w`` out of its lock's queue, its session index and the heap."""
        cdef _Lock lock = w.lock
        self._graph_gen += 1
        if w.prev is None:
            lock.head = w.next
        else:
            w.prev.next = w.next
        if w.next is None:
            lock.tail = w.prev
        else:
            w.next.prev = w.prev
        w.prev = None
        w.next = None
        del lock.by_owner[w.owner]
        self._unschedule(w)
        self._forget_session_waiter(w)
        self._n_waiters -= 1
        w.lock = None
        if w.group is not None:
            self._unschedule(w.group)

    cdef inline void _forget_session_waiter(self, _Waiter w):
        """Take ``w`` out of its session's index of waiters."""
        cdef dict sess = self._sessions.get(w.session)
        if sess is not None:
            sess.pop(w, None)
            if not sess:
                del self._sessions[w.session]

    cdef inline dict _session_index(self, int64_t s):
        """Session ``s``'s index of waiters ({_Waiter: None} in arrival order), made if new."""
        cdef dict sess = self._sessions.get(s)
        if sess is None:
            sess = {}
            self._sessions[s] = sess
        return sess

    cdef inline _Waiter _enqueue(self, _Lock lock, bytes o, int64_t s, object request, int64_t ttl,
                                 int64_t delay, object meta, int64_t t, bint shared, _Group group,
                                 dict sess, int64_t actor):
        """A new waiter of ``o`` at the tail of ``lock``'s queue, indexed by owner and in
        ``sess`` (session ``s``'s index); not scheduled."""
        cdef _Waiter w = _Waiter.__new__(_Waiter)
        self._graph_gen += 1
        w.index = -1
        w.kind = K_WAIT
        w.lock = lock
        w.owner = o
        w.session = s
        w.actor = actor
        w.request = request
        w.ttl_ms = ttl
        w.lock_delay_ms = delay
        w.enqueued_ms = t
        w.meta = meta
        w.shared = shared
        w.group = group
        w.priority = 0
        if lock.tail is None:
            lock.head = w
        else:
            lock.tail.next = w
            w.prev = lock.tail
        lock.tail = w
        if lock.by_owner is None:
            lock.by_owner = {}
        lock.by_owner[o] = w
        sess[w] = None
        self._n_waiters += 1
        return w

    cdef void _queue_by_priority(self, _Waiter w, int64_t priority):
        """Give the tail waiter ``w`` ``priority`` and move it ahead of every waiter of
        a lower priority (behind every one of its own or a higher priority: FIFO within
        a priority, as Apache Helix's priority lock).  O(waiters it passes)."""
        cdef _Lock lock = w.lock
        cdef _Waiter after = w.prev
        w.priority = priority
        while after is not None and after.priority < priority:
            after = after.prev
        if after is w.prev:
            return
        self._relink_after(w, after)

    cdef void _relink_after(self, _Waiter w, _Waiter after):
        """Move the queued waiter ``w`` to just behind ``after`` (None: to the head)."""
        cdef _Lock lock = w.lock
        self._graph_gen += 1
        if w.prev is None:
            lock.head = w.next
        else:
            w.prev.next = w.next
        if w.next is None:
            lock.tail = w.prev
        else:
            w.next.prev = w.prev
        w.prev = after
        if after is None:
            w.next = lock.head
            lock.head = w
        else:
            w.next = after.next
            after.next = w
        if w.next is None:
            lock.tail = w
        else:
            w.next.prev = w

    cdef Py_ssize_t _withdraw(self, _Waiter w, int kind, object cycle, _Lock skip, int64_t tau,
                              int64_t now) except -1:
        """Take the waiting request ``w`` belongs to (its group, if any) out of every
        queue: an event of ``kind`` per waiter (none if kind == 0, ``cycle`` on it), then
        settle its locks at ``tau`` except ``skip``.  Returns the number of waiters removed."""
        cdef _Lock lock = w.lock
        cdef Event ev
        if w.group is not None:
            return self._remove_group(w.group, kind, cycle, skip, tau, now)
        if kind:
            ev = self._waiter_event(kind, w)
            ev.cycle = cycle
        self._unlink(w)
        if lock is not skip:
            self._settle(lock, tau, now)
        return 1

    cdef inline void _schedule_block(self, _Lock lock, int64_t at):
        if lock.index >= 0 and lock.deadline == at:
            return
        lock.kind = K_BLOCK
        self._schedule(lock, at)

    cdef int _settle(self, _Lock lock, int64_t tau, int64_t now) except -1:
        """Bring an unheld lock to rest at logical time ``tau``.

        Hand it to the head waiter unless blocked at ``tau`` (then schedule the
        block's end), keep it while a lock-delay runs, else delete it.
        """
        cdef _Waiter w
        cdef int64_t until
        if lock.held:
            return 0
        if lock.delay_until <= tau:
            lock.delay_until = 0
        if lock.head is not None:
            until = _max(lock.delay_until, self._hold_until)
            if tau >= until:
                w = lock.head
                if lock.n_leases == 0 and not w.shared and lock.limit == 0 and w.group is None:
                    # the common case: an exclusive lock hands off to its head waiter
                    self._check_counter()
                    self._unlink(w)
                    self._grant_waiter(lock, w, now)
                    return 0
                self._unschedule(lock)
                # FIFO across kinds: grant from the head while the head is compatible
                # (consecutive readers together; permits up to the limit)
                while w is not None and not lock.held:
                    if w.group is not None:
                        if not self._group_ready(w.group, tau):
                            break
                        self._grant_group(w.group, now, tau, lock)
                    elif w.shared or lock.limit:
                        if lock.limit and lock.n_leases >= lock.limit:
                            break
                        self._check_counter()
                        self._unlink(w)
                        self._grant_waiter_lease(lock, w, now)
                    else:
                        if lock.n_leases:
                            break
                        self._check_counter()
                        self._unlink(w)
                        self._grant_waiter(lock, w, now)
                        break
                    w = lock.head
            else:
                self._schedule_block(lock, until)
        elif lock.delay_until > tau:
            self._schedule_block(lock, lock.delay_until)
        else:
            self._unschedule(lock)
            if lock.n_leases == 0:
                del self._locks[lock.name]
                if self._delayed:
                    self._delayed.pop(lock.name, None)
        return 0

    cdef bint _group_ready(self, _Group g, int64_t tau):
        """True iff every waiter of ``g`` heads its queue and could be granted at ``tau``."""
        cdef _Waiter m
        cdef _Lock lock
        for m in g.members:
            lock = m.lock
            if lock.head is not m or lock.held or tau < _max(lock.delay_until, self._hold_until):
                return False
            if not m.shared and lock.n_leases:
                return False
        return True

    cdef int _grant_group(self, _Group g, int64_t now, int64_t tau, _Lock skip) except -1:
        """Grant every waiter of ``g`` (one lease and token per name, in request order),
        then settle its other locks at ``tau`` (``skip``: the lock being settled)."""
        cdef _Waiter m
        cdef list members = g.members
        cdef list locks = [m.lock for m in members]
        cdef Py_ssize_t i
        cdef _Lock lock
        self._check_counter_room(len(members))
        for m in members:
            self._unlink(m)
        for i in range(len(members)):
            m = <_Waiter>members[i]
            lock = <_Lock>locks[i]
            if m.shared:
                self._grant_waiter_lease(lock, m, now)
            else:
                self._unschedule(lock)
                self._grant_waiter(lock, m, now)
        for lock in locks:
            if lock is not skip:
                self._settle(lock, tau, now)
        return 0

    cdef Py_ssize_t _remove_group(self, _Group g, int kind, object cycle, _Lock skip, int64_t tau,
                                  int64_t now) except -1:
        """Take every waiter of ``g`` out of its queue (an event of ``kind`` each, none if
        kind == 0), then settle their locks at ``tau`` except ``skip``.  Returns the
        number of waiters removed."""
        cdef _Waiter m
        cdef list locks = [m.lock for m in g.members]
        cdef _Lock lock
        cdef Event ev
        for m in g.members:
            if kind:
                ev = self._waiter_event(kind, m)
                ev.cycle = cycle
            self._unlink(m)
        for lock in locks:
            if lock is not skip:
                self._settle(lock, tau, now)
        return len(locks)

    cdef inline _Lock _new_lock(self, str name):
        cdef _Lock lock = _Lock.__new__(_Lock)
        lock.name = name
        lock.index = -1
        self._locks[name] = lock
        return lock

    cdef inline void _drop_holder(self, _Lock lock):
        self._cow(lock)
        lock.held = False
        lock.owner = None
        lock.meta = None
        self._n_held -= 1
        self._unschedule(lock)


    cdef inline void _counter_at_least(self, int64_t tok):
        """Raise the counter and the epoch to at least those of ``tok``."""
        cdef int64_t ctr = tok & _MAX_COUNTER
        if ctr > self._counter:
            self._counter = ctr
        if (tok >> _SHIFT) > self._epoch:
            self._epoch = tok >> _SHIFT

    cdef inline _Lease _install_lease(self, _Lock lock, int64_t tok, bytes o, int64_t session, int64_t ttl,
                                      int64_t delay, object meta, bint sh, int64_t t):
        """Add the non-exclusive lease (tok, o) of ``session`` to ``lock`` until ``t + ttl``
        (the lock is not held exclusively, nor by ``o``); returns it."""
        cdef _Lease lease = _Lease.__new__(_Lease)
        self._cow(lock)
        lock.delay_until = 0
        lease.index = -1
        lease.kind = K_SHARED
        lease.lock = lock
        lease.token = tok
        lease.owner = o
        lease.session = session
        lease.ttl_ms = ttl
        lease.lock_delay_ms = delay
        lease.meta = meta
        lease.shared = sh
        if lock.leases is None:
            lock.leases = {}
        lock.leases[o] = lease
        lock.n_leases += 1
        self._n_held += 1
        self._schedule(lease, t + ttl)
        return lease
