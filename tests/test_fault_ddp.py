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

from ps.server.durability.checkpoints import load
from tests.procs import ENV, free_port

EVERY = 3


def torchrun(tmp, steps: int, *extra: str) -> subprocess.CompletedProcess:
    args = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "worker.cli", "train", "--arch", "allreduce", "--torch-threads", "1", "--log-every", "0",
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
