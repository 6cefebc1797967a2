# The lock table's queries (included by fastlock/_core.pyx).

cdef class _Queries(_Transitions):
    """What the table holds, read without processing deadlines: holders, waiters, pages of
    held locks for the operator, counters."""

    cpdef holder(self, name, now, owner=None):
        """An unexpired holder of ``name`` at ``now`` as a :class:`Holder` snapshot, or None.

        Without ``owner``: the exclusive holder, else the earliest-granted unexpired
        shared holder / permit (see holders_of() for all of them).  With ``owner``
        (bytes): that owner's unexpired lease of any kind, or None.

        Pure query: a lease whose deadline is <= now counts as gone even if expire()
        has not processed it yet (call expire(now) first to see hand-offs).
        """
        cdef str n = _name(name)
        cdef int64_t t = _ms(now, "now", 0)
        cdef bytes o = None if owner is None else _owner(owner)
        cdef _Lock lock = <_Lock>self._locks.get(n)
        cdef _Lease lease
        if lock is None:
            return None
        if lock.held:
            if lock.deadline <= t or (o is not None and lock.owner != o):
                return None
            return self._snapshot(lock)
        if lock.n_leases == 0:
            return None
        if o is not None:
            lease = <_Lease>lock.leases.get(o)
            if lease is None or lease.deadline <= t:
                return None
            return self._lease_snapshot(lock, lease)
        for lease in lock.leases.values():
            if lease.deadline > t:
                return self._lease_snapshot(lock, lease)
        return None

    def holders_of(self, name, now, start=0, limit=-1):
        """Every unexpired holder of ``name`` at ``now`` (:class:`Holder` snapshots):
        the exclusive holder, or the shared holders / permits in grant order.  Pure query.
        ``start`` (int >= 0) skips that many of them, ``limit`` (int; < 0: no limit)
        returns at most that many: a page is built without the others' snapshots."""
        cdef str n = _name(name)
        cdef int64_t t = _ms(now, "now", 0)
        cdef Py_ssize_t skip = start
        cdef Py_ssize_t most = limit
        cdef _Lock lock = <_Lock>self._locks.get(n)
        cdef _Lease lease
        cdef list out = []
        if lock is None or most == 0:
            return out
        if lock.held:
            if lock.deadline > t and skip == 0:
                out.append(self._snapshot(lock))
        elif lock.n_leases:
            for lease in lock.leases.values():
                if lease.deadline > t:
                    if skip > 0:
                        skip -= 1
                        continue
                    out.append(self._lease_snapshot(lock, lease))
                    if len(out) == most:
                        break
        return out

    def holder_count(self, name, now):
        """Number of unexpired holders of ``name`` at ``now`` (int), counted without
        snapshots.  Pure query."""
        cdef _Lock lock = <_Lock>self._locks.get(_name(name))
        cdef int64_t t = _ms(now, "now", 0)
        cdef _Lease lease
        cdef int64_t n = 0
        if lock is None:
            return 0
        if lock.held:
            return 1 if lock.deadline > t else 0
        if lock.n_leases:
            for lease in lock.leases.values():
                if lease.deadline > t:
                    n += 1
        return n

    cdef Holder _lease_snapshot(self, _Lock lock, _Lease lease):
        cdef Holder h = Holder.__new__(Holder)
        h.name = lock.name
        h.token = lease.token
        h.owner = lease.owner
        h.session = lease.session
        h.ttl_ms = lease.ttl_ms
        h.deadline_ms = lease.deadline
        h.lock_delay_ms = lease.lock_delay_ms
        h.meta = lease.meta
        h.shared = lease.shared
        h.limit = lock.limit
        return h

    cdef Holder _snapshot(self, _Lock lock):
        cdef Holder h = Holder.__new__(Holder)
        h.name = lock.name
        h.token = lock.token
        h.owner = lock.owner
        h.session = lock.session
        h.ttl_ms = lock.ttl_ms
        h.deadline_ms = lock.deadline
        h.lock_delay_ms = lock.lock_delay_ms
        h.meta = lock.meta
        h.shared = False
        h.limit = 0
        return h

    def check(self, name, token, now):
        """True iff ``token`` is the token of an unexpired holder of ``name`` at ``now``
        (Chubby's sequencer check): the exclusive holder, or any shared holder / permit
        (O(holders) for those).  Pure query."""
        cdef str n = _name(name)
        cdef int64_t tok = _token(token)
        cdef int64_t t = _ms(now, "now", 0)
        cdef _Lock lock = <_Lock>self._locks.get(n)
        cdef _Lease lease
        if lock is None:
            return False
        if lock.held:
            return lock.token == tok and t < lock.deadline
        if lock.n_leases:
            for lease in lock.leases.values():
                if lease.token == tok:
                    return t < lease.deadline
        return False

    def waiters(self, name):
        """Owners (bytes) waiting on ``name``, in FIFO order."""
        cdef str n = _name(name)
        cdef _Lock lock = <_Lock>self._locks.get(n)
        cdef list out = []
        cdef _Waiter w
        if lock is not None:
            w = lock.head
            while w is not None:
                out.append(w.owner)
                w = w.next
        return out

    def waiter_details(self, name, start=0, limit=-1):
        """The waiters of ``name`` in FIFO order, each as a tuple
        (session, shared, limit, meta, many): ``limit`` is the name's semaphore
        limit (0 for a lock), ``many`` whether the waiter is part of an
        acquire_many() request.  For contenders(); owners are not included.
        ``start`` (int >= 0) skips that many waiters, ``limit`` (int; < 0: no limit)
        returns at most that many: a page is built without the others' tuples."""
        cdef str n = _name(name)
        cdef Py_ssize_t skip = start
        cdef Py_ssize_t most = limit
        cdef _Lock lock = <_Lock>self._locks.get(n)
        cdef list out = []
        cdef _Waiter w
        if lock is not None and most != 0:
            w = lock.head
            while w is not None and skip > 0:
                w = w.next
                skip -= 1
            while w is not None and len(out) != most:
                out.append((w.session, bool(w.shared) and lock.limit == 0, lock.limit, w.meta,
                            w.group is not None))
                w = w.next
        return out

    def waiter_info(self, name, limit=-1):
        """The waiters on ``name`` in FIFO order, each ``(owner, session, meta, enqueued_ms,
        deadline_ms, shared)``: ``enqueued_ms`` is the ``now`` of the acquire it answers,
        ``deadline_ms`` when its wait runs out (its acquire_many() request's, for a member
        of one), -1 for a wait without end.  Times in milliseconds.  At most ``limit``
        (int; < 0: all), the first in the queue."""
        cdef str n = _name(name)
        cdef Py_ssize_t most = limit
        cdef _Lock lock = <_Lock>self._locks.get(n)
        cdef list out = []
        cdef _Waiter w
        cdef _Entry e
        if lock is not None and most != 0:
            w = lock.head
            while w is not None and len(out) != most:
                e = w.group if w.group is not None else w
                out.append((w.owner, w.session, w.meta, w.enqueued_ms,
                            e.deadline if e.index >= 0 else -1, bool(w.shared)))
                w = w.next
        return out

    def queue_length(self, name):
        """Number of waiters on ``name`` (int)."""
        cdef _Lock lock = <_Lock>self._locks.get(_name(name))
        return 0 if lock is None or lock.by_owner is None else len(lock.by_owner)

    def session_waiters(self, session):
        """Number of waiters of ``session`` (int)."""
        cdef int64_t s = _session(session)
        cdef dict sess = self._sessions.get(s)
        return 0 if sess is None else len(sess)

    def holders(self):
        """Every current holder as :class:`Holder` snapshots (for snapshots/replication),
        in no particular order; includes leases past their deadline that expire() has
        not processed yet."""
        cdef list out = []
        cdef _Lock lock
        cdef _Lease lease
        for lock in self._locks.values():
            if lock.held:
                out.append(self._snapshot(lock))
            elif lock.n_leases:
                for lease in lock.leases.values():
                    out.append(self._lease_snapshot(lock, lease))
        return out


    def waited_names(self, select=None, unheld=False):
        """The names (str) whose queue holds a waiter, sorted: each whatever its state (held,
        free behind a lock-delay or the promotion grace, an acquire_many() member waiting for
        its other names); only those ``select(name)`` is true for (a callable; None: every
        one); with ``unheld`` only those without any lease (exclusive, shared or permit; a
        lease past its deadline that expire() has not processed counts as one, as holders()).
        A slot move takes the waiters of its slots out with it (fastlock.server.sharded).

        Raises TypeError if ``select`` is neither None nor callable (state unchanged); an
        error ``select`` raises propagates (state unchanged).
        """
        cdef list out = []
        cdef _Lock lock
        cdef bint only_unheld = bool(unheld)
        if select is not None and not callable(select):
            raise TypeError("select must be None or a callable(name) -> bool")
        for lock in self._locks.values():
            if lock.head is None or (only_unheld and (lock.held or lock.n_leases)):
                continue
            if select is None or select(lock.name):
                out.append(lock.name)
        out.sort()
        return out

    def held_page(self, prefix, after, limit, by_waiters, now):
        """One page of the locks held at ``now`` whose name starts with ``prefix``
        (str; "" for all), for the operator's listing: every lock is looked at in C,
        and only the page's names are sorted and returned, so a table of a million
        leases builds no row for the locks outside the page.  Pure query.

        ``after`` (str or None): only names above it (the last name of the previous
        page; with ``by_waiters`` False).  ``limit`` (int >= 1): most names in the page.
        ``by_waiters``: the locks with the most waiters first (then by name), the
        locks without waiters after them by name; else by name.

        Returns ``(page, matched)``: ``page`` a list of ``(name, waiters)`` in page
        order, ``waiters`` the length of the lock's queue; ``matched`` the number of
        unexpired leases (each shared holder and permit counts) of every matching lock."""
        import heapq
        if type(prefix) is not str:
            raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
        if after is not None and type(after) is not str:
            raise TypeError(f"after must be a str or None, not {type(after).__name__}")
        cdef str p = <str>prefix
        cdef object a = after
        cdef int64_t n = _int(limit, "limit")
        if n < 1:
            raise ValueError(f"limit must be >= 1, got {n}")
        cdef int64_t t = _ms(now, "now", 0)
        cdef bint rank = bool(by_waiters)
        cdef list names = []
        cdef list waited = []
        cdef int64_t matched = 0
        cdef int64_t live
        cdef Py_ssize_t nw
        cdef _Lock lock
        cdef _Lease lease
        cdef str name
        for lock in self._locks.values():
            if lock.held:
                if lock.deadline <= t:
                    continue
                live = 1
            elif lock.n_leases:
                live = 0
                for lease in lock.leases.values():
                    if lease.deadline > t:
                        live += 1
                if not live:
                    continue
            else:
                continue
            name = lock.name
            if p and not name.startswith(p):
                continue
            if a is not None and name <= <str>a:
                continue
            matched += live
            nw = 0 if lock.by_owner is None else len(lock.by_owner)
            if rank and nw:
                waited.append((-nw, name))
            else:
                names.append(name)
        cdef list page = [(nm, -neg) for neg, nm in heapq.nsmallest(n, waited)] if rank else []
        if len(page) < n:
            for name in heapq.nsmallest(n - len(page), names):
                lock = <_Lock>self._locks[name]
                page.append((name, 0 if lock.by_owner is None else len(lock.by_owner)))
        return page, matched

    def stats(self):
        """Counters (dict str -> int): locks_held (leases held: each shared holder and
        each permit counts), waiters, grants (fresh grants),
        releases, expiries, wait_timeouts, cancels (waiters removed by cancel(), by a
        retry, or by drop_session()), deadlocks (waiters failed by break_deadlocks()), plus locks (table entries) and deadlines
        (heap size)."""
        return {
            "locks_held": self._n_held,
            "waiters": self._n_waiters,
            "grants": self._grants,
            "releases": self._releases,
            "expiries": self._expiries,
            "wait_timeouts": self._wait_timeouts,
            "cancels": self._cancels,
            "deadlocks": self._deadlocks,
            "locks": len(self._locks),
            "deadlines": len(self._heap),
        }

    def __len__(self):
        """Number of leases currently held (each shared holder and permit counts)."""
        return self._n_held

    @property
    def waiter_count(self):
        """Number of waiters queued on every lock together (int)."""
        return self._n_waiters
