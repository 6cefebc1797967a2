"""Synchronous replication (``--replication sync``) against real processes.

- every grant acknowledged by a sync primary is on its standby when the primary
  is SIGKILLed under load and the standby promotes (the history of acknowledged
  grants is checked lease by lease on the promoted node);
- a promoted standby that was in sync grants a free lock as soon as it is the
  primary (no grace period); after asynchronous replication it keeps the grace;
- a SIGSTOPped standby: the primary holds the replies for ``--sync-timeout``,
  then fails them and refuses grants (``fence``), or degrades to asynchronous
  replication, loudly (``degrade``); both return to ``in_sync`` when the standby
  is back;
- bad flag values are usage errors naming the flag.

Every wait has a deadline; servers are stopped by PID (the ``cluster`` fixture).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock.errors import ConnectionLost, FastlockError, LockNotAcquired, NotPrimary, Unavailable
from fastlock.replication.syncrep import SyncAck, SyncSettings
from fastlock.server import ServerConfig

FAILOVER = 1.0  # --failover-after, seconds
SYNC = ["--replication", "sync"]
EPOCH_SHIFT = 40


async def log_line(srv, pattern: str, timeout: float, start: int = 0) -> str:
    return await asyncio.to_thread(srv.wait_for_log, pattern, timeout, start)


def sync_state(status: dict) -> str:
    return status["replication"]["sync"].get("state", "async")


@pytest.mark.parametrize("ack", ["fsynced", "written"])
def test_acknowledged_grants_survive_kill9_and_promotion(cluster, ack):
    primary = cluster.primary(args=[*SYNC, "--sync-ack", ack])
    # the standby's own --replication applies once it is the primary: async, as it has no standby then
    standby = cluster.standby(primary.address, failover_after=FAILOVER)
    acked: list[tuple[str, int]] = []
    owners: dict[str, bytes] = {}

    async def worker(node: RawNode, w: int, stop: asyncio.Event) -> None:
        i = 0
        while not stop.is_set():
            name = f"sync/{w}/{i}"
            i += 1
            try:
                token, _, owner = await node.acquire(name, 60_000)
            except (ConnectionLost, FastlockError, OSError):
                return
            owners[name] = owner
            acked.append((name, token))

    async def main() -> None:
        nodes = [await RawNode.open(primary.address) for _ in range(8)]
        await poll(lambda: status_of(primary.address), lambda st: sync_state(st) == "in_sync", timeout=10,
                   what="the primary to report its standby in sync")
        stop = asyncio.Event()
        tasks = [asyncio.ensure_future(worker(nodes[w % 8], w, stop)) for w in range(32)]
        await poll(lambda: asyncio.sleep(0, len(acked)), lambda n: n >= 400, timeout=20,
                   what="400 acknowledged grants")
        extended = {}  # an extend is acknowledged once the standby has it too
        for name, token in acked[:20]:
            owner = owners[name]
            await nodes[0].extend(name, token, owner, 90_000)
            extended[name] = token
        primary.kill()  # SIGKILL with acquires in flight
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        for node in nodes:
            await node.close()
        promoted = await log_line(standby, r"PROMOTED to primary", 15)
        assert "no new grants for 0 ms" in promoted, promoted
        new = await RawNode.open(standby.address)
        try:
            missing = []
            for name, token in acked:
                info = await new.holder(name)
                if info is None or info["token"] != token:
                    missing.append((name, token, info))
            assert not missing, f"{len(missing)} of {len(acked)} acknowledged grants lost: {missing[:5]}"
            for name in extended:
                assert (await new.holder(name))["ttl_ms"] == 90_000, name
            fresh, _, _ = await new.acquire("sync/after-failover", 5_000)
            assert fresh >> EPOCH_SHIFT > max(t for _, t in acked) >> EPOCH_SHIFT
        finally:
            await new.close()

    run(main(), timeout=60)


async def _first_free_grant_after_kill(cluster, args: list[str]) -> tuple[dict, float, str]:
    """Kill a primary holding a 2 s lease; return (the promoted node's status, seconds from
    PROMOTED to the first grant of a free lock there, the promotion log line)."""
    primary = cluster.primary(args=args)
    standby = cluster.standby(primary.address, failover_after=FAILOVER)  # async once it is the primary
    node = await RawNode.open(primary.address)
    await node.acquire("held", 2_000)  # the longest TTL seen: the async grace
    await node.close()
    await poll(lambda: status_of(standby.address), lambda st: st["replication"]["applied_lsn"] >= 1, timeout=10,
               what="the standby to apply the grant")
    primary.kill()
    line = await log_line(standby, r"PROMOTED to primary", 15)
    promoted_at = time.monotonic()
    new = await RawNode.open(standby.address)
    try:
        status = await new.status()  # right after the promotion

        async def try_free() -> bool:
            try:
                await new.acquire("free", 1_000)
                return True
            except (LockNotAcquired, Unavailable, NotPrimary):
                return False

        await poll(try_free, timeout=15, what="a grant of a free lock on the promoted node")
        elapsed = time.monotonic() - promoted_at
    finally:
        await new.close()
    return status, elapsed, line


@pytest.mark.parametrize("policy", [[], ["--sync-on-timeout", "fence"]], ids=["degrade-default", "fence-strict"])
def test_in_sync_promotion_grants_a_free_lock_without_grace(cluster, policy):
    # degrade (the default) acknowledges nothing without the standby while the standby's last word
    # is "in sync" (it waits until the standby has heard otherwise): no grace, as strict
    status, after_promotion, line = run(_first_free_grant_after_kill(cluster, [*SYNC, *policy]))
    assert "no new grants for 0 ms (grace)" in line, line
    assert any("promotion without a grace period: in sync" in x for x in cluster.servers[1].lines)
    assert status["grace_remaining_ms"] == 0, status
    assert after_promotion < 0.5, f"free lock granted {after_promotion:.2f} s after promotion"


def test_promotion_keeps_the_grace_after_async(cluster):
    # the standby of an asynchronous primary may lack grants the primary acknowledged: grace
    status, after_promotion, line = run(_first_free_grant_after_kill(cluster, []))
    assert "no new grants for 2000 ms (grace)" in line, line
    assert status["grace_remaining_ms"] > 0, status
    assert after_promotion > 1.0, f"free lock granted {after_promotion:.2f} s after promotion (grace is 2 s)"


@pytest.mark.parametrize("policy", ["fence", "degrade"])
def test_a_stopped_standby_holds_grants_then_the_policy_applies(cluster, policy):
    # no --failover-after: the heartbeat fence stays off, so only --sync-timeout acts
    primary = cluster.primary(args=[*SYNC, "--sync-timeout", "0.5", "--sync-on-timeout", policy])
    standby = cluster.standby(primary.address, args=SYNC)

    async def main() -> None:
        node = await RawNode.open(primary.address)
        await poll(lambda: status_of(primary.address), lambda st: sync_state(st) == "in_sync", timeout=10,
                   what="in sync")
        token, _, owner = await node.acquire("a", 30_000)  # acknowledged with the standby's ack
        standby.pause()
        try:
            acquire = asyncio.ensure_future(node.acquire("b", 30_000))
            done, _ = await asyncio.wait({acquire}, timeout=0.3)
            assert not done, "a grant was acknowledged while the standby was stopped"
            if policy == "fence":
                with pytest.raises(Unavailable, match="synchronous replication"):
                    await asyncio.wait_for(acquire, 5)
                st = await status_of(primary.address)
                assert sync_state(st) == "held" and st["replication"]["sync"]["holds"] == 1, st
                with pytest.raises(Unavailable, match="synchronous standby"):
                    await asyncio.wait_for(node.acquire("c", 30_000), 2)  # refused at once while held
                with pytest.raises(Unavailable, match="synchronous replication"):
                    await asyncio.wait_for(node.extend("a", token, owner, 30_000), 2)
                await node.release("a", token, owner)  # a release does not wait
            else:
                await asyncio.wait_for(acquire, 5)  # acknowledged without the standby
                st = await status_of(primary.address)
                assert sync_state(st) == "degraded" and st["replication"]["sync"]["degradations"] == 1, st
                await log_line(primary, r"DEGRADED to asynchronous", 5)
                await asyncio.wait_for(node.acquire("c", 30_000), 2)  # no wait while degraded
        finally:
            standby.resume()
        await poll(lambda: status_of(primary.address), lambda st: sync_state(st) == "in_sync", timeout=10,
                   what="back in sync after the standby resumed")
        await asyncio.wait_for(node.acquire("d", 30_000), 5)
        await node.close()

    run(main(), timeout=40)


def run_fastlock(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "fastlock", *args], capture_output=True, text=True, timeout=30,
                          env=full)


@pytest.mark.parametrize("argv, env, needle", [
    (["--replication", "semi"], {}, "--replication: invalid choice"),
    (["--sync-ack", "received"], {}, "--sync-ack: invalid choice"),
    (["--sync-timeout", "0"], {}, "--sync-timeout"),
    (["--sync-timeout", "-1"], {}, "--sync-timeout"),
    (["--sync-on-timeout", "ignore"], {}, "--sync-on-timeout: invalid choice"),
    ([], {"FASTLOCK_REPLICATION": "both"}, "$FASTLOCK_REPLICATION: --replication"),
])
def test_bad_sync_settings_are_usage_errors(tmp_path, argv, env, needle):
    out = run_fastlock("serve", "--data-dir", str(tmp_path), *argv, "--print-config", env=env)
    assert out.returncode == 2 and needle in out.stderr, out.stderr


def test_sync_settings_check_their_values():
    with pytest.raises(ValueError, match="replication must be one of"):
        ServerConfig(replication="semi")
    with pytest.raises(ValueError, match="sync_ack must be one of"):
        ServerConfig(sync_ack="received")
    with pytest.raises(ValueError, match="sync_timeout_ms must be a positive integer"):
        ServerConfig(sync_timeout_ms=0)
    assert ServerConfig().sync_settings() is None
    assert ServerConfig(replication="sync", sync_ack="written").sync_settings() == SyncSettings(SyncAck.WRITTEN)


def test_sync_ack_is_a_replicas_op_and_only_after_replicate(cluster):
    from fastlock import protocol as P
    from fastlock.errors import PermissionDenied, ProtocolError

    primary = cluster.primary(args=SYNC)

    async def main() -> None:
        client = await RawNode.open(primary.address)  # the admin principal: not a replica
        with pytest.raises(PermissionDenied):
            await asyncio.wait_for(client.request(P.OP_SYNC_ACK, 1), 5)
        await client.close()
        replica = await RawNode.open(primary.address, token=cluster.creds.token(cluster.replica_of("fake")))
        with pytest.raises((ProtocolError, ConnectionLost), match="SYNC_ACK before REPLICATE|closed|lost"):
            await asyncio.wait_for(replica.request(P.OP_SYNC_ACK, 10**9), 5)
        await replica.close()
        st = await status_of(primary.address)  # still serving, nothing acknowledged
        assert st["replication"]["sync"]["standby_acked_lsn"] == 0 and sync_state(st) == "not_in_sync", st

    run(main(), timeout=20)


# -- the gate alone (no processes): its bounds and its checks of SYNC_ACK ---------------------------

class _Gatehost:
    """The few parts of the server the sync gate reads."""

    def __init__(self):
        from types import SimpleNamespace

        from fastlock.roles import Role

        self.wal = SimpleNamespace(logged_lsn=0)
        self.roles = SimpleNamespace(role=Role.PRIMARY, grace_remaining_ms=lambda now: 0, expires_leases=True,
                                     set_sync_held=lambda held: None)
        self.timers: list = []
        self.loop = SimpleNamespace(call_later=lambda delay, fn: self.timers.append(fn) or SimpleNamespace(
            cancel=lambda: None))


def _gate(monkeypatch, waiting: int, settings: SyncSettings | None = None):
    from types import SimpleNamespace

    from fastlock.replication import syncrep

    monkeypatch.setattr(syncrep, "MAX_WAITING", waiting)
    host = _Gatehost()
    standby = SimpleNamespace(session=7, closed=False)
    source = SimpleNamespace(replicas={7: SimpleNamespace(conn=SimpleNamespace(closed=False, send=lambda m: None,
                                                                               flush=lambda: None))},
                             admit_sync_ack=lambda conn, lsn: True)  # the window rules: test_sync_ack_guard.py
    return syncrep.SyncGate(host, source, settings or SyncSettings()), host, standby


def test_the_gate_releases_in_lsn_order_and_bounds_what_waits(monkeypatch):
    gate, host, standby = _gate(monkeypatch, waiting=2)
    outcomes: list = []
    for lsn in (1, 2, 3):
        host.wal.logged_lsn = lsn
        gate.after(lambda error=None, lsn=lsn: outcomes.append((lsn, error)))()
    assert outcomes[0][0] == 3 and isinstance(outcomes[0][1], Unavailable)  # beyond the bound: refused at once
    assert "already wait" in str(outcomes[0][1]) and len(gate.waiting) == 2
    gate.on_ack(standby, 1)
    # in sync: the standby has everything a client was told of (LSN 2 waits, LSN 3 was refused)
    assert outcomes[1:] == [(1, None)] and gate.in_sync and gate.released_lsn == 1
    gate.on_ack(standby, 3)
    assert outcomes[2:] == [(2, None)] and gate.in_sync and gate.status()["state"] == "in_sync"


@pytest.mark.parametrize("lsn", [-1, 10**6, "1", None, 1.5])
def test_a_bad_sync_ack_is_a_protocol_error_and_changes_nothing(monkeypatch, lsn):
    from types import SimpleNamespace

    from fastlock.errors import ProtocolError

    gate, host, standby = _gate(monkeypatch, waiting=8)
    host.wal.logged_lsn = 5
    with pytest.raises(ProtocolError):
        gate.on_ack(standby, lsn)
    with pytest.raises(ProtocolError, match="before REPLICATE"):
        gate.on_ack(SimpleNamespace(session=99), 1)
    assert gate.acked_lsn == 0 and not gate.in_sync


def test_serve_alone_stops_waiting_for_a_stopped_sync_standby(cluster):
    from fastlock import protocol as P

    primary = cluster.primary(args=[*SYNC, "--sync-timeout", "0.3", "--sync-on-timeout", "fence"])
    standby = cluster.standby(primary.address, args=SYNC)

    async def main() -> None:
        node = await RawNode.open(primary.address)
        await poll(lambda: status_of(primary.address), lambda st: sync_state(st) == "in_sync", timeout=10,
                   what="in sync")
        standby.pause()
        try:
            with pytest.raises(Unavailable):
                await asyncio.wait_for(node.acquire("a", 30_000), 5)
            await asyncio.wait_for(node.request(P.OP_SERVE_ALONE), 5)  # the operator's word
            await asyncio.wait_for(node.acquire("b", 30_000), 5)  # granted without the standby
            st = await status_of(primary.address)
            assert sync_state(st) == "degraded", st
        finally:
            standby.resume()
        await node.close()

    run(main(), timeout=30)


@pytest.mark.parametrize("heard", [True, False], ids=["standby-hears", "standby-silent"])
def test_a_degrade_acknowledges_nothing_until_a_paired_standby_heard_it(monkeypatch, heard):
    """A paired standby with a failover window, last told "in sync", may promote without a
    grace period: a degrading primary holds the replies until the standby echoes a heartbeat
    sent after the "not in sync" status, and fails them a further --sync-timeout later."""
    from fastlock.replication import syncrep

    clock = [1_000]
    monkeypatch.setattr(syncrep, "monotonic_ms", lambda: clock[0])
    gate, host, standby = _gate(monkeypatch, waiting=8)
    gate.source.fencing = True  # paired with a standby that fails over by itself
    outcomes: list = []

    def grant(lsn: int) -> None:
        host.wal.logged_lsn = lsn
        gate.after(lambda error=None: outcomes.append((lsn, error)))()

    grant(1)
    gate.on_ack(standby, 1)
    assert gate.in_sync and gate.status_push() is not None  # the standby is told "in sync"
    grant(2)
    clock[0] += 2_000  # --sync-timeout (2 s) without an acknowledgement
    host.timers.pop()()
    st = gate.status()
    assert st["state"] == "degraded" and st["standby_heard_degrade"] is False, st
    assert outcomes == [(1, None)]  # LSN 2 still waits: the standby may believe it is in sync
    gate.on_contact(clock[0] - 1)  # an echo of a heartbeat sent before the degrade proves nothing
    assert outcomes == [(1, None)]
    if heard:
        gate.on_contact(clock[0] + 1)
        assert outcomes == [(1, None), (2, None)] and gate.status()["standby_heard_degrade"]
        grant(3)  # degraded and heard: acknowledged at once
        assert outcomes[-1] == (3, None)
    else:
        clock[0] += 2_000  # another --sync-timeout: the silent standby is fenced against anyway
        host.timers.pop()()
        assert outcomes[-1][0] == 2 and isinstance(outcomes[-1][1], Unavailable)
        assert "has not confirmed" in str(outcomes[-1][1])


@pytest.mark.parametrize("attached", [False, True], ids=["no-standby", "standby-silent"])
def test_a_strict_hold_names_a_missing_standby_as_missing(monkeypatch, caplog, attached):
    """--sync-on-timeout fence: the first grant waits --sync-timeout, then the hold's reason
    (held_because, the CRITICAL log) says whether no standby is attached or the attached one is silent."""
    from fastlock.replication import syncrep
    from fastlock.replication.syncrep import SyncOnTimeout

    clock = [1_000]
    monkeypatch.setattr(syncrep, "monotonic_ms", lambda: clock[0])
    gate, host, _ = _gate(monkeypatch, waiting=8, settings=SyncSettings(on_timeout=SyncOnTimeout.FENCE))
    if not attached:
        gate.source.replicas = {}
    outcomes: list = []
    host.wal.logged_lsn = 4
    gate.after(lambda error=None: outcomes.append(error))()
    assert outcomes == [] and gate.status()["state"] != "held"  # the grant waits --sync-timeout first
    clock[0] += 2_000
    with caplog.at_level("CRITICAL", logger=syncrep.__name__):
        host.timers.pop()()
    assert len(outcomes) == 1 and isinstance(outcomes[0], Unavailable)
    why = gate.status()["held_because"]
    critical = [r.getMessage() for r in caplog.records if r.levelname == "CRITICAL"]
    assert len(critical) == 1 and why in critical[0]
    if attached:
        assert why.startswith("the standby has not acknowledged LSN 4") and "(it has LSN 0)" in why, why
    else:
        assert why.startswith("no standby is attached") and "the standby has not" not in why, why
