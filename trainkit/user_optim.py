"""A user's own torch.optim optimizer described for the parameter server: its class and
each parameter group's hyper-parameters (psar.trainkit.optim.ParamGroup), the shards running
the same torch class over the same groups (worker/own_loop.py, docs/own-loop.md)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from psar.trainkit.optim import ParamGroup

SUPPORTED = {torch.optim.SGD: "sgd", torch.optim.AdamW: "adamw"}
"""The optimizer classes the shards can run, by their name on the wire."""

_REFUSED_IF_SET = {"maximize": False, "differentiable": False}
"""Group options the shards do not run: refused unless at their default."""


def supported_names() -> str:
    return ", ".join(f"torch.optim.{c.__name__}" for c in SUPPORTED)


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The wire name of the optimizer's class; a clear error for any other class."""
    name = SUPPORTED.get(type(optimizer))  # a subclass may step differently: not its base
    if name is None:
        raise ValueError(
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__} is not supported "
            f"under --arch ps (the shards run the optimizer): use {supported_names()} (each "
            "with any number of parameter groups)"
        )
    return name


def describe(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str]
) -> tuple[str, tuple[ParamGroup, ...]]:
    """(wire name, groups) of a user's optimizer; `names`: id(parameter) -> its name in
    the model. Every parameter of every group must be one of the model's. A frozen one
    (requires_grad=False) is left out of its group, as torch's step skips it (it never
    gets a gradient): `AdamW(model.parameters())` over a partly frozen model is torch's
    way to write it (the shards hold no slot for a frozen parameter)."""
    name = optimizer_name(optimizer)
    groups = []
    for i, g in enumerate(optimizer.param_groups):
        for option, default in _REFUSED_IF_SET.items():
            if g.get(option, default) != default:
                raise ValueError(
                    f"param group {i}: {option}={g[option]!r} is not supported under --arch ps"
                )
        trained = [p for p in g["params"] if p.requires_grad]
        unknown = [p for p in trained if id(p) not in names]
        if unknown:
            raise ValueError(
                f"param group {i} holds {len(unknown)} tensors that are not parameters of the "
                "model given to prepare(); build the optimizer from model.parameters()"
            )
        params = tuple(names[id(p)] for p in trained)
        if name == "sgd":
            groups.append(
                ParamGroup(
                    params=params,
                    lr=float(g["lr"]),
                    momentum=float(g["momentum"]),
                    dampening=float(g["dampening"]),
                    nesterov=bool(g["nesterov"]),
                    weight_decay=float(g["weight_decay"]),
                )
            )
        else:
            beta1, beta2 = (float(b) for b in g["betas"])
            groups.append(
                ParamGroup(
                    params=params,
                    lr=float(g["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    eps=float(g["eps"]),
                    weight_decay=float(g["weight_decay"]),
                    amsgrad=bool(g["amsgrad"]),
                )
            )
    return name, tuple(groups)


def current_lrs(optimizer: torch.optim.Optimizer) -> tuple[float, ...]:
    """Each group's learning rate now (what its LR scheduler set)."""
    return tuple(float(g["lr"]) for g in optimizer.param_groups)
