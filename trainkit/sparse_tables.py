"""Sparse embedding tables on the worker side, before either backend takes the model.

A sparse table is an ``nn.Embedding`` / ``nn.EmbeddingBag`` marked
``psar_sparse_table = True`` with ``psar_init = (std, seed)``: its initial rows are
:func:`init_rows` of that recipe, which shards, PS workers and DDP workers all compute
the same way (block by block, so no process draws a whole table at once).

Why this module: a table too big for one host is the case a parameter server is for,
so a worker must never have to hold it. A workload may build its tables on the meta
device (no memory; the built-in ``recsys`` does); then

- the PS backend calls :func:`release_tables` (the worker keeps an empty (0, dim)
  weight and pulls the rows each batch touches; the shards build theirs), and
- DDP calls :func:`materialize_tables` (every rank holds the whole table, as DDP
  needs, built once from the recipe: one table's bytes at the peak, not two).

Tables built with real weights work with both as before.
"""

from __future__ import annotations

import torch
from torch import nn

BLOCK_ROWS = 65536
"""Rows per generator block of :func:`init_rows` (one seeded generator per block)."""


def local_rows(rows: int, shard: int, num_shards: int) -> int:
    """How many of `rows` rows shard `shard` holds (rows r with r % num_shards == shard)."""
    return max(0, (rows - shard + num_shards - 1) // num_shards)


def init_rows(
    rows: int, dim: int, std: float, seed: int, *, shard: int = 0, num_shards: int = 1
) -> torch.Tensor:
    """Initial values N(0, std^2) of rows r % num_shards == shard, in increasing r.

    Block b (rows b*BLOCK_ROWS ...) is drawn from its own generator seeded
    (seed, b), so any shard (or a worker) computes the same values for the same row
    without drawing the whole table at once.
    """
    out = torch.empty(local_rows(rows, shard, num_shards), dim)
    at = 0
    for b0 in range(0, rows, BLOCK_ROWS):
        n = min(BLOCK_ROWS, rows - b0)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + b0 // BLOCK_ROWS) % (1 << 63))
        block = torch.randn(n, dim, generator=gen)
        mine = block[(shard - b0) % num_shards :: num_shards]
        out[at : at + len(mine)] = mine * std
        at += len(mine)
    return out


def marked_tables(model: nn.Module) -> dict[str, nn.Module]:
    """{module name: table} of every embedding marked ``psar_sparse_table``."""
    return {
        name: mod
        for name, mod in model.named_modules()
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag))
        and getattr(mod, "psar_sparse_table", False)
    }


def mark_sparse_embeddings(model: nn.Module, min_rows: int) -> list[str]:
    """Mark every unmarked ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True`` and
    at least `min_rows` rows as a sparse table (--sparse-min-rows, a loop of its own):
    its recipe is torch's own init of an embedding, N(0, 1), seeded from its name (the
    same on every rank). Returns the names marked (none where `min_rows` is 0)."""
    import zlib

    marked = []
    for name, mod in model.named_modules():
        if (
            min_rows > 0
            and isinstance(mod, (nn.Embedding, nn.EmbeddingBag))
            and mod.sparse
            and mod.num_embeddings >= min_rows
            and not getattr(mod, "psar_sparse_table", False)
        ):
            mod.psar_sparse_table = True
            mod.psar_init = (1.0, zlib.crc32(name.encode()))
            marked.append(name)
    return marked


def materialize_tables(model: nn.Module) -> int:
    """Give every marked table still on the meta device its rows (from ``psar_init``),
    on the CPU; returns how many were built. For backends where each worker holds the
    whole table (DDP), and for callers that use the model directly."""
    built = 0
    for name, mod in marked_tables(model).items():
        w = mod.weight
        if not w.is_meta:
            continue
        recipe = getattr(mod, "psar_init", None)
        if recipe is None:
            raise ValueError(
                f"sparse table {name or '(root)'} is on the meta device without psar_init: "
                "set psar_init = (std, seed) so its rows can be built"
            )
        rows = init_rows(mod.num_embeddings, mod.embedding_dim, float(recipe[0]), int(recipe[1]))
        mod.weight = nn.Parameter(rows.to(w.dtype), requires_grad=w.requires_grad)
        built += 1
    return built


def release_tables(model: nn.Module) -> int:
    """Replace every marked table's weight with an empty (0, dim) one on the CPU (the
    PS worker's row cache starts empty; the shards hold the rows); returns how many
    were released. num_embeddings keeps the table's size."""
    released = 0
    for mod in marked_tables(model).values():
        w = mod.weight
        if w.shape[0] == 0 and not w.is_meta:
            continue
        mod.weight = nn.Parameter(
            torch.empty(0, mod.embedding_dim, dtype=w.dtype), requires_grad=w.requires_grad
        )
        released += 1
    return released


__all__ = [
    "BLOCK_ROWS",
    "init_rows",
    "local_rows",
    "marked_tables",
    "materialize_tables",
    "release_tables",
]
