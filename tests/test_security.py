"""Trust boundaries (issue 9): principals, ACLs, owner-key hashing, peer authentication,
failed-auth rate limiting, protected mode and credential hygiene.

Each finding of the security review is replayed against real ``fastlock serve``
processes and must now fail safely: refused with a clear error, and nothing on
the server changed (checked by an admin connection before and after).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import tempfile
import time

import pytest

import fastlock
from fastlock import protocol as P
from fastlock._testbase import CredentialsDir, ServerProcess, raw_hello_async
from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock._testbase.handshake import key_lines, prove_in_memory
from fastlock.auth import Credentials, CredentialsError, hash_owner
from fastlock.errors import AuthError, LeaseLost, NotPrimary, PermissionDenied, Unavailable
from fastlock.tokens import epoch_of
from fastlock.wal import Grant, decode_frames

LONG = 30_000  # ms


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastlock", *args], capture_output=True, text=True, timeout=30,
                          cwd=tempfile.gettempdir(), env=env)


class Stream:
    """A raw protocol connection that keeps every message, pushes included."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.decoder = P.FrameDecoder(64 << 20, limits=P.REPLY_LIMITS)
        self.messages: list = []
        self._next = 1

    @classmethod
    async def open(cls, address: str, token, name: str = "raw") -> Stream:
        host, _, port = address.rpartition(":")
        s = cls(*await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5))
        reply = await raw_hello_async(s.call, name, token)
        assert reply[1] == 0, reply
        return s

    async def _read_until(self, pred, timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while True:
            for m in self.messages:
                if pred(m):
                    return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching message within {timeout} s: {self.messages[-3:]}")
            data = await asyncio.wait_for(self.reader.read(65536), left)
            if not data:
                raise ConnectionError("closed")
            self.messages.extend(self.decoder.feed(data))

    async def call(self, op: int, *args):
        rid = self._next
        self._next += 1
        self.writer.write(P.packb([rid, op, *args]))
        return await self._read_until(lambda m: m[0] in (rid, 0) and (m[0] == rid or type(m[1]) is int))

    async def push(self, kind: str):
        return await self._read_until(lambda m: m[0] == 0 and m[1] == kind)

    async def close(self):
        self.writer.close()


@pytest.fixture
def creds(tmp_path):
    return CredentialsDir(tmp_path / "credentials", replicas=4, anonymous=False)


@pytest.fixture
def secured(creds, server_factory):
    """A primary that needs a token (no anonymous principal)."""
    return server_factory("secured", args=creds.server_args("node-1"))


async def _holders(address: str, admin_token: str, names) -> dict:
    node = await RawNode.open(address, token=admin_token)
    try:
        return {n: await node.holder(n) for n in names}
    finally:
        await node.close()


# --------------------------------------------------------------------------- lease theft


def test_replicate_is_refused_to_clients_and_gives_replicas_only_owner_hashes(secured, creds):
    """Finding: any client sent REPLICATE and read every holder's owner key, then released
    the victim's lease with it.  Now a client is refused; a replica gets hashes, which
    release nothing when a client presents them."""

    async def main():
        victim = await fastlock.connect(secured.address, token=creds.token("app"), client_name="victim")
        try:
            lease = await victim.acquire("orders/42", ttl=30.0)
            before = await _holders(secured.address, creds.token("admin"), ["orders/42"])
            for token in (creds.token("app"), creds.token("admin")):
                thief = await RawNode.open(secured.address, token=token)
                try:
                    with pytest.raises(PermissionDenied):
                        await thief.request(P.OP_REPLICATE, 1, None, 0, "thief@x")
                    with pytest.raises(PermissionDenied):
                        await thief.request(P.OP_REPL_ACK, 1, 1)
                finally:
                    await thief.close()
            # a replica principal: the snapshot and the stream from LSN 1 hold only the hash
            rep = await Stream.open(secured.address, creds.token("node-2"), "standby:x")
            try:
                reply = await rep.call(P.OP_REPLICATE, 0, None, 0, "x@node-x")
                assert reply[1] == 0, reply
                snap = (await rep.push("snap"))[2]
                (name, token, owner, *_), = snap[3]
                assert (name, token) == ("orders/42", lease.fencing_token)
                assert owner == hash_owner(lease.owner) and owner != lease.owner
                incarnation = reply[2]["incarnation"]
            finally:
                await rep.close()
            rep = await Stream.open(secured.address, creds.token("node-2"), "standby:x")
            try:
                reply = await rep.call(P.OP_REPLICATE, 1, incarnation, 0, "x@node-x")
                assert reply[2]["mode"] == "stream"
                first, _last, frames = (await rep.push("repl"))[2]  # the backlog: WAL frames from LSN 1
                grant = next(rec for _lsn, rec in decode_frames(frames, first) if isinstance(rec, Grant))
                assert grant.name == "orders/42" and grant.owner_hash == hash_owner(lease.owner)
                assert lease.owner not in frames
            finally:
                await rep.close()
            # a client replaying the hash: hashed again, matches nothing
            thief = await RawNode.open(secured.address, token=creds.token("app"))
            try:
                with pytest.raises(LeaseLost):
                    await thief.extend("orders/42", lease.fencing_token, owner, LONG)
                with pytest.raises(LeaseLost):
                    await thief.release("orders/42", lease.fencing_token, owner)
                assert await thief.request(P.OP_CANCEL, "orders/42", owner) is None
            finally:
                await thief.close()
            after = await _holders(secured.address, creds.token("admin"), ["orders/42"])
            assert after["orders/42"]["token"] == before["orders/42"]["token"] == lease.fencing_token
            await victim.extend(lease, ttl=30.0)  # still the victim's
            await victim.release(lease)
        finally:
            await victim.close()

    run(main())


def test_cancel_releases_a_held_lease_only_with_its_owner_key(secured, creds):
    """Finding: CANCEL(name, owner) released a held lease without proof of ownership."""

    async def main():
        async with fastlock.connect(secured.address, token=creds.token("app")) as c:
            lease = await c.acquire("jobs/1", ttl=30.0)
            other = await RawNode.open(secured.address, token=creds.token("app"))
            try:
                for wrong in (os.urandom(16), hash_owner(lease.owner), lease.owner[:-1] + b"\0"):
                    assert await other.request(P.OP_CANCEL, "jobs/1", wrong) is None
                assert (await other.holder("jobs/1"))["token"] == lease.fencing_token
                # the owner key itself is the proof: the grant that raced with a cancel is released
                assert await other.request(P.OP_CANCEL, "jobs/1", lease.owner) == "released"
                assert await other.holder("jobs/1") is None
            finally:
                await other.close()

    run(main())


# --------------------------------------------------------------------------- ACLs and kinds


def _write_acl_credentials(path, tokens: dict) -> str:
    lines = ["version = 2"]
    lines += ['[principals.orders]', 'kind = "client"', *key_lines(tokens["orders"]),
              'acl = [{prefix = "orders/", ops = ["*"]}, {prefix = "shared/", ops = ["check", "holder"]}]']
    lines += ['[principals.reader]', 'kind = "client"', *key_lines(tokens["reader"]),
              'acl = [{prefix = "", ops = ["check", "holder", "watch"]}]']
    lines += ['[principals.admin]', 'kind = "admin"', *key_lines(tokens["admin"])]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_acl_prefixes_and_operations_are_enforced(server_factory, tmp_path):
    tokens = {n: f"fl1.{n}.{os.urandom(16).hex()}" for n in ("orders", "reader", "admin")}
    srv = server_factory("acl", args=["--credentials", _write_acl_credentials(tmp_path / "c.toml", tokens)])

    async def main():
        orders = await RawNode.open(srv.address, token=tokens["orders"])
        reader = await RawNode.open(srv.address, token=tokens["reader"])
        admin = await RawNode.open(srv.address, token=tokens["admin"])
        try:
            assert orders.hello["principal"] == "orders" and orders.hello["kind"] == "client"
            token, _, owner = await orders.acquire("orders/1", LONG)
            for name in ("billing/1", "order", "shared/x"):
                with pytest.raises(PermissionDenied):
                    await orders.acquire(name, LONG)
            assert await orders.request(P.OP_CHECK, "shared/x", 1) is False  # check granted on shared/
            with pytest.raises(PermissionDenied):
                await orders.request(P.OP_WATCH, "shared/x")
            # the reader sees, never changes
            assert (await reader.holder("orders/1"))["token"] == token
            for op in (reader.acquire("orders/2", LONG), reader.release("orders/1", token, owner),
                       reader.extend("orders/1", token, owner, LONG),
                       reader.request(P.OP_CANCEL, "orders/1", owner)):
                with pytest.raises(PermissionDenied):
                    await op
            # a bad name type is a validation error, not a crash or a pass
            with pytest.raises(fastlock.InvalidArgument):
                await orders.request(P.OP_ACQUIRE, 42, os.urandom(16), LONG, 0, 0, None)
            # admins may act on every name; the holder shows who acquired it, apart from the claimed name
            info = await admin.holder("orders/1")
            assert info["token"] == token and info["principal"] == "orders" and info["client"] == "raw"
            await admin.acquire("billing/1", LONG)
            with pytest.raises(AuthError):  # no anonymous principal in this file
                await RawNode.open(srv.address, token=None)
        finally:
            for n in (orders, reader, admin):
                await n.close()

    run(main())


def test_operator_and_replica_operations_are_refused_to_others_with_no_state_change(cluster):
    """Findings: PROMOTE from a client deposed a healthy primary; SERVE_ALONE unpaired it;
    an epoch in a client's HELLO deposed it for good."""
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=2.0, grace=0.2)
    creds = cluster.creds

    async def main():
        await poll(lambda: status_of(p.address), lambda st: st["replication"]["paired_standby"], timeout=5,
                   what="pairing")
        before = (await status_of(p.address))["replication"]
        attackers = [None, creds.token("app"), creds.token(cluster.replica_of("other"))]
        for token in attackers:
            for target, op, args in ((s.address, P.OP_PROMOTE, (True,)), (p.address, P.OP_SERVE_ALONE, ()),
                                     (p.address, P.OP_PROMOTE, (True,))):
                if token == attackers[2] and target == s.address:
                    # a standby authenticates no replica principal at all (only a primary does)
                    with pytest.raises(NotPrimary, match="not primary"):
                        await RawNode.open(target, token=token, known_epoch=2**63 - 1)
                    continue
                node = await RawNode.open(target, token=token, known_epoch=2**63 - 1)
                try:
                    with pytest.raises(PermissionDenied):
                        await node.request(op, *args)
                finally:
                    await node.close()
        assert (await status_of(s.address))["role"] == "standby"
        after = await status_of(p.address)
        assert after["role"] == "primary" and after["epoch"] == 0
        assert after["replication"]["paired_standby"] == before["paired_standby"]
        assert not after["replication"]["serving_alone"]
        # clients see no replication details (who the standby is)
        anon = await RawNode.open(p.address, token=None)
        try:
            assert "paired_standby" not in (await anon.status())["replication"]
        finally:
            await anon.close()
        # the admin may
        res = await asyncio.to_thread(cli, "serve-alone", "--server", p.address)
        assert res.returncode == 0, res.stderr

    run(main())


# --------------------------------------------------------------------------- fake standby


def test_a_fake_standby_cannot_keep_the_old_primary_unfenced(cluster):
    """Finding: during a partition a fake standby attached under the real standby's node id
    (printed by STATUS) and echoed heartbeats, so the old primary kept granting while the
    real standby promoted: two holders.  Now pairing goes by the replica principal.  The
    primary has no replica credential, so it stays fenced after the promotion (it cannot
    rejoin the new primary, which would close every connection and pairing)."""
    p = cluster.primary(replica_credential=False)
    px = cluster.proxy(p.address)
    s = cluster.standby(px.address, failover_after=1.0, grace=0.2)

    async def main():
        st = await poll(lambda: status_of(p.address), lambda st: st["replication"]["paired_standby"], timeout=5,
                        what="pairing")
        paired = st["replication"]["paired_standby"]
        node_id = paired.rpartition("/")[2]
        px.pause()  # the real standby is cut off
        # a client principal cannot attach at all; another replica principal cannot take the pairing
        for token, error in ((None, PermissionDenied), (cluster.creds.token("app"), PermissionDenied),
                             (cluster.creds.token(cluster.replica_of("fake")), Unavailable)):
            fake = await RawNode.open(p.address, token=token, name="standby:fake")
            try:
                with pytest.raises(error):
                    await fake.request(P.OP_REPLICATE, 0, None, 1000, f"standby@{node_id}")
                with pytest.raises((PermissionDenied, fastlock.ProtocolError)):
                    await fake.request(P.OP_REPL_ACK, int(time.monotonic() * 1000), 1)
            finally:
                await fake.close()
        await poll(lambda: status_of(p.address), lambda st: st["replication"]["fenced"], timeout=3,
                   what="the old primary to fence itself")
        await asyncio.to_thread(s.wait_for_log, r"PROMOTED", 10)
        # never two holders: the old primary refuses, the new one grants (after its grace)
        old = await RawNode.open(p.address, token=None)
        try:
            with pytest.raises(Unavailable):
                await old.acquire("ledger", 1000)
        finally:
            await old.close()
        async with fastlock.connect(s.address, connect_timeout=2.0) as c:
            lease = await c.acquire("ledger", ttl=5.0, wait=5.0)
            assert epoch_of(lease.fencing_token) == 1  # the new epoch
        st = await status_of(p.address)
        assert st["role"] == "primary" and st["replication"]["fenced"], st
        assert st["replication"]["paired_standby"] == paired  # the fake never paired

    run(main())


def test_a_standby_refuses_a_primary_that_cannot_prove_itself(tmp_path):
    """The primary authenticates to the standby too: a server holding a different credentials
    file (same principal names, other keys) gets no token and feeds no snapshot."""
    real = CredentialsDir(tmp_path / "real")
    impostor_creds = CredentialsDir(tmp_path / "impostor")
    impostor = ServerProcess(tmp_path / "impostor-data", args=impostor_creds.server_args("node-1")).start()
    standby = ServerProcess(tmp_path / "standby", args=["--standby-of", impostor.address,
                                                        *real.server_args("node-2")])
    try:
        standby.start()
        standby.wait_for_log(r"not following .* could not prove", 10)
        assert not any("applied snapshot" in line for line in standby.lines)
        # it proved its token without sending it: the impostor never saw the token
        assert not any(real.token("node-2") in line for line in impostor.lines)
    finally:
        standby.stop()
        impostor.stop()


# --------------------------------------------------------------------------- failed authentication


def test_failed_authentications_are_rate_limited_and_logged_without_flooding(secured, creds):
    async def main():
        async def hello(token):
            node = await RawNode.open(secured.address, token=token)
            await node.close()

        for _ in range(5):
            with pytest.raises(AuthError, match="authentication failed"):
                await hello("fl1.app.wrong")
        # banned: even the right token is refused, without being checked
        with pytest.raises(AuthError, match="too many failed"):
            await hello(creds.token("app"))
        # many more attempts: each refused, and the log does not grow with them
        for _ in range(200):
            with pytest.raises(AuthError):
                await hello("fl1.app.wrong")
        auth_lines = [ln for ln in secured.lines if "authentic" in ln or "banned" in ln]
        assert len(auth_lines) <= 6, auth_lines
        assert sum("authentication failed from 127.0.0.1" in ln for ln in auth_lines) == 1
        assert any("banned for" in ln for ln in auth_lines)
        # the ban ends (it doubles per ban, up to 300 s; the first ones here are 1-8 s)
        deadline = time.monotonic() + 20
        while True:
            try:
                await hello(creds.token("app"))
                break
            except AuthError:
                assert time.monotonic() < deadline, "still banned after 20 s"
                await asyncio.sleep(0.25)

    run(main(), timeout=60)


# --------------------------------------------------------------------------- hygiene


def test_protected_mode_refuses_a_public_address_without_credentials(tmp_path):
    out = cli("serve", "--listen", "0.0.0.0:0", "--data-dir", str(tmp_path / "d"))
    assert out.returncode == 1
    assert "refusing to listen on 0.0.0.0 without credentials" in out.stderr
    assert "--allow-unauthenticated" in out.stderr
    assert not (tmp_path / "d").exists() or not any(n.startswith("wal-") for n in os.listdir(tmp_path / "d"))


@pytest.mark.parametrize("flag", ["--auth-secret-file", "--standby-token-file", "--credentials"])
def test_an_empty_secret_or_token_file_is_refused_at_start(tmp_path, flag):
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    out = cli("serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"), flag, str(empty))
    assert out.returncode == 1, out.stderr
    assert "empty" in out.stderr or "no [principals" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    env = dict(os.environ, FASTLOCK_AUTH_SECRET="")
    out = cli("serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"), env=env)
    assert out.returncode == 1 and "FASTLOCK_AUTH_SECRET is set but empty" in out.stderr
    with pytest.raises(CredentialsError, match="empty"):
        fastlock.connect("127.0.0.1:1", token_file=str(empty))


def test_credentials_init_makes_private_files_that_load(tmp_path):
    d = tmp_path / "creds"
    out = cli("credentials", "init", str(d), "--client", "orders=orders/", "--client", "ops", "--replica", "a",
              "--replica", "b", "--admin", "root")
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    names = sorted(os.listdir(d))
    assert names == ["a.token", "b.token", "credentials.toml", "ops.token", "orders.token", "root.token"]
    for n in names:
        assert stat.S_IMODE(os.stat(d / n).st_mode) == 0o600
    loaded = Credentials.load(d / "credentials.toml")
    token = (d / "orders.token").read_text().strip()
    assert token not in (d / "credentials.toml").read_text()
    p = prove_in_memory(loaded, token)
    assert p.name == "orders" and p.allows("acquire", "orders/1") and not p.allows("acquire", "billing")
    assert prove_in_memory(loaded, token[:-1] + ("A" if token[-1] != "A" else "B")) is None
    again = cli("credentials", "init", str(d))
    assert again.returncode == 1 and "not overwriting" in again.stderr


def test_fastlock_run_keeps_credentials_out_of_the_command_environment(secured, creds):
    show = [sys.executable, "-c", "import os; print(os.environ.get('FASTLOCK_TOKEN_FILE', 'unset'))"]
    env = dict(os.environ, FASTLOCK_TOKEN_FILE=creds.token_file("app"))
    out = cli("run", "job", "--server", secured.address, "--", *show, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "unset"
    out = cli("run", "job", "--server", secured.address, "--pass-credentials", "--", *show, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == creds.token_file("app")
    # and without a token the secured server refuses it
    out = cli("run", "job", "--server", secured.address, "--", *show, env={k: v for k, v in env.items()
                                                                         if k != "FASTLOCK_TOKEN_FILE"})
    assert out.returncode == 77 and "authentication failed" in out.stderr


def test_the_sync_client_and_the_cli_present_tokens(secured, creds):
    from fastlock.sync import SyncClient

    with SyncClient(secured.address, token_file=creds.token_file("app")) as c:
        lease = c.acquire("sync/1", ttl=5.0)
        c.release(lease)
    out = cli("status", "--server", secured.address, "--token-file", creds.token_file("admin"))
    assert out.returncode == 0, out.stderr
    assert "paired_standby" in json.loads(out.stdout)["replication"]
    out = cli("serve-alone", "--server", secured.address, "--token-file", creds.token_file("app"))
    assert out.returncode == 1 and "serve_alone needs an admin principal; 'app' is a client" in out.stderr


# --------------------------------------------------------------------------- mutual TLS principals


def test_mutual_tls_certificates_authenticate_principals(tmp_path, server_factory):
    """With mutual TLS a verified certificate's CN maps to a principal (``cert_identities``),
    as etcd's --client-cert-auth with the CN as user: a client and a standby need no token."""
    trustme = pytest.importorskip("trustme")
    from fastlock.auth import generate

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))

    def issue(cn, *names):
        leaf = ca.issue_cert(*(names or (cn,)), common_name=cn)
        leaf.cert_chain_pems[0].write_to_path(str(tmp_path / f"{cn}.pem"))
        leaf.private_key_pem.write_to_path(str(tmp_path / f"{cn}-key.pem"))
        return {"tls_cert": str(tmp_path / f"{cn}.pem"), "tls_key": str(tmp_path / f"{cn}-key.pem")}

    node1, node2 = issue("node1", "127.0.0.1"), issue("node2", "127.0.0.1")
    billing, admin, nobody = issue("billing"), issue("admin"), issue("nobody")
    generate(tmp_path / "creds", clients=[("billing", "billing/")], replicas=["node-1", "node-2"], admins=["admin"],
             cert_identities={"billing": ["billing"], "node-2": ["node2"], "admin": ["admin"]})
    tls = ["--tls-ca", str(tmp_path / "ca.pem"), "--tls-client-auth", "required",
           "--credentials", str(tmp_path / "creds" / "credentials.toml")]
    p = server_factory("p", args=["--tls-cert", node1["tls_cert"], "--tls-key", node1["tls_key"], *tls])
    s = server_factory("s", args=["--tls-cert", node2["tls_cert"], "--tls-key", node2["tls_key"], *tls,
                                  "--standby-of", p.address])  # no token: its certificate is its credential
    s.wait_for_log(r"replicating from", 10)
    ca_file = str(tmp_path / "ca.pem")

    async def main():
        async with fastlock.connect(p.address, tls_ca=ca_file, **billing) as c:
            assert c.server_info["principal"] == "billing" and c.server_info["kind"] == "client"
            lease = await c.acquire("billing/1", ttl=10.0)
            with pytest.raises(PermissionDenied):
                await c.acquire("orders/1", ttl=10.0)
            await c.release(lease)
        async with fastlock.connect(p.address, tls_ca=ca_file, **admin) as c:
            st = await poll(c.status, lambda st: st["replication"]["paired_standby"], timeout=5, what="pairing")
            # paired by the principal its certificate maps to
            assert st["replication"]["paired_standby"].rpartition("@")[2].startswith("node-2/")
        with pytest.raises(AuthError, match="anonymous"):  # a valid certificate that maps to no principal
            await fastlock.connect(p.address, tls_ca=ca_file, connect_timeout=2.0, **nobody)

    run(main())


def test_per_principal_quotas_count_authenticated_principals(server_factory, tmp_path):
    """The limits' per-principal quotas key on the authenticated principal (conn.principal),
    not on the self-declared client name."""
    from fastlock.auth import generate
    from fastlock.errors import LimitExceeded

    paths = generate(tmp_path / "creds", clients=[("team-a", ""), ("team-b", "")], replicas=[], admins=["admin"])
    srv = server_factory("quota", args=["--credentials", str(tmp_path / "creds" / "credentials.toml"),
                                        "--max-leases-per-principal", "1"])

    async def main():
        a1 = await fastlock.connect(srv.address, token_file=paths["team-a"], client_name="same-name")
        a2 = await fastlock.connect(srv.address, token_file=paths["team-a"], client_name="other-name")
        b = await fastlock.connect(srv.address, token_file=paths["team-b"], client_name="same-name")
        try:
            await a1.acquire("q/1", ttl=10.0)
            with pytest.raises(LimitExceeded, match="team-a"):  # the principal's quota, over its connections
                await a2.acquire("q/2", ttl=10.0)
            await b.acquire("q/3", ttl=10.0)  # another principal, whatever name it claims
        finally:
            for c in (a1, a2, b):
                await c.close()

    run(main())


# --------------------------------------------------------------------------- what STATUS tells a client


def _strings(value) -> list[str]:
    """Every str in a STATUS reply, keys included."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def test_status_shows_clients_no_path_no_peer_and_no_error_text(cluster):
    """Finding: STATUS showed every client the data directory path.  A client principal (the app,
    or anonymous) sees counters and role but no path on the server, nothing of who the standby
    is, no task error text; an admin sees all of it."""
    from fastlock.server.statusview import CLIENT_REPLICATION_FIELDS

    p = cluster.primary()
    s = cluster.standby(p.address)
    creds = cluster.creds

    async def main():
        await poll(lambda: status_of(p.address), lambda st: st["replication"]["standbys"], timeout=10,
                   what="the standby attached")
        for node in (p, s):
            full = await status_of(node.address)  # the cluster's admin
            assert full["wal"]["active_segment"].startswith(str(node.data_dir.resolve()))
            assert "last_error" in full["tasks"]
            for token in (creds.token("app"), None):
                raw = await RawNode.open(node.address, token=token)
                try:
                    seen = await raw.status()
                finally:
                    await raw.close()
                assert raw.hello["kind"] == "client"
                leaks = [text for text in _strings(seen) if str(cluster.root) in text or "/" in text]
                assert leaks == [], leaks
                assert seen["wal"]["active_segment"] == os.path.basename(full["wal"]["active_segment"])
                assert "last_error" not in seen["tasks"]
                assert set(seen["replication"]) <= CLIENT_REPLICATION_FIELDS
                assert seen["role"] == full["role"] and seen["epoch"] == full["epoch"]
                assert seen["locks_held"] == full["locks_held"]
        standby_view = (await status_of(s.address))["replication"]
        assert "pair_confirmed" in standby_view and "failover_after_ms" in standby_view

    run(main())


def test_client_status_keeps_only_plain_values_of_known_sections():
    """Unit: a section STATUS gains later (per-principal usage, the coordinator's URL) stays
    hidden from clients until it is listed; nested maps and lists inside a listed section too."""
    from fastlock.server.statusview import client_status

    status = {
        "role": "primary", "epoch": 3, "locks_held": 2,
        "wal": {"active_segment": "/srv/data/wal-00000000000000000001.log", "last_lsn": 9},
        "tasks": {"running": 1, "failed": 1, "last_error": "open('/srv/data/x'): denied"},
        "limits": {"connections": 4, "principals": {"billing": {"leases": 1}}},
        "coordinator": {"url": "etcd://127.0.0.1:2379/fl", "node": "n1"},
        "replication": {"fenced": False, "serving_alone": False, "standbys": [{"name": "node-2"}],
                        "paired_standby": "node-2", "sync": {"in_sync": True}},
        "sessions_by_principal": {"billing": 3},
    }
    view = client_status(status)
    assert view == {
        "role": "primary", "epoch": 3, "locks_held": 2,
        "wal": {"active_segment": "wal-00000000000000000001.log", "last_lsn": 9},
        "tasks": {"running": 1, "failed": 1},
        "limits": {"connections": 4},
        "replication": {"fenced": False, "serving_alone": False},
    }
    assert status["wal"]["active_segment"].startswith("/srv/")  # the input is not changed
