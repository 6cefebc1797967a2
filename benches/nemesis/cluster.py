"""The nemesis's cluster, its fault cycle and its run (see :mod:`benches.nemesis`)."""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benches.nemesis.report import NO_FAILOVER_KINDS, _s, build_report
from benches.nemesis.workers import STORE_SCHEMA

KINDS = ("kill", "pause", "partition", "promote")
#: the fault kinds of ``--group etcd`` (three nodes arbitrated by etcd; see :mod:`benches.nemesis`)
GROUP_KINDS = ("kill", "pause", "partition", "kill-standby", "etcd-restart")
GROUPS = ("pair", "etcd")


@dataclasses.dataclass
class NemesisConfig:
    """A nemesis run's settings; times in seconds (see :mod:`benches.nemesis` for each choice)."""

    duration: float = 60.0          # s during which faults are started
    seed: int = 20261201
    failover_after: float = 1.0     # s, the standby's --failover-after
    promotion_grace: float = 2.0    # s, --promotion-grace (the writers fence, so a short grace is safe)
    workers: int = 6                # worker processes
    locks: int = 0                  # lock names (0: twice as many as workers)
    ttl: float = 8.0                # s, lock() TTL: > failover_after + request_timeout (see the docstring)
    wait: float = 20.0              # s, lock() wait: covers any allowed outage
    request_timeout: float = 5.0    # s, the clients' request_timeout (the library default)
    kinds: tuple = KINDS
    heal_timeout: float = 30.0      # s to become healthy after a fault
    promote_timeout: float = 15.0   # s for a promotion to show after a fault
    warmup: float = 2.0             # s of load before the first fault
    fsync: str = "always"
    max_faults: int = 0             # 0: no limit but --duration
    server_args: tuple = ()         # more `fastlock serve` flags for every node (e.g. --replication sync)
    group: str = "pair"             # pair: a and b, two-node failover; etcd: a, b, c under --coordinator
    coordinator_ttl: int = 1        # s, the nodes' --coordinator-ttl (group "etcd" only)
    shards: int = 0                 # etcd groups sharing the slots (benches.shard_nemesis); 0: one group
    pair_workers: int = 0           # W2 worker processes: acquire+release pairs on names of their own
    pair_pause: float = 0.02        # s between a W2 worker's pairs

    @property
    def failover_s(self) -> float:
        """Seconds from a dead primary to another node's promotion, at most: the
        standby's failover window (pair), or the etcd lease TTL (etcd)."""
        return float(self.coordinator_ttl) if self.group == "etcd" else self.failover_after


@dataclasses.dataclass
class Fault:
    """One injected fault and what followed it; ``*_s`` are seconds after :attr:`at`."""

    index: int
    kind: str
    mode: str = ""                  # partition: blackhole | reset
    group: str = ""                 # the shard group it struck (benches.shard_nemesis); "": the whole deployment
    old_primary: str = ""
    new_primary: str = ""
    at: float = 0.0                 # monotonic, the fault began
    promoted_s: float | None = None  # the standby logged PROMOTED, after the fault began
    fenced_s: float | None = None   # the old primary stopped granting (its log; 0 for a kill), see report.py
    new_epoch: int | None = None    # the epoch it logged
    ended_s: float | None = None    # SIGCONT / heal / promote returned
    repaired_s: float | None = None  # the old primary answered as a standby of the new one
    healthy_s: float | None = None
    first_grant_s: float | None = None  # the first grant any worker received after the fault began
    no_grant_s: float | None = None  # the longest window without any grant, from the fault until healthy
    note: str = ""


def _fastlock_env(extra_paths: list[str]) -> dict[str, str]:
    """The environment for subprocesses: the same fastlock package as this
    process (installed, or a source tree built in place), then ``extra_paths``."""
    import importlib.util

    env = dict(os.environ)
    spec = importlib.util.find_spec("fastlock")
    paths = []
    if spec is not None and spec.origin:
        paths.append(os.path.dirname(os.path.dirname(os.path.abspath(spec.origin))))
    paths += extra_paths
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


# =========================================================================== the cluster


class _Node:
    """One node slot: fixed port, data dir and proxy; a process when running.

    The proxy is what a partition cuts: in front of this node's port (pair:
    the standby's replication connection goes through it), or between this
    node and etcd (group "etcd": the node's ``--coordinator`` names it).
    """

    def __init__(self, name: str, root: Path, cfg: NemesisConfig, env: dict, auth_args: list[str],
                 admin_token: str):
        self.name = name
        self.auth_args = auth_args  # the credentials file and this node's replica token
        self.admin_token = admin_token  # status with replication details
        self.root = root
        self.cfg = cfg
        self.env = env
        self.data_dir = root / name
        self.port = 0
        self.proc = None  # ServerProcess
        self.proxy = None  # TcpProxy: to this node's port (pair), or to etcd (group "etcd")
        #: the port of this node's proxy (pair): the node is started with --reachable-as on it
        self.relay_port = 0
        self.coordinator: str | None = None  # etcd://PROXY/PREFIX (group "etcd")
        self.extra_args: list[str] = []  # more flags of this node alone (a shard's --shard-map, --shard-group)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, standby_of: _Node | None) -> None:
        from fastlock._testbase import ServerProcess, free_port

        args = ["--name", self.name, *self.auth_args, *self.cfg.server_args, *self.extra_args]
        if self.coordinator is None:  # pair: peers reach this node through its proxy
            self.relay_port = self.relay_port or free_port()
            args += ["--reachable-as", f"127.0.0.1:{self.relay_port}"]
        if self.coordinator is not None:  # the same flags at every (re)start, as a supervisor would
            args += ["--coordinator", self.coordinator, "--node-id", self.name,
                     "--coordinator-ttl", str(self.cfg.coordinator_ttl),
                     "--promotion-grace", f"{self.cfg.promotion_grace:g}"]
        elif standby_of is not None:
            args += ["--standby-of", standby_of.proxy.address, "--failover-after", f"{self.cfg.failover_after:g}",
                     "--promotion-grace", f"{self.cfg.promotion_grace:g}"]
        last: Exception | None = None
        for _ in range(5):  # the port may be briefly unavailable right after the old process died
            srv = ServerProcess(self.data_dir, fsync=self.cfg.fsync, port=self.port, args=args, env=self.env,
                                log_path=self.root / f"{self.name}.log")
            try:
                srv.start(timeout=20)
            except RuntimeError as exc:
                last = exc
                srv.stop(5)
                time.sleep(0.3)
                continue
            self.proc, self.port = srv, srv.port
            return
        raise RuntimeError(f"node {self.name} did not start: {last}")

    def status(self) -> dict | None:
        if self.proc is None or not self.proc.alive:
            return None
        try:
            return self.proc.status(timeout=1.0, token=self.admin_token)
        except Exception:  # noqa: BLE001 - a node that cannot answer has no status
            return None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(10)


class Nemesis:
    """The controller: starts the cluster and the workers, injects one fault at
    a time, re-pairs, waits for health, and stops every process by PID.
    :meth:`run` does it all; :func:`run_nemesis` adds the report."""

    def __init__(self, cfg: NemesisConfig, root: Path, *, new: bool = True):
        """``new``: a run to start (credentials are generated in ``root``); False for a
        finished run read back by :meth:`load` (no credentials, no processes)."""
        self.cfg = cfg
        self.root = root
        self.rng = random.Random(cfg.seed)
        bench_root = str(Path(__file__).resolve().parents[2])  # the directory holding benches/
        self.env = _fastlock_env([bench_root])
        from fastlock._testbase import CredentialsDir

        # each node follows with its own replica principal; workers stay anonymous clients
        names = self.node_names()
        self.creds = CredentialsDir(root / "credentials", replicas=len(names)) if new else None
        self.nodes = {n: _Node(n, root, cfg, self.env, self.creds.server_args(f"node-{i + 1}") if new else [],
                               self.creds.token("admin") if new else "")
                      for i, n in enumerate(names)}
        self.primary, self.standby = self.nodes[names[0]], self.nodes[names[1]]
        self.etcd = None  # tests/etcdserver.EtcdServer (group "etcd")
        self.workers: list[subprocess.Popen] = []
        self.faults: list[Fault] = []
        self.aborted: str | None = None
        self.store = root / "store.db"
        self.started = 0.0
        self.stopped_at = 0.0
        self._probe_feed = None
        self._probe_rest = ""
        self.leftover_checked = False
        self.leftover: list[dict] | str = []
        self._probe_grant_at = 0.0
        self.log = logging.getLogger("nemesis")

    def node_names(self) -> tuple[str, ...]:
        """The names of the nodes, in start order."""
        return ("a", "b", "c") if self.cfg.group == "etcd" else ("a", "b")

    # -- the run's record: enough to build the report again from a kept run dir ---------
    STATE = "nemesis-run.json"

    def save_state(self, elapsed: float) -> None:
        state = {"config": dataclasses.asdict(self.cfg), "faults": [dataclasses.asdict(f) for f in self.faults],
                 "stopped_at": self.stopped_at, "aborted": self.aborted, "leftover": self.leftover,
                 "elapsed_s": elapsed}
        (self.root / self.STATE).write_text(json.dumps(state, indent=1))

    @classmethod
    def load(cls, root: str | Path) -> tuple[Nemesis, float]:
        """A finished run, read back from its kept directory (see :meth:`save_state`);
        returns it and its elapsed seconds."""
        root = Path(root)
        state = json.loads((root / cls.STATE).read_text())
        cfg = NemesisConfig(**{**state["config"], "kinds": tuple(state["config"]["kinds"])})
        nem = cls(cfg, root, new=False)
        nem.faults = [Fault(**f) for f in state["faults"]]
        nem.stopped_at, nem.aborted, nem.leftover = state["stopped_at"], state["aborted"], state["leftover"]
        return nem, state["elapsed_s"]

    # -- set-up and tear-down --------------------------------------------------------
    def start_cluster(self) -> None:
        from fastlock._testbase import TcpProxy, classify_fastlock

        if self.cfg.group == "etcd":
            self.start_group()
            return
        a, b = self.nodes["a"], self.nodes["b"]
        a.start(None)
        # b needs a's proxy to start; a's and b's proxies target their fixed ports from then on
        a.proxy = TcpProxy(a.address, classify=classify_fastlock, port=a.relay_port).start()
        b.start(a)
        b.proxy = TcpProxy(b.address, classify=classify_fastlock, port=b.relay_port).start()
        b.proc.wait_for_log(r"paired: primary", 20)

    def start_group(self) -> None:
        """Group "etcd": one throwaway etcd member, three coordinated nodes, each
        reaching etcd through its own proxy; ``a`` starts first and takes the key."""
        from fastlock._testbase import TcpProxy

        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        from etcdserver import EtcdServer, unique_prefix

        self.etcd = EtcdServer().start()
        prefix = unique_prefix()
        for node in self.nodes.values():
            node.proxy = TcpProxy(self.etcd.address).start()
            node.coordinator = f"etcd://{node.proxy.address}{prefix}"
        a = self.nodes["a"]
        a.start(None)
        a.proc.wait_for_log(r"PROMOTED", 20)
        for name in ("b", "c"):
            self.nodes[name].start(None)
        self.primary, self.standby = a, self.nodes["b"]

    def start_workers(self) -> None:
        cfg = self.cfg
        conn = sqlite3.connect(self.store, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(STORE_SCHEMA)
        from fastlock.fencing import SQLiteFence

        SQLiteFence(conn).ensure_schema()
        conn.close()
        wcfg = {"seed": cfg.seed, "workers": cfg.workers, "locks": cfg.locks or 2 * cfg.workers,
                "ttl": cfg.ttl, "wait": cfg.wait, "pair_workers": cfg.pair_workers,
                "pair_pause": cfg.pair_pause,
                "request_timeout": cfg.request_timeout, "store": str(self.store),
                "addresses": [node.address for node in self.nodes.values()]}
        (self.root / "config.json").write_text(json.dumps(wcfg))
        for i in range(cfg.workers + 1 + cfg.pair_workers):  # then the prober, then the W2 workers
            err = open(self.root / f"worker-{i}.stderr", "w")
            self.workers.append(subprocess.Popen(
                [sys.executable, "-m", "benches.nemesis", "--worker", str(self.root), "--index", str(i)],
                cwd=str(self.root), env=self.env, stdin=subprocess.DEVNULL, stdout=err, stderr=err))
            err.close()

    def stop_all(self) -> None:
        """Stop every worker and server by PID (SIGTERM, then SIGKILL), and the proxies."""
        if not self.stopped_at:
            self.stopped_at = time.monotonic()
        for w in self.workers:
            if w.poll() is None:
                try:
                    w.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for w in self.workers:
            try:
                w.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait(5)
        if self.workers and not self.leftover_checked:
            self.leftover_checked = True
            self.leftover = self.held_after_workers_stopped()
        for node in self.nodes.values():
            try:
                node.stop()
            except Exception:
                self.log.exception("stopping node %s", node.name)
            if node.proxy is not None:
                node.proxy.close()
        if self.etcd is not None:
            self.etcd.stop()
        if self._probe_feed is not None:
            self._probe_feed.close()

    def held_after_workers_stopped(self) -> list[dict] | str:
        """Locks the primary still shows held once every worker has stopped (each
        released what it held on the way out): orphans, with their holder info."""
        from fastlock import protocol as P
        from fastlock.cli.admin import admin_request

        node = self.primary
        if node.proc is None or not node.proc.alive:
            return "no primary running"
        held = []
        try:
            for i in range(self.cfg.locks or 2 * self.cfg.workers):
                info = admin_request(("127.0.0.1", node.port), None, P.OP_HOLDER, f"acct/{i}", reply_timeout=2.0)
                if info:
                    held.append({"lock": f"acct/{i}", **{k: info.get(k) for k in ("token", "client", "remaining_ms")}})
        except Exception as exc:  # noqa: BLE001 - reported instead
            return f"{type(exc).__name__}: {exc}"
        return held

    # -- observation --------------------------------------------------------------------
    def last_probe_grant(self) -> float:
        """When the prober last received a grant (read from its event log as it grows)."""
        if self._probe_feed is None:
            path = self.root / f"worker-{self.cfg.workers}.jsonl"
            if not path.exists():
                return 0.0
            self._probe_feed = open(path)
        self._probe_rest += self._probe_feed.read()
        *lines, self._probe_rest = self._probe_rest.split("\n")  # the last piece may be half written
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("ev") == "grant":
                self._probe_grant_at = ev["at"]
        return self._probe_grant_at

    def dead_worker(self) -> str | None:
        """The last lines of a worker process that exited (they never exit on their own)."""
        for i, w in enumerate(self.workers):
            if w.poll() is not None:
                tail = (self.root / f"worker-{i}.stderr").read_text(errors="replace").strip().splitlines()[-3:]
                return f"worker {i} exited with {w.returncode}: " + " | ".join(tail)
        return None

    def healthy(self, since: float) -> tuple[bool, str]:
        if self.cfg.group == "etcd":
            return self.group_healthy(since)
        p, s = self.primary.status(), self.standby.status()
        if p is None:
            return False, f"primary {self.primary.name} does not answer"
        if p["role"] != "primary" or p["replication"]["fenced"] or p.get("grace_remaining_ms", 0) > 0:
            return False, (f"primary {self.primary.name}: role {p['role']}, fenced {p['replication']['fenced']}, "
                           f"grace {p.get('grace_remaining_ms')} ms")
        if s is None:
            return False, f"standby {self.standby.name} does not answer"
        r = s["replication"]
        if s["role"] != "standby" or not r.get("connected") or not r.get("synced") or not r.get("pair_confirmed"):
            return False, (f"standby {self.standby.name}: role {s['role']}, connected {r.get('connected')}, "
                           f"synced {r.get('synced')}, paired {r.get('pair_confirmed')}")
        if self.last_probe_grant() <= since:
            return False, "the prober was granted nothing since the re-pair"
        return True, "healthy"

    def group_healthy(self, since: float) -> tuple[bool, str]:
        """Group "etcd": :attr:`primary` holds the key, may grant and is past its
        grace; every other node is a synced standby of it; the prober was granted
        something since ``since``."""
        ok, why = self.group_state(self.primary, self.nodes.values())
        if not ok:  # a failover no fault caused (an etcd lease the load let run out): follow it
            found = [n for n in self.nodes.values() if (n.status() or {}).get("role") == "primary"]
            if len(found) == 1 and found[0] is not self.primary:
                self.log.info("following a failover no fault caused: %s -> %s", self.primary.name, found[0].name)
                self.primary = found[0]
                ok, why = self.group_state(self.primary, self.nodes.values())
        if not ok:
            return ok, why
        if self.last_probe_grant() <= since:
            return False, "the prober was granted nothing since the fault ended"
        return True, "healthy"

    @staticmethod
    def group_state(primary: _Node, nodes) -> tuple[bool, str]:
        """Is ``primary`` an etcd group's primary that holds the key, may grant and is past
        its grace, with every other node of ``nodes`` a synced standby of it?"""
        p = primary.status()
        if p is None:
            return False, f"primary {primary.name} does not answer"
        coord = p.get("coordinator") or {}
        if (p["role"] != "primary" or p["replication"].get("fenced") or p.get("grace_remaining_ms", 0) > 0
                or not coord.get("holding") or not coord.get("may_grant")):
            # (a node not yet primary reports its follower, which has no "fenced")
            return False, (f"primary {primary.name}: role {p['role']}, fenced {p['replication'].get('fenced')}, "
                           f"grace {p.get('grace_remaining_ms')} ms, arbiter {coord}")
        for node in nodes:
            if node is primary:
                continue
            s = node.status()
            if s is None:
                return False, f"standby {node.name} does not answer"
            r = s["replication"]
            if s["role"] != "standby" or r.get("primary") != primary.address or not r.get("synced"):
                return False, (f"standby {node.name}: role {s['role']}, follows {r.get('primary')}, "
                               f"synced {r.get('synced')}")
        return True, "healthy"

    def wait_healthy(self, since: float, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        why = ""
        while time.monotonic() < deadline:
            dead = self.dead_worker()
            if dead:
                self.aborted = dead
                return None
            ok, why = self.healthy(since)
            if ok:
                return time.monotonic()
            time.sleep(0.1)
        self.log.warning("not healthy after %.0f s: %s", timeout, why)
        self.aborted = f"cluster not healthy {timeout:.0f} s after fault {len(self.faults)}: {why}"
        return None

    # -- faults ---------------------------------------------------------------------------
    def _promoted(self, node: _Node, start_line: int, fault: Fault) -> bool:
        try:
            line = node.proc.wait_for_log(r"PROMOTED", self.cfg.promote_timeout, start=start_line)
        except RuntimeError as exc:
            fault.note = f"{node.name} did not promote: {str(exc).splitlines()[0]}"
            return False
        fault.promoted_s = time.monotonic() - fault.at
        m = re.search(r"epoch (\d+)", line)
        fault.new_epoch = int(m.group(1)) if m else None
        return True

    def _pause(self, p: _Node, fault: Fault, promoted) -> bool:
        """SIGSTOP ``p`` until ``promoted()`` returns (whether another node
        promoted), plus a random 0-1 s, then SIGCONT; returns ``promoted()``."""
        fault.at = time.monotonic()
        p.proc.pause()
        try:
            ok = promoted()
            time.sleep(self.rng.uniform(0.0, 1.0))  # the experiment: how long past the promotion
        finally:
            p.proc.resume()
        fault.ended_s = time.monotonic() - fault.at
        return ok

    def _partition(self, p: _Node, label: str | None, fault: Fault, promoted) -> bool:
        """Black-hole (or, one time in two, reset) the connections of ``p``'s
        proxy labelled ``label`` (None: all) until ``promoted()`` returns, plus
        a random 0-1 s, then heal; returns ``promoted()``."""
        fault.mode = self.rng.choice(["blackhole", "reset"])
        fault.at = time.monotonic()
        p.proxy.blackhole(label)
        if fault.mode == "reset":
            p.proxy.cut(label)
        try:
            ok = promoted()
            time.sleep(self.rng.uniform(0.0, 1.0))
        finally:
            p.proxy.heal()
        fault.ended_s = time.monotonic() - fault.at
        return ok

    def _group_promoted(self, fault: Fault, old_epoch: int, skip: _Node | None = None) -> bool:
        """Group "etcd": wait (``promote_timeout``) until a node other than ``skip``
        is an unfenced primary above ``old_epoch``; it becomes :attr:`primary`."""
        deadline = time.monotonic() + self.cfg.promote_timeout
        while time.monotonic() < deadline:
            for node in self.nodes.values():
                st = None if node is skip else node.status()
                if st and st["role"] == "primary" and not st["replication"]["fenced"] and st["epoch"] > old_epoch:
                    fault.promoted_s = time.monotonic() - fault.at
                    fault.new_epoch = st["epoch"]
                    fault.new_primary = node.name
                    self.primary = node
                    return True
            time.sleep(0.05)
        fault.note = f"no node promoted above epoch {old_epoch} within {self.cfg.promote_timeout:g} s"
        return False

    def inject_group(self, kind: str) -> Fault:
        """One fault against group "etcd" (see :mod:`benches.nemesis`); a node
        killed is restarted with the same flags after a random 0-1.5 s, as by a
        supervisor; a surviving old primary rejoins by itself."""
        p = self.primary
        fault = Fault(index=len(self.faults) + 1, kind=kind, old_primary=p.name, new_primary=p.name)
        self.faults.append(fault)
        st = p.status()
        old_epoch = st["epoch"] if st else 0
        if kind == "kill":
            fault.at = time.monotonic()
            p.proc.kill()
            time.sleep(self.rng.uniform(0.0, 1.5))
            p.start(None)
            self._group_promoted(fault, old_epoch)
            fault.ended_s = time.monotonic() - fault.at
        elif kind == "pause":
            self._pause(p, fault, lambda: self._group_promoted(fault, old_epoch, skip=p))
        elif kind == "partition":
            self._partition(p, None, fault, lambda: self._group_promoted(fault, old_epoch, skip=p))
        elif kind == "kill-standby":
            victim = self.rng.choice([n for n in self.nodes.values() if n is not p])
            fault.note = f"killed standby {victim.name}"
            fault.at = time.monotonic()
            victim.proc.kill()
            time.sleep(self.rng.uniform(0.0, 1.5))
            victim.start(None)
            fault.ended_s = time.monotonic() - fault.at
        elif kind == "etcd-restart":
            fault.at = time.monotonic()
            self.etcd.restart()
            fault.ended_s = time.monotonic() - fault.at
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        if kind in NO_FAILOVER_KINDS:
            # no failover expected; should one happen all the same, follow it
            found = [n for n in self.nodes.values() if (n.status() or {}).get("role") == "primary"]
            if len(found) == 1 and found[0] is not p:
                self.primary = found[0]
                fault.new_primary = found[0].name
                fault.note = "a failover happened"
        fault.repaired_s = time.monotonic() - fault.at
        healthy_at = self.wait_healthy(fault.at + fault.repaired_s, self.cfg.heal_timeout)
        fault.healthy_s = None if healthy_at is None else healthy_at - fault.at
        return fault

    def inject(self, kind: str) -> Fault:
        if self.cfg.group == "etcd":
            return self.inject_group(kind)
        p, s = self.primary, self.standby
        fault = Fault(index=len(self.faults) + 1, kind=kind, old_primary=p.name)
        self.faults.append(fault)
        mark = len(s.proc.lines)
        promoted = False
        if kind == "kill":
            fault.at = time.monotonic()
            p.proc.kill()
            promoted = self._promoted(s, mark, fault)
            fault.ended_s = time.monotonic() - fault.at
        elif kind == "pause":
            promoted = self._pause(p, fault, lambda: self._promoted(s, mark, fault))
        elif kind == "partition":
            promoted = self._partition(p, "replication", fault, lambda: self._promoted(s, mark, fault))
        elif kind == "promote":
            fault.at = time.monotonic()
            res = subprocess.run([sys.executable, "-m", "fastlock", "promote", "--server", s.address,
                                  "--timeout", "20"], capture_output=True, text=True, timeout=40,
                                 cwd=str(self.root),
                                 env=dict(self.env, FASTLOCK_TOKEN_FILE=self.creds.token_file("admin")))
            fault.ended_s = time.monotonic() - fault.at
            if res.returncode != 0:
                fault.note = f"promote exited {res.returncode}: {(res.stderr or res.stdout).strip()[-300:]}"
            promoted = self._promoted(s, mark, fault)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

        if not promoted:
            # no failover: the old primary (if it lives) stays primary; restart it if it died
            if not p.proc.alive:
                p.start(None)
            fault.new_primary = p.name
            healthy_at = self.wait_healthy(time.monotonic(), self.cfg.heal_timeout)
            fault.healthy_s = None if healthy_at is None else healthy_at - fault.at
            return fault

        fault.new_primary = s.name
        self.primary, self.standby = s, p
        if p.proc.alive:
            time.sleep(self.rng.uniform(0.0, 1.5))  # clients may still reach the old primary meanwhile
            p.proc.stop(10)
        # the documented re-pairing: same port, same data dir, --standby-of the new primary
        p.start(s)
        try:
            p.proc.wait_for_log(r"paired: primary", 20)
        except RuntimeError as exc:
            fault.note = (fault.note + "; " if fault.note else "") + f"re-pair: {str(exc).splitlines()[0]}"
        repaired = time.monotonic()
        fault.repaired_s = repaired - fault.at
        healthy_at = self.wait_healthy(repaired, self.cfg.heal_timeout)
        fault.healthy_s = None if healthy_at is None else healthy_at - fault.at
        return fault

    def run(self) -> None:
        cfg = self.cfg
        self.started = time.monotonic()
        self.start_cluster()
        self.start_workers()
        time.sleep(cfg.warmup)  # load before the first fault (the experiment, not a wait for a condition)
        if self.wait_healthy(self.started, cfg.heal_timeout) is None:
            return
        end = time.monotonic() + cfg.duration
        order: list[str] = []
        while time.monotonic() < end and (not cfg.max_faults or len(self.faults) < cfg.max_faults):
            if not order:
                order = list(cfg.kinds)
                self.rng.shuffle(order)
            fault = self.inject(order.pop(0))
            self.log.info("fault %d %s%s: promoted %s, healthy %s %s", fault.index, fault.kind,
                          f"/{fault.mode}" if fault.mode else "", _s(fault.promoted_s), _s(fault.healthy_s),
                          fault.note)
            if self.aborted:
                return
            time.sleep(self.rng.uniform(0.5, 1.5))  # steady load between faults



def report_again(root: str | Path) -> dict:
    """The report of a finished run whose directory was kept (``--keep DIR``)."""
    nem, elapsed = Nemesis.load(root)
    report = build_report(nem, elapsed)
    report["run_dir"] = str(root)
    return report


def run_nemesis(cfg: NemesisConfig, root: str | None = None, *, nemesis: type[Nemesis] | None = None,
                prefix: str = "fastlock-nemesis-",
                report: Callable[[Nemesis, float], dict] | None = None) -> dict:
    """Run the nemesis (see the module docstring) and return its report (a dict).

    ``root``: a directory for data dirs, logs, the store, the worker event
    logs and ``nemesis-run.json`` (kept; :func:`report_again` reads them back);
    by default a temporary one named ``prefix...``, removed afterwards.  ``nemesis``: the
    class run (:class:`Nemesis` by default; the sharded nemesis passes its own) and
    ``report``: what builds the report from it and the seconds elapsed
    (:func:`build_report` by default).
    """
    own = root is None
    base = Path(tempfile.mkdtemp(prefix=prefix) if own else root)
    base.mkdir(parents=True, exist_ok=True)
    nem = (nemesis or Nemesis)(cfg, base)
    atexit.register(nem.stop_all)
    t0 = time.monotonic()
    try:
        nem.run()
    except Exception as exc:
        nem.aborted = f"{type(exc).__name__}: {exc}"
        nem.log.exception("nemesis run failed")
    finally:
        nem.stop_all()
        atexit.unregister(nem.stop_all)
    nem.save_state(time.monotonic() - t0)
    result = (report or build_report)(nem, time.monotonic() - t0)
    result["run_dir"] = str(base)
    if own:
        shutil.rmtree(base, ignore_errors=True)
    return result


