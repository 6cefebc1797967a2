"""etcd reached over TLS as a confined etcd user, and what the arbiter believes of etcd.

Against the session's secured etcd (tests/etcdserver.py: client TLS with
``--client-cert-auth``, authentication on, users made by docs/etcd.md's etcdctl
lines): the documented role confines a user to its prefix; an invalidated token
costs one new login; each setting that cannot work stops ``fastlock serve`` at
start with exit status 1 and a line naming the setting (never the password); the
flags that cannot go together are refused before anything starts.  Against the
plain etcd: an arbiter refuses an epoch in etcd that it cannot believe, rewrites
it, and keeps electing with epochs from what the nodes know.  Skipped without the
etcd binary unless FASTLOCK_REQUIRE_ETCD=1.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from etcdserver import rbac_commands, unique_prefix
from test_coordination_etcd import arbiter

from fastlock._testbase import ServerProcess
from fastlock.coordination import EPOCH_ALLOWANCE, EtcdAccess, EtcdGateway, EtcdRefused
from fastlock.coordination.gateway import KeyValue
from fastlock.coordination.records import read_epoch
from fastlock.protocol import MAX_EPOCH

pytest.importorskip("httpx")
pytest.importorskip("trustme")


#: the lease TTL (ms) of an arbiter whose steps the test drives by hand: a loaded machine's pause
#: between two of its steps must not run its lease out (these tests are about epochs, not time)
HAND_STEPPED_TTL_MS = 10_000


def gateway(etcd, user=None, **changes) -> EtcdGateway:
    return EtcdGateway([("127.0.0.1", etcd.port)], timeout_s=2.0, access=etcd.access(user, **changes))


async def test_the_documented_role_confines_a_user_to_its_prefix(secure_etcd):
    assert any("grant-permission" in line and "--prefix=true" in line for line in rbac_commands("group"))
    prefix = unique_prefix()
    user = secure_etcd.confine(prefix)
    gw = gateway(secure_etcd, user)
    try:
        await gw.put(f"{prefix}/epoch", b"1")
        assert (await gw.get(f"{prefix}/epoch")).value == b"1"
        for outside in (f"{prefix}2/epoch", f"{prefix}", "/other/key"):
            with pytest.raises(EtcdRefused, match="permission denied"):
                await gw.put(outside, b"1")
        with pytest.raises(EtcdRefused, match="permission denied"):
            await gw.get(f"{prefix}2/epoch")
    finally:
        await gw.close()


async def test_an_invalidated_token_costs_one_new_login(secure_etcd):
    """etcd invalidates a user's tokens when its password is set (here to the same one): the
    next request is refused as unauthenticated, the gateway logs in again once and the
    request succeeds."""
    prefix = unique_prefix()
    user = secure_etcd.confine(prefix)
    gw = gateway(secure_etcd, user)
    try:
        await gw.put(f"{prefix}/k", b"1")
        assert gw.authentications == 1
        await gw.put(f"{prefix}/k", b"2")
        assert gw.authentications == 1  # the token is kept
        await asyncio.to_thread(secure_etcd.etcdctl,
                                f"etcdctl user passwd {user.name} --interactive=false < {user.password_file}")
        await gw.put(f"{prefix}/k", b"3")
        assert gw.authentications == 2
        assert (await gw.get(f"{prefix}/k")).value == b"3"
    finally:
        await gw.close()


def _bad_settings(etcd, tmp: Path, prefix: str) -> dict[str, tuple[list[str], str]]:
    """case -> (serve flags, what the refusal line says)."""
    user = etcd.confine(prefix)
    certs = etcd.certs
    wrong = tmp / "wrong.password"
    wrong.write_text("not-the-password\n")

    def flags(**changes) -> list[str]:
        out = etcd.serve_flags(user)
        for flag, value in changes.items():
            name = "--coordinator-" + flag.replace("_", "-")
            i = out.index(name)
            if value is None:
                del out[i:i + 2]
            else:
                out[i + 1] = value
        return out

    return {
        "wrong password": (flags(password_file=str(wrong)), "check --coordinator-user and --coordinator-password-file"),
        "no permission on the prefix": (etcd.serve_flags(etcd.confine(prefix, grant=False)),
                                        "readwrite on the group's key prefix"),
        "no user": (flags(user=None, password_file=None), "has authentication enabled"),
        "etcd's CA not trusted": (flags(cacert=certs["other_ca"]), "check --coordinator-cacert"),
        "client certificate of another CA": (flags(cert=certs["other"], key=certs["other_key"]),
                                             "check --coordinator-cert"),
        "client certificate with a CN": (flags(cert=certs["client_cn"], key=certs["client_cn_key"]),
                                         "only a subjectAltName"),
        "http to an https etcd": (flags(protocol="http", cacert=None, cert=None, key=None),
                                  "check --coordinator-protocol"),
        "CA file not PEM": (flags(cacert=user.password_file), "--coordinator-cacert"),
        "password file missing": (flags(password_file=str(tmp / "absent")), "--coordinator-password-file"),
    }


def test_a_setting_that_cannot_work_stops_the_node_at_start(secure_etcd, cluster, tmp_path):
    """Each case: exit status 1 with one "cannot start" line naming the setting; the
    password appears nowhere in the output."""
    prefix = unique_prefix()
    cases = _bad_settings(secure_etcd, tmp_path, prefix)
    passwords = [Path(f).read_text().strip() for f in Path(secure_etcd.base).glob("*.password")]
    for case, (flags, message) in cases.items():
        srv = ServerProcess(tmp_path / case.replace(" ", "-"), args=[
            *cluster.auth_args("n1"), "--coordinator", f"etcd://{secure_etcd.address}{prefix}",
            "--node-id", "n1", "--coordinator-ttl", "1", *flags])
        done = subprocess.run(srv.command(), capture_output=True, text=True, timeout=60, cwd=tmp_path)
        lines = [line for line in done.stderr.splitlines() if "cannot start" in line]
        assert done.returncode == 1 and len(lines) == 1 and message in lines[0], (case, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, (case, done.stderr[-2000:])
        assert not any(p in done.stderr for p in passwords), case


@pytest.mark.parametrize("flags, message", [
    (["--coordinator-user", "u"], "go together"),
    (["--coordinator-password-file", "p"], "go together"),
    (["--coordinator-cacert", "ca.pem"], "need --coordinator-protocol https"),
    (["--coordinator-protocol", "https", "--coordinator-key", "k.pem"], "needs --coordinator-cert"),
    (["--coordinator-protocol", "ftp"], "invalid choice"),
])
def test_etcd_access_flags_that_cannot_work_are_refused(tmp_path, flags, message):
    argv = [sys.executable, "-m", "fastlock", "serve", "--data-dir", str(tmp_path / "d"),
            "--standby-token-file", str(tmp_path / "t"), "--coordinator", "etcd://127.0.0.1:2379/p", *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "d").exists()


def test_etcd_access_settings_come_from_the_config_file_and_the_environment(tmp_path):
    """Each etcd access flag is also a config-file key and a FASTLOCK_* variable; the printed
    configuration shows the password file's path, never a password."""
    (tmp_path / "etcd.password").write_text("s3cret-etcd-password\n")
    config = tmp_path / "fastlock.toml"
    config.write_text(f'''coordinator = "etcd://127.0.0.1:2379/fastlock/prod"
coordinator-protocol = "https"
coordinator-cacert = "/etc/fastlock/etcd-ca.pem"
coordinator-cert = "/etc/fastlock/etcd-client.pem"
coordinator-key = "/etc/fastlock/etcd-client-key.pem"
coordinator-password-file = "{tmp_path / "etcd.password"}"
standby-token-file = "{tmp_path / "t"}"
''')
    argv = [sys.executable, "-m", "fastlock", "serve", "--config", str(config), "--print-config"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=tmp_path,
                          env={**os.environ, "FASTLOCK_COORDINATOR_USER": "fastlock-prod"})
    assert done.returncode == 0, done.stderr
    for line in ('coordinator-protocol = "https"', 'coordinator-cacert = "/etc/fastlock/etcd-ca.pem"',
                 'coordinator-cert = "/etc/fastlock/etcd-client.pem"',
                 'coordinator-key = "/etc/fastlock/etcd-client-key.pem"',
                 f'coordinator-password-file = "{tmp_path / "etcd.password"}"',
                 'coordinator-user = "fastlock-prod"  # env FASTLOCK_COORDINATOR_USER'):
        assert line in done.stdout, (line, done.stdout)
    assert "s3cret-etcd-password" not in done.stdout + done.stderr


def test_etcd_access_flags_need_a_coordinator(tmp_path):
    argv = [sys.executable, "-m", "fastlock", "serve", "--data-dir", str(tmp_path / "d"),
            "--coordinator-protocol", "https"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert done.returncode == 2 and "only apply with --coordinator" in done.stderr, done.stderr


async def test_a_user_for_an_etcd_without_authentication_is_refused(etcd, tmp_path):
    """A user configured while etcd's authentication is off would never log in: refused, naming
    the setting (the plain etcd of the other tests has authentication off)."""
    password = tmp_path / "etcd.password"
    password.write_text("whatever\n")
    password.chmod(0o600)
    gw = EtcdGateway([("127.0.0.1", etcd.port)], access=EtcdAccess(user="u", password_file=str(password)))
    try:
        with pytest.raises(EtcdRefused, match="authentication disabled.*--coordinator-user"):
            await gw.get(unique_prefix() + "/epoch")
    finally:
        await gw.close()


def test_a_password_over_plain_http_off_loopback_is_refused(secure_etcd):
    user = secure_etcd.confine(unique_prefix())
    with pytest.raises(ValueError, match="in clear"):
        EtcdGateway([("10.0.0.9", 2379)], access=secure_etcd.access(user, protocol="http", cacert=None, cert=None,
                                                                   key=None))


# -- what the arbiter believes of etcd (plain etcd: the arbiter alone) -------------------------------


@pytest.mark.parametrize("value, seen, stored, refused", [
    (None, 0, 0, False),
    (b"0", 0, 0, False),
    (b"16", 0, 16, False),
    (b"17", 0, 0, True),
    (b"40", 30, 40, False),
    (str(MAX_EPOCH).encode(), MAX_EPOCH - 1, MAX_EPOCH, False),
    (str(MAX_EPOCH).encode(), 5, 0, True),
    (str(MAX_EPOCH + 1).encode(), MAX_EPOCH, 0, True),
    (b"-5", 10, 0, True),
    (b"+5", 10, 0, True),
    (b" 5", 10, 0, True),
    (b"5.0", 10, 0, True),
    (b"\xd9\xa5", 10, 0, True),  # ARABIC-INDIC DIGIT FIVE: a digit, but not ASCII
    (b"", 10, 0, True),
    (b"9" * 5000, 10, 0, True),
])
def test_read_epoch_believes_only_a_decimal_epoch_within_the_allowance(value, seen, stored, refused):
    kv = None if value is None else KeyValue(b"/p/epoch", value, 1, 1, 0)
    reading = read_epoch(kv, seen)
    assert (reading.stored, reading.refused) == (stored, refused)
    assert EPOCH_ALLOWANCE == 16  # the allowance the docs state

#: values no node writes to PREFIX/epoch: decimal epochs beyond what any node here has seen, then garbage
ROGUE_EPOCHS = [str(MAX_EPOCH).encode(), b"100", b"-5", b"12abc", b"9" * 5000, b"1e9", b" 3"]


async def test_a_rogue_epoch_is_refused_rewritten_and_never_stops_elections(etcd):
    """``PREFIX/epoch`` overwritten with values no node wrote (beyond the allowance above
    what the nodes have seen, negative, not a number, a huge string), before and while a
    node holds the key: the holder keeps the key and rewrites the epoch to its own, and each
    next holder takes the epoch after what the nodes know; epochs only grow, one a time."""
    prefix = unique_prefix()
    gw = EtcdGateway([("127.0.0.1", etcd.port)])
    epochs = []
    try:
        await gw.put(prefix + "/epoch", str(MAX_EPOCH).encode())  # before the group's life
        seen = 0
        for i, rogue in enumerate(ROGUE_EPOCHS):
            a, ea = arbiter(etcd.address, prefix, f"n{i}", min_epoch=lambda s=seen: s,
                            ttl_ms=HAND_STEPPED_TTL_MS)
            try:
                await a.step()
                assert a.holding and a.epoch == seen + 1, (rogue, a.epoch, seen)
                assert (await gw.get(prefix + "/epoch")).value == str(a.epoch).encode()
                epochs.append(a.epoch)
                await gw.put(prefix + "/epoch", rogue)  # during its life
                await a.step()
                assert a.holding and ea.first("lost") is None, rogue
                assert (await gw.get(prefix + "/epoch")).value == str(a.epoch).encode(), rogue
                seen = a.epoch
                await gw.put(prefix + "/epoch", rogue)  # and left there for the next election
            finally:
                await a.close()
    finally:
        await gw.close()
    assert epochs == list(range(1, len(ROGUE_EPOCHS) + 1))


async def test_a_bid_goes_above_the_epoch_a_live_member_advertises(etcd):
    """Someone overwrites ``PREFIX/epoch`` with garbage and deletes ``PREFIX/primary``: a node
    that has seen no epoch itself still bids above the epoch the last primary advertises in
    its member key (credible: within the allowance of what the bidder has seen)."""
    from fastlock.coordination.gateway import b64

    prefix = unique_prefix()
    gw = EtcdGateway([("127.0.0.1", etcd.port)])
    a, _ = arbiter(etcd.address, prefix, "a", min_epoch=lambda: 2, ttl_ms=HAND_STEPPED_TTL_MS)
    b, _ = arbiter(etcd.address, prefix, "b", ttl_ms=HAND_STEPPED_TTL_MS)
    try:
        await a.step()
        await a.step()  # its member key now advertises its term
        assert a.holding and a.epoch == 3
        await gw.put(prefix + "/epoch", b"garbage")
        await gw.call("kv/deleterange", {"key": b64(prefix + "/primary")})
        await b.step()
        assert b.holding and b.epoch == 4
    finally:
        await a.close()
        await b.close()
        await gw.close()


async def test_an_epoch_within_the_allowance_is_believed(etcd):
    """A node that missed elections: etcd's epoch up to EPOCH_ALLOWANCE above what it has
    seen is the group's, and its bid goes above it."""
    prefix = unique_prefix()
    gw = EtcdGateway([("127.0.0.1", etcd.port)])
    a, _ = arbiter(etcd.address, prefix, "a", min_epoch=lambda: 3, ttl_ms=HAND_STEPPED_TTL_MS)
    try:
        await gw.put(prefix + "/epoch", str(3 + EPOCH_ALLOWANCE).encode())
        await a.step()
        assert a.holding and a.epoch == 3 + EPOCH_ALLOWANCE + 1
    finally:
        await a.close()
        await gw.close()
