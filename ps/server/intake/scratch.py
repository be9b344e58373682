"""Where an fp16 push's bytes land before its slot is added to the round's exact sum.

A push into a sync round summed exactly (ps/server/modes/exact_sum.py) has no staging
copy of its own: each slot's fp16 bytes land (straight from the socket on the data plane)
in a scratch buffer of one slot, from a pool the shard shares between pushes; the slot
is added to the sum once it is whole, and its buffer goes back to the pool when the push
ends (accepted: its values are in the sum; not accepted: they are subtracted from the sum
first). The memory is the fp16 bytes of the pushes in flight (2 per parameter each), not
an fp32 copy of every worker's gradient held until the round's close. Model buffers' slots (values, never summed) keep a
small fp32 staging per worker, read when the round closes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, MutableMapping

import torch


class ScratchPool:
    """fp16 buffers of one slot each, reused from push to push."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocated = 0
        """Bytes of every buffer the pool ever made (in use or free): its footprint."""

    def take(self, numel: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(numel)
            if free:
                return free.pop()
            self.allocated += numel * 2
        return torch.empty(numel, dtype=torch.float16)

    def give(self, t: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(t.numel(), []).append(t)


class ExactStaging(MutableMapping[str, torch.Tensor]):
    """A push's staging for an exact round: a pool buffer per gradient slot while it is
    being received, the worker's own fp32 buffer per model-buffer slot."""

    def __init__(self, pool: ScratchPool, numel: dict[str, int], raw: dict[str, torch.Tensor]):
        self.pool = pool
        self.numel = numel
        self.raw = raw
        """Model-buffer slots: the worker's own fp32 staging (their values are read at the
        round's close, never summed)."""
        self._open: dict[str, torch.Tensor] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.raw:
            return self.raw[key]
        t = self._open.get(key)
        if t is None:
            t = self._open[key] = self.pool.take(self.numel[key])
        return t

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        raise TypeError("exact staging is filled piece by piece, never assigned")

    def __delitem__(self, key: str) -> None:
        """Slot `key`'s buffer goes back to the pool (its values no longer needed)."""
        t = self._open.pop(key, None)
        if t is not None:
            self.pool.give(t)

    def __iter__(self) -> Iterator[str]:
        return iter([*self.raw, *self._open])

    def __len__(self) -> int:
        return len(self.raw) + len(self._open)

    def close(self) -> None:
        """The push ended: every buffer still open goes back to the pool."""
        for key in list(self._open):
            del self[key]
