"""Where a durable W3 hand-off's time goes, and this machine's floor for it.

    python -m benches.durable_handoff [--rounds 3] [--seconds 4] [--clients 16] [--hold-ms 1]
                                      [--dir PATH] [--json PATH] [--baseline DIR]

W3 of :mod:`benches.peers` is ``--clients`` clients on ONE lock, each holding it
``--hold-ms`` and then releasing it.  Issue 27's target asks that with ``--fsync always``
a hand-off cost no more than with ``--fsync never`` plus one preallocated ``fdatasync``
(the fsync probe's p50), over 0.97.  This bench runs, in the same rounds:

fastlock, fastlock client
    the W3 of ``benches.peers``: ``fastlock.connect()`` clients, acquire (waiting),
    hold, release.
fastlock, raw client
    the same loop of bare msgpack frames (HELLO, then ACQUIRE with a wait and RELEASE).
reference server, raw client
    seventy lines of uvloop that do what a durable FIFO lock server cannot avoid: a
    RELEASE with a waiter is answered, then the release's and the next grant's records are
    appended to a preallocated file with one ``pwrite`` and, in ``always``, one
    ``fdatasync``, then the grant's reply is written.  Its always-minus-never is the floor
    of a durable hand-off on this machine.
baseline (with ``--baseline DIR``)
    the fastlock server of another build (``DIR/fastlock``, compiled in place) with the
    same two clients, in the same rounds: an A/B of a server change.
fsync probe
    :func:`benches.fsync_probe.probe`'s ``overwrite`` p50 (4 KiB into preallocated
    space + ``fdatasync``), the figure the target names.

Per run: microseconds per hand-off (the target's figure, the measured span over the
grants in it), the hand-off gap p50 (a holder's RELEASE sent -> the next holder's grant
received, one clock: the part a server can change), the hold p50 (``asyncio.sleep``
oversleeps) and the releasing client's RELEASE round trip p50.  fastlock runs under a thin
timer (as ``benches.durable_path``'s): per RELEASE read, the time until the next grant's
reply is handed to its transport, whether that happened within the same read (the batch
written and synced on the loop, no thread hop), that time less the ``fdatasync`` in it,
and the server's own ``fdatasync`` p50.

Rounds alternate the order of the modes and of the servers (the machine is small and
shared); medians over rounds are printed.  Every server is on 127.0.0.1 with a free port
and stopped by its PID; every loop is bounded by ``--seconds`` and a count.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import collections
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import msgpack

from benches import fsync_probe
from benches.harness import ServerProcess, free_port, run_async
from fastlock.protocol import PROTOCOL_VERSION

PREALLOC = 8 << 20  # the reference server's file (bytes)
MODES = ("never", "always")
WARMUP_S = 1.0  # seconds of each run not counted
MAX_HANDOFFS = 200_000  # a bound on each client's loop besides the clock
OP_HELLO, OP_ACQUIRE, OP_RELEASE = 1, 2, 3
LOCK = "w3"


# --------------------------------------------------------------------------- #
# the servers
# --------------------------------------------------------------------------- #

def serve_timed(out_path: str, serve_args: list[str]) -> None:
    """Run ``fastlock serve serve_args`` in this process with each RELEASE timed from the read
    that carried it to the flush of the next grant's reply (another connection's), and that time
    less the one ``fdatasync`` made meanwhile (``beyond_sync_us``, when exactly one was); write
    ``{"handoff_us": [...], "inline": [...], "beyond_sync_us": [...], "fsync_us": [...], "fsyncs",
    "thread_fsyncs"}`` to ``out_path`` when the server exits."""
    from fastlock.cli import main as fastlock_main
    from fastlock.server.session import Session

    data_received = Session.data_received
    flush = Session.flush
    clock = time.perf_counter_ns
    state: dict[str, Any] = {"t0": 0, "from": None, "reading": False, "fsyncs": 0}
    spent: list[float] = []
    beyond: list[float] = []
    inline: list[bool] = []
    servers: list = []

    def timed_data_received(self: Session, data: bytes) -> None:
        try:
            msg = msgpack.unpackb(data)
            if type(msg) is list and len(msg) > 1 and msg[1] == OP_RELEASE:
                state["t0"] = clock()
                state["from"] = id(self)
                state["fsyncs"] = self.server.commit.io.fsyncs
        except Exception:  # noqa: BLE001 - several frames or a partial one: not timed
            pass
        state["reading"] = True
        try:
            data_received(self, data)
        finally:
            state["reading"] = False

    def timed_flush(self: Session) -> None:
        if state["from"] is not None and id(self) != state["from"] and self.out:
            spent.append((clock() - state["t0"]) / 1e3)
            inline.append(state["reading"])
            io = self.server.commit.io
            if io.fsyncs == state["fsyncs"] + 1:
                beyond.append(spent[-1] - io.fsync_seconds[-1] * 1e6)
            state["from"] = None
            if not servers:
                servers.append(self.server)
        flush(self)

    Session.data_received = timed_data_received  # type: ignore[method-assign]
    Session.flush = timed_flush  # type: ignore[method-assign]

    def write() -> None:
        out: dict[str, Any] = {"handoff_us": spent, "inline": inline, "beyond_sync_us": beyond, "fsync_us": [],
                               "fsyncs": 0, "thread_fsyncs": 0}
        for server in servers:
            out["fsync_us"] = [seconds * 1e6 for seconds in server.wal.take_fsync_seconds()]
            io = server.commit.io
            out["fsyncs"], out["thread_fsyncs"] = io.fsyncs, io.thread_fsyncs
        with open(out_path, "w") as f:
            json.dump(out, f)

    atexit.register(write)
    sys.exit(fastlock_main(["serve", *serve_args]))


def serve_reference(port: int, mode: str, directory: str) -> None:
    """The reference server: one lock, FIFO waiters.  An ACQUIRE of a free lock is granted at
    once (its record appended and, ``always``, ``fdatasync``'d before the reply); else it waits.
    A RELEASE by the holder is answered at once (it waits for no sync, as fastlock's), then its
    record and the next waiter's grant record are appended with one ``pwrite`` and (``always``)
    one ``fdatasync`` before the grant's reply.  HELLO is answered ok."""
    import uvloop

    fd, path = tempfile.mkstemp(dir=directory)
    os.unlink(path)
    os.pwrite(fd, bytes(PREALLOC), 0)
    os.fsync(fd)
    durable = mode == "always"
    state: dict[str, Any] = {"off": 0, "token": 0, "holder": None}
    waiters: collections.deque = collections.deque()  # (connection, request id, ttl_ms), FIFO

    def append(records: bytes) -> None:
        off = state["off"]
        os.pwrite(fd, records, off)
        state["off"] = (off + len(records)) % (PREALLOC - 4096)

    def grant(conn: Reference, req_id: int, ttl_ms: int) -> tuple[bytes, bytes]:
        """The next token to ``conn``: its record and its reply."""
        state["token"] += 1
        state["holder"] = (conn, state["token"])
        return (msgpack.packb([1, LOCK, state["token"], ttl_ms, time.time_ns() // 1_000_000]),
                msgpack.packb([req_id, 0, [state["token"], ttl_ms, 0]]))

    def hand_off(records: bytes) -> None:
        """The lock is free: grant it to the next waiter (``records`` and its grant's synced first)."""
        state["holder"] = None
        if not waiters:
            if records:
                append(records)
            return
        conn, req_id, ttl_ms = waiters.popleft()
        record, reply = grant(conn, req_id, ttl_ms)
        append(records + record)
        if durable:
            os.fdatasync(fd)
        conn.transport.write(reply)

    class Reference(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.unpacker = msgpack.Unpacker()
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def connection_lost(self, exc: Exception | None) -> None:
            for entry in [w for w in waiters if w[0] is self]:
                waiters.remove(entry)
            holder = state["holder"]
            if holder is not None and holder[0] is self:
                hand_off(b"")

        def data_received(self, data: bytes) -> None:
            self.unpacker.feed(data)
            for msg in self.unpacker:
                req_id, op = msg[0], msg[1]
                if op == OP_ACQUIRE:
                    if state["holder"] is None and not waiters:
                        record, reply = grant(self, req_id, msg[4])
                        append(record)
                        if durable:
                            os.fdatasync(fd)
                        self.transport.write(reply)
                    else:
                        waiters.append((self, req_id, msg[4]))
                elif op == OP_RELEASE:
                    holder = state["holder"]
                    if holder is None or holder[0] is not self or holder[1] != msg[3]:
                        self.transport.write(msgpack.packb([req_id, 1, "not the holder"]))
                        continue
                    self.transport.write(msgpack.packb([req_id, 0, None]))  # a release waits for no sync
                    hand_off(msgpack.packb([2, LOCK, msg[3], time.time_ns() // 1_000_000]))
                else:  # HELLO (and anything else): ok
                    self.transport.write(msgpack.packb([req_id, 0, None]))

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Reference, "127.0.0.1", port)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with server:
            await stop.wait()

    uvloop.run(main())


# --------------------------------------------------------------------------- #
# the clients
# --------------------------------------------------------------------------- #

class RawClient:
    """One connection of bare msgpack frames: HELLO, ACQUIRE (waiting up to 10 s), RELEASE."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.unpacker = msgpack.Unpacker()
        self.req = 0
        self.owner = os.urandom(16)

    @classmethod
    async def open(cls, port: int) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client = cls(reader, writer)
        await client.call(OP_HELLO, PROTOCOL_VERSION, "durable_handoff", None)  # anonymous (open mode)
        return client

    async def call(self, op: int, *args: Any) -> Any:
        self.req += 1
        self.writer.write(msgpack.packb([self.req, op, *args]))
        while True:
            for reply in self.unpacker:
                if reply[1] != 0:
                    raise RuntimeError(f"server refused op {op}: {reply}")
                return reply[2]
            chunk = await self.reader.read(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.unpacker.feed(chunk)

    async def acquire(self) -> int:
        return (await self.call(OP_ACQUIRE, LOCK, self.owner, 10_000, 10_000, 0, None))[0]

    async def release(self, token: int) -> None:
        await self.call(OP_RELEASE, LOCK, token, self.owner)

    async def close(self) -> None:
        self.writer.close()


class LibClient:
    """One ``fastlock.connect()`` client: acquire (waiting up to 10 s), release."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.lease: Any = None

    @classmethod
    async def open(cls, port: int) -> LibClient:
        import fastlock
        return cls(await fastlock.connect(f"127.0.0.1:{port}"))

    async def acquire(self) -> int:
        self.lease = await self.client.acquire(LOCK, ttl=10, wait=10)
        return self.lease.fencing_token

    async def release(self, token: int) -> None:
        await self.client.release(self.lease)

    async def close(self) -> None:
        await self.client.close()


async def w3(kind: Any, port: int, clients: int, hold_s: float, seconds: float) -> dict[str, float]:
    """``clients`` connections of ``kind`` on one lock, each acquiring, holding ``hold_s`` and
    releasing, for ``WARMUP_S`` + ``seconds``: microseconds per hand-off over the measured
    grants, the gap p50 (a RELEASE sent -> the next grant received), the hold p50 and the
    release's round trip p50."""
    conns = [await kind.open(port) for _ in range(clients)]
    events: list[tuple[int, int, int]] = []  # (grant received ns, release sent ns, token)
    releases: list[tuple[int, int]] = []  # (release sent ns, its round trip ns)
    clock = time.perf_counter_ns
    start = clock()
    measure = start + int(WARMUP_S * 1e9)
    end = measure + int(seconds * 1e9)

    async def one(c: Any) -> None:
        for _ in range(MAX_HANDOFFS):
            if clock() >= end:
                return
            token = await c.acquire()
            granted = clock()
            await asyncio.sleep(hold_s)
            released = clock()
            events.append((granted, released, token))
            await c.release(token)
            releases.append((released, clock() - released))

    try:
        await asyncio.wait_for(asyncio.gather(*(one(c) for c in conns)), WARMUP_S + seconds + 30)
    finally:
        for c in conns:
            await c.close()
    events.sort()
    tokens = [e[2] for e in events]
    if any(a >= b for a, b in zip(tokens, tokens[1:])):
        raise RuntimeError("fencing tokens did not increase along the grant order")
    counted = [e for e in events if measure <= e[0] < end]
    gaps = [b[0] - a[1] for a, b in zip(events, events[1:]) if measure <= b[0] < end]
    holds = [e[1] - e[0] for e in counted]
    answered = [rtt for sent, rtt in releases if measure <= sent < end]
    if len(counted) < 2:
        raise RuntimeError(f"only {len(counted)} grants measured")
    span = counted[-1][0] - counted[0][0]
    return {"us_per_handoff": span / (len(counted) - 1) / 1e3, "gap_p50_us": statistics.median(gaps) / 1e3,
            "hold_p50_us": statistics.median(holds) / 1e3,
            "release_p50_us": statistics.median(answered) / 1e3 if answered else float("nan"),
            "handoffs": len(counted)}


# --------------------------------------------------------------------------- #
# one round
# --------------------------------------------------------------------------- #

def _child(*args: str, package_dir: str | None = None) -> list[str]:
    """The command line of this module run again in a child process that imports the same
    ``fastlock`` and ``benches`` as this one (``package_dir``: its ``fastlock`` from there)."""
    path = ([os.path.abspath(package_dir)] if package_dir else []) + sys.path
    code = f"import sys; sys.path[:] = {path!r}; from benches.durable_handoff import main; sys.exit(main())"
    return [sys.executable, "-c", code, *args]


def measure_fastlock(mode: str, args: argparse.Namespace, work: str, package_dir: str | None = None) -> dict:
    """The fastlock server (of ``package_dir``'s build, else this one's) in ``mode`` under the timer,
    with the raw client's W3, then the fastlock client's."""
    port = free_port()
    data = tempfile.mkdtemp(dir=work)
    timings = os.path.join(work, f"timed-{mode}.json")
    server = ServerProcess("fastlock", _child("--serve-timed", timings, "--", "--listen", f"127.0.0.1:{port}",
                                             "--data-dir", data, "--fsync", mode, "--log-level", "WARNING",
                                             package_dir=package_dir),
                           log_path=os.path.join(work, f"fastlock-{mode}.log"))
    hold = args.hold_ms / 1e3
    try:
        server.start(ready_port=port)
        raw = run_async(w3(RawClient, port, args.clients, hold, args.seconds))
        lib = run_async(w3(LibClient, port, args.clients, hold, args.seconds))
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)
    with open(timings) as f:
        timed = json.load(f)
    os.unlink(timings)
    spent = timed["handoff_us"]
    syncs = timed["fsync_us"]
    return {"raw": raw, "lib": lib,
            "server_handoff_p50_us": statistics.median(spent) if spent else float("nan"),
            "server_inline_share": sum(timed["inline"]) / len(spent) if spent else float("nan"),
            "server_beyond_sync_p50_us": statistics.median(timed["beyond_sync_us"]) if timed["beyond_sync_us"]
            else float("nan"),
            "server_fsync_p50_us": statistics.median(syncs) if syncs else 0.0,
            "thread_fsync_share": timed["thread_fsyncs"] / timed["fsyncs"] if timed["fsyncs"] else 0.0}


def measure_reference(mode: str, args: argparse.Namespace, work: str) -> dict:
    """The reference server in ``mode`` with the raw client's W3."""
    port = free_port()
    server = ServerProcess("reference", _child("--serve-reference", mode, "--port", str(port), "--dir", work),
                           log_path=os.path.join(work, f"reference-{mode}.log"))
    try:
        server.start(ready_port=port)
        raw = run_async(w3(RawClient, port, args.clients, args.hold_ms / 1e3, args.seconds))
    finally:
        server.stop()
    return {"raw": raw}


def one_round(rnd: int, args: argparse.Namespace, work: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    modes = MODES if rnd % 2 == 0 else MODES[::-1]
    servers: list[tuple[str, Any]] = [("fastlock", measure_fastlock), ("reference", measure_reference)]
    if args.baseline:
        servers.insert(1, ("baseline", lambda mode, args, work: measure_fastlock(mode, args, work, args.baseline)))
    for mode in modes:
        for name, measure in (servers if rnd % 4 < 2 else servers[::-1]):
            out[f"{name} {mode}"] = measure(mode, args, work)
    out["probe_p50_us"] = fsync_probe.probe(work, 1000)["overwrite"]["p50"]
    return out


#: the clients each server is measured with
CLIENTS = {"fastlock": ("lib", "raw"), "baseline": ("lib", "raw"), "reference": ("raw",)}
KEYS = ("us_per_handoff", "gap_p50_us", "hold_p50_us", "release_p50_us")
SERVER_KEYS = ("server_handoff_p50_us", "server_inline_share", "server_beyond_sync_p50_us", "server_fsync_p50_us",
               "thread_fsync_share")


def summarise(rounds: list[dict]) -> dict[str, float]:
    """Medians over rounds: ``"<server> <mode> <client> <figure>"``, the fastlock servers'
    timings ``"<server> <mode> <timing>"`` and ``probe_p50_us``."""
    med = statistics.median
    s: dict[str, float] = {"probe_p50_us": med(r["probe_p50_us"] for r in rounds)}
    for server, clients in CLIENTS.items():
        if f"{server} never" not in rounds[0]:
            continue
        for mode in MODES:
            for client in clients:
                for key in KEYS:
                    s[f"{server} {mode} {client} {key}"] = med(r[f"{server} {mode}"][client][key] for r in rounds)
            if server != "reference":
                for key in SERVER_KEYS:
                    s[f"{server} {mode} {key}"] = med(r[f"{server} {mode}"][key] for r in rounds)
    return s


def report(s: dict[str, float]) -> str:
    probe = s["probe_p50_us"]
    names = {"lib": "fastlock client", "raw": "raw client"}
    lines = ["| microseconds | never | always | extra | extra / probe | always / bound |",
             "|---|---:|---:|---:|---:|---:|"]
    for server, clients in CLIENTS.items():
        for client in clients:
            if f"{server} never {client} us_per_handoff" not in s:
                continue
            for key, what in (("us_per_handoff", "per hand-off"), ("gap_p50_us", "gap p50 (release sent -> grant)"),
                              ("hold_p50_us", "hold p50"), ("release_p50_us", "release round trip p50")):
                never, always = s[f"{server} never {client} {key}"], s[f"{server} always {client} {key}"]
                bound = f"{always / ((never + probe) / 0.97):.3f}" if key == "us_per_handoff" else ""
                lines.append(f"| {server}, {names[client]}: {what} | {never:.0f} | {always:.0f} | "
                             f"{always - never:.0f} | {(always - never) / probe:.2f} | {bound} |")
    lines.append("")
    for server in ("fastlock", "baseline"):
        for mode in MODES:
            if f"{server} {mode} server_handoff_p50_us" in s:
                lines.append(f"{server} {mode}: server time RELEASE read -> next grant's reply p50 "
                             f"{s[f'{server} {mode} server_handoff_p50_us']:.0f} us, within the same read "
                             f"{s[f'{server} {mode} server_inline_share']:.0%}, beyond its one fdatasync p50 "
                             f"{s[f'{server} {mode} server_beyond_sync_p50_us']:.0f} us; its fdatasync p50 "
                             f"{s[f'{server} {mode} server_fsync_p50_us']:.0f} us, on the writer thread "
                             f"{s[f'{server} {mode} thread_fsync_share']:.0%}")
    lines.append(f"fsync probe (4 KiB into preallocated space + fdatasync) p50: {probe:.0f} us; the target: "
                 "always / bound <= 1, bound = (never + probe) / 0.97")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve-timed"]:
        serve_timed(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
        return 0
    ap = argparse.ArgumentParser(prog="python -m benches.durable_handoff", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--rounds", type=int, default=3, help="rounds, alternating the order (default 3)")
    ap.add_argument("--seconds", type=float, default=4.0,
                    help=f"seconds measured per run after {WARMUP_S:g} s not counted (default 4)")
    ap.add_argument("--clients", type=int, default=16, help="clients on the one lock (default 16)")
    ap.add_argument("--hold-ms", type=float, default=1.0, help="milliseconds each holds the lock (default 1)")
    ap.add_argument("--dir", default=None, help="where the data dirs and the probe's file go "
                    "(default: a temporary directory under the current one, so the disk is this one's)")
    ap.add_argument("--json", metavar="PATH", help="also write every round and the medians as JSON")
    ap.add_argument("--baseline", metavar="DIR", help="also run, as 'baseline', the fastlock server of the "
                    "package DIR/fastlock (another build: a checkout with its modules compiled in place)")
    ap.add_argument("--serve-reference", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_reference:
        serve_reference(args.port, args.serve_reference, args.dir or ".")
        return 0
    if not (1 <= args.rounds <= 20 and 0.5 <= args.seconds <= 120 and 2 <= args.clients <= 256
            and 0 <= args.hold_ms <= 100):
        ap.error("--rounds 1-20, --seconds 0.5-120, --clients 2-256 and --hold-ms 0-100")
    if args.baseline and not os.path.isdir(os.path.join(args.baseline, "fastlock")):
        ap.error(f"--baseline {args.baseline}: no fastlock package there")
    work = tempfile.mkdtemp(prefix="durable-handoff-", dir=args.dir or ".")
    try:
        rounds = []
        for rnd in range(args.rounds):
            r = one_round(rnd, args, work)
            rounds.append(r)
            brief = {k: (round(v["raw"]["us_per_handoff"]) if isinstance(v, dict) else round(v))
                     for k, v in r.items()}
            print(f"round {rnd + 1}/{args.rounds}: us per hand-off (raw client) {json.dumps(brief)}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarise(rounds)
    print(report(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "medians": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
