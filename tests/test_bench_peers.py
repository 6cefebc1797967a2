"""The pure parts of ``python -m benches.peers``: rounds, issue 12's verdicts, the markdown tables.

No servers: rows are made by hand in the shape ``benches.harness`` gives them.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

# benches/ is not installed with the package: import it from the source tree
# (appended, so that ``fastlock`` itself still comes from the installed package)
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from benches import fsync_probe  # noqa: E402
from benches.peers import goals, report, rounds  # noqa: E402
from benches.peers.__main__ import main as peers_main  # noqa: E402

SYSTEM = {goals.ALWAYS: "fastlock", goals.NEVER: "fastlock", goals.POSTGRES: "postgres", goals.REDIS: "redis",
          goals.ECHO: "echo"}


def row(target: str, workload: str, *, p50: float = 100.0, acq: float = 60.0, rel: float = 40.0,
        pairs: float = 10_000.0, handoffs: float = 600.0, changes: float | None = None, jain: float = 1.0,
        cpu: tuple[float, float] = (90.0, 80.0), tokens: bool | None = True, rnd: int = 0) -> dict:
    """A measured row with every field the report reads."""
    r = {
        "target": target, "system": SYSTEM.get(target, "other"), "workload": workload, "round": rnd,
        "fencing": target.startswith("fastlock"), "polling": target == goals.REDIS, "threaded": False,
        "notes": "", "is_floor": target == goals.ECHO, "clients": 1, "hold_ms": 0.0,
        "pairs_per_s": pairs, "requests_per_s": 2 * pairs,
        "pair_us": {"n": 100, "p50": p50, "p90": p50 * 1.2, "p99": p50 * 2, "max": p50 * 5, "mean": p50},
        "acquire_us": {"n": 100, "p50": acq, "p90": acq, "p99": acq * 2, "max": acq * 5, "mean": acq},
        "release_us": {"n": 100, "p50": rel, "p90": rel, "p99": rel * 2, "max": rel * 5, "mean": rel},
        "errors": [], "error_count": 0, "client_cpu_pct": cpu[0], "server_cpu_pct": cpu[1],
        "other_cpu_pct": 0.0, "round_trips_per_pair": 2.0, "wasted_round_trips": 0,
        "wasted_round_trips_per_acquire": 0.0, "tokens_increasing": tokens,
    }
    if workload == "W3":
        r.update({"handoffs_per_s": handoffs, "owner_changes_per_s": handoffs if changes is None else changes,
                  "jain": jain, "per_client_acquisitions": [10, 10],
                  "time_to_acquire_us": r["acquire_us"],
                  "hold_measured_us": {"n": 100, "p50": 1100.0, "p90": 1100.0, "p99": 1200.0, "max": 1300.0,
                                       "mean": 1100.0}})
    return r


def error_row(target: str, workload: str, msg: str = "boom", rnd: int = 0) -> dict:
    return {"target": target, "system": SYSTEM.get(target, "other"), "workload": workload, "round": rnd,
            "error_count": 1, "errors": [msg]}


def make_payload(*, always_w1=300.0, never_w1=100.0, pg_w1=120.0, probe_p50=150.0,
                 always_w2=20_000.0, never_w2=30_000.0, pg_w2=10_000.0, redis_w2=10_000.0,
                 always_w3=600.0, never_w3=620.0, pg_w3=610.0, jain_always=1.0, jain_never=1.0) -> dict:
    """A results payload with the four systems issue 12's goals compare, one round."""
    rows = [
        row(goals.ALWAYS, "W1", p50=always_w1), row(goals.ALWAYS, "W2", pairs=always_w2),
        row(goals.ALWAYS, "W3", handoffs=always_w3, jain=jain_always),
        row(goals.NEVER, "W1", p50=never_w1), row(goals.NEVER, "W2", pairs=never_w2),
        row(goals.NEVER, "W3", handoffs=never_w3, jain=jain_never),
        row(goals.POSTGRES, "W1", p50=pg_w1), row(goals.POSTGRES, "W2", pairs=pg_w2),
        row(goals.POSTGRES, "W3", handoffs=pg_w3),
        row(goals.REDIS, "W1", p50=250.0), row(goals.REDIS, "W2", pairs=redis_w2),
        row(goals.REDIS, "W3", handoffs=601.0, changes=30.0, jain=0.7, tokens=None),
        row(goals.ECHO, "W1", p50=121.0, acq=50.0, rel=50.0), row(goals.ECHO, "W2", pairs=29_572.0),
        row(goals.ECHO, "W3", handoffs=800.0),
    ]
    stats = {"n": 10, "p50": probe_p50, "p90": probe_p50, "p99": probe_p50 * 2, "max": probe_p50 * 3,
             "mean": probe_p50}
    return {"rows": rows, "rounds": 2, "duration_s": 10.0, "warmup_s": 2.0, "hold_ms": 1.0, "w2_clients": 32,
            "w3_clients": 16, "elapsed_s": 100.0, "skipped": {}, "busy_before_pct": 5.0,
            "command": "python -m benches.peers --rounds 2",
            "machine": {"cpus": 2, "cpu": "test cpu", "platform": "linux", "python": "3.11"},
            "fsync_probe": {"dir": "/tmp", "count": 10, "rounds": 2, "append": dict(stats, p50=probe_p50 * 2),
                            "overwrite": stats}}


def by_key(vs: list[dict]) -> dict[str, dict]:
    return {v["key"]: v for v in vs}


# --------------------------------------------------------------------------- rounds

def test_schedule_runs_every_item_once_per_round_before_the_next_round():
    order = rounds.schedule(["a", "b", "c"], 3)
    assert [r for r, _ in order] == [0, 0, 0, 1, 1, 1, 2, 2, 2]      # interleaved, not 3 × a in a row
    assert [x for _, x in order] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]   # rotated by the round
    assert rounds.schedule(["a"], 2) == [(0, "a"), (1, "a")]
    assert rounds.schedule([], 2) == []
    with pytest.raises(ValueError):
        rounds.schedule(["a"], 0)


def test_median_of_odd_and_even_counts_ignores_nan():
    assert rounds.median([3.0, 1.0, 2.0]) == 2.0
    assert rounds.median([4, 1]) == 2.5
    assert rounds.median([5.0, float("nan"), 1.0, 3.0]) == 3.0
    assert math.isnan(rounds.median([float("nan")]))
    assert math.isnan(rounds.median([]))


def test_merge_rows_gives_medians_spread_and_joined_errors():
    raw = [row(goals.ALWAYS, "W1", p50=300.0, rnd=0), row(goals.NEVER, "W1", p50=90.0, rnd=0),
           row(goals.ALWAYS, "W1", p50=500.0, rnd=1, tokens=False), row(goals.NEVER, "W1", p50=110.0, rnd=1)]
    raw[2]["errors"], raw[2]["error_count"] = ["client 3: late"], 1
    merged = rounds.merge_rows(raw)
    assert [m["target"] for m in merged] == [goals.ALWAYS, goals.NEVER]      # first-seen order
    always = merged[0]
    assert always["pair_us"]["p50"] == 400.0 and always["pair_us"]["p99"] == 800.0
    assert always["rounds"] == 2 and always["rounds_failed"] == 0
    assert always["spread"]["pair_us.p50"] == {"min": 300.0, "max": 500.0, "values": [300.0, 500.0]}
    assert always["tokens_increasing"] is False        # holds only if it held in every round
    assert always["errors"] == ["client 3: late"] and always["error_count"] == 1
    assert always["target"] == goals.ALWAYS and always["fencing"] is True and "round" not in always
    assert merged[1]["pair_us"]["p50"] == 100.0


def test_merge_rows_uses_the_measured_rounds_and_keeps_a_row_no_round_measured():
    raw = [row(goals.POSTGRES, "W2", pairs=9_000.0), error_row(goals.POSTGRES, "W2", "timeout", rnd=1),
           error_row(goals.REDIS, "start", "no binary"), error_row(goals.REDIS, "start", "no binary", rnd=1)]
    pg, redis = rounds.merge_rows(raw)
    assert pg["pairs_per_s"] == 9_000.0 and pg["rounds"] == 1 and pg["rounds_failed"] == 1
    assert pg["errors"] == ["timeout"] and pg["error_count"] == 1
    assert "pair_us" not in redis and redis["rounds"] == 0 and redis["rounds_failed"] == 2
    assert redis["error_count"] == 2 and redis["errors"] == ["no binary", "no binary"]


def test_merge_probes():
    def p(a: float, o: float) -> dict:
        return {"dir": "/tmp", "count": 100, "block_bytes": 4096, "append": {"p50": a, "p99": a * 3},
                "overwrite": {"p50": o, "p99": o * 3}}
    m = rounds.merge_probes([dict(p(100.0, 50.0), round=0), dict(p(300.0, 70.0), round=1),
                             dict(p(200.0, 60.0), round=2)])
    assert m["append"]["p50"] == 200.0 and m["overwrite"]["p99"] == 180.0 and m["rounds"] == 3
    assert "round" not in m
    assert m["spread"]["append.p50"]["values"] == [100.0, 300.0, 200.0] and m["dir"] == "/tmp"
    assert rounds.merge_probes([]) is None


# --------------------------------------------------------------------------- verdicts

def test_goals_table_is_well_formed():
    assert len({g.key for g in goals.ALL_GOALS}) == len(goals.ALL_GOALS)
    assert all(g.op in goals.OPS and g.need > 0 for g in goals.ALL_GOALS)
    assert all(v["verdict"] != "N/A" for v in goals.verdicts(make_payload(), goals.ALL_GOALS))  # names resolve


def test_every_goal_passes_on_figures_that_meet_it():
    vs = by_key(goals.verdicts(make_payload(always_w1=240.0)))
    assert {k: v["verdict"] for k, v in vs.items()} == {g.key: "PASS" for g in goals.GOALS}
    w1 = vs["w1-durable"]        # 240 <= 100 + 1.0 × 150
    assert w1["lhs"]["value"] == 240.0 and w1["rhs_value"] == 250.0 and w1["ratio"] == pytest.approx(0.96)
    assert [t["value"] for t in w1["rhs"]] == [100.0, 150.0]
    assert vs["w2-always-vs-pg"]["ratio"] == pytest.approx(2.0)


def test_every_goal_fails_on_figures_that_miss_it():
    p = make_payload(always_w1=300.0, never_w1=130.0, pg_w1=120.0, probe_p50=150.0, always_w2=14_000.0,
                     pg_w2=10_000.0, never_w2=24_000.0, redis_w2=10_000.0, always_w3=500.0, never_w3=600.0,
                     pg_w3=610.0, jain_always=0.98, jain_never=0.5)
    vs = by_key(goals.verdicts(p))
    assert {k: v["verdict"] for k, v in vs.items()} == {g.key: "FAIL" for g in goals.GOALS}
    assert vs["w1-durable"]["ratio"] == pytest.approx(300 / 280)
    assert vs["w2-never-vs-redis"]["ratio"] == pytest.approx(2.4)
    assert vs["w3-always-vs-never"]["ratio"] == pytest.approx(500 / 600)
    assert vs["w3-jain-always"]["ratio"] == pytest.approx(0.98) and vs["w3-jain-always"]["rhs_value"] == 1.0


def test_verdict_bounds_strict_and_inclusive():
    vs = by_key(goals.verdicts(make_payload(never_w1=120.0, pg_w1=120.0, always_w2=15_000.0, pg_w2=10_000.0)))
    assert vs["w1-never-vs-pg"]["verdict"] == "FAIL"       # "below": equal is not enough
    assert vs["w2-always-vs-pg"]["verdict"] == "PASS"      # "at least": exactly 1.5 × is enough


def test_a_missing_system_or_probe_gives_no_verdict():
    p = make_payload()
    p["rows"] = [r for r in p["rows"] if r["target"] != goals.POSTGRES]
    p["rows"].append(error_row(goals.POSTGRES, "W2"))
    p["fsync_probe"] = None
    vs = by_key(goals.verdicts(p))
    assert vs["w1-durable"]["verdict"] == "N/A" and vs["w1-durable"]["missing"] == [goals.PROBE_P50]
    assert vs["w2-always-vs-pg"]["verdict"] == "N/A"
    assert vs["w2-always-vs-pg"]["missing"] == [f"{goals.POSTGRES}/W2/pairs_per_s"]
    assert vs["w2-never-vs-redis"]["verdict"] == "PASS"


def test_compiled_path_goals_pass_and_fail_at_their_bounds():
    # W3: never 800/s is 1,250 µs per hand-off; + a 150 µs probe = 1,400 µs; / 0.97 = 1,443.3 µs = 692.9/s
    p = make_payload(never_w1=110.0, never_w2=30_000.0, pg_w2=15_000.0, never_w3=800.0, always_w3=693.0)
    vs = by_key(goals.verdicts(p, goals.ALL_GOALS))
    assert [v["key"] for v in goals.verdicts(p, goals.ALL_GOALS)] == [g.key for g in goals.ALL_GOALS]
    assert vs["w1-never-vs-echo"]["verdict"] == "PASS"              # 110 <= 1.1 × 121
    assert vs["w2-never-vs-echo"]["verdict"] == "PASS"              # 30,000 >= 0.8 × 29,572
    assert vs["w2-never-vs-pg"]["verdict"] == "PASS" and vs["w2-never-vs-pg"]["ratio"] == pytest.approx(2.0)
    w3 = vs["w3-always-one-sync"]
    assert w3["lhs"]["value"] == pytest.approx(1e6 / 693) and w3["rhs_value"] == pytest.approx(1_400.0)
    assert w3["verdict"] == "PASS"
    vs = by_key(goals.verdicts(make_payload(never_w1=134.0, never_w2=23_000.0, pg_w2=12_000.0, never_w3=800.0,
                                            always_w3=692.0), goals.ALL_GOALS))
    assert {k: vs[k]["verdict"] for k in ("w1-never-vs-echo", "w2-never-vs-echo", "w2-never-vs-pg",
                                          "w3-always-one-sync")} == dict.fromkeys(
        ("w1-never-vs-echo", "w2-never-vs-echo", "w2-never-vs-pg", "w3-always-one-sync"), "FAIL")


def test_a_w3_row_without_hand_offs_gives_no_per_hand_off_figure():
    p = make_payload()
    for r in p["rows"]:
        if r["target"] == goals.ALWAYS and r["workload"] == "W3":
            r["handoffs_per_s"] = 0.0
    v = by_key(goals.verdicts(p, goals.ALL_GOALS))["w3-always-one-sync"]
    assert v["verdict"] == "N/A" and v["missing"] == [f"{goals.ALWAYS}/W3/us_per_handoff"]


def test_verdicts_of_merged_rounds_use_the_medians():
    r0, r1 = make_payload(always_w2=10_000.0), make_payload(always_w2=40_000.0)
    raw = [dict(r, round=0) for r in r0["rows"]] + [dict(r, round=1) for r in r1["rows"]]
    p = dict(r0, rows=rounds.merge_rows(raw))
    v = by_key(goals.verdicts(p))["w2-always-vs-pg"]
    assert v["lhs"]["value"] == 25_000.0 and v["ratio"] == pytest.approx(2.5) and v["verdict"] == "PASS"


# --------------------------------------------------------------------------- markdown

def test_comparison_markdown_has_issue_12s_columns_and_figures():
    p = make_payload(always_w1=568.0)
    p["rows"] = [r for r in p["rows"] if not (r["target"] == goals.POSTGRES and r["workload"] == "W2")]
    lines = goals.comparison_markdown(p).splitlines()
    assert "2 rounds interleaved, medians" in lines[0] and "p50 300 µs appending, 150 µs overwriting" in lines[0]
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == ("| workload | fastlock default (always) | fastlock `--fsync never` | "
                        "PostgreSQL advisory (asyncpg) | Redis SET NX + Lua | msgpack echo floor |")
    assert table[1] == "|---|---:|---:|---:|---:|---:|"
    cells = {t.split(" | ")[0].lstrip("| "): [c.strip() for c in t.strip("|").split("|")[1:]] for t in table[2:]}
    assert cells["W1 one client, acquire+release p50"] == ["568 µs", "100 µs", "120 µs", "250 µs", "121 µs"]
    assert cells["W1 acquire p50 / release p50"][4] == "50 / 50 µs"
    assert cells["W2 32 clients, own locks, pairs/s"] == ["20,000", "30,000", "–", "10,000", "29,572"]
    assert cells["W2 CPU client / server"][0] == "90 % / 80 %"
    assert cells["W3 16 clients, one lock, 1 ms hold, hand-offs/s"] == [
        "600", "620", "610", "601 (30 owner changes/s)", "–"]
    assert len(table) == 7


def test_verdict_markdown_and_lines():
    vs = goals.verdicts(make_payload(always_w1=300.0))
    md = goals.verdict_markdown(vs).splitlines()
    assert md[0] == "| target | measured | against | ratio | need | verdict |" and len(md) == 2 + len(goals.GOALS)
    assert md[2] == ("| W1 p50 always ≤ W1 p50 never + 1.0 × fsync probe p50 | 300 | 100 + 150 = 250 | 1.20 | "
                     "<= 1 | **FAIL** |")
    lines = goals.verdict_lines(vs)
    assert lines[0].startswith("FAIL  W1 p50 always") and "ratio 1.200 (need <= 1)" in lines[0]
    assert lines[1].startswith("PASS  W1 p50 never < PostgreSQL advisory: 100 vs 120, ratio 0.833")


def test_results_md_has_the_probe_and_the_verdicts():
    p = make_payload(always_w1=300.0)
    p["verdicts"] = goals.verdicts(p)
    md = report.markdown(p)
    assert "Every figure is the median of 2 rounds" in md
    assert "| overwriting a preallocated zero-filled file | 150 | 150 | 300 | 450 |" in md
    assert "## Targets (issue 12)" in md and "**FAIL**" in md and "**PASS**" in md
    assert goals.comparison_markdown(p) in md


# --------------------------------------------------------------------------- probe and arguments

def test_fsync_probe_times_both_shapes(tmp_path):
    r = fsync_probe.probe(str(tmp_path), 5)
    assert r["count"] == 5 and r["block_bytes"] == 4096 and r["dir"] == str(tmp_path)
    for shape in ("append", "overwrite"):
        assert r[shape]["n"] == 5 and 0 < r[shape]["p50"] <= r[shape]["p99"] <= r[shape]["max"]
    assert list(tmp_path.iterdir()) == []          # its files are removed


def test_fsync_probe_times_the_direct_overwrite_where_the_file_system_takes_it(tmp_path):
    r = fsync_probe.probe_modes(str(tmp_path), 5)
    if fsync_probe.DIRECT not in r:
        pytest.skip("this file system takes no O_DIRECT writes")
    assert set(r) == {*fsync_probe.MODES, fsync_probe.DIRECT}
    assert 0 < r[fsync_probe.DIRECT]["p50_us"] <= r[fsync_probe.DIRECT]["p99_us"]
    assert list(tmp_path.iterdir()) == []          # its files are removed


def test_fsync_probe_refuses_bad_arguments(tmp_path):
    for bad in (0, -1, fsync_probe.MAX_COUNT + 1, 2.5):
        with pytest.raises(ValueError):
            fsync_probe.probe(str(tmp_path), bad)
    with pytest.raises(OSError):
        fsync_probe.probe(str(tmp_path / "missing"), 1)


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--rounds", "21"], ["--probe-count", "0"],
                                  ["--only", "mysql"]])
def test_bad_arguments_stop_before_anything_runs(argv, capsys):
    with pytest.raises(SystemExit) as e:
        peers_main(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err
