"""What each principal may hold: :class:`Quota` (one per-principal limit) and the
default shares of the global caps (:func:`quota_limits`, :func:`output_share`).

By default a principal may hold a quarter (1/:data:`PRINCIPAL_SHARE`) of each global
cap and the ``anonymous`` principal a further ``1/--anonymous-quota-divisor`` of
that; where at most one client principal can connect (:func:`client_principals`)
there is nobody to share with and the defaults are off.  :mod:`.admission` counts
what each principal holds against these quotas.
"""

from __future__ import annotations

from ..auth import ANONYMOUS, Credentials
from ..errors import LimitExceeded
from .config import ServerConfig

#: a principal's default quota of each resource: 1/PRINCIPAL_SHARE of the global cap
PRINCIPAL_SHARE = 4


def limit_exceeded(limit: int, who: str, what: str, flag: str) -> LimitExceeded:
    """The refusal of one more of ``what`` to ``who`` at ``limit``:
    "``who`` already has ``limit`` ``what`` (--``flag``)" (returned, for the caller to raise)."""
    return LimitExceeded(f"{who} already has {limit} {what} (--{flag})")


def client_principals(credentials: Credentials) -> int:
    """How many client principals can connect with ``credentials``: those of the file,
    the anonymous principal when allowed, the legacy shared secret's (admins and
    replicas hold no share: they have the reserved connections)."""
    named = sum(p.kind == "client" for p in credentials.principals.values())
    return named + (credentials.anonymous is not None) + (credentials.shared_secret is not None)


def default_share(cap: int) -> int:
    """A principal's default quota of a global ``cap``: ``cap // PRINCIPAL_SHARE`` (at least 1)."""
    return max(1, cap // PRINCIPAL_SHARE)


class Quota:
    """One per-principal limit: ``limit`` of ``what`` per principal (0: none), the
    ``anonymous`` principal's ``anonymous_limit``; set by ``--flag``."""

    __slots__ = ("limit", "anonymous_limit", "what", "flag")

    def __init__(self, limit: int, anonymous_limit: int, what: str, flag: str):
        self.limit = limit
        self.anonymous_limit = anonymous_limit
        self.what = what
        self.flag = flag

    def limit_for(self, principal: str) -> int:
        """The quota of ``principal`` (0: none)."""
        return self.anonymous_limit if principal == ANONYMOUS else self.limit

    def check(self, principal: str, have: int, adding: int = 1) -> None:
        """Raise :class:`LimitExceeded` if ``principal``, which has ``have``, may not
        have ``adding`` more (never with no quota)."""
        limit = self.anonymous_limit if principal == ANONYMOUS else self.limit
        if limit and have + adding > limit:
            if adding == 1 or have >= limit:
                raise limit_exceeded(limit, f"principal {principal!r}", self.what, self.flag)
            raise LimitExceeded(f"principal {principal!r} has {have} of its {limit} {self.what}: "
                                f"{adding} more would pass the quota (--{self.flag})")


def quota_limits(config: ServerConfig, single_principal: bool, max_connections: int) -> dict[str, tuple[int, int]]:
    """Each resource's quota as ``(principal's, anonymous principal's)``.

    A quota left at None is the default share of its global cap (1/4, and the
    anonymous principal's a further ``1/anonymous_quota_divisor`` of that: 1/16);
    0 is none.  ``single_principal`` (one client principal at most can connect, see
    :func:`client_principals`: open mode, the shared secret alone, or a credentials
    file with one client and no anonymous access) leaves the defaults off and gives
    the anonymous principal the same quotas as any, as there is nobody to share with;
    set quotas still apply.
    """
    caps = {"leases": config.max_leases, "waiters": config.max_waiters, "watches": config.max_watches,
            "keys": config.max_keys, "connections": max_connections, "key_bytes": config.max_key_bytes}
    out = {}
    for what, cap in caps.items():
        value = getattr(config, f"max_{what}_per_principal")
        if value is None:
            value = 0 if single_principal else default_share(cap)
        divisor = 1 if single_principal else config.anonymous_quota_divisor
        anonymous = max(1, value // divisor) if value else 0
        out[what] = (value, anonymous)
    return out


def output_share(config: ServerConfig, single_principal: bool) -> Quota:
    """Each principal's share of unread replies (bytes), as :func:`quota_limits` shares the
    other caps: None is a quarter of ``--max-output-bytes-total`` (the anonymous principal's
    a sixteenth); with one client principal at most, the total."""
    share = config.max_output_bytes_per_principal
    if share is None:
        share = config.max_output_bytes_total if single_principal else default_share(config.max_output_bytes_total)
    divisor = 1 if single_principal else config.anonymous_quota_divisor
    return Quota(share, max(1, share // divisor) if share else 0, "bytes of unread replies",
                 "max-output-bytes-per-principal")
