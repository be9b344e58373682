"""The loopback grid (`python -m bench.links --grid loopback`): ps-sync samples/s against
workers (1, 2, 4, 8) and shards (1, 2, 4), every process on this host.

Compute is emulated (`--emulate-compute-ms T`, default 100 ms) on a model big enough that
communication matters (MLP 784-1024-1024-10: 1.86M parameters, 7.45 MB of fp32 gradient
pushed and 7.45 MB of weights pulled by every worker every step) and a small batch (16)
so the real compute stays well under T. Ideal linear scaling from one worker is N x (the
1-worker rate with the same shards); the ratio to it shows where a shard's link (here:
its process and the machine's CPUs, all on loopback) becomes the bottleneck: with S
shards each carries N x 7.45 MB in and out per step. The emulated grids of bench/links.py
give each shard a NIC of its own instead.

samples/s = total samples over the window in which every worker trains, after the
warm-up steps (`median_samples_per_sec`: each worker's samples per step / its median step
time, added up, the figure before 2026-12).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.lib import common as c

MODEL = "mlp 784-1024-1024-10 (1,863,690 params, 7.45 MB fp32)"


def measure(out: Path, *, workers: list[int], shards: list[int], compute_ms: float, batch: int,
            steps: int, timeout: float) -> dict[str, Any]:  # fmt: skip
    train = [*c.REF_WORKLOAD, "--batch-size", str(batch), "--torch-threads", "1",
             "--precision", "fp32", "--log-every", "0", "--eval-batches", "0",
             "--emulate-compute-ms", str(compute_ms), "--steps", str(steps)]  # fmt: skip
    rows = []
    base: dict[int, float] = {}
    for s in shards:
        for n in workers:
            c.log(f"scaling: {n} workers, {s} shards")
            run = c.ps_job(out / f"w{n}-s{s}", workers=n, shards=s, mode="sync", train=train,
                           timeout=timeout)  # fmt: skip
            rate = c.steady_rate(run)[0]
            base.setdefault(s, rate / n)  # the first (smallest) worker count is the base
            rows.append({
                "workers": n,
                "shards": s,
                "samples_per_sec": rate,
                "median_samples_per_sec": c.robust_rate(run),
                "step_ms": 1e3 * c.job_step_seconds(run),
                "ratio_to_linear": rate / (n * base[s]),
                "ratio_to_compute_bound": rate / (n * batch / (compute_ms / 1e3)),
            })  # fmt: skip
    return {"compute_ms": compute_ms, "batch_size": batch, "steps": steps, "model": MODEL,
            "base_workers": min(workers), "results": rows}  # fmt: skip


def table(doc: dict[str, Any]) -> str:
    head = ["shards", "workers", "samples/s", "step ms", "x linear from 1 worker",
            "x compute-bound ideal"]  # fmt: skip
    rows = [[r["shards"], r["workers"], r["samples_per_sec"], r["step_ms"], r["ratio_to_linear"],
             r["ratio_to_compute_bound"]] for r in doc["results"]]  # fmt: skip
    return (
        "## Scaling on loopback (ps sync)\n\n" + c.md_table(head, rows) + f"\n\n{doc['model']}, "
        f"batch {doc['batch_size']}/worker, emulated compute {doc['compute_ms']:g} ms/step, "
        f"{doc['steps']} steps; samples/s over the window every worker trains in. x linear: "
        f"samples/s / (workers x the {doc['base_workers']}-worker rate with the same shards); "
        "x compute-bound ideal: / (workers x batch / compute time)."
    )


def write_plot(out: Path, doc: dict[str, Any]) -> None:
    lines = {}
    for s in sorted({r["shards"] for r in doc["results"]}):
        rs = [r for r in doc["results"] if r["shards"] == s]
        lines[f"{s} shard(s)"] = ([r["workers"] for r in rs], [r["samples_per_sec"] for r in rs])
    rs = [r for r in doc["results"] if r["shards"] == min(r["shards"] for r in doc["results"])]
    n0 = min(r["workers"] for r in rs)
    r0 = next(r["samples_per_sec"] for r in rs if r["workers"] == n0)
    lines["linear from 1 worker, 1 shard"] = ([r["workers"] for r in rs],
                                               [r0 * r["workers"] / n0 for r in rs])  # fmt: skip
    c.plot(out / "scaling.png", lines, xlabel="workers", ylabel="samples/s",
           title="ps sync scaling on loopback (emulated compute)")  # fmt: skip
