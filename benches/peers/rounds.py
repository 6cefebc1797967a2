"""Interleaved rounds: the run order, and one median row per (target, workload).

A run of ``--rounds N`` measures every system N times, round-robin: round r
runs the whole list of systems (rotated by r, so no system is always first
after the machine settled), then round r+1 does the same again.  This module is
pure (no servers, no clock): it orders the work and merges the per-round rows.
"""

from __future__ import annotations

import math
from typing import Any

# figures whose per-round min, max and values go in the merged row's "spread"
SPREAD_FIELDS = (
    "pair_us.p50", "pair_us.p99", "acquire_us.p50", "release_us.p50", "pairs_per_s", "handoffs_per_s",
    "owner_changes_per_s", "jain", "client_cpu_pct", "server_cpu_pct",
)
MAX_ERRORS = 10


def schedule(items: list, rounds: int) -> list[tuple[int, Any]]:
    """``(round, item)`` pairs: all items in round 0, then all in round 1, ...; round r rotated by r.

    :raises ValueError: ``rounds`` < 1.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    out: list[tuple[int, Any]] = []
    n = len(items)
    for r in range(rounds):
        k = r % n if n else 0
        out += [(r, it) for it in items[k:] + items[:k]]
    return out


def median(values: list[float]) -> float:
    """Median of the values that are not NaN (mean of the middle two for an even count); NaN if none."""
    xs = sorted(v for v in values if not (isinstance(v, float) and math.isnan(v)))
    if not xs:
        return float("nan")
    mid = len(xs) // 2
    return float(xs[mid]) if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _merge_values(values: list[Any]) -> Any:
    """One value for a field seen in several rounds (see :func:`merge_rows`)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(_is_number(v) for v in present):
        return median(present)
    if all(isinstance(v, bool) for v in present):
        return all(present)
    if all(isinstance(v, dict) for v in present):
        keys = list(dict.fromkeys(k for d in present for k in d))
        return {k: _merge_values([d.get(k) for d in present]) for k in keys}
    return present[0]


def get_path(row: dict, path: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; None when any part is missing."""
    cur: Any = row
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def spread(rows: list[dict], fields: tuple[str, ...] = SPREAD_FIELDS) -> dict[str, dict[str, Any]]:
    """``{field: {"min", "max", "values"}}`` over the rows (per-round order) for the numeric fields present."""
    out: dict[str, dict[str, Any]] = {}
    for f in fields:
        vals = [get_path(r, f) for r in rows]
        nums = [v for v in vals if _is_number(v) and not math.isnan(v)]
        if nums:
            out[f] = {"min": min(nums), "max": max(nums), "values": vals}
    return out


def is_measured(row: dict) -> bool:
    """A row with figures (an error row has only its target, workload and errors)."""
    return "pair_us" in row


def merge_rows(rows: list[dict]) -> list[dict]:
    """One row per (target, workload), in first-seen order, from the rows of every round.

    Numbers (nested ones too) become the median over the rounds that measured
    them; booleans hold only if they held in every round (``tokens_increasing``);
    strings and lists come from the first measured round; ``errors`` are joined
    (at most 10) and ``error_count`` summed over all rounds.  The merged row adds
    ``rounds`` (rounds measured), ``rounds_failed`` and ``spread`` (see
    :func:`spread`) and drops the per-round ``round`` number.  A (target, workload) that no round measured keeps its
    first error row, with the errors of all rounds.
    """
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r.get("target", "?"), r.get("workload", "?")), []).append(r)
    merged: list[dict] = []
    for group in groups.values():
        ok = [r for r in group if is_measured(r)]
        errors = [e for r in group for e in r.get("errors", [])]
        if ok:
            keys = list(dict.fromkeys(k for r in ok for k in r if k != "round"))
            m = {k: _merge_values([r.get(k) for r in ok]) for k in keys}
            m["spread"] = spread(ok)
        else:
            m = dict(group[0])
        m["errors"] = errors[:MAX_ERRORS]
        m["error_count"] = sum(r.get("error_count", 0) for r in group)
        m["rounds"] = len(ok)
        m["rounds_failed"] = len(group) - len(ok)
        merged.append(m)
    return merged


def merge_probes(probes: list[dict]) -> dict[str, Any] | None:
    """The fsync probes of every round as one: medians of each figure, per-round p50/p99 in ``spread``."""
    if not probes:
        return None
    m = _merge_values([{k: v for k, v in p.items() if k != "round"} for p in probes])
    m["rounds"] = len(probes)
    m["spread"] = spread(probes, ("append.p50", "append.p99", "overwrite.p50", "overwrite.p99"))
    return m
