"""bench/lib/grid.py (issue #19's crossover, `python -m bench.links --grid`): the window rate after warm-up, the grid,
each cell's arithmetic against `psar plan` itself, the table, and (slow) a real run of
the small grid on network namespaces. No test asserts a time or a ratio of a real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib import common as c
from bench.lib import grid as g
from psar.worker.plan_model import PlanInputs, plan

ROOT = Path(__file__).resolve().parent.parent


def _steps(path: Path, rank: int, start: float, times: list[float], batch: int = 16) -> None:
    with path.open("w") as fh:
        for k, t in enumerate(times, 1):
            rec = {"step": k, "time": t, "samples": k * batch, "loss": 1.0, "wall": start + t,
                   "rank": rank, "arch": "ps", "mode": "sync"}  # fmt: skip
            fh.write(json.dumps(rec) + "\n")


def test_window_rate_skips_each_ranks_warm_up(tmp_path: Path) -> None:
    # Rank 0's first step takes 5 s (start-up), then 0.1 s steps; rank 1 steady from t=0.
    _steps(tmp_path / "steps-ps-rank0.jsonl", 0, 100.0, [5.0 + 0.1 * k for k in range(21)])
    _steps(tmp_path / "steps-ps-rank1.jsonl", 1, 100.0, [0.1 * k + 0.1 for k in range(60)])
    run = c.load_run(tmp_path)
    rate, window = c.window_rate(run)  # from rank 0's slow first step: drags rank 1 in
    late, late_window = c.window_rate(run, skip=2)  # from rank 0's third step (105.2 s)
    assert late_window == pytest.approx(6.0 - 5.2)
    assert late == pytest.approx(2 * 16 / 0.1)  # both ranks at 10 steps/s, 16 samples
    assert window > late_window
    assert c.window_rate(run, skip=1000)[0] != c.window_rate(run, skip=1000)[0]  # nan: empty


def test_the_grid_and_the_model_size() -> None:
    assert g.shard_counts(2) == [0, 1, 2]
    assert g.shard_counts(4) == [0, 2, 4]
    assert g.shard_counts(8) == [0, 4, 8]
    assert g.params(hidden=1024) == 1_863_690  # MLP 784-1024-1024-10: bench/links.py's PARAMS
    assert g.params() == 20_037_642  # the grid's MLP 784-4096-4096-10: 80 MB of fp32
    assert g.GRIDS["full"] == {"workers": (2, 4, 8), "mbit": (1000.0, 10000.0)}
    args = g.train_args(7, 25.0)
    assert args[args.index("--emulate-compute-ms") + 1] == "25"
    assert args[args.index("--steps") + 1] == "7"
    assert "hidden=4096" in args and args[args.index("--batch-size") + 1] == "4"
    small = g.train_args(7, 25.0, hidden=1024, batch=16)
    assert "hidden=1024" in small and small[small.index("--batch-size") + 1] == "16"


def test_the_grid_flags_reach_its_shape() -> None:
    class Args:
        grid_hidden, grid_chunk_mib, grid_batch = 2048, 0.25, 8

    assert g.shape(Args()) == (2048, 0.25, 8)
    assert g.shape(object()) == (g.HIDDEN, g.CHUNK_MIB, g.BATCH)


def test_a_tie_the_plan_calls_and_a_tie_measured_agree() -> None:
    # psar plan says "treat it as a tie" under a 5% margin: a measured margin under 5%
    # either way agrees with it; a clear measured win does not.
    assert g.judge_winner("allreduce", 0.006, "ps", 0.008)["winner_right"]
    assert not g.judge_winner("allreduce", 0.006, "ps", 0.008)["strict_winner_right"]
    assert not g.judge_winner("allreduce", 0.006, "ps", 0.2)["winner_right"]
    assert not g.judge_winner("ps", 0.3, "allreduce", 0.01)["winner_right"]
    assert g.judge_winner("ps", 0.3, "ps", 0.01) == {
        "plan_tie": False,
        "measured_tie": True,
        "strict_winner_right": True,
        "winner_right": True,
    }


@pytest.mark.slow
def test_cells_check_measured_rates_against_psar_plan() -> None:
    link = {"workers": 4, "mbit": 1000.0, "gbps_best": 0.1, "rtt_us": 40.0}
    jobs = {
        "allreduce": {"samples_per_sec": 400.0, "window_s": 3.0, "median_rate": 410.0},
        "ps-k0": {"shards": 4, "samples_per_sec": 300.0, "window_s": 3.0, "median_rate": 1.0},
        "ps-k2": {"shards": 2, "samples_per_sec": 200.0, "window_s": 3.0, "median_rate": 1.0},
        "ps-k4": {"shards": 4, "samples_per_sec": 500.0, "window_s": 3.0, "median_rate": 1.0},
    }
    rows = g.cells(4, 1000.0, link, jobs, 30.0)
    assert [r["shard_hosts"] for r in rows] == [0, 2, 4]
    for r in rows:
        s, k = r["shards"], r["shard_hosts"]
        # The grid's ps-sync pulls early (--chunk-rounds shards): the plan models that.
        want = plan(PlanInputs(g.params(), 4, s, bandwidth_bytes_per_second=0.1e9,
                               latency_seconds=20e-6, optimizer="sgd-momentum",
                               compute_seconds=0.03, shard_hosts=k, early_pull=True,
                               chunk_bytes=int(g.CHUNK_MIB * 2**20)))  # fmt: skip
        ps_rate = jobs[f"ps-k{k}"]["samples_per_sec"]
        assert r["ps_over_allreduce"] == pytest.approx(ps_rate / 400.0)
        assert r["ps_step_ms"] == pytest.approx(1e3 * 4 * g.BATCH / ps_rate)
        assert r["ps_plan_step_ms"] == pytest.approx(
            1e3 * want.ps.step_seconds_no_overlap, rel=1e-3
        )
        assert r["allreduce_plan_step_ms"] == pytest.approx(
            1e3 * want.allreduce.step_seconds_no_overlap, rel=1e-3
        )
        assert r["byteps_bound_ms"] == pytest.approx(1e3 * want.byteps_bound_seconds, rel=1e-3)
        assert r["plan_winner"] == want.winner
        assert r["measured_winner"] == ("ps" if ps_rate > 400.0 else "allreduce")
        assert r["strict_winner_right"] == (r["plan_winner"] == r["measured_winner"])
        assert r["winner_right"] == r["strict_winner_right"] or r["plan_tie"] and r["measured_tie"]
    assert rows[2]["byteps_bound_gain"] == pytest.approx(1.5, rel=1e-3)  # K = N = 4
    assert rows[2]["plan_winner"] == "ps"  # pipelined, K = N: the PS moves M each way once
    push_then_pull = g.cells(4, 1000.0, link, jobs, 30.0, early_pull=False)
    assert push_then_pull[2]["plan_winner"] == "allreduce"
    assert g.ps_flags(True) == (["--chunk-rounds"], ["--early-pull"]) and g.ps_flags(False) == (
        [],
        ["--no-early-pull"],
    )
    assert g.shard_counts(4, "4") == [4] and g.shard_counts(8, "0,8") == [0, 8]
    doc = {"grid": "small", "steps": 5, "compute_ms": 30.0, "batch": g.BATCH,
           "params": g.params(), "chunk_mib": g.CHUNK_MIB, "links": [link], "cells": rows,
           "failed_cells": [{"workers": 8, "shard_hosts": 8, "mbit": 1000.0,
                             "error": "worker3 exited 1:\n  | boom"}],
           "plan_winner_right_everywhere": False, "all_within_20pct": False,
           "k0_ps_not_faster": True}  # fmt: skip
    text = g.table(doc)
    assert text.count("\n| 4 |") == 3 and "1 Gbit/s" in text and "(1.5x)" in text
    assert "0.100 GB/s" in text and "20 us" not in text  # goodput; latency shows the RTT
    assert "Plan's winner right in every cell: **no**" in text
    assert "Failed: n=8 k=8 1000 Mbit/s:   | boom" in text


def test_a_failed_job_costs_its_cells_only() -> None:
    link = {"workers": 2, "mbit": 1000.0, "gbps_best": 0.1, "rtt_us": 40.0}
    jobs = {
        "allreduce": {"samples_per_sec": 400.0, "window_s": 3.0, "median_rate": 410.0},
        "ps-k0": {"shards": 2, "error": "shard exited 1"},
        "ps-k1": {"shards": 1, "samples_per_sec": 200.0, "window_s": 3.0, "median_rate": 1.0},
        "ps-k2": {"shards": 2, "samples_per_sec": 300.0, "window_s": 3.0, "median_rate": 1.0},
    }
    rows = g.cells(2, 1000.0, link, jobs, 30.0)
    assert rows[0] == {"workers": 2, "shard_hosts": 0, "shards": 2, "mbit": 1000.0,
                       "error": "shard exited 1"}  # fmt: skip
    assert [("error" in r) for r in rows] == [True, False, False]
    jobs["allreduce"] = {"error": "rank1 exited 1"}
    assert all(r.get("error") for r in g.cells(2, 1000.0, link, jobs, 30.0))


def test_grid_flag_is_refused_when_unknown() -> None:
    p = subprocess.run([sys.executable, "-m", "bench.links", "--grid", "huge"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2 and "--grid" in p.stderr


@pytest.mark.slow
def test_small_grid_runs_on_namespaces_or_says_why(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "bench.links", "--grid", "small", "--steps", "6",
                        "--json", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=1800)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    if "skipped" in doc:
        assert doc["skipped"]
        return
    assert [(r["workers"], r["shard_hosts"]) for r in doc["cells"]] == [(4, 0), (4, 2), (4, 4)]
    assert doc["congestion"] == "cubic" and doc["hidden"] == g.HIDDEN
    for r in doc["cells"]:
        assert r["ps_samples_per_sec"] > 0 and r["allreduce_samples_per_sec"] > 0
        assert r["plan_winner"] in ("ps", "allreduce")
    assert (tmp_path / "links_grid.md").exists()


def test_the_plan_models_the_shared_cores_with_the_measured_rates() -> None:
    cpu = {"cores": 2, "ps_bytes_per_cpu_second": 2.0e9, "allreduce_bytes_per_cpu_second": 3.0e9}
    assert g.cpu_flags(None) == [] and g.cpu_flags({}) == []
    assert g.cpu_flags(cpu) == ["--cpu-cores", "2", "--cpu-shared", "--ps-cpu-gbps", "2",
                                "--allreduce-cpu-gbps", "3"]  # fmt: skip
    own = {**cpu, "worker_cpu_seconds_per_step": 0.09}
    assert g.cpu_flags(own) == [*g.cpu_flags(cpu), "--worker-cpu-ms", "90"]
    link = {"workers": 4, "mbit": 10000.0, "gbps_best": 1.2, "rtt_us": 40.0, "cpu": cpu}
    jobs = {
        "allreduce": {"samples_per_sec": 50.0, "window_s": 3.0, "median_rate": 50.0},
        "ps-k4": {"shards": 4, "samples_per_sec": 33.0, "window_s": 3.0, "median_rate": 33.0},
    }
    (row,) = g.cells(4, 10000.0, link, jobs, 30.0)
    want = plan(PlanInputs(g.params(), 4, 4, bandwidth_bytes_per_second=1.2e9,
                           latency_seconds=20e-6, optimizer="sgd-momentum", compute_seconds=0.03,
                           shard_hosts=4, early_pull=True, chunk_bytes=int(g.CHUNK_MIB * 2**20),
                           cpu_cores=2, cpu_shared=True, ps_cpu_bytes_per_second=2e9,
                           allreduce_cpu_bytes_per_second=3e9))  # fmt: skip
    assert row["ps_plan_step_ms"] == pytest.approx(1e3 * want.ps.step_seconds_no_overlap, rel=1e-3)
    assert row["ps_plan_bottleneck"] == "cpu" and row["plan_winner"] == want.winner == "allreduce"
    doc = {"grid": "small", "steps": 5, "compute_ms": 30.0, "batch": g.BATCH,
           "params": g.params(), "chunk_mib": g.CHUNK_MIB, "links": [link], "cells": [row],
           "plan_winner_right_everywhere": True, "all_within_20pct": False,
           "k0_ps_not_faster": True}  # fmt: skip
    assert "ps 2.00, ring 3.00 GB/s per core, 2 cores" in g.table(doc)
    assert "W = 90 ms of CPU per worker per step" in g.table(
        {**doc, "links": [{**link, "cpu": own}]}
    )


@pytest.mark.slow
def test_a_workers_own_cpu_per_step_is_measured(tmp_path: Path) -> None:
    from bench.experiments import cpu_rate

    steps = (5, 35)  # 30 steps of difference: start-up's noise spread thin
    small = g.train_args(1, 0.0, hidden=2048, batch=4)
    light = cpu_rate.worker_cpu_seconds(tmp_path / "small", small, steps=steps)
    heavy = cpu_rate.worker_cpu_seconds(tmp_path / "big", g.train_args(1, 0.0), steps=steps)
    # Real CPU-seconds per step: more for the 80 MB model (20M parameters) than for the
    # 5.8M one, and neither is the run's start-up (seconds).
    assert 0 < light < heavy < 1.0


def test_cpu_rate_cli_says_what_is_missing() -> None:
    p = subprocess.run([sys.executable, "-m", "bench.experiments.cpu_rate", "--no-rates"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2 and "give --worker-train FLAGS too" in p.stderr


@pytest.mark.slow
def test_cpu_rate_cli_measures_a_users_workload() -> None:
    flags = "--workload mlp --batch-size 32 --torch-threads 1 --log-every 0 --eval-batches 0"
    p = subprocess.run([sys.executable, "-m", "bench.experiments.cpu_rate", "--no-rates", "--worker-train",
                        flags], cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    # A light step: the longer run was stretched until its CPU stood out of start-up's.
    assert 0 < doc["worker_cpu_seconds_per_step"] < 0.05
    assert doc["worker_cpu_ms_flag"].startswith("--worker-cpu-ms ")
    bad = subprocess.run([sys.executable, "-m", "bench.experiments.cpu_rate", "--no-rates", "--worker-train",
                          "--workload nope"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert bad.returncode == 1 and "--worker-train: psar train failed" in bad.stderr


@pytest.mark.slow
def test_cpu_rates_are_measured_on_two_hosts() -> None:
    p = subprocess.run([sys.executable, "-m", "bench.experiments.cpu_rate"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    if p.returncode != 0 and "namespace" in p.stderr + p.stdout:
        pytest.skip(p.stderr.strip()[-300:])
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    assert doc["ps_bytes_per_cpu_second"] > 1e7 and doc["allreduce_bytes_per_cpu_second"] > 1e7


def test_a_congestion_control_namespaces_may_not_use_is_a_reason_to_skip(tmp_path: Path) -> None:
    allowed = tmp_path / "tcp_allowed_congestion_control"
    allowed.write_text("reno bbr\n")
    why = g.congestion_unavailable("cubic", allowed)
    assert "may use only reno bbr" in why and "--congestion system" in why
    assert 'tcp_allowed_congestion_control="reno bbr cubic"' in why
    assert g.congestion_unavailable("bbr", allowed) is None
    assert g.congestion_unavailable("system", allowed) is None
    assert g.congestion_unavailable(g.system_congestion(), allowed) is None  # always allowed
    assert g.congestion_unavailable("cubic", tmp_path / "absent") is None  # sysctl will say
