# cython: language_level=3, nonecheck=True
"""The replication fields the server reads on every request and batch end, as slots.

:class:`SourceWire` is the compiled base of
:class:`fastlock.replication.source.ReplicationSource`, :class:`QueuesWire` that of
:class:`fastlock.replication.queues.QueueShipper` and :class:`SyncWire` that of the
synchronous-replication gates (:class:`fastlock.replication.syncrep.SyncGate`,
:class:`fastlock.replication.groupsync.GroupSyncGate`).  Their fields are declared in
``_wire.pxd``: the server's compiled request path (``fastlock/server/_wire.pyx``, the watch
histories' batch end in ``fastlock/server/_watchlog.pyx``) reads them as C struct fields,
without a dictionary lookup; Python code reads and sets them as attributes.
"""


cdef class SyncWire:
    """The compiled base of a synchronous-replication gate: ``enabled`` (bool), whether grant
    and extend replies wait for the standbys (False: asynchronous replication)."""


cdef class QueuesWire:
    """The compiled base of :class:`~fastlock.replication.queues.QueueShipper`: ``dirty`` (lock
    names whose queue may have changed since the last shipment), ``shipped`` (lock name -> the
    owner hashes last shipped) and ``informed`` (the standby sessions sent the whole map)."""


cdef class SourceWire:
    """The compiled base of :class:`~fastlock.replication.source.ReplicationSource`:
    ``fencing`` (bool: paired, the fence is checked before a grant), ``sync`` (its
    :class:`SyncWire` gate), ``ttl`` (its :class:`~fastlock.replication.ttlbound.TtlBound`) and
    ``replicas`` (session id -> attached standby)."""
