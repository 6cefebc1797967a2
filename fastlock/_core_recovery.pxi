# Replication and recovery into the lock table (included by fastlock/_core.pyx).

cdef class _Recovery(_Queries):
    """What a standby, a restart and a promotion install in the table: replicated and
    recovered holders, running lock-delays, the promotion's grant hold."""

    def install_holders(self, holders, now):
        """:meth:`install_holder` for each of ``holders`` (items of 10 fields in the order of
        :class:`fastlock.wal.HolderRecord`: name, token, owner, ttl_ms, lock_delay_ms,
        client_name, correlation_id, granted_wall_ms, shared, limit), each with meta
        ``(client_name, correlation_id)``; returns the longest ``ttl_ms`` (0 if none).
        Recovery's loop over a million leases, in C.

        Raises: as :meth:`install_holder` (the holders before the bad one stay installed).
        """
        cdef int64_t longest = 0
        for h in holders:
            self.install_holder(h[0], h[1], h[2], h[3], h[4], (h[5], h[6]), now, h[8], h[9])
            if h[3] > longest:
                longest = h[3]
        return longest

    cpdef install_holder(self, name, token, owner, ttl_ms, lock_delay_ms, meta, now, shared=False, limit=0):
        """Make (token, owner) the holder of ``name`` with deadline ``now + ttl_ms``.

        Used by WAL replay and by a standby: replaces any current holder silently,
        never queues, ignores any block (lock-delay or grant hold), raises the counter
        to at least the token's counter and the epoch to at least the token's epoch.
        The session of an installed holder is 0.  Queued waiters stay queued, except a
        waiter with the same owner key, which gets EV_WAIT_CANCELLED.

        ``shared`` / ``limit`` (as acquire()) install a non-exclusive lease: it
        replaces an exclusive holder and the same owner's lease, joins the other
        shared holders / permits (the limit is not enforced: the log is the
        authority; leases under another limit are replaced), and sets the name's limit.  An exclusive install replaces every
        holder of the name.

        Raises:
          TypeError / ValueError: a bad argument, e.g. a token outside 1..2**63-1 or
            whose counter part is 0 (state unchanged).
        """
        cdef str n = _name(name)
        cdef int64_t tok = _token(token)
        cdef bytes o
        cdef int64_t ttl, delay, t
        cdef bint sh
        cdef int64_t lim
        cdef _Lock lock
        cdef _Waiter w
        cdef _Lease lease
        if tok & _MAX_COUNTER == 0:
            raise ValueError(f"token {tok} has a zero counter part; no such token is issued")
        o = _owner(owner)
        ttl = _ms(ttl_ms, "ttl_ms", 1)
        delay = _lock_delay(lock_delay_ms)
        t = _ms(now, "now", 0)
        sh = _shared(shared)
        lim = _limit(limit, sh)
        self._advance(t)
        lock = <_Lock>self._locks.get(n)
        if lock is None:
            lock = self._new_lock(n)
        elif lock.head is not None:
            w = lock.by_owner.get(o)
            if w is not None:
                self._cancels += self._withdraw(w, _EV_WAIT_CANCELLED, None, lock, t, t)
        if sh or lim or lock.n_leases:
            # drop the leases this install replaces
            if lock.n_leases:
                for lease in list(lock.leases.values()):
                    if not (sh or lim) or lease.owner == o or lock.limit != lim:
                        self._drop_lease(lock, lease)
            if lock.held and (sh or lim):
                self._drop_holder(lock)
        if sh or lim:
            self._cow(lock)
            lock.limit = lim
            if lock.index >= 0:
                self._unschedule(lock)
            self._install_lease(lock, tok, o, 0, ttl, delay, meta, sh, t)
            self._counter_at_least(tok)
            return
        self._cow(lock)
        lock.limit = 0
        if not lock.held:
            self._n_held += 1
        self._hold(lock, tok, o, 0, ttl, delay, meta, t)
        self._counter_at_least(tok)


    def remove_holder(self, name, token, now):
        """Replay of a release or expiry: drop the holder (of any kind) of ``name`` whose
        token is ``token`` (no event, no lock-delay), then hand the lock to the next waiter as a
        release would.  Returns True if a holder was dropped, else False.

        Raises TypeError / ValueError for a bad argument (state unchanged).
        """
        cdef str n = _name(name)
        cdef int64_t tok = _token(token)
        cdef int64_t t = _ms(now, "now", 0)
        cdef _Lock lock
        cdef _Lease lease
        self._advance(t)
        lock = <_Lock>self._locks.get(n)
        if lock is None:
            return False
        if lock.held and lock.token == tok:
            self._drop_holder(lock)
        else:
            if lock.n_leases == 0:
                return False
            for lease in lock.leases.values():
                if lease.token == tok:
                    break
            else:
                return False
            self._drop_lease(lock, lease)
        self._settle(lock, t, t)
        return True


    def lock_delays(self):
        """Every running lock-delay as ``(name, until_ms)`` pairs (monotonic ms), in no
        particular order: what a snapshot must keep so that a restarted or promoted
        node still refuses the name until the delay has passed.  Includes delays that
        ``expire()`` has not yet processed (until_ms <= now).  Pure query.

        A delay starts when a lease with a lock-delay expires: its EV_EXPIRED event
        carries ``deadline_ms`` and ``lock_delay_ms``, so the delay runs until
        ``deadline_ms + lock_delay_ms`` (the later one if several overlap).
        """
        cdef list out = []
        cdef _Lock lock
        for lock in list(self._delayed.values()):
            if lock.delay_until > 0 and not lock.held:
                out.append((lock.name, lock.delay_until))
            elif lock.delay_until == 0:
                del self._delayed[lock.name]
        return out

    def install_lock_delay(self, name, until_ms, now):
        """Replay of a running lock-delay: no grant on ``name`` before ``until_ms``
        (monotonic ms), as if a lease had expired with that lock-delay.

        A later deadline than the current one wins.  Ignored (returns False) when
        ``until_ms <= now`` or when ``name`` is held exclusively (that holder was
        granted after the delay, which ended it); else returns True.  Waiters stay
        queued until the delay ends.

        Raises TypeError / ValueError for a bad argument (state unchanged).
        """
        cdef str n = _name(name)
        cdef int64_t until = _ms(until_ms, "until_ms", 0)
        cdef int64_t t = _ms(now, "now", 0)
        cdef _Lock lock
        self._advance(t)
        if until <= t:
            return False
        lock = <_Lock>self._locks.get(n)
        if lock is None:
            lock = self._new_lock(n)
        elif lock.held:
            return False
        lock.delay_until = _max(lock.delay_until, until)
        self._delayed[lock.name] = lock
        self._settle(lock, t, t)
        return True

    def hold_grants_until(self, until_ms):
        """Grant no lock before ``until_ms`` (monotonic ms): the promotion grace period,
        as Chubby's new master waits before granting locks that may have been held.

        While ``now < until_ms`` acquire() never grants (wait_ms=0 gets NOT_ACQUIRED,
        other requests queue) and releases/expiries do not hand off; at ``until_ms``
        each blocked lock grants its head waiter, in (deadline, scheduling) order.
        The value replaces the previous one, so an operator can also shorten the hold.
        Existing holders are untouched.

        Raises TypeError / ValueError if until_ms is not an int in 0..MAX_MS.
        """
        cdef int64_t until = _ms(until_ms, "until_ms", 0)
        cdef list blocked = []
        cdef _Entry e
        cdef _Lock lock
        cdef int64_t at
        self._hold_until = until
        for e in self._heap:
            if e.kind == K_BLOCK and (<_Lock>e).head is not None:
                blocked.append(e)
        blocked.sort(key=_entry_key)
        for e in blocked:
            lock = <_Lock>e
            at = _max(lock.delay_until, until)
            if lock.deadline != at:
                self._schedule(lock, at)


def _entry_key(_Entry e):
    return (e.deadline, e.seq)
