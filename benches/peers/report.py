"""results.md (tables + verdicts against issue 6's targets) and PNG plots."""

from __future__ import annotations

import math
import os
from typing import Any

from benches.peers import goals

DEFAULT_FASTLOCK = "fastlock fsync=always"
FASTLOCK_ROWS = ("fastlock fsync=always", "fastlock fsync=never")
W4_GROUPS = [
    ("fsync every write", ["fastlock fsync=always", "redis SET NX aof=always", "etcd lease/client",
                           "etcd lease/acquire"]),
    ("fsync once a second", ["fastlock fsync=interval", "redis SET NX aof=everysec"]),
]


def _rows(payload: dict, wl: str) -> list[dict]:
    return [r for r in payload["rows"] if r.get("workload") == wl and "pair_us" in r]


def _row(payload: dict, target: str, wl: str) -> dict | None:
    for r in _rows(payload, wl):
        if r["target"] == target:
            return r
    return None


def _f(x: Any, fmt: str = "{:,.0f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return fmt.format(x)


def _div(a, b) -> float:
    try:
        return a / b if b else float("nan")
    except TypeError:
        return float("nan")


def _yes(b: bool) -> str:
    return "yes" if b else "no"


def verdicts(payload: dict, fastlock: str = DEFAULT_FASTLOCK) -> list[str]:
    """Issue 6's targets for one fastlock row, each a line 'PASS/MISS ...'."""
    out: list[str] = []
    w1, w2, w3 = (_row(payload, fastlock, w) for w in ("W1", "W2", "W3"))
    peers = lambda wl: [r for r in _rows(payload, wl) if r["system"] not in ("fastlock", "echo")]  # noqa: E731
    if w1:
        others = peers("W1")
        best = min(others, key=lambda r: r["pair_us"]["p50"], default=None)
        if best:
            ok = w1["pair_us"]["p50"] < best["pair_us"]["p50"]
            out.append(f"{'PASS' if ok else 'MISS'} W1 p50 lower than every peer: {fastlock} "
                       f"{w1['pair_us']['p50']:.0f} us vs best peer {best['target']} {best['pair_us']['p50']:.0f} us "
                       f"(x{_div(w1['pair_us']['p50'], best['pair_us']['p50']):.2f})")
    if w2:
        for system, factor in (("redis", 2.0), ("etcd", 10.0), ("zookeeper", 10.0)):
            rs = [r for r in peers("W2") if r["system"] == system]
            if not rs:
                continue
            best = max(rs, key=lambda r: r["pairs_per_s"])
            ratio = _div(w2["pairs_per_s"], best["pairs_per_s"])
            out.append(f"{'PASS' if ratio >= factor else 'MISS'} W2 >= {factor:g}x {system}: {fastlock} "
                       f"{w2['pairs_per_s']:,.0f} pairs/s vs {best['target']} {best['pairs_per_s']:,.0f} "
                       f"(x{ratio:.1f})")
    if w3:
        others = peers("W3")
        best = max(others, key=lambda r: r["handoffs_per_s"], default=None)
        wasted = w3.get("wasted_round_trips") or 0
        if best:
            ok = w3["handoffs_per_s"] > best["handoffs_per_s"] and w3["jain"] >= 0.99 and wasted == 0
            out.append(f"{'PASS' if ok else 'MISS'} W3 hand-offs/s above every peer, Jain >= 0.99, no wasted "
                       f"round trips: {fastlock} {w3['handoffs_per_s']:,.0f}/s (Jain {w3['jain']:.3f}, wasted "
                       f"{wasted}) vs best peer {best['target']} {best['handoffs_per_s']:,.0f}/s "
                       f"({best['owner_changes_per_s']:,.0f} owner changes/s)")
    return out


def markdown(payload: dict) -> str:
    m = payload["machine"]
    echo1 = _row(payload, "echo floor", "W1")
    echo2 = _row(payload, "echo floor", "W2")
    fl1 = _row(payload, DEFAULT_FASTLOCK, "W1")
    fl2 = _row(payload, DEFAULT_FASTLOCK, "W2")
    fl3 = _row(payload, DEFAULT_FASTLOCK, "W3")
    rtt = echo1["acquire_us"]["p50"] if echo1 else float("nan")
    hold = payload["hold_ms"] / 1e3
    L: list[str] = []
    L.append("# fastlock vs Redis, etcd, ZooKeeper, PostgreSQL advisory locks\n")
    L.append(f"Machine: {m.get('cpu', '?')}, {m.get('cpus')} CPUs, {m.get('memory_gib', '?')} GiB, "
             f"{m.get('platform')}, Python {m.get('python')}, uvloop {m.get('uvloop', '-')}. "
             f"{payload['duration_s']:g} s per workload after {payload['warmup_s']:g} s warmup; one client "
             f"process (asyncio tasks; kazoo in threads); loopback only; total run {payload['elapsed_s']:g} s; "
             f"other processes before start: {_f(payload.get('busy_before_pct'), '{:.0f}')} % of a core.\n")
    if payload.get("rounds", 1) > 1:
        L.append(f"Every figure is the median of {payload['rounds']} rounds, interleaved (each round runs every "
                 "system once, with fresh servers); results.json gives each figure's min, max and per-round values "
                 "(`spread`) and every round's rows (`round_rows`).\n")
    if payload.get("skipped"):
        L.append("Skipped: " + "; ".join(f"{k} ({v})" for k, v in payload["skipped"].items()) + "\n")
    L.append("A *pair* is one acquire + one release; latencies exclude the hold. "
             "Requests/s count a pair as 2 requests whatever the recipe sends (its real round trips per pair "
             "are in the RT/pair column). CPU % is per core (client process; server process tree).\n")

    L.append("## W1 — one client, sequential acquire+release (µs)\n")
    L.append("| target | fencing token | p50 | p90 | p99 | max | × echo | × fastlock | RT/pair | CPU client/server % |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in _rows(payload, "W1"):
        p = r["pair_us"]
        L.append(f"| {r['target']} | {_yes(r['fencing']) if not r.get('is_floor') else '–'} | {p['p50']:.0f} | "
                 f"{p['p90']:.0f} | {p['p99']:.0f} | {p['max']:.0f} | "
                 f"{_f(_div(p['p50'], echo1['pair_us']['p50']) if echo1 else None, '{:.2f}')} | "
                 f"{_f(_div(p['p50'], fl1['pair_us']['p50']) if fl1 else None, '{:.2f}')} | "
                 f"{_f(r.get('round_trips_per_pair'), '{:.1f}')} | "
                 f"{r['client_cpu_pct']:.0f} / {r['server_cpu_pct']:.0f} |")
    L.append(f"\nEcho round trip p50: {_f(rtt, '{:.0f}')} µs (the echo 'pair' is two round trips).\n")

    L.append(f"## W2 — {payload['w2_clients']} clients, each on its own lock\n")
    L.append("| target | pairs/s | requests/s | pair p50 µs | pair p99 µs | × echo req/s | fastlock ÷ this | "
             "CPU client/server % |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in _rows(payload, "W2"):
        L.append(f"| {r['target']} | {r['pairs_per_s']:,.0f} | {r['requests_per_s']:,.0f} | "
                 f"{r['pair_us']['p50']:.0f} | {r['pair_us']['p99']:.0f} | "
                 f"{_f(_div(r['requests_per_s'], echo2['requests_per_s']) if echo2 else None, '{:.2f}')} | "
                 f"{_f(_div(fl2['pairs_per_s'], r['pairs_per_s']) if fl2 else None, '{:.1f}')} | "
                 f"{r['client_cpu_pct']:.0f} / {r['server_cpu_pct']:.0f} |")

    bound = 1.0 / (hold + rtt / 1e6) if not math.isnan(rtt) else float("nan")
    echo3 = _row(payload, "echo floor", "W3")
    cold = (1e6 / echo3["handoffs_per_s"] - echo3["hold_measured_us"]["mean"]) if echo3 else float("nan")
    L.append(f"\n## W3 — {payload['w3_clients']} clients on ONE lock, each holding it {payload['hold_ms']:g} ms\n")
    L.append(f"Bound: 1 / (hold + echo round trip) = {_f(bound)}/s. The echo floor row is ONE client that holds, "
             f"then does one echo round trip: the hand-off chain with a server that does nothing; its cycle minus "
             f"its hold is the *cold* round trip ({_f(cold)} µs), since processes idle during the hold must wake "
             "up. Owner changes count grants whose holder differs from the previous holder; wasted round trips "
             "are failed polling attempts.\n")
    L.append("| target | hand-offs/s | owner changes/s | time-to-acquire p50 µs | p99 µs | Jain | "
             "wasted RT/acquire | measured hold ms | × bound | fastlock ÷ this | CPU client/server % |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in _rows(payload, "W3"):
        chg = "– (1 client)" if r.get("is_floor") else f"{r['owner_changes_per_s']:,.0f}"
        L.append(f"| {r['target']} | {r['handoffs_per_s']:,.0f} | {chg} | "
                 f"{r['time_to_acquire_us']['p50']:,.0f} | {r['time_to_acquire_us']['p99']:,.0f} | "
                 f"{r['jain']:.3f} | {_f(r.get('wasted_round_trips_per_acquire'), '{:.1f}')} | "
                 f"{r['hold_measured_us']['mean'] / 1e3:.2f} | {_f(_div(r['handoffs_per_s'], bound), '{:.2f}')} | "
                 f"{_f(_div(fl3['handoffs_per_s'], r['handoffs_per_s']) if fl3 else None, '{:.1f}')} | "
                 f"{r['client_cpu_pct']:.0f} / {r['server_cpu_pct']:.0f} |")

    w4rows = []
    for group, names in W4_GROUPS:
        for n in names:
            a, b = _row(payload, n, "W1"), _row(payload, n, "W2")
            if a or b:
                w4rows.append((group, n, a, b))
    if w4rows:
        L.append("\n## W4 — durability-matched (W1 and W2)\n")
        L.append("| durability | target | W1 pair p50 µs | W1 p99 µs | W2 pairs/s | W2 pair p99 µs |")
        L.append("|---|---|---:|---:|---:|---:|")
        for group, n, a, b in w4rows:
            L.append(f"| {group} | {n} | {_f(a and a['pair_us']['p50'])} | {_f(a and a['pair_us']['p99'])} | "
                     f"{_f(b and b['pairs_per_s'])} | {_f(b and b['pair_us']['p99'])} |")

    L.append("\n## Fencing tokens and waiting\n")
    L.append("| target | fencing token | waiting | notes |")
    L.append("|---|---|---|---|")
    seen = set()
    for r in payload["rows"]:
        if r.get("is_floor") or r["target"] in seen or "system" not in r:
            continue
        seen.add(r["target"])
        L.append(f"| {r['target']} | {_yes(r['fencing'])} | {'polling' if r['polling'] else 'server-side queue'} "
                 f"| {r.get('notes', '')} |")

    busy = [r for r in payload["rows"] if r.get("other_cpu_pct", 0) > 20]
    if busy:
        L.append("\n## Noise warning\n")
        L.append("Other processes used more than 20 % of a core during these runs (figures less reliable): "
                 + ", ".join(f"{r['target']} {r['workload']} ({r['other_cpu_pct']:.0f} %)" for r in busy) + "\n")

    errs = [r for r in payload["rows"] if r.get("error_count")]
    if errs:
        L.append("\n## Errors\n")
        for r in errs:
            L.append(f"- {r.get('target')} {r.get('workload')}: {'; '.join(map(str, r.get('errors', [])[:3]))}")

    probe = payload.get("fsync_probe")
    if probe:
        L.append("\n## fsync probe (4 KiB write + fdatasync, µs)\n")
        L.append(f"In {probe.get('dir')}, where fastlock's data dir is made; {_f(probe.get('count'))} operations per "
                 f"shape in each of {probe.get('rounds')} round(s), medians.\n")
        L.append("| shape | p50 | p90 | p99 | max |")
        L.append("|---|---:|---:|---:|---:|")
        for shape, what in (("append", "appending to a file"),
                            ("overwrite", "overwriting a preallocated zero-filled file")):
            s = probe.get(shape) or {}
            L.append(f"| {what} | {_f(s.get('p50'))} | {_f(s.get('p90'))} | {_f(s.get('p99'))} | {_f(s.get('max'))} |")
    if payload.get("verdicts"):
        L.append("\n## Targets (issue 12)\n")
        L.append(goals.verdict_markdown(payload["verdicts"]))
        L.append("## README comparison table\n")
        L.append(goals.comparison_markdown(payload))

    L.append("\n## Targets (issue 6)\n")
    for name in FASTLOCK_ROWS:
        if _row(payload, name, "W1"):
            for v in verdicts(payload, name):
                L.append(f"- {v}")
    return "\n".join(L) + "\n"


def plots(payload: dict, out: str) -> list[str]:
    """summary.png (W1/W2/W3) and w4_durability.png; [] if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    def logx(ax):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())

    files = []
    fig, axes = plt.subplots(1, 3, figsize=(18, 6))

    def color(r):
        return {"fastlock": "tab:green", "echo": "tab:gray", "redis": "tab:red", "etcd": "tab:blue",
                "zookeeper": "tab:orange", "postgres": "tab:purple"}.get(r["system"], "tab:brown")

    r1 = _rows(payload, "W1")
    ax = axes[0]
    ax.barh([r["target"] for r in r1], [r["pair_us"]["p50"] for r in r1], color=[color(r) for r in r1])
    ax.scatter([r["pair_us"]["p99"] for r in r1], [r["target"] for r in r1], marker="|", color="black", s=200,
               label="p99", zorder=3)
    logx(ax)
    ax.set_xlabel("µs per acquire+release (log; bar p50, tick p99) — lower is better")
    ax.set_title("W1 uncontended latency")
    ax.invert_yaxis()
    ax.legend(loc="lower right")

    r2 = _rows(payload, "W2")
    ax = axes[1]
    ax.barh([r["target"] for r in r2], [r["pairs_per_s"] for r in r2], color=[color(r) for r in r2])
    logx(ax)
    ax.set_xlabel(f"pairs/s, {payload['w2_clients']} clients on distinct locks (log) — higher is better")
    ax.set_title("W2 parallel throughput")
    ax.invert_yaxis()

    r3 = _rows(payload, "W3")
    ax = axes[2]
    y = list(range(len(r3)))
    ax.barh([i - 0.2 for i in y], [r["handoffs_per_s"] for r in r3], height=0.4, color=[color(r) for r in r3],
            label="hand-offs/s")
    ax.barh([i + 0.2 for i in y], [r["owner_changes_per_s"] for r in r3], height=0.4, color="lightgray",
            edgecolor=[color(r) for r in r3], label="owner changes/s")
    for i, r in enumerate(r3):
        ax.text(r["handoffs_per_s"], i, f"  Jain {r['jain']:.2f}", va="center", fontsize=8)
    ax.set_yticks(y, [r["target"] for r in r3])
    ax.set_xlim(0, 1.45 * max([r["handoffs_per_s"] for r in r3] + [1]))
    ax.set_xlabel(f"per second, {payload['w3_clients']} clients on one lock, hold {payload['hold_ms']:g} ms")
    ax.set_title("W3 contended hand-off")
    ax.invert_yaxis()
    ax.legend(loc="center right")
    fig.suptitle(f"fastlock vs peers — {payload['machine'].get('cpus')} CPUs, one Python client process")
    fig.tight_layout()
    p = os.path.join(out, "summary.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    files.append(p)

    w4 = [(g, n, _row(payload, n, "W1"), _row(payload, n, "W2")) for g, ns in W4_GROUPS for n in ns]
    w4 = [x for x in w4 if x[2] or x[3]]
    if w4:
        fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
        labels = [f"{n}\n({g})" for g, n, _, _ in w4]
        axes[0].barh(labels, [a["pair_us"]["p50"] if a else 0 for _, _, a, _ in w4],
                     color=["tab:green" if n.startswith("fastlock") else "tab:red" if n.startswith("redis")
                            else "tab:blue" for _, n, _, _ in w4])
        logx(axes[0])
        axes[0].set_xlabel("W1 pair p50 µs (log) — lower is better")
        axes[0].invert_yaxis()
        axes[1].barh(labels, [b["pairs_per_s"] if b else 0 for _, _, _, b in w4],
                     color=["tab:green" if n.startswith("fastlock") else "tab:red" if n.startswith("redis")
                            else "tab:blue" for _, n, _, _ in w4])
        logx(axes[1])
        axes[1].set_xlabel("W2 pairs/s (log) — higher is better")
        axes[1].invert_yaxis()
        fig.suptitle("W4 durability-matched")
        fig.tight_layout()
        p = os.path.join(out, "w4_durability.png")
        fig.savefig(p, dpi=100)
        plt.close(fig)
        files.append(p)
    return files
