"""fp16 gradients of a sync round summed exactly, in any order, as they arrive (issue #36).

Every finite fp16 value is an integer multiple of 2^-24 (the smallest subnormal) below
2^16 in magnitude, so `value * 2^24` is an integer below 2^40 and up to 2^23 of them sum
exactly in an int64. A round whose pushes carry fp16 (`psar server --exact-fp16-sum`, on
by default) therefore keeps one int64 accumulator per slot instead of one fp32 staging
copy per worker: each push's slot is added the moment it has arrived whole and been found
finite (from a small per-push scratch of the slot's fp16 bytes, ps/server/intake/), and
the round's close converts each slot once (`mean`) and steps. Integer addition is
associative: the sum, and so the mean and the masters, are bit for bit the same whatever
order the pushes arrive or interleave in, and the close costs one conversion instead of
n-1 fp32 sums. The mean is the exact sum divided once (in float64) by 2^24 x loss scale x
the slot's worker count, then rounded to fp32: correctly rounded where that count is a
power of two, within the last bit otherwise, and never dependent on order. fp32 and bf16
rounds keep the rank-order fp32 sum that equals DDP's (rounds.py).

What arrived, counted: a slot counts a worker once its bytes arrived whole and finite (or
its push named it absent: zeros, DDP's semantics for an unused parameter). With no copy
per worker there is nothing to take back, so a push cut off or refused after some of its
slots counted keeps those: its re-send (a retry re-sends the same gradient) skips them,
checked by a fingerprint (a re-send carrying other values for them is refused), and a
worker that leaves mid-push counts in the mean of the slots it delivered (each slot divides
by its own count). A round skipped (overflow) or replaced (restore, rollback) drops all.

The accumulators are the gradients' memory: 8 bytes per parameter whatever the number of
workers, and at the close each slot's fp32 mean is written into the first half of its own
accumulator (chunk by chunk, each read before anything overlapping it is written), so the
step takes its gradients from there without another buffer.
"""

from __future__ import annotations

import threading

import torch

from ps.errors import FailedPrecondition, InvalidArgument, quote

UNIT = 2.0**24
"""fp16 value * UNIT is an integer (fp16's smallest subnormal is 2^-24)."""
CHUNK = 1 << 16
"""Elements converted at a time at the close (float64 temporaries stay in cache)."""


class ExactSum:
    """One sync round's fp16 gradients as int64 fixed-point sums per slot."""

    def __init__(self, numel: dict[str, int]) -> None:
        self.numel = dict(numel)
        self.round = 0
        """The round being summed (0: none yet); commits for another are dropped."""
        self.scale: float | None = None
        """The loss scale every push of the round carries (the shard's, in sync)."""
        self._acc: dict[str, torch.Tensor] = {}
        self._round_of: dict[str, int] = {}
        """Slot -> the round its accumulator holds (an older one's is overwritten by the
        round's first commit: no zeroing on the close's path)."""
        self._locks = {k: threading.Lock() for k in numel}
        self._meta = threading.Lock()
        self.counted: dict[str, set[int]] = {}
        """Slot -> the workers whose gradient of it is in the sum (data or zeros)."""
        self.absent: dict[str, set[int]] = {}
        """Slot -> the workers that named it absent (no gradient: zeros)."""
        self._prints: dict[tuple[int, str], tuple[int, bool]] = {}
        """(worker, slot) -> (sum of its fixed-point values, all zeros) as counted."""
        self._closing = False

    # ---- a round --------------------------------------------------------------------

    def open(self, round_: int, loss_scale: float) -> None:
        """A data push of round `round_` began with `loss_scale` (under the shard lock):
        the first opens the round; the others must carry the same scale."""
        with self._meta:
            if self.round != round_:
                self._reset(round_)
            if self.scale is None:
                self.scale = loss_scale
            elif loss_scale != self.scale:
                raise FailedPrecondition(
                    f"sync round {round_} sums fp16 gradients scaled by {self.scale} (the "
                    f"shard's loss scale); this push is scaled by {loss_scale}: scale by the "
                    "loss scale of your last pull",
                    reason="loss_scale",
                )

    def add(self, worker: int, round_: int, key: str, values: torch.Tensor) -> None:
        """Add a finite fp16 slot of `worker`'s push (its whole slot) into the sum."""
        fixed = values.to(torch.float32).mul_(UNIT).to(torch.int64)
        lo, hi = torch.aminmax(fixed)
        printed = (int(fixed.sum()), bool(lo == 0) and bool(hi == 0))
        with self._locks[key]:
            if not self._open_for(round_):
                return  # the round closed under it: the push is refused at its end
            if self._counted_again(worker, key, printed):
                return
            acc = self._acc.get(key)
            if acc is None:
                acc = self._acc[key] = torch.empty(self.numel[key], dtype=torch.int64)
            if self._round_of.get(key) == round_:
                acc.add_(fixed)
            else:  # the round's first: over what an earlier round left
                acc.copy_(fixed)
                self._round_of[key] = round_
            self._prints[(worker, key)] = printed
            self.counted.setdefault(key, set()).add(worker)

    def add_zeros(self, worker: int, round_: int, key: str) -> None:
        """`worker` named slot `key` absent: it counts as zeros (whatever bytes came)."""
        with self._locks[key]:
            if not self._open_for(round_) or self._counted_again(worker, key, (0, True)):
                return
            self._prints[(worker, key)] = (0, True)
            self.counted.setdefault(key, set()).add(worker)
            self.absent.setdefault(key, set()).add(worker)

    def name_absent(self, worker: int, round_: int, keys: frozenset[str]) -> None:
        """A verdict names slots absent whose bytes (zeros) were added already."""
        for key in keys:
            with self._locks[key]:
                if not self._open_for(round_):
                    return
                printed = self._prints.get((worker, key))
                if printed is not None and not printed[1]:
                    raise InvalidArgument(
                        f"slot {quote(key)} is named absent in the verdict but its data was "
                        "not zeros: send zeros for a slot with no gradient",
                        reason="malformed",
                    )
                if printed is None:
                    self._prints[(worker, key)] = (0, True)
                    self.counted.setdefault(key, set()).add(worker)
                self.absent.setdefault(key, set()).add(worker)

    # ---- the close ------------------------------------------------------------------

    def close(self) -> None:
        """The round closes (under the shard lock): no commit may land any more."""
        with self._meta:
            self._closing = True

    def unused(self, key: str) -> bool:
        """No worker of the round had a gradient for `key`: it is not stepped."""
        return self.counted.get(key, set()) <= self.absent.get(key, set())

    def mean(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Slot `key`'s mean over the workers counted for it, as fp32: into `out`, or (the
        sum is not needed again) into the first half of its accumulator, valid until the
        next round's first commit."""
        n = self.numel[key]
        acc = self._acc.get(key)
        if acc is None or self._round_of.get(key) != self.round:
            # No data this round (every worker counted zeros for it)
            return out.zero_() if out is not None else torch.zeros(n)
        assert self.scale is not None
        denom = UNIT * self.scale * len(self.counted.get(key, ()))
        if out is None:
            out = acc.view(torch.float32)[:n]
        with self._locks[key]:
            for lo in range(0, n, CHUNK):
                hi = min(n, lo + CHUNK)
                # Chunk lo:hi of the fp32 result overlaps only accumulator elements below
                # hi / 2 + 1, all read already (this chunk's into `part` first).
                part = acc[lo:hi].to(torch.float64).div_(denom)
                out[lo:hi].copy_(part)
        return out

    def reset(self, round_: int = 0) -> None:
        """Empty for round `round_` (after a close, or a skipped round); O(1)."""
        with self._meta:
            self._reset(round_)

    def nbytes(self) -> int:
        """Bytes the accumulators hold (the round's gradient memory)."""
        return sum(t.numel() * t.element_size() for t in self._acc.values())

    # ---- internals --------------------------------------------------------------------

    def _reset(self, round_: int) -> None:
        self._round_of.clear()  # what the accumulators hold belongs to no round now
        self.counted.clear()
        self.absent.clear()
        self._prints.clear()
        self.scale = None
        self.round = round_
        self._closing = False

    def _open_for(self, round_: int) -> bool:
        return round_ == self.round and not self._closing

    def _counted_again(self, worker: int, key: str, printed: tuple[int, bool]) -> bool:
        """Whether `worker`'s slot `key` is in the sum already: a re-send must carry the
        same values (it is skipped), other values are refused."""
        before = self._prints.get((worker, key))
        if before is None:
            return False
        if before != printed:
            raise FailedPrecondition(
                f"slot {quote(key)} of worker {worker}'s round {self.round} is in the round's "
                "exact sum already with other values: a re-sent push must carry the "
                "gradient it first sent",
                reason="resend_differs",
            )
        return True
