"""Lease-bounded execution under faults: does protected work stop before the next grant?

    python -m benches.bounded [--trials 2000] [--run-trials 200] [--locks 10] [--ttl 0.8]
                              [--margin 0.2] [--seed N] [--max-seconds 1800] [--json PATH]

What runs
---------
One ``fastlock serve --fsync never`` process and one :class:`fastlock._testbase.proxy.TcpProxy`
in front of it, all on 127.0.0.1.  A *round* starts one holder process (this module with
``--holder``) that connects through the proxy and holds ``--locks`` locks at once, each
through ``async with client.lock(name, ttl=TTL, bounded=True, margin=MARGIN)``; each body
loops for a random 1-3 TTLs (then ends normally, releasing the lock): it checks
``lease.remaining(MARGIN) > 0`` and then performs its side effect, a line ``name t``
(``t``: ``time.monotonic()``) written to its stdout, then sleeps 1-5 ms.  This process
queues one waiter on every lock (a direct connection) as soon as it is held, and at a
random moment of the first TTL applies one fault, chosen at random, for a random
0.2-2.5 TTLs:

* ``freeze``: SIGSTOP the holder process, then SIGCONT;
* ``partition``: blackhole the proxy (nothing forwarded either way), then heal;
* ``block``: SIGUSR1 to the holder, whose handler sleeps in the main thread (the event
  loop is blocked by "user code"), for the fault's duration.

The holder never releases (its ``release`` only stops the renewal): every next grant comes
from the server's TTL, the moment the bound must precede - a release would hand the lock
over at once and prove only causality.  Every lock is one trial.  The next holder's grant
happened no earlier than the send time of its ACQUIRE plus the queue wait the server
reports (``Lease.expires_at - Lease.ttl``, less 1 ms for the server's millisecond clock): a
lower bound, early by the transit time of that ACQUIRE (a few ms on a loaded host), so the
check is stricter than the truth.  A trial passes if the body's last side effect precedes
that bound, whether the body was stopped by the bound (``stopped``: the timer's cancel;
``checked``: its own check before a side effect) or ended on its own (``done``).  All
clocks are this host's CLOCK_MONOTONIC.  The margin printed is ``grant lower bound - last
side effect`` (seconds).

``fastlock run`` trials (``--run-trials``): rounds of four ``fastlock run NAME --ttl TTL
--margin MARGIN --grace G`` processes through the proxy, each running a child that never
ends by itself (and, at random, ignores SIGTERM or is SIGSTOPped itself); the fault is a
partition of the runners.  The child's death is seen through a pidfd (an upper bound of
the moment it died); the trial passes if it precedes the next holder's grant (its lower
bound, as above), and the runner's exit status is recorded (75: stopped in time, as it
saw it).

Honest limits
-------------
A frozen holder cannot act while frozen - neither stop its work nor perform a side effect.
So a ``freeze`` trial checks what happens when it resumes: whether a body step that was due
while it was frozen runs before the event loop's stop timer, and whether the check before
each side effect catches it.  The window between that check (a clock read) and the side
effect itself (~1 µs of Python) cannot be closed in user space: a freeze landing exactly
there performs one late side effect; fencing tokens are what protect the resource then.
The same holds for ``block``.  ``fastlock run`` trials do not freeze the runner itself (a
stopped runner sends no signals: its exit status 76 reports it afterwards).

Bounded: ``--trials``/``--run-trials`` rounds, each under a hard per-round timeout, and the
whole run under ``--max-seconds`` (it stops starting rounds then, and reports what ran).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import fastlock
from fastlock._testbase.proxy import TcpProxy
from fastlock._testbase.servers import ServerProcess

FAULTS = ("freeze", "partition", "block")
#: the server's clock is in whole milliseconds: its reported queue wait may exceed the real one by this much
MS_SLACK = 0.001


# -- the holder process ------------------------------------------------------------------

async def _holder(address: str, names: list[str], ttl: float, margin: float, seed: int) -> None:
    logging.basicConfig(level=logging.ERROR)  # the warnings of a stopped body are expected here
    rng = random.Random(seed)
    out = sys.stdout.fileno()

    def emit(line: str) -> None:
        os.write(out, (line + "\n").encode())

    block_seconds = float(os.environ.get("H_BLOCK", "0"))

    def on_usr1(signum, frame):  # user code that blocks the event loop (in the main thread)
        time.sleep(block_seconds)

    signal.signal(signal.SIGUSR1, on_usr1)
    client = await fastlock.connect(address, request_timeout=max(0.2, ttl / 3))

    async def expire_instead(lease: fastlock.Lease) -> None:
        # the leases are never released, only left to expire: every next grant then comes
        # from the server's TTL, the moment the bound must precede (a release would hand
        # the lock over at once, proving only causality)
        client.renewers.stop(lease)

    client.release = expire_instead  # type: ignore[method-assign]

    async def one(name: str) -> None:
        work_for = ttl * rng.uniform(1.0, 3.0)
        try:
            async with client.lock(name, ttl=ttl, bounded=True, margin=margin) as lease:
                emit(f"held {name} {lease.fencing_token}")
                end = time.monotonic() + work_for
                while time.monotonic() < end:
                    if lease.remaining(margin) <= 0:
                        emit(f"end {name} checked {time.monotonic()!r}")
                        return
                    t = time.monotonic()
                    os.write(out, f"fx {name} {t!r}\n".encode())  # the side effect
                    await asyncio.sleep(rng.uniform(0.001, 0.005))
            emit(f"end {name} done {time.monotonic()!r}")
        except fastlock.LeaseExpiring:
            emit(f"end {name} stopped {time.monotonic()!r}")
        except fastlock.FastlockError as exc:
            emit(f"end {name} error:{type(exc).__name__} {time.monotonic()!r}")

    await asyncio.gather(*(one(n) for n in names))
    client.connector.close()


# -- the bench ------------------------------------------------------------------------------

@dataclass
class Trial:
    """One lock's outcome: ``margin`` = grant lower bound - last side effect (seconds)."""

    kind: str
    fault: str
    outcome: str
    margin: float | None
    ok: bool
    detail: str = ""


@dataclass
class Totals:
    trials: list[Trial] = field(default_factory=list)
    rounds: int = 0
    skipped: int = 0
    run_exit_codes: dict[str, int] = field(default_factory=dict)


async def _read_lines(stream: asyncio.StreamReader, sink: list[str]) -> None:
    while True:
        line = await stream.readline()
        if not line:
            return
        sink.append(line.decode().rstrip("\n"))


async def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.005)
    return True


async def _apply_fault(fault: str, pid: int, proxy: TcpProxy, duration: float) -> None:
    if fault == "freeze":
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(duration)  # the fault's length (the experiment, not a wait for a condition)
        os.kill(pid, signal.SIGCONT)
    elif fault == "partition":
        await asyncio.to_thread(proxy.blackhole)
        await asyncio.sleep(duration)
        await asyncio.to_thread(proxy.heal)
    else:
        os.kill(pid, signal.SIGUSR1)  # the handler sleeps for H_BLOCK seconds, set at start


async def _lock_round(args, rng: random.Random, server: ServerProcess, proxy: TcpProxy, waiter, n: int,
                      totals: Totals) -> None:
    names = [f"r{n}/l{i}" for i in range(args.locks)]
    fault = rng.choice(FAULTS)
    duration = args.ttl * rng.uniform(0.2, 2.5)
    env = dict(os.environ, H_BLOCK=repr(duration))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benches.bounded", "--holder", proxy.address, "--ttl", repr(args.ttl),
        "--margin", repr(args.margin), "--seed", str(rng.randrange(1 << 30)), *names,
        stdout=asyncio.subprocess.PIPE, env=env)
    lines: list[str] = []
    reader = asyncio.ensure_future(_read_lines(proc.stdout, lines))
    waits: dict[str, asyncio.Task] = {}
    try:
        if not await _wait(lambda: sum(ln.startswith("held ") for ln in lines) == len(names), 30.0):
            totals.skipped += 1
            return
        for name in names:
            waits[name] = asyncio.ensure_future(waiter.acquire(name, ttl=30.0, wait=None))
        await asyncio.sleep(rng.uniform(0.0, args.ttl))  # a random moment of the first TTL
        fault_at = time.monotonic()
        await _apply_fault(fault, proc.pid, proxy, duration)
        done, pending = await asyncio.wait(waits.values(), timeout=10 * args.ttl + 20.0)
        await _wait(lambda: sum(ln.startswith("end ") for ln in lines) == len(names), 10.0)
        try:
            await asyncio.wait_for(proc.wait(), 10.0)
        except asyncio.TimeoutError:
            pass
        for name, task in waits.items():
            ends = [ln.split() for ln in lines if ln.startswith(f"end {name} ")]
            outcome = ends[-1][2] if ends else "no-end"
            effects = [float(ln.split()[2]) for ln in lines if ln.startswith(f"fx {name} ")]
            if task not in done or task.exception() is not None:
                totals.trials.append(Trial("lock", fault, f"{outcome}/no-next-grant", None, False))
                continue
            lease = task.result()
            grant_after = lease.expires_at - lease.ttl - MS_SLACK
            last = max(effects) if effects else None
            margin = None if last is None else grant_after - last
            detail = "" if margin is None or margin > 0 else (
                f"last effect {last!r}, grant after {grant_after!r}, token {lease.fencing_token}, "
                f"fault at {fault_at!r} for {duration:.3f} s, lines: {[ln for ln in lines if name + ' ' in ln][-3:]}")
            ok = margin is None or margin > 0
            totals.trials.append(Trial("lock", fault, outcome, margin, ok, "" if ok else detail))
            await waiter.release(lease)
    finally:
        for task in waits.values():
            task.cancel()
        if proc.returncode is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            except ProcessLookupError:
                pass
            await proc.wait()
        await asyncio.to_thread(proxy.heal)
        reader.cancel()
        totals.rounds += 1


RUN_CHILD = """
import os, signal, sys, time
if sys.argv[2] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1], "w").write(f"{os.getpid()}\\n")
while True:
    time.sleep(0.01)
"""


async def _run_round(args, rng: random.Random, proxy: TcpProxy, waiter, n: int, tmp: Path, totals: Totals) -> None:
    loop = asyncio.get_running_loop()
    count = 4
    names = [f"run{n}/l{i}" for i in range(count)]
    modes = [rng.choice(("obey", "ignore", "stopped")) for _ in names]
    grace = min(0.1, args.ttl / 8)
    procs, pidfiles = [], []
    for name, mode in zip(names, modes):
        pidfile = tmp / f"{name.replace('/', '_')}.pid"
        pidfiles.append(pidfile)
        procs.append(await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fastlock", "run", name, "--ttl", repr(args.ttl), "--margin", repr(args.margin),
            "--grace", repr(grace), "--server", proxy.address, "--log-level", "ERROR", "--",
            sys.executable, "-c", RUN_CHILD, str(pidfile), "ignore" if mode == "ignore" else "obey",
            stderr=asyncio.subprocess.DEVNULL))
    died: dict[str, float] = {}
    fds: list[int] = []
    waits: dict[str, asyncio.Task] = {}
    try:
        if not await _wait(lambda: all(p.exists() and p.read_text().endswith("\n") for p in pidfiles), 30.0):
            totals.skipped += 1
            return
        for name, mode, pidfile in zip(names, modes, pidfiles):
            pid = int(pidfile.read_text())
            fd = os.pidfd_open(pid)
            fds.append(fd)
            loop.add_reader(fd, lambda name=name: died.setdefault(name, time.monotonic()))
            if mode == "stopped":
                os.kill(pid, signal.SIGSTOP)  # a stopped child: only SIGKILL ends it
            waits[name] = asyncio.ensure_future(waiter.acquire(name, ttl=30.0, wait=None))
        await asyncio.sleep(rng.uniform(0.0, args.ttl))
        await asyncio.to_thread(proxy.blackhole)
        done, _ = await asyncio.wait(waits.values(), timeout=10 * args.ttl + 20.0)
        await _wait(lambda: len(died) == len(names), 10.0)
        await asyncio.to_thread(proxy.heal)
        for p in procs:
            try:
                code = await asyncio.wait_for(p.wait(), 20.0)
            except asyncio.TimeoutError:
                code = -1
            totals.run_exit_codes[str(code)] = totals.run_exit_codes.get(str(code), 0) + 1
        for name, mode in zip(names, modes):
            task = waits[name]
            if task not in done or task.exception() is not None or name not in died:
                totals.trials.append(Trial("run", f"partition/{mode}", "no-next-grant-or-death", None, False))
                continue
            lease = task.result()
            margin = (lease.expires_at - lease.ttl - MS_SLACK) - died[name]
            totals.trials.append(Trial("run", f"partition/{mode}", "killed", margin, margin > 0))
            await waiter.release(lease)
    finally:
        for task in waits.values():
            task.cancel()
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        await asyncio.to_thread(proxy.heal)
        totals.rounds += 1


def _margins(trials: list[Trial]) -> dict:
    margins = sorted(t.margin for t in trials if t.margin is not None)

    def pct(q: float) -> float | None:
        return None if not margins else margins[min(len(margins) - 1, int(q * len(margins)))]

    return {"n": len(margins), "min": pct(0.0), "p01": pct(0.01), "p10": pct(0.10), "p50": pct(0.5),
            "p90": pct(0.9), "max": margins[-1] if margins else None,
            "mean": statistics.fmean(margins) if margins else None}


def _summary(trials: list[Trial]) -> dict:

    by: dict[str, dict[str, int]] = {}
    for t in trials:
        row = by.setdefault(t.fault, {})
        row[t.outcome] = row.get(t.outcome, 0) + 1
    return {
        "trials": len(trials), "passed": sum(t.ok for t in trials), "failed": sum(not t.ok for t in trials),
        # stopped by the bound (the timer's cancel, or the body's own check) vs. ended on its own
        "margin_s_stopped": _margins([t for t in trials if t.outcome in ("stopped", "checked", "killed")]),
        "margin_s_done": _margins([t for t in trials if t.outcome.startswith("done")]),
        "outcomes_by_fault": by,
    }


async def _bench(args) -> dict:
    rng = random.Random(args.seed)
    started = time.monotonic()
    totals = Totals()
    with tempfile.TemporaryDirectory(prefix="fastlock-bounded-") as tmp:
        server = ServerProcess(Path(tmp) / "data", fsync="never").start()
        try:
            with TcpProxy(server.address) as proxy:
                waiter = await fastlock.connect(server.address, client_name="next-holder")
                try:
                    n = 0
                    while sum(t.kind == "lock" for t in totals.trials) < args.trials:
                        if time.monotonic() - started > args.max_seconds:
                            break
                        await _lock_round(args, rng, server, proxy, waiter, n, totals)
                        n += 1
                    while sum(t.kind == "run" for t in totals.trials) < args.run_trials:
                        if time.monotonic() - started > args.max_seconds:
                            break
                        await _run_round(args, rng, proxy, waiter, n, Path(tmp), totals)
                        n += 1
                finally:
                    await waiter.close()
        finally:
            server.stop()
    lock_trials = [t for t in totals.trials if t.kind == "lock"]
    run_trials = [t for t in totals.trials if t.kind == "run"]
    return {
        "config": {"ttl_s": args.ttl, "margin_s": args.margin, "locks_per_holder": args.locks, "seed": args.seed},
        "seconds": round(time.monotonic() - started, 1), "rounds": totals.rounds, "rounds_skipped": totals.skipped,
        "lock": _summary(lock_trials), "run": _summary(run_trials), "run_exit_codes": totals.run_exit_codes,
        "failures": [asdict(t) for t in totals.trials if not t.ok][:50],
    }


def _print(result: dict) -> None:
    cfg = result["config"]
    print(f"bounded execution: ttl {cfg['ttl_s']} s, margin {cfg['margin_s']} s, {cfg['locks_per_holder']} locks "
          f"per holder, seed {cfg['seed']}; {result['rounds']} rounds ({result['rounds_skipped']} skipped) in "
          f"{result['seconds']} s")
    for kind in ("lock", "run"):
        s = result[kind]
        if not s["trials"]:
            continue
        share = 100.0 * s["passed"] / s["trials"]
        print(f"  {kind}: {s['passed']}/{s['trials']} trials with the last side effect (run: the child's death) "
              f"before the next grant ({share:.2f} %)")
        for which in ("stopped", "done"):
            m = s[f"margin_s_{which}"]
            if m["n"]:
                print(f"    margin s, {which} (grant lower bound - last effect): " + ", ".join(
                    f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in m.items() if v is not None))
        for fault, outcomes in sorted(s["outcomes_by_fault"].items()):
            print(f"    {fault}: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    if result["run_exit_codes"]:
        print(f"  fastlock run exit codes: {result['run_exit_codes']}")
    for f in result["failures"]:
        print(f"  FAILED: {f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benches.bounded", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=2000, help="lock trials (one per lock per round)")
    p.add_argument("--run-trials", type=int, default=200, help="fastlock run trials (four per round)")
    p.add_argument("--locks", type=int, default=10, help="locks per holder process")
    p.add_argument("--ttl", type=float, default=0.8, help="lease TTL, seconds")
    p.add_argument("--margin", type=float, default=0.2, help="stop margin, seconds")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-seconds", type=float, default=1800.0, help="stop starting rounds after this long")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--holder", metavar="ADDRESS", help=argparse.SUPPRESS)
    p.add_argument("names", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.holder:
        asyncio.run(_holder(args.holder, args.names, args.ttl, args.margin, args.seed or 0))
        return 0
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    result = asyncio.run(_bench(args))
    _print(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["lock"]["failed"] == 0 and result["run"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
