"""One standby per primary, and what keeps a primary from granting beside a promoted standby.

Each test is a split-brain found by trying to break fastlock as a new user would:
two standbys both promoting to the same epoch (same tokens); a manual promotion
while the primary still runs; the old primary restarted after an automatic
failover; a stray REPLICATE fencing the primary.  Real processes; bounded waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile

import pytest

from fastlock import protocol as P
from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock.errors import ConnectionLost, NotPrimary, Unavailable
from fastlock.tokens import epoch_of

FAILOVER = 1.0
GRACE = 0.2




def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastlock", *args], capture_output=True, text=True,
                          timeout=30, cwd=tempfile.gettempdir())


#: a ``fastlock`` command that loads the package, writes "ready" on stderr, then runs
#: once a line arrives on stdin (see :func:`cli_on_cue`)
_ON_CUE = ("import sys; from fastlock.cli import main; print('ready', file=sys.stderr, flush=True); "
           "sys.stdin.readline(); sys.exit(main())")


def cli_on_cue(*args: str) -> subprocess.Popen:
    """Start ``fastlock ARGS`` and wait (bounded) until it is loaded; it runs once a line is
    written to its stdin, so that a test's fault starts just before the command's request and
    not a Python start-up (seconds on a loaded machine) earlier."""
    proc = subprocess.Popen([sys.executable, "-c", _ON_CUE, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tempfile.gettempdir())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ready = pool.submit(proc.stderr.readline)
        try:
            assert ready.result(timeout=30) == "ready\n"
        except BaseException:
            proc.kill()  # the read ends at EOF
            proc.communicate()
            raise
    return proc


def cue(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    """Let a :func:`cli_on_cue` command run; wait (at most 30 s) for it to end."""
    out, err = proc.communicate("go\n", timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_second_standby_is_refused_and_never_promotes(cluster):
    p = cluster.primary()
    s1 = cluster.standby(p.address, "standby1", failover_after=FAILOVER, grace=GRACE)
    s2 = cluster.standby(p.address, "standby2", failover_after=FAILOVER, grace=GRACE, wait_sync=False)
    s2.wait_for_log(r"supports one standby", 10)

    async def main():
        st = await poll(lambda: status_of(p.address), lambda st: st["replication"]["paired_standby"],
                        timeout=5, what="pairing")
        assert st["replication"]["paired_standby"].startswith("standby1@")
        assert [sb["name"] for sb in st["replication"]["standbys"]] == [st["replication"]["paired_standby"]]
        p.kill()
        s1.wait_for_log(r"PROMOTED", 10)
        # the refused standby never synchronised: it must not promote, ever
        st2 = await status_of(s2.address)
        assert st2["role"] == "standby" and not st2["replication"]["synced"]
        node = await RawNode.open(s2.address)
        try:
            with pytest.raises(NotPrimary):
                await node.acquire("x", 1000)
        finally:
            await node.close()

    run(main())
    assert not any("PROMOTED" in line for line in s2.lines)


def test_manual_promotion_deposes_a_primary_that_still_runs(cluster):
    p = cluster.primary()
    s = cluster.standby(p.address)  # no --failover-after: promotion by command only

    async def main():
        a = await RawNode.open(p.address)
        token, _, _ = await a.acquire("held", 30_000)
        await a.close()
        await poll(lambda: status_of(s.address), lambda st: st["replication"]["applied_lsn"] >= 1,
                   timeout=5, what="standby caught up")
        res = await asyncio.to_thread(cli, "promote", "--server", s.address)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["epoch"] == 1
        # the old primary heard of epoch 1 over the replication link and stepped down
        # (standby: it has already followed the new primary, found at its address)
        st = await poll(lambda: status_of(p.address), lambda st: st["role"] in ("deposed", "standby"), timeout=5,
                        what="the old primary to step down")
        assert st["last_token"] == token if st["role"] == "deposed" else st["epoch"] == 1, st
        old = await RawNode.open(p.address)
        try:
            with pytest.raises(NotPrimary):
                await old.acquire("free", 1000)
        finally:
            await old.close()

    run(main())


def test_old_primary_restarted_after_failover_starts_fenced(cluster):
    """The old primary has no replica credential: it cannot look for the new primary at its
    standby's address and follow it, so it stays the fenced primary this test reads
    (test_pair_rejoin.py has the rejoin)."""
    p = cluster.primary(replica_credential=False)
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)

    async def main():
        await poll(lambda: status_of(p.address), lambda st: st["replication"]["paired_standby"],
                   timeout=5, what="pairing")
        p.kill()
        s.wait_for_log(r"PROMOTED", 10)
        new = await RawNode.open(s.address)
        try:
            await poll(lambda: new.acquire("split", 30_000), timeout=5, what="a grant after the grace")
        finally:
            await new.close()
        old = cluster.restart(p)  # same data dir, same command line: it must not grant
        assert any("restarted while paired" in line for line in old.lines)
        node = await RawNode.open(old.address)
        try:
            assert node.hello["role"] == "primary" and node.hello["fenced"] is True, node.hello
            with pytest.raises(Unavailable):
                await node.acquire("split", 1000)
            st = await node.status()
            assert st["replication"]["fenced"]
        finally:
            await node.close()
        # a client listing the stale node first skips it for the real primary
        import fastlock

        async with fastlock.connect(old.address, s.address) as client:
            assert client.server_info["epoch"] == 1
            with pytest.raises(fastlock.LockNotAcquired):
                await client.acquire("split", ttl=1.0, wait=0)  # held on the new primary
        # the operator may still decide otherwise
        res = await asyncio.to_thread(cli, "serve-alone", "--server", old.address)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["unpaired"].startswith("standby@")
        assert not os.path.exists(old.data_dir / "pairing.json")

    run(main())


def test_a_stray_replicate_does_not_pair_or_fence(cluster):
    """Pairing needs an echoed heartbeat: a REPLICATE that never acknowledges anything
    (a confused tool holding a replica credential) changes nothing."""
    from fastlock import protocol as P

    p = cluster.primary()

    async def main():
        stray = await RawNode.open(p.address, name="not-a-standby", token=cluster.creds.token(cluster.replica_of("x")))
        await stray.request(P.OP_REPLICATE, 0, None, 1000, "stray")
        await stray.close()
        node = await RawNode.open(p.address)
        try:
            await poll(lambda: node.status(), lambda st: not st["replication"]["standbys"], timeout=5,
                       what="the stray to be detached")
            # well past the stray's 1 s window: still granting, not paired
            for i in range(3):
                await asyncio.sleep(0.5)  # the time that would have let a fence arm
                token, _, owner = await node.acquire(f"k{i}", 1000)
                assert token > 0
            st = await node.status()
            assert st["replication"]["paired_standby"] is None and not st["replication"]["fenced"]
        finally:
            await node.close()

    run(main())


# --------------------------------------------------------------------------- second round


def test_manual_promote_of_a_frozen_primary_is_refused_without_a_fence_or_force(cluster):
    """No --failover-after: the frozen primary cannot confirm and does not fence itself."""
    p = cluster.primary()
    s = cluster.standby(p.address)

    async def main():
        a = await RawNode.open(p.address)
        await a.acquire("x", 30_000)
        await a.close()
        await poll(lambda: status_of(s.address), lambda st: st["replication"]["applied_lsn"] >= 1,
                   timeout=5, what="standby caught up")
        p.pause()
        try:
            res = await asyncio.to_thread(cli, "promote", "--server", s.address)
            assert res.returncode == 1 and "did not confirm" in res.stderr, res.stderr
            assert (await status_of(s.address))["role"] == "standby"
        finally:
            p.resume()
        # once the primary answers again, the same command deposes it and promotes
        res = await asyncio.to_thread(cli, "promote", "--server", s.address)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["primary_confirmed"] is True
        assert (await status_of(p.address))["role"] in ("deposed", "standby")  # standby: it follows s already

    run(main())


def test_manual_promote_of_an_unreachable_primary_waits_for_its_fence(cluster):
    """With --failover-after, a partitioned primary fences itself; promotion waits for that,
    so the old node afterwards neither releases (the new primary would never see it) nor
    hands the lock to anybody; its waiter is sent away to look for the new primary.  It has
    no replica credential, so it stays that fenced primary (it cannot follow the new one,
    found at the standby's own address, which would replace its table)."""
    p = cluster.primary(replica_credential=False)
    px = cluster.proxy(p.address)
    s = cluster.standby(px.address, failover_after=3.0, grace=GRACE)

    async def main():
        holder = await RawNode.open(p.address)
        token, _, owner = await holder.acquire("x", 30_000)
        waiter = await RawNode.open(p.address)
        queued = asyncio.ensure_future(waiter.acquire("x", 1000, wait_ms=60_000))
        await poll(lambda: status_of(p.address), lambda st: st["waiters"] == 1, timeout=5, what="queued")
        await poll(lambda: status_of(p.address), lambda st: st["replication"]["paired_standby"], timeout=5,
                   what="pairing")
        promote = await asyncio.to_thread(cli_on_cue, "promote", "--server", s.address)
        px.pause()  # partition: the STEP_DOWN request cannot get through
        res = await asyncio.to_thread(cue, promote)  # within its 3 s window: before it promotes by itself
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["primary_confirmed"] is False
        assert "promote: still working: role promoting" in res.stderr, res.stderr  # progress while it waits
        assert any("did not confirm stepping down" in line for line in s.lines)
        # by the time the standby serves, the old primary has fenced itself
        st = await status_of(p.address)
        assert st["role"] == "primary" and st["replication"]["fenced"], st
        with pytest.raises(Unavailable):  # to be repeated at the new primary
            await holder.request(P.OP_RELEASE, "x", token, owner)
        with pytest.raises(ConnectionLost):  # fenced a whole window: told to look elsewhere, never granted
            await asyncio.wait_for(queued, 5)
        st = await status_of(p.address)
        assert st["waiters"] == 0 and st["locks_held"] == 1 and st["last_token"] == token
        await holder.close()
        await waiter.close()

    run(main(), timeout=60)


def test_promoted_standby_restarted_as_standby_of_the_old_primary_refuses_and_deposes_it(cluster):
    """Both nodes restarted with their usual command lines after a failover: the old
    primary must not resume granting, and the promoted node must keep its leases and
    be the primary again."""
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)

    async def main():
        await poll(lambda: status_of(p.address), lambda st: st["replication"]["paired_standby"],
                   timeout=5, what="pairing")
        p.kill()
        s.wait_for_log(r"PROMOTED", 10)
        b = await RawNode.open(s.address)
        token, _, _ = await poll(lambda: b.acquire("y", 60_000), timeout=5, what="grant after grace")
        await b.close()
        assert epoch_of(token) == 1
        s.stop()
        old = cluster.restart(p)  # fenced: paired, and its standby may have been promoted
        s2 = cluster.restart(s)   # its unit file still says --standby-of <old primary address>
        # (the restarted old primary has a new port: point the standby at it explicitly)
        s2.stop()
        s3 = cluster._start(type(s)(s.data_dir, args=["--standby-of", old.address, "--name", "standby",
                                                      *cluster.auth_args("standby"),
                                                      "--failover-after", str(FAILOVER)]))
        s3.wait_for_log(r"refusing to follow", 10)
        st_old = await poll(lambda: status_of(old.address), lambda st: st["role"] == "deposed", timeout=5,
                            what="the old primary to step down")
        assert st_old["locks_held"] == 0
        # the old primary is deposed (durably): the node at the higher epoch is the primary again
        # (it has --failover-after), with the lease it granted
        st_b = await poll(lambda: status_of(s3.address), lambda st: st["role"] == "primary", timeout=10,
                          what="the promoted node to promote itself again")
        assert st_b["epoch"] == 2 and st_b["locks_held"] == 1, st_b

    run(main(), timeout=60)


def test_a_copied_standby_data_dir_is_refused_while_the_original_is_alive(cluster):
    import shutil

    p = cluster.primary()
    s1 = cluster.standby(p.address, "standby1", failover_after=FAILOVER, grace=GRACE)
    shutil.copytree(s1.data_dir, cluster.root / "clone", ignore=shutil.ignore_patterns("LOCK"))
    clone = cluster._start(type(s1)(cluster.root / "clone",
                                    args=["--standby-of", p.address, "--name", "clone", *cluster.auth_args("standby1"),
                                          "--failover-after", str(FAILOVER)]))
    clone.wait_for_log(r"copied data directory", 10)

    async def main():
        st = await status_of(p.address)
        assert [sb["name"] for sb in st["replication"]["standbys"]] == [st["replication"]["paired_standby"]]
        assert st["replication"]["paired_standby"].startswith("standby1@")
        assert not st["replication"]["fenced"]

    run(main())
    assert sum("reconnected" in line for line in p.lines) < 5


def test_a_standby_renamed_on_restart_is_the_same_standby(cluster):
    p = cluster.primary()
    s = cluster.standby(p.address, "east", failover_after=FAILOVER, grace=GRACE)

    async def main():
        await poll(lambda: status_of(p.address), lambda st: st["replication"]["paired_standby"],
                   timeout=5, what="pairing")
        s.stop()
        renamed = cluster._start(type(s)(s.data_dir, args=["--standby-of", p.address, "--name", "east-1",
                                                           *cluster.auth_args("east"),
                                                           "--failover-after", str(FAILOVER)]))
        renamed.wait_for_log(r"replicating from", 10)
        await poll(lambda: status_of(p.address),
                   lambda st: st["replication"]["paired_standby"].startswith("east-1@")
                   and not st["replication"]["fenced"], timeout=5, what="re-paired under the new name")
        node = await RawNode.open(p.address)
        try:
            token, _, _ = await node.acquire("z", 1000)
            assert token > 0
        finally:
            await node.close()

    run(main())


def test_metrics_address_in_use_fails_the_start(cluster, tmp_path):
    import socket

    from fastlock._testbase import ServerProcess

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        srv = ServerProcess(tmp_path / "m", args=["--metrics", f"127.0.0.1:{busy.getsockname()[1]}"])
        with pytest.raises(RuntimeError, match="exited"):
            srv.start(timeout=20)
        assert not any("listening on" in line for line in srv.lines)
        assert any("cannot start" in line for line in srv.lines)
        srv.stop()
    finally:
        busy.close()


# --------------------------------------------------------------------------- third round


def test_a_waiting_promotion_is_not_undone_by_the_old_primary_coming_back(cluster):
    """The standby stops following before it waits out the old primary's fence: a primary
    restarted during the wait stays fenced, and grants nothing after the promotion."""
    from fastlock._testbase import ServerProcess

    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=4.0, grace=GRACE)

    async def main():
        port, args = p.port, p.args
        p.kill()
        promote = asyncio.ensure_future(asyncio.to_thread(cli, "promote", "--server", s.address))
        await asyncio.to_thread(s.wait_for_log, r"did not confirm stepping down", 10)
        old = cluster._start(ServerProcess(p.data_dir, port=port, args=args))  # same address as before
        res = await promote
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["primary_confirmed"] is False
        node = await RawNode.open(old.address)
        try:
            with pytest.raises(Unavailable):
                await node.acquire("L", 1000)
            assert (await node.status())["replication"]["fenced"]
        finally:
            await node.close()

    run(main(), timeout=60)


def test_a_deposed_primary_stays_deposed_after_a_restart(cluster):
    """... until it follows the new primary, found at its paired standby's address."""
    p = cluster.primary()
    s = cluster.standby(p.address)  # no --failover-after: the old primary never fences itself

    async def main():
        res = await asyncio.to_thread(cli, "promote", "--server", s.address)
        assert res.returncode == 0 and json.loads(res.stdout)["primary_confirmed"] is True, res.stderr
        p.kill()
        # its once-a-second look at its standby's address may have found the new primary before
        # the kill (on a loaded machine the promote command returns later): then it restarts as
        # that primary's standby, and otherwise deposed
        rejoined = any("REJOINING as a standby of " + s.address in line for line in p.lines)
        old = cluster.restart(p)  # its usual command line
        assert rejoined or any("stays deposed" in line for line in old.lines)
        node = await RawNode.open(old.address)
        try:
            assert node.hello["role"] in ("deposed", "standby")  # never a primary again at its old epoch
            with pytest.raises(NotPrimary):
                await node.acquire("L", 1000)
        finally:
            await node.close()
        st = await poll(lambda: status_of(old.address), lambda st: st["role"] == "standby"
                        and st["replication"]["synced"], timeout=20, what="the deposed node to follow the new primary")
        assert st["replication"]["primary"] == s.address and st["epoch"] == 1, st

    run(main())


def test_no_automatic_failover_before_the_primary_confirms_the_pairing(tmp_path):
    """The standby's decision rule: silence alone is not enough; the primary's heartbeats
    must have said it fences itself for this standby (node id and window)."""
    from fakehost import FakeHost

    from fastlock.replication import StandbyFollower
    from fastlock.roles import Role
    from fastlock.units import monotonic_ms

    promoted: list[str] = []
    host = FakeHost(str(tmp_path), Role.STANDBY, primary_address="127.0.0.1:9")
    follower = StandbyFollower(host, ("127.0.0.1", 9), failover_after_ms=50, name="east@id-1",
                               token="fl1.node-1.secret", on_primary_silent=lambda: promoted.append("silent"))
    follower.synced = True
    try:
        # the primary pairs with "[label@]replica principal/node id" (see LockServer._op_replicate)
        for paired, window, expect in ((None, 0, False), ("west@node-1/id-2", 50, False),
                                       ("east@node-2/id-1", 50, False), ("east@node-1/id-1", 99, False),
                                       ("renamed@node-1/id-1", 50, True)):
            follower.on_push("hb", [1, 0, 0, 0, paired, window])
            follower.last_heard_ms = monotonic_ms() - 1000  # the primary has been silent for 1 s
            follower._check_silence()
            assert bool(promoted) is expect, (paired, window)
    finally:
        follower.stop()


# --------------------------------------------------------------------------- fourth round


def test_fail_back_with_force_after_the_new_primary_died_uses_a_higher_epoch(cluster):
    """The old primary never received the new epoch in its WAL; its step-down record and
    node state remember it, so a forced promotion goes above it, never reusing it.  It has no
    replica credential until its restart, so it cannot follow the new primary (and learn its
    leases and epoch) meanwhile."""
    p = cluster.primary(replica_credential=False)
    s = cluster.standby(p.address)

    async def main():
        res = await asyncio.to_thread(cli, "promote", "--server", s.address)
        assert res.returncode == 0 and json.loads(res.stdout)["epoch"] == 1, res.stderr
        b = await RawNode.open(s.address)
        token_b, _, _ = await poll(lambda: b.acquire("k0", 60_000), timeout=5, what="grant on the new primary")
        await b.close()
        s.kill()  # really dead
        p.stop()
        rejoin = cluster._start(type(p)(p.data_dir, args=["--standby-of", s.address, "--name", "old",
                                                    *cluster.auth_args("primary")]))
        res = await asyncio.to_thread(cli, "promote", "--server", rejoin.address, "--force")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["epoch"] == 2
        node = await RawNode.open(rejoin.address)
        try:
            token_a, _, _ = await poll(lambda: node.acquire("k0", 1000), timeout=10, what="grant after grace")
        finally:
            await node.close()
        assert epoch_of(token_a) == 2 and token_a > token_b

    run(main())


def test_a_standby_data_dir_started_without_standby_of_refuses_to_be_a_second_primary(cluster):
    from fastlock._testbase import ServerProcess

    p = cluster.primary()
    s = cluster.standby(p.address)
    s.stop()
    alone = ServerProcess(s.data_dir, args=["--name", "standby"])
    with pytest.raises(RuntimeError, match="exited"):
        alone.start(timeout=20)
    assert any("belongs to a standby of" in line for line in alone.lines)
    alone.stop()


def test_the_default_grace_survives_a_standby_restart(cluster):
    """The longest TTL seen is persisted: a forced promotion after a restart still waits it out."""
    p = cluster.primary()
    s = cluster.standby(p.address)

    async def main():
        a = await RawNode.open(p.address)
        token, _, owner = await a.acquire("x", 60_000)
        await a.request(P.OP_RELEASE, "x", token, owner)
        await a.close()
        await poll(lambda: status_of(s.address), lambda st: st["replication"]["applied_lsn"] >= 2,
                   timeout=5, what="standby caught up")
        s.stop()
        p.kill()
        again = cluster.restart(s)
        res = await asyncio.to_thread(cli, "promote", "--server", again.address, "--force")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["grace_ms"] >= 60_000

    run(main())
