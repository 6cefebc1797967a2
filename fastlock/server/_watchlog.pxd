# The compiled classes of fastlock/server/_watchlog.pyx, declared for the server's batch end
# (fastlock/server/_wire.pyx), which records and publishes holder changes by C calls.  A typed
# slot still None where it is read raises AttributeError (_watchlog.pyx is compiled with nonecheck).

from ..replication._wire cimport SourceWire
from ..wal.commit cimport GroupCommit


cdef class ChangeLogWire:
    cdef public object pending

    cpdef list publish(self, object upto)
    cpdef mark_published(self, object upto)


cdef class HistoryWire(ChangeLogWire):
    cdef public Py_ssize_t limit
    cdef public object changes
    cdef public dict by_name
    cdef public object floor
    cdef public object published

    cpdef record(self, object rev, object name, object what, object token, object meta, bint published=*)


cdef class CommittedWire:
    cdef public object server
    cdef public SourceWire source
    cdef public ChangeLogWire log
    cdef public Py_ssize_t revision_at
    cdef public GroupCommit commit
    cdef public object scheduled

    cpdef bint listening(self)
    cpdef bint deliver(self, list changes)
    cpdef batch_end(self)
    cpdef settle(self)
    cdef _settle(self, object pending)
    cpdef listener_added(self)
    cpdef _publish(self, object upto, object refused=*, bint flush=*)


cdef class RevisionsWire(CommittedWire):
    cdef public object registry
    cdef public dict watched
    cdef public object table

    cpdef logged(self, object name, object what, object token, object meta)
