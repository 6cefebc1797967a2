"""What a principal that abuses RESERVE costs the others (fastlock.server.woundwait).

    python -m benches.reserve_abuse [--parked 1000] [--pairs 300] [--closes 200] [--refused 5000]

One ``fastlock serve`` (``--fsync never``) with two client principals, ``attacker`` and
``honest``.  Printed:

* an honest principal's RESERVE+RELEASE pair (one name, microseconds, sequential round
  trips) before and after the attacker parks ``--parked`` reservations of 64 names each
  behind an older reservation of its own (a wake looks only at the reservations parked on
  the names an older one stopped waiting on);
* the server's CPU time per connection of the honest principal opened and closed (HELLO,
  then a close) while those reservations are parked, over ``--closes`` of them (a close wakes
  only the reservations parked on the names the closed connection's reservations waited on);
* the seconds the server takes to answer ``--refused`` pipelined RESERVEs of the attacker
  once it is at its 1,000 live reservations (each refusal looks at a bounded number of its
  own reservations), and the honest principal's worst PING meanwhile (milliseconds).

Everything runs on 127.0.0.1; the server is stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

import msgpack

from fastlock import protocol as P
from fastlock._testbase import ServerProcess, raw_hello
from fastlock.auth import generate
from fastlock.protocol.ops import OP_RESERVE
from fastlock.server.woundwait import MAX_RESERVATIONS_PER_PRINCIPAL

TTL_MS = 600_000


class Peer:
    """A blocking raw msgpack connection."""

    def __init__(self, address: str, name: str, token: str):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=120)
        self.unpacker = msgpack.Unpacker(raw=False)
        self.next_id = 1
        reply = raw_hello(self.call, name, token)
        assert reply[1] == 0, reply

    def send(self, op: int, *args) -> int:
        rid = self.next_id
        self.next_id += 1
        self.sock.sendall(msgpack.packb([rid, op, *args], use_bin_type=True))
        return rid

    def recv(self):
        while True:
            for msg in self.unpacker:
                return msg
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("closed")
            self.unpacker.feed(data)

    def call(self, op: int, *args):
        rid = self.send(op, *args)
        while True:
            msg = self.recv()
            if msg[0] == rid:
                return msg

    def close(self) -> None:
        self.sock.close()


def pair_us(peer: Peer, count: int, tag: str) -> float:
    """Microseconds per RESERVE+RELEASE of one fresh name, ``count`` times in a row."""
    t0 = time.perf_counter()
    for i in range(count):
        owner = os.urandom(16)
        reply = peer.call(OP_RESERVE, [f"honest/{tag}/{i}"], owner, TTL_MS, 0, None, int(time.time() * 1000),
                          b"h%d" % i)
        assert reply[1] == 0, reply
        peer.call(P.OP_RELEASE, f"honest/{tag}/{i}", reply[2][0][0], owner)
    return (time.perf_counter() - t0) / count * 1e6


def cpu_seconds(pid: int) -> float:
    """The user + system CPU time (seconds) of process ``pid`` so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.reserve_abuse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--parked", type=int, default=1000, help="reservations the attacker parks (64 names each)")
    ap.add_argument("--pairs", type=int, default=300, help="honest RESERVE+RELEASE pairs timed each time")
    ap.add_argument("--closes", type=int, default=200, help="connections opened and closed with them parked")
    ap.add_argument("--refused", type=int, default=5000, help="pipelined RESERVEs refused at the limit")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fastlock-reserve-abuse-") as tmp:
        root = Path(tmp)
        paths = generate(root / "creds", clients=[("attacker", ""), ("honest", "")], replicas=[], admins=[])
        tokens = {p: Path(f).read_text().strip() for p, f in paths.items()}
        server = ServerProcess(root / "data", fsync="never", args=[
            "--credentials", str(root / "creds" / "credentials.toml"),
            "--max-waiters-per-principal", "1000000", "--max-leases-per-principal", "1000000"]).start()
        try:
            honest = Peer(server.address, "honest", tokens["honest"])
            attacker = Peer(server.address, "attacker", tokens["attacker"])
            before = pair_us(honest, args.pairs, "a")
            attacker.call(P.OP_ACQUIRE, "attacker/held", os.urandom(16), TTL_MS, 0, 0, None)
            stamp = int(time.time() * 1000)
            attacker.send(OP_RESERVE, ["attacker/held"], os.urandom(16), TTL_MS, TTL_MS, None, stamp - 5_000,
                          b"older")
            for i in range(args.parked):
                attacker.send(OP_RESERVE, [f"attacker/{i}/{k}" for k in range(63)] + ["attacker/held"],
                              os.urandom(16), TTL_MS, TTL_MS, None, stamp, b"p%d" % i)
            attacker.call(P.OP_PING)
            after = pair_us(honest, args.pairs, "b")
            print(f"honest RESERVE+RELEASE: {before:.0f} us before, {after:.0f} us with {args.parked} "
                  f"reservations of 64 names parked by another principal")
            cpu_before = cpu_seconds(server.proc.pid)
            for _ in range(args.closes):
                Peer(server.address, "honest-closed", tokens["honest"]).close()
                honest.call(P.OP_PING)  # after the close was read
            per_close = (cpu_seconds(server.proc.pid) - cpu_before) / max(1, args.closes)
            print(f"a connection opened and closed with them parked: {per_close * 1e3:.2f} ms of server CPU "
                  f"(over {args.closes})")
            attacker.close()  # its parked reservations go with its connection
            filler = Peer(server.address, "attacker-2", tokens["attacker"])
            for i in range(MAX_RESERVATIONS_PER_PRINCIPAL):
                filler.send(OP_RESERVE, [f"attacker/r/{i}"], os.urandom(16), TTL_MS, 0, None, stamp, b"r%d" % i)
            filler.call(P.OP_PING)
            frames = b"".join(msgpack.packb([filler.next_id + i, OP_RESERVE, ["attacker/z"], os.urandom(16), TTL_MS,
                                             0, None, int(time.time() * 1000), b"q%d" % i], use_bin_type=True)
                              for i in range(args.refused))
            last = filler.next_id + args.refused - 1
            t0 = time.perf_counter()
            filler.sock.sendall(frames)
            worst = 0.0
            for _ in range(20):
                t = time.perf_counter()
                honest.call(P.OP_PING)
                worst = max(worst, time.perf_counter() - t)
            while filler.recv()[0] != last:
                pass
            print(f"{args.refused} RESERVEs refused at the limit of {MAX_RESERVATIONS_PER_PRINCIPAL}: answered in "
                  f"{time.perf_counter() - t0:.2f} s; the honest principal's worst PING meanwhile "
                  f"{worst * 1000:.1f} ms")
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
