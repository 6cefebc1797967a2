# Argument checks of fastlock._core (included by _core.pyx): every public call of the
# lock table checks its arguments here again (defense in depth: the protocol layer validates first).

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


cdef inline int64_t _priority(object v) except? -1:
    cdef int64_t r
    if v is 0:
        return 0
    r = _int(v, "priority")
    if r < 0 or r > _MAX_PRIORITY:
        raise ValueError(f"priority must be in 0..{_MAX_PRIORITY}, got {r}")
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
