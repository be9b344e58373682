"""A user's model with buffers, shared parameters, an unused parameter and a non-float
parameter trains under both architectures; grad accumulation and low-precision worker
weights work too. Real shard, worker and torchrun processes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from psar.worker.workloads.loader import load_workload
from tests import procs
from tests.procs import run_ps_workers, run_torchrun, shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER = ["--workload", "tests.user_workloads:make_tricky", "--steps", "6", "--batch-size", "16",
        "--precision", "fp32", "--eval-batches", "2", "--lr", "0.05"]  # fmt: skip


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    # The user's module lives in this repo's tests/ folder: put the root on PYTHONPATH.
    monkeypatch.setitem(procs.ENV, "PYTHONPATH", ROOT)


@pytest.mark.slow
def test_awkward_user_model_trains_under_both(tmp_path) -> None:
    with shards(2) as addrs:
        ps = run_ps_workers(addrs, 2, tmp_path, [*USER, "--save", str(tmp_path / "ps.pt")])
    ddp = run_torchrun(2, tmp_path, [*USER, "--save", str(tmp_path / "ddp.pt")])
    for rep in [*ps, ddp]:
        assert rep["steps"] == 6 and np.isfinite(rep["losses"]).all()
        assert rep["val_loss"] is not None
    a, b = torch.load(tmp_path / "ps.pt"), torch.load(tmp_path / "ddp.pt")
    assert a.keys() == b.keys()
    assert "norm.running_mean" in a and a["steps"].dtype == torch.long
    # Weights and float buffers alike: the shards keep rank 0's buffers, as DDP broadcasts
    # them, and step no parameter that no worker used (docs/architecture.md).
    for k in ("hidden.weight", "tied.weight", "unused.weight", "norm.running_mean"):
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # CI's slow stage runs it; the default run stays under 10 min
def test_grad_accumulation_matches_across_architectures_and_batch_sizes(tmp_path) -> None:
    common = ["--workload", "mlp", "--steps", "8", "--precision", "fp32", "--eval-batches", "0"]
    accum = [*common, "--batch-size", "8", "--grad-accum", "2"]
    with shards(1) as addrs:
        ps = run_ps_workers(addrs, 2, tmp_path, accum)
    ddp = run_torchrun(2, tmp_path, accum)
    np.testing.assert_allclose(ps[0]["losses"], ddp["losses"], rtol=1e-5)
    # Two micro-batches of 8 are the same 16 samples as one batch of 16.
    with shards(1) as addrs:
        big = run_ps_workers(addrs, 2, tmp_path, [*common, "--batch-size", "16"])
    np.testing.assert_allclose(ps[0]["losses"], big[0]["losses"], rtol=1e-5)


@pytest.mark.slow  # default run under 10 minutes; CI runs -m slow too
def test_low_precision_worker_weights_halve_pull_bytes(tmp_path) -> None:
    common = ["--workload", "mlp", "--steps", "5", "--batch-size", "16", "--precision", "bf16",
              "--eval-batches", "1"]  # fmt: skip
    with shards(1) as addrs:
        full = run_ps_workers(addrs, 1, tmp_path, common)
    with shards(1) as addrs:
        half = run_ps_workers(
            addrs,
            1,
            tmp_path,
            [*common, "--worker-weights", "bf16", "--save", str(tmp_path / "w.pt")],
        )
    assert half[0]["bytes_pulled"] * 2 == full[0]["bytes_pulled"]
    saved = torch.load(tmp_path / "w.pt")
    assert all(v.dtype == torch.float32 for v in saved.values())  # the fp32 masters are saved
    np.testing.assert_allclose(half[0]["losses"], full[0]["losses"], rtol=0.05)


@pytest.mark.slow  # about 14 s
def test_low_precision_worker_initialises_the_masters_in_fp32(tmp_path) -> None:
    """Rank 0 initialises the shards' fp32 masters from the model's fp32 values, before it
    casts its own weights to bf16 (lr 1e-30: a step moves no weight by an ulp, so the
    saved masters are the initial weights)."""
    common = ["--workload", "mlp", "--steps", "1", "--batch-size", "4", "--precision", "bf16",
              "--worker-weights", "bf16", "--optimizer", "sgd", "--momentum", "0", "--lr", "1e-30",
              "--eval-batches", "0", "--save", str(tmp_path / "w.pt")]  # fmt: skip
    with shards(1) as addrs:
        run_ps_workers(addrs, 1, tmp_path, common)
    saved = torch.load(tmp_path / "w.pt")
    init = load_workload("mlp", 0, {}).model.state_dict()
    assert set(saved) == set(init)
    for k, v in init.items():
        assert saved[k].dtype == torch.float32
        assert torch.equal(saved[k], v), k  # not rounded to bf16 on the way
        assert not torch.equal(v.to(torch.bfloat16).float(), v)  # (rounding would show)
