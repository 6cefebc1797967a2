# The compiled classes of fastlock/wal/_syncer.pyx that group commit (commit.pyx) reaches with C calls.

cdef class Batch:
    cdef public object data, first_lsn, last_lsn
    cdef public bint fsync


cdef class SegmentFile:
    cdef public int _fd
    cdef public object seg_first
    cdef public object seg_path
    cdef public long long segment_bytes
    cdef public long long seg_size
    cdef public long long alloc_end
    cdef public long long durable_offset
    cdef public long long bytes
    cdef public long long batches
    cdef public bint _dirty
    cdef public object disk
    cdef public object fill
    cdef public long long fsyncs
    cdef public object fsync_seconds
    cdef public bint preallocate
    cdef public long long prealloc_step

    cpdef bint write_cached(self, Batch batch) except -1
    cpdef bint write_synced(self, Batch batch) except -1
    cdef bint _fill_due(self, long long offset) noexcept
    cdef bint job_finished(self) noexcept


# a record's frame and a batch's seal, called by group commit per record and per batch
cpdef Py_ssize_t append_lease_record(bytearray buf, int kind, str name, long long token, long long wall_ms,
                                     Py_ssize_t most) except -2
cpdef Py_ssize_t append_grant_record(bytearray buf, int kind, object name, long long token, bytes owner,
                                     long long ttl_ms, long long lock_delay_ms, object client_name,
                                     object correlation_id, long long wall_ms, Py_ssize_t most) except -2
cpdef seal_batch(bytearray buf, Py_ssize_t last_frame)
