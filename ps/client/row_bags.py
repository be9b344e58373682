"""The backward of an ``nn.EmbeddingBag`` whose weight is a batch's rows (sparse_worker.py).

On a PS worker a table's weight is only the rows the batch names, and the ids are
remapped to them, so its gradient is small and dense. PyTorch's CPU kernel for that
gradient (``_embedding_bag_dense_backward``) sorts the ids and then adds one row per id
through a dispatched ``axpy`` call: at 4096 bags of 4 ids over 2 tables that was a third
of a worker's CPU time per step (py-spy, bench/sparse.py at 10M rows). One ``index_add_``
over the ids computes the same sums (in the batch's order rather than the ids' sorted
order: the same values to float rounding) without the sort or the per-id calls.

Only the common case takes this path: a CPU weight, 2-D ids (bags of equal size), no
offsets or per-sample weights, mode ``sum`` or ``mean``, no ``scale_grad_by_freq``.
Everything else runs the module's own forward, as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["install"]


_MEAN = "mean"
_POOLINGS = ("sum", _MEAN)
"""The poolings whose gradient is a bag's gradient (over its size for mean) per id."""


class _BagOfRows(torch.autograd.Function):
    """embedding_bag(ids, weight, pooling) forward as PyTorch's; backward by index_add_."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ids: torch.Tensor, pooling: str) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.rows, ctx.mean, ctx.dtype = weight.shape[0], pooling == _MEAN, weight.dtype
        return F.embedding_bag(ids, weight, mode=pooling)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (ids,) = ctx.saved_tensors
        bags, size = ids.shape
        if ctx.mean:
            grad = grad / size
        # Every id of a bag gets its bag's gradient: (bags, size, dim) viewed flat.
        per_id = grad.to(ctx.dtype).unsqueeze(1).expand(bags, size, grad.shape[1])
        out = torch.zeros(ctx.rows, grad.shape[1], dtype=ctx.dtype)
        return out.index_add_(0, ids.reshape(-1), per_id.reshape(-1, grad.shape[1])), None, None


def _fast(mod: nn.EmbeddingBag, ids: torch.Tensor, offsets: Any, per_sample_weights: Any) -> bool:
    w, pooling = mod.weight, mod.mode  # a bag's pooling (not a consistency mode)
    return (
        offsets is None
        and per_sample_weights is None
        and ids.dim() == 2
        and ids.shape[1] > 0
        and pooling in _POOLINGS
        and not mod.scale_grad_by_freq
        and w.device.type == "cpu"
        and ids.device.type == "cpu"
        and torch.is_grad_enabled()
        and w.requires_grad
    )


def install(mod: nn.Module) -> None:
    """Give an ``nn.EmbeddingBag`` table (its weight a batch's rows) the index_add_
    backward where its call allows; other modules are left as they are."""
    if not isinstance(mod, nn.EmbeddingBag):
        return  # nn.Embedding's CPU backward adds by index already
    own = type(mod).forward

    def forward(
        ids: torch.Tensor, offsets: Any = None, per_sample_weights: Any = None
    ) -> torch.Tensor:
        if _fast(mod, ids, offsets, per_sample_weights):
            return _BagOfRows.apply(mod.weight, ids, mod.mode)
        return own(mod, ids, offsets, per_sample_weights)

    # An instance attribute: nn.Module.__call__ (and its hooks) calls self.forward.
    mod.forward = forward
