"""PSBackend's part for a worker's own loop (worker/own_loop.py): the user's torch.optim
optimizer shipped to the shards (its class, each parameter group's hyper-parameters and
state), each step's learning rates and clipping (psar.trainkit.optim.StepOptions), and the
optimizer's state read back for `optimizer.state_dict()`.

A part of ps/client/backend.py's PSBackend (it holds one as `own`), which provides the
client, slots, params, traits, loss scale and clock.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from psar.ps.partition import Slot
from psar.trainkit.optim import OptimizerConfig, ParamGroup, StepOptions
from psar.trainkit.user_optim import describe


@dataclass
class OwnOptimizer:
    """A user's optimizer as the shards run it."""

    optimizer: torch.optim.Optimizer
    name: str
    """sgd | adamw."""
    groups: tuple[ParamGroup, ...]
    config: OptimizerConfig
    """The job's `optimizer`: the class (and group 0's values, for what reads one);
    the schedule constant: each step's learning rates travel with its push."""

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor]) -> OwnOptimizer:
        name, groups = describe(optimizer, {id(p): n for n, p in params.items()})
        listed = {n for g in groups for n in g.params}
        if missing := [n for n in params if n not in listed]:
            raise ValueError(
                f"parameters {missing[:3]} require a gradient but are in no group of the "
                "optimizer; add them to it, or freeze them (requires_grad_(False))"
            )
        g0 = groups[0]
        config = OptimizerConfig(
            name=name,
            lr=g0.lr or 1.0,  # > 0 for OptimizerConfig; each push brings the real ones
            momentum=g0.momentum,
            nesterov=g0.nesterov,
            weight_decay=g0.weight_decay,
            beta1=g0.beta1,
            beta2=g0.beta2,
            eps=g0.eps,
        )
        return cls(optimizer, name, groups, config)

    def groups_on(self, slots: list[Slot]) -> tuple[ParamGroup, ...]:
        """Every group, naming only the parameters with a slot among `slots` (a shard's)."""
        held = {s.param for s in slots}
        return tuple(
            dataclasses.replace(g, params=tuple(n for n in g.params if n in held))
            for g in self.groups
        )


class OwnLoopPart:
    """The user's optimizer on the shards, and each step's options. `backend`: the
    PSBackend (typed Any: in ps/ an import of the backend here, even for annotations,
    would be a cycle)."""

    def __init__(self, backend: Any) -> None:
        self.b = backend
        self.optimizer: OwnOptimizer | None = None
        """A worker's own loop: the user's optimizer the shards run (setup() on)."""

    def init_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        """The user's optimizer state by slot, for rank 0's Init (a resumed loop)."""
        if self.optimizer is None or not self.optimizer.optimizer.state:
            return None
        state = self.optimizer.optimizer.state
        out: dict[str, dict[str, torch.Tensor]] = {}
        for s in self.b.slots:
            p = self.b.params.get(s.param)
            if p is None or p not in state:
                continue
            values = {}
            for name, v in state[p].items():
                if not isinstance(v, torch.Tensor):
                    continue
                if v.dim() == 0:
                    values[name] = v.detach().float().cpu()
                elif v.numel() == p.numel():
                    flat = v.detach().float().cpu().reshape(-1)
                    values[name] = flat[s.start : s.start + s.numel]
                else:
                    raise ValueError(
                        f"optimizer state {name!r} of {s.param} has {v.numel()} elements, "
                        f"the parameter {p.numel()}; load a state dict saved for this model"
                    )
            out[s.key] = values
        return out

    def remote_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state the shards hold, by parameter name, in each parameter's
        shape (0-d values, AdamW's step, as they are): what torch's optimizer of the same
        class would hold after the same steps."""
        b = self.b
        b.overlap.await_pull()
        by_slot = b.client.optimizer_state()
        out: dict[str, dict[str, torch.Tensor]] = {}
        for s in b.slots:
            p = b.params.get(s.param)
            if p is None:
                continue  # a buffer slot: no optimizer state
            for name, v in by_slot.get(s.key, {}).items():
                mine = out.setdefault(s.param, {})
                if v.dim() == 0:
                    mine.setdefault(name, v.clone())
                    continue
                if name not in mine:
                    mine[name] = torch.zeros(p.numel())
                mine[name][s.start : s.start + s.numel].copy_(v)
        return {
            n: {k: v if v.dim() == 0 else v.view_as(b.params[n]) for k, v in d.items()}
            for n, d in out.items()
        }

    def step_options(self, options: StepOptions | None) -> StepOptions | None:
        """This step's options as the shards take them: in modes without rounds a push is
        the update, clipped by the norm of this worker's own gradient (sent along)."""
        b = self.b
        if options is None or options.clip_norm <= 0 or b.traits.rounds:
            return options
        norms = [torch.linalg.vector_norm(p.grad.float()) for p in b.params.values()
                 if p.grad is not None]  # fmt: skip
        # As clip_grad_norm_ takes it: the norm of the per-parameter norms.
        norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
        norm /= b.loss_scale
        # A non-finite norm is an overflow: the push says so, and is dropped.
        return dataclasses.replace(options, grad_norm=norm if math.isfinite(norm) else 0.0)

    def round_total(self, options: StepOptions | None) -> tuple[float | None, float | None]:
        """After this step's push, with clipping: (the round's squared norm over every
        shard to send with the pull, its norm) in modes with rounds; (None, the worker's
        own norm) in the others; (None, None) without clipping."""
        if options is None or options.clip_norm <= 0:
            return None, None
        if not self.b.traits.rounds:
            return None, options.grad_norm
        parts = self.b.client.round_norm(self.b.clock)
        total = 0.0
        for part, _skipped in parts:  # shard order: the same sum on every worker
            total += part
        skipped = any(s for _, s in parts)
        return total, (None if skipped else math.sqrt(total))
