"""Which credential a client presents: one rule for :func:`fastlock.connect`, the
blocking client, ``fastlock run`` and every ``fastlock`` command.

An explicit argument always beats the environment, a token beats the legacy
shared secret, and a variable fills in only what the caller left out:

1. ``token`` (the token itself);
2. ``token_file`` (``--token-file``);
3. ``auth``, the legacy shared secret (``--auth-secret-file``'s content);
4. the file named by ``$FASTLOCK_TOKEN_FILE``;
5. ``$FASTLOCK_AUTH_SECRET``, the legacy shared secret itself;
6. none (the server's anonymous principal, or a TLS certificate's identity).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import InvalidArgument
from .credentials import MAX_TOKEN_CHARS, read_token_file

__all__ = ["resolve_credential"]


def resolve_credential(*, token: str | None = None, token_file: str | os.PathLike[str] | None = None,
                       auth: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The credential a client proves in its HELLO (the module docstring's order); None: none.

    Args:
        token: a principal's token.
        token_file: a file holding one (read with :func:`~fastlock.auth.read_token_file`).
        auth: the legacy shared secret.
        env: the environment (default :data:`os.environ`).

    Raises:
        InvalidArgument: both ``token`` and ``token_file``, an empty or over-long
            (1024 characters) token or secret, or ``$FASTLOCK_AUTH_SECRET`` set but blank.
        CredentialsError: a token file that cannot be read or is empty.
    """
    env = os.environ if env is None else env
    if token is not None and token_file is not None:
        raise InvalidArgument("give token or token_file, not both")
    if token is None and token_file is not None:
        token = read_token_file(token_file)
    if token is None and auth is None:
        path = env.get("FASTLOCK_TOKEN_FILE")
        if path:
            token = read_token_file(path)
        else:
            value = env.get("FASTLOCK_AUTH_SECRET")
            if value is not None and not value.strip():
                raise InvalidArgument("FASTLOCK_AUTH_SECRET is set but empty")
            auth = value.strip() if value is not None else None
    if token is not None:
        if type(token) is not str or not token or len(token) > MAX_TOKEN_CHARS:
            raise InvalidArgument(f"a token is a non-empty str of at most {MAX_TOKEN_CHARS} characters")
        return token
    if auth is not None and (type(auth) is not str or not auth or len(auth) > MAX_TOKEN_CHARS):
        raise InvalidArgument(f"the auth secret must be a non-empty str of at most {MAX_TOKEN_CHARS} characters")
    return auth
