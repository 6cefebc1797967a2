"""The tooz driver's lock (:class:`FastlockLock`), exclusive or shared; see :mod:`fastlock.contrib.tooz`.

A lock object holds a stack of holds, each a fastlock lease and its kind (shared or
not).  tooz's semantics, as its functional suite and its file driver define them:

* an exclusive acquire on an object that holds the lock already does not re-enter: it
  asks the server like any other (``blocking=False`` then returns False).  A waiting
  acquire by the thread that holds the name through the same coordinator (any lock
  object of it) returns False at once: it would wait for itself (the client's
  :class:`~fastlock.errors.AlreadyHeld`); other threads queue;
* a shared acquire on an object that holds a live shared lease **joins** that lease: it
  extends it (which proves it alive) and pushes it once more, so it needs one release
  more.  It never queues on the server: the server queues a new reader behind a waiting
  writer (FIFO across kinds), and that writer waits for this object's own lease;
* :meth:`FastlockLock.release` pops one hold and releases the lease on the server when
  no hold of it is left.

The object may be shared by threads (as tooz's tests do); its stack is guarded by a
lock that a join holds across its extend, so no release can end the lease it joins.

Holds belong to the process that took them: in a child forked from it every method
first raises what the coordinator raises there (``tooz.ToozError``), and once the child
has restarted the coordinator the object holds nothing (its stack, and the guard a
parent thread may have held at the fork, are made anew), so the child can never release
or extend its parent's lease.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from tooz import locking

from ..client import Lease
from ..errors import LeaseLost, LockNotAcquired, LockNotHeld

if TYPE_CHECKING:
    from .tooz import FastlockDriver

__all__ = ["FastlockLock"]


class FastlockLock(locking.Lock):
    """A tooz lock on a fastlock lock (see the module docstring and :mod:`fastlock.contrib.tooz`)."""

    def __init__(self, coord: FastlockDriver, name: bytes, fl_name: str):
        super().__init__(name)
        self._coord = coord
        #: the fastlock lock name
        self._fl_name = fl_name
        #: the holds, oldest first: (lease, shared); a joined shared lease appears once per hold
        self._holds: list[tuple[Lease, bool]] = []
        self._state = threading.Lock()
        #: the process whose holds ``_holds`` are
        self._pid = os.getpid()

    def _here(self) -> None:
        """Raise in a forked child of the coordinator's process (``tooz.ToozError``); drop
        the holds of another process (see the module docstring)."""
        self._coord.check_process()
        if self._pid != os.getpid():
            self._state = threading.Lock()
            self._holds = []
            self._pid = os.getpid()

    @property
    def acquired(self) -> bool:
        return bool(self._holds) and self._pid == os.getpid()

    @property
    def lease(self) -> Lease | None:
        """The lease of the newest hold, or None when not held."""
        holds = self._holds
        return holds[-1][0] if holds and self._pid == os.getpid() else None

    def leases(self) -> list[Lease]:
        """The distinct leases this object holds (one per fencing token)."""
        self._here()
        with self._state:
            return list({lease.fencing_token: lease for lease, _ in self._holds}.values())

    def acquire(self, blocking: bool | float = True, shared: bool = False, timeout: float | None = None) -> bool:
        """Take the lock, exclusive or ``shared`` (a fastlock shared lease: any number of
        shared holders, or one exclusive).  ``blocking`` False tries once, True waits
        ``timeout`` seconds (None: forever), a number waits that many seconds.  A shared
        acquire on an object with a live shared lease joins it (see the module docstring).
        Returns False if not taken; a lost connection raises ``ToozConnectionError``."""
        if blocking is False:
            wait: float | None = 0.0
        elif blocking is True:
            wait = timeout
        else:
            wait = float(blocking)
        self._here()
        if shared and self._join_shared():
            return True
        coord = self._coord
        try:
            acquiring = coord.fastlock_client().acquire(self._fl_name, ttl=coord.lock_ttl, wait=wait,
                                                        shared=bool(shared))
            lease = coord.call(acquiring)
        except LockNotAcquired:
            return False
        with self._state:
            self._holds.append((lease, bool(shared)))
        coord.lock_taken(self)
        return True

    def _join_shared(self) -> bool:
        """Push the newest live shared hold again (extended by the lock TTL); False if there
        is none.  Holds of a lease found lost are dropped."""
        coord = self._coord
        with self._state:
            while self._holds:
                shared = [lease for lease, is_shared in self._holds if is_shared]
                if not shared:
                    return False
                lease = shared[-1]
                try:
                    coord.call(coord.fastlock_client().extend(lease, ttl=coord.lock_ttl))
                except LeaseLost:
                    self._drop(lease)
                    continue
                self._holds.append((lease, True))
                return True
        return False

    def _drop(self, lease: Lease) -> None:
        """Remove every hold of ``lease`` (caller holds ``_state``)."""
        self._holds = [h for h in self._holds if h[0].fencing_token != lease.fencing_token]
        if not self._holds:
            self._coord.lock_dropped(self)

    def release(self) -> bool:
        """Release the newest hold; its lease is released on the server when no other hold
        has it.  False if this object holds nothing, or the lease was lost (expired without
        heartbeat, or broken)."""
        self._here()
        with self._state:
            if not self._holds:
                return False
            lease, _ = self._holds.pop()
            if not self._holds:
                self._coord.lock_dropped(self)
            if any(h[0].fencing_token == lease.fencing_token for h in self._holds):
                return not lease.lost.is_set()
        coord = self._coord
        try:
            coord.call(coord.fastlock_client().release(lease))
        except LeaseLost:
            return False
        return True

    def is_still_owner(self) -> bool:
        """Whether the newest hold's lease is still one of the lock's current leases (the
        server's token check, which knows shared holders too)."""
        self._here()
        lease = self.lease
        if lease is None:
            return False
        coord = self._coord
        return bool(coord.call(coord.fastlock_client().check(self._fl_name, lease.fencing_token)))

    def heartbeat(self) -> bool:
        """Extend every lease held by the driver's ``timeout``; the holds of a lost lease
        are dropped.  False if nothing is held afterwards."""
        coord = self._coord
        for lease in self.leases():
            try:
                coord.call(coord.fastlock_client().extend(lease, ttl=coord.lock_ttl))
            except LeaseLost:
                with self._state:
                    self._drop(lease)
        return self.acquired

    def forget(self) -> list[Lease]:
        """Drop every hold without telling the server; returns the distinct leases dropped
        (the coordinator's ``stop`` releases them itself)."""
        leases = self.leases()
        with self._state:
            self._holds = []
        return leases

    def break_(self) -> bool:
        """Force-release the lock, whoever holds it, every shared holder included: the
        server's revoke (:meth:`fastlock.client.Client.revoke`, audited in its WAL); an old
        holder's next release or heartbeat finds its lease lost.  True if a holder was
        revoked, False if the lock was free.  The principal must be an admin (or the server
        in open mode), else :class:`~fastlock.errors.PermissionDenied`."""
        self._here()
        coord = self._coord
        try:
            revoked = coord.call(coord.fastlock_client().revoke(self._fl_name, reason="tooz break_"))
        except LockNotHeld:
            return False
        return bool(revoked)
