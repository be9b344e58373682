"""`psar plan --table-rows` beside each bench/sparse.py cell (docs/cost-model.md, "Sparse
tables"), as bench/lib/grid.py sets `psar plan` beside each crossover cell.

The cell as the plan sees it: the workers and shards of the run on this machine's cores,
all shared (`--cpu-cores os.cpu_count() --cpu-shared`), the recsys model's dense
parameters, its tables, batch, bag and Zipf exponent, fp32 on the wire, SGD, and W, one
DDP-sparse rank's CPU per step in a ring of one (measured: bench/lib/cpucost.py
`worker_cpu_seconds`, or given). Links are loopback, far faster than the cores
(10 GB/s, 30 us: any such value gives the same verdict). Recorded: the plan's samples/s of
every design, its ratios to DDP-sparse, its pick among the designs the run measured, and
whether that pick is the measured fastest (`pick_right`).
"""

from __future__ import annotations

import os
from typing import Any

from psar.worker.plan_sparse import SparseInputs, plan_sparse
from psar.worker.plan_types import PlanInputs

#: bench/sparse.py's ways, by the plan's names for them.
WAYS = {"ps_sparse": "ps", "hybrid": "hybrid", "allreduce_sparse": "allreduce_sparse",
        "allreduce_dense": "allreduce_dense"}  # fmt: skip


def dense_params(options: dict[str, str]) -> int:
    """The recsys model's parameters outside its tables (built on the meta device)."""
    from psar.worker.workloads import load_workload

    model = load_workload("recsys", 0, options, materialize=False).model
    tables = {id(p) for m in model.modules() if getattr(m, "psar_sparse_table", False)
              for p in m.parameters()}  # fmt: skip
    return sum(p.numel() for p in model.parameters() if id(p) not in tables)


def plan_cell(out: dict[str, Any], options: dict[str, str], worker_cpu_s: float,
              cores: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The plan of one bench/sparse.py result `out` and how it compares."""
    inp = PlanInputs(
        params=dense_params(options), workers=out["workers"], servers=out["shards"],
        bandwidth_bytes_per_second=10e9, latency_seconds=30e-6, wire_dtype="fp32",
        optimizer="sgd", compute_seconds=0.0, cpu_cores=cores or os.cpu_count() or 1,
        cpu_shared=True, worker_cpu_seconds=worker_cpu_s,
    )  # fmt: skip
    sp = SparseInputs(
        table_rows=tuple(out["rows"]), dim=out["dim"], bag=out["bag"],
        batch=out["batch_per_worker"], zipf=float(options.get("zipf", 1.05)),
        sparse_wire_dtype="fp32",
    )  # fmt: skip
    archs = plan_sparse(inp, sp)
    samples = out["workers"] * out["batch_per_worker"]
    rate = {way: samples / archs[name].score for way, name in WAYS.items()}
    measured = {w: out[w]["samples_per_sec"] for w in WAYS if "samples_per_sec" in out.get(w, {})}
    ran = [w for w in measured if archs[WAYS[w]].fits]
    pick = min(ran, key=lambda w: archs[WAYS[w]].score) if ran else None
    doc: dict[str, Any] = {
        "worker_cpu_ms": 1e3 * worker_cpu_s,
        "dense_params": inp.params,
        "touched_rows_per_worker": sp.touched(inp.workers)[0],
        "samples_per_sec": rate,
        "pick_among_measured": pick,
        "measured_fastest": max(measured, key=measured.__getitem__) if measured else None,
    }
    doc["pick_right"] = pick is not None and pick == doc["measured_fastest"]
    base = "allreduce_sparse"
    doc["vs_allreduce_sparse"] = {
        w: {"plan": rate[w] / rate[base],
            "measured": measured[w] / measured[base] if w in measured and base in measured else None}
        for w in WAYS if w != base
    }  # fmt: skip
    return doc


def cell_options(result: dict[str, Any]) -> dict[str, str]:
    """The recsys options of a bench/sparse.py result: its tables, dim, bag and extras."""
    rows = ",".join(str(r) for r in result["rows"])
    extra = dict(o.split("=", 1) for o in result.get("options", []))
    return {"rows": rows, "dim": str(result["dim"]), "bag": str(result["bag"]), **extra}


def measure_worker_cpu(result: dict[str, Any], out_dir: Any) -> float:
    """W: one DDP-sparse rank's CPU-seconds per step of the cell in a ring of one
    (bench/lib/cpucost.py: two run lengths differenced), bench/sparse.py's flags."""
    from bench.lib.cpucost import worker_cpu_seconds

    opts = {**cell_options(result), "samples": "1000000", "val_samples": "0", "sparse": "true"}
    train = [*(a for k, v in opts.items() for a in ("--workload-option", f"{k}={v}")),
             "--workload", "recsys", "--batch-size", str(result["batch_per_worker"]),
             "--precision", "fp32", "--lr", "0.05", "--momentum", "0", "--eval-batches", "0",
             "--log-every", "0", "--torch-threads", "1", "--wire-dtype", "fp32",
             "--optimizer-impl", "loop"]  # fmt: skip
    return worker_cpu_seconds(out_dir, train)
