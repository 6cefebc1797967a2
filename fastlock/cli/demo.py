"""``fastlock demo``: real processes, a real server, and a fenced SQLite ledger.

What it does, in about five seconds:

1. starts ``fastlock serve`` in a subprocess on 127.0.0.1 (a free port, a
   temporary data directory);
2. starts several worker **processes**.  Each repeatedly takes the lock
   ``ledger`` (``async with client.lock("ledger", ...)``), reads the account
   balance, works a few milliseconds, and appends a row to a shared SQLite
   ledger while writing the new balance, in one fenced transaction
   (:class:`fastlock.fencing.SQLiteFence`);
3. freezes worker 1 with SIGSTOP while it holds the lock, just before its
   write, and keeps it frozen past its TTL until another worker has been
   granted the lock and has written with a higher fencing token;
4. resumes worker 1 (SIGCONT).  It goes on with its write as if nothing had
   happened, as a process after a long GC pause would.  The ledger refuses it
   (:class:`~fastlock.errors.StaleFencingToken`), and the worker's client
   notices that its lease was lost.  Beside it, worker 1 tries the write a hostile
   client would, its sequencer with the token raised to ``2**62``: the ledger
   refuses that too (:class:`~fastlock.sequencer.BadSequencerSignature`), since
   the workers write with signed sequencers (:mod:`fastlock.sequencer`) and the
   fence holds the server's public key;
5. stops everything, checks the ledger and prints a report.

The ledger is consistent when: tokens never decrease in commit order; every
row's ``balance_before`` is the previous row's ``balance_after`` (a stale
read-modify-write would break this chain); ``balance_after = balance_before +
amount``; the account balance equals the last row and the sum of all amounts;
the rows are exactly the writes the workers reported as committed; and no two
grants carried the same token.  Exit status 0 only when the ledger is
consistent, the stale write was rejected, and the frozen worker noticed its
lease was lost.

Options: ``--workers N`` (default 4), ``--ttl SECONDS`` (default 1.0),
``--keep`` (keep the temporary directory), ``--timeout SECONDS`` (bound on
every wait, default 20).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..auth import generate
from ..auth.sequencer_keys import read_keys
from ..client import connect
from ..errors import FastlockError, LockNotAcquired, StaleFencingToken
from ..fencing import SQLiteFence
from ..sequencer import SequencerRejected, from_text, keys_from_text, keys_to_text
from .args import positive_seconds_arg, ttl_arg, wait_arg
from .ledger import FENCE_TABLE, LOCK, LedgerCheck, append_entry, check_ledger, create_ledger, read_balance

_LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+)")

# A child started by this demo dies with it, even if the demo is SIGKILLed:
# the child asks the kernel for a death signal (prctl PR_SET_PDEATHSIG), which
# survives exec.  Linux only; elsewhere the finally-blocks and the workers'
# stdin EOF do the cleanup.
_PDEATHSIG_EXEC = (
    "import ctypes, os, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]))\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.executable, [sys.executable] + sys.argv[3:])\n"
)


def _child_cmd(args: list[str], deathsig: int) -> list[str]:
    if sys.platform.startswith("linux"):
        return [sys.executable, "-c", _PDEATHSIG_EXEC, str(int(deathsig)), str(os.getpid()), *args]
    return [sys.executable, *args]


def _child_env() -> dict[str, str]:
    # Children must import the same fastlock as this process (source tree or installed).
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _emit(**msg: Any) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


async def _worker(args: argparse.Namespace) -> int:
    name = f"worker-{args.worker_id}"
    loop = asyncio.get_running_loop()
    start, go, stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
    events = {"start": start, "go": go, "stop": stop}

    def read_commands() -> None:  # a thread: parent commands on stdin, EOF = stop
        for line in sys.stdin:
            ev = events.get(line.strip())
            if ev is not None:
                loop.call_soon_threadsafe(ev.set)
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=read_commands, daemon=True).start()
    rng = random.Random(args.worker_id * 7919 + os.getpid())
    db = sqlite3.connect(args.db, timeout=10)
    with open(args.keys, encoding="utf-8") as f:  # the server's public keys: signed sequencers only
        fence = SQLiteFence(db, FENCE_TABLE, keys=keys_from_text(f.read()), skew=None)
    grants = writes = 0

    def write_entry(token: int, balance: int, amount: int, proof: Any, **extra: Any) -> int:
        """Append the ledger entry under ``token`` with its sequencer ``proof`` (fenced unless
        ``--unfenced``) and say what happened; returns 1 if it was written, 0 if refused."""
        try:
            append_entry(fence, name, token, balance, amount, not args.unfenced, proof)
        except StaleFencingToken as exc:
            _emit(ev="stale", token=exc.token, highest=exc.highest, msg=str(exc))
            return 0
        _emit(ev="wrote", token=token, amount=amount, **extra)
        return 1

    def forge(sequencer: str, balance: int) -> None:
        """The hostile write: this lease's sequencer with the token raised to 2**62."""
        blob = bytearray(from_text(sequencer))
        blob[10:22] = (2**62).to_bytes(8, "big") + (2**62 >> 40).to_bytes(4, "big")
        try:
            append_entry(fence, name, 2**62, balance, 1, True, bytes(blob))
        except SequencerRejected as exc:
            _emit(ev="forged", rejected=type(exc).__name__)
        else:
            _emit(ev="forged", rejected=None)

    async with connect(args.server, client_name=name, sequencers=True) as client:
        _emit(ev="ready")
        waiters = [asyncio.ensure_future(e.wait()) for e in (start, stop)]
        try:
            await asyncio.wait(waiters, timeout=args.timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        if not start.is_set():
            stop.set()
        while not stop.is_set():
            try:
                async with client.lock(LOCK, ttl=args.ttl, wait=args.wait) as lease:
                    grants += 1
                    token = lease.fencing_token
                    _emit(ev="granted", token=token)
                    balance = read_balance(db)
                    amount = rng.randint(1, 100)
                    if grants == args.freeze_on_grant:
                        # Tell the parent we hold the lock and have read the balance;
                        # it freezes us here.  "go" was sent while we were stopped.
                        _emit(ev="holding", token=token)
                        await asyncio.wait_for(go.wait(), args.timeout)
                        resumed = loop.time()
                        # Write as if nothing happened (no lease.lost check): a
                        # process that paused right before its write does just that.
                        writes += write_entry(token, balance, amount, lease.sequencer, stale_write_accepted=True)
                        if not args.unfenced and lease.sequencer is not None:
                            forge(lease.sequencer, balance)
                        try:
                            await asyncio.wait_for(lease.lost.wait(), 2 * args.ttl + 1.0)
                        except asyncio.TimeoutError:
                            pass
                        _emit(ev="lost", noticed=lease.lost.is_set(),
                              after=round(loop.time() - resumed, 3) if lease.lost.is_set() else None)
                        stop.set()
                        continue
                    await asyncio.sleep(rng.uniform(0.005, 0.02))  # the "work" done under the lock
                    writes += write_entry(token, balance, amount, lease.sequencer)
            except LockNotAcquired:
                _emit(ev="not_acquired")
    db.close()
    _emit(ev="done", grants=grants, writes=writes)
    return 0


def _worker_main(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_worker(args))
    except (FastlockError, OSError, asyncio.TimeoutError, sqlite3.Error) as exc:
        _emit(ev="error", msg=f"{type(exc).__name__}: {exc}")
        return 1


# --------------------------------------------------------------------------- parent


class _Child:
    """A subprocess whose output lines are read by a thread."""

    def __init__(self, label: str, cmd: list[str], *, on_line: Callable[[str, str], None] | None,
                 stdin: bool, stdout_json: bool):
        self.label = label
        self.tail: deque[str] = deque(maxlen=40)
        # cwd outside any source tree: `-m fastlock` must import the installed package
        self.proc = subprocess.Popen(
            cmd, env=_child_env(), cwd=tempfile.gettempdir(),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_json else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._on_line = on_line
        self._threads = [threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True)]
        if stdout_json:
            self._threads.append(threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True))
        for t in self._threads:
            t.start()

    def _read(self, stream, is_json: bool) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if is_json:
                if self._on_line is not None:
                    self._on_line(self.label, line)
            else:
                self.tail.append(line)
                if self._on_line is not None and self.label == "server":
                    self._on_line(self.label, line)
        stream.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, command: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(command.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


@dataclass
class _WorkerStats:
    grants: list[int] = field(default_factory=list)
    writes: list[tuple[int, int]] = field(default_factory=list)  # (token, amount)
    stale: list[tuple[int, int]] = field(default_factory=list)  # (token, highest)
    ready: bool = False
    done: bool = False
    error: str | None = None
    lost_noticed: bool | None = None
    lost_after: float | None = None
    holding_token: int | None = None
    stale_write_accepted: bool = False
    forged_rejected: str | None = None  # the error class that refused the forged write


class _Demo:
    def __init__(self, args: argparse.Namespace, out: Callable[[str], None]):
        self.args = args
        self.out = out
        self.inbox: queue.Queue[tuple[str, str]] = queue.Queue()
        self.workers: dict[str, _Child] = {}
        self.stats: dict[str, _WorkerStats] = {}
        self.server: _Child | None = None
        self.port: int | None = None
        self.deadline = time.monotonic() + args.timeout

    def progress(self, text: str) -> None:
        if not self.args.quiet:
            print(f"[demo] {text}", file=sys.stderr, flush=True)

    # Every child's line lands in one queue; only the main thread consumes it.
    def _on_line(self, label: str, line: str) -> None:
        self.inbox.put((label, line))

    def _handle(self, label: str, line: str) -> None:
        if label == "server":
            m = _LISTENING.search(line)
            if m and self.port is None:
                self.port = int(m.group(1))
            return
        try:
            msg = json.loads(line)
        except ValueError:  # not a message: keep it with the worker's stderr for diagnostics
            self.workers[label].tail.append(line)
            return
        st = self.stats[label]
        ev = msg.get("ev")
        if ev == "granted":
            st.grants.append(msg["token"])
        elif ev == "wrote":
            st.writes.append((msg["token"], msg["amount"]))
            if msg.get("stale_write_accepted"):
                st.stale_write_accepted = True
        elif ev == "stale":
            st.stale.append((msg["token"], msg["highest"]))
        elif ev == "forged":
            st.forged_rejected = msg["rejected"] or ""
        elif ev == "holding":
            st.holding_token = msg["token"]
        elif ev == "lost":
            st.lost_noticed, st.lost_after = msg["noticed"], msg["after"]
        elif ev == "ready":
            st.ready = True
        elif ev == "done":
            st.done = True
        elif ev == "error":
            st.error = msg["msg"]

    def wait_until(self, what: str, cond: Callable[[], bool]) -> None:
        """Consume child messages until ``cond()`` holds.

        :raises RuntimeError: the demo's overall deadline (``--timeout``) passed,
            a worker reported an error, or the server exited.
        """
        while not cond():
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"the demo's {self.args.timeout:.0f} s timeout passed while waiting for {what}")
            self._check_children_alive(what)
            try:
                label, line = self.inbox.get(timeout=min(remaining, 0.25))
            except queue.Empty:
                continue
            self._handle(label, line)
            if label in self.stats and self.stats[label].error:
                raise RuntimeError(f"{label} failed: {self.stats[label].error}")

    def _check_children_alive(self, what: str) -> None:
        if self.server is not None and self.server.proc.poll() is not None:
            raise RuntimeError(f"the server exited ({self.server.proc.returncode}) while waiting for {what}:\n"
                               + "\n".join(self.server.tail))

    # -- the scenario
    def run(self, tmpdir: str) -> int:
        a = self.args
        db = os.path.join(tmpdir, "ledger.db")
        create_ledger(db)
        data_dir = os.path.join(tmpdir, "server-data")
        # credentials with a sequencer key (and every name for connections without a token)
        generate(os.path.join(tmpdir, "credentials"), anonymous_prefix="")
        credentials = os.path.join(tmpdir, "credentials", "credentials.toml")
        keys = os.path.join(tmpdir, "sequencer-keys.pub")
        with open(keys, "w", encoding="utf-8") as f:
            f.write(keys_to_text(read_keys(credentials).verify_keys))
        self.server = _Child(
            "server",
            _child_cmd(["-m", "fastlock", "serve", "--listen", "127.0.0.1:0", "--data-dir", data_dir,
                        "--credentials", credentials], signal.SIGTERM),
            on_line=self._on_line, stdin=False, stdout_json=False,
        )
        self.wait_until("the server to listen", lambda: self.port is not None)
        addr = f"127.0.0.1:{self.port}"
        self.progress(f"server pid {self.server.pid} listening on {addr}, data in {tmpdir}")

        victim = "worker-1"
        for i in range(1, a.workers + 1):
            label = f"worker-{i}"
            cmd = ["-m", "fastlock.cli.demo", "--worker", "--worker-id", str(i), "--server", addr, "--db", db,
                   "--keys", keys, "--ttl", str(a.ttl), "--wait", str(a.timeout), "--timeout", str(a.timeout)]
            if label == victim:
                cmd += ["--freeze-on-grant", "2"]
            if a.unfenced:
                cmd.append("--unfenced")
            self.stats[label] = _WorkerStats()
            self.workers[label] = _Child(label, _child_cmd(cmd, signal.SIGKILL), on_line=self._on_line,
                                         stdin=True, stdout_json=True)
        self.wait_until("the workers to connect", lambda: all(st.ready for st in self.stats.values()))
        self.progress(f"{a.workers} workers connected: " + ", ".join(
            f"{lbl} pid {w.pid}" for lbl, w in self.workers.items()))
        t_start = time.monotonic()
        for w in self.workers.values():
            w.send("start")

        vst = self.stats[victim]
        self.wait_until(f"{victim} to hold the lock", lambda: vst.holding_token is not None)
        frozen_token = vst.holding_token
        assert frozen_token is not None
        os.kill(self.workers[victim].pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        self.workers[victim].send("go")  # read only once it is resumed
        self.progress(f"froze {victim} (SIGSTOP) while it holds token {frozen_token}, before its write")

        def higher_writes() -> list[tuple[str, int]]:
            return [(lbl, t) for lbl, st in self.stats.items() if lbl != victim
                    for t, _ in st.writes if t > frozen_token]

        # Another worker must be granted the lock (the server expired the frozen
        # lease) and write with a higher token; a few such writes, then resume.
        self.wait_until("another worker to take the lock", lambda: len(higher_writes()) >= 3)
        takeover_label, takeover_token = min(
            ((lbl, t) for lbl, st in self.stats.items() if lbl != victim for t in st.grants if t > frozen_token),
            key=lambda x: x[1])
        self.progress(f"{takeover_label} was granted token {takeover_token}; {len(higher_writes())} writes "
                      f"with higher tokens so far")
        t_cont = time.monotonic()
        os.kill(self.workers[victim].pid, signal.SIGCONT)
        self.progress(f"resumed {victim} (SIGCONT) after {t_cont - t_stop:.2f} s")
        self.wait_until(f"{victim} to try its write and check its lease",
                        lambda: vst.lost_noticed is not None or vst.done)
        # Let the others go on a little after the rejection, then stop everyone.
        after = len(higher_writes())
        self.wait_until("more writes after the resume", lambda: len(higher_writes()) >= after + 2 * a.workers)
        for w in self.workers.values():
            w.send("stop")
        self.wait_until("the workers to finish", lambda: all(st.done for st in self.stats.values()))
        elapsed = time.monotonic() - t_start
        for w in self.workers.values():
            w.wait(max(0.1, self.deadline - time.monotonic()))
        # Drain anything still queued (e.g. a late line).
        while True:
            try:
                self._handle(*self.inbox.get_nowait())
            except queue.Empty:
                break

        check, rows = check_ledger(db, fenced=not a.unfenced)
        return self._report(addr, victim, frozen_token, t_cont - t_stop, takeover_label, takeover_token,
                            check, rows, elapsed)

    def _report(self, addr: str, victim: str, frozen_token: int, frozen_for: float, takeover_label: str,
                takeover_token: int, check: LedgerCheck, rows: list[tuple], elapsed: float) -> int:
        a, out = self.args, self.out
        vst = self.stats[victim]
        all_grants = [t for st in self.stats.values() for t in st.grants]
        distinct = len(all_grants) == len(set(all_grants))
        reported = sorted((lbl, t, amt) for lbl, st in self.stats.items() for t, amt in st.writes)
        in_ledger = sorted((w, t, amt) for _, w, t, _, amt, _ in rows)
        matches = reported == in_ledger
        stale_in_ledger = any(w == victim and t == frozen_token for _, w, t, *_ in rows)
        rejected = sum(len(st.stale) for st in self.stats.values())
        victim_rejected = any(t == frozen_token for t, _ in vst.stale)
        consistent = check.consistent and distinct and matches and not stale_in_ledger

        out(f"fastlock demo: {a.workers} worker processes, lock {LOCK!r}, ttl {a.ttl:.1f} s, server {addr}"
            + (", ledger writes UNFENCED" if a.unfenced else ""))
        for lbl, st in self.stats.items():
            toks = f"{min(st.grants)}..{max(st.grants)}" if st.grants else "-"
            note = "  (frozen)" if lbl == victim else ""
            out(f"  {lbl:<10} grants {len(st.grants):>3}  writes {len(st.writes):>3}  tokens {toks}{note}")
        out(f"  freeze       {victim} stopped (SIGSTOP) holding token {frozen_token} for {frozen_for:.2f} s "
            f"(ttl {a.ttl:.1f} s)")
        out(f"  takeover     {takeover_label} was granted token {takeover_token} while {victim} was frozen")
        if victim_rejected:
            hi = next(h for t, h in vst.stale if t == frozen_token)
            out(f"  stale write  {victim} resumed and wrote with token {frozen_token}: REJECTED "
                f"(StaleFencingToken, highest accepted {hi})")
        elif vst.stale_write_accepted:
            why = "unfenced" if a.unfenced else "fencing failed"
            out(f"  stale write  {victim} resumed and wrote with token {frozen_token}: ACCEPTED ({why})")
        else:
            out(f"  stale write  {victim} did not report its write")
        forged_ok = a.unfenced or bool(vst.forged_rejected)
        if not a.unfenced:
            out(f"  forged write {victim} wrote with its sequencer's token raised to 2**62: "
                + (f"REJECTED ({vst.forged_rejected})" if vst.forged_rejected else "ACCEPTED or not tried"))
        noticed = bool(vst.lost_noticed)
        out(f"  lease lost   {victim} noticed: {'yes' if noticed else 'no'}"
            + (f" ({vst.lost_after:.2f} s after resuming)" if noticed and vst.lost_after is not None else ""))
        token_range = f"{min(all_grants)}..{max(all_grants)}" if all_grants else "-"
        out(f"  tokens       {len(all_grants)} grants, range {token_range}, all distinct: {_yn(distinct)}")
        out(f"  ledger       {check.rows} rows; tokens non-decreasing: {_yn(check.tokens_non_decreasing)}; "
            f"balance chain intact: {_yn(check.chain_intact and check.rows_add_up)}; "
            f"balance {check.balance} = sum of amounts {check.sum_amounts}: {_yn(check.balance_matches)}; "
            f"rows = writes the workers committed: {_yn(matches)}")
        for p in check.problems[:10]:
            out(f"  problem      {p}")
        if stale_in_ledger:
            out(f"  problem      the ledger holds {victim}'s write with stale token {frozen_token}")
        out(f"  time         {elapsed:.1f} s")
        out(f"stale writes rejected: {rejected}")
        out(f"ledger consistent: {_yn(consistent)}")
        ok = consistent and victim_rejected and noticed and forged_ok
        out(f"result: {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1

    def cleanup(self) -> None:
        for w in self.workers.values():
            if w.proc.poll() is None:
                try:
                    os.kill(w.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                w.kill(signal.SIGKILL)
        for w in self.workers.values():
            w.wait(5)
        if self.server is not None and self.server.proc.poll() is None:
            self.server.kill(signal.SIGTERM)
            if not self.server.wait(5):
                self.server.kill(signal.SIGKILL)
                self.server.wait(5)


def _yn(b: bool) -> str:
    return "yes" if b else "no"


_DESCRIPTION = "start a server and workers that write a fenced SQLite ledger"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``demo`` (with all of the demo's flags) to ``fastlock``'s subparsers."""
    p = subparsers.add_parser("demo", help=_DESCRIPTION, description=_DESCRIPTION)
    _add_arguments(p)
    p.set_defaults(handler=run_from_args)
    return p


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastlock demo", description=_DESCRIPTION, allow_abbrev=False)
    _add_arguments(p)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=4, help="worker processes (2..16, default 4)")
    p.add_argument("--ttl", type=ttl_arg, default=1.0, help="lease TTL in seconds (default 1.0)")
    p.add_argument("--timeout", type=positive_seconds_arg, default=20.0,
                   help="bound in seconds on each wait of the demo (default 20)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (ledger, server data)")
    p.add_argument("--unfenced", action="store_true",
                   help="write the ledger WITHOUT the fencing check, to see the stale write corrupt it "
                        "(the demo then exits 1)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    # Worker mode (internal): run by the demo itself.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--server", help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    p.add_argument("--keys", help=argparse.SUPPRESS)
    p.add_argument("--wait", type=wait_arg, default=10.0, help=argparse.SUPPRESS)
    p.add_argument("--freeze-on-grant", type=int, default=0, help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> int:
    """Run the demo (or, with the internal ``--worker`` flag, one worker).

    :returns: 0 when the ledger is consistent, the frozen worker's stale write
        was rejected and it noticed its lease was lost; 1 otherwise; 2 on a
        usage error.
    """
    return run_from_args(_parser().parse_args(argv))


def run_from_args(args: argparse.Namespace) -> int:
    """Run the demo with parsed options (see :func:`main`); returns the exit status."""
    if args.worker:
        return _worker_main(args)
    if not 2 <= args.workers <= 16:
        print("fastlock demo: --workers must be between 2 and 16", file=sys.stderr)
        return 2
    tmpdir = tempfile.mkdtemp(prefix="fastlock-demo-")
    demo = _Demo(args, lambda s: print(s, flush=True))
    try:
        return demo.run(tmpdir)
    except (RuntimeError, OSError, sqlite3.Error) as exc:
        print(f"fastlock demo failed: {exc}", file=sys.stderr)
        for label, child in [("server", demo.server), *demo.workers.items()]:
            if child is not None and child.tail:
                print(f"--- last lines of {label}'s stderr:", file=sys.stderr)
                print("\n".join(child.tail), file=sys.stderr)
        print("result: FAIL")
        return 1
    finally:
        demo.cleanup()
        if args.keep:
            print(f"kept {tmpdir}", file=sys.stderr)
        else:
            shutil.rmtree(tmpdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
