"""The allreduce architecture resumes too: rank 0 checkpoints every --checkpoint-every
steps; when a rank dies, torchrun --max-restarts relaunches the job and every rank
continues from the newest checkpoint instead of step 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from psar.ps.server.durability.checkpoints import load
from tests.procs import ENV, free_port

EVERY = 3


def torchrun(tmp, steps: int, *extra: str) -> subprocess.CompletedProcess:
    args = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "psar.worker.cli", "train", "--arch", "allreduce", "--torch-threads", "1", "--log-every", "0",
        "--workload", "tests.fault_workloads:crashing_mlp", "--workload-option", "crash_step=8",
        "--batch-size", "16", "--precision", "fp32", "--eval-batches", "0", "--steps", str(steps),
        "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", str(EVERY),
        "--report", str(tmp / "report.json"), *extra,
    ]  # fmt: skip
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=ENV, start_new_session=True)  # fmt: skip
    try:
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:  # the agent and every rank it started
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return subprocess.CompletedProcess(args, p.returncode, out, err)


@pytest.mark.slow
def test_relaunched_ddp_job_resumes_from_the_newest_checkpoint(tmp_path) -> None:
    steps = 12
    p = torchrun(tmp_path, steps)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    # Rank 1 died in step 8, after the checkpoint of step 6: the relaunch went on from 6.
    assert report["start_step"] == 6
    assert len(report["losses"]) == steps - 6
    final = load(tmp_path / "ckpt" / f"ddp-{steps:012d}.pt")
    assert final["step"] == steps
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        f"ddp-{s:012d}.pt" for s in (6, 9, 12)
    ]


def run_world(tmp, nproc: int, steps: int) -> list[dict]:
    """psar train --arch allreduce on `nproc` ranks for --steps `steps` from the shared
    checkpoint folder; each rank's step log lines (rank, step)."""
    run = tmp / f"run-{nproc}-{steps}"
    args = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "psar.worker.cli", "train", "--arch", "allreduce", "--torch-threads", "1",
        "--log-every", "0", "--workload", "mlp", "--batch-size", "16", "--precision", "fp32",
        "--eval-batches", "0", "--steps", str(steps), "--checkpoint-dir", str(tmp / "ckpt"),
        "--checkpoint-every", str(EVERY), "--run-dir", str(run),
    ]  # fmt: skip
    p = subprocess.run(args, capture_output=True, text=True, env=ENV, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return [
        {"rank": int(f.stem.rsplit("rank", 1)[1]), "world": nproc, **json.loads(line)}
        for f in sorted(run.glob("steps-allreduce-rank*.jsonl"))
        for line in f.read_text().splitlines()
    ]


@pytest.mark.slow
def test_a_world_of_another_size_continues_at_the_same_place_in_the_data(tmp_path) -> None:
    """torchrun --nnodes MIN:MAX restarts a job with more or fewer ranks: the checkpoint's
    step is rebased to the new world's steps, so no batch of the epoch is skipped or
    trained twice (2 ranks, then 1, then 2 again)."""
    from psar.worker.data import ShardedBatches

    first = run_world(tmp_path, 2, 6)  # checkpoint of step 6: batches 0..11
    alone = run_world(tmp_path, 1, 20)  # continues at step 12 (6 x 2 / 1): batches 12..19
    assert min(x["step"] for x in alone) == 13
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())  # 12 was saved, then pruned
    assert names == [f"ddp-{s:012d}.pt" for s in (15, 18, 20)]
    assert load(tmp_path / "ckpt" / names[-1])["world"] == 1
    # 2 ranks again: step 20 of 1 rank is their step 10, saved at once, and the 1-rank
    # checkpoints numbered past it dropped (--steps 10: nothing left to train).
    assert run_world(tmp_path, 2, 10) == []
    assert os.listdir(tmp_path / "ckpt") == [f"ddp-{10:012d}.pt"]
    assert load(tmp_path / "ckpt" / f"ddp-{10:012d}.pt")["world"] == 2
    again = run_world(tmp_path, 2, 16)  # continues at step 10: batches 20..31
    assert min(x["step"] for x in again) == 11
    assert max(int(n[4:16]) for n in os.listdir(tmp_path / "ckpt")) == 16
    trained: list[int] = []
    for x in first + alone + again:
        cut = ShardedBatches(range(4096), batch_size=16, rank=x["rank"],
                             world_size=x["world"], seed=0)  # fmt: skip
        trained += cut.indices(x["step"] - 1).tolist()
    assert len(trained) == len(set(trained)) == 32 * 16  # every batch of 0..31 once
