"""Watch revisions: the bounded history of holder changes a resuming watch replays.

Every holder change a lock watch can deliver (a grant, a release, an expiry, a
revoke) carries a **revision**: ``epoch << 40 | lsn``, the epoch of the primary
that logged the change's write-ahead-log record and that record's LSN in the
primary's log (the layout of a fencing token, :mod:`fastlock.tokens`).  A standby
replays the same records with the primary's LSNs, so it gives every change the
same revision as the primary did; a promoted standby's own changes carry its new,
higher epoch.  Revisions therefore only grow along the history of the lock table,
on the primary and on its standbys alike.

:class:`WatchLog` keeps the last ``limit`` changes (``--watch-history``, default
:data:`DEFAULT_HISTORY` changes) by revision and by lock name.  A change is
*published* (pushed to the watchers, and replayable) once its record is durable on
this node and, under synchronous replication, acknowledged by the standby: a watch
never sees a change a failover could take back.  A watch that resumes from
revision ``since`` gets every published change of its lock after ``since``, then
the live ones; ``since`` older than the history kept raises
:class:`~fastlock.errors.Compacted` (with the oldest revision it could resume
from); ``since`` a change this node never had (the old primary published it but
its record never reached this standby: asynchronous replication) raises
:class:`~fastlock.errors.WatchDiverged`.  This node knows which revisions of an
older epoch it has: the last LSN it applied of each epoch it followed
(:meth:`WatchLog.applied`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from itertools import islice
from operator import itemgetter
from typing import Any, NamedTuple

from ..errors import Compacted, FastlockError, LimitExceeded, WatchDiverged
from ..protocol.framing import encode_error, encode_push
from ..protocol.ops import PUSH_WATCH_PROGRESS
from ..roles import Role
from ..tokens import TOKEN_EPOCH_SHIFT, counter_of, epoch_of
from ._watchlog import CommittedWire, HistoryWire, RevisionsWire

__all__ = ["CommittedPublisher", "DEFAULT_HISTORY", "DEFAULT_PROGRESS_INTERVAL", "REPLAY_PAGE", "REPLAY_PAGE_BYTES",
           "ReplayPager", "Revisions", "WatchChange", "WatchLog", "check_lineage", "revision", "shown_revision"]

#: changes kept for resuming watches by default (about 150 bytes each)
DEFAULT_HISTORY = 100_000
#: seconds between the progress notices a resumable watch receives by default
DEFAULT_PROGRESS_INTERVAL = 10.0
#: the replayed changes one connection is sent per loop turn (a resume's others in later turns)
REPLAY_PAGE = 1_000
#: about the most bytes of key values one page of a key watch's replay carries (one value more at most)
REPLAY_PAGE_BYTES = 1 << 20
#: the most resumes one connection may have waiting behind a long replay (LimitExceeded beyond)
MAX_QUEUED_RESUMES = 256


def revision(epoch: int, lsn: int) -> int:
    """The revision (int) of the record at ``lsn`` (int) logged by the primary of ``epoch`` (int)."""
    return epoch << TOKEN_EPOCH_SHIFT | lsn


def shown_revision(rev: int) -> str:
    """``"<revision> (<epoch>/<lsn>)"``, for messages."""
    return f"{rev} ({epoch_of(rev)}/{counter_of(rev)})"


def check_lineage(since: int, current: int, lineage: dict[int, int]) -> None:
    """Check that revision ``since`` is in this node's history: ``current`` is its
    revision now, ``lineage`` the last LSN it applied of each older epoch it followed.

    :raises WatchDiverged: the primary that delivered ``since`` lost changes its
        standby never received (asynchronous replication), or ``since`` is from the future.
    """
    epoch = epoch_of(since)
    here = epoch_of(current)
    if epoch > here or (epoch == here and since > current):
        # this node logged every change of its own epoch: none that could have been lost
        raise WatchDiverged(f"revision {shown_revision(since)} is ahead of this node's history (latest "
                            f"{shown_revision(current)}): no node of this history delivered it (a revision "
                            f"from another cluster, or made up); start a new watch")
    if epoch < here and counter_of(since) > lineage.get(epoch, -1):
        raise WatchDiverged(f"revision {shown_revision(since)} is not in this node's history (up to "
                            f"{shown_revision(current)}; of epoch {epoch} it has up to LSN "
                            f"{lineage.get(epoch, 'none')}): the primary that delivered it lost changes "
                            f"its standby never received; start a new watch")


#: a change as kept: (revision, name, what, token, meta) - a plain tuple, built on the hot path
Kept = tuple[int, str, str, int, Any]
_REVISION = itemgetter(0)


class WatchChange(NamedTuple):
    """One holder change kept for resuming watches: its ``revision``, the lock
    ``name``, ``what`` happened ("granted", "released", "expired", "revoked"), the
    lease's ``token`` and its ``meta`` (recorded client, correlation id) or None."""

    revision: int
    name: str
    what: str
    token: int
    meta: Any


class WatchLog(HistoryWire):
    """The last ``limit`` holder changes, by revision and by lock name.

    Changes are :meth:`record`-ed in revision order (as their records are logged)
    and :meth:`publish`-ed up to a revision once committed; ``floor`` is the
    revision after which every change is kept (None: not known yet, a standby
    before its first record).  Both are compiled, on
    :class:`~fastlock.server._watchlog.HistoryWire`: ``record(rev, name, what, token,
    meta, published=False)`` keeps a change (``published``: already committed, as a
    standby's), dropping the oldest beyond the limit; ``publish(upto)`` returns the
    pending changes up to revision ``upto`` (now committed), in order.
    """

    def __init__(self, limit: int = DEFAULT_HISTORY) -> None:
        if limit < 1:
            raise ValueError(f"the watch history keeps at least 1 change, got {limit}")
        self.limit = limit
        self.changes: deque[Kept] = deque()
        self.by_name: dict[str, deque[Kept]] = {}
        #: changes recorded but not yet published (committed), in revision order
        self.pending: deque[Kept] = deque()
        self.floor: int | None = None
        #: the revision up to which everything is published (what a progress notice says)
        self.published = 0
        #: epoch -> the last LSN of it this node applied as a standby
        self.lineage: dict[int, int] = {}

    # -- recording ----------------------------------------------------------------------
    def start(self, rev: int) -> None:
        """Begin the history at ``rev`` (a node starting as primary: its last logged record)."""
        if self.floor is None:
            self.floor = rev
            self.published = max(self.published, rev)

    def reset(self, rev: int) -> None:
        """Forget every change and begin again at ``rev`` (a standby installed a snapshot)."""
        self.changes.clear()
        self.by_name.clear()
        self.pending.clear()
        self.floor = rev
        self.published = rev
        self.lineage[epoch_of(rev)] = counter_of(rev)

    def applied(self, epoch: int, lsn: int) -> None:
        """A standby applied the records of ``epoch``'s primary up to ``lsn``."""
        self.lineage[epoch] = lsn
        rev = revision(epoch, lsn)
        if self.floor is None:
            self.floor = rev
        if not self.pending and rev > self.published:
            self.published = rev

    def drop_pending(self) -> None:
        """Changes this node will never publish (its acknowledgements were refused: deposed)."""
        self.pending.clear()

    def progress(self, current: int) -> int:
        """The revision up to which every change is published; ``current``: the revision
        of the last record logged."""
        if self.pending:
            return self.pending[0][0] - 1
        return max(self.published, current)

    # -- resuming -----------------------------------------------------------------------
    def since(self, name: str, since: int, current: int, limit: int | None = None) -> list[WatchChange]:
        """The published changes of ``name`` after revision ``since`` (the first ``limit``
        of them; None: all), found by bisection: the cost is that of what is returned.

        ``current``: this node's revision now (its epoch, its last logged LSN).
        :raises Compacted: ``since`` is older than the history kept.
        :raises WatchDiverged: ``since`` names a change this node never had: one of an
            older epoch past what this node received of it (the primary that delivered it
            lost changes its standby never received), or one ahead of this node's history
            (a later epoch, or past its last record in its own epoch).
        """
        floor = self.floor if self.floor is not None else current
        if since < floor:
            raise Compacted(f"revision {shown_revision(since)} is older than the watch history kept here (from "
                            f"{shown_revision(floor)}): start a new watch", floor)
        check_lineage(since, current, self.lineage)
        group = self.by_name.get(name)
        if not group:
            return []
        first = self.pending[0][0] if self.pending else 1 << 63  # not committed yet: published live, later
        start = bisect_right(group, since, key=_REVISION)
        if start >= len(group):
            return []
        out: list[WatchChange] = []
        # from the nearer end of the deque (islice walks it from the left, reversed from the right)
        if start <= len(group) // 2 or limit is not None:
            for c in islice(group, start, None):
                if c[0] >= first or len(out) == limit:
                    break
                out.append(WatchChange(*c))
        else:
            for c in islice(reversed(group), len(group) - start):
                if c[0] < first:
                    out.append(WatchChange(*c))
            out.reverse()
        return out

    def status(self) -> dict:
        """For ``fastlock status``: kept, limit, floor, published."""
        return {"kept": len(self.changes), "limit": self.limit, "floor": self.floor, "published": self.published,
                "pending": len(self.pending)}


class CommittedPublisher(CommittedWire):
    """Publishes a change history's committed changes and sends its progress notices:
    what the lock watches' :class:`Revisions` and the key watches'
    :class:`~fastlock.server.keyrevisions.KeyRevisions` share.

    A change is published once its record is committed: durable on this node
    (``wal.when_durable``) and, under synchronous replication, acknowledged by the
    standby (``source.sync.after``); a refused acknowledgement, or a node that may no
    longer write (deposed, fenced), publishes nothing - a promoted standby may take
    those changes back.  That batch end is compiled, on
    :class:`~fastlock.server._watchlog.CommittedWire`.  A subclass names its history
    (``log``: ``pending``, ``publish(upto)``, ``progress(current)``), where a pending
    change keeps its revision (``revision_at``: its index in the change's tuple), who
    hears of the published ones (``deliver``, ``listening``), and the connections a
    progress notice goes to (``watching``).

    ``server``: the :class:`~fastlock.server.lockserver.LockServer`;
    ``revision_at``: the index of the revision in a change the history keeps;
    ``progress_interval``: seconds between progress notices (0: none);
    ``progress_kind``: the push kind of a progress notice.
    """

    def __init__(self, server: Any, revision_at: int, progress_interval: float, progress_kind: str) -> None:
        self.server = server
        self.source = server.source  # its sync gate's flag, read per batch end
        self.revision_at = revision_at
        self.commit = server.wal.group_commit  # its ack mark and when_durable, read per batch end
        self.progress_interval = progress_interval
        self.progress_kind = progress_kind
        #: the revision up to which a publication is already scheduled
        self.scheduled = 0
        self._timer: Any = None

    def current(self) -> int:
        """This node's revision now."""
        raise NotImplementedError

    def watching(self) -> Any:
        """The session ids of the connections that receive progress notices."""
        raise NotImplementedError

    def progress(self) -> int:
        """The revision up to which every change is published (a progress notice's)."""
        self.settle()
        return int(self.log.progress(self.current()))

    def start_progress(self, loop: Any) -> None:
        """Send a progress notice every ``progress_interval`` seconds to every connection
        :meth:`watching` names (none if the interval is 0)."""
        if self.progress_interval > 0:
            self._timer = loop.call_later(self.progress_interval, self._tick, loop)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self, loop: Any) -> None:
        self._timer = loop.call_later(self.progress_interval, self._tick, loop)
        server = self.server
        watching = self.watching()
        if not watching or server.roles.role is not Role.PRIMARY:
            return
        data = encode_push(self.progress_kind, [self.progress()])
        sessions = server.sessions
        for session in watching:
            conn = sessions.get(session)
            if conn is not None and not conn.closed:
                conn.send(data)
        server.after_batch()


class Revisions(RevisionsWire, CommittedPublisher):
    """The server's side of watch revisions: keeps the :class:`WatchLog`, publishes
    committed changes to the lock watchers (:class:`~fastlock.server.watches.WatchRegistry`)
    and sends progress notices.  What runs per change and per batch end is compiled, on
    :class:`~fastlock.server._watchlog.RevisionsWire`: ``logged(name, what, token, meta)``
    records a holder change whose record was just logged (the last one logged), and
    ``batch_end()`` publishes the committed ones to the lock watchers.

    ``server`` is the :class:`~fastlock.server.lockserver.LockServer`; ``history``:
    changes kept (``--watch-history``); ``progress_interval``: seconds between
    progress notices (``--watch-progress-interval``; 0: none).
    """

    def __init__(self, server: Any, registry: Any, history: int = DEFAULT_HISTORY,
                 progress_interval: float = DEFAULT_PROGRESS_INTERVAL) -> None:
        # a Kept change: (revision, name, what, token, meta)
        super().__init__(server, 0, progress_interval, PUSH_WATCH_PROGRESS)
        self.registry = registry
        self.watched = registry.by_name  # lock name -> its watchers: anyone listening?
        self.table = server.table  # its epoch, a revision's high bits
        self.log = WatchLog(history)

    # -- the revision now ----------------------------------------------------------------
    def current(self) -> int:
        """This node's revision now: a primary's epoch and last logged LSN; a standby's
        primary's epoch and the last primary LSN it applied."""
        server = self.server
        follower = server.follower
        if follower is not None and server.roles.role is not Role.PRIMARY and follower.applied_lsn:
            return revision(follower.primary_epoch, follower.applied_lsn)
        return revision(server.table.epoch, server.wal.logged_lsn)

    def replay(self, name: str, since: int, limit: int | None = None) -> list[WatchChange]:
        """The published changes of ``name`` after ``since`` (the first ``limit``; None: all).
        :raises Compacted: too old.  :raises WatchDiverged: not in this node's history."""
        self.settle()
        return self.log.since(name, since, self.current(), limit)

    # -- the primary's changes -----------------------------------------------------------
    def started(self) -> None:
        """The node started: its history begins at its revision now."""
        self.log.start(self.current())

    def watching(self) -> Any:
        return self.registry.revisioned

    # -- the standby's changes -----------------------------------------------------------
    def replicated(self, epoch: int, lsn: int, name: str, what: str, token: int, meta: Any) -> None:
        """A standby applied the holder change of the primary's record at ``lsn``."""
        self.log.record(revision(epoch, lsn), name, what, token, meta, published=True)

    def applied(self, epoch: int, lsn: int) -> None:
        """A standby applied the primary's records up to ``lsn`` of ``epoch``."""
        self.log.applied(epoch, lsn)

    def snapshot(self, epoch: int, lsn: int) -> None:
        """A standby installed the primary's snapshot at ``lsn`` of ``epoch``: the history
        begins again there (the changes before it are not known here)."""
        self.log.reset(revision(epoch, lsn))

    def status(self) -> dict:
        """For ``fastlock status`` (``watch_history``)."""
        self.settle()
        return {**self.log.status(), "revision": self.current(), "progress_interval": self.progress_interval}


class ReplayPager:
    """Sends the replays of resuming watches :data:`REPLAY_PAGE` pushes per connection per
    loop turn, so that a resume from an old revision (up to the whole history) never holds
    the event loop for more than a page: other connections are served between pages.

    Each connection's resumes run one after the other, in the order they came.  A resume
    is ``next_page(limit)``, which returns its next pushes (at most ``limit`` encoded
    frames; fewer when they carry many bytes) and whether it has caught up with what is
    published, and ``finish()``, called in the turn it caught up: it starts the live watch
    and replies.  A
    :class:`~fastlock.errors.FastlockError` either raises is the request's error reply
    (``Compacted`` with the oldest revision kept).  A connection that closes drops its
    resumes.  At most :data:`MAX_QUEUED_RESUMES` wait per connection.
    """

    def __init__(self, server: Any) -> None:
        self.server = server
        #: connection (server session number) -> its resumes not yet finished, oldest first
        self.queues: dict[int, deque[tuple[int, Callable[[int], tuple[list[bytes], bool]], Callable[[], None]]]] = {}

    def busy(self, conn: Any) -> bool:
        """Whether ``conn`` has a resume still being sent (a later one must queue behind it)."""
        return conn.session in self.queues

    def add(self, conn: Any, req_id: int, next_page: Callable[[int], tuple[list[bytes], bool]],
            finish: Callable[[], None]) -> None:
        """Queue the resume of request ``req_id`` (see the class docstring).

        :raises LimitExceeded: :data:`MAX_QUEUED_RESUMES` resumes of ``conn`` wait already."""
        queue = self.queues.get(conn.session)
        if queue is not None:
            if len(queue) >= MAX_QUEUED_RESUMES:
                raise LimitExceeded(f"this connection has {len(queue)} watch resumes waiting behind a long replay, "
                                    f"the most allowed ({MAX_QUEUED_RESUMES}): resume the others once they are done")
            queue.append((req_id, next_page, finish))
            return
        self.queues[conn.session] = deque([(req_id, next_page, finish)])
        self.server.loop.call_soon(self._run, conn)

    def _run(self, conn: Any) -> None:
        queue = self.queues.get(conn.session)
        if queue is None:
            return
        if conn.closed:
            del self.queues[conn.session]
            return
        budget = REPLAY_PAGE
        while queue and budget > 0:
            req_id, next_page, finish = queue[0]
            try:
                frames, done = next_page(budget)
                for frame in frames:
                    conn.send(frame)
                budget -= len(frames)
                if not done:
                    break  # the next turn asks again
                queue.popleft()
                finish()
            except FastlockError as exc:
                if queue and queue[0][0] == req_id:
                    queue.popleft()
                extra = exc.oldest if isinstance(exc, Compacted) else getattr(exc, "primary", None)
                conn.send(encode_error(req_id, exc.code or 0, str(exc), extra))
        if queue:
            self.server.loop.call_soon(self._run, conn)
        else:
            del self.queues[conn.session]
        self.server.after_batch()
