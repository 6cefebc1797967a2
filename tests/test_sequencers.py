"""Signed sequencers (fastlock.sequencer): the format and its test vector, every refusal,
the fences that take them (SQLite, the high-water-mark stores, the ASGI middleware), the
group keys in the credentials file, and a fuzz run of mutated sequencers.

The server's side (a grant with a sequencer, across a failover, against the SQLite,
PostgreSQL and HTTP fences) is in test_sequencers_integration.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from fastlock import sequencer as S
from fastlock._testbase.sequencer_fuzz import fuzz
from fastlock.auth import CredentialsError, generate
from fastlock.auth.credentials import Credentials
from fastlock.auth.sequencer_keys import SequencerKeyError, add_key, read_keys, retire_key, set_signing
from fastlock.contrib.asgi import FencingMiddleware, path_resource
from fastlock.errors import StaleFencingToken
from fastlock.fencing import SQLiteFence
from fastlock.tokens import make_token
from fastlock.watermarks import FileHighWaterMarks, MemoryHighWaterMarks, SequencerFence

ROOT = Path(__file__).resolve().parent.parent
SEED = bytes(range(32))
NOW = 1_700_000_000.0  # Unix seconds: "now" in these tests
EXPIRES_MS = int(NOW * 1000) + 10_000


def signing(algorithm: str = "ed25519", seed: bytes = SEED) -> S.SigningKey:
    return S.SigningKey.of(algorithm, seed)


def make(key: S.SigningKey, name: str = "ledger", token: int = make_token(2, 5), *, principal: str = "app",
         mode: int = S.EXCLUSIVE, expires_at_ms: int = EXPIRES_MS) -> bytes:
    return S.encode(key, name=name, token=token, principal=principal, mode=mode, expires_at_ms=expires_at_ms)


# -- the format ---------------------------------------------------------------------------------


def _vector(algorithm: str) -> str:
    text = (ROOT / "docs" / "sequencers.md").read_text()
    found = re.search(rf"<!-- test vector: {algorithm} -->\n```\n([0-9a-f]+)\n```", text)
    assert found, f"docs/sequencers.md has no {algorithm} test vector"
    return found.group(1)


@pytest.mark.parametrize("algorithm", ["ed25519", "hmac-sha256"])
def test_the_documented_test_vector_is_what_the_module_makes_and_verifies(algorithm):
    key = signing(algorithm)
    blob = S.encode(key, name="orders/42", token=make_token(3, 7), principal="app", mode=S.EXCLUSIVE,
                    expires_at_ms=1_800_000_000_000)
    assert blob.hex() == _vector(algorithm)
    seq = S.verify(bytes.fromhex(_vector(algorithm)), [key.verify_key], name="orders/42", skew=None)
    assert (seq.name, seq.token, seq.epoch, seq.principal, seq.mode, seq.expires_at_ms) == (
        "orders/42", 3298534883335, 3, "app", "exclusive", 1_800_000_000_000)
    assert seq.key_id == key.key_id and seq.algorithm == algorithm


def test_layout_fields_sit_at_the_documented_offsets():
    key = signing()
    blob = make(key, "r", make_token(9, 1), principal="p", mode=S.PERMIT, expires_at_ms=0x0102030405060708)
    assert blob[0] == 1 and blob[1] == S.ED25519 and blob[2:10] == key.key_id
    assert int.from_bytes(blob[10:18], "big") == make_token(9, 1)
    assert int.from_bytes(blob[18:22], "big") == 9
    assert blob[22:30] == bytes.fromhex("0102030405060708")
    assert blob[30] == S.PERMIT and blob[31:33] == b"\x00\x01" and blob[33:34] == b"r"
    assert blob[34] == 1 and blob[35:36] == b"p" and len(blob) == 36 + 64


@pytest.mark.parametrize("algorithm", ["ed25519", "hmac-sha256"])
def test_text_and_bytes_verify_alike(algorithm):
    key = signing(algorithm)
    blob = make(key)
    by_bytes = S.verify(blob, key.verify_key, name="ledger", now=NOW)
    by_text = S.verify(S.to_text(blob), {key.key_id: key.verify_key}, name="ledger", now=NOW)
    assert by_bytes == by_text and by_text.text == S.to_text(blob)


# -- every refusal, each with its own error ------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["ed25519", "hmac-sha256"])
def test_an_altered_byte_anywhere_is_refused(algorithm):
    key = signing(algorithm)
    blob = make(key)
    for i in range(len(blob)):
        altered = bytearray(blob)
        altered[i] ^= 0x01
        with pytest.raises(S.SequencerRejected):
            S.verify(bytes(altered), [key.verify_key], name="ledger", now=NOW)
    # the signed fields themselves: an altered token fails on the signature
    forged = bytearray(blob)
    forged[10:18] = (1 << 62).to_bytes(8, "big")
    forged[18:22] = ((1 << 62) >> 40).to_bytes(4, "big")
    with pytest.raises(S.BadSequencerSignature):
        S.verify(bytes(forged), [key.verify_key], now=NOW)


def test_each_refusal_says_what_is_wrong():
    key = signing()
    blob = make(key)
    with pytest.raises(S.UnknownSequencerKey):
        S.verify(blob, [signing(seed=b"\x07" * 32).verify_key], now=NOW)
    with pytest.raises(S.WrongSequencerName):
        S.verify(blob, [key.verify_key], name="other", now=NOW)
    with pytest.raises(S.ExpiredSequencer):
        S.verify(blob, [key.verify_key], now=EXPIRES_MS / 1000 + S.DEFAULT_SKEW + 0.01)
    assert S.verify(blob, [key.verify_key], now=EXPIRES_MS / 1000 + S.DEFAULT_SKEW - 0.01)  # within the skew
    assert S.verify(blob, [key.verify_key], now=NOW + 10**6, skew=None)  # expiry not checked
    text = S.to_text(blob)
    for bad in (b"", blob[:20], blob[:-1], blob + b"\0", b"\x02" + blob[1:], "not base64!", "A" * 5000, 42,
                text + "=", text[:10] + " " + text[10:], text + "\n", text[:-1] + "+"):
        with pytest.raises(S.MalformedSequencer):
            S.verify(bad, [key.verify_key], now=NOW)
    # an HMAC key with the Ed25519 key's id cannot be used to pass an HMAC-signed blob off
    confused = S.VerifyKey(key.key_id, "hmac-sha256", b"\0" * 32)
    with pytest.raises(S.BadSequencerSignature):
        S.verify(blob, [confused], now=NOW)


def test_token_and_epoch_must_agree():
    key = signing("hmac-sha256")
    blob = bytearray(make(key))
    blob[18:22] = (7).to_bytes(4, "big")
    with pytest.raises(S.MalformedSequencer, match="token and epoch"):
        S.verify(bytes(blob), [key.verify_key], now=NOW)


def test_fuzz_no_mutated_sequencer_is_accepted():
    """20,000 mutants here; FASTLOCK_SEQUENCER_FUZZ=1000000 runs the issue's 10^6 (also
    `python -m benches.sequencers --fuzz 1000000`)."""
    count = int(os.environ.get("FASTLOCK_SEQUENCER_FUZZ", "20000"))
    result = fuzz(count)
    assert result.accepted == 0
    assert result.refused == count
    # every kind of refusal is reached, the signature check included (not only malformed bytes)
    assert {"MalformedSequencer", "BadSequencerSignature", "UnknownSequencerKey"} <= set(result.by_error)


# -- the fences ---------------------------------------------------------------------------------


@pytest.fixture
def sqlite_fence(tmp_path):
    conn = sqlite3.connect(tmp_path / "app.db")
    conn.execute("CREATE TABLE ledger (amount INTEGER)")
    conn.commit()
    fence = SQLiteFence(conn, keys=[signing().verify_key], skew=None)
    fence.ensure_schema()
    yield fence
    conn.close()


def test_the_forged_2_62_attack_fails_against_the_sqlite_fence(sqlite_fence):
    """The issue's attack: ``execute("ledger", 2**62, ...)`` with no lease.  A fence with
    keys refuses the bare integer, a forged sequencer and one of another group, and the
    real holder's write is accepted afterwards."""
    fence = sqlite_fence
    insert = "INSERT INTO ledger (amount) VALUES (?)"
    with pytest.raises(S.MalformedSequencer, match="signed sequencers only"):
        fence.execute("ledger", 2**62, insert, (666,))
    real = make(signing(), "ledger", make_token(0, 1))
    forged = bytearray(real)
    forged[10:18] = (2**62).to_bytes(8, "big")
    forged[18:22] = (2**62 >> 40).to_bytes(4, "big")
    with pytest.raises(S.BadSequencerSignature):
        fence.execute("ledger", bytes(forged), insert, (666,))
    with pytest.raises(S.UnknownSequencerKey):
        fence.execute("ledger", make(signing(seed=b"\x09" * 32), "ledger", 2**62), insert, (666,))
    with pytest.raises(S.WrongSequencerName):
        fence.execute("ledger", make(signing(), "other", 2**62), insert, (666,))
    assert fence.highest("ledger") is None
    assert fence.execute("ledger", S.to_text(real), insert, (10,)) == 1
    assert fence.highest("ledger") == make_token(0, 1)
    assert fence.conn.execute("SELECT amount FROM ledger").fetchall() == [(10,)]


def test_sqlite_fence_with_keys_orders_holders_by_their_signed_tokens(sqlite_fence):
    fence = sqlite_fence
    old = S.to_text(make(signing(), "ledger", make_token(0, 4)))
    new = make(signing(), "ledger", make_token(1, 1))
    fence.execute("ledger", S.decode(new)[0], "INSERT INTO ledger (amount) VALUES (1)")  # a Sequencer record
    with pytest.raises(StaleFencingToken):
        fence.execute("ledger", old, "INSERT INTO ledger (amount) VALUES (2)")
    assert fence.conn.execute("SELECT amount FROM ledger").fetchall() == [(1,)]


def test_a_fence_takes_exclusive_sequencers_only_unless_told_otherwise(sqlite_fence):
    """A shared lease or a semaphore permit is held by several clients at once: its sequencer is
    genuine, but a write fence that took it would let them all write together.  Every fence
    refuses those modes (WrongSequencerMode, the mark untouched) unless given ``modes``;
    :func:`verify` checks the mode only when asked."""
    insert = "INSERT INTO ledger (amount) VALUES (?)"
    shared = make(signing(), "ledger", make_token(0, 7), mode=S.SHARED)
    permit = make(signing(), "ledger", make_token(0, 8), mode=S.PERMIT)
    for blob in (shared, permit):
        with pytest.raises(S.WrongSequencerMode, match="exclusive"):
            sqlite_fence.execute("ledger", blob, insert, (1,))
    assert sqlite_fence.highest("ledger") is None
    fence = SequencerFence(signing().verify_key, skew=None)
    for blob in (shared, permit):
        with pytest.raises(S.WrongSequencerMode):
            fence.check("ledger", blob)
        with pytest.raises(S.WrongSequencerMode):
            asyncio.run(fence.check_async("ledger", blob))
    assert fence.marks.highest("ledger") is None
    assert S.verify(permit, [signing().verify_key], name="ledger", skew=None).mode == "permit"
    with pytest.raises(S.WrongSequencerMode):
        S.verify(permit, [signing().verify_key], name="ledger", skew=None, modes=("exclusive", "shared"))
    wider = SequencerFence(signing().verify_key, skew=None, modes=("exclusive", "permit"))
    assert wider.check("ledger", permit).token == make_token(0, 8)
    with pytest.raises(S.WrongSequencerMode):
        wider.check("ledger", shared)
    with pytest.raises(S.MalformedSequencer, match="mode"):
        SequencerFence(signing().verify_key, modes=("exclusive", "writer"))


@pytest.mark.parametrize("store", ["memory", "file"])
def test_sequencer_fence_on_a_high_water_mark_store(store, tmp_path):
    marks = MemoryHighWaterMarks() if store == "memory" else FileHighWaterMarks(tmp_path / "marks.json")
    fence = SequencerFence([signing().verify_key, signing("hmac-sha256").verify_key], marks, skew=None)
    first = make(signing("hmac-sha256"), "report", make_token(0, 3))
    assert fence.check("report", first).token == make_token(0, 3)
    assert fence.check("report", first).token == make_token(0, 3)  # one lease writes many times
    fence.check("report", make(signing(), "report", make_token(1, 1)))
    with pytest.raises(StaleFencingToken):
        fence.check("report", first)
    with pytest.raises(S.MalformedSequencer):
        fence.check("report", 2**62)
    with pytest.raises(S.WrongSequencerName):
        fence.check("other", first)
    assert marks.highest("report") == make_token(1, 1) and marks.highest("other") is None
    if store == "file":  # another process's view of the same file
        assert json.loads((tmp_path / "marks.json").read_text()) == {"report": make_token(1, 1)}


def test_file_marks_are_shared_by_processes(tmp_path):
    path = tmp_path / "marks.json"
    code = ("import sys; from fastlock.watermarks import FileHighWaterMarks as F; "
            "F(sys.argv[1]).advance('r', int(sys.argv[2]))")
    subprocess.run([sys.executable, "-c", code, str(path), "50"], check=True, timeout=60)
    with pytest.raises(StaleFencingToken):
        FileHighWaterMarks(path).advance("r", 49)
    done = subprocess.run([sys.executable, "-c", code, str(path), "40"], capture_output=True, timeout=60)
    assert done.returncode != 0 and b"StaleFencingToken" in done.stderr


# -- the ASGI middleware --------------------------------------------------------------------


async def _call(app, method: str, path: str, sequencer: str | None) -> tuple[int, bytes]:
    headers = [(b"content-type", b"text/plain")]
    if sequencer is not None:
        headers.append((b"if-fencing-sequencer", sequencer.encode("ascii")))
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def test_asgi_middleware_answers_428_403_409_and_lets_valid_writes_through():
    written: list[tuple[str, int]] = []

    async def app(scope, receive, send):
        written.append((scope["path"], scope["fastlock.sequencer"].token if "fastlock.sequencer" in scope else -1))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    fenced = FencingMiddleware(app, SequencerFence([signing().verify_key], skew=None),
                               resource=lambda scope: scope["path"].removeprefix("/ledger/"))
    old = S.to_text(make(signing(), "acct-1", make_token(0, 2)))
    new = S.to_text(make(signing(), "acct-1", make_token(1, 1)))
    forged = S.to_text(make(signing(seed=b"\x05" * 32), "acct-1", 2**62))
    assert (await _call(fenced, "PUT", "/ledger/acct-1", None))[0] == 428
    assert (await _call(fenced, "PUT", "/ledger/acct-1", forged))[0] == 403
    assert (await _call(fenced, "PUT", "/ledger/acct-1", "garbage"))[0] == 403
    assert (await _call(fenced, "PUT", "/ledger/acct-2", new))[0] == 403  # another resource's
    assert (await _call(fenced, "PUT", "/ledger/acct-1", new))[0] == 204
    status, body = await _call(fenced, "POST", "/ledger/acct-1", old)
    assert status == 409 and b"stale fencing token" in body
    assert (await _call(fenced, "GET", "/ledger/acct-1", None))[0] == 204  # reads are not fenced
    assert written == [("/ledger/acct-1", make_token(1, 1)), ("/ledger/acct-1", -1)]
    assert not fenced._locks  # no per-resource lock left behind


async def test_asgi_middleware_fences_a_path_on_the_lock_of_its_name_by_default():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    fenced = FencingMiddleware(app, SequencerFence([signing().verify_key], skew=None))
    orders = S.to_text(make(signing(), "orders/1", make_token(0, 1)))
    assert (await _call(fenced, "PUT", "/orders/1", orders))[0] == 204
    assert (await _call(fenced, "PUT", "/orders/2", orders))[0] == 403  # another lock's
    slashed = S.to_text(make(signing(), "/orders/1", make_token(0, 2)))
    assert (await _call(fenced, "PUT", "/orders/1", slashed))[0] == 403  # the lock is "orders/1"
    assert path_resource({"type": "http"}) is None


async def test_asgi_middleware_runs_one_fenced_write_per_resource_at_a_time():
    inside = 0
    most = 0
    release = asyncio.Event()

    async def app(scope, receive, send):
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        await release.wait()
        inside -= 1
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    fenced = FencingMiddleware(app, SequencerFence([signing().verify_key], skew=None))
    seq = S.to_text(make(signing(), "r", make_token(0, 1)))
    calls = [asyncio.ensure_future(_call(fenced, "PUT", "/r", seq)) for _ in range(3)]
    while inside == 0:
        await asyncio.sleep(0)
    release.set()
    assert [status for status, _ in await asyncio.gather(*calls)] == [204, 204, 204]
    assert most == 1


# -- the group keys in the credentials file --------------------------------------------------


def test_credentials_init_makes_a_signing_key_and_rotation_keeps_an_overlap(tmp_path):
    generate(tmp_path / "c")
    path = str(tmp_path / "c" / "credentials.toml")
    first = read_keys(path)
    assert first.signing is not None and [k.key_id for k in first.keys] == [first.signing.key_id]
    assert Credentials.load(path).sequencer_keys == first
    assert (os.stat(path).st_mode & 0o777) == 0o600
    added = add_key(path)
    second = read_keys(path)
    assert second.signing == first.signing and len(second.keys) == 2  # the new key only verifies yet
    set_signing(path, added.key_id.hex())
    assert read_keys(path).signing == added
    with pytest.raises(SequencerKeyError, match="signing key"):
        retire_key(path, added.key_id.hex())
    retire_key(path, first.signing.key_id.hex())
    final = Credentials.load(path)
    assert final.sequencer_keys.keys == (added,) and final.principals  # the principals are kept
    old = make(first.signing, "x")
    with pytest.raises(S.UnknownSequencerKey):  # a retired key's sequencers are refused
        S.verify(old, final.sequencer_keys.verify_keys, now=NOW)


def test_a_malformed_sequencer_key_table_is_refused_at_load(tmp_path):
    generate(tmp_path / "c")
    path = tmp_path / "c" / "credentials.toml"
    text = path.read_text()
    kid = re.search(r'id = "([0-9a-f]{16})"', text).group(1)
    bad = {"id": text.replace(kid, "0" * 16), "two signers": text + text[text.index("[[sequencer_keys]]"):],
           "algorithm": text.replace('algorithm = "ed25519"', 'algorithm = "rsa"')}
    for body in bad.values():
        path.write_text(body)
        with pytest.raises(CredentialsError, match="sequencer key"):
            Credentials.load(path)


def test_cli_exports_public_keys_that_verify_the_servers_sequencers(tmp_path):
    generate(tmp_path / "c")
    fastlock = [sys.executable, "-m", "fastlock", "credentials", "sequencer-key", str(tmp_path / "c")]
    out = subprocess.run([*fastlock, "--public"], capture_output=True, text=True, check=True, timeout=60).stdout
    assert "secret" not in out and len(out.splitlines()) == 1
    keys = S.keys_from_text(out)
    signer = read_keys(tmp_path / "c" / "credentials.toml").signing
    assert S.verify(make(signer), keys, now=NOW).key_id == signer.key_id
    secret_hex = signer.secret.hex()
    assert secret_hex not in out and S.to_text(signer.secret) not in out
    listing = subprocess.run(fastlock, capture_output=True, text=True, check=True, timeout=60).stdout
    assert listing.split() == [signer.key_id.hex(), "ed25519", "signs"]


def test_hmac_works_without_cryptography_and_ed25519_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(S, "HAVE_ED25519", False)
    key = signing("hmac-sha256")
    assert S.verify(make(key), [key.verify_key], now=NOW).algorithm == "hmac-sha256"
    with pytest.raises(ImportError, match="cryptography"):
        S.SigningKey.of("ed25519", SEED)
    with pytest.raises(ImportError, match="cryptography"):
        uncached = S.VerifyKey(bytes.fromhex("43c6789d8daec12a"), "ed25519", b"\1" * 32)
        S.verify(bytes.fromhex(_vector("ed25519")), [uncached], skew=None)


@pytest.mark.parametrize("skew", [float("nan"), float("inf"), -1.0, "2", True])
def test_a_skew_that_is_not_a_finite_number_of_seconds_is_refused_not_ignored(skew, tmp_path):
    """A NaN skew made every expiry comparison false: an expired sequencer passed, silently.
    verify() and every fence refuse such a skew (None turns the check off, and says so)."""
    from fastlock.errors import InvalidArgument

    expired = make(signing(), "ledger", make_token(0, 1), expires_at_ms=int(NOW * 1000) - 3_600_000)
    with pytest.raises(InvalidArgument, match="skew"):
        S.verify(expired, [signing().verify_key], name="ledger", now=NOW, skew=skew)
    with pytest.raises(InvalidArgument, match="skew"):
        SequencerFence(signing().verify_key, skew=skew)
    with pytest.raises(InvalidArgument, match="skew"):
        SQLiteFence(sqlite3.connect(tmp_path / "x.db"), keys=[signing().verify_key], skew=skew)
    with pytest.raises(S.ExpiredSequencer):
        S.verify(expired, [signing().verify_key], name="ledger", now=NOW)
