"""The backward of an ``nn.EmbeddingBag`` whose weight is a batch's rows (sparse_worker.py).

On a PS worker a table's weight is only the rows the batch names, and the ids are
remapped to them, so its gradient is small and dense. PyTorch's CPU kernel for that
gradient (``_embedding_bag_dense_backward``) sorts the ids and then adds one row per id
through a dispatched ``axpy`` call: at 4096 bags of 4 ids over 2 tables that was a third
of a worker's CPU time per step (py-spy, bench/sparse.py at 10M rows). One ``index_add_``
over the ids computes the same sums (in the batch's order rather than the ids' sorted
order: the same values to float rounding) without the sort or the per-id calls.

Faster still where the worker says, with the ids, where the batch names each row
(:func:`batch_rows`, which finds the batch's unique rows by one sort that gives that
order too): a row's gradient is then the sum of its bags' gradients, which is an
``embedding_bag`` over the bags' gradients (one segment per row) — no (bags x size x dim)
copy of the gradient to scatter from, and the same bits (a row's terms added in the
batch's order either way). bench/experiments/row_backward.py times both ways per table
(4096 bags of 4, dim 64, one thread): rows found 1.33 -> 1.02 ms, gradient added 2.58 ->
0.95 ms at 10M rows.

Only the common case takes this path: a CPU weight, 2-D ids (bags of equal size), no
offsets or per-sample weights, mode ``sum`` or ``mean``, no ``scale_grad_by_freq``.
Everything else runs the module's own forward, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BatchRows", "batch_rows", "install"]

BAG_ROWS = "psar_bag_rows"
"""Module attribute the worker sets before a table's forward: (the remapped ids it hands
the forward, BatchRows.by_row, BatchRows.starts); taken by that forward only."""


@dataclass(frozen=True)
class BatchRows:
    """A batch's ids (flat) as the rows a worker pulls, and where it names each."""

    uniq: torch.Tensor
    """The unique ids, shard by shard (row r on shard r % S), each shard's increasing:
    each shard's rows are one slice of the pulled rows and of the pushed gradients."""
    inv: torch.Tensor
    """Per position of the flat ids: its row's index in `uniq`."""
    by_row: torch.Tensor
    """The positions, row by row (in `uniq`'s order), each row's increasing."""
    starts: torch.Tensor
    """Per row of `uniq`: where its positions start in `by_row`."""


def batch_rows(ids: torch.Tensor, rows: int, num_shards: int) -> BatchRows | None:
    """The unique rows of flat int64 `ids` of a table of `rows` rows on `num_shards`
    shards, by one stable sort of a key that orders them by shard, then id. None where
    an id lies outside [0, rows) (the key would confuse it with another row): the
    caller then takes torch.unique's path, and the shard names the bad ids."""
    if ids.numel() == 0:
        return None
    lo, hi = torch.aminmax(ids)
    if int(lo) < 0 or int(hi) >= rows:
        return None
    per_shard = -(-rows // num_shards)
    key = ids % num_shards * per_shard + ids // num_shards if num_shards > 1 else ids
    keys, by_row = _stable_sort(key, per_shard * num_shards)
    first = torch.empty(keys.numel(), dtype=torch.bool)
    first[0] = True
    torch.ne(keys[1:], keys[:-1], out=first[1:])
    starts = first.nonzero().squeeze(1)
    inv = torch.empty_like(by_row)
    inv[by_row] = torch.cumsum(first, 0) - 1
    ukeys = keys[starts]
    uniq = ukeys % per_shard * num_shards + ukeys // per_shard if num_shards > 1 else ukeys
    return BatchRows(uniq, inv, by_row, starts)


_MEAN = "mean"
_POOLINGS = ("sum", _MEAN)
"""The poolings whose gradient is a bag's gradient (over its size for mean) per id."""


def _stable_sort(key: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.sort(key, stable=True) for int64 keys in [0, bound): where each key and its
    position fit one int64 together, numpy sorts those (its vectorised sort of plain
    integers: 0.45 ms against torch's 0.72 ms for 16,384 keys, one core) and both are
    read back: the same order, ties in position order."""
    n = key.numel()
    bits = max(1, (n - 1).bit_length())
    if bound.bit_length() + bits > 62:
        return torch.sort(key, stable=True)
    packed = torch.from_numpy(np.sort((key << bits).add_(torch.arange(n)).numpy()))
    return packed >> bits, packed & ((1 << bits) - 1)


class _BagOfRows(torch.autograd.Function):
    """embedding_bag(ids, weight, pooling) forward as PyTorch's; backward by index_add_,
    or by an embedding_bag over the bags' gradients where `by_row`, `starts` are given
    (BatchRows'; the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        weight: torch.Tensor,
        ids: torch.Tensor,
        pooling: str,
        by_row: torch.Tensor | None = None,
        starts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ctx.size = ids.shape[1]
        if by_row is not None:
            ctx.save_for_backward(torch.div(by_row, ctx.size, rounding_mode="floor"), starts)
        else:
            ctx.save_for_backward(ids)
        ctx.rows, ctx.mean, ctx.dtype = weight.shape[0], pooling == _MEAN, weight.dtype
        return F.embedding_bag(ids, weight, mode=pooling)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        size = ctx.size
        grad = (grad / size if ctx.mean else grad).to(ctx.dtype)
        if len(ctx.saved_tensors) == 2:  # each row: the sum of the gradients of its bags
            bag_of, starts = ctx.saved_tensors
            out = F.embedding_bag(bag_of, grad.contiguous(), starts, mode="sum")
            return out, None, None, None, None
        (ids,) = ctx.saved_tensors
        bags = ids.shape[0]
        # Every id of a bag gets its bag's gradient: (bags, size, dim) viewed flat.
        per_id = grad.unsqueeze(1).expand(bags, size, grad.shape[1])
        out = torch.zeros(ctx.rows, grad.shape[1], dtype=ctx.dtype)
        out.index_add_(0, ids.reshape(-1), per_id.reshape(-1, grad.shape[1]))
        return out, None, None, None, None


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
        told = mod.__dict__.pop(BAG_ROWS, None)  # this call's only: never a later one's
        if _fast(mod, ids, offsets, per_sample_weights):
            if told is not None and told[0] is ids:
                return _BagOfRows.apply(mod.weight, ids, mod.mode, told[1], told[2])
            return _BagOfRows.apply(mod.weight, ids, mod.mode)
        return own(mod, ids, offsets, per_sample_weights)

    # An instance attribute: nn.Module.__call__ (and its hooks) calls self.forward.
    mod.forward = forward
