"""Where a durable W1 acquire's time goes: inside the server, or around it.

    python -m benches.durable_path [--rounds 3] [--pairs 3000] [--dir PATH] [--json PATH]

Issue 12's W1 target asks that an ``--fsync always`` acquire+release cost no
more than the same pair with ``--fsync never`` plus one preallocated
``fdatasync`` (the fsync probe's p50).  This bench splits the durable pair's
extra time into the part the server spends and the part it does not:

server time per ACQUIRE (in process)
    ``fastlock serve`` runs under a thin timer (``--serve-timed``): from the
    read that carried an ACQUIRE to the flush of that connection's reply, per
    request, in the server process (``time.perf_counter_ns``).  Everything the
    durable path does - the WAL record, the ``fdatasync``, the hand-back of the
    grant - lies inside this window; the network and the client do not.
pair p50, raw client
    a msgpack client with no library around it (HELLO, then ACQUIRE + RELEASE
    of one lock, one request at a time) against the same two servers.
pair p50, fastlock client
    ``fastlock.connect()`` acquire + release, the W1 of ``benches.peers``.
reference server
    forty lines of uvloop that answer the same frames and do what a durable
    lock server cannot avoid: append the request to a preallocated file and,
    in ``always``, ``fdatasync`` it before an ACQUIRE's reply.  Its extra is
    the floor of the exchange on this machine.
fsync probe
    :func:`benches.fsync_probe.probe_modes`: 4 KiB write + ``fdatasync`` into a
    preallocated file, p50, and its ``--wakeup`` round trips (what waiting for
    a sync costs a client beyond the sync).

Rounds run the servers in alternating order (the machine is small and shared);
medians over rounds are printed.  Every server is on 127.0.0.1 with a free port
and stopped by its PID; every loop is bounded by ``--pairs``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
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
from benches.harness import ServerProcess, free_port, latency_stats, run_async
from fastlock.protocol import PROTOCOL_VERSION

WARMUP = 300  # pairs not counted at the start of each measurement
PREALLOC = 8 << 20  # the reference server's file (bytes)
MODES = ("never", "always")


# --------------------------------------------------------------------------- #
# the servers
# --------------------------------------------------------------------------- #

def serve_timed(out_path: str, serve_args: list[str]) -> None:
    """Run ``fastlock serve serve_args`` in this process with each ACQUIRE timed from the read
    that carried it to the flush of its connection's reply; write ``{"acquire_us": [...]}`` to
    ``out_path`` when the server exits."""
    from fastlock.cli import main as fastlock_main
    from fastlock.server.session import Session

    data_received = Session.data_received
    flush = Session.flush
    clock = time.perf_counter_ns
    started: dict[int, int] = {}  # id(session) -> when the read with an ACQUIRE began
    spent: list[float] = []
    syncs: list[float] = []  # the data fsyncs' durations (microseconds)
    wals: list = []

    def timed_data_received(self: Session, data: bytes) -> None:
        try:
            msg = msgpack.unpackb(data)
            if type(msg) is list and len(msg) > 1 and msg[1] == 2:  # OP_ACQUIRE
                started[id(self)] = clock()
        except Exception:  # noqa: BLE001 - several frames or a partial one: not timed
            pass
        data_received(self, data)

    def timed_flush(self: Session) -> None:
        t0 = started.pop(id(self), None)
        if t0 is not None:
            spent.append((clock() - t0) / 1e3)
            if not wals:
                wals.append(self.server.wal)
        flush(self)

    Session.data_received = timed_data_received  # type: ignore[method-assign]
    Session.flush = timed_flush  # type: ignore[method-assign]

    def write() -> None:
        for wal in wals:
            syncs.extend(seconds * 1e6 for seconds in wal.take_fsync_seconds())
        with open(out_path, "w") as f:
            json.dump({"acquire_us": spent, "fsync_us": syncs}, f)

    atexit.register(write)
    sys.exit(fastlock_main(["serve", *serve_args]))


def serve_reference(port: int, mode: str, directory: str) -> None:
    """The reference server: answer HELLO/ACQUIRE/RELEASE frames with canned replies after
    appending each read to a preallocated file (``always``: and ``fdatasync`` before an
    ACQUIRE's reply)."""
    import uvloop

    fd, path = tempfile.mkstemp(dir=directory)
    os.unlink(path)
    os.pwrite(fd, bytes(PREALLOC), 0)
    os.fsync(fd)
    durable = mode == "always"
    state = {"off": 0, "token": 0}

    class Reference(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def data_received(self, data: bytes) -> None:
            msg = msgpack.unpackb(data)
            off = state["off"]
            os.pwrite(fd, data, off)
            state["off"] = (off + len(data)) % (PREALLOC - 4096)
            if msg[1] == 2:  # ACQUIRE: a grant
                if durable:
                    os.fdatasync(fd)
                state["token"] += 1
                reply = [msg[0], 0, [state["token"], msg[4], 0]]
            else:
                reply = [msg[0], 0, None]
            self.transport.write(msgpack.packb(reply))

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

async def raw_pairs(port: int, pairs: int) -> list[int]:
    """``pairs`` acquire+release round trips of bare msgpack frames; nanoseconds per pair."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    unpacker = msgpack.Unpacker()

    async def call(*msg: Any) -> Any:
        writer.write(msgpack.packb(list(msg)))
        while True:
            for reply in unpacker:
                if reply[1] != 0:
                    raise RuntimeError(f"server refused {msg[1]}: {reply}")
                return reply
            chunk = await reader.read(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            unpacker.feed(chunk)

    await call(1, 1, PROTOCOL_VERSION, "durable_path", None)  # HELLO, anonymous (open mode)
    owner = os.urandom(16)
    req = 2
    out = []
    clock = time.perf_counter_ns
    for _ in range(pairs):
        t0 = clock()
        token = (await call(req, 2, "w1", owner, 5000, 0, 0, None))[2][0]
        await call(req + 1, 3, "w1", token, owner)
        out.append(clock() - t0)
        req += 2
    writer.close()
    return out


async def fastlock_pairs(port: int, pairs: int) -> list[int]:
    """``pairs`` acquire+release of one lock through ``fastlock.connect()``; nanoseconds per pair."""
    import fastlock

    client = await fastlock.connect(f"127.0.0.1:{port}")
    out = []
    clock = time.perf_counter_ns
    try:
        for _ in range(pairs):
            t0 = clock()
            await client.release(await client.acquire("w1", ttl=5))
            out.append(clock() - t0)
    finally:
        await client.close()
    return out


# --------------------------------------------------------------------------- #
# one round
# --------------------------------------------------------------------------- #

def _child(*args: str) -> list[str]:
    """The command line of this module run again in a child process that imports the same
    ``fastlock`` and ``benches`` as this one (an installed package or one built in place)."""
    code = f"import sys; sys.path[:] = {sys.path!r}; from benches.durable_path import main; sys.exit(main())"
    return [sys.executable, "-c", code, *args]


def _p50(samples_ns: list[int]) -> float:
    return latency_stats(samples_ns[WARMUP:])["p50"]


def measure_fastlock(mode: str, pairs: int, work: str) -> dict[str, float]:
    port = free_port()
    data = tempfile.mkdtemp(dir=work)
    timings = os.path.join(work, f"timed-{mode}.json")
    server = ServerProcess("fastlock", _child("--serve-timed", timings, "--", "--listen", f"127.0.0.1:{port}",
                                             "--data-dir", data, "--fsync", mode, "--log-level", "WARNING"),
                           log_path=os.path.join(work, f"fastlock-{mode}.log"))
    try:
        server.start(ready_port=port)
        raw = run_async(raw_pairs(port, pairs))
        lib = run_async(fastlock_pairs(port, pairs))
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)
    with open(timings) as f:
        timed = json.load(f)
    os.unlink(timings)
    # the raw client's acquires come first: skip its warm-up, then one per pair
    server = timed["acquire_us"][WARMUP:pairs]
    syncs = timed["fsync_us"][-2 * pairs:]  # the latest 4096 at most: about the last two clients' acquires
    return {"server_acquire_p50_us": statistics.median(server) if server else float("nan"),
            "server_fsync_p50_us": statistics.median(syncs) if syncs else 0.0,
            "raw_pair_p50_us": _p50(raw), "fastlock_pair_p50_us": _p50(lib)}


def measure_reference(mode: str, pairs: int, work: str) -> dict[str, float]:
    port = free_port()
    server = ServerProcess("reference", _child("--serve-reference", mode, "--port", str(port), "--dir", work),
                           log_path=os.path.join(work, f"reference-{mode}.log"))
    try:
        server.start(ready_port=port)
        raw = run_async(raw_pairs(port, pairs))
    finally:
        server.stop()
    return {"raw_pair_p50_us": _p50(raw)}


def one_round(rnd: int, pairs: int, work: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    order = MODES if rnd % 2 == 0 else MODES[::-1]
    for mode in order:
        out[f"fastlock {mode}"] = measure_fastlock(mode, pairs, work)
        out[f"reference {mode}"] = measure_reference(mode, pairs, work)
    probe = fsync_probe.probe_modes(work, 1000)
    out["probe_p50_us"] = probe["prealloc fdatasync"]["p50_us"]
    wake = fsync_probe.wakeup(work, out["probe_p50_us"] / 1e6, seconds=1.5)
    out["wakeup_sync_extra_us"] = wake["sync"]["extra_us"]
    out["wakeup_none_extra_us"] = wake["none"]["extra_us"]
    return out


def _median(rounds: list[dict], *path: str) -> float:
    values = []
    for r in rounds:
        v: Any = r
        for key in path:
            v = v[key]
        values.append(v)
    return statistics.median(values)


def summarise(rounds: list[dict]) -> dict[str, float]:
    """Medians over rounds, and the durable extras (always - never) in microseconds."""
    s: dict[str, float] = {"probe_p50_us": _median(rounds, "probe_p50_us"),
                           "wakeup_sync_extra_us": _median(rounds, "wakeup_sync_extra_us"),
                           "wakeup_none_extra_us": _median(rounds, "wakeup_none_extra_us")}
    for mode in MODES:
        for key in ("server_acquire_p50_us", "server_fsync_p50_us", "raw_pair_p50_us", "fastlock_pair_p50_us"):
            s[f"fastlock {mode} {key}"] = _median(rounds, f"fastlock {mode}", key)
        s[f"reference {mode} raw_pair_p50_us"] = _median(rounds, f"reference {mode}", "raw_pair_p50_us")
    for name in ("fastlock {} server_acquire_p50_us", "fastlock {} raw_pair_p50_us",
                 "fastlock {} fastlock_pair_p50_us", "reference {} raw_pair_p50_us"):
        s["extra " + name.format("").replace("  ", " ")] = s[name.format("always")] - s[name.format("never")]
    return s


def report(s: dict[str, float]) -> str:
    probe = s["probe_p50_us"]
    rows = [
        ("fastlock: server time per ACQUIRE", "server_acquire_p50_us", "fastlock"),
        ("fastlock: pair, raw client", "raw_pair_p50_us", "fastlock"),
        ("fastlock: pair, fastlock client", "fastlock_pair_p50_us", "fastlock"),
        ("reference server: pair, raw client", "raw_pair_p50_us", "reference"),
    ]
    lines = ["| p50, microseconds | never | always | extra | extra / probe |", "|---|---:|---:|---:|---:|"]
    for label, key, server in rows:
        never, always = s[f"{server} never {key}"], s[f"{server} always {key}"]
        lines.append(f"| {label} | {never:.0f} | {always:.0f} | {always - never:.0f} | "
                     f"{(always - never) / probe:.2f} |")
    beyond = s["fastlock always server_acquire_p50_us"] - s["fastlock always server_fsync_p50_us"]
    lines.append(f"\nthe server's own fdatasync p50 (always): {s['fastlock always server_fsync_p50_us']:.0f} us; "
                 f"its time per durable ACQUIRE beyond that sync: {beyond:.0f} us (never: "
                 f"{s['fastlock never server_acquire_p50_us']:.0f} us in all)")
    lines.append(f"fsync probe (4 KiB write + fdatasync, preallocated) p50: {probe:.0f} us; a round trip to a "
                 f"process that syncs costs {s['wakeup_sync_extra_us']:.0f} us beyond the sync "
                 f"({s['wakeup_none_extra_us']:.0f} us to one that does nothing)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve-timed"]:
        serve_timed(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
        return 0
    ap = argparse.ArgumentParser(prog="python -m benches.durable_path", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--rounds", type=int, default=3, help="rounds, alternating the modes' order (default 3)")
    ap.add_argument("--pairs", type=int, default=3000, help="acquire+release pairs per client and server "
                    f"(default 3000; the first {WARMUP} are not counted)")
    ap.add_argument("--dir", default=None, help="where the data dirs and the probe's file go "
                    "(default: a temporary directory under the current one, so the disk is this one's)")
    ap.add_argument("--json", metavar="PATH", help="also write every round and the medians as JSON")
    ap.add_argument("--serve-reference", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_reference:
        serve_reference(args.port, args.serve_reference, args.dir or ".")
        return 0
    if args.rounds < 1 or args.pairs <= WARMUP:
        ap.error(f"--rounds must be >= 1 and --pairs > {WARMUP}")
    work = tempfile.mkdtemp(prefix="durable-path-", dir=args.dir or ".")
    try:
        rounds = []
        for rnd in range(args.rounds):
            r = one_round(rnd, args.pairs, work)
            rounds.append(r)
            print(f"round {rnd + 1}/{args.rounds}: " + json.dumps(
                {k: (round(v, 1) if isinstance(v, float) else {kk: round(vv, 1) for kk, vv in v.items()})
                 for k, v in r.items()}), flush=True)
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
