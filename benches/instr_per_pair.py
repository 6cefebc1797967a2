"""Instructions per acquire+release pair of the server process, counted by callgrind.

    python -m benches.instr_per_pair [--server fastlock|echo] [--fsync never|always|interval] [--pairs 2000]
        [--clients 1] [--keep FILE]

The server (``python -m fastlock serve --fsync MODE``, ``never`` unless ``--fsync`` says, on a free
port with a throwaway data dir, or the echo floor ``python -m benches.echo serve``) runs under
``valgrind --tool=callgrind``; ``--clients`` blocking msgpack clients on 127.0.0.1 (one
connection each, this process) run pairs on a lock of their own: ACQUIRE, then RELEASE
with the token of the reply, each request sent when the reply before it has arrived
(the echo server sends each frame back, the same bytes both ways).  After a warm-up the
counters are zeroed (``callgrind_control --zero``), ``--pairs`` pairs run (round-robin
over the clients, each client's request of a round written before the replies are read),
and the counts are dumped (``callgrind_control --dump``); the server's instructions (every
thread's: ``Ir``) divided by the pairs is printed.  Instruction counts do not move with the
machine's load, unlike CPU time: two builds are compared by running this module with each
one's python.  ``--keep FILE``: keep the dump there, for ``callgrind_annotate --inclusive=yes FILE``.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import msgpack


def _ops() -> tuple[int, int, int, int]:
    """HELLO's op and protocol version, ACQUIRE's and RELEASE's ops."""
    from fastlock import protocol as P

    return P.OP_HELLO, P.PROTOCOL_VERSION, P.OP_ACQUIRE, P.OP_RELEASE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Client:
    """A blocking msgpack client on one connection."""

    def __init__(self, port: int, deadline: float) -> None:
        while True:
            try:
                self.sock = socket.create_connection(("127.0.0.1", port), 1.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.sock.settimeout(120.0)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.unpacker = msgpack.Unpacker()
        self.token = 1  # the last grant's token (the echo server: any int)

    def send(self, obj: list) -> None:
        self.sock.sendall(msgpack.packb(obj))

    def reply(self) -> list:
        for obj in self.unpacker:
            return obj
        while True:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            self.unpacker.feed(data)
            for obj in self.unpacker:
                return obj


def _control(flag: str, pid: int) -> None:
    subprocess.run(["callgrind_control", flag, str(pid)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=120)


def _total_ir(path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith("summary:") or line.startswith("totals:"):
                return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


def measure(server: str, pairs: int, clients: int, keep: str | None, fsync: str = "never") -> float:
    """Server instructions per pair (see the module docstring); ``fsync``: the server's ``--fsync`` mode."""
    hello, version, acquire, release = _ops()
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        if server == "echo":
            cmd = [sys.executable, "-m", "benches.echo", "serve", "--listen", f"127.0.0.1:{port}"]
        else:
            cmd = [sys.executable, "-m", "fastlock", "serve", "--listen", f"127.0.0.1:{port}",
                   "--data-dir", os.path.join(tmp, "data"), "--fsync", fsync]
        srv = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p", *cmd],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        try:
            deadline = time.monotonic() + 300
            conns = [_Client(port, deadline) for _ in range(clients)]
            for c in conns:
                c.send([1, hello, version, "instr", None])
                c.reply()
            req = [10] * clients

            def round_() -> None:
                for acquire_op in (True, False):
                    for i, c in enumerate(conns):
                        req[i] += 1
                        if acquire_op:
                            c.send([req[i], acquire, f"k{i}", b"0123456789abcdef", 10_000, 0, 0, None])
                        else:
                            c.send([req[i], release, f"k{i}", c.token, b"0123456789abcdef"])
                    for c in conns:
                        r = c.reply()
                        if acquire_op:
                            # the echo server sends the request back: any int stands for a token
                            c.token = r[2][0] if server != "echo" else 1
                        elif server != "echo" and r[1] != 0:
                            raise RuntimeError(f"release refused: {r}")

            for _ in range(max(1, 200 // clients)):  # warm-up
                round_()
            _control("--zero", srv.pid)
            rounds = max(1, pairs // clients)
            for _ in range(rounds):
                round_()
            _control("--dump", srv.pid)
            for c in conns:
                c.sock.close()
        finally:
            srv.send_signal(signal.SIGTERM)
            try:
                srv.wait(120)
            except subprocess.TimeoutExpired:
                srv.kill()
                srv.wait()
        # the explicit dump is part 1 (``OUT.PID.1``); the one at exit follows it
        dumps = sorted(glob.glob(f"{out}.{srv.pid}.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        if not dumps:
            raise RuntimeError("callgrind wrote no dump")
        dump = dumps[0]
        if keep:
            shutil.copy(dump, keep)
        return _total_ir(dump) / (rounds * clients)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.instr_per_pair", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=("fastlock", "echo"), default="fastlock")
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--keep", help="copy the callgrind dump here")
    ap.add_argument("--fsync", choices=("never", "always", "interval"), default="never",
                    help="the fastlock server's --fsync mode (default never)")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    per_pair = measure(args.server, args.pairs, args.clients, args.keep, args.fsync)
    print(f"{args.tag or args.server}: {per_pair:,.0f} server instructions/pair "
          f"({args.pairs} pairs, {args.clients} client(s), --fsync {args.fsync})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
