"""Failover time, replication lag, and the cost of a standby (issue 4).

    python -m benches.failover [--runs 10] [--failover-after 1.0] [--promotion-grace 0.0]
        [--duration 3] [--warmup 1] [--concurrency 32] [--rounds 2] [--fsync always]
        [--only failover,w2] [--json PATH]

Everything runs on 127.0.0.1: ``fastlock serve`` subprocesses on free ports
with throwaway data dirs, always stopped (SIGTERM, then SIGKILL) in ``finally``
blocks; every wait has a deadline.

failover
    ``--runs`` times: a primary and a standby (``--failover-after F
    --promotion-grace G``), 8 client tasks doing acquire+release on their own
    locks through ``fastlock.connect(primary, standby)``; SIGKILL the primary
    under that load, then each task asks for a fresh lock (``wait`` 5 s) until
    one is granted.  Measured on this process's monotonic clock:

    - kill -> the standby's ``PROMOTED`` log line (as read from its stderr);
    - kill -> the first grant by the new primary (its epoch is checked).

    Expected: F minus the time since the primary's last heartbeat (sent every
    F/8), plus up to F/8 for the standby's watchdog, plus G for the first grant,
    plus a reconnect.
w2
    W2 of :mod:`benches.harness` (``--concurrency`` client tasks, each on its
    own lock, acquire+release in a closed loop) against a primary alone and
    against a primary with a standby attached (``--failover-after F``), in one
    run, alternating ``--rounds`` times (ABBA...), medians reported.  Each row
    shows the CPU % of the client, of the server processes (primary, and
    standby when attached) and of other processes; on a shared 2-core machine
    rows with other processes above 20 % are marked NOISY (``--quiet-wait``).  The
    ratio with/without is the figure (target: >= 80 %).  While the standby is
    attached a thread samples the primary's ``status`` every 50 ms: its
    ``replication.standbys[0]`` ``lag_records`` (records written but not yet
    acknowledged by the standby) and ``lag_ms`` (age of the oldest
    unacknowledged batch), and the standby's own ``lag_records``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from benches import harness
from benches.load import FastlockTarget, _env_with_fastlock
from fastlock.tokens import epoch_of

# --------------------------------------------------------------------------- helpers


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100.0 * (len(v) - 1))))]


class _StatusPoller:
    """A blocking STATUS client on one socket (no fastlock client: it must not redirect)."""

    def __init__(self, address: str, timeout: float = 2.0, token: str | None = None):
        from fastlock import protocol as P
        from fastlock._testbase.handshake import raw_hello

        self.P = P
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.settimeout(timeout)
        self.dec = P.FrameDecoder(limits=P.REPLY_LIMITS)
        self.next_id = 1
        # an admin sees the standbys (its token proved, never sent)
        raw_hello(lambda *request: [0, 0, self._call(*request)], "bench-status", token)

    def _call(self, op: int, *args: Any) -> Any:
        rid = self.next_id
        self.next_id += 1
        self.sock.sendall(self.P.packb([rid, op, *args]))
        while True:
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("status connection closed")
            for msg in self.dec.feed(data):
                if msg[0] == rid:
                    if msg[1] != 0:
                        raise RuntimeError(f"status error: {msg[2]}")
                    return msg[2]

    def status(self) -> dict:
        return self._call(self.P.OP_STATUS)

    def close(self) -> None:
        self.sock.close()


class _LagSampler(threading.Thread):
    def __init__(self, primary: str, standby: str, every: float = 0.05, token: str | None = None):
        super().__init__(daemon=True, name="lag-sampler")
        self.token = token
        self.primary, self.standby, self.every = primary, standby, every
        self.stop_event = threading.Event()
        self.lag_records: list[int] = []
        self.lag_ms: list[int] = []
        self.standby_lag_records: list[int] = []
        self.errors: list[str] = []

    def run(self) -> None:
        try:
            p, s = _StatusPoller(self.primary, token=self.token), _StatusPoller(self.standby, token=self.token)
        except OSError as exc:
            self.errors.append(str(exc))
            return
        try:
            while not self.stop_event.wait(self.every):
                try:
                    sb = p.status()["replication"]["standbys"]
                    if sb:
                        self.lag_records.append(sb[0]["lag_records"])
                        self.lag_ms.append(sb[0]["lag_ms"])
                    self.standby_lag_records.append(s.status()["replication"]["lag_records"])
                except (OSError, RuntimeError, KeyError) as exc:
                    self.errors.append(str(exc))
        finally:
            p.close()
            s.close()

    def summary(self) -> dict[str, Any]:
        def stats(xs):
            return {"median": _pct(xs, 50), "p99": _pct(xs, 99), "max": max(xs) if xs else float("nan"),
                    "samples": len(xs)}
        return {"primary_lag_records": stats(self.lag_records), "primary_lag_ms": stats(self.lag_ms),
                "standby_lag_records": stats(self.standby_lag_records), "errors": self.errors[:5]}


# --------------------------------------------------------------------------- W2 with a standby


class FastlockWithStandby(FastlockTarget):
    """The load benches' fastlock target plus a standby attached before the load starts."""

    def __init__(self, *, fsync: str, failover_after: float):
        super().__init__(fsync=fsync)
        self.failover_after = failover_after
        self.standby_port: int | None = None
        self.name = f"fastlock fsync={fsync} + standby"

    def start(self) -> None:
        from fastlock._testbase import CredentialsDir

        # a standby authenticates as a replica principal; clients stay anonymous
        self._creds_dir = tempfile.mkdtemp(prefix="bench-fastlock-credentials-")
        creds = CredentialsDir(os.path.join(self._creds_dir, "c"), replicas=2)
        self.extra_args = (*self.extra_args, *creds.server_args("node-1"))
        self.admin_token = creds.token("admin")
        super().start()
        d = os.path.join(self.tmpdir, "standby")
        os.makedirs(d)
        argv = [self.python, "-m", "fastlock", "serve", "--listen", "127.0.0.1:0",
                "--data-dir", os.path.join(d, "data"), "--fsync", self.fsync,
                "--standby-of", f"127.0.0.1:{self.port}", "--failover-after", str(self.failover_after),
                "--name", "bench-standby", *creds.server_args("node-2")]
        srv = harness.ServerProcess("fastlock-standby", argv, log_path=os.path.join(d, "server.log"), cwd=d,
                                    env=_env_with_fastlock())
        self.servers.append(srv)
        self.standby_port = srv.start(ready_regex=r"listening on 127\.0\.0\.1:(\d+)")
        deadline = time.monotonic() + 10
        while "replicating from" not in srv.tail(100_000):
            if time.monotonic() > deadline:
                raise TimeoutError(f"standby did not attach: {srv.tail()}")
            time.sleep(0.02)

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self._creds_dir, ignore_errors=True)


def run_w2(args: argparse.Namespace, log) -> dict[str, Any]:
    wl = harness.Workload("W2", args.concurrency, False, 0.0, args.duration, args.warmup)
    rows: dict[str, list[dict]] = {"alone": [], "standby": []}
    lags: list[dict] = []
    order = []
    for r in range(args.rounds):
        order += ["alone", "standby"] if r % 2 == 0 else ["standby", "alone"]
    for kind in order:
        if args.quiet_wait > 0:
            harness.wait_for_quiet(args.quiet_wait, log=log)
        target = (FastlockTarget(fsync=args.fsync) if kind == "alone"
                  else FastlockWithStandby(fsync=args.fsync, failover_after=args.failover_after))
        sampler = None
        with harness.running(target):
            if kind == "standby":
                sampler = _LagSampler(f"127.0.0.1:{target.port}", f"127.0.0.1:{target.standby_port}",
                                      token=target.admin_token)
                sampler.start()
            try:
                row = harness.run_workload(target, wl, use_uvloop=args.uvloop)
            finally:
                if sampler is not None:
                    sampler.stop_event.set()
                    sampler.join(5)
        rows[kind].append(row)
        msg = f"  W2 {kind:<8} {row.get('pairs_per_s', float('nan')):>9.0f} pairs/s  p99 " \
              f"{row.get('pair_us', {}).get('p99', float('nan')):.0f} us  errors {row.get('error_count')}  " \
              f"cpu % client/servers/other {row.get('client_cpu_pct', float('nan')):.0f}/" \
              f"{row.get('server_cpu_pct', float('nan')):.0f}/{row.get('other_cpu_pct', float('nan')):.0f}"
        if row.get("other_cpu_pct", 0) > 20:
            msg += "  (NOISY: other processes)"
        if sampler is not None:
            lag = sampler.summary()
            lags.append(lag)
            msg += (f"  lag records median/p99/max {lag['primary_lag_records']['median']}/"
                    f"{lag['primary_lag_records']['p99']}/{lag['primary_lag_records']['max']}, ms "
                    f"{lag['primary_lag_ms']['median']}/{lag['primary_lag_ms']['p99']}/{lag['primary_lag_ms']['max']}")
        log(msg)
    med = {k: statistics.median(r["pairs_per_s"] for r in v) for k, v in rows.items()}
    lag_records = [x for lag in lags for x in [lag["primary_lag_records"]["max"]]]
    return {
        "pairs_per_s_alone": med["alone"],
        "pairs_per_s_with_standby": med["standby"],
        "ratio": med["standby"] / med["alone"] if med["alone"] else float("nan"),
        "rounds": args.rounds,
        "lag": lags,
        "lag_records_max": max(lag_records) if lag_records else None,
        "rows": rows,
    }


# --------------------------------------------------------------------------- failover time


async def _one_failover(run: int, root: str, args: argparse.Namespace,
                        primary_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """One kill -9 under load (see the module docstring); ``primary_args``: more ``serve``
    flags for the primary (e.g. ``--replication sync``); ``args.promotion_grace`` None:
    the standby's default grace."""
    import fastlock
    from fastlock._testbase import CredentialsDir, ServerProcess
    from fastlock.errors import ConnectionLost, FastlockError

    creds = CredentialsDir(os.path.join(root, f"credentials{run}"), replicas=2)
    p = ServerProcess(os.path.join(root, f"p{run}"), fsync=args.fsync, env=_env_with_fastlock(),
                      args=[*creds.server_args("node-1"), *primary_args])
    s = ServerProcess(os.path.join(root, f"s{run}"), fsync=args.fsync, env=_env_with_fastlock())
    clients = []
    tasks: list[asyncio.Task] = []
    try:
        await asyncio.to_thread(p.start)
        grace = [] if args.promotion_grace is None else ["--promotion-grace", str(args.promotion_grace)]
        s.args = ["--standby-of", p.address, "--failover-after", str(args.failover_after), *grace,
                  *creds.server_args("node-2")]
        await asyncio.to_thread(s.start)
        await asyncio.to_thread(s.wait_for_log, r"replicating from", 10)
        await asyncio.to_thread(s.wait_for_log, r"paired: primary", 10)  # automatic failover armed
        killed = asyncio.Event()
        killed_at = 0.0
        first: list[tuple[float, int]] = []
        loaded = [0]

        async def client_task(i: int, c) -> None:
            while not killed.is_set():
                try:
                    lease = await c.acquire(f"load/{i}", ttl=5.0, wait=1.0)
                    loaded[0] += 1
                    await c.release(lease)
                except FastlockError:
                    await asyncio.sleep(0.005)
            k = 0
            while not first:
                k += 1
                try:
                    lease = await c.acquire(f"after/{run}/{i}/{k}", ttl=5.0, wait=5.0)
                except (ConnectionLost, FastlockError):
                    await asyncio.sleep(0.002)
                    continue
                first.append((time.monotonic(), lease.fencing_token))
                return

        for i in range(8):
            clients.append(await fastlock.connect(p.address, s.address, client_name=f"f{i}", connect_timeout=1.0))
        tasks = [asyncio.ensure_future(client_task(i, c)) for i, c in enumerate(clients)]
        deadline = time.monotonic() + 10
        while loaded[0] < 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        # land the kill anywhere in the heartbeat cycle
        await asyncio.sleep((run % 8) * args.failover_after / 64)
        mark = len(s.lines)
        promoted = asyncio.ensure_future(asyncio.to_thread(s.wait_for_log, r"PROMOTED", 30, mark))
        killed_at = time.monotonic()
        await asyncio.to_thread(p.kill)
        killed.set()
        await promoted
        promoted_at = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        granted_at, token = first[0]
        return {"run": run, "promoted_s": promoted_at - killed_at, "first_grant_s": granted_at - killed_at,
                "epoch": epoch_of(token), "grants_before": loaded[0]}
    finally:
        for t in tasks:
            t.cancel()
        for c in clients:
            await c.close()
        await asyncio.to_thread(s.stop)
        await asyncio.to_thread(p.stop)


def run_failover(args: argparse.Namespace, log) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="bench-failover-")
    runs = []
    try:
        for run in range(args.runs):
            r = harness.run_async(asyncio.wait_for(_one_failover(run, root, args), 60), use_uvloop=args.uvloop)
            assert r["epoch"] >= 1, r
            runs.append(r)
            log(f"  run {run + 1:>2}: kill -> PROMOTED {r['promoted_s'] * 1000:7.1f} ms, "
                f"-> first grant {r['first_grant_s'] * 1000:7.1f} ms (epoch {r['epoch']})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    prom = [r["promoted_s"] for r in runs]
    grant = [r["first_grant_s"] for r in runs]
    return {
        "runs": runs,
        "failover_after_s": args.failover_after,
        "promotion_grace_s": args.promotion_grace,
        "promoted_s": {"median": statistics.median(prom), "max": max(prom), "min": min(prom)},
        "first_grant_s": {"median": statistics.median(grant), "max": max(grant), "min": min(grant)},
    }


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.failover", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="failover runs (default 10)")
    ap.add_argument("--failover-after", type=float, default=1.0, help="standby's --failover-after (s)")
    ap.add_argument("--promotion-grace", type=float, default=0.0,
                    help="standby's --promotion-grace (s); the first grant comes this much after promotion")
    ap.add_argument("--duration", type=float, default=3.0, help="W2 seconds measured per run")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=32, help="W2 client tasks (default 32)")
    ap.add_argument("--rounds", type=int, default=2, help="W2 runs per configuration, alternating (median)")
    ap.add_argument("--fsync", choices=("always", "interval", "never"), default="always")
    ap.add_argument("--only", default="failover,w2", help="comma list of failover, w2")
    ap.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                    help="before each W2 run, wait up to S seconds for other processes to go quiet")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--uvloop", dest="uvloop", action="store_true", default=True)
    g.add_argument("--no-uvloop", dest="uvloop", action="store_false")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = only - {"failover", "w2"}
    if unknown:
        ap.error(f"unknown --only parts: {sorted(unknown)}")

    def log(msg: str) -> None:
        print(msg, flush=True)

    out: dict[str, Any] = {"args": vars(args), "cpus": os.cpu_count(), "python": sys.version.split()[0]}
    if "failover" in only:
        log(f"failover: {args.runs} runs, --failover-after {args.failover_after} --promotion-grace "
            f"{args.promotion_grace}, fsync={args.fsync}, SIGKILL under load (8 clients)")
        out["failover"] = f = run_failover(args, log)
    if "w2" in only:
        log(f"W2: {args.concurrency} clients on distinct locks, {args.duration}+{args.warmup} s, "
            f"fsync={args.fsync}, {args.rounds} rounds alone/with a standby")
        out["w2"] = w = run_w2(args, log)
    log("")
    log("summary")
    if "failover" in only:
        f = out["failover"]
        log(f"  failover (kill -9 -> PROMOTED)     median {f['promoted_s']['median'] * 1000:.0f} ms, "
            f"max {f['promoted_s']['max'] * 1000:.0f} ms over {len(f['runs'])} runs "
            f"(--failover-after {args.failover_after} s)")
        log(f"  failover (kill -9 -> first grant)  median {f['first_grant_s']['median'] * 1000:.0f} ms, "
            f"max {f['first_grant_s']['max'] * 1000:.0f} ms (--promotion-grace {args.promotion_grace} s)")
    if "w2" in only:
        w = out["w2"]
        lr = [x for lag in w["lag"] for x in [lag["primary_lag_records"]]]
        lm = [x for lag in w["lag"] for x in [lag["primary_lag_ms"]]]
        log(f"  W2 alone {w['pairs_per_s_alone']:.0f} pairs/s, with a standby "
            f"{w['pairs_per_s_with_standby']:.0f} pairs/s: ratio {w['ratio'] * 100:.1f} % "
            f"({'PASS' if w['ratio'] >= 0.8 else 'MISS'} >= 80 %)")
        if lr:
            log("  replication lag under W2 (primary's view, per round median/p99/max): records "
                + "; ".join(f"{x['median']}/{x['p99']}/{x['max']}" for x in lr)
                + "  ms " + "; ".join(f"{x['median']}/{x['p99']}/{x['max']}" for x in lm))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
