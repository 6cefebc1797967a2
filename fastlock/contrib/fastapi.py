"""FastAPI / Starlette: one leader per deployment, leader-only work stopped when leadership is lost.

Every replica of the app campaigns in a :class:`fastlock.election.Election`
from its lifespan; the one elected runs the functions registered with
:meth:`Leadership.leader_task` (a scheduler, a queue consumer...), each given
the :class:`~fastlock.election.Term` (``term.fencing_token`` for its writes).
When the term ends - a renewal refused, the renew deadline passed (a
partition, a frozen process), the server unreachable - those tasks are
cancelled at once and the replica campaigns again; another replica takes
over once the lease is free.  On shutdown the leader resigns, so the next one
is elected without waiting for the TTL::

    from fastapi import FastAPI
    from fastlock.contrib.fastapi import Leadership

    leadership = Leadership("billing/scheduler", "10.0.0.5:7420", "10.0.0.6:7420")

    @leadership.leader_task
    async def run_scheduler(term):
        while True:
            await send_due_invoices(fencing_token=term.fencing_token)
            await asyncio.sleep(10)

    app = FastAPI(lifespan=leadership.lifespan)

    @app.get("/healthz")
    def healthz():
        return {"leader": leadership.is_leader}

An app with a lifespan of its own enters ``async with leadership.run():``
inside it.  Nothing here imports FastAPI: any ASGI app with a lifespan works.

A leader task that raises is logged and the replica resigns (so a replica
whose leader-only work is broken does not keep the leadership) and campaigns
again after ``retry_period``; one that returns simply ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastlock.client import connect
from fastlock.client.election import Term
from fastlock.errors import FastlockError

__all__ = ["Leadership", "LeaderTask"]

log = logging.getLogger(__name__)

LeaderTask = Callable[[Term], Awaitable[Any]]


class Leadership:
    """One election, campaigned for from an app's lifespan.

    Args:
        name: the election's lock name (one per deployment and role).
        *servers: fastlock addresses (``"host:port"``), as :func:`fastlock.connect`.
        candidate_id: this replica's id; default ``"<hostname>:<pid>"``.
        lease_duration, renew_deadline, retry_period: seconds, as
            :class:`fastlock.election.Election` (15 / 10 / 2 by default, as
            Kubernetes' leader election).
        **connect_options: passed to :func:`fastlock.connect` (``token_file``,
            ``tls_ca``, ``client_name``...).

    Raises (from :meth:`run`): what :func:`fastlock.connect` raises when no
    server can be reached at startup (the app then fails to start).
    """

    def __init__(self, name: str, *servers: str, candidate_id: str | None = None, lease_duration: float = 15.0,
                 renew_deadline: float = 10.0, retry_period: float = 2.0, **connect_options: Any):
        self.name = name
        self.servers = servers
        self.candidate_id = candidate_id or f"{socket.gethostname()}:{os.getpid()}"
        self.durations = {"lease_duration": lease_duration, "renew_deadline": renew_deadline,
                          "retry_period": retry_period}
        self.connect_options = connect_options
        self.tasks: list[LeaderTask] = []
        self.term: Term | None = None

    def leader_task(self, fn: LeaderTask) -> LeaderTask:
        """Register ``async def fn(term)`` to run while this replica is leader (a decorator)."""
        self.tasks.append(fn)
        return fn

    @property
    def is_leader(self) -> bool:
        """True while this replica holds a live term (its own renew deadline not passed)."""
        term = self.term
        return term is not None and term.is_leader()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """The app's lifespan (``FastAPI(lifespan=leadership.lifespan)``); sets ``app.state.leadership``."""
        state = getattr(app, "state", None)
        if state is not None:
            state.leadership = self
        async with self.run():
            yield

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[Leadership]:
        """Connect and campaign in the background until the block exits; then stop
        the leader tasks, resign and close the client."""
        client = await connect(*self.servers, **self.connect_options)
        election = client.election(self.name, self.candidate_id, **self.durations)
        campaign = asyncio.ensure_future(self._campaign(election))
        try:
            yield self
        finally:
            campaign.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await campaign
            await client.close()

    async def _campaign(self, election: Any) -> None:
        while True:
            try:
                term = await election.campaign()
            except FastlockError as exc:
                log.warning("election %s: campaign failed (%s); again in %.1f s", self.name, exc,
                            self.durations["retry_period"])
                await asyncio.sleep(self.durations["retry_period"])
                continue
            log.info("election %s: %s is leader (token %d)", self.name, self.candidate_id, term.fencing_token)
            self.term = term
            try:
                failed = await self._lead(term)
            finally:
                self.term = None
                await term.resign()  # no-op when the term was already lost
            log.info("election %s: %s no longer leader", self.name, self.candidate_id)
            if failed:  # give the other replicas a head start in the queue
                await asyncio.sleep(self.durations["retry_period"])

    async def _lead(self, term: Term) -> bool:
        """Run the leader tasks until the term is lost (returns False) or one of them raises (True)."""
        tasks: dict[asyncio.Future[Any], LeaderTask] = {asyncio.ensure_future(fn(term)): fn for fn in self.tasks}
        lost = asyncio.ensure_future(term.lost.wait())
        try:
            pending: set[asyncio.Future[Any]] = {lost, *tasks}
            while not lost.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                failed = [t for t in done if t is not lost and not t.cancelled() and t.exception() is not None]
                for t in failed:
                    log.error("election %s: leader task %s failed; resigning", self.name,
                              getattr(tasks[t], "__qualname__", tasks[t]), exc_info=t.exception())
                if failed:
                    return True
            return False
        finally:
            for t in (lost, *tasks):
                t.cancel()
            await asyncio.gather(lost, *tasks, return_exceptions=True)
