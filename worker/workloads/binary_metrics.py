"""Held-out metrics of a binary classifier (a click model), as recommendation users read
them: logloss and ROC AUC. Both take the model's raw outputs (logits) and 0/1 targets of
the whole evaluated set at once: AUC is a ranking over all samples, not a per-batch mean.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["binary_auc", "binary_logloss", "click_metrics"]


def binary_logloss(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean binary cross-entropy (nats) of sigmoid(logits) against 0/1 targets, in float64
    from the logits (stable where a probability rounds to 0 or 1)."""
    if logits.numel() == 0:
        raise ValueError("binary_logloss: no samples")
    x, y = logits.detach().reshape(-1).double(), targets.detach().reshape(-1).double()
    return float(F.binary_cross_entropy_with_logits(x, y))


def binary_auc(scores: torch.Tensor, targets: torch.Tensor) -> float | None:
    """Exact ROC AUC: the Mann-Whitney statistic P(score of a random positive > score of a
    random negative), a tied pair counted half. O(n log n): one sort (torch.unique).

    Any monotone transform of the scores gives the same AUC, so logits or probabilities
    both work. Returns None when the targets hold one class only (no positive-negative
    pair: the AUC is undefined), NaN when a score is NaN (a diverged model ranks nothing).
    """
    s, y = scores.detach().reshape(-1).double(), targets.detach().reshape(-1)
    if s.shape != y.shape:
        raise ValueError(f"binary_auc: {s.numel()} scores but {y.numel()} targets")
    pos = y > 0.5
    n_pos = int(pos.sum())
    n_neg = s.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    if bool(torch.isnan(s).any()):
        return math.nan
    # Rank of each sample among all (1-based), tied scores sharing their mean rank: the
    # group of value g spans ranks (start_g, start_g + count_g], mean start_g + (count_g+1)/2.
    _, inverse, counts = torch.unique(s, sorted=True, return_inverse=True, return_counts=True)
    counts = counts.double()
    start = torch.cumsum(counts, 0) - counts
    rank = (start + (counts + 1) / 2)[inverse]
    # Mann-Whitney U of the positives: their rank sum less the least it could be.
    u = float(rank[pos].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def click_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float | None]:
    """The recsys workload's held-out metrics (Workload.val_metrics): ``val_logloss`` and
    ``val_auc``."""
    return {"val_logloss": binary_logloss(logits, targets), "val_auc": binary_auc(logits, targets)}
