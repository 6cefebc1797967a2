"""fastlock.auth without a server: the credentials file's validation, token checks,
ACL matching, owner hashing, and the failed-authentication limiter's bans and logs."""

from __future__ import annotations

import logging
import re

import pytest

from fastlock.auth import (
    AuthFailures,
    Credentials,
    CredentialsError,
    hash_owner,
    hash_token,
    is_loopback,
    make_token,
    primary_proof,
    primary_proof_key,
    token_principal,
)

H = "ab" * 32  # 64 hex digits


def load(tmp_path, text: str) -> Credentials:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return Credentials.load(path)


@pytest.mark.parametrize("text, message", [
    ("version = 1\n", "no [principals"),
    ("version = 2\n[principals.a]\nkind = 'admin'\n", "unsupported version"),
    ("[principals\n", "not valid TOML"),
    (f"[principals.a]\nkind = 'root'\ntoken_sha256 = '{H}'\n", "kind must be one of"),
    ("[principals.a]\nkind = 'admin'\ntoken_sha256 = 'xyz'\n", "64 lowercase hex"),
    ("[principals.a]\nkind = 'admin'\n", "needs token_sha256 or cert_identities"),
    (f"[principals.a]\nkind = 'client'\ntoken_sha256 = '{H}'\n", "needs an acl"),
    (f"[principals.a]\nkind = 'client'\ntoken_sha256 = '{H}'\nacl = [{{prefix = 'x', ops = ['destroy']}}]\n",
     "unknown acl ops"),
    (f"[principals.a]\nkind = 'client'\ntoken_sha256 = '{H}'\nacl = [{{prefix = 'x', ops = []}}]\n", "non-empty"),
    (f"[principals.a]\nkind = 'admin'\ntoken_sha256 = '{H}'\nacl = [{{prefix = '', ops = ['*']}}]\n",
     "only client principals"),
    (f"[principals.a]\nkind = 'admin'\ntoken_sha256 = '{H}'\nnode_id = 'x'\n", "node_id"),
    (f"[principals.a]\nkind = 'admin'\ntoken_sha256 = '{H}'\nprimary_proof_key = '{H}'\n", "primary_proof_key"),
    (f"[principals.a]\nkind = 'admin'\ntoken_sha256 = '{H}'\ncolour = 'x'\n", "unknown keys"),
    (f"[principals.anonymous]\nkind = 'client'\ntoken_sha256 = '{H}'\nacl = [{{prefix = '', ops = ['*']}}]\n",
     "anonymous principal is a client without a token"),
    (f"[principals.'bad name']\nkind = 'admin'\ntoken_sha256 = '{H}'\n", "a name is"),
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
    creds = load(tmp_path, f"""
version = 1
[principals.orders]
kind = "client"
token_sha256 = "{hash_token(orders).hex()}"
acl = [{{prefix = "orders/", ops = ["acquire", "release"]}}, {{prefix = "", ops = ["check"]}}]
cert_identities = ["orders.example"]
[principals.root]
kind = "admin"
token_sha256 = "{hash_token(admin).hex()}"
""")
    p = creds.authenticate(orders)
    assert p.name == "orders" and p.kind == "client"
    assert p.allows("acquire", "orders/1") and p.allows("release", "orders/")
    assert not p.allows("extend", "orders/1") and not p.allows("acquire", "order") and p.allows("check", "x")
    assert creds.authenticate(admin).allows("acquire", "anything")
    # another principal's name on this token, a truncated token, a foreign format: nobody
    assert creds.authenticate(orders.replace("fl1.orders.", "fl1.root.")) is None
    assert creds.authenticate(orders[:-1]) is None and creds.authenticate("orders") is None
    assert creds.by_cert_identity("orders.example").name == "orders" and creds.by_cert_identity("x") is None
    assert creds.anonymous is None and not creds.open
    assert creds.replica("orders") is None


def test_the_shared_secret_is_a_client_of_every_name_only():
    creds = Credentials.open_mode().with_shared_secret("s3cret")
    p = creds.authenticate("s3cret")
    assert (p.name, p.kind) == ("shared-secret", "client") and p.allows("acquire", "any/name")
    assert creds.anonymous is None and creds.authenticate("s3cre") is None
    with pytest.raises(CredentialsError, match="empty"):
        Credentials.open_mode().with_shared_secret("")


def test_hashes_and_proofs():
    key = b"k" * 16
    assert hash_owner(key) != key and len(hash_owner(key)) == 16 and hash_owner(hash_owner(key)) != hash_owner(key)
    token = make_token("node-a")
    assert token_principal(token) == "node-a" and token_principal("fl2.node-a.x") is None
    k = primary_proof_key(token)
    assert primary_proof(k, "node-a", b"c" * 32) != primary_proof(k, "node-b", b"c" * 32)
    assert primary_proof(k, "node-a", b"c" * 32) != primary_proof(primary_proof_key(make_token("node-a")), "node-a",
                                                                  b"c" * 32)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.com")


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
