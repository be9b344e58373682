"""One rank of a loop of its own calls optimizer.step() without a backward (issue 45,
defect 16): the job stops with a clear error instead of hanging (allreduce: until the
process group's 600 s timeout) or averaging in a missing gradient (ps). Two workers,
real processes under `psar launch`; the one-process cases: tests/test_own_loop_misuse.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.procs import PSAR, run_own_group

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
