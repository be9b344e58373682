"""Model buffers on a shard (BatchNorm running stats, any float buffer; issue #17).

They are slots of the job (`Job.buffer_slots`) the optimizer never steps: a push carries
their values, not gradients (never loss-scaled), and the shard keeps, per update, the
values DDP would give every rank: rank 0's (DDP broadcasts rank 0's buffers before every
forward), or the mean over the round's workers with --buffers average (sync).
"""

from __future__ import annotations

import torch

from ps.job import Job


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
