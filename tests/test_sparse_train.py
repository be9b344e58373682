"""recsys end to end: a sync PS run with sparse tables matches DDP (dense) in fp32, and
async/ssp runs train with row-sparse pushes. Real shards, workers and torchrun."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.procs import run_ps_workers, run_torchrun, shards

COMMON = ["--workload", "recsys", "--workload-option", "rows=10000,1000",
          "--workload-option", "dim=8", "--workload-option", "samples=4096",
          "--workload-option", "val_samples=256", "--steps", "12", "--batch-size", "32",
          "--seed", "3", "--lr", "0.5", "--momentum", "0", "--eval-batches", "2",
          "--precision", "fp32", "--wire-dtype", "fp32"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_ps_sync_sparse_matches_ddp_dense_fp32(tmp_path, accum: int) -> None:  # noqa: ANN001
    # accum 1: a step's row gradients are the one micro-batch's, pushed as they are;
    # accum 2: two micro-batches' rows merged (summed per row) before the push.
    sp, sd = ["--save", str(tmp_path / "ps.pt")], ["--save", str(tmp_path / "ddp.pt")]
    common = [*COMMON, "--grad-accum", str(accum)]
    with shards(2) as addrs:
        ps = run_ps_workers(addrs, 2, tmp_path, [*common, "--sparse-wire-dtype", "fp32", *sp])
    ddp = run_torchrun(2, tmp_path, [*common, *sd])
    a, b = np.asarray(ps[0]["losses"]), np.asarray(ddp["losses"])
    assert len(a) == len(b) == 12
    assert np.max(np.abs(a - b) / np.abs(b)) <= 1e-5
    assert ps[0]["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-4)
    a, b = torch.load(tmp_path / "ps.pt"), torch.load(tmp_path / "ddp.pt")
    assert a.keys() == b.keys() and a["tables.0.weight"].shape == (10000, 8)
    for k in a:  # the tables come back from the shards
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    # Only touched rows travel: far fewer bytes than the dense allreduce.
    assert ps[0]["bytes_pushed"] * 10 < ddp["bytes_allreduced"]
    tables = ps[0]["sparse_tables"]
    assert set(tables) == {"tables.0.weight", "tables.1.weight"}
    assert all(t["staleness_histogram"] == {"0": 24} for t in tables.values())
    # The worker holds only the rows of its batch, not the 10000 x 8 table.
    assert ps[0]["worker_param_bytes"] < 10000 * 8 * 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "extra"),
    [("async", ["--sparse-optimizer", "adagrad"]), ("ssp", ["--sparse-optimizer", "lazy_adam"])],
)
def test_ps_async_ssp_sparse_train(tmp_path, mode: str, extra: list[str]) -> None:  # noqa: ANN001
    args = [*COMMON, "--mode", mode, "--staleness", "1", "--sparse-lr", "0.05", *extra]
    with shards(2) as addrs:
        reps = run_ps_workers(addrs, 2, tmp_path, args)
    for rep in reps:
        assert all(np.isfinite(rep["losses"]))
        hist = rep["sparse_tables"]["tables.0.weight"]["staleness_histogram"]
        assert sum(hist.values()) == 2 * 12  # one applied push per shard per step
        assert rep["sparse_bytes_pushed"] > 0


@pytest.mark.slow
def test_recsys_loss_falls_towards_its_floor() -> None:
    import re

    from psar.worker.workloads import load_workload

    w = load_workload(
        "recsys", 0, {"rows": "2000,200", "dim": "8", "samples": "65536", "scale": "4"}
    )
    floor = float(re.search(r"loss floor ([0-9.]+)", w.description).group(1))
    opt = torch.optim.Adagrad(w.model.parameters(), lr=0.1)
    x, y = w.train_dataset.tensors
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        i = torch.randint(0, len(x), (256,), generator=g)
        loss = w.loss_fn(w.model(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    xv, yv = w.val_dataset.tensors
    with torch.no_grad():
        val = float(w.loss_fn(w.model(xv), yv))
    assert floor < 0.45 and val < floor + 0.05 < 0.69  # from ~0.69 to near the floor


@pytest.mark.slow
def test_rows_pulled_in_fp16_move_half_the_row_bytes_and_train_alike(tmp_path) -> None:  # noqa: ANN001
    """--sparse-pull-dtype fp16: every pulled row costs dim x 2 bytes (+ its 8-byte id)
    where fp32 costs dim x 4, the same rows are pulled, and the losses stay within fp16's
    rounding of the rows (an fp32 model, fp32 masters on the shards)."""
    args = [*COMMON, "--mode", "sync", "--sparse-wire-dtype", "fp32"]
    reps = {}
    for dtype in ("fp32", "fp16"):
        with shards(2) as addrs:
            out = tmp_path / dtype
            out.mkdir()
            reps[dtype] = run_ps_workers(addrs, 2, out, [*args, "--sparse-pull-dtype", dtype])
    dim = 8
    for w in range(2):
        full, half = reps["fp32"][w]["sparse_bytes_pulled"], reps["fp16"][w]["sparse_bytes_pulled"]
        rows = full // (dim * 4 + 8)
        assert rows > 0 and full == rows * (dim * 4 + 8)
        assert half == rows * (dim * 2 + 8)
    a, b = np.asarray(reps["fp32"][0]["losses"]), np.asarray(reps["fp16"][0]["losses"])
    assert np.max(np.abs(a - b) / np.abs(a)) <= 1e-2
    assert not np.array_equal(a, b)  # the rows were rounded: fp16 did travel
