"""psar compare: one small real comparison end to end, plus the table's arithmetic."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from psar.worker.compare import DEFAULT_RUNS, RUNS, TABLE_KEYS, main, smoothed, table, time_to


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


@pytest.mark.slow
def test_compare_end_to_end_small(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cmp"
    argv = ["--steps", "10", "--workers", "2", "--out", str(out), "--smooth", "3",
            "--eval-batches", "2", "--log-every", "5"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((out / "compare.json").read_text())
    assert list(doc["runs"]) == list(DEFAULT_RUNS)
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
    # Bytes counted alike: at 2 workers a ring rank sends and receives the gradient once
    # each way (2(n-1)/n = 1), as a PS worker pushes it and pulls the weights once.
    # (tests/test_wire_bytes.py checks both against the interfaces.)
    ring, ps = doc["runs"]["allreduce"]["bytes_per_step"], doc["runs"]["ps-sync"]["bytes_per_step"]
    assert ring == pytest.approx(ps, rel=1e-3)
    assert (out / "compare.md").exists()
    printed = capsys.readouterr().out
    assert f"time to loss<{doc['target_loss']:.4g} (s)" in printed


# --- --repeats: mean ± 95% interval (issue #19) -----------------------------------------

from psar.worker import compare_repeats  # noqa: E402
from psar.worker.intervals import format_interval, mean_interval, t975  # noqa: E402


def test_mean_interval_is_students_t() -> None:
    mean, half = mean_interval([10.0, 12.0, 14.0])
    assert mean == 12.0
    assert half == pytest.approx(4.303 * 2.0 / math.sqrt(3))  # s = 2, df = 2
    assert mean_interval([5.0, None, math.nan]) == (5.0, None)
    assert mean_interval([]) is None
    assert t975(11) == t975(10) and t975(1000) == 1.96
    with pytest.raises(ValueError):
        t975(0)


def test_format_interval() -> None:
    assert format_interval((1234.5, 56.7)) == "1,234 ± 57"
    assert format_interval((0.51234, 0.0123), 3) == "0.512 ± 0.012"
    assert format_interval((3.0, None)) == "3" and format_interval(None) == "-"


def test_aggregate_means_intervals_and_each_repeat() -> None:
    reps = [
        dict.fromkeys(TABLE_KEYS) | {"exit_code": 0, "samples_per_sec": 100.0,
                                     "time_to_target_s": 2.0, "final_train_loss": 0.5},
        dict.fromkeys(TABLE_KEYS) | {"exit_code": 0, "samples_per_sec": 110.0,
                                     "time_to_target_s": None, "final_train_loss": 0.7},
        dict.fromkeys(TABLE_KEYS) | {"exit_code": 1, "samples_per_sec": 120.0,
                                     "time_to_target_s": 4.0, "final_train_loss": 0.6},
    ]  # fmt: skip
    row = compare_repeats.aggregate(reps)
    assert row["samples_per_sec"] == 110.0 and row["exit_code"] == 1
    assert row["final_train_loss"] == pytest.approx(0.6)
    assert row["samples_per_sec_interval"] == pytest.approx([110.0, 4.303 * 10 / math.sqrt(3)])
    assert row["time_to_target_s_interval"] == pytest.approx([3.0, 12.706])  # s = sqrt(2), n = 2
    assert row["time_to_target_reached"] == "2/3"
    assert [r["samples_per_sec"] for r in row["repeats"]] == [100.0, 110.0, 120.0]
    assert compare_repeats.aggregate(reps[:1]) is reps[0]  # one repeat: the row as before


def test_table_prints_mean_plus_minus_half_width() -> None:
    row = dict.fromkeys(TABLE_KEYS) | {"exit_code": 0, "samples_per_sec": 1000.0,
                                       "samples_per_sec_interval": [1000.0, 25.0],
                                       "time_to_target_s": 1.5,
                                       "time_to_target_s_interval": [1.5, 0.2]}  # fmt: skip
    doc = {"target_loss": 0.5, "target_given": True, "smooth_window": 10, "repeats": 3,
           "runs": {"ps-sync": row},
           "config": {"workload": "mlp", "workers": 2, "batch_size": 32, "steps": 5,
                      "precision": "fp32", "seed": 0, "servers": 1, "staleness": 2,
                      "straggler": {}}}  # fmt: skip
    text = table(doc)
    assert "| ps-sync | 1,000 ± 25 | 1.5 ± 0.2 |" in text
    assert "3 times" in text and "95% interval" in text


def test_repeats_must_be_positive(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--repeats", "0", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "--repeats: must be a whole number >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_repeats_end_to_end(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rep"
    argv = ["--steps", "6", "--workers", "2", "--out", str(out), "--smooth", "2",
            "--eval-batches", "0", "--runs", "allreduce,ps-sync", "--repeats", "2"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((out / "compare.json").read_text())
    assert doc["repeats"] == 2
    for name in ("allreduce", "ps-sync"):
        row = doc["runs"][name]
        each = [r["samples_per_sec"] for r in row["repeats"]]
        assert len(each) == 2 and all(v > 0 for v in each)
        mean, half = row["samples_per_sec_interval"]
        assert mean == pytest.approx(sum(each) / 2) and half >= 0
        assert row["time_to_target_reached"] == "2/2"
        for rep in ("r1", "r2"):
            assert (out / name / rep / "report-0.json").exists()
    assert " ± " in capsys.readouterr().out


# --- hybrid (issue #46): a row where the workload has sparse tables ----------------------

from psar.worker.compare import default_runs  # noqa: E402

_RECSYS = ["--workload-option", "rows=2000,200", "--workload-option=dim=8",
           "--workload-option", "samples=2048"]  # fmt: skip


def test_default_runs_add_hybrid_where_the_workload_has_tables() -> None:
    assert default_runs("recsys", _RECSYS, 0) == (*DEFAULT_RUNS, "hybrid-sync")
    assert default_runs("mlp", [], 0) == DEFAULT_RUNS
    assert RUNS["hybrid-async"] == ("hybrid", "async") and "hybrid-local" not in RUNS


@pytest.mark.slow
def test_compare_a_recsys_workload_has_a_hybrid_row(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    argv = ["--workload", "recsys", *_RECSYS, "--steps", "8", "--workers", "2", "--servers",
            "2", "--runs", "allreduce,ps-sync,hybrid-sync", "--out", str(out), "--smooth", "3",
            "--eval-batches", "2", "--workload-option", "sparse=true",
            "--optimizer-impl", "loop", "--sparse-wire-dtype", "fp32", "--momentum", "0"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((out / "compare.json").read_text())
    row = doc["runs"]["hybrid-sync"]
    assert row["exit_code"] == 0 and row["steps_rank0"] == 8 and row["staleness_max"] == 0
    assert row["samples_per_sec"] > 0 and row["bytes_per_step"] > 0
    # The same training as DDP-sparse (fp32, rows fp32 on the wire; plain SGD, as the
    # shards step tables), so the same final loss.
    ddp = doc["runs"]["allreduce"]
    assert row["final_train_loss"] == pytest.approx(ddp["final_train_loss"], rel=1e-5)
    # Held-out logloss and AUC under every architecture, the same training so the same
    # figures, in compare.json, the table, and each run's report.md (issue #46 item 3).
    for name in ("allreduce", "ps-sync", "hybrid-sync"):
        r = doc["runs"][name]
        assert r["val_logloss"] == pytest.approx(ddp["val_logloss"], rel=1e-4), name
        assert r["val_auc"] == pytest.approx(ddp["val_auc"], abs=1e-3), name
        assert "| val logloss | val AUC |" in (out / name / "report.md").read_text()
    assert "| val logloss | val AUC |" in (out / "compare.md").read_text()
