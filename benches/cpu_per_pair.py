"""CPU time per acquire+release pair, server process and client process, in the W2 shape.

    python -m benches.cpu_per_pair [--clients 32] [--tasks 1] [--pairs 32000] [--fsync never] [--tag NAME] [--echo]
                                   [--syscalls]

C clients (one connection each), each with T tasks, on distinct locks run a fixed number of pairs
against a ``python -m fastlock serve`` subprocess (free port, throwaway data
dir, stopped afterwards).  Prints the server's and this client process's CPU
microseconds per pair (user + system; the system part of each in brackets), and pairs/s.  CPU time, not wall time:
on a shared, loaded machine it moves far less than throughput, so two installs
can be compared by running this module with each one's python, alternately.

``--echo`` measures the floor in the same shape instead: ``python -m benches.echo serve``
as the server and its client (:class:`benches.echo.EchoClientProtocol`: request ids, a
dict of futures, msgpack) sending an acquire-sized and a release-sized request per pair.

``--syscalls`` counts the client's system calls per pair during the measured pairs
(:class:`SyscallCounter`, ``perf stat``; it slows them, so that run's CPU figures are not
comparable with those of a run without).  :func:`server_process` starts either server for
other benches (:mod:`benches.syscall_floor`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu_seconds(pid: int) -> tuple[float, float]:
    """The user and system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


SYSCALLS = ("recvfrom", "sendto", "sendmsg", "read", "write", "writev", "epoll_wait", "epoll_ctl")


class SyscallCounter:
    """This process's system calls between :meth:`start` and :meth:`stop`, counted by ``perf
    stat`` (attached disabled, enabled and disabled through its control FIFO, each step
    acknowledged): all of them (``all``) and those of :data:`SYSCALLS`, from :meth:`counts`
    after :meth:`close`.  Counting slows every system call: CPU figures measured while counting
    are not comparable with those measured without.

    :raises OSError: ``perf`` cannot be started.
    """

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="syscalls-")
        ctl, ack = os.path.join(self.dir, "ctl"), os.path.join(self.dir, "ack")
        os.mkfifo(ctl)
        os.mkfifo(ack)
        self.out = os.path.join(self.dir, "out")
        events = ["raw_syscalls:sys_enter", *(f"syscalls:sys_enter_{n}" for n in SYSCALLS)]
        self.proc = subprocess.Popen(["perf", "stat", "-x", ",", "-o", self.out, "-e", ",".join(events), "-D", "-1",
                                      "--control", f"fifo:{ctl},{ack}", "-p", str(os.getpid())],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.ctl = os.open(ctl, os.O_WRONLY)  # both opens wait for perf's side (bounded by perf's start)
        self.ack = os.open(ack, os.O_RDONLY)

    def _command(self, word: bytes) -> None:
        os.write(self.ctl, word + b"\n")
        if not os.read(self.ack, 16).startswith(b"ack"):
            raise RuntimeError(f"perf did not acknowledge {word!r}")

    def start(self) -> None:
        self._command(b"enable")

    def stop(self) -> None:
        self._command(b"disable")

    def close(self) -> None:
        os.close(self.ctl)
        os.close(self.ack)
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def counts(self) -> dict[str, int]:
        counts = {}
        with open(self.out) as f:
            for line in f:
                parts = line.strip().split(",")
                if len(parts) > 2 and parts[0].isdigit():
                    name = parts[2].split("sys_enter_", 1)[1] if "sys_enter_" in parts[2] else "all"
                    counts[name] = int(parts[0])
        shutil.rmtree(self.dir, ignore_errors=True)
        return counts


@contextlib.contextmanager
def server_process(echo: bool, fsync: str = "never") -> Iterator[tuple[int, int]]:
    """A server subprocess on a free port of 127.0.0.1, yielding ``(pid, port)`` once it accepts
    connections (within 20 s), stopped on the way out (SIGTERM, SIGKILL after 10 s).

    ``echo``: ``python -m benches.echo serve``; else ``python -m fastlock serve`` with ``fsync``
    and a throwaway data dir.

    :raises OSError: the server did not accept a connection within 20 s.
    """
    port = _free_port()
    with tempfile.TemporaryDirectory() as data:
        if echo:
            argv = [sys.executable, "-m", "benches.echo", "serve", "--listen", f"127.0.0.1:{port}"]
            cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        else:
            argv = [sys.executable, "-m", "fastlock", "serve", "--listen", f"127.0.0.1:{port}",
                    "--data-dir", data, "--fsync", fsync]
            cwd = tempfile.gettempdir()
        srv = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), 0.1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or srv.poll() is not None:
                        raise
                    time.sleep(0.05)
            yield srv.pid, port
        finally:
            srv.send_signal(signal.SIGTERM)
            try:
                srv.wait(10)
            except subprocess.TimeoutExpired:
                srv.kill()
                srv.wait()


class _EchoClient:
    """The echo floor's client with a lock client's two calls (:mod:`benches.echo`)."""

    def __init__(self, proto) -> None:
        self.proto = proto
        self.owner = os.urandom(16)
        self.token = 1 << 40

    async def acquire(self, name: str, ttl: float) -> int:
        # shaped like a lock acquire: [id, op, name, owner key, ttl_ms, wait_ms, lock_delay_ms, tag]
        await self.proto.request(1, name, self.owner, int(ttl * 1000), -1, 0, None)
        self.token += 1
        return self.token

    async def release(self, token: int) -> None:
        await self.proto.request(2, "k", token, self.owner)  # shaped like a release

    async def close(self) -> None:
        self.proto.transport.close()


async def _measure(clients: int, pairs: int, fsync: str, tasks: int = 1, echo: bool = False,
                   count_syscalls: bool = False) -> tuple[float, float, float, float, float, dict[str, float]]:
    import fastlock

    with server_process(echo, fsync) as (srv_pid, port):
        if echo:
            from .echo import open_client
            conns = [_EchoClient(await open_client("127.0.0.1", port)) for _ in range(clients)]
        else:
            conns = [await fastlock.connect(f"127.0.0.1:{port}") for _ in range(clients)]

        async def worker(i: int, client, n: int) -> None:
            for _ in range(n):
                await client.release(await client.acquire(f"k{i}", ttl=10))

        workers = [(i * tasks + t, c) for i, c in enumerate(conns) for t in range(tasks)]
        await asyncio.gather(*(worker(i, c, 100) for i, c in workers))  # warm-up
        per = pairs // len(workers)
        counter = SyscallCounter() if count_syscalls else None
        if counter is not None:
            counter.start()
        s0 = process_cpu_seconds(srv_pid)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i, c, per) for i, c in workers))
        t1 = time.perf_counter()
        s1 = process_cpu_seconds(srv_pid)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        calls: dict[str, float] = {}
        if counter is not None:
            counter.stop()
            counter.close()
            calls = {name: c / (per * clients * tasks) for name, c in counter.counts().items()}
        for c in conns:
            await c.close()
    n = per * clients * tasks
    client_s = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    server_s = s1[0] + s1[1] - s0[0] - s0[1]
    return (1e6 * server_s / n, 1e6 * client_s / n, n / (t1 - t0), 1e6 * (r1.ru_stime - r0.ru_stime) / n,
            1e6 * (s1[1] - s0[1]) / n, calls)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.cpu_per_pair", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--tasks", type=int, default=1, help="tasks per client, each on its own lock (default 1)")
    ap.add_argument("--pairs", type=int, default=32000)
    ap.add_argument("--fsync", default="never")
    ap.add_argument("--tag", default="fastlock")
    ap.add_argument("--echo", action="store_true", help="measure the echo floor in the same shape")
    ap.add_argument("--syscalls", action="store_true",
                    help="count the client's system calls per pair with perf stat (slows them: CPU figures differ)")
    args = ap.parse_args(argv)
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    server_us, client_us, rate, client_sys_us, server_sys_us, calls = asyncio.run(
        _measure(args.clients, args.pairs, args.fsync, args.tasks, args.echo, args.syscalls))
    print(f"{args.tag}: server {server_us:6.1f} us/pair  client {client_us:6.1f} us/pair  wall {rate:7.0f} pairs/s"
          f"  (server system {server_sys_us:.1f}, client system {client_sys_us:.1f} us/pair)")
    if calls:
        print("  client system calls per pair:" + "".join(f"  {name} {c:.2f}" for name, c in sorted(calls.items())
                                                          if c >= 0.005))
    return 0


if __name__ == "__main__":
    sys.exit(main())
