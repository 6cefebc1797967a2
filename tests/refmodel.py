"""Plain-Python reference model of ``fastlock._core.LockTable``.

Same API, same semantics, same event order -- written for obviousness, not
speed: lists, dicts, and a linear scan for the earliest deadline.  The property
tests (tests/test_core_properties.py) drive this model and the compiled table
with the same random operations and require identical results.

Semantics in one place (the compiled table must match every line):

* Times are integer monotonic milliseconds.  A lease is valid while
  ``now < deadline``; a waiter has timed out at ``now >= wait deadline``.
* Every state-changing call validates its arguments first (in signature order),
  then processes every deadline ``<= now`` (:meth:`expire`), then does its work.
* Deadlines (lease ends, wait timeouts, "blocked until" ends) are scheduled
  entries ``(deadline, seq)``; ``seq`` comes from one shared counter and is
  taken anew on every (re)schedule.  ``expire(now)`` handles due entries in
  ``(deadline, seq)`` order, each at its logical time ``tau`` = its deadline.
  A grant made while handling an entry gets the deadline ``now + ttl``.
* A lock is *blocked* at time ``tau`` while ``tau < max(delay_until,
  hold_until)``: ``delay_until`` is set to ``expiry + lock_delay_ms`` when a
  lease with a lock-delay expires (not on release); ``hold_until`` is the
  global grant hold.  An unheld lock with waiters is always blocked and has
  one "block" entry at the end of the block; an unheld lock without waiters
  is kept only while its lock-delay runs (entry at ``delay_until``); otherwise
  it is deleted (unless it has shared holders / permits).
* Kinds: an exclusive lease (``holder``), or any number of non-exclusive leases
  (``shared``: shared holders, or semaphore permits when ``limit > 0``), never
  both.  A request is granted only from the head of the FIFO queue (or when the
  queue is empty) and only when compatible: exclusive needs no holder at all; a
  shared request needs no exclusive holder; a permit needs fewer than ``limit``
  permits.  Settling grants head waiters while they are compatible (consecutive
  readers together).  A name's ``limit`` is fixed while it has holders or
  waiters; a request with another limit gets LIMIT_CONFLICT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GRANTED = 0
QUEUED = 1
NOT_ACQUIRED = 2
LIMIT_CONFLICT = 3

EV_GRANTED = 1
EV_EXPIRED = 2
EV_WAIT_TIMEOUT = 3
EV_WAIT_CANCELLED = 4
EV_DEADLOCK = 5

TOKEN_EPOCH_SHIFT = 40
MAX_EPOCH = (1 << 23) - 1
MAX_COUNTER = (1 << 40) - 1
MAX_LOCK_DELAY_MS = 60_000
MAX_MS = (1 << 53) - 1
MAX_LIMIT = (1 << 31) - 1
MAX_MANY = 64
DEADLOCK_PASSES = 4
DEADLOCK_WORK = 10_000
_INT64_MAX = (1 << 63) - 1
_INT64_MIN = -(1 << 63)

LEASE = "lease"
WAIT = "wait"
BLOCK = "block"
SHARED = "shared"
GROUP = "group"


class NotHolder(LookupError):
    """release/extend named a lease that is not the current, unexpired holder."""


@dataclass
class Event:
    kind: int
    name: str
    token: int
    owner: bytes
    session: int
    request: Any
    ttl_ms: int
    deadline_ms: int
    meta: Any
    fresh: bool
    lock_delay_ms: int
    # EV_GRANTED: grant time minus the answered request's arrival (0 immediate,
    # the queueing time when queued, <= 0 for a re-delivered lease)
    waited_ms: int = 0
    shared: bool = False
    limit: int = 0
    cycle: Any = None  # EV_DEADLOCK: ((session, name), ...) starting with the failed waiter's step


@dataclass
class Holder:
    name: str
    token: int
    owner: bytes
    session: int
    ttl_ms: int
    deadline_ms: int
    lock_delay_ms: int
    meta: Any
    shared: bool = False
    limit: int = 0


@dataclass(eq=False)
class _Entry:
    deadline: int
    seq: int
    kind: str
    lock: _Lock
    waiter: _Waiter | None = None
    lease: _Lease | None = None
    group: _Group | None = None


@dataclass(eq=False)
class _Lease:
    token: int
    owner: bytes
    session: int
    ttl_ms: int
    lock_delay_ms: int
    meta: Any
    entry: _Entry
    shared: bool = False
    actor: int = 0  # the actor of the request it was granted to
    priority: int = 0  # the priority of the request it was granted to (exclusive leases)


@dataclass(eq=False)
class _Waiter:
    owner: bytes
    session: int
    request: Any
    ttl_ms: int
    lock_delay_ms: int
    meta: Any
    entry: _Entry | None  # None: waits forever
    enqueued_ms: int = 0  # ``now`` of the acquire this waiter answers
    shared: bool = False
    group: _Group | None = None  # its acquire_many() request
    lock: _Lock | None = None
    actor: int = 0  # who waits within the session (0: the session as a whole)
    priority: int = 0  # 0..MAX_PRIORITY: queued ahead of every waiter of a lower one


@dataclass(eq=False)
class _Group:
    """A waiting acquire_many() request: a waiter per name, granted together."""
    members: list
    entry: _Entry | None = None


class _Lock:
    def __init__(self, name: str) -> None:
        self.name = name
        self.holder: _Lease | None = None  # the exclusive lease
        self.shared: dict[bytes, _Lease] = {}  # non-exclusive leases by owner, in grant order
        self.limit = 0  # semaphore limit; 0 for a lock
        self.waiters: list[_Waiter] = []  # FIFO
        self.delay_until = 0
        self.block: _Entry | None = None


# -- argument checks (same order and exception types as the compiled core) --------


def _int(v, what):
    if type(v) is bool or not isinstance(v, int):
        raise TypeError(f"{what} must be an int, not {type(v).__name__}")
    if v < _INT64_MIN or v > _INT64_MAX:
        raise ValueError(f"{what} out of range")
    return v


def _ms(v, what, lo):
    v = _int(v, what)
    if v < lo or v > MAX_MS:
        raise ValueError(f"{what} out of range")
    return v


def _name(v):
    if type(v) is not str:
        raise TypeError("name must be a str")
    if not v:
        raise ValueError("name must not be empty")
    return v


def _owner(v):
    if type(v) is not bytes:
        raise TypeError("owner must be bytes")
    return v


def _nonneg(v, what):
    v = _int(v, what)
    if v < 0:
        raise ValueError(f"{what} must be >= 0")
    return v


def _bool(v, what):
    if type(v) is not bool:
        raise TypeError(f"{what} must be a bool")
    return v


def _limit(v, shared):
    v = _int(v, "limit")
    if v < 0 or v > MAX_LIMIT:
        raise ValueError("limit out of range")
    if v and shared:
        raise ValueError("a semaphore permit cannot also be shared")
    return v


MAX_PRIORITY = 99


def _priority(v):
    v = _int(v, "priority")
    if not 0 <= v <= MAX_PRIORITY:
        raise ValueError(f"priority must be in 0..{MAX_PRIORITY}, got {v}")
    return v


def _lock_delay(v):
    v = _int(v, "lock_delay_ms")
    if v < 0 or v > MAX_LOCK_DELAY_MS:
        raise ValueError("lock_delay_ms out of range")
    return v


class RefLockTable:
    """The reference model.  See the module docstring for the semantics."""

    def __init__(self) -> None:
        self.locks: dict[str, _Lock] = {}
        self.entries: list[_Entry] = []  # every scheduled deadline, unordered
        self.events: list[Event] = []
        self.sessions: dict[int, list[tuple[str, bytes]]] = {}  # session -> waiters in arrival order
        self.seq = 0
        self.epoch = 0
        self._counter = 0
        self.hold_until = 0
        self.n = dict(grants=0, releases=0, expiries=0, wait_timeouts=0, cancels=0, deadlocks=0)

    # -- deadlines -----------------------------------------------------------

    def _schedule(self, kind, lock, deadline, waiter=None) -> _Entry:
        self.seq += 1
        e = _Entry(deadline, self.seq, kind, lock, waiter)
        self.entries.append(e)
        return e

    def _unschedule(self, e: _Entry | None) -> None:
        if e is not None:
            self.entries.remove(e)

    def _earliest(self) -> _Entry | None:
        best = None
        for e in self.entries:
            if best is None or (e.deadline, e.seq) < (best.deadline, best.seq):
                best = e
        return best

    # -- fencing -----------------------------------------------------------------

    @property
    def counter(self) -> int:
        return self._counter

    @property
    def last_token(self) -> int:
        return (self.epoch << TOKEN_EPOCH_SHIFT) | self._counter

    def set_epoch(self, epoch) -> None:
        e = _int(epoch, "epoch")
        if e < self.epoch or e > MAX_EPOCH:
            raise ValueError("bad epoch")
        self.epoch = e

    def advance_counter(self, counter) -> None:
        if type(counter) is bool or not isinstance(counter, int):
            raise TypeError("counter must be an int")
        if counter < 0:
            raise ValueError("counter must be >= 0")
        if counter > MAX_COUNTER:
            raise OverflowError("counter too large")
        self._counter = max(self._counter, counter)

    # -- internal transitions ---------------------------------------------------------

    def _expire(self, now: int) -> None:
        while True:
            e = self._earliest()
            if e is None or e.deadline > now:
                return
            self.entries.remove(e)
            tau = e.deadline
            lock = e.lock
            if e.kind in (LEASE, SHARED):
                if e.kind == LEASE:
                    lease = lock.holder
                    lock.holder = None
                else:
                    lease = e.lease
                    del lock.shared[lease.owner]
                self.n["expiries"] += 1
                self.events.append(
                    Event(EV_EXPIRED, lock.name, lease.token, lease.owner, lease.session, None,
                          lease.ttl_ms, tau, lease.meta, False, lease.lock_delay_ms, 0, lease.shared,
                          lock.limit if e.kind == SHARED else 0))
                if lease.lock_delay_ms > 0:
                    lock.delay_until = max(lock.delay_until, tau + lease.lock_delay_ms)
            elif e.kind == GROUP:
                g = e.group
                g.entry = None
                self.n["wait_timeouts"] += len(g.members)
                self._remove_group(g, EV_WAIT_TIMEOUT, None, None, tau, now)
                continue
            elif e.kind == WAIT:
                w = e.waiter
                self.n["wait_timeouts"] += 1
                self.events.append(self._waiter_event(EV_WAIT_TIMEOUT, lock, w))
                w.entry = None
                self._remove_waiter(lock, w)
            else:
                lock.block = None
            self._settle(lock, tau, now)

    @staticmethod
    def _waiter_event(kind, lock, w) -> Event:
        return Event(kind, lock.name, 0, w.owner, w.session, w.request, w.ttl_ms, 0, w.meta, False,
                     w.lock_delay_ms, 0, w.shared, lock.limit)

    def _next_token(self) -> int:
        if self._counter >= MAX_COUNTER:
            raise OverflowError("fencing counter exhausted")
        self._counter += 1
        return (self.epoch << TOKEN_EPOCH_SHIFT) | self._counter

    def _grant(self, lock, owner, session, request, ttl_ms, lock_delay_ms, meta, now, waited_ms=0,
               actor=0, priority=0) -> None:
        token = self._next_token()
        self._unschedule(lock.block)
        lock.block = None
        lock.delay_until = 0
        entry = self._schedule(LEASE, lock, now + ttl_ms)
        lock.holder = _Lease(token, owner, session, ttl_ms, lock_delay_ms, meta, entry, actor=actor,
                             priority=priority)
        self.n["grants"] += 1
        self.events.append(
            Event(EV_GRANTED, lock.name, token, owner, session, request, ttl_ms, now + ttl_ms, meta,
                  True, lock_delay_ms, waited_ms))

    def _grant_lease(self, lock, owner, session, request, ttl_ms, lock_delay_ms, meta, shared, now,
                     waited_ms=0, actor=0) -> None:
        token = self._next_token()
        self._unschedule(lock.block)
        lock.block = None
        lock.delay_until = 0
        entry = self._schedule(SHARED, lock, now + ttl_ms)
        lease = _Lease(token, owner, session, ttl_ms, lock_delay_ms, meta, entry, shared, actor)
        entry.lease = lease
        lock.shared[owner] = lease
        self.n["grants"] += 1
        self.events.append(
            Event(EV_GRANTED, lock.name, token, owner, session, request, ttl_ms, now + ttl_ms, meta,
                  True, lock_delay_ms, waited_ms, shared, lock.limit))

    def _remove_waiter(self, lock, w) -> None:
        lock.waiters.remove(w)
        self._unschedule(w.entry)
        w.entry = None
        w.lock = None
        if w.group is not None and w.group.entry is not None:
            self._unschedule(w.group.entry)
            w.group.entry = None
        order = self.sessions[w.session]
        order.remove((lock.name, w.owner))
        if not order:
            del self.sessions[w.session]

    def _set_block(self, lock, at) -> None:
        if lock.block is not None and lock.block.deadline == at:
            return
        self._unschedule(lock.block)
        lock.block = self._schedule(BLOCK, lock, at)

    def _settle(self, lock, tau, now) -> None:
        """A lock without an exclusive holder at logical time tau: grant its compatible
        head waiters, stay blocked, or go away."""
        if lock.holder is not None:
            return
        if lock.delay_until <= tau:
            lock.delay_until = 0
        if lock.waiters:
            until = max(lock.delay_until, self.hold_until)
            if tau >= until:
                self._unschedule(lock.block)
                lock.block = None
                while lock.waiters and lock.holder is None:
                    w = lock.waiters[0]
                    if w.group is not None:
                        if not self._group_ready(w.group, tau):
                            break
                        self._grant_group(w.group, now, tau, lock)
                        continue
                    exclusive = not (w.shared or lock.limit)
                    if exclusive and lock.shared:
                        break
                    if not exclusive and lock.limit and len(lock.shared) >= lock.limit:
                        break
                    if self._counter >= MAX_COUNTER:
                        raise OverflowError("fencing counter exhausted")
                    self._remove_waiter(lock, w)
                    if exclusive:
                        self._grant(lock, w.owner, w.session, w.request, w.ttl_ms, w.lock_delay_ms, w.meta,
                                    now, now - w.enqueued_ms, w.actor, w.priority)
                        break
                    self._grant_lease(lock, w.owner, w.session, w.request, w.ttl_ms, w.lock_delay_ms, w.meta,
                                      w.shared, now, now - w.enqueued_ms, w.actor)
            else:
                self._set_block(lock, until)
        elif lock.delay_until > tau:
            self._set_block(lock, lock.delay_until)
        else:
            self._unschedule(lock.block)
            lock.block = None
            if not lock.shared:
                del self.locks[lock.name]

    def _group_ready(self, g, tau) -> bool:
        for m in g.members:
            lock = m.lock
            if lock.waiters[0] is not m or lock.holder is not None:
                return False
            if tau < max(lock.delay_until, self.hold_until):
                return False
            if not m.shared and lock.shared:
                return False
        return True

    def _grant_group(self, g, now, tau, skip) -> None:
        if self._counter + len(g.members) > MAX_COUNTER:
            raise OverflowError("fencing counter exhausted")
        locks = [m.lock for m in g.members]
        for m, lock in zip(g.members, locks):
            self._remove_waiter(lock, m)
        for m, lock in zip(g.members, locks):
            if m.shared:
                self._grant_lease(lock, m.owner, m.session, m.request, m.ttl_ms, m.lock_delay_ms, m.meta, True,
                                  now, now - m.enqueued_ms, m.actor)
            else:
                self._grant(lock, m.owner, m.session, m.request, m.ttl_ms, m.lock_delay_ms, m.meta, now,
                            now - m.enqueued_ms, m.actor)
        for lock in locks:
            if lock is not skip:
                self._settle(lock, tau, now)

    def _remove_group(self, g, kind, cycle, skip, tau, now) -> None:
        locks = [m.lock for m in g.members]
        for m, lock in zip(g.members, locks):
            if kind:
                event = self._waiter_event(kind, lock, m)
                event.cycle = cycle
                self.events.append(event)
            self._remove_waiter(lock, m)
        for lock in locks:
            if lock is not skip:
                self._settle(lock, tau, now)

    def _find_waiter(self, lock, owner) -> _Waiter | None:
        for w in lock.waiters:
            if w.owner == owner:
                return w
        return None

    # -- lock operations -----------------------------------------------------------

    def acquire(self, name, owner, session, request, ttl_ms, wait_ms, lock_delay_ms, meta, now,
                shared=False, limit=0, actor=0, priority=0) -> int:
        name = _name(name)
        owner = _owner(owner)
        session = _nonneg(session, "session")
        ttl_ms = _ms(ttl_ms, "ttl_ms", 1)
        wait_ms = _ms(wait_ms, "wait_ms", -1)
        lock_delay_ms = _lock_delay(lock_delay_ms)
        now = _ms(now, "now", 0)
        actor = _nonneg(actor, "actor")
        priority = _priority(priority)
        shared = _bool(shared, "shared")
        limit = _limit(limit, shared)
        exclusive = not (shared or limit)
        self._expire(now)
        lock = self.locks.get(name)
        if lock is None:
            if now >= self.hold_until:
                if self._counter >= MAX_COUNTER:
                    raise OverflowError("fencing counter exhausted")
                lock = self.locks[name] = _Lock(name)
                lock.limit = limit
                if exclusive:
                    self._grant(lock, owner, session, request, ttl_ms, lock_delay_ms, meta, now, 0, actor, priority)
                else:
                    self._grant_lease(lock, owner, session, request, ttl_ms, lock_delay_ms, meta, shared, now, 0,
                                      actor)
                return GRANTED
        else:
            if lock.holder is not None or lock.shared or lock.waiters:
                if limit != lock.limit:
                    return LIMIT_CONFLICT
            h = lock.holder if (lock.holder is not None and lock.holder.owner == owner) else lock.shared.get(owner)
            if h is not None:
                is_lease = lock.holder is not h
                self.events.append(
                    Event(EV_GRANTED, name, h.token, owner, session, request, h.ttl_ms, h.entry.deadline,
                          h.meta, False, h.lock_delay_ms, h.entry.deadline - h.ttl_ms - now, h.shared,
                          lock.limit if is_lease else 0))
                return GRANTED
            w = self._find_waiter(lock, owner)
            if w is not None and w.group is not None:
                raise ValueError("owner waits in an acquire_many() request")
            if w is not None:
                self.n["cancels"] += 1
                self.events.append(self._waiter_event(EV_WAIT_CANCELLED, lock, w))
                if wait_ms == 0:
                    self._remove_waiter(lock, w)
                    self._settle(lock, now, now)
                    return NOT_ACQUIRED
                if session != w.session:
                    order = self.sessions[w.session]
                    order.remove((name, owner))
                    if not order:
                        del self.sessions[w.session]
                    self.sessions.setdefault(session, []).append((name, owner))
                    w.session = session
                w.actor = actor
                w.request, w.ttl_ms, w.lock_delay_ms, w.meta = request, ttl_ms, lock_delay_ms, meta
                w.enqueued_ms = now
                self._unschedule(w.entry)
                w.entry = self._schedule(WAIT, lock, now + wait_ms, w) if wait_ms > 0 else None
                return QUEUED
            if (not lock.waiters and lock.holder is None
                    and now >= max(lock.delay_until, self.hold_until)):
                if not lock.shared:
                    lock.limit = limit
                if exclusive and not lock.shared:
                    if self._counter >= MAX_COUNTER:
                        raise OverflowError("fencing counter exhausted")
                    self._grant(lock, owner, session, request, ttl_ms, lock_delay_ms, meta, now, 0, actor, priority)
                    return GRANTED
                if not exclusive and (limit == 0 or len(lock.shared) < limit):
                    if self._counter >= MAX_COUNTER:
                        raise OverflowError("fencing counter exhausted")
                    self._grant_lease(lock, owner, session, request, ttl_ms, lock_delay_ms, meta, shared, now, 0,
                                      actor)
                    return GRANTED
        if wait_ms == 0:
            return NOT_ACQUIRED
        if lock is None:
            lock = self.locks[name] = _Lock(name)
            lock.limit = limit
        elif not lock.waiters and lock.holder is None and not lock.shared:
            lock.limit = limit
        w = _Waiter(owner, session, request, ttl_ms, lock_delay_ms, meta, None, now, shared, None, lock, actor,
                    priority)
        # ahead of every waiter of a lower priority, behind the others (FIFO within a priority)
        at = len(lock.waiters)
        while at > 0 and lock.waiters[at - 1].priority < priority:
            at -= 1
        lock.waiters.insert(at, w)
        self.sessions.setdefault(session, []).append((name, owner))
        if wait_ms > 0:
            w.entry = self._schedule(WAIT, lock, now + wait_ms, w)
        self._settle(lock, now, now)
        return QUEUED

    def acquire_many(self, items, owner, session, request, ttl_ms, wait_ms, lock_delay_ms, meta, now,
                     actor=0) -> int:
        if type(items) not in (list, tuple):
            raise TypeError("items must be a list or tuple")
        if not 1 <= len(items) <= MAX_MANY:
            raise ValueError("items must hold 1..MAX_MANY names")
        names, kinds = [], []
        for item in items:
            if type(item) not in (list, tuple) or len(item) != 2:
                raise TypeError("each item must be a (name, shared) pair")
            names.append(_name(item[0]))
            kinds.append(_bool(item[1], "shared"))
        if len(set(names)) != len(names):
            raise ValueError("items name a lock twice")
        owner = _owner(owner)
        session = _nonneg(session, "session")
        ttl_ms = _ms(ttl_ms, "ttl_ms", 1)
        wait_ms = _ms(wait_ms, "wait_ms", -1)
        lock_delay_ms = _lock_delay(lock_delay_ms)
        now = _ms(now, "now", 0)
        actor = _nonneg(actor, "actor")
        self._expire(now)
        k = len(names)
        first = None
        held_all = True
        holds_any = False
        for name, shared in zip(names, kinds):
            lock = self.locks.get(name)
            if lock is None:
                held_all = False
                continue
            if lock.limit and (lock.shared or lock.waiters):
                return LIMIT_CONFLICT
            w = self._find_waiter(lock, owner)
            if w is not None:
                if w.group is None or len(w.group.members) != k or (first is not None and w.group is not first.group):
                    raise ValueError("owner already waits on a name in another request")
                first = w
            holds_any |= (lock.holder is not None and lock.holder.owner == owner) or owner in lock.shared
            if not ((lock.holder is not None and lock.holder.owner == owner and not shared)
                    or (shared and owner in lock.shared)):
                held_all = False
        if holds_any and not held_all:
            raise ValueError("owner already holds some of these names in another request")
        if first is not None:
            if held_all:
                raise ValueError("owner already holds some of these names")
            g = first.group
            if any(m.lock.name not in names for m in g.members):
                raise ValueError("owner waits in a request for other names")
            self.n["cancels"] += len(g.members)
            for m in g.members:
                self.events.append(self._waiter_event(EV_WAIT_CANCELLED, m.lock, m))
            if wait_ms == 0:
                self._remove_group(g, 0, None, None, now, now)
                return NOT_ACQUIRED
            for m in g.members:
                if session != m.session:
                    order = self.sessions[m.session]
                    order.remove((m.lock.name, owner))
                    if not order:
                        del self.sessions[m.session]
                    self.sessions.setdefault(session, []).append((m.lock.name, owner))
                    m.session = session
                m.actor = actor
                m.request, m.ttl_ms, m.lock_delay_ms, m.meta = request, ttl_ms, lock_delay_ms, meta
                m.enqueued_ms = now
            if g.entry is not None:
                self._unschedule(g.entry)
                g.entry = None
            if wait_ms > 0:
                g.entry = self._schedule(GROUP, None, now + wait_ms)
                g.entry.group = g
            return QUEUED
        if held_all:
            for name in names:
                lock = self.locks[name]
                h = lock.holder if lock.holder is not None else lock.shared[owner]
                self.events.append(
                    Event(EV_GRANTED, name, h.token, owner, session, request, h.ttl_ms, h.entry.deadline,
                          h.meta, False, h.lock_delay_ms, h.entry.deadline - h.ttl_ms - now, h.shared))
            return GRANTED
        free = now >= self.hold_until and all(
            lock is None or not (lock.waiters or lock.holder is not None or now < lock.delay_until
                                 or (lock.shared and not shared))
            for lock, shared in ((self.locks.get(n), sh) for n, sh in zip(names, kinds)))
        if free:
            if self._counter + k > MAX_COUNTER:
                raise OverflowError("fencing counter exhausted")
            for name, shared in zip(names, kinds):
                lock = self.locks.get(name)
                if lock is None:
                    lock = self.locks[name] = _Lock(name)
                lock.limit = 0
                if shared:
                    self._grant_lease(lock, owner, session, request, ttl_ms, lock_delay_ms, meta, True, now, 0, actor)
                else:
                    self._grant(lock, owner, session, request, ttl_ms, lock_delay_ms, meta, now, 0, actor)
            return GRANTED
        if wait_ms == 0:
            return NOT_ACQUIRED
        g = _Group([])
        for name, shared in zip(names, kinds):
            lock = self.locks.get(name)
            if lock is None:
                lock = self.locks[name] = _Lock(name)
            elif not lock.waiters and lock.holder is None and not lock.shared:
                lock.limit = 0
            w = _Waiter(owner, session, request, ttl_ms, lock_delay_ms, meta, None, now, shared, g, lock, actor)
            lock.waiters.append(w)
            self.sessions.setdefault(session, []).append((name, owner))
            g.members.append(w)
        if wait_ms > 0:
            g.entry = self._schedule(GROUP, None, now + wait_ms)
            g.entry.group = g
        for w in list(g.members):
            if w.lock is not None:
                self._settle(w.lock, now, now)
        return QUEUED

    def _lease_of(self, name, token, owner):
        """(lock, lease) for the unexpired holder (token, owner) of ``name``; NotHolder if none."""
        lock = self.locks.get(name)
        if lock is not None:
            h = lock.holder
            if h is not None and h.token == token and h.owner == owner:
                return lock, h
            lease = lock.shared.get(owner)
            if lease is not None and lease.token == token:
                return lock, lease
        raise NotHolder(name)

    def _drop(self, lock, lease) -> None:
        self._unschedule(lease.entry)
        if lock.holder is lease:
            lock.holder = None
        else:
            del lock.shared[lease.owner]

    def release(self, name, token, owner, now) -> None:
        name = _name(name)
        token = _nonneg(token, "token")
        owner = _owner(owner)
        now = _ms(now, "now", 0)
        self._expire(now)
        lock, lease = self._lease_of(name, token, owner)
        self._drop(lock, lease)
        self.n["releases"] += 1
        self._settle(lock, now, now)

    def release_to(self, name, token, owner, to_owner, now) -> None:
        name = _name(name)
        token = _nonneg(token, "token")
        owner = _owner(owner)
        to_owner = _owner(to_owner)
        now = _ms(now, "now", 0)
        self._expire(now)
        lock = self.locks.get(name)
        h = None if lock is None else lock.holder
        if h is None or h.token != token or h.owner != owner:
            raise NotHolder(f"lease {token} of {owner!r} does not hold {name!r} exclusively")
        w = self._find_waiter(lock, to_owner)
        if w is None:
            raise ValueError(f"{to_owner!r} does not wait on {name!r}")
        if w.group is not None or w.shared:
            raise ValueError(f"{to_owner!r} waits in an acquire_many() request or for a shared lease")
        w.priority = max(w.priority, lock.waiters[0].priority)
        lock.waiters.remove(w)
        lock.waiters.insert(0, w)
        self._drop(lock, h)
        self.n["releases"] += 1
        self._settle(lock, now, now)

    def holder_priority(self, name) -> int:
        lock = self.locks.get(_name(name))
        return -1 if lock is None or lock.holder is None else lock.holder.priority

    def waiter_priority(self, name, owner) -> int:
        lock = self.locks.get(_name(name))
        w = None if lock is None else self._find_waiter(lock, _owner(owner))
        return -1 if w is None else w.priority

    def waiter_priorities(self, name) -> list[tuple[bytes, int]]:
        lock = self.locks.get(_name(name))
        return [] if lock is None else [(w.owner, w.priority) for w in lock.waiters]

    def extend(self, name, token, owner, ttl_ms, now, session=None) -> int:
        name = _name(name)
        token = _nonneg(token, "token")
        owner = _owner(owner)
        ttl_ms = _ms(ttl_ms, "ttl_ms", 1)
        now = _ms(now, "now", 0)
        if session is not None:
            session = _nonneg(session, "session")
        self._expire(now)
        lock, h = self._lease_of(name, token, owner)
        h.ttl_ms = ttl_ms
        if session is not None:
            h.session = session
        self._unschedule(h.entry)
        h.entry = self._schedule(LEASE if lock.holder is h else SHARED, lock, now + ttl_ms)
        h.entry.lease = h
        return now + ttl_ms

    def cancel(self, name, owner, now) -> bool:
        name = _name(name)
        owner = _owner(owner)
        now = _ms(now, "now", 0)
        self._expire(now)
        lock = self.locks.get(name)
        w = self._find_waiter(lock, owner) if lock is not None else None
        if w is None:
            return False
        if w.group is not None:
            self.n["cancels"] += len(w.group.members)
            self._remove_group(w.group, EV_WAIT_CANCELLED, None, None, now, now)
            return True
        self.n["cancels"] += 1
        self.events.append(self._waiter_event(EV_WAIT_CANCELLED, lock, w))
        self._remove_waiter(lock, w)
        self._settle(lock, now, now)
        return True

    def drop_session(self, session, now) -> int:
        session = _nonneg(session, "session")
        now = _ms(now, "now", 0)
        self._expire(now)
        count = 0
        touched = []
        for name, owner in list(self.sessions.get(session, [])):
            lock = self.locks[name]
            self._remove_waiter(lock, self._find_waiter(lock, owner))
            self.n["cancels"] += 1
            count += 1
            if lock not in touched:
                touched.append(lock)
        for lock in touched:  # settled only once every waiter of the session is gone
            self._settle(lock, now, now)
        return count

    def expire(self, now) -> None:
        self._expire(_ms(now, "now", 0))

    def next_deadline(self) -> int:
        e = self._earliest()
        return -1 if e is None else e.deadline

    def drain_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    # -- queries ---------------------------------------------------------------------

    def _leases(self, lock) -> list[_Lease]:
        return [lock.holder] if lock.holder is not None else list(lock.shared.values())

    def _snapshot(self, lock, h=None) -> Holder:
        h = lock.holder if h is None else h
        limit = 0 if h is lock.holder else lock.limit
        return Holder(lock.name, h.token, h.owner, h.session, h.ttl_ms, h.entry.deadline, h.lock_delay_ms,
                      h.meta, h.shared, limit)

    def holder(self, name, now, owner=None) -> Holder | None:
        name = _name(name)
        now = _ms(now, "now", 0)
        if owner is not None:
            owner = _owner(owner)
        for h in self.holders_of(name, now):
            if owner is None or h.owner == owner:
                return h
        return None

    def holders_of(self, name, now) -> list[Holder]:
        name = _name(name)
        now = _ms(now, "now", 0)
        lock = self.locks.get(name)
        if lock is None:
            return []
        return [self._snapshot(lock, h) for h in self._leases(lock) if h.entry.deadline > now]

    def check(self, name, token, now) -> bool:
        name = _name(name)
        token = _nonneg(token, "token")
        now = _ms(now, "now", 0)
        lock = self.locks.get(name)
        if lock is None:
            return False
        return any(h.token == token and now < h.entry.deadline for h in self._leases(lock))

    def waiters(self, name) -> list[bytes]:
        lock = self.locks.get(_name(name))
        return [] if lock is None else [w.owner for w in lock.waiters]

    def waiter_info(self, name) -> list[tuple]:
        lock = self.locks.get(_name(name))
        out = []
        for w in [] if lock is None else lock.waiters:
            entry = w.group.entry if w.group is not None else w.entry
            out.append((w.owner, w.session, w.meta, w.enqueued_ms,
                        -1 if entry is None else entry.deadline, w.shared))
        return out

    def session_waiters(self, session) -> int:
        return len(self.sessions.get(_nonneg(session, "session"), []))

    def holders(self) -> list[Holder]:
        return [self._snapshot(lock, h) for lock in self.locks.values() for h in self._leases(lock)]

    def waited_names(self, select=None, unheld=False) -> list[str]:
        if select is not None and not callable(select):
            raise TypeError("select must be None or a callable(name) -> bool")
        return sorted(name for name, lock in self.locks.items()
                      if lock.waiters and not (unheld and self._leases(lock))
                      and (select is None or select(name)))

    def held_page(self, prefix, after, limit, by_waiters, now) -> tuple[list[tuple[str, int]], int]:
        now = _ms(now, "now", 0)
        rows = []  # (name, live leases, waiters) of every matching lock
        for name, lock in self.locks.items():
            live = sum(1 for h in self._leases(lock) if h.entry.deadline > now)
            if live and name.startswith(prefix) and (after is None or name > after):
                rows.append((name, live, len(lock.waiters)))
        if by_waiters:
            rows.sort(key=lambda r: (r[2] == 0, -r[2], r[0]))
        else:
            rows.sort()
        return [(name, waiters) for name, _, waiters in rows[:limit]], sum(r[1] for r in rows)

    def stats(self) -> dict[str, int]:
        return {
            "locks_held": len(self),
            "waiters": sum(len(lock.waiters) for lock in self.locks.values()),
            **self.n,
            "locks": len(self.locks),
            "deadlines": len(self.entries),
        }

    def __len__(self) -> int:
        return sum(len(self._leases(lock)) for lock in self.locks.values())

    @property
    def waiter_count(self) -> int:
        return sum(len(lock.waiters) for lock in self.locks.values())

    # -- replication / recovery ----------------------------------------------------------

    def install_holder(self, name, token, owner, ttl_ms, lock_delay_ms, meta, now, shared=False, limit=0) -> None:
        name = _name(name)
        token = _nonneg(token, "token")
        if token & MAX_COUNTER == 0:
            raise ValueError("token with a zero counter part")
        owner = _owner(owner)
        ttl_ms = _ms(ttl_ms, "ttl_ms", 1)
        lock_delay_ms = _lock_delay(lock_delay_ms)
        now = _ms(now, "now", 0)
        shared = _bool(shared, "shared")
        limit = _limit(limit, shared)
        exclusive = not (shared or limit)
        self._expire(now)
        lock = self.locks.get(name)
        if lock is None:
            lock = self.locks[name] = _Lock(name)
        w = self._find_waiter(lock, owner)
        if w is not None and w.group is not None:
            self.n["cancels"] += len(w.group.members)
            self._remove_group(w.group, EV_WAIT_CANCELLED, None, lock, now, now)
        elif w is not None:
            self.n["cancels"] += 1
            self.events.append(self._waiter_event(EV_WAIT_CANCELLED, lock, w))
            self._remove_waiter(lock, w)
        for lease in list(lock.shared.values()):
            if exclusive or lease.owner == owner or lock.limit != limit:
                self._drop(lock, lease)
        if lock.holder is not None:
            self._drop(lock, lock.holder)
        self._unschedule(lock.block)
        lock.block = None
        lock.delay_until = 0
        lock.limit = limit
        if exclusive:
            entry = self._schedule(LEASE, lock, now + ttl_ms)
            lock.holder = _Lease(token, owner, 0, ttl_ms, lock_delay_ms, meta, entry)
        else:
            entry = self._schedule(SHARED, lock, now + ttl_ms)
            entry.lease = lock.shared[owner] = _Lease(token, owner, 0, ttl_ms, lock_delay_ms, meta, entry, shared)
        self._counter = max(self._counter, token & MAX_COUNTER)
        self.epoch = max(self.epoch, token >> TOKEN_EPOCH_SHIFT)

    def remove_holder(self, name, token, now) -> bool:
        name = _name(name)
        token = _nonneg(token, "token")
        now = _ms(now, "now", 0)
        self._expire(now)
        lock = self.locks.get(name)
        if lock is None:
            return False
        for h in self._leases(lock):
            if h.token == token:
                self._drop(lock, h)
                self._settle(lock, now, now)
                return True
        return False

    # -- deadlock detection ------------------------------------------------------------
    # The same graph as the core's (see LockTable.break_deadlocks), built whole; its
    # components come from pairwise reachability instead of Tarjan's algorithm.  Its
    # searches are whole: ``max_work`` only stops a call from starting another search (the
    # core also stops a search at the bound and goes on at the next call; a call over a
    # graph smaller than the bound is the same in both).

    @staticmethod
    def _request_key(req):
        if isinstance(req, _Group):
            first = req.members[0]
            return (first.enqueued_ms, max(m.lock.name for m in req.members), first.owner)
        return (req.enqueued_ms, req.lock.name, req.owner)

    def _waiting_parties(self, now, min_wait_ms) -> dict:
        """(session, actor) -> its requests waiting >= min_wait_ms on locks, ascending by age key,
        for the parties that hold a lease of a name somebody waits for (no other party has an
        edge into it, so no other is in a cycle)."""
        holders = set()
        for lock in self.locks.values():
            if lock.waiters:
                if lock.holder is not None:
                    holders.add((lock.holder.session, lock.holder.actor))
                holders.update((h.session, h.actor) for h in lock.shared.values())
        parties: dict = {}
        for lock in self.locks.values():
            for w in lock.waiters:
                if lock.limit or w.session == 0 or now - w.enqueued_ms < min_wait_ms:
                    continue
                if (w.session, w.actor) not in holders:
                    continue
                req = w.group if w.group is not None else w
                reqs = parties.setdefault((w.session, w.actor), [])
                if req not in reqs:
                    reqs.append(req)
        for reqs in parties.values():
            reqs.sort(key=self._request_key)
        return parties

    @staticmethod
    def _waiter_successors(w) -> list:
        lock = w.lock
        out = []
        i = lock.waiters.index(w)
        if i > 0:
            ahead = lock.waiters[i - 1]
            out.append(ahead.group if ahead.group is not None else ahead)
        if lock.holder is not None or (not w.shared and lock.shared):
            out.append(lock)
        return out

    def _successors(self, node, parties) -> list:
        if isinstance(node, tuple):
            return parties.get(node, [])
        if isinstance(node, _Waiter):
            return self._waiter_successors(node)
        if isinstance(node, _Group):
            return [n for m in node.members for n in self._waiter_successors(m)]
        # holders that do not wait cannot be in a cycle: left out, as the core does
        if node.holder is not None:
            party = (node.holder.session, node.holder.actor)
            return [party] if party in parties else []
        return sorted({(h.session, h.actor) for h in node.shared.values() if (h.session, h.actor) in parties})

    def _reach(self, node, parties) -> set:
        """Every node reachable from ``node`` by one or more edges."""
        seen, todo = set(), [node]
        while todo:
            for nxt in self._successors(todo.pop(), parties):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    def _deadlock_victims(self, now, min_wait_ms) -> list:
        """[(victim request, cycle)], one per component with two or more parties."""
        parties = self._waiting_parties(now, min_wait_ms)
        reach = {root: self._reach(root, parties) for root in parties}
        nodes = set(parties).union(*reach.values()) if reach else set()
        self.search_nodes = len(nodes) if len(parties) >= 2 else 0
        for node in nodes - set(reach):
            reach[node] = self._reach(node, parties)
        victims, done = [], set()
        for party in parties:
            if party in done:
                continue
            comp = {n for n in nodes if n in reach[party] and party in reach[n]} | {party}
            done |= comp
            members = [n for n in comp if isinstance(n, tuple)]
            if len(members) < 2:
                continue
            for victim in sorted((r for p in members for r in parties[p] if r in comp),
                                 key=self._request_key, reverse=True):
                first = victim.members[0] if isinstance(victim, _Group) else victim
                home = (first.session, first.actor)
                out = self._bfs(victim, lambda n, home=home: isinstance(n, tuple) and n != home, home,
                                comp, parties)
                if out is not None:
                    break
            back = self._bfs(out[-1], lambda n, home=home: n == home, None, comp, parties)

            def step_name(req, nxt):
                if isinstance(req, _Waiter):
                    return req.lock.name
                return next(m.lock.name for m in req.members if nxt in self._waiter_successors(m))

            steps = [(home[0], step_name(victim, out[1]))]
            steps += [(back[i][0], step_name(back[i + 1], back[i + 2]))
                      for i in range(len(back) - 1) if isinstance(back[i], tuple)]
            victims.append((victim, tuple(steps)))
        return victims

    def _bfs(self, start, is_end, avoid, comp, parties):
        """Breadth-first path [start, ..., end] inside ``comp`` to the first node discovered
        with is_end(node), never entering ``avoid``; None if there is none."""
        parent, queue = {start: None}, [start]
        while queue:
            node = queue.pop(0)
            for nxt in self._successors(node, parties):
                if nxt in parent or nxt not in comp or nxt == avoid:
                    continue
                parent[nxt] = node
                if is_end(nxt):
                    path = []
                    while nxt is not None:
                        path.append(nxt)
                        nxt = parent[nxt]
                    return path[::-1]
                queue.append(nxt)
        return None

    def has_deadlock(self, now, min_wait_ms) -> bool:
        """True iff a component of the wait-for graph holds two or more parties."""
        return bool(self._deadlock_victims(now, min_wait_ms))

    def break_deadlocks(self, now, min_wait_ms, max_work=DEADLOCK_WORK) -> list:
        now = _ms(now, "now", 0)
        min_wait_ms = _ms(min_wait_ms, "min_wait_ms", 0)
        max_work = _ms(max_work, "max_work", 0)
        self._expire(now)
        broken, work = [], 0
        for _ in range(DEADLOCK_PASSES):
            if broken and work >= max_work:
                break
            victims = self._deadlock_victims(now, min_wait_ms)
            work += self.search_nodes
            if not victims:
                break
            for victim, cycle in sorted(victims, key=lambda v: self._request_key(v[0])):
                self.n["deadlocks"] += 1
                broken.append(cycle)
                if isinstance(victim, _Group):
                    self._remove_group(victim, EV_DEADLOCK, cycle, None, now, now)
                    continue
                lock = victim.lock
                event = self._waiter_event(EV_DEADLOCK, lock, victim)
                event.cycle = cycle
                self.events.append(event)
                self._remove_waiter(lock, victim)
                self._settle(lock, now, now)
        return broken

    def lock_delays(self) -> list[tuple[str, int]]:
        return [(lock.name, lock.delay_until) for lock in self.locks.values()
                if lock.delay_until > 0 and lock.holder is None]

    def install_lock_delay(self, name, until_ms, now) -> bool:
        name = _name(name)
        until_ms = _ms(until_ms, "until_ms", 0)
        now = _ms(now, "now", 0)
        self._expire(now)
        if until_ms <= now:
            return False
        lock = self.locks.get(name)
        if lock is None:
            lock = self.locks[name] = _Lock(name)
        elif lock.holder is not None:
            return False
        lock.delay_until = max(lock.delay_until, until_ms)
        self._settle(lock, now, now)
        return True

    def hold_grants_until(self, until_ms) -> None:
        self.hold_until = _ms(until_ms, "until_ms", 0)
        blocked = sorted((e for e in self.entries if e.kind == BLOCK and e.lock.waiters),
                         key=lambda e: (e.deadline, e.seq))
        for e in blocked:
            lock = e.lock
            at = max(lock.delay_until, self.hold_until)
            if e.deadline != at:
                self._unschedule(e)
                lock.block = self._schedule(BLOCK, lock, at)
