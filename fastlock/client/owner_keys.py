"""Owner keys: the 16 random bytes that prove which acquire a lease belongs to.

Every acquire sends a fresh key; the server keeps only its hash and honours a
release or extend only with the key itself (see docs/security.md).  A
key must therefore be unguessable by other clients and never repeat, and it is
drawn for every acquire, so :func:`new_owner_key` takes keys from a buffer
filled by one ``os.urandom`` call per :data:`KEYS_PER_DRAW` keys instead of one
``getrandom`` system call per acquire.

The buffer is emptied in a child after ``fork()`` (``os.register_at_fork``):
a child must never hand out the keys its parent is about to hand out.
"""

from __future__ import annotations

import os

__all__ = ["new_owner_key", "OWNER_KEY_BYTES", "KEYS_PER_DRAW"]

#: bytes in one owner key (the protocol's size, checked by the server)
OWNER_KEY_BYTES = 16
#: keys drawn from the OS at once
KEYS_PER_DRAW = 256

_pool: list[bytes] = []


def new_owner_key() -> bytes:
    """Return a fresh random owner key (:data:`OWNER_KEY_BYTES` bytes, from
    ``os.urandom``), never returned before in this process."""
    if not _pool:
        raw = os.urandom(OWNER_KEY_BYTES * KEYS_PER_DRAW)
        _pool.extend([raw[i:i + OWNER_KEY_BYTES] for i in range(0, len(raw), OWNER_KEY_BYTES)])
    return _pool.pop()


def _after_fork_in_child() -> None:
    _pool.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)
