"""Ranks of a loop of its own (worker/own_loop.py) agree, once a step, that each of them
runs a backward before its optimizer step.

Under DDP the gradients are allreduced during backward: a rank that calls step() without
a backward never joins that allreduce, and the others wait in theirs until the process
group's timeout (600 s by default), then fail without saying why. So every rank says,
before its step's first backward (run.backward) or, lacking one, in step(), whether it
ran a backward, in one small allreduce of its own; that collective comes before any of
the step's gradient buckets on every rank, so all of them meet in it and all raise the
same error naming the ranks that skipped the backward, at once instead of hanging.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def agree_on_backward(did_backward: bool, rank: int, world_size: int, step: int,
                      device: torch.device) -> None:  # fmt: skip
    """Every rank calls this once per step (see the module docstring); raises on every
    rank alike if any rank stepped without a backward."""
    flags = torch.zeros(world_size, dtype=torch.int32, device=device)
    flags[rank] = int(did_backward)
    dist.all_reduce(flags)
    skipped = [r for r, f in enumerate(flags.tolist()) if not f]
    if skipped:
        raise RuntimeError(
            f"step {step}: rank(s) {skipped} called optimizer.step() without a backward "
            "since their last step, so their gradients were never combined with the "
            "others'; call run.backward(loss) on every rank before every "
            "run.optimizer.step() (every rank stops here rather than wait on the others)"
        )
