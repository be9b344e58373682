"""bench/gpu/scale.py: its CPU-scaled run (--json shape, sane numbers) and its arithmetic."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import scale as g
from bench.lib import common as c

ROOT = Path(__file__).resolve().parents[1]


def run_script(tmp_path: Path, *args: str, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "bench.gpu.scale", "--json", "--device", "cpu",
           "--out", str(tmp_path), "--timeout-s", "120", *args]  # fmt: skip
    got = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout)


def check_row(row: dict) -> None:
    assert {"run", "step_ms", "x_no_comm", "phases_ms", "samples_per_s"} <= row.keys()
    for key in ("step_ms", "x_no_comm", "samples_per_s"):
        assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, key
    assert {"forward", "backward"} <= row["phases_ms"].keys()
    assert all(math.isfinite(v) and v >= 0 for v in row["phases_ms"].values())


@pytest.mark.slow  # default run under 10 minutes; CI runs -m slow too
def test_cpu_run_json_shape_and_numbers(tmp_path: Path) -> None:
    doc = run_script(tmp_path, "--rows", "no_comm,ps_sync_1shard", "--steps", "8", timeout=150)
    assert doc["device"] == "cpu"
    assert [r["run"] for r in doc["rows"]] == ["no_comm", "ps_sync_1shard"]
    for row in doc["rows"]:
        check_row(row)
    no_comm, ps = doc["rows"]
    assert no_comm["x_no_comm"] == 1.0
    assert {"push", "pull"} <= ps["phases_ms"].keys() and "push" not in no_comm["phases_ms"]
    # second half = steps 5-8: the window runs from step 5's end to step 8's (one worker)
    assert ps["samples_in_window"] == pytest.approx(3 * 16)
    assert (tmp_path / "gpu_scale.json").exists() and (tmp_path / "gpu_scale.md").exists()


@pytest.mark.slow
def test_cpu_run_every_row(tmp_path: Path) -> None:
    doc = run_script(tmp_path, "--quick", timeout=600)
    assert [r["run"] for r in doc["rows"]] == list(g.ROWS)
    for row in doc["rows"]:
        check_row(row)
    async_row = next(r for r in doc["rows"] if r["run"] == "ps_async_2workers")
    assert async_row["ps_sync_run"] == "ps_sync_4shards"
    assert async_row["x_ps_sync_1worker"] > 0


def test_bad_rows_are_a_usage_error() -> None:
    with pytest.raises(SystemExit) as e:
        g.main(["--rows", "no_comm,bogus", "--device", "cpu"])
    assert e.value.code == 2


def series(rank: int, times: list[float], batch: int, start: float) -> c.Series:
    return c.Series(rank, times, [batch * (i + 1) for i in range(len(times))],
                    [0.0] * len(times), start)  # fmt: skip


def test_step_ms_uses_the_second_half_and_window_counts_total_samples() -> None:
    r0 = series(0, [0.5 + 0.01 * i for i in range(10)], 16, 100.0)  # 10 ms steps
    slow = series(1, [0.3 + 0.02 * i for i in range(10)], 16, 100.0)  # 20 ms after a slow 1st
    assert g.step_durations([0.5, 0.51]) == pytest.approx([0.5, 0.01])
    assert g.step_ms(c.Run([r0, slow], [])) == pytest.approx((10 + 20) / 2)
    # second halves on the wall clock: r0 ends steps at 100.55..100.59, r1 at 100.56..100.60
    r1 = series(1, [0.5 + 0.01 * i for i in range(10)], 16, 100.01)
    rate, window = c.window_rate(g.second_half(c.Run([r0, r1], [])))
    assert window == pytest.approx(0.03)  # 100.56 .. 100.59
    assert rate == pytest.approx(2 * 16 / 0.01)  # both ranks' samples in it, not a median


def test_ratios() -> None:
    rows = [{"run": "no_comm", "mode": "ddp", "shards": 0, "step_ms": 10.0, "samples_per_s": 1600.0},
            {"run": "ps_sync_4shards", "mode": "sync", "shards": 4, "step_ms": 20.0,
             "samples_per_s": 800.0},
            {"run": "ps_async_2workers", "mode": "async", "shards": 4, "step_ms": 25.0,
             "samples_per_s": 1200.0}]  # fmt: skip
    g.add_ratios(rows)
    assert [r["x_no_comm"] for r in rows] == [1.0, 2.0, 2.5]
    assert rows[2]["x_ps_sync_1worker"] == 1.5 and rows[2]["ps_sync_run"] == "ps_sync_4shards"
