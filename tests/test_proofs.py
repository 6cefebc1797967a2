"""No secret crosses the wire and no proof can be reflected (issue 23, item 1), against
real server processes on 127.0.0.1.

The attacker of these tests is a local process with no credentials: it can bind a
free port (a dead primary's) and connect anywhere, and it sees every byte that
reaches a listener of its own.  Each test scripts one finding of the issue and
checks that it now yields no usable credential and changes nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile

import msgpack
import pytest

import fastlock
import fastlock.auth
from fastlock import protocol as P
from fastlock._testbase import CredentialsDir, ServerProcess, TcpProxy, free_port, raw_hello_async
from fastlock._testbase.cluster import RawNode, poll, run
from fastlock.auth import derive_keys, hash_token, secret_of
from fastlock.errors import AuthError, ConnectionLost, NotPrimary, PermissionDenied
from fastlock.tokens import epoch_of

pytestmark = pytest.mark.timeout(120)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastlock", *args], capture_output=True, text=True, timeout=30,
                          cwd=tempfile.gettempdir(), env=env)


def secrets_of(token: str) -> dict[str, bytes]:
    """Every form of ``token`` that must never be on the wire."""
    secret = secret_of(token)
    keys = derive_keys(token)
    return {"token": token.encode(), "random part": token.rpartition(".")[2].encode(),
            "token hash": hash_token(token), "sha256": hashlib.sha256(token.encode()).digest(),
            "ClientKey": secret.client_key, "StoredKey": keys.stored_key, "ServerKey": keys.server_key}


def node_state(server: ServerProcess) -> dict:
    path = os.path.join(server.data_dir, "node-state.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


async def status_as(address: str, token: str | None) -> dict:
    node = await RawNode.open(address, name="status", token=token)
    try:
        return await asyncio.wait_for(node.status(), 5)
    finally:
        await node.close()


def node_id_of(server: ServerProcess) -> str:
    with open(os.path.join(server.data_dir, "node-id")) as f:
        return f.read().strip()


class Frames:
    """A raw asyncio connection that reads whole msgpack frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.unpacker = msgpack.Unpacker(raw=False)
        self.next_id = 1

    @classmethod
    async def open(cls, address: str) -> Frames:
        host, _, port = address.rpartition(":")
        return cls(*await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5))

    async def read(self, timeout: float = 5.0):
        """The next frame, or None at EOF."""
        while True:
            for msg in self.unpacker:
                return msg
            data = await asyncio.wait_for(self.reader.read(1 << 16), timeout)
            if not data:
                return None
            self.unpacker.feed(data)

    def write(self, frame) -> None:
        self.writer.write(msgpack.packb(frame, use_bin_type=True))

    async def call(self, op: int, *args):
        rid = self.next_id
        self.next_id += 1
        self.write([rid, op, *args])
        while True:
            msg = await self.read()
            if msg is None or msg[0] == rid:
                return msg

    def close(self) -> None:
        self.writer.close()


# --------------------------------------------------------------------------- nothing secret on the wire


def test_no_token_its_hash_or_its_keys_ever_cross_the_wire(tmp_path):
    """Capture every byte a client, an admin command and a standby exchange with a primary."""
    creds = CredentialsDir(tmp_path / "creds")
    relay_port = free_port()  # the recording proxy's: the primary is told it is reachable there
    primary = ServerProcess(tmp_path / "p", args=[*creds.server_args("node-1"),
                                                  "--reachable-as", f"127.0.0.1:{relay_port}"]).start()
    proxy = TcpProxy(primary.address, record_bytes=8 << 20, port=relay_port).start()
    standby = ServerProcess(tmp_path / "s", args=["--standby-of", proxy.address, *creds.server_args("node-2")])
    try:
        standby.start()
        standby.wait_for_log(r"replicating from", 10)

        async def main():
            async with fastlock.connect(proxy.address, token=creds.token("app")) as c:
                async with c.lock("wire/1", ttl=5):
                    pass

        run(main())
        res = cli("status", "--server", proxy.address, "--token-file", creds.token_file("admin"))
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["role"] == "primary"
        sent, answered = proxy.recorded()
        assert b"wire/1" in sent and b"standby:" in sent  # the capture saw all three parties
        for principal in ("app", "admin", "node-2"):
            for what, value in secrets_of(creds.token(principal)).items():
                assert value not in sent, f"{principal}'s {what} was sent"
                assert value not in answered, f"{principal}'s {what} was answered"
    finally:
        standby.stop()
        proxy.close()
        primary.stop()


def test_a_token_sent_in_clear_is_refused_and_counted_as_a_failure(tmp_path):
    creds = CredentialsDir(tmp_path / "creds")
    with ServerProcess(tmp_path / "p", args=creds.server_args("node-1")) as srv:
        async def main():
            conn = await Frames.open(srv.address)
            try:
                reply = await conn.call(P.OP_HELLO, P.PROTOCOL_VERSION, "old", creds.token("app"))
                assert reply[1] == AuthError.code and "proved, never sent" in reply[2]
                assert await conn.read() is None  # closed
            finally:
                conn.close()
            conn = await Frames.open(srv.address)
            try:
                reply = await conn.call(P.OP_HELLO, 1, "old", None)
                assert reply[1] != 0 and "protocol version 1 not supported" in reply[2]
            finally:
                conn.close()

        run(main())


# --------------------------------------------------------------------------- squatters posing as servers


class Squatter:
    """Listens on a dead server's address and records everything said to it.

    ``script(conn, first_frame)`` decides what it answers to each connection.
    """

    def __init__(self, address: str, script):
        self.host, _, port = address.rpartition(":")
        self.port = int(port)
        self.script = script
        self.frames: list = []
        self.raw = bytearray()  # bytes relayed as they came
        self.connections = 0
        self.got_one = asyncio.Event()
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> Squatter:
        self.server = await asyncio.start_server(self._serve, self.host, self.port, reuse_address=True)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader, writer) -> None:
        conn = Frames(reader, writer)
        self.connections += 1
        try:
            first = await conn.read()
            if first is None:
                return
            self.frames.append(first)
            await self.script(conn, first)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            self.got_one.set()
            writer.close()

    def said(self) -> bytes:
        return b"".join(msgpack.packb(f, use_bin_type=True) for f in self.frames)


async def relay_bytes(conn: Frames, first: list, target: str, relayed: bytearray, timeout: float = 10.0) -> None:
    """A squatter's plain byte relay of ``conn`` (whose first frame ``first`` it already
    read) to the server at ``target``; what the client sends is added to ``relayed``."""
    host, _, port = target.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(msgpack.packb(first, use_bin_type=True))

    async def pump(src, dst, from_client: bool) -> None:
        while data := await src.read(1 << 16):
            if from_client:
                relayed.extend(data)
            dst.write(data)

    pumps = [asyncio.ensure_future(pump(conn.reader, writer, True)),
             asyncio.ensure_future(pump(reader, conn.writer, False))]
    try:
        await asyncio.wait(pumps, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in pumps:
            task.cancel()
        writer.close()


async def _read_rest(conn: Frames, squatter: Squatter) -> None:
    while True:
        msg = await conn.read(2.0)
        if msg is None:
            return
        squatter.frames.append(msg)


def test_a_squatter_relaying_the_standbys_handshake_to_the_standby_gets_no_proof_and_changes_nothing(tmp_path):
    """The issue's reflection attack: the primary is SIGKILLed, a process binds its port, and
    relays the standby's reconnecting handshake to a third live primary holding the same
    credentials file, then to the standby's own listener (as is, and with the challenge
    relabelled as the dead primary's node), then answers with a poisoned epoch.
    The default pair of `credentials init`: no TLS, no extra flag."""
    cdir = tmp_path / "creds"
    res = cli("credentials", "init", str(cdir))
    assert res.returncode == 0, res.stderr
    args = ["--credentials", str(cdir / "credentials.toml")]
    primary = ServerProcess(tmp_path / "p", args=[*args, "--standby-token-file", str(cdir / "node-a.token")]).start()
    standby = ServerProcess(tmp_path / "s", args=["--standby-of", primary.address, *args,
                                                  "--standby-token-file", str(cdir / "node-b.token")])
    third = ServerProcess(tmp_path / "third", args=args)
    tokens = {n: (cdir / f"{n}.token").read_text().strip() for n in ("node-a", "node-b", "app", "admin")}
    try:
        third.start()
        standby.start()
        standby.wait_for_log(r"replicating from", 10)
        before = node_state(standby)
        primary_node = node_id_of(primary)
        primary.kill()
        relayed: list = []  # what the standby's own listener answered the squatter's relayed proofs

        async def reflect(conn: Frames, first, relabel: bool) -> None:
            own = await Frames.open(standby.address)
            try:
                # the standby's HELLO, to the standby's own listener, claiming to have dialed it
                # (else the listener refuses at once: the endpoint the standby dialed was the squatter's)
                first[4]["to"] = standby.address
                own.write(first)
                challenge = await own.read()
                if challenge is None or challenge[1] != 0:
                    return
                if relabel:  # pretend the challenge came from the dead primary's node
                    challenge[2]["challenge"]["node"] = primary_node
                conn.write([first[0], 0, challenge[2]])
                proof = await conn.read(3.0)
                if proof is None:
                    return
                own.write(proof)  # the standby's proof, back to its own listener
                answer = await own.read()
                relayed.append(answer)
                if answer is not None and answer[1] == 0:
                    conn.write([proof[0], 0, answer[2]])
                    # with a proven session the squatter would attach as the standby, window 0
                    relayed.append(await own.call(P.OP_REPLICATE, 0, None, 0, "squatter@" + primary_node))
                await _read_rest(conn, squatter)
            finally:
                own.close()

        async def relay_to_third(conn: Frames, first) -> None:
            # a plain byte relay: the standby talks to a real primary with the credentials
            first[4]["to"] = third.address  # past the third's endpoint check, to reach the node pinning
            await relay_bytes(conn, first, third.address, squatter.raw, timeout=5)

        async def poison(conn: Frames, first) -> None:
            # no challenge at all: a server "in open mode" at the highest epoch
            conn.write([first[0], 0, {"server": "fastlock", "protocol": P.PROTOCOL_VERSION, "role": "primary",
                                      "epoch": 8388607, "node": "squatter", "fenced": False}])
            await _read_rest(conn, squatter)

        scripts = [relay_to_third, lambda c, f: reflect(c, f, False), lambda c, f: reflect(c, f, True), poison]
        step = {"n": 0}

        async def script(conn: Frames, first) -> None:
            which = scripts[min(step["n"], len(scripts) - 1)]
            step["n"] += 1
            await which(conn, first)

        squatter = Squatter(primary.address, script)

        async def main():
            async with squatter:
                await poll(lambda: asyncio.sleep(0, step["n"]), lambda n: n >= 5, timeout=40,
                           what="the standby reconnecting to the squatter five times")
            # the standby refused each: its own node in the challenge, a proof its listener
            # would not give, a server without a proof
            st = await status_as(standby.address, tokens["admin"])
            assert st["role"] == "standby" and st["epoch"] == 0

        run(main(), 60)
        # the standby answered the relabelled challenge with a proof, which its own listener
        # refused: it proved nothing to the squatter, nor let it attach
        assert relayed, "the standby never answered the relabelled challenge"
        for reply in relayed:  # the proof names the dead primary's node: refused
            assert reply is None or reply[1] == AuthError.code, reply
        # nothing the squatter said was persisted: no epoch 8388607
        after = node_state(standby)
        assert after.get("max_epoch_seen", 0) == before.get("max_epoch_seen", 0) == 0
        assert standby.wait_for_log(r"could not prove", 1)
        assert standby.wait_for_log(r"not the expected node", 1)  # the relay to the third primary
        assert standby.wait_for_log(r"this node itself", 1)  # the relay to its own listener
        lost = next(i for i, line in enumerate(standby.lines) if "lost the replication connection" in line)
        assert not any("replicating from" in line for line in standby.lines[lost:])
        # and no token, no key of any principal reached the squatter
        said = squatter.said() + bytes(squatter.raw)
        for name, token in tokens.items():
            for what, value in secrets_of(token).items():
                assert value not in said, f"{name}'s {what} reached the squatter"
    finally:
        standby.stop()
        third.stop()
        primary.stop()


def test_a_squatter_gets_no_token_and_no_owner_key_from_a_client_or_an_admin(tmp_path):
    """A process on a dead server's port, answering as a server in open mode (no challenge)
    or with a made-up challenge and proof: the client and the admin command refuse it after
    HELLO, and never send their token, an acquire or an owner key."""
    creds = CredentialsDir(tmp_path / "creds")
    dead = ServerProcess(tmp_path / "dead", args=["--credentials", creds.file]).start()
    address = dead.address
    dead.kill()

    async def open_mode(conn: Frames, first) -> None:
        conn.write([first[0], 0, {"server": "fastlock", "protocol": P.PROTOCOL_VERSION, "role": "primary",
                                  "epoch": 0, "fenced": False, "session": 1}])
        await _read_rest(conn, squatter)

    async def fake_challenge(conn: Frames, first) -> None:
        conn.write([first[0], 0, {"challenge": {"nonce": os.urandom(32), "node": "squatter"}}])
        proof = await conn.read(3.0)
        if proof is not None:
            squatter.frames.append(proof)
            conn.write([proof[0], 0, {"server": "fastlock", "protocol": P.PROTOCOL_VERSION, "role": "primary",
                                      "epoch": 0, "fenced": False, "server_proof": os.urandom(32)}])
        await _read_rest(conn, squatter)

    for script in (open_mode, fake_challenge):
        squatter = Squatter(address, script)

        async def main(squatter: Squatter = squatter):
            async with squatter:
                with pytest.raises(ConnectionLost, match="proof|prove|challenge"):
                    async with fastlock.connect(address, token=creds.token("app"), connect_timeout=2) as c:
                        await c.acquire("secret/lock", ttl=5)
                res = await asyncio.to_thread(cli, "status", "--server", address, "--token-file",
                                              creds.token_file("admin"))
                assert res.returncode != 0 and re.search("proof|prove|challenge", res.stderr + res.stdout), res

        run(main(), 60)
        said = squatter.said()
        ops = {f[1] for f in squatter.frames if isinstance(f, list) and len(f) > 1}
        assert ops <= {P.OP_HELLO}, ops  # nothing but HELLO: no acquire, no owner key, no status
        assert b"secret/lock" not in said
        for name in ("app", "admin"):
            for what, value in secrets_of(creds.token(name)).items():
                assert value not in said, f"{name}'s {what} reached the squatter"


# --------------------------------------------------------------------------- the primary's side


def test_a_reattach_cannot_change_the_pairs_failover_window_and_an_unproven_epoch_changes_nothing(tmp_path):
    """Finding (b): a re-attach as the standby with failover window 0 kept the primary
    unfenced while the real standby promoted.  The window is the pairing's, fixed at the
    first pairing; and an epoch in an unauthenticated HELLO or STEP_DOWN changes nothing."""
    creds = CredentialsDir(tmp_path / "creds")
    primary = ServerProcess(tmp_path / "p", args=creds.server_args("node-1")).start()
    standby = ServerProcess(tmp_path / "s", args=["--standby-of", primary.address, "--failover-after", "3",
                                                  *creds.server_args("node-2")])
    try:
        standby.start()
        standby.wait_for_log(r"paired: primary", 10)
        node = node_id_of(standby)

        async def main():
            await poll(lambda: status_as(primary.address, creds.token("admin")),
                       lambda st: st["replication"]["paired_standby"], timeout=5, what="pairing")
            # the real standby's principal and node id, window 0: refused
            raw = await Frames.open(primary.address)
            try:
                hello = await raw_hello_async(raw.call, f"standby:{node}", creds.token("node-2"), role="replica")
                assert hello[1] == 0, hello
                reply = await raw.call(P.OP_REPLICATE, 0, None, 0, node)
                assert reply[1] == PermissionDenied.code and "cannot change it" in reply[2], reply
            finally:
                raw.close()
            # an unauthenticated peer's epochs: in HELLO (a hint) and in STEP_DOWN (refused)
            anon = await RawNode.open(primary.address, token=None, known_epoch=8388607)
            try:
                with pytest.raises(PermissionDenied):
                    await anon.request(P.OP_STEP_DOWN, 8388607, 0)
            finally:
                await anon.close()
            st = await status_as(primary.address, creds.token("admin"))
            assert st["role"] == "primary" and st["epoch"] == 0 and not st["replication"]["fenced"]
            assert st["replication"]["standbys"][0]["failover_after_ms"] == 3000

        run(main())
        assert node_state(primary).get("max_epoch_seen", 0) == 0
    finally:
        standby.stop()
        primary.stop()


def test_a_node_never_authenticates_its_own_replica_principal_nor_any_while_standby(tmp_path):
    creds = CredentialsDir(tmp_path / "creds")
    primary = ServerProcess(tmp_path / "p", args=creds.server_args("node-1")).start()
    standby = ServerProcess(tmp_path / "s", args=["--standby-of", primary.address, *creds.server_args("node-2")])
    try:
        standby.start()
        standby.wait_for_log(r"replicating from", 10)

        async def main():
            # the primary uses node-1 itself: it never proves anything for it
            with pytest.raises(AuthError, match="itself"):
                await RawNode.open(primary.address, token=creds.token("node-1"))
            # a standby authenticates no replica, not even another one
            with pytest.raises(NotPrimary, match="not primary"):
                await RawNode.open(standby.address, token=creds.token("node-3"))
            # clients and admins still reach the standby
            admin = await RawNode.open(standby.address, token=creds.token("admin"))
            try:
                assert (await admin.status())["role"] == "standby"
            finally:
                await admin.close()

        run(main())
    finally:
        standby.stop()
        primary.stop()


# --------------------------------------------------------------------------- format 1 -> 2


def test_a_format_1_credentials_file_is_refused_at_start_and_upgraded_by_the_command(tmp_path):
    d = tmp_path / "creds"
    d.mkdir(mode=0o700)
    tokens = {"app": fastlock.auth.make_token("app"), "admin": fastlock.auth.make_token("admin")}
    lines = ["version = 1"]
    for name, kind in (("app", "client"), ("admin", "admin")):
        lines += [f"[principals.{name}]", f'kind = "{kind}"', f'token_sha256 = "{hash_token(tokens[name]).hex()}"']
        if kind == "client":
            lines.append('acl = [{prefix = "", ops = ["*"]}]')
    (d / "credentials.toml").write_text("\n".join(lines) + "\n")
    refused = subprocess.run([sys.executable, "-m", "fastlock", "serve", "--listen", "127.0.0.1:0",
                              "--data-dir", str(tmp_path / "data"), "--credentials", str(d / "credentials.toml")],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and f"fastlock credentials upgrade {d}" in refused.stderr, refused.stderr
    missing = cli("credentials", "upgrade", str(d))
    assert missing.returncode != 0 and "no token file" in missing.stderr, missing
    for name, token in tokens.items():
        (d / f"{name}.token").write_text(token + "\n")
        os.chmod(d / f"{name}.token", 0o600)
    done = cli("credentials", "upgrade", str(d))
    assert done.returncode == 0 and "format 2" in done.stdout, done
    with ServerProcess(tmp_path / "data", args=["--credentials", str(d / "credentials.toml")]) as srv:
        async def main():
            async with fastlock.connect(srv.address, token=tokens["app"]) as c:  # the same token as before
                async with c.lock("upgraded", ttl=5):
                    pass

        run(main())


# --------------------------------------------------------------------------- one credential rule


def test_every_party_takes_the_token_file_before_the_secret_in_the_environment(tmp_path):
    """Finding: `fastlock run` read FASTLOCK_AUTH_SECRET before FASTLOCK_TOKEN_FILE, the reverse
    of the client's documented rule.  With both set (the secret wrong), the library, `fastlock
    run`, `fastlock status` and `fastlock locks` all present the token."""
    creds = CredentialsDir(tmp_path / "creds")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
    env.update(FASTLOCK_TOKEN_FILE=creds.token_file("admin"), FASTLOCK_AUTH_SECRET="not-the-secret")
    with ServerProcess(tmp_path / "p", args=["--credentials", creds.file]) as srv:
        env["FASTLOCK_SERVER"] = srv.address
        for argv in (["run", "rule/lock", "--ttl", "5", "--", sys.executable, "-c", "pass"],
                     ["status", "--server", srv.address], ["locks"]):
            res = cli(*argv, env=env)
            assert res.returncode == 0, (argv, res.stderr)

        async def main():
            saved = dict(os.environ)
            os.environ.update(FASTLOCK_TOKEN_FILE=env["FASTLOCK_TOKEN_FILE"], FASTLOCK_AUTH_SECRET="not-the-secret")
            try:
                async with fastlock.connect(srv.address) as c:
                    assert c.server_info["principal"] == "admin"
            finally:
                os.environ.clear()
                os.environ.update(saved)

        run(main())


def test_during_a_partition_nobody_without_the_standbys_token_keeps_the_old_primary_granting(tmp_path):
    """Finding (b) with a partition: the standby is cut off, an attacker without credentials
    tries to re-attach to the old primary as that standby with failover window 0 (with a
    made-up proof, and by asking the standby's own listener for a challenge); the old primary
    fences, the standby promotes, and the two never both grant 'ledger'.  The old primary
    has no replica credential, so it stays fenced after the promotion (it cannot rejoin the
    new primary, which would close the connections this test reads it through)."""
    from fastlock._testbase.cluster import Cluster

    cluster = Cluster(tmp_path)
    try:
        p = cluster.primary(replica_credential=False)
        px = cluster.proxy(p.address)
        s = cluster.standby(px.address, failover_after=1.5, grace=0.2)
        standby_principal = cluster.replica_of("standby")

        async def main():
            st = await poll(lambda: status_as(p.address, cluster.creds.token("admin")),
                            lambda st: st["replication"]["paired_standby"], timeout=5, what="pairing")
            node = st["replication"]["paired_standby"].rpartition("/")[2]
            px.pause()  # the partition: the real standby is cut off from the primary
            first = {"principal": standby_principal, "nonce": os.urandom(32), "role": "replica", "node": None,
                     "from": node}
            # the standby's own listener gives no challenge it could use: it is not primary
            own = await Frames.open(s.address)
            try:
                challenge = await own.call(P.OP_HELLO, P.PROTOCOL_VERSION, f"standby:{node}", first)
                assert challenge[1] == 0  # a challenge (which it cannot answer) ...
                reply = await own.call(P.OP_HELLO, P.PROTOCOL_VERSION, f"standby:{node}", {"proof": os.urandom(32)})
                assert reply[1] == AuthError.code, reply  # ... and no replica is authenticated there
            finally:
                own.close()
            attacker = await Frames.open(p.address)
            try:
                assert (await attacker.call(P.OP_HELLO, P.PROTOCOL_VERSION, f"standby:{node}", first))[1] == 0
                reply = await attacker.call(P.OP_HELLO, P.PROTOCOL_VERSION, f"standby:{node}",
                                            {"proof": os.urandom(32)})
                assert reply[1] == AuthError.code, reply
                assert await attacker.read() is None  # closed: no REPLICATE with window 0 gets through
            finally:
                attacker.close()
            await poll(lambda: status_as(p.address, cluster.creds.token("admin")),
                       lambda st: st["replication"]["fenced"], timeout=5, what="the old primary to fence itself")
            await asyncio.to_thread(s.wait_for_log, r"PROMOTED", 15)
            old = await RawNode.open(p.address, token=cluster.creds.token("app"))
            try:  # still fenced: nobody re-attached as its standby
                with pytest.raises(fastlock.Unavailable):
                    await old.acquire("ledger", 1000)
            finally:
                await old.close()
            async with fastlock.connect(s.address, token=cluster.creds.token("app"), connect_timeout=2.0) as c:
                lease = await c.acquire("ledger", ttl=5.0, wait=5.0)
                assert epoch_of(lease.fencing_token) == 1  # the new epoch: one holder, on the new primary

        run(main(), 60)
    finally:
        cluster.stop_all()


def _pair_that_fails_over(tmp_path) -> tuple[CredentialsDir, ServerProcess, ServerProcess]:
    """A primary and its paired standby (automatic failover after 1 s), from one credentials
    directory; the caller stops both."""
    creds = CredentialsDir(tmp_path / "creds")
    primary = ServerProcess(tmp_path / "p", args=creds.server_args("node-1")).start()
    standby = ServerProcess(tmp_path / "s", args=["--standby-of", primary.address, "--failover-after", "1",
                                                  *creds.server_args("node-2")])
    try:
        standby.start()
        standby.wait_for_log(r"paired: primary", 10)
    except BaseException:
        standby.stop()
        primary.stop()
        raise
    return creds, primary, standby


def test_a_client_riding_through_a_failover_refuses_a_squatter_relaying_it_to_the_new_primary(tmp_path):
    """A client that knew the primary at an address: after its kill -9 a process on that port
    relays the client's handshake, byte for byte, to the promoted standby (a real server with
    the credentials, so its proof is good).  The client expects, at that address, the node
    that proved itself there before: it refuses, and the relay sees nothing but HELLO - no
    acquire, no owner key."""
    creds, primary, standby = _pair_that_fails_over(tmp_path)
    relayed = bytearray()
    try:

        async def relay(conn: Frames, first) -> None:
            first[4]["to"] = standby.address  # past the endpoint check, to reach the node pinning
            await relay_bytes(conn, first, standby.address, relayed)

        async def main():
            async with fastlock.connect(primary.address, token=creds.token("app"), connect_timeout=2) as c:
                async with c.lock("before", ttl=5):
                    pass
                await asyncio.to_thread(primary.kill)
                squatter = Squatter(primary.address, relay)
                async with squatter:
                    await asyncio.to_thread(standby.wait_for_log, r"PROMOTED", 15)
                    with pytest.raises(ConnectionLost, match="not the expected node"):
                        await c.acquire("secret/lock", ttl=5, wait=10)
                    assert squatter.connections >= 1
            # the client stopped at the challenge: the new primary's node is not the one it knew there
            frames = [*squatter.frames, *msgpack.Unpacker(io.BytesIO(bytes(relayed)), raw=False)]
            assert frames and {m[1] for m in frames} == {P.OP_HELLO}, frames
            assert all("proof" not in m[4] for m in frames), frames  # not even a proof
            relayed.extend(squatter.said())
            assert b"secret/lock" not in relayed
            for what, value in secrets_of(creds.token("app")).items():
                assert value not in relayed, f"the app's {what} was relayed"

        run(main(), 60)
    finally:
        standby.stop()
        primary.stop()


def test_a_new_client_or_command_relayed_from_a_dead_nodes_port_gets_no_session(tmp_path):
    """The red team's relay: after the primary's kill -9 a process on its port relays, byte for
    byte, whatever connects there to the promoted standby.  A client that has never been there
    (a new process) and an admin command have no node to expect, so the proofs alone would
    pass; but the handshake binds the endpoint the client dialed, and the new primary, reached
    at another endpoint, refuses it: no session, so nothing the squatter could inject into."""
    creds, primary, standby = _pair_that_fails_over(tmp_path)
    relayed = bytearray()
    try:

        async def relay(conn: Frames, first) -> None:
            await relay_bytes(conn, first, standby.address, relayed)  # untouched: the endpoint is signed

        async def main():
            primary.kill()
            squatter = Squatter(primary.address, relay)
            async with squatter:
                await asyncio.to_thread(standby.wait_for_log, r"PROMOTED", 15)
                # a new client, given only the dead primary's address
                with pytest.raises(AuthError, match="dialed"):
                    async with fastlock.connect(primary.address, token=creds.token("app"), connect_timeout=3) as c:
                        await c.acquire("secret/lock", ttl=5, wait=0)
                # an admin command, in a process of its own
                res = await asyncio.to_thread(cli, "status", "--server", primary.address, "--token-file",
                                              creds.token_file("admin"))
                assert res.returncode != 0 and "dialed" in res.stderr, (res.returncode, res.stderr)
                assert squatter.connections >= 2
            frames = [*squatter.frames, *msgpack.Unpacker(io.BytesIO(bytes(relayed)), raw=False)]
            assert frames and {m[1] for m in frames} == {P.OP_HELLO}, frames  # nothing but the handshake
            assert b"secret/lock" not in relayed
            # the same client at the new primary's own address is served
            async with fastlock.connect(standby.address, token=creds.token("app")) as c:
                lease = await c.acquire("secret/lock", ttl=5, wait=10)
                assert lease.fencing_token > 0
            assert standby.wait_for_log(r"dialed 127\.0\.0\.1:\d+ but reached this server", 1)

        run(main(), 60)
    finally:
        standby.stop()
        primary.stop()
