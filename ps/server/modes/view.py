"""What an update rule may see of its shard: `ShardView`, the narrow interface every mode's
UpdatePolicy (ps/server/modes/) is handed, under the shard's lock. ps/server/update/updates.py
implements it; nothing else of the shard is reachable from a rule."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Set
from typing import Any, Protocol

import torch

from psar.ps.job import Job
from psar.ps.server.metrics.recorder import ShardRecorder
from psar.trainkit.optim import StepAdjust


class ShardView(Protocol):
    """What an update rule may read and change of its shard, and nothing else: called under
    the shard's lock (ps/server/update/updates.py is the shard's implementation)."""

    @property
    def job(self) -> Job | None:
        """The job (its mode's knobs: delay compensation, staleness-aware lr, ...)."""
        ...

    @property
    def version(self) -> int:
        """Updates applied so far."""
        ...

    @property
    def rounds(self) -> int:
        """Rounds closed so far (applied or skipped)."""
        ...

    @property
    def live(self) -> Set[int]:
        """The workers in the live set (read only: membership changes it)."""
        ...

    @property
    def masters(self) -> Mapping[str, torch.nn.Parameter]:
        """The fp32 masters by slot (their values change only through the calls below,
        or in place where a rule restores what it applied)."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """Its per-slot state may be saved and restored in place (per-chunk undo)."""
        ...

    @property
    def metrics(self) -> ShardRecorder:
        """Where a rule records what it did (ps/server/metrics/recorder.py)."""
        ...

    @property
    def buffer_keys(self) -> frozenset[str]:
        """Slots holding model buffers (values, never stepped)."""
        ...

    @property
    def loss_scale(self) -> float:
        """The shard's loss scale now (1.0 without loss scaling): the scale the pulls
        since the last round's close carried, so the one a sync round's pushes carry."""
        ...

    def slowest_live_clock(self, default: int) -> int:
        """The smallest clock of a live worker (`default` when none is live)."""
        ...

    def apply_update(
        self, grads: dict[str, torch.Tensor], staleness: list[int], adjust: StepAdjust | None = None
    ) -> None:
        """One optimizer step of every slot in `grads`; the update is then finished."""
        ...

    def step_slot(self, key: str, grad: torch.Tensor) -> None:
        """The optimizer step of one slot only; finish_update ends the update."""
        ...

    def step_each(self, keys: Iterable[str], fn: Callable[[str], Any]) -> None:
        """fn(key) for each slot, on the update threads when it pays (fn may step_slot)."""
        ...

    def finish_update(self, staleness: list[int]) -> None:
        """After the step(s) of an update: schedule, version, counters, the round."""
        ...

    def skip_round(self, reason: str) -> None:
        """Close a round without an update (masters and optimizer state untouched)."""
        ...

    def set_buffers(self, values: dict[str, torch.Tensor]) -> None:
        """Overwrite buffer slots with these values."""
        ...

    def buffer_values(self, grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """A round's buffer values from its pushes in rank order (ps/server/update/buffers.py)."""
        ...

    def drop_nonfinite(self) -> None:
        """Count a push dropped for non-finite values."""
        ...
