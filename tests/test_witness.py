"""The witness (``fastlock witness``, ``serve --witness``): a pair that fails over by itself
and keeps granting when its standby dies.

- the witness's rule, on a fake clock: one holder per epoch, a higher epoch only once the
  lease below has expired, the vote fsynced and held for a whole lease after a restart,
  bad arguments refused without a change;
- its handshake: a replica principal proves its token (never sent); a client or admin
  principal, a wrong proof, or a request before HELLO is refused;
- real processes (SIGKILL): the standby killed -> the primary keeps granting past its
  standby fence; the primary killed -> the standby promotes with the witness's lease;
  the primary|standby link cut with the witness reachable -> no promotion, the primary
  keeps granting; the witness dead -> the pair keeps serving, the standby says it cannot
  be promoted and, the primary killed, does not promote.

Every wait has a deadline; processes are stopped by PID (the ``cluster`` fixture).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from fastlock import protocol as P
from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock._testbase.proxy import TcpProxy, free_port
from fastlock._testbase.servers import WitnessProcess
from fastlock.auth import ClientHandshake, Credentials, say_hello, secret_of
from fastlock.errors import (
    AuthError,
    ConnectionLost,
    InvalidArgument,
    LockNotAcquired,
    NotPrimary,
    ProtocolError,
    Unavailable,
)
from fastlock.protocol import rpc
from fastlock.replication.witness import (
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_ADDRESS,
    OP_WITNESS_LEASE,
    Witness,
    read_vote,
)

FAILOVER = 1.0  # --failover-after, seconds


class Clock:
    def __init__(self) -> None:
        self.now = 1_000

    def __call__(self) -> int:
        return self.now


# -- the rule ---------------------------------------------------------------------------------

def test_one_holder_per_epoch_and_a_higher_epoch_only_after_the_lease_expired(tmp_path):
    clock = Clock()
    w = Witness(str(tmp_path), Credentials.open_mode(), clock=clock)
    assert w.lease("r1/a", 1, 1000)["granted"]
    assert read_vote(str(tmp_path)).holder == "r1/a"  # on disk before the answer
    refused = w.lease("r2/b", 2, 1000)
    assert not refused["granted"] and refused["epoch"] == 1 and refused["remaining_ms"] == 1000
    assert not w.lease("r2/b", 1, 1000)["granted"]  # never a second holder of epoch 1
    clock.now += 600
    assert w.lease("r1/a", 1, 1000)["granted"]  # renewed: 1000 ms from now
    clock.now += 999
    assert not w.lease("r2/b", 2, 1000)["granted"]
    clock.now += 1
    assert w.lease("r2/b", 2, 1000)["granted"]
    assert not w.lease("r1/a", 1, 1000)["granted"]  # superseded
    assert read_vote(str(tmp_path)).epoch == 2


def test_a_restarted_witness_holds_its_vote_for_a_whole_lease(tmp_path):
    clock = Clock()
    w = Witness(str(tmp_path), Credentials.open_mode(), clock=clock)
    assert w.lease("r1/a", 3, 2000)["granted"]
    again = Witness(str(tmp_path), Credentials.open_mode(), clock=clock)
    assert not again.lease("r2/b", 4, 1000)["granted"]
    clock.now += 2000
    assert again.lease("r2/b", 4, 1000)["granted"]


def test_an_out_of_sync_word_is_kept_and_handed_to_the_next_vote(tmp_path):
    clock = Clock()
    w = Witness(str(tmp_path), Credentials.open_mode(), clock=clock)
    assert w.lease("r1/a", 1, 1000)["out_of_sync"] is False
    assert w.lease("r1/a", 1, 1000, True)["out_of_sync"] is True
    assert read_vote(str(tmp_path)).out_of_sync  # on disk before the answer
    clock.now += 1000
    vote = w.lease("r2/b", 2, 1000)
    assert vote["granted"] and vote["previous_out_of_sync"] and not vote["out_of_sync"]
    assert Witness(str(tmp_path), Credentials.open_mode(), clock=clock).lease("r2/b", 2, 1000)["previous_out_of_sync"]


@pytest.mark.parametrize("epoch, lease_ms", [(-1, 1000), ("1", 1000), (1, 99), (1, 600_001), (1, 1.5), (2**63, 1000)])
def test_bad_arguments_are_refused_and_change_nothing(tmp_path, epoch, lease_ms):
    w = Witness(str(tmp_path), Credentials.open_mode(), clock=Clock())
    with pytest.raises(InvalidArgument):
        w.lease("r1/a", epoch, lease_ms)
    assert w.vote.epoch == 0 and w.vote.holder is None
    with pytest.raises(InvalidArgument):
        w.lease("r1/a", 1, 1000, 1)  # out_of_sync is a bool
    assert w.vote.epoch == 0


# -- the handshake ----------------------------------------------------------------------------

@pytest.fixture
def witness(cluster, tmp_path):
    w = WitnessProcess(tmp_path / "witness", cluster.creds.file)
    cluster.servers.append(w)  # stopped with the cluster
    return w.start()


async def _open(witness, token: str | None, node: str = "n1", port: int | None = None) -> rpc.RpcConnection:
    conn = await rpc.open_connection("127.0.0.1", port or witness.port, timeout=5)
    handshake = ClientHandshake(secret_of(token) if token else None, role="replica" if token else None,
                                own_node=node)
    try:
        await asyncio.wait_for(say_hello(conn, "test", handshake), 5)
    except BaseException:
        conn.close()
        raise
    return conn


def test_only_a_replica_principal_that_proves_its_token_is_served(cluster, witness):
    async def main():
        conn = await _open(witness, cluster.creds.token("node-1"))
        try:
            answer = await conn.request(OP_WITNESS_LEASE, 5, 1000)
            assert answer["granted"] and answer["holder"] == "node-1/n1"
            with pytest.raises(InvalidArgument):
                await conn.request(OP_WITNESS_LEASE, 6, 10)
        finally:
            conn.close()
        for principal in ("app", "admin"):
            with pytest.raises((AuthError, ConnectionLost)):
                conn = await _open(witness, cluster.creds.token(principal))
                conn.close()
        with pytest.raises((AuthError, ConnectionLost)):
            await _open(witness, None)  # no token: nothing to prove
        raw = await rpc.open_connection("127.0.0.1", witness.port, timeout=5)
        try:
            with pytest.raises((ProtocolError, ConnectionLost)):
                await asyncio.wait_for(raw.request(OP_WITNESS_LEASE, 7, 1000), 5)
        finally:
            raw.close()
        st = await _status(witness, cluster.creds.token("node-2"))
        assert st["epoch"] == 5 and st["holder"] == "node-1/n1"  # nothing else changed the vote

    run(main())


async def _status(witness, token: str) -> dict:
    conn = await _open(witness, token, node="probe")
    try:
        return await conn.request(P.OP_STATUS)
    finally:
        conn.close()


async def _flood(port: int, source: str, stop: asyncio.Event, opened: list[int]) -> None:
    """Hold a connection to the witness from ``source`` that never says HELLO; open
    another each time the witness closes it, until ``stop`` (at most 500 times)."""
    for _ in range(500):
        if stop.is_set():
            return
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(0.01)
            continue
        opened[0] += 1
        try:
            read = asyncio.ensure_future(reader.read(1))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([read, stopped], return_when=asyncio.FIRST_COMPLETED)
            read.cancel()
            stopped.cancel()
        finally:
            writer.close()


def test_a_flood_of_unauthenticated_connections_never_keeps_a_node_out(cluster, witness):
    async def main():
        proved = await _open(witness, cluster.creds.token("node-1"))  # in before the flood
        stop = asyncio.Event()
        opened = [0]
        sources = [f"127.0.0.{2 + i // MAX_CONNECTIONS_PER_ADDRESS}"
                   for i in range(MAX_CONNECTIONS + 2 * MAX_CONNECTIONS_PER_ADDRESS)]  # from 6 addresses
        flood = [asyncio.ensure_future(_flood(witness.port, src, stop, opened)) for src in sources]
        try:
            async def count() -> int:
                return opened[0]
            await poll(count, lambda n: n >= len(sources), timeout=20, what="the flood's connections")
            for _ in range(5):  # the nodes get in while the flood goes on
                st = await _status(witness, cluster.creds.token("node-2"))
                assert st["server"] == "fastlock-witness"
            assert (await proved.request(OP_WITNESS_LEASE, 3, 1000))["granted"]  # a proved node stays in
        finally:
            stop.set()
            await asyncio.gather(*flood)
            proved.close()

    run(main())


def test_a_relayed_node_is_refused_unless_the_witness_is_reachable_as_the_relay(cluster, witness, tmp_path):
    port = free_port()
    behind = WitnessProcess(tmp_path / "behind", cluster.creds.file, args=["--reachable-as", f"127.0.0.1:{port}"])
    cluster.servers.append(behind)
    behind.start()
    to_behind = TcpProxy(behind.address, port=port).start()
    to_plain = TcpProxy(witness.address).start()
    cluster.proxies += [to_behind, to_plain]

    async def main():
        conn = await _open(behind, cluster.creds.token("node-1"), port=to_behind.port)
        try:
            assert (await conn.request(P.OP_STATUS))["server"] == "fastlock-witness"
        finally:
            conn.close()
        with pytest.raises(AuthError, match="dialed"):
            await _open(witness, cluster.creds.token("node-1"), port=to_plain.port)

    run(main())


# -- a pair with a witness (real processes) ----------------------------------------------------

def _pair(cluster, witness, *, through_proxy: bool = False, args: tuple[str, ...] = ()):
    a = cluster.primary("a", args=["--witness", witness.address, *args])
    target = cluster.proxy(a.address).address if through_proxy else a.address
    b = cluster.standby(target, "b", failover_after=FAILOVER, args=["--witness", witness.address, *args])
    a.wait_for_log(r"holding its lease for epoch", 10)
    return a, b


async def grant_now(node: RawNode, name: str, ttl_ms: int = 30_000) -> int:
    """A grant without waiting (a lease of ``ttl_ms`` milliseconds): the primary is not fenced."""
    token, _, _ = await asyncio.wait_for(node.acquire(name, ttl_ms), 5)
    return token


async def grant(address: str, name: str, timeout: float = 20, ttl_ms: int = 30_000) -> int:
    """A grant of ``name`` (a lease of ``ttl_ms`` milliseconds), retried until ``timeout`` seconds."""
    node = await RawNode.open(address)
    try:
        async def attempt():
            try:
                return await grant_now(node, name, ttl_ms)
            except (LockNotAcquired, Unavailable, NotPrimary, asyncio.TimeoutError):
                return None

        return await poll(attempt, lambda t: t is not None, timeout=timeout, what=f"a grant of {name!r}")
    finally:
        await node.close()


async def keeps_granting(address: str, prefix: str, seconds: float) -> int:
    """Grant a new lock every 50 ms for ``seconds`` (bounded in count too); each must succeed at once."""
    node = await RawNode.open(address)
    try:
        end = time.monotonic() + seconds
        count = 0
        while time.monotonic() < end and count < 400:
            await grant_now(node, f"{prefix}/{count}")
            count += 1
            await asyncio.sleep(0.05)
        return count
    finally:
        await node.close()


def test_standby_killed_primary_keeps_granting(cluster, witness):
    a, b = _pair(cluster, witness)

    async def main():
        b.kill()
        # three failover windows: the standby fence alone would have closed after 0.75 s
        assert await keeps_granting(a.address, "alone", 3 * FAILOVER) > 0
        st = await status_of(a.address)
        assert st["role"] == "primary" and not st["replication"]["fenced"]
        assert st["replication"]["witness"]["reachable"]
        assert not any("no word from the standby" in line for line in a.lines)

    run(main())


def test_primary_killed_standby_promotes_with_the_witness_lease(cluster, witness):
    a, b = _pair(cluster, witness)

    async def main():
        # the longest TTL the standby has seen, so its promotion grace (an async pair): 5 s
        before = await grant(a.address, "before", ttl_ms=5_000)
        a.kill()
        await asyncio.to_thread(b.wait_for_log, r"PROMOTED to primary", 20)
        assert any("granted this node the lease of epoch" in line for line in b.lines)
        after = await grant(b.address, "after", timeout=40)  # after the grace period
        assert after > before
        st = await _status(witness, cluster.creds.token("node-8"))
        assert st["epoch"] == after >> 40 and st["holder"].startswith(cluster.replica_of("b") + "/")

    run(main())


def test_partition_between_the_pair_with_the_witness_reachable_no_promotion(cluster, witness):
    a, b = _pair(cluster, witness, through_proxy=True)
    link = cluster.proxies[0]

    async def main():
        link.blackhole()
        await asyncio.to_thread(b.wait_for_log, r"did not grant the lease of epoch", 30)
        assert await keeps_granting(a.address, "cut", 1.0) > 0
        assert not any("PROMOTED" in line for line in b.lines)
        assert (await status_of(b.address))["role"] in ("standby", "promoting")
        assert (await status_of(a.address))["role"] == "primary"
        link.heal()
        await poll(lambda: status_of(b.address), lambda s: s["role"] == "standby" and s["replication"]["synced"],
                   timeout=20, what="the standby following again")
        assert not any("PROMOTED" in line for line in b.lines)

    run(main())


def test_witness_dead_pair_keeps_serving_and_cannot_promote(cluster, witness):
    a, b = _pair(cluster, witness)

    async def main():
        witness.kill()
        st = await poll(lambda: status_of(b.address), lambda s: s["replication"]["witness"]["reachable"] is False,
                        timeout=10, what="the standby saying the witness is unreachable")
        assert st["replication"]["witness"]["automatic_promotion"].startswith("impossible")
        assert await keeps_granting(a.address, "no-witness", 1.0) > 0  # the standby is heard
        a.kill()
        await asyncio.to_thread(b.wait_for_log, r"did not grant the lease of epoch", 30)
        st = await status_of(b.address)
        assert st["role"] in ("standby", "promoting") and not any("PROMOTED" in line for line in b.lines)

    run(main())


SYNC = ("--replication", "sync", "--sync-timeout", "0.5")


def test_sync_pair_standby_killed_primary_keeps_granting(cluster, witness):
    a, b = _pair(cluster, witness, args=SYNC)

    async def main():
        await poll(lambda: status_of(a.address), lambda st: st["replication"]["sync"]["state"] == "in_sync",
                   timeout=10, what="in sync")
        b.kill()
        # the degrade cannot be heard by a dead standby: the witness records it instead
        await grant(a.address, "degraded")
        await asyncio.to_thread(a.wait_for_log, r"the witness recorded that the standby is no longer in sync", 10)
        assert await keeps_granting(a.address, "alone", 3 * FAILOVER) > 0
        st = await status_of(a.address)
        assert st["replication"]["sync"]["state"] == "degraded" and not st["replication"]["fenced"]

    run(main())


def test_sync_pair_cut_then_primary_killed_promotes_with_a_grace(cluster, witness):
    """Grants the primary acknowledged without its (cut off) standby: the witness tells the
    promoted node, which takes the grace period instead of promoting without one."""
    a, b = _pair(cluster, witness, through_proxy=True, args=SYNC)
    link = cluster.proxies[0]

    async def main():
        await poll(lambda: status_of(a.address), lambda st: st["replication"]["sync"]["state"] == "in_sync",
                   timeout=10, what="in sync")
        await grant(a.address, "before")  # the standby learns the longest TTL (its default grace)
        link.blackhole()
        await grant(a.address, "acknowledged-alone")
        await asyncio.to_thread(a.wait_for_log, r"the witness recorded that the standby is no longer in sync", 10)
        a.kill()
        line = await asyncio.to_thread(b.wait_for_log, r"PROMOTED to primary", 30)
        assert "no new grants for 0 ms" not in line, line
        assert any("the witness says the old primary acknowledged grants without its standby" in x for x in b.lines)

    run(main())


def test_a_standby_without_the_witness_gets_no_witness_lease_on_the_primary(cluster, witness):
    """The standby would promote without asking the witness: the primary's witness lease
    proves nothing then, so a dead standby fences it as in a pair without a witness."""
    a = cluster.primary("a", args=["--witness", witness.address])
    b = cluster.standby(a.address, "b", failover_after=FAILOVER)
    a.wait_for_log(r"holding its lease for epoch", 10)

    async def main():
        st = await status_of(a.address)
        assert st["replication"]["paired_standby_witness"] is None
        b.kill()
        await asyncio.to_thread(a.wait_for_log, r"no word from the standby", 10)
        node = await RawNode.open(a.address)
        try:
            with pytest.raises(Unavailable):
                await grant_now(node, "fenced")
        finally:
            await node.close()

    run(main())


# -- a witness that restarts (kill -9) ---------------------------------------------------------

def _restart(cluster, witness) -> WitnessProcess:
    """The same witness again after a kill -9: its data directory, on its port (the pair names it)."""
    again = WitnessProcess(witness.data_dir, cluster.creds.file, port=witness.port, args=witness.args[2:])
    cluster.servers.append(again)
    return again.start()


def test_a_witness_killed_and_restarted_is_used_again(cluster, witness):
    """kill -9 of the witness: the pair keeps serving (its standby is heard); restarted on
    its data directory, the primary holds its lease again, and a standby killed then
    leaves the primary granting on the restarted witness's lease alone."""
    a, b = _pair(cluster, witness)

    async def main():
        epoch = (await status_of(a.address))["epoch"]
        witness.kill()
        await asyncio.to_thread(a.wait_for_log, r"witness .* unreachable", 10)
        assert await keeps_granting(a.address, "witness-down", 1.0) > 0
        held_before = sum("holding its lease for epoch" in line for line in a.lines)
        again = _restart(cluster, witness)
        assert f"vote: epoch {epoch}," in again.wait_for_log(r"vote: epoch", 10)  # kept on disk
        await poll(lambda: asyncio.sleep(0, sum("holding its lease for epoch" in line for line in a.lines)),
                   lambda n: n > held_before, timeout=15, what="the primary holding the restarted witness's lease")
        await poll(lambda: status_of(b.address), lambda s: s["replication"]["witness"]["reachable"] is True,
                   timeout=10, what="the standby reaching the restarted witness")
        b.kill()
        # three failover windows: the standby fence alone would have closed after 0.75 s
        assert await keeps_granting(a.address, "alone", 3 * FAILOVER) > 0
        st = await status_of(a.address)
        assert st["role"] == "primary" and not st["replication"]["fenced"]

    run(main())


def test_a_restarted_witness_never_votes_a_second_node_into_an_epoch_it_gave(cluster, witness):
    """The standby paused and the primary killed; another replica node takes the witness's
    vote for the next epoch (as a standby promoting would) and is never heard from again; the
    witness is killed (kill -9) between that vote and any promotion, and restarted.  The
    pair's standby, resumed, asks for the same epoch: refused (one holder per epoch, ever,
    across the restart), so it does not promote; the node voted in keeps its epoch."""
    a, b = _pair(cluster, witness)
    voter = cluster.creds.token("node-7")

    async def main():
        epoch = (await status_of(a.address))["epoch"]
        b.pause()  # the vote below goes to the test's node, not to a racing promotion of b
        a.kill()
        conn = await _open(witness, voter, node="elsewhere")
        try:
            async def take():
                return await conn.request(OP_WITNESS_LEASE, epoch + 1, 60_000)

            # granted once the killed primary's lease of `epoch` has expired on the witness
            got = await poll(take, lambda r: r["granted"], timeout=20, what="the vote for the next epoch")
            assert got["holder"] == "node-7/elsewhere"
        finally:
            conn.close()
        witness.kill()  # after the vote (fsynced before the answer), before any promotion
        again = _restart(cluster, witness)
        assert read_vote(str(witness.data_dir)).holder == "node-7/elsewhere"
        b.resume()
        line = await asyncio.to_thread(b.wait_for_log, rf"did not grant the lease of epoch {epoch + 1}", 30)
        assert "node-7/elsewhere" in line, line
        st = await status_of(b.address)
        assert st["role"] in ("standby", "promoting") and not any("PROMOTED" in x for x in b.lines)
        conn = await _open(again, voter, node="elsewhere")
        try:  # the node voted in still holds its epoch on the restarted witness
            renewed = await conn.request(OP_WITNESS_LEASE, epoch + 1, 60_000)
        finally:
            conn.close()
        assert renewed["granted"] and renewed["epoch"] == epoch + 1 and renewed["holder"] == "node-7/elsewhere"

    run(main(), timeout=80)


# -- the witness over TLS ----------------------------------------------------------------------

def _issue(ca, directory, stem: str) -> tuple[str, str]:
    leaf = ca.issue_cert("127.0.0.1", "localhost", common_name=stem)
    cert, key = directory / f"{stem}.pem", directory / f"{stem}-key.pem"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    return str(cert), str(key)


@pytest.fixture
def tls_files(tmp_path):
    """CA ``ca`` signs the nodes' and the witness's certificates; CA ``other`` a look-alike witness's."""
    trustme = pytest.importorskip("trustme")
    d = tmp_path / "certs"
    d.mkdir()
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    files = {"ca": str(d / "ca.pem")}
    for stem in ("a", "b", "witness"):
        files[stem], files[f"{stem}-key"] = _issue(ca, d, stem)
    files["impostor"], files["impostor-key"] = _issue(other, d, "impostor")
    return files


def _tls_node(files: dict, stem: str) -> list[str]:
    return ["--tls-cert", files[stem], "--tls-key", files[f"{stem}-key"], "--tls-ca", files["ca"]]


async def _tls_status(address: str, ca: str) -> dict:
    import fastlock

    async with fastlock.connect(address, tls_ca=ca, connect_timeout=5, failover_timeout=0) as client:
        return await client.status()


def test_a_pair_reaches_its_witness_over_mutual_tls_and_fails_over(cluster, tls_files, tmp_path):
    """Witness and nodes with the serve TLS flags (the witness asks for client certificates):
    the primary holds the witness's lease over TLS, and the primary killed, the standby
    promotes with the witness's lease for the next epoch."""
    w = WitnessProcess(tmp_path / "tls-witness", cluster.creds.file,
                       args=["--tls-cert", tls_files["witness"], "--tls-key", tls_files["witness-key"],
                             "--tls-ca", tls_files["ca"], "--tls-client-auth", "required"])
    cluster.servers.append(w)
    w.start()
    assert any("(TLS)" in line for line in w.lines)
    a = cluster.primary("a", args=["--witness", w.address, *_tls_node(tls_files, "a")])
    b = cluster.standby(a.address, "b", failover_after=FAILOVER, wait_sync=False,
                        args=["--witness", w.address, *_tls_node(tls_files, "b")])
    b.wait_for_log(r"replicating from", 15)
    b.wait_for_log(r"paired: primary", 15)  # automatic failover is armed once the primary has paired
    a.wait_for_log(r"holding its lease for epoch", 15)

    async def main():
        st = await _tls_status(a.address, tls_files["ca"])
        assert st["replication"]["witness"]["tls"] is True and st["replication"]["witness"]["reachable"]
        a.kill()
        await asyncio.to_thread(b.wait_for_log, r"PROMOTED to primary", 30)
        assert any("granted this node the lease of epoch" in line for line in b.lines)
        # a plain (non-TLS) connection to the TLS witness is refused and changes nothing
        with pytest.raises((ConnectionLost, OSError, asyncio.TimeoutError, ProtocolError)):
            await _open(w, cluster.creds.token("node-7"))

    run(main(), timeout=60)


def test_a_node_refuses_a_witness_its_ca_did_not_sign(cluster, tls_files, tmp_path):
    """A witness whose certificate another CA signed: the node's TLS handshake fails, its
    status says why (the certificate), and the primary holds no witness lease."""
    w = WitnessProcess(tmp_path / "impostor-witness", cluster.creds.file,
                       args=["--tls-cert", tls_files["impostor"], "--tls-key", tls_files["impostor-key"]])
    cluster.servers.append(w)
    w.start()
    a = cluster.primary("a", args=["--witness", w.address, *_tls_node(tls_files, "a")])
    b = cluster.standby(a.address, "b", failover_after=FAILOVER, wait_sync=False,
                        args=["--witness", w.address, *_tls_node(tls_files, "b")])

    async def main():
        st = await poll(lambda: _tls_status(b.address, tls_files["ca"]),
                        lambda s: s["replication"]["witness"]["error"] is not None, timeout=15,
                        what="the standby's witness error")
        assert "CERTIFICATE_VERIFY_FAILED" in st["replication"]["witness"]["error"], st["replication"]["witness"]
        assert not any("holding its lease for epoch" in line for line in a.lines)

    run(main())


def test_witness_tls_flags_that_do_not_go_together_are_refused(tmp_path, cluster):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "fastlock", "witness", "--listen", "127.0.0.1:0", "--data",
                          str(tmp_path / "w"), "--credentials", cluster.creds.file, "--tls-key", "k.pem"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "need --tls-cert" in res.stderr
