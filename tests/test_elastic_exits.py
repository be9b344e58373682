"""How workers leave an elastic job, and how late or wrong ones are turned away (issue #45
defects 7-10), with real `psar server` and `psar train` processes:

- rank 0 stopped (SIGTERM) or killed (SIGKILL) mid-job: a model file still holds the
  job's final weights, written by the worker the shards name (its val loss is the job's);
- a joiner refused for another model holds no rank (the next Join gets it at once) and
  never logs "joined";
- a joiner to a job whose data is all dealt is told so and exits 0, long before any pull
  deadline;
- a joiner given a departed worker's rank writes a step log of its own."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import grpc
import pytest
import torch

from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from psar.worker.data import evaluate
from psar.worker.report import load_run
from psar.worker.workloads import load_workload
from tests.fault_procs import shard_set, stats, wait_until
from tests.test_elastic import LEASE, Job

EVAL = 4
ARGS = ["--world-size", "2", "--max-workers", "3", "--steps", "300",
        "--emulate-compute-ms", "40", "--eval-batches", str(EVAL)]  # fmt: skip


def val_loss_of(path: Path) -> float:
    """The val loss of a saved model, computed as the workers do (tests/fault_procs BASE:
    mlp, seed 1, batch 16, fp32)."""
    wl = load_workload("mlp", 1, {})
    wl.model.load_state_dict(torch.load(path))
    return wl.val_value(evaluate(wl.model, wl.val_dataset, wl.loss_fn, 16, None, EVAL))


def reports(tmp: Path, *names: str) -> dict[str, dict]:
    return {n: json.loads((tmp / f"report-{n}.json").read_text()) for n in names}


def check_the_model(tmp: Path, survivors: tuple[str, ...], left: str) -> None:
    """One worker wrote --save (not the one that left early), and the file's val loss is
    the one that worker reported for the job."""
    model = tmp / "model.pt"
    assert model.exists(), "no file holds the job's model"
    got = reports(tmp, *survivors)
    writers = [n for n, r in got.items() if r["saved_model"] == str(model)]
    assert len(writers) == 1, {n: r["saved_model"] for n, r in got.items()}
    assert got[writers[0]]["val_loss"] == pytest.approx(val_loss_of(model), rel=1e-5)
    if (tmp / f"report-{left}.json").exists():  # SIGTERM: it reported, and wrote nothing
        assert reports(tmp, left)[left]["saved_model"] is None


@pytest.mark.slow  # real processes for 4-30 s: the slow suite
def test_rank0_stopped_a_refused_joiner_and_a_late_one(tmp_path: Path) -> None:
    save = ["--save", str(tmp_path / "model.pt")]
    with shard_set(1, tmp_path, *LEASE) as (shard,):
        addr = shard.address
        job = Job([addr], tmp_path, [*ARGS, *save])
        try:
            job.start("w0", "--rank", "0")
            job.start("w1", "--rank", "1")
            wait_until(lambda: min(stats([addr])[0]["worker_clocks"][:2]) >= 2, 180, "both train")
            job.signal("w0", signal.SIGTERM)  # rank 0 leaves mid-job
            assert job.wait("w0") == 0

            # Defect 8: a joiner with another model is refused; it takes no rank.
            job.start("other", "--join", "--workload-option", "hidden=32")
            assert job.wait("other", timeout=120) == 1
            log = job.log("other")
            assert "serves a different job" in log and "joined a job" not in log, log
            assert stats([addr])[0]["joins"] == 0
            with grpc.insecure_channel(addr) as ch:  # the next Join gets rank 2 at once
                reply = pb_grpc.ParameterServerStub(ch).Join(
                    pb.JoinRequest(instance="next"), timeout=10
                )
            assert reply.worker == 2

            assert job.wait("w1") == 0  # w1 trains the rest alone

            # Defect 9: the data is all dealt; a joiner is told and exits 0.
            job.start("late", "--join", "--pull-timeout-s", "600")
            assert job.wait("late", timeout=120) == 0, job.log("late")
            assert "data is all dealt" in job.log("late")
        finally:
            job.close()
    check_the_model(tmp_path, ("w1",), left="w0")
    assert reports(tmp_path, "w1")["w1"]["workers_took_part"] == 2  # w0 and w1 pushed


@pytest.mark.slow
def test_rank0_killed_mid_job_still_leaves_the_model(tmp_path: Path) -> None:
    with shard_set(1, tmp_path, *LEASE) as (shard,):
        addr = shard.address
        job = Job([addr], tmp_path, [*ARGS, "--save", str(tmp_path / "model.pt")])
        try:
            job.start("w0", "--rank", "0")
            job.start("w1", "--rank", "1")
            wait_until(lambda: min(stats([addr])[0]["worker_clocks"][:2]) >= 2, 180, "both train")
            job.signal("w0", signal.SIGKILL)
            job.wait("w0")
            # A joiner takes the dead worker's rank once its lease ran out, and logs
            # its steps in a file of its own (defect 10).
            wait_until(lambda: stats([addr])[0]["lease_expirations"] >= 1, 60, "w0's lease")
            job.start("j", "--join")
            assert job.wait("w1") == 0 and job.wait("j") == 0
        finally:
            job.close()
    check_the_model(tmp_path, ("w1", "j"), left="w0")
    assert reports(tmp_path, "j")["j"]["rank"] in (0, 2)


@pytest.mark.slow  # real processes for 4-30 s: the slow suite
def test_a_joiner_given_a_used_rank_writes_its_own_step_log(tmp_path: Path) -> None:
    """Defect 10: steps-ps-rank{R}.jsonl of a departed worker is never overwritten."""
    with shard_set(1, tmp_path, *LEASE) as (shard,):
        addr = shard.address
        args = ["--world-size", "2", "--max-workers", "2", "--steps", "300",
                "--emulate-compute-ms", "40"]  # fmt: skip
        job = Job([addr], tmp_path, args)
        try:
            job.start("w0", "--rank", "0")
            job.start("w1", "--rank", "1")
            wait_until(lambda: min(stats([addr])[0]["worker_clocks"]) >= 2, 180, "both train")
            job.signal("w1", signal.SIGTERM)
            assert job.wait("w1") == 0
            job.start("j", "--join")  # rank 1 is free again: the joiner gets it
            assert job.wait("j") == 0 and job.wait("w0") == 0
        finally:
            job.close()
    run = tmp_path / "run"
    names = sorted(p.name for p in run.glob("steps-*.jsonl"))
    assert names == ["steps-ps-rank0.jsonl", "steps-ps-rank1.1.jsonl", "steps-ps-rank1.jsonl"]
    first, second = (
        [json.loads(x)["batches"] for x in (run / n).read_text().splitlines()]
        for n in ("steps-ps-rank1.jsonl", "steps-ps-rank1.1.jsonl")
    )
    assert first and second and not {i for b in first for i in b} & {i for b in second for i in b}
    series, _ = load_run(run)  # psar report reads every worker's file
    assert sorted(s.rank_label for s in series) == ["0", "1", "1.1"]
