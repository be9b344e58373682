"""Model buffers on a shard (BatchNorm running stats, any float buffer; issue #17).

Integer buffers (num_batches_tracked, counters) are not slots: their exact values travel
in shard 0's push and pull headers (Job.int_buffers), never in the wire dtype. The shard
keeps them per clock (IntBufferLog): in sync a fast worker pushes clock c+1 while a slow
one still pulls round c, and the slow one must get round c's values (rank 0's), not
the fast one's of c+1, or its counters run ahead.

They are slots of the job (`Job.buffer_slots`) the optimizer never steps: a push carries
their values, not gradients (never loss-scaled), and the shard keeps, per update, the
values DDP would give every rank: rank 0's (DDP broadcasts rank 0's buffers before every
forward), or the mean over the round's workers with --buffers average (sync).
"""

from __future__ import annotations

import torch

from psar.ps.errors import InvalidArgument, quote
from psar.ps.job import Job


def round_buffers(job: Job, grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A sync round's buffer values from its pushes (rank order; read before any sum
    touches them): the lowest rank's, or the mean of all in rank order."""
    keys = job.buffer_slots
    if not keys or not grads:
        return {}
    if not job.buffers_average:
        return {k: grads[0][k].clone() for k in keys}
    out = {}
    for k in keys:
        t = grads[0][k].clone()
        for g in grads[1:]:
            t.add_(g[k])
        out[k] = t.div_(len(grads))
    return out


def check_int_buffers(job: Job, values: dict[str, tuple[int, ...]]) -> None:
    """A push's integer buffers: none, or exactly the job's (each with its element count).
    int64 range is the proto's (sint64)."""
    if not values:
        return
    want = dict(job.int_buffers)
    if set(values) != set(want):
        extra, missing = sorted(set(values) - set(want)), sorted(set(want) - set(values))
        raise InvalidArgument(
            f"push carries integer buffers {[quote(k) for k in extra[:3]]} this shard does not "
            f"hold, or lacks {[quote(k) for k in missing[:3]]}: send every one of the job's "
            f"integer buffers ({len(want)}) to shard 0, or none",
            reason="malformed",
        )
    for k, v in values.items():
        if len(v) != want[k]:
            raise InvalidArgument(
                f"integer buffer {quote(k)} has {len(v)} elements, the job says {want[k]}",
                reason="malformed",
            )


IntValues = dict[str, tuple[int, ...]]


class IntBufferLog:
    """Integer buffers by clock: for each recent clock, the values of the worker the
    update policy chose (UpdatePolicy.takes_int_buffers) and that worker's rank."""

    def __init__(self, keep: int = 3) -> None:
        self.keep = max(2, keep)
        """Clocks kept: a worker pulls at most this far behind the newest push (sync: one
        round; ssp: its bound + 2)."""
        self.by_clock: dict[int, tuple[int, IntValues]] = {}

    @classmethod
    def for_job(cls, job: Job) -> IntBufferLog:
        return cls(keep=min(job.staleness + 3, 64))

    def held(self, clock: int) -> int | None:
        got = self.by_clock.get(clock)
        return None if got is None else got[0]

    def put(self, clock: int, worker: int, values: IntValues) -> None:
        self.by_clock[clock] = (worker, values)  # a header's own dict: nobody mutates it
        while len(self.by_clock) > self.keep:
            del self.by_clock[min(self.by_clock)]

    def for_pull(self, clock: int) -> IntValues:
        """What a pull at `clock` gets: the values of the newest clock <= `clock` (none:
        the worker keeps its own)."""
        older = [c for c in self.by_clock if c <= clock]
        return self.by_clock[max(older)][1] if older else {}

    def newest(self) -> tuple[int, int, IntValues] | None:
        """(clock, worker, values) of the newest clock held (inspection)."""
        if not self.by_clock:
            return None
        c = max(self.by_clock)
        return c, *self.by_clock[c]

    def digest_text(self) -> str:
        return repr(sorted((c, w, sorted(v.items())) for c, (w, v) in self.by_clock.items()))
