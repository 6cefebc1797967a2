"""Leader election against a real server: one leader at a time, failover, frozen leaders, observers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import pytest
from conftest import wait_until

import fastlock
from fastlock._testbase import HistoryChecker

# Small Kubernetes-style durations keep the tests fast.
LEASE, DEADLINE, RETRY = 1.0, 0.7, 0.2
TIMEOUT = 10.0


@pytest.mark.parametrize("n", [2, 5])
async def test_exactly_one_leader_at_a_time(connect, n):
    history = HistoryChecker()
    leading: list[str] = []
    overlap = []
    terms_each = 3

    async def candidate(i: int) -> list[int]:
        cid = f"cand-{i}"
        c = await connect(cid)
        election = c.election("leader", cid, lease_duration=LEASE, renew_deadline=DEADLINE, retry_period=RETRY)
        tokens = []
        for _ in range(terms_each):
            async with election.leadership() as term:
                assert term.is_leader() and term.candidate_id == cid
                history.held("leader", term.fencing_token, time.monotonic())
                leading.append(cid)
                if len(leading) > 1:
                    overlap.append(list(leading))
                assert (await election.leader()) == (cid, term.fencing_token)
                await asyncio.sleep(0.02)  # hold
                assert term.is_leader()
                leading.remove(cid)
                history.released("leader", term.fencing_token, time.monotonic())
                tokens.append(term.fencing_token)
            assert term.lost.is_set() and not term.is_leader()
        return tokens

    results = await asyncio.wait_for(asyncio.gather(*(candidate(i) for i in range(n))), 30)
    assert not overlap
    assert history.check() == n * terms_each
    assert all(r == sorted(r) for r in results)


async def test_observe_reports_every_leader_in_order(connect):
    observer = await connect("observer")
    seen: list = []
    election = observer.election("obs", "observer", lease_duration=LEASE, renew_deadline=DEADLINE,
                                 retry_period=RETRY)
    first_none = asyncio.Event()

    async def observe():
        async for leader in election.observe():
            seen.append(leader)
            if leader is None:
                first_none.set()
            if len([s for s in seen if s is not None]) == 3:
                return

    task = asyncio.ensure_future(observe())
    await asyncio.wait_for(first_none.wait(), TIMEOUT)  # the watch began: nobody leads
    tokens = []
    for i in range(3):
        cid = f"node-{i}"
        c = await connect(cid)
        e = c.election("obs", cid, lease_duration=LEASE, renew_deadline=DEADLINE, retry_period=RETRY)
        async with e.leadership() as term:
            tokens.append(term.fencing_token)
            await wait_until(lambda: seen[-1] is not None, what="observer saw the leader")
    await asyncio.wait_for(task, TIMEOUT)
    leaders = [s for s in seen if s is not None]
    assert leaders == [(f"node-{i}", tokens[i]) for i in range(3)]
    assert seen[0] is None and seen[1:] == [leaders[0], None, leaders[1], None, leaders[2]]


async def test_the_candidate_id_is_named_whatever_the_client_name(connect):
    """docs/client-features.md: the candidate id travels as the term's correlation id, so a
    candidate needs no ``client_name=candidate_id``."""
    observer = await connect("observer")
    view = observer.election("cid", "observer", lease_duration=LEASE, renew_deadline=DEADLINE, retry_period=RETRY)
    events = view.observe()
    assert await asyncio.wait_for(anext(events), TIMEOUT) is None
    candidate = await connect("web-7")  # a client name that is not the candidate id
    election = candidate.election("cid", "node-a", lease_duration=LEASE, renew_deadline=DEADLINE,
                                  retry_period=RETRY)
    async with election.leadership() as term:
        assert await view.leader() == ("node-a", term.fencing_token)
        assert await asyncio.wait_for(anext(events), TIMEOUT) == ("node-a", term.fencing_token)
    await events.aclose()


async def test_leader_steps_down_when_it_cannot_renew_within_the_deadline(client, server):
    election = client.election("sd", "solo", lease_duration=LEASE, renew_deadline=DEADLINE, retry_period=RETRY)
    states: list[str] = []
    async with election.leadership() as term:
        term.health.add_listener(states.append)
        server.pause()
        try:
            await asyncio.wait_for(term.health.jeopardy.wait(), TIMEOUT)
            assert term.is_leader()
            await asyncio.wait_for(term.lost.wait(), TIMEOUT)
            assert not term.is_leader()
            assert term.time_left() <= 0
            # stepped down on its own clock, before the server could expire the lease
            assert time.monotonic() < term.lease.expires_at - (LEASE - DEADLINE) / 2 + 0.05
        finally:
            server.resume()
    assert states == ["in_jeopardy", "lost"]


async def test_leader_jeopardy_then_safe(client, server):
    election = client.election("js", "solo", lease_duration=LEASE, renew_deadline=DEADLINE, retry_period=RETRY)
    async with election.leadership() as term:
        server.pause()
        try:
            await asyncio.wait_for(term.health.jeopardy.wait(), TIMEOUT)
        finally:
            server.resume()
        await asyncio.wait_for(term.health.safe.wait(), TIMEOUT)
        assert term.is_leader() and term.health.state == "safe"
        assert await client.check("js", term.fencing_token)


def test_bad_durations_are_refused():
    client = fastlock.Client(["127.0.0.1:1"])  # never connects
    with pytest.raises(fastlock.InvalidArgument):
        client.election("e", "a", lease_duration=1.0, renew_deadline=1.0)
    with pytest.raises(fastlock.InvalidArgument):
        client.election("e", "a", lease_duration=2.0, renew_deadline=1.0, retry_period=1.0)
    with pytest.raises(fastlock.InvalidArgument):
        client.election("e", "a", lease_duration=-1.0)
    with pytest.raises(fastlock.WrongArgumentType):
        client.election("e", "", lease_duration=1.0, renew_deadline=0.5, retry_period=0.1)


# -- candidates as separate processes ---------------------------------------------------


class Candidate:
    """``python -m fastlock.election`` in a subprocess; its JSON lines are collected."""

    def __init__(self, proc: asyncio.subprocess.Process, cid: str):
        self.proc = proc
        self.cid = cid
        self.events: list[dict] = []
        self.changed = asyncio.Event()
        self.reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, server, cid: str, cwd) -> Candidate:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fastlock.election", "--server", server.address, "--name", "leader",
            "--id", cid, "--lease-duration", str(LEASE), "--renew-deadline", str(DEADLINE),
            "--retry-period", str(RETRY), "--act-every", "0.02",
            stdout=asyncio.subprocess.PIPE, cwd=cwd,
        )
        return cls(proc, cid)

    async def _read(self) -> None:
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                return
            self.events.append(json.loads(line))
            self.changed.set()

    async def wait_event(self, kind: str, timeout: float = TIMEOUT) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for ev in self.events:
                if ev["event"] == kind:
                    return ev
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{self.cid}: no {kind!r} event within {timeout} s: {self.events[-5:]}")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    def first(self, kind: str) -> dict | None:
        return next((ev for ev in self.events if ev["event"] == kind), None)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.kill()
            except ProcessLookupError:
                pass
        await self.proc.wait()
        await self.reader


async def start_candidates(server, tmp_path, n: int) -> list[Candidate]:
    cands = []
    for i in range(n):
        cands.append(await Candidate.start(server, f"p{i}", tmp_path))
    for c in cands:
        await c.wait_event("ready", 20)
    return cands


async def first_leader(cands: list[Candidate], exclude=()) -> tuple[Candidate, dict]:
    async def one(c):
        return c, await c.wait_event("elected")

    tasks = [asyncio.ensure_future(one(c)) for c in cands if c not in exclude]
    try:
        done, _ = await asyncio.wait(tasks, timeout=TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        assert done, "nobody was elected"
        return next(iter(done)).result()
    finally:
        for t in tasks:
            t.cancel()


async def test_killed_leader_is_replaced_once_its_lease_runs_out(client, server, tmp_path):
    """How soon (median about lease_duration): ``python -m benches.election_failover``."""
    cands = await start_candidates(server, tmp_path, 3)
    try:
        old, elected = await first_leader(cands)
        await old.wait_event("act")
        await asyncio.sleep(0.3)  # hold: let it renew at least once
        others = [c for c in cands if c is not old]
        assert all(c.first("elected") is None for c in others)
        killed_at = time.monotonic()
        old.proc.kill()  # SIGKILL: no release, the lease must expire
        new, new_elected = await first_leader(others)
        assert new_elected["t"] > killed_at and new_elected["token"] > elected["token"]
        leader = await client.election("leader", "x", lease_duration=LEASE, renew_deadline=DEADLINE,
                                       retry_period=RETRY).leader()
        assert leader == (new.cid, new_elected["token"])
        assert sum(1 for c in others if c.first("elected")) == 1
    finally:
        for c in cands:
            await c.stop()


async def test_frozen_leader_loses_its_term_and_stops_acting(client, server, tmp_path):
    cands = await start_candidates(server, tmp_path, 2)
    try:
        old, elected = await first_leader(cands)
        await old.wait_event("act")
        other = next(c for c in cands if c is not old)
        os.kill(old.proc.pid, signal.SIGSTOP)  # a long GC pause / VM stall
        paused_at = time.monotonic()
        try:
            new_elected = await other.wait_event("elected")  # after the old lease expired on the server
        finally:
            resumed_at = time.monotonic()
            os.kill(old.proc.pid, signal.SIGCONT)
        assert new_elected["token"] > elected["token"]
        assert new_elected["t"] - paused_at <= LEASE + RETRY
        lost = await old.wait_event("lost")
        assert lost["token"] == elected["token"] and lost["t"] >= resumed_at
        # The old leader did not act once it was resumed: every 'act' of its
        # term was emitted before it was frozen.
        acts = [ev["t"] for ev in old.events if ev["event"] == "act" and ev["token"] == elected["token"]]
        assert acts and max(acts) < paused_at
        assert (await client.holder("leader"))["token"] == new_elected["token"]
    finally:
        for c in cands:
            await c.stop()
