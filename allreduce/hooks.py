"""DDP communication hooks that put fp16/bf16 gradients on the wire.

On CUDA, torch's own `fp16_compress_hook` / `bf16_compress_hook` are used. torch's
bf16 hook refuses to run without CUDA/NCCL, yet gloo reduces bf16 tensors fine, so on
CPU one hook with the same semantics serves both dtypes: divide by the world size
first (so the sum cannot overflow where the mean would not), cast, allreduce, cast back.
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
    if on_cuda and dtype == torch.float16:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif on_cuda and dtype == torch.bfloat16:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:
        ddp.register_comm_hook(None, compress_hook(dtype))
