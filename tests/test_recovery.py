"""Recovery semantics of a real server process (tokens never go backwards; nothing acknowledged is lost).

Each test runs ``fastlock serve`` as a subprocess, stops it cleanly (SIGTERM) or
crashes it (SIGKILL), restarts it on the same data dir and port, and checks
what a client sees: held leases kept with the same token and a fresh full TTL,
holders able to extend and release with their lease, waiters gone, the
counter resuming above.  Also: a torn tail is cut and logged, mid-log
corruption stops the server with a message naming the segment and offset,
snapshots compact the log and survive restarts, and ``fastlock wal dump``
prints an audit trail.  The WAL's own unit tests (``test_wal.py``) cover the
file format in-process; these go through the daemon, its CLI and its logs.
"""

from __future__ import annotations

import asyncio
import glob
import os
import random
import re
import subprocess
import sys

import pytest
from conftest import wait_until

import fastlock
from fastlock._testbase import ServerProcess
from fastlock.errors import ConnectionLost, LeaseLost
from fastlock.tokens import epoch_of

#: the subject is the server process: the test loop only drives a client (see conftest.py)
pytestmark = pytest.mark.one_loop

COUNTER_MASK = (1 << 40) - 1
_RECOVERED = re.compile(r"recovered (\d+) leases, epoch (\d+), counter (\d+) \((\d+) records replayed, "
                        r"(\d+) torn bytes cut\)")


# -- helpers ----------------------------------------------------------------------------------
@pytest.fixture
def servers():
    """ServerProcess objects made by the test; every one is stopped afterwards."""
    made: list[ServerProcess] = []

    def make(data_dir, **kw) -> ServerProcess:
        srv = ServerProcess(data_dir, **kw)
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.stop()


async def start(srv: ServerProcess) -> ServerProcess:
    # in a thread, so that this loop keeps running (clients see their connection drop)
    return await asyncio.to_thread(srv.start)


async def down(srv: ServerProcess, how: str) -> None:
    if how == "kill":
        await asyncio.to_thread(srv.kill)
    else:
        assert await asyncio.to_thread(srv.stop) == 0


async def retry_after_restart(call):
    """Run ``call()``; if the client had not yet noticed its old connection died, the
    first request fails with ConnectionLost and the second one reconnects."""
    try:
        return await call()
    except ConnectionLost:
        return await call()


def recovered_line(srv: ServerProcess) -> tuple[int, int, int, int, int]:
    """(leases, epoch, counter, records replayed, torn bytes) from the server's recovery log line."""
    m = _RECOVERED.search(srv.wait_for_log(_RECOVERED, 5))
    return tuple(int(g) for g in m.groups())  # type: ignore[return-value]


def segments(data_dir) -> list[str]:
    return sorted(glob.glob(os.path.join(str(data_dir), "wal-*.log")))


def snapshots(data_dir) -> list[str]:
    return sorted(glob.glob(os.path.join(str(data_dir), "snap-*.snap")))


def count_lines(srv: ServerProcess, pattern: str) -> int:
    rx = re.compile(pattern)
    return sum(1 for line in list(srv.lines) if rx.search(line))


async def pairs_until(client, name: str, pairs: int, done, what: str, timeout: float = 30.0) -> int:
    """``pairs`` acquire+release pairs of ``name`` by ``client``, then one more pair at each look
    until ``done()`` is true (failing, with ``what`` named, after ``timeout`` seconds); the
    highest fencing token granted.

    A snapshot due while another one is still being written starts at the first record logged
    after that one is done: the records that make the snapshots a test waits for may be needed
    later than a fixed count of them would be logged.
    """
    top = 0

    async def pair() -> None:
        nonlocal top
        lease = await client.acquire(name, ttl=60.0)
        top = max(top, lease.fencing_token)
        await client.release(lease)

    for _ in range(pairs):
        await pair()

    async def met() -> bool:
        if done():
            return True
        await pair()
        return False

    await wait_until(met, timeout, what)
    return top


async def queued(client, n: int) -> bool:
    return (await client.status())["waiters"] == n


# -- a held lease across a restart --------------------------------------------------------------
@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_held_lease_survives_restart_with_fresh_ttl(tmp_path, servers, loop_errors, how):
    ttl = 4.0
    srv = await start(servers(tmp_path / "data"))
    holder = await fastlock.connect(srv.address, client_name="holder")
    waiter = await fastlock.connect(srv.address, client_name="waiter")
    try:
        tokens = []
        for i in range(5):  # move the counter along
            lease = await holder.acquire(f"rec/other-{i}", ttl=ttl)
            tokens.append(lease.fencing_token)
            await holder.release(lease)
        lease = await holder.acquire("rec/held", ttl=ttl, correlation_id="req-held")
        tokens.append(lease.fencing_token)
        queued_acquire = asyncio.ensure_future(waiter.acquire("rec/held", ttl=ttl, wait=None))
        await wait_until(lambda: queued(holder, 1), 5, "the waiter to queue")
        # let the lease age, so that a fresh TTL after recovery is visible
        await wait_until(lambda: _remaining_below(holder, "rec/held", (ttl - 1.5) * 1000), 5,
                         "the lease to age by 1.5 s")
        before = (await holder.holder("rec/held"))["remaining_ms"]

        await down(srv, how)
        # waiting goes by connection: the waiter's place is gone with the server, and its
        # acquire (wait=None: no deadline) rides through, looking for a primary
        assert not queued_acquire.done()
        await start(srv)  # same data dir, same port
        leases, _epoch, counter, _replayed, torn = recovered_line(srv)
        assert leases == 1 and torn == 0
        assert counter >= max(tokens) & COUNTER_MASK

        async with fastlock.connect(srv.address, client_name="observer") as obs:
            info = await obs.holder("rec/held")
            uptime_ms = (await obs.status())["uptime_ms"]  # the server started before it recovered
            # same lease (same token), fresh full TTL measured from recovery
            assert info is not None and info["token"] == lease.fencing_token and info["client"] == "holder"
            assert info["ttl_ms"] == ttl * 1000
            assert ttl * 1000 - uptime_ms - 2 <= info["remaining_ms"] <= ttl * 1000
            assert info["remaining_ms"] > before  # not what was left before the restart
            assert await obs.check("rec/held", lease.fencing_token)
            st = await obs.status()
            assert st["locks_held"] == 1
            # waiters are not durable (recovery restored leases only): the one queued now is
            # the waiter's retry, with the same owner key, on its new connection
            await wait_until(lambda: queued(obs, 1), 10, "the waiter to queue again")
            assert st["counter"] >= max(tokens) & COUNTER_MASK
            # the counter resumes above every token handed out before
            fresh = await obs.acquire("rec/fresh", ttl=ttl, wait=0)
            assert fresh.fencing_token > max(tokens)
            await obs.release(fresh)

            # the holder (its old client reconnects) extends and releases with its lease
            extended = await retry_after_restart(lambda: holder.extend(lease, ttl=ttl + 1))
            assert extended.fencing_token == lease.fencing_token
            assert (await obs.holder("rec/held"))["ttl_ms"] == (ttl + 1) * 1000
            await holder.release(extended)
            assert not await obs.check("rec/held", lease.fencing_token)
            with pytest.raises(LeaseLost):
                await holder.release(extended)
            # the waiter that rode through the restart is granted next
            handed = await asyncio.wait_for(queued_acquire, 5)
            assert handed.fencing_token > fresh.fencing_token
            await waiter.release(handed)
            # the lock is free now; the next grant's token is above everything before
            again = await obs.acquire("rec/held", ttl=ttl, wait=0)
            assert again.fencing_token > fresh.fencing_token
            await obs.release(again)
    finally:
        await holder.close()
        await waiter.close()


async def _remaining_below(client, name: str, ms: float) -> bool:
    info = await client.holder(name)
    assert info is not None, f"{name} lost before the restart"
    return info["remaining_ms"] < ms


async def test_release_of_recovered_lease_from_a_new_connection(tmp_path, servers, loop_errors):
    """Ownership goes by lease: after a crash, any connection presenting the lease may use it."""
    srv = await start(servers(tmp_path / "data"))
    async with fastlock.connect(srv.address, client_name="a") as a:
        leases = [await a.acquire(f"rec/n{i}", ttl=30.0) for i in range(20)]
        await down(srv, "kill")
        await start(srv)
    assert recovered_line(srv)[0] == 20
    async with fastlock.connect(srv.address, client_name="b") as b:
        for lease in leases:
            assert await b.check(lease.name, lease.fencing_token)
            await b.extend(lease, ttl=30.0)
            await b.release(lease)
        st = await b.status()
        assert st["locks_held"] == 0
        # releases are acknowledged before they are durable (server.py): once they are
        # on disk, what was released is not resurrected by another crash
        await wait_until(lambda: _all_durable(b), 5, "the releases to be fsynced")
    await down(srv, "kill")
    await start(srv)
    assert recovered_line(srv)[0] == 0


async def _all_durable(client) -> bool:
    wal = (await client.status())["wal"]
    return wal["durable_lsn"] == wal["last_lsn"]


# -- torn tail and corruption --------------------------------------------------------------------
async def test_torn_tail_is_cut_and_logged(tmp_path, servers, loop_errors):
    data = tmp_path / "data"
    srv = await start(servers(data))
    async with fastlock.connect(srv.address, client_name="t") as c:
        lease = await c.acquire("torn/held", ttl=30.0)
        for _ in range(10):
            await c.release(await c.acquire("torn/busy", ttl=30.0))
    await down(srv, "stop")
    seg = segments(data)[-1]
    size = os.path.getsize(seg)
    garbage = random.Random(3).randbytes(333)  # what a crash in the middle of a write can leave
    with open(seg, "ab") as f:
        f.write(garbage)

    await start(srv)
    line = srv.wait_for_log(r"torn tail cut", 5)
    m = re.search(r"segment (\S+) offset (\d+), (\d+) bytes removed", line)
    assert m, line
    assert m.group(1) == seg and int(m.group(2)) == size and int(m.group(3)) == len(garbage)
    assert "WARNING" in line
    leases, _e, _c, _r, torn = recovered_line(srv)
    assert leases == 1 and torn == len(garbage)
    assert os.path.getsize(seg) == size  # really cut, back to the last whole record
    async with fastlock.connect(srv.address) as c:
        assert await c.check("torn/held", lease.fencing_token)
        nxt = await c.acquire("torn/busy", ttl=30.0, wait=0)
        assert nxt.fencing_token > lease.fencing_token
    # the next start finds a clean log
    await down(srv, "kill")
    await start(srv)
    assert recovered_line(srv)[4] == 0
    assert not any("torn tail" in line for line in srv.lines)


@pytest.mark.parametrize("where", ["last", "older"])
async def test_mid_log_corruption_refuses_to_start(tmp_path, servers, loop_errors, where):
    data = tmp_path / "data"
    srv = await start(servers(data))
    for life in range(2 if where == "older" else 1):
        if life:
            await start(srv)  # a second segment after the first
        async with fastlock.connect(srv.address, client_name="t") as c:
            for i in range(10):  # ten round trips: ten batches in the segment
                await c.release(await c.acquire(f"mid/{i}", ttl=30.0))
        await down(srv, "stop")
    seg = segments(data)[0 if where == "older" else -1]
    with open(seg, "r+b") as f:  # flip a byte in the first record's body (valid batches follow)
        f.seek(24 + 12)
        b = f.read(1)
        f.seek(24 + 12)
        f.write(bytes([b[0] ^ 0x5A]))
    damaged = open(seg, "rb").read()

    with pytest.raises(RuntimeError) as err:
        await start(srv)
    assert srv.proc.returncode not in (0, None)
    out = str(err.value)
    if where == "last":
        assert "mid-log corruption" in out and "refusing to start" in out
    else:
        assert "corrupt record in a non-last segment" in out
    assert f"{seg}: CRC mismatch at offset 24" in out
    assert open(seg, "rb").read() == damaged  # nothing was cut or "repaired" behind our back
    assert not any("listening on" in line for line in srv.lines)


# -- snapshots and compaction -------------------------------------------------------------------
@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_snapshots_compact_the_log_and_state_survives(tmp_path, servers, loop_errors, how):
    data = tmp_path / "data"
    srv = await start(servers(data, args=["--snapshot-every", "25"]))
    held: dict[str, int] = {}
    async with fastlock.connect(srv.address, client_name="snap") as c:
        for i in range(5):
            lease = await c.acquire(f"snap/held-{i}", ttl=60.0)
            held[lease.name] = lease.fencing_token
        await pairs_until(c, "snap/busy", 40, lambda: count_lines(srv, r"snapshot \S+ written") >= 2,
                          "two snapshots written")
    first_segment = segments(data)[0]
    await down(srv, "stop")

    # second life: its own segment; its snapshots cover the whole first segment
    await start(srv)
    async with fastlock.connect(srv.address, client_name="snap") as c:
        # two snapshots of this life: the older one kept covers the whole first segment
        top = await pairs_until(c, "snap/busy", 60, lambda: count_lines(srv, r"snapshot \S+ written") >= 2,
                                "two snapshots written")
        for i in range(3):  # a change after the last snapshot, replayed from the log
            lease = await c.acquire(f"snap/late-{i}", ttl=60.0)
            held[lease.name] = lease.fencing_token
        top = max(top, *held.values())
        total = (await c.status())["wal"]["last_lsn"]
    assert not os.path.exists(first_segment), "segments covered by the snapshots must be deleted"
    # a snapshot still being written holds its new file beside the two kept until it deletes the oldest
    await wait_until(lambda: len(snapshots(data)) <= 2, 10, "at most the two kept snapshots on disk")
    assert any(re.search(r"snapshot \S+ written: .* [1-9]\d* segments deleted", line) for line in srv.lines)

    await down(srv, how)
    await start(srv)
    leases, _epoch, counter, replayed, _torn = recovered_line(srv)
    assert leases == len(held)
    assert replayed < total  # started from a snapshot, not from LSN 1
    assert counter >= top & COUNTER_MASK
    async with fastlock.connect(srv.address, client_name="check") as c:
        for name, token in held.items():
            assert await c.check(name, token), name
            assert (await c.holder(name))["token"] == token
        assert await c.holder("snap/busy") is None
        nxt = await c.acquire("snap/busy", ttl=60.0, wait=0)
        assert nxt.fencing_token > top


# -- audit dump ------------------------------------------------------------------------------------
def _wal_dump(data_dir, *extra) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "fastlock", "wal", "dump", *extra, str(data_dir)],
                         capture_output=True, text=True, timeout=60, cwd=str(data_dir.parent))
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if line and not line.startswith("#")]


async def _durable(client, lsn: int) -> bool:
    return (await client.status())["wal"]["durable_lsn"] >= lsn


def _find(lines: list[str], kind: str, lock: str, token: int) -> str:
    hits = [line for line in lines if line.split()[2] == kind and f"lock={lock} " in line
            and f"token={token} " in line]
    assert len(hits) == 1, (kind, lock, token, lines)
    return hits[0]


async def test_wal_dump_audit_trail(tmp_path, servers, loop_errors):
    data = tmp_path / "data"
    srv = await start(servers(data))
    async with fastlock.connect(srv.address, client_name="billing-api") as c:
        a1 = await c.acquire("audit/a", ttl=30.0, correlation_id="req-42")
        await c.release(a1)
        b1 = await c.acquire("audit/b", ttl=0.2, correlation_id="req-43")  # left to expire
        await asyncio.to_thread(srv.wait_for_log, r"lease expired: 'audit/b'", 10)
        # an expiry is acknowledged to nobody: wait until its record is on disk before the crash
        await wait_until(lambda: _durable(c, 4), 5, "the expiry record to be fsynced")
    await down(srv, "kill")
    await start(srv)  # the trail spans two segments
    async with fastlock.connect(srv.address, client_name="report-job") as c:
        a2 = await c.acquire("audit/a", ttl=30.0, correlation_id="req-44")
    await down(srv, "stop")

    lines = _wal_dump(data)
    g1 = _find(lines, "grant", "audit/a", a1.fencing_token)
    # the authenticated principal is shown first: the client name is only self-declared
    assert "client=anonymous:billing-api" in g1 and "corr=req-42" in g1 and "ttl_ms=30000" in g1
    # neither the owner key nor the hash the server keeps appears: only an 8-digit tag
    from fastlock.auth import hash_owner

    assert a1.owner.hex() not in "\n".join(lines) and hash_owner(a1.owner).hex()[:8] not in g1
    _find(lines, "release", "audit/a", a1.fencing_token)
    g2 = _find(lines, "grant", "audit/b", b1.fencing_token)
    assert "corr=req-43" in g2 and "ttl_ms=200" in g2
    _find(lines, "expire", "audit/b", b1.fencing_token)
    g3 = _find(lines, "grant", "audit/a", a2.fencing_token)
    assert "client=anonymous:report-job" in g3 and "corr=req-44" in g3
    # in LSN order: grant a1 < release a1 < grant b1 < expire b1 < grant a2
    order = [lines.index(x) for x in (g1, _find(lines, "release", "audit/a", a1.fencing_token), g2,
                                      _find(lines, "expire", "audit/b", b1.fencing_token), g3)]
    assert order == sorted(order)
    lsns = [int(line.split()[0]) for line in lines]
    assert lsns == sorted(lsns)

    only_b = _wal_dump(data, "--lock", "audit/b")
    assert [line.split()[2] for line in only_b] == ["grant", "expire"]
    assert all("lock=audit/b " in line for line in only_b)
    only_a = _wal_dump(data, "--lock", "audit/a")
    assert [line.split()[2] for line in only_a] == ["grant", "release", "grant"]


def test_second_server_on_the_same_data_dir_refuses_to_start(tmp_path):
    """Two servers appending to one log would overwrite each other and reuse tokens."""
    data = tmp_path / "shared"
    first = ServerProcess(data).start()
    try:
        second = ServerProcess(data)
        with pytest.raises(RuntimeError, match="in use by another fastlock process"):
            second.start(timeout=20)
        assert second.proc.wait(10) != 0
        second.stop()
        # the first keeps serving
        assert "listening on" in first.wait_for_log("listening on")
    finally:
        first.stop()
    # once the first has stopped, the directory is free again
    again = ServerProcess(data).start()
    again.stop()


async def test_an_extend_that_lengthens_the_ttl_is_acknowledged_only_when_durable(server_factory, loop_errors):
    """Recovery restores the recorded TTL, so a longer TTL must be on disk before the holder
    is told (with the interval timer out of the way, only the extend's own fsync can do it)."""
    srv = server_factory("ext", args=["--fsync-interval-ms", "600000"])
    async with fastlock.connect(srv.address) as client:
        lease = await client.acquire("L", ttl=1.0)
        longer = await client.extend(lease, ttl=60.0)
        wal = (await client.status())["wal"]
        assert wal["durable_lsn"] == wal["last_lsn"]  # the EXTEND record was fsynced before the reply
        same = await client.extend(longer, ttl=60.0)  # no TTL change: no record, no wait
        assert same.ttl == 60.0


def test_repair_wal_never_reissues_a_token(tmp_path):
    """Cutting mid-log corruption may drop acknowledged grants; the repaired server starts a
    new epoch so that every token it issues is above every token issued before."""
    data = tmp_path / "data"
    srv = ServerProcess(data).start()
    tokens = []

    async def grants():
        async with fastlock.connect(srv.address) as client:
            for _ in range(20):
                lease = await client.acquire("L", ttl=5.0)
                tokens.append(lease.fencing_token)
                await client.release(lease)

    try:
        asyncio.run(grants())
    finally:
        srv.kill()
    seg = sorted(glob.glob(str(data / "wal-*.log")))[-1]
    with open(seg, "r+b") as f:
        size = len(f.read().rstrip(b"\0"))  # the records, not the preallocated zeros after them
        f.seek(size // 3)
        byte = f.read(1)
        f.seek(size // 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    refused = ServerProcess(data)
    with pytest.raises(RuntimeError):
        refused.start(timeout=20)
    refused.stop()
    repaired = ServerProcess(data, args=["--repair-wal"]).start()
    try:
        assert any("WAL was repaired" in line for line in repaired.lines)

        async def after():
            async with fastlock.connect(repaired.address) as client:
                lease = await client.acquire("L", ttl=5.0)
                return lease.fencing_token

        token = asyncio.run(after())
        assert token > max(tokens) and epoch_of(token) == 1
    finally:
        repaired.stop()


@pytest.mark.parametrize("name, text, needle", [
    ("node-state.json", '{"max_epoch_seen": 3', "Expecting"),  # cut short
    ("node-state.json", '{"max_epoch_seen": "3"}', "'max_epoch_seen' is str, not int"),
    ("node-state.json", "[1, 2]", "not a JSON object"),
    ("deposed.json", '{"epoch": 2, "why": "x"', "Expecting"),
    ("pairing.json", '{"standby": "s@id"}', "must name 'standby' and 'failover_after_ms'"),
])
def test_a_damaged_node_state_file_refuses_the_start_with_one_clear_line(tmp_path, name, text, needle):
    """A node state file that is not what the node writes (epoch, pairing, step-down)
    stops the start with a line naming the file, not a traceback: guessing an
    epoch or a role could reuse fencing tokens or make a second primary."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / name).write_text(text)
    srv = ServerProcess(data)
    try:
        with pytest.raises(RuntimeError, match="exited"):
            srv.start(timeout=20)
        assert srv.proc.returncode not in (0, None)
        line = next(line for line in srv.lines if "cannot start" in line)
        assert f"{data / name} is damaged" in line and needle in line, line
        assert not any("Traceback" in line for line in srv.lines)
    finally:
        srv.stop()
