"""Invariant 12's fair shares: every principal is bounded by default, counted as each op runs.

Each test drives real ``fastlock serve`` processes over loopback with raw msgpack
peers (:class:`test_limits.Raw`): a principal at its quotas gets a
:class:`~fastlock.errors.LimitExceeded` naming the flag from every op that would
create a lease, a waiter, a watch, a key or a connection, and nothing changes;
another principal keeps acquiring, watching, putting and connecting.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import msgpack
import pytest
from test_limits import Raw, acquire_args, error_of

from fastlock import protocol as P
from fastlock._testbase import CredentialsDir, raw_hello
from fastlock.errors import LimitExceeded
from fastlock.protocol.ops import (
    KEY_UPSERT,
    OP_ACQUIRE_PRIORITY,
    OP_COMMIT_RESERVATION,
    OP_KEY_DELETE,
    OP_KEY_GET,
    OP_KEY_LIST,
    OP_KEY_PUT,
    OP_KEY_UNWATCH,
    OP_KEY_WATCH,
    OP_KEY_WATCH_FROM,
    OP_RATE_LIMIT,
    OP_REQUEST_REVOKE,
    OP_RESERVE,
    OP_SHARD_MAP,
    OP_SHARD_MAP_NOTICE,
    OP_SLOT_ADOPT,
    OP_SLOT_EXPORT,
    OP_SLOT_IMPORT,
    OP_SYNC_ACK,
    OP_TRANSFER,
    OP_WAIT_IDENTITY,
    OP_WAITS_FOR,
    OP_WATCH_FROM,
)
from fastlock.server import ServerConfig
from fastlock.server.admission import RESERVED_CONNECTIONS
from fastlock.server.shares import quota_limits

QUOTA_FLAGS = ("--max-leases-per-principal", "--max-waiters-per-principal", "--max-watches-per-principal",
               "--max-keys-per-principal", "--max-connections-per-principal", "--max-key-bytes-per-principal")


def _limit(reply, flag: str) -> None:
    code, message = error_of(reply)
    assert code == LimitExceeded.code, reply
    assert flag in message, message


def _usage(admin: Raw) -> dict:
    """Every principal's usage row (STATUS as an admin), and the global counts."""
    st = admin.call(P.OP_STATUS)[2]
    rows = {u["principal"]: u for u in st["principals"]}
    return {"principals": rows, "locks_held": st["locks_held"], "waiters": st["waiters"],
            "watches": st["limits"]["watches"]}


def wait_for(what: str, check, timeout: float = 10.0):
    """``check()``'s first truthy value, polled every 20 ms for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _from(address: str, source: str, timeout: float = 5.0) -> socket.socket:
    """A TCP connection to ``address`` from the loopback address ``source`` (127.0.0.x)."""
    host, port = address.rsplit(":", 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect((host, int(port)))
    return s


def _hello_from(address: str, source: str, credential: str | None) -> tuple[socket.socket, list | None]:
    """Connect from ``source`` and say HELLO: the socket and the reply (None at EOF)."""
    s = _from(address, source)
    s.sendall(msgpack.packb([1, P.OP_HELLO, P.PROTOCOL_VERSION, "flood", credential], use_bin_type=True))
    unpacker = msgpack.Unpacker(raw=False)
    while True:
        try:
            data = s.recv(1 << 16)
        except (ConnectionResetError, TimeoutError):
            return s, None
        if not data:
            return s, None
        unpacker.feed(data)
        for msg in unpacker:
            return s, msg


# ---------------------------------------------------------------------------------------------
# the defaults


def test_default_quotas_are_a_share_of_each_global_cap():
    config = ServerConfig()
    shared = quota_limits(config, single_principal=False, max_connections=10_000)
    assert shared == {"leases": (250_000, 62_500), "waiters": (25_000, 6_250), "watches": (25_000, 6_250),
                      "keys": (25_000, 6_250), "connections": (2_500, 625),
                      "key_bytes": (64 << 20, 16 << 20)}
    # one principal only (open mode, the shared secret): nobody to share with, the global caps bound it
    assert set(quota_limits(config, single_principal=True, max_connections=10_000).values()) == {(0, 0)}
    # a set quota applies in every mode; 0 is none; the anonymous principal's follows its divisor
    config = ServerConfig(max_leases_per_principal=40, max_watches_per_principal=0, anonymous_quota_divisor=8)
    assert quota_limits(config, single_principal=False, max_connections=80)["leases"] == (40, 5)
    assert quota_limits(config, single_principal=True, max_connections=80)["leases"] == (40, 40)
    assert quota_limits(config, single_principal=False, max_connections=80)["watches"] == (0, 0)
    assert quota_limits(config, single_principal=False, max_connections=80)["connections"] == (20, 2)


def test_the_help_names_each_quota_and_its_default():
    from fastlock.cli import build_parser

    text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    for flag in (*QUOTA_FLAGS, "--anonymous-quota-divisor"):
        assert flag in text, flag
    assert text.count("a quarter of --max-") == 7 and "the anonymous principal's a sixteenth" in text


# ---------------------------------------------------------------------------------------------
# every op that creates something is counted, as it runs


def _quota_server(server_factory, tmp_path, *extra: str):
    creds = CredentialsDir(tmp_path / "credentials", replicas=1)
    srv = server_factory("quotas", args=["--credentials", creds.file, "--max-leases-per-principal", "3",
                                         "--max-waiters-per-principal", "2", "--max-watches-per-principal", "2",
                                         "--max-keys-per-principal", "2", "--max-connections-per-principal", "4",
                                         "--anonymous-quota-divisor", "1", *extra])
    return srv, creds


def _ops_at_quota(address: str, app_token: str, owner: bytes, peer: Raw) -> dict[int, list]:
    """For EVERY op of the protocol's op table: how a client principal at its quotas
    sends it, as ``(arguments or a callable making the request, the quota flag its
    refusal must name or None)``; the test fails on an op missing here."""
    def new_conn() -> list:  # HELLO on a new connection makes one
        with Raw(address, hello=False) as raw:
            return raw_hello(raw.call, "one-more", app_token)

    return {
        P.OP_HELLO: [(new_conn, "--max-connections-per-principal"),
                     (lambda: raw_hello(peer.call, "again", app_token), None)],  # the same connection again: no new one
        P.OP_ACQUIRE: [(("free/1", owner, 60_000, 0, 0, None), "--max-leases-per-principal"),
                       (("free/1", owner, 60_000, -1, 0, None), "--max-waiters-per-principal"),
                       (("free/2", owner, 60_000, 0, 0, None, True), "--max-leases-per-principal"),  # shared
                       (("free/3", owner, 60_000, 0, 0, None, False, 3), "--max-leases-per-principal"),  # permit
                       (("held/1", os.urandom(16), 60_000, 5_000, 0, None), "--max-waiters-per-principal"),
                       (("held/1", os.urandom(16), 60_000, 0, 0, None), "--max-leases-per-principal")],
        P.OP_ACQUIRE_MANY: [(([["m/1", False], ["m/2", True]], owner, 60_000, 0, 0, None),
                             "--max-leases-per-principal"),
                            (([["held/2", False]], os.urandom(16), 60_000, -1, 0, None),
                             "--max-waiters-per-principal")],
        P.OP_WATCH: [(("w/new",), "--max-watches-per-principal")],
        OP_KEY_WATCH: [(("kw/new/",), "--max-watches-per-principal")],
        OP_KEY_WATCH_FROM: [(("kw/new/", None, None), "--max-watches-per-principal")],
        OP_WATCH_FROM: [(("w/new", None), "--max-watches-per-principal")],
        OP_KEY_PUT: [(("k/new", b"v", None, None, None, KEY_UPSERT), "--max-keys-per-principal"),
                       (("k/1", b"w", None, None, None, KEY_UPSERT), None)],  # replaces its own key: no new one
        # the rest create nothing: each sent with arguments that would act if they could
        P.OP_RELEASE: [(("app/1", 1, owner), None)],
        P.OP_EXTEND: [(("app/1", 1, owner, 60_000), None)],
        P.OP_CANCEL: [(("free/9", owner), None)],
        P.OP_CHECK: [(("app/1", 1), None)],
        P.OP_STATUS: [((), None)],
        P.OP_PING: [((), None)],
        P.OP_UNWATCH: [(("w/none",), None)],
        P.OP_HOLDER: [(("held/1",), None)],
        P.OP_REPLICATE: [((0, None, 0, "x@y"), None)],
        P.OP_REPL_ACK: [((1, 1), None)],
        P.OP_PROMOTE: [((True,), None)],
        P.OP_SERVE_ALONE: [((), None)],
        P.OP_STEP_DOWN: [((9, "x"), None)],
        OP_KEY_GET: [(("k/1",), None)],
        OP_KEY_LIST: [(("k/", 10), None)],
        OP_KEY_DELETE: [(("k/none",), None)],
        OP_KEY_UNWATCH: [(("none/",), None)],
        P.OP_LOCKS: [(("", 10), None)],
        P.OP_LOCK_INFO: [(("held/1",), None)],
        P.OP_REVOKE: [((None, None, "x", "anonymous"), None)],
        P.OP_CONTENDERS: [(("held/1",), None)],
        OP_SYNC_ACK: [((1,), None)],
        OP_RATE_LIMIT: [(("rl/1", 1000, 1000, 10, 1), None)],  # a limiter: bounded apart (server/ratelimit.py)
        # priorities (fastlock.server.preemption): a prioritized acquire counts as ACQUIRE does
        OP_ACQUIRE_PRIORITY: [(("free/1", owner, 60_000, 0, 0, None, False, 0, 0, 5), "--max-leases-per-principal"),
                              (("held/1", os.urandom(16), 60_000, 5_000, 0, None, False, 0, 0, 5),
                               "--max-waiters-per-principal")],
        OP_REQUEST_REVOKE: [(("held/1", owner, 100), None)],  # owner does not wait there: refused
        OP_TRANSFER: [(("app/1", 1, owner, "nobody"), None)],
        # client sessions (fastlock.server.sessions): bounded apart (per connection, principal and server);
        # an unknown session key is refused, and a new session holds no lease, waiter, watch or key
        P.OP_SESSION_OPEN: [((os.urandom(16), 10_000), None)],
        P.OP_SESSION_ATTACH: [((os.urandom(16), [["app/1", 1, owner]], []), None)],
        P.OP_SESSION_KEEPALIVE: [((os.urandom(16),), None)],
        P.OP_SESSION_CLOSE: [((os.urandom(16),), None)],
        P.OP_SESSIONS: [((None,), None)],
        P.OP_SESSION_REVOKE: [(("0" * 16, None), None)],
        OP_SHARD_MAP: [((), None)],  # reads the shard map (None: not sharded): holds nothing
        # a cross-shard multi-lock's reservation (fastlock.server.woundwait) counts as ACQUIRE_MANY does;
        # a commit creates nothing (no such reservation here: refused)
        OP_RESERVE: [((["r/1", "r/2"], owner, 60_000, 0, None, int(time.time() * 1000), b"m1"),
                      "--max-leases-per-principal"),
                     ((["held/2"], os.urandom(16), 60_000, -1, None, int(time.time() * 1000), b"m2"),
                      "--max-waiters-per-principal")],
        OP_COMMIT_RESERVATION: [((b"m1",), None)],
        # deadlock detection across shards (fastlock.server.edgechase): a connection's one wait id
        # (bounded by the connections), read-only probes (bounded per principal per second)
        OP_WAIT_IDENTITY: [((os.urandom(32),), None)],
        OP_WAITS_FOR: [((os.urandom(16), 1, 0), None)],
        # a slot move's ops (fastlock.server.slotmove): an admin's; an unsharded node refuses them
        OP_SLOT_EXPORT: [((0, 0, None), None)],
        OP_SLOT_IMPORT: [((0, 0, b""), None)],
        OP_SLOT_ADOPT: [((0, 0, 1), None)],
        # a move's driver telling of a map change (fastlock.server.mapnotice): an admin's; an unsharded node refuses it
        OP_SHARD_MAP_NOTICE: [((5,), None)],
    }


def test_every_op_that_creates_a_resource_is_counted(server_factory, tmp_path):
    """A principal at every quota (leases + waiters, waiters, watches, keys, connections)
    sends every op of the op table, one at a time and then all in one pipelined write:
    each op that would create something is refused naming its quota's flag, and neither
    its usage nor the server's totals move."""
    srv, creds = _quota_server(server_factory, tmp_path)
    token = creds.token("app")
    admin = Raw(srv.address, credential=creds.token("admin"))
    anon = Raw(srv.address)
    app = [Raw(srv.address, credential=token) for _ in range(4)]
    try:
        for name in ("held/1", "held/2"):
            assert anon.call(P.OP_ACQUIRE, *acquire_args(name))[1] == 0
        owner = os.urandom(16)
        assert app[0].call(P.OP_ACQUIRE, "app/1", owner, 60_000, 0, 0, None)[1] == 0
        app[0].send(P.OP_ACQUIRE, *acquire_args("held/1", wait_ms=-1))
        app[0].send(P.OP_ACQUIRE, *acquire_args("held/2", wait_ms=-1))
        assert app[0].call(P.OP_WATCH, "w/1")[1] == 0
        assert app[0].call(OP_KEY_WATCH, "kw/")[1] == 0
        for key in ("k/1", "k/2"):
            assert app[0].call(OP_KEY_PUT, key, b"v", None, None, None, KEY_UPSERT)[1] == 0
        before = _usage(admin)
        row = before["principals"]["app"]
        assert {k: row[k] for k in ("leases", "waiters", "watches", "keys", "connections")} == {
            "leases": 1, "waiters": 2, "watches": 2, "keys": 2, "connections": 4}, row

        peer = app[1]
        drivers = _ops_at_quota(srv.address, token, os.urandom(16), peer)
        assert set(drivers) == set(P.OP_NAMES), "an op of the op table has no driver here: add one"
        for op, variants in drivers.items():
            for request, flag in variants:
                reply = request() if callable(request) else peer.call(op, *request)
                if flag is not None:
                    _limit(reply, flag)
                after = _usage(admin)
                assert after == before, (P.OP_NAMES[op], request, reply)
        # all of them in one write: the count moves as each request runs, not after the read
        frames = b"".join(msgpack.packb([1000 + i, op, *request], use_bin_type=True)
                          for i, (op, request) in enumerate((op, r) for op, vs in drivers.items()
                                                            for r, _ in vs if not callable(r)))
        peer.sock.sendall(frames + msgpack.packb([999_999, P.OP_PING], use_bin_type=True))
        while (msg := peer.recv())[0] != 999_999:
            assert msg[0] != 0, msg
        assert _usage(admin) == before
    finally:
        for raw in (admin, anon, *app):
            raw.close()


def test_one_pipelined_write_of_2000_acquires_grants_exactly_the_quota(server_factory):
    srv = server_factory("pipelined", args=["--max-leases-per-principal", "200"])
    raw = Raw(srv.address, timeout=30)
    try:
        frames = b"".join(msgpack.packb([i + 1, P.OP_ACQUIRE, *acquire_args(f"p/{i}", ttl_ms=P.MAX_TTL_MS)],
                                        use_bin_type=True) for i in range(2_000))
        raw.next_id = 2_001
        raw.sock.sendall(frames)
        replies = [raw.recv() for _ in range(2_000)]
        granted = [r for r in replies if r[1] == 0]
        refused = [r for r in replies if r[1] == LimitExceeded.code]
        assert len(granted) == 200 and len(refused) == 1_800
        assert "--max-leases-per-principal" in refused[0][2]
        assert raw.call(P.OP_STATUS)[2]["locks_held"] == 200
    finally:
        raw.close()


def test_acquire_many_is_all_or_nothing_against_the_quota(server_factory):
    """ACQUIRE_MANY counts every name: a set that would pass the quota is refused whole
    (nothing granted, nothing queued), pipelined sets stop exactly at the quota."""
    srv = server_factory("many", args=["--max-leases-per-principal", "100", "--max-waiters-per-principal", "10"])
    raw, other = Raw(srv.address, timeout=30), Raw(srv.address)
    try:
        frames = b"".join(msgpack.packb([i + 1, P.OP_ACQUIRE_MANY, [[f"s{i}/{k}", False] for k in range(8)],
                                         os.urandom(16), P.MAX_TTL_MS, 0, 0, None], use_bin_type=True)
                          for i in range(40))  # 320 names asked, 100 allowed: 12 sets of 8
        raw.next_id = 41
        raw.sock.sendall(frames)
        replies = [raw.recv() for _ in range(40)]
        assert sum(r[1] == 0 for r in replies) == 12
        assert all(r[1] == LimitExceeded.code for r in replies if r[1] != 0)
        st = raw.call(P.OP_STATUS)[2]
        assert st["locks_held"] == 96 and st["waiters"] == 0
        # four left: a set of five is refused whole, queued or not
        names = [[f"s0/{k}", False] for k in range(5)]  # held already: it would queue
        _limit(raw.call(P.OP_ACQUIRE_MANY, names, os.urandom(16), 60_000, -1, 0, None), "--max-leases-per-principal")
        _limit(raw.call(P.OP_ACQUIRE_MANY, [[f"t/{k}", False] for k in range(5)], os.urandom(16), 60_000, 0, 0, None),
               "--max-leases-per-principal")
        st = raw.call(P.OP_STATUS)[2]
        assert st["locks_held"] == 96 and st["waiters"] == 0
        # a set that fits queues and reserves its leases: then nothing more fits
        queued = raw.send(P.OP_ACQUIRE_MANY, [[f"s0/{k}", False] for k in range(4)], os.urandom(16), 60_000, -1, 0,
                          None)
        wait_for("the set to queue", lambda: other.call(P.OP_STATUS)[2]["waiters"] == 4)
        _limit(raw.call(P.OP_ACQUIRE, *acquire_args("one-more")), "--max-leases-per-principal")
        assert queued and raw.call(P.OP_STATUS)[2]["locks_held"] == 96
    finally:
        raw.close()
        other.close()


# ---------------------------------------------------------------------------------------------
# one principal cannot push another into a global cap


def test_one_principal_at_its_quotas_cannot_push_another_into_a_global_cap(server_factory, tmp_path):
    """The issue's scenario scaled down, with the default shares: anonymous connections
    from five addresses pipeline every kind of request with hour-long TTLs (the longest); anonymous
    ends at a sixteenth of each global cap, and ``app`` still acquires, waits,
    watches, puts and connects."""
    creds = CredentialsDir(tmp_path / "credentials", replicas=1)
    srv = server_factory("fair", args=["--credentials", creds.file, "--max-leases", "64", "--max-waiters", "32",
                                       "--max-watches", "32", "--max-keys", "32", "--max-connections", "32"])
    admin = Raw(srv.address, credential=creds.token("admin"))
    flood: list[socket.socket] = []
    app: list[Raw] = []
    try:
        day = P.MAX_TTL_MS
        for i in range(20):
            s, reply = _hello_from(srv.address, f"127.0.0.{2 + i % 5}", None)
            flood.append(s)
            if reply is None or reply[1] != 0:
                continue
            requests = []
            for k in range(200):
                requests.append([P.OP_ACQUIRE, f"a{i}/{k}", os.urandom(16), day, 0, 0, None])
                requests.append([P.OP_ACQUIRE, "app/contended", os.urandom(16), day, -1, 0, None])
                requests.append([P.OP_ACQUIRE_MANY, [[f"m{i}/{k}/{n}", False] for n in range(64)], os.urandom(16),
                                 day, 0, 0, None])
                requests.append([P.OP_WATCH, f"w{i}/{k}"])
                requests.append([OP_KEY_PUT, f"k{i}/{k}", b"v" * 64, None, None, None, KEY_UPSERT])
            s.sendall(b"".join(msgpack.packb([n + 2, *r], use_bin_type=True) for n, r in enumerate(requests)))
        def at_quotas() -> dict | None:
            row = _usage(admin)["principals"].get("anonymous")
            full = row is not None and row["leases"] + row["waiters"] == 4 and row["watches"] == row["keys"] == 2
            return row if full else None

        # each held at its quota: 64/16 leases (and waiters, which reserve leases), 32/16 of the rest
        anon = wait_for("the flood to reach anonymous's quotas", at_quotas, timeout=15)
        assert anon["waiters"] <= 2 and anon["connections"] == 2, anon
        st = _usage(admin)
        assert st["locks_held"] <= 4 and st["waiters"] <= 2 and st["watches"] == 2
        # app gets everything it asks for
        token = creds.token("app")
        app = [Raw(srv.address, credential=token) for _ in range(8)]
        owner = os.urandom(16)
        reply = app[0].call(P.OP_ACQUIRE, "app/1", owner, 60_000, 0, 0, None)
        assert reply[1] == 0, reply
        assert app[0].call(P.OP_ACQUIRE_MANY, [[f"app/m/{n}", False] for n in range(8)], os.urandom(16), 60_000,
                           0, 0, None)[1] == 0
        app[1].send(P.OP_ACQUIRE, "app/1", os.urandom(16), 60_000, -1, 0, None)
        wait_for("app's waiter", lambda: _usage(admin)["principals"]["app"]["waiters"] == 1)
        for n in range(4):
            assert app[2].call(P.OP_WATCH, f"app/w/{n}")[1] == 0
            assert app[2].call(OP_KEY_PUT, f"app/k/{n}", b"v", None, None, None, KEY_UPSERT)[1] == 0
        assert app[1].call(P.OP_RELEASE, "app/none", 1, owner)[1] != 0  # (its connection still works)
        assert app[0].call(P.OP_RELEASE, "app/1", reply[2][0], owner)[1] == 0
        assert app[1].recv()[1] == 0  # the waiter got it
    finally:
        for s in flood:
            s.close()
        for raw in (admin, *app):
            raw.close()


def test_anonymous_connections_from_many_addresses_leave_room_for_credentialed_clients(server_factory, tmp_path):
    """Anonymous connections from six loopback addresses, HELLO done or silent, try to
    fill --max-connections: a credentialed client and an admin still connect and are
    served within 15 s."""
    creds = CredentialsDir(tmp_path / "credentials", replicas=1)
    srv = server_factory("table", args=["--credentials", creds.file, "--max-connections", "48",
                                        "--hello-timeout", "60"])
    flood: list[socket.socket] = []
    try:
        ready = 0
        for i in range(60):
            source = f"127.0.0.{2 + i % 6}"
            if i % 2:
                flood.append(_from(srv.address, source))  # silent: never says HELLO
                continue
            s, reply = _hello_from(srv.address, source, None)
            flood.append(s)
            ready += reply is not None and reply[1] == 0
        assert ready == 48 // 16  # the anonymous principal's share of connections
        # each call is bounded by its socket timeout (15 s): the credentialed principals get in
        with Raw(srv.address, credential=creds.token("app"), timeout=15) as app:
            assert app.call(P.OP_PING)[1] == 0
        with Raw(srv.address, credential=creds.token("admin"), timeout=15) as admin:
            rows = {u["principal"]: u for u in admin.call(P.OP_STATUS)[2]["principals"]}
        assert rows["anonymous"]["connections"] == 3 and rows["anonymous"]["connections_quota"] == 3
    finally:
        for s in flood:
            s.close()


def test_slots_reserved_for_replicas_and_admins(server_factory, tmp_path):
    """Clients fill --max-connections: another client's HELLO is refused naming the flag,
    while an admin still gets in and a standby attaches and replicates."""
    creds = CredentialsDir(tmp_path / "credentials", replicas=2)
    primary = server_factory("primary", args=["--max-connections", "6", "--max-connections-per-principal", "0",
                                              *creds.server_args("node-1")])
    token = creds.token("app")
    clients = [Raw(primary.address, credential=token) for _ in range(6)]
    try:
        extra = Raw(primary.address, hello=False)
        _limit(raw_hello(extra.call, "seventh", token), "--max-connections")
        assert extra.closed_by_server()
        extra.close()
        with Raw(primary.address, credential=creds.token("admin")) as admin:
            assert admin.call(P.OP_PING)[1] == 0
            server_factory("standby", args=["--standby-of", primary.address, *creds.server_args("node-2")])
            primary.wait_for_log(r"standby .* attached", timeout=15)
            st = admin.call(P.OP_STATUS)[2]
            assert st["limits"]["reserved_connections"] == RESERVED_CONNECTIONS
            assert st["sessions"] == 8  # six clients, the admin and the standby
        for raw in clients:
            assert raw.call(P.OP_PING)[1] == 0
    finally:
        for raw in clients:
            raw.close()


# ---------------------------------------------------------------------------------------------
# revoking a principal, and leases counted after a promotion


def _pair(server_factory, tmp_path, *standby_args: str):
    creds = CredentialsDir(tmp_path / "credentials", replicas=2)
    primary = server_factory("primary", args=[*creds.server_args("node-1")])
    standby = server_factory("standby", args=["--standby-of", primary.address, "--promotion-grace", "0",
                                              *creds.server_args("node-2"), *standby_args])
    primary.wait_for_log(r"standby .* attached", timeout=15)
    return creds, primary, standby


def _standby_caught_up(standby, token: str) -> dict | None:
    with Raw(standby.address, credential=token) as raw:
        st = raw.call(P.OP_STATUS)[2]
    repl = st["replication"]
    return st if repl.get("connected") and repl["primary_last_lsn"] <= repl["applied_lsn"] else None


def test_revoke_principal_revokes_every_lease_in_pages_and_replicates(server_factory, tmp_path):
    creds, primary, standby = _pair(server_factory, tmp_path)
    app = Raw(primary.address, credential=creds.token("app"), timeout=30)
    anon = Raw(primary.address)
    admin = Raw(primary.address, credential=creds.token("admin"), timeout=30)
    try:
        sets = 40  # 2,560 leases: three pages of the revocation
        app.next_id = sets + 1
        app.sock.sendall(b"".join(msgpack.packb([i + 1, P.OP_ACQUIRE_MANY, [[f"a{i}/{k}", False] for k in range(64)],
                                                 os.urandom(16), P.MAX_TTL_MS, 0, 0, None], use_bin_type=True)
                                  for i in range(sets)))
        assert all(app.recv()[1] == 0 for _ in range(sets))
        assert anon.call(P.OP_ACQUIRE, *acquire_args("anon/1"))[1] == 0
        waiting = anon.send(P.OP_ACQUIRE, *acquire_args("a0/0", wait_ms=-1))  # anonymous waits on one of app's
        assert anon.call(P.OP_WATCH, "a1/1")[1] == 0
        reply = admin.call(P.OP_REVOKE, None, None, "tenant gone", "app")
        assert reply[1] == 0 and reply[2] == {"principal": "app", "revoked": sets * 64, "waiting": 0}, reply[1:]
        seen = [anon.recv() for _ in range(2)]  # the watch's push and the grant, in either order
        pushes = [m for m in seen if m[0] == 0]
        assert len(pushes) == 1 and pushes[0][2][:2] == ["a1/1", P.WATCH_REVOKED], seen
        granted = next(m for m in seen if m[0] != 0)
        assert granted[0] == waiting and granted[1] == 0, granted  # the lock went to its next waiter
        rows = {u["principal"]: u for u in admin.call(P.OP_STATUS)[2]["principals"]}
        assert rows["app"]["leases"] == 0 and rows["anonymous"]["leases"] == 2
        assert admin.call(P.OP_STATUS)[2]["locks_held"] == 2
        st = wait_for("the standby to apply the revocations",
                       lambda: _standby_caught_up(standby, creds.token("admin")), timeout=15)
        assert st["locks_held"] == 2
        # by name and token together is not a revocation by principal
        code, message = error_of(admin.call(P.OP_REVOKE, "a0/0", None, None, "app"))
        assert "no lock name" in message
        # a client may not revoke
        assert error_of(app.call(P.OP_REVOKE, None, None, None, "anonymous"))[1].startswith("revoke needs an admin")
    finally:
        for raw in (app, anon, admin):
            raw.close()


def test_promoted_standby_counts_replicated_leases_against_their_principal(server_factory, tmp_path):
    creds, primary, standby = _pair(server_factory, tmp_path, "--max-leases-per-principal", "10")
    app = Raw(primary.address, credential=creds.token("app"))
    try:
        for i in range(10):
            assert app.call(P.OP_ACQUIRE, *acquire_args(f"r/{i}"))[1] == 0
        wait_for("the standby to apply the grants", lambda: _standby_caught_up(standby, creds.token("admin")),
                  timeout=15)
    finally:
        app.close()
    primary.stop()
    with Raw(standby.address, credential=creds.token("admin"), timeout=30) as admin:
        reply = admin.call(P.OP_PROMOTE, True)
        assert reply[1] == 0, reply
        rows = {u["principal"]: u for u in admin.call(P.OP_STATUS)[2]["principals"]}
        assert rows["app"]["leases"] == 10 and rows["app"]["leases_quota"] == 10
    with Raw(standby.address, credential=creds.token("app")) as app:
        _limit(app.call(P.OP_ACQUIRE, *acquire_args("r/new")), "--max-leases-per-principal")
    with Raw(standby.address) as anon:  # another principal is not affected
        assert anon.call(P.OP_ACQUIRE, *acquire_args("r/anon"))[1] == 0


@pytest.mark.parametrize("bad", [[None, None, None, ""], [None, None, None, 7], [None, None, None, "x" * 65]])
def test_revoke_principal_refuses_a_bad_principal(server_factory, bad):
    srv = server_factory("badrevoke")
    with Raw(srv.address) as raw:  # open mode: the anonymous principal may administer locks
        assert raw.call(P.OP_ACQUIRE, *acquire_args("x"))[1] == 0
        code, message = error_of(raw.call(P.OP_REVOKE, *bad))
        assert "principal must be a name" in message
        assert raw.call(P.OP_STATUS)[2]["locks_held"] == 1


# ---------------------------------------------------------------------------------------------
# the operator's view and commands


def _cli(*args: str, server: str, token_file: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
    if token_file is not None:
        env["FASTLOCK_TOKEN_FILE"] = token_file
    return subprocess.run([sys.executable, "-m", "fastlock", *args, "--server", server], capture_output=True,
                          text=True, timeout=60, env=env)


def test_principals_and_revoke_principal_from_the_command_line(server_factory, tmp_path):
    creds = CredentialsDir(tmp_path / "credentials", replicas=1)
    srv = server_factory("cli", args=["--credentials", creds.file])
    with Raw(srv.address, credential=creds.token("app")) as app, Raw(srv.address) as anon:
        for i in range(3):
            assert app.call(P.OP_ACQUIRE, *acquire_args(f"c/{i}"))[1] == 0
        assert anon.call(P.OP_WATCH, "c/0")[1] == 0
        admin_file = creds.token_file("admin")
        out = _cli("principals", "-o", "json", server=srv.address, token_file=admin_file)
        assert out.returncode == 0, out.stderr
        rows = {u["principal"]: u for u in json.loads(out.stdout)}
        assert (rows["app"]["leases"], rows["app"]["leases_quota"]) == (3, 250_000)
        assert (rows["anonymous"]["watches"], rows["anonymous"]["watches_quota"]) == (1, 6_250)
        table = _cli("principals", server=srv.address, token_file=admin_file)
        assert table.returncode == 0 and re.search(r"app\s+3/250000\s+0/25000", table.stdout), table.stdout
        # a client sees its own row only
        own = _cli("principals", "-o", "json", server=srv.address, token_file=creds.token_file("app"))
        assert [u["principal"] for u in json.loads(own.stdout)] == ["app"]
        # revoking needs an admin, and NAME or --principal, not both
        refused = _cli("revoke", "--principal", "app", server=srv.address, token_file=creds.token_file("app"))
        assert refused.returncode == 1 and "revoke needs an admin principal" in refused.stderr
        both = _cli("revoke", "c/0", "--principal", "app", server=srv.address, token_file=admin_file)
        assert both.returncode == 2 and "not both" in both.stderr
        done = _cli("revoke", "--principal", "app", "--reason", "tenant gone", server=srv.address,
                    token_file=admin_file)
        assert done.returncode == 0, done.stderr
        assert "revoked 3 leases of principal app (0 of its acquires still waiting)" in done.stdout
        assert app.call(P.OP_STATUS)[2]["locks_held"] == 0
        # the audit records name who asked and why
        dump = subprocess.run([sys.executable, "-m", "fastlock", "wal", "dump", str(tmp_path / "cli")],
                              capture_output=True, text=True, timeout=60)
        assert dump.stdout.count('by=admin reason="tenant gone"') == 3, dump.stdout


def test_metrics_show_usage_and_quota_per_principal(server_factory, tmp_path):
    pytest.importorskip("prometheus_client")
    creds = CredentialsDir(tmp_path / "credentials", replicas=1)
    srv = server_factory("metrics", args=["--credentials", creds.file, "--metrics", "127.0.0.1:0"])
    url = re.search(r"(http://\S+/metrics)", srv.wait_for_log(r"metrics on http://")).group(1)
    with Raw(srv.address, credential=creds.token("app")) as app:
        assert app.call(P.OP_ACQUIRE, *acquire_args("m/1"))[1] == 0

        def scraped() -> str | None:
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
            return text if 'fastlock_principal_usage{principal="app",resource="leases"} 1.0' in text else None

        text = wait_for("the exporter's refresh", scraped)
        assert 'fastlock_principal_quota{principal="app",resource="leases"} 250000.0' in text
        assert 'fastlock_principal_usage{principal="app",resource="connections"} 1.0' in text


def test_the_issue_flood_at_the_default_quotas(server_factory, tmp_path):
    """The finding itself, at the defaults: eight token-less connections pipeline
    ACQUIRE_MANY of 64 names with hour-long TTLs (the longest).  Anonymous stops at its sixteenth of
    --max-leases (62,500; every set all or nothing), and ``app`` still acquires."""
    creds = CredentialsDir(tmp_path / "credentials", replicas=1)
    srv = server_factory("flood", args=["--credentials", creds.file])
    peers = [Raw(srv.address, timeout=60) for _ in range(8)]
    try:
        per_peer = 140  # 8 x 140 sets of 64 names = 71,680 asked
        for p, peer in enumerate(peers):
            peer.next_id = per_peer + 1
            peer.sock.sendall(b"".join(
                msgpack.packb([i + 1, P.OP_ACQUIRE_MANY, [[f"f{p}/{i}/{k}", False] for k in range(64)],
                               os.urandom(16), P.MAX_TTL_MS, 0, 0, None], use_bin_type=True) for i in range(per_peer)))
        replies = [peer.recv() for peer in peers for _ in range(per_peer)]
        granted = sum(r[1] == 0 for r in replies)
        assert granted == 62_500 // 64  # 976 sets: the 977th would pass the quota
        assert all(r[1] == LimitExceeded.code and "--max-leases-per-principal" in r[2] for r in replies if r[1])
        with Raw(srv.address, credential=creds.token("admin")) as admin:
            usage = _usage(admin)
        assert usage["locks_held"] == granted * 64
        assert usage["principals"]["anonymous"]["leases_quota"] == 62_500
        with Raw(srv.address, credential=creds.token("app")) as app:
            assert app.call(P.OP_ACQUIRE_MANY, [[f"app/{k}", False] for k in range(64)], os.urandom(16), 60_000, 0,
                            0, None)[1] == 0
    finally:
        for peer in peers:
            peer.close()


def test_recovered_leases_count_against_their_principal_after_a_restart(server_factory, tmp_path):
    creds = CredentialsDir(tmp_path / "credentials", replicas=1)
    args = ["--credentials", creds.file, "--max-leases-per-principal", "5"]
    srv = server_factory("restart", args=args)
    with Raw(srv.address, credential=creds.token("app")) as app:
        for i in range(5):
            assert app.call(P.OP_ACQUIRE, *acquire_args(f"r/{i}"))[1] == 0
    srv.stop()
    srv = server_factory("restart", args=args)
    with Raw(srv.address, credential=creds.token("app")) as app:
        _limit(app.call(P.OP_ACQUIRE, *acquire_args("r/new")), "--max-leases-per-principal")
        assert [(u["principal"], u["leases"]) for u in app.call(P.OP_STATUS)[2]["principals"]] == [("app", 5)]
    with Raw(srv.address) as anon:
        assert anon.call(P.OP_ACQUIRE, *acquire_args("r/anon"))[1] == 0


def test_one_client_principal_alone_keeps_the_whole_server(server_factory, tmp_path):
    """Credentials with one client principal and no anonymous access: nobody to share
    with, so no default share (admins and replicas have the reserved connections)."""
    creds = CredentialsDir(tmp_path / "credentials", replicas=1, anonymous=False)
    srv = server_factory("alone", args=["--credentials", creds.file, "--max-leases", "8"])
    with Raw(srv.address, credential=creds.token("app")) as app:
        for i in range(8):
            assert app.call(P.OP_ACQUIRE, *acquire_args(f"alone/{i}"))[1] == 0
        _limit(app.call(P.OP_ACQUIRE, *acquire_args("alone/8")), "--max-leases")
        assert [(u["principal"], u["leases"], u["leases_quota"])
                for u in app.call(P.OP_STATUS)[2]["principals"]] == [("app", 8, 0)]


def test_a_release_uncounts_the_lease_from_its_own_principal_whoever_sends_it(server_factory, tmp_path):
    """A RELEASE of an unwatched lock uncounts the lease from the principal that holds it: the
    releasing connection's when it is that principal's, and the holder's too when another
    principal's connection releases it with its owner key; both principals acquire up to their
    quota again at once."""
    creds = CredentialsDir(tmp_path / "credentials", replicas=1)
    srv = server_factory("release", args=["--credentials", creds.file, "--max-leases-per-principal", "8"])
    with (Raw(srv.address, credential=creds.token("app")) as app, Raw(srv.address) as anon,
          Raw(srv.address, credential=creds.token("admin")) as admin):
        def leases() -> list[int]:  # app's and anonymous's
            return sorted(u["leases"] for p, u in _usage(admin)["principals"].items() if p != "admin")

        held: dict[str, list[tuple[str, int, bytes]]] = {"app": [], "anon": []}
        for who, raw in (("app", app), ("anon", anon)):  # each up to its quota
            for i in range(9):
                args = acquire_args(f"{who}/{i}")
                reply = raw.call(P.OP_ACQUIRE, *args)
                if reply[1] != 0:
                    _limit(reply, "--max-leases-per-principal")
                    break
                held[who].append((args[0], reply[2][0], args[1]))
        counts = sorted(len(h) for h in held.values())
        assert counts[0] >= 2 and leases() == counts, (held, leases())
        # each releases its leases but one, and that one the other principal's connection releases
        for who, raw, other in (("app", app, anon), ("anon", anon, app)):
            for i, (name, token, owner) in enumerate(held[who]):
                assert (raw if i else other).call(P.OP_RELEASE, name, token, owner)[1] == 0
        assert leases() == [0, 0]
        for who, raw in (("app", app), ("anon", anon)):
            for i in range(len(held[who])):
                assert raw.call(P.OP_ACQUIRE, *acquire_args(f"{who}/again/{i}"))[1] == 0
