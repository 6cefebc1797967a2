"""fastlock.auth without a server: the credentials file's validation, token checks,
ACL matching, owner hashing, and the failed-authentication limiter's bans and logs."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

import fastlock
from fastlock._testbase.handshake import key_lines, prove_in_memory
from fastlock.auth import (
    AuthFailures,
    ClientHandshake,
    Credentials,
    CredentialsError,
    ServerNotProven,
    generate,
    hash_owner,
    hash_token,
    is_loopback,
    make_token,
    secret_of,
    token_principal,
    upgrade,
)
from fastlock.auth.handshake import NONCE_BYTES, ClientFirst, ServerHandshake

H = "ab" * 32  # 64 hex digits
K = f"stored_key = '{H}'\nserver_key = '{H}'\n"


def load(tmp_path, text: str) -> Credentials:
    path = tmp_path / "c.toml"
    path.write_text(text if "version" in text or text.startswith("[principals\n") else "version = 2\n" + text)
    return Credentials.load(path)


@pytest.mark.parametrize("text, message", [
    ("version = 2\n", "no [principals"),
    ("version = 3\n[principals.a]\nkind = 'admin'\n", "unsupported version"),
    ("[principals\n", "not valid TOML"),
    (f"[principals.a]\nkind = 'root'\n{K}", "kind must be one of"),
    ("[principals.a]\nkind = 'admin'\nstored_key = 'xyz'\n", "64 lowercase hex"),
    (f"[principals.a]\nkind = 'admin'\nstored_key = '{H}'\n", "go together"),
    ("[principals.a]\nkind = 'admin'\n", "needs stored_key and server_key, or cert_identities"),
    (f"[principals.a]\nkind = 'client'\n{K}", "needs an acl"),
    (f"[principals.a]\nkind = 'client'\n{K}acl = [{{prefix = 'x', ops = ['destroy']}}]\n",
     "unknown acl ops"),
    (f"[principals.a]\nkind = 'client'\n{K}acl = [{{prefix = 'x', ops = []}}]\n", "non-empty"),
    (f"[principals.a]\nkind = 'admin'\n{K}acl = [{{prefix = '', ops = ['*']}}]\n",
     "only client principals"),
    (f"[principals.a]\nkind = 'admin'\n{K}node_id = 'x'\n", "node_id"),
    (f"[principals.a]\nkind = 'admin'\n{K}primary_proof_key = '{H}'\n", "unknown keys"),
    (f"[principals.a]\nkind = 'admin'\n{K}token_sha256 = '{H}'\n", "unknown keys"),
    (f"[principals.anonymous]\nkind = 'client'\n{K}acl = [{{prefix = '', ops = ['*']}}]\n",
     "anonymous principal is a client without a token"),
    (f"[principals.'bad name']\nkind = 'admin'\n{K}", "a name is"),
    ("[principals.a]\nkind = 'admin'\ncert_identities = ['x']\n[principals.b]\nkind = 'admin'\n"
     "cert_identities = ['x']\n", "already maps"),
])
def test_malformed_credentials_are_refused_with_the_reason(tmp_path, text, message):
    with pytest.raises(CredentialsError, match=re.escape(message)) as info:
        load(tmp_path, text)
    assert "c.toml" in str(info.value)


def test_a_missing_credentials_file_names_itself(tmp_path):
    with pytest.raises(CredentialsError, match="cannot read credentials file"):
        Credentials.load(tmp_path / "nope.toml")


def test_tokens_acls_and_certificate_identities(tmp_path):
    orders, admin = make_token("orders"), make_token("root")
    nl = "\n"
    creds = load(tmp_path, f"""
version = 2
[principals.orders]
kind = "client"
{nl.join(key_lines(orders))}
acl = [{{prefix = "orders/", ops = ["acquire", "release"]}}, {{prefix = "", ops = ["check"]}}]
cert_identities = ["orders.example"]
[principals.root]
kind = "admin"
{nl.join(key_lines(admin))}
""")
    p = prove_in_memory(creds, orders)
    assert p.name == "orders" and p.kind == "client"
    assert p.allows("acquire", "orders/1") and p.allows("release", "orders/")
    assert not p.allows("extend", "orders/1") and not p.allows("acquire", "order") and p.allows("check", "x")
    assert prove_in_memory(creds, admin).allows("acquire", "anything")
    # another principal's name on this token, a truncated token, a foreign format: nobody
    assert prove_in_memory(creds, orders.replace("fl1.orders.", "fl1.root.")) is None
    assert prove_in_memory(creds, orders[:-1]) is None and prove_in_memory(creds, "orders") is None
    assert creds.by_cert_identity("orders.example").name == "orders" and creds.by_cert_identity("x") is None
    assert creds.anonymous is None and not creds.open


def test_the_shared_secret_is_a_client_of_every_name_only():
    creds = Credentials.open_mode().with_shared_secret("s3cret")
    p = prove_in_memory(creds, "s3cret")
    assert (p.name, p.kind) == ("shared-secret", "client") and p.allows("acquire", "any/name")
    assert creds.anonymous is None and prove_in_memory(creds, "s3cre") is None
    with pytest.raises(CredentialsError, match="empty"):
        Credentials.open_mode().with_shared_secret("")


def test_hashes():
    key = b"k" * 16
    assert hash_owner(key) != key and len(hash_owner(key)) == 16 and hash_owner(hash_owner(key)) != hash_owner(key)
    token = make_token("node-a")
    assert token_principal(token) == "node-a" and token_principal("fl2.node-a.x") is None
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.com")


# -- the handshake, sans-IO ---------------------------------------------------------------------


def _pair(tmp_path):
    paths = generate(tmp_path / "c", clients=[("app", "")], replicas=["node-a", "node-b"], admins=["admin"])
    creds = Credentials.load(tmp_path / "c" / "credentials.toml")
    tokens = {name: open(path).read().strip() for name, path in paths.items()}
    return creds, tokens


def _challenge(server, creds, client):
    first = ClientFirst.parse(client.first())
    found = creds.lookup(first.principal)
    return server.challenge(first, found.keys if found is not None else None, found)


def test_a_handshake_proves_both_sides_and_sends_no_secret(tmp_path):
    creds, tokens = _pair(tmp_path)
    server = ServerHandshake("node-p")
    client = ClientHandshake(secret_of(tokens["node-a"]), role="replica", own_node="node-s")
    secret = secret_of(tokens["node-a"])
    pending, challenge = _challenge(server, creds, client)
    answer = client.answer(challenge)
    sent = repr((client.first(), answer)).encode()
    for forbidden in (tokens["node-a"].encode(), secret.client_key, hash_token(tokens["node-a"])):
        assert forbidden not in sent
    proof = server.verify(pending, answer)
    assert proof is not None and pending.principal.name == "node-a"
    assert client.welcome({"server_proof": proof, "role": "primary"})["role"] == "primary"
    assert client.server_node == "node-p"


def test_wrong_swapped_reflected_replayed_and_misdirected_proofs_are_refused(tmp_path):
    creds, tokens = _pair(tmp_path)
    server = ServerHandshake("node-p")
    secret = secret_of(tokens["node-a"])

    # a wrong token for the principal: the server refuses the proof
    wrong = ClientHandshake(secret_of("fl1.node-a." + "A" * 43), role="replica")
    pending, challenge = _challenge(server, creds, wrong)
    assert server.verify(pending, wrong.answer(challenge)) is None

    # an unknown principal is challenged like any other, then refused
    ghost = ClientHandshake(secret_of(make_token("ghost")))
    pending, challenge = _challenge(server, creds, ghost)
    assert set(challenge["challenge"]) == {"nonce", "node"} and len(challenge["challenge"]["nonce"]) == NONCE_BYTES
    assert server.verify(pending, ghost.answer(challenge)) is None

    # a replayed proof with a fresh server nonce: refused
    c1 = ClientHandshake(secret, role="replica", nonce=b"n" * NONCE_BYTES)
    pending1, challenge1 = _challenge(server, creds, c1)
    proof1 = c1.answer(challenge1)
    c2 = ClientHandshake(secret, role="replica", nonce=b"n" * NONCE_BYTES)
    pending2, _ = _challenge(server, creds, c2)
    assert pending2.server_nonce != pending1.server_nonce and server.verify(pending2, proof1) is None

    # swapped roles: a proof made for "client" does not verify as "replica" (the role is signed)
    c3 = ClientHandshake(secret, role="client")
    pending3, challenge3 = _challenge(server, creds, c3)
    forged = dataclasses.replace(pending3, first=dataclasses.replace(pending3.first, role="replica"))
    proof3 = c3.answer(challenge3)
    assert server.verify(forged, proof3) is None and server.verify(pending3, proof3) is not None

    # a reflected proof: the client's own proof handed back as the server's is not the server proof
    c4 = ClientHandshake(secret, role="replica")
    _, challenge4 = _challenge(server, creds, c4)
    reflected = c4.answer(challenge4)["proof"]
    with pytest.raises(ServerNotProven, match="proof is missing or wrong"):
        c4.welcome({"server_proof": reflected})

    # a server proof made at another node (relayed) does not verify at the client that expected this one
    other = ServerHandshake("node-x")
    c5 = ClientHandshake(secret, role="replica")
    pending5, challenge5 = _challenge(other, creds, c5)
    relabelled = {"challenge": {**challenge5["challenge"], "node": "node-p"}}
    proof5 = c5.answer(relabelled)
    assert other.verify(pending5, proof5) is None  # the node id is signed: the relay's relabel breaks it


def test_a_client_refuses_its_own_node_the_wrong_node_and_a_server_that_does_not_prove_itself(tmp_path):
    creds, tokens = _pair(tmp_path)
    secret = secret_of(tokens["node-a"])
    self_server = ServerHandshake("node-s")
    me = ClientHandshake(secret, role="replica", own_node="node-s")
    _, challenge = _challenge(self_server, creds, me)
    with pytest.raises(ServerNotProven, match="this node itself"):
        me.answer(challenge)
    picky = ClientHandshake(secret, expect_node="node-p")
    with pytest.raises(ServerNotProven, match="not the expected node"):
        picky.answer(challenge)
    # no downgrade: a server that answers with hello info (open mode) instead of a challenge
    downgrade = ClientHandshake(secret)
    with pytest.raises(ServerNotProven, match="did not answer the credential with a challenge"):
        downgrade.answer({"server": "fastlock", "role": "primary"})
    with pytest.raises(ServerNotProven, match="without a challenge"):
        downgrade.welcome({"server": "fastlock", "role": "primary"})
    # a client without a credential takes the hello info as it is (anonymous, one round trip)
    assert ClientHandshake(None).first() is None and ClientHandshake(None).welcome({"x": 1}) == {"x": 1}


# -- the credentials file: format 2, upgrade from format 1 ---------------------------------------


def _v1(directory, names=("app", "node-a")):
    directory.mkdir(mode=0o700)
    tokens = {n: make_token(n) for n in names}
    lines = ["version = 1"]
    for n, t in tokens.items():
        kind = "client" if n == "app" else "replica"
        lines += [f"[principals.{n}]", f'kind = "{kind}"', f'token_sha256 = "{hash_token(t).hex()}"']
        if kind == "client":
            lines.append('acl = [{prefix = "orders/", ops = ["acquire", "release"]}]')
        else:
            lines += [f'primary_proof_key = "{H}"', 'node_id = "abc"']
    lines += ["[principals.anonymous]", 'kind = "client"', 'acl = [{prefix = "public/", ops = ["*"]}]']
    (directory / "credentials.toml").write_text("\n".join(lines) + "\n")
    return tokens


def test_format_1_is_refused_naming_the_upgrade_and_the_upgrade_keeps_tokens(tmp_path):
    d = tmp_path / "creds"
    tokens = _v1(d)
    with pytest.raises(CredentialsError, match=re.escape(f"fastlock credentials upgrade {d}")):
        Credentials.load(d / "credentials.toml")
    for name, token in tokens.items():
        (d / f"{name}.token").write_text(token + "\n")
    assert sorted(upgrade(d)) == ["app", "node-a"]
    assert oct((d / "credentials.toml").stat().st_mode & 0o777) == "0o600"
    creds = Credentials.load(d / "credentials.toml")
    app = prove_in_memory(creds, tokens["app"])
    assert app.name == "app" and app.allows("acquire", "orders/1") and not app.allows("extend", "orders/1")
    replica = prove_in_memory(creds, tokens["node-a"])
    assert replica.kind == "replica" and replica.node_id == "abc"
    assert creds.anonymous is not None and creds.anonymous.allows("put", "public/x")
    with pytest.raises(CredentialsError, match="not format 1"):
        upgrade(d)


def test_the_upgrade_refuses_without_every_token_file_and_writes_nothing(tmp_path):
    d = tmp_path / "creds"
    tokens = _v1(d)
    (d / "app.token").write_text(tokens["app"] + "\n")
    before = (d / "credentials.toml").read_bytes()
    with pytest.raises(CredentialsError, match="no token file beside .* for 'node-a'"):
        upgrade(d)
    (d / "node-a.token").write_text(make_token("node-a") + "\n")  # another token: refused too
    with pytest.raises(CredentialsError, match="does not hold the token"):
        upgrade(d)
    assert (d / "credentials.toml").read_bytes() == before
    assert sorted(p.name for p in d.iterdir()) == ["app.token", "credentials.toml", "node-a.token"]


def test_credentials_init_writes_format_2(tmp_path):
    creds, tokens = _pair(tmp_path)
    text = (tmp_path / "c" / "credentials.toml").read_text()
    assert "version = 2" in text and "token_sha256" not in text and "primary_proof_key" not in text
    for token in tokens.values():
        assert token not in text and token.rpartition(".")[2] not in text
    assert prove_in_memory(creds, tokens["admin"]).kind == "admin"


def test_failed_authentications_ban_doubling_and_log_a_bounded_number_of_lines(caplog):
    now = [1000.0]
    f = AuthFailures(max_failures=3, window_s=60, ban_s=1, max_ban_s=4, summary_every_s=10, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="fastlock.auth")
    bans = []
    for _ in range(4):  # four bans in a row: 1, 2, 4, 4 s
        for _ in range(3):
            f.failed("10.0.0.1", "x", "unknown token")
        bans.append(f.banned_for("10.0.0.1"))
        now[0] += bans[-1] + 0.001
    assert bans == [1, 2, 4, 4]
    assert f.banned_for("10.0.0.2") == 0
    for _ in range(1000):
        f.refused_while_banned("10.0.0.1")
    now[0] += 11
    f.refused_while_banned("10.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert sum("authentication failed from 10.0.0.1" in m for m in lines) == 1
    assert sum("banned for" in m for m in lines) == 4
    assert len(lines) <= 8, lines
    assert any("more failed or refused authentications" in m for m in lines)


def test_the_limiter_forgets_the_oldest_address_when_full():
    f = AuthFailures(max_failures=1, max_addresses=3)
    for i in range(10):
        f.failed(f"10.0.0.{i}", "x", "r")
    assert len(f._by_address) == 3 and f.banned_for("10.0.0.9") > 0 and f.banned_for("10.0.0.0") == 0


def test_many_addresses_cannot_flood_the_log_either(caplog):
    now = [0.0]
    f = AuthFailures(max_lines=20, summary_every_s=10, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="fastlock.auth")
    for i in range(5000):
        f.failed(f"2001:db8::{i:x}", "x", "unknown token")
    now[0] += 10
    f.failed("2001:db8::ffff:1", "x", "unknown token")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) <= 22, len(lines)
    assert "4980 more failed or refused authentications from 4980 addresses" in lines[-2] + lines[-1]


# -- which credential a client presents: one rule ------------------------------------------------


def test_resolve_credential_follows_one_documented_order(tmp_path):
    from fastlock.auth import resolve_credential

    token_file = tmp_path / "t.token"
    token_file.write_text("fl1.app.file\n")
    env_file = tmp_path / "env.token"
    env_file.write_text("fl1.app.env\n")
    env = {"FASTLOCK_TOKEN_FILE": str(env_file), "FASTLOCK_AUTH_SECRET": "env-secret"}
    assert resolve_credential(token="fl1.app.t", auth="s", env=env) == "fl1.app.t"
    assert resolve_credential(token_file=token_file, auth="s", env=env) == "fl1.app.file"
    assert resolve_credential(auth="s", env=env) == "s"  # an explicit secret beats the environment
    assert resolve_credential(env=env) == "fl1.app.env"  # the token file beats the secret in the environment
    assert resolve_credential(env={"FASTLOCK_AUTH_SECRET": " env-secret\n"}) == "env-secret"
    assert resolve_credential(env={}) is None
    with pytest.raises(fastlock.InvalidArgument, match="set but empty"):
        resolve_credential(env={"FASTLOCK_AUTH_SECRET": "  "})
    with pytest.raises(fastlock.InvalidArgument, match="not both"):
        resolve_credential(token="x", token_file=token_file, env={})
