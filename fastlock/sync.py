"""The blocking client; it lives in :mod:`fastlock.client.sync`.

``from fastlock.sync import SyncClient`` keeps working.
"""

from .client.sync import SyncClient, SyncLease, SyncLockContext, SyncMultiLease
from .client.sync_election import SyncElection, SyncTerm

__all__ = ["SyncClient", "SyncLease", "SyncMultiLease", "SyncElection", "SyncTerm", "SyncLockContext"]
