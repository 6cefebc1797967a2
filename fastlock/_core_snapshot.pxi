# Snapshots of the lock table (included by fastlock/_core.pyx).

cdef class _SnapshotTable(_TableState):
    """Snapshots of the lock table encoded in slices, as the table was when begun: a lock
    whose holders are about to change is encoded first (copy on write, :meth:`_cow`)."""
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
        self._snap_out.data = NULL

    def __dealloc__(self):
        free(self._snap_out.data)

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
