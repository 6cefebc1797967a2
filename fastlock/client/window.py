"""Once-per-window runs: :meth:`Client.once_per <fastlock.client.Client.once_per>`.

A job scheduled on many machines (cron on every node of a fleet) runs at most once
per window, even when a run is shorter than the window and the machines' clocks
disagree: ShedLock's ``lockAtLeastFor``.  Faking it with a lock and a sleep fails
both ways (a short run frees the lock for a second run in the same window; a
process that dies in the sleep frees it too).

**How.**  The run takes a lease of ``name`` with ``wait=0`` and a TTL of exactly the
window, so the server's own deadline for it is the grant plus the window, on the
server's monotonic clock.  A run that ends early does not release it: the lease
runs out at the end of the window, by the server's clock alone, and until then
every other run is refused (``LockNotAcquired``).  A lease is replicated and
survives a failover with its deadline (the promoted standby keeps it), so the
window does too; a run that dies keeps the window taken just the same.  The
clients' clocks play no part in that: a client whose wall clock is an hour off
(or whose process is frozen) cannot shorten a window.

A run still going near the end of its window (two thirds of ``min(ttl, window)``
before the client's conservative estimate of the server's deadline: as early, before
the end, as a renewal of a ``ttl`` lease comes before its expiry) extends its
lease by ``ttl`` and renews it in the background from then on, as
:meth:`Client.lock <fastlock.client.Client.lock>` does, so a long run keeps the
lock.  When such a run ends, the lease is released if the window has passed by
the client's monotonic clock, counted from when the grant was read (later than
the grant); otherwise it is extended for what is left of the window, measured so,
and left to run out.  Only that path uses a duration the client measured, and
only ever to make the hold longer than the window, never shorter.

The window is a lease TTL: at most one hour (the longest TTL).

Fencing: each run's lease has its own fencing token, higher than every earlier
run's; a run that lost its lease (``lease.lost``) and goes on writing is refused by
a resource that checks tokens.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..errors import FastlockError
from ..logsafe import quote
from .lease import Lease

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

log = logging.getLogger(__name__)

__all__ = ["OncePerWindow"]


class OncePerWindow:
    """One run of the job ``name``, at most one per ``window`` seconds (see the module's
    text); made by :meth:`Client.once_per <fastlock.client.Client.once_per>`.

    ``async with`` it (the lease is the value) or call :meth:`start` and :meth:`finish`.

    Attributes:
        name (str): the job's lock name.
        window (float): seconds, counted from the grant on the server's clock.
        ttl (float): seconds: the TTL a run still going at the window's end renews with.
        lease (Lease | None): the run's lease once started.
    """

    __slots__ = ("client", "name", "window", "ttl", "correlation_id", "lease", "_read_at", "_guard", "_extended")

    def __init__(self, client: Client, name: str, window: float, *, ttl: float = 30.0,
                 correlation_id: str | None = None):
        P.check_name(name)
        P.check_ttl_ms(P.seconds_to_ms(window, "window"))
        P.check_ttl_ms(P.seconds_to_ms(ttl, "ttl"))
        if correlation_id is not None:
            P.check_optional_str(correlation_id, "correlation_id", P.MAX_CORRELATION_ID_CHARS)
        self.client = client
        self.name = name
        self.window = float(window)
        self.ttl = float(ttl)
        self.correlation_id = correlation_id
        self.lease: Lease | None = None
        self._read_at = 0.0  # loop.time() when the grant was read (no earlier than the grant)
        self._guard: asyncio.Task[None] | None = None
        self._extended = False  # the lease outlived its window's TTL (the run went on)

    async def start(self) -> Lease:
        """Start the run: take the window's lease, or fail at once.

        Raises:
            LockNotAcquired: a run of ``name`` started less than ``window`` seconds ago
                (or holds it still); nothing changed.
            ConnectionLost, PermissionDenied, ...: as :meth:`Client.acquire
                <fastlock.client.Client.acquire>`.
        """
        loop = asyncio.get_running_loop()
        lease = await self.client.acquire(self.name, ttl=self.window, wait=0, correlation_id=self.correlation_id)
        self._read_at = loop.time()
        self.lease = lease
        self._guard = loop.create_task(self._keep(lease), name=f"fastlock-window-{self.name}")
        return lease

    async def _keep(self, lease: Lease) -> None:
        """Extend the lease just before its window ends, then renew it, while the run goes on."""
        loop = asyncio.get_running_loop()
        margin = min(self.ttl, self.window) * 2.0 / 3.0
        await asyncio.sleep(max(0.0, lease.expires_at - margin - loop.time()))
        self._extended = True
        try:
            extended = await self.client.extend(lease, ttl=self.ttl)
        except FastlockError as exc:
            log.warning("run of %s (token %d) could not keep its lease past its window: %s",
                        quote(self.name), lease.fencing_token, exc)
            lease.lost.set()
            return
        self.lease = extended
        self.client.start_renewing(extended)

    async def finish(self) -> None:
        """End the run.  The lease stays until ``window`` seconds after its grant (it is
        not released before); a run that went on past its window releases it.
        Errors of the release or extend are logged, not raised (``lease.lost`` is set)."""
        guard, self._guard = self._guard, None
        lease = self.lease
        if guard is not None:
            guard.cancel()
            try:
                await guard
            except asyncio.CancelledError:
                if not guard.cancelled():  # the caller itself is being cancelled
                    raise
        if lease is None or not self._extended:
            return  # the lease runs out at the end of the window, on the server's clock
        client = self.client
        client.renewers.stop(lease)
        left = self._read_at + self.window - asyncio.get_running_loop().time()
        try:
            if left > 0.001:
                await client.extend(lease, ttl=left)  # the rest of the window, then it runs out
            else:
                await client.release(lease)
        except FastlockError as exc:
            log.warning("end of the run of %s (token %d): %s", quote(self.name), lease.fencing_token, exc)
            lease.lost.set()

    async def __aenter__(self) -> Lease:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.finish()

    def __repr__(self) -> str:
        return f"<OncePerWindow {self.name!r} window={self.window}s>"
