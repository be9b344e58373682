"""A loop of its own, cut and resumed with run.save_state() / prepare(resume_from=) +
the scheduler registered again, as docs/own-loop.md shows them (examples/own_loop.py --state-dir /
--resume), equals the run never cut, bit for bit, under ps sync and allreduce (issue 45,
defect 15): a Hugging Face warm-up scheduler (lr 0 at the first step) cut mid-warm-up,
AdamW, dropout, clipping and no_sync accumulation; 2 workers, real processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_own_loop import _launch

STEPS, CUT = 7, 2
# The lr is 0 at step 1 and reaches its peak at step 4: the cut (after step 2) is inside
# the warm-up, where a scheduler built anew would set every lr back to 0.
ARGS = ["--steps", str(STEPS), "--batch-size", "16", "--optimizer", "adamw", "--lr", "0.01",
        "--schedule", "linear", "--warmup", "3", "--clip", "0.5", "--accum", "2",
        "--dropout", "0.2", "--seed", "3", "--log-every", "1"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["ps", "allreduce"])
def test_a_resumed_run_equals_the_run_never_cut(arch: str, tmp_path: Path) -> None:
    whole, _ = _launch(arch, *ARGS, "--save", str(tmp_path / "whole.pt"))
    state = tmp_path / "state"
    first, _ = _launch(arch, *ARGS, "--state-dir", str(state), "--save-every", str(CUT),
                       "--stop-after", str(CUT))  # fmt: skip
    assert sorted(p.name for p in state.iterdir()) == [
        "model.pt",
        "optimizer.pt",
        "rank0.pt",
        "rank1.pt",
    ]
    rest, _ = _launch(arch, *ARGS, "--resume", str(state), "--save", str(tmp_path / "resumed.pt"),
                      steps_from=CUT + 1)  # fmt: skip
    for rank in (0, 1):
        assert len(first[rank]) == CUT and len(rest[rank]) == STEPS - CUT
        # Every loss the same float (the printed 9 digits of a float32 sum).
        assert first[rank] + rest[rank] == whole[rank], (rank, first[rank], rest[rank])
    a, b = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for i, s in a["optimizer"]["state"].items():
        for name, v in s.items():
            assert torch.equal(v, b["optimizer"]["state"][i][name]), (i, name)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
