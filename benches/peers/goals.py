"""Issue 12's and issue 27's targets as data, their verdicts, and the README's comparison table.

Each goal reads ``lhs OP need × rhs``: ``lhs`` is one measured figure, ``rhs``
the sum of ``coef × figure`` terms (1 when there are none), and ``ratio`` is
``lhs / rhs``.  A figure is named ``"<row target>/<workload>/<field path>"``
(a merged row of ``benches.peers``) or ``"probe/<field path>"`` (the fsync
probe of the same run); a field path of :data:`DERIVED` is computed from the
row (``us_per_handoff``: microseconds per W3 hand-off, ``1e6 / handoffs_per_s``).
Pure functions of a results payload: no servers.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

from benches.peers.rounds import get_path

ALWAYS = "fastlock fsync=always"
NEVER = "fastlock fsync=never"
POSTGRES = "postgres advisory"
REDIS = "redis SET NX"
ECHO = "echo floor"
PROBE_P50 = "probe/overwrite.p50"  # what the WAL pays per durable batch: 4 KiB into preallocated space + fdatasync

OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge}


@dataclass(frozen=True)
class Goal:
    key: str
    text: str
    lhs: str
    op: str                                   # one of OPS
    need: float
    rhs: tuple[tuple[float, str], ...] = ()   # (coef, figure) terms summed; () means 1


GOALS: tuple[Goal, ...] = (
    Goal("w1-durable", "W1 p50 always ≤ W1 p50 never + 1.0 × fsync probe p50",
         f"{ALWAYS}/W1/pair_us.p50", "<=", 1.0, ((1.0, f"{NEVER}/W1/pair_us.p50"), (1.0, PROBE_P50))),
    Goal("w1-never-vs-pg", "W1 p50 never < PostgreSQL advisory",
         f"{NEVER}/W1/pair_us.p50", "<", 1.0, ((1.0, f"{POSTGRES}/W1/pair_us.p50"),)),
    Goal("w2-always-vs-pg", "W2 pairs/s always ≥ 1.5 × PostgreSQL advisory",
         f"{ALWAYS}/W2/pairs_per_s", ">=", 1.5, ((1.0, f"{POSTGRES}/W2/pairs_per_s"),)),
    Goal("w2-never-vs-redis", "W2 pairs/s never ≥ 2.5 × Redis SET NX",
         f"{NEVER}/W2/pairs_per_s", ">=", 2.5, ((1.0, f"{REDIS}/W2/pairs_per_s"),)),
    Goal("w3-always-vs-never", "W3 hand-offs/s always ≥ 0.95 × never",
         f"{ALWAYS}/W3/handoffs_per_s", ">=", 0.95, ((1.0, f"{NEVER}/W3/handoffs_per_s"),)),
    Goal("w3-never-vs-pg", "W3 hand-offs/s never ≥ PostgreSQL advisory",
         f"{NEVER}/W3/handoffs_per_s", ">=", 1.0, ((1.0, f"{POSTGRES}/W3/handoffs_per_s"),)),
    Goal("w3-jain-always", "W3 Jain index always ≥ 0.99", f"{ALWAYS}/W3/jain", ">=", 0.99),
    Goal("w3-jain-never", "W3 Jain index never ≥ 0.99", f"{NEVER}/W3/jain", ">=", 0.99),
)


#: the compiled request path's targets (issue 27) not already among :data:`GOALS` (which has its durable
#: W1 and W2 ones and W1 ``never`` below PostgreSQL).  W3's bound ``never × cycle / (cycle + probe)`` with
#: ``cycle = 1 / never`` is the same as "time per hand-off ``always`` ≤ (``never``'s + the probe's p50) / 0.97".
COMPILED_PATH_GOALS: tuple[Goal, ...] = (
    Goal("w1-never-vs-echo", "W1 p50 never ≤ 1.1 × msgpack echo floor",
         f"{NEVER}/W1/pair_us.p50", "<=", 1.1, ((1.0, f"{ECHO}/W1/pair_us.p50"),)),
    Goal("w2-never-vs-echo", "W2 pairs/s never ≥ 0.8 × msgpack echo floor",
         f"{NEVER}/W2/pairs_per_s", ">=", 0.8, ((1.0, f"{ECHO}/W2/pairs_per_s"),)),
    Goal("w2-never-vs-pg", "W2 pairs/s never ≥ 2 × PostgreSQL advisory",
         f"{NEVER}/W2/pairs_per_s", ">=", 2.0, ((1.0, f"{POSTGRES}/W2/pairs_per_s"),)),
    Goal("w3-always-one-sync", "W3 µs per hand-off always ≤ (never + fsync probe p50) / 0.97",
         f"{ALWAYS}/W3/us_per_handoff", "<=", 1 / 0.97,
         ((1.0, f"{NEVER}/W3/us_per_handoff"), (1.0, PROBE_P50))),
)

#: every target a ``benches.peers`` run gives a verdict on
ALL_GOALS: tuple[Goal, ...] = GOALS + COMPILED_PATH_GOALS

#: field paths computed from a row rather than read from it
DERIVED = {
    "us_per_handoff": lambda row: (1e6 / row["handoffs_per_s"]
                                   if isinstance(row.get("handoffs_per_s"), (int, float)) and row["handoffs_per_s"] > 0
                                   else None),
}


def figure(payload: dict, name: str) -> float | None:
    """The number that ``name`` names in ``payload`` (see the module docstring); None if absent or NaN."""
    source, _, rest = name.partition("/")
    if source == "probe":
        v = get_path(payload.get("fsync_probe") or {}, rest)
    else:
        target, _, rest = name.partition("/")
        workload, _, path = rest.partition("/")
        row = next((r for r in payload.get("rows", [])
                    if r.get("target") == target and r.get("workload") == workload and "pair_us" in r), None)
        if row is None:
            v = None
        elif path in DERIVED:
            v = DERIVED[path](row)
        else:
            v = get_path(row, path)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def verdict(goal: Goal, payload: dict) -> dict[str, Any]:
    """One goal against one payload: figures, ratio and ``PASS``, ``FAIL`` or ``N/A`` (a figure is missing)."""
    lhs = figure(payload, goal.lhs)
    terms = [{"figure": f, "coef": c, "value": figure(payload, f)} for c, f in goal.rhs]
    missing = [goal.lhs] * (lhs is None) + [t["figure"] for t in terms if t["value"] is None]
    rhs = sum(t["coef"] * t["value"] for t in terms) if not missing and terms else (None if missing else 1.0)
    out: dict[str, Any] = {"key": goal.key, "goal": goal.text, "lhs": {"figure": goal.lhs, "value": lhs},
                           "rhs": terms, "rhs_value": rhs, "op": goal.op, "need": goal.need,
                           "ratio": None, "verdict": "N/A"}
    if missing:
        out["missing"] = missing
    elif rhs and rhs > 0:
        out["ratio"] = lhs / rhs
        out["verdict"] = "PASS" if OPS[goal.op](out["ratio"], goal.need) else "FAIL"
    else:
        out["missing"] = [t["figure"] for t in terms]   # a zero bound: nothing to compare with
    return out


def verdicts(payload: dict, goals: tuple[Goal, ...] = GOALS) -> list[dict[str, Any]]:
    """Every goal's :func:`verdict`, in the table's order."""
    return [verdict(g, payload) for g in goals]


def _num(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"


def _rhs_text(v: dict) -> str:
    if not v["rhs"]:
        return "–"
    parts = [_num(t["value"]) if t["coef"] == 1 else f"{t['coef']:g} × {_num(t['value'])}" for t in v["rhs"]]
    text = " + ".join(parts)
    return f"{text} = {_num(v['rhs_value'])}" if len(parts) > 1 else text


def _ratio(v: dict, digits: int) -> str:
    return "–" if v["ratio"] is None else f"{v['ratio']:.{digits}f}"


def verdict_lines(vs: list[dict]) -> list[str]:
    """One plain-text line per verdict: ``PASS  goal: lhs vs rhs, ratio r (need OP n)``."""
    return [f"{v['verdict']:<4}  {v['goal']}: {_num(v['lhs']['value'])} vs {_rhs_text(v)}, ratio "
            f"{_ratio(v, 3)} (need {v['op']} {v['need']:g})"
            + (f" [missing {', '.join(v['missing'])}]" if v.get("missing") else "") for v in vs]


def verdict_markdown(vs: list[dict]) -> str:
    """The verdicts as a markdown table."""
    lines = ["| target | measured | against | ratio | need | verdict |", "|---|---:|---:|---:|---:|---|"]
    for v in vs:
        lines.append(f"| {v['goal']} | {_num(v['lhs']['value'])} | {_rhs_text(v)} | "
                     f"{_ratio(v, 2)} | {v['op']} {v['need']:g} | "
                     f"**{v['verdict']}** |")
    return "\n".join(lines) + "\n"


COMPARISON_COLUMNS = (       # (column heading, row target)
    ("fastlock default (always)", ALWAYS),
    ("fastlock `--fsync never`", NEVER),
    ("PostgreSQL advisory (asyncpg)", POSTGRES),
    ("Redis SET NX + Lua", REDIS),
    ("msgpack echo floor", ECHO),
)


def _row(payload: dict, target: str, workload: str) -> dict | None:
    return next((r for r in payload.get("rows", []) if r.get("target") == target
                 and r.get("workload") == workload and "pair_us" in r), None)


def _us(v: float | None) -> str:
    return "–" if v is None or math.isnan(v) else f"{v:,.0f}"


def _cells(payload: dict, target: str) -> list[str]:
    w1, w2, w3 = (_row(payload, target, w) for w in ("W1", "W2", "W3"))
    cells = [f"{_us(w1['pair_us']['p50'])} µs" if w1 else "–",
             f"{_us(w1['acquire_us']['p50'])} / {_us(w1['release_us']['p50'])} µs" if w1 else "–",
             _us(w2["pairs_per_s"]) if w2 else "–",
             f"{_us(w2['client_cpu_pct'])} % / {_us(w2['server_cpu_pct'])} %" if w2 else "–"]
    if w3 is None or w3.get("is_floor"):
        cells.append("–")
    elif w3.get("polling"):
        cells.append(f"{_us(w3['handoffs_per_s'])} ({_us(w3['owner_changes_per_s'])} owner changes/s)")
    else:
        cells.append(_us(w3["handoffs_per_s"]))
    return cells


def comparison_markdown(payload: dict) -> str:
    """The README's comparison table (issue 12's columns) with a caption saying how it was measured."""
    probe = payload.get("fsync_probe") or {}
    cpus = (payload.get("machine") or {}).get("cpus", "?")
    rounds = payload.get("rounds", 1)
    p_app, p_ovw = get_path(probe, "append.p50"), get_path(probe, "overwrite.p50")
    command = payload.get("command", "python -m benches.peers")
    how = f"{rounds} rounds interleaved, medians" if rounds > 1 else "one round"
    duration = payload.get("duration_s", float("nan"))
    caption = (f"One side-by-side run on a {cpus}-core machine shared with other jobs (`{command}`: "
               f"same Python asyncio client style for every system, {how}; {duration:g} s per workload). "
               f"The fsync probe on the data dir, 4 KiB write + fdatasync: p50 {_us(p_app)} µs appending, "
               f"{_us(p_ovw)} µs overwriting a preallocated zero-filled file.")
    hold = payload.get("hold_ms", 1.0)
    labels = ["W1 one client, acquire+release p50", "W1 acquire p50 / release p50",
              f"W2 {payload.get('w2_clients', 32)} clients, own locks, pairs/s", "W2 CPU client / server",
              f"W3 {payload.get('w3_clients', 16)} clients, one lock, {hold:g} ms hold, hand-offs/s"]
    cols = [_cells(payload, target) for _, target in COMPARISON_COLUMNS]
    lines = [caption, "", "| workload | " + " | ".join(h for h, _ in COMPARISON_COLUMNS) + " |",
             "|---|" + "---:|" * len(COMPARISON_COLUMNS)]
    for i, label in enumerate(labels):
        lines.append(f"| {label} | " + " | ".join(c[i] for c in cols) + " |")
    return "\n".join(lines) + "\n"
