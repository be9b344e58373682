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
n-1 fp32 sums. The mean is the exact sum divided by 2^24 x loss scale x the slot's worker
count, rounded once to fp32 (`exact_mean`): the correctly rounded mean of the exact sum for
any worker count (the loss scale a power of two, as GradScaler's are), and never dependent
on order. fp32 and bf16
rounds keep the rank-order fp32 sum that equals DDP's (rounds.py).

What is in the sum: a slot counts a worker once its bytes arrived whole and finite (or
its push named it absent: zeros, DDP's semantics for an unused parameter). Until the push
is accepted the slot's fp16 bytes stay where they landed (the push's scratch): a push that
is not accepted (refused, non-finite, cut off, superseded, cancelled, or its worker gone
when the round closes) is subtracted again from those bytes, and integer subtraction
undoes integer addition exactly, so the sum is bit for bit what it was before the push
began; nor does it keep deciding how its round sums (exact or rank order), if it was the
round's first (SyncPolicy.under_way, rounds.py). Every push carries the shard's own loss
scale (the one its pulls gave every worker), the first one of a round included, so a
broken first push cannot set another scale and get the honest ones refused. A round skipped
(overflow) or replaced (restore, rollback) drops all.

The close's work is the step: a slot's mean is converted (into a 4-byte-per-parameter
fp32 buffer of its own) the moment its sum has every live worker in, so with the last
push streaming slot by slot, only its last slot is converted once its last piece is in;
a sum that changes after that (a push withdrawn, a worker gone) is converted again at the
close. The gradients' memory between a push's acceptance and the round's close is then
12 bytes per parameter whatever the number of workers (8 of sums, 4 of means; the
rank-order sum held 4 per worker until the close), plus each push's fp16 bytes (2 per
parameter) while it is in flight, from its first byte to its acceptance.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import torch

from psar.ps.errors import FailedPrecondition, InvalidArgument, quote

UNIT = 2.0**24
"""fp16 value * UNIT is an integer (fp16's smallest subnormal is 2^-24)."""
MIN_SCALE = 2.0**-112
"""The smallest loss scale a round summed exactly takes: fp16's largest value unscaled by
it still fits fp32 (65504 x 2^112 < 3.4e38), so the mean converted at the close is finite.
Staged in rank order, a push unscaled past fp32's range is refused as non-finite; here the
sum is converted only after the pushes were accepted, so the header is refused instead."""
MAX_SCALE = 2.0**64
"""The largest: the close divides the sum by 2^24 x loss scale x workers in fp32, and from
about 2^104 / workers that divisor is inf and the mean 0 (a zero-gradient step that still
moves the weights by momentum and weight decay). No fp16 run scales its loss this far (its
gradients overflow long before), so a larger scale is a broken header."""


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
        self._held: dict[int, dict[str, torch.Tensor | None]] = {}
        """Worker -> slot -> the fp16 values its push in flight added (None: zeros), until
        the push is accepted; a push that is not is subtracted again (withdraw)."""
        self.expected = 0
        """Live workers when the round's last push began: a slot counted for that many
        has its mean converted on arrival (off the close's path)."""
        self._means: dict[str, torch.Tensor] = {}
        """Slot -> its fp32 mean buffer (4 bytes per parameter, reused round after round)."""
        self._ready: dict[str, int] = {}
        """Slot -> the change (`_changed`) its mean buffer was converted at."""
        self._changed: dict[str, int] = {}
        """Slot -> a stamp of its sum's last change this round (an add, a subtraction)."""
        self._stamps = itertools.count(1)
        """Stamps for `_changed` (next() on it is atomic: slots change on many threads)."""
        self._closing = False

    # ---- a round --------------------------------------------------------------------

    def open(
        self, round_: int, loss_scale: float, expected: int = 0, *, shard_scale: float
    ) -> None:
        """A data push of round `round_` began with `loss_scale` (under the shard lock),
        `expected` workers live. Every push, the round's first included, must carry
        `shard_scale`, the shard's own (sync: the scale its pulls gave every worker), which
        is the round's: a broken first push cannot set another and get the honest ones
        refused."""
        if not loss_scale >= MIN_SCALE:
            raise InvalidArgument(
                f"loss_scale {loss_scale} is below 2^-112: fp16 gradients unscaled by it may "
                "not fit fp32, and the round's exact fp16 sum would be non-finite; scale by "
                "the loss scale of your last pull (a scale this small means the run diverged)",
                reason="malformed",
            )
        if loss_scale > MAX_SCALE:
            raise InvalidArgument(
                f"loss_scale {loss_scale} is above 2^64: the round's exact fp16 sum divided by "
                "it would not be a finite fp32 mean; scale by the loss scale of your last pull",
                reason="malformed",
            )
        if loss_scale != shard_scale:
            raise FailedPrecondition(
                f"sync round {round_} sums fp16 gradients scaled by {shard_scale} (the shard's "
                f"loss scale); this push is scaled by {loss_scale}: scale by the loss scale of "
                "your last pull",
                reason="loss_scale",
            )
        with self._meta:
            if self.round != round_:
                self._reset(round_)
            self.expected = expected
            self.scale = shard_scale

    def add(self, worker: int, round_: int, key: str, values: torch.Tensor) -> None:
        """Add a finite fp16 slot of `worker`'s push (its whole slot) into the sum;
        `values` must stay as they are until the push is accepted or withdrawn."""
        with self._locks[key]:
            if not self._open_for(round_):
                return  # the round closed under it: the push is refused at its end
            self._check_new(worker, key)
            acc = self._acc.get(key)
            if acc is None:
                acc = self._acc[key] = torch.empty(self.numel[key], dtype=torch.int64)
            if self._round_of.get(key) == round_:
                into_fixed(acc, values, torch.Tensor.add_)
            else:  # the round's first: over what an earlier round left
                into_fixed(acc, values, torch.Tensor.copy_)
                self._round_of[key] = round_
            self.counted.setdefault(key, set()).add(worker)
            with self._meta:
                self._held.setdefault(worker, {})[key] = values
            self._change(key)

    def add_zeros(self, worker: int, round_: int, key: str) -> None:
        """`worker` named slot `key` absent: it counts as zeros (whatever bytes came)."""
        with self._locks[key]:
            if not self._open_for(round_):
                return
            self._check_new(worker, key)
            self.counted.setdefault(key, set()).add(worker)
            self.absent.setdefault(key, set()).add(worker)
            with self._meta:
                self._held.setdefault(worker, {})[key] = None
            self._change(key)

    def name_absent(self, worker: int, round_: int, keys: frozenset[str]) -> None:
        """A verdict names slots absent whose bytes (zeros) were added already."""
        for key in keys:
            with self._locks[key]:
                if not self._open_for(round_):
                    return
                held = self._held.get(worker, {})
                if key in held:
                    values = held[key]
                    if values is not None and bool(values.any()):
                        raise InvalidArgument(
                            f"slot {quote(key)} is named absent in the verdict but its data "
                            "was not zeros: send zeros for a slot with no gradient",
                            reason="malformed",
                        )
                else:
                    self._check_new(worker, key)
                    self.counted.setdefault(key, set()).add(worker)
                    with self._meta:
                        self._held.setdefault(worker, {})[key] = None
                self.absent.setdefault(key, set()).add(worker)
                self._change(key)

    def accept(self, worker: int, round_: int) -> None:
        """`worker`'s push of `round_` was accepted: what it added stays (its values may
        be reused from now on)."""
        with self._meta:
            if round_ == self.round:
                self._held.pop(worker, None)

    def withdraw(self, worker: int, round_: int) -> None:
        """`worker`'s push of `round_` ended without being accepted: subtract what it added
        (exact: the sum is what it was before the push began). Under the shard lock."""
        with self._meta:
            if round_ != self.round or self._closing:
                return  # the round closed (it withdrew this push itself) or was dropped
            held = self._held.pop(worker, None)
        self._subtract(worker, held or {})

    # ---- the close ------------------------------------------------------------------

    def close(self, accepted: set[int]) -> None:
        """The round closes with the pushes of `accepted` (under the shard lock): nothing
        lands any more, and a push still in flight from any other worker (one that left)
        is withdrawn."""
        with self._meta:
            self._closing = True
        for lock in self._locks.values():
            with lock:  # an add that found the round open has landed once this is free
                pass
        with self._meta:
            gone = {w: held for w, held in self._held.items() if w not in accepted}
            self._held.clear()
        for w, held in gone.items():
            self._subtract(w, held)

    def unused(self, key: str) -> bool:
        """No worker of the round had a gradient for `key`: it is not stepped."""
        return self.counted.get(key, set()) <= self.absent.get(key, set())

    def mean(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Slot `key`'s mean over the workers counted for it, as fp32: into `out`, or its
        mean buffer (valid until the round's next change or the next round). Converted
        already where the slot's last push arrived after the others (the usual case)."""
        with self._locks[key]:
            if key not in self._ready or self._ready[key] != self._changed.get(key, 0):
                self._convert(key)
            buf = self._means[key]
            return buf if out is None else out.copy_(buf)

    def total(self, key: str) -> torch.Tensor:
        """The round's int64 sum of slot `key` so far (zeros before its first add)."""
        with self._locks[key]:
            acc = self._acc.get(key)
            if acc is None or self._round_of.get(key) != self.round:
                return torch.zeros(self.numel[key], dtype=torch.int64)
            return acc.clone()

    def reset(self, round_: int = 0) -> None:
        """Empty for round `round_` (after a close, or a skipped round); O(1)."""
        with self._meta:
            self._reset(round_)

    def nbytes(self) -> int:
        """Bytes the accumulators and mean buffers hold (the round's gradient memory)."""
        held = [*self._acc.values(), *self._means.values()]
        return sum(t.numel() * t.element_size() for t in held)

    # ---- internals --------------------------------------------------------------------

    def _reset(self, round_: int) -> None:
        self._round_of.clear()  # what the accumulators hold belongs to no round now
        self.counted.clear()
        self.absent.clear()
        self._held.clear()
        self._ready.clear()
        self._changed.clear()
        self.scale = None
        self.round = round_
        self._closing = False

    def _change(self, key: str) -> None:
        """Slot `key`'s sum or counts changed (its key lock held): its mean is stale; if
        every expected worker is in now, convert it at once (the round's close then
        finds it done)."""
        self._changed[key] = next(self._stamps)
        if self.expected and len(self.counted.get(key, ())) >= self.expected:
            if not self.unused(key):
                self._convert(key)

    def _convert(self, key: str) -> None:
        """The fp32 mean of slot `key` into its buffer: the int64 sum converted to fp32
        and divided once, one pass (its key lock held)."""
        buf = self._means.get(key)
        if buf is None:
            buf = self._means[key] = torch.empty(self.numel[key])
        acc = self._acc.get(key)
        count = len(self.counted.get(key, ()))
        if acc is None or self._round_of.get(key) != self.round or not count:
            buf.zero_()  # no data this round (every worker counted zeros for it)
        else:
            assert self.scale is not None
            exact_mean(acc, count, UNIT * self.scale, out=buf)
        self._ready[key] = self._changed.get(key, 0)

    def _open_for(self, round_: int) -> bool:
        return round_ == self.round and not self._closing

    def _subtract(self, worker: int, held: dict[str, torch.Tensor | None]) -> None:
        for key, values in held.items():
            with self._locks[key]:
                if values is not None:
                    into_fixed(self._acc[key], values, torch.Tensor.sub_)
                self.counted[key].discard(worker)
                self.absent.get(key, set()).discard(worker)
                self._change(key)

    def _check_new(self, worker: int, key: str) -> None:
        if worker in self.counted.get(key, ()):  # a push's slot completes once: a bug
            raise FailedPrecondition(
                f"slot {quote(key)} of worker {worker}'s round {self.round} is in the round's "
                "exact sum already: push each round once (a retry re-sends the whole push)",
                reason="duplicate",
            )


CHUNK = 1 << 16
"""Elements converted at a time: the conversion's scratch is 768 KiB (fp32 and int64),
whatever the slot's size."""


def fixed_point(values: torch.Tensor) -> torch.Tensor:
    """fp16 values as int64 multiples of 2^-24 (exact)."""
    return values.to(torch.float32).mul_(UNIT).to(torch.int64)


def into_fixed(acc: torch.Tensor, values: torch.Tensor, op: Callable[..., object]) -> None:
    """`op(acc, fixed_point(values))` (add_, sub_ or copy_), CHUNK elements at a time
    through one small scratch. Why: converted whole, a slot's push made a 12-byte-per-
    parameter transient (fp32, then int64), fresh pages every time for a big slot; in
    cache-sized pieces the add of a 16M-element slot takes 50 ms instead of 180 (one
    thread, this repository's 2-core machine) and its transient stays below the shard's
    mmap threshold (trainkit/allocator.py)."""
    n = values.numel()
    f32 = torch.empty(min(n, CHUNK))
    i64 = torch.empty(min(n, CHUNK), dtype=torch.int64)
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        f = f32[: b - a].copy_(values[a:b]).mul_(UNIT)
        op(acc[a:b], i64[: b - a].copy_(f))


POW2_FAST = 1 << 12
"""Up to this many workers, a power-of-two count takes the one-pass path: the sum (below
2^53) converts to fp32 with one rounding and the division by a power of two is exact."""


def exact_mean(acc: torch.Tensor, count: int, unit: float, out: torch.Tensor) -> torch.Tensor:
    """`acc / (count x unit)` rounded once to fp32 into `out`: the correctly rounded mean
    of the exact int64 sum `acc` of `count` workers' fixed-point values (`unit`: 2^24 x
    loss scale, a power of two). Why not one fp32 division: the sum rounded to fp32 first
    and the quotient rounded again is off by an ulp for some elements where `count` is not
    a power of two (issue #45: 98 of 1,024 over 3 workers).

    How, for any count below 2^28 (the shard bounds a job's workers far below): every
    addend is below 2^40 in magnitude, so is the quotient x = acc / count. Split it exactly
    (integer division toward zero) as x = q + r / count. Where |q| >= 2^25, x's rounding to
    24 bits depends only on q and whether r is zero: 2q + sign(r) is exact in fp64 and
    rounds, halved, as x does. Elsewhere q + r / count in fp64 is within 2^-28 of an ulp32
    of x, closer than x is to any fp32 midpoint it is not on (those are multiples of
    ulp32 / 2 / count away), so rounding it to fp32 rounds as x does. Dividing by `unit`
    (a power of two, no fp32 subnormal in reach: |mean| >= 2^-88 / count) is exact."""
    if count & (count - 1) == 0 and count <= POW2_FAST:
        return torch.div(acc, unit * count, out=out)
    n = acc.numel()
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        part = acc[a:b]
        q = torch.div(part, count, rounding_mode="trunc")
        r = part - q * count
        near = q.to(torch.float64) + r.to(torch.float64) / count
        far = (2 * q + torch.sign(r)).to(torch.float64).mul_(0.5)
        x = torch.where(q.abs() >= 1 << 25, far, near)
        out[a:b].copy_(x.div_(unit))
    return out
