# cython: language_level=3, nonecheck=True
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

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void *op)

from .._core cimport table_epoch
from ..roles import Action
from ..tokens import COUNTER_MASK, TOKEN_EPOCH_SHIFT

cdef object _deque = deque
# deque's own methods, called with the deque as their first argument: no bound method per call
cdef object _append = deque.append
cdef object _popleft = deque.popleft
cdef object _clear = deque.clear
cdef object _RELEASE = Action.RELEASE
cdef object _COUNTER_MASK = COUNTER_MASK
cdef int64_t _LSN_MASK = COUNTER_MASK  # a revision's LSN part, as a C integer
cdef int _SHIFT = TOKEN_EPOCH_SHIFT


cdef inline bint _atomic(object x):
    """``x`` holds no reference the cyclic collector follows (None, str, int)."""
    return x is None or type(x) is str or type(x) is int


cdef inline _untrack_change(tuple change, object rev, object name, object what, object token, object meta):
    """Take a kept change out of the cyclic collector's view when nothing in it can be part of a
    reference cycle (its ints and strs, its ``meta`` of strs and None): a history keeps up to its
    limit of them, which every collection would otherwise scan while they are young."""
    if meta is not None:
        if type(meta) is not tuple:
            return
        for m in <tuple>meta:
            if not _atomic(m):
                return
        PyObject_GC_UnTrack(<void *>meta)
    if _atomic(rev) and _atomic(name) and _atomic(what) and _atomic(token):
        PyObject_GC_UnTrack(<void *>change)


cdef class ChangeLogWire:
    """The compiled base of a change history (:class:`HistoryWire`, the key watches'
    :class:`fastlock.server.keyrevisions.KeyChangeLog`): ``pending``, the changes recorded and
    not yet published, in revision order (a deque), and :meth:`publish`, read and called by
    :class:`CommittedWire` with C calls."""

    cpdef list publish(self, object upto):
        """The pending changes up to revision ``upto`` (now committed), in order."""
        raise NotImplementedError

    cpdef mark_published(self, object upto):
        """:meth:`publish` for changes nobody is told of: they are only marked published."""
        self.publish(upto)


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
        _untrack_change(change, rev, name, what, token, meta)
        if self.floor is None:
            self.floor = rev - 1
        changes = self.changes
        _append(changes, change)
        by_name = self.by_name
        group = by_name.get(name)
        if group is None:
            group = _deque()
            by_name[name] = group
        _append(group, change)
        if len(changes) > self.limit:
            old = _popleft(changes)
            self.floor = old[0]
            same = by_name[old[1]]
            _popleft(same)
            if not same:
                del by_name[old[1]]
        if published:
            self.published = rev
            return
        _append(self.pending, change)

    cpdef list publish(self, object upto):
        """The pending changes up to revision ``upto`` (now committed), in order."""
        cdef list out = []
        pending = self.pending
        while pending and pending[0][0] <= upto:
            out.append(_popleft(pending))
        if out:  # (indexes from the start: the module is compiled without wraparound)
            last = out[len(out) - 1][0]
            if last > self.published:
                self.published = last
        return out

    cpdef mark_published(self, object upto):
        """:meth:`publish` without the list: the pending changes up to ``upto`` are dropped
        from ``pending`` and ``published`` moves up to the last of them."""
        pending = self.pending
        if not pending:
            return
        last = pending[len(pending) - 1][0]
        if last <= upto:  # (the common case: all of them)
            _clear(pending)
        else:
            last = None
            while pending[0][0] <= upto:
                last = _popleft(pending)[0]
        if last is not None and last > self.published:
            self.published = last


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
    ``scheduled``: the revision up to which a publication is already scheduled (the
    changes recorded while nobody listens get none: :meth:`settle` marks them published
    once committed).  A subclass gives :meth:`listening` and :meth:`deliver`.
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
        if self.source.sync.enabled:  # (WriteAheadLog.when_durable's and when_durable_later's own calls)
            self.scheduled = upto
            deliver = (<object>self.source.sync).after(_Publication(self, upto))
            if self.listening():
                self.commit.when_durable(deliver)  # a watcher waits: the batch is synced for it
            else:
                self.commit.when_durable_later(deliver)
            return
        if not self.listening():
            # nobody to push to: the changes committed by now are marked published here, the
            # others at a later batch end or when the history is read (settle); nothing is
            # scheduled, and a release in ``always`` costs no fdatasync of its own
            self._settle(pending)
            return
        self.scheduled = upto
        if (<int64_t>upto & _LSN_MASK) <= <int64_t>self.commit.marks.ack:
            # already durable (a relaxed fsync mode wrote this batch at once): published in this
            # batch end, whose flush sends the pushes
            self._publish(upto, None, False)
            return
        self.commit.when_durable(_Publication(self, upto))  # a watcher waits: the batch is synced for it

    cpdef settle(self):
        """Mark published, without pushing them, the pending changes whose records are committed
        now (the group commit's ack mark), when nobody listens and no standby must acknowledge
        them (``source.sync``): the changes :meth:`batch_end` left without a publication.  A
        reader of the history (a replay, a progress notice, the status) settles it first.  The
        changes still pending when a watcher is added are published to it by the next batch
        end's publication, which covers every pending change (``scheduled`` stays below them)."""
        pending = self.log.pending
        if not pending or self.source.sync.enabled or self.listening():
            return
        self._settle(pending)

    cdef _settle(self, object pending):
        """:meth:`settle` of the non-empty ``pending`` changes, its conditions checked."""
        cdef int64_t ack = self.commit.marks.ack
        cdef Py_ssize_t at = self.revision_at
        cdef int64_t rev
        first = pending[0][at]
        rev = first
        if (rev & _LSN_MASK) > ack:  # none of them yet (the common case within a loop turn)
            return
        last = pending[len(pending) - 1][at]
        rev = last
        if (rev & _LSN_MASK) <= ack:  # all of them
            self.log.mark_published(last)
            return
        upto = first
        for change in pending:  # (in revision order, which is the log's order)
            rev = change[at]
            if (rev & _LSN_MASK) > ack:
                break
            upto = change[at]
        self.log.mark_published(upto)

    cpdef listener_added(self):
        """A watcher was added: the changes left pending while nobody listened (:meth:`batch_end`,
        without a sync of their own) get their sync now (``always``; in the relaxed modes they
        are published once written); the next batch end's publication pushes them."""
        commit = self.commit
        pending = self.log.pending
        if (commit.always and pending
                and pending[len(pending) - 1][self.revision_at] & _COUNTER_MASK > commit.marks.ack):
            commit.request_sync()

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
        (<HistoryWire?>self.log).record(rev, name, what, token, meta)  # (TypeError for another history)

    cpdef bint listening(self):
        return bool(self.watched)

    cpdef bint deliver(self, list changes):
        return bool(self.registry.publish(changes))
