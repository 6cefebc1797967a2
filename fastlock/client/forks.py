"""What happens to the blocking client across ``fork()``.

A process that forks (Celery's prefork pool, gunicorn ``--preload``,
``multiprocessing`` with the ``fork`` start method) gives its child a copy of
every :class:`~fastlock.client.blocking.SyncClient`, but not the client's
background thread: the parent's event loop can never run in the child, and a
call handed to it would wait for ever.  So:

- **The child reconnects.**  At every call a ``SyncClient`` compares the
  process id with the one it was opened in.  In a new process it leaves the
  parent's loop, thread, connection and thread locks untouched - the parent
  still uses that socket, and closing or writing to it from the child would
  disturb the parent; they are kept (:func:`keep_inherited`) so that no
  finalizer runs on them in the child - and opens its own loop, thread and
  connection with the same arguments, then serves the call under its usual
  deadline (an acquire: ``wait + connect_timeout``).  A child therefore takes
  the lock or raises within that bound.  Reconnecting was chosen over raising
  an error because a client made before ``fork()`` - a preloaded application
  - is meant to be used in every worker.  A client closed in the parent stays
  closed in the child (``ConnectionLost`` at once).
- **Leases stay with their process.**  A lease is held, and renewed by its
  loop, in the process that acquired it.  A ``SyncLease``,
  ``SyncMultiLease`` or ``SyncTerm`` the child inherited is not the child's:
  ``release``/``extend``/``resign`` of one in the child raise
  :class:`~fastlock.errors.LeaseLost` without sending anything
  (:func:`check_held_here`), so a child can never free its parent's lock, and
  its ``lost`` event is set in the child.  A ``with client.lock(...)`` block
  entered before the fork exits in the child without releasing.  The parent
  keeps holding and renewing the lease.

The asyncio :class:`~fastlock.client.Client` belongs to its event loop and is
not carried across ``fork()``: a child makes its own.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..errors import LeaseLost

__all__ = ["fork_lock", "keep_inherited", "check_held_here"]

# Guards reopening after a fork.  Made anew in every child (by
# ``os.register_at_fork``): a lock that another parent thread held at the
# moment of the fork would stay locked in the child for ever.
_lock = threading.Lock()

# What a child inherited from its parent's clients (loops, threads, asyncio
# clients): kept, never run, closed nor collected in the child.
_inherited: list[Any] = []


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def fork_lock() -> threading.Lock:
    """The lock under which a client reopens itself after a fork (a fresh one in each process)."""
    return _lock


def keep_inherited(*objects: Any) -> None:
    """Keep ``objects`` (a parent's loop, thread, client...) alive in this
    process without ever using them (see the module docstring)."""
    _inherited.append(objects)


def check_held_here(held: Any, what: str) -> None:
    """Refuse ``held`` (an object with ``pid`` and ``lost``: a lease, a
    multi-lease, a term) if this process inherited it through ``fork()``: it
    is its parent's.

    Raises:
        LeaseLost: ``held.pid`` is not this process (``held.lost`` is set).
    """
    if held.pid != os.getpid():
        held.lost.set()
        raise LeaseLost(f"this {what} was acquired by process {held.pid}; this process ({os.getpid()}) is a fork "
                        f"of it and does not hold it (nothing was sent)")
