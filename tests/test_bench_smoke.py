"""bench/: the arithmetic on synthetic step logs, the suite's tables and goals, and tiny
real runs of each benchmark's --json path (schemas only: no test asserts a time or a
ratio)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import stragglers
from bench.lib import common as c
from bench.lib import suite

ROOT = Path(__file__).resolve().parent.parent


def _write_steps(path: Path, rank: int, start_wall: float, step_s: float, steps: int, batch=10):
    with path.open("w") as fh:
        for k in range(1, steps + 1):
            rec = {"step": k, "time": k * step_s, "samples": k * batch, "loss": 1.0 / k,
                   "wall": start_wall + k * step_s, "rank": rank, "arch": "ps", "mode": "async"}  # fmt: skip
            fh.write(json.dumps(rec) + "\n")


def test_rates_from_step_logs(tmp_path: Path) -> None:
    # rank 0: 0.1 s steps from t=100 for 50 steps; rank 1: 0.3 s steps from t=101 for 20.
    _write_steps(tmp_path / "steps-ps-rank0.jsonl", 0, 100.0, 0.1, 50)
    _write_steps(tmp_path / "steps-ps-rank1.jsonl", 1, 101.0, 0.3, 20)
    hist = {"staleness": {"histogram": {"0": 98, "3": 1, "7": 1}}}
    (tmp_path / "report-0.json").write_text(json.dumps(hist))
    run = c.load_run(tmp_path)
    assert [s.rank for s in run.series] == [0, 1]
    assert run.series[1].start_wall == pytest.approx(101.0)
    assert c.step_seconds(run.series[0]) == pytest.approx(0.1)
    assert c.robust_rate(run) == pytest.approx(10 / 0.1 + 10 / 0.3)
    assert c.job_rate(run) == pytest.approx(10 / 0.1 + 10 / 0.3)
    # Window: from rank 1's first step (101.3) to rank 0's last (105.0).
    rate, window = c.window_rate(run)
    assert window == pytest.approx(3.7)
    assert rate == pytest.approx(10 / 0.1 + 10 / 0.3)
    assert c.staleness(run) == {"p50": 0, "p99": 3, "max": 7}


def test_mtime_gives_the_start_when_records_lack_wall(tmp_path: Path) -> None:
    path = tmp_path / "steps-ps-rank0.jsonl"
    path.write_text(json.dumps({"step": 1, "time": 2.5, "samples": 4, "loss": 1.0}) + "\n")
    (s,) = c.load_run(tmp_path).series
    assert s.start_wall == pytest.approx(path.stat().st_mtime - 2.5)


def test_straggler_theory_is_the_classic_number() -> None:
    th = stragglers.theory(8, 3.0, 0.08, 32)
    assert th["async"] / th["sync"] == pytest.approx(2.75)
    assert th["sync"] == pytest.approx(8 * 32 / 0.24)
    assert 1.0 < stragglers.ssp_bound(8, 60, 2) < 1.1


def test_tables_render_and_goals_are_read(tmp_path: Path) -> None:
    docs = {
        "ps_datapath": {
            "results": [
                {"payload_mib": 16, "shards": 1, "gbps": 1.0, "tcp_gbps": 2.0, "ratio_to_tcp": 0.5}
            ]
        },  # fmt: skip
        "step_throughput": {
            "goals": {"allreduce_over_plain_ddp": {"measured": 0.98, "goal": 0.97, "met": True}}
        },
        "stragglers": {"workers": 8, "slow_factor": 3.0, "async_over_sync": 2.6, "goal_met": True},
        "links": {"cases": [{"step_ratio": 1.2}], "all_within_30pct": True},
        "elastic": {"ps_speedup": 3.1, "goal_met": True, "ps": {"samples_lost": 0}},
    }
    lines = suite.goals(docs)
    assert len(lines) == 5 and all("**met**" in ln for ln in lines)
    assert "preemption schedule" in lines[-1] and "0 samples lost" in lines[-1]
    assert "PS data path" in suite.table_of("ps_datapath", docs["ps_datapath"])
    assert "Skipped: no netns" in suite.table_of("links", {"skipped": "no netns"})
    results = tmp_path / "results.md"
    results.write_text(f"# Results\n\n## Suite runs\n\n{suite.MARK}\n\n## Older\n\nkeep me\n")
    suite.record("## first run\n\n### Goals\n\n- a", results)
    suite.record("## second run\n\n### Goals\n\n- b", results)
    text = results.read_text()
    assert text.count(suite.MARK) == 1 and "keep me" in text
    # newest first, under the marker, one heading level down
    assert text.index("### second run") < text.index("### first run") < text.index("keep me")
    assert "#### Goals" in text


def _bench(module: str, *args: str, timeout: float = 600) -> dict:
    p = subprocess.run([sys.executable, "-m", module, "--json", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


@pytest.mark.slow
def test_stragglers_json_schema(tmp_path: Path) -> None:
    doc = _bench("bench.stragglers", "--workers", "2", "--slow-factor", "2", "--steps", "5",
                 "--compute-ms", "20", "--out", str(tmp_path))  # fmt: skip
    assert set(doc["samples_per_sec"]) == {"sync", "async", "ssp"}
    for key in ("theory_async_over_sync", "async_over_sync", "ssp_over_sync", "time_to_target_s"):
        assert key in doc
    assert doc["theory_async_over_sync"] == pytest.approx(1.5)
    for mode in ("sync", "async", "ssp"):
        assert {"p99", "max"} <= set(doc["staleness"][mode])
        assert doc["samples_per_sec"][mode] > 0
    assert (tmp_path / "stragglers.json").exists() and (tmp_path / "stragglers.md").exists()


@pytest.mark.slow
def test_allreduce_against_plain_ddp_alone(tmp_path: Path) -> None:
    """The former allreduce-overhead benchmark: two rows, no no-communication run."""
    doc = _bench("bench.step_throughput", "--quick", "--steps", "8", "--runs",
                 "plain-ddp,psar-allreduce", "--out", str(tmp_path))  # fmt: skip
    (res,) = doc["results"]
    assert set(res["runs"]) == {"plain-ddp", "psar-allreduce"}
    assert (
        res["no_comm_samples_per_sec"] is None
        and res["runs"]["plain-ddp"]["exposed_comm_ms"] is None
    )
    assert res["runs"]["plain-ddp"]["ratio_to_plain_ddp"] == pytest.approx(1.0)
    assert set(doc["goals"]) == {"allreduce_over_plain_ddp"}
    assert isinstance(doc["goals"]["allreduce_over_plain_ddp"]["met"], bool)


@pytest.mark.slow
def test_step_throughput_json_schema(tmp_path: Path) -> None:
    doc = _bench("bench.step_throughput", "--quick", "--steps", "8", "--out", str(tmp_path))
    (res,) = doc["results"]
    assert set(res["runs"]) == {"plain-ddp", "psar-allreduce", "psar-ps-sync-1",
                                "psar-ps-sync-2", "psar-ps-sync-1-no-overlap",
                                "psar-ps-sync-1-chunk-rounds", "psar-ps-sync-1-grpc",
                                "psar-ps-sync-1-no-shm", "rpc-ps"}  # fmt: skip
    for r in res["runs"].values():
        assert {"samples_per_sec", "ratio_to_plain_ddp", "exposed_comm_ms"} <= set(r)
    ps = res["runs"]["psar-ps-sync-1"]
    assert set(ps["phase_ms"]) == {"push", "wait", "pull", "exposed"}
    assert ps["phase_ms"]["exposed"] > 0  # the phases really come from the step logs
    assert set(doc["goals"]) == {"ps_sync_over_plain_ddp", "ps_sync_over_rpc",
                                 "allreduce_over_plain_ddp"}  # fmt: skip


@pytest.mark.slow
def test_head_to_head_json_schema(tmp_path: Path) -> None:
    doc = _bench("bench.experiments.head_to_head", "--quick", "--steps", "10",
                 "--out", str(tmp_path))  # fmt: skip
    (case,) = doc["cases"]
    assert set(case["runs"]) == {"allreduce", "ps-sync", "ps-async", "ps-ssp"}
    assert case["runs"]["allreduce"]["samples_per_sec_x_allreduce"] == pytest.approx(1.0)
    assert all(r["samples_per_sec"] > 0 and r["job_samples_per_sec"] > 0
               for r in case["runs"].values())  # fmt: skip


@pytest.mark.slow
def test_scaling_json_schema(tmp_path: Path) -> None:
    doc = _bench("bench.links", "--grid", "loopback", "--grid-workers", "1,2", "--grid-shards",
                 "1", "--steps", "6", "--compute-ms", "30", "--out", str(tmp_path))  # fmt: skip
    assert [(r["workers"], r["shards"]) for r in doc["results"]] == [(1, 1), (2, 1)]
    assert doc["results"][0]["ratio_to_linear"] == pytest.approx(1.0)


@pytest.mark.slow
def test_links_json_schema_or_reason(tmp_path: Path) -> None:
    doc = _bench("bench.links", "--quick", "--steps", "6", "--out", str(tmp_path))
    if "skipped" in doc:
        assert doc["skipped"]
        return
    assert {x["arch"] for x in doc["cases"]} == {"ps", "allreduce"}
    for x in doc["cases"]:
        assert {"measured_step_ms", "predicted_step_ms", "step_ratio", "within_30pct"} <= set(x)


@pytest.mark.slow
def test_the_suite_writes_a_summary_with_goals(tmp_path: Path) -> None:
    docs = _bench("bench", "--quick", "--only", "ps_datapath", "--out", str(tmp_path))
    assert set(docs) == {"ps_datapath"}
    summary = (tmp_path / "summary.md").read_text()
    assert "### Goals" in summary and "PS data path" in summary
    assert (tmp_path / "ps_datapath" / "ps_datapath.log").exists()  # the child's own log
