"""One standby per primary, and what keeps a primary from granting beside a promoted standby.

Each test is a split-brain found by trying to break fastlock as a new user would:
two standbys both promoting to the same epoch (same tokens); a manual promotion
while the primary still runs; the old primary restarted after an automatic
failover; a stray REPLICATE fencing the primary.  Real processes; bounded waits.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile

import pytest

from fastlock.errors import NotPrimary, Unavailable
from tcpproxy import RawNode, poll, run, status_of

FAILOVER = 1.0
GRACE = 0.2




def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastlock", *args], capture_output=True, text=True,
                          timeout=30, cwd=tempfile.gettempdir())


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
        st = await poll(lambda: status_of(p.address), lambda st: st["role"] == "deposed", timeout=5,
                        what="the old primary to step down")
        assert st["last_token"] == token
        old = await RawNode.open(p.address)
        try:
            with pytest.raises(NotPrimary):
                await old.acquire("free", 1000)
        finally:
            await old.close()

    run(main())


def test_old_primary_restarted_after_failover_starts_fenced(cluster):
    p = cluster.primary()
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
            assert node.hello["fenced"] is True
            with pytest.raises(Unavailable):
                await node.acquire("split", 1000)
            st = await node.status()
            assert st["replication"]["fenced"] and st["locks_held"] == 0
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
    (a confused tool, a port scanner speaking msgpack) changes nothing."""
    from fastlock import protocol as P

    p = cluster.primary()

    async def main():
        stray = await RawNode.open(p.address, name="not-a-standby")
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
