"""DDP communication hooks that put fp16/bf16 gradients on the wire.

torch's own `fp16_compress_hook` is used for fp16 on CUDA and CPU alike, and its
`bf16_compress_hook` for bf16 on CUDA: a comparison of psar's PS pushing fp16/bf16 with
DDP then measures DDP as users run it (issue #19). torch's bf16 hook refuses to run
without CUDA/NCCL, yet gloo reduces bf16 tensors fine, so on CPU bf16 takes a hook with
the same semantics: divide by the world size first (so the sum cannot overflow where the
mean would not), cast, allreduce, cast back.
"""

# No `from __future__ import annotations`: DDP inspects the hook's annotations at
# registration and wants the real dist.GradBucket class, not a string.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


def compress_hook(dtype: torch.dtype) -> Callable[[Any, dist.GradBucket], torch.futures.Future]:
    """A DDP comm hook that allreduces the bucket in `dtype`."""

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state if state is not None else dist.group.WORLD
        buffer = bucket.buffer()
        wire = buffer.div(dist.get_world_size(group)).to(dtype)
        fut = dist.all_reduce(wire, group=group, async_op=True).get_future()

        def decompress(f: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(f.value()[0])
            return buffer

        return fut.then(decompress)

    return hook


def register_wire_dtype(ddp: torch.nn.parallel.DistributedDataParallel, dtype: torch.dtype) -> None:
    """Make `ddp` move gradients in `dtype` (fp32: leave DDP's default allreduce)."""
    if dtype == torch.float32:
        return
    on_cuda = next(ddp.module.parameters()).is_cuda
    if dtype == torch.float16:  # gloo runs torch's fp16 hook on CPU too
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif on_cuda and dtype == torch.bfloat16:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:
        ddp.register_comm_hook(None, compress_hook(dtype))
