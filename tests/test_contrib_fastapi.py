"""fastlock.contrib.fastapi with FastAPI's TestClient (which runs the app's lifespan): one
leader among replicas, hand-over on shutdown, leader-only work stopped when leadership is lost."""

from __future__ import annotations

import asyncio
import threading

import pytest

fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from fastlock.contrib.fastapi import Leadership  # noqa: E402

FAST = {"lease_duration": 2.0, "renew_deadline": 1.0, "retry_period": 0.2}


class Replica:
    """One replica of an app: its leader-only task reports start and stop through thread events."""

    def __init__(self, address: str, name: str, *, fail: bool = False):
        self.started = threading.Event()
        self.stopped = threading.Event()
        self.tokens: list[int] = []
        self.leadership = Leadership("app/scheduler", address, candidate_id=name, **FAST)

        @self.leadership.leader_task
        async def scheduler(term):
            self.tokens.append(term.fencing_token)
            self.started.set()
            try:
                if fail:
                    raise RuntimeError("the scheduler broke")
                await asyncio.Event().wait()  # leader-only work, until cancelled
            finally:
                self.stopped.set()

        self.app = fastapi.FastAPI(lifespan=self.leadership.lifespan)

        @self.app.get("/leader")
        def leader():
            return {"leader": self.leadership.is_leader}


def test_one_leader_and_hand_over_on_shutdown(server):
    a, b = Replica(server.address, "a"), Replica(server.address, "b")
    with TestClient(a.app) as ca:
        assert a.started.wait(10)
        assert ca.get("/leader").json() == {"leader": True}
        assert a.app.state.leadership is a.leadership
        with TestClient(b.app) as cb:
            assert cb.get("/leader").json() == {"leader": False}
            assert not b.started.is_set()
            ca.__exit__(None, None, None)  # replica a shuts down: it resigns
            assert a.stopped.is_set()
            assert b.started.wait(5)  # no wait for a's TTL
            assert cb.get("/leader").json() == {"leader": True}
            assert b.tokens[0] > a.tokens[0]
        assert b.stopped.is_set()


def test_leader_work_stops_when_leadership_is_lost(server):
    a = Replica(server.address, "a")
    with TestClient(a.app) as ca:
        assert a.started.wait(10)
        server.kill()  # renewals fail: the term ends at its renew deadline (1 s)
        assert a.stopped.wait(5)
        assert ca.get("/leader").json() == {"leader": False}


def test_a_failing_leader_task_resigns(server):
    a, b = Replica(server.address, "a", fail=True), Replica(server.address, "b")
    with TestClient(a.app), TestClient(b.app) as cb:
        assert a.started.wait(10) and a.stopped.wait(5)
        # a resigned and campaigns again behind b: b is elected at once
        assert b.started.wait(5)
        assert cb.get("/leader").json() == {"leader": True}
