"""The sharded nemesis in CI: three etcd-arbitrated shard groups (a primary and a standby
each, one etcd holding the map), routing clients over all of them, faults against any group.

The short version of ``python -m benches.shard_nemesis`` (see its docstring for the
deployment, the workers and the checks): one fault of each of ``kill``, ``pause`` and
``partition``, each against a group the seeded RNG picks, and one ``move-kill`` (a slot move
whose source's or destination's primary is killed while it runs, then resumed), 3 W3 workers (contended
``lock()`` hand-offs with fenced writes), 1 W2 worker (acquire+release pairs) and the
prober.  ``FASTLOCK_SHARD_NEMESIS_SECONDS=120`` runs every kind of fault for that many
seconds instead.  Skipped without the etcd binary unless FASTLOCK_REQUIRE_ETCD=1.

Asserted: the run did what it claims (every fault kind, a promotion after each, every
group healthy again, grants in every group, fenced writes); safety strictly (no token
granted twice, tokens never backwards per name in the grants or the store, no overlapping
critical sections); and no lease lost by a ``lock()`` holder, no error surfaced to worker
code, no wait that ran out, no grant of an older epoch after a promotion.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from benches.nemesis import NemesisConfig  # noqa: E402
from benches.nemesis.cluster import Fault  # noqa: E402
from benches.nemesis.report import granted_before_fence, struck  # noqa: E402
from benches.shard_nemesis import SHARD_KINDS, print_shard_report, run_shard_nemesis  # noqa: E402

SECONDS = os.environ.get("FASTLOCK_SHARD_NEMESIS_SECONDS")
SHORT_KINDS = ("kill", "pause", "partition", "move-kill")


def _config() -> NemesisConfig:
    common = dict(seed=20261206, workers=3, locks=9, pair_workers=1, heal_timeout=30.0, group="etcd",
                  coordinator_ttl=2, shards=3, fsync="never")
    if SECONDS is None:
        return NemesisConfig(duration=60.0, max_faults=len(SHORT_KINDS), kinds=SHORT_KINDS, warmup=1.0, **common)
    return NemesisConfig(duration=float(SECONDS), kinds=SHARD_KINDS, **common)


@pytest.mark.timeout(300 if SECONDS is None else 200 + 2 * float(SECONDS))
def test_shard_nemesis_short_run(tmp_path):
    import etcdserver

    try:
        etcdserver.find_etcd()
    except etcdserver.EtcdUnavailable as exc:
        etcdserver.require_etcd(str(exc))
    pytest.importorskip("httpx")
    cfg = _config()
    report = run_shard_nemesis(cfg, str(tmp_path / "shard-nemesis"))
    print_shard_report(report)

    assert report["aborted"] is None, report["aborted"]
    assert {k.split("/")[0] for k in report["faults_by_kind"]} == set(cfg.kinds), report["faults_by_kind"]
    assert report["faults_without_promotion"] == []
    assert all(f["healthy_s"] is not None for f in report["fault_log"])
    assert report["grants"] >= 50 and report["store_rows"] >= 50
    assert set(report["grants_by_group"]) == {"g0", "g1", "g2"}, report["grants_by_group"]

    safety = report["safety"]
    assert safety["violations"] == 0, "\n".join(safety["store"] + safety["grants"])

    a = report["availability"]
    assert a["ttl_exceeds_failover_plus_request_timeout"]
    failures = {key: a[key] for key in ("leases_lost", "releases_failed_at_exit", "errors_surfaced", "waits_ran_out",
                                        "old_epoch_grants_after_promotion", "loop_errors") if a[key]}
    assert not failures, (failures, a["errors_by_op_and_type"], a["waits_ran_out_by_type"],
                          a["old_epoch_grant_samples"][:3])


def test_a_fault_of_one_group_exempts_and_counts_only_that_groups_grants():
    """A kill of g1's primary: a grant of g1 made as it died is exempt; a grant of g2 with
    a low epoch in the same window is not (g2's epochs are its own); an unsharded grant is."""
    kill = Fault(index=1, kind="kill", old_primary="g1a", at=5.0, new_epoch=3, fenced_s=0.0, group="g1")
    epoch = 1 << 40
    in_g1 = {"token": 2 * epoch + 1, "sent": 4.99, "at": 5.01, "group": "g1"}
    in_g2 = {"token": 2 * epoch + 1, "sent": 4.99, "at": 5.01, "group": "g2"}
    unsharded = {"token": 2 * epoch + 1, "sent": 4.99, "at": 5.01}
    assert granted_before_fence(in_g1, [kill]) and struck(kill, in_g1)
    assert not granted_before_fence(in_g2, [kill]) and not struck(kill, in_g2)
    assert granted_before_fence(unsharded, [kill])
    deployment = Fault(index=2, kind="etcd-restart", old_primary="g0a", at=5.0)  # no group: strikes all
    assert struck(deployment, in_g2)


# --------------------------------------------------------------------------- found by the nemesis


async def test_a_lock_context_of_the_routing_client_follows_a_moved_name(groups):
    """``client.lock()`` of a ShardedClient routes when it runs: a lease held across a move of its
    slot is released at the exit on the new group, and a later ``lock()`` of the name goes there."""
    from fastlock._testbase.shards import names_owned_by
    from fastlock.sharding import slot_of

    name = names_owned_by(groups.shard_map, "g0", 1, "ctx")[0]
    async with groups.connect() as client:
        async with client.lock(name, ttl=10) as lease:
            await groups.move(str(slot_of(name)), "g1")
        assert not lease.lost.is_set()  # the exit's release reached g1
        async with client.lock(name, ttl=5) as again:
            assert again.fencing_token > lease.fencing_token
        assert not again.lost.is_set()


def _maps(name: str):
    from fastlock.sharding import ShardGroup, ShardMap, SlotRange, slot_of

    groups = (ShardGroup("g0", ("127.0.0.1:1",)), ShardGroup("g1", ("127.0.0.1:2",)))
    slot = slot_of(name)
    assert 0 < slot < 16383
    before = ShardMap(1, groups, (SlotRange(0, 16383, "g0"),))
    after = ShardMap(3, groups, (SlotRange(0, slot - 1, "g0"), SlotRange(slot, slot, "g1"),
                                 SlotRange(slot + 1, 16383, "g0")))
    return before, before.with_epoch(2), after


class _GroupClient:
    """A group's client that answers ``acquire`` from a script (a value, or an error to raise)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls = 0
        self.connector = types.SimpleNamespace(addresses=[])  # a new map's addresses are set here

    async def acquire(self, name, **kwargs):
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def close(self):
        pass


def _routing_client(shard_map, clients, reads, monkeypatch):
    import fastlock.client.sharded as sharded
    from fastlock.client import Client

    served = list(reads)

    async def read_shard_map(client, timeout=5.0):
        return "g?", served.pop(0) if len(served) > 1 else served[0]

    monkeypatch.setattr(sharded, "read_shard_map", read_shard_map)
    routing = sharded.ShardedClient(Client(["127.0.0.1:1"], session=False), "g0", shard_map, lambda a: None)
    routing._clients.update(clients)
    routing.edges.deadlock_timeout = None  # the fake group clients answer no deadlock probe
    return routing


async def test_a_redirect_waits_for_its_owner_to_serve_the_redirects_epoch(monkeypatch):
    """g0 has flipped a move (epoch 3) and redirects to g1, which still serves the marked map (epoch 2):
    the client reads g1's map again until it is epoch 3, then acquires at g1."""
    from fastlock.errors import WrongShard

    before, marked, after = _maps("moved-name")
    g0 = _GroupClient(WrongShard("moved", 1, "g1", ("127.0.0.1:2",), 3))
    g1 = _GroupClient("lease")
    routing = _routing_client(before, {"g0": g0, "g1": g1}, [marked, marked, after], monkeypatch)
    assert await routing.acquire("moved-name", ttl=5) == "lease"
    assert routing.shard_map.epoch == 3 and (g0.calls, g1.calls) == (1, 1)


async def test_a_node_behind_the_clients_map_is_asked_again(monkeypatch):
    """The client reads epoch 3 (the name is g1's); g1 has not read the flip yet and redirects with
    epoch 2: the client asks g1 again instead of failing."""
    from fastlock.errors import WrongShard

    _before, _marked, after = _maps("moved-name")
    g1 = _GroupClient(WrongShard("not yet", 1, "g0", ("127.0.0.1:1",), 2), "lease")
    routing = _routing_client(after, {"g0": _GroupClient(), "g1": g1}, [after], monkeypatch)
    assert await routing.acquire("moved-name", ttl=5) == "lease"
    assert g1.calls == 2
    # a redirect of the same epoch that names no other owner is the caller's error, at once
    g1.answers = [WrongShard("no", 1, "g0", ("127.0.0.1:1",), 3)]
    with pytest.raises(WrongShard):
        await routing.acquire("moved-name", ttl=5)


async def test_a_call_follows_a_name_that_moves_on_while_it_follows(monkeypatch):
    """The client's map says g0; g0 redirects to g1 (the move to g1 flipped), whose map has the slot
    marked moving on to g2; g1 then redirects to g2 (that move flipped too): the call follows to g2."""
    from fastlock.errors import WrongShard
    from fastlock.sharding import ShardGroup, ShardMap, SlotRange, slot_of

    groups = tuple(ShardGroup(f"g{k}", (f"127.0.0.1:{k + 1}",)) for k in range(3))
    slot = slot_of("moved-name")

    def owned_by(epoch: int, group: str) -> ShardMap:
        return ShardMap(epoch, groups, (SlotRange(0, slot - 1, "g0"), SlotRange(slot, slot, group),
                                        SlotRange(slot + 1, 16383, "g0")))

    g0 = _GroupClient(WrongShard("moved", slot, "g1", ("127.0.0.1:2",), 3))
    g1 = _GroupClient(WrongShard("moved on", slot, "g2", ("127.0.0.1:3",), 5))
    g2 = _GroupClient("lease")
    routing = _routing_client(owned_by(1, "g0"), {"g0": g0, "g1": g1, "g2": g2},
                              [owned_by(3, "g1"), owned_by(5, "g2")], monkeypatch)
    assert await routing.acquire("moved-name", ttl=5) == "lease"
    assert (g0.calls, g1.calls, g2.calls) == (1, 1, 1) and routing.shard_map.epoch == 5
