"""The blocking client (fastlock.sync) against a real server process, from many threads."""

from __future__ import annotations

import socket
import threading
import time

import pytest

import fastlock
from fastlock._testbase import HistoryChecker
from fastlock.sync import SyncClient, SyncLease

TIMEOUT = 10.0


@pytest.fixture
def sync_client(server):
    with SyncClient(server.address, client_name="sync") as c:
        yield c


def test_16_threads_keep_mutual_exclusion(server):
    clients = [SyncClient(server.address, client_name=f"s{i}") for i in range(2)]  # 8 threads share each
    history = HistoryChecker()
    guard = threading.Lock()  # protects the checker's bookkeeping, not the critical section
    inside = 0
    max_inside = 0
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        nonlocal inside, max_inside
        client = clients[i % 2]
        try:
            for _ in range(10):
                with client.lock("shared", ttl=5.0, wait=TIMEOUT * 3) as lease:
                    with guard:
                        inside += 1
                        max_inside = max(max_inside, inside)
                        history.held("shared", lease.fencing_token, time.monotonic())
                    time.sleep(0.001)  # hold
                    with guard:
                        inside -= 1
                        history.released("shared", lease.fencing_token, time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - reported below, in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a thread is stuck"
    finally:
        for c in clients:
            c.close()
    assert not errors, errors
    assert max_inside == 1
    assert history.check() == 160


def test_lock_renews_in_the_background_while_the_thread_blocks(sync_client, server):
    with SyncClient(server.address, client_name="other") as other:
        with sync_client.lock("renew", ttl=0.3) as lease:
            assert isinstance(lease, SyncLease)
            time.sleep(1.0)  # a blocking call of > 3 TTLs
            assert not lease.lost.is_set()
            assert lease.health_state == "safe"
            assert other.check("renew", lease.fencing_token)
            with pytest.raises(fastlock.LockNotAcquired):
                other.acquire("renew", ttl=1.0, wait=0)
        assert not other.check("renew", lease.fencing_token)


def test_lost_is_a_threading_event(sync_client, server):
    lease = sync_client.lock("lost", ttl=0.5).acquire()
    server.pause()
    try:
        assert lease.lost.wait(TIMEOUT)
        assert lease.health_state == "lost" and lease.time_left() <= 0
    finally:
        server.resume()
    with pytest.raises(fastlock.LeaseLost):
        sync_client.release(lease)


def test_acquire_extend_release_and_errors(sync_client):
    lease = sync_client.acquire("plain", ttl=1.0)
    assert sync_client.check("plain", lease.fencing_token)
    assert sync_client.extend(lease, ttl=3.0).ttl == 3.0
    assert sync_client.holder("plain")["token"] == lease.fencing_token
    with pytest.raises(fastlock.AlreadyHeld):  # not re-entrant: the same thread is told at once
        sync_client.acquire("plain", ttl=1.0, wait=0.2)
    t0 = time.monotonic()
    with pytest.raises(fastlock.LockNotAcquired):
        sync_client.acquire("plain", ttl=1.0, wait=0.2, queue_behind_self=True)  # queues, then times out
    assert time.monotonic() - t0 >= 0.19
    sync_client.release(lease)
    with pytest.raises(fastlock.LeaseLost):
        sync_client.release(lease)
    assert lease.lost.is_set()
    with pytest.raises(fastlock.InvalidArgument):
        sync_client.acquire("", ttl=1.0)
    assert sync_client.status()["waiters"] == 0
    assert sync_client.ping() >= 0


def test_lock_many_and_watch(sync_client, server):
    events = sync_client.watch("w1", timeout=TIMEOUT)
    assert next(events).kind == "free"
    with sync_client.lock_many(["w2", "w1"], ttl=2.0) as multi:
        assert multi.names == ("w1", "w2")
        granted = next(events)
        assert (granted.kind, granted.token) == ("granted", multi["w1"].fencing_token)
    released = next(events)
    assert (released.kind, released.token) == ("released", multi["w1"].fencing_token)
    events.close()  # unsubscribes
    assert sync_client.holder("w2") is None


def test_election_from_threads(server):
    with SyncClient(server.address, client_name="a") as a, SyncClient(server.address, client_name="b") as b:
        ea = a.election("sync-leader", "a", lease_duration=1.0, renew_deadline=0.7, retry_period=0.2)
        eb = b.election("sync-leader", "b", lease_duration=1.0, renew_deadline=0.7, retry_period=0.2)
        with ea.leadership() as term:
            assert term.is_leader()
            assert eb.leader() == ("a", term.fencing_token)
            with pytest.raises(fastlock.LockNotAcquired):
                eb.campaign(wait=0.1)
        assert term.lost.is_set() and not term.is_leader()
        with eb.leadership(wait=TIMEOUT) as term_b:
            assert term_b.fencing_token > term.fencing_token


def test_close_stops_the_thread_and_refuses_calls(server):
    client = SyncClient(server.address)
    thread = client._thread
    client.close()
    client.close()  # idempotent
    assert not thread.is_alive()
    with pytest.raises(fastlock.ConnectionLost):
        client.status()


def test_connect_failure_raises_and_leaves_no_thread():
    before = threading.active_count()
    with socket.socket() as unused:  # bound, never listening: connections are refused
        unused.bind(("127.0.0.1", 0))
        with pytest.raises(fastlock.ConnectionLost):
            SyncClient(f"127.0.0.1:{unused.getsockname()[1]}", connect_timeout=1.0)
    assert threading.active_count() == before


def test_close_wakes_every_thread_blocked_in_a_call(server):
    """close() fails what is pending at once and lets it reach the blocked
    threads before stopping its loop (it used to strand some of them)."""
    with SyncClient(server.address, client_name="observer") as observer:
        held = observer.acquire("busy", ttl=30.0)

        def close_during_calls() -> None:
            """One client closed while its calls block in threads."""
            client = SyncClient(server.address, client_name="closing")
            outcomes: list[str] = []
            guard = threading.Lock()

            def record(fn) -> None:
                try:
                    fn()
                    outcome = "returned"
                except BaseException as exc:  # noqa: BLE001 - every outcome is recorded and checked below
                    outcome = type(exc).__name__
                with guard:
                    outcomes.append(outcome)

            def watch() -> None:
                for _event in client.watch("busy"):
                    pass

            election = client.election("busy", "candidate", retry_period=0.05)
            targets = [lambda: client.acquire("busy", ttl=5.0, wait=None) for _ in range(6)]
            targets += [watch, lambda: election.campaign(wait=None)]
            threads = [threading.Thread(target=record, args=(fn,), daemon=True) for fn in targets]
            for t in threads:
                t.start()
            deadline = time.monotonic() + TIMEOUT
            while observer.status()["waiters"] < 7:  # 6 acquires + the campaign, queued on the server
                assert time.monotonic() < deadline, "the acquires did not queue"
                time.sleep(0.01)
            client.close()
            for t in threads:
                t.join(TIMEOUT)
            assert not any(t.is_alive() for t in threads), f"threads still blocked after close(): {outcomes}"
            assert outcomes == ["ConnectionLost"] * len(targets)
            # and everything after close() refuses at once (wait=None: a call that waited would never
            # return, and the test's timeout would fail it)
            for call in (lambda: client.acquire("other", ttl=1.0, wait=None), client.ping,
                         lambda: client.lock("other", ttl=1.0).acquire(),
                         lambda: next(client.watch("other")), lambda: election.campaign(wait=None)):
                with pytest.raises(fastlock.ConnectionLost):
                    call()
            deadline = time.monotonic() + TIMEOUT
            while observer.status()["waiters"] != 0:  # the server dropped the closed connection's waiters
                assert time.monotonic() < deadline, "waiters of the closed client remain"
                time.sleep(0.01)

        for _ in range(5):  # the race was timing-dependent: close at several points
            close_during_calls()
        observer.release(held)


def _run_in_fork(child, timeout: float) -> dict:
    """Fork; run ``child()`` (returns a JSON-able dict) in the child and return
    what it returned.  The child is bounded by ``timeout`` seconds and killed
    by its PID if it has not exited by then."""
    import json
    import os
    import select
    import signal

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            try:
                result = child()
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                result = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(write_end, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        data = b""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([read_end], [], [], left)
            if not ready:
                break
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            data += chunk
        assert data, f"the forked child sent nothing within {timeout} s (a hang)"
        return json.loads(data)
    finally:
        os.close(read_end)
        try:
            os.kill(pid, signal.SIGKILL)  # it has normally exited already
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)


def test_a_forked_child_reconnects_and_takes_a_lock_within_its_wait(server):
    """A SyncClient made before fork() (a preloaded app, a prefork pool): the child
    opens its own connection at its first call and takes a lock within its wait;
    the lease the parent holds stays the parent's - the child cannot release it."""
    with SyncClient(server.address, client_name="parent") as client:
        with client.lock("fork/parent", ttl=2.0, wait=TIMEOUT) as parent_lease:
            wait = 2.0

            def child() -> dict:
                started = time.monotonic()
                lease = client.acquire("fork/child", ttl=5.0, wait=wait)
                took = time.monotonic() - started
                client.release(lease)
                try:
                    client.release(parent_lease)  # inherited: not the child's
                    refused = None
                except fastlock.LeaseLost as exc:
                    refused = str(exc)
                try:
                    client.acquire("fork/parent", ttl=1.0, wait=0)  # still held by the parent
                    taken = True
                except fastlock.LockNotAcquired:
                    taken = False
                return {"took": took, "token": lease.fencing_token, "refused": refused, "taken": taken,
                        "lost_in_child": parent_lease.lost.is_set()}

            result = _run_in_fork(child, timeout=wait + 8.0)
            assert "error" not in result, result
            assert result["token"] > 0  # within the child's bound (_run_in_fork's timeout): never hangs
            assert result["refused"] and "does not hold it" in result["refused"]
            assert result["taken"] is False and result["lost_in_child"] is True
            # the parent still holds its lease, and its client still works
            assert client.check("fork/parent", parent_lease.fencing_token)
            assert not parent_lease.lost.is_set()
            assert client.ping() > 0


def test_a_fork_while_other_threads_are_in_calls(server):
    """fork() while one parent thread waits in a queued acquire and another sends pings in a
    loop (the client's thread locks and in-flight calls are mid-use at the fork): each child
    takes a free lock within its wait, finds the contested one held, and cannot release the
    parent's lease; the parent's waiting call then completes as usual."""
    with SyncClient(server.address, client_name="blocker") as other, \
            SyncClient(server.address, client_name="parent") as client:
        contested = other.acquire("fork/contested", ttl=30.0)
        held = client.acquire("fork/held", ttl=30.0)
        waited: list[SyncLease] = []
        waiter = threading.Thread(target=lambda: waited.append(
            client.acquire("fork/contested", ttl=5.0, wait=TIMEOUT)))
        waiter.start()
        deadline = time.monotonic() + TIMEOUT
        while other.lock_info("fork/contested").waiter_count == 0:
            assert time.monotonic() < deadline, "the parent's waiter never queued"
            time.sleep(0.01)
        stop = threading.Event()
        pinger = threading.Thread(target=lambda: [client.ping() for _ in iter(stop.is_set, True)])
        pinger.start()
        try:
            for i in range(4):
                def child(i=i) -> dict:
                    started = time.monotonic()
                    lease = client.acquire(f"fork/child-{i}", ttl=5.0, wait=2.0)
                    took = time.monotonic() - started
                    client.release(lease)
                    try:
                        client.acquire("fork/contested", ttl=1.0, wait=0)
                        contested_taken = True
                    except fastlock.LockNotAcquired:
                        contested_taken = False
                    try:
                        client.release(held)
                        released_parents = True
                    except fastlock.LeaseLost:
                        released_parents = False
                    client.close()
                    return {"took": took, "contested_taken": contested_taken, "released_parents": released_parents}

                result = _run_in_fork(child, timeout=10.0)
                assert result == {"took": result.get("took"), "contested_taken": False,
                                  "released_parents": False}, result
        finally:
            stop.set()
            pinger.join(TIMEOUT)
        assert client.check("fork/held", held.fencing_token)
        other.release(contested)
        waiter.join(TIMEOUT)
        assert len(waited) == 1 and waited[0].fencing_token > contested.fencing_token
        client.release(waited[0])
        client.release(held)


def test_a_forked_child_of_a_closed_client_raises_at_once(server):
    client = SyncClient(server.address, client_name="closed-parent")
    client.close()

    def child() -> dict:
        started = time.monotonic()
        try:
            client.acquire("fork/closed", ttl=1.0, wait=None)  # refused at once, or never returns
        except fastlock.ConnectionLost as exc:
            return {"raised": str(exc), "took": time.monotonic() - started}
        return {"raised": None}

    result = _run_in_fork(child, timeout=10.0)
    assert result.get("raised") == "client is closed", result


def _threads(*targets) -> None:
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()


def test_two_threads_of_one_client_in_a_cycle_are_broken(server_factory):
    # deadlock detection tells the threads of one blocking client apart (each its own party)
    srv = server_factory("sync-dl", args=["--deadlock-timeout", "0.2"])
    both_hold = threading.Barrier(2, timeout=TIMEOUT)
    outcomes = []
    with SyncClient(srv.address, client_name="threads") as client:

        def worker(mine, other):
            first = client.acquire(mine, ttl=TIMEOUT)
            both_hold.wait()
            try:
                lease = client.acquire(other, ttl=TIMEOUT, wait=TIMEOUT)
            except fastlock.DeadlockDetected:
                outcomes.append("failed")
            else:
                outcomes.append("granted")
                client.release(lease)
            client.release(first)

        _threads(lambda: worker("m", "n"), lambda: worker("n", "m"))
    assert sorted(outcomes) == ["failed", "granted"]


def test_threads_of_one_client_queued_behind_another_client_are_no_deadlock(server_factory):
    srv = server_factory("sync-queue", args=["--deadlock-timeout", "0.2"])
    granted = []
    with SyncClient(srv.address, client_name="holder") as a, SyncClient(srv.address, client_name="two") as b:
        held = a.acquire("q", ttl=TIMEOUT)

        def waiter():
            lease = b.acquire("q", ttl=TIMEOUT, wait=TIMEOUT)
            granted.append(time.monotonic())
            b.release(lease)

        threads = [threading.Thread(target=waiter) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + TIMEOUT
        while len(a.contenders("q")["waiters"]) < 2:  # both queued (bounded poll)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        queued = time.monotonic()
        threads[0].join(0.6)  # longer than detection's worst case (1.5 x 0.2 s): nobody is failed
        assert granted == [] and all(t.is_alive() for t in threads)
        a.release(held)
        for t in threads:
            t.join(TIMEOUT)
            assert not t.is_alive()
    assert len(granted) == 2 and min(granted) > queued
