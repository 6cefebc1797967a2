"""Protocol fuzzer: every operation from every principal kind against a real server (issue 9).

    python -m benches.fuzz [--requests 1000000] [--seed N] [--batch 64] [--json PATH]

What runs
---------
One real ``fastlock serve`` (``--fsync never``, ``--auth-failures-before-ban 0`` so
that the fuzzer's own failed HELLOs do not ban 127.0.0.1 - the ban has its own
test) with a credentials file of five principals:

============  =======  ============================================================
principal     kind     granted
============  =======  ============================================================
orders        client   every client operation on ``orders/``
reader        client   check, holder, watch on every name
anonymous     client   every client operation on ``public/`` (no token)
node-2        replica  replicate, repl_ack, step_down
admin         admin    everything but replica operations
============  =======  ============================================================

The run alternates two kinds of round:

*unauthorised round*
    for each principal, a fresh connection sends ``--batch`` requests that the
    policy above refuses it (an operation of another kind, a lock name outside
    its ACL, an unknown operation, a HELLO with an epoch hint from a non-replica,
    or garbage that is not a request at all).  An admin connection snapshots the
    server before and after (role, epoch, counters, lock-table statistics,
    pairing, and the holder of every lock name the fuzzer uses): any difference
    is an **unauthorised state change**, and any success reply to a refused
    lock/replica/operator operation is counted with them.
*mixed round*
    long-lived connections of every principal send ``--batch`` random requests
    each: well-formed ones (names from a pool spanning every ACL prefix, owner
    keys of real leases, their hashes and random ones, valid and invalid TTLs),
    ill-typed ones, wrong arities and random msgpack values.

The server runs with small per-principal quotas (:data:`QUOTA_ARGS`); after every
mixed round an admin STATUS checks that no principal holds more than its quotas
(leases plus waiting acquires, waiting acquires, watches, keys, connections): any
excess is a **quota breach**.

Each round also replays the handshake with REAL proofs (a legitimate exchange's
client proof replayed after a fresh server nonce, its server proof reflected back as
a client proof: any success is an unauthorised success), and one connection writes
:data:`FLOOD_REQUESTS` pipelined status and list requests at once while the admin
connection PINGs: the worst PING (milliseconds) is reported, as the server bounds a
connection's work per loop turn and pages list replies.

Every reply is checked: an ``internal server error`` reply is counted as an
**internal error**; the server process exiting, or a traceback in its log, is a
**crash**.  At the end the server's RSS (``VmRSS``) is read.  The generator
is a function of a :class:`random.Random`, so ``tests/test_fuzz.py`` drives the
same rounds from hypothesis (``st.randoms()``) for a short run in the suite.

Valid TTLs are at least 12 h and valid waits are 0 or forever, so nothing
expires or times out by itself between two snapshots; the replica attaches
without a failover window (a fence would close by itself between snapshots).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastlock import protocol as P
from fastlock._testbase import ServerProcess, raw_hello_async
from fastlock._testbase.handshake import handshake_for, key_lines
from fastlock.auth import ANONYMOUS, hash_owner
from fastlock.errors import InternalServerError, LimitExceeded
from fastlock.protocol import ops

NAMES = ["orders/1", "orders/2", "orders/x/y", "public/a", "public/b", "billing/1", "admin", "order", "",
         "x" * 600, "nul\x00", "ünïcode/1"]
PROBE_NAMES = [n for n in NAMES if n and len(n.encode()) <= 512 and "\x00" not in n]
VALID_TTLS = [1_800_000, 3_600_000]  # 30 min, 1 h (the longest): nothing expires during a run (--max-seconds)
BAD_TTLS = [0, -5, 2**64 - 1, 1.5, True, None, "10", 3_600_001]
OPS = sorted(P.OP_NAMES) + [0, 16, 17, 99, -1, 1 << 40]
LOCK_OPS = {P.OP_ACQUIRE: "acquire", P.OP_RELEASE: "release", P.OP_EXTEND: "extend", P.OP_CANCEL: "cancel",
            P.OP_CHECK: "check", P.OP_HOLDER: "holder", P.OP_WATCH: "watch", P.OP_CONTENDERS: "holder",
            P.OP_ACQUIRE_MANY: "acquire",
            # the key store (fastlock.server.keys), checked on the key or prefix like a lock name
            ops.OP_KEY_PUT: "put", ops.OP_KEY_GET: "get", ops.OP_KEY_LIST: "get", ops.OP_KEY_DELETE: "delete",
            ops.OP_KEY_WATCH: "get", ops.OP_KEY_UNWATCH: "get",
            # priorities (fastlock.server.preemption); a priority above 0 needs "prioritize" too
            ops.OP_ACQUIRE_PRIORITY: "acquire", ops.OP_REQUEST_REVOKE: "preempt", ops.OP_TRANSFER: "release",
            # watches that resume (fastlock.server.watchlog, keyrevisions) and rate limits (server.ratelimit)
            ops.OP_WATCH_FROM: "watch", ops.OP_KEY_WATCH_FROM: "get", ops.OP_RATE_LIMIT: "acquire",
            # a cross-shard multi-lock's reservation (fastlock.server.woundwait): "acquire" on every name
            ops.OP_RESERVE: "acquire"}
#: a client's own sessions (fastlock.server.sessions): proved by the session key, each attached
#: name checked for "extend" by the handler: left to validation; never a replica's
SESSION_OPS = {ops.OP_SESSION_OPEN, ops.OP_SESSION_ATTACH, ops.OP_SESSION_KEEPALIVE, ops.OP_SESSION_CLOSE}
ALL_CLIENT_OPS = set(LOCK_OPS.values()) | {"prioritize"}
REPLICA_OPS = {P.OP_REPLICATE, P.OP_REPL_ACK, P.OP_STEP_DOWN, P.OP_SYNC_ACK}
#: SHARD_MAP: the map holds no secret; COMMIT_RESERVATION acts only on the calling connection's own
#: reservation (fastlock.server.woundwait); WAIT_IDENTITY sets the connection's own wait id and
#: WAITS_FOR reads opaque ids only (fastlock.server.edgechase)
OPEN_OPS = {P.OP_PING, P.OP_STATUS, P.OP_UNWATCH, ops.OP_SHARD_MAP, ops.OP_COMMIT_RESERVATION,
            ops.OP_WAIT_IDENTITY, ops.OP_WAITS_FOR}
ADMIN_OPS = {P.OP_PROMOTE, P.OP_SERVE_ALONE, P.OP_LOCKS, P.OP_LOCK_INFO, P.OP_REVOKE, ops.OP_SESSIONS,
             ops.OP_SESSION_REVOKE, ops.OP_SLOT_EXPORT, ops.OP_SLOT_IMPORT, ops.OP_SHARD_MAP_NOTICE,
             ops.OP_SLOT_ADOPT}
#: per-principal quotas small enough for the mixed rounds to reach (the anonymous principal's: a quarter)
QUOTA_ARGS = ["--max-leases-per-principal", "24", "--max-waiters-per-principal", "8",
              "--max-watches-per-principal", "8", "--max-keys-per-principal", "8"]


def unclassified_ops() -> set[int]:
    """Protocol operations the fuzzer's policy does not know (a new op must be added to it)."""
    known = OPEN_OPS | REPLICA_OPS | ADMIN_OPS | set(LOCK_OPS) | SESSION_OPS | {P.OP_HELLO}
    return set(P.OP_NAMES) - known


@dataclass
class Spec:
    """One fuzzed principal: its kind and (for clients) ACL as (prefix, ops) rules."""

    name: str
    kind: str
    acl: tuple = ()
    token: str | None = None

    def allowed(self, op: int, args: list) -> bool | None:
        """The policy: True granted, False refused, None unknown (left to validation)."""
        if op not in P.OP_NAMES:
            return False
        if op in OPEN_OPS:
            return True
        if op == P.OP_HELLO:
            return self.kind == "replica"  # from anyone else, HELLO must change nothing
        if op in REPLICA_OPS:
            return self.kind == "replica"
        if op in ADMIN_OPS:
            return self.kind == "admin"  # the lock-admin ops: admins only when the server has credentials
        if self.kind == "admin":
            return True
        if self.kind != "client":
            return False
        if op in SESSION_OPS:
            return None
        if not args or type(args[0]) is not str:
            return None
        if op not in LOCK_OPS:
            raise KeyError(f"the fuzzer has no policy for op {op} ({P.OP_NAMES[op]}): add it to benches/fuzz.py")
        return any(args[0].startswith(prefix) and LOCK_OPS[op] in ops for prefix, ops in self.acl)


def make_specs() -> list[Spec]:
    tok = lambda n: f"fl1.{n}.{os.urandom(24).hex()}"  # noqa: E731
    return [
        Spec("orders", "client", (("orders/", ALL_CLIENT_OPS),), tok("orders")),
        Spec("reader", "client", (("", {"check", "holder", "watch"}),), tok("reader")),
        Spec(ANONYMOUS, "client", (("public/", ALL_CLIENT_OPS),), None),
        Spec("node-2", "replica", (), tok("node-2")),
        Spec("admin", "admin", (), tok("admin")),
    ]


def write_credentials(path: Path, specs: list[Spec]) -> None:
    lines = ["version = 2"]
    for s in specs:
        lines += [f"[principals.{s.name}]", f'kind = "{s.kind}"']
        if s.token:
            lines += key_lines(s.token)
        if s.kind == "client":
            rules = ", ".join(f'{{prefix = {json.dumps(p)}, ops = {json.dumps(sorted(o))}}}' for p, o in s.acl)
            lines.append(f"acl = [{rules}]")
    path.write_text("\n".join(lines) + "\n")


# -- request generation ------------------------------------------------------------------------


def _junk(rng: random.Random, depth: int = 0):
    pick = rng.randrange(12 if depth < 3 else 8)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63 - 1, -(2**63), rng.randrange(-1000, 1000)])
    if pick == 3:
        return rng.choice([0.0, -1.5, 1e308, float("nan"), float("inf")])
    if pick == 4:
        return rng.choice(NAMES)
    if pick == 5:
        return rng.randbytes(rng.choice([0, 1, 16, 64, 65, 300]))
    if pick == 6:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(0, 20)))
    if pick == 7:
        return rng.choice(["", "fl1.admin.x", "fl1.node-2.x", {"principal": "node-2", "challenge": b"x" * 32}])
    if pick <= 9:
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {str(_junk(rng, depth + 1))[:8]: _junk(rng, depth + 1) for _ in range(rng.randrange(0, 3))}


class Generator:
    """Random requests (``[op, args]``) from a :class:`random.Random`."""

    def __init__(self, rng: random.Random, owners: list[bytes]):
        self.rng = rng
        self.owners = owners  # owner keys of leases granted so far (capped)

    def owner(self):
        rng = self.rng
        pick = rng.randrange(6)
        if self.owners and pick < 3:
            key = rng.choice(self.owners)
            return key if pick < 2 else hash_owner(key)  # a real key, or the hash a replica sees
        if pick == 3:
            return _junk(self.rng)
        return rng.randbytes(16)

    @staticmethod
    def _proof_shapes(rng: random.Random) -> list:
        """HELLO credentials of the handshake (fastlock.auth.handshake): first messages naming
        known, unknown and privileged principals and roles, made-up and replayed proofs, a
        server proof reflected back, and malformed ones.  None may authenticate anyone."""
        nonce = rng.randbytes(32)
        return [
            {"principal": rng.choice(["node-2", "admin", "orders", "ghost", None]), "nonce": nonce,
             "role": rng.choice(["replica", "admin", "client", None]), "node": rng.choice([None, "x" * 16]),
             "from": rng.choice([None, "0123456789abcdef"])},
            {"proof": rng.randbytes(32)},  # made up (or replayed: the server nonce changed)
            {"proof": rng.randbytes(32), "server_proof": rng.randbytes(32)},  # a reflected server proof
            {"principal": "node-2", "nonce": rng.randbytes(rng.choice([0, 16, 31, 33, 64]))},
            {"proof": _junk(rng)},
            {"challenge": {"nonce": nonce, "node": "x"}},
        ]

    def args(self, op: int) -> list:
        rng = self.rng
        if rng.random() < 0.25:
            return [_junk(rng) for _ in range(rng.randrange(0, 8))]
        name = rng.choice(NAMES) if rng.random() < 0.95 else _junk(rng)
        ttl = rng.choice(VALID_TTLS) if rng.random() < 0.8 else rng.choice(BAD_TTLS)
        token = (rng.choice([1, 2, 3, (1 << 40) | 1, 2**63 - 1, 0, -1, "1"]) if rng.random() < 0.5
                 else rng.randrange(1, 50))
        if op == P.OP_HELLO:
            cred = rng.choice([None, "fl1.orders.nope", _junk(rng), *self._proof_shapes(rng)])
            out = [rng.choice([P.PROTOCOL_VERSION, P.PROTOCOL_VERSION, 1, 3, None]), rng.choice(["f", None, 5]),
                   cred]
            if rng.random() < 0.5:
                out.append(rng.choice([0, 1, 2, 2**22, 2**63 - 1, -1, None, "9"]))
            return out
        if op == P.OP_ACQUIRE:
            wait = rng.choice([0, 0, 0, -1]) if rng.random() < 0.9 else rng.choice([-2, 86_400_001, 1 << 40, None, 1.5])
            delay = 0 if rng.random() < 0.9 else rng.choice([-1, 60_001, 1.0])
            return [name, self.owner(), ttl, wait, delay, rng.choice([None, "corr", 7])]
        if op == ops.OP_ACQUIRE_PRIORITY:
            return [name, self.owner(), ttl, rng.choice([0, 0, -1, 1.5]), 0, rng.choice([None, "corr"]),
                    rng.choice([False, True, 1]), rng.choice([0, 0, 2, -1]), rng.choice([0, 1, -1]),
                    rng.choice([0, 1, 99, 100, -1, 1.5, None])]
        if op == ops.OP_REQUEST_REVOKE:
            return [name, self.owner(), rng.choice([1, 100, 600_000, 0, 600_001, None, "x"])]
        if op == ops.OP_TRANSFER:
            return [name, token, self.owner(), rng.choice(["corr", "", None, 7, _junk(rng)])]
        if op == ops.OP_WATCH_FROM:
            return [name, rng.choice([None, 0, 1, (1 << 40) | 5, 2**62, -1, "1"])]
        if op == ops.OP_KEY_WATCH_FROM:
            return [name, rng.choice([None, 0, 1 << 40, 2**62, -1]), rng.choice([None, 0, 3, -1, "0"])]
        if op == ops.OP_RESERVE:
            now = int(time.time() * 1000)
            return [rng.choice([[name], [name, f"{name}/2"], [name, name], [], name]), self.owner(), ttl,
                    rng.choice([0, 0, 1.5, -2]), rng.choice([None, "corr"]),
                    rng.choice([now, now - 120_000, now + 60_000, -1, None]),
                    rng.choice([self.owner(), b"", b"x" * 33])]
        if op == ops.OP_COMMIT_RESERVATION:
            return [rng.choice([self.owner(), b"", None, "x"])]
        if op == ops.OP_WAIT_IDENTITY:
            return [rng.choice([rng.randbytes(32), rng.randbytes(16), self.owner(), b"", b"x" * 65, None, "x"])]
        if op == ops.OP_WAITS_FOR:
            return [rng.choice([self.owner(), b"", b"x" * 17, None]), rng.choice([0, 1, -1, 2**63, "1"]),
                    rng.choice([0, 16, 17, -1, 2**40, None])]
        if op == ops.OP_RATE_LIMIT:
            return [name, rng.choice([1, 100, 0, -1, 2**40]), rng.choice([1000, 0, -5]), rng.choice([1, 10, 0]),
                    rng.choice([1, 0, 11, -1])]
        if op in (ops.OP_SESSION_OPEN, ops.OP_SESSION_KEEPALIVE, ops.OP_SESSION_CLOSE):
            key = rng.choice([self.owner(), b"", b"x" * 17, None, "k"])
            return [key, rng.choice([10_000, 0, -1, 2**40])] if op == ops.OP_SESSION_OPEN else [key]
        if op == ops.OP_SESSION_ATTACH:
            return [self.owner(), [[name, token, self.owner()]], rng.choice([[], [[name, token]], None])]
        if op == P.OP_RELEASE:
            return [name, token, self.owner()]
        if op == P.OP_EXTEND:
            return [name, token, self.owner(), ttl]
        if op == P.OP_CANCEL:
            return [name, self.owner()]
        if op == P.OP_CHECK:
            return [name, token]
        if op in (P.OP_WATCH, P.OP_UNWATCH, P.OP_HOLDER):
            return [name]
        if op == P.OP_REPLICATE:
            return [rng.choice([0, 1, -1, 1 << 62, None]), rng.choice([None, "x", 3]), rng.choice([0, -1, None]),
                    rng.choice(["fuzz@node", "@", "", None, "a@b@c", 5])]
        if op == P.OP_REPL_ACK:
            return [rng.choice([0, 1, 2**62, -1, None]), rng.choice([0, 1, 2**62, "x"])]
        if op == P.OP_PROMOTE:
            return [rng.choice([True, False, None, 1])]
        # paging: a list request with a cursor that is valid, out of range or junk
        if op == ops.OP_KEY_LIST:
            cursor = [rng.choice([name, None, "", _junk(rng)])] if rng.random() < 0.5 else []
            return [rng.choice(["", "orders/", name]), rng.choice([1, 10, 10_000, 0, 10_001, None]), *cursor]
        if op == P.OP_CONTENDERS:
            cursor = rng.choice([None, [0, 0], [1, rng.randrange(100)], [1, 1 << 41], [2, 0], [0, -1], [True, 0],
                                 _junk(rng)])
            return [name, cursor] if rng.random() < 0.5 else [name]
        if op == P.OP_LOCKS:
            return [rng.choice(["", "orders/", _junk(rng)]), rng.choice([None, 1, 10_000, 0]),
                    rng.choice([None, name]), rng.choice([None, "name", "contended", "x"])]
        return [_junk(rng) for _ in range(rng.randrange(0, 3))]

    def request(self, spec: Spec) -> tuple[int, list]:
        op = self.rng.choice(OPS)
        args = self.args(op)
        if spec.kind == "replica" and op == P.OP_REPLICATE and len(args) > 2:
            args[2] = 0  # no failover window: a paired primary's fence would close by itself between snapshots
        return op, args

    def unauthorised(self, spec: Spec, tries: int = 50) -> tuple[int, list] | None:
        """A request the policy refuses ``spec`` (None if none was found in ``tries``)."""
        for _ in range(tries):
            op, args = self.request(spec)
            if spec.allowed(op, args) is False:
                return op, args
        return None


def quota_burst(rng: random.Random, spec: Spec, batch: int) -> list[tuple[int, list]]:
    """``batch`` requests of a client principal that create what its quotas bound, on
    fresh names under its ACL's first prefix: acquires (exclusive, shared, permits, waits
    forever), multi-locks, watches, key puts - pipelined, they reach its quotas."""
    prefix = next((p for p, granted in spec.acl if "acquire" in granted and "put" in granted), None)
    if spec.kind != "client" or prefix is None:
        return []
    ttl = VALID_TTLS[0]
    reqs: list[tuple[int, list]] = []
    for _ in range(batch):
        name = f"{prefix}q/{rng.randrange(1 << 30)}"
        pick = rng.randrange(6)
        if pick == 0:
            reqs.append((P.OP_ACQUIRE, [name, rng.randbytes(16), ttl, rng.choice((0, -1)), 0, None]))
        elif pick == 1:
            reqs.append((P.OP_ACQUIRE, [f"{prefix}q/held", rng.randbytes(16), ttl, -1, 0, None,
                                        rng.random() < 0.5]))
        elif pick == 2:
            many = [[f"{name}/{k}", rng.random() < 0.3] for k in range(rng.randrange(1, 9))]
            reqs.append((P.OP_ACQUIRE_MANY, [many, rng.randbytes(16), ttl, rng.choice((0, -1)), 0, None]))
        elif pick == 3:
            reqs.append((P.OP_ACQUIRE, [name, rng.randbytes(16), ttl, 0, 0, None, False, rng.randrange(1, 4)]))
        elif pick == 4:
            reqs.append((rng.choice((P.OP_WATCH, ops.OP_KEY_WATCH)), [name]))
        else:
            reqs.append((ops.OP_KEY_PUT, [name, b"v", None, None, None, ops.KEY_UPSERT]))
    return reqs


# -- the run ----------------------------------------------------------------------------------


@dataclass
class Figures:
    requests: int = 0
    replies: int = 0
    no_reply: int = 0
    refused: int = 0
    crashes: int = 0
    internal_errors: int = 0
    unauthorised_state_changes: int = 0
    unauthorised_successes: int = 0
    quota_breaches: int = 0
    quota_refusals: int = 0  # LimitExceeded naming a per-principal quota: the quotas were reached
    proofs_replayed: int = 0  # real proofs replayed or reflected (each must be refused)
    flood_requests: int = 0  # requests pipelined by the flooding connection
    worst_ping_ms: float = 0.0  # another connection's slowest PING while one connection floods
    connections_closed_by_server: int = 0
    rounds: int = 0
    server_log_lines: int = 0
    rss_kib: int = 0
    max_rss_kib: int = 0
    examples: list = field(default_factory=list)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["examples"] = self.examples[:10]
        return d


class Conn:
    """One pipelining protocol connection as a principal."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.reader = self.writer = None
        self.decoder = P.FrameDecoder(64 << 20, limits=P.REPLY_LIMITS)
        self.next_id = 1
        self.closed = True

    async def connect(self, address: str) -> None:
        """Open the TCP connection only (no HELLO)."""
        host, _, port = address.rpartition(":")
        self.reader, self.writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
        self.decoder = P.FrameDecoder(64 << 20, limits=P.REPLY_LIMITS)
        self.closed = False

    async def call(self, op: int, *args: Any) -> Any:
        """One request and its reply (None if the server closed the connection first).
        One frame, no PING behind it: before HELLO completes, any other request closes
        the connection."""
        rid = self.next_id
        self.next_id += 1
        self.writer.write(P.packb([rid, op, *args]))
        while True:
            data = await asyncio.wait_for(self.reader.read(1 << 16), 10)
            if not data:
                self.closed = True
                return None
            for msg in self.decoder.feed(data):
                if type(msg) is list and msg and msg[0] == rid:
                    return msg

    async def open(self, address: str) -> bool:
        await self.connect(address)
        reply = await raw_hello_async(self.call, f"fuzz-{self.spec.name}", self.spec.token)
        ok = reply is not None and reply[1] == 0
        if not ok:
            await self.close()
        return ok

    async def batch(self, requests: list, idle: float = 10.0) -> list:
        """Send every request pipelined; return each one's reply (None: none came).

        Requests that may close the connection (garbage, HELLO) should come last
        (:func:`closing_last`), or the rest of the batch is lost with it.
        """
        ids = []
        out = []
        for op, args in requests:
            if op is None:  # garbage: not a request at all
                out.append(P.packb(args))
                ids.append(None)
                continue
            rid = self.next_id
            self.next_id += 1
            ids.append(rid)
            out.append(P.packb([rid, op, *args]))
        # a PING after the batch: a connection answers in order, so once its reply is in,
        # every request before it that will be answered at once has been (a waiting
        # acquire is answered later or never)
        sentinel = self.next_id
        self.next_id += 1
        out.append(P.packb([sentinel, P.OP_PING]))
        try:
            self.writer.write(b"".join(out))
        except (ConnectionError, RuntimeError):
            self.closed = True
            return [None] * len(requests)
        want = {rid for rid in ids if rid is not None}
        got: dict = {}
        done = False
        while not done and not self.closed:
            try:
                data = await asyncio.wait_for(self.reader.read(1 << 16), idle)
            except asyncio.TimeoutError:
                break  # the server did not answer a PING in time: counted as requests without reply
            except ConnectionError:
                data = b""
            if not data:
                self.closed = True
                break
            for msg in self.decoder.feed(data):
                if type(msg) is list and msg:
                    if msg[0] in want:
                        got[msg[0]] = msg
                        want.discard(msg[0])
                    elif msg[0] == sentinel:
                        done = True
        return [got.get(rid) if rid is not None else None for rid in ids]

    async def close(self):
        self.closed = True
        if self.writer is not None:
            self.writer.close()


def closing_last(reqs: list) -> list:
    """The batch with garbage and HELLOs (which may close the connection) moved to the end."""
    return sorted(reqs, key=lambda r: r[0] is None or r[0] == P.OP_HELLO)


def _is_internal_error(reply) -> bool:
    return type(reply) is list and len(reply) > 2 and reply[1] == InternalServerError.code


async def snapshot(admin: Conn) -> dict:
    replies = await admin.batch([[P.OP_STATUS, []]] + [[P.OP_HOLDER, [n]] for n in PROBE_NAMES])
    st = replies[0][2]
    keep = {k: st[k] for k in ("role", "epoch", "last_token", "counter", "locks_held", "waiters", "grants",
                               "releases", "expiries", "wait_timeouts", "cancels")}
    repl = st.get("replication", {})
    keep["replication"] = {k: repl.get(k) for k in ("paired_standby", "serving_alone", "fenced",
                                                     "paired_window_ms")}
    # a refusal (e.g. Unavailable from a fenced primary, which the replica may cause) is state too
    keep["holders"] = {n: ("refused", r[1]) if r[1] != 0 else (r[2]["token"], r[2]["principal"]) if r[2] else None
                       for n, r in zip(PROBE_NAMES, replies[1:])}
    return keep


async def settle(admin: Conn, sessions: int = 1, timeout: float = 5.0) -> None:
    """Wait until the server has at most ``sessions`` sessions and every WAL record is
    written with its callbacks run: connections closed earlier - the waiters they drop,
    a grant that can no longer be delivered and is released - are done with before a
    snapshot is compared."""
    deadline = time.monotonic() + timeout
    while True:
        st = (await admin.batch([[P.OP_STATUS, []]]))[0][2]
        if st["sessions"] <= sessions and st["wal"]["ack_lsn"] >= st["wal"]["last_lsn"]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not settle: {st['sessions']} sessions, wal {st['wal']}")
        await asyncio.sleep(0.005)


async def fuzz_rounds(address: str, specs: list[Spec], rng: random.Random, rounds: int, batch: int,
                      figures: Figures, owners: list[bytes], server: ServerProcess | None = None,
                      deadline: float | None = None) -> None:
    """Run ``rounds`` pairs of (unauthorised, mixed) rounds; add to ``figures``."""
    gen = Generator(rng, owners)
    admin_spec = next(s for s in specs if s.kind == "admin")
    admin = Conn(admin_spec)
    if not await admin.open(address):
        raise RuntimeError("the admin connection was refused")
    legit = {s.name: Conn(s) for s in specs}
    await settle(admin)  # a previous run's connections may still be closing
    try:
        for _ in range(rounds):
            if deadline is not None and time.monotonic() > deadline:
                break
            figures.rounds += 1
            # -- unauthorised round: nothing may change
            await settle(admin, 1 + sum(not c.closed for c in legit.values()))
            before = await snapshot(admin)
            for spec in specs:
                reqs = []
                for _ in range(batch):
                    if rng.random() < 0.01:
                        reqs.append((None, _junk(rng)))
                        continue
                    r = gen.unauthorised(spec)
                    if r is not None:
                        reqs.append(r)
                reqs = closing_last(reqs)
                attacker = Conn(spec)
                if not await attacker.open(address):
                    continue
                replies = await attacker.batch(reqs)
                figures.connections_closed_by_server += attacker.closed
                await attacker.close()
                _count(figures, reqs, replies, unauthorised=True)
            after = await snapshot(admin)
            if before != after:
                figures.unauthorised_state_changes += 1
                figures.examples.append({"unauthorised state change": [before, after]})
            # -- mixed round: anything goes
            for spec in specs:
                conn = legit[spec.name]
                if conn.closed and not await conn.open(address):
                    continue
                reqs = closing_last([gen.request(spec) if rng.random() > 0.005 else (None, _junk(rng))
                                     for _ in range(batch)] + quota_burst(rng, spec, batch // 4))
                replies = await conn.batch(reqs)
                figures.connections_closed_by_server += conn.closed
                _count(figures, reqs, replies, unauthorised=False)
                for (op, args), reply in zip(reqs, replies):
                    if op == P.OP_ACQUIRE and reply is not None and reply[1] == 0 and len(owners) < 64:
                        owners.append(args[1])
            # -- the handshake's real proofs replayed and reflected; one connection flooding
            for spec in specs:
                if spec.token is not None:
                    await replayed_proofs(address, spec, figures)
            await flood_and_ping(address, rng.choice(specs), admin, rng, figures)
            breaches = quota_breaches((await admin.batch([[P.OP_STATUS, []]]))[0][2])
            figures.quota_breaches += len(breaches)
            figures.examples += [{"quota breach": b} for b in breaches]
            if server is not None and server.proc.poll() is not None:
                figures.crashes += 1
                return
    finally:
        await admin.close()
        for conn in legit.values():
            await conn.close()


async def replayed_proofs(address: str, spec: Spec, figures: Figures) -> None:
    """The handshake's replay and reflection shapes with REAL proofs (``spec`` has a
    token): a legitimate exchange completes; then, on fresh connections that start
    with the same first message (same client nonce, so a fresh server nonce), its
    client proof is replayed, and its server proof is offered as a client proof
    (reflected).  Neither may authenticate: a success is an unauthorised success."""
    legit, replay, reflect = Conn(spec), Conn(spec), Conn(spec)
    try:
        for c in (legit, replay, reflect):
            await c.connect(address)
        hs = handshake_for(spec.token)
        first = hs.first()
        name = f"fuzz-{spec.name}"
        challenge = await legit.call(P.OP_HELLO, P.PROTOCOL_VERSION, name, first)
        if challenge is None or challenge[1] != 0:
            return  # refused (a ban, a quota): nothing to replay this time
        proof = hs.answer(challenge[2])
        final = await legit.call(P.OP_HELLO, P.PROTOCOL_VERSION, name, proof)
        if final is None or final[1] != 0:
            return
        hs.welcome(final[2])
        for conn, offered in ((replay, proof), (reflect, {"proof": final[2]["server_proof"]})):
            if (await conn.call(P.OP_HELLO, P.PROTOCOL_VERSION, name, first)) is None:
                continue
            reply = await conn.call(P.OP_HELLO, P.PROTOCOL_VERSION, name, offered)
            figures.proofs_replayed += 1
            if reply is not None and reply[1] == 0:
                figures.unauthorised_successes += 1
                figures.examples.append({"replayed or reflected proof accepted": [spec.name, repr(reply)[:200]]})
    finally:
        for c in (legit, replay, reflect):
            await c.close()


#: requests one flooding connection pipelines in one write per round
FLOOD_REQUESTS = 4_000


async def flood_and_ping(address: str, flooder: Spec, pinger: Conn, rng: random.Random, figures: Figures,
                         pings: int = 20) -> None:
    """One connection of ``flooder`` writes :data:`FLOOD_REQUESTS` pipelined list and
    status requests at once (the large replies are paged) while ``pinger`` PINGs
    ``pings`` times; the slowest PING (milliseconds) is kept in ``figures``.  The
    server bounds a connection's work per loop turn, so the PINGs are served between."""
    flood = Conn(flooder)
    if not await flood.open(address):
        return
    shapes = [[P.OP_STATUS], [ops.OP_KEY_LIST, "", 10_000], [P.OP_CONTENDERS, rng.choice(NAMES[:5])],
              [P.OP_HOLDER, rng.choice(NAMES[:5])], [P.OP_PING]]
    frames = []
    for _ in range(FLOOD_REQUESTS):
        rid = flood.next_id
        flood.next_id += 1
        frames.append(P.packb([rid, *rng.choice(shapes)]))
    figures.flood_requests += FLOOD_REQUESTS

    async def drain() -> None:
        # read (and drop) the replies until the flood is answered, bounded in time
        left = FLOOD_REQUESTS
        deadline = time.monotonic() + 30
        while left > 0 and time.monotonic() < deadline:
            try:
                data = await asyncio.wait_for(flood.reader.read(1 << 20), 10)
            except asyncio.TimeoutError:
                return
            if not data:
                return
            left -= sum(1 for _ in flood.decoder.feed(data))

    try:
        flood.writer.write(b"".join(frames))
        reader = asyncio.ensure_future(drain())
        for _ in range(pings):
            t0 = time.perf_counter()
            await pinger.batch([])
            figures.worst_ping_ms = max(figures.worst_ping_ms, (time.perf_counter() - t0) * 1000)
        await reader
    finally:
        await flood.close()


def quota_breaches(status: dict) -> list[dict]:
    """The principals of ``status`` (an admin's STATUS) holding more than a quota allows."""
    out = []
    for u in status.get("principals", ()):
        held = {"leases": u["leases"] + u["waiters"], "waiters": u["waiters"], "watches": u["watches"],
                "keys": u["keys"], "connections": u["connections"]}
        out += [{"principal": u["principal"], what: n, "quota": u[f"{what}_quota"]}
                for what, n in held.items() if u[f"{what}_quota"] and n > u[f"{what}_quota"]]
    return out


def _count(figures: Figures, reqs, replies, *, unauthorised: bool) -> None:
    for (op, args), reply in zip(reqs, replies):
        figures.requests += 1
        if reply is None:
            figures.no_reply += 1
            continue
        figures.replies += 1
        if _is_internal_error(reply):
            figures.internal_errors += 1
            figures.examples.append({"internal error": [op, repr(args)[:200]]})
        elif reply[1] != 0:
            figures.refused += 1
            if reply[1] == LimitExceeded.code and "-per-principal" in str(reply[2]):
                figures.quota_refusals += 1
        elif unauthorised and op not in (P.OP_HELLO, P.OP_PING, P.OP_STATUS, P.OP_UNWATCH):
            figures.unauthorised_successes += 1
            figures.examples.append({"unauthorised success": [op, repr(args)[:200], repr(reply)[:200]]})


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
        return int(m.group(1)) if m else 0
    except OSError:
        return 0


def start_server(root: Path, specs: list[Spec], *, sharded: bool = False) -> ServerProcess:
    """The fuzzed server; ``sharded``: a node of group ``fuzz`` of a shard map that gives half
    the slots to a group ``elsewhere`` (an address nothing listens on), so about half the
    names are answered with WrongShard and multi-name requests may span groups."""
    creds = root / "credentials.toml"
    write_credentials(creds, specs)
    shard_args: list[str] = []
    if sharded:
        from fastlock.sharding import ShardGroup, ShardMap, even_ranges, write_map_file

        shard_map = ShardMap(1, (ShardGroup("fuzz", ("127.0.0.1:1",)), ShardGroup("elsewhere", ("127.0.0.1:2",))),
                             even_ranges(["fuzz", "elsewhere"]))
        write_map_file(root / "shard-map.json", shard_map)
        shard_args = ["--shard-map", str(root / "shard-map.json"), "--shard-group", "fuzz"]
    return ServerProcess(root / "data", fsync="never",
                         args=["--credentials", str(creds), "--auth-failures-before-ban", "0", *QUOTA_ARGS,
                               *shard_args]).start()


def server_crashed(server: ServerProcess) -> bool:
    return server.proc.poll() is not None or any("Traceback" in line or "internal error" in line
                                                  for line in server.lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100_000, help="stop after about this many requests")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--batch", type=int, default=64, help="requests per connection per round")
    ap.add_argument("--max-seconds", type=float, default=3600.0, help="stop after this long in any case")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--sharded", action="store_true",
                    help="fuzz a sharded node (a shard map giving half the slots to another group)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    rng = random.Random(seed)
    specs = make_specs()
    figures = Figures()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fastlock-fuzz-") as tmp:
        server = start_server(Path(tmp), specs, sharded=args.sharded)
        owners: list[bytes] = []
        try:
            deadline = t0 + args.max_seconds
            per_round = 2 * len(specs) * args.batch
            while figures.requests < args.requests and time.monotonic() < deadline and not figures.crashes:
                rounds = max(1, min(50, (args.requests - figures.requests) // per_round))
                asyncio.run(fuzz_rounds(server.address, specs, rng, rounds, args.batch, figures, owners, server,
                                        deadline))
                rss = rss_kib(server.pid)
                figures.max_rss_kib = max(figures.max_rss_kib, rss)
                print(f"  {figures.requests:>9} requests  {time.monotonic() - t0:7.1f} s  rss {rss / 1024:.1f} MiB  "
                      f"internal errors {figures.internal_errors}  unauthorised changes "
                      f"{figures.unauthorised_state_changes + figures.unauthorised_successes}", file=sys.stderr)
            figures.rss_kib = rss_kib(server.pid)
            figures.server_log_lines = len(server.lines)
            figures.crashes += server_crashed(server)
        finally:
            server.stop()
    elapsed = time.monotonic() - t0
    print(f"seed {seed}: {figures.requests} requests ({figures.replies} replies, {figures.refused} refused, "
          f"{figures.no_reply} without reply) in {elapsed:.1f} s ({figures.requests / elapsed:.0f}/s), "
          f"{figures.rounds} rounds")
    print(f"crashes {figures.crashes}, internal errors {figures.internal_errors}, unauthorised state changes "
          f"{figures.unauthorised_state_changes}, unauthorised successes {figures.unauthorised_successes}, "
          f"quota breaches {figures.quota_breaches} ({figures.quota_refusals} refusals at a quota)")
    print(f"real proofs replayed or reflected {figures.proofs_replayed} (every one refused unless counted above); "
          f"flood: {figures.flood_requests} pipelined requests, another connection's worst PING "
          f"{figures.worst_ping_ms:.1f} ms")
    print(f"server log: {figures.server_log_lines} lines; ", end="")
    print(f"server RSS at the end {figures.rss_kib / 1024:.1f} MiB (max seen {figures.max_rss_kib / 1024:.1f} MiB)")
    for ex in figures.examples[:5]:
        print("  example:", json.dumps(ex, default=repr)[:500])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(figures.as_dict(), seed=seed, seconds=elapsed), f, indent=2, default=repr)
    bad = (figures.crashes or figures.internal_errors or figures.unauthorised_state_changes
           or figures.unauthorised_successes or figures.quota_breaches)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
