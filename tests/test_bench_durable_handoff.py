"""``python -m benches.durable_handoff``: its medians, its table, its arguments, and one real
measurement of the timed fastlock server and of the reference FIFO server (a second each)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

# benches/ is not installed with the package: import it from the source tree
# (appended, so that ``fastlock`` itself still comes from the installed package)
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from benches import durable_handoff  # noqa: E402


def _run(us: float) -> dict:
    return {"us_per_handoff": us, "gap_p50_us": us - 1000, "hold_p50_us": 1000.0, "release_p50_us": 80.0,
            "handoffs": 100}


def _round(never: float, always: float, probe: float) -> dict:
    def fastlock(us: float) -> dict:
        return {"raw": _run(us), "lib": _run(us + 50), "server_handoff_p50_us": us - 1100,
                "server_inline_share": 1.0, "server_beyond_sync_p50_us": 40.0, "server_fsync_p50_us": 100.0,
                "thread_fsync_share": 0.0}
    return {"fastlock never": fastlock(never), "fastlock always": fastlock(always),
            "reference never": {"raw": _run(never - 20)}, "reference always": {"raw": _run(always - 30)},
            "probe_p50_us": probe}


def test_summary_takes_medians_over_rounds():
    rounds = [_round(1300, 1500, 100), _round(1310, 1490, 110), _round(1290, 9000, 105)]
    s = durable_handoff.summarise(rounds)
    assert s["fastlock always raw us_per_handoff"] == 1500  # the outlier round does not move it
    assert s["fastlock always lib us_per_handoff"] == 1550
    assert s["reference never raw us_per_handoff"] == 1280
    assert s["fastlock always server_handoff_p50_us"] == 400
    assert s["probe_p50_us"] == 105
    assert not any(key.startswith("baseline") for key in s)  # not measured: not reported


def test_report_gives_each_extra_as_a_multiple_of_the_probe_and_the_bound():
    text = durable_handoff.report(durable_handoff.summarise([_round(1300, 1500, 100)]))
    # bound = (never + probe) / 0.97 = 1443.3; 1500 / 1443.3 = 1.039
    assert "| fastlock, raw client: per hand-off | 1300 | 1500 | 200 | 2.00 | 1.039 |" in text
    assert "| reference, raw client: per hand-off | 1280 | 1470 | 190 | 1.90 |" in text
    assert "beyond its one fdatasync p50 40 us" in text
    assert "p50: 100 us" in text


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--seconds", "0.1"], ["--clients", "1"],
                                  ["--rounds", "x"], ["--baseline", "/nonexistent"]])
def test_bad_arguments_stop_before_anything_runs(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        durable_handoff.main(argv)
    assert exc.value.code == 2
    assert "durable_handoff" in capsys.readouterr().err


def test_a_measurement_times_the_servers_handoffs_and_both_clients(tmp_path):
    args = argparse.Namespace(clients=4, hold_ms=1.0, seconds=0.5, baseline=None)
    durable = durable_handoff.measure_fastlock("always", args, str(tmp_path))
    for client in ("raw", "lib"):
        run = durable[client]
        assert run["handoffs"] > 10 and run["us_per_handoff"] > 1000  # each holds 1 ms
        assert 0 < run["gap_p50_us"] < run["us_per_handoff"] and run["release_p50_us"] > 0
    # every hand-off's grant waited for one fdatasync, inside the server's time for it
    assert 0 < durable["server_fsync_p50_us"] < durable["server_handoff_p50_us"]
    assert durable["server_beyond_sync_p50_us"] > 0
    assert not list(tmp_path.glob("timed-*.json"))  # the timings file is read and removed
    reference = durable_handoff.measure_reference("always", args, str(tmp_path))
    assert reference["raw"]["handoffs"] > 10 and reference["raw"]["us_per_handoff"] > 1000
