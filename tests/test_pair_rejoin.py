"""A pair that keeps serving and heals itself, against real processes (kill -9, SIGSTOP).

- a sync pair run with the README's flags (``--replication sync`` on both nodes)
  keeps granting after an automatic failover: the promoted node has no standby,
  so it degrades (Patroni's default), says so in its status, and returns to
  ``in_sync`` once the old primary is back as its standby;
- with ``--sync-on-timeout fence`` (strict) the promoted node refuses grants
  with ``Unavailable`` naming the strict mode, and says why in its status;
- a sync primary whose standby is killed: without ``--failover-after`` it keeps
  granting (degraded); with it, the heartbeat fence holds grants until the
  standby is back (restarted by its supervisor with the same flags) - no operator;
- an old primary restarted with its original flags after a failover becomes
  the new primary's standby by itself, discards (and logs, lease by lease) the
  grants it made that never reached the standby, and every token keeps rising;
  restarted again with the same flags it follows the new primary again;
- a paused old primary, resumed after the standby promoted, rejoins it too.

Every wait has a deadline; servers are stopped by PID (the ``cluster`` fixture).
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock.errors import LockNotAcquired, NotPrimary, Unavailable

FAILOVER = 1.0  # --failover-after, seconds
SYNC = ["--replication", "sync"]
EPOCH_SHIFT = 40


def epoch(token: int) -> int:
    return token >> EPOCH_SHIFT


def sync_of(status: dict) -> dict:
    return status["replication"]["sync"]


async def log_line(srv, pattern: str, timeout: float, start: int = 0) -> str:
    return await asyncio.to_thread(srv.wait_for_log, pattern, timeout, start)


async def synced_standby(srv, what: str) -> dict:
    """The status of ``srv`` once it is a standby that has synced (bounded wait)."""
    return await poll(lambda: status_of(srv.address), lambda s: s["role"] == "standby" and s["replication"]["synced"],
                      timeout=10, what=what)


async def grant(address: str, name: str, ttl_ms: int = 30_000, timeout: float = 15) -> int:
    """A grant of the free lock ``name`` at ``address`` (retried while it is refused), its token."""
    node = await RawNode.open(address)
    try:
        async def attempt():
            try:
                return (await asyncio.wait_for(node.acquire(name, ttl_ms), 5))[0]
            except (LockNotAcquired, Unavailable, NotPrimary, asyncio.TimeoutError):
                return None

        return await poll(attempt, lambda t: t is not None, timeout=timeout, what=f"a grant of {name!r}")
    finally:
        await node.close()


def test_sync_pair_with_the_readme_flags_keeps_granting_after_a_failover_and_heals(cluster):
    a = cluster.primary("a", args=SYNC)
    b = cluster.standby(a.address, "b", failover_after=FAILOVER, args=SYNC)

    async def main():
        await poll(lambda: status_of(a.address), lambda st: sync_of(st)["state"] == "in_sync", timeout=10,
                   what="in sync")
        before = await grant(a.address, "before")
        a.kill()
        line = await log_line(b, r"PROMOTED to primary", 15)
        assert "no new grants for 0 ms (grace)" in line, line  # in sync: no grace under the default policy
        tokens = [await grant(b.address, f"after/{i}", timeout=5) for i in range(5)]  # never held, never hung
        assert all(epoch(t) == 1 for t in tokens) and min(tokens) > before
        st = await status_of(b.address)
        assert sync_of(st)["state"] == "degraded" and sync_of(st)["degraded_because"] == "no standby is attached"
        await log_line(b, r"DEGRADED to asynchronous: no standby is attached", 5)

        # the old primary restarted by its supervisor with its original flags: b's standby by itself
        a2 = cluster.restart(a)
        await log_line(a2, r"REJOINING as a standby of " + b.address, 15)
        await poll(lambda: status_of(b.address), lambda st: sync_of(st)["state"] == "in_sync", timeout=15,
                   what="the new primary back in sync with the old one as its standby")
        st = await status_of(a2.address)
        assert st["role"] == "standby" and st["replication"]["primary"] == b.address, st
        assert (await grant(b.address, "healed")) > max(tokens)

    run(main(), timeout=90)


def test_strict_mode_refuses_grants_without_a_standby_and_says_why(cluster):
    strict = [*SYNC, "--sync-on-timeout", "fence", "--sync-timeout", "0.5"]
    a = cluster.primary("a", args=strict)
    b = cluster.standby(a.address, "b", failover_after=FAILOVER, args=strict)

    async def main():
        await poll(lambda: status_of(a.address), lambda st: sync_of(st)["state"] == "in_sync", timeout=10,
                   what="in sync")
        a.kill()
        await log_line(b, r"PROMOTED to primary", 15)
        node = await RawNode.open(b.address)
        try:
            with pytest.raises(Unavailable, match="synchronous replication timed out"):
                await asyncio.wait_for(node.acquire("x", 30_000), 10)  # waited --sync-timeout for a standby
            with pytest.raises(Unavailable, match=r"strict: --sync-on-timeout fence"):
                await asyncio.wait_for(node.acquire("y", 30_000), 5)  # refused at once while held
        finally:
            await node.close()
        st = await status_of(b.address)
        assert sync_of(st)["state"] == "held" and "no standby is attached" in sync_of(st)["held_because"], st
        await log_line(b, r"--sync-on-timeout fence: strict", 5)

    run(main(), timeout=60)


@pytest.mark.parametrize("failover_after", [None, FAILOVER], ids=["manual-failover", "automatic-failover"])
def test_a_sync_primary_keeps_granting_when_its_standby_is_killed(cluster, failover_after):
    a = cluster.primary("a", args=SYNC)
    b = cluster.standby(a.address, "b", failover_after=failover_after, args=SYNC)

    async def main():
        await poll(lambda: status_of(a.address), lambda st: sync_of(st)["state"] == "in_sync", timeout=10,
                   what="in sync")
        first = await grant(a.address, "first")
        b.kill()
        if failover_after is None:
            # nothing can promote without the operator: it degrades and keeps granting
            assert (await grant(a.address, "alone", timeout=10)) > first
            st = await status_of(a.address)
            assert sync_of(st)["state"] == "degraded", st
        else:
            # a standby that fails over by itself may be alive behind a partition: the primary fences
            # until it is back; its supervisor restarts it with the same flags, and grants resume
            await poll(lambda: status_of(a.address), lambda st: st["replication"]["fenced"], timeout=10,
                       what="the fence")
        b2 = cluster.restart(b)
        await log_line(b2, r"replicating from", 10)
        await poll(lambda: status_of(a.address), lambda st: sync_of(st)["state"] == "in_sync", timeout=15,
                   what="back in sync")
        assert (await grant(a.address, "again")) > first

    run(main(), timeout=60)


def test_old_primary_restarted_with_its_flags_discards_its_unacknowledged_tail_and_follows(cluster):
    # async, so that the old primary can acknowledge grants its standby never receives: the
    # standby follows through a proxy, and the proxy stops passing bytes first
    a = cluster.primary("a")
    px = cluster.proxy(a.address)
    b = cluster.standby(px.address, "b", failover_after=3.0, grace=0.5)

    async def main():
        shared = await grant(a.address, "shared")  # replicated: the same lease on both
        await poll(lambda: status_of(b.address), lambda st: st["locks_held"] == 1, timeout=5, what="replicated")
        px.pause()  # the link is cut: a keeps granting until its fence closes (3 s - 0.75 s)
        tail = [await grant(a.address, f"tail/{i}", timeout=1) for i in range(3)]
        assert (await status_of(a.address))["replication"]["fenced"] is False
        a.kill()
        await log_line(b, r"PROMOTED to primary", 15)
        taken = await grant(b.address, "tail/0")  # b never heard of a's tail/0: free there after the grace
        assert epoch(taken) == 1 and taken > max(tail)

        a2 = cluster.restart(a)  # the original flags, a new port
        fenced = await log_line(a2, r"no word from the standby", 10)
        assert "since this node started" in fenced and b.address in fenced, fenced
        await log_line(a2, r"REJOINING as a standby of " + b.address, 15)
        summary = await log_line(a2, r"rejoined .* discarding what its snapshot", 15)
        assert "3 leases" in summary, summary
        for i, token in enumerate(tail):
            await log_line(a2, rf"rejoin discarded lease 'tail/{i}' token {token} ", 5)
        st = await synced_standby(a2, "a2 synced as a standby")
        assert st["epoch"] == 1 and st["locks_held"] == 2, st  # shared and b's tail/0
        node = await RawNode.open(a2.address)
        try:
            with pytest.raises(NotPrimary):
                await node.acquire("tail/1", 1000)  # a standby grants nothing, at any epoch
        finally:
            await node.close()
        later = await grant(b.address, "later")
        assert later > taken > max(tail) > shared  # tokens keep rising across the whole sequence

        # restarted again with the same flags: it follows b again (its node-state.json says so)
        a2.stop()
        a3 = cluster.restart(a2)
        await log_line(a3, r"started without --standby-of: following " + b.address, 10)
        await log_line(a3, r"replicating from", 10)
        assert (await status_of(a3.address))["role"] == "standby"

    run(main(), timeout=120)


def test_a_paused_old_primary_rejoins_the_promoted_standby_when_resumed(cluster):
    a = cluster.primary("a")
    b = cluster.standby(a.address, "b", failover_after=FAILOVER, grace=0.5)

    async def main():
        before = await grant(a.address, "x")
        a.pause()
        try:
            await log_line(b, r"PROMOTED to primary", 15)
        finally:
            a.resume()
        await log_line(a, r"REJOINING as a standby of " + b.address, 15)
        st = await synced_standby(a, "the old primary synced as a standby")
        assert st["epoch"] == 1, st
        assert (await grant(b.address, "y")) > before

    run(main(), timeout=60)



def test_both_nodes_with_the_same_flags_fail_over_and_back_by_themselves(cluster):
    # --failover-after on the primary too: the window it follows with once it has rejoined
    a = cluster.primary("a", args=[*SYNC, "--failover-after", str(FAILOVER)])
    b = cluster.standby(a.address, "b", failover_after=FAILOVER, args=SYNC)

    async def main():
        first = await grant(a.address, "first")
        a.kill()
        await log_line(b, r"PROMOTED to primary", 15)
        second = await grant(b.address, "second")
        a2 = cluster.restart(a)
        await log_line(a2, r"REJOINING as a standby of " + b.address, 15)
        await log_line(a2, r"paired: primary .* fences itself for this standby \(failover window 1000 ms\)", 15)
        await poll(lambda: status_of(b.address), lambda st: sync_of(st)["state"] == "in_sync", timeout=15,
                   what="b in sync with a as its standby")
        b.kill()
        line = await log_line(a2, r"PROMOTED to primary", 15)
        assert "no new grants for 0 ms (grace)" in line, line
        third = await grant(a2.address, "third")
        assert [epoch(t) for t in (first, second, third)] == [0, 1, 2] and first < second < third

    run(main(), timeout=90)


def test_a_degrade_waits_until_the_paused_standby_has_heard_it(cluster):
    # the standby fails over by itself and was told "in sync": the degraded primary acknowledges
    # nothing without it until it has read "not in sync" (it could promote without a grace otherwise)
    # --sync-timeout 1: degraded after 1 s, the held replies fail 1 s later, the fence is at 2.25 s
    a = cluster.primary("a", args=[*SYNC, "--sync-timeout", "1"])
    b = cluster.standby(a.address, "b", failover_after=3.0, args=SYNC)

    async def main():
        await poll(lambda: status_of(a.address), lambda st: sync_of(st)["state"] == "in_sync", timeout=10,
                   what="in sync")
        node = await RawNode.open(a.address)
        try:
            b.pause()  # well within the fence (3 s - 0.75 s)
            try:
                acquire = asyncio.ensure_future(node.acquire("during", 30_000))
                await log_line(a, r"DEGRADED to asynchronous", 5)
                done, _ = await asyncio.wait({acquire}, timeout=0.2)
                assert not done, "acknowledged while the standby may still believe it is in sync"
                st = await status_of(a.address)
                assert sync_of(st)["state"] == "degraded" and not sync_of(st)["standby_heard_degrade"], st
            finally:
                b.resume()
            token, _, _ = await asyncio.wait_for(acquire, 5)  # released once the standby has echoed
            await log_line(b, r"primary says this standby is not in sync", 5)
            await log_line(a, r"heard that it is no longer in sync", 5)
            await poll(lambda: status_of(a.address), lambda st: sync_of(st)["state"] == "in_sync", timeout=10,
                       what="back in sync")
            assert (await asyncio.wait_for(node.acquire("after", 30_000), 5))[0] > token
        finally:
            await node.close()

    run(main(), timeout=60)


def test_a_sync_primary_alone_degrades_once_and_says_so_in_status_and_metrics(cluster):
    import re
    import urllib.request

    a = cluster.primary("a", args=[*SYNC, "--metrics", "127.0.0.1:0"])
    url = re.search(r"(http://\S+/metrics)", a.wait_for_log(r"metrics on http://")).group(1)

    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(fastlock_sync_\w+) (\S+)$", text, re.M)}

    async def main():
        tokens = [await grant(a.address, f"alone/{i}", timeout=5) for i in range(3)]  # no --sync-timeout wait
        assert tokens == sorted(tokens)
        st = await status_of(a.address)
        assert sync_of(st)["state"] == "degraded" and sync_of(st)["degradations"] == 1, st
        # the exporter refreshes its snapshot once a second
        values = await poll(lambda: asyncio.to_thread(scrape), lambda v: v.get("fastlock_sync_degraded") == 1,
                            timeout=5, what="fastlock_sync_degraded 1", interval=0.1)
        assert values["fastlock_sync_degraded"] == 1 and values["fastlock_sync_held"] == 0, values
        assert values["fastlock_sync_degradations_total"] == 1, values
        assert sum("DEGRADED to asynchronous" in line for line in a.lines) == 1  # once per transition

    run(main(), timeout=40)


def test_paused_primaries_rejoin_each_other_back_and_forth(cluster):
    # both nodes with the same --failover-after: each pause promotes the other, each resume rejoins
    a = cluster.primary("a", args=["--failover-after", str(FAILOVER), "--promotion-grace", "0.5"])
    b = cluster.standby(a.address, "b", failover_after=FAILOVER, grace=0.5)

    async def main():
        tokens = [await grant(a.address, "t0")]
        for n, (old, new) in enumerate([(a, b), (b, a)], start=1):
            start_new, start_old = len(new.lines), len(old.lines)
            old.pause()
            try:
                await log_line(new, r"PROMOTED to primary", 15, start_new)
            finally:
                old.resume()
            await log_line(old, r"REJOINING as a standby of " + new.address, 15, start_old)
            await log_line(old, r"paired: primary .* fences itself for this standby", 15, start_old)
            tokens.append(await grant(new.address, f"t{n}"))
            assert epoch(tokens[-1]) == n
        assert tokens == sorted(tokens)

    run(main(), timeout=90)


def test_a_primary_deposed_by_a_manual_promotion_follows_the_new_primary(cluster):
    a = cluster.primary("a")
    b = cluster.standby(a.address, "b")  # promotion by command only

    async def main():
        first = await grant(a.address, "first", ttl_ms=1_000)  # the longest TTL: b's grace after the promotion
        await poll(lambda: status_of(b.address), lambda st: st["replication"]["applied_lsn"] >= 1, timeout=5,
                   what="replicated")
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "fastlock", "promote", "--server",
                                                    b.address, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err
        await log_line(a, r"REJOINING as a standby of " + b.address, 15)
        st = await synced_standby(a, "the deposed primary synced as a standby")
        assert st["epoch"] == 1, st
        assert (await grant(b.address, "second")) > first

    run(main(), timeout=60)


def test_a_rejoined_old_primary_restarted_the_documented_way_pairs_with_its_window(cluster):
    # rejoined with its primary's flags (no --failover-after: window 0), then restarted by an operator
    # with --standby-of the new primary and --failover-after: the new primary pairs at that window
    a = cluster.primary("a")
    b = cluster.standby(a.address, "b", failover_after=FAILOVER, grace=0.5)

    async def main():
        await grant(a.address, "x", ttl_ms=1_000)
        a.kill()
        await log_line(b, r"PROMOTED to primary", 15)
        a2 = cluster.restart(a)
        await log_line(a2, r"paired: primary .* \(failover window 0 ms\)", 15)
        a2.stop()
        a3 = cluster._start(type(a2)(a2.data_dir, args=["--standby-of", b.address, "--failover-after", "1",
                                                        "--name", "a", *cluster.auth_args("a")]))
        await log_line(a3, r"paired: primary .* \(failover window 1000 ms\)", 15)

    run(main(), timeout=60)


# -- the announced address and the pairing that keeps it (no processes) ---------------------------

@pytest.mark.parametrize("announced, peer, expected", [
    ("127.0.0.1:7421", "10.0.0.9", "127.0.0.1:7421"),
    ("0.0.0.0:7421", "10.0.0.9", "10.0.0.9:7421"),  # listens everywhere: where its connection came from
    ("[::]:7421", "10.0.0.9", "10.0.0.9:7421"),
    (None, "10.0.0.9", None),  # an older standby announces none
])
def test_a_standby_address_is_where_it_serves_clients(announced, peer, expected):
    from fastlock.replication.messages import standby_address

    assert standby_address(announced, peer) == expected


@pytest.mark.parametrize("announced", ["x", "host:0", "host:70000", 7421, ["h", 1], "h" * 300 + ":1"])
def test_a_bad_announced_address_is_refused_and_changes_nothing(announced):
    from fastlock.errors import InvalidArgument
    from fastlock.replication.messages import standby_address

    with pytest.raises(InvalidArgument, match="a standby's address"):
        standby_address(announced, "10.0.0.9")


def test_the_pairing_keeps_the_address_and_reads_one_without(tmp_path):
    import json

    from fastlock.errors import NodeFileDamaged
    from fastlock.replication import PAIRING_FILE, Pairing, read_pairing, write_pairing

    write_pairing(str(tmp_path), Pairing("b@node-2/abc", 1000, "127.0.0.1:7421"))
    assert read_pairing(str(tmp_path)) == Pairing("b@node-2/abc", 1000, "127.0.0.1:7421")
    (tmp_path / PAIRING_FILE).write_text(json.dumps({"standby": "node-2/abc", "failover_after_ms": 0}))
    assert read_pairing(str(tmp_path)) == Pairing("node-2/abc", 0, None)  # written before addresses were kept
    (tmp_path / PAIRING_FILE).write_text(json.dumps({"standby": "node-2/abc", "failover_after_ms": 0,
                                                     "address": 7421}))
    with pytest.raises(NodeFileDamaged, match="address"):
        read_pairing(str(tmp_path))
