"""The masters' optimizer state as slot pieces: what a worker's `optimizer.state_dict()`
reads from the shards (OptimizerState) and what rank 0's Init may bring back to them
(InitChunk.state), so a user's own loop saves and resumes its optimizer under `--arch ps`
as it would under DDP (worker/own_loop.py).

Every value is an fp32 tensor: either flat, of its slot's size (momentum buffers, Adam's
moments), or a 0-d scalar (AdamW's step). Anything else is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from psar.ps import wire
from psar.ps.errors import InvalidArgument, quote

MAX_STATE_NAMES = 8
"""State entries a slot may carry (AdamW with amsgrad has four)."""


@dataclass
class StateValue:
    """One optimizer state entry of one slot, as it travels."""

    slot: str
    name: str
    value: torch.Tensor
    """fp32: flat (the slot's size) or 0-d (scalar)."""


def read_state(
    optimizer: torch.optim.Optimizer, masters: dict[str, torch.nn.Parameter]
) -> list[StateValue]:
    """Every slot's optimizer state (copies: the caller sends them off the lock)."""
    out = []
    for key, p in masters.items():
        for name, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                v = value.detach().to(torch.float32).clone()
                out.append(StateValue(key, name, v if v.dim() == 0 else v.reshape(-1)))
    return out


class StateCollector:
    """Optimizer state pieces of an Init, checked as they come (slot, name, size, order)."""

    def __init__(self, numel: dict[str, int]) -> None:
        self.numel = numel
        self.values: dict[tuple[str, str], torch.Tensor] = {}
        self.filled: dict[tuple[str, str], int] = {}

    def add(self, slot: str, name: str, numel: int, offset: int, scalar: bool, data: bytes) -> None:
        if slot not in self.numel:
            raise InvalidArgument(f"Init: optimizer state for slot {quote(slot)} not in the job")
        if not name or len(name) > 64:
            raise InvalidArgument(f"Init: optimizer state name {quote(name)} for {quote(slot)}")
        want = 1 if scalar else self.numel[slot]
        if numel != want:
            raise InvalidArgument(
                f"Init: optimizer state {quote(name)} of slot {quote(slot)} declares {numel} "
                f"elements; it holds {want} (a scalar: 1)"
            )
        key = (slot, name)
        if key not in self.values:
            if sum(1 for s, _ in self.values if s == slot) >= MAX_STATE_NAMES:
                raise InvalidArgument(f"Init: more than {MAX_STATE_NAMES} state entries per slot")
            self.values[key] = torch.empty(()) if scalar else torch.empty(want)
            self.filled[key] = 0
        n = len(data) // 4
        if len(data) % 4 or offset != self.filled[key] or offset + n > want:
            raise InvalidArgument(
                f"Init: optimizer state {quote(name)} of slot {quote(slot)}: a piece at "
                f"{offset} of {n} fp32 elements does not continue the {self.filled[key]} "
                f"received of {want}"
            )
        values = wire.decode(data, torch.float32)
        if not bool(torch.isfinite(values).all()):
            raise InvalidArgument(
                f"Init: optimizer state {quote(name)} of slot {quote(slot)} is not finite"
            )
        self.values[key].view(-1)[offset : offset + n].copy_(values)
        self.filled[key] += n

    def done(self) -> list[StateValue]:
        short = [k for k, n in self.filled.items() if n != self.values[k].numel()]
        if short:
            raise InvalidArgument(f"Init: optimizer state {short[0]} incomplete")
        return [StateValue(s, n, v) for (s, n), v in self.values.items()]


def load_state(
    optimizer: torch.optim.Optimizer,
    masters: dict[str, torch.nn.Parameter],
    values: list[StateValue],
) -> None:
    """Start the optimizer from these values (at init, before any update)."""
    for v in values:
        if v.name == "step" and not (v.value.dim() == 0 and math.isfinite(float(v.value))):
            raise InvalidArgument("Init: optimizer state 'step' must be a finite scalar")
    for v in values:
        optimizer.state[masters[v.slot]][v.name] = v.value.clone()
