"""The end-of-run validation every architecture runs (worker/loop.py `_finish`): the
mean held-out loss (``val_loss``, through the workload's ``val_transform``) and, where
the workload has a ``val_metrics`` hook, its extra named metrics over the same samples
(recsys: ``val_logloss``, ``val_auc``). Under ps, allreduce and hybrid alike the model
here is the worker's own, so one function serves them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where validation runs: `psar report/compare --help` load none
    from psar.worker.data import AutocastArg
    from psar.worker.workloads import Workload

__all__ = ["column", "extra_names", "validate"]


def validate(
    workload: Workload, batch_size: int, autocast: AutocastArg, max_batches: int
) -> dict[str, Any]:
    """The report's validation keys: ``val_loss``, ``val_loss_unit``, and with a
    ``val_metrics`` hook each of its metrics plus ``val_extra_metrics`` (their names, in
    order, so `psar report` / `psar compare` find them without knowing the workload)."""
    import torch

    from psar.worker.data import evaluate

    unit = workload.val_metric if workload.val_metric != "loss" else "nats"
    if workload.val_dataset is None or not max_batches:
        return {"val_loss": None, "val_loss_unit": unit}
    # The outputs are kept only for a hook: (n,) logits for recsys, but an lm's would be
    # (n, seq, vocab), too many to hold for nothing.
    keep: list[tuple[Any, Any]] | None = [] if workload.val_metrics is not None else None
    mean = evaluate(
        workload.model,
        workload.val_dataset,
        workload.loss_fn,
        batch_size,
        autocast,
        max_batches=max_batches,
        keep=keep,
    )
    out: dict[str, Any] = {"val_loss": workload.val_value(mean), "val_loss_unit": unit}
    if keep:
        extra = workload.extra_val_metrics(
            torch.cat([o for o, _ in keep]), torch.cat([t for _, t in keep])
        )
        out.update(extra)
        out["val_extra_metrics"] = list(extra)
    return out


def extra_names(summaries: list[dict[str, Any]]) -> list[str]:
    """The extra held-out metrics (``val_extra_metrics``) named in any of these reports,
    first-seen order: `psar report` and `psar compare` give each a column."""
    names: list[str] = []
    for d in summaries:
        names += [n for n in d.get("val_extra_metrics") or () if n not in names]
    return names


def column(name: str) -> str:
    """A metric's column heading: ``val_auc`` -> ``val AUC``, ``val_logloss`` -> ``val logloss``."""
    return name.replace("_", " ").replace(" auc", " AUC")
