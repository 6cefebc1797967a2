"""Signed sequencers: a fencing token that a resource verifies by itself, offline.

A bare fencing token is an integer that a fence trusts: a buggy or hostile client that
writes once with token ``2**62`` makes every real holder's later write "stale" for good.
A *sequencer* is the token signed by the lock service's group key, together with what it
was granted for: the lock name, the token, its epoch, the principal that holds it, the
lease's mode and the server's wall-clock expiry of the lease.  A resource that holds the
public key (Ed25519) or the shared secret (HMAC-SHA256) checks the signature with
:func:`verify`, without calling fastlock, then checks the token against its high-water
mark as before.  (Chubby's sequencers are checked by calling the lock service,
``CheckSequencer``; these are checked with a signature.)

This module imports neither the client nor the server: a resource needs only it, and the
``cryptography`` package for Ed25519 (HMAC-SHA256 uses the standard library alone).

Byte format, version 1 (all integers big-endian)::

    offset  size  field
    0       1     version            1
    1       1     algorithm          1 = Ed25519, 2 = HMAC-SHA256
    2       8     key id             first 8 bytes of SHA-256("fastlock-sequencer-key\\0" || alg byte || key)
                                     (key: the Ed25519 public key, or the HMAC secret)
    10      8     fencing token      unsigned, < 2**63
    18      4     epoch              unsigned (the token's high bits: token >> 40)
    22      8     expires at         unsigned, Unix time in milliseconds (the server's wall clock
                                     at signing plus what was left of the lease)
    30      1     mode               0 = exclusive, 1 = shared, 2 = semaphore permit
    31      2     name length N      1..1024 (bytes of UTF-8)
    33      N     lock name          UTF-8
    33+N    1     principal length P 0..255 (bytes of UTF-8)
    34+N    P     principal          UTF-8 ("" when none)
    34+N+P  S     signature          Ed25519: 64 bytes; HMAC-SHA256: 32 bytes

The signature covers ``b"fastlock-sequencer\\0"`` followed by every byte before it (the
domain prefix keeps a group key from signing anything that is not a sequencer).  As
text (an HTTP header, an environment variable) a sequencer is its bytes in base64url
without padding (:func:`to_text`); :func:`verify` takes bytes or that text.

What :func:`verify` refuses, each with its own error (all :class:`SequencerRejected`):
malformed bytes or an unknown version/algorithm (:class:`MalformedSequencer`), a key id the
verifier does not hold (:class:`UnknownSequencerKey`), a bad signature
(:class:`BadSequencerSignature`), a sequencer for another name
(:class:`WrongSequencerName`), one whose lease expired more than ``skew`` seconds ago
(:class:`ExpiredSequencer`), and, when the caller names the modes it takes, one of another
mode (:class:`WrongSequencerMode`: a shared lease or a semaphore permit is held by several
clients at once, so a write fence takes exclusive sequencers only, :data:`WRITE_MODES`).
It does NOT know whether a later holder exists: that is the fence's high-water mark
(:mod:`fastlock.fencing`, :class:`HighWaterMarks`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import importlib.util
import re
import struct
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from .errors import FastlockError, InvalidArgument
from .tokens import TOKEN_EPOCH_SHIFT

__all__ = [
    "VERSION", "ED25519", "HMAC_SHA256", "EXCLUSIVE", "SHARED", "PERMIT", "MODES", "DEFAULT_SKEW",
    "Sequencer", "VerifyKey", "SigningKey", "SequencerRejected", "MalformedSequencer",
    "UnknownSequencerKey", "BadSequencerSignature", "WrongSequencerName", "ExpiredSequencer",
    "WrongSequencerMode", "WRITE_MODES", "check_modes", "check_skew",
    "verify", "sign", "encode", "decode", "to_text", "from_text", "key_id_of", "new_signing_key",
    "keys_from_text", "keys_to_text", "HAVE_ED25519",
]

#: the format version this module writes and reads
VERSION = 1
#: algorithm bytes
ED25519 = 1
HMAC_SHA256 = 2
ALGORITHM_NAMES = {ED25519: "ed25519", HMAC_SHA256: "hmac-sha256"}
ALGORITHMS = {name: code for code, name in ALGORITHM_NAMES.items()}
#: mode bytes
EXCLUSIVE = 0
SHARED = 1
PERMIT = 2
MODES = {EXCLUSIVE: "exclusive", SHARED: "shared", PERMIT: "permit"}
#: the modes a write fence takes by default: only an exclusive lease has one holder at a time
WRITE_MODES = frozenset({"exclusive"})
#: how long (seconds) after its expiry a sequencer is still accepted by default (clock skew)
DEFAULT_SKEW = 2.0
#: the longest lock name in a sequencer (bytes of UTF-8)
MAX_NAME_BYTES = 1024
#: the longest principal (bytes of UTF-8)
MAX_PRINCIPAL_BYTES = 255
#: signature sizes by algorithm
SIGNATURE_BYTES = {ED25519: 64, HMAC_SHA256: 32}
#: the longest sequencer in bytes (and its text, about 4/3 of it): what a verifier reads at most
MAX_BYTES = 34 + MAX_NAME_BYTES + MAX_PRINCIPAL_BYTES + 64
MAX_TEXT_CHARS = (MAX_BYTES * 4 + 2) // 3

_BASE64URL = re.compile(r"[A-Za-z0-9_-]*\Z")
_DOMAIN = b"fastlock-sequencer\0"
_KEY_DOMAIN = b"fastlock-sequencer-key\0"
_HEAD = struct.Struct(">BB8sQIQBH")  # version, algorithm, key id, token, epoch, expires ms, mode, name length
_MAX_U64 = (1 << 64) - 1

#: Ed25519 needs the cryptography package (imported on first use, so that a process that only
#: uses HMAC-SHA256, or no sequencer, does not pay for the import); HMAC-SHA256 works without it
HAVE_ED25519 = importlib.util.find_spec("cryptography") is not None


class SequencerRejected(FastlockError, ValueError):
    """A sequencer that must not be trusted (base class: catch this to refuse a write)."""


class MalformedSequencer(SequencerRejected):
    """Not a sequencer: bad text, wrong length, an unknown version, algorithm or mode."""


class UnknownSequencerKey(SequencerRejected):
    """Signed by a key the verifier does not hold (a foreign group, or a retired key)."""


class BadSequencerSignature(SequencerRejected):
    """The signature does not match the bytes: forged or altered."""


class WrongSequencerName(SequencerRejected):
    """A valid sequencer for another lock name (replayed against the wrong resource)."""


class ExpiredSequencer(SequencerRejected):
    """The lease it was granted for expired more than the skew allowance ago."""


class WrongSequencerMode(SequencerRejected):
    """A valid sequencer of a mode the verifier does not take (a shared lease or a
    semaphore permit, held by several clients at once, offered to a write fence)."""


def check_skew(skew: Any) -> float | None:
    """``skew`` (seconds a sequencer stays accepted after its expiry) as a float, or None
    (expiry not checked).

    :raises InvalidArgument: not None and not a finite number >= 0 (a NaN would make every
        expiry comparison false, and so accept every expired sequencer)."""
    if skew is None:
        return None
    if isinstance(skew, bool) or not isinstance(skew, (int, float)) or not 0 <= skew < float("inf"):
        raise InvalidArgument(f"skew must be None or a finite number of seconds >= 0, not {skew!r}")
    return float(skew)


def check_modes(modes: Iterable[str] | None) -> frozenset[str] | None:
    """``modes`` as a frozenset of mode names (``"exclusive"``, ``"shared"``, ``"permit"``),
    or None (every mode).

    :raises MalformedSequencer: an unknown mode name, a bare string, or none at all."""
    if modes is None:
        return None
    if isinstance(modes, str):
        raise MalformedSequencer(f"modes is a collection of mode names, not the string {modes!r}")
    chosen = frozenset(modes)
    unknown = sorted(str(m) for m in chosen - set(MODES.values()))
    if unknown or not chosen:
        raise MalformedSequencer(f"unknown sequencer mode {', '.join(unknown) or '(none given)'}: the modes are "
                                 f"{', '.join(MODES.values())}")
    return chosen


class Sequencer(NamedTuple):
    """A decoded sequencer (what :func:`verify` returns once every check passed).

    ``expires_at_ms``: Unix time in milliseconds (the server's wall clock) when the lease
    ends unless renewed; ``mode``: ``"exclusive"``, ``"shared"`` or ``"permit"``;
    ``key_id``: 8 bytes; ``algorithm``: ``"ed25519"`` or ``"hmac-sha256"``; ``blob``: the
    signed bytes, signature included.
    """

    name: str
    token: int
    epoch: int
    principal: str
    mode: str
    expires_at_ms: int
    key_id: bytes
    algorithm: str
    blob: bytes

    @property
    def text(self) -> str:
        """The sequencer as base64url text without padding (:func:`to_text`)."""
        return to_text(self.blob)


class VerifyKey(NamedTuple):
    """A key a verifier holds: ``algorithm`` ``"ed25519"`` (``key``: the 32-byte public
    key) or ``"hmac-sha256"`` (``key``: the shared secret, 32 bytes or more);
    ``key_id`` (8 bytes) is derived from them (:func:`key_id_of`)."""

    key_id: bytes
    algorithm: str
    key: bytes

    @classmethod
    def of(cls, algorithm: str, key: bytes) -> VerifyKey:
        """The verify key for ``algorithm`` and ``key``, its id derived.

        :raises MalformedSequencer: unknown algorithm or a key of the wrong size."""
        _check_key(algorithm, key, public=True)
        return cls(key_id_of(algorithm, key), algorithm, bytes(key))


class SigningKey(NamedTuple):
    """A key the lock server signs with: ``algorithm`` ``"ed25519"`` (``secret``: the
    32-byte private seed) or ``"hmac-sha256"`` (``secret``: the shared secret).  Never
    leaves the server's credentials file; :attr:`verify_key` is what a resource gets."""

    key_id: bytes
    algorithm: str
    secret: bytes

    @classmethod
    def of(cls, algorithm: str, secret: bytes) -> SigningKey:
        """The signing key for ``algorithm`` and ``secret``, its id derived from the key a
        verifier holds.

        :raises MalformedSequencer: unknown algorithm or a secret of the wrong size.
        :raises ImportError: Ed25519 without the ``cryptography`` package."""
        _check_key(algorithm, secret, public=False)
        public = _public_of(algorithm, secret)
        return cls(key_id_of(algorithm, public), algorithm, bytes(secret))

    @property
    def verify_key(self) -> VerifyKey:
        """The key that verifies this key's signatures (for HMAC: the secret itself)."""
        return VerifyKey(self.key_id, self.algorithm, _public_of(self.algorithm, self.secret))


def _check_key(algorithm: str, key: bytes, *, public: bool) -> None:
    if algorithm not in ALGORITHMS:
        raise MalformedSequencer(f"unknown sequencer algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    if not isinstance(key, (bytes, bytearray)):
        raise MalformedSequencer(f"a sequencer key is bytes, not {type(key).__name__}")
    if algorithm == "ed25519" and len(key) != 32:
        raise MalformedSequencer(f"an Ed25519 {'public' if public else 'private'} key is 32 bytes, not {len(key)}")
    if algorithm == "hmac-sha256" and not 32 <= len(key) <= 128:
        raise MalformedSequencer(f"an HMAC-SHA256 secret is 32 to 128 bytes, not {len(key)}")


def _need_ed25519() -> Any:
    """cryptography's Ed25519 module (imported once).  :raises ImportError: not installed."""
    if not HAVE_ED25519:
        raise ImportError("Ed25519 sequencers need the cryptography package: pip install cryptography")
    from cryptography.hazmat.primitives.asymmetric import ed25519
    return ed25519


def _public_of(algorithm: str, secret: bytes) -> bytes:
    if algorithm == "hmac-sha256":
        return bytes(secret)
    return bytes(_need_ed25519().Ed25519PrivateKey.from_private_bytes(bytes(secret)).public_key().public_bytes_raw())


def key_id_of(algorithm: str, key: bytes) -> bytes:
    """The 8-byte id of a verify key: SHA-256 of ``"fastlock-sequencer-key\\0"``, the
    algorithm byte and ``key`` (the Ed25519 public key or the HMAC secret), first 8 bytes."""
    return hashlib.sha256(_KEY_DOMAIN + bytes((ALGORITHMS[algorithm],)) + bytes(key)).digest()[:8]


def new_signing_key(algorithm: str = "ed25519") -> SigningKey:
    """A fresh random signing key (32 bytes from :func:`secrets.token_bytes`).

    :raises ImportError: Ed25519 without the ``cryptography`` package."""
    import secrets
    return SigningKey.of(algorithm, secrets.token_bytes(32))


# -- encoding ----------------------------------------------------------------------------


def encode(key: SigningKey, *, name: str, token: int, principal: str = "", mode: int = EXCLUSIVE,
           expires_at_ms: int) -> bytes:
    """The signed bytes of a sequencer (the format in the module docstring).

    :param key: the group's signing key.
    :param name: the lock name (1..1024 bytes of UTF-8).
    :param token: the fencing token, 0..2**63-1; its epoch is ``token >> 40``.
    :param principal: who holds the lease ("" for none), at most 255 bytes of UTF-8.
    :param mode: :data:`EXCLUSIVE`, :data:`SHARED` or :data:`PERMIT`.
    :param expires_at_ms: the lease's end, Unix time in milliseconds.
    :raises ValueError: a field out of range.
    """
    raw_name = name.encode("utf-8")
    raw_principal = principal.encode("utf-8")
    if not 1 <= len(raw_name) <= MAX_NAME_BYTES:
        raise ValueError(f"a sequencer's name is 1..{MAX_NAME_BYTES} bytes, not {len(raw_name)}")
    if len(raw_principal) > MAX_PRINCIPAL_BYTES:
        raise ValueError(f"a sequencer's principal is at most {MAX_PRINCIPAL_BYTES} bytes")
    if not 0 <= token < 1 << 63 or mode not in MODES or not 0 <= expires_at_ms <= _MAX_U64:
        raise ValueError("token, mode or expiry out of range")
    body = (_HEAD.pack(VERSION, ALGORITHMS[key.algorithm], key.key_id, token, token >> TOKEN_EPOCH_SHIFT,
                       expires_at_ms, mode, len(raw_name))
            + raw_name + bytes((len(raw_principal),)) + raw_principal)
    return body + _signature(key, _DOMAIN + body)


def sign(key: SigningKey, name: str, token: int, principal: str, mode: int, ttl_left_ms: int,
         now: float | None = None) -> bytes:
    """:func:`encode` with the expiry ``now`` (Unix seconds, default :func:`time.time`)
    plus ``ttl_left_ms`` milliseconds: what the lock server calls for each grant."""
    wall_ms = int((time.time() if now is None else now) * 1000)
    return encode(key, name=name, token=token, principal=principal or "", mode=mode,
                  expires_at_ms=wall_ms + max(0, ttl_left_ms))


def _signature(key: SigningKey, message: bytes) -> bytes:
    if key.algorithm == "hmac-sha256":
        return hmac.new(key.secret, message, hashlib.sha256).digest()
    return bytes(_private_key(key.secret).sign(message))


_PRIVATE_CACHE: dict[bytes, Any] = {}


def _private_key(secret: bytes) -> Any:
    pk = _PRIVATE_CACHE.get(secret)
    if pk is None:
        pk = _need_ed25519().Ed25519PrivateKey.from_private_bytes(secret)
        if len(_PRIVATE_CACHE) < 16:  # a server holds one signing key at a time (a few across rotations)
            _PRIVATE_CACHE[secret] = pk
    return pk


def to_text(blob: bytes) -> str:
    """Sequencer bytes as base64url without padding (for headers and environment variables)."""
    return base64.urlsafe_b64encode(blob).rstrip(b"=").decode("ascii")


def from_text(text: str) -> bytes:
    """The bytes of a sequencer's text (:func:`to_text`).

    :raises MalformedSequencer: not base64url, or longer than :data:`MAX_TEXT_CHARS`."""
    if len(text) > MAX_TEXT_CHARS:
        raise MalformedSequencer(f"sequencer text longer than {MAX_TEXT_CHARS} characters")
    if not _BASE64URL.match(text) or len(text) % 4 == 1:  # strict: one text per sequencer
        raise MalformedSequencer("sequencer text is not base64url without padding")
    try:
        raw = text.encode("ascii")
        return base64.urlsafe_b64decode(raw + b"=" * (-len(raw) % 4))
    except (UnicodeEncodeError, binascii.Error, ValueError):
        raise MalformedSequencer("sequencer text is not base64url") from None


def decode(blob: bytes | str) -> tuple[Sequencer, bytes, bytes]:
    """Parse without checking the signature: the :class:`Sequencer`, the signed message
    (domain prefix included) and the signature.  For tools and tests; trust only
    :func:`verify`.

    :raises MalformedSequencer: the bytes do not follow the format."""
    if isinstance(blob, str):
        blob = from_text(blob)
    elif isinstance(blob, (bytearray, memoryview)):
        blob = bytes(blob)
    elif not isinstance(blob, bytes):
        raise MalformedSequencer(f"a sequencer is bytes or text, not {type(blob).__name__}")
    if len(blob) > MAX_BYTES or len(blob) < _HEAD.size:
        raise MalformedSequencer(f"a sequencer is {_HEAD.size}..{MAX_BYTES} bytes, not {len(blob)}")
    version, alg, key_id, token, epoch, expires_ms, mode, name_len = _HEAD.unpack_from(blob)
    if version != VERSION:
        raise MalformedSequencer(f"sequencer version {version} (this verifier reads {VERSION})")
    if alg not in SIGNATURE_BYTES:
        raise MalformedSequencer(f"unknown sequencer algorithm {alg}")
    if mode not in MODES:
        raise MalformedSequencer(f"unknown sequencer mode {mode}")
    if token >= 1 << 63 or epoch != token >> TOKEN_EPOCH_SHIFT:
        raise MalformedSequencer("token and epoch disagree")
    at = _HEAD.size
    if not 1 <= name_len <= MAX_NAME_BYTES or at + name_len + 1 > len(blob):
        raise MalformedSequencer("bad name length")
    raw_name = blob[at:at + name_len]
    at += name_len
    principal_len = blob[at]
    at += 1
    raw_principal = blob[at:at + principal_len]
    at += principal_len
    if len(blob) - at != SIGNATURE_BYTES[alg]:
        raise MalformedSequencer("bad length (principal or signature)")
    try:
        name = raw_name.decode("utf-8")
        principal = raw_principal.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedSequencer("name or principal is not UTF-8") from None
    seq = Sequencer(name, token, epoch, principal, MODES[mode], expires_ms, key_id, ALGORITHM_NAMES[alg], blob)
    return seq, _DOMAIN + blob[:at], blob[at:]


def _key_table(keys: Iterable[VerifyKey] | Mapping[bytes, VerifyKey] | VerifyKey) -> Mapping[bytes, VerifyKey]:
    if isinstance(keys, VerifyKey):
        return {keys.key_id: keys}
    if isinstance(keys, Mapping):
        return keys
    return {k.key_id: k for k in keys}


def verify(blob: bytes | str, keys: Iterable[VerifyKey] | Mapping[bytes, VerifyKey] | VerifyKey, *,
           name: str | None = None, now: float | None = None, skew: float | None = DEFAULT_SKEW,
           modes: Iterable[str] | None = None) -> Sequencer:
    """Check a sequencer and return what it says.

    :param blob: the sequencer's bytes, or its base64url text.
    :param keys: the keys this verifier trusts (:class:`VerifyKey`; several during a key
        rotation): an iterable, a mapping key id -> key, or one key.
    :param name: the lock name the write is for (None: not checked; a fence always passes
        it).
    :param now: Unix time in seconds (default :func:`time.time`).
    :param skew: seconds a sequencer stays accepted after its expiry, for clock skew
        between the server and this host (default 2.0); None: expiry not checked (the
        high-water mark alone orders writers).
    :param modes: the lease modes taken (``"exclusive"``, ``"shared"``, ``"permit"``); None
        (default): any (read ``Sequencer.mode``).  A write fence passes :data:`WRITE_MODES`.
    :returns: the :class:`Sequencer`.
    :raises MalformedSequencer: not a sequencer of this format.
    :raises UnknownSequencerKey: its key id is not among ``keys``.
    :raises BadSequencerSignature: forged or altered.
    :raises WrongSequencerName: valid, but for another name than ``name``.
    :raises ExpiredSequencer: its lease ended more than ``skew`` seconds before ``now``.
    :raises WrongSequencerMode: valid, but of a mode not in ``modes``.
    :raises InvalidArgument: ``skew`` is not None or a finite number >= 0.
    """
    taken = check_modes(modes)
    skew = check_skew(skew)
    seq, message, signature = decode(blob)
    table = _key_table(keys)
    key = table.get(seq.key_id)
    if key is None:
        raise UnknownSequencerKey(f"sequencer signed by unknown key {seq.key_id.hex()}")
    if key.algorithm != seq.algorithm:
        raise BadSequencerSignature(f"sequencer claims {seq.algorithm}, key {seq.key_id.hex()} is {key.algorithm}")
    if key.algorithm == "hmac-sha256":
        expected = hmac.new(key.key, message, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, signature):
            raise BadSequencerSignature("sequencer signature does not match (forged or altered)")
    else:
        public = _public_key(key.key)  # raises ImportError without cryptography
        from cryptography.exceptions import InvalidSignature
        try:
            public.verify(signature, message)
        except InvalidSignature:
            raise BadSequencerSignature("sequencer signature does not match (forged or altered)") from None
    if name is not None and seq.name != name:
        raise WrongSequencerName(f"sequencer is for {seq.name!r}, not {name!r}")
    if taken is not None and seq.mode not in taken:
        raise WrongSequencerMode(f"sequencer for {seq.name!r} token {seq.token} is of a {seq.mode} lease, held by "
                                 f"several clients at once; this verifier takes {', '.join(sorted(taken))} only")
    if skew is not None:
        wall = time.time() if now is None else now
        late_ms = wall * 1000 - seq.expires_at_ms
        if late_ms > skew * 1000:
            raise ExpiredSequencer(f"sequencer for {seq.name!r} token {seq.token} expired "
                                   f"{late_ms / 1000:.3f} s ago (allowance {skew} s)")
    return seq


_PUBLIC_CACHE: dict[bytes, Any] = {}


def _public_key(raw: bytes) -> Any:
    pk = _PUBLIC_CACHE.get(raw)
    if pk is None:
        pk = _need_ed25519().Ed25519PublicKey.from_public_bytes(raw)
        if len(_PUBLIC_CACHE) < 64:  # the keys of a few groups across rotations
            _PUBLIC_CACHE[raw] = pk
    return pk


# -- key files ----------------------------------------------------------------------------------


def keys_to_text(keys: Iterable[VerifyKey]) -> str:
    """Verify keys as text, one a line: ``fastlock-sequencer-key <algorithm> <key id hex> <key
    base64url>`` (what ``fastlock credentials sequencer-key --public`` prints)."""
    return "".join(f"fastlock-sequencer-key {k.algorithm} {k.key_id.hex()} {to_text(k.key)}\n" for k in keys)


def keys_from_text(text: str) -> list[VerifyKey]:
    """The verify keys of :func:`keys_to_text`'s text (blank lines and ``#`` comments skipped).

    :raises MalformedSequencer: a line that is not a key, or whose id does not match its key."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 4 or parts[0] != "fastlock-sequencer-key":
            raise MalformedSequencer(f"line {number}: not 'fastlock-sequencer-key ALGORITHM ID KEY'")
        key = VerifyKey.of(parts[1], from_text(parts[3]))
        if key.key_id.hex() != parts[2]:
            raise MalformedSequencer(f"line {number}: key id {parts[2]} does not match its key ({key.key_id.hex()})")
        out.append(key)
    return out
