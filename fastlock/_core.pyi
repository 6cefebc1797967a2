"""Type stub for the compiled lock table (``fastlock/_core.pyx``).

The core is sans-IO: it never reads a clock, a socket or a file.  Every method
that can change state takes ``now``: the caller's monotonic clock in integer
**milliseconds**.  Every such method first expires whatever is due at ``now``
(exactly as :meth:`LockTable.expire` would), then does its own work.

Outcomes that concern other parties (a waiter granted, a lease expired, a
wait that timed out or was cancelled) are queued as :class:`Event` objects and
collected with :meth:`LockTable.drain_events`.  The immediate answer of a call
is its return value.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any

# acquire() statuses
GRANTED: int  # the lock was granted: an EV_GRANTED event carries the lease
QUEUED: int  # the request waits in the lock's FIFO queue
NOT_ACQUIRED: int  # wait_ms == 0 and the request was not grantable now
LIMIT_CONFLICT: int  # the name has holders/waiters under another semaphore limit; nothing changed

# Event kinds
EV_GRANTED: int  # a lease was granted (immediately or to a waiter)
EV_EXPIRED: int  # a lease reached its deadline
EV_WAIT_TIMEOUT: int  # a waiter's wait_ms ran out; it left the queue
EV_WAIT_CANCELLED: int  # a waiter was cancelled or superseded by a retry
EV_DEADLOCK: int  # a waiter was failed by break_deadlocks(); Event.cycle names the cycle

#: Bits of a fencing token below the epoch: token = (epoch << TOKEN_EPOCH_SHIFT) | counter
TOKEN_EPOCH_SHIFT: int  # 40
MAX_EPOCH: int  # (1 << 23) - 1, so tokens stay below 2**63
MAX_LOCK_DELAY_MS: int  # 60_000
MAX_COUNTER: int  # (1 << 40) - 1: a grant needing a larger counter raises OverflowError
MAX_MS: int  # (1 << 53) - 1: largest now / ttl_ms / wait_ms / until_ms accepted (ValueError above)
MAX_LIMIT: int  # (1 << 31) - 1: largest semaphore limit
MAX_MANY: int  # 64: most names in one acquire_many() request
MAX_PRIORITY: int  # 99: highest acquire() priority (0 the default)
DEADLOCK_PASSES: int  # 4: most searches of one break_deadlocks() call
DEADLOCK_WORK: int  # 10_000: steps of one break_deadlocks() call (waiters looked at, nodes entered or left)


class NotHolder(LookupError):
    """release/extend named a lease that is not the current, unexpired holder."""


class Event:
    kind: int
    name: str
    token: int  # EV_GRANTED / EV_EXPIRED: the lease's fencing token; else 0
    owner: bytes  # the acquire's owner key
    session: int  # session of the waiter (or of the holder when granted)
    request: Any  # opaque object given to acquire() (None for EV_EXPIRED)
    ttl_ms: int  # EV_GRANTED: the lease's TTL
    deadline_ms: int  # EV_GRANTED: lease deadline (now + ttl_ms)
    meta: Any  # opaque object given to acquire()
    lock_delay_ms: int  # EV_GRANTED / EV_EXPIRED: the lease's lock-delay
    fresh: bool  # EV_GRANTED: False when an idempotent retry re-delivers an existing lease
    waited_ms: int  # EV_GRANTED: grant time minus the answered request's arrival (<= 0 if re-delivered)
    shared: bool  # a shared (read) lease, or a waiter asking for one
    limit: int  # the semaphore limit of a permit / a waiter for one; 0 for a lock
    cycle: tuple[tuple[int, str], ...] | None  # EV_DEADLOCK: (session, name) steps, the failed waiter's first


class Holder:
    name: str
    token: int
    owner: bytes
    session: int
    ttl_ms: int
    deadline_ms: int
    lock_delay_ms: int
    meta: Any
    shared: bool  # a shared (read) lease
    limit: int  # a semaphore permit's limit; 0 for a lock's lease


class Block:
    """Bytes encoded in C, handed over without a copy: a read-only buffer (``bytes(block)``,
    ``memoryview(block)``, ``len(block)``) that frees its memory when collected."""
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...

class LockTable:
    """Leased locks, shared locks and counting semaphores with fencing tokens and
    FIFO waiters, sans-IO; every time is monotonic integer milliseconds.

    Kinds of request on one name (acquire()'s ``shared`` / ``limit``):

    * exclusive (default): granted when the name has no holder of any kind;
    * shared (``shared=True``): granted while no exclusive lease is held, so any
      number of readers share (as ZooKeeper's read lock, PostgreSQL's
      ``pg_advisory_lock_shared``);
    * permit (``limit=N``): the name is a counting semaphore with at most N
      holders (Curator's InterProcessSemaphoreV2, ``consul lock -n N``).

    FIFO across kinds: a request is granted only from the head of the name's queue
    (or when it is empty) and only if compatible with the current holders; settling
    grants head waiters while they are compatible, so consecutive readers (or
    permits) go together and a queued writer is never overtaken by later readers.
    Every grant of every kind takes its own token from the one counter, so a
    writer's token exceeds every token granted before it.
    """

    def __init__(self) -> None: ...

    # -- fencing counter ---------------------------------------------------
    epoch: int  # read-only; set with set_epoch()
    last_token: int  # read-only: (epoch << 40) | last counter issued (0 if none)

    def set_epoch(self, epoch: int) -> None:
        """Raise the epoch (ValueError if lower than the current one or > MAX_EPOCH)."""

    def advance_counter(self, counter: int) -> None:
        """Make the counter at least ``counter`` (never lowers it)."""

    @property
    def counter(self) -> int: ...

    # -- lock operations ------------------------------------------------------
    def acquire(
        self,
        name: str,
        owner: bytes,
        session: int,
        request: Any,
        ttl_ms: int,
        wait_ms: int,
        lock_delay_ms: int,
        meta: Any,
        now: int,
        shared: bool = False,
        limit: int = 0,
        actor: int = 0,
        priority: int = 0,
    ) -> int:
        """Grant ``name`` to ``owner`` or queue the request.

        priority: 0 (default)..MAX_PRIORITY; a queued request waits ahead of every
          waiter of a lower priority, FIFO within a priority (ValueError outside).

        wait_ms: -1 waits forever, 0 tries once, > 0 waits that many ms.
        shared: a shared (read) lease instead of an exclusive one.
        limit: 1..MAX_LIMIT makes ``name`` a counting semaphore and this a permit
          request (not combined with shared: ValueError); 0 (default) for a lock.
        actor: >= 0, who makes the request within the session (a task, a thread);
          the lease's holder is party (session, actor) of break_deadlocks(); 0: the
          session as a whole.
        Returns GRANTED (an EV_GRANTED event is queued), QUEUED, NOT_ACQUIRED, or
        LIMIT_CONFLICT when the name has holders or waiters under another limit
        (a semaphore vs a lock, or two limits): nothing changes.  A name's limit is
        remembered while it has holders or waiters.
        A retried waiting request keeps the kind it first asked for.
        ValueError if ``owner`` waits on ``name`` in an acquire_many() request.
        Idempotent by owner: if ``owner`` already holds ``name`` the existing
        lease is re-delivered (EV_GRANTED with fresh=False, no new token); if
        ``owner`` already waits on ``name`` the waiter keeps its place and takes
        the new session/request, and the old request gets EV_WAIT_CANCELLED.
        Not re-entrant otherwise: another owner on the same session queues.
        """

    def acquire_many(
        self,
        items: list[tuple[str, bool]] | tuple[tuple[str, bool], ...],
        owner: bytes,
        session: int,
        request: Any,
        ttl_ms: int,
        wait_ms: int,
        lock_delay_ms: int,
        meta: Any,
        now: int,
        actor: int = 0,
    ) -> int:
        """Take a set of (name, shared) locks atomically: all granted together or none.

        1..MAX_MANY distinct names; no semaphores (LIMIT_CONFLICT).  Granted at once
        (GRANTED; one EV_GRANTED per name in request order, each with its own token,
        every lease with ``owner``) when every name could be granted on its own;
        else QUEUED (or NOT_ACQUIRED for wait_ms == 0) as ONE request with a waiter at
        the tail of each name's queue, holding none of them.  It is granted when each
        of its waiters heads its queue and is compatible with that name's holders;
        until then it blocks each queue behind it (FIFO per name).  Queue order is
        arrival order on every name, so an earlier set is ahead of a later one on all
        names they share: no deadlock among waiting sets.  A wait timeout, cancel()
        of any of its names, drop_session() or break_deadlocks() removes the whole
        request (an event per name).  A retry with the same owner and names keeps its
        place (EV_WAIT_CANCELLED per name for the old request) or re-delivers the
        leases (fresh=False) if granted.  Waiters count per name in
        session_waiters() / waiter_count.

        Raises TypeError / ValueError for bad items or arguments, or when ``owner``
        already holds / waits on some of the names in another request; OverflowError
        if the fencing counter cannot cover the set.
        """

    def release(self, name: str, token: int, owner: bytes, now: int) -> None:
        """Release the lease (of any kind); compatible head waiters are granted.

        Raises NotHolder if (token, owner) is not an unexpired holder of name.
        A clean release never applies lock-delay.
        """

    def extend(self, name: str, token: int, owner: bytes, ttl_ms: int, now: int, session: int | None = None) -> int:
        """Set the lease's deadline to now + ttl_ms (and its TTL to ttl_ms).

        Returns the new deadline. Raises NotHolder as release() does; an expired
        lease is never revived.  ``session`` (optional): the renewing session becomes
        the lease's (break_deadlocks() sees a reconnected client's leases as its own).
        """

    def cancel(self, name: str, owner: bytes, now: int) -> bool:
        """Remove the waiter ``owner`` from ``name``'s queue (EV_WAIT_CANCELLED); a waiter
        of an acquire_many() request withdraws the whole request (an event per name).

        Returns False if no such waiter (it may have been granted already).
        """

    def drop_session(self, session: int, now: int) -> int:
        """Remove every waiter of ``session`` at once (no events). Holders stay."""

    def expire(self, now: int) -> None:
        """Process every deadline <= now, in (deadline, scheduling order)."""

    def next_deadline(self) -> int:
        """Earliest pending deadline in ms, or -1 when nothing is scheduled."""

    def drain_events(self) -> list[Event]: ...

    # -- queries ---------------------------------------------------------------
    def holder(self, name: str, now: int, owner: bytes | None = None) -> Holder | None:
        """An unexpired holder: without owner the exclusive one, else the earliest-granted
        shared holder / permit; with owner (bytes) that owner's lease of any kind."""
    def holder_count(self, name: str, now: int) -> int:
        """Number of unexpired holders of ``name`` (no snapshots built)."""
    def holders_of(self, name: str, now: int, start: int = 0, limit: int = -1) -> list[Holder]:
        """Every unexpired holder of ``name``: the exclusive one, or the shared holders /
        permits in grant order; ``start`` skips that many, at most ``limit`` (< 0: all)."""
    def check(self, name: str, token: int, now: int) -> bool:
        """True iff ``token`` is an unexpired holder's token, of any kind (Chubby's sequencer check)."""
    def waiters(self, name: str) -> list[bytes]:
        """Owners waiting on ``name`` in FIFO order."""
    def waiter_details(self, name: str, start: int = 0, limit: int = -1) -> list[tuple[int, bool, int, Any, bool]]:
        """The waiters of ``name`` in FIFO order as (session, shared, limit, meta, many):
        ``limit`` the name's semaphore limit (0 for a lock), ``many`` part of an
        acquire_many() request.  Owners are not included (for contenders()).  ``start``
        skips that many waiters, at most ``limit`` (< 0: all)."""
    def queue_length(self, name: str) -> int:
        """Number of waiters on ``name``."""
    def release_to(self, name: str, token: int, owner: bytes, to_owner: bytes, now: int) -> None:
        """Release the exclusive lease and grant it to the waiter ``to_owner`` at once
        (moved to the head first).  NotHolder / ValueError (no such plain exclusive
        waiter); nothing changes on an error."""

    def holder_priority(self, name: str) -> int:
        """The exclusive holder's request priority (-1: no exclusive holder)."""

    def waiter_priority(self, name: str, owner: bytes) -> int:
        """The priority of ``owner``'s waiting request on ``name`` (-1: it does not wait)."""

    def waiter_priorities(self, name: str, limit: int = -1) -> list[tuple[bytes, int]]:
        """``(owner, priority)`` of the waiters in queue order, the first ``limit``."""

    def waiter_info(self, name: str, limit: int = -1) -> list[tuple[bytes, int, Any, int, int, bool]]:
        """Waiters on ``name`` in FIFO order as ``(owner, session, meta, enqueued_ms,
        deadline_ms, shared)`` (ms; ``deadline_ms`` -1: waits without end; a member of an
        acquire_many() request has the request's deadline); the first ``limit`` (< 0: all)."""
    def session_waiters(self, session: int) -> int: ...
    def snapshot_begin(self, pack: Callable[[Any], bytes]) -> None:
        """Begin a snapshot of every holder as the msgpack array a WAL snapshot stores,
        encoded in C a slice at a time (:meth:`snapshot_step`) as the table is now: a lock
        whose holders change first is encoded just before the change (copy on write);
        ``pack`` encodes a meta field that is not None, str or bytes.
        :raises RuntimeError: one is in progress."""
    def snapshot_step(self, max_locks: int) -> bool:
        """Encode up to ``max_locks`` more locks; True once all are.
        :raises RuntimeError: none in progress.  :raises MemoryError: (the snapshot ends)."""
    def snapshot_end(self) -> tuple[int, Block]:
        """``(count, data)`` of the complete snapshot (``data``: without a copy); it is over.
        :raises RuntimeError: none complete."""
    def snapshot_abort(self) -> None:
        """End a snapshot in progress without its result."""
    def pack_holders(self, pack: Callable[[Any], bytes]) -> tuple[int, Block]:
        """``(count, data)``: a whole snapshot at once (begin, every step, end)."""
    def holders(self) -> list[Holder]:
        """Every current lease of every kind (for snapshots), any order."""
    def waited_names(self, select: Callable[[str], bool] | None = None, unheld: bool = False) -> list[str]:
        """The names with a waiter, sorted, whatever their state; only those ``select(name)``
        is true for; with ``unheld`` only those without any lease.  :raises TypeError:
        ``select`` is not callable."""
    def held_page(self, prefix: str, after: str | None, limit: int, by_waiters: bool,
                  now: int) -> tuple[list[tuple[str, int]], int]:
        """One page of the held locks (name, queue length) by name or by waiters, and the
        number of matching unexpired leases; builds no row outside the page."""
    def stats(self) -> dict[str, int]:
        """Counters; ``locks_held`` counts leases (each shared holder / permit)."""
    def __len__(self) -> int:
        """Number of leases currently held (each shared holder and permit counts)."""
    @property
    def waiter_count(self) -> int:
        """Number of waiters queued on every lock together."""

    # -- replication / recovery ------------------------------------------------
    def install_holders(self, holders: Iterable[Sequence[Any]], now: int) -> int:
        """:meth:`install_holder` for each 10-field HolderRecord, meta (client_name,
        correlation_id); returns the longest ttl_ms (0 if none)."""
    def install_holder(
        self, name: str, token: int, owner: bytes, ttl_ms: int, lock_delay_ms: int, meta: Any, now: int,
        shared: bool = False, limit: int = 0,
    ) -> None:
        """Make (token, owner) a holder of ``name`` with deadline now + ttl_ms.

        Used by WAL replay and by a standby; never queues, raises the counter to at
        least the token's counter and the epoch to at least the token's epoch.  An
        exclusive install replaces every holder; a shared / permit install
        (``shared`` / ``limit`` as acquire()) replaces an exclusive holder, the
        same owner's lease and leases under another limit, and joins the rest.
        """

    def remove_holder(self, name: str, token: int, now: int) -> bool:
        """Replay of a release/expiry: drop the holder (any kind) whose token is ``token``."""

    # -- deadlock detection ----------------------------------------------------
    def break_deadlocks(self, now: int, min_wait_ms: int, max_work: int = ...) -> list[tuple[tuple[int, str], ...]]:
        """Fail one request per deadlock; returns the cycles broken.

        Parties are (session, actor) (see acquire()); a party that waits releases
        nothing.  Linear graph: party -> its requests waiting >= min_wait_ms (ms;
        PostgreSQL's deadlock_timeout, the server calls this from its timer);
        request -> the request just ahead in each of its queues and the lock if a
        holder conflicts; lock -> its holders' parties.  Session 0 and semaphore
        waits (an OR-wait) are left out.  A deadlock is a strongly connected
        component (Tarjan, iterative) with two or more parties.  Its victim is the
        youngest request of one of its parties (latest arrival, then greatest name,
        then owner) that reaches another party: it gets EV_DEADLOCK with
        Event.cycle = ((session, name), ...) starting with its own step, and its
        locks are settled (grants may follow).  At most DEADLOCK_PASSES searches
        per call, a further one only while they made < max_work steps.
        Bounded work: roots are the parties that hold a name somebody waits for;
        a call makes at most max_work steps (a waiter looked at, a node entered or
        left), a search stopped there goes on at the next call (its graph search
        anew, over what still waits, if waiters or holders changed): see
        deadlock_backlog.
        """

    @property
    def deadlock_backlog(self) -> bool:
        """True while a deadlock search is left unfinished at its call's max_work."""

    def party_waits(self, session: int, actor: int, limit: int = ...) -> tuple[int, list[tuple[int, int]]]:
        """What party (session, actor) waits for: (the latest enqueued_ms of its waits on
        locks, -1 if none; at most ``limit`` distinct (session, actor) holding or waiting
        ahead on those names, the holders first)."""

    def lock_delays(self) -> list[tuple[str, int]]:
        """Every running lock-delay as (name, until_ms) (monotonic ms): what a snapshot keeps.
        A delay starts when a lease with a lock-delay expires; EV_EXPIRED carries
        deadline_ms and lock_delay_ms, so it runs until deadline_ms + lock_delay_ms."""

    def install_lock_delay(self, name: str, until_ms: int, now: int) -> bool:
        """Replay of a running lock-delay: no grant on name before until_ms (ms).
        False (ignored) if until_ms <= now or name is held exclusively."""

    def hold_grants_until(self, until_ms: int) -> None:
        """Grant no lock before ``until_ms`` (promotion grace period, as Chubby)."""
