"""Workers that disagree about a job's size, and how many took part (issue #45 defect 13),
with real `psar server` and `psar train` processes: rank 0 started with --world-size 2
and rank 1 with 3 both stop with one line (the shards' reason, no traceback), instead of
rank 1 failing in a traceback while rank 0 trains alone; a job that trained with fewer
workers than its --world-size says so in its summary (workers_took_part)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fault_procs import Workers, shard_set

ARGS = ["--mode", "sync", "--steps", "40", "--emulate-compute-ms", "20"]


def test_workers_that_disagree_about_the_size_all_stop_with_one_line(tmp_path: Path) -> None:
    with shard_set(1, tmp_path) as (shard,):
        w = Workers([shard.address], 2, tmp_path, ARGS, per_rank={1: ["--world-size", "3"]})
        try:
            codes = [p.wait(timeout=120) for p in w.procs if p is not None]
        finally:
            w.close()
    logs = [w.log(r) for r in range(2)]
    assert codes == [2, 2], logs
    for r, log in enumerate(logs):
        assert "Traceback" not in log, log
        errors = [x for x in log.splitlines() if x.startswith("psar train: error:")]
        assert len(errors) == 1 and "--world-size 3" in errors[0], (r, log)
    assert "the job was stopped" in logs[0] and "rank 0 with 2" in logs[0]
    assert not (tmp_path / "report-0.json").exists()  # rank 0 did not train alone


@pytest.mark.slow  # the default run's 5 minutes; the disagreeing sizes test stays in it
def test_a_job_trained_by_fewer_workers_than_its_size_says_so(tmp_path: Path) -> None:
    # Rank 1 never starts: its first term (--join-grace-s) runs out and rank 0 trains alone.
    with shard_set(1, tmp_path, "--lease-s", "1", "--join-grace-s", "1") as (shard,):
        alone = {0: ["--world-size", "2"]}  # the last --world-size given is the one taken
        w = Workers([shard.address], 1, tmp_path, ARGS, per_rank=alone)
        try:
            (report,) = w.wait()
        finally:
            w.close()
    assert report["world_size"] == 2 and report["workers_took_part"] == 1, report
    assert "only 1 of 2 workers took part" in w.log(0)


@pytest.mark.slow  # real processes for 4-30 s: the slow suite
def test_a_full_job_says_every_worker_took_part(tmp_path: Path) -> None:
    with shard_set(1, tmp_path) as (shard,):
        w = Workers([shard.address], 2, tmp_path, ARGS)
        try:
            reports = w.wait()
        finally:
            w.close()
    assert reports[0]["workers_took_part"] == 2
    assert reports[1]["workers_took_part"] is None  # only rank 0 asks the shards
    assert "2 of 2 workers took part" in w.log(0)
