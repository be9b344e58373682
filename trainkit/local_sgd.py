"""Local SGD / DiLoCo, the worker's half, shared by both architectures (--mode local).

A worker runs its own *inner* optimizer (--optimizer) on its own weights for H steps
(--sync-every), with no communication at all. Then it computes its *pseudo-gradient*,
the weights at the last sync minus the weights now, and the pseudo-gradients of all
workers are averaged and handed to the *outer* optimizer, which updates the shared
weights from those of the last sync (Douillard et al., DiLoCo, arXiv 2311.08105).
Where the averaging and the outer step run is the architecture's business: on the
shards (ps/server/modes/local.py) or on every rank after an allreduce
(allreduce/backend.py). Everything else -- inner steps, the anchor weights, the
pseudo-gradient, the drift -- is the same code here, so both run the same arithmetic.

Here in trainkit (not worker/) because the backends of both architectures use it and
trainkit is what both may import without crossing a wall (tests/test_walls.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from psar.trainkit.finite import all_finite
from psar.trainkit.optim import (
    LossScaleConfig,
    OptimizerConfig,
    build_optimizer,
    build_scheduler,
    with_run_length,
)


def outer_optimizer_config(name: str, lr: float, momentum: float) -> OptimizerConfig:
    """The outer optimizer as an OptimizerConfig (what a shard or a rank builds with
    psar.trainkit.optim): nesterov = SGD with Nesterov momentum; sgd = SGD without momentum
    (lr 1.0: the new weights are the plain average of the workers')."""
    nesterov = name == "nesterov"
    return OptimizerConfig(
        name="sgd", lr=lr, momentum=momentum if nesterov else 0.0, nesterov=nesterov
    )


class LocalSteps:
    """One worker's inner optimizer, its anchor (the weights of the last sync) and the
    figures of its outer rounds.

    `params` are the worker's fp32 parameters, stepped in place by the inner optimizer;
    the backend averages what `pseudo_gradients` returns and writes the new shared
    weights back into them, then calls `rebase`.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        inner: OptimizerConfig,
        *,
        sync_every: int,
        total_steps: int,
        loss_scale: LossScaleConfig,
        device: torch.device,
        start_step: int = 0,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"--sync-every must be >= 1, got {sync_every}")
        self.params = params
        self.sync_every = sync_every
        self.total_steps = total_steps
        cfg = with_run_length(inner, total_steps)
        self.optimizer = build_optimizer(params, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        # Inner steps in fp16 need their own loss scale (GradScaler semantics, as DDP).
        self.scaler = torch.amp.GradScaler(
            device.type,
            init_scale=loss_scale.init_scale,
            growth_factor=loss_scale.growth_factor,
            backoff_factor=loss_scale.backoff_factor,
            growth_interval=loss_scale.growth_interval,
            enabled=loss_scale.enabled,
        )
        self.anchor = [p.detach().clone() for p in params]
        self.step_index = start_step
        self.rounds = 0
        self.skipped_rounds = 0
        self.round_bytes = 0
        self.bytes_total = 0
        self.drifts: list[float] = []

    # ---- inner steps ------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def inner_step(self) -> bool:
        """One step of the inner optimizer on this worker's gradients; True if skipped
        (non-finite gradients: the weights stay)."""
        self.step_index += 1
        if self.scaler.is_enabled():
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < before
        else:
            skipped = not all_finite(p.grad for p in self.params if p.grad is not None)
            if not skipped:
                self.optimizer.step()
        if not skipped:
            self.scheduler.step()
        return skipped

    def due(self) -> bool:
        """Does the step just taken end an outer round (every H steps, and the last)?"""
        return self.step_index % self.sync_every == 0 or self.step_index >= self.total_steps

    # ---- outer rounds -----------------------------------------------------------------

    def pseudo_gradients(self) -> tuple[list[torch.Tensor], float, bool]:
        """(anchor - weights per parameter, drift, finite). The drift is the L2 norm of
        the difference between this worker's weights and the shared weights of the last
        sync: how far H inner steps took it."""
        pseudo = [a - p.detach() for a, p in zip(self.anchor, self.params, strict=True)]
        finite = all_finite(pseudo)
        drift = (
            math.sqrt(sum(float(g.double().pow(2).sum()) for g in pseudo)) if finite else math.inf
        )
        return pseudo, drift, finite

    def rebase(self, nbytes: int, drift: float, *, skipped: bool) -> None:
        """The params now hold the new shared weights: they are the next anchor.
        `nbytes` moved for this round (both directions), `drift` from pseudo_gradients."""
        for a, p in zip(self.anchor, self.params, strict=True):
            a.copy_(p.detach())
        self.rounds += 1
        self.skipped_rounds += int(skipped)
        self.round_bytes = nbytes
        self.bytes_total += nbytes
        if math.isfinite(drift):
            self.drifts.append(drift)

    def restore_anchor(self) -> None:
        """Put the anchor (the shared weights of the last sync) back into the params."""
        for a, p in zip(self.anchor, self.params, strict=True):
            p.data.copy_(a)

    def report(self) -> dict[str, Any]:
        """The run report's local-SGD figures."""
        d = self.drifts
        return {
            "sync_every": self.sync_every,
            "outer_rounds": self.rounds,
            "skipped_outer_rounds": self.skipped_rounds,
            "bytes_per_outer_round": self.bytes_total // self.rounds if self.rounds else 0,
            "drift": {
                "mean": sum(d) / len(d) if d else 0.0,
                "max": max(d, default=0.0),
                "last": d[-1] if d else 0.0,
            },
        }
