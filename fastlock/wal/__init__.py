"""Write-ahead log: append, group commit, recovery, snapshots/compaction, audit dump.

This package re-exports the names other modules use; its modules, each one concern:
:mod:`~fastlock.wal.records` (typed records and the one ``apply``),
:mod:`~fastlock.wal.format` (segments, frames, the frame reader),
:mod:`~fastlock.wal.files` (directory modes, atomic writes, the directory lock),
:mod:`~fastlock.wal.recovery`, :mod:`~fastlock.wal.snapshot` (snapshots and compaction),
:mod:`~fastlock.wal.writer` (the segment writer and its thread),
:mod:`~fastlock.wal.commit` (group commit on the loop),
:mod:`~fastlock.wal.log` (the loop-side :class:`WriteAheadLog`),
:mod:`~fastlock.wal.backlog` (reading the log back) and :mod:`~fastlock.wal.dump`.

Everything the lock server must remember across a restart goes through this log:
grants, releases, expiries, TTL changes, epoch changes and fencing-counter
reservations.  Recovery loads the newest valid snapshot and replays the records
after it.

On disk (one directory)
-----------------------
``wal-<first-lsn:020d>.log``
    A segment: a 24-byte header (magic ``FLOCKWAL``, format version, first LSN,
    CRC32 of the header) followed by frames.  Each frame is::

        crc32 : u32 little-endian  -- zlib.crc32 of the next 4 bytes + body
        len   : u32 little-endian  -- body length in bytes (low 30 bits);
                                      bit 30 marks the first frame of a written
                                      batch, bit 31 its last frame ("commit")
        body  : msgpack array       -- [type, field, ...] (see below)

    Record *i* of a segment has LSN ``first_lsn + i`` (LSNs are implicit, start
    at 1 and never repeat).  A segment is rotated once it holds at least
    ``segment_bytes``; a batch never spans two segments, and the old segment is
    fsynced before the next one is created, so only the last segment can ever
    have an unsynced tail, whatever the fsync mode.  Every :meth:`~WriteAheadLog.open`
    starts a new segment at the next LSN.

    Segments are preallocated: zero-filled and synced in 1 MiB steps ahead of
    the write offset (up to ``segment_bytes``), so that the ``fdatasync`` of a
    batch overwrites existing blocks and writes no metadata.  The zeros after
    the last record are cut at rotation and at a clean close; after a crash,
    recovery cuts them (a frame header is never all zeros, so zeros up to the
    end of the last segment are the end of the log, not a torn tail).
``snap-<lsn:020d>.snap``
    A snapshot of the lock table after applying every record up to ``lsn``:
    a header (magic ``FLOCKSNP``, version, lsn, epoch, counter, body length),
    a msgpack array of holders, then (when there are some) a msgpack array of keys
    and a shard group's slots and queues imported by moves and not yet taken
    (:class:`~fastlock.wal.records.ImportedSlots`; absent: none), and a trailing
    CRC32 of everything before it.
    Written to ``*.tmp``, fsynced, renamed, directory fsynced (so a snapshot
    is either absent or complete).

Record bodies (``[type, ...]``, in memory the named tuples of
:mod:`fastlock.wal.records`; times are wall-clock milliseconds since the Unix
epoch, kept for the audit dump only -- expiry never looks at them):

==========  ==  ==================================================================
GRANT        1  name, token, owner_hash, ttl_ms, lock_delay_ms, client, correlation_id, wall_ms
RELEASE      2  name, token, wall_ms
EXPIRE       3  name, token, wall_ms
EXTEND       4  name, token, ttl_ms, wall_ms
EPOCH        5  epoch, wall_ms
RESERVE      6  counter, wall_ms         (counter values up to ``counter`` may be issued)
REVOKE      10  name, token, principal, reason, wall_ms  (an operator's force-release: audit)
LOCK_DELAY  20  name, until_wall_ms, wall_ms   (no grant of ``name`` before ``until_wall_ms``)
KEY_PUT     30  key, value, lease_name, token, principal, wall_ms   (lease_name None: no lease)
KEY_DELETE  31  key, wall_ms
REVOKE_REQ  70  name, token, principal, until_wall_ms, grace_ms, wall_ms  (a revoke request's deadline)
KEY_MOVED   80  key, to_group, wall_ms   (a slot move gave the key to shard group ``to_group``)
SLOTS_ADPT  81  first, last, floor, epoch, queues, wall_ms  (this group imported slots ``first..last``)
==========  ==  ==================================================================

A GRANT of a shared lease or a semaphore permit has two more fields, ``shared``
(bool) and ``limit`` (int; 0 for a lock); an exclusive grant is written without
them, as before, so every earlier log reads the same.  LOCK_DELAY records a
running lock-delay (logged at the expiry that starts it and again after every
snapshot, which holds leases only); recovery and a promoted standby keep the lock
unavailable until its wall-clock end, capped at 60 s from recovery.
REVOKE_REQUEST (``revoke_request`` in the dump) keeps the deadline of a revoke
request (:mod:`fastlock.server.preemption`) while its lease holds: logged at the
request and again after every snapshot; recovery and a promoted standby revoke
the lease at that deadline if it still holds.

``owner_hash`` is BLAKE2b-128 of the client's owner key (see :func:`fastlock.auth.hash_owner`):
the key never reaches the disk, a snapshot or a standby.  A log written by a fastlock
before owner hashing (same format version) holds raw keys instead; it recovers, but its
leases' holders cannot extend or release them any more (their keys hash to something
else), so those leases end at their TTL.  ``client`` is ``principal:client_name`` (the
authenticated principal, then the client's self-declared name, which may be empty);
older logs hold the bare client name (no ``:``).

Replay rules: GRANT installs the holder (an exclusive grant replaces every holder;
a shared one or a permit joins the compatible ones); RELEASE/EXPIRE/REVOKE remove
the holder whose token matches; EXTEND sets the holder's ``ttl_ms`` when its
token matches; EPOCH raises the epoch; RESERVE raises the counter; KEY_PUT sets
a key if its lease is the current holder (or it has none), KEY_DELETE removes
it, KEY_MOVED removes it too (it moved to another shard group), and a
RELEASE/EXPIRE that removes a holder removes the keys of that lease
(:mod:`fastlock.wal.keyspace`); LOCK_DELAY keeps a running lock-delay.  The
recovered epoch is the highest of every EPOCH record and every token's epoch;
the recovered counter is the highest of every token's counter and every
reservation.  ``token = (epoch << 40) | counter`` (see ``_core.pyi``).

The framing (length + CRC per record, numbered segments, torn-tail repair on
recovery) follows etcd's WAL.

Recovery and corruption
-----------------------
Zeros from a frame boundary to the end of the *last* segment are preallocated
space that was never written: cut at INFO level, not a torn tail.  A bad frame
(short, zero length, length beyond the file, CRC mismatch) in the
*last* segment followed by nothing valid is a torn tail: a write that the
crash interrupted.  It is cut (the file is truncated and fsynced) and reported
as a WARNING naming the segment, the offset and the number of bytes removed.
Valid frames may follow the bad one only if they are the rest of the same
batch (no batch-start mark among them, nothing after a commit mark): that is
the one batch whose fsync never completed in ``always`` mode, with its pages
written out of order.  Anything else -- valid data from a later batch, or any
bad frame in a non-last segment -- is mid-log corruption: :class:`WalCorruption` is raised with
the segment path, the byte offset and the LSN -- nothing is silently skipped.
An operator who accepts the loss can reopen with ``open(repair=True)``, which
cuts the last segment at its first bad frame (logged at ERROR).

If the newest snapshot is unreadable (CRC, truncation), an older one is used
when the segments needed to replay from it still exist (``keep_snapshots=2``
keeps them by default); otherwise :class:`WalCorruption` explains which.

fsync modes and what each can lose
----------------------------------
``always`` (default)
    Group commit: the records logged during one turn of the event loop are
    written with one ``pwrite`` and made durable with ONE ``fdatasync``
    (``fsync`` on macOS); only then do their :meth:`~WriteAheadLog.when_durable`
    callbacks run.  ``fdatasync`` is enough: inside the preallocated space the
    file's size and blocks do not change, and past it ``fdatasync`` also writes
    the new size (metadata needed to read the data back); segment creation,
    rotation and the final trim use ``fsync``.  At most
    one fsync is in flight; everything logged meanwhile forms the next batch.
    A batch that nobody waits for (only releases and expiries, which the
    server acknowledges without the disk) is written but not fsynced: the next
    waited-for batch's fsync covers it, or the ``fsync_interval_ms`` timer does.
    So a grant that follows a release pays one fsync, not two.
    Loses nothing that was acknowledged after a durability wait.  A crash may leave records that were
    written but never acknowledged (the in-flight batch); replay keeps them if
    they are intact, which is harmless (a grant nobody heard of expires after
    its TTL; its token is simply never used).  No reservation records are
    written in this mode: every grant is durable before its ack, so the
    replayed counter already covers every acknowledged token.
``interval``
    Callbacks run once the batch is written to the OS (``os.write`` returned);
    a timer fsyncs every ``fsync_interval_ms`` (as Redis ``appendfsync
    everysec``).  An OS crash or power loss loses up to the last
    ``fsync_interval_ms`` of acknowledged records (a process crash loses
    nothing: the OS has the data).  Lost grants/releases/extends mean a lock may
    come back free or held after a restart -- but fencing tokens are never
    reused: see counter reservation below.
``never``
    As ``interval`` without the timer: the OS decides when to write back.
    An OS crash can lose any amount of acknowledged records, with the same
    token guarantee.

In every mode, EPOCH records and counter reservations are fsynced before the
callbacks of their batch run (epochs are rare and a lost epoch would let tokens
go backwards); segment rotation and :meth:`~WriteAheadLog.close` fsync too.

Counter reservation (``interval``/``never``), as databases cache sequences:
when a grant's counter exceeds the reserved counter, a RESERVE record for
``counter + reserve_block`` is logged before it and that batch is fsynced
before its callbacks run.  So after any crash, the recovered counter is at
least every acknowledged token's counter, and the server resumes above it.
Each restart may skip up to ``reserve_block`` counter values (2**40 of them).

Failed writes and fsyncs are fatal, as in PostgreSQL since "fsyncgate" (2018):
after a failed fsync the kernel may have dropped the dirty pages, so retrying
cannot tell what reached the disk.  The log calls ``on_fatal(exc)`` on the
loop, never runs another durability callback, and every later ``log_*`` raises
:class:`WalFatal`.  The process should stop and recover from disk.

Group commit implementation: auto, writer thread or inline
----------------------------------------------------------
Three choices (``writer="auto"``, the default, ``"thread"`` or ``"inline"``):

* ``thread``: a dedicated thread does ``pwrite`` + ``fdatasync`` while the
  loop keeps serving and accumulating the next batch.  Its loop is compiled
  (:mod:`fastlock.wal._syncer`): it waits on a condition variable, writes and
  syncs without ever taking the GIL, and signals completion through an eventfd
  (a pipe on systems without one) that the event loop watches with
  ``add_reader`` -- one thread wake-up and one loop wake-up per batch, no
  Python queue and no ``call_soon_threadsafe``; the loop reads the job slot's state without
  its lock.  After a batch the thread finished, the next one is handed over at the end of
  that loop turn, with the records of every request the turn reads (a batch end that takes
  the finished batch early, ``WriteAheadLog.poll``, does not hand over the records logged so
  far on their own, which would make batches of one or two records while syncs are quick).
  The zero-fill of the next preallocation step runs on the thread after the completion is
  signalled.
* ``inline``: the batch is written and synced in a ``loop.call_soon`` callback
  on the loop thread, which blocks the loop for the sync.
* ``auto``: inline once one client has waited alone for
  :data:`~fastlock.wal.commit.LONE_BATCHES` (8) batches in a row (each had at most
  one durability waiter, and none was formed while a batch was on the thread), the
  thread as soon as clients wait together: with two batches, a moment in which one of
  32 concurrent clients happened to wait alone synced 8-10 % of their batches on the
  loop, holding back the other clients' reads and replies for each (1.2 % with 8).
  A lone client saves the two wake-ups of the hand-off, which on a small virtual
  machine cost more than the sync itself (W1, below);
  concurrent clients keep group commit on the thread, and the loop goes on
  parsing and replying during their sync.  A lone client's batch is written and
  synced by compiled code (``SegmentFile.write_synced``) at the batch end of the
  request it answers (``WriteAheadLog.poll``), not one loop turn later; a second
  batch end with records in the same turn counts as clients waiting together
  (its batch goes to the thread).  What a lone client's sync delays
  is only work that needs no disk (releases, checks, other clients' idle
  connections): by one sync at most.

``python -m benches.durability --only w1 --w1-writers thread,inline,auto``
measures W1 with each beside ``--fsync never`` and the fsync probe: on the
project's 2-vCPU machine (a shared disk) auto 281 µs and inline 291 µs against
thread 390 µs and never 85 µs, probe 126 µs.  ``python benches/bench_wal.py
--compare-writers`` measures group commit under many producers.  A slow sync
(it can vary by an order of magnitude within minutes) stalls every client and
timer for its whole length with ``inline``, which is kept for benchmarks and
for platforms where threads are undesirable.  With a thread, a batch that needs
no sync (``interval``/``never`` modes, no reservation, no rotation) is written
inline: a ``pwrite`` into the page cache costs microseconds, less than the
hand-off to the thread and back.

Replication hooks
-----------------
:meth:`WriteAheadLog.read_from` iterates ``(lsn, record)`` over the segments
still on disk; :meth:`WriteAheadLog.add_listener` registers ``fn(first_lsn,
last_lsn, data)`` called on the loop with the exact bytes of each written batch
(frames as on disk; decode with :func:`decode_frames`).  A standby can stream
those and append them verbatim to its own log.
"""

from ..errors import DataDirInUse, StorageError, WalCompacted, WalCorruption, WalFatal
from .backlog import BacklogReader
from .dump import dump
from .files import DIR_MODE, FILE_MODE, fsync_dir, secure_directory, write_atomically
from .format import MAX_RECORD_BYTES, decode_frames
from .log import FSYNC_MODES, WriteAheadLog
from .records import (
    COUNTER_MASK,
    EPOCH,
    EXPIRE,
    EXTEND,
    GRANT,
    LOCK_DELAY,
    RECORD_NAMES,
    RELEASE,
    RESERVE,
    REVOKE,
    TOKEN_EPOCH_SHIFT,
    Epoch,
    Expire,
    Extend,
    Grant,
    HolderRecord,
    LeaseMeta,
    LockDelay,
    LogState,
    Record,
    Release,
    Reserve,
    Revoke,
    RevokeRequest,
    apply,
)
from .recovery import RecoveredState
from .snapshot import HolderSlices, PackedHolders, SnapshotState

__all__ = [
    "WriteAheadLog",
    "RecoveredState",
    "HolderRecord",
    "PackedHolders",
    "HolderSlices",
    "SnapshotState",
    "StorageError",
    "WalCorruption",
    "WalFatal",
    "WalCompacted",
    "DataDirInUse",
    "BacklogReader",
    "dump",
    "decode_frames",
    "secure_directory",
    "write_atomically",
    "fsync_dir",
    "DIR_MODE",
    "FILE_MODE",
    "FSYNC_MODES",
    "MAX_RECORD_BYTES",
    "GRANT",
    "RELEASE",
    "EXPIRE",
    "EXTEND",
    "EPOCH",
    "RESERVE",
    "REVOKE",
    "LOCK_DELAY",
    "LockDelay",
    "RECORD_NAMES",
    "TOKEN_EPOCH_SHIFT",
    "COUNTER_MASK",
    "Grant",
    "Release",
    "Expire",
    "Extend",
    "Epoch",
    "Reserve",
    "Revoke",
    "RevokeRequest",
    "Record",
    "LeaseMeta",
    "LogState",
    "apply",
]
