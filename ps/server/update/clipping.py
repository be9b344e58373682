"""Clipping an update by its global L2 norm, on the shards (docs/own-loop.md, "Clipping").

A DDP user clips the averaged gradient: `clip_grad_norm_` scales every gradient by
min(1, max_norm / (norm + 1e-6)), the norm taken over the whole model. A parameter
server's update is spread over shards that never talk to each other, so:

- modes with rounds (sync): the round's mean is the update. When a round whose pushes
  ask for clipping (StepOptions.clip_norm) closes, the shard holds its update instead of
  applying it (`HeldRound`) and answers RoundNorm with its part of the squared norm (the
  sum of squares of the mean over its slots). Every worker sums the parts in shard order
  (the same sum everywhere) and sends the total with its pull; the first such pull to a
  shard applies the held update scaled by `clip_coef`, and the pull is answered as usual;
- modes without rounds (async, ssp): a push is the update, and its worker knows the norm
  of its whole gradient: it sends that (StepOptions.grad_norm) and each shard scales its
  part of the push by the same `clip_coef` before the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from psar.trainkit.optim import StepAdjust

EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s: max_norm / (norm + EPS)."""


def clip_coef(max_norm: float, norm: float) -> float:
    """The factor clip_grad_norm_ scales the gradients by (1.0: not clipped)."""
    return min(1.0, max_norm / (norm + EPS))


def sq_norm(grads: dict[str, torch.Tensor]) -> float:
    """Sum of squares of these gradients (accumulated in float64)."""
    return float(sum(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for g in grads.values()))


def scale_(grads: dict[str, torch.Tensor], coef: float) -> None:
    """Multiply every gradient by `coef` in place, as clip_grad_norm_ does (fp32 factor)."""
    if coef < 1.0:
        for g in grads.values():
            g.mul_(torch.tensor(coef, dtype=g.dtype))


@dataclass
class HeldRound:
    """A round's update held for its global norm (modes with rounds)."""

    round: int
    """The round it closes (rounds + 1 while held)."""
    grads: dict[str, torch.Tensor]
    staleness: list[int]
    adjust: StepAdjust | None
    clip_norm: float
    sq_norm: float
    """This shard's part of the squared norm of the round's mean."""


@dataclass
class RoundNorms:
    """The parts of the squared norm this shard answered for recent rounds: a worker may
    ask after another worker's pull has applied the round (kept for a few rounds)."""

    keep: int = 64
    parts: dict[int, float] | None = None

    def put(self, round_: int, part: float) -> None:
        if self.parts is None:
            self.parts = {}
        self.parts[round_] = part
        for old in [r for r in self.parts if r <= round_ - self.keep]:
            del self.parts[old]

    def get(self, round_: int) -> float | None:
        return None if self.parts is None else self.parts.get(round_)


def total_norm(total_sq: float) -> float:
    """The norm of a total squared norm from the wire (checked finite, >= 0)."""
    if not math.isfinite(total_sq) or total_sq < 0:
        raise ValueError(f"clip_total_sq must be a finite number >= 0, got {total_sq}")
    return math.sqrt(total_sq)
