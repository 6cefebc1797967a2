"""Mutated sequencers through :func:`fastlock.sequencer.verify`: the fuzz run of the tests
(``tests/test_sequencers.py``) and of ``python -m benches.sequencers --fuzz N``."""

from __future__ import annotations

import random
from typing import NamedTuple

from fastlock import sequencer as S
from fastlock.tokens import make_token

#: a fixed "now" (Unix seconds) and the originals' expiry, 10 s after it
NOW = 1_700_000_000.0
EXPIRES_MS = int(NOW * 1000) + 10_000


class FuzzResult(NamedTuple):
    """``accepted``: mutants that verified (must be 0); ``refused``: mutants refused;
    ``unchanged``: mutants equal to their original (not counted); ``by_error``: refusals
    per error class name."""

    accepted: int
    refused: int
    unchanged: int
    by_error: dict[str, int]


def mutate(rng: random.Random, blob: bytes, donor: bytes) -> bytes:
    """One mutant of ``blob``: bit flips, a random byte, a truncation or extension, a
    splice from ``donor`` (another valid sequencer), the forged-token attack (a chosen
    token with its matching epoch), or random bytes."""
    data = bytearray(blob)
    how = rng.randrange(6)
    if how == 0:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == 1:
        data[rng.randrange(len(data))] = rng.randrange(256)
    elif how == 2:
        if rng.random() < 0.5:
            return bytes(data[:rng.randrange(len(data))])
        return bytes(data) + rng.randbytes(rng.randint(1, 8))
    elif how == 3:
        start = rng.randrange(len(data))
        end = min(len(data), start + rng.randint(1, 16))
        data[start:end] = donor[start:end] if end <= len(donor) else rng.randbytes(end - start)
    elif how == 4:
        token = rng.choice([1 << 62, (1 << 63) - 1, make_token(rng.randrange(1 << 23), rng.randrange(1 << 40))])
        data[10:18] = token.to_bytes(8, "big")
        data[18:22] = (token >> 40).to_bytes(4, "big")
    else:
        return rng.randbytes(rng.randint(0, len(data) + 8))
    return bytes(data)


def fuzz(count: int, seed: int = 28) -> FuzzResult:
    """``count`` mutants (each different from its original; those equal to it are counted
    apart as ``unchanged``) of an Ed25519 and an HMAC-SHA256 sequencer, alternately,
    through ``verify(..., name="ledger")`` with both keys trusted."""
    rng = random.Random(seed)
    keys = [S.SigningKey.of("ed25519", bytes(range(32))), S.SigningKey.of("hmac-sha256", bytes(range(32)))]
    verify_keys = [k.verify_key for k in keys]
    originals = [S.encode(k, name="ledger", token=make_token(2, 5), principal="app", expires_at_ms=EXPIRES_MS)
                 for k in keys]
    donors = [S.encode(k, name="ledger2", token=make_token(9, 99), principal="mallory", expires_at_ms=EXPIRES_MS)
              for k in keys]
    accepted = refused = unchanged = 0
    by_error: dict[str, int] = {}
    i = 0
    while accepted + refused < count:
        original = originals[i & 1]
        mutant = mutate(rng, original, donors[i & 1])
        i += 1
        if mutant == original:
            unchanged += 1
            continue
        try:
            S.verify(mutant, verify_keys, name="ledger", now=NOW)
        except S.SequencerRejected as exc:
            refused += 1
            by_error[type(exc).__name__] = by_error.get(type(exc).__name__, 0) + 1
        else:
            accepted += 1
    return FuzzResult(accepted, refused, unchanged, by_error)
