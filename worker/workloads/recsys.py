"""Built-in ``recsys`` workload: embedding tables pooled into a small MLP predicting a click.

Generated data (seeded, vectorised), documented in docs/sparse.md:

- Each sample has ``bag`` ids per table. Ids follow a bounded Zipf law: the item of
  popularity rank k (1..rows) is drawn with probability proportional to 1 / k^zipf,
  and ranks are scattered over the table by a fixed bijection r -> (r * P) mod rows
  (P a large prime not dividing rows), so hot rows are spread over all shards.
- A hidden teacher gives every row of every table a score s ~ N(0, 1); a sample's
  logit is ``scale * sum over tables of mean(s[ids])``, and its label is drawn
  Bernoulli(sigmoid(logit)). The model can represent the teacher exactly, so the
  loss floor is the mean binary entropy of those probabilities (``loss_floor``,
  printed in the description) and the loss must fall towards it.

Tables are ``nn.EmbeddingBag(mode="mean")`` marked for the parameter server
(``psar_sparse_table``, ``psar_init``: see ps/client/sparse_worker.py), built on the meta
device: a PS worker never allocates them, DDP builds them from ``psar_init``
(trainkit/sparse_tables.py). ``sparse=true`` makes
them produce sparse gradients (DDP allreduces those sparsely with gloo); PS always
moves only touched rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from psar.worker.workloads.base import Workload, opt_bool, opt_float, opt_int, seeded

__all__ = ["RecsysModel", "make", "make_dataset", "zipf_ids"]

_PRIMES = (1_000_000_007, 998_244_353, 2_147_483_647, 433_494_437)


def zipf_ids(gen: torch.Generator, rows: int, n: int, exponent: float) -> torch.Tensor:
    """n row ids in [0, rows): bounded Zipf(exponent) popularity ranks, scattered."""
    k = torch.arange(1, rows + 1, dtype=torch.float64)
    cdf = torch.cumsum(k.pow_(-exponent), 0)
    cdf /= cdf[-1].clone()
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    ranks = torch.searchsorted(cdf, u).clamp_(max=rows - 1)
    prime = next(p for p in _PRIMES if rows % p != 0)
    return (ranks * (prime % rows)) % rows if rows > 1 else ranks


class RecsysModel(nn.Module):
    """Tables (EmbeddingBag, mean of ``bag`` ids) -> concat -> MLP -> one click logit."""

    def __init__(
        self, rows: list[int], dim: int, bag: int, hidden: int, sparse: bool, seed: int
    ) -> None:
        super().__init__()
        self.bag = bag
        self.tables = nn.ModuleList()
        for t, n in enumerate(rows):
            # On the meta device: no process allocates a table it does not need (a PS
            # worker never holds one); the backend builds it from psar_init where it
            # does (DDP), load_workload for direct use (trainkit/sparse_tables.py).
            emb = nn.EmbeddingBag(n, dim, mode="mean", sparse=sparse, device="meta")
            emb.psar_sparse_table = True
            emb.psar_init = (1.0 / math.sqrt(dim), seed * 7919 + t)
            self.tables.append(emb)
        self.mlp = nn.Sequential(
            nn.Linear(dim * len(rows), hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = [emb(x[:, t * self.bag : (t + 1) * self.bag]) for t, emb in enumerate(self.tables)]
        return self.mlp(torch.cat(pooled, dim=1)).squeeze(-1)


def make_dataset(
    data_seed: int, rows: list[int], bag: int, samples: int, exponent: float, scale: float
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(ids (samples, tables * bag) int64, labels float, loss floor in nats)."""
    gen = torch.Generator().manual_seed(data_seed)
    cols, logit = [], torch.zeros(samples, dtype=torch.float64)
    for n in rows:
        ids = zipf_ids(gen, n, samples * bag, exponent).reshape(samples, bag)
        score = torch.randn(n, generator=gen, dtype=torch.float64)
        logit += score[ids].mean(dim=1)
        cols.append(ids)
    p = torch.sigmoid(logit * scale)
    y = torch.bernoulli(p, generator=gen).float()
    eps = 1e-12
    floor = float(-(p * (p + eps).log() + (1 - p) * (1 - p + eps).log()).mean())
    return torch.cat(cols, dim=1), y, floor


def _bce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits.float(), y.float())


def make(
    seed: int,
    *,
    rows: Any = "1000000,100000",
    dim: Any = 64,
    bag: Any = 4,
    hidden: Any = 64,
    samples: Any = 65536,
    val_samples: Any = 4096,
    zipf: Any = 1.05,
    scale: Any = 2.0,
    sparse: Any = False,
    data_seed: Any = 0,
) -> Workload:
    """Build the ``recsys`` workload. Options (``--workload-option key=value``):

    - ``rows`` ("1000000,100000"): rows of each table, comma-separated (10M+ works).
    - ``dim`` (64): embedding width of every table.
    - ``bag`` (4): ids per sample per table (mean-pooled).
    - ``hidden`` (64): MLP hidden width.
    - ``samples`` (65536) / ``val_samples`` (4096): generated samples.
    - ``zipf`` (1.05): Zipf exponent of id popularity.
    - ``scale`` (2.0): teacher logit scale (larger: lower loss floor).
    - ``sparse`` (false): tables produce sparse gradients (allreduce-sparse under DDP).
    - ``data_seed`` (0): seeds ids, teacher and labels.
    """
    table_rows = [opt_int("rows", r, minimum=1) for r in str(rows).split(",") if r.strip()]
    if not table_rows:
        raise ValueError("option rows: give at least one table size")
    dim = opt_int("dim", dim, minimum=1)
    bag = opt_int("bag", bag, minimum=1)
    hidden = opt_int("hidden", hidden, minimum=1)
    samples = opt_int("samples", samples, minimum=1)
    val_samples = opt_int("val_samples", val_samples, minimum=0)
    exponent = opt_float("zipf", zipf, low=0.0)
    scale = opt_float("scale", scale)
    sparse = opt_bool("sparse", sparse)
    data_seed = opt_int("data_seed", data_seed)
    with seeded(seed):
        model = RecsysModel(table_rows, dim, bag, hidden, sparse, seed)
    x, y, floor = make_dataset(data_seed, table_rows, bag, samples + val_samples, exponent, scale)
    train = TensorDataset(x[:samples], y[:samples])
    val = TensorDataset(x[samples:], y[samples:])
    return Workload(
        model=model,
        train_dataset=train,
        val_dataset=val if val_samples else None,
        loss_fn=_bce,
        description=(
            f"recsys tables {table_rows} x {dim}, bag {bag}, zipf {exponent}; "
            f"loss floor {floor:.4f} nats"
        ),
    )
