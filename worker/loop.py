"""The one training loop. It never asks which architecture it runs on.

Read top to bottom: build the workload (same seed everywhere), hand the model to the
backend, then per step: micro-batches forward/backward under autocast, the backend
combines gradients and updates weights, and the step is logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from trainkit.nullmetrics import NullMetrics
from trainkit.roles import resolve_local_rank, resolve_rank, resolve_world_size
from worker.backend import Backend, StepOutcome
from worker.config import TrainConfig
from worker.data import ShardedBatches, evaluate
from worker.precision import pick_device, resolve
from worker.progress import Progress
from worker.workloads import load_workload

logger = logging.getLogger("psar.train")


def make_backend(cfg: TrainConfig, **kwargs: Any) -> Backend:
    """The backend for cfg.arch; the only place the architecture is looked at."""
    if cfg.arch == "ps":
        from ps.client.backend import PSBackend

        kwargs.pop("find_unused_parameters", None)
        return PSBackend(cfg, **kwargs)
    from allreduce.backend import DDPBackend

    kwargs.pop("metrics", None)
    return DDPBackend(cfg, **kwargs)


def resolve_ranks(cfg: TrainConfig, env: dict[str, str]) -> tuple[int, int, int]:
    """(rank, world_size, local_rank): flags first, then the launcher's environment
    (torchrun, Slurm, Kubernetes; see trainkit/roles.py)."""
    ps = cfg.arch == "ps"
    rank = resolve_rank(cfg.ps.rank if ps else -1, env)
    world = resolve_world_size(cfg.ps.world_size if ps else 0, env)
    if not 0 <= rank < world:
        raise ValueError(f"--rank {rank} must be in [0, --world-size {world})")
    return rank, world, resolve_local_rank(env)


def _compute_padding(cfg: TrainConfig, compute: float) -> float:
    """Seconds to sleep after this step's real compute.

    --slowdown F makes a straggler honestly: its compute takes F times as long as it
    measured. --emulate-compute-ms T fixes each step's compute at T ms (times F), so a
    benchmark can host many workers on few cores with a known compute time.
    """
    if cfg.emulate_compute_ms:
        return max(0.0, cfg.emulate_compute_ms / 1000.0 * cfg.slowdown - compute)
    return (cfg.slowdown - 1.0) * compute


def train(cfg: TrainConfig, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one worker's part of a job; returns the summary (also written to --report)."""
    env = dict(os.environ if env is None else env)
    rank, world, local_rank = resolve_ranks(cfg, env)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = pick_device(cfg.device, local_rank)
    precision = resolve(device, cfg.precision, cfg.wire_dtype, cfg.worker_weights)
    metrics = _metrics(cfg, local_rank)
    workload = load_workload(cfg.workload, cfg.seed, cfg.workload_options())
    batches = ShardedBatches(
        workload.train_dataset,
        batch_size=cfg.batch_size,
        rank=rank,
        world_size=world,
        seed=cfg.seed,
    )
    total = cfg.steps
    if cfg.epochs:
        total = max(1, math.ceil(cfg.epochs * batches.steps_per_epoch() / cfg.grad_accum))
    backend = make_backend(
        cfg,
        precision=precision,
        rank=rank,
        world_size=world,
        total_steps=total,
        metrics=metrics,
        find_unused_parameters=workload.find_unused_parameters,
    )
    model = workload.model
    logger.info(
        "rank %d/%d: %s (%s), %s, %d steps; setting up",
        rank,
        world,
        cfg.arch,
        backend.mode,
        cfg.workload,
        total,
    )
    module = backend.setup(model)
    module.train()
    log = _StepLog(cfg, backend, rank)
    progress = Progress(total, enabled=rank == 0 and cfg.log_every > 0, every=cfg.log_every)
    losses: list[float] = []
    outcomes: list[StepOutcome] = []
    samples = 0
    last_backward = 0.0
    start = time.perf_counter()
    with _aborting(backend):
        # A relaunched worker resumes where its checkpoint/shards say (docs/reliability.md).
        for step in range(getattr(backend, "start_step", 0) + 1, total + 1):
            model.zero_grad(set_to_none=True)
            phases: Counter[str] = Counter()
            step_loss = 0.0
            for micro in range(cfg.grad_accum):
                t0 = time.perf_counter()
                x, y = batches.batch((step - 1) * cfg.grad_accum + micro)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                t1 = time.perf_counter()
                last = micro == cfg.grad_accum - 1
                with contextlib.nullcontext() if last else backend.no_sync():
                    with precision.autocast():
                        loss = workload.loss_fn(module(x), y)
                    step_loss += loss.item() / cfg.grad_accum
                    if step == cfg.inject_overflow_step and rank == 0:
                        loss = loss * float("inf")  # testing aid: a guaranteed overflow
                    t2 = time.perf_counter()
                    phases.update({"data": t1 - t0, "forward": t2 - t1})
                    if last:
                        # Pad before the last backward: under DDP that backward carries the
                        # allreduce, which padding after it would hide. This step's backward
                        # is not known yet, so the previous step's stands in for it.
                        compute = phases["forward"] + phases["backward"] + last_backward
                        pad = _compute_padding(cfg, compute)
                        if pad > 0:
                            time.sleep(pad)
                            phases["straggle"] = pad
                        t2 = time.perf_counter()
                    backend.scale_loss(loss / cfg.grad_accum).backward()
                t3 = time.perf_counter()
                phases["backward"] += t3 - t2
                last_backward = t3 - t2
                samples += len(x)
            outcome = backend.step()
            phases.update(outcome.phases)
            losses.append(step_loss)
            outcomes.append(outcome)
            for name, secs in phases.items():
                metrics.phase(name, secs)
            metrics.step_done(cfg.batch_size * cfg.grad_accum)
            metrics.set_loss(step_loss)
            metrics.set_loss_scale(outcome.loss_scale)
            if outcome.skipped:
                metrics.overflow_step()
            if outcome.staleness is not None:
                metrics.observed_staleness(outcome.staleness)
            elapsed = time.perf_counter() - start
            log.write(step, elapsed, step_loss, samples, outcome, phases)
            progress.update(step, samples / max(elapsed, 1e-9), step_loss, outcome)
    wall = time.perf_counter() - start
    progress.close()
    val_loss = None
    if workload.val_dataset is not None and cfg.eval_batches:
        mean = evaluate(
            model,
            workload.val_dataset,
            workload.loss_fn,
            cfg.batch_size,
            precision.autocast,
            max_batches=cfg.eval_batches,
        )
        val_loss = workload.val_value(mean)
    summary = _summary(cfg, backend, precision.name, world, total, samples, wall, losses, outcomes)
    summary["val_loss"] = val_loss
    summary["val_loss_unit"] = workload.val_metric if workload.val_metric != "loss" else "nats"
    summary["rank"] = rank
    summary["shards"] = backend.shard_stats() if rank == 0 else []
    summary.update(backend.report_extras())
    if cfg.save and rank == 0:
        torch.save(backend.state_dict(), cfg.save)
    backend.finish()
    log.close()
    if cfg.report and (cfg.arch == "ps" or rank == 0):
        path = cfg.report.replace("{rank}", str(rank))
        with open(path, "w") as fh:
            json.dump(summary, fh, indent=2)
    if cfg.metrics_port and cfg.metrics_linger_s:
        time.sleep(cfg.metrics_linger_s)
    return summary


@contextlib.contextmanager
def _aborting(backend: Backend) -> Iterator[None]:
    """On any error in the steps, let the backend release its waiting threads first, so
    the process exits with the error instead of hanging at interpreter exit."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            backend.abort()
        raise


def _summary(
    cfg, backend, precision, world, total, samples, wall, losses, outcomes
) -> dict[str, Any]:  # noqa: ANN001
    stale = [o.staleness for o in outcomes if o.staleness is not None and not o.skipped]
    summary: dict[str, Any] = {
        "arch": cfg.arch,
        "mode": backend.mode,
        "world_size": world,
        "workload": cfg.workload,
        "precision": precision,
        "wire_dtype": str(backend.precision.wire).replace("torch.", ""),
        "steps": total,
        "batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum,
        "samples": samples,
        "samples_per_sec": samples / wall if wall > 0 else 0.0,
        "global_samples_per_sec": world * samples / wall if wall > 0 else 0.0,
        "wall_seconds": wall,
        "losses": losses,
        "final_train_loss": losses[-1] if losses else None,
        "skipped_steps": sum(o.skipped for o in outcomes),
        "final_loss_scale": outcomes[-1].loss_scale if outcomes else None,
        **backend.comm_bytes(),
    }
    if cfg.arch == "ps":
        summary["staleness"] = staleness_summary(stale)
    return summary


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


class _StepLog:
    """--run-dir: one JSON line per step of this process."""

    def __init__(self, cfg: TrainConfig, backend: Backend, rank: int) -> None:
        self.fh = None
        self.arch, self.mode, self.rank = cfg.arch, backend.mode, rank
        self.backend = backend
        if cfg.run_dir:
            os.makedirs(cfg.run_dir, exist_ok=True)
            path = os.path.join(cfg.run_dir, f"steps-{cfg.arch}-rank{rank}.jsonl")
            self.fh = open(path, "w", buffering=1)  # noqa: SIM115 - closed in close()

    def write(
        self, step: int, t: float, loss: float, samples: int, o: StepOutcome, phases: dict
    ) -> None:
        if self.fh is None:
            return
        rec = {
            "step": step,
            "time": t,
            "loss": loss,
            "samples": samples,
            "loss_scale": o.loss_scale,
            "bytes": sum(self.backend.comm_bytes().values()),
            "staleness": o.staleness,
            "skipped": o.skipped,
            "rank": self.rank,
            "arch": self.arch,
            "mode": self.mode,
            "wall": time.time(),
            "phases": {k: round(v, 6) for k, v in phases.items()},
        }
        self.fh.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


def _metrics(cfg: TrainConfig, local_rank: int) -> Any:
    if not cfg.metrics_port:
        return NullMetrics()
    from worker.metrics import WorkerMetrics, serve_metrics

    m = WorkerMetrics(arch=cfg.arch)
    port = cfg.metrics_port + local_rank
    serve_metrics(m.registry, port, cfg.metrics_addr)
    return m
