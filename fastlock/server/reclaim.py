"""The reclaim window of a promoted primary: waiters that ride through keep their places.

When a standby is promoted, its mirror of the old primary's waiter queues
(:mod:`fastlock.replication.queues`: each lock's waiters as owner-key hashes, in
FIFO order) becomes a :class:`ReclaimGate`.  For ``window`` seconds
(``--queue-reclaim-window``, default :data:`DEFAULT_WINDOW`) an acquire of such a
lock does not enter the lock's queue at once; it is *parked*.  Parked acquires
enter the queue in the old order: the next expected waiter (proved by its owner
key, the same on every retry of a ride-through) goes in as soon as it is parked,
and with it every expected one parked behind it; an acquire that was not queued
before the failover goes in after every expected waiter.  At the window's end the
waiters that have not come back are skipped and everything parked enters the
queue: expected ones in their old order, then the others in arrival order.  So a
new arrival never overtakes a waiter that reclaims its place, and a waiter that
died with the old primary delays the ones behind it by the window at most.

A slot move that freezes a lock's slot within the window takes the lock out of it
(:meth:`ReclaimGate.take`): its queue, in the order above, leaves with the move's other
waiters of that lock, and its parked acquires are held by the move.

An acquire with ``wait=0`` on a lock that still expects waiters is refused
(``LockNotAcquired``: it could only be granted by overtaking them).  A CANCEL of a
parked acquire cancels it (its acquire gets ``Cancelled``); a parked acquire
whose connection closed is dropped.  A parked acquire's wait counts from when it
enters the queue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import protocol as P
from ..errors import Cancelled, FastlockError, LimitExceeded, LockNotAcquired
from ._wire import ReclaimWire

if TYPE_CHECKING:  # pragma: no cover
    from .session import Session

__all__ = ["DEFAULT_WINDOW", "Parked", "ReclaimGate"]

log = logging.getLogger(__name__)

#: seconds a promoted primary keeps the old waiters' places by default
DEFAULT_WINDOW = 5.0


class Parked(NamedTuple):
    """An acquire held by the gate: its connection, request id, request, owner-key hash and
    queue priority (ACQUIRE_PRIORITY's; 0 for ACQUIRE)."""

    conn: Session
    req_id: int
    msg: list
    owner: bytes
    priority: int = 0


class _Queue:
    __slots__ = ("expected", "parked")

    def __init__(self, expected: list[bytes]) -> None:
        self.expected = expected  # owner hashes not yet back, in the old FIFO order
        self.parked: list[Parked] = []


class ReclaimGate(ReclaimWire):
    """The locks whose old waiters may still reclaim their places (see the module).

    ``enter(conn, req_id, msg, name, owner, priority)`` runs an acquire now (the handler's);
    ``batch_end()`` ends the server's batch (events, flush)."""

    def __init__(self, enter: Callable[[Session, int, list, str, bytes, int], None], batch_end: Callable[[], None],
                 window: float = DEFAULT_WINDOW, limit: int = 100_000) -> None:
        self.enter = enter
        self.batch_end = batch_end
        self.window = window
        #: acquires parked at most, all locks together (``--max-waiters``): beyond, ``LimitExceeded``
        self.limit = limit
        self.parked = 0
        self.queues: dict[str, _Queue] = {}
        self._timer: Any = None
        self._ends_at = 0.0  # the loop's time when the window armed ends

    def arm(self, queues: dict[str, list[bytes]], holds: Callable[[str, bytes], bool], loop: Any,
            window: float | None = None) -> None:
        """Start the window with the old primary's ``queues`` (``holds(name, owner)``: the
        owner already holds the lock here - its grant was replicated - so it is not expected),
        for ``window`` seconds (None: :attr:`window`; at most that).  A window armed already
        ends at the later of its end and this one's."""
        window = self.window if window is None else min(window, self.window)
        if window <= 0:
            return
        for name, owners in queues.items():
            expected = [o for o in dict.fromkeys(owners) if not holds(name, o)]
            if expected:
                self.queues[name] = _Queue(expected)
        if self.queues:
            log.warning("reclaim window: %d locks keep the places of %d waiters of the old primary for %g s",
                        len(self.queues), sum(len(q.expected) for q in self.queues.values()), window)
            end = loop.time() + window
            if self._timer is None or self._ends_at < end:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = loop.call_later(window, self.close)
                self._ends_at = end

    def holds(self, name: str) -> bool:
        """Does the gate hold acquires of ``name`` now?"""
        return name in self.queues

    def park(self, conn: Session, req_id: int, msg: list, name: str, owner: bytes, wait_ms: int,
             priority: int = 0) -> None:
        """Hold this acquire of ``name`` (at queue ``priority``) until its place comes (it may enter at once).

        :raises LockNotAcquired: ``wait_ms`` 0 by one that was not queued before the failover.
        :raises LimitExceeded: ``limit`` acquires are parked already (by one not expected)."""
        queue = self.queues[name]
        if wait_ms == 0 and owner not in queue.expected:
            raise LockNotAcquired(f"{name!r}: waiters queued before the failover are reclaiming their places")
        for i, p in enumerate(queue.parked):
            if p.owner == owner:  # a retry of the same acquire (a new connection): it replaces the old
                del queue.parked[i]
                self.parked -= 1
                _fail(p, Cancelled(f"{name!r}: superseded by a retry of the same acquire"))
                break
        if self.parked >= self.limit and owner not in queue.expected:  # a returning waiter is never refused
            raise LimitExceeded(f"{self.limit} acquires already wait for the reclaim window after the "
                                f"promotion (max-waiters); retry")
        queue.parked.append(Parked(conn, req_id, msg, owner, priority))
        self.parked += 1
        self._advance(name, queue)

    def cancel(self, name: str, owner: bytes) -> bool:
        """A CANCEL of ``name`` by ``owner``: True if it was parked (now failed with
        ``Cancelled``) or expected (no longer awaited)."""
        queue = self.queues.get(name)
        if queue is None:
            return False
        found = False
        for i, p in enumerate(queue.parked):
            if p.owner == owner:
                del queue.parked[i]
                self.parked -= 1
                _fail(p, Cancelled(f"{name!r}: cancelled"))
                found = True
                break
        if owner in queue.expected:
            queue.expected.remove(owner)
            found = True
        self._advance(name, queue)
        return found

    def take(self, names: Callable[[str], bool]) -> dict[str, tuple[list[tuple[bytes, int]], list[Parked]]]:
        """Take the locks whose name ``names`` accepts out of the window (a move froze their slots:
        their queues leave with the move): name -> (its queue, the acquires parked for it).  The
        queue lists the (owner-key hash, queue priority) of the waiters still expected, in their old
        order, then of the acquires parked that were not expected, in arrival order; the parked
        acquires are the caller's to answer."""
        taken: dict[str, tuple[list[tuple[bytes, int]], list[Parked]]] = {}
        for name in [n for n in self.queues if names(n)]:
            queue = self.queues.pop(name)
            priority = {p.owner: p.priority for p in queue.parked}
            expected = set(queue.expected)
            order = [(o, priority.get(o, 0)) for o in queue.expected]
            order += [(p.owner, p.priority) for p in queue.parked if p.owner not in expected]
            self.parked -= len(queue.parked)
            taken[name] = (order, queue.parked)
        return taken

    def _advance(self, name: str, queue: _Queue) -> None:
        """Let in every parked acquire whose place has come."""
        expected = queue.expected
        while expected:
            nxt = next((p for p in queue.parked if p.owner == expected[0]), None)
            if nxt is None:
                return
            expected.pop(0)
            queue.parked.remove(nxt)
            self.parked -= 1
            self._enter(nxt, name)
        del self.queues[name]
        self.parked -= len(queue.parked)
        for p in queue.parked:
            self._enter(p, name)

    def _enter(self, p: Parked, name: str) -> None:
        if p.conn.closed:
            return
        try:
            self.enter(p.conn, p.req_id, p.msg, name, p.owner, p.priority)
        except FastlockError as exc:
            p.conn.send(P.encode_error(p.req_id, exc.code, str(exc), getattr(exc, "primary", None)))

    def close(self) -> None:
        """The window ended: skip the waiters that did not come back, let everything parked in."""
        self._timer = None
        queues, self.queues = self.queues, {}
        self.parked = 0
        skipped = 0
        for name, queue in queues.items():
            order = {o: i for i, o in enumerate(queue.expected)}
            back = sorted((p for p in queue.parked if p.owner in order), key=lambda p: order[p.owner])
            skipped += len(queue.expected) - len(back)
            for p in [*back, *(p for p in queue.parked if p.owner not in order)]:
                self._enter(p, name)
        if queues:
            log.info("reclaim window over: %d waiters of the old primary did not come back (skipped)", skipped)
            self.batch_end()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def status(self) -> dict:
        """The locks still in the window, the waiters they expect and the acquires parked."""
        return {"locks": len(self.queues), "expected": sum(len(q.expected) for q in self.queues.values()),
                "parked": self.parked, "window_s": self.window}


def _fail(p: Parked, exc: FastlockError) -> None:
    """Answer a parked acquire with ``exc``."""
    p.conn.send(P.encode_error(p.req_id, exc.code, str(exc), None))
