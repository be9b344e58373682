"""A run's final loss, one definition for every report (issue #45 defect 14)."""

from __future__ import annotations

import math

FINAL_LOSS_STEPS = 10
"""psar's one definition of a run's final loss (the report's final_train_loss, psar
report's "final loss", psar compare's "final train loss"): the mean of the last
FINAL_LOSS_STEPS finite step losses of that rank (one step's loss is noise)."""


def final_loss(losses: list[float], steps: int = FINAL_LOSS_STEPS) -> float | None:
    """The mean of the finite losses among the last `steps` (None: none is finite)."""
    tail = [v for v in losses[-steps:] if math.isfinite(v)]
    return sum(tail) / len(tail) if tail else None
