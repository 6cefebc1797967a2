"""Key revisions: the bounded history of key changes a resuming prefix watch replays.

A key change is one of the records of the write-ahead log: a KEY_PUT (one key
put), a KEY_DELETE (one key deleted), or the RELEASE, EXPIRE or REVOKE record
that ends a lease - and with it every key attached to the lease, several keys
under one record.  A key change's **position** is therefore a pair: the
record's revision (``epoch << 40 | lsn``, as a lock change's,
:mod:`fastlock.server.watchlog`) and its ``index`` within the record (0 for a
put or a delete; the keys a lease's end deletes are numbered in key order,
0, 1, 2...).  A standby applies the same records at the same LSNs and deletes a
lease's keys in the same key order (:meth:`fastlock.wal.keyspace.KeySpace.lease_ended`),
so it gives every key change the position the primary gave it; a promoted
standby's own changes carry its new, higher epoch.

The pair is not folded into one wire integer: a revision already uses 63 bits
(a fencing token's layout) and msgpack carries 64, so the wire carries both
(``revision``, ``index``).  Inside this node a position is the one int
``revision << INDEX_BITS | index``; ``index`` :data:`WHOLE` stands for "every
change of that record" (a progress notice, a watch's start): a watch that
resumes from ``(revision, None)`` is sent the changes of the later records.

:class:`KeyChangeLog` keeps the last ``limit`` key changes (``--watch-history``,
as the lock watches' history) and at most ``max_bytes`` bytes of their values
(``--max-key-bytes``: the history never holds more value bytes than the key
space may), by position.  A change is published - pushed to the prefix
watchers and replayable - once its record is committed, by the rules of the
lock watches (durable here, acknowledged by a synchronous standby); a resume
from a position older than the history kept gets
:class:`~fastlock.errors.Compacted`, one of a revision this node never had
:class:`~fastlock.errors.WatchDiverged`, by the rules and the lineage of the
lock watches' history (:func:`fastlock.server.watchlog.check_lineage`).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from typing import Any, NamedTuple

from ..errors import Compacted
from ..protocol.ops import PUSH_KEY_PROGRESS
from ..tokens import TOKEN_EPOCH_SHIFT
from ._watchlog import ChangeLogWire
from .watchlog import DEFAULT_HISTORY, CommittedPublisher, check_lineage, shown_revision

__all__ = ["INDEX_BITS", "WHOLE", "KeyChange", "KeyChangeLog", "KeyRevisions", "position"]

#: bits of a key change's index within its record, inside a position
INDEX_BITS = 32
#: the index that stands for every change of a record (a record ends at most ``--max-keys`` keys, far fewer)
WHOLE = (1 << INDEX_BITS) - 1
#: what a kept change costs beside its key and value (bytes, about)
CHANGE_BYTES = 120
#: above every character a key may hold after a prefix (for the end of a prefix's range of keys)
TOP = "\U0010ffff"


def position(revision: int, index: int | None) -> int:
    """The position (int) of the change ``index`` (None: every change) of the record at ``revision``."""
    return revision << INDEX_BITS | (WHOLE if index is None else index)


class KeyChange(NamedTuple):
    """One key change kept for resuming prefix watches: the ``revision`` of its record and
    its ``offset`` within it (its index, 0, 1, ...), the ``key``, ``what`` happened ("put", "delete", "released",
    "expired", "revoked") and the new ``value`` (bytes, a put's) or None."""

    revision: int
    offset: int
    key: str
    what: str
    value: bytes | None


#: a change as kept: (position, revision, index, key, what, value) - a plain tuple, built on the hot path
Kept = tuple[int, int, int, str, str, Any]


class KeyChangeLog(ChangeLogWire):
    """The last ``limit`` key changes (and at most ``max_bytes`` bytes of values), by position.

    Changes are :meth:`record`-ed in position order and :meth:`publish`-ed up to a
    revision once committed; ``floor`` is the position after which every change is
    kept (None: not known yet).  ``lineage`` is the lock history's (epoch -> the last
    LSN of it applied here as a standby), shared: both histories follow the same records.
    """

    def __init__(self, limit: int = DEFAULT_HISTORY, max_bytes: int = 1 << 62,
                 lineage: dict[int, int] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"the key history keeps at least 1 change, got {limit}")
        self.limit = limit
        self.max_bytes = max_bytes
        self.changes: deque[Kept] = deque()
        #: the kept changes of each key, and the keys that have some, in key order (a prefix is a range)
        self.by_key: dict[str, deque[Kept]] = {}
        self.keys: list[str] = []
        self.pending: deque[Kept] = deque()
        self.floor: int | None = None
        #: the revision up to which every change is published
        self.published = 0
        #: bytes of the values (and keys) kept
        self.bytes = 0
        self.lineage = lineage if lineage is not None else {}

    def start(self, rev: int) -> None:
        """Begin the history at ``rev`` (a node starting as primary)."""
        if self.floor is None:
            self.floor = position(rev, None)
            self.published = max(self.published, rev)

    def reset(self, rev: int) -> None:
        """Forget every change and begin again at ``rev`` (a standby installed a snapshot)."""
        self.changes.clear()
        self.by_key.clear()
        self.keys.clear()
        self.pending.clear()
        self.bytes = 0
        self.floor = position(rev, None)
        self.published = rev

    def record(self, rev: int, index: int, key: str, what: str, value: bytes | None,
               published: bool = False) -> None:
        """Keep a change (``published``: already committed, a standby's), dropping the
        oldest beyond the limits."""
        pos = rev << INDEX_BITS | index
        change = (pos, rev, index, key, what, value)
        if self.floor is None:
            self.floor = position(rev - 1, None)
        changes = self.changes
        changes.append(change)
        same = self.by_key.get(key)
        if same is None:
            self.by_key[key] = same = deque()
            insort(self.keys, key)
        same.append(change)
        self.bytes += CHANGE_BYTES + len(key) + (len(value) if value is not None else 0)
        while len(changes) > self.limit or (self.bytes > self.max_bytes and len(changes) > 1):
            old = changes.popleft()
            self.floor = old[0]
            self.bytes -= CHANGE_BYTES + len(old[3]) + (len(old[5]) if old[5] is not None else 0)
            same = self.by_key[old[3]]
            same.popleft()
            if not same:
                del self.by_key[old[3]]
                del self.keys[bisect_left(self.keys, old[3])]
        if published:
            self.published = rev
        else:
            self.pending.append(change)

    def applied(self, rev: int) -> None:
        """A standby applied the primary's records up to revision ``rev``."""
        if self.floor is None:
            self.floor = position(rev, None)
        if not self.pending and rev > self.published:
            self.published = rev

    def publish(self, upto: int) -> list[Kept]:
        """The pending changes of the records up to revision ``upto`` (committed), in order."""
        pending = self.pending
        out = []
        while pending and pending[0][1] <= upto:
            out.append(pending.popleft())
        if out:
            self.published = max(self.published, out[-1][1])
        return out

    def progress(self, current: int) -> int:
        """The revision up to which every key change is published; ``current``: the
        revision of the last record logged."""
        if self.pending:
            return self.pending[0][1] - 1
        return max(self.published, current)

    def since(self, prefix: str, rev: int, index: int | None, current: int) -> list[KeyChange]:
        """The published changes of the keys under ``prefix`` after the position
        ``(rev, index)`` (index None: after every change of ``rev``), in order.

        :raises Compacted: the position is older than the history kept.
        :raises WatchDiverged: ``rev`` names a record this node never had.
        """
        since = position(rev, index)
        floor = self.floor if self.floor is not None else position(current, None)
        if since < floor:
            oldest = floor >> INDEX_BITS
            raise Compacted(f"key revision {shown_revision(rev)} index {index} is older than the key watch history "
                            f"kept here (from {shown_revision(oldest)}): start a new watch", oldest)
        check_lineage(rev, current, self.lineage)
        first = self.pending[0][0] if self.pending else 1 << 127  # not committed yet: published live, later
        keys = self.keys
        lo = bisect_left(keys, prefix)
        matching = bisect_left(keys, prefix + TOP, lo) - lo  # about how many keys under prefix have changes
        # the cheaper of two walks: back from the newest change to the position (a resume is
        # usually recent), or through the changes of the keys under the prefix - never more
        # than twice the smaller of the two, whatever the position and the prefix
        found: list[Kept] = []
        steps = 0
        for change in reversed(self.changes):
            pos = change[0]
            if pos <= since:
                found.reverse()
                return [KeyChange(*c[1:]) for c in found]
            steps += 1
            if steps > matching:
                break
            if pos < first and change[3].startswith(prefix):
                found.append(change)
        found = []
        by_key = self.by_key
        for i in range(lo, len(keys)):
            key = keys[i]
            if not key.startswith(prefix):
                break
            for change in reversed(by_key[key]):
                pos = change[0]
                if pos <= since:
                    break
                if pos < first:
                    found.append(change)
        found.sort()
        return [KeyChange(*c[1:]) for c in found]

    def status(self) -> dict:
        """For ``fastlock status``: kept, limit, floor (revision), published, pending, bytes."""
        return {"kept": len(self.changes), "limit": self.limit,
                "floor": None if self.floor is None else self.floor >> INDEX_BITS, "published": self.published,
                "pending": len(self.pending), "bytes": self.bytes, "max_bytes": self.max_bytes}


class KeyRevisions(CommittedPublisher):
    """The server's side of key revisions: keeps the :class:`KeyChangeLog`, publishes
    committed key changes to the prefix watchers (:class:`~fastlock.server.keys.KeyStore`)
    and sends their progress notices.

    ``server``: the :class:`~fastlock.server.lockserver.LockServer` (its ``revisions``,
    :class:`~fastlock.server.watchlog.Revisions`, gives the revision now and the
    lineage); ``history``: changes kept (``--watch-history``); ``max_bytes``: value
    bytes kept (``--max-key-bytes``); ``progress_interval``: seconds between progress
    notices (``--watch-progress-interval``; 0: none).
    """

    def __init__(self, server: Any, history: int = DEFAULT_HISTORY, max_bytes: int = 1 << 62,
                 progress_interval: float = 10.0) -> None:
        # a kept key change: (position, revision, index, key, what, value)
        super().__init__(server, 1, progress_interval, PUSH_KEY_PROGRESS)
        self.log = KeyChangeLog(history, max_bytes, server.revisions.log.lineage)

    def current(self) -> int:
        """This node's revision now (as the lock watches')."""
        return int(self.server.revisions.current())

    def replay(self, prefix: str, rev: int, index: int | None) -> list[KeyChange]:
        """The published changes under ``prefix`` after ``(rev, index)``.
        :raises Compacted: too old.  :raises WatchDiverged: not in this node's history."""
        self.settle()
        return self.log.since(prefix, rev, index, self.current())

    # -- the primary's changes -----------------------------------------------------------
    def started(self) -> None:
        """The node started as primary: its history begins at its revision now."""
        self.log.start(self.current())

    def logged(self, index: int, key: str, what: str, value: bytes | None) -> None:
        """A key change of the record just logged (the last one), ``index`` within it."""
        server = self.server
        self.log.record(server.table.epoch << TOKEN_EPOCH_SHIFT | server.wal.logged_lsn, index, key, what, value)

    def deliver(self, changes: list) -> bool:
        keys = self.server.keys
        keys.publish(changes)
        return bool(keys.watchers)

    def listening(self) -> bool:
        return bool(self.server.keys.watchers)

    def watching(self) -> Any:
        return self.server.keys.revisioned

    # -- the standby's changes -----------------------------------------------------------
    def replicated(self, epoch: int, lsn: int, index: int, key: str, what: str, value: bytes | None) -> None:
        """A standby applied a key change of the primary's record at ``lsn``."""
        self.log.record(epoch << TOKEN_EPOCH_SHIFT | lsn, index, key, what, value, published=True)

    def applied(self, epoch: int, lsn: int) -> None:
        """A standby applied the primary's records up to ``lsn`` of ``epoch``."""
        self.log.applied(epoch << TOKEN_EPOCH_SHIFT | lsn)

    def snapshot(self, epoch: int, lsn: int) -> None:
        """A standby installed the primary's snapshot at ``lsn`` of ``epoch``."""
        self.log.reset(epoch << TOKEN_EPOCH_SHIFT | lsn)

    def status(self) -> dict:
        """For ``fastlock status`` (``key_watch_history``)."""
        self.settle()
        return {**self.log.status(), "revision": self.current()}
