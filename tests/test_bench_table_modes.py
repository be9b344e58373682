"""bench/sparse.py --table-modes (issue #46's goal: async / bounded-stale tables within 1%
of sync's AUC at equal samples): each mode's job gets the same training flags but its
--mode, and each AUC is judged against sync's. The jobs are stood in for here; the real
run is the benchmark's (bench/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import sparse
from bench.lib import table_modes


def test_every_mode_trains_alike_and_is_judged_against_sync(monkeypatch, capsys) -> None:
    seen: dict[str, list[str]] = {}
    auc = {"sync": 0.80, "async": 0.795, "ssp": 0.78}

    def job(t: Path, mode: str, train: list[str], shards: int, timeout: float) -> dict:
        seen[mode] = train
        hist = {"0": 3, "1": 1} if mode != "sync" else {"0": 4}
        return {"val_auc": auc[mode], "val_logloss": 0.5, "final_train_loss": 0.5,
                "sparse_tables": {"tables.0.weight": {"staleness_histogram": hist}}}  # fmt: skip

    monkeypatch.setattr(table_modes, "_job", job)
    argv = ["--table-modes", "sync,async,ssp", "--rows", "1000", "--steps", "3", "--batch", "8",
            "--workload-option", "dense=2"]  # fmt: skip
    assert sparse.main(argv) == 0
    assert seen["sync"] == seen["async"] == seen["ssp"]  # equal samples: one set of flags
    train = seen["sync"]
    assert train[train.index("--steps") + 1] == "3" and "dense=2" in train
    assert "samples=48" in train  # one pass: 3 steps x 2 workers x 8, nothing seen twice
    text = capsys.readouterr().out
    assert "| async | 0.7950 | 0.9938 | yes |" in text
    assert "| ssp | 0.7800 | 0.9750 | no |" in text


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="accepted: sync, async, ssp"):
        table_modes.run_modes(1000, 3, 8, modes=["sync", "local"])
