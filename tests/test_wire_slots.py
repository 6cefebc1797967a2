"""The compiled request path's casts of its typed collaborators are checked: an object of
another type where the batch end or a history expects a compiled class raises TypeError
instead of reading memory as that class (a crash).  Each case runs in a child interpreter,
so a crash shows as that process's death, not the test run's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60)


def test_a_lock_history_that_is_not_a_watch_log_raises_type_error():
    """RevisionsWire.logged records through HistoryWire.record: a key history (a ChangeLogWire,
    not a HistoryWire) put in its place is refused with TypeError, and nothing is recorded."""
    done = _run("""
        from fastlock._core import LockTable
        from fastlock.server._watchlog import RevisionsWire
        from fastlock.server.keyrevisions import KeyChangeLog
        from fastlock.server.watchlog import WatchLog
        from fastlock.wal.commit import GroupCommit

        wire = RevisionsWire()
        wire.table = LockTable()
        wire.commit = GroupCommit(None, False, 0, lambda exc: None)
        wire.log = WatchLog(10)
        wire.logged("a", "granted", 1, None)
        assert len(wire.log.changes) == 1
        wire.log = KeyChangeLog(10)
        try:
            wire.logged("a", "released", 1, None)
        except TypeError as exc:
            assert not wire.log.changes and not wire.log.pending
            print("TypeError:", exc)
        """)
    assert done.returncode == 0, done.stderr
    assert "TypeError:" in done.stdout


def test_a_dirty_entry_that_is_not_a_connection_raises_type_error():
    """The batch end flushes the connections queued in ``dirty`` (a public list) by C calls:
    anything else there is refused with TypeError (the process goes on)."""
    done = _run("""
        from fastlock._core import LockTable
        from fastlock.replication._wire import QueuesWire, SourceWire
        from fastlock.server._watchlog import CommittedWire, RevisionsWire
        from fastlock.server._wire import BatchEnd, ExpiryWire
        from fastlock.server.watchlog import WatchLog
        from fastlock.wal._syncer import SegmentFile
        from fastlock.wal.commit import GroupCommit

        class Snapshots:  # no snapshot due
            next_due = next_due_bytes = 1 << 62

        server = BatchEnd()
        server.table = LockTable()
        server.commit = GroupCommit(SegmentFile(), False, 0, lambda exc: None)
        server.snapshots = Snapshots()
        server.expiry = ExpiryWire()
        server.revisions = RevisionsWire()
        server.revisions.log = WatchLog(10)
        server.key_revisions = CommittedWire()
        server.key_revisions.log = WatchLog(10)
        server.queues = QueuesWire()
        server.source = SourceWire()
        server.dirty = []
        server.after_batch()  # nothing queued: nothing flushed
        server.dirty = [object()]
        try:
            server.after_batch()
        except TypeError as exc:
            print("TypeError:", exc)
        """)
    assert done.returncode == 0, done.stderr
    assert "TypeError:" in done.stdout


# a server's and a connection's compiled entry points, called before their __init__ set the
# typed slots they read (each slot still None)
_BEFORE_INIT = {
    "LockServer.acknowledge": "LockServer.__new__(LockServer).acknowledge([])",
    "LockServer.released": "LockServer.__new__(LockServer).released('a', 1, None)",
    "LockServer.deliver_granted": "LockServer.__new__(LockServer).deliver_granted([])",
    "LockServer.after_batch": "LockServer.__new__(LockServer).after_batch()",
    "Session.send": "Session.__new__(Session).send(b'x')",
    "Session.flush": "Session.__new__(Session).flush()",
    "Session.data_received": "Session.__new__(Session).data_received(bytes([0x93, 1, 2, 3]))",
    "dispatch": "dispatch(Handlers.__new__(Handlers), Session.__new__(Session), [1, 2, 'a'])",
}


@pytest.mark.parametrize("call", sorted(_BEFORE_INIT))
def test_a_typed_slot_read_while_none_raises_instead_of_crashing(call):
    """Compiled code reads its typed collaborators (``BatchEnd.wal``, ``SessionWire.server``,
    ...) by C field access: one still None (the server's or connection's ``__init__`` not run
    yet) raises AttributeError or TypeError (the module's ``nonecheck``) instead of reading
    None's memory as that class."""
    done = _run(f"""
        from fastlock.server._wire import dispatch
        from fastlock.server.handlers import Handlers
        from fastlock.server.lockserver import LockServer
        from fastlock.server.session import Session

        try:
            {_BEFORE_INIT[call]}
        except (AttributeError, TypeError) as exc:
            print(type(exc).__name__ + ":", exc)
        """)
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr}"
    assert "Error:" in done.stdout


# the group commit's compiled entry points, called before __init__ set the typed slots they read
# (its pending batch, its commit: each still None)
_COMMIT_BEFORE_INIT = {
    "GroupCommit.add_lease_record": "GroupCommit.__new__(GroupCommit).add_lease_record(2, 'a', 1, 0)",
    "GroupCommit.add_grant_record":
        "GroupCommit.__new__(GroupCommit).add_grant_record(1, 'a', 1, b'o', 1000, 0, None, None, 0)",
    "LogAppender.log_release": "LogAppender.__new__(LogAppender).log_release('a', 1)",
}


@pytest.mark.parametrize("call", sorted(_COMMIT_BEFORE_INIT))
def test_a_group_commit_slot_read_while_none_raises_instead_of_crashing(call):
    """``fastlock.wal.commit`` reads its typed slots (``GroupCommit._pending``,
    ``LogAppender._commit``, ...) by C field access: one still None (``__init__`` not run) raises
    AttributeError or TypeError (the module's ``nonecheck``) instead of reading or writing None's
    memory as that class."""
    done = _run(f"""
        from fastlock.wal.commit import GroupCommit, LogAppender

        try:
            {_COMMIT_BEFORE_INIT[call]}
        except (AttributeError, TypeError) as exc:
            print(type(exc).__name__ + ":", exc)
        """)
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr}"
    assert "Error:" in done.stdout


# a watch history's compiled entry points with one of their typed slots still None: ``wire`` is a
# RevisionsWire (a lock watch history's publisher) with a history holding one unpublished change
_HISTORY_SETUP = """
    from fastlock._core import LockTable
    from fastlock.replication._wire import SourceWire, SyncWire
    from fastlock.server._watchlog import RevisionsWire
    from fastlock.server.watchlog import WatchLog
    from fastlock.wal.commit import GroupCommit

    wire = RevisionsWire()
    wire.table = LockTable()
    wire.watched = {}
    wire.scheduled = 0
    wire.revision_at = 0
    wire.log = WatchLog(10)
    wire.log.record(1, "a", "granted", 1, None)
    wire.source = SourceWire()
    wire.source.sync = SyncWire()
    wire.commit = GroupCommit(None, True, 0, lambda exc: None)
"""
_HISTORY_NONE = {
    "RevisionsWire.logged (commit None)": "wire.commit = None; wire.logged('a', 'released', 1, None)",
    "RevisionsWire.batch_end (log None)": "wire.log = None; wire.batch_end()",
    "RevisionsWire.batch_end (source None)": "wire.source = None; wire.batch_end()",
    "RevisionsWire.batch_end (source.sync None)": "wire.source.sync = None; wire.batch_end()",
    "RevisionsWire.settle (commit None)": "wire.commit = None; wire.settle()",
    "RevisionsWire.settle (log None)": "wire.log = None; wire.settle()",
    "RevisionsWire.listener_added (commit None)": "wire.commit = None; wire.listener_added()",
}


@pytest.mark.parametrize("call", sorted(_HISTORY_NONE))
def test_a_watch_history_slot_read_while_none_raises_instead_of_crashing(call):
    """A watch history's batch end and record path (``_watchlog.pyx``) read their typed
    collaborators (``log``, ``source``, ``source.sync``, ``commit``) by C field
    access: one still None raises AttributeError or TypeError (the module's ``nonecheck``)
    instead of reading None's memory as that class."""
    done = _run(_HISTORY_SETUP + f"""
    try:
        {_HISTORY_NONE[call]}
    except (AttributeError, TypeError) as exc:
        print(type(exc).__name__ + ":", exc)
    """)
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr}"
    assert "Error:" in done.stdout
