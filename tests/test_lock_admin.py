"""The operator's lock requests against real servers: ``locks``, ``lock``, ``revoke``
(issue 14's stuck-lock story), who may run them, and the REVOKE record in the WAL
(recovery and the standby apply it)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

import fastlock
from fastlock import LeaseLost, LockNotHeld, PermissionDenied
from fastlock._testbase import CredentialsDir, ServerProcess
from fastlock.wal.records import Revoke, decode, encode

TIMEOUT = 30.0

HOLDER_SCRIPT = """
import asyncio, sys, fastlock
async def main():
    client = await fastlock.connect(sys.argv[1], client_name="crashy-job")
    lease = await client.acquire("a2", ttl=3600.0, correlation_id="job-17")
    print(lease.fencing_token, flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def fastlock_cli(*args: str, server: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "fastlock", *args, "--server", server] if server else
                          [sys.executable, "-m", "fastlock", *args],
                          capture_output=True, text=True, timeout=TIMEOUT, env=full)


def test_a_crashed_holder_is_listed_revoked_and_audited(server, tmp_path):
    """The issue's story: a job takes "a2" for an hour and dies; `fastlock locks` shows it,
    `fastlock revoke a2 --reason "crashed job"` frees it, the next acquirer gets a higher token,
    and `fastlock wal dump` shows who revoked it and why."""
    child = subprocess.Popen([sys.executable, "-c", HOLDER_SCRIPT, server.address], stdout=subprocess.PIPE,
                             text=True)
    try:
        old_token = int(child.stdout.readline())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(TIMEOUT)

    listed = fastlock_cli("locks", server=server.address)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()[:2]
    assert header.split()[:3] == ["NAME", "TOKEN", "HOLDER"]
    assert row.split()[:4] == ["a2", str(old_token), "anonymous:crashy-job", "job-17"]
    as_json = json.loads(fastlock_cli("locks", "a", "-o", "json", server=server.address).stdout)
    (lease,) = as_json["locks"]
    assert (lease["name"], lease["fencing_token"], lease["waiters"]) == ("a2", old_token, 0)
    assert 3000 < lease["remaining"] <= 3600.0
    assert json.loads(fastlock_cli("locks", "b", "-o", "json", server=server.address).stdout)["locks"] == []

    revoked = fastlock_cli("revoke", "a2", "--reason", "crashed job", server=server.address)
    assert revoked.returncode == 0, revoked.stderr
    assert f"revoked a2 token {old_token}" in revoked.stdout

    async def next_acquirer() -> int:
        async with fastlock.connect(server.address) as client:
            lease = await client.acquire("a2", ttl=5.0, wait=0)
            return lease.fencing_token

    assert asyncio.run(next_acquirer()) > old_token
    again = fastlock_cli("revoke", "a2", "--token", str(old_token), server=server.address)
    assert again.returncode == 1 and "LockNotHeld" in again.stderr and "Traceback" not in again.stderr

    server.stop()
    dump = fastlock_cli("wal", "dump", "--lock", "a2", str(server.data_dir), server="")
    lines = [line for line in dump.stdout.splitlines() if " revoke " in line]
    assert len(lines) == 1, dump.stdout
    assert f"token={old_token} " in lines[0] and 'by=anonymous reason="crashed job"' in lines[0]


async def test_revocation_fences_a_live_holder_and_tells_watchers(server, connect):
    holder = await connect("holder")
    waiter = await connect("waiter")
    admin = await connect("operator")
    lease = await holder.acquire("jobs/7", ttl=60.0)
    events = admin.watch("jobs/7")
    assert (await anext(events)).kind == "held"
    queued = asyncio.ensure_future(waiter.acquire("jobs/7", ttl=5.0, wait=20.0, correlation_id="w-1"))
    info = await _poll(lambda: admin.lock_info("jobs/7"), lambda i: i.waiter_count == 1)
    (w,) = info.waiters
    assert (w.client, w.correlation_id, w.principal) == ("waiter", "w-1", "anonymous")
    assert 0 <= w.waiting < 20.0 and 0 < w.wait_remaining <= 20.0
    assert [h.fencing_token for h in info.holders] == [lease.fencing_token]

    revoked = await admin.revoke("jobs/7", fencing_token=lease.fencing_token, reason="stuck")
    assert [r.fencing_token for r in revoked] == [lease.fencing_token]
    event = await asyncio.wait_for(anext(events), TIMEOUT)
    assert (event.kind, event.token, event.client) == ("revoked", lease.fencing_token, "holder")
    granted = await asyncio.wait_for(queued, TIMEOUT)
    assert granted.fencing_token > lease.fencing_token
    with pytest.raises(LeaseLost):
        await holder.extend(lease)
    assert not await admin.check("jobs/7", lease.fencing_token)
    with pytest.raises(LockNotHeld, match=r"^'free/lock' has no holder$"):
        await admin.revoke("free/lock")
    with pytest.raises(LockNotHeld, match=r"^'jobs/7' has no lease with token 5$"):
        await admin.revoke("jobs/7", fencing_token=5)
    await events.aclose()


async def test_lock_info_orders_waiters_and_marks_endless_waits(server, connect):
    admin = await connect("operator")
    await (await connect("h")).acquire("q", ttl=30.0)
    first, second = await connect("first"), await connect("second")
    t1 = asyncio.ensure_future(first.acquire("q", ttl=5.0, wait=None))
    await _poll(lambda: admin.lock_info("q"), lambda i: i.waiter_count == 1)
    t2 = asyncio.ensure_future(second.acquire("q", ttl=5.0, wait=15.0))
    info = await _poll(lambda: admin.lock_info("q"), lambda i: i.waiter_count == 2)
    assert [w.client for w in info.waiters] == ["first", "second"]
    assert info.waiters[0].wait_remaining is None and info.waiters[1].wait_remaining is not None
    assert info.waiters[0].since <= info.waiters[1].since
    for t in (t1, t2):
        t.cancel()


def test_only_admins_may_list_or_revoke_when_the_server_has_credentials(tmp_path):
    creds = CredentialsDir(tmp_path / "credentials")
    srv = ServerProcess(tmp_path / "data", args=creds.server_args("node-1")).start()
    try:
        async def scenario() -> None:
            async with fastlock.connect(srv.address, token=creds.token("app")) as app, \
                    fastlock.connect(srv.address) as anonymous, \
                    fastlock.connect(srv.address, token=creds.token("admin")) as admin:
                lease = await app.acquire("x", ttl=30.0)
                for who in (app, anonymous):
                    with pytest.raises(PermissionDenied):
                        await who.locks()
                    with pytest.raises(PermissionDenied):
                        await who.lock_info("x")
                    with pytest.raises(PermissionDenied):
                        await who.revoke("x", fencing_token=lease.fencing_token)
                assert await app.check("x", lease.fencing_token)  # nothing changed
                assert [h.principal for h in (await admin.locks()).locks] == ["app"]
                await admin.revoke("x")
                assert not await app.check("x", lease.fencing_token)

        asyncio.run(scenario())
        refused = fastlock_cli("locks", server=srv.address)
        assert refused.returncode == 1 and "needs an admin principal" in refused.stderr
        refused = fastlock_cli("revoke", "x", server=srv.address, env={"FASTLOCK_TOKEN_FILE": creds.token_file("app")})
        assert refused.returncode == 1, refused.stderr
        assert "revoke needs an admin principal; 'app' is a client" in refused.stderr, refused.stderr
        assert "lock_info" not in refused.stderr
        ok = fastlock_cli("locks", server=srv.address, env={"FASTLOCK_TOKEN_FILE": creds.token_file("admin")})
        assert ok.returncode == 0 and ok.stdout.startswith("NAME"), ok.stderr
    finally:
        srv.stop()


def test_a_revocation_survives_a_restart(server):
    async def take_and_revoke() -> int:
        async with fastlock.connect(server.address) as client:
            lease = await client.acquire("r", ttl=3600.0)
            await client.revoke("r", reason="test")
            return lease.fencing_token

    token = asyncio.run(take_and_revoke())
    server.stop()
    restarted = ServerProcess(server.data_dir, port=server.port).start()
    try:
        async def after() -> tuple[bool, int]:
            async with fastlock.connect(restarted.address) as client:
                held = await client.holder("r")
                lease = await client.acquire("r", ttl=5.0, wait=0)
                return held is None, lease.fencing_token

        free, new_token = asyncio.run(after())
    finally:
        restarted.stop()
    assert free and new_token > token


def test_revoke_record_round_trips():
    rec = Revoke("n", 7, "admin", "why", 123)
    assert decode(encode(rec)) == rec and encode(rec)[0] == 10


async def _poll(fetch, pred, timeout: float = TIMEOUT):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        value = await fetch()
        if pred(value):
            return value
        if loop.time() > end:
            raise AssertionError(f"condition not reached: {value!r}")
        await asyncio.sleep(0.02)


def test_the_cli_lists_one_lock_as_a_table(server):
    async def hold() -> None:
        async with fastlock.connect(server.address, client_name="tab") as client:
            await client.acquire("t", ttl=60.0)  # closing the client leaves the lease held

    asyncio.run(hold())
    out = fastlock_cli("lock", "t", server=server.address)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].split()[:2] == ["HOLDER", "TOKEN"]
    assert "anonymous:tab" in out.stdout and "no waiters" in out.stdout


def test_a_revocation_reaches_the_standby_and_its_log(cluster):
    """The REVOKE record travels the replication stream; the standby applies it with the one
    ``apply`` (the lease is gone from its table) and keeps it in its own WAL for the audit."""
    from fastlock._testbase.cluster import RawNode, poll, run, status_of

    p = cluster.primary()
    s = cluster.standby(p.address)

    async def main() -> int:
        a = await RawNode.open(p.address)
        try:
            token, _, _ = await a.acquire("gone", 60_000)
            await a.acquire("kept", 60_000)
            await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 2, timeout=TIMEOUT,
                       what="both grants on the standby")
        finally:
            await a.close()
        async with fastlock.connect(p.address, token=cluster.creds.token("admin")) as admin:
            await admin.revoke("gone", reason="replicated")
        await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 1, timeout=TIMEOUT,
                   what="the revocation on the standby")
        return token

    token = run(main())
    s.stop()
    dump = fastlock_cli("wal", "dump", "--lock", "gone", str(s.data_dir), server="")
    assert any(" revoke " in line and f"token={token} " in line and 'reason="replicated"' in line
               for line in dump.stdout.splitlines()), dump.stdout


async def test_a_try_acquire_of_a_lock_this_connection_holds_says_so(server, connect):
    client = await connect("self")
    lease = await client.acquire("mine", ttl=30.0)
    expected = f"held by this same connection \\(token {lease.fencing_token}\\)"
    with pytest.raises(fastlock.LockNotAcquired, match=expected):
        await client.acquire("mine", ttl=30.0, wait=0)
    other = await connect("other")
    with pytest.raises(fastlock.LockNotAcquired) as refused:
        await other.acquire("mine", ttl=30.0, wait=0)
    assert "same connection" not in str(refused.value)


async def test_locks_pages_by_name_and_ranks_by_waiters_on_the_server(server, connect, monkeypatch, capsys):
    holder = await connect("holder")
    waiter = await connect("waiter")
    admin = await connect("operator")
    names = [f"page/{i:02d}" for i in range(25)]
    for name in names:
        await holder.acquire(name, ttl=60.0)
    queued = [asyncio.ensure_future(waiter.acquire("page/17", ttl=5.0, wait=20.0)) for _ in range(2)]
    queued.append(asyncio.ensure_future(waiter.acquire("page/03", ttl=5.0, wait=20.0)))
    await _poll(lambda: admin.status(), lambda st: st["waiters"] == 3)
    seen, page = [], await admin.locks("page/", most=10)
    assert (page.matched, page.truncated, page.next) == (25, True, "page/09")
    seen += [h.name for h in page.locks]
    while page.truncated:
        page = await admin.locks("page/", most=10, after=page.next)
        seen += [h.name for h in page.locks]
    assert seen == names and page.next is None and page.matched == 5
    ranked = await admin.locks(most=3, order="contended")
    assert [(h.name, h.waiters) for h in ranked.locks] == [("page/17", 2), ("page/03", 1), ("page/00", 0)]
    assert ranked.truncated and ranked.next is None
    with pytest.raises(fastlock.InvalidArgument):
        await admin.locks(after="page/01", order="contended")
    from fastlock.cli import locks as cli_locks
    from fastlock.cli import main as cli_main

    monkeypatch.setattr(cli_locks, "PAGE", 7)  # the command pages through: 4 requests
    capsys.readouterr()
    assert await asyncio.to_thread(cli_main, ["locks", "page/", "-o", "json", "--server", server.address]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in listed["locks"]] == names and listed["matched"] == 25
    for task in queued:
        task.cancel()


def test_the_open_mode_warning_says_what_anonymous_clients_may_do(server):
    """In open mode the anonymous principal may list and revoke leases: the warning says so, and
    names what is refused (not "admin operations", which locks and revoke are)."""
    line = server.wait_for_log(r"open mode \(no --credentials\)")
    assert "list or revoke anyone's lease (fastlock locks, lock, revoke)" in line, line
    assert "replication, promote and serve-alone are refused" in line and "admin operations" not in line, line
    assert fastlock_cli("locks", server=server.address).returncode == 0
    promote = fastlock_cli("promote", "--force", server=server.address)
    assert promote.returncode != 0 and "promote needs an admin principal" in promote.stderr, promote.stderr


async def test_a_revoked_holder_hears_who_revoked_its_lease_and_why(server, connect):
    holder = await connect("holder")
    admin = await connect("operator")
    lease = await holder.acquire("jobs/8", ttl=60.0)
    await admin.revoke("jobs/8", fencing_token=lease.fencing_token, reason="stuck since Monday")
    expected = rf"^'jobs/8': token {lease.fencing_token} was revoked by anonymous: stuck since Monday$"
    with pytest.raises(LeaseLost, match=expected):
        await holder.extend(lease)
    with pytest.raises(LeaseLost, match=expected):
        await holder.release(lease)
    with pytest.raises(LeaseLost, match=r"was revoked by anonymous: stuck since Monday; key 'k' not put$"):
        await holder.put("k", b"v", lease=lease)
    second = await holder.acquire("jobs/8", ttl=60.0)
    await admin.revoke("jobs/8")  # no reason given
    with pytest.raises(LeaseLost, match=r"was revoked by anonymous \(no reason given\)$"):
        await holder.release(second)
    released = await holder.acquire("jobs/8", ttl=60.0)
    await holder.release(released)
    with pytest.raises(LeaseLost, match=r"is not the current holder \(expired, released or never held\)$"):
        await holder.release(released)


def test_recent_revocations_are_bounded_oldest_first():
    from fastlock.server.lockadmin import RecentRevocations, Revocation

    kept = RecentRevocations(limit=3)
    for token in range(1, 6):
        kept.add("k", token, "ops", f"r{token}")
    assert len(kept) == 3
    assert kept.get("k", 1) is None and kept.get("k", 2) is None
    assert kept.get("k", 5) == Revocation("ops", "r5") and kept.get("other", 5) is None
