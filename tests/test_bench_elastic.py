"""bench/elastic.py: its counting on synthetic step logs (what the final model was trained
on: lost, repeated, rolled back; time lost per event) and a tiny real run of the whole
schedule for both architectures (slow: its JSON keys, and the PS loses no sample)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.lib import elastic_count as ec
from psar.worker.data import ElasticBatches, ShardedBatches
from tests.test_bench_smoke import _bench

N, B = 96, 4  # samples, batch: 24 batches in the epoch


def _proc(rank: int, world: int, key: str, start: float, resume: int, steps: range) -> ec.Proc:
    cut = ShardedBatches(range(N), batch_size=B, rank=rank, world_size=world, seed=0)
    p = ec.Proc(rank, world, key, start, resume)
    for s in steps:
        idx = cut.indices(s - 1).tolist()
        p.steps[s] = ec.Step(start + s, len(idx), 1.0, idx)
    return p


def test_allreduce_lineage_counts_only_what_the_final_model_holds() -> None:
    # Round a: 2 ranks, steps 1-5 (batches 0-9), checkpoint at step 4. Round b: 4 ranks
    # resume from it (step 4 of 2 = step 2 of 4) and train steps 3-4 (batches 8-15), then
    # die before a checkpoint. Round c: 4 ranks again from that rebased step 2: steps 3-6
    # (batches 8-23). Step 5 of round a and all of round b were rolled back.
    a = [_proc(r, 2, "a", 100, 0, range(1, 6)) for r in range(2)]
    b = [_proc(r, 4, "b", 200, 4, range(3, 5)) for r in range(4)]
    c = [_proc(r, 4, "c", 300, 2, range(3, 7)) for r in range(4)]
    groups = ec.rounds(c + a + b)
    assert [g[0].round_key for g in groups] == ["a", "b", "c"]
    assert ec.lineage(groups) == {2: None, 1: 2, 0: 4}
    counted = ec.count_allreduce(a + b + c)
    assert counted.lost(N) == 0 and counted.repeated() == 0
    assert sum(n for _, n, _ in counted.rolled_back) == (2 + 2 * 4) * B
    # Without the rebase (round c starting at step 5 of 4: batches 16-23 from step 5, as
    # if the world had not changed), batches 8-15 are lost.
    c_skip = [_proc(r, 4, "c", 300, 2, range(5, 7)) for r in range(4)]
    assert ec.count_allreduce(a + b + c_skip).lost(N) == 8 * B


def test_a_round_started_from_a_shrunk_world_repeats_what_it_trains_twice() -> None:
    a = [_proc(r, 4, "a", 100, 0, range(1, 4)) for r in range(4)]  # batches 0-11, ckpt 3
    b = [_proc(0, 1, "b", 200, 3, range(11, 25))]  # step 10 of 1 rank: batches 10-23
    counted = ec.count_allreduce(a + b)
    assert counted.repeated() == 2 * B and counted.lost(N) == 0


def _ps_logs(run: Path, deals: dict[str, list[list[int]]]) -> None:
    for name, steps in deals.items():
        (run / name).mkdir(parents=True)
        with (run / name / "steps-ps-rank0.jsonl").open("w") as fh:
            for k, ids in enumerate(steps):
                fh.write(json.dumps({"step": k + 1, "wall": 10.0 + k, "loss": 2.0, "batches": ids}) + "\n")  # fmt: skip


def test_ps_counts_from_the_step_logs_and_the_shards_consumed_ids(tmp_path: Path) -> None:
    n_ids = N // B
    _ps_logs(tmp_path, {"w0": [[i] for i in range(0, n_ids, 2)],
                        "w1": [[i] for i in range(1, n_ids - 2, 2)]})  # fmt: skip
    # The last odd id was trained by no logged step: lost, unless the shards consumed it
    # (a worker killed between its push and its log line).
    assert ec.count_ps(tmp_path, N, B, 0, consumed_ids=None).lost(N) == B
    counted = ec.count_ps(tmp_path, N, B, 0, consumed_ids=n_ids)
    assert counted.lost(N) == 0 and counted.unlogged == B and counted.repeated() == 0
    # The samples are those ElasticBatches gives the ids.
    want = set(ElasticBatches(range(N), batch_size=B, seed=0).indices(0).tolist())
    assert want <= set(counted.trained)


def test_time_lost_is_the_stall_after_an_event_and_the_work_thrown_away() -> None:
    steps = [(float(t), 8) for t in (*range(0, 10), *range(15, 20))]  # a 5 s gap at 10-15
    counted = ec.Counted(ec.Counter(), steps, [], rolled_back=[(8.5, 8, 11.0), (9.5, 8, 11.0)],
                         step_s=1.0)  # fmt: skip
    rows = ec.time_lost(counted, [("start", 0.0), ("kill", 10.0)], 20.0)
    assert rows[0]["stall_s"] == 0.0 and rows[0]["rolled_back_s"] == 0.0
    assert rows[1]["stall_s"] == pytest.approx(5.0 - 1.0)  # 10 -> 15, less one step
    assert rows[1]["rolled_back_s"] == pytest.approx(1.0 + 1.0)
    assert rows[1]["rolled_back_samples"] == 16
    assert ec.rate_series(steps, 0.0, 20.0, 5.0)[:3] == [(0.0, 8.0), (5.0, 8.0), (10.0, 0.0)]


@pytest.mark.slow
def test_the_schedule_end_to_end_for_both_architectures(tmp_path: Path) -> None:
    doc = _bench("bench.elastic", "--quick", "--batches", "240", "--compute-ms", "200",
                 "--no-fixed", "--out", str(tmp_path), timeout=900)  # fmt: skip
    for arch in ("ps", "allreduce"):
        row = doc[arch]
        assert {"seconds", "samples_lost", "samples_repeated"} <= set(row)
        assert row["seconds"] > 0 and row["samples_planned"] == 240 * 8
        assert [e["event"] for e in row["events"]] == ["start 2", *doc["schedule"][1:]]
    assert doc["ps"]["samples_lost"] == 0 and doc["ps"]["samples_repeated"] == 0
    assert doc["allreduce"]["restarts"] >= 4  # every change restarted the torchrun job
    assert (tmp_path / "elastic.json").exists() and (tmp_path / "elastic.md").exists()
