"""Scale: memory per held lease and per lock name ever used, W1 with many
leases held, recovery time of many live leases (issue 12).

Runs against real ``fastlock serve`` processes (the fastlock installed for the
Python that runs this script) on 127.0.0.1, each stopped by its PID; every
phase is bounded in count and in time (``--phase-timeout``)::

    python -m benches.scale                      # N = 1,000,000
    python -m benches.scale --leases 200000 --recovery never
    python -m benches.scale --json /tmp/scale.json

memory and W1 (one server, ``--fsync never``, so the disk does not blur them)
    server RSS (``VmRSS`` of ``/proc/PID/status``) at start; W1 (one client,
    ``fastlock.connect`` acquire+release of a free lock, ``--w1-pairs`` pairs)
    with no lease held; N leases held (``ACQUIRE_MANY`` of 64 names, pipelined
    over ``--connections`` connections); W1 again with the N leases held; RSS;
    all N released; RSS; N names never used before, each acquired and released
    once; RSS; W1 again with nothing held.  Bytes per held lease = (RSS held -
    RSS at start) / N; bytes per name ever used = (RSS after the names - RSS
    after the release) / N.  The memory of a process that freed objects is
    reused by the process but rarely given back to the system, so "after
    release" says what is retained, the names' figure what a used name costs
    on top.
recovery (``--recovery always,never``: one server per mode)
    N leases held, SIGKILL, the data dir's size (WAL segments, snapshot), a
    new server on the same data dir and port: the time from its start to
    "listening", to the first grant of a free lock, and the recovery time the
    server logs; one of the N names is checked to be still held.

Prints one line per phase, then a JSON object of every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import msgpack

import fastlock
from fastlock import protocol as P
from fastlock._testbase import ServerProcess

from .harness import latency_stats

MANY = 64  # names per ACQUIRE_MANY (the protocol's limit)
TTL_MS = 3_600_000  # held leases outlive every phase
_RECOVERED = re.compile(r"recovered (\d+) leases.* in ([0-9.]+) ms")


def rss_kib(pid: int) -> int:
    """``VmRSS`` of process ``pid`` in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


class _Pipe(asyncio.Protocol):
    """A raw pipelined connection: :meth:`call` sends a request, the future gets the reply."""

    def __init__(self) -> None:
        self.unpacker = msgpack.Unpacker(raw=False)
        self.waiting: dict[int, asyncio.Future] = {}
        self.next_id = 1
        self.transport: asyncio.Transport | None = None
        self.lost = asyncio.get_running_loop().create_future()

    @classmethod
    async def open(cls, address: str, name: str) -> _Pipe:
        host, port = address.rsplit(":", 1)
        _, pipe = await asyncio.get_running_loop().create_connection(cls, host, int(port))
        reply = await pipe.call(P.OP_HELLO, P.PROTOCOL_VERSION, name, None)
        if reply[1] != P.STATUS_OK:
            raise RuntimeError(f"HELLO refused: {reply}")
        return pipe

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.unpacker.feed(data)
        for msg in self.unpacker:
            fut = self.waiting.pop(msg[0], None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("connection lost"))
        self.waiting.clear()

    def call(self, op: int, *args) -> asyncio.Future:
        rid = self.next_id
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        assert self.transport is not None
        self.transport.write(msgpack.packb([rid, op, *args], use_bin_type=True))
        return fut

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _ok(reply: list, what: str) -> object:
    if reply[1] != P.STATUS_OK:
        raise RuntimeError(f"{what}: error {reply[1]}: {reply[2]!r}")
    return reply[2]


async def _pipelined(pipes: list[_Pipe], jobs: list, run_one, window: int) -> None:
    """Run ``run_one(pipe, job)`` for every job, ``window`` at a time on each pipe."""
    per_pipe = [jobs[i::len(pipes)] for i in range(len(pipes))]

    async def drive(pipe: _Pipe, mine: list) -> None:
        pending: set[asyncio.Task] = set()
        for job in mine:
            if len(pending) >= window:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
            pending.add(asyncio.ensure_future(run_one(pipe, job)))
        if pending:
            await asyncio.gather(*pending)

    await asyncio.gather(*(drive(p, m) for p, m in zip(pipes, per_pipe)))


class Holdings:
    """The leases one bench client holds: ``(names, owner, tokens)`` per ACQUIRE_MANY."""

    def __init__(self) -> None:
        self.groups: list[tuple[list[str], bytes, list[int]]] = []

    def __len__(self) -> int:
        return sum(len(g[0]) for g in self.groups)


async def acquire_names(pipes: list[_Pipe], prefix: str, n: int, window: int) -> Holdings:
    """Acquire ``prefix0 .. prefix(n-1)`` (free names) with ACQUIRE_MANY, pipelined."""
    held = Holdings()
    chunks = [[f"{prefix}{i}" for i in range(start, min(n, start + MANY))] for start in range(0, n, MANY)]

    async def one(pipe: _Pipe, names: list[str]) -> None:
        owner = os.urandom(16)
        reply = await pipe.call(P.OP_ACQUIRE_MANY, [[name, False] for name in names], owner, TTL_MS, 0, 0, None)
        tokens = _ok(reply, f"acquire_many {names[0]}..")[0]  # type: ignore[index]
        held.groups.append((names, owner, tokens))

    await _pipelined(pipes, chunks, one, window)
    return held


async def release_all(pipes: list[_Pipe], held: Holdings, window: int) -> None:
    """Release every lease of ``held``, pipelined (one RELEASE per lease)."""
    async def one(pipe: _Pipe, group: tuple[list[str], bytes, list[int]]) -> None:
        names, owner, tokens = group
        replies = await asyncio.gather(*(pipe.call(P.OP_RELEASE, name, token, owner)
                                         for name, token in zip(names, tokens)))
        for r in replies:
            _ok(r, "release")

    await _pipelined(pipes, held.groups, one, max(1, window // 2))
    held.groups.clear()


async def open_pipes(address: str, count: int) -> list[_Pipe]:
    return [await _Pipe.open(address, f"scale-{i}") for i in range(count)]


async def w1(address: str, pairs: int, time_limit: float) -> dict:
    """W1: one ``fastlock.connect`` client, acquire+release of a free lock, ``pairs`` times
    (or until ``time_limit`` seconds); pair latency statistics in µs."""
    samples: list[int] = []
    async with fastlock.connect(address, client_name="scale-w1") as client:
        for _ in range(50):  # warm-up
            await client.release(await client.acquire("w1/lock", ttl=10, wait=5))
        stop = time.monotonic() + time_limit
        for _ in range(pairs):
            t0 = time.perf_counter_ns()
            lease = await client.acquire("w1/lock", ttl=10, wait=5)
            await client.release(lease)
            samples.append(time.perf_counter_ns() - t0)
            if time.monotonic() > stop:
                break
    return latency_stats(samples)


def _say(text: str) -> None:
    print(text, flush=True)


def _mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


def _w1_line(label: str, st: dict) -> str:
    return (f"W1 {label}: p50 {st['p50']:.0f} µs, p90 {st['p90']:.0f} µs, p99 {st['p99']:.0f} µs, "
            f"max {st['max']:.0f} µs ({st['n']} pairs)")


def _server_args(n: int, extra: list[str]) -> list[str]:
    return ["--max-leases", str(n + 1000), "--max-output-bytes", str(256 << 20), *extra]


async def _timed(coro, timeout: float, what: str):
    try:
        return await asyncio.wait_for(coro, timeout)
    except TimeoutError:
        raise RuntimeError(f"{what}: not done within {timeout} s (--phase-timeout)") from None


async def memory_and_w1(root: Path, args: argparse.Namespace) -> dict:
    """The memory and W1 phases (see the module docstring)."""
    n = args.leases
    out: dict = {"leases": n}
    srv = ServerProcess(root / "memory", fsync="never",
                        args=_server_args(n, args.server_args))
    srv.start()
    try:
        pid = srv.pid
        out["rss_start_kib"] = rss_kib(pid)
        _say(f"server pid {pid}, RSS at start {_mib(out['rss_start_kib'])}")
        out["w1_empty"] = await _timed(w1(srv.address, args.w1_pairs, args.phase_timeout), args.phase_timeout,
                                       "W1")
        _say(_w1_line("with 0 leases held", out["w1_empty"]))
        pipes = await open_pipes(srv.address, args.connections)
        t0 = time.perf_counter()
        held = await _timed(acquire_names(pipes, "held/", n, args.window), args.phase_timeout, "filling")
        out["fill_seconds"] = round(time.perf_counter() - t0, 2)
        out["rss_held_kib"] = rss_kib(pid)
        out["held_status"] = len(held)
        _say(f"{n:,} leases held in {out['fill_seconds']} s; RSS {_mib(out['rss_held_kib'])}")
        out["w1_held"] = await _timed(w1(srv.address, args.w1_pairs, args.phase_timeout), args.phase_timeout,
                                      "W1")
        _say(_w1_line(f"with {n:,} leases held", out["w1_held"]))
        t0 = time.perf_counter()
        await _timed(release_all(pipes, held, args.window), args.phase_timeout, "releasing")
        out["release_seconds"] = round(time.perf_counter() - t0, 2)
        out["rss_released_kib"] = rss_kib(pid)
        _say(f"all released in {out['release_seconds']} s; RSS {_mib(out['rss_released_kib'])}")
        t0 = time.perf_counter()
        used = await _timed(acquire_names(pipes, "used/", n, args.window), args.phase_timeout, "names")
        await _timed(release_all(pipes, used, args.window), args.phase_timeout, "names")
        out["names_seconds"] = round(time.perf_counter() - t0, 2)
        out["rss_names_kib"] = rss_kib(pid)
        _say(f"{n:,} more names used once (acquired, released) in {out['names_seconds']} s; "
             f"RSS {_mib(out['rss_names_kib'])}")
        out["w1_after"] = await _timed(w1(srv.address, args.w1_pairs, args.phase_timeout), args.phase_timeout,
                                       "W1")
        _say(_w1_line("after all released", out["w1_after"]))
        st = _ok(await pipes[0].call(P.OP_STATUS), "status")
        out["status_after"] = {k: v for k, v in st.items() if isinstance(v, int)}  # type: ignore[union-attr]
        for p in pipes:
            p.close()
    finally:
        srv.stop()
    out["bytes_per_held_lease"] = round((out["rss_held_kib"] - out["rss_start_kib"]) * 1024 / n)
    out["bytes_per_name_used"] = round((out["rss_names_kib"] - out["rss_released_kib"]) * 1024 / n)
    out["retained_after_release_bytes_per_lease"] = round((out["rss_released_kib"] - out["rss_start_kib"]) * 1024 / n)
    _say(f"=> {out['bytes_per_held_lease']} bytes per held lease; after release "
         f"{out['retained_after_release_bytes_per_lease']} bytes per lease retained; "
         f"{out['bytes_per_name_used']} bytes per name ever used (on top)")
    return out


def _dir_sizes(data_dir: Path) -> dict:
    sizes = {"wal_bytes": 0, "snapshot_bytes": 0, "other_bytes": 0}
    for f in data_dir.rglob("*"):
        if not f.is_file():
            continue
        kind = "snapshot_bytes" if "snap" in f.name else "wal_bytes" if f.name.endswith(".wal") or "wal" in f.name \
            else "other_bytes"
        sizes[kind] += f.stat().st_size
    return sizes


async def _first_grant(address: str, deadline: float) -> tuple[float, bool, str | None]:
    """Connect, acquire a free lock (wait 0) and one of the held names; the time of the
    first answer (perf_counter), whether the held name was refused as held, and the
    error of the free lock's acquire (None: granted; a relaxed ``--fsync`` mode refuses
    grants for the longest TTL after a restart)."""
    while True:
        try:
            pipe = await _Pipe.open(address, "scale-recovery")
            break
        except (ConnectionError, OSError):
            if time.perf_counter() > deadline:
                raise
            await asyncio.sleep(0.002)
    reply = await pipe.call(P.OP_ACQUIRE, "recovery/free", os.urandom(16), 10_000, 0, 0, None)
    granted = time.perf_counter()
    refused = None if reply[1] == P.STATUS_OK else str(reply[2])
    reply = await pipe.call(P.OP_ACQUIRE, "held/0", os.urandom(16), 10_000, 0, 0, None)
    pipe.close()
    return granted, reply[1] != P.STATUS_OK, refused


async def recovery(root: Path, fsync: str, args: argparse.Namespace) -> dict:
    """Hold N leases, SIGKILL, restart on the same data dir: how long until it grants."""
    n = args.leases
    data = root / f"recovery-{fsync}"
    out: dict = {"fsync": fsync, "leases": n}
    srv = ServerProcess(data, fsync=fsync, args=_server_args(n, args.server_args))
    srv.start()
    try:
        pipes = await open_pipes(srv.address, args.connections)
        t0 = time.perf_counter()
        await _timed(acquire_names(pipes, "held/", n, args.window), args.phase_timeout, "filling")
        out["fill_seconds"] = round(time.perf_counter() - t0, 2)
        out["rss_held_kib"] = rss_kib(srv.pid)
        for p in pipes:
            p.close()
    finally:
        srv.kill()
    out.update(_dir_sizes(data))
    again = ServerProcess(data, fsync=fsync, port=srv.port, log_level="INFO", args=_server_args(n, args.server_args))
    t0 = time.perf_counter()
    again.start(timeout=args.phase_timeout)
    try:
        listening = time.perf_counter()
        granted, still_held, refused = await _first_grant(again.address, t0 + args.phase_timeout)
        out["free_lock_refused"] = refused
        out["to_listening_s"] = round(listening - t0, 3)
        out["to_first_grant_s"] = round(granted - t0, 3)
        out["held_name_still_held"] = still_held
        m = _RECOVERED.search(again.wait_for_log(_RECOVERED, 5))
        if m:
            out["recovered_leases"] = int(m.group(1))
            out["server_recovery_ms"] = float(m.group(2))
        out["rss_recovered_kib"] = rss_kib(again.pid)
    finally:
        again.stop()
    _say(f"recovery, --fsync {fsync}: {n:,} leases filled in {out['fill_seconds']} s; SIGKILL; on disk: WAL "
         f"{out['wal_bytes'] / 1e6:.1f} MB, snapshot {out['snapshot_bytes'] / 1e6:.1f} MB; restart -> listening "
         f"{out['to_listening_s']} s, first answer {out['to_first_grant_s']} s "
         f"({'granted' if refused is None else 'refused: ' + refused}) (server's own figure "
         f"{out.get('server_recovery_ms')} ms for {out.get('recovered_leases')} leases); a held name still held: "
         f"{still_held}; RSS after recovery {_mib(out['rss_recovered_kib'])}")
    return out


async def run(args: argparse.Namespace) -> dict:
    result: dict = {"leases": args.leases}
    with tempfile.TemporaryDirectory(prefix="fastlock-scale-") as tmp:
        root = Path(tmp)
        if not args.no_memory:
            result["memory"] = await memory_and_w1(root, args)
        result["recovery"] = [await recovery(root, mode, args) for mode in args.recovery if mode]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--leases", type=int, default=1_000_000, help="N: leases held, names used (default 1,000,000)")
    ap.add_argument("--w1-pairs", type=int, default=5000, help="W1 pairs per measurement (default 5000)")
    ap.add_argument("--connections", type=int, default=4, help="connections that fill (default 4)")
    ap.add_argument("--window", type=int, default=16, help="ACQUIRE_MANY requests in flight per connection")
    ap.add_argument("--recovery", default="always,never", type=lambda s: s.split(","),
                    help="fsync modes of the recovery runs, comma-separated ('' for none; default always,never)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory and W1 phases")
    ap.add_argument("--phase-timeout", type=float, default=300.0, help="seconds any one phase may take")
    ap.add_argument("--server-args", default="", type=lambda s: s.split(), help="extra `fastlock serve` flags")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.leases < MANY:
        ap.error(f"--leases must be at least {MANY}")
    try:
        import uvloop
    except ImportError:
        uvloop = None
    result = uvloop.run(run(args)) if uvloop is not None else asyncio.run(run(args))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
