"""Closed-loop load generator shared by ``benches.load`` and ``benches.peers``.

A *target* is one system under test (fastlock, the echo floor, Redis, ...).  It
starts its server(s) as subprocesses on 127.0.0.1 with a throwaway data dir and
opens *sessions*: one per simulated client, each with its own connection.  A
session exposes two calls, ``acquire(name)`` and ``release(name)``; the echo
floor implements both as one msgpack round trip each, so every figure of a lock
service can be read as a ratio to what the harness and a Python client cost.

Workloads (closed loop: each client issues its next request only after the
previous one returned):

W1  one client, sequential acquire+release of one lock.  Latency of the pair
    and of each half, p50/p90/p99/max in microseconds.
W2  N clients (default 32), each on its own lock.  Pairs/s and pair p99.
    *Requests/s counts a pair as 2 requests* (one acquire + one release); a
    recipe that needs more round trips per pair still counts 2, its extra round
    trips are visible in ``round_trips_per_pair``.
W3  N clients (default 16) on ONE lock, each holding it ``hold`` (1 ms) then
    releasing and immediately asking again.  Hand-offs/s (= acquisitions/s),
    owner changes/s (acquisitions whose holder differs from the previous one:
    a polling lock often hands the lock back to the client that just let go),
    p50/p99 time-to-acquire, Jain's fairness index over per-client acquisition
    counts, wasted round trips (failed polling attempts) per acquisition, the
    measured hold time.

Every loop is bounded in count (``MAX_OPS``) and in time (warmup + duration),
the whole run sits under a hard timeout, and servers are stopped in ``finally``
blocks (SIGTERM, then SIGKILL after a grace period).

Threaded clients (kazoo) use the same workloads with threads instead of tasks;
see :func:`run_workload`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is a bench dependency
    psutil = None

MAX_OPS = 50_000_000          # per-client upper bound on loop iterations
STOP_GRACE = 10.0             # s a server gets after SIGTERM before SIGKILL
RUN_GRACE = 20.0              # s a workload may run past warmup+duration
READY_TIMEOUT = 30.0          # s a server gets to become ready
DEFAULT_TTL = 10.0            # s lease TTL used by every recipe that has one
DEFAULT_WAIT = 5.0            # s a blocked acquire waits before failing
LOOPBACK = "127.0.0.1"

now_ns = time.perf_counter_ns


# --------------------------------------------------------------------------- #
# statistics
# --------------------------------------------------------------------------- #

def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of an already sorted list (``p`` in 0..100)."""
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values), max(1, math.ceil(p / 100.0 * len(sorted_values)))) - 1
    return sorted_values[k]


def latency_stats(samples_ns: Iterable[int]) -> dict[str, float]:
    """p50/p90/p99/max/mean in microseconds of samples in nanoseconds."""
    s = sorted(samples_ns)
    if not s:
        return {"n": 0, "p50": float("nan"), "p90": float("nan"), "p99": float("nan"),
                "max": float("nan"), "mean": float("nan")}
    return {
        "n": len(s),
        "p50": percentile(s, 50) / 1e3,
        "p90": percentile(s, 90) / 1e3,
        "p99": percentile(s, 99) / 1e3,
        "max": s[-1] / 1e3,
        "mean": sum(s) / len(s) / 1e3,
    }


def jain_index(counts: Iterable[int]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1.0 = perfectly fair."""
    xs = list(counts)
    sq = sum(x * x for x in xs)
    if not xs or sq == 0:
        return float("nan")
    return sum(xs) ** 2 / (len(xs) * sq)


# --------------------------------------------------------------------------- #
# processes
# --------------------------------------------------------------------------- #

def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for servers that can't bind 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = READY_TIMEOUT, proc: subprocess.Popen | None = None) -> None:
    """Block until something accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError):
            with socket.create_connection((LOOPBACK, port), timeout=0.5):
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {LOOPBACK}:{port} after {timeout} s")


class ServerProcess:
    """One server subprocess with its log file, stopped for sure by :meth:`stop`.

    ``ready`` is either a port to poll, or a regex searched in the log whose
    first group is the port (as fastlock's ``listening on 127.0.0.1:<port>``).
    """

    def __init__(self, name: str, argv: list[str], *, log_path: str, cwd: str | None = None,
                 env: dict[str, str] | None = None, user: str | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.cwd = cwd
        self.env = env
        self.user = user
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._log = None

    def start(self, *, ready_port: int | None = None, ready_regex: str | None = None,
              timeout: float = READY_TIMEOUT) -> int:
        argv = self.argv
        if self.user is not None:
            argv = ["runuser", "-u", self.user, "--"] + argv
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=self.cwd, env=self.env, start_new_session=True)
        try:
            if ready_regex is not None:
                self.port = self._wait_log(ready_regex, timeout)
                wait_port(self.port, timeout, self.proc)
            elif ready_port is not None:
                wait_port(ready_port, timeout, self.proc)
                self.port = ready_port
        except BaseException:
            self.stop()
            raise
        return self.port or 0

    def _wait_log(self, regex: str, timeout: float) -> int:
        pat = re.compile(regex)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                m = pat.search(f.read().decode("utf-8", "replace"))
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            time.sleep(0.02)
        raise TimeoutError(f"{self.name} not ready after {timeout} s: {self.tail()}")

    def tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        return ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds."""
        p = self.proc
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None


class CpuMeter:
    """CPU seconds (user+system) of this process and of a set of server process trees."""

    def __init__(self, server_pids: Callable[[], list[int]]) -> None:
        self._server_pids = server_pids
        self._t0 = self._c0 = None
        self._s0: dict[int, float] = {}

    @staticmethod
    def _tree_times(pids: list[int]) -> dict[int, float]:
        out: dict[int, float] = {}
        if psutil is None:
            return out
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(pid)
                for p in [root] + root.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        t = p.cpu_times()
                        out[p.pid] = t.user + t.system
        return out

    @staticmethod
    def _self_time() -> float:
        t = os.times()
        return t.user + t.system

    @staticmethod
    def _machine_busy() -> float:
        if psutil is None:
            return float("nan")
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._c0 = self._self_time()
        self._s0 = self._tree_times(self._server_pids())
        self._m0 = self._machine_busy()

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self._t0
        client = self._self_time() - self._c0
        s1 = self._tree_times(self._server_pids())
        # processes that appeared during the window count from 0
        server = sum(v - self._s0.get(pid, 0.0) for pid, v in s1.items())
        machine = self._machine_busy() - self._m0
        pct = lambda x: 100.0 * x / wall if wall > 0 and psutil else float("nan")  # noqa: E731
        # other_cpu_pct: what the rest of the machine burnt meanwhile (another
        # benchmark or test suite running beside this one makes the figures noisy)
        return {"client_cpu_pct": 100.0 * client / wall if wall > 0 else float("nan"),
                "server_cpu_pct": pct(server), "other_cpu_pct": max(0.0, pct(machine - client - server))}


# --------------------------------------------------------------------------- #
# targets
# --------------------------------------------------------------------------- #

class Session:
    """One client connection.  ``acquire`` returns a fencing token or None.

    ``round_trips`` counts every request sent (a polling recipe sends more than
    one per acquire); ``wasted`` counts failed attempts (polls that lost).
    """

    round_trips: int = 0
    wasted: int = 0

    async def acquire(self, name: str) -> int | None:  # pragma: no cover - interface
        raise NotImplementedError

    async def release(self, name: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    async def close(self) -> None:
        pass


class SyncSession:
    """Same as :class:`Session` for thread-based clients (kazoo)."""

    round_trips: int = 0
    wasted: int = 0

    def acquire(self, name: str) -> int | None:  # pragma: no cover - interface
        raise NotImplementedError

    def release(self, name: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


class Target:
    """A system under test: servers + a way to open sessions.

    Subclasses set ``name`` (the row label), ``fencing`` (does acquire give a
    fencing token?), ``polling`` (does waiting poll?), ``threaded`` (sessions
    are :class:`SyncSession` driven by threads), and implement ``start``,
    ``stop``, ``server_pids`` and ``open`` (or ``open_sync``).
    """

    name = "?"
    system = "?"
    fencing = False
    polling = False
    threaded = False
    notes = ""
    is_floor = False

    def __init__(self) -> None:
        self.tmpdir: str | None = None
        self.servers: list[ServerProcess] = []

    # lifecycle --------------------------------------------------------------
    def make_tmpdir(self, root: str | None = None) -> str:
        self.tmpdir = tempfile.mkdtemp(prefix=f"bench-{self.system}-", dir=root)
        return self.tmpdir

    def start(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def stop(self) -> None:
        for s in reversed(self.servers):
            with contextlib.suppress(Exception):
                s.stop()
        self.servers.clear()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    def server_pids(self) -> list[int]:
        return [s.pid for s in self.servers if s.pid]

    def describe(self) -> dict[str, Any]:
        return {"target": self.name, "system": self.system, "fencing": self.fencing,
                "polling": self.polling, "threaded": self.threaded, "notes": self.notes,
                "is_floor": self.is_floor}

    # sessions ---------------------------------------------------------------
    async def open(self, idx: int) -> Session:  # pragma: no cover - interface
        raise NotImplementedError

    def open_sync(self, idx: int) -> SyncSession:  # pragma: no cover - interface
        raise NotImplementedError


@contextlib.contextmanager
def running(target: Target):
    """Start ``target`` and stop it whatever happens."""
    try:
        target.start()
        yield target
    finally:
        target.stop()


# --------------------------------------------------------------------------- #
# workloads
# --------------------------------------------------------------------------- #

@dataclasses.dataclass
class Workload:
    name: str                 # W1 / W2 / W3
    clients: int
    shared_lock: bool         # W3: everybody on one lock
    hold: float = 0.0         # s held between acquire and release
    duration: float = 3.0     # s measured
    warmup: float = 1.0       # s run before measuring


def standard_workloads(duration: float, warmup: float, *, w2_clients: int = 32, w3_clients: int = 16,
                       hold: float = 0.001) -> dict[str, Workload]:
    return {
        "W1": Workload("W1", 1, False, 0.0, duration, warmup),
        "W2": Workload("W2", w2_clients, False, 0.0, duration, warmup),
        "W3": Workload("W3", w3_clients, True, hold, duration, warmup),
    }


class _Recorder:
    """Per-client sample buffers; only operations that start after warmup count."""

    def __init__(self, n: int) -> None:
        self.acq = [[] for _ in range(n)]       # acquire latency (ns) = time-to-acquire
        self.rel = [[] for _ in range(n)]       # release latency (ns)
        self.pair = [[] for _ in range(n)]      # acquire+release (ns), hold excluded
        self.hold = [[] for _ in range(n)]      # measured hold (ns)
        self.grants: list[tuple] = []  # (grant time ns, client, token) in observed order
        self.tokens = [[] for _ in range(n)]
        self.errors: list[str] = []
        self.lock = threading.Lock()


def _lock_name(wl: Workload, i: int) -> str:
    return "bench/shared" if wl.shared_lock else f"bench/lock-{i:03d}"


async def _async_client(sess: Session, i: int, wl: Workload, rec: _Recorder,
                        t_measure: int, t_end: int) -> None:
    name = _lock_name(wl, i)
    hold = wl.hold
    acq_l, rel_l, pair_l, hold_l, tok_l = rec.acq[i], rec.rel[i], rec.pair[i], rec.hold[i], rec.tokens[i]
    grants = rec.grants
    for _ in range(MAX_OPS):
        t0 = now_ns()
        if t0 >= t_end:
            break
        tok = await sess.acquire(name)
        t1 = now_ns()
        if hold:
            grants.append((t1, i, tok))
            await asyncio.sleep(hold)
        t2 = now_ns()
        await sess.release(name)
        t3 = now_ns()
        if t0 >= t_measure and t3 <= t_end:
            acq_l.append(t1 - t0)
            rel_l.append(t3 - t2)
            pair_l.append((t1 - t0) + (t3 - t2))
            if hold:
                hold_l.append(t2 - t1)
            if tok is not None:
                tok_l.append(tok)


def _sync_client(sess: SyncSession, i: int, wl: Workload, rec: _Recorder,
                 t_measure: int, t_end: int) -> None:
    name = _lock_name(wl, i)
    hold = wl.hold
    try:
        for _ in range(MAX_OPS):
            t0 = now_ns()
            if t0 >= t_end:
                break
            tok = sess.acquire(name)
            t1 = now_ns()
            if hold:
                with rec.lock:
                    rec.grants.append((t1, i, tok))
                time.sleep(hold)
            t2 = now_ns()
            sess.release(name)
            t3 = now_ns()
            if t0 >= t_measure and t3 <= t_end:
                rec.acq[i].append(t1 - t0)
                rec.rel[i].append(t3 - t2)
                rec.pair[i].append((t1 - t0) + (t3 - t2))
                if hold:
                    rec.hold[i].append(t2 - t1)
                if tok is not None:
                    rec.tokens[i].append(tok)
    except Exception as e:  # noqa: BLE001 - reported in the results
        with rec.lock:
            rec.errors.append(f"client {i}: {type(e).__name__}: {e}")


def _summarise(target: Target, wl: Workload, rec: _Recorder, t_measure: int,
               t_end: int, cpu: dict[str, float]) -> dict[str, Any]:
    span = (t_end - t_measure) / 1e9
    pairs = sum(len(x) for x in rec.pair)
    flat = lambda lists: [v for xs in lists for v in xs]  # noqa: E731
    out: dict[str, Any] = dict(target.describe())
    out.update({
        "workload": wl.name, "clients": wl.clients, "hold_ms": wl.hold * 1e3,
        "duration_s": span, "warmup_s": wl.warmup, "pairs": pairs,
        "pairs_per_s": pairs / span if span > 0 else float("nan"),
        "requests_per_s": 2 * pairs / span if span > 0 else float("nan"),
        "pair_us": latency_stats(flat(rec.pair)),
        "acquire_us": latency_stats(flat(rec.acq)),
        "release_us": latency_stats(flat(rec.rel)),
        "errors": rec.errors[:10], "error_count": len(rec.errors),
    })
    out.update(cpu)
    # W3 specifics
    if wl.shared_lock:
        grants = sorted((g for g in rec.grants if t_measure <= g[0] <= t_end), key=lambda g: g[0])
        changes = sum(1 for a, b in zip(grants, grants[1:]) if a[1] != b[1])
        per_client = [0] * wl.clients
        for g in grants:
            per_client[g[1]] += 1
        out.update({
            "handoffs": len(grants),
            "handoffs_per_s": len(grants) / span if span > 0 else float("nan"),
            "owner_changes": changes,
            "owner_changes_per_s": changes / span if span > 0 else float("nan"),
            "time_to_acquire_us": out["acquire_us"],
            "jain": jain_index(per_client),
            "per_client_acquisitions": per_client,
            "hold_measured_us": latency_stats(flat(rec.hold)),
        })
    # fencing tokens must increase per client and (W3) along the grant order
    tokens_ok = all(all(a < b for a, b in zip(t, t[1:])) for t in rec.tokens)
    if wl.shared_lock:
        seq = [g[2] for g in sorted(rec.grants, key=lambda g: g[0]) if g[2] is not None]
        tokens_ok = tokens_ok and all(a < b for a, b in zip(seq, seq[1:]))
    out["tokens_increasing"] = tokens_ok if any(rec.tokens) else None
    return out


def _counters(sessions: list) -> tuple[int, int]:
    return sum(s.round_trips for s in sessions), sum(s.wasted for s in sessions)


def _finish(target: Target, wl: Workload, rec: _Recorder, t_measure: int, t_end: int,
            cpu: dict[str, float], c0: tuple[int, int], c1: tuple[int, int]) -> dict[str, Any]:
    res = _summarise(target, wl, rec, t_measure, t_end, cpu)
    rt, wasted = c1[0] - c0[0], c1[1] - c0[1]
    acquisitions = max(1, sum(len(x) for x in rec.acq))
    res["round_trips_per_pair"] = rt / acquisitions if rt else None
    res["wasted_round_trips"] = wasted
    res["wasted_round_trips_per_acquire"] = wasted / acquisitions
    return res


async def _run_async(target: Target, wl: Workload) -> dict[str, Any]:
    sessions: list[Session] = []
    try:
        for i in range(wl.clients):
            sessions.append(await target.open(i))
        # one untimed pair per client so connections, prepared statements and
        # scripts are warm even with --warmup 0
        for i, s in enumerate(sessions):
            if not wl.shared_lock or i == 0:
                await s.acquire(_lock_name(wl, i))
                await s.release(_lock_name(wl, i))
        rec = _Recorder(wl.clients)
        meter = CpuMeter(target.server_pids)
        t_start = now_ns()
        t_measure = t_start + int(wl.warmup * 1e9)
        t_end = t_measure + int(wl.duration * 1e9)
        snaps: dict[str, Any] = {}

        async def snapshots() -> None:
            await asyncio.sleep(max(0.0, (t_measure - now_ns()) / 1e9))
            snaps["c0"] = _counters(sessions)
            meter.start()
            await asyncio.sleep(max(0.0, (t_end - now_ns()) / 1e9))
            snaps["c1"] = _counters(sessions)
            snaps["cpu"] = meter.stop()

        snap = asyncio.ensure_future(snapshots())
        tasks = [asyncio.ensure_future(_async_client(s, i, wl, rec, t_measure, t_end))
                 for i, s in enumerate(sessions)]
        try:
            await asyncio.wait_for(asyncio.gather(snap, *tasks), wl.warmup + wl.duration + RUN_GRACE)
        except Exception as e:  # noqa: BLE001 - reported in the row
            rec.errors.append(f"{type(e).__name__}: {e}")
            for t in tasks + [snap]:
                t.cancel()
            await asyncio.gather(snap, *tasks, return_exceptions=True)
        cpu = snaps.get("cpu", {"client_cpu_pct": float("nan"), "server_cpu_pct": float("nan")})
        return _finish(target, wl, rec, t_measure, t_end, cpu, snaps.get("c0", (0, 0)),
                       snaps.get("c1", snaps.get("c0", (0, 0))))
    finally:
        for s in sessions:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(s.close(), 5)


def _run_threaded(target: Target, wl: Workload) -> dict[str, Any]:
    sessions: list[SyncSession] = []
    try:
        for i in range(wl.clients):
            sessions.append(target.open_sync(i))
        for i, s in enumerate(sessions):
            if not wl.shared_lock or i == 0:
                s.acquire(_lock_name(wl, i))
                s.release(_lock_name(wl, i))
        rec = _Recorder(wl.clients)
        meter = CpuMeter(target.server_pids)
        t_start = now_ns()
        t_measure = t_start + int(wl.warmup * 1e9)
        t_end = t_measure + int(wl.duration * 1e9)
        threads = [threading.Thread(target=_sync_client, args=(s, i, wl, rec, t_measure, t_end), daemon=True)
                   for i, s in enumerate(sessions)]
        for t in threads:
            t.start()
        time.sleep(max(0.0, (t_measure - now_ns()) / 1e9))
        c0 = _counters(sessions)
        meter.start()
        time.sleep(max(0.0, (t_end - now_ns()) / 1e9))
        c1 = _counters(sessions)
        cpu = meter.stop()
        deadline = time.monotonic() + RUN_GRACE
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            rec.errors.append("threads still running after the hard timeout")
        return _finish(target, wl, rec, t_measure, t_end, cpu, c0, c1)
    finally:
        for s in sessions:
            with contextlib.suppress(Exception):
                s.close()


def run_workload(target: Target, wl: Workload, *, use_uvloop: bool = True) -> dict[str, Any]:
    """Run one workload against a started target; return its result row."""
    if target.threaded:
        res = _run_threaded(target, wl)
    else:
        res = run_async(_run_async(target, wl), use_uvloop=use_uvloop)
    res["uvloop"] = use_uvloop and not target.threaded
    return res


def run_async(coro, *, use_uvloop: bool = True):
    """asyncio.run on uvloop when asked for and importable."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            use_uvloop = False
    if use_uvloop:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            return r.run(coro)
    return asyncio.run(coro)


def run_target(target: Target, workloads: Iterable[Workload], *, use_uvloop: bool = True,
               log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Start a target, run each workload on it, stop it; failures become error rows.

    The echo floor runs W1 and W2 as given, and W3 as its hand-off floor
    (one client: hold, then one round trip; see ``EchoTarget.handoff_floor``).
    """
    rows: list[dict[str, Any]] = []
    try:
        with running(target):
            for wl in workloads:
                if target.is_floor and wl.shared_lock:
                    log(f"  {target.name:<28} W3 floor (1 client: hold {wl.hold * 1e3:g} ms + 1 round trip) ...")
                    row = target.handoff_floor(wl.hold, wl.duration, wl.warmup, use_uvloop=use_uvloop)
                    rows.append(row)
                    log("    " + one_line(row))
                    continue
                log(f"  {target.name:<28} {wl.name} ({wl.clients} clients, {wl.duration:g}+{wl.warmup:g} s) ...")
                try:
                    row = run_workload(target, wl, use_uvloop=use_uvloop)
                except Exception as e:  # noqa: BLE001 - one failure must not stop the suite
                    row = dict(target.describe(), workload=wl.name, error_count=1,
                               errors=[f"{type(e).__name__}: {e}"])
                rows.append(row)
                log("    " + one_line(row))
    except Exception as e:  # noqa: BLE001
        log(f"  {target.name}: could not start: {type(e).__name__}: {e}")
        rows.append(dict(target.describe(), workload="start", error_count=1, errors=[f"{type(e).__name__}: {e}"]))
    return rows


def one_line(row: dict[str, Any]) -> str:
    if row.get("workload") not in ("W1", "W2", "W3") or "pair_us" not in row:
        return f"ERROR {row.get('errors')}"
    s = (f"pairs/s={row['pairs_per_s']:,.0f} pair p50={row['pair_us']['p50']:.0f}us "
         f"p99={row['pair_us']['p99']:.0f}us cpu client={row['client_cpu_pct']:.0f}% "
         f"server={row['server_cpu_pct']:.0f}%")
    if row["workload"] == "W3":
        s += (f" handoffs/s={row['handoffs_per_s']:,.0f} changes/s={row['owner_changes_per_s']:,.0f} "
              f"tta p99={row['time_to_acquire_us']['p99']:.0f}us jain={row['jain']:.3f}")
        if row.get("wasted_round_trips_per_acquire"):
            s += f" wasted/acq={row['wasted_round_trips_per_acquire']:.1f}"
    if row.get("other_cpu_pct", 0) > 20:
        s += f" [busy machine: other processes used {row['other_cpu_pct']:.0f}% CPU]"
    if row.get("error_count"):
        s += f" errors={row['error_count']} {row['errors'][:1]}"
    return s


def machine_busy_pct(sample: float = 1.0) -> float:
    """CPU % (of one core) the whole machine burns over ``sample`` seconds (nan without psutil)."""
    if psutil is None:
        return float("nan")
    a = CpuMeter._machine_busy()
    time.sleep(sample)
    return 100.0 * (CpuMeter._machine_busy() - a) / sample


def wait_for_quiet(max_wait: float, threshold: float = 25.0, log: Callable[[str], None] = print) -> float:
    """Wait up to ``max_wait`` s for the machine to idle below ``threshold`` % of a core.

    Benchmarks on a 2-core machine shared with test suites are noise; this
    returns the last busy figure so the report can say how quiet it was.
    """
    deadline = time.monotonic() + max_wait
    busy = machine_busy_pct()
    while busy > threshold and time.monotonic() < deadline:
        log(f"machine busy ({busy:.0f}% of a core used by other processes); waiting for it to settle ...")
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
        busy = machine_busy_pct()
    if busy > threshold:
        log(f"warning: machine still busy ({busy:.0f}% of a core); figures will be noisy")
    return busy


# --------------------------------------------------------------------------- #
# command line helpers
# --------------------------------------------------------------------------- #

def add_common_args(ap) -> None:
    ap.add_argument("--duration", type=float, default=3.0, help="seconds measured per workload (default 3)")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds run before measuring (default 1)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="clients for W2 (default 32); W3 uses half of it (default 16)")
    ap.add_argument("--hold", type=float, default=1.0, help="W3 hold time in ms (default 1)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--uvloop", dest="uvloop", action="store_true", default=True,
                   help="run clients and the echo server on uvloop (default when importable)")
    g.add_argument("--no-uvloop", dest="uvloop", action="store_false", help="use the stdlib asyncio loop")
    ap.add_argument("--workloads", default="W1,W2,W3", help="comma list (default W1,W2,W3)")
    ap.add_argument("--json", metavar="PATH", help="also write all rows as JSON to PATH")
    ap.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                    help="wait up to S seconds for other processes to go idle before starting (default 0)")


def workloads_from_args(args) -> list[Workload]:
    w2 = args.concurrency or 32
    w3 = max(2, w2 // 2) if args.concurrency else 16
    all_w = standard_workloads(args.duration, args.warmup, w2_clients=w2, w3_clients=w3, hold=args.hold / 1e3)
    wanted = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    return [all_w[w] for w in wanted if w in all_w]


def write_json(path: str, payload: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)


def print_result(result: dict[str, Any], json_path: str | None = None, problems: Iterable[str] = ()) -> None:
    """Print a bench's ``result`` as JSON, each of ``problems`` on stderr, and write the
    result to ``json_path`` too when given."""
    print(json.dumps(result, indent=2))
    for problem in problems:
        print(problem, file=sys.stderr)
    if json_path:
        write_json(json_path, result)


def machine_info() -> dict[str, Any]:
    import platform
    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                            "cpus": os.cpu_count()}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    with contextlib.suppress(OSError):
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    if psutil:
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    with contextlib.suppress(ImportError):
        import uvloop
        info["uvloop"] = uvloop.__version__
    return info
