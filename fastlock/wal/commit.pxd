# The compiled classes of fastlock/wal/commit.pyx, declared for the modules that reach them
# with C calls and C field reads (the server's batch end, fastlock/server/_wire.pyx).

from ._syncer cimport Batch, SegmentFile


cdef class _Pending:
    cdef public bytearray buf
    cdef public object first_lsn
    cdef public Py_ssize_t last_frame
    cdef public bint fsync
    cdef public bint fsync_requested


cdef class Marks:
    cdef public object first, written, synced, ack


cdef class GroupCommit:
    cdef public SegmentFile io
    cdef public bint always
    cdef public object interval_ms
    cdef public object on_fatal
    cdef public object loop
    cdef public object fatal
    cdef public bint stopped
    cdef public object next_lsn
    cdef public Marks marks
    cdef _Pending _pending
    cdef bint _scheduled
    cdef bint _flushed_in_turn
    cdef object _inflight
    cdef object _waiters
    cdef object _last_waiter  # the _Waiter appended last to _waiters (while _waiters holds any)
    cdef Py_ssize_t _forcing
    cdef list _sync_waiters
    cdef public list listeners
    cdef public list progress
    cdef object _timer
    cdef public bint adaptive
    cdef Py_ssize_t _lone_batches
    cdef bint _after_thread
    cdef public object batch_end

    cpdef add_lease_record(self, kind, name, token, wall_ms)
    cpdef add_grant_record(self, kind, name, token, owner, ttl_ms, lock_delay_ms, client_name, correlation_id,
                           wall_ms)
    cpdef poll(self)
    cdef inline bint _lone_batch(self, bint concurrent, Py_ssize_t *run) noexcept
    cpdef _kick(self, bint concurrent=*)
    cpdef _io_done(self, Batch batch, bint concurrent=*)
    cdef inline void _schedule_kick(self)
    cpdef when_durable(self, callback)
    cpdef object pending_waiter(self)
    cpdef join_waiter(self)
    cpdef when_durable_later(self, callback)
    cdef bint _keep_waiter(self, object callback, bint forcing) except -1
    cpdef bint flush_now(self) except -1
    cpdef bint flush_first(self) except -1


cdef class Reservation:
    cdef public long long block, reserved, max_counter, epoch


cdef class LogAppender:
    cdef public GroupCommit _commit
    cdef public Reservation _counters
    cdef public bint _always
    cdef public bint appending
    cdef public object lease_observer

    cdef int append_grant(self, object name, object token, object owner, object ttl_ms, object lock_delay_ms,
                   object client_name, object correlation_id, object shared, object limit) except -1
    cdef int append_release(self, object name, object token) except -1
