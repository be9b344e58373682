"""What one worker's run leaves behind: the per-step JSON lines (--run-dir) and the
summary (--report). Both are contracts read by `psar report`, `psar compare`, the
benchmarks and the tests (worker/report.py describes the fields): keys stay put.

Every architecture-specific figure comes from the backend (its arch, mode, bytes, shard
figures, report extras), never from the configuration, so this file works for any
backend that satisfies trainkit/backend.py's protocol.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from typing import Any

from psar.trainkit.backend import Backend, StepOutcome, describe
from psar.trainkit.config import TrainConfig
from psar.worker.final_loss import final_loss


def staleness_summary(values: list[int]) -> dict[str, Any]:
    """p50/p99/max and a histogram {staleness: count} of applied gradients."""
    if not values:
        return {"p50": None, "p99": None, "max": None, "histogram": {}}
    ordered = sorted(values)

    def pct(q: float) -> int:
        return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]

    hist = Counter(ordered)
    return {
        "p50": pct(0.50),
        "p99": pct(0.99),
        "max": ordered[-1],
        "histogram": {str(k): hist[k] for k in sorted(hist)},
    }


def run_summary(
    cfg: TrainConfig,
    backend: Backend,
    *,
    world: int,
    total: int,
    samples: int,
    wall: float,
    losses: list[float],
    outcomes: list[StepOutcome],
) -> dict[str, Any]:
    """The report's training figures, in the order the report has always listed them
    (the loop appends validation, rank, shards and the backend's extras)."""
    info = describe(backend)
    summary: dict[str, Any] = {
        "arch": info.arch,
        "mode": info.mode,
        "world_size": world,
        "workload": cfg.workload,
        "precision": backend.ctx.precision.name,
        "wire_dtype": str(backend.ctx.precision.wire).replace("torch.", ""),
        "steps": total,
        "batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum,
        "samples": samples,
        "samples_per_sec": samples / wall if wall > 0 else 0.0,
        "global_samples_per_sec": world * samples / wall if wall > 0 else 0.0,
        "wall_seconds": wall,
        "losses": losses,
        "final_train_loss": final_loss(losses),
        "skipped_steps": sum(o.skipped for o in outcomes),
        "final_loss_scale": outcomes[-1].loss_scale if outcomes else None,
        **backend.report(),
    }
    if info.staleness:
        # Skipped steps applied nothing, so their staleness describes no update.
        stale = [o.staleness for o in outcomes if o.staleness is not None and not o.skipped]
        summary["staleness"] = staleness_summary(stale)
    return summary


def _wire_bytes(backend: Backend) -> dict[str, int]:
    """The step log's byte counts: on and off the wire, and `bytes`, their sum (the same
    count under both architectures: docs/metrics.md)."""
    b = backend.report()
    sent, received = b.get("bytes_sent", 0), b.get("bytes_received", 0)
    return {"bytes": sent + received, "bytes_sent": sent, "bytes_received": received}


def write_report(path_template: str, rank: int, summary: dict[str, Any]) -> None:
    """--report: '{rank}' in the path becomes this worker's rank."""
    with open(path_template.replace("{rank}", str(rank)), "w") as fh:
        json.dump(summary, fh, indent=2)


class StepLog:
    """--run-dir: one JSON line per step of this process (a no-op without --run-dir)."""

    def __init__(self, run_dir: str, backend: Backend, rank: int) -> None:
        self.fh = None
        info = describe(backend)
        self.arch, self.mode, self.rank = info.arch, info.mode, rank
        self.backend = backend
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            path = os.path.join(run_dir, f"steps-{self.arch}-rank{rank}.jsonl")
            self.fh = open(path, "w", buffering=1)  # noqa: SIM115 - closed in close()

    def write(
        self,
        step: int,
        t: float,
        loss: float,
        samples: int,
        o: StepOutcome,
        phases: dict[str, float],
        batches: list[int] | None = None,
    ) -> None:
        """One step's line; `batches`: the batch ids it trained on where the shards deal
        the data (elastic jobs, docs/elastic.md)."""
        if self.fh is None:
            return
        rec = {
            "step": step,
            "time": t,
            "loss": loss,
            "samples": samples,
            "loss_scale": o.loss_scale,
            **_wire_bytes(self.backend),
            "staleness": o.staleness,
            "skipped": o.skipped,
            "rank": self.rank,
            "arch": self.arch,
            "mode": self.mode,
            "wall": time.time(),
            "phases": {k: round(v, 6) for k, v in phases.items()},
        }
        if batches is not None:
            rec["batches"] = batches
        self.fh.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
