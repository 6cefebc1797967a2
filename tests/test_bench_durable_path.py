"""``python -m benches.durable_path``: its medians and extras, its table, and one real measurement
of the timed fastlock server and of the reference server (a few hundred pairs each)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# benches/ is not installed with the package: import it from the source tree
# (appended, so that ``fastlock`` itself still comes from the installed package)
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from benches import durable_path  # noqa: E402


def _round(server_never: float, server_always: float, pair_never: float, pair_always: float,
           probe: float) -> dict:
    return {
        "fastlock never": {"server_acquire_p50_us": server_never, "server_fsync_p50_us": 0.0,
                           "raw_pair_p50_us": pair_never,
                           "fastlock_pair_p50_us": pair_never + 10},
        "fastlock always": {"server_acquire_p50_us": server_always, "server_fsync_p50_us": server_always - 20,
                            "raw_pair_p50_us": pair_always,
                            "fastlock_pair_p50_us": pair_always + 10},
        "reference never": {"raw_pair_p50_us": pair_never - 20},
        "reference always": {"raw_pair_p50_us": pair_always - 30},
        "probe_p50_us": probe, "wakeup_sync_extra_us": 30.0, "wakeup_none_extra_us": 10.0,
    }


def test_summary_takes_medians_over_rounds_and_the_extras_of_the_medians():
    rounds = [_round(10, 110, 60, 170, 100), _round(12, 130, 70, 200, 90), _round(11, 500, 65, 180, 95)]
    s = durable_path.summarise(rounds)
    assert s["fastlock always server_acquire_p50_us"] == 130  # the outlier round does not move it
    assert s["extra fastlock server_acquire_p50_us"] == 130 - 11
    assert s["extra fastlock raw_pair_p50_us"] == 180 - 65
    assert s["extra reference raw_pair_p50_us"] == 150 - 45
    assert s["probe_p50_us"] == 95


def test_report_gives_each_extra_as_a_multiple_of_the_probe():
    text = durable_path.report(durable_path.summarise([_round(10, 110, 60, 260, 100)]))
    assert "| fastlock: server time per ACQUIRE | 10 | 110 | 100 | 1.00 |" in text
    assert "| fastlock: pair, raw client | 60 | 260 | 200 | 2.00 |" in text
    assert "p50: 100 us" in text
    assert "beyond that sync: 20 us" in text


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--pairs", "10"], ["--rounds", "x"]])
def test_bad_arguments_stop_before_anything_runs(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        durable_path.main(argv)
    assert exc.value.code == 2
    assert "durable_path" in capsys.readouterr().err


def test_a_measurement_times_the_servers_acquires_and_both_clients(tmp_path):
    pairs = durable_path.WARMUP + 100
    timed = durable_path.measure_fastlock("never", pairs, str(tmp_path))
    # every figure was measured (a median of real samples, not the NaN of none)
    assert 0 < timed["server_acquire_p50_us"] < timed["raw_pair_p50_us"]
    assert timed["fastlock_pair_p50_us"] > 0
    durable = durable_path.measure_fastlock("always", pairs, str(tmp_path))
    # the syncs are the log's latest (both clients' acquires), the acquires the raw client's only:
    # two windows of a disk whose speed can change between them, so each is checked on its own
    assert durable["server_fsync_p50_us"] > 0
    assert durable["server_acquire_p50_us"] > 0
    reference = durable_path.measure_reference("always", pairs, str(tmp_path))
    assert reference["raw_pair_p50_us"] > 0
    assert not list(tmp_path.glob("timed-*.json"))  # the timings file is read and removed
