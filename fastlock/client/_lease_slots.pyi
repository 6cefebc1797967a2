"""Type stub of the compiled :mod:`fastlock.client._lease_slots` (see its ``.pyx`` docstring)."""

import asyncio

from .lease import LeaseHealth, RevokeRequest

class LeaseSlots:
    _lost: asyncio.Event | None
    expires_at: float
    _health: LeaseHealth | None
    sequencer: bytes | None
    revoke_request: RevokeRequest | None
    _revoke_requested: asyncio.Event | None
