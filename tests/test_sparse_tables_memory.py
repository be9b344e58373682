"""A PS worker never holds a sparse table; DDP builds it once (trainkit/sparse_tables.py).

The table too big for one host is what a parameter server is for, so the built-in
recsys workload builds its tables on the meta device: the PS backend releases them
(the shards build their rows from psar_init), DDP materializes them, and
load_workload materializes them for callers that use the model directly.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from psar.trainkit.sparse_tables import init_rows, marked_tables, materialize_tables, release_tables
from psar.worker.workloads import load_workload
from psar.worker.workloads.recsys import RecsysModel

ROOT = Path(__file__).resolve().parents[1]


def test_a_billion_row_table_costs_nothing_until_built() -> None:
    model = RecsysModel([1_000_000_000, 100], dim=64, bag=4, hidden=8, sparse=False, seed=3)
    tables = marked_tables(model)
    assert len(tables) == 2 and all(t.weight.is_meta for t in tables.values())
    assert release_tables(model) == 2
    for t in tables.values():
        assert t.weight.shape == (0, 64) and not t.weight.is_meta and t.weight.requires_grad
        assert t.num_embeddings in (1_000_000_000, 100)  # the size is kept for the shards
    assert release_tables(model) == 0  # nothing left to release


def test_built_tables_are_the_recipes_rows_and_the_rest_is_seeded() -> None:
    a = load_workload("recsys", 5, {"rows": "3000,70", "dim": "8", "samples": "16"})
    b = load_workload("recsys", 5, {"rows": "3000,70", "dim": "8", "samples": "16"})
    for t, (name, mod) in enumerate(marked_tables(a.model).items()):
        want = init_rows(mod.num_embeddings, 8, 1 / 8**0.5, 5 * 7919 + t)
        assert torch.equal(mod.weight, want), name
        assert mod.weight.requires_grad
    sb = b.model.state_dict()
    for k, va in a.model.state_dict().items():
        assert torch.equal(va, sb[k]), k
    assert materialize_tables(a.model) == 0  # built already: nothing to do
    lazy = load_workload("recsys", 5, {"rows": "3000,70", "dim": "8", "samples": "16"},
                         materialize=False)  # fmt: skip
    assert all(m.weight.is_meta for m in marked_tables(lazy.model).values())


def test_a_meta_table_without_a_recipe_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Embedding(10, 4, device="meta"))
    model[0].psar_sparse_table = True
    with pytest.raises(ValueError, match=r"sparse table 0 .*psar_init"):
        materialize_tables(model)


# `psar train` leaves through os._exit (worker/cli.py _leave), which runs no atexit hook:
# report the peak from there.
# The worker's peak above what importing torch and psar costs: a CUDA build of torch maps
# several hundred MB of libraries on import, even on a CPU, and none of that is the table.
_PEAK = """
import os, resource, runpy, sys
import torch, psar.worker.cli
_base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
_exit = os._exit
def _report_then_exit(code):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print("MAXRSS_KB", peak - _base, "BASE_KB", _base, file=sys.stderr, flush=True)
    _exit(code)
os._exit = _report_then_exit
sys.argv = ["psar", *sys.argv[1:]]
runpy.run_module("psar.worker.cli", run_name="__main__")
"""


@pytest.mark.slow
def test_a_ps_worker_never_holds_the_table(tmp_path: Path) -> None:
    # 6M rows x 64 fp32 = 1.5 GB on the shard; the worker's peak memory stays well
    # under it (it held two such tables at its peak before: the layer and a copy).
    rows, table_kb = 6_000_000, 6_000_000 * 64 * 4 // 1024
    shard = subprocess.Popen(
        [sys.executable, "-m", "psar.worker.cli", "server", "--bind", "127.0.0.1:0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        line = ""
        while "listening on" not in line:
            line = shard.stdout.readline()
            assert line, "the shard exited before listening"
        addr = line.split("listening on ")[1].split()[0]
        # Keep reading its output, so a chatty shard never blocks on a full pipe.
        threading.Thread(target=shard.stdout.read, daemon=True).start()
        p = subprocess.run(
            [sys.executable, "-c", _PEAK, "train", "--arch", "ps", "--servers", addr,
             "--workload", "recsys", "--workload-option", f"rows={rows},1000",
             "--workload-option", "samples=2048", "--workload-option", "val_samples=0",
             "--batch-size", "256", "--steps", "3", "--eval-batches", "0", "--log-every", "0",
             "--run-dir", str(tmp_path), "--torch-threads", "1"],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        shard.terminate()
        shard.wait(30)
    assert p.returncode == 0, p.stderr[-3000:]
    peak_kb = int(p.stderr.split("MAXRSS_KB")[-1].split()[0])
    assert peak_kb < table_kb / 2, f"worker peak {peak_kb} kB above imports, {table_kb} kB table"
