"""The key/value space the log describes: small values by key, each optionally attached to a lease.

A key attached to a lease lives while that lease lives (as an etcd key put
with a lease, or a ZooKeeper ephemeral node): when the lease is released or
expires, every key attached to it goes with it.  A key with no lease stays
until it is deleted.  The lease is a lock lease of the lock table, named by
``(lock name, fencing token)``: the table's TTLs, renewals, expiry, recovery
and replication apply to it unchanged.

:class:`KeySpace` is sans-IO and is used by recovery (inside
:class:`~fastlock.wal.records.LogState`), by the standby and by the server's
key store (:mod:`fastlock.server.keys`), so all three keep the same state
from the same records (:func:`fastlock.wal.records.apply`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = ["KeyEntry", "KeySpace"]


class KeyEntry(NamedTuple):
    """One key's value and what it is attached to.  Wall-clock times are ms since the
    Unix epoch, for display only (they decide nothing)."""

    value: bytes
    lease_name: str | None  # the lock whose lease holds the key, or None (a key without lease)
    token: int  # that lease's fencing token (0 without lease)
    principal: str | None  # who wrote it (counted against that principal's key quota)
    created_wall_ms: int
    updated_wall_ms: int


class KeySpace:
    """Keys in sorted order (prefix listing is a binary search), their entries, the keys
    of each lease, and the number of keys and of value bytes of each principal."""

    __slots__ = ("entries", "_sorted", "by_lease", "per_principal", "value_bytes", "value_bytes_per_principal")

    def __init__(self) -> None:
        self.entries: dict[str, KeyEntry] = {}
        self._sorted: list[str] = []
        #: (lease name, token) -> the keys attached to that lease
        self.by_lease: dict[tuple[str, int], set[str]] = {}
        self.per_principal: dict[str | None, int] = {}
        #: bytes of every value together, and of each principal's values
        self.value_bytes = 0
        self.value_bytes_per_principal: dict[str | None, int] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str) -> KeyEntry | None:
        return self.entries.get(key)

    def put(self, key: str, value: bytes, lease_name: str | None, token: int, principal: str | None,
            wall_ms: int) -> KeyEntry:
        """Set ``key`` (replacing its value and its lease); returns the new entry."""
        old = self.entries.get(key)
        created = wall_ms
        if old is None:
            insort(self._sorted, key)
        else:
            created = old.created_wall_ms
            self._detach(key, old)
        entry = KeyEntry(value, lease_name, token if lease_name is not None else 0, principal, created, wall_ms)
        self.entries[key] = entry
        if lease_name is not None:
            self.by_lease.setdefault((lease_name, entry.token), set()).add(key)
        self.per_principal[principal] = self.per_principal.get(principal, 0) + 1
        self.value_bytes += len(value)
        self.value_bytes_per_principal[principal] = self.value_bytes_per_principal.get(principal, 0) + len(value)
        return entry

    def delete(self, key: str) -> KeyEntry | None:
        """Remove ``key``; returns its entry, or None if it was absent."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        i = bisect_left(self._sorted, key)
        del self._sorted[i]
        self._detach(key, entry)
        return entry

    def _detach(self, key: str, entry: KeyEntry) -> None:
        if entry.lease_name is not None:
            keys = self.by_lease.get((entry.lease_name, entry.token))
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.by_lease[(entry.lease_name, entry.token)]
        n = self.per_principal.get(entry.principal, 0) - 1
        if n > 0:
            self.per_principal[entry.principal] = n
        else:
            self.per_principal.pop(entry.principal, None)
        size = len(entry.value)
        self.value_bytes -= size
        n = self.value_bytes_per_principal.get(entry.principal, 0) - size
        if n > 0:
            self.value_bytes_per_principal[entry.principal] = n
        else:
            self.value_bytes_per_principal.pop(entry.principal, None)

    def lease_ended(self, lease_name: str, token: int) -> list[tuple[str, KeyEntry]]:
        """Remove every key attached to the lease ``(lease_name, token)``; returns them."""
        keys = self.by_lease.get((lease_name, token))
        if not keys:
            return []
        gone = []
        for key in sorted(keys):
            entry = self.delete(key)
            if entry is not None:
                gone.append((key, entry))
        return gone

    def with_prefix(self, prefix: str, after: str | None = None) -> Iterator[tuple[str, KeyEntry]]:
        """The keys that start with ``prefix``, in key order (only those above ``after``, if given)."""
        keys = self._sorted
        i = bisect_right(keys, after) if after is not None and after >= prefix else bisect_left(keys, prefix)
        while i < len(keys) and keys[i].startswith(prefix):
            key = keys[i]
            yield key, self.entries[key]
            i += 1

    def leases(self) -> list[tuple[str, int]]:
        """Every lease that holds keys, as ``(lease name, token)``."""
        return list(self.by_lease)

    # -- snapshots: each key as [key, value, lease name, token, principal, created, updated] ---------
    def to_list(self) -> list[list]:
        return [[key, *entry] for key, entry in self.entries.items()]

    @classmethod
    def from_list(cls, items: Any) -> KeySpace:
        """The key space stored in a snapshot.  :raises ValueError: malformed."""
        space = cls()
        if type(items) is not list:
            raise ValueError("the keys of a snapshot must be a list")
        for item in items:
            if (type(item) is not list or len(item) != 7 or type(item[0]) is not str or type(item[1]) is not bytes
                    or type(item[3]) is not int):
                raise ValueError(f"snapshot key must be a list of 7 items: {item!r:.80}")
            key, value, lease_name, token, principal, created, updated = item
            space.put(key, value, lease_name, token, principal, created)
            space.entries[key] = space.entries[key]._replace(updated_wall_ms=updated)
        return space
