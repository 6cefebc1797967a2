# cython: language_level=3
"""The compiled part of the WAL's commit pipeline: write + fdatasync without the GIL.

:class:`Syncer` owns one job slot and is driven by one thread (a
``threading.Thread`` whose target is :meth:`Syncer.run`).  The loop puts a
batch in the slot with :meth:`Syncer.submit` (a ``pwrite`` at an offset, an
optional ``fdatasync``, an optional zero-fill of preallocated space after the
reply), or a Python callable with :meth:`Syncer.submit_call` (a segment
rotation, which creates files); the thread waits on a pthread condition
variable with the GIL released, does the I/O with the GIL released, and
signals completion by writing 8 bytes to ``notify_fd`` -- an eventfd (or a
pipe) the loop watches with ``loop.add_reader``.  The loop collects the
outcome with :meth:`Syncer.take_result`; it reads the slot's state without the
lock (an atomic load, the thread's store of DONE publishing the outcome), so
asking whether a job is finished costs no lock and no GIL release.  One thread wake-up and one loop
wake-up per batch; the thread never takes the GIL for a plain batch.

:func:`append_frame` appends one record to the batch being built as a frame of
:mod:`fastlock.wal.format` (the CRC-32 of zlib, computed in C), with no Python object
per record beyond the record's bytes; :func:`append_grant_record` and
:func:`append_lease_record` encode a GRANT's and a RELEASE's (EXPIRE's) record body straight
into that frame, as msgpack writes it; :func:`seal_batch` marks a batch's first and last
frames.

The module-level functions :func:`pwrite_all`, :func:`datasync` and
:func:`zero_fill` do the same I/O for callers on the loop (the ``inline``
writer) or with the GIL held (a rotation), releasing the GIL meanwhile.

Errors are returned as ``errno`` values and raised as :class:`OSError` by the
Python-facing functions (naming the operation and the errno's text; the
thread's job result names the operation that failed, see
:meth:`Syncer.take_result`); the caller treats every failure as fatal (see
:mod:`fastlock.wal`).
"""

import os
import types

from libc.errno cimport EDQUOT, EINTR, ENOSPC, errno
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport uint64_t
from libc.string cimport memcpy

cdef extern from "<zlib.h>" nogil:
    unsigned long crc32(unsigned long crc, const unsigned char *buf, unsigned int len)

cdef extern from "<unistd.h>" nogil:
    ctypedef long ssize_t
    ctypedef long long off_t
    ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset)
    ssize_t write(int fd, const void *buf, size_t count)
    int ftruncate(int fd, off_t length)

cdef extern from "<time.h>" nogil:
    cdef struct timespec:
        long tv_sec
        long tv_nsec
    int CLOCK_MONOTONIC
    int clock_gettime(int clk, timespec *ts)

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *m, void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *m)
    int pthread_mutex_lock(pthread_mutex_t *m)
    int pthread_mutex_unlock(pthread_mutex_t *m)
    int pthread_cond_init(pthread_cond_t *c, void *attr)
    int pthread_cond_destroy(pthread_cond_t *c)
    int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m)
    int pthread_cond_broadcast(pthread_cond_t *c)

cdef extern from *:
    """
    #include <unistd.h>
    /* fdatasync writes the data and the metadata needed to read it back (the file
       size among them), not timestamps.  macOS has no usable fdatasync: fsync. */
    #if defined(__APPLE__)
    #define fl_datasync(fd) fsync(fd)
    #else
    #define fl_datasync(fd) fdatasync(fd)
    #endif
    static const char fl_zeros[65536] = {0};
    /* the job slot's state, read by the loop without the mutex: the thread's results are
       written before it stores DONE (release), and read after the loop loads DONE (acquire) */
    #define fl_load_state(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
    #define fl_store_state(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
    """
    int fl_datasync(int fd) nogil
    const char fl_zeros[65536]
    int fl_load_state(int *state) nogil
    void fl_store_state(int *state, int value) nogil

DEF ZEROS = 65536

#: the operations a job's failure names (:meth:`Syncer.take_result`), by their code
OPS = (None, "pwrite", "fdatasync", "zero-fill", "ftruncate")

cdef enum:
    OP_NONE = 0
    OP_PWRITE = 1
    OP_DATASYNC = 2
    OP_ZERO_FILL = 3
    OP_FTRUNCATE = 4

cdef enum:
    IDLE = 0      # no job
    QUEUED = 1    # a job waits for the thread
    RUNNING = 2   # the thread is doing it
    DONE = 3      # done, the loop has not taken the result yet


cdef double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef int _pwrite_all(int fd, const char *buf, Py_ssize_t n, long long off) noexcept nogil:
    """Write all ``n`` bytes at ``off``; 0 or an errno."""
    cdef ssize_t w
    while n > 0:
        w = pwrite(fd, buf, <size_t>n, <off_t>off)
        if w < 0:
            if errno == EINTR:
                continue
            return errno
        buf += w
        n -= w
        off += w
    return 0


cdef int _datasync(int fd) noexcept nogil:
    if fl_datasync(fd) != 0:
        return errno
    return 0


cdef int _zero_fill(int fd, long long start, long long end) noexcept nogil:
    """Write zeros over ``[start, end)``; 0 or an errno."""
    cdef long long n
    cdef int err
    while start < end:
        n = end - start
        if n > ZEROS:
            n = ZEROS
        err = _pwrite_all(fd, fl_zeros, <Py_ssize_t>n, start)
        if err:
            return err
        start += n
    return 0


cdef inline void _put_u32(unsigned char *p, unsigned long v) noexcept nogil:
    p[0] = <unsigned char>v
    p[1] = <unsigned char>(v >> 8)
    p[2] = <unsigned char>(v >> 16)
    p[3] = <unsigned char>(v >> 24)


def append_frame(bytearray buf, bytes body, Py_ssize_t most):
    """Append ``body`` (one record) to ``buf`` as a WAL frame; return the frame's offset in ``buf``.

    The frame is ``crc32 | len | body``: ``len`` is the body's length (u32 little-endian, no
    batch marks) and ``crc32`` (u32 little-endian) zlib's CRC-32 of ``len`` and the body, as
    :mod:`fastlock.wal.format` reads them.
    :raises ValueError: ``body`` is longer than ``most`` bytes (nothing is appended).
    """
    cdef Py_ssize_t n = PyBytes_GET_SIZE(body)
    cdef Py_ssize_t off = PyByteArray_GET_SIZE(buf)
    cdef unsigned char *p
    if n > most:
        raise ValueError(f"WAL record of {n} bytes exceeds {most}")
    PyByteArray_Resize(buf, off + 8 + n)
    p = <unsigned char *>PyByteArray_AS_STRING(buf) + off
    _put_u32(p + 4, <unsigned long>n)
    memcpy(p + 8, PyBytes_AS_STRING(body), n)
    _put_u32(p, crc32(0, p + 4, <unsigned int>(n + 4)))
    return off


# -- the hot records, encoded in C ----------------------------------------------------------
# A grant's and a release's record body is written straight into the batch as msgpack's Packer
# writes ``[kind, name, token, ...]`` (the shortest int, str and bin forms; str as UTF-8), with
# no list, no body object and no packer call per record.

cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object s, Py_ssize_t *size) except NULL


cdef inline Py_ssize_t _int_size(long long v) noexcept nogil:
    """Bytes of msgpack's shortest form of the int ``v``."""
    if v >= 0:
        if v < 0x80:
            return 1
        if v < 0x100:
            return 2
        if v < 0x10000:
            return 3
        if v < 0x100000000LL:
            return 5
        return 9
    if v >= -32:
        return 1
    if v >= -128:
        return 2
    if v >= -32768:
        return 3
    if v >= -2147483648LL:
        return 5
    return 9


cdef inline Py_ssize_t _put_be(unsigned char *p, unsigned char head, unsigned long long u, int width) noexcept nogil:
    cdef int k
    p[0] = head
    for k in range(width):
        p[1 + k] = <unsigned char>(u >> (8 * (width - 1 - k)))
    return 1 + width


cdef inline Py_ssize_t _put_int(unsigned char *p, long long v) noexcept nogil:
    """Write ``v`` as msgpack's Packer does (the shortest form); return its bytes."""
    if v >= 0:
        if v < 0x80:
            p[0] = <unsigned char>v
            return 1
        if v < 0x100:
            return _put_be(p, 0xCC, <unsigned long long>v, 1)
        if v < 0x10000:
            return _put_be(p, 0xCD, <unsigned long long>v, 2)
        if v < 0x100000000LL:
            return _put_be(p, 0xCE, <unsigned long long>v, 4)
        return _put_be(p, 0xCF, <unsigned long long>v, 8)
    if v >= -32:
        p[0] = <unsigned char>(v & 0xFF)
        return 1
    if v >= -128:
        return _put_be(p, 0xD0, <unsigned long long>v, 1)
    if v >= -32768:
        return _put_be(p, 0xD1, <unsigned long long>v, 2)
    if v >= -2147483648LL:
        return _put_be(p, 0xD2, <unsigned long long>v, 4)
    return _put_be(p, 0xD3, <unsigned long long>v, 8)


cdef inline Py_ssize_t _str_head(Py_ssize_t n) noexcept nogil:
    return 1 if n < 32 else 2 if n < 0x100 else 3 if n < 0x10000 else 5


cdef inline Py_ssize_t _put_str(unsigned char *p, const char *s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t h
    if n < 32:
        p[0] = <unsigned char>(0xA0 | n)
        h = 1
    elif n < 0x100:
        h = _put_be(p, 0xD9, <unsigned long long>n, 1)
    elif n < 0x10000:
        h = _put_be(p, 0xDA, <unsigned long long>n, 2)
    else:
        h = _put_be(p, 0xDB, <unsigned long long>n, 4)
    memcpy(p + h, s, n)
    return h + n


cdef inline Py_ssize_t _put_bin(unsigned char *p, const char *s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t h
    if n < 0x100:
        h = _put_be(p, 0xC4, <unsigned long long>n, 1)
    elif n < 0x10000:
        h = _put_be(p, 0xC5, <unsigned long long>n, 2)
    else:
        h = _put_be(p, 0xC6, <unsigned long long>n, 4)
    memcpy(p + h, s, n)
    return h + n


cdef unsigned char *_frame_space(bytearray buf, Py_ssize_t n, Py_ssize_t most, Py_ssize_t *off) except NULL:
    """Grow ``buf`` by one frame of an ``n``-byte body; the body's first byte (``off``: the frame's)."""
    if n > most:
        raise ValueError(f"WAL record of {n} bytes exceeds {most}")
    off[0] = PyByteArray_GET_SIZE(buf)
    PyByteArray_Resize(buf, off[0] + 8 + n)
    return <unsigned char *>PyByteArray_AS_STRING(buf) + off[0] + 8


cdef inline void _seal_frame(bytearray buf, Py_ssize_t off, Py_ssize_t n) noexcept:
    cdef unsigned char *p = <unsigned char *>PyByteArray_AS_STRING(buf) + off
    _put_u32(p + 4, <unsigned long>n)
    _put_u32(p, crc32(0, p + 4, <unsigned int>(n + 4)))


cpdef Py_ssize_t append_lease_record(bytearray buf, int kind, str name, long long token, long long wall_ms,
                                     Py_ssize_t most) except -2:
    """Append the record ``[kind, name, token, wall_ms]`` (a RELEASE's, an EXPIRE's: kind 0..127)
    to ``buf`` as a frame, as :func:`append_frame` does with msgpack's encoding of that list;
    return the frame's offset in ``buf``.
    :raises ValueError: the body is longer than ``most`` bytes (nothing is appended).
    :raises UnicodeEncodeError: ``name`` has no UTF-8 form (nothing is appended).
    :raises TypeError: ``name`` is None."""
    cdef Py_ssize_t name_n, n, off
    cdef const char *name_p
    cdef unsigned char *p
    if name is None:
        raise TypeError("append_lease_record: name must be a str, not None")
    name_p = PyUnicode_AsUTF8AndSize(name, &name_n)
    n = 2 + _str_head(name_n) + name_n + _int_size(token) + _int_size(wall_ms)
    p = _frame_space(buf, n, most, &off)
    p[0] = 0x94
    p[1] = <unsigned char>kind
    p += 2
    p += _put_str(p, name_p, name_n)
    p += _put_int(p, token)
    _put_int(p, wall_ms)
    _seal_frame(buf, off, n)
    return off


cpdef Py_ssize_t append_grant_record(bytearray buf, int kind, object name, long long token, bytes owner,
                                     long long ttl_ms, long long lock_delay_ms, object client_name,
                                     object correlation_id, long long wall_ms, Py_ssize_t most) except -2:
    """Append a GRANT record ``[kind, name, token, owner, ttl_ms, lock_delay_ms, client_name,
    correlation_id, wall_ms]`` (``client_name``, ``correlation_id``: str or None) to ``buf`` as a
    frame, as :func:`append_frame` does with msgpack's encoding of that list; return the frame's
    offset in ``buf``, or -1, appending nothing, when ``name`` is not a str or ``client_name`` or
    ``correlation_id`` neither a str nor None (the caller encodes that record itself).
    :raises ValueError: the body is longer than ``most`` bytes (nothing is appended).
    :raises UnicodeEncodeError: a str has no UTF-8 form (nothing is appended)."""
    cdef Py_ssize_t name_n, client_n = 0, corr_n = 0, owner_n, n, off
    cdef const char *client_p = NULL
    cdef const char *corr_p = NULL
    cdef const char *name_p
    cdef unsigned char *p
    if type(name) is not str or owner is None:
        return -1
    if client_name is not None and type(client_name) is not str:
        return -1
    if correlation_id is not None and type(correlation_id) is not str:
        return -1
    name_p = PyUnicode_AsUTF8AndSize(name, &name_n)
    if client_name is not None:
        client_p = PyUnicode_AsUTF8AndSize(client_name, &client_n)
    if correlation_id is not None:
        corr_p = PyUnicode_AsUTF8AndSize(correlation_id, &corr_n)
    owner_n = PyBytes_GET_SIZE(owner)
    n = (2 + _str_head(name_n) + name_n + _int_size(token) + (2 if owner_n < 0x100 else 3 if owner_n < 0x10000 else 5)
         + owner_n + _int_size(ttl_ms) + _int_size(lock_delay_ms) + _int_size(wall_ms)
         + (1 if client_p == NULL else _str_head(client_n) + client_n)
         + (1 if corr_p == NULL else _str_head(corr_n) + corr_n))
    p = _frame_space(buf, n, most, &off)
    p[0] = 0x99
    p[1] = <unsigned char>kind
    p += 2
    p += _put_str(p, name_p, name_n)
    p += _put_int(p, token)
    p += _put_bin(p, PyBytes_AS_STRING(owner), owner_n)
    p += _put_int(p, ttl_ms)
    p += _put_int(p, lock_delay_ms)
    if client_p == NULL:
        p[0] = 0xC0
        p += 1
    else:
        p += _put_str(p, client_p, client_n)
    if corr_p == NULL:
        p[0] = 0xC0
        p += 1
    else:
        p += _put_str(p, corr_p, corr_n)
    _put_int(p, wall_ms)
    _seal_frame(buf, off, n)
    return off


cpdef seal_batch(bytearray buf, Py_ssize_t last_frame):
    """Mark the frames of ``buf`` (one batch, :func:`append_frame`'s frames, the last at offset
    ``last_frame``) as a batch: START on the first frame's length, COMMIT on the last's (one
    frame: both), and recompute those frames' CRC-32, as :mod:`fastlock.wal.format` reads them.
    """
    cdef unsigned char *p = <unsigned char *>PyByteArray_AS_STRING(buf)
    cdef Py_ssize_t size = PyByteArray_GET_SIZE(buf)
    cdef Py_ssize_t first_end
    if size < 8 or last_frame < 0 or last_frame + 8 > size:
        raise ValueError("seal_batch: no frame at the offset given")
    p[last_frame + 7] |= 0x80
    p[7] |= 0x40
    _put_u32(p + last_frame, crc32(0, p + last_frame + 4, <unsigned int>(size - last_frame - 4)))
    if last_frame:
        first_end = 8 + ((p[4] | (p[5] << 8) | (p[6] << 16) | (<unsigned long>p[7] << 24)) & 0x3FFFFFFF)
        _put_u32(p, crc32(0, p + 4, <unsigned int>(first_end - 4)))


def pwrite_all(int fd, const unsigned char[::1] data, long long offset):
    """Write every byte of ``data`` at ``offset`` of ``fd`` (GIL released).

    :raises OSError: the write failed.
    """
    cdef int err
    cdef Py_ssize_t n = data.shape[0]
    if n == 0:
        return
    with nogil:
        err = _pwrite_all(fd, <const char *>&data[0], n, offset)
    if err:
        raise OSError(err, f"pwrite failed: {os.strerror(err)}")


def datasync(int fd):
    """``fdatasync(fd)`` (``fsync`` on macOS) with the GIL released; returns its duration (seconds).

    :raises OSError: it failed.
    """
    cdef int err
    cdef double t0, t1
    with nogil:
        t0 = _now()
        err = _datasync(fd)
        t1 = _now()
    if err:
        raise OSError(err, f"fdatasync failed: {os.strerror(err)}")
    return t1 - t0


def zero_fill(int fd, long long start, long long end):
    """Write zeros over ``[start, end)`` of ``fd`` (GIL released); no sync.

    :raises OSError: a write failed.
    """
    cdef int err
    with nogil:
        err = _zero_fill(fd, start, end)
    if err:
        raise OSError(err, f"zero-fill failed: {os.strerror(err)}")


cdef class Syncer:
    """One job slot and the thread body that empties it (see the module docstring).

    :param notify_fd: the write end the thread signals each completion on (an
        eventfd or a pipe, non-blocking); the caller owns and closes it.
    """

    cdef pthread_mutex_t _mu
    cdef pthread_cond_t _cv
    cdef int _notify_fd
    cdef int _state
    cdef bint _stopping
    cdef bint _filling  # the thread is writing the zeros of a preallocation step
    # the job
    cdef int _fd
    cdef object _data  # keeps the written buffer alive until the job is done
    cdef const char *_buf
    cdef Py_ssize_t _len
    cdef long long _offset
    cdef bint _sync
    cdef long long _zero_from
    cdef long long _zero_to
    cdef object _call
    cdef bint _is_call
    # the outcome
    cdef int _err
    cdef int _op  # the operation that failed (OP_*), with _err
    cdef int _zero_err
    cdef int _zero_op
    cdef bint _zero_full  # a zero-fill ran out of space (ENOSPC/EDQUOT): not an error, see zero_full
    cdef double _seconds
    cdef object _exc

    def __cinit__(self, int notify_fd):
        pthread_mutex_init(&self._mu, NULL)
        pthread_cond_init(&self._cv, NULL)
        self._notify_fd = notify_fd
        fl_store_state(&self._state, IDLE)

    def __dealloc__(self):
        pthread_cond_destroy(&self._cv)
        pthread_mutex_destroy(&self._mu)

    cdef int _queue(self) except -1:
        if fl_load_state(&self._state) != IDLE:
            raise RuntimeError("Syncer: a job is already in the slot")
        # (the GIL stays held: the thread never takes it while it holds the mutex, and holds the
        # mutex only to change the state.)  Signalled after the unlock: the woken thread does not
        # run into the mutex still held here
        pthread_mutex_lock(&self._mu)
        fl_store_state(&self._state, QUEUED)
        pthread_mutex_unlock(&self._mu)
        pthread_cond_broadcast(&self._cv)
        return 0

    cdef inline bint finished(self) noexcept nogil:
        """Is the job in the slot finished, its result not taken yet?  (No lock: one atomic load.)"""
        return fl_load_state(&self._state) == DONE

    def submit(self, int fd, bytes data, long long offset, bint sync, long long zero_from=0, long long zero_to=0):
        """Queue a batch: write ``data`` at ``offset`` of ``fd``, then ``fdatasync`` if
        ``sync``; after signalling completion, zero-fill ``[zero_from, zero_to)`` and
        fdatasync it (preallocation ahead of the write offset; its failure is
        reported with the next job, except running out of space: see :attr:`zero_full`).

        :raises RuntimeError: the slot is not empty.
        """
        self._fd = fd
        self._data = data
        self._buf = <const char *>data
        self._len = len(data)
        self._offset = offset
        self._sync = sync
        self._zero_from = zero_from
        self._zero_to = zero_to
        self._call = None
        self._is_call = False
        self._queue()

    def submit_call(self, fn):
        """Queue ``fn()``, run on the thread with the GIL; its exception is the job's outcome.

        :raises RuntimeError: the slot is not empty.
        """
        self._data = None
        self._zero_from = self._zero_to = 0
        self._call = fn
        self._is_call = True
        self._queue()

    def take_result(self):
        """``(errno, operation, fdatasync seconds or -1.0, exception or None)`` of the
        finished job, emptying the slot; ``None`` while it runs.  The operation is the
        one that failed (``"pwrite"``, ``"fdatasync"``, ``"zero-fill"`` or
        ``"ftruncate"``, the last two of the zero-fill after an earlier job), None when
        errno is 0."""
        # (no lock: only the loop changes DONE, to IDLE, and the thread waits for QUEUED only)
        if fl_load_state(&self._state) != DONE:
            return None
        out = (self._err, OPS[self._op] if self._err else None, self._seconds, self._exc)
        self._err = 0
        self._exc = None
        self._data = None
        self._call = None
        fl_store_state(&self._state, IDLE)
        return out

    @property
    def done(self):
        """Is the job in the slot finished, its result not taken yet?  (The loop may take it
        with :meth:`take_result` before the wake-up on ``notify_fd`` arrives.)"""
        return self.finished()

    @property
    def zero_full(self):
        """Did a zero-fill run out of space (ENOSPC or EDQUOT)?  Such a failure is not
        reported with the next job: the caller stops preallocating."""
        return self._zero_full

    def wait_fill(self):
        """Wait (GIL released) until the zeros of a running preallocation step are written.

        The loop calls this before it writes a batch itself: its write may land in
        the range being zero-filled, and must not be overwritten by those zeros.
        """
        self._wait_fill()

    cdef void _wait_fill(self) noexcept:
        # no step being written (the common case): the GIL stays held (the thread never
        # takes the GIL while it holds the mutex)
        pthread_mutex_lock(&self._mu)
        if not self._filling:
            pthread_mutex_unlock(&self._mu)
            return
        pthread_mutex_unlock(&self._mu)
        with nogil:
            pthread_mutex_lock(&self._mu)
            while self._filling:
                pthread_cond_wait(&self._cv, &self._mu)
            pthread_mutex_unlock(&self._mu)

    def stop(self):
        """Make :meth:`run` return once the slot holds no queued job."""
        with nogil:
            pthread_mutex_lock(&self._mu)
            self._stopping = True
            pthread_cond_broadcast(&self._cv)
            pthread_mutex_unlock(&self._mu)

    def run(self):
        """The thread body: do each queued job and signal its completion, until :meth:`stop`.

        Runs without the GIL from start to end (the GIL is taken only for a call job),
        so the thread never competes with the event loop for it."""
        with nogil:
            self._run()

    cdef void _call_job(self) noexcept:
        if self._zero_err:
            self._err = self._zero_err  # a failed zero-fill fails the job after it
            self._op = self._zero_op
            return
        try:
            self._call()
        except BaseException as exc:  # handed to the loop, which makes the log fatal
            self._exc = exc

    cdef void _run(self) noexcept nogil:
        cdef bint quit
        cdef int err, fd
        cdef double t0
        cdef long long zfrom, zto
        cdef uint64_t one = 1
        while True:
            pthread_mutex_lock(&self._mu)
            while self._state != QUEUED and not self._stopping:
                pthread_cond_wait(&self._cv, &self._mu)
            quit = self._state != QUEUED
            if not quit:
                fl_store_state(&self._state, RUNNING)
            pthread_mutex_unlock(&self._mu)
            if quit:
                return
            self._seconds = -1.0
            err = 0
            if self._is_call:
                with gil:
                    self._call_job()
            # what the zero-fill needs, read before the loop may queue the next job
            fd = self._fd
            zfrom = self._zero_from
            zto = self._zero_to
            if not self._is_call:
                err = self._zero_err  # a failed zero-fill fails the job after it
                self._op = self._zero_op
                if err == 0:
                    err = _pwrite_all(fd, self._buf, self._len, self._offset)
                    self._op = OP_PWRITE
                if err == 0 and self._sync:
                    t0 = _now()
                    err = _datasync(fd)
                    self._seconds = _now() - t0
                    self._op = OP_DATASYNC
                self._err = err
            pthread_mutex_lock(&self._mu)
            fl_store_state(&self._state, DONE)  # (after the results it publishes)
            # set with DONE: the loop cannot see the job done and miss the fill
            self._filling = zto > zfrom and err == 0
            pthread_mutex_unlock(&self._mu)
            write(self._notify_fd, &one, 8)  # a full pipe already holds a wake-up
            if self._filling:
                err = _zero_fill(fd, zfrom, zto)
                self._zero_op = OP_ZERO_FILL
                if err == ENOSPC or err == EDQUOT:
                    # no room to preallocate: give back what this step took (the records
                    # below zfrom are untouched) before the loop may write again; a
                    # record's own write reports ENOSPC if the records do not fit
                    if ftruncate(fd, zfrom) == 0:
                        self._zero_full = True
                        err = 0
                    else:
                        err = errno
                        self._zero_op = OP_FTRUNCATE
                pthread_mutex_lock(&self._mu)
                self._filling = False
                pthread_cond_broadcast(&self._cv)
                pthread_mutex_unlock(&self._mu)
                if err == 0 and not self._zero_full:
                    err = _datasync(fd)
                    self._zero_op = OP_DATASYNC
                self._zero_err = err


cdef class Batch:
    """One batch of frames for the writer (:mod:`fastlock.wal.writer`): ``data`` (bytes), the
    frames of LSNs ``first_lsn..last_lsn`` (ints); ``fsync``: fsync it before it counts as done.
    Made by group commit (:mod:`fastlock.wal.commit`) for every batch, so compiled
    (its attributes are declared in ``_syncer.pxd``)."""

    def __init__(self, data, first_lsn, last_lsn, bint fsync):
        self.data = data
        self.first_lsn = first_lsn
        self.last_lsn = last_lsn
        self.fsync = fsync


#: the compiled I/O primitives (the default ``SegmentWriter.disk``); tests substitute others
COMPILED_DISK = types.SimpleNamespace(pwrite_all=pwrite_all, datasync=datasync, zero_fill=zero_fill)


cdef class SegmentFile:
    """The compiled base of :class:`fastlock.wal.writer.SegmentWriter`: the active segment's
    state that every batch changes, as slots (``_fd``, ``seg_first``, ``seg_path``,
    ``segment_bytes``, ``seg_size``, ``alloc_end``, ``durable_offset``, ``bytes``, ``batches``,
    ``_dirty``, ``disk``, ``fsyncs``, ``fsync_seconds`` (a deque of seconds), ``preallocate``,
    ``prealloc_step`` (bytes); ``fill``: the writer thread's :class:`Syncer`, None without
    one), :meth:`write_cached`, the write of a batch into the page cache compiled, and
    :meth:`write_synced`, the write and ``fdatasync`` of a durable batch on the loop compiled.
    Everything else is ``SegmentWriter``'s."""

    cdef bint _fill_due(self, long long offset) noexcept:
        """Is a preallocation step due once the write offset is ``offset`` (as
        ``SegmentWriter._zero_range(offset, max(alloc_end, offset))`` is not empty)?"""
        cdef long long start, end, half, step = self.prealloc_step
        if not self.preallocate:
            return False
        if step <= 0:
            return True  # (no step known here: SegmentWriter.write decides)
        half = step // 2
        start = offset if offset > self.alloc_end else self.alloc_end
        if start - offset >= half:
            return False
        end = ((offset + half + step - 1) // step) * step
        if end > self.segment_bytes:
            end = self.segment_bytes
        return end > start

    cpdef bint write_synced(self, Batch batch) except -1:
        """``SegmentWriter.write(batch)`` for a batch of records to be fsynced, while no rotation
        is due, no preallocation step falls due after it and ``disk`` is :data:`COMPILED_DISK`:
        written at the write offset (after the zeros of a preallocation step the thread may be
        writing there) and ``fdatasync``'d with the GIL released, counted (``fsyncs``, its
        duration in ``fsync_seconds``); returns True.  Returns False, doing nothing, for any
        other batch (the caller runs ``write``).

        :raises OSError: the write or the sync failed (:func:`~fastlock.wal.files.io_error`,
            naming ``pwrite`` or ``fdatasync`` and the segment); the segment is cut back to
            where the batch began, as ``write`` does.
        """
        cdef object data = batch.data
        cdef Py_ssize_t n
        cdef int err, fd = self._fd
        cdef const char *buf
        cdef long long off = self.seg_size
        cdef double t0, t1
        if (not batch.fsync or type(data) is not bytes or off >= self.segment_bytes
                or self.disk is not COMPILED_DISK):
            return False
        n = PyBytes_GET_SIZE(data)
        if n == 0 or self._fill_due(off + n):
            return False
        if self.fill is not None:  # zeros being written where this batch goes must land first
            (<Syncer>self.fill)._wait_fill()
        buf = PyBytes_AS_STRING(data)
        with nogil:
            err = _pwrite_all(fd, buf, n, off)
            if err == 0:
                t0 = _now()
                err = _datasync(fd)
                t1 = _now()
                if err:
                    err = -err  # (the sync's failure)
        if err:
            from .files import io_error

            op = "pwrite" if err > 0 else "fdatasync"
            err = err if err > 0 else -err
            exc = OSError(err, f"{op} failed: {os.strerror(err)}")
            self.cut_failed_batch()
            raise io_error(op, self.seg_path, exc) from exc
        self.seg_size = off + n
        if self.seg_size > self.alloc_end:
            self.alloc_end = self.seg_size
        self.bytes += n
        self.batches += 1
        self.fsyncs += 1  # counted before its duration is shown: a reader of both sees count >= durations
        self.fsync_seconds.append(t1 - t0)
        self._dirty = False
        self.durable_offset = self.seg_size
        return True

    cdef bint job_finished(self) noexcept:
        """Has the writer thread (``fill``) finished the job in its slot, its result not taken
        yet?  False without a thread.  (One atomic load, no Python call: the loop asks at
        every batch end while a batch is on the thread.)"""
        return self.fill is not None and (<Syncer>self.fill).finished()

    @property
    def rotation_due(self):
        """Does the next batch start a new segment (an fsync and a create)?"""
        return self.seg_size >= self.segment_bytes

    cpdef bint write_cached(self, Batch batch) except -1:
        """``SegmentWriter.write(batch)`` for a batch of records that is not to be fsynced, while
        no rotation is due and ``disk`` is :data:`COMPILED_DISK`: written at the write offset
        (after the zeros of a preallocation step the thread may be writing there), counted;
        returns True.  Returns False, doing nothing, for any other batch (the caller runs
        ``write``).

        :raises OSError: the write failed (:func:`~fastlock.wal.files.io_error`); the segment is
            cut back to where the batch began, as ``write`` does.
        """
        cdef object data = batch.data
        cdef Py_ssize_t n
        cdef int err
        if (batch.fsync or type(data) is not bytes or self.seg_size >= self.segment_bytes
                or self.disk is not COMPILED_DISK):
            return False
        n = PyBytes_GET_SIZE(data)
        if n == 0:
            return False
        if self.fill is not None:  # zeros being written where this batch goes must land first
            (<Syncer>self.fill)._wait_fill()
        err = _pwrite_all(self._fd, PyBytes_AS_STRING(data), n, self.seg_size)
        if err:
            from .files import io_error

            exc = OSError(err, f"pwrite failed: {os.strerror(err)}")
            self.cut_failed_batch()
            raise io_error("pwrite", self.seg_path, exc) from exc
        self.seg_size += n
        if self.seg_size > self.alloc_end:
            self.alloc_end = self.seg_size
        self.bytes += n
        self.batches += 1
        self._dirty = True
        return True
