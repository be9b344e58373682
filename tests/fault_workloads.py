"""A workload that dies once, for the allreduce restart test
(`--workload tests.fault_workloads:crashing_mlp`).

The mlp workload, except that on the first launch (TORCHELASTIC_RESTART_COUNT 0) the
rank `crash_rank` exits hard (as if killed) in its `crash_step`-th loss computation.
torchrun --max-restarts then relaunches every rank.
"""

from __future__ import annotations

import os
from typing import Any

from psar.worker.workloads.base import Workload
from psar.worker.workloads.mlp import make


def crashing_mlp(
    seed: int, *, crash_step: Any = 5, crash_rank: Any = 1, **options: Any
) -> Workload:
    w = make(seed, **options)
    first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    dies = first_launch and os.environ.get("RANK") == str(crash_rank)
    calls = 0
    loss_fn = w.loss_fn

    def loss(out, y):  # noqa: ANN001, ANN202
        nonlocal calls
        calls += 1
        if dies and calls == int(crash_step):
            os._exit(137)
        return loss_fn(out, y)

    w.loss_fn = loss
    return w
