# The compiled classes of fastlock/server/_wire.pyx: a connection's input and replies, the op
# handlers' collaborators, the batch end and the quota counts.  Each one's collaborators are
# typed slots, so the request path reads them and calls their compiled methods by C calls; one
# still None where it is read (before its object's __init__ set it) raises AttributeError
# (_wire.pyx is compiled with nonecheck).

from .._core cimport Event
from ..replication._wire cimport QueuesWire, SourceWire
from ..wal.commit cimport GroupCommit, LogAppender
from ._watchlog cimport CommittedWire, HistoryWire, RevisionsWire

cdef class BatchEnd


cdef class IntakeWire:
    cdef public object decoder
    cdef public object raw
    cdef public Py_ssize_t raw_at
    cdef public object pending
    cdef public Py_ssize_t next
    cdef public bint held
    cdef public bint scheduled


cdef class ExpiryWire:
    cdef public object handle
    cdef public object at_ms


cdef class LimitsWire:
    cdef public dict sessions
    cdef public object idle_timeout_ms


cdef class DelaysWire:
    cdef public dict per_principal


cdef class ReclaimWire:
    cdef public dict queues


cdef class SessionsWire:
    cdef public dict attached_to


cdef class KeysWire:
    cdef public object space


cdef class UsageWire:
    cdef public dict leases
    cdef public object waiting


cdef class QuotaCounts:
    cdef public object table, waiters, leases, _epoch
    cdef public DelaysWire delays
    cdef public dict usage, _principal_of
    cdef public set ended_early
    cdef public set counted_now  # leases an acquire counted whose grant event is not processed yet

    cpdef check_acquire(self, principal, leases, waiters)
    cpdef lock_delay_count(self, now)
    cpdef acquired(self, UsageWire u, status, names, last_token)
    cpdef grant_event(self, Event ev)
    cpdef lease_ended(self, token, meta=*, principal=*, name=*)


cdef class HandlersWire:
    cdef public BatchEnd server
    cdef public object table, roles, config, watchers, kinds
    cdef public KeysWire keys
    cdef public SessionsWire sessions
    cdef public SourceWire source
    cdef public LogAppender wal
    cdef public QuotaCounts quotas
    cdef public dict by_op, need_by_op
    cdef public object acquire_handler, release_handler  # ACQUIRE's and RELEASE's entries in by_op, unwrapped


cdef class SessionWire:
    cdef public BatchEnd server
    cdef public object session
    cdef public IntakeWire intake
    cdef public object transport
    cdef public list out
    cdef public Py_ssize_t out_bytes
    cdef public bint closed
    cdef public bint ready
    cdef public object last_read_ms
    cdef object _grant  # the principal the connection authenticated as (auth.Principal: the grant property) ...
    cdef readonly frozenset grant_everywhere  # ... what it may do on every name (Principal.everywhere) ...
    cdef readonly bint grant_admin  # ... whether it is an admin ...
    cdef readonly object grant_name  # ... and its name (the per-principal quotas' key)
    cdef public object recorded  # ... and what its grants record as their client
    cdef object owner_key  # the last owner key received (None: none yet) ...
    cdef bytes owner_hashed  # ... and its hash
    cdef public object _drain  # while writing is paused: a future done when it resumes (else None)

    cpdef bytes owner_hash(self, object owner)
    cpdef flush(self)
    cpdef send(self, object data)


cdef class BatchEnd:
    cdef public object table, roles
    cdef public frozenset admitted  # roles.admitted, kept by the roles' on_admitted (None: read from roles)
    cdef public SourceWire source
    cdef public QueuesWire queues
    cdef public ExpiryWire expiry
    cdef public LimitsWire limits
    cdef public RevisionsWire revisions  # the lock watches' history (watchlog.Revisions) ...
    cdef public CommittedWire key_revisions  # ... and the key watches' (keyrevisions.KeyRevisions)
    cdef public ReclaimWire reclaim
    cdef public object node_state, max_ttl_ms
    cdef public LogAppender wal
    cdef public QuotaCounts quotas
    cdef public HandlersWire handlers
    cdef public GroupCommit commit  # the WAL's group commit (wal.group_commit) ...
    cdef public object snapshots  # ... and snapshotter (wal.snapshotter) ...
    cdef object snapshots_read  # ... whose marks the batch end read last ...
    cdef long long snapshot_due_lsn, snapshot_due_bytes  # ... its next_due and next_due_bytes then
    cdef public list dirty
    cdef public bint in_batch_end
    cdef public bint batch_end_owed  # a delivery left its flush to the batch end in progress
    cdef public long long granted_logged  # the highest fencing token whose grant record is logged

    cpdef after_batch(self)
    cpdef process_events(self, list events)
    cpdef acknowledge(self, list grants)
    cpdef deliver_granted(self, list grants, refused_by=*)
    cpdef log_decided(self)
    cpdef log_decided_for(self, long long token)
    cpdef released(self, name, token, meta, principal=*)
