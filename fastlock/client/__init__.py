"""The asyncio client (and, in :mod:`fastlock.client.blocking`, the blocking one).

Modules, each readable alone:

- :mod:`~fastlock.client.connection` - finding the primary, the connection,
  riding through a failover, liveness;
- :mod:`~fastlock.client.sweep` - what each address answered in a sweep, and the
  first connect's wait for a primary during a failover;
- :mod:`~fastlock.client.lease` - :class:`Lease` (immutable), its shared
  :class:`LeaseState`, :class:`LeaseHealth`, :class:`WatchEvent`;
- :mod:`~fastlock.client.renewer` - the one renewal loop (locks, multi-locks,
  election terms);
- :mod:`~fastlock.client.multilock` - several locks at once, all or none;
- :mod:`~fastlock.client.kinds` - shared locks' and semaphores' arguments,
  :class:`Semaphore`, the one-request atomic multi-lock;
- :mod:`~fastlock.client.client` - the :class:`Client` facade;
- :mod:`~fastlock.client.connect` - :func:`connect`, the entry point;
- :mod:`~fastlock.client.admin` - the operator's requests (``locks``, ``lock_info``, ``revoke``);
- :mod:`~fastlock.client.election` - leader election on leases;
- :mod:`~fastlock.client.blocking` - :class:`~fastlock.client.blocking.SyncClient` for threads;
- :mod:`~fastlock.client.session` - the client's session: one keep-alive for every renewed
  lease, and the operator's ``sessions`` / ``close_session``.

The client imports only :mod:`fastlock.protocol` and leaf modules.  Every name
``fastlock.client`` had before it became a package is re-exported here.
"""

from ..units import DEFAULT_PORT
from .acquire import new_caller
from .admin import LeaseInfo, LockInfo, LockList, PrincipalRevocation, WaiterInfo
from .client import LATE_GRANT_FRACTION, Client, LockContext
from .connect import connect
from .connection import RETRYABLE, ClientConnection, Connector, RideThrough, resolve_credential
from .election import Election, Leader, Term
from .keys import KeyEvent, KeyList, KeyValue
from .kinds import Semaphore
from .lease import IN_JEOPARDY, LOST, SAFE, HolderInfo, Lease, LeaseHealth, LeaseState, WatchEvent
from .multilock import LockManyContext, MultiLease
from .renewer import Renewer
from .session import SessionClosed, SessionInfo, SessionKeeper
from .sweep import FAILOVER_TIMEOUT, AddressAnswer, NoPrimaryFound

__all__ = ["connect", "Client", "Lease", "LeaseState", "LeaseHealth", "LockContext", "MultiLease",
           "LockManyContext", "WatchEvent", "HolderInfo", "Election", "Term", "Leader", "Renewer", "resolve_credential",
           "DEFAULT_PORT", "LATE_GRANT_FRACTION", "SAFE", "IN_JEOPARDY", "LOST", "RETRYABLE", "ClientConnection",
           "Connector", "RideThrough", "KeyValue", "KeyList", "KeyEvent",
           "LeaseInfo", "LockInfo", "LockList", "WaiterInfo", "Semaphore", "PrincipalRevocation",
           "FAILOVER_TIMEOUT", "AddressAnswer", "NoPrimaryFound", "new_caller",
           "SessionInfo", "SessionClosed", "SessionKeeper"]
