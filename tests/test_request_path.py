"""The server's per-request fast paths keep every check they shortcut.

The request path skips work on its common case (see ``fastlock.server.session``
and ``fastlock.server.handlers``): the output cap is checked only while the
transport has paused writing, a principal's permissions on every name are
granted without walking its ACL, and a connection keeps the hash of the last
owner key it sent.  Each test here drives a real ``fastlock serve`` process into
the case the fast path does not cover and checks that the limit or refusal
still applies.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rawwire import RawWire

from fastlock import protocol as P
from fastlock._testbase import ServerProcess
from fastlock._testbase.cluster import RawNode
from fastlock._testbase.handshake import key_lines
from fastlock.auth import CLIENT_OPS, AclRule, Principal, generate, hash_owner, make_token
from fastlock.errors import InvalidArgument, LeaseLost, PermissionDenied
from fastlock.protocol.ops import (
    OP_ACQUIRE_PRIORITY,
    OP_KEY_GET,
    OP_KEY_PUT,
    OP_REQUEST_REVOKE,
    OP_SESSION_ATTACH,
    OP_SESSION_OPEN,
)


@pytest.mark.parametrize("cap", [4096, 300_000], ids=["below-high-water", "above-high-water"])
def test_a_client_that_leaves_more_than_the_output_cap_unread_is_dropped(server_factory, cap):
    """--max-output-bytes is enforced whether the cap is below the transport's
    default high-water mark (64 KiB, lowered to the cap) or above it."""
    srv = server_factory(fsync="never", args=["--max-output-bytes", str(cap)])
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(0.2)
    try:
        sock.sendall(msgpack.packb([1, P.OP_HELLO, P.PROTOCOL_VERSION, "no-reader", None]))
        chunk = msgpack.packb([2, P.OP_STATUS]) * 500  # ~0.5 MB of replies per chunk
        dropped = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not dropped:  # bounded: at most 30 s of pushing
            try:
                sock.sendall(chunk)
            except TimeoutError:
                pass  # the server stopped reading us for now
            except (BrokenPipeError, ConnectionResetError):
                dropped = True
            dropped = dropped or any("bytes of replies unread" in line for line in srv.lines)
        line = srv.wait_for_log(r"closing connection .* bytes of replies unread \(limit \d+\)", timeout=5)
        assert f"(limit {cap})" in line
    finally:
        sock.close()
    # everybody else is still served
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as other:
        other.sendall(msgpack.packb([1, P.OP_HELLO, P.PROTOCOL_VERSION, "other", None]) +
                      msgpack.packb([2, P.OP_PING]))
        up = msgpack.Unpacker()
        replies = []
        while len(replies) < 2:
            up.feed(other.recv(65536))
            replies.extend(up)
        assert [r[:2] for r in replies] == [[1, 0], [2, 0]]


async def test_the_last_owner_key_kept_per_connection_proves_nothing_else(server):
    """A connection keeps the hash of the last owner key it sent: a request with
    another key, with the hash itself, or with a key that is not bytes is still
    refused, on the same connection right after the kept key."""
    node = await RawNode.open(server.address)
    try:
        key_a, key_b = os.urandom(16), os.urandom(16)
        token_a, _, _ = await node.acquire("owner/a", 10_000, owner=key_a)
        token_b, _, _ = await node.acquire("owner/b", 10_000, owner=key_b)
        with pytest.raises(LeaseLost):  # key_b is the kept one now
            await node.release("owner/a", token_a, key_b)
        with pytest.raises(LeaseLost):  # what the server stores is the hash: it proves nothing
            await node.release("owner/a", token_a, hash_owner(key_a))
        await node.extend("owner/b", token_b, key_b, 10_000)
        with pytest.raises(InvalidArgument):  # (a wrong type travels as InvalidArgument)
            await node.request(P.OP_RELEASE, "owner/b", token_b, key_b.hex())
        with pytest.raises(LeaseLost):
            await node.extend("owner/b", token_b, key_a, 10_000)
        await node.release("owner/a", token_a, key_a)
        await node.release("owner/b", token_b, key_b)
        assert await node.holder("owner/a") is None and await node.holder("owner/b") is None
    finally:
        await node.close()


@pytest.fixture
def acl_server(tmp_path):
    """A server whose principals cover each branch of the permission check."""
    directory = tmp_path / "creds"
    paths = generate(directory, clients=[("full", "")], replicas=["node-a"], admins=["root"],
                     anonymous_prefix="public/")
    some = make_token("some")
    with open(directory / "credentials.toml", "a") as f:
        f.write(f"""
[principals.some]
kind = "client"
{chr(10).join(key_lines(some))}
acl = [{{prefix = "", ops = ["acquire", "release", "holder"]}}, {{prefix = "w/", ops = ["watch", "extend"]}}]
""")
    tokens = {name: open(path).read().strip() for name, path in paths.items()}
    tokens["some"] = some
    srv = ServerProcess(tmp_path / "data", fsync="never",
                        args=["--credentials", str(directory / "credentials.toml")]).start()
    try:
        yield srv, tokens
    finally:
        srv.stop()


async def test_every_request_is_still_authorized(acl_server):
    srv, tokens = acl_server
    nodes = {}
    try:
        for who in ("full", "some", "node-a", "root"):
            nodes[who] = await RawNode.open(srv.address, token=tokens[who])
        nodes["anonymous"] = await RawNode.open(srv.address, token=None)

        # a grant on every name: every client op on any name
        t, _, key = await nodes["full"].acquire("any/thing", 10_000)
        await nodes["full"].request(P.OP_WATCH, "any/thing")
        await nodes["full"].extend("any/thing", t, key, 10_000)
        await nodes["full"].release("any/thing", t, key)
        # some ops on every name, others on a prefix only
        t, _, key = await nodes["some"].acquire("x/1", 10_000)
        with pytest.raises(PermissionDenied):
            await nodes["some"].extend("x/1", t, key, 10_000)
        with pytest.raises(PermissionDenied):
            await nodes["some"].request(P.OP_WATCH, "x/1")
        with pytest.raises(PermissionDenied):
            await nodes["some"].request(P.OP_CHECK, "x/1", t)
        await nodes["some"].release("x/1", t, key)
        t, _, key = await nodes["some"].acquire("w/1", 10_000)
        await nodes["some"].extend("w/1", t, key, 10_000)
        await nodes["some"].request(P.OP_WATCH, "w/1")
        await nodes["some"].release("w/1", t, key)
        # the anonymous principal: its prefix only
        t, _, key = await nodes["anonymous"].acquire("public/1", 10_000)
        await nodes["anonymous"].release("public/1", t, key)
        with pytest.raises(PermissionDenied):
            await nodes["anonymous"].acquire("private/1", 10_000)
        # a replica may do no client operation; a client no replica or admin operation
        with pytest.raises(PermissionDenied):
            await nodes["node-a"].acquire("any/thing", 10_000)
        with pytest.raises(PermissionDenied):
            await nodes["full"].request(P.OP_REPL_ACK, 0, 0)
        with pytest.raises(PermissionDenied):
            await nodes["full"].request(P.OP_SERVE_ALONE)
        # an admin: client operations on every name
        t, _, key = await nodes["root"].acquire("x/2", 10_000)
        await nodes["root"].release("x/2", t, key)
        for name in ("any/thing", "x/1", "w/1", "public/1", "private/1", "x/2"):
            assert await nodes["root"].holder(name) is None  # nothing refused changed anything
    finally:
        for node in nodes.values():
            await node.close()


_NAMES = st.text(alphabet="ab/", max_size=4)


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["client", "replica", "admin"]),
       rules=st.lists(st.tuples(_NAMES, st.sets(st.sampled_from(CLIENT_OPS), min_size=1)), max_size=3),
       op=st.sampled_from(CLIENT_OPS), name=_NAMES)
def test_the_every_name_shortcut_gives_the_same_answers_as_the_rules(kind, rules, op, name):
    acl = tuple(AclRule(prefix, frozenset(ops)) for prefix, ops in rules) if kind == "client" else ()
    principal = Principal("p", kind, acl=acl)
    by_rules = kind == "admin" or (kind == "client" and any(op in r.ops and name.startswith(r.prefix) for r in acl))
    assert principal.allows(op, name) == by_rules
    if op in principal.everywhere and kind != "replica":
        assert by_rules  # granted on every name: granted on this one
    assert ("replica" in principal.everywhere) == (kind == "replica")
    assert ("admin" in principal.everywhere) == (kind == "admin")


async def test_the_transports_high_water_mark_is_kept_at_or_below_the_output_cap(tmp_path, loop_errors):
    """The cap is checked only while writing is paused, so a session lowers its
    transport's high-water mark to a cap below it (at connect, and when the cap changes)."""
    from fastlock.server import LockServer, ServerConfig

    server = LockServer(ServerConfig(port=0, data_dir=str(tmp_path / "data"), fsync="never", max_output_bytes=4096))
    await server.start()
    node = await RawNode.open(f"{server.address[0]}:{server.address[1]}")
    try:
        [session] = server.sessions.values()
        assert session.out_cap == 4096 and session.transport.get_write_buffer_limits()[1] <= 4096
        session.out_cap = 1000
        assert session.transport.get_write_buffer_limits()[1] <= 1000
        session.out_cap = 1 << 20  # raising the cap leaves the mark where it is (still below it)
        assert session.transport.get_write_buffer_limits()[1] <= 1000
        assert await node.request(P.OP_PING) is None
    finally:
        await node.close()
        await server.close()


def test_owner_hashes_are_blake2b_128_personalised_as_in_every_log_written_before():
    """hash_owner's cheaper construction gives the digest the WAL has always stored."""
    import hashlib

    for key in (b"k", os.urandom(16), os.urandom(64)):
        assert hash_owner(key) == hashlib.blake2b(key, digest_size=16, person=b"fastlock-owner").digest()


#: ACQUIRE's arguments after name and owner, each bad in one way (ttl, wait, lock-delay,
#: correlation id, shared, limit, actor, shared and limit together)
_BAD_ACQUIRE_ARGS = [
    (0, 0, 0, None, False, 0, 0),
    (10_000, -5, 0, None, False, 0, 0),
    (10_000, 0, -1, None, False, 0, 0),
    (10_000, 0, 0, 7, False, 0, 0),
    (10_000, 0, 0, None, 1, 0, 0),
    (10_000, 0, 0, None, False, -1, 0),
    (10_000, 0, 0, None, False, 0, "a"),
    (10_000, 0, 0, None, True, 2, 0),
    (2**64 - 1, 0, 0, None, False, 0, 0),  # beyond a C long long: out of range, not wrapped around
    (10_000, 2**64 - 1, 0, None, False, 0, 0),
    (10_000, -(2**63), 0, None, False, 0, 0),
    (10_000, 0, 2**63, None, False, 0, 0),
]


async def test_every_form_of_acquire_runs_the_same_checks(server):
    """ACQUIRE, ACQUIRE with its sequencer flag and ACQUIRE_PRIORITY are one implementation
    (``server/_wire.pyx``, ``enter_acquire``): each bad argument gets the same error in every
    form, the lock stays free, and a good request of each form is granted."""
    node = await RawNode.open(server.address)
    try:
        owner = os.urandom(16)
        for args in _BAD_ACQUIRE_ARGS:
            forms = {"acquire": (P.OP_ACQUIRE, "form/x", owner, *args),
                     "sequencer flag": (P.OP_ACQUIRE, "form/x", owner, *args, False),
                     "priority": (OP_ACQUIRE_PRIORITY, "form/x", owner, *args, 5),
                     "priority with sequencer flag": (OP_ACQUIRE_PRIORITY, "form/x", owner, *args, 5, False)}
            errors = {}
            for form, request in forms.items():
                with pytest.raises(InvalidArgument) as caught:
                    await node.request(*request)
                errors[form] = str(caught.value)
            assert len(set(errors.values())) == 1, errors
        assert await node.holder("form/x") is None
        for op, extra in ((P.OP_ACQUIRE, ()), (P.OP_ACQUIRE, (False,)), (OP_ACQUIRE_PRIORITY, (5,)),
                          (OP_ACQUIRE_PRIORITY, (5, False))):
            key = os.urandom(16)
            token, ttl_ms, _ = await node.request(op, "form/y", key, 10_000, 0, 0, None, False, 0, 0, *extra)
            assert ttl_ms == 10_000
            assert (await node.holder("form/y"))["token"] == token
            with pytest.raises(InvalidArgument, match="sequencer must be a bool"):  # EXTEND's flag, one path
                await node.request(P.OP_EXTEND, "form/y", token, key, 10_000, "yes")
            assert await node.request(P.OP_EXTEND, "form/y", token, key, 20_000, False) == 20_000
            assert await node.request(P.OP_EXTEND, "form/y", token, key, 20_000) == 20_000
            await node.release("form/y", token, key)
    finally:
        await node.close()


def _replies(port: int, requests: list[list]) -> list:
    """Send HELLO then each request on one connection, one at a time; the replies after HELLO's."""
    with RawWire(port) as wire:
        wire.hello("paths")
        out = []
        for req in requests:
            wire.send(req)
            out.append(wire.reply())
        return out


def test_acquire_and_release_answer_alike_called_directly_or_through_a_wrapped_handler(server_factory):
    """ACQUIRE and RELEASE run by a C call from dispatch while the op table holds their own
    handlers; --metrics wraps every handler, so they run through the table instead.  The same
    requests, valid and refused, get the same replies either way."""
    owner, other = b"0123456789abcdef", b"fedcba9876543210"
    requests = [
        [2, P.OP_ACQUIRE, "a", owner, 10_000, 0, 0, None],
        [3, P.OP_ACQUIRE, "a", other, 10_000, 0, 0, "busy"],  # held: not acquired
        [4, P.OP_ACQUIRE, "b", owner, 0, 0, 0, None],  # ttl below the least
        [5, P.OP_ACQUIRE, "", owner, 10_000, 0, 0, None],  # an empty name
        [6, P.OP_ACQUIRE, "c", "not bytes", 10_000, 0, 0, None],  # a bad owner key
        [7, P.OP_RELEASE, "a", 999_999, owner],  # not the holder's token
        [8, P.OP_RELEASE, "a", "token", owner],  # a token that is not an int
        [9, P.OP_ACQUIRE, "a", owner, 10_000, 0, 0, None],  # a retry of the held lease
    ]
    plain = server_factory("plain", fsync="never")
    wrapped = server_factory("wrapped", fsync="never", args=["--metrics", "127.0.0.1:0"])
    wrapped.wait_for_log(r"metrics on http://")
    got = [_replies(srv.port, requests) for srv in (plain, wrapped)]
    token = got[0][0][2][0]
    release = [[10, P.OP_RELEASE, "a", token, other], [11, P.OP_RELEASE, "a", token, owner],
               [12, P.OP_RELEASE, "a", token, owner]]  # another owner; the holder; released already
    got = [g + _replies(srv.port, release) for g, srv in zip(got, (plain, wrapped))]
    for g in got:  # the retry's waited_ms is a clock reading: its token and TTL are compared
        assert g[7][1] == 0
        g[7][2] = g[7][2][:2]
    assert got[0] == got[1]
    assert got[0][0][1] == 0 and got[0][-2] == [11, 0, None]
    assert all(reply[1] != 0 for reply in got[0][1:7])  # each refused
    # integers at and beyond the ends of 64 bits: each refused, alike either way
    edges = [[13, P.OP_RELEASE, "a", 2**64 - 1, owner], [14, P.OP_RELEASE, "a", -(2**63), owner],
             [15, P.OP_RELEASE, "a", 2**63, owner],
             [16, P.OP_ACQUIRE, "e", owner, 2**64 - 1, 0, 0, None],
             [17, P.OP_ACQUIRE, "e", owner, 10_000, 2**64 - 1, 0, None],
             [18, P.OP_ACQUIRE, "e", owner, 10_000, -(2**63), 0, None],
             [19, P.OP_ACQUIRE, "e", owner, 10_000, 0, 2**63, None]]
    got = [_replies(srv.port, edges) for srv in (plain, wrapped)]
    assert got[0] == got[1]
    assert all(reply[1] != 0 for reply in got[0])


def _wait_all_written(server: ServerProcess, timeout: float = 10.0) -> None:
    """Poll the server's STATUS until every record it logged is written (``timeout`` seconds at most)."""
    deadline = time.monotonic() + timeout
    while True:
        wal = server.status()["wal"]
        if wal["written_lsn"] == wal["last_lsn"]:
            return
        assert time.monotonic() < deadline, wal
        time.sleep(0.02)


@pytest.mark.parametrize("fsync", ["always", "never"])
def test_a_lease_released_in_its_grants_batch_stays_released_after_kill9(server_factory, fsync):
    """An ACQUIRE granted at once and the RELEASE of its lease read in the same batch (one write):
    the grant's record is logged before the release's, so the log replayed after kill -9 leaves
    the lock free (a release record ahead of its grant's would be skipped, and the lease held again)."""
    owner = b"0123456789abcdef"
    server = server_factory("data", fsync=fsync)
    with RawWire(server.port) as wire:
        wire.hello("order")
        wire.send([2, P.OP_ACQUIRE, "first", owner, 60_000, 0, 0, None])
        token = wire.reply()[2][0]
        # the next lock's acquire and the release of the lease it gets (the next token), in one write
        wire.send([3, P.OP_ACQUIRE, "order", owner, 60_000, 0, 0, None], [4, P.OP_RELEASE, "order", token + 1, owner],
                  [5, P.OP_HOLDER, "order"])
        replies = {r[0]: r for r in (wire.reply(), wire.reply(), wire.reply())}
        assert replies[3][1] == 0 and replies[3][2][0] == token + 1, replies
        assert replies[4] == [4, 0, None] and replies[5] == [5, 0, None], replies
    _wait_all_written(server)  # (a release's record rides on the loop turn after its reply)
    server.kill()
    again = server_factory("data", fsync=fsync)
    with RawWire(again.port) as wire:
        wire.send([1, P.OP_HELLO, P.PROTOCOL_VERSION, "order", None], [2, P.OP_HOLDER, "order"],
                  [3, P.OP_HOLDER, "first"])
        got = [wire.reply() for _ in range(3)]
    assert got[1] == [2, 0, None], got  # released, and it stays so
    assert got[2][2]["token"] == token  # (the log was replayed: the first lease is held)


def test_every_record_naming_a_lease_granted_in_its_batch_follows_the_grants_record(server_factory):
    """Records that name a lease (EXTEND, a KEY_PUT attached to it, a session's attach, a
    REVOKE_REQUEST on its holder) read in the batch that granted it: each is logged after the
    grant's record, since recovery and a standby skip such a record for a lease they do not
    hold: the longer TTL and the key acknowledged are kept through kill -9."""
    owner, waiter, session_key = b"0123456789abcdef", b"fedcba9876543210", b"s" * 16
    server = server_factory("data", fsync="always")
    with RawWire(server.port) as wire:
        wire.hello("order")
        wire.send([2, P.OP_ACQUIRE, "first", owner, 60_000, 0, 0, None], [3, OP_SESSION_OPEN, session_key, 60_000])
        replies = {r[0]: r for r in (wire.reply(), wire.reply())}
        token = replies[2][2][0]
        # each lock's acquire (its lease gets the next token) and a request naming that lease, in one write
        wire.send([4, P.OP_ACQUIRE, "ext", owner, 5_000, 0, 0, None],
                  [5, P.OP_EXTEND, "ext", token + 1, owner, 120_000],
                  [6, P.OP_ACQUIRE, "key", owner, 60_000, 0, 0, None],
                  [7, OP_KEY_PUT, "k", b"v", "key", token + 2, owner, 0],
                  [8, P.OP_ACQUIRE, "attach", owner, 60_000, 0, 0, None],
                  [9, OP_SESSION_ATTACH, session_key, [["attach", token + 3, owner]], []],
                  [10, P.OP_ACQUIRE, "asked", owner, 60_000, 0, 0, None],
                  [11, OP_ACQUIRE_PRIORITY, "asked", waiter, 60_000, -1, 0, None, False, 0, 0, 5],
                  [12, OP_REQUEST_REVOKE, "asked", waiter, 30_000])
        replies = {}
        deadline = time.monotonic() + 10
        while not all(i in replies for i in (4, 5, 6, 7, 8, 9, 10, 12)):  # (11 waits; pushes carry no such id)
            assert time.monotonic() < deadline, replies
            reply = wire.reply()
            replies.setdefault(reply[0], reply)
        assert [replies[i][1] for i in (4, 5, 6, 7, 8, 9, 10, 12)] == [0] * 8, replies
        assert replies[5][2] == 120_000 and replies[7][2] is True and replies[9][2]["attached"] == 1, replies
    _wait_all_written(server)
    server.kill()
    dump = subprocess.run([sys.executable, "-m", "fastlock.wal", "dump", "-o", "json", str(server.data_dir)],
                          capture_output=True, text=True, timeout=60, check=True)
    granted, named = set(), []
    for record in map(json.loads, dump.stdout.splitlines()):
        if "type" not in record:  # a note (the preallocated space after the last record)
            continue
        if record["type"] == "grant":
            granted.add(record["token"])
        elif record.get("token"):
            named.append(record["type"])
            assert record["token"] in granted, (record, dump.stdout)
    assert {"extend", "key_put", "revoke_request"} <= set(named), dump.stdout
    again = server_factory("data", fsync="always")
    with RawWire(again.port) as wire:
        wire.hello("after")
        wire.send([2, P.OP_HOLDER, "ext"], [3, OP_KEY_GET, "k"])
        got = {r[0]: r for r in (wire.reply(), wire.reply())}
    assert got[2][2]["token"] == token + 1 and got[2][2]["ttl_ms"] == 120_000, got  # the TTL it was told
    assert got[3][2] is not None and got[3][2]["value"] == b"v", got  # the key it was told was put
