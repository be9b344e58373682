"""bench/sparse.py's torchrec way (issue #46 item 4): the runner's pure helpers agree with
psar's (table init, logloss) and with brute force (AUC, bytes of an all-to-all); the way
is skipped, saying why, without a TorchRec venv; and, where the venv exists, a tiny run
trains psar's model on psar's data: its loss equals DDP-sparse's."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from bench import sparse
from bench.lib import torchrec_dmp, torchrec_way
from psar.trainkit.sparse_tables import BLOCK_ROWS, init_rows


def test_block_rows_are_psars_init_rows() -> None:
    rows = 2 * BLOCK_ROWS + 123  # three blocks, the last one short
    whole = init_rows(rows, 4, 0.125, 7)
    for lo, hi in [(0, rows), (0, 10), (BLOCK_ROWS - 5, BLOCK_ROWS + 5), (rows - 3, rows),
                   (rows // 2, rows)]:  # fmt: skip
        assert torch.equal(torchrec_dmp.block_rows(rows, 4, 0.125, 7, lo, hi), whole[lo:hi])
    assert torchrec_dmp.BLOCK_ROWS == BLOCK_ROWS


def test_auc_is_the_fraction_of_ordered_pairs_ties_half() -> None:
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (40,), generator=gen).float()  # many ties
    labels = torch.randint(0, 2, (40,), generator=gen).float()
    pos = [s for s, y in zip(scores, labels, strict=True) if y == 1]
    neg = [s for s, y in zip(scores, labels, strict=True) if y == 0]
    pairs = [1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg)]
    assert torchrec_dmp.rank_auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs))
    assert math.isnan(torchrec_dmp.rank_auc(scores, torch.ones(40)))


def test_logloss_is_the_recsys_loss() -> None:
    logits, labels = torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1.0, 0.0, 0.0])
    want = -(math.log(torch.sigmoid(torch.tensor(2.0)).item())
             + math.log(1 - torch.sigmoid(torch.tensor(-1.0)).item())
             + math.log(1 - torch.sigmoid(torch.tensor(0.5)).item())) / 3  # fmt: skip
    assert torchrec_dmp.logloss(logits, labels) == pytest.approx(want)


def test_all_to_all_counts_only_the_other_ranks_rows() -> None:
    t = torch.zeros(10, 4)  # 16 bytes a row
    assert torchrec_dmp._a2a(t, [3, 7], rank=0, world=2) == 7 * 16
    assert torchrec_dmp._a2a(t, [3, 7], rank=1, world=2) == 3 * 16
    assert torchrec_dmp._a2a(t, None, rank=1, world=2) == 5 * 16
    assert torchrec_dmp._a2a(torch.zeros(0), None, rank=0, world=2) == 0


def test_without_a_venv_the_row_says_why(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope" / "python")
    out = sparse._torchrec(tmp_path, missing, [], 8, 2, 10.0, "")
    assert "--torchrec-python" in out["skipped"] and "no such file" in out["skipped"]
    assert "does not exist" in torchrec_way.unusable("")


def test_the_inputs_are_psars_batches_and_weights(tmp_path: Path) -> None:
    from psar.worker.data import ShardedBatches
    from psar.worker.workloads import load_workload

    kv = {"rows": "300,50", "dim": "8", "bag": "2", "samples": "64", "val_samples": "16",
          "dense": "3", "interaction": "dot"}  # fmt: skip
    opts = [a for k, v in kv.items() for a in ("--workload-option", f"{k}={v}")]
    torchrec_way.write_inputs(tmp_path, opts, batch=8, steps=3, world=2, lr=0.05)
    spec = torch.load(tmp_path / "spec.pt", weights_only=True)
    w = load_workload("recsys", 0, kv, materialize=False)
    b1 = ShardedBatches(w.train_dataset, batch_size=8, rank=1, world_size=2, seed=0)
    got = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert torch.equal(got["x"][2], b1.batch(2)[0]) and torch.equal(got["y"][2], b1.batch(2)[1])
    assert spec["rows"] == [300, 50] and spec["dlrm"] and spec["interaction"] == "dot"
    assert torch.equal(spec["dense_state"]["top.0.weight"], w.model.top[0].weight)
    assert torch.equal(spec["val_x"], w.val_dataset.tensors[0])
    # The runner's dense layers take that state under the same names.
    dense = torchrec_dmp._dense_modules(spec)
    dense.load_state_dict(spec["dense_state"])


PYTHON = torchrec_way.default_python()


@pytest.mark.slow
@pytest.mark.skipif(
    not PYTHON,
    reason=f"no TorchRec venv at {torchrec_way.DEFAULT_PYTHON} (its builder: "
    "bench/baselines/torchrec_venv.sh)",
)
def test_torchrec_way_trains_psars_model_on_psars_data() -> None:
    why = torchrec_way.unusable(PYTHON)
    if why:
        pytest.skip(why)
    out = sparse.bench(100_000, 3, 256, 4, 300.0, 0, ways=("allreduce_sparse", "torchrec"),
                       options=("val_samples=512",), torchrec_python=PYTHON)  # fmt: skip
    row = out["torchrec"]
    assert "error" not in row and "skipped" not in row, row
    assert row["samples_per_sec"] > 0 and row["window_s"] > 0
    assert row["bytes_per_step"] > 0 and len(row["peak_rss_bytes_per_rank"]) == 2
    # Each rank holds half of each table's rows (row-wise), plus the dense part.
    assert 0.5 * sum(out["rows"]) * 64 * 4 <= row["worker_model_bytes"] < sum(out["rows"]) * 256
    assert all("row_wise" in s for s in row["sharding"].values())
    assert 0.0 <= row["val_auc"] <= 1.0 and row["val_logloss"] > 0
    # Same initial weights, data, optimizer and gradient averaging as DDP-sparse.
    assert row["final_loss"] == pytest.approx(out["allreduce_sparse"]["final_loss"], rel=1e-5)
