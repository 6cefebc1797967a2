"""The blocking client; it lives in :mod:`fastlock.client.sync`.

``from fastlock.sync import SyncClient`` keeps working.
"""

from .client.sync import SyncClient, SyncElection, SyncLease, SyncLockContext, SyncMultiLease, SyncTerm

__all__ = ["SyncClient", "SyncLease", "SyncMultiLease", "SyncElection", "SyncTerm", "SyncLockContext"]
