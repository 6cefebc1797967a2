# cython: language_level=3
"""The compiled slots of :class:`~fastlock.client.lease.LeaseState` (see fastlock/client/lease.py).

:class:`LeaseSlots` holds the fields of a lease's mutable state as C object slots, declared in
``_lease_slots.pxd``, so that the client's compiled request path (``_path.pyx``) makes a
grant's state and sets its fields by typed C stores.  ``LeaseState`` subclasses it with the
behaviour (the ``lost``, ``health`` and ``revoke_requested`` events made on first use).
"""


cdef class LeaseSlots:
    """The six fields of a :class:`~fastlock.client.lease.LeaseState`, each None until set:
    ``_lost`` (asyncio.Event | None), ``expires_at`` (float, ``loop.time()`` seconds),
    ``_health`` (LeaseHealth | None), ``sequencer`` (bytes | None), ``revoke_request``
    (RevokeRequest | None), ``_revoke_requested`` (asyncio.Event | None)."""
