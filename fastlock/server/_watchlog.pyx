# cython: language_level=3
"""The watch history's per-change path, compiled (see fastlock/server/watchlog.py).

:class:`HistoryWire` is the compiled base of
:class:`fastlock.server.watchlog.WatchLog`: it keeps a holder change
(:meth:`HistoryWire.record`) and publishes the changes committed up to a revision
(:meth:`HistoryWire.publish`) on the structures ``WatchLog`` reads to resume a
watch (``changes``, ``by_name``, ``pending``, ``floor``, ``published``).

:class:`CommittedWire` is the compiled base of
:class:`fastlock.server.watchlog.CommittedPublisher`, which the lock watches' and the
key watches' histories share: the batch end's publication of the committed changes
(:meth:`CommittedWire.batch_end`).  A change nobody watches is only marked published.
:class:`RevisionsWire`, the compiled base of :class:`fastlock.server.watchlog.Revisions`,
adds the revision of a change just logged (:meth:`RevisionsWire.logged`: the table's
epoch and the log's last LSN, read from the :class:`~fastlock.wal.commit.GroupCommit`
with no Python call) and the lock watchers it publishes to.
"""

from collections import deque

from libc.stdint cimport int64_t

from .._core cimport table_epoch
from ..roles import Action
from ..tokens import COUNTER_MASK, TOKEN_EPOCH_SHIFT

cdef object _deque = deque
cdef object _RELEASE = Action.RELEASE
cdef object _COUNTER_MASK = COUNTER_MASK
cdef int64_t _LSN_MASK = COUNTER_MASK  # a revision's LSN part, as a C integer
cdef int _SHIFT = TOKEN_EPOCH_SHIFT


cdef class ChangeLogWire:
    """The compiled base of a change history (:class:`HistoryWire`, the key watches'
    :class:`fastlock.server.keyrevisions.KeyChangeLog`): ``pending``, the changes recorded and
    not yet published, in revision order (a deque), and :meth:`publish`, read and called by
    :class:`CommittedWire` with C calls."""

    cpdef list publish(self, object upto):
        """The pending changes up to revision ``upto`` (now committed), in order."""
        raise NotImplementedError


cdef class HistoryWire(ChangeLogWire):
    """The last ``limit`` holder changes, by revision (``changes``) and by lock name
    (``by_name``: name -> its changes), each ``(revision, name, what, token, meta)``;
    ``pending``: those recorded and not yet published, in revision order; ``floor``:
    the revision after which every change is kept (None: not known yet);
    ``published``: the revision up to which everything is published."""

    # (its slots are declared in _watchlog.pxd)

    cpdef record(self, object rev, object name, object what, object token, object meta, bint published=False):
        """Keep a change (``published``: already committed, as a standby's), dropping
        the oldest beyond the limit."""
        change = (rev, name, what, token, meta)
        if self.floor is None:
            self.floor = rev - 1
        changes = self.changes
        if changes is not self._changes_of:  # (bound once per deque: no method lookup per change)
            self._changes_of = changes
            self._changes_append = changes.append
        self._changes_append(change)
        group = self.by_name.get(name)
        if group is None:
            group = _deque()
            self.by_name[name] = group
        group.append(change)
        if len(changes) > self.limit:
            old = changes.popleft()
            self.floor = old[0]
            same = self.by_name[old[1]]
            same.popleft()
            if not same:
                del self.by_name[old[1]]
        if published:
            self.published = rev
            return
        pending = self.pending
        if pending is not self._pending_of:
            self._pending_of = pending
            self._pending_append = pending.append
        self._pending_append(change)

    cpdef list publish(self, object upto):
        """The pending changes up to revision ``upto`` (now committed), in order."""
        cdef list out = []
        pending = self.pending
        while pending and pending[0][0] <= upto:
            out.append(pending.popleft())
        if out:  # (indexes from the start: the module is compiled without wraparound)
            last = out[len(out) - 1][0]
            if last > self.published:
                self.published = last
        return out


cdef class CommittedWire:
    """The compiled base of :class:`fastlock.server.watchlog.CommittedPublisher`: a
    change history's batch end, which publishes the changes recorded in the batch once
    their records are committed -- durable on this node and, under synchronous
    replication, acknowledged by the standby -- and nothing a refused acknowledgement
    or a node that may no longer write (deposed, fenced) covers.

    ``server``: the :class:`~fastlock.server.lockserver.LockServer`; ``source``: its
    :class:`~fastlock.replication.source.ReplicationSource` (``sync.enabled``); ``log``: the
    history (its ``pending`` changes, ``publish(upto)``); ``revision_at``: the index of
    the revision in a pending change; ``commit``: the log's
    :class:`~fastlock.wal.commit.GroupCommit` (``marks.ack``, ``when_durable``);
    ``scheduled``: the revision up to which a publication is already scheduled;
    ``later_queued``: a publication of the changes nobody listens to waits for the next
    sync (:meth:`_publish_committed`, one at a time), and ``later_upto`` is the last
    revision it may publish.  A subclass gives :meth:`listening` and :meth:`deliver`.
    """

    # (its slots are declared in _watchlog.pxd)

    cpdef bint listening(self):
        """Does anyone watch now (False: a publication only marks its changes published)?"""
        return True

    cpdef bint deliver(self, list changes):
        """Hand published ``changes`` (in order) to their watchers; True if a push was queued."""
        raise NotImplementedError

    cpdef batch_end(self):
        """At each batch end: publish the changes recorded in it once committed."""
        pending = self.log.pending
        if not pending:  # nothing recorded and unpublished
            return
        upto = pending[len(pending) - 1][self.revision_at]  # the last change recorded and not yet published
        if upto <= self.scheduled:
            return
        self.scheduled = upto
        if self.source.sync.enabled:  # (WriteAheadLog.when_durable's and when_durable_later's own calls)
            deliver = (<object>self.source.sync).after(_Publication(self, upto))
            if self.listening():
                self.commit.when_durable(deliver)  # a watcher waits: the batch is synced for it
            else:
                self.commit.when_durable_later(deliver)
            return
        if (<int64_t>upto & _LSN_MASK) <= <int64_t>self.commit.marks.ack:
            # already durable (a relaxed fsync mode wrote this batch at once): published in this
            # batch end, whose flush sends the pushes
            self._publish(upto, None, False)
            return
        if self.listening():
            self.commit.when_durable(_Publication(self, upto))  # a watcher waits: the batch is synced for it
            return
        # nobody to push to: published by the next sync anyone asks for (a release in
        # ``always`` costs no fdatasync of its own); listener_added asks for it.  One
        # publication waits at a time: it publishes every change durable when it runs.
        self.later_upto = upto
        if not self.later_queued:
            self.later_queued = True
            self.commit.when_durable_later(_CommittedPublication(self))

    cpdef listener_added(self):
        """A watcher was added: the changes scheduled for publication while nobody listened
        (:meth:`batch_end`, without a sync of their own) get their sync now (``always``; in the
        relaxed modes they are published once written)."""
        commit = self.commit
        if commit.always and self.scheduled & _COUNTER_MASK > commit.marks.ack:
            commit.request_sync()

    cpdef _publish_committed(self):
        """The waiting publication of :meth:`batch_end` (nobody listened): publish the pending
        changes up to ``later_upto`` whose records are durable now (the group commit's ack mark),
        and wait for the next sync again while changes it covers are left."""
        self.later_queued = False
        cdef GroupCommit commit = self.commit
        cdef int64_t ack = commit.marks.ack
        cdef int64_t later_upto = self.later_upto
        cdef int64_t rev
        cdef Py_ssize_t at = self.revision_at
        upto = None
        for change in self.log.pending:  # (in revision order, which is the log's order)
            rev = change[at]
            if rev > later_upto or (rev & _LSN_MASK) > ack:
                break
            upto = change[at]
        if upto is not None:
            self._publish(upto)
        if (later_upto & _LSN_MASK) > ack and not self.later_queued:
            self.later_queued = True
            commit.when_durable_later(_CommittedPublication(self))

    cpdef _publish(self, object upto, object refused=None, bint flush=True):
        changes = self.log.publish(upto)
        # nobody watching: the changes are only marked published
        if changes and refused is None and self.listening() and self.server.roles.may(_RELEASE):
            if self.deliver(changes) and flush:
                self.server.after_batch()  # the pushes go out


cdef class _Publication:
    """The publication of a history's changes up to revision ``upto`` once committed:
    calling it runs ``wire._publish(upto, refused)`` (``refused``: the error replication
    refused them with, or None) - the ``when_durable`` / ``sync.after`` callback of
    :meth:`CommittedWire.batch_end`."""

    cdef CommittedWire wire
    cdef object upto

    def __cinit__(self, CommittedWire wire, object upto):
        self.wire = wire
        self.upto = upto

    def __call__(self, refused=None):
        self.wire._publish(self.upto, refused)


cdef class _CommittedPublication:
    """The ``when_durable_later`` callback of :meth:`CommittedWire.batch_end` while nobody
    listens: calling it runs ``wire._publish_committed()``."""

    cdef CommittedWire wire

    def __cinit__(self, CommittedWire wire):
        self.wire = wire

    def __call__(self):
        self.wire._publish_committed()


cdef class RevisionsWire(CommittedWire):
    """What :class:`fastlock.server.watchlog.Revisions` runs per change and per batch end:
    :meth:`logged` and :class:`CommittedWire`'s batch end, publishing to the lock
    watchers (``registry``, the :class:`~fastlock.server.watches.WatchRegistry`).
    ``log`` is the :class:`~fastlock.server.watchlog.WatchLog` (a :class:`HistoryWire`).
    """

    # (its slots, ``registry``, ``watched`` - the registry's ``by_name`` - and the server's lock
    # ``table``, are declared in _watchlog.pxd)

    cpdef logged(self, object name, object what, object token, object meta):
        """A holder change whose record was just logged (the last one logged)."""
        cdef int64_t rev = (table_epoch(self.table) << _SHIFT) | (<int64_t>self.commit.next_lsn - 1)
        (<HistoryWire>self.log).record(rev, name, what, token, meta)

    cpdef bint listening(self):
        return bool(self.watched)

    cpdef bint deliver(self, list changes):
        return bool(self.registry.publish(changes))
