"""A loop of the user's own under --arch hybrid (issue #46 item 1): prepare() puts the
tables the user marks on the shards and allreduces the rest, and trains exactly as the
same script under --arch allreduce (DDP with sparse gradients), fp32, per step. Real
shards, real ranks under `psar launch`, gloo. Also --sparse-min-rows, which puts big
sparse=True embeddings on the shards without a mark."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests.procs import PSAR, run_own_group

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import json, sys
import torch
import torch.nn.functional as F
from torch import nn
from psar import prepare
from psar.trainkit.sparse_tables import init_rows

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(5000, 8, mode="mean", sparse=True)
        self.emb.psar_sparse_table = True          # this table goes to the shards
        self.emb.psar_init = (0.1, 7)              # ... which build its rows from this
        self.emb.weight.data = init_rows(5000, 8, 0.1, 7)  # the same rows, for DDP
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids):
        return self.mlp(self.emb(ids)).squeeze(-1)

torch.manual_seed(0)
model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.5)
losses = []
with prepare(model, opt, seed=0) as run:
    sched = run.register(torch.optim.lr_scheduler.StepLR(run.optimizer, 4, gamma=0.5))
    gen = torch.Generator().manual_seed(run.rank)
    for step in range(10):
        ids = torch.randint(0, 5000, (32, 3), generator=gen)
        y = (ids[:, 0] % 2).float()
        run.optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(run.model(ids), y)
        run.backward(loss)
        run.optimizer.step()
        sched.step()
        losses.append(loss.item())
    if run.rank == 0:
        json.dump({"arch": run.arch, "losses": losses}, open(sys.argv[1], "w"))
"""


def _launch(tmp: Path, arch: str) -> dict:
    script = tmp / "loop.py"
    script.write_text(SCRIPT)
    out = tmp / f"{arch}.json"
    extra = ["--mode", "sync", "--servers", "1"] if arch == "hybrid" else []
    args = [*PSAR, "launch", "--arch", arch, *extra, "--workers", "2",
            "--", sys.executable, str(script), str(out)]  # fmt: skip
    p = run_own_group(args, timeout=240, cwd=ROOT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_loop_of_its_own_trains_under_hybrid_exactly_as_under_ddp(tmp_path: Path) -> None:
    hybrid, ddp = _launch(tmp_path, "hybrid"), _launch(tmp_path, "allreduce")
    assert (hybrid["arch"], ddp["arch"]) == ("hybrid", "allreduce")
    a, b = np.asarray(hybrid["losses"]), np.asarray(ddp["losses"])
    assert len(a) == len(b) == 10
    assert np.max(np.abs(a - b) / np.abs(b)) <= 1e-5, (a, b)
    assert a[-1] != a[0]  # it trained (the scheduler's halving included)


def test_sparse_min_rows_marks_big_sparse_embeddings_only() -> None:
    from psar.trainkit.sparse_tables import mark_sparse_embeddings, marked_tables

    model = nn.Module()
    model.big = nn.EmbeddingBag(3000, 4, sparse=True)
    model.small = nn.EmbeddingBag(100, 4, sparse=True)
    model.dense = nn.Embedding(5000, 4)  # sparse=False: its gradient is dense, DDP's way
    model.marked = nn.Embedding(10, 4)
    model.marked.psar_sparse_table, model.marked.psar_init = True, (0.5, 1)
    assert mark_sparse_embeddings(model, 0) == []
    assert mark_sparse_embeddings(model, 1000) == ["big"]
    assert set(marked_tables(model)) == {"big", "marked"}
    assert model.big.psar_init[0] == 1.0  # torch's init of an embedding: N(0, 1)
    assert model.marked.psar_init == (0.5, 1)  # a user's mark stays as it is
    again = nn.Module()
    again.big = nn.EmbeddingBag(3000, 4, sparse=True)
    mark_sparse_embeddings(again, 1000)
    assert again.big.psar_init == model.big.psar_init  # the same seed on every rank


def test_a_resume_with_tables_on_the_shards_is_refused_saying_why(tmp_path: Path) -> None:
    from psar.worker.own_loop import _tables_to_shards

    model = nn.Module()
    model.big = nn.EmbeddingBag(3000, 4, sparse=True)
    _tables_to_shards(model, 0, None)  # nothing marked, nothing resumed: fine
    _tables_to_shards(model, 0, tmp_path)  # resumed, but no table on the shards: fine
    with pytest.raises(ValueError, match=r"sparse tables \(big\) live on the shards"):
        _tables_to_shards(model, 1000, tmp_path)
    assert torch.is_tensor(model.big.weight)
