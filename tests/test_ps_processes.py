"""Consistency modes with real shard and worker processes on loopback.

Uneven workers are made with --slowdown (sleeps in proportion to measured compute),
so the tests check orderings and bounds, never wall-clock times.
"""

from __future__ import annotations

import json

import pytest

from tests.procs import run_ps_workers, shard_stats, shards

BASE = ["--workload", "mlp", "--batch-size", "16", "--seed", "1", "--precision", "fp32",
        "--eval-batches", "0"]  # fmt: skip


def _digests(report: dict) -> list[str]:
    return [s["state_digest"] for s in report["shards"]]


@pytest.mark.slow
def test_sync_result_is_independent_of_arrival_order(tmp_path) -> None:
    # Same job twice; first worker 1 arrives last in every round, then worker 0 does.
    runs = []
    for slow in (1, 0):
        d = tmp_path / f"slow{slow}"
        d.mkdir()
        with shards(2) as addrs:
            reps = run_ps_workers(
                addrs, 2, d, [*BASE, "--steps", "12"], per_rank={slow: ["--slowdown", "3"]}
            )
        runs.append(reps)
    assert _digests(runs[0][0]) == _digests(runs[1][0])  # bit-identical masters and optimizer state
    assert runs[0][0]["losses"] == runs[1][0]["losses"]
    assert all(s["updates_applied"] == 12 for s in runs[0][0]["shards"])


@pytest.fixture(scope="module")
def drift_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """async and ssp(S=1) with worker 1 four times slower than workers 0 and 2."""
    out = {}
    for mode in ("async", "ssp"):
        d = tmp_path_factory.mktemp(mode)
        with shards(1) as addrs:
            reps = run_ps_workers(
                addrs, 3, d, [*BASE, "--steps", "16", "--mode", mode, "--staleness", "1"],
                per_rank={1: ["--slowdown", "4"]},
            )  # fmt: skip
            out[mode] = (reps, shard_stats(addrs)[0])
    return out


@pytest.mark.slow
def test_async_applies_every_push_and_measures_staleness(drift_runs: dict) -> None:
    reps, shard = drift_runs["async"]
    assert shard["updates_applied"] == 3 * 16  # every push applied on arrival
    assert max(r["staleness"]["max"] for r in reps) > 0
    assert sum(shard["staleness_histogram"]) == 3 * 16
    # Without a bound the fast workers drift ahead of the slow one.
    assert shard["max_clock_gap"] > 1


def test_ssp_bounds_the_clock_gap(drift_runs: dict) -> None:
    reps, shard = drift_runs["ssp"]
    assert shard["max_clock_gap"] <= 1  # nobody ever ran more than S=1 clock ahead
    assert shard["updates_applied"] == 3 * 16  # nothing thrown away inside the bound
    # While a worker at clock c computes, each other worker can push at most 2S + 1
    # gradients (from clock c - S up to c + S + 1), so staleness <= (2S + 1)(N - 1).
    assert max(r["staleness"]["max"] for r in reps) <= (2 * 1 + 1) * (3 - 1)


@pytest.mark.slow
def test_sync_loss_scale_agrees_across_workers_and_overflow_skips(tmp_path) -> None:
    args = [*BASE, "--steps", "6", "--precision", "bf16", "--wire-dtype", "fp16",
            "--loss-scale-init-scale", "256", "--inject-overflow-step", "3",
            "--run-dir", str(tmp_path)]  # fmt: skip
    with shards(2) as addrs:
        reps = run_ps_workers(addrs, 2, tmp_path, args)
    scales = []
    for r in range(2):
        rows = [
            json.loads(x) for x in (tmp_path / f"steps-ps-rank{r}.jsonl").read_text().splitlines()
        ]
        scales.append([x["loss_scale"] for x in rows])
        assert [x["step"] for x in rows if x["skipped"]] == [3]
    assert scales[0] == scales[1]
    assert scales[0][2] == 128  # halved by the skipped round
    assert all(s["skipped_rounds"] == 1 for s in reps[0]["shards"])
