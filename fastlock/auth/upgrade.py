"""``fastlock credentials upgrade DIR``: a format-1 credentials file rewritten as format 2.

Format 1 stored ``token_sha256`` per principal (and ``primary_proof_key`` per
replica); format 2 stores the handshake's ``stored_key`` and ``server_key``
(:mod:`fastlock.auth.handshake`).  Neither can be computed from the other, so
the upgrade reads each principal's token from ``DIR/<principal>.token`` (as
``fastlock credentials init`` left them), checks it against the stored
hash, and writes the keys.  Tokens are unchanged: clients need no change.
"""

from __future__ import annotations

import os
import tempfile

from .credentials import (
    FILE_HEADER,
    CredentialsError,
    hash_token,
    principal_lines,
    read_token_file,
    read_toml,
)
from .handshake import derive_keys

__all__ = ["upgrade"]

_V1_KEYS = {"kind", "token_sha256", "acl", "node_id", "primary_proof_key", "cert_identities"}


def upgrade(directory: str | os.PathLike) -> list[str]:
    """Rewrite ``DIR/credentials.toml`` from format 1 to format 2.

    Every principal with a ``token_sha256`` needs ``DIR/<principal>.token``
    holding the token of that hash.  The new file replaces the old one
    atomically (a temporary file in DIR, fsynced, renamed), mode 0600;
    comments of the old file are not kept.  Returns the names of the
    principals whose keys were derived.

    Raises:
        CredentialsError: the file is missing, unreadable, not format 1, or a
            principal's token file is missing or holds another token; nothing
            is written then.
    """
    directory = os.fspath(directory)
    path = os.path.join(directory, "credentials.toml")
    data = read_toml(path)
    if data.get("version", 1) != 1:
        raise CredentialsError(f"{path}: version {data.get('version')!r}, not format 1: nothing to upgrade")
    table = data.get("principals")
    if not isinstance(table, dict) or not table:
        raise CredentialsError(f"{path}: no [principals.NAME] tables")
    lines = list(FILE_HEADER)
    derived = []
    missing = []
    for name, entry in table.items():
        if not isinstance(entry, dict) or set(entry) - _V1_KEYS:
            raise CredentialsError(f"{path}: principal {name!r}: not a format-1 principal table")
        keys = None
        stored_hash = entry.get("token_sha256")
        if stored_hash is not None:
            token_path = os.path.join(directory, f"{name}.token")
            if not os.path.exists(token_path):
                missing.append(name)
                continue
            token = read_token_file(token_path)
            if hash_token(token).hex() != stored_hash:
                raise CredentialsError(f"{token_path} does not hold the token whose hash {path} stores for "
                                       f"{name!r}: nothing written")
            keys = derive_keys(token)
            derived.append(name)
        lines += principal_lines(str(name), str(entry.get("kind")), keys, entry.get("acl"),
                                 entry.get("node_id"), entry.get("cert_identities"))
    if missing:
        raise CredentialsError(f"no token file beside {path} for {', '.join(repr(m) for m in missing)} "
                               f"(expected {os.path.join(directory, '<principal>.token')}): nothing written; "
                               f"put each principal's token file there, or make new credentials with "
                               f"`fastlock credentials init`")
    text = "\n".join(lines)
    fd, tmp = tempfile.mkstemp(prefix=".credentials.", suffix=".toml", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return derived
