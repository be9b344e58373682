"""psar compare: one small real comparison end to end, plus the table's arithmetic."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from worker.compare import RUNS, TABLE_KEYS, main, smoothed, table, time_to


def test_smoothed_is_a_trailing_mean_that_skips_non_finite_losses() -> None:
    assert smoothed([4.0, 2.0, math.inf, 0.0], 2) == [4.0, 3.0, 3.0, 1.0]
    assert math.isnan(smoothed([math.nan], 3)[0])


def test_time_to_target_is_the_first_smoothed_crossing() -> None:
    row = {"_time": [0.1, 0.2, 0.3, 0.4], "_smooth": [3.0, 1.0, 0.4, 0.2]}
    assert time_to(row, 0.5) == 0.3
    assert time_to(row, 0.1) is None
    assert time_to({}, 1.0) is None


def test_table_names_the_target_and_every_run() -> None:
    row = dict.fromkeys(TABLE_KEYS) | {"exit_code": 0, "samples_per_sec": 1234.5}
    doc = {
        "target_loss": 0.61,
        "target_given": False,
        "smooth_window": 10,
        "runs": {name: dict(row) for name in RUNS},
        "config": {
            "workload": "mlp",
            "workers": 2,
            "batch_size": 32,
            "steps": 5,
            "precision": "fp32",
            "seed": 0,
            "servers": 1,
            "staleness": 2,
            "straggler": {"1": 3.0},
        },  # fmt: skip
    }
    text = table(doc)
    assert "time to loss<0.61 (s)" in text and "rank 1 x3" in text
    assert all(f"| {name} | 1,234 |" in text for name in RUNS)


@pytest.mark.parametrize(
    "argv, needle",
    [(["--runs", "ps-sync,bogus"], "unknown ['bogus']"), (["--mode", "ssp"], "--mode is set")],
)
def test_bad_flags_exit_2(tmp_path: Path, capsys, argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path)])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_compare_end_to_end_small(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cmp"
    argv = ["--steps", "10", "--workers", "2", "--out", str(out), "--smooth", "3",
            "--eval-batches", "2", "--log-every", "5"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((out / "compare.json").read_text())
    assert list(doc["runs"]) == list(RUNS)
    assert doc["table_keys"] == list(TABLE_KEYS)
    assert math.isfinite(doc["target_loss"]) and not doc["target_given"]
    for name, row in doc["runs"].items():
        assert set(TABLE_KEYS) <= set(row), name
        assert row["exit_code"] == 0 and row["steps_rank0"] == 10
        assert row["samples_per_sec"] > 0 and row["bytes_per_step"] > 0
        # The target is derived from the worst final loss, so every run reaches it.
        assert row["time_to_target_s"] is not None, name
        assert (out / name / "report-0.json").exists()
        assert (out / name / "report.md").exists() and (out / name / "launch.log").exists()
    for name in ("ps-sync", "ps-async", "ps-ssp"):
        assert (out / name / "report-1.json").exists()
        assert doc["runs"][name]["staleness_max"] is not None
    assert doc["runs"]["ps-sync"]["staleness_max"] == 0
    assert doc["runs"]["allreduce"]["staleness_max"] is None
    assert (out / "compare.md").exists()
    printed = capsys.readouterr().out
    assert f"time to loss<{doc['target_loss']:.4g} (s)" in printed
