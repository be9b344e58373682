"""The optimizer a loop of the user's own gets back from worker/own_loop.py's prepare().

Like Horovod's DistributedOptimizer, it is an instance of a subclass of the user's own
optimizer class (`DistributedSGD` for torch.optim.SGD), sharing the user's param groups
and state: `isinstance(opt, torch.optim.SGD)` holds, torch's LR schedulers take it, and a
scheduler changing `param_groups[i]["lr"]` changes what the next step ships. Only what
the architecture does differently is overridden:

- step(): the backend's step (DDP: the averaged gradient, a local step; PS: the push,
  the shards' step with each group's current learning rate, the pull);
- state_dict(): under PS the state is read from the shards, in torch's format (a file
  saved under one architecture loads under the other);
- load_state_dict() and add_param_group(): refused once prepared (the shards took the
  groups and state with the job: resume with prepare(resume_from=),
  or load the state into your optimizer before prepare()).

Also prepare()'s checks of the model and optimizer it is given (refuse_*): the same
under both architectures, before any backend is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

PREPARED = "_psar_prepared"
"""Set on a model prepare() took: a second prepare() of it is refused (the first run
holds the job: a second would register the same rank again, or wrap DDP in DDP)."""

_LOAD_FIRST = (
    "resume with prepare(..., resume_from=FOLDER) (FOLDER written by "
    "run.save_state()), or load the optimizer's state into your own optimizer before "
    "prepare() (the same under both architectures: under --arch ps the shards take it "
    "with the job)"
)


class _Distributed:
    """The overrides, placed before the user's optimizer class in the subclass."""

    _psar_step: Callable[[], Any]
    _psar_state: Callable[[], dict[str, dict[str, torch.Tensor]] | None]
    _psar_names: dict[int, str]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The architecture's step (see the module docstring); returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._psar_step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        remote = self._psar_state()
        if remote is None:
            return super().state_dict()  # type: ignore[misc]
        own = self.state  # type: ignore[attr-defined]
        held = dict(own)
        own.clear()
        for group in self.param_groups:  # type: ignore[attr-defined]
            for p in group["params"]:
                values = remote.get(self._psar_names[id(p)])
                if values:
                    own[p] = {k: v.to(p.device) for k, v in values.items()}
        try:
            return super().state_dict()  # type: ignore[misc]
        finally:
            own.clear()
            own.update(held)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError(f"load_state_dict after prepare(): {_LOAD_FIRST}")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "add_param_group after prepare(): the job's groups are fixed; add the group to "
            "your optimizer before prepare()"
        )


def distributed(
    optimizer: torch.optim.Optimizer,
    step: Callable[[], Any],
    remote_state: Callable[[], dict[str, dict[str, torch.Tensor]] | None],
    names: dict[int, str],
) -> torch.optim.Optimizer:
    """The user's optimizer as prepare() returns it (module docstring): a new object of a
    subclass of its class sharing its param groups, state and defaults. `step()` runs
    the architecture's step; `remote_state()` is the state where the shards hold it
    (None: here); `names`: id(parameter) -> its name in the model."""
    base = type(optimizer)
    cls = type(f"Distributed{base.__name__}", (_Distributed, base), {"__module__": __name__})
    out = cls.__new__(cls)
    out.__dict__.update(optimizer.__dict__)  # the same param_groups, state and defaults
    # An LR scheduler built on `optimizer` before prepare() wrapped its step() in the
    # instance: copied, it would run torch's local step on `optimizer` instead of the
    # architecture's (a silent local step under ps). The class's step is the one.
    out.__dict__.pop("step", None)
    out._psar_step = step
    out._psar_state = remote_state
    out._psar_names = names
    return out


def refuse_a_second_prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One prepare() per model: the run it returned holds the job (PREPARED)."""
    if any(getattr(m, PREPARED, False) for m in model.modules()) or isinstance(
        optimizer, _Distributed
    ):
        raise RuntimeError(
            "prepare() was called already for this model or optimizer; call it once per "
            "process and keep using the run it returned (run.model, run.optimizer): a "
            "second one would join the job again (under ps the same rank registers twice, "
            "under allreduce DDP would wrap DDP)"
        )


def refuse_foreign_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every tensor the optimizer steps must be one of the model's parameters, under
    either architecture: under allreduce an optimizer over another model's would step
    tensors that never get a gradient, and train nothing without a word."""
    mine = {id(p) for p in model.parameters()}
    for i, group in enumerate(optimizer.param_groups):
        foreign = [p for p in group["params"] if id(p) not in mine]
        if foreign:
            raise ValueError(
                f"param group {i} holds {len(foreign)} tensors that are not parameters of "
                "the model given to prepare(); build the optimizer from model.parameters() "
                "of that model"
            )
