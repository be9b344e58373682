"""bench/shard_update.py: a tiny real run of its --json path (schema and the bit check;
no test asserts a time or a ratio), and the shapes it benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import shard_update

ROOT = Path(__file__).resolve().parent.parent


def test_identical_means_the_shards_implementation(tmp_path: Path) -> None:
    """With --impl loop the shard is compared with torch's per-parameter AdamW."""
    r = shard_update.measure(shard_update.model_params(300_000), 1, 1, "loop")
    assert r["shard_impl"] == "loop" and r["identical"] is True


def test_model_params_add_up_and_cut_into_slots() -> None:
    for total in (300_000, 2_000_000, 57_000_000):
        params = shard_update.model_params(total)
        assert sum(n for _, n in params) == total
        assert len({name for name, _ in params}) == len(params)


def test_tiny_run_json(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.shard_update", "--params", "300000", "--reps", "2",
         "--threads", "1,2", "--json", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    doc = json.loads(out.stdout)
    assert doc["benchmark"] == "shard_update" and doc["params"] == 300_000
    assert [r["threads"] for r in doc["results"]] == [1, 2]
    for r in doc["results"]:
        assert {"shard", "torch foreach=False"} <= set(r["params_per_s"])
        assert ("shard intra-op" in r["params_per_s"]) == (r["threads"] > 1)
        assert r["params"] == 300_000 and r["steps_timed"] == 2
        assert r["shard_stats_params_per_s"] > 0
        assert r["shard_impl"] == "fused"  # auto, where torch has the kernel (here)
        assert "torch fused" in r["shard_over"]
    # The shard's update, on one thread or a pool, equals torch's own AdamW of the same
    # implementation bit for bit.
    assert doc["identical"] is True
    assert set(doc["ratio_vs_torch_fused"]) == {"1", "2"}
    assert (tmp_path / "shard_update.json").exists() and (tmp_path / "shard_update.md").exists()
