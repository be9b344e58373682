"""A worker's integer buffers on the PS (BatchNorm's num_batches_tracked, any counter).

Float buffers travel as slots (ps/server/update/buffers.py); integer ones would not survive the
wire dtype (bf16 holds integers exactly only up to 256), so their exact values ride in
shard 0's push and pull headers instead: every push to shard 0 carries this worker's,
the shard keeps rank 0's (DDP broadcasts rank 0's buffers before every forward) and
every pull from shard 0 brings them back. A relaunched worker rejoining the job thus
gets the counters the others have, not zeros; checkpoints of shard 0 keep them.

Buffers with more than MAX_INT_BUFFER_ELEMENTS elements in all stay each worker's own
(said once in the log), as do all of them under --mode local.
"""

from __future__ import annotations

import logging

import torch

from psar.ps.job import MAX_INT_BUFFER_ELEMENTS

log = logging.getLogger("psar.client")


def is_integer_buffer(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.numel() > 0


class IntBuffers:
    """The model's integer buffers: their spec for shard 0's job, their values now, and
    the values a pull brought back."""

    def __init__(self, model: torch.nn.Module, *, enabled: bool = True) -> None:
        found = {n: b for n, b in model.named_buffers() if is_integer_buffer(b)}
        total = sum(b.numel() for b in found.values())
        if found and total > MAX_INT_BUFFER_ELEMENTS:
            log.warning(
                "integer buffers of %d elements (more than %d): they stay each worker's own "
                "on the PS (%s)",
                total,
                MAX_INT_BUFFER_ELEMENTS,
                ", ".join(sorted(found)[:3]),
            )
            found = {}
        self.buffers: dict[str, torch.Tensor] = found if enabled else {}

    def __bool__(self) -> bool:
        return bool(self.buffers)

    def spec(self) -> tuple[tuple[str, int], ...]:
        """(name, numel) of each, for shard 0's Job.int_buffers."""
        return tuple((n, b.numel()) for n, b in self.buffers.items())

    def values(self) -> dict[str, tuple[int, ...]]:
        """This worker's values now (bool as 0/1), flattened."""
        return {
            n: tuple(int(x) for x in b.detach().reshape(-1).tolist())
            for n, b in self.buffers.items()
        }

    def load(self, values: dict[str, tuple[int, ...]]) -> None:
        """Overwrite the buffers with pulled values (empty: the shard has none yet)."""
        with torch.no_grad():
            for n, v in values.items():
                b = self.buffers.get(n)
                if b is not None and len(v) == b.numel():
                    src = torch.tensor(v, dtype=torch.int64).to(b.dtype).reshape(b.shape)
                    b.copy_(src)


__all__ = ["IntBuffers", "is_integer_buffer"]
