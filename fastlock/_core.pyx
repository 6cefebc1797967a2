# cython: language_level=3
"""The compiled lock table of fastlock (sans-IO).

A :class:`LockTable` holds, per lock name, the current holder (owner key,
session, fencing token, TTL, deadline, lock-delay) and a FIFO queue of waiters.
It never reads a clock and never does I/O: every state-changing call takes
``now``, the caller's monotonic clock in integer **milliseconds**, first
processes everything that is due at ``now`` (exactly as :meth:`LockTable.expire`
does) and then does its own work.  Outcomes that concern other parties are
queued as :class:`Event` objects and collected with
:meth:`LockTable.drain_events`.

Data structures
---------------
* ``dict`` name -> ``_Lock``.  A lock with no holder, no waiters and no pending
  block is deleted at once, so memory does not grow with the number of names
  ever used.
* Per lock, a doubly linked list of ``_Waiter`` in arrival order (as ZooKeeper's
  sequential nodes) plus a ``dict`` owner -> waiter, so cancel is O(1).
* Per session, an insertion-ordered ``dict`` of its waiters, so
  :meth:`LockTable.drop_session` is O(waiters of that session).
* ONE indexed binary min-heap for every deadline: lease deadlines, waiter
  timeouts and "lock blocked until" ends (lock-delay and the promotion grace
  period).  Entries are keyed by ``(deadline_ms, seq)`` where ``seq`` comes
  from one shared counter each time a deadline is (re)scheduled, and carry
  their own heap index, so reschedule and removal are O(log n) (the idea of
  etcd's lease heap) and :meth:`LockTable.next_deadline` is O(1).  A lock is
  its own heap entry: it is scheduled either for its lease deadline (held) or
  for the end of its block (not held), never both.

Processing order
----------------
:meth:`LockTable.expire` pops due entries in ``(deadline, seq)`` order and
handles each at its *logical* time ``tau`` (its deadline): a lease expiring at
``tau`` hands the lock to the next waiter at ``tau`` unless the lock is blocked
at ``tau``; a waiter whose timeout entry comes later in that order is still
queued at ``tau`` and can be granted.  A lease granted while processing gets
the deadline ``now + ttl_ms`` (a TTL counts from the moment the grant is
made), so it is never processed in the same pass.
"""

cimport cython
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy
from cpython.buffer cimport PyBuffer_FillInfo
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.long cimport PyLong_Check, PyLong_CheckExact
from cpython.bool cimport PyBool_Check


cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object obj, int* overflow) except? -1
    bint PyUnicode_IS_COMPACT_ASCII(object s)
    void* PyUnicode_DATA(object s)
    Py_ssize_t PyUnicode_GET_LENGTH(object s)


cdef enum:
    # acquire() statuses
    _GRANTED = 0
    _QUEUED = 1
    _NOT_ACQUIRED = 2
    _LIMIT_CONFLICT = 3
    # event kinds
    _EV_GRANTED = 1
    _EV_EXPIRED = 2
    _EV_WAIT_TIMEOUT = 3
    _EV_WAIT_CANCELLED = 4
    _EV_DEADLOCK = 5

#: acquire() status: the lock was granted; an EV_GRANTED event carries the lease.
GRANTED = _GRANTED
#: acquire() status: the request waits in the lock's FIFO queue.
QUEUED = _QUEUED
#: acquire() status: wait_ms == 0 and the lock was not free.
NOT_ACQUIRED = _NOT_ACQUIRED
#: acquire() status: the name has holders or waiters under another ``limit`` (a
#: semaphore's limit vs. a lock, or two different limits); nothing changed.
LIMIT_CONFLICT = _LIMIT_CONFLICT

#: Event kind: a lease was granted (immediately or to a waiter), or re-delivered.
EV_GRANTED = _EV_GRANTED
#: Event kind: a lease reached its deadline.
EV_EXPIRED = _EV_EXPIRED
#: Event kind: a waiter's wait_ms ran out; it left the queue.
EV_WAIT_TIMEOUT = _EV_WAIT_TIMEOUT
#: Event kind: a waiter was cancelled or superseded by a retry.
EV_WAIT_CANCELLED = _EV_WAIT_CANCELLED
#: Event kind: a waiter was failed to break a deadlock; ``Event.cycle`` names the cycle.
EV_DEADLOCK = _EV_DEADLOCK

cdef extern from *:
    """
    #define FL_SHIFT 40
    #define FL_MAX_COUNTER ((((long long)1) << 40) - 1)
    #define FL_MAX_EPOCH ((((long long)1) << 23) - 1)
    #define FL_MAX_LOCK_DELAY_MS 60000LL
    #define FL_MAX_MS ((((long long)1) << 53) - 1)
    #define FL_MAX_LIMIT ((((long long)1) << 31) - 1)
    #define FL_MAX_PRIORITY 99LL
    """
    const int64_t _SHIFT "FL_SHIFT"
    const int64_t _MAX_COUNTER "FL_MAX_COUNTER"
    const int64_t _MAX_EPOCH "FL_MAX_EPOCH"
    const int64_t _MAX_LOCK_DELAY_MS "FL_MAX_LOCK_DELAY_MS"
    const int64_t _MAX_MS "FL_MAX_MS"
    const int64_t _MAX_LIMIT "FL_MAX_LIMIT"
    const int64_t _MAX_PRIORITY "FL_MAX_PRIORITY"

#: Bits of a fencing token below the epoch: token = (epoch << TOKEN_EPOCH_SHIFT) | counter
TOKEN_EPOCH_SHIFT = _SHIFT
#: Largest epoch, so that every token stays below 2**63.
MAX_EPOCH = _MAX_EPOCH
#: Largest counter value; a grant that would need a larger one raises OverflowError.
MAX_COUNTER = _MAX_COUNTER
#: Largest lock-delay in milliseconds (Chubby's lock-delay is capped at one minute).
MAX_LOCK_DELAY_MS = _MAX_LOCK_DELAY_MS
#: Largest ``now``, TTL, wait or hold time in milliseconds (2**53 - 1: exact in
#: a float, ~285 000 years), so that deadline arithmetic never overflows.
MAX_MS = _MAX_MS
#: Largest semaphore limit (permits per name).
MAX_LIMIT = _MAX_LIMIT
#: Most names in one acquire_many() request.
MAX_MANY = 64
#: Highest request priority (acquire()'s ``priority``: 0..MAX_PRIORITY, 0 the default).
MAX_PRIORITY = _MAX_PRIORITY
#: Most searches of one break_deadlocks() call (each fails one request per deadlock found).
DEADLOCK_PASSES = 4
#: Steps one break_deadlocks() call makes (its default ``max_work``; a step is a waiter
#: looked at or a graph node entered or left): a search stopped there goes on at the next
#: call (see LockTable.deadlock_backlog).
DEADLOCK_WORK = 10_000

cdef enum:
    K_LEASE = 1   # a lock's lease deadline
    K_BLOCK = 2   # end of a lock's lock-delay / grant hold
    K_WAIT = 3    # a waiter's wait timeout
    K_SHARED = 4  # a non-exclusive lease's deadline (shared holder or semaphore permit)
    K_GROUP = 5   # a multi-lock request's wait timeout


class NotHolder(LookupError):
    """release/extend named a lease that is not the current, unexpired holder."""


# The concepts, each in its own file (included in this order; a class builds on the one before):
include "_core_args.pxi"          # argument checks
include "_core_records.pxi"       # Event, Holder: what a caller gets back
include "_core_encode.pxi"        # msgpack written in C (snapshots)
include "_core_entries.pxi"       # locks, leases, waiters, groups; deadlock parties
include "_core_state.pxi"         # _TableState: fields, the deadline heap, events
include "_core_snapshot.pxi"      # _SnapshotTable: snapshots in slices, copy on write
include "_core_transitions.pxi"   # _Transitions: expiry, grants, hand-off, waiters
include "_core_queries.pxi"       # _Queries: holders, waiters, pages, counters
include "_core_recovery.pxi"      # _Recovery: installed holders, lock-delays, the grant hold
include "_core_deadlock.pxi"      # _DeadlockDetection: wait-for cycles and their victims


# ---------------------------------------------------------------------------
# the table: the fencing counter and the lock operations
# ---------------------------------------------------------------------------

cdef class LockTable(_DeadlockDetection):
    """Leased locks with fencing tokens and FIFO waiters, sans-IO.

    All times are monotonic integer milliseconds given by the caller.  A lease
    is valid while ``now < deadline`` and expired at ``now >= deadline``; a
    waiter has timed out at ``now >= its wait deadline``.

    Fencing tokens are ``(epoch << 40) | counter`` (see :attr:`last_token`):
    the counter grows by one per fresh grant and never goes down, and the
    epoch (raised on promotion) puts every later token above every earlier one.

    The class holds the fencing counter and the lock operations; what it builds on
    is one base class per concept, each in its own file (see the ``include`` lines
    above): state and deadline heap, snapshots, transitions, queries, recovery,
    deadlock detection.
    """

    def __init__(self):
        """An empty table at epoch 0, counter 0, with no grant hold."""

    # -- fencing counter ---------------------------------------------------------

    @property
    def epoch(self):
        """Current epoch (int, read-only; raise it with :meth:`set_epoch`)."""
        return self._epoch

    @property
    def last_token(self):
        """``(epoch << 40) | counter`` (int): every token issued so far is <= it, every
        later one is > it; 0 on a new table."""
        return (self._epoch << _SHIFT) | self._counter

    @property
    def counter(self):
        """The last counter value issued (int, 0..MAX_COUNTER)."""
        return self._counter

    def set_epoch(self, epoch):
        """Raise the epoch to ``epoch`` (a promotion starts a new epoch, like a Raft term).

        Setting the current epoch again is a no-op.

        Raises:
          TypeError: epoch is not an int.
          ValueError: epoch < current epoch, or epoch > MAX_EPOCH.
        """
        cdef int64_t e = _int(epoch, "epoch")
        if e < self._epoch:
            raise ValueError(f"epoch can only go up: {e} < current {self._epoch}")
        if e > _MAX_EPOCH:
            raise ValueError(f"epoch {e} > MAX_EPOCH ({_MAX_EPOCH})")
        self._epoch = e

    def advance_counter(self, counter):
        """Make the counter at least ``counter`` (never lowers it).

        Used on recovery and with counter ranges reserved ahead in the WAL (as
        databases cache sequences), so a lost log tail never causes reuse.

        Raises:
          TypeError: counter is not an int.
          ValueError: counter < 0.
          OverflowError: counter > MAX_COUNTER (2**40 - 1).
        """
        if not PyLong_Check(counter) or PyBool_Check(counter):
            raise TypeError(f"counter must be an int, not {type(counter).__name__}")
        if counter < 0:
            raise ValueError(f"counter must be >= 0, got {counter}")
        if counter > _MAX_COUNTER:
            raise OverflowError(f"counter {counter} > MAX_COUNTER ({_MAX_COUNTER})")
        if <int64_t>counter > self._counter:
            self._counter = <int64_t>counter

    # -- lock operations -----------------------------------------------------------

    cpdef acquire(self, name, owner, session, request, ttl_ms, wait_ms, lock_delay_ms, meta, now,
                shared=False, limit=0, actor=0, priority=0):
        """Grant ``name`` to ``owner`` or queue the request (FIFO, as ZooKeeper's
        sequential nodes).

        Args:
          name (str): lock name, not empty.
          owner (bytes): the client-chosen owner key (request id); a retry with the
            same key finds its existing lease or waiter.
          session (int >= 0): the caller's session (connection); waiting goes by
            session (see drop_session()), ownership by lease.
          request: opaque, handed back in events about this request.
          ttl_ms (int): lease TTL in ms, 1..MAX_MS, counted from the grant.
          wait_ms (int): -1 waits forever, 0 tries once, > 0 waits that many ms.
          lock_delay_ms (int): 0..MAX_LOCK_DELAY_MS ms; if this lease *expires*,
            nobody gets the lock before expiry + lock_delay_ms (Chubby's lock-delay);
            a clean release never applies it.
          meta: opaque, stored with the lease.
          now (int): monotonic ms, 0..MAX_MS.
          shared (bool): ask for a shared (read) lease: any number of shared
            holders or one exclusive holder.  Default False (exclusive).
          limit (int): 0 (default) for a lock; 1..MAX_LIMIT makes ``name`` a
            counting semaphore with at most ``limit`` holders, each permit its
            own lease and fencing token (Curator's InterProcessSemaphoreV2,
            ``consul lock -n``).  Not combined with ``shared``.
          actor (int >= 0): who makes the request within the session (a client's
            task or thread), for deadlock detection only: the holder of a lease
            granted to this request is party ``(session, actor)`` of the wait-for
            graph (see break_deadlocks()).  0 (default): the session as a whole.
          priority (int): 0 (default)..MAX_PRIORITY.  A queued request waits ahead of
            every waiter of a lower priority and behind every one of its own or a higher
            priority (FIFO within a priority, as Apache Helix's priority lock); a retry
            keeps the place and priority it first had.  An exclusive lease granted to
            it carries it (holder_priority()).

        FIFO across kinds (ZooKeeper's shared-lock recipe): a request is granted
        only at the head of the queue (or when the queue is empty) and only if it
        is compatible with the current holders; so readers arriving behind a
        queued writer queue behind it, and consecutive readers (permits) at the
        head are granted together.  Every grant, of every kind, takes a fencing
        token from the one counter.

        Returns GRANTED (an EV_GRANTED event is queued), QUEUED, NOT_ACQUIRED
        (wait_ms == 0 and the request is not grantable now: incompatible holders,
        waiters ahead, or a block) or LIMIT_CONFLICT (the name has holders or
        waiters with another ``limit``: a lock vs a semaphore or two limits;
        the limit is remembered while the name has holders or waiters).

        Idempotent by owner: if ``owner`` already holds ``name`` the existing lease
        is re-delivered (EV_GRANTED with fresh=False, same token and deadline, to
        the new session/request; nothing changes).  If ``owner`` already waits on
        ``name`` the old request gets EV_WAIT_CANCELLED and the waiter keeps its
        place, taking the new session, request, ttl, lock-delay, meta and a wait
        deadline counted from ``now`` (with wait_ms == 0 it leaves the queue and
        NOT_ACQUIRED is returned).  Not re-entrant otherwise: another owner on the
        same session queues.

        A retry of a waiting request keeps the kind (shared or not) it first asked for.

        Raises:
          TypeError / ValueError: a bad argument (state unchanged), e.g. shared with limit > 0.
          OverflowError: the fencing counter is exhausted.
        """
        cdef str n = _name(name)
        cdef bytes o = _owner(owner)
        cdef int64_t s = _session(session)
        cdef int64_t ttl = _ms(ttl_ms, "ttl_ms", 1)
        cdef int64_t wait = _ms(wait_ms, "wait_ms", -1)
        cdef int64_t delay = _lock_delay(lock_delay_ms)
        cdef int64_t t = _ms(now, "now", 0)
        cdef int64_t a = _actor(actor)
        cdef int64_t prio = _priority(priority)
        cdef bint sh
        cdef int64_t lim
        cdef _Lock lock
        cdef _Waiter w
        sh = _shared(shared)
        lim = _limit(limit, sh)
        self._advance(t)
        lock = <_Lock>self._locks.get(n)
        if lock is None:
            if t >= self._hold_until:
                self._check_counter()
                lock = self._new_lock(n)
                if sh or lim:
                    self._cow(lock)
                    lock.limit = lim
                    self._grant_lease(lock, o, s, request, ttl, delay, meta, sh, t, 0, a)
                else:
                    self._grant(lock, o, s, request, ttl, delay, meta, t, 0, a)
                    lock.priority = prio
                return _GRANTED
        else:
            if lock.held:
                if lim != lock.limit:
                    return _LIMIT_CONFLICT
                if lock.owner == o:
                    self._redeliver(lock, o, s, request, t)
                    return _GRANTED
            elif lock.n_leases:
                if lim != lock.limit:
                    return _LIMIT_CONFLICT
                if o in lock.leases:
                    self._redeliver(lock, o, s, request, t)
                    return _GRANTED
            if lock.head is not None:
                if lim != lock.limit:
                    return _LIMIT_CONFLICT
                w = lock.by_owner.get(o)
                if w is not None:
                    if w.group is not None:
                        raise ValueError(f"owner {o!r} waits on {n!r} in an acquire_many() request")
                    return self._retry_waiter(w, s, request, ttl, wait, delay, meta, t, a)
            elif not lock.held and t >= _max(lock.delay_until, self._hold_until):
                if lock.n_leases == 0:
                    self._cow(lock)
                    lock.limit = lim
                    if not (sh or lim):
                        self._check_counter()
                        self._grant(lock, o, s, request, ttl, delay, meta, t, 0, a)
                        lock.priority = prio
                        return _GRANTED
                if lim == 0 or lock.n_leases < lim:
                    if sh or lim:
                        self._check_counter()
                        self._grant_lease(lock, o, s, request, ttl, delay, meta, sh, t, 0, a)
                        return _GRANTED
        if wait == 0:
            return _NOT_ACQUIRED
        if lock is None:
            lock = self._new_lock(n)
            self._cow(lock)
            lock.limit = lim
        elif lock.head is None and not lock.held and lock.n_leases == 0:
            self._cow(lock)
            lock.limit = lim
        w = self._enqueue(lock, o, s, request, ttl, delay, meta, t, sh, None, self._session_index(s), a)
        if prio:
            self._queue_by_priority(w, prio)
        if wait > 0:
            self._schedule(w, t + wait)
        self._settle(lock, t, t)
        return _QUEUED

    cdef object _retry_waiter(self, _Waiter w, int64_t s, object request, int64_t ttl,
                              int64_t wait, int64_t delay, object meta, int64_t t, int64_t a):
        """A retry of the waiting request ``w`` belongs to (its group, if any): the old
        request gets EV_WAIT_CANCELLED per waiter; wait == 0 withdraws it (NOT_ACQUIRED),
        else every waiter keeps its place and takes session ``s``, actor ``a`` and the new
        request, ttl, lock-delay, meta and a wait deadline counted from ``t`` (QUEUED)."""
        cdef list members = [w] if w.group is None else w.group.members
        cdef _Entry entry = w if w.group is None else w.group
        cdef _Waiter m
        self._cancels += len(members)
        for m in members:
            self._waiter_event(_EV_WAIT_CANCELLED, m)
        if wait == 0:
            self._withdraw(w, 0, None, None, t, t)
            return _NOT_ACQUIRED
        for m in members:
            if s != m.session:
                self._forget_session_waiter(m)
                self._session_index(s)[m] = None
                m.session = s
            m.actor = a
            m.request = request
            m.ttl_ms = ttl
            m.lock_delay_ms = delay
            m.enqueued_ms = t  # the reply answers this request: its wait counts from now
            self._graph_gen += 1
            m.meta = meta
        if wait > 0:
            self._schedule(entry, t + wait)
        else:
            self._unschedule(entry)
        return _QUEUED

    def acquire_many(self, items, owner, session, request, ttl_ms, wait_ms, lock_delay_ms, meta, now,
                     actor=0):
        """Take a set of locks atomically: all granted together or none, one queued request.

        Args:
          items (list or tuple of ``(name, shared)`` pairs): 1..MAX_MANY distinct names,
            each exclusive (shared False) or shared (True); semaphores are not allowed.
          owner, session, request, ttl_ms, wait_ms, lock_delay_ms, meta, now, actor: as
            acquire(), for every lease of the set.

        Granted (GRANTED, one EV_GRANTED per name in request order, each lease with its
        own fencing token) when every name could be granted on its own at once: no
        waiter, not blocked, compatible with its holders.  Otherwise (unless
        wait_ms == 0: NOT_ACQUIRED) it queues ONE request with a waiter at the tail of
        every name's queue (QUEUED) and holds none of them while it waits.  It is
        granted when each of its waiters heads its queue and is compatible with that
        name's holders (checked whenever one of its names settles); until then each
        waiter blocks the queue behind it, so FIFO holds per name.

        No deadlock among queued requests: queue order on every name is arrival order,
        so of two requests sharing names the earlier one is ahead on every shared name
        and nothing waits for a later request; and a waiting set holds nothing.  (A
        client that *holds* locks and waits can still deadlock: break_deadlocks().)

        Returns GRANTED, QUEUED, NOT_ACQUIRED or LIMIT_CONFLICT (a name is a semaphore).
        A retry with the same owner re-delivers the leases (fresh=False) if the owner
        holds every name, or keeps the waiting request's place (the old request gets
        EV_WAIT_CANCELLED per name; wait_ms == 0 withdraws it).  A wait timeout,
        cancel() of any of its names, drop_session() or break_deadlocks() removes the
        whole request (an event per name).

        Raises:
          TypeError / ValueError: a bad argument, or ``owner`` already holds or waits on
            some of the names in another way (nothing changes).
          OverflowError: the fencing counter cannot cover the set.
        """
        cdef list names = []
        cdef list kinds = []
        cdef bytes o
        cdef int64_t s, ttl, wait, delay, t, a
        cdef Py_ssize_t i, k
        cdef _Lock lock
        cdef _Waiter w, first
        cdef _Group g
        cdef dict sess
        cdef bint free, held_all, holds_any = False
        if type(items) is not list and type(items) is not tuple:
            raise TypeError(f"items must be a list or tuple, not {type(items).__name__}")
        if not 1 <= len(items) <= MAX_MANY:
            raise ValueError(f"items must hold 1..{MAX_MANY} names, got {len(items)}")
        for item in items:
            if (type(item) is not tuple and type(item) is not list) or len(item) != 2:
                raise TypeError("each item must be a (name, shared) pair")
            names.append(_name(item[0]))
            kinds.append(_shared(item[1]))
        if len(set(names)) != len(names):
            raise ValueError("items name a lock twice")
        o = _owner(owner)
        s = _session(session)
        ttl = _ms(ttl_ms, "ttl_ms", 1)
        wait = _ms(wait_ms, "wait_ms", -1)
        delay = _lock_delay(lock_delay_ms)
        t = _ms(now, "now", 0)
        a = _actor(actor)
        self._advance(t)
        k = len(names)
        # a semaphore among the names; the owner's earlier request on them
        first = None
        held_all = True
        for i in range(k):
            lock = <_Lock>self._locks.get(names[i])
            if lock is None:
                held_all = False
                continue
            if lock.limit and (lock.n_leases or lock.head is not None):
                return _LIMIT_CONFLICT
            w = None if lock.head is None else <_Waiter>lock.by_owner.get(o)
            if w is not None:
                if w.group is None or len(w.group.members) != k or (first is not None and w.group is not first.group):
                    raise ValueError(f"owner {o!r} already waits on {names[i]!r} in another request")
                first = w
            if (lock.held and lock.owner == o) or (lock.n_leases and o in lock.leases):
                holds_any = True
            if not ((lock.held and lock.owner == o and not kinds[i])
                    or (lock.n_leases and kinds[i] and o in lock.leases)):
                held_all = False
        if holds_any and not held_all:
            raise ValueError(f"owner {o!r} already holds some of these names in another request")
        if first is not None:
            if held_all:
                raise ValueError(f"owner {o!r} already holds some of these names")
            for w in first.group.members:
                if w.lock.name not in names:
                    raise ValueError(f"owner {w.owner!r} waits in a request for other names")
            return self._retry_waiter(first, s, request, ttl, wait, delay, meta, t, a)
        if held_all:
            for i in range(k):
                self._redeliver(<_Lock>self._locks[names[i]], o, s, request, t)
            return _GRANTED
        free = t >= self._hold_until
        if free:
            for i in range(k):
                lock = <_Lock>self._locks.get(names[i])
                if lock is not None and (lock.head is not None or lock.held or t < lock.delay_until
                                         or (lock.n_leases and not kinds[i])):
                    free = False
                    break
        if free:
            self._check_counter_room(k)
            for i in range(k):
                lock = <_Lock>self._locks.get(names[i])
                if lock is None:
                    lock = self._new_lock(names[i])
                self._cow(lock)
                lock.limit = 0
                if kinds[i]:
                    self._grant_lease(lock, o, s, request, ttl, delay, meta, True, t, 0, a)
                else:
                    self._grant(lock, o, s, request, ttl, delay, meta, t, 0, a)
            return _GRANTED
        if wait == 0:
            return _NOT_ACQUIRED
        g = _Group.__new__(_Group)
        g.index = -1
        g.kind = K_GROUP
        g.members = []
        sess = self._session_index(s)
        for i in range(k):
            lock = <_Lock>self._locks.get(names[i])
            if lock is None:
                lock = self._new_lock(names[i])
            elif lock.head is None and not lock.held and lock.n_leases == 0:
                self._cow(lock)
                lock.limit = 0
            g.members.append(self._enqueue(lock, o, s, request, ttl, delay, meta, t, kinds[i], g, sess, a))
        if wait > 0:
            self._schedule(g, t + wait)
        for w in list(g.members):
            if w.lock is not None:
                self._settle(w.lock, t, t)
        return _QUEUED

    cpdef release(self, name, token, owner, now):
        """Release the lease (``token``, ``owner``) on ``name``; the next waiter (if any)
        is granted (EV_GRANTED), unless grants are held (hold_grants_until()).

        A clean release never applies lock-delay.  Any session may release: ownership
        goes by lease, not by connection.

        Raises:
          NotHolder: (token, owner) is not the unexpired holder of ``name`` (already
            released, expired, or someone else's); nothing changes.
          TypeError / ValueError: a bad argument (state unchanged).
          OverflowError: the fencing counter is exhausted, so the next waiter cannot
            be granted; the release itself took effect and the waiter stays queued.
        """
        cdef str n = _name(name)
        cdef int64_t tok = _token(token)
        cdef bytes o = _owner(owner)
        cdef int64_t t = _ms(now, "now", 0)
        cdef _Lock lock
        cdef _Lease lease
        self._advance(t)
        lock = <_Lock>self._locks.get(n)
        if _holds(lock, tok, o):
            self._drop_holder(lock)
        else:
            lease = self._lease_of(lock, tok, o)
            if lease is None:
                raise NotHolder(f"lease {tok} of {o!r} does not hold {n!r}")
            self._drop_lease(lock, lease)
        self._releases += 1
        self._settle(lock, t, t)

    def release_to(self, name, token, owner, to_owner, now):
        """Release the exclusive lease (``token``, ``owner``) on ``name`` and hand it to the
        waiter ``to_owner`` in the same step: that waiter is moved to the head of the queue
        first, taking the head's priority if that is higher, so it is granted (EV_GRANTED,
        a fresh token) with no gap, unless grants are held (hold_grants_until(); it then
        heads the queue).  A directed hand-off, as
        Kubernetes' coordinated leader election; a clean release (no lock-delay).

        Raises:
          NotHolder: (token, owner) is not the unexpired exclusive holder of ``name``.
          ValueError: ``to_owner`` does not wait on ``name``, or waits in an
            acquire_many() request or for a shared lease.  Nothing changes on any error.
          TypeError: a bad argument (state unchanged).
          OverflowError: as release().
        """
        cdef str n = _name(name)
        cdef int64_t tok = _token(token)
        cdef bytes o = _owner(owner)
        cdef bytes to = _owner(to_owner)
        cdef int64_t t = _ms(now, "now", 0)
        cdef _Lock lock
        cdef _Waiter w
        self._advance(t)
        lock = <_Lock>self._locks.get(n)
        if not _holds(lock, tok, o):
            raise NotHolder(f"lease {tok} of {o!r} does not hold {n!r} exclusively")
        w = None if lock.head is None else <_Waiter>lock.by_owner.get(to)
        if w is None:
            raise ValueError(f"{to!r} does not wait on {n!r}")
        if w.group is not None or w.shared:
            raise ValueError(f"{to!r} waits on {n!r} in an acquire_many() request or for a shared lease")
        if w is not lock.head:
            # it takes the head's place and, if higher, its priority: the queue stays in
            # priority order for whoever queues while a grant hold keeps it waiting
            w.priority = _max(w.priority, lock.head.priority)
            self._relink_after(w, None)
        self._drop_holder(lock)
        self._releases += 1
        self._settle(lock, t, t)

    def holder_priority(self, name):
        """The priority (int) the exclusive holder of ``name`` was granted with (0 for a
        lease recovered from a snapshot or the log), or -1 when nobody holds it
        exclusively.  Read without processing deadlines."""
        cdef _Lock lock = <_Lock>self._locks.get(_name(name))
        return lock.priority if lock is not None and lock.held else -1

    def waiter_priority(self, name, owner):
        """The priority (int) of ``owner``'s waiting request on ``name``, -1 if it does
        not wait on it.  O(1)."""
        cdef _Lock lock = <_Lock>self._locks.get(_name(name))
        cdef _Waiter w
        if lock is None or lock.head is None:
            return -1
        w = <_Waiter>lock.by_owner.get(_owner(owner))
        return -1 if w is None else w.priority

    def waiter_priorities(self, name, limit=-1):
        """``(owner, priority)`` of the waiters on ``name`` in queue order (highest
        priority first, FIFO within one), at most ``limit`` (int; < 0: all)."""
        cdef _Lock lock = <_Lock>self._locks.get(_name(name))
        cdef Py_ssize_t most = limit
        cdef list out = []
        cdef _Waiter w
        if lock is not None and most != 0:
            w = lock.head
            while w is not None and len(out) != most:
                out.append((w.owner, w.priority))
                w = w.next
        return out

    cdef inline _Lease _lease_of(self, _Lock lock, int64_t tok, bytes o):
        """The non-exclusive lease (tok, o) of ``lock``, or None."""
        cdef _Lease lease
        if lock is None or lock.n_leases == 0:
            return None
        lease = <_Lease>lock.leases.get(o)
        if lease is None or lease.token != tok:
            return None
        return lease

    def extend(self, name, token, owner, ttl_ms, now, session=None):
        """Set the lease's deadline to ``now + ttl_ms`` (ms) and its TTL to ``ttl_ms``.

        The deadline may move earlier (a shorter TTL).  Returns the new deadline (int ms).
        ``session`` (int >= 0, optional): the session renewing it, which becomes the
        lease's (a client that reconnected holds its leases from its new connection:
        break_deadlocks() sees them as held by it; the actor is kept).

        Raises:
          NotHolder: as release(); an expired lease is never revived.
          TypeError / ValueError: a bad argument (ttl_ms must be 1..MAX_MS); state unchanged.
        """
        cdef str n = _name(name)
        cdef int64_t tok = _token(token)
        cdef bytes o = _owner(owner)
        cdef int64_t ttl = _ms(ttl_ms, "ttl_ms", 1)
        cdef int64_t t = _ms(now, "now", 0)
        cdef int64_t s = -1 if session is None else _session(session)
        cdef _Lock lock
        cdef _Lease lease
        self._advance(t)
        lock = <_Lock>self._locks.get(n)
        if _holds(lock, tok, o):
            self._cow(lock)
            lock.ttl_ms = ttl
            if s >= 0:
                lock.session = s
            self._schedule(lock, t + ttl)
            return t + ttl
        lease = self._lease_of(lock, tok, o)
        if lease is None:
            raise NotHolder(f"lease {tok} of {o!r} does not hold {n!r}")
        self._cow(lock)
        lease.ttl_ms = ttl
        if s >= 0:
            lease.session = s
        self._schedule(lease, t + ttl)
        return t + ttl

    def cancel(self, name, owner, now):
        """Remove the waiter ``owner`` from ``name``'s queue (EV_WAIT_CANCELLED for its request).
        A waiter of an acquire_many() request takes the whole request out of every queue
        (EV_WAIT_CANCELLED per name).

        Returns True if a waiter was removed, False if there is none (it may have
        been granted already: the caller must then release that lease, never leak it).

        Raises TypeError / ValueError for a bad argument (state unchanged).
        """
        cdef str n = _name(name)
        cdef bytes o = _owner(owner)
        cdef int64_t t = _ms(now, "now", 0)
        cdef _Lock lock
        cdef _Waiter w
        self._advance(t)
        lock = <_Lock>self._locks.get(n)
        if lock is None or lock.head is None:
            return False
        w = <_Waiter>lock.by_owner.get(o)
        if w is None:
            return False
        self._cancels += self._withdraw(w, _EV_WAIT_CANCELLED, None, None, t, t)
        return True

    def drop_session(self, session, now):
        """Remove every waiter of ``session`` at once, with no events (its connection is
        gone), then settle the locks they waited on, in the order of the session's first
        waiter on each.  Holders stay: a lease outlives its connection until its TTL.

        O(waiters of that session).  Returns the number of waiters removed.
        Raises TypeError / ValueError for a bad argument (state unchanged).
        """
        cdef int64_t s = _session(session)
        cdef int64_t t = _ms(now, "now", 0)
        cdef dict sess
        cdef _Waiter w
        cdef _Lock lock
        cdef int count = 0
        cdef dict touched = {}
        self._advance(t)
        sess = self._sessions.pop(s, None)
        if sess is None:
            return 0
        # remove them all first, then settle: a waiter of this session must never be
        # granted while its session is being dropped (e.g. a reader behind its writer)
        for w in list(sess):
            touched[w.lock] = None
            self._unlink(w)
            self._cancels += 1
            count += 1
        for lock in touched:
            self._settle(lock, t, t)
        return count

    def expire(self, now):
        """Process every deadline <= ``now`` (ms), in (deadline, scheduling order).

        Leases expire (EV_EXPIRED) and hand off to the next waiter (EV_GRANTED) unless
        the lock is blocked; waits time out (EV_WAIT_TIMEOUT); blocks end and grant.
        Every other state-changing method starts with this same step.

        Raises:
          TypeError / ValueError: a bad ``now``.
          OverflowError: a hand-off needs a token and the fencing counter is exhausted
            (2**40 - 1 grants in the table's life); processing stops at that entry.
        """
        cdef int64_t t = _ms(now, "now", 0)
        self._advance(t)

    cpdef next_deadline(self):
        """Earliest pending deadline in ms (int), or -1 when nothing is scheduled: O(1).

        The server arms ONE timer for it and calls expire() when it fires.
        """
        if len(self._heap) == 0:
            return -1
        return (<_Entry>self._heap[0]).deadline

    cpdef list drain_events(self):
        """Return (and forget) the events queued since the last call, oldest first."""
        cdef list evs = self._events
        self._events = []
        return evs


# ---------------------------------------------------------------------------
# C entry points: the table's calls on a server's request path, for compiled callers that
# cimport them (declared in _core.pxd; fastlock/server/_wire.pyx).  Each is the method of
# the same name (``table``: a LockTable, else TypeError).
# ---------------------------------------------------------------------------

cdef object table_acquire(object table, object name, object owner, object session, object request,
                          object ttl_ms, object wait_ms, object lock_delay_ms, object meta, object now,
                          object shared, object limit, object actor, object priority):
    return (<LockTable?>table).acquire(name, owner, session, request, ttl_ms, wait_ms, lock_delay_ms, meta,
                                       now, shared, limit, actor, priority)


cdef object table_release(object table, object name, object token, object owner, object now):
    return (<LockTable?>table).release(name, token, owner, now)


cdef object table_holder(object table, object name, object now, object owner):
    """(A str ``name`` with no entry has no holder: None at once, without the method's checks of
    its arguments, which the request path passes checked.)"""
    cdef LockTable t = <LockTable?>table
    if type(name) is str and name not in t._locks:
        return None
    return t.holder(name, now, owner)


cdef list table_drain_events(object table):
    return (<LockTable?>table).drain_events()


cdef object table_next_deadline(object table):
    return (<LockTable?>table).next_deadline()


cdef int64_t table_waiter_count(object table) except -1:
    """:attr:`LockTable.waiter_count`."""
    return (<LockTable?>table)._n_waiters


cdef int64_t table_epoch(object table) except -1:
    """:attr:`LockTable.epoch`."""
    return (<LockTable?>table)._epoch


cdef int64_t table_last_token(object table) except -1:
    """:attr:`LockTable.last_token`."""
    cdef LockTable t = <LockTable?>table
    return (t._epoch << _SHIFT) | t._counter
