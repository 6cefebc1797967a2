"""Argument validators shared by the client and the server.

The client refuses a bad argument with :class:`~fastlock.errors.InvalidArgument`
(or :class:`~fastlock.errors.WrongArgumentType`) before anything is sent; a
server refuses the same argument, from a client that did not check, with the
same message.  Times here are integer **milliseconds**, as on the wire; the
Python API's seconds are checked and converted by :mod:`fastlock.units`
(:func:`seconds_to_ms` is re-exported here for the callers of this module).
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgument, WrongArgumentType
from ..units import seconds_to_ms
from .ops import MAX_EPOCH

__all__ = [
    "MAX_CLIENT_NAME_CHARS", "MAX_CORRELATION_ID_CHARS", "MAX_LIMIT", "MAX_LOCK_DELAY_MS", "MAX_MANY",
    "MAX_NAME_BYTES", "MAX_ACTOR", "check_actor", "check_bytes", "check_limit", "check_many_items",
    "MAX_OWNER_BYTES", "MAX_RECORDED_TTL_MS", "MAX_TTL_MS", "MAX_WAIT_MS", "MIN_TTL_MS", "check_epoch",
    "check_lock_delay_ms", "check_name", "check_optional_str", "check_owner", "check_recorded_ttl_ms", "check_shared",
    "check_token", "check_ttl_ms", "check_wait_ms", "seconds_to_ms",
]

# limits of the arguments (units in the names)
MAX_NAME_BYTES = 512
MIN_TTL_MS = 1
#: the longest TTL an acquire or extend may ask: 1 hour.  A lease held longer is renewed
#: (``lock()``, ``extend()``); a longer TTL is almost always milliseconds given where seconds
#: are meant (Redis's ``PX`` habit: ``ttl=10000`` would be 2.8 hours), and a promoted standby
#: waits out the longest TTL granted before it grants free locks
MAX_TTL_MS = 3600 * 1000
#: the longest TTL a recorded lease may carry (a snapshot from a fastlock that allowed 24 h)
MAX_RECORDED_TTL_MS = 24 * 3600 * 1000
MAX_WAIT_MS = 24 * 3600 * 1000
MAX_LOCK_DELAY_MS = 60_000
MAX_OWNER_BYTES = 64
MAX_CORRELATION_ID_CHARS = 256
MAX_CLIENT_NAME_CHARS = 128
#: the largest semaphore limit (equal to ``fastlock._core.MAX_LIMIT``)
MAX_LIMIT = (1 << 31) - 1
#: the most names in one ACQUIRE_MANY (equal to ``fastlock._core.MAX_MANY``)
MAX_MANY = 64
#: the largest actor (who waits within a session: deadlock detection's party)
MAX_ACTOR = (1 << 63) - 1


def check_name(name: Any) -> str:
    """A lock name: non-empty str, at most 512 bytes of UTF-8, no NUL."""
    if type(name) is not str:
        raise WrongArgumentType(f"lock name must be str, not {type(name).__name__}")
    if name.isascii() and 0 < len(name) <= MAX_NAME_BYTES and "\x00" not in name:
        return name  # the common case: ASCII is one byte per character, nothing to encode
    if not name:
        raise InvalidArgument("lock name must not be empty")
    try:
        n = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument("lock name must be valid UTF-8 (no lone surrogates)") from None
    if n > MAX_NAME_BYTES:
        raise InvalidArgument(f"lock name is {n} bytes of UTF-8; the limit is {MAX_NAME_BYTES}")
    if "\x00" in name:
        raise InvalidArgument("lock name must not contain NUL")
    return name


def check_ttl_ms(ttl_ms: Any) -> int:
    if type(ttl_ms) is not int:  # bool is refused on purpose
        raise WrongArgumentType(f"ttl must be an integer number of milliseconds, not {type(ttl_ms).__name__}")
    if ttl_ms > MAX_TTL_MS:
        raise InvalidArgument(f"ttl {ttl_ms / 1000:g} s ({ttl_ms / 3_600_000:.1f} hours) is above the longest "
                              f"lease TTL, {MAX_TTL_MS // 1000} s (1 hour): a TTL is in seconds in the Python API "
                              f"and the command line (ttl=10 is 10 s); hold a lock longer by renewing it "
                              f"(lock(), extend())")
    if ttl_ms < MIN_TTL_MS:
        raise InvalidArgument(f"ttl must be at least {MIN_TTL_MS} ms, got {ttl_ms} ms")
    return ttl_ms


def check_recorded_ttl_ms(ttl_ms: Any) -> int:
    """A recorded lease's TTL (a snapshot's holder): ``MIN_TTL_MS..MAX_RECORDED_TTL_MS`` ms.

    Raises:
        WrongArgumentType: not an int.  InvalidArgument: out of that range.
    """
    if type(ttl_ms) is not int:
        raise WrongArgumentType(f"ttl must be an integer number of milliseconds, not {type(ttl_ms).__name__}")
    if not MIN_TTL_MS <= ttl_ms <= MAX_RECORDED_TTL_MS:
        raise InvalidArgument(f"a recorded ttl must be {MIN_TTL_MS}..{MAX_RECORDED_TTL_MS} ms, got {ttl_ms} ms")
    return ttl_ms


def check_wait_ms(wait_ms: Any) -> int:
    if type(wait_ms) is not int:  # bool is refused on purpose
        raise WrongArgumentType(f"wait must be an integer number of milliseconds, not {type(wait_ms).__name__}")
    if not (wait_ms == -1 or 0 <= wait_ms <= MAX_WAIT_MS):
        raise InvalidArgument(f"wait must be -1 (forever) or 0..{MAX_WAIT_MS} ms, got {wait_ms}")
    return wait_ms


def check_lock_delay_ms(delay_ms: Any) -> int:
    if type(delay_ms) is not int:  # bool is refused on purpose
        raise WrongArgumentType(f"lock_delay must be an integer number of milliseconds, not {type(delay_ms).__name__}")
    if not 0 <= delay_ms <= MAX_LOCK_DELAY_MS:
        raise InvalidArgument(f"lock_delay must be 0..{MAX_LOCK_DELAY_MS} ms, got {delay_ms}")
    return delay_ms


def check_shared(shared: Any) -> bool:
    """A shared (read) lease: True, or False for an exclusive one."""
    if type(shared) is not bool:
        raise WrongArgumentType(f"shared must be a bool, not {type(shared).__name__}")
    return shared


def check_actor(actor: Any) -> int:
    """Who makes an acquire within its session (a client's task or thread): an int in
    0..MAX_ACTOR, 0 standing for the whole session (see DeadlockDetected)."""
    if type(actor) is not int:  # bool is refused on purpose
        raise WrongArgumentType(f"actor must be an int, not {type(actor).__name__}")
    if not 0 <= actor <= MAX_ACTOR:
        raise InvalidArgument(f"actor must be 0..{MAX_ACTOR}, got {actor}")
    return actor


def check_limit(limit: Any) -> int:
    """A semaphore limit: 1..MAX_LIMIT holders, or 0 for a lock."""
    if type(limit) is not int:  # bool is refused on purpose
        raise WrongArgumentType(f"limit must be an int, not {type(limit).__name__}")
    if not 0 <= limit <= MAX_LIMIT:
        raise InvalidArgument(f"limit must be 1..{MAX_LIMIT} (a semaphore) or 0 (a lock), got {limit}")
    return limit


def check_many_items(items: Any) -> list[tuple[str, bool]]:
    """The names of one atomic multi-lock: a list of 1..MAX_MANY ``[name, shared]``
    pairs with distinct names."""
    if type(items) is not list:
        raise WrongArgumentType(f"the names must be a list of [name, shared] pairs, not {type(items).__name__}")
    if not 1 <= len(items) <= MAX_MANY:
        raise InvalidArgument(f"a multi-lock takes 1..{MAX_MANY} names, got {len(items)}")
    out = []
    for item in items:
        if type(item) not in (list, tuple) or len(item) != 2:
            raise WrongArgumentType("each name of a multi-lock must be a [name, shared] pair")
        out.append((check_name(item[0]), check_shared(item[1])))
    if len({name for name, _ in out}) != len(out):
        raise InvalidArgument("a multi-lock names each lock once")
    return out


def check_bytes(value: Any, what: str, most: int) -> bytes:
    """``value`` if it is bytes of 1..``most`` bytes, named ``what`` in the error.

    :raises WrongArgumentType: not bytes.
    :raises InvalidArgument: empty or longer than ``most`` bytes.
    """
    if type(value) is not bytes:
        raise WrongArgumentType(f"{what} must be bytes, not {type(value).__name__}")
    if not 1 <= len(value) <= most:
        raise InvalidArgument(f"{what} must be 1..{most} bytes, not {len(value)}")
    return value


def check_owner(owner: Any) -> bytes:
    """An owner key: 1..MAX_OWNER_BYTES bytes (:func:`check_bytes`)."""
    return check_bytes(owner, "owner key", MAX_OWNER_BYTES)


def check_token(token: Any) -> int:
    if type(token) is not int:  # bool is refused on purpose
        raise WrongArgumentType(f"fencing token must be int, not {type(token).__name__}")
    if not 0 < token < (1 << 63):
        raise InvalidArgument("fencing token out of range (1 .. 2**63-1)")
    return token


def check_epoch(epoch: Any, what: str = "epoch") -> int:
    """An epoch from the wire: an int in 0..MAX_EPOCH (so its tokens stay below 2**63)."""
    if type(epoch) is not int:  # bool is refused on purpose
        raise WrongArgumentType(f"{what} must be int, not {type(epoch).__name__}")
    if not 0 <= epoch <= MAX_EPOCH:
        raise InvalidArgument(f"{what} {epoch} out of range (0 .. {MAX_EPOCH}: tokens must stay below 2**63)")
    return epoch


def check_optional_str(value: Any, what: str, limit: int) -> str | None:
    if value is None:
        return None
    if type(value) is not str:
        raise WrongArgumentType(f"{what} must be str or None, not {type(value).__name__}")
    if len(value) > limit:
        raise InvalidArgument(f"{what} is longer than {limit} characters")
    return value
