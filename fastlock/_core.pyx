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
    """
    const int64_t _SHIFT "FL_SHIFT"
    const int64_t _MAX_COUNTER "FL_MAX_COUNTER"
    const int64_t _MAX_EPOCH "FL_MAX_EPOCH"
    const int64_t _MAX_LOCK_DELAY_MS "FL_MAX_LOCK_DELAY_MS"
    const int64_t _MAX_MS "FL_MAX_MS"
    const int64_t _MAX_LIMIT "FL_MAX_LIMIT"

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


# ---------------------------------------------------------------------------
# argument checks (defense in depth: the protocol layer validates first)
# ---------------------------------------------------------------------------

cdef inline int64_t _int(object v, str what) except? -1:
    """``v`` as a C int64; TypeError unless a real int (bool refused), ValueError if huge."""
    cdef int overflow = 0
    cdef long long r
    if not PyLong_CheckExact(v):
        if PyBool_Check(v) or not PyLong_Check(v):
            raise TypeError(f"{what} must be an int, not {type(v).__name__}")
    r = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow:
        raise ValueError(f"{what} out of range: {v!r}")
    return r


cdef inline int64_t _ms(object v, str what, int64_t lo) except? -1:
    """An integer millisecond value in ``lo..MAX_MS``."""
    cdef int64_t r = _int(v, what)
    if r < lo or r > _MAX_MS:
        raise ValueError(f"{what} must be in {lo}..{_MAX_MS} ms, got {r}")
    return r


cdef inline int64_t _token(object v) except? -1:
    cdef int64_t r = _int(v, "token")
    if r < 0:
        raise ValueError(f"token must be >= 0, got {r}")
    return r


cdef inline str _name(object v):
    if type(v) is not str:
        raise TypeError(f"name must be a str, not {type(v).__name__}")
    if not (<str>v):
        raise ValueError("name must not be empty")
    return <str>v


cdef inline bytes _owner(object v):
    if type(v) is not bytes:
        raise TypeError(f"owner must be bytes, not {type(v).__name__}")
    return <bytes>v


cdef inline int64_t _session(object v) except? -1:
    cdef int64_t r = _int(v, "session")
    if r < 0:
        raise ValueError(f"session must be >= 0, got {r}")
    return r


cdef inline int64_t _actor(object v) except? -1:
    cdef int64_t r = _int(v, "actor")
    if r < 0:
        raise ValueError(f"actor must be >= 0, got {r}")
    return r


cdef inline bint _shared(object v) except -1:
    if v is False:
        return False
    if not PyBool_Check(v):
        raise TypeError(f"shared must be a bool, not {type(v).__name__}")
    return v is True


cdef inline int64_t _limit(object v, bint shared) except? -1:
    cdef int64_t r
    if v is 0:
        return 0
    r = _int(v, "limit")
    if r < 0 or r > _MAX_LIMIT:
        raise ValueError(f"limit must be in 0..{_MAX_LIMIT}, got {r}")
    if r and shared:
        raise ValueError("a semaphore permit (limit > 0) cannot also be shared")
    return r


cdef inline int64_t _lock_delay(object v) except? -1:
    cdef int64_t r = _int(v, "lock_delay_ms")
    if r < 0 or r > _MAX_LOCK_DELAY_MS:
        raise ValueError(f"lock_delay_ms must be in 0..{_MAX_LOCK_DELAY_MS}, got {r}")
    return r


# ---------------------------------------------------------------------------
# public value objects
# ---------------------------------------------------------------------------

@cython.freelist(256)
@cython.final
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
    cdef readonly int kind
    cdef readonly str name
    cdef readonly int64_t token
    cdef readonly bytes owner
    cdef readonly int64_t session
    cdef readonly object request
    cdef readonly int64_t ttl_ms
    cdef readonly int64_t deadline_ms
    cdef readonly object meta
    cdef readonly bint fresh
    cdef readonly int64_t lock_delay_ms
    cdef readonly int64_t waited_ms
    cdef readonly bint shared
    cdef readonly int64_t limit
    cdef readonly object cycle

    def __repr__(self):
        kinds = {1: "GRANTED", 2: "EXPIRED", 3: "WAIT_TIMEOUT", 4: "WAIT_CANCELLED", 5: "DEADLOCK"}
        return (f"<Event {kinds.get(self.kind, self.kind)} name={self.name!r} token={self.token} "
                f"owner={self.owner!r} session={self.session} ttl_ms={self.ttl_ms} "
                f"deadline_ms={self.deadline_ms} fresh={self.fresh} waited_ms={self.waited_ms} "
                f"shared={self.shared} limit={self.limit}>")


@cython.final
cdef class Holder:
    """A snapshot of a lock's holder (read-only; later calls do not change it).

    Attributes: name (str), token (int), owner (bytes), session (int; 0 for a
    holder installed by install_holder()), ttl_ms (ms), deadline_ms (monotonic
    ms), lock_delay_ms (ms), meta (opaque), shared (bool: a shared/read lease),
    limit (int: the semaphore limit of a permit, 0 otherwise).
    """
    cdef readonly str name
    cdef readonly int64_t token
    cdef readonly bytes owner
    cdef readonly int64_t session
    cdef readonly int64_t ttl_ms
    cdef readonly int64_t deadline_ms
    cdef readonly int64_t lock_delay_ms
    cdef readonly object meta
    cdef readonly bint shared
    cdef readonly int64_t limit

    def __repr__(self):
        return (f"<Holder name={self.name!r} token={self.token} owner={self.owner!r} "
                f"session={self.session} ttl_ms={self.ttl_ms} deadline_ms={self.deadline_ms} "
                f"shared={self.shared} limit={self.limit}>")


# ---------------------------------------------------------------------------
# msgpack, written straight from the table (LockTable.pack_holders): the same bytes
# as msgpack.Packer(use_bin_type=True) gives for these types, without a Python
# object per holder.

cdef struct _Out:
    char* data
    Py_ssize_t size
    Py_ssize_t cap


@cython.final
cdef class Block:
    """Bytes encoded in C, handed over without a copy: a read-only buffer (``bytes(block)``,
    ``memoryview(block)``, ``len(block)``) that frees its memory when collected."""
    cdef char* data
    cdef Py_ssize_t start
    cdef Py_ssize_t size

    def __dealloc__(self):
        free(self.data)

    def __len__(self):
        return self.size

    def __getbuffer__(self, Py_buffer* view, int flags):
        PyBuffer_FillInfo(view, self, self.data + self.start, self.size, 1, flags)

    def __releasebuffer__(self, Py_buffer* view):
        pass


cdef int _reserve(_Out* o, Py_ssize_t extra) except -1:
    cdef Py_ssize_t cap
    cdef char* p
    if o.size + extra <= o.cap:
        return 0
    cap = o.cap * 2
    if cap < o.size + extra:
        cap = o.size + extra
    if cap < 65536:
        cap = 65536
    p = <char*>realloc(o.data, cap)
    if p == NULL:
        raise MemoryError()
    o.data = p
    o.cap = cap
    return 0


cdef inline void _be(_Out* o, uint64_t v, int n):
    """``v`` as ``n`` big-endian bytes (room reserved by the caller)."""
    cdef int i
    for i in range(n):
        o.data[o.size + i] = <char>((v >> (8 * (n - 1 - i))) & 0xff)
    o.size += n


cdef inline void _head(_Out* o, unsigned char code, uint64_t v, int n):
    o.data[o.size] = <char>code
    o.size += 1
    _be(o, v, n)


cdef int _pack_int(_Out* o, int64_t v) except -1:
    _reserve(o, 9)
    if v >= 0:
        if v < 128:
            _be(o, <uint64_t>v, 1)
        elif v < 0x100:
            _head(o, 0xcc, <uint64_t>v, 1)
        elif v < 0x10000:
            _head(o, 0xcd, <uint64_t>v, 2)
        elif v < 0x100000000:
            _head(o, 0xce, <uint64_t>v, 4)
        else:
            _head(o, 0xcf, <uint64_t>v, 8)
    elif v >= -32:
        _be(o, <uint64_t>v & 0xff, 1)
    elif v >= -0x80:
        _head(o, 0xd0, <uint64_t>v & 0xff, 1)
    elif v >= -0x8000:
        _head(o, 0xd1, <uint64_t>v & 0xffff, 2)
    elif v >= -0x80000000:
        _head(o, 0xd2, <uint64_t>v & 0xffffffff, 4)
    else:
        _head(o, 0xd3, <uint64_t>v, 8)
    return 0


cdef int _pack_raw(_Out* o, const char* p, Py_ssize_t n, bint text) except -1:
    """A str (``text``: its UTF-8 bytes) or a bin of ``n`` bytes at ``p``."""
    _reserve(o, n + 5)
    if text and n < 32:
        _be(o, 0xa0 | <uint64_t>n, 1)
    elif n < 0x100:
        _head(o, 0xd9 if text else 0xc4, <uint64_t>n, 1)
    elif n < 0x10000:
        _head(o, 0xda if text else 0xc5, <uint64_t>n, 2)
    else:
        _head(o, 0xdb if text else 0xc6, <uint64_t>n, 4)
    memcpy(o.data + o.size, p, n)
    o.size += n
    return 0


cdef int _pack_obj(_Out* o, object x, object pack) except -1:
    """None, a str or bytes here; anything else through ``pack`` (msgpack's)."""
    cdef bytes b
    if x is None:
        _reserve(o, 1)
        _be(o, 0xc0, 1)
    elif type(x) is str:
        if PyUnicode_IS_COMPACT_ASCII(x):  # its characters are its UTF-8 bytes
            _pack_raw(o, <const char*>PyUnicode_DATA(x), PyUnicode_GET_LENGTH(x), True)
        else:  # (a temporary copy: no UTF-8 cache is left on the str)
            b = (<str>x).encode("utf-8")
            _pack_raw(o, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b), True)
    elif type(x) is bytes:
        _pack_raw(o, PyBytes_AS_STRING(x), PyBytes_GET_SIZE(x), False)
    else:
        b = pack(x)
        _reserve(o, PyBytes_GET_SIZE(b))
        memcpy(o.data + o.size, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))
        o.size += PyBytes_GET_SIZE(b)
    return 0


cdef int _pack_holder(_Out* o, str name, int64_t token, bytes owner, int64_t ttl_ms, int64_t lock_delay_ms,
                      object meta, bint shared, int64_t limit, object pack) except -1:
    """A holder as a WAL snapshot stores it (fastlock.wal.records.HolderRecord): 8 fields
    for an exclusive lease, 10 for a shared lease or a permit; granted_wall_ms 0."""
    cdef bint wide = shared or limit != 0
    _reserve(o, 1)
    _be(o, 0x9a if wide else 0x98, 1)
    _pack_obj(o, name, pack)
    _pack_int(o, token)
    _pack_obj(o, owner, pack)
    _pack_int(o, ttl_ms)
    _pack_int(o, lock_delay_ms)
    if meta:
        _pack_obj(o, meta[0], pack)
        _pack_obj(o, meta[1], pack)
    else:
        _reserve(o, 2)
        _be(o, 0xc0c0, 2)
    _pack_int(o, 0)
    if wide:
        _reserve(o, 1)
        _be(o, 0xc3 if shared else 0xc2, 1)
        _pack_int(o, limit)
    return 0


# ---------------------------------------------------------------------------
# internal entries
# ---------------------------------------------------------------------------

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
    # FIFO queue
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


# ---------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------

cdef class LockTable:
    """Leased locks with fencing tokens and FIFO waiters, sans-IO.

    All times are monotonic integer milliseconds given by the caller.  A lease
    is valid while ``now < deadline`` and expired at ``now >= deadline``; a
    waiter has timed out at ``now >= its wait deadline``.

    Fencing tokens are ``(epoch << 40) | counter`` (see :attr:`last_token`):
    the counter grows by one per fresh grant and never goes down, and the
    epoch (raised on promotion) puts every later token above every earlier one.
    """
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
    cdef int64_t _searches       # deadlock searches made (numbers _Node.dl_search)
    cdef int64_t _search_nodes   # nodes the last deadlock search visited
    cdef _Search _dl_search      # a search stopped at its work bound, or None
    cdef int64_t _graph_gen      # bumped by every change of waiters or holders (a stopped search's check)
    # the snapshot in progress (snapshot_begin): its number (0: none), the locks it
    # covers, the next one to encode, the holders encoded so far and their count
    cdef int64_t _snap_gen
    cdef int64_t _snap_last
    cdef list _snap_locks
    cdef Py_ssize_t _snap_pos
    cdef _Out _snap_out
    cdef Py_ssize_t _snap_count
    cdef object _snap_pack
    cdef object _snap_error

    def __cinit__(self):
        self._locks = {}
        self._delayed = {}
        self._heap = []
        self._events = []
        self._sessions = {}
        self._snap_out.data = NULL

    def __dealloc__(self):
        free(self._snap_out.data)

    def __init__(self):
        """An empty table at epoch 0, counter 0, with no grant hold."""

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

    # -- internal transitions ------------------------------------------------------

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
        lock.ttl_ms = ttl_ms
        lock.lock_delay_ms = lock_delay_ms
        lock.meta = meta
        lock.delay_until = 0
        lock.kind = K_LEASE
        self._schedule(lock, now + ttl_ms)

    cdef inline int _grant_waiter(self, _Lock lock, _Waiter w, int64_t now) except -1:
        """Grant ``lock`` exclusively to the (unlinked) waiter ``w``."""
        return self._grant(lock, w.owner, w.session, w.request, w.ttl_ms, w.lock_delay_ms,
                           w.meta, now, now - w.enqueued_ms, w.actor)

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

    def acquire(self, name, owner, session, request, ttl_ms, wait_ms, lock_delay_ms, meta, now,
                shared=False, limit=0, actor=0):
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

    def release(self, name, token, owner, now):
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

    def next_deadline(self):
        """Earliest pending deadline in ms (int), or -1 when nothing is scheduled: O(1).

        The server arms ONE timer for it and calls expire() when it fires.
        """
        if len(self._heap) == 0:
            return -1
        return (<_Entry>self._heap[0]).deadline

    def drain_events(self):
        """Return (and forget) the events queued since the last call, oldest first."""
        cdef list evs = self._events
        self._events = []
        return evs

    # -- queries (pure: they never process deadlines) ------------------------------

    def holder(self, name, now, owner=None):
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

    # -- snapshots: encoded in slices, as the table was when begun (copy on write) ----------

    cdef inline void _cow(self, _Lock lock):
        """Before ``lock``'s holders change: a snapshot in progress that has not encoded
        them yet does now.  A failure (out of memory) ends the snapshot, never the change."""
        self._graph_gen += 1
        if self._snap_gen != 0 and lock.snap_gen != self._snap_gen:
            try:
                self._snap_lock(lock)
            except BaseException as exc:
                self._snap_error = exc
                self._snap_gen = 0

    cdef int _snap_lock(self, _Lock lock) except -1:
        """Encode ``lock``'s holders into the snapshot in progress (once per snapshot)."""
        cdef _Lease lease
        lock.snap_gen = self._snap_gen
        if lock.held:
            _pack_holder(&self._snap_out, lock.name, lock.token, lock.owner, lock.ttl_ms, lock.lock_delay_ms,
                         lock.meta, False, 0, self._snap_pack)
            self._snap_count += 1
        elif lock.n_leases:
            for lease in lock.leases.values():
                _pack_holder(&self._snap_out, lock.name, lease.token, lease.owner, lease.ttl_ms,
                             lease.lock_delay_ms, lease.meta, lease.shared, lock.limit, self._snap_pack)
                self._snap_count += 1
        return 0

    cdef void _snap_clear(self):
        free(self._snap_out.data)
        self._snap_out.data = NULL
        self._snap_out.size = 0
        self._snap_out.cap = 0
        self._snap_gen = 0
        self._snap_locks = None
        self._snap_pack = None
        self._snap_error = None
        self._snap_count = 0

    def snapshot_begin(self, pack):
        """Begin a snapshot of every current holder (as :meth:`holders`), encoded as the
        msgpack array a WAL snapshot stores (the bytes
        :func:`fastlock.wal.snapshot.encode_snapshot` gives for them as ``HolderRecord``s
        with ``granted_wall_ms`` 0), in C, with no Python object per holder.

        :meth:`snapshot_step` encodes the next locks; a lock whose holders change before
        its step is encoded just before the change, so the snapshot is the table as it
        is now, whatever happens until :meth:`snapshot_end`.  This call copies a
        reference to each lock (a few ms per million).  ``pack``
        (``msgpack.Packer(use_bin_type=True).pack``) encodes a meta field that is not
        None, a str or bytes.
        :raises RuntimeError: a snapshot is in progress already."""
        if self._snap_locks is not None:
            raise RuntimeError("a snapshot of the lock table is in progress already")
        self._snap_clear()
        _reserve(&self._snap_out, 5 + 64 * len(self._locks))  # (about a lease's size)
        self._snap_out.size = 5  # room for the array header, written once the count is known
        self._snap_last += 1
        self._snap_gen = self._snap_last
        self._snap_pack = pack
        self._snap_locks = list(self._locks.values())
        self._snap_pos = 0

    def snapshot_step(self, max_locks):
        """Encode the holders of up to ``max_locks`` (int >= 1) more locks; True once every
        lock is.  :raises RuntimeError: no snapshot in progress.  :raises MemoryError:
        out of memory (the snapshot ends).  Other errors of ``pack`` end it too."""
        cdef Py_ssize_t i, end
        cdef _Lock lock
        if self._snap_locks is None:
            raise RuntimeError("no snapshot of the lock table is in progress")
        if self._snap_error is not None:
            exc = self._snap_error
            self._snap_clear()
            raise exc
        end = min(self._snap_pos + max(1, <Py_ssize_t>max_locks), len(self._snap_locks))
        try:
            for i in range(self._snap_pos, end):
                lock = <_Lock>self._snap_locks[i]
                if lock.snap_gen != self._snap_gen:
                    self._snap_lock(lock)
        except BaseException:
            self._snap_clear()
            raise
        self._snap_pos = end
        return end == len(self._snap_locks)

    def snapshot_end(self):
        """``(count, data)``: the holders of the snapshot begun, once :meth:`snapshot_step`
        returned True (``data``: a :class:`Block`, the encoded array without a copy); the
        snapshot is over.  :raises RuntimeError: none is complete."""
        cdef Py_ssize_t start, end, count = self._snap_count
        cdef _Out* o = &self._snap_out
        cdef Block block
        if self._snap_locks is None or self._snap_pos < len(self._snap_locks) or self._snap_error is not None:
            raise RuntimeError("no complete snapshot of the lock table")
        try:
            end = o.size
            if count < 16:
                start = 4
                o.size = 4
                _be(o, 0x90 | <uint64_t>count, 1)
            elif count < 0x10000:
                start = 2
                o.size = 2
                _head(o, 0xdc, <uint64_t>count, 2)
            else:
                start = 0
                o.size = 0
                _head(o, 0xdd, <uint64_t>count, 4)
            block = Block.__new__(Block)
            block.data = o.data
            o.data = NULL  # the block owns it now
            block.start = start
            block.size = end - start
            return count, block
        finally:
            self._snap_clear()

    def snapshot_abort(self):
        """End a snapshot in progress (if any) without its result."""
        self._snap_clear()

    def pack_holders(self, pack):
        """``(count, data)``: every current holder encoded at once (:meth:`snapshot_begin`,
        :meth:`snapshot_step` over every lock, :meth:`snapshot_end`).
        :raises RuntimeError: a snapshot is in progress."""
        self.snapshot_begin(pack)
        self.snapshot_step(len(self._snap_locks) + 1)
        return self.snapshot_end()

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

    # -- replication / recovery ------------------------------------------------------

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

    # -- deadlock detection ----------------------------------------------------------

    cdef Py_ssize_t _find_holders(self, _Search sr, Py_ssize_t budget) except -1:
        """Add to ``sr.holders`` the parties ``(session, actor)`` (session 0 left out)
        holding a lease of a name one of ``sr.pending`` waits for - only a lock leads to a
        party in the wait-for graph, so no other party is in a cycle.  Allocates only per
        name.  Stops after ``budget`` waiters (at least one); returns the waiters looked at."""
        cdef Py_ssize_t done = 0
        cdef Py_ssize_t n = len(sr.pending)
        cdef dict holders = sr.holders
        cdef int64_t search = sr.search
        cdef _Waiter w
        cdef _Lock lock
        cdef _Lease lease
        while sr.j < n:
            if done >= budget and done > 0:
                return done
            w = <_Waiter>sr.pending[sr.j]
            sr.j += 1
            done += 1
            lock = w.lock
            if lock is None or lock.dl_mark == search:  # (gone since the search began)
                continue
            lock.dl_mark = search
            if lock.held:
                if lock.session:
                    holders[(lock.session, lock.actor)] = None
            elif lock.n_leases:
                for lease in lock.leases.values():
                    if lease.session:
                        holders[(lease.session, lease.actor)] = None
        return done

    cdef int _restart_search(self, _Search sr) except -1:
        """Start ``sr``'s graph search again (a new search number) from the party it was
        searching from, its parties keeping only their requests still waiting as theirs."""
        cdef _Party p
        cdef _Waiter w
        cdef dict parties = {}
        current = sr.keys[(sr.start + sr.i) % len(sr.keys)] if sr.keys and sr.i >= 0 else None
        for key, p in sr.parties.items():
            kept = []
            for req in p.requests:
                w = <_Waiter>req if type(req) is _Waiter else <_Waiter>(<_Group>req).members[0]
                if w.lock is not None and w.session == p.session and w.actor == p.actor:
                    kept.append(req)
            if kept:
                p.requests = kept
                p.ordered = False
                parties[key] = p
        self._searches += 1
        sr.search = self._searches
        sr.parties = parties
        sr.keys = list(parties)
        sr.start = 0
        if current is not None and current in parties:
            sr.start = sr.keys.index(current)
        sr.i = -1
        sr.stack = []
        sr.path = []
        sr.todo = []
        sr.positions = []
        sr.counter = 0
        sr.n_comp = 0
        return 0

    cdef Py_ssize_t _make_parties(self, _Search sr, Py_ssize_t budget) except -1:
        """Make the search's parties from ``sr.pending``: each holder party with a request
        waiting at least ``min_wait`` ms on a lock (not a semaphore).  Stops after
        ``budget`` waiters (at least one); returns the waiters looked at."""
        cdef Py_ssize_t done = 0
        cdef Py_ssize_t n = len(sr.pending)
        cdef _Waiter w
        cdef _Party p
        while sr.j < n:
            if done >= budget and done > 0:
                return done
            w = <_Waiter>sr.pending[sr.j]
            sr.j += 1
            done += 1
            if w.lock is None or w.lock.limit or sr.t - w.enqueued_ms < sr.min_wait:
                continue  # (gone since the search began, a semaphore wait, or too young)
            key = (w.session, w.actor)
            if key not in sr.holders:
                continue
            if w.group is None:
                req = w
            elif w is (<_Group>w.group).members[0]:  # a multi-lock once, by its first waiter
                req = w.group
            else:
                continue
            p = <_Party>sr.parties.get(key)
            if p is None:
                p = _Party.__new__(_Party)
                p.session = w.session
                p.actor = w.actor
                p.requests = [req]
                sr.parties[key] = p
            else:
                p.requests.append(req)
        return done

    @property
    def deadlock_backlog(self):
        """True while a deadlock search stopped at its call's ``max_work`` with parties
        left to search from: the next break_deadlocks() call goes on from there."""
        return self._dl_search is not None

    def break_deadlocks(self, now, min_wait_ms, max_work=DEADLOCK_WORK):
        """Find and break deadlocks among waiters; returns the cycles broken (a list of
        tuples of ``(session, name)`` steps, as ``Event.cycle``).

        Parties: a request's party is ``(session, actor)`` (acquire()'s ``actor``: a
        client's task or thread; 0 stands for the whole session), and a lease's
        holder is the party of the request it was granted to.  A party that waits
        is blocked: it releases nothing until its wait ends.  The wait-for graph
        has a node per party, per waiting request and per lock (its holders), and
        edges, each O(1) per waiter or holder:

        * party -> each of its requests waiting at least ``min_wait_ms`` (ms since
          the request it answers arrived: PostgreSQL's ``deadlock_timeout``);
        * request -> for each of its waiters (one per name of a multi-lock): the
          request of the waiter just ahead in that queue (FIFO: granted first),
          and the lock if a holder conflicts (any holder for an exclusive waiter,
          the exclusive holder for a shared one);
        * lock -> the party of each holder (session 0, installed holders, is
          unknown and left out).

        Semaphore waiters are left out (a permit waits for ANY holder, so a cycle
        through one is not a deadlock).  A deadlock is a strongly connected
        component (Tarjan's algorithm, iterative) holding at least two parties: a
        party waiting only for itself (two tasks of one session, one holding and
        one waiting) is not one.  In each such component the youngest request of
        one of its parties that lies in the component (latest arrival, then
        greatest name, then owner) is failed: it leaves its queues with
        EV_DEADLOCK (one event per waiter) and its locks are settled.  Its
        ``cycle`` is the shortest path (breadth first, successors in the order
        above; a party's requests ascending, a lock's parties ascending) from
        the failed request back to its party: one ``(session, name)`` step per
        party on it, starting with the failed request's.  Victims are failed in
        ascending age order.  This is repeated while it finds a deadlock, at
        most DEADLOCK_PASSES times per call, and only while the searches so far
        made fewer than ``max_work`` (int >= 0) steps; a later call finds what
        is left.

        Bounded work: a search starts only from the parties that can be in a
        cycle - those with a request waiting at least ``min_wait_ms`` that hold
        a lease of a name somebody waits for (every other party has no edge
        into it) - and a call makes at most ``max_work`` steps (at least one):
        a step is a waiter looked at (every waiter once, to find the names
        waited for and their holders, allocating only per name; then the
        waiters of the holders' sessions, to make the parties) or a node of
        the graph entered or left.  A search that reaches the bound stops and
        the next call goes on with it; if waiters or holders changed meanwhile,
        finding the holders and making the parties go on over what is still
        there (a party that began to hold meanwhile is left to the next
        search), and the graph search starts again from the party it was
        searching from.  Components found before the bound are broken at once
        (:attr:`deadlock_backlog` is True while a search is left unfinished).
        A call whose search fits in ``max_work`` steps is a full search, as
        above; what it breaks does not depend on the bound.

        Raises TypeError / ValueError for a bad argument (state unchanged).
        """
        cdef int64_t t = _ms(now, "now", 0)
        cdef int64_t min_wait = _ms(min_wait_ms, "min_wait_ms", 0)
        cdef int64_t budget = _ms(max_work, "max_work", 0)
        cdef int64_t work = 0
        cdef list broken = []
        cdef list victims
        cdef _Waiter w
        self._advance(t)
        for _ in range(DEADLOCK_PASSES):
            if broken and work >= budget:
                break
            victims = self._deadlock_pass(t, min_wait, budget - work)
            work += self._search_nodes
            if not victims:  # none found, or the search stopped at the bound (None)
                break
            victims.sort(key=_victim_key)
            for req, cycle in victims:
                w = <_Waiter>req if type(req) is _Waiter else <_Waiter>(<_Group>req).members[0]
                if w.lock is None:
                    continue
                self._deadlocks += 1
                broken.append(cycle)
                self._withdraw(w, _EV_DEADLOCK, cycle, None, t, t)
        return broken

    cdef object _deadlock_pass(self, int64_t t, int64_t min_wait, int64_t budget):
        """One search (Tarjan's algorithm, iterative) from each party in turn, or the
        search kept from the last call: [(victim request, cycle)] per deadlocked
        component found.  After ``budget`` steps (at least one; a step is a waiter looked
        at to find the holders or make the parties, or a node entered or left) it stops
        and is kept for the next call (which starts its graph search again from the
        party it was searching from if the graph changed meanwhile, as breaking these
        victims does): it returns the components found so far, or None if none.  Sets
        _search_nodes to the steps this call made."""
        cdef _Search sr = self._dl_search
        cdef list victims = []
        cdef list stack, path, todo, positions, nexts, members
        cdef dict parties
        cdef _Node root, node, nxt, m, parent
        cdef Py_ssize_t pos, top, n, made = 0
        cdef int counter, n_comp, n_parties
        cdef Py_ssize_t steps
        cdef int64_t search
        self._dl_search = None
        self._search_nodes = 0
        if sr is not None and sr.gen != self._graph_gen:
            # The graph changed.  Finding the holders and making the parties go on (over
            # waiters since gone, skipped: at worst a party that began to hold meanwhile is
            # left out, and is found by the next search); the graph search starts again
            # from the party it was searching from, over the parties' requests still waiting.
            if sr.keys is not None:
                self._restart_search(sr)
            else:
                sr.changed = True
            sr.gen = self._graph_gen
        if sr is None:
            self._searches += 1
            sr = _Search.__new__(_Search)
            sr.search = self._searches
            sr.gen = self._graph_gen
            sr.t = t
            sr.min_wait = min_wait
            sr.holders = {}
            sr.marked = False
            sr.changed = False
            sr.pending = [w for sess in self._sessions.values() for w in <dict>sess]
            sr.j = 0
            sr.parties = {}
            sr.keys = None
            sr.i = -1
            sr.stack = []
            sr.path = []
            sr.todo = []
            sr.positions = []
            sr.counter = 0
            sr.n_comp = 0
        if not sr.marked:
            made = self._find_holders(sr, budget)
            if sr.j < len(sr.pending):  # the bound: go on at the next call
                self._search_nodes = made
                self._dl_search = sr
                return None
            sr.marked = True
            if len(sr.holders) < 2:
                return victims
            sr.pending = [w for s in {key[0]: None for key in sr.holders} for w in self._sessions.get(s, ())]
            sr.j = 0
        if sr.keys is None:
            made += self._make_parties(sr, budget - made)
            if sr.j < len(sr.pending):  # the bound: go on making them at the next call
                self._search_nodes = made
                self._dl_search = sr
                return None
            sr.pending = None
            sr.holders = None
            if sr.changed:  # requests made into parties may be gone since
                self._restart_search(sr)
            else:
                sr.keys = list(sr.parties)
                sr.start = 0
        if len(sr.keys) < 2:
            return victims
        search = sr.search
        parties = sr.parties
        stack, path, todo, positions = sr.stack, sr.path, sr.todo, sr.positions
        counter, n_comp = sr.counter, sr.n_comp
        n = len(sr.keys)
        steps = made  # the waiters looked at count as work too
        while True:
            if not path:
                # the next root not reached yet
                while True:
                    sr.i += 1
                    if sr.i >= n:
                        break
                    root = <_Node>parties[sr.keys[(sr.start + sr.i) % n]]
                    if root.dl_search != search:
                        break
                if sr.i >= n:
                    break
                _enter(root, search, counter)
                counter += 1
                steps += 1
                stack.append(root)
                path.append(root)
                todo.append(_successors(root, parties))
                positions.append(0)
            elif steps >= budget and steps > 0:
                # the bound: keep the search for the next call, or restart there after breaking
                sr.counter, sr.n_comp = counter, n_comp
                self._search_nodes = steps
                self._dl_search = sr  # (breaking the victims changes the graph: it starts again there)
                return victims if victims else None
            top = len(path) - 1
            node = <_Node>path[top]
            nexts = <list>todo[top]
            pos = positions[top]
            if pos < len(nexts):
                positions[top] = pos + 1
                nxt = <_Node>nexts[pos]
                if nxt.dl_search != search:
                    _enter(nxt, search, counter)
                    counter += 1
                    steps += 1
                    stack.append(nxt)
                    path.append(nxt)
                    todo.append(_successors(nxt, parties))
                    positions.append(0)
                elif nxt.dl_on_stack and nxt.dl_index < node.dl_low:
                    node.dl_low = nxt.dl_index
                continue
            path.pop()
            todo.pop()
            positions.pop()
            steps += 1
            if top > 0:
                parent = <_Node>path[top - 1]
                if node.dl_low < parent.dl_low:
                    parent.dl_low = node.dl_low
            if node.dl_low != node.dl_index:
                continue
            # node roots a component: pop it off the stack
            if stack[len(stack) - 1] is node:
                stack.pop()
                node.dl_on_stack = False
                continue
            members = []
            n_parties = 0
            while True:
                m = <_Node>stack.pop()
                m.dl_on_stack = False
                members.append(m)
                if type(m) is _Party:
                    n_parties += 1
                if m is node:
                    break
            if n_parties < 2:
                continue
            n_comp += 1
            for m in members:
                m.dl_comp = n_comp
            victims.append(_component_victim(members, parties, n_comp, search))
        self._search_nodes = steps
        return victims

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


def _request_key(req):
    """A waiting request's age key: (arrival ms, name, owner); a multi-lock's
    greatest name."""
    cdef _Waiter w
    if type(req) is _Waiter:
        w = <_Waiter>req
        return (w.enqueued_ms, w.lock.name, w.owner)
    w = <_Waiter>(<_Group>req).members[0]
    return (w.enqueued_ms, max([(<_Waiter>m).lock.name for m in (<_Group>req).members]), w.owner)


def _victim_key(victim):
    return _request_key(victim[0])


cdef inline object _request_of(_Waiter w):
    return w if w.group is None else w.group


cdef inline void _enter(_Node node, int64_t search, int index):
    node.dl_search = search
    node.dl_index = node.dl_low = index
    node.dl_comp = 0
    node.dl_on_stack = True


cdef inline bint _in_comp(_Node node, int cid, int64_t search):
    return node.dl_search == search and node.dl_comp == cid


cdef list _waiter_successors(_Waiter w, list out):
    """Append what ``w`` waits for: the request just ahead of it, its lock if a holder conflicts."""
    cdef _Lock lock = w.lock
    if w.prev is not None:
        out.append(_request_of(w.prev))
    if lock.held or (not w.shared and lock.n_leases):
        out.append(lock)
    return out


cdef list _successors(_Node node, dict parties):
    """The wait-for graph's edges out of ``node`` (see LockTable.break_deadlocks); a
    lock's edges go to the holders' parties that wait (no other can be in a cycle)."""
    cdef list out
    cdef list keys
    cdef _Lock lock
    cdef _Lease lease
    cdef _Waiter m
    cdef _Party party
    if type(node) is _Party:
        party = <_Party>node
        if not party.ordered:  # (sorted when the search first reaches the party)
            if len(party.requests) > 1:
                party.requests.sort(key=_request_key)
            party.ordered = True
        return party.requests
    if type(node) is _Waiter:
        return _waiter_successors(<_Waiter>node, [])
    if type(node) is _Group:
        out = []
        for m in (<_Group>node).members:
            _waiter_successors(m, out)
        return out
    lock = <_Lock>node
    out = []
    if lock.held:
        p = parties.get((lock.session, lock.actor))
        if p is not None:
            out.append(p)
    elif lock.n_leases:
        keys = []
        for lease in lock.leases.values():
            key = (lease.session, lease.actor)
            if key in parties:
                keys.append(key)
        if len(keys) > 1:
            keys = sorted(set(keys))
        for key in keys:
            out.append(parties[key])
    return out


cdef str _step_name(object req, object nxt):
    """The name of ``req``'s waiter whose edge leads to ``nxt`` (the first in request order)."""
    cdef _Waiter m
    if type(req) is _Waiter:
        return (<_Waiter>req).lock.name
    for m in (<_Group>req).members:
        if nxt in _waiter_successors(m, []):
            return m.lock.name
    raise AssertionError("no edge")  # pragma: no cover


cdef list _bfs_path(_Node start, _Party home, dict parties, int cid, int64_t search, dict dead):
    """Breadth first from ``start`` inside component ``cid``: to the first party that is not
    ``home`` when ``dead`` is a dict (``home`` is not crossed; what proves unable to reach
    another party is marked dead for ``home``), else to ``home``.  The path
    [start, ..., end], or None."""
    cdef dict parent = {start: None}
    cdef list queue = [start]
    cdef list path
    cdef Py_ssize_t i = 0
    cdef _Node node, nxt
    end = None
    while end is None and i < len(queue):
        node = <_Node>queue[i]
        i += 1
        for nxt in _successors(node, parties):
            if nxt in parent or not _in_comp(nxt, cid, search):
                continue
            if dead is not None and (nxt is home or dead.get(nxt) is home):
                continue
            parent[nxt] = node
            if nxt is home or (dead is not None and type(nxt) is _Party):
                end = nxt
                break
            queue.append(nxt)
    if end is None:
        for node in queue:
            dead[node] = home
        return None
    path = []
    while end is not None:
        path.append(end)
        end = parent[end]
    path.reverse()
    return path


cdef tuple _component_victim(list members, dict parties, int cid, int64_t search):
    """The victim request of a deadlocked component and the cycle naming it: the
    youngest request of a party of the component, in it, that reaches another party
    without crossing its own; the cycle runs from it to the nearest such party and
    from there back by a shortest path (so every party on it is distinct)."""
    cdef list candidates = []
    cdef list out_path, back, steps
    cdef dict dead = {}
    cdef Py_ssize_t i
    cdef _Waiter w
    cdef _Party home
    for m in members:
        if type(m) is _Party:
            for req in (<_Party>m).requests:
                if _in_comp(<_Node>req, cid, search):
                    candidates.append(req)
    candidates.sort(key=_request_key, reverse=True)
    for victim in candidates:
        w = <_Waiter>victim if type(victim) is _Waiter else <_Waiter>(<_Group>victim).members[0]
        home = <_Party>parties[(w.session, w.actor)]
        out_path = _bfs_path(victim, home, parties, cid, search, dead)
        if out_path is not None:
            break
    else:
        raise AssertionError("a component of two parties has a cycle through both")  # pragma: no cover
    back = _bfs_path(out_path[len(out_path) - 1], home, parties, cid, search, None)
    steps = [(home.session, _step_name(victim, out_path[1]))]
    for i in range(len(back) - 1):
        if type(back[i]) is _Party:
            steps.append(((<_Party>back[i]).session, _step_name(back[i + 1], back[i + 2])))
    return (victim, tuple(steps))
