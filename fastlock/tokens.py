"""The layout of a fencing token, the one place it is written for Python code.

A fencing token is a 63-bit integer ``epoch << TOKEN_EPOCH_SHIFT | counter``: the
epoch (raised by each promotion) in the high 23 bits, the node's grant counter in
the low 40.  Tokens therefore grow across failovers, as a writer that fences on
them needs.  The compiled core (``fastlock/_core.pyx``) keeps the same numbers in C
(``fastlock._core.TOKEN_EPOCH_SHIFT``, ``MAX_EPOCH``, ``MAX_COUNTER``); a test
checks that they agree.

A leaf module: it imports nothing from fastlock, so the client, the server, the
write-ahead log and the test base all read tokens through it.
"""

from __future__ import annotations

__all__ = ["TOKEN_EPOCH_SHIFT", "COUNTER_MASK", "MAX_EPOCH", "epoch_of", "counter_of", "make_token",
           "format_token"]

#: bits of a fencing token below the epoch
TOKEN_EPOCH_SHIFT = 40
#: the counter's bits of a token (``token & COUNTER_MASK``); also the largest counter
COUNTER_MASK = (1 << TOKEN_EPOCH_SHIFT) - 1
#: the largest epoch: every token stays below ``2**63``
MAX_EPOCH = (1 << (63 - TOKEN_EPOCH_SHIFT)) - 1


def epoch_of(token: int) -> int:
    """The epoch (int) that issued ``token`` (int): its high bits."""
    return token >> TOKEN_EPOCH_SHIFT


def counter_of(token: int) -> int:
    """The grant counter (int) of ``token`` (int) within its epoch: its low 40 bits."""
    return token & COUNTER_MASK


def make_token(epoch: int, counter: int) -> int:
    """The token (int) of grant ``counter`` in ``epoch``.

    :raises ValueError: ``epoch`` not in 0..MAX_EPOCH or ``counter`` not in 0..COUNTER_MASK.
    """
    if not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"epoch must be 0..{MAX_EPOCH}, got {epoch}")
    if not 0 <= counter <= COUNTER_MASK:
        raise ValueError(f"counter must be 0..{COUNTER_MASK}, got {counter}")
    return epoch << TOKEN_EPOCH_SHIFT | counter


def format_token(token: int) -> str:
    """``"<token> (<epoch>/<counter>)"``, as ``wal dump`` shows a token."""
    return f"{token} ({epoch_of(token)}/{counter_of(token)})"
