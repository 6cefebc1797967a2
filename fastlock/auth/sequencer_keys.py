"""The group's sequencer keys in the credentials file (:mod:`fastlock.sequencer`).

They live in ``credentials.toml`` beside the principals, so every node of a pair or
group that shares the file signs with the same key, and a promoted standby's sequencers
verify with the keys the resources already hold.  One ``[[sequencer_keys]]`` table per
key, at the end of the file::

    [[sequencer_keys]]
    id = "43c6789d8daec12a"       # fastlock.sequencer.key_id_of: checked against the key
    algorithm = "ed25519"         # or "hmac-sha256"
    secret = "<64 hex digits>"    # the Ed25519 private seed, or the HMAC secret
    signing = true                # at most one key signs; the others only verify (rotation)

Rotation with an overlap (``fastlock credentials sequencer-key DIR``): add a key that only
verifies (``--add``), give its public key to every resource (``--public``), copy the file
to every node, then make it the signing key (``--sign ID``) and, once no lease signed by
the old key can still be alive, retire the old one (``--retire ID``).  The secrets never
leave the file: only public keys (Ed25519) are printed; an HMAC secret is printed only
when asked for by name (``--hmac-secret ID``), for a resource that verifies with it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import FastlockError
from ..sequencer import ALGORITHMS, MalformedSequencer, SigningKey, VerifyKey, new_signing_key

__all__ = ["SequencerKeyError", "SequencerKeys", "parse_sequencer_keys", "sequencer_key_lines", "add_key",
           "set_signing", "retire_key", "read_keys"]

_HEX = re.compile(r"^[0-9a-f]+$")
_TABLE = "[[sequencer_keys]]"


class SequencerKeyError(FastlockError, ValueError):
    """A malformed ``[[sequencer_keys]]`` table, or a key operation that cannot be done
    (:class:`fastlock.auth.CredentialsError` when raised while loading credentials)."""


@dataclass(frozen=True)
class SequencerKeys:
    """The sequencer keys of a credentials file: ``keys`` in file order, ``signing`` the one
    the server signs with (None: this server hands out no sequencers)."""

    keys: tuple[SigningKey, ...] = ()
    signing: SigningKey | None = None

    @property
    def verify_keys(self) -> list[VerifyKey]:
        """Every key's verify key (what a resource of this group trusts)."""
        return [k.verify_key for k in self.keys]


def parse_sequencer_keys(entries: Any, where: str) -> SequencerKeys:
    """The ``sequencer_keys`` array of a credentials file (absent: none).

    :raises SequencerKeyError: a malformed entry, an id that does not match its key, two
        signing keys, or a repeated id."""
    if entries is None:
        return SequencerKeys()
    if not isinstance(entries, list):
        raise SequencerKeyError(f"{where}: sequencer_keys is an array of tables ([[sequencer_keys]])")
    keys: list[SigningKey] = []
    signing = None
    for n, entry in enumerate(entries):
        what = f"{where}: sequencer key {n + 1}"
        if not isinstance(entry, dict) or set(entry) - {"id", "algorithm", "secret", "signing"}:
            raise SequencerKeyError(f"{what}: a table of id, algorithm, secret, signing")
        algorithm, secret, kid = entry.get("algorithm"), entry.get("secret"), entry.get("id")
        if algorithm not in ALGORITHMS:
            raise SequencerKeyError(f"{what}: algorithm is one of {', '.join(ALGORITHMS)}, not {algorithm!r}")
        if type(secret) is not str or not _HEX.match(secret) or len(secret) % 2:
            raise SequencerKeyError(f"{what}: secret is lowercase hex")
        try:
            key = SigningKey.of(algorithm, bytes.fromhex(secret))
        except (MalformedSequencer, ImportError) as exc:
            raise SequencerKeyError(f"{what}: {exc}") from None
        if kid != key.key_id.hex():
            raise SequencerKeyError(f"{what}: id {kid!r} does not match its key ({key.key_id.hex()})")
        if any(k.key_id == key.key_id for k in keys):
            raise SequencerKeyError(f"{what}: id {kid} repeated")
        flag = entry.get("signing", False)
        if type(flag) is not bool:
            raise SequencerKeyError(f"{what}: signing is true or false")
        if flag:
            if signing is not None:
                raise SequencerKeyError(f"{what}: only one sequencer key signs ({signing.key_id.hex()} does)")
            signing = key
        keys.append(key)
    return SequencerKeys(tuple(keys), signing)


def sequencer_key_lines(keys: Iterable[SigningKey], signing: SigningKey | None) -> list[str]:
    """The TOML lines of the ``[[sequencer_keys]]`` tables (each ending with a blank line)."""
    lines = []
    for key in keys:
        lines += [_TABLE, f'id = "{key.key_id.hex()}"', f'algorithm = "{key.algorithm}"',
                  f'secret = "{key.secret.hex()}"',
                  f"signing = {'true' if signing is not None and key.key_id == signing.key_id else 'false'}", ""]
    return lines


def read_keys(path: str | os.PathLike[str]) -> SequencerKeys:
    """The sequencer keys of the credentials file at ``path``.

    :raises SequencerKeyError: unreadable or malformed."""
    import tomllib
    where = os.fspath(path)
    try:
        with open(where, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SequencerKeyError(f"cannot read {where}: {exc}") from None
    return parse_sequencer_keys(data.get("sequencer_keys"), where)


def _rewrite(path: str, keys: SequencerKeys) -> None:
    """Replace the ``[[sequencer_keys]]`` tables at the end of the file (written by
    ``credentials init`` and this module) with ``keys``; the rest of the file is kept."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    head = lines
    if _TABLE in lines:
        first = lines.index(_TABLE)
        head = lines[:first]
        if any(ln.strip().startswith("[") and ln.strip() != _TABLE for ln in lines[first:]):
            raise SequencerKeyError(f"{path}: the [[sequencer_keys]] tables must come last: move them by hand")
    while head and not head[-1].strip():
        head.pop()
    text = "\n".join([*head, "", *sequencer_key_lines(keys.keys, keys.signing)])
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def add_key(path: str, algorithm: str = "ed25519") -> SigningKey:
    """Add a fresh key to the credentials file at ``path``: it signs if no key does yet,
    otherwise it only verifies until :func:`set_signing` (the overlap of a rotation)."""
    current = read_keys(path)
    key = new_signing_key(algorithm)
    _rewrite(path, SequencerKeys((*current.keys, key), current.signing or key))
    return key


def _find(keys: SequencerKeys, key_id: str, path: str) -> SigningKey:
    for key in keys.keys:
        if key.key_id.hex() == key_id:
            return key
    known = ", ".join(k.key_id.hex() for k in keys.keys)
    raise SequencerKeyError(f"{path}: no sequencer key {key_id!r} (known: {known})")


def set_signing(path: str, key_id: str) -> None:
    """Make key ``key_id`` (hex) the signing key; the others stay, verifying only."""
    current = read_keys(path)
    _rewrite(path, SequencerKeys(current.keys, _find(current, key_id, path)))


def retire_key(path: str, key_id: str) -> None:
    """Remove key ``key_id`` (hex): sequencers it signed are refused from then on by
    servers and resources that reload the keys.  The signing key cannot be retired."""
    current = read_keys(path)
    key = _find(current, key_id, path)
    if current.signing is not None and key.key_id == current.signing.key_id:
        raise SequencerKeyError(f"{path}: {key_id} is the signing key: make another key sign first (--sign ID)")
    _rewrite(path, SequencerKeys(tuple(k for k in current.keys if k.key_id != key.key_id), current.signing))
