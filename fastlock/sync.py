"""The blocking client; it lives in :mod:`fastlock.client.blocking`.

``from fastlock.sync import SyncClient`` keeps working.
"""

from .client.blocking import SyncClient, SyncLease, SyncLockContext, SyncMultiLease
from .client.blocking_election import SyncElection, SyncTerm

__all__ = ["SyncClient", "SyncLease", "SyncMultiLease", "SyncElection", "SyncTerm", "SyncLockContext"]
