"""The client's own CPU per acquire+release pair, with no socket and no server.

    python -m benches.client_path [--pairs 20000] [--rounds 5] [--tag NAME] [--profile] [--echo]

A :class:`fastlock.Client` is given a connection whose transport is an
in-process fake server: each request frame written to it is answered (a grant
for ACQUIRE, ``None`` for anything else) by a ``call_soon`` of the
connection's ``data_received``, as a socket read would be delivered.  The replies
are encoded before each round (the bench sends one request at a time, with request
ids counting up; the warm-up decodes every request and checks it is the one a
reply was prepared for), so that the fake server costs what the echo floor's fake
transport costs: a ``call_soon`` per write.  What is
measured is therefore the client's Python path - argument checks, owner keys,
request encoding, the reply's decoding and dispatch, the lease, the asyncio
future and task hops - without the system calls and the server, which
dominate and blur :mod:`benches.cpu_per_pair` on a shared machine.
``--echo`` measures the echo floor's client instead (:class:`benches.echo.EchoSession`:
an acquire-sized and a release-sized request, encoded and decoded with msgpack) on a
transport that hands every write back as it is.  Prints the
process CPU microseconds per pair (min and median of the rounds).  Two
installs are compared by running this module with each one's python,
alternately (from a directory outside the source tree, so that the installed
package is imported).

``--profile`` runs the pairs under ``cProfile`` instead and prints the client's
Python-level calls per pair (a count that does not depend on the machine's load):
the calls of functions of fastlock and asyncio, and the calls of built-in functions
made from them; the fake server's and this bench's own are left out, and so is
compiled code (a Cython function calling another is no Python-level call).  Then the
most frequent of those functions, with their calls per pair.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgpack

from .harness import run_async
from .null_transport import NullTransport


class _FakeServer(NullTransport):
    """A transport that answers every request frame in the next loop turn.

    The bench sends one request at a time, acquire then release, with request ids
    counting up from the connection's next one: :meth:`prepare` encodes (msgpack) the
    replies of a round's pairs before it starts, and each write is answered by the next
    of them - a grant ``[token, ttl_ms, 0]`` for an ACQUIRE, None for a RELEASE - so that
    the measured rounds count the client's work and a fake server as cheap as the echo
    bench's (which hands the written bytes back), not a decode and an encode of the fake
    server's.  While ``checked`` (the warm-up) each written frame is decoded and its id and
    op compared with the reply's; after a round the bench checks that every request was
    answered (no future left pending, the ids used as prepared).
    """

    def __init__(self, proto: Any, loop: asyncio.AbstractEventLoop, acquire_op: int, release_op: int,
                 ttl_ms: int):
        self.deliver = proto.data_received
        self.loop = loop
        self.acquire_op = acquire_op
        self.release_op = release_op
        self.ttl_ms = ttl_ms
        self.token = 1 << 40
        self.unpacker = msgpack.Unpacker(raw=False)
        self.checked = False
        self.replies: Iterator[bytes] = iter(())
        self.expected: Iterator[tuple[int, int]] = iter(())

    def prepare(self, first_id: int, pairs: int, checked: bool = False) -> None:
        """Encode the replies of ``pairs`` acquire+release pairs whose first request id is
        ``first_id`` (``checked``: decode each request and compare its id and op)."""
        replies = []
        expected = []
        for rid in range(first_id, first_id + 2 * pairs, 2):
            self.token += 1
            replies.append(msgpack.packb([rid, 0, [self.token, self.ttl_ms, 0]]))
            replies.append(msgpack.packb([rid + 1, 0, None]))
            expected += [(rid, self.acquire_op), (rid + 1, self.release_op)]
        self.replies = iter(replies)
        self.expected = iter(expected)
        self.checked = checked

    def write(self, data: bytes) -> None:
        if self.checked:
            self.unpacker.feed(data)
            (req,) = list(self.unpacker)  # one frame per write: one request in flight
            if (req[0], req[1]) != next(self.expected):
                raise AssertionError(f"request {req!r} is not the one prepared")
        self.loop.call_soon(self.deliver, next(self.replies))


class _EchoFake(_FakeServer):
    """The echo floor's transport: every write handed back as it is, in the next loop turn."""

    def __init__(self, proto: Any, loop: asyncio.AbstractEventLoop):
        self.deliver = proto.data_received
        self.loop = loop

    def write(self, data: bytes) -> None:
        self.loop.call_soon(self.deliver, data)


def _ours(filename: str) -> bool:
    """A function of the client's path: fastlock's or asyncio's, not the bench's nor msgpack's."""
    return ("/fastlock/" in filename or "/asyncio/" in filename) and "/benches/" not in filename


def client_calls(stats: pstats.Stats) -> dict[str, int]:
    """Python-level calls of the client's path in ``stats``, by function (see the module docstring)."""
    counts: dict[str, int] = {}
    for (filename, line, name), (_, calls, _, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if filename == "~":
            calls = sum(c[1] if isinstance(c, tuple) else c for (f, _, _), c in callers.items() if _ours(f))
            label = name
        elif _ours(filename):
            label = f"{name} ({filename.rsplit('/', 1)[-1]}:{line})"
        else:
            continue
        if calls:
            counts[label] = counts.get(label, 0) + calls
    return counts


async def _pairs_of(pair: Callable[[], Awaitable[None]], pairs: int, rounds: int, profile: bool,
                    prepare: Callable[[int, bool], None] = lambda n, checked: None) -> list[float]:
    """Run ``pair`` ``pairs`` times per round after a warm-up of 2,000 (``prepare(n, checked)``
    before each run of ``n`` pairs; ``checked``: the warm-up); CPU microseconds per pair of
    each round (``profile``: print the Python-level calls instead, return [])."""
    prepare(2000, True)
    for _ in range(2000):  # warm-up
        await pair()
    if profile:
        prepare(pairs, False)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(pairs):
            await pair()
        profiler.disable()
        counts = client_calls(pstats.Stats(profiler))
        print(f"client Python-level calls per pair: {sum(counts.values()) / pairs:.1f}")
        for label, calls in sorted(counts.items(), key=lambda kv: -kv[1])[:20]:
            print(f"  {calls / pairs:6.2f}  {label}")
        return []
    per_pair = []
    for _ in range(rounds):
        prepare(pairs, False)
        t0 = time.process_time()
        for _ in range(pairs):
            await pair()
        per_pair.append((time.process_time() - t0) / pairs * 1e6)
    return per_pair


async def _measure(pairs: int, rounds: int, profile: bool = False) -> list[float]:
    from fastlock import protocol as P
    from fastlock.client import Client
    from fastlock.client.connection import ClientConnection

    loop = asyncio.get_running_loop()
    client = Client(["127.0.0.1:1"])
    proto = ClientConnection(("127.0.0.1", 1), lambda *_: None, 5.0)
    fake = _FakeServer(proto, loop, P.OP_ACQUIRE, P.OP_RELEASE, 10_000)
    proto.connection_made(fake)  # type: ignore[arg-type]
    client.connector.proto = proto
    next_id = proto._next_id

    def prepare(n: int, checked: bool) -> None:
        nonlocal next_id
        if proto.pending or proto._next_id != next_id:
            raise AssertionError("a request of the last run was not answered as prepared")
        fake.prepare(next_id, n, checked)
        next_id += 2 * n

    async def pair() -> None:
        await client.release(await client.acquire("k", ttl=10))

    try:
        return await _pairs_of(pair, pairs, rounds, profile, prepare)
    finally:
        prepare(0, False)
        proto.close()


async def _measure_echo(pairs: int, rounds: int, profile: bool = False) -> list[float]:
    from .echo import EchoClientProtocol, EchoSession

    proto = EchoClientProtocol()
    proto.connection_made(_EchoFake(proto, asyncio.get_running_loop()))
    session = EchoSession(proto, 0)

    async def pair() -> None:
        await session.acquire("k")
        await session.release("k")

    return await _pairs_of(pair, pairs, rounds, profile)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.client_path", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--pairs", 20000), ("--rounds", 5)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--tag", default=None, help="the label printed (default: fastlock, or echo with --echo)")
    ap.add_argument("--profile", action="store_true", help="count the client's Python-level calls per pair")
    ap.add_argument("--echo", action="store_true",
                    help="measure the echo floor's client (benches.echo) on an echoing fake transport instead")
    args = ap.parse_args(argv)
    measure = _measure_echo if args.echo else _measure
    per_pair = run_async(measure(args.pairs, args.rounds, args.profile))  # on uvloop when it is installed
    if args.profile:
        return 0
    tag = args.tag or ("echo" if args.echo else "fastlock")
    print(f"{tag}: client CPU {min(per_pair):6.2f} us/pair (min), {statistics.median(per_pair):6.2f} (median) "
          f"of {args.rounds} rounds of {args.pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
