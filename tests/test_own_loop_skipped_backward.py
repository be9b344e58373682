"""One rank of a loop of its own calls optimizer.step() without a backward (issue 45,
defect 16): the job stops with a clear error instead of hanging (allreduce: until the
process group's 600 s timeout) or averaging in a missing gradient (ps). Two workers,
real processes under `psar launch`; the one-process cases: tests/test_own_loop_misuse.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import ENV, PSAR, run_own_group, shards

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys
import torch
import torch.nn.functional as F
from psar import prepare

skip_rank, skip_step = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
with prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), seed=0) as run:
    gen = torch.Generator().manual_seed(run.rank)
    for step in range(1, 6):
        x, y = torch.randn(8, 4, generator=gen), torch.randint(0, 2, (8,), generator=gen)
        run.optimizer.zero_grad()
        loss = F.cross_entropy(run.model(x), y)
        if (run.rank, step) != (skip_rank, skip_step):
            run.backward(loss)
        run.optimizer.step()
        print(f"rank={run.rank} step={step} done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["ps", "allreduce"])
def test_a_rank_stepping_without_backward_stops_the_job_saying_so(
    arch: str, tmp_path: Path
) -> None:
    script = tmp_path / "skips.py"
    script.write_text(SCRIPT)
    ps = ["--mode", "sync", "--servers", "1"] if arch == "ps" else []
    args = [*PSAR, "launch", "--arch", arch, *ps, "--workers", "2", "--",
            sys.executable, str(script), "1", "2"]  # fmt: skip
    # Without the check: allreduce hangs until the process group's timeout (600 s), so
    # this timeout fails the test; ps trains on (exit 0) with rank 1's gradient missing.
    p = run_own_group(args, timeout=180, cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "rank=1 step=1 done" in out and "rank=1 step=2 done" not in out, out[-3000:]
    if arch == "allreduce":
        # Every rank stops in the step's agreement, with the same message.
        said = "step 2: rank(s) [1] called optimizer.step() without a backward"
        assert out.count(said) >= 2, out[-3000:]
        assert "rank=0 step=2 done" not in out, out[-3000:]
    else:
        assert "rank 1: run.optimizer.step() without a backward" in out, out[-3000:]
        # Rank 1 sent nothing for step 2: rank 0's round never closed without it.
        assert "rank=0 step=2 done" not in out, out[-3000:]


@pytest.mark.slow
def test_under_ps_every_rank_hears_why_the_job_stopped(tmp_path: Path) -> None:
    """By hand (no launcher to end the others): rank 1 steps without a backward at step
    2, and rank 0, waiting on the sync round rank 1 never pushes to, ends within a pull
    with rank 1's own line (the shard stops the job with it), not after the pull timeout
    (300 s) and not by training on alone."""
    script = tmp_path / "skips.py"
    script.write_text(SCRIPT)
    with shards(1) as addrs:
        procs = []
        for rank in range(2):
            env = {**ENV, "PSAR_SERVERS": addrs[0], "RANK": str(rank), "WORLD_SIZE": "2",
                   "LOCAL_RANK": str(rank), "PSAR_ARGS": "--mode sync --torch-threads 1"}  # fmt: skip
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), "1", "2"],
                    cwd=ROOT,
                    env=env,
                    text=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            )
        try:
            outs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
    said = "the job was stopped: worker 1 failed: rank 1: run.optimizer.step() without a backward"
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode != 0, f"rank {rank}:\n{out[-3000:]}"
        assert "step=2 done" not in out, f"rank {rank}:\n{out[-3000:]}"
    assert "every rank was told why" in outs[1], outs[1][-3000:]
    assert said in outs[0], outs[0][-3000:]
