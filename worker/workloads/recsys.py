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

DLRM-style (Naumov et al. 2019; issue #46 item 3), asked for with ``dense=N`` and/or
``interaction=dot``: each sample also has N dense (continuous) features, N(0, 1), which
a bottom MLP maps to a ``dim`` vector, and the teacher adds a linear function of them to
the logit; ``interaction=dot`` feeds the top MLP the pairwise dot products of the pooled
table vectors and the bottom vector (the upper triangle, with the bottom vector itself)
instead of their concatenation. A sample's x is then float64 (the dense features, then
the ids, exact up to 2^53); the defaults (``dense=0``, ``interaction=cat``) build the
model and data above, unchanged.

Validation reports ``val_logloss`` (mean BCE of the held-out samples: val_loss, the same
quantity, computed in float64 over the concatenated logits) and ``val_auc`` (exact ROC
AUC) through ``Workload.val_metrics`` (worker/workloads/binary_metrics.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from psar.worker.workloads.base import Workload, opt_bool, opt_float, opt_int, seeded
from psar.worker.workloads.binary_metrics import click_metrics

__all__ = ["DLRMModel", "RecsysModel", "make", "make_dataset", "zipf_ids"]

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


def _tables(rows: list[int], dim: int, sparse: bool, seed: int) -> nn.ModuleList:
    tables = nn.ModuleList()
    for t, n in enumerate(rows):
        # On the meta device: no process allocates a table it does not need (a PS
        # worker never holds one); the backend builds it from psar_init where it
        # does (DDP), load_workload for direct use (trainkit/sparse_tables.py).
        emb = nn.EmbeddingBag(n, dim, mode="mean", sparse=sparse, device="meta")
        emb.psar_sparse_table = True
        emb.psar_init = (1.0 / math.sqrt(dim), seed * 7919 + t)
        tables.append(emb)
    return tables


class RecsysModel(nn.Module):
    """Tables (EmbeddingBag, mean of ``bag`` ids) -> concat -> MLP -> one click logit."""

    def __init__(
        self, rows: list[int], dim: int, bag: int, hidden: int, sparse: bool, seed: int
    ) -> None:
        super().__init__()
        self.bag = bag
        self.tables = _tables(rows, dim, sparse, seed)
        self.mlp = nn.Sequential(
            nn.Linear(dim * len(rows), hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def psar_table_ids(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each table's ids of a batch, by module name, before forward: under the
        parameter server every table's rows are pulled at once (ps/client/sparse_worker.py)."""
        return {
            f"tables.{t}": x[:, t * self.bag : (t + 1) * self.bag] for t in range(len(self.tables))
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = [emb(x[:, t * self.bag : (t + 1) * self.bag]) for t, emb in enumerate(self.tables)]
        return self.mlp(torch.cat(pooled, dim=1)).squeeze(-1)


class DLRMModel(nn.Module):
    """DLRM-style: dense features -> bottom MLP -> a ``dim`` vector; the tables' pooled
    vectors; their interaction (``dot``: pairwise dot products, with the bottom vector;
    ``cat``: concatenation) -> top MLP (two hidden layers) -> one click logit."""

    def __init__(
        self, rows: list[int], dim: int, bag: int, hidden: int, sparse: bool, seed: int,
        dense: int, interaction: str,
    ) -> None:  # fmt: skip
        super().__init__()
        self.bag, self.dense, self.interaction = bag, dense, interaction
        self.tables = _tables(rows, dim, sparse, seed)
        self.bottom = (
            nn.Sequential(nn.Linear(dense, hidden), nn.ReLU(), nn.Linear(hidden, dim), nn.ReLU())
            if dense
            else None
        )
        n = len(rows) + bool(dense)
        width = n * (n - 1) // 2 + dim * bool(dense) if interaction == "dot" else n * dim
        self.top = nn.Sequential(
            nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, 1),
        )  # fmt: skip

    def psar_table_ids(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """As RecsysModel.psar_table_ids."""
        ids = x[:, self.dense :].long()
        return {
            f"tables.{t}": ids[:, t * self.bag : (t + 1) * self.bag]
            for t in range(len(self.tables))
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x[:, self.dense :].long()
        vecs = [emb(ids[:, t * self.bag : (t + 1) * self.bag]) for t, emb in enumerate(self.tables)]
        if self.bottom is not None:
            vecs.insert(0, self.bottom(x[:, : self.dense].float()))
        if self.interaction == "cat":
            return self.top(torch.cat(vecs, dim=1)).squeeze(-1)
        z = torch.stack(vecs, dim=1)  # (batch, n, dim)
        i, j = torch.triu_indices(len(vecs), len(vecs), offset=1, device=z.device)
        pairs = torch.bmm(z, z.transpose(1, 2))[:, i, j]
        feats = torch.cat([vecs[0], pairs], dim=1) if self.bottom is not None else pairs
        return self.top(feats).squeeze(-1)


def make_dataset(
    data_seed: int, rows: list[int], bag: int, samples: int, exponent: float, scale: float,
    dense: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, float]:  # fmt: skip
    """(x, labels float, loss floor in nats): x is the ids (samples, tables * bag) int64,
    or with `dense` features float64 (samples, dense + tables * bag), features first."""
    gen = torch.Generator().manual_seed(data_seed)
    cols, logit = [], torch.zeros(samples, dtype=torch.float64)
    for n in rows:
        ids = zipf_ids(gen, n, samples * bag, exponent).reshape(samples, bag)
        score = torch.randn(n, generator=gen, dtype=torch.float64)
        logit += score[ids].mean(dim=1)
        cols.append(ids)
    if dense:  # drawn after the tables': without dense features the data is as before
        feats = torch.randn(samples, dense, generator=gen, dtype=torch.float64)
        logit += feats @ (torch.randn(dense, generator=gen, dtype=torch.float64) / dense**0.5)
        cols = [feats, *(c.double() for c in cols)]
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
    dense: Any = 0,
    interaction: Any = "cat",
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
    - ``dense`` (0): dense features per sample, through a bottom MLP (DLRM-style).
    - ``interaction`` (cat): how the top MLP sees the vectors: cat | dot (DLRM's pairwise
      dot products); cat with dense=0 is the plain model above.
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
    dense = opt_int("dense", dense, minimum=0)
    if interaction not in ("cat", "dot"):
        raise ValueError(f"option interaction: accepted: cat, dot; got {interaction!r}")
    if interaction == "dot" and len(table_rows) + bool(dense) < 2:
        raise ValueError("option interaction=dot: needs two vectors (two tables, or dense > 0)")
    with seeded(seed):
        if dense or interaction == "dot":
            model: nn.Module = DLRMModel(
                table_rows, dim, bag, hidden, sparse, seed, dense, interaction
            )
        else:
            model = RecsysModel(table_rows, dim, bag, hidden, sparse, seed)
    x, y, floor = make_dataset(
        data_seed, table_rows, bag, samples + val_samples, exponent, scale, dense
    )
    train = TensorDataset(x[:samples], y[:samples])
    val = TensorDataset(x[samples:], y[samples:])
    return Workload(
        model=model,
        train_dataset=train,
        val_dataset=val if val_samples else None,
        loss_fn=_bce,
        # Held-out logloss and AUC, as recommendation users measure (issue #46 item 3).
        val_metrics=click_metrics,
        description=(
            f"recsys tables {table_rows} x {dim}, bag {bag}, zipf {exponent}"
            + (
                f", {dense} dense features, {interaction} interaction"
                if dense or interaction == "dot"
                else ""
            )
            + "; "
            f"loss floor {floor:.4f} nats"
        ),
    )
