"""Held-out logloss and AUC (issue #46 item 3): the metrics against brute force and torch,
the Workload.val_metrics hook, the report / compare columns, and a real recsys run that
writes both into its report and its summary line."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from psar.worker import compare, report
from psar.worker.validation import validate
from psar.worker.workloads import Workload, load_workload
from psar.worker.workloads.binary_metrics import binary_auc, binary_logloss
from tests.procs import ENV, PSAR, free_port, run_own_group


def brute_auc(scores: list[float], labels: list[int]) -> float:
    """Every (positive, negative) pair: 1 if the positive scores higher, 1/2 if tied."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y == 1]
    neg = [s for s, y in zip(scores, labels, strict=True) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize(("n", "levels", "seed"), [(2, 0, 0), (7, 3, 1), (50, 0, 2), (300, 5, 3),
                                                   (301, 2, 4), (200, 40, 5)])  # fmt: skip
def test_auc_is_the_pairwise_count_with_ties_half(n: int, levels: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, generator=g)
    if levels:  # few distinct values: many ties, across and within the classes
        scores = torch.round(scores * levels / 3)
    labels = torch.bernoulli(torch.full((n,), 0.4), generator=g)
    labels[0], labels[-1] = 1.0, 0.0  # both classes present
    want = brute_auc(scores.tolist(), [int(v) for v in labels.tolist()])
    assert binary_auc(scores, labels) == pytest.approx(want, abs=1e-12)
    # a ranking metric: any strictly increasing transform of the scores gives the same
    assert binary_auc(torch.sigmoid(scores.double()), labels) == pytest.approx(want, abs=1e-12)


def test_auc_degenerate_cases() -> None:
    y = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert binary_auc(torch.tensor([0.1, 0.2, 0.3, 0.4]), y) == 1.0  # perfectly ranked
    assert binary_auc(torch.tensor([0.4, 0.3, 0.2, 0.1]), y) == 0.0  # perfectly reversed
    assert binary_auc(torch.zeros(4), y) == 0.5  # every pair tied
    assert binary_auc(torch.tensor([-math.inf, 0.0, 0.0, math.inf]), y) == 0.875
    # one class only: no positive-negative pair, the AUC is undefined -> None
    assert binary_auc(torch.tensor([0.1, 0.2]), torch.ones(2)) is None
    assert binary_auc(torch.tensor([0.1, 0.2]), torch.zeros(2)) is None
    assert binary_auc(torch.empty(0), torch.empty(0)) is None
    # a NaN score (a diverged model) ranks nothing -> NaN
    assert math.isnan(binary_auc(torch.tensor([0.1, math.nan, 0.3, 0.4]), y))
    with pytest.raises(ValueError, match="3 scores but 4 targets"):
        binary_auc(torch.zeros(3), y)


def test_logloss_is_torchs_bce() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=g) * 3
    y = torch.bernoulli(torch.sigmoid(logits), generator=g)
    want = F.binary_cross_entropy(torch.sigmoid(logits.double()), y.double())
    assert binary_logloss(logits, y) == pytest.approx(float(want), rel=1e-12)
    # stable where sigmoid rounds to 0 or 1 in float32: a confident miss costs its logit
    assert binary_logloss(torch.tensor([-200.0]), torch.tensor([1.0])) == pytest.approx(200.0)
    with pytest.raises(ValueError, match="no samples"):
        binary_logloss(torch.empty(0), torch.empty(0))


def test_recsys_validates_logloss_and_auc_over_the_held_out_set() -> None:
    # three tables of different sizes, DLRM-style (dense features, dot interaction)
    w = load_workload("recsys", 0, {"rows": "1000,50,7", "dim": "4", "samples": "256",
                                    "val_samples": "300", "dense": "3", "interaction": "dot"})  # fmt: skip
    assert [t.num_embeddings for t in w.model.tables] == [1000, 50, 7]
    got = validate(w, 64, None, 100)
    assert got["val_extra_metrics"] == ["val_logloss", "val_auc"]
    # the same quantity as val_loss (its per-batch float32 means, weighted by size)
    assert got["val_logloss"] == pytest.approx(got["val_loss"], rel=1e-5)
    x, y = w.val_dataset.tensors
    with torch.no_grad():
        logits = w.model.eval()(x)
    assert got["val_auc"] == pytest.approx(brute_auc(logits.tolist(), y.int().tolist()))
    # --eval-batches bounds the samples, for val_loss and the metrics alike
    two = validate(w, 64, None, 2)
    assert two["val_logloss"] == pytest.approx(binary_logloss(logits[:128], y[:128]), rel=1e-6)
    # no validation: no val_loss and no metrics
    assert validate(w, 64, None, 0) == {"val_loss": None, "val_loss_unit": "nats"}


def test_a_workload_without_the_hook_reports_as_before_and_bad_names_are_refused() -> None:
    w = load_workload("mlp", 0, {"samples": "256", "val_samples": "64"})
    assert set(validate(w, 32, None, 2)) == {"val_loss", "val_loss_unit"}
    bad = Workload(model=w.model, train_dataset=w.train_dataset, loss_fn=w.loss_fn,
                   val_dataset=w.val_dataset, val_metrics=_loss_named_val_loss)  # fmt: skip
    with pytest.raises(ValueError, match="'val_loss' must start with 'val_'"):
        validate(bad, 32, None, 2)
    with pytest.raises(TypeError, match="val_metrics must be callable"):
        Workload(model=w.model, train_dataset=w.train_dataset, loss_fn=w.loss_fn,
                 val_metrics="auc")  # type: ignore[arg-type]  # fmt: skip


def _loss_named_val_loss(out: torch.Tensor, y: torch.Tensor) -> dict[str, float | None]:
    return {"val_loss": 0.0}


def test_report_and_compare_tables_have_a_column_per_metric(tmp_path: Path) -> None:
    summary = {"arch": "hybrid", "mode": "sync", "world_size": 2, "rank": 0, "val_loss": 0.5,
               "val_logloss": 0.5, "val_auc": 0.75, "val_extra_metrics": ["val_logloss", "val_auc"]}  # fmt: skip
    md = report.summarize([], [summary])
    head, _, row = md.splitlines()[2:5]
    assert head.endswith("| val logloss | val AUC |") and row.endswith("| 0.5 | 0.75 |")
    plain = report.summarize([], [{"arch": "ps", "mode": "sync", "val_loss": 0.5}])
    assert "AUC" not in plain  # a workload without the metrics: the table as before
    row = dict.fromkeys(compare.TABLE_KEYS) | {"exit_code": 0}
    cfg = {"workload": "recsys", "workers": 2, "batch_size": 8, "steps": 5, "precision": "fp32",
           "seed": 0, "servers": 1, "staleness": 2, "straggler": {}}  # fmt: skip
    doc = {"target_loss": 0.6, "target_given": True, "smooth_window": 3, "config": cfg,
           "runs": {"allreduce": {**row, **summary}, "ps-sync": row}}  # fmt: skip
    text = compare.table(doc)
    assert "| val logloss | val AUC |" in text.splitlines()[0]
    assert text.splitlines()[2].endswith("| 0 | 0.5 | 0.75 |")
    assert text.splitlines()[3].endswith("| 0 | - | - |")


def test_a_recsys_run_reports_logloss_and_auc(tmp_path: Path) -> None:
    # A real `psar train` process: allreduce, one rank (the rendezvous from the launcher's
    # variables, as torchrun sets them), tiny tables, a few steps.
    env = {**ENV, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    args = [*PSAR, "train", "--arch", "allreduce", "--workload", "recsys",
            "--workload-option", "rows=2000,300,50", "--workload-option", "dim=8",
            "--workload-option", "samples=1024", "--workload-option", "val_samples=512",
            "--steps", "5", "--batch-size", "64", "--eval-batches", "8", "--log-every", "0",
            "--torch-threads", "1", "--report", str(tmp_path / "report.json")]  # fmt: skip
    p = run_own_group(args, 120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["val_extra_metrics"] == ["val_logloss", "val_auc"]
    assert rep["val_logloss"] == pytest.approx(rep["val_loss"], rel=1e-5)
    assert 0.0 <= rep["val_auc"] <= 1.0
    said = json.loads(p.stdout.strip().splitlines()[-1])  # the run's summary line
    assert said["val_auc"] == rep["val_auc"] and said["val_logloss"] == rep["val_logloss"]
