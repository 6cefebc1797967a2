"""The sharded nemesis: three etcd-arbitrated shard groups, each a primary and a standby,
under a cycle of faults against any group, clients routing over all of them.

    python -m benches.shard_nemesis --duration S [--seed N] [--shards 3] [--workers 4]
        [--pair-workers 2] [--ttl 8] [--wait 20] [--coordinator-ttl 2] [--promotion-grace 2]
        [--kinds kill,pause,...] [--max-faults N] [--json PATH] [--keep DIR]
    python -m benches.shard_nemesis --report DIR     # the report of a run kept with --keep DIR

The deployment
--------------
One throwaway etcd member (``tests/etcdserver.py``) holds the shard map, in the key
``PREFIX/shard-map`` (epoch 1, the 16384 slots split evenly over groups ``g0``, ``g1``,
``g2``, each naming its two nodes' addresses), written with
:meth:`fastlock.coordination.shardmap.EtcdShardMap.create` before any node starts.  Each
group is two ``fastlock serve`` processes, ``gKa`` and ``gKb``, on fixed free loopback ports,
each started with ``--coordinator etcd://PROXY/PREFIX/gK`` (the group's own election key),
``--shard-map etcd://PROXY/PREFIX --shard-group gK``, ``--coordinator-ttl T`` and
``--promotion-grace G``, where PROXY is the node's own :class:`fastlock._testbase.TcpProxy`
to etcd, so one node can be cut off from etcd (its election and its map watch) alone.
``gKa`` starts first and takes its group's key; ``gKb`` follows it as a standby.

The workers are :mod:`benches.nemesis`'s processes, connected with ``fastlock.connect`` to
``g0``'s two addresses: each reads the map and routes every name to its group's primary
(:class:`fastlock.client.sharded.ShardedClient`, one client per group):

* W3, ``--workers`` processes: contended hand-offs on ``--locks`` names ``acct/I`` (default
  three per worker, spread over the groups by their slots) through ``client.lock()``, with
  fenced writes to one SQLite store while holding (see :mod:`benches.nemesis`);
* W2, ``--pair-workers`` processes: ``acquire`` + ``release`` pairs, one every 20 ms, on
  16 names of their own each (``pairs/I/K``, spread over the groups);
* the prober: one fresh name every 50 ms (so each group sees a probe about every 150 ms).

Every grant a worker logs names the group the client routed it to.

The nemesis
-----------
Faults are :mod:`benches.nemesis`'s etcd-group kinds (``GROUP_KINDS``), one at a time, each
against the group a seeded RNG picks (``etcd-restart`` strikes every group at once):

``kill``          SIGKILL the group's primary, restart it after 0-1.5 s with the same flags;
``pause``         SIGSTOP it until its standby is primary at a higher epoch, plus 0-1 s;
``partition``     cut its link to etcd (black hole or reset) until its standby is primary;
``kill-standby``  SIGKILL the group's standby, restart it after 0-1.5 s;
``etcd-restart``  SIGKILL etcd and start it again on the same ports and data;
``move``          a slot move under the load, from a random group to another: the shortest run
                  of the source's slots holding two of the W3 names (leases held, waiters
                  queued), else one such slot, moved as ``fastlock shard move --slots A-B --to G``
                  moves it (:func:`fastlock.cli.shardmove.move_slots`, in the controller, as the
                  admin); a move that fails ends the run;
``move-kill``     the same move, with the primary of its source or destination SIGKILLed
                  0.05-0.4 s after the move starts and restarted 0-1.5 s later; a move the
                  kill stopped is run again (at most twice), as an operator resumes one.

After each fault the controller waits (``--heal-timeout``) until EVERY group is healthy
(its primary holds the key, may grant and is past its grace; its standby is synced) and
the prober was granted something since.  Faults run one at a time: a move is not combined
with a kill or a pause of its source or destination here.

Checks
------
The checks of :mod:`benches.nemesis` (:mod:`fastlock._testbase.history`), per lock name,
over the grants of every group: no token granted twice, no grant sent after another grant
of the name was received carrying a lower token (tokens rise per name across groups and
failovers), the fenced store's accepted writes never go backwards and no two critical
sections overlap; the prober's fresh names are checked as one sequence per group.  The
availability figures (lost leases, errors surfaced to worker code, waits that ran out,
grants of an older epoch after a promotion) follow the same rules, except that a fault of
one group exempts or counts only grants of that group, and the windows without a grant
after a fault are measured over the struck group's grants.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import logging
import os
import shlex
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from benches.nemesis.cluster import GROUP_KINDS, Fault, Nemesis, NemesisConfig, run_nemesis
from benches.nemesis.report import NO_FAILOVER_KINDS, _read_events, _s, build_report, print_report
from fastlock.sharding import slot_of

#: fault kinds of the sharded nemesis: the etcd group's, and a slot move
SHARD_KINDS = (*GROUP_KINDS, "move", "move-kill")
#: the slot moves of a run, kept next to nemesis-run.json
MOVES = "moves.json"
#: fault kinds that strike the whole deployment rather than one group
DEPLOYMENT_KINDS = ("etcd-restart",)


async def _write_map(url: str, shard_map) -> None:
    from fastlock.coordination.shardmap import load_from_etcd

    stored = await load_from_etcd(url)
    try:
        await stored.create(shard_map)
    finally:
        await stored.gateway.close()


async def _move(url: str, first: int, last: int, to: str) -> dict:
    from fastlock.cli.shardmove import move_slots
    from fastlock.coordination.shardmap import load_from_etcd

    stored = await load_from_etcd(url)
    try:
        return (await move_slots(stored, first, last, to)).as_dict()
    finally:
        await stored.gateway.close()


async def _read_map(url: str):
    from fastlock.coordination.shardmap import load_from_etcd

    stored = await load_from_etcd(url)
    try:
        found = await stored.read()
    finally:
        await stored.gateway.close()
    if found is None:
        raise RuntimeError(f"no shard map at {url}")
    return found[0]


@dataclasses.dataclass
class SlotMove:
    """One ``fastlock shard move`` the controller ran; ``started``/``ended`` are
    ``time.monotonic()`` seconds, ``report`` the command's JSON (its MoveReport)."""

    first: int
    last: int
    source: str
    to: str
    started: float = 0.0
    ended: float = 0.0
    report: dict | None = None
    error: str = ""

    def summary(self) -> str:
        what = f"slots {self.first}-{self.last} {self.source}->{self.to}"
        if self.report is None:
            return f"{what}: FAILED ({self.error[-160:]})"
        r = self.report
        return (f"{what}: {r.get('leases')} leases, {r.get('queues')} queues, freeze {r.get('freeze_ms') or 0:.0f} ms, "
                f"epoch {r.get('epoch')}")


class ShardNemesis(Nemesis):
    """:class:`benches.nemesis.Nemesis` over ``cfg.shards`` etcd groups of two nodes each.

    :attr:`nodes` holds every node (its logs, its stop); while a fault strikes group G,
    :attr:`nodes` and :attr:`primary` are G's, so that the etcd group's fault code
    (:meth:`Nemesis.inject_group`) runs against G unchanged.
    """

    def __init__(self, cfg: NemesisConfig, root: Path, *, new: bool = True):
        super().__init__(cfg, root, new=new)
        self.all_nodes = dict(self.nodes)
        #: group name -> its nodes, the first started as its primary
        self.shard_groups = {f"g{k}": [self.nodes[f"g{k}a"], self.nodes[f"g{k}b"]] for k in range(cfg.shards)}
        self.primaries = {g: nodes[0] for g, nodes in self.shard_groups.items()}
        self.focus: str | None = None  # the group a fault is striking
        self.shard_map = None  # the map in etcd, as last read
        self.map_url = ""  # etcd://ETCD/PREFIX, etcd itself (not a node's proxy)
        self.moves: list[SlotMove] = []

    def stop_all(self) -> None:
        """Stop every group's nodes (not only the group a fault strikes), the workers and proxies."""
        self.nodes = self.all_nodes
        super().stop_all()

    def node_names(self) -> tuple[str, ...]:
        return tuple(f"g{k}{n}" for k in range(self.cfg.shards) for n in "ab")

    # -- set-up ---------------------------------------------------------------------------
    def start_cluster(self) -> None:
        from fastlock._testbase import TcpProxy, free_port
        from fastlock.sharding import ShardGroup, ShardMap, even_ranges

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from etcdserver import EtcdServer, unique_prefix

        self.etcd = EtcdServer().start()
        prefix = unique_prefix()
        for node in self.all_nodes.values():
            node.port = free_port()
        groups = tuple(ShardGroup(g, tuple(n.address for n in nodes)) for g, nodes in self.shard_groups.items())
        self.shard_map = ShardMap(1, groups, even_ranges([g.name for g in groups]))
        self.map_url = f"etcd://{self.etcd.address}{prefix}"
        asyncio.run(_write_map(self.map_url, self.shard_map))
        for group, nodes in self.shard_groups.items():
            for node in nodes:
                node.proxy = TcpProxy(self.etcd.address).start()
                node.coordinator = f"etcd://{node.proxy.address}{prefix}/{group}"
                node.extra_args = ["--shard-map", f"etcd://{node.proxy.address}{prefix}", "--shard-group", group]
        for nodes in self.shard_groups.values():
            nodes[0].start(None)
        for nodes in self.shard_groups.values():  # gKa takes its group's key first
            nodes[0].proc.wait_for_log(r"PROMOTED", 20)
            nodes[1].start(None)
        self.primary, self.standby = self.shard_groups["g0"]

    def start_workers(self) -> None:
        # the workers connect to g0's nodes only: a client's seed connection is one group's
        saved = self.nodes
        self.nodes = {n.name: n for n in self.shard_groups["g0"]}
        try:
            super().start_workers()
        finally:
            self.nodes = saved

    # -- health and faults --------------------------------------------------------------------
    def healthy(self, since: float) -> tuple[bool, str]:
        """Every group healthy (:meth:`Nemesis.group_state`) and a probe granted since ``since``."""
        for group, nodes in self.shard_groups.items():
            primary = self.primary if group == self.focus else self.primaries[group]
            ok, why = self.group_state(primary, nodes)
            if not ok and group != self.focus:
                # a group the fault did not aim at may have failed over all the same (an etcd restart)
                for node in nodes:
                    if node is not primary and (node.status() or {}).get("role") == "primary":
                        self.primaries[group] = primary = node
                        ok, why = self.group_state(primary, nodes)
            if not ok:
                return False, f"group {group}: {why}"
        if self.last_probe_grant() <= since:
            return False, "the prober was granted nothing since the fault ended"
        return True, "healthy"

    def find_primaries(self) -> None:
        """Follow failovers no fault caused (the load's, a move's): each group's one node that
        answers as its primary becomes :attr:`primaries`' entry."""
        for group, nodes in self.shard_groups.items():
            found = [n for n in nodes if (n.status() or {}).get("role") == "primary"]
            if len(found) == 1:
                self.primaries[group] = found[0]

    # -- slot moves ------------------------------------------------------------------------------
    def read_map(self):
        """The shard map in etcd now (:attr:`shard_map` is set to it)."""
        self.shard_map = asyncio.run(_read_map(self.map_url))
        return self.shard_map

    def plan_move(self, source: str, names: list[str]) -> tuple[int, int]:
        """Slots to move out of ``source``: the shortest run of its slots that holds two of
        ``names`` (the W3 workers' contended names: held leases and waiters), else the slot
        of one of them, else ``source``'s first slot."""
        shard_map = self.shard_map
        slots = sorted({slot_of(n) for n in names if shard_map.owner(n).name == source})

        def movable(first: int, last: int) -> bool:
            return all(shard_map.owner_of_slot(s).name == source and shard_map.moving_to_of_slot(s) is None
                       for s in range(first, last + 1))

        pairs = sorted(zip(slots, slots[1:]), key=lambda p: p[1] - p[0])
        for first, last in pairs:
            if movable(first, last):
                return first, last
        for slot in slots:
            if movable(slot, slot):
                return slot, slot
        first = next(r.first for r in shard_map.ranges if r.group == source)
        return first, first

    def move(self, first: int, last: int, to: str, timeout: float = 90.0) -> SlotMove:
        """Move slots ``first..last`` to group ``to`` as ``fastlock shard move --slots FIRST-LAST
        --to TO`` does (:func:`fastlock.cli.shardmove.move_slots`, in this process, as the admin,
        against etcd), given ``timeout`` seconds; recorded in :attr:`moves` (monotonic times),
        :attr:`shard_map` read again after."""
        source = self.shard_map.owner_of_slot(first).name
        record = SlotMove(first, last, source, to, started=time.monotonic())
        saved = os.environ.get("FASTLOCK_TOKEN_FILE")
        os.environ["FASTLOCK_TOKEN_FILE"] = self.creds.token_file("admin")
        try:
            record.report = asyncio.run(asyncio.wait_for(_move(self.map_url, first, last, to), timeout))
        except Exception as exc:  # noqa: BLE001 - recorded: the run is aborted with it
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            if saved is None:
                os.environ.pop("FASTLOCK_TOKEN_FILE", None)
            else:
                os.environ["FASTLOCK_TOKEN_FILE"] = saved
        record.ended = time.monotonic()
        self.moves.append(record)
        self.read_map()
        return record

    def inject_move(self) -> Fault:
        """A slot move (:meth:`plan_move`) from a random group to another, under the load."""
        source = self.rng.choice(sorted(self.shard_groups))
        to = self.rng.choice(sorted(g for g in self.shard_groups if g != source))
        p = self.primaries[source]
        fault = Fault(index=len(self.faults) + 1, kind="move", old_primary=p.name, new_primary=p.name, group=source)
        self.faults.append(fault)
        self.read_map()
        first, last = self.plan_move(source, [f"acct/{i}" for i in range(self.cfg.locks or 2 * self.cfg.workers)])
        fault.at = time.monotonic()
        record = self.move(first, last, to)
        fault.ended_s = record.ended - fault.at
        fault.note = record.summary()
        fault.repaired_s = fault.ended_s
        healthy_at = self.wait_healthy(record.ended, self.cfg.heal_timeout)
        fault.healthy_s = None if healthy_at is None else healthy_at - fault.at
        if record.error and not self.aborted:
            self.aborted = f"slot move {record.first}-{record.last} {source}->{to} failed: {record.error}"
        return fault

    def inject_move_kill(self) -> Fault:
        """A slot move with the primary of its source or destination SIGKILLed while it runs
        (0.05-0.4 s after it starts), restarted 0-1.5 s later; a move that failed is run
        again (at most twice), as an operator resumes one."""
        self.find_primaries()
        source = self.rng.choice(sorted(self.shard_groups))
        to = self.rng.choice(sorted(g for g in self.shard_groups if g != source))
        victim_group = self.rng.choice([source, to])
        p = self.primaries[victim_group]
        fault = Fault(index=len(self.faults) + 1, kind="move-kill", old_primary=p.name, new_primary=p.name,
                      group=victim_group)
        self.faults.append(fault)
        self.read_map()
        first, last = self.plan_move(source, [f"acct/{i}" for i in range(self.cfg.locks or 2 * self.cfg.workers)])
        st = p.status()
        old_epoch = st["epoch"] if st else 0
        records: list[SlotMove] = []
        mover = threading.Thread(target=lambda: records.append(self.move(first, last, to)), daemon=True)
        fault.at = time.monotonic()
        mover.start()
        time.sleep(self.rng.uniform(0.05, 0.4))
        p.proc.kill()
        time.sleep(self.rng.uniform(0.0, 1.5))
        p.start(None)
        self.focus, self.nodes, self.primary = victim_group, {n.name: n for n in self.shard_groups[victim_group]}, p
        try:
            self._group_promoted(fault, old_epoch)
        finally:
            self.primaries[victim_group] = self.primary
            self.nodes, self.focus = self.all_nodes, None
            fault.new_primary = self.primaries[victim_group].name
        mover.join(120)
        notes = [f"killed {p.name} ({'source' if victim_group == source else 'destination'})"]
        record = records[0] if records else None
        for _ in range(2):  # resume a move the kill stopped
            if record is not None and not record.error:
                break
            notes.append(f"move failed ({record.error[:120] if record else 'no result'}); run again")
            self.find_primaries()
            record = self.move(first, last, to)
        fault.ended_s = time.monotonic() - fault.at
        fault.note = "; ".join(notes + [record.summary() if record else "no move result"])
        fault.repaired_s = fault.ended_s
        healthy_at = self.wait_healthy(time.monotonic(), self.cfg.heal_timeout)
        fault.healthy_s = None if healthy_at is None else healthy_at - fault.at
        if (record is None or record.error) and not self.aborted:
            self.aborted = f"slot move {first}-{last} {source}->{to} not done after a kill and two resumes"
        return fault

    def inject(self, kind: str):
        if kind == "move":
            return self.inject_move()
        if kind == "move-kill":
            return self.inject_move_kill()
        group = "" if kind in DEPLOYMENT_KINDS else self.rng.choice(sorted(self.shard_groups))
        focus = group or "g0"
        self.find_primaries()
        self.focus = focus
        self.nodes = {n.name: n for n in self.shard_groups[focus]}
        self.primary = self.primaries[focus]
        try:
            fault = self.inject_group(kind)
        finally:
            self.primaries[focus] = self.primary
            self.nodes = self.all_nodes
            self.focus = None
        fault.group = group
        return fault

    def held_after_workers_stopped(self) -> list[dict] | str:
        """Locks some group's primary still shows held once every worker has stopped."""
        from fastlock import protocol as P
        from fastlock.cli.admin import admin_request

        held = []
        try:
            self.read_map()
            self.find_primaries()
            for i in range(self.cfg.locks or 2 * self.cfg.workers):
                name = f"acct/{i}"
                node = self.primaries[self.shard_map.owner(name).name]
                if node.proc is None or not node.proc.alive:
                    held.append({"lock": name, "unknown": f"{node.name} not running"})
                    continue
                info = admin_request(("127.0.0.1", node.port), None, P.OP_HOLDER, name, reply_timeout=2.0)
                if info:
                    held.append({"lock": name, **{k: info.get(k) for k in ("token", "client", "remaining_ms")}})
        except Exception as exc:  # noqa: BLE001 - reported instead
            return f"{type(exc).__name__}: {exc}"
        return held

    def run(self) -> None:
        super().run()
        if self.faults:
            last = self.faults[-1]
            self.log.info("last fault %d %s on %s: healthy %s", last.index, last.kind, last.group or "all",
                          _s(last.healthy_s))


def run_shard_nemesis(cfg: NemesisConfig, root: str | None = None) -> dict:
    """Run the sharded nemesis (see the module docstring); its report (a dict, as
    :func:`benches.nemesis.run_nemesis`'s, plus ``faults_by_group``).  ``root``: a directory
    kept afterwards (else a temporary one, removed)."""
    return run_nemesis(cfg, root, nemesis=ShardNemesis, prefix="fastlock-shard-nemesis-", report=_report)


def _report(nem: Nemesis, elapsed: float) -> dict:
    """The sharded run's report: :func:`build_report`'s, per group; the moves are also kept
    in the run's directory (``MOVES``)."""
    assert isinstance(nem, ShardNemesis)
    (nem.root / MOVES).write_text(json.dumps([dataclasses.asdict(m) for m in nem.moves], indent=1))
    report = build_report(nem, elapsed)
    by_group: dict[str, int] = {}
    for f in nem.faults:
        by_group[f.group or "all"] = by_group.get(f.group or "all", 0) + 1
    report["faults_by_group"] = by_group
    report["shards"] = nem.cfg.shards
    report["moves"] = [dataclasses.asdict(m) for m in getattr(nem, "moves", [])]
    # promotions the servers logged before the run stopped, beyond each group's first: the faults'
    # and any the load caused
    offset = time.time() - time.monotonic()
    promotions = 0
    for name in nem.all_nodes:
        path = nem.root / f"{name}.log"
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                if "PROMOTED to primary" in line:
                    at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() - offset
                    promotions += not nem.stopped_at or at < nem.stopped_at
    report["promotions_after_start"] = promotions - nem.cfg.shards
    report["faults_that_promoted"] = sum(1 for f in nem.faults if f.promoted_s is not None)
    cfg = nem.cfg
    grants = [e for e in _read_events(nem.root, cfg.workers + 1 + cfg.pair_workers) if e["ev"] == "grant"]
    report["grants_by_group"] = dict(sorted(Counter(g.get("group", "-") for g in grants).items()))
    return report


def print_shard_report(report: dict) -> None:
    """:func:`benches.nemesis.print_report`, then the faults per group."""
    print_report(report)
    cfg = report["config"]
    print(f"  shard groups: {report['shards']} (a primary and a standby each, coordinator_ttl "
          f"{cfg['coordinator_ttl']} s); W3 workers {cfg['workers']}, W2 workers {cfg['pair_workers']}; "
          f"faults by group: " + ", ".join(f"{g} {n}" for g, n in sorted(report["faults_by_group"].items())))
    print("  grants by group: " + ", ".join(f"{g} {n}" for g, n in report["grants_by_group"].items()))
    for m in report["moves"]:
        print(f"  move: {SlotMove(**m).summary()} ({m['ended'] - m['started']:.2f} s)")
    print(f"  promotions after the start: {report['promotions_after_start']} (faults followed by a promotion: "
          f"{report['faults_that_promoted']}; the rest: failovers the load or an etcd restart caused)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.shard_nemesis", description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds during which faults are started")
    ap.add_argument("--seed", type=int, default=NemesisConfig.seed)
    ap.add_argument("--shards", type=int, default=3, help="shard groups (a primary and a standby each)")
    ap.add_argument("--workers", type=int, default=4, help="W3 worker processes (contended hand-offs)")
    ap.add_argument("--pair-workers", type=int, default=2, help="W2 worker processes (acquire+release pairs)")
    ap.add_argument("--locks", type=int, default=0, help="W3 lock names (default: three per W3 worker)")
    ap.add_argument("--ttl", type=float, default=8.0, help="lock() TTL, seconds")
    ap.add_argument("--wait", type=float, default=20.0, help="lock() wait, seconds")
    ap.add_argument("--request-timeout", type=float, default=5.0, help="the clients' request_timeout, seconds")
    ap.add_argument("--coordinator-ttl", type=int, default=2,
                    help="the nodes' --coordinator-ttl, whole seconds (1 s loses leases to load alone on 2 cores)")
    ap.add_argument("--promotion-grace", type=float, default=2.0, help="seconds")
    ap.add_argument("--kinds", default="", help=f"fault kinds (default: {','.join(SHARD_KINDS)})")
    ap.add_argument("--max-faults", type=int, default=0)
    ap.add_argument("--heal-timeout", type=float, default=30.0, help="seconds for every group to heal after a fault")
    ap.add_argument("--fsync", default="always", choices=("always", "interval", "never"))
    ap.add_argument("--server-args", default="", metavar="FLAGS", help="more `fastlock serve` flags, one string")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    ap.add_argument("--keep", metavar="DIR", help="keep data dirs, logs and event logs in DIR")
    ap.add_argument("--report", metavar="DIR", help="only print the report of a run kept with --keep DIR")
    args = ap.parse_args(argv)
    if args.report:
        nem, elapsed = ShardNemesis.load(args.report)
        if (Path(args.report) / MOVES).exists():
            nem.moves = [SlotMove(**m) for m in json.loads((Path(args.report) / MOVES).read_text())]
        report = _report(nem, elapsed)
    else:
        kinds = tuple(k for k in args.kinds.split(",") if k) or SHARD_KINDS
        bad = [k for k in kinds if k not in SHARD_KINDS]
        if bad:
            ap.error(f"--kinds: unknown {bad}; choose from {','.join(SHARD_KINDS)}")
        if not 1 <= args.shards <= 16:
            ap.error("--shards: 1 to 16")
        cfg = NemesisConfig(duration=args.duration, seed=args.seed, workers=args.workers,
                            locks=args.locks or 3 * args.workers, ttl=args.ttl, wait=args.wait,
                            request_timeout=args.request_timeout, kinds=kinds, heal_timeout=args.heal_timeout,
                            fsync=args.fsync, max_faults=args.max_faults, promotion_grace=args.promotion_grace,
                            server_args=tuple(shlex.split(args.server_args)), group="etcd",
                            coordinator_ttl=args.coordinator_ttl, shards=args.shards,
                            pair_workers=args.pair_workers)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        report = run_shard_nemesis(cfg, args.keep)
    print_shard_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["safety"]["violations"] == 0 and not report["aborted"] else 1


__all__ = ["DEPLOYMENT_KINDS", "NO_FAILOVER_KINDS", "SHARD_KINDS", "ShardNemesis", "print_shard_report",
           "run_shard_nemesis"]

if __name__ == "__main__":
    sys.exit(main())
