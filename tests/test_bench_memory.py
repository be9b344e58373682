"""bench/lib/memory.py (python -m bench.step_throughput --memory): its arithmetic, the
roles it samples, and a tiny real run's JSON keys (no test asserts a measured figure)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib import memory
from psar.worker.workloads import mlp

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("hidden,depth", [(4096, 7), (64, 2), (16, 0)])
def test_mlp_params_counts_the_workloads_model(hidden: int, depth: int) -> None:
    if hidden < 4096:
        model = mlp.build_model(memory.IN_DIM, hidden, depth, memory.CLASSES)
        want = sum(p.numel() for p in model.parameters())
    else:  # by hand: 784x4096 + 6 x 4096x4096 + 4096x10, and the biases
        want = 784 * 4096 + 6 * 4096**2 + 4096 * 10 + 7 * 4096 + 10
    assert memory.mlp_params(memory.IN_DIM, hidden, depth, memory.CLASSES) == want


def test_per_param_subtracts_the_baseline_job() -> None:
    # 1000 + 6 B/param x 100 params over a baseline of 1000 + 6 x 10
    assert memory.per_param(1600, 1060, 100, 10) == pytest.approx(6.0)


def test_role_tells_ranks_shards_and_torchrun_apart() -> None:
    py = "/usr/bin/python3"
    assert memory.role([py, "-u", "-m", "psar.worker.cli", "train", "--arch", "ps"]) == "worker"
    assert memory.role([py, "-m", "psar.worker.cli", "server", "--shard", "0"]) == "shard"
    agent = [py, "-m", "torch.distributed.run", "--nnodes", "1", "-m", "psar.worker.cli", "train"]
    assert memory.role(agent) is None
    assert memory.role([py, "-m", "psar.worker.cli"]) is None
    assert memory.role(["bash", "-c", "true"]) is None


def test_summary_divides_by_the_parameters_each_process_holds() -> None:
    mib = 2**20
    base = {"ps": {"worker": [100 * mib, 101 * mib], "shard": [200 * mib] * 2},
            "ddp": {"worker": [150 * mib] * 2}}  # fmt: skip
    p, bp = 10_000_000, 10_000
    big = {"ps": {"worker": [101 * mib + 6 * (p - bp), 100 * mib + 5 * (p - bp)],
                  "shard": [200 * mib + 16 * (p - bp) // 2] * 2},
           "ddp": {"worker": [150 * mib + 20 * (p - bp)] * 2}}  # fmt: skip
    planned = memory.plan_rows(p)
    doc = memory.summarise(big, base, p, bp, planned)
    rows = doc["rows"]
    assert rows["ps_worker"]["bytes_per_param"] == pytest.approx(6.0)  # the larger rank
    assert rows["ps_shard"]["bytes_per_param"] == pytest.approx(16.0)
    assert rows["ddp_worker"]["bytes_per_param"] == pytest.approx(20.0)
    assert doc["ps_worker_over_ddp_worker"] == pytest.approx(0.3)
    assert rows["ddp_worker"]["plan_bytes"] == planned["ddp_worker_bytes"]
    assert rows["ddp_worker"]["measured_over_plan"] == pytest.approx(
        20 * (p - bp) / planned["ddp_worker_bytes"]
    )
    assert doc["goals"]["ps_worker_over_ddp_worker"]["met"] is True
    assert "memory" in memory.table({**doc, "params": p, "workers": 2, "plan": planned}).lower()


def test_early_pulls_are_read_from_rank_0s_log(tmp_path: Path) -> None:
    (tmp_path / "worker0.log").write_text("x INFO worker 0: early pulls off (the job's)\n")
    assert memory.early_pulls(tmp_path) is False
    (tmp_path / "worker0.log").write_text("x INFO worker 0: early pulls on (the job's)\n")
    assert memory.early_pulls(tmp_path) is True
    assert "--early-pull" in memory.plan_rows(1000, True)["command"].split()
    (tmp_path / "worker0.log").write_text("nothing\n")
    with pytest.raises(RuntimeError, match="early pulls"):
        memory.early_pulls(tmp_path)


@pytest.mark.slow
def test_memory_section_runs_and_emits_its_keys(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "bench.step_throughput", "--memory", "--json",
            "--memory-hidden", "64", "--memory-depth", "2", "--steps", "2",
            "--out", str(tmp_path)]  # fmt: skip
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    assert doc["benchmark"] == "step_memory"
    assert doc["params"] == memory.mlp_params(memory.IN_DIM, 64, 2, memory.CLASSES)
    assert set(doc["rows"]) == {"ps_worker", "ps_shard", "ddp_worker"}
    for row in doc["rows"].values():
        assert {"peak_bytes", "baseline_bytes", "bytes_per_param", "plan_bytes",
                "plan_bytes_per_param", "measured_over_plan"} <= set(row)  # fmt: skip
        assert row["peak_bytes"] > 0 and row["baseline_bytes"] > 0
    assert len(doc["rows"]["ps_worker"]["per_process_peak_bytes"]) == 2
    assert set(doc["goals"]) == {"ps_worker_over_ddp_worker", "plan_within_15pct"}
    assert {"ps_worker_bytes", "ddp_worker_bytes", "command"} <= set(doc["plan"])
    assert (tmp_path / "step_memory.json").exists()
