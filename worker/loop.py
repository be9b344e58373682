"""The one training loop. It never asks which architecture it runs on.

Read top to bottom: build the workload (same seed everywhere), hand the model to the
backend, then per step: micro-batches forward/backward under autocast, the backend
combines gradients and updates weights, and the step is logged.

`backend_class` is the only code here that reads --arch: everything after it (ranks,
metrics label, report fields, who writes the report) comes from the backend, through
the members trainkit/backend.py declares (tests/test_backend_protocol.py checks both).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from psar.trainkit.backend import Backend, BackendContext, StepOutcome, describe
from psar.trainkit.config import TrainConfig
from psar.trainkit.precision import PrecisionPolicy, pick_device, resolve
from psar.trainkit.recorder import NullWorkerRecorder, WorkerRecorder
from psar.trainkit.roles import resolve_local_rank, resolve_rank, resolve_world_size
from psar.trainkit.seeding import seed_process
from psar.trainkit.writable import check_file_writable, check_folder_writable
from psar.worker.data import ElasticBatches, ShardedBatches
from psar.worker.progress import Progress
from psar.worker.records import StepLog, run_summary, write_report
from psar.worker.validation import validate
from psar.worker.workloads import Workload, load_workload

logger = logging.getLogger("psar.train")


def backend_class(cfg: TrainConfig) -> type[Backend]:
    """The Backend class for --arch: the one place the architecture is looked at.

    Imported here, lazily, so a DDP run never loads the parameter-server client (ps/client)
    and a PS run never loads torch.distributed's DDP (allreduce/)."""
    if cfg.arch == "ps":
        from psar.ps.client.backend import PSBackend

        return PSBackend
    if cfg.arch == "hybrid":  # tables on the shards, dense layers allreduced
        from psar.worker.hybrid import HybridBackend

        return HybridBackend
    from psar.allreduce.backend import DDPBackend

    return DDPBackend


def make_backend(ctx: BackendContext) -> Backend:
    """One worker's backend, built the same way whichever the architecture."""
    return backend_class(ctx.cfg).from_config(ctx)


def resolve_ranks(cfg: TrainConfig, env: dict[str, str]) -> tuple[int, int, int]:
    """(rank, world_size, local_rank): the backend's flags first, then the launcher's
    environment (torchrun, Slurm, Kubernetes; see trainkit/roles.py). A worker joining a
    running elastic job takes its rank from --rank only, else -1: shard 0 gives it one
    (the launcher's rank variables number its own processes, e.g. srun's SLURM_PROCID
    starts at 0 again in a step started into a running job)."""
    info = backend_class(cfg).describe(cfg)
    flag_rank, flag_world = info.flag_rank, info.flag_world_size
    world = resolve_world_size(flag_world, env)
    if cfg.ps.join and cfg.elastic:
        return flag_rank, world, resolve_local_rank(env)
    rank = resolve_rank(flag_rank, env)
    if not 0 <= rank < world:
        raise ValueError(f"--rank {rank} must be in [0, --world-size {world})")
    return rank, world, resolve_local_rank(env)


@dataclass
class _Run:
    """One worker's part of a job, as built before its first step."""

    cfg: TrainConfig
    rank: int
    world: int
    total: int
    """Last step of the run (a resumed worker starts after backend.ctx.start_step)."""
    device: torch.device
    precision: PrecisionPolicy
    metrics: WorkerRecorder
    workload: Workload
    batches: ShardedBatches | ElasticBatches
    """Batch i: the rank's own shard's (by step), or batch id i where the shards deal them."""
    backend: Backend


@dataclass
class _Tally:
    """What the steps accumulate for the summary."""

    losses: list[float] = field(default_factory=list)
    outcomes: list[StepOutcome] = field(default_factory=list)
    samples: int = 0
    last_backward: float = 0.0
    """Seconds of the previous step's last backward (stands in for this step's)."""
    last_step: int = 0
    """The last step taken (an elastic job's length is the data's, not --steps)."""


def train(cfg: TrainConfig, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one worker's part of a job; returns the summary (also written to --report)."""
    with _graceful_stop(cfg.elastic) as stop:
        run = _prepare(cfg, dict(os.environ if env is None else env))
        backend = run.backend
        info = describe(backend)
        logger.info(
            "rank %s/%d: %s (%s), %s, %d steps; setting up",
            run.rank if run.rank >= 0 else "(given by shard 0)",
            run.world,
            info.arch,
            info.mode,
            cfg.workload,
            run.total,
        )
        module = backend.setup(run.workload.model)
        run.rank, run.world = backend.ctx.rank, backend.ctx.world_size  # a joiner learns them
        if backend.dealer is None:  # an elastic PS worker records it with every pull
            run.metrics.set_world_size(run.world)
        module.train()
        # Dropout and other draws during training: the same in every run of this job, and
        # the same for rank r under either architecture (trainkit/seeding.py).
        seed_process(cfg.seed, run.rank)
        tally, wall = _run_steps(run, module, stop)
        summary = _finish(run, tally, wall, stopped=stop.requested)
    if cfg.metrics_port and cfg.metrics_linger_s:
        time.sleep(cfg.metrics_linger_s)  # a last scrape sees the final counts
    return summary


def check_outputs(cfg: TrainConfig, rank: int) -> None:
    """The files this rank writes at the end (--save on rank 0, or in an elastic job on
    whichever worker the shards name at its end; --report on the ranks that write one) and
    --run-dir can be written: checked at start and by --dry-run."""
    if cfg.run_dir:  # first: made here, it may be the folder --report writes into
        check_folder_writable(cfg.run_dir, "--run-dir")
    if cfg.save and (rank <= 0 or cfg.elastic):
        check_file_writable(cfg.save, "--save")
    if cfg.report and "{rank}" in cfg.report:
        check_file_writable(cfg.report.replace("{rank}", str(max(rank, 0))), "--report")
    elif cfg.report and rank <= 0:
        check_file_writable(cfg.report, "--report")


def _prepare(cfg: TrainConfig, env: dict[str, str]) -> _Run:
    """Ranks, device, precision, metrics, workload, data shard and backend."""
    rank, world, local_rank = resolve_ranks(cfg, env)
    check_outputs(cfg, rank)  # before any step: a path that cannot be written loses nothing
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = pick_device(cfg.device, local_rank)
    # --mode local steps the worker's own weights with its inner optimizer: fp32 there.
    weights = "fp32" if cfg.local_sgd and cfg.worker_weights == "auto" else cfg.worker_weights
    precision = resolve(device, cfg.precision, cfg.wire_dtype, weights)
    # The metrics exist before the backend (a PS backend records its transport in them),
    # so their arch label comes from the backend's class.
    metrics = _metrics(cfg, backend_class(cfg).describe(cfg).arch, local_rank)
    # Sparse tables stay unbuilt: the backend's setup builds them (DDP) or never does (PS).
    workload = load_workload(cfg.workload, cfg.seed, cfg.workload_options(), materialize=False)
    if cfg.elastic:
        batches, total, data = _elastic_data(cfg, workload, world)
    else:
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
    ctx = BackendContext(
        cfg,
        precision,
        rank,
        world,
        total,
        metrics=metrics,
        find_unused_parameters=workload.find_unused_parameters,
    )
    backend = make_backend(ctx)
    if backend.dealer is not None:
        backend.dealer.plan_data(*data)
    return _Run(cfg, rank, world, total, device, precision, metrics, workload, batches, backend)


def _elastic_data(
    cfg: TrainConfig, workload: Workload, world: int
) -> tuple[ElasticBatches, int, tuple[int, str]]:
    """An elastic job's data (docs/elastic.md): batches by id, the steps the job takes at
    its starting size (its schedule's length), and (batch ids, what they mean) for the
    shards. --steps N: the ids N steps of --world-size workers train on; --epochs E: E
    epochs' worth, every sample once per epoch."""
    batches = ElasticBatches(workload.train_dataset, batch_size=cfg.batch_size, seed=cfg.seed)
    if cfg.epochs:
        ids = int(cfg.epochs * batches.batches_per_epoch())
    else:
        ids = cfg.steps * world * cfg.grad_accum
    # Dealt a push's worth at a time: --grad-accum micro-batches, times H inner steps
    # with --mode local. Whole deals only, so every step has all its micro-batches.
    per_push = cfg.grad_accum * max(1, cfg.local.sync_every)
    ids = max(per_push, ids // per_push * per_push)
    total = max(1, math.ceil(ids / (world * cfg.grad_accum)))
    options = " ".join(cfg.workload_option)
    stream = (
        f"{cfg.workload}{' ' + options if options else ''}: {batches.batches_per_epoch()} "
        f"batches of {cfg.batch_size} per epoch, seed {cfg.seed}"
    )
    return batches, total, (ids, stream)


class _Stop:
    requested = False
    """SIGTERM came: leave the job after the step in flight."""


@contextlib.contextmanager
def _graceful_stop(enabled: bool) -> Iterator[_Stop]:
    """Where the shards deal the data (an elastic job), SIGTERM -- a preemption notice, a
    scale-down, scancel -- makes the worker leave after the step in flight: its gradient
    counts, its next batches go to the others, and it exits 0. A second SIGTERM is the
    handler's before ours (psar train: stop now)."""
    stop = _Stop()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield stop
        return
    before = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        if stop.requested and callable(before):
            before(signum, frame)
            return
        stop.requested = True
        logger.warning("SIGTERM: leaving the job after the step in flight")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, before)


def _steps(run: _Run, stop: _Stop) -> Iterator[tuple[int, list[int]]]:
    """(step, the batch indices of its micro-batches): the rank's own shard's up to the run's
    last step, or the ids the shards deal until the data is done or a SIGTERM came."""
    backend, accum = run.backend, run.cfg.grad_accum
    dealer = backend.dealer
    if dealer is None:
        # A relaunched worker resumes where its checkpoint/shards say (docs/reliability.md).
        for step in range(backend.ctx.start_step + 1, run.total + 1):
            yield step, [(step - 1) * accum + micro for micro in range(accum)]
        return
    step = backend.ctx.start_step
    while (ids := dealer.next_batches(stop=stop.requested)) is not None:
        step += 1
        yield step, ids


def _run_steps(run: _Run, module: torch.nn.Module, stop: _Stop) -> tuple[_Tally, float]:
    """Every step of the run; returns the tally and the wall seconds they took."""
    cfg, backend = run.cfg, run.backend
    log = StepLog(cfg.run_dir, backend, run.rank)
    progress = Progress(run.total, enabled=run.rank == 0 and cfg.log_every > 0, every=cfg.log_every)
    tally = _Tally()
    start = time.perf_counter()
    with contextlib.closing(log), _aborting(backend):
        for step, batch_ids in _steps(run, stop):
            step_loss, phases = _forward_backward(run, module, step, batch_ids, tally)
            outcome = backend.step()
            phases.update(outcome.phases)
            tally.losses.append(step_loss)
            tally.outcomes.append(outcome)
            _observe(run, step_loss, outcome, phases)
            elapsed = time.perf_counter() - start
            dealt = batch_ids if backend.dealer is not None else None
            log.write(step, elapsed, step_loss, tally.samples, outcome, phases, dealt)
            progress.update(step, tally.samples / max(elapsed, 1e-9), step_loss, outcome)
            tally.last_step = step
    wall = time.perf_counter() - start
    progress.close()
    return tally, wall


def _forward_backward(
    run: _Run, module: torch.nn.Module, step: int, batch_ids: list[int], tally: _Tally
) -> tuple[float, Counter[str]]:
    """This step's micro-batches, forward and backward; returns (loss, phase seconds)."""
    cfg, backend, workload = run.cfg, run.backend, run.workload
    workload.model.zero_grad(set_to_none=True)
    phases: Counter[str] = Counter()
    step_loss = 0.0
    n = len(batch_ids)  # --grad-accum; an elastic job's last step may have fewer
    for micro, index in enumerate(batch_ids):
        t0 = time.perf_counter()
        x, y = run.batches.batch(index)
        x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
        t1 = time.perf_counter()
        last = micro == n - 1
        with contextlib.nullcontext() if last else backend.no_sync():
            with run.precision.autocast():
                loss = workload.loss_fn(module(x), y)
            step_loss += loss.item() / n
            if step == cfg.inject_overflow_step and run.rank == 0:
                loss = loss * float("inf")  # testing aid: a guaranteed overflow
            t2 = time.perf_counter()
            phases.update({"data": t1 - t0, "forward": t2 - t1})
            if last:
                # Pad before the last backward: under DDP that backward carries the
                # allreduce, which padding after it would hide. This step's backward
                # is not known yet, so the previous step's stands in for it.
                compute = phases["forward"] + phases["backward"] + tally.last_backward
                pad = _compute_padding(cfg, compute)
                if pad > 0:
                    time.sleep(pad)
                    phases["straggle"] = pad
                t2 = time.perf_counter()
            backend.scale_loss(loss / n).backward()
        t3 = time.perf_counter()
        phases["backward"] += t3 - t2
        tally.last_backward = t3 - t2
        tally.samples += len(x)
    return step_loss, phases


def _compute_padding(cfg: TrainConfig, compute: float) -> float:
    """Seconds to sleep after this step's real compute.

    --slowdown F makes a straggler honestly: its compute takes F times as long as it
    measured. --emulate-compute-ms T fixes each step's compute at T ms (times F), so a
    benchmark can host many workers on few cores with a known compute time.
    """
    if cfg.emulate_compute_ms:
        return max(0.0, cfg.emulate_compute_ms / 1000.0 * cfg.slowdown - compute)
    return (cfg.slowdown - 1.0) * compute


def _observe(run: _Run, step_loss: float, outcome: StepOutcome, phases: dict[str, float]) -> None:
    """One finished step into the Prometheus series (docs/metrics.md)."""
    metrics, cfg = run.metrics, run.cfg
    for name, secs in phases.items():
        metrics.phase(name, secs)
    metrics.step_done(cfg.batch_size * cfg.grad_accum)
    metrics.set_loss(step_loss)
    metrics.set_loss_scale(outcome.loss_scale)
    if outcome.skipped:
        metrics.overflow_step()
    if outcome.staleness is not None:
        metrics.observed_staleness(outcome.staleness)
    if outcome.outer_round:
        metrics.outer_round(outcome.round_bytes, outcome.drift)
    if outcome.cache_lookups:
        metrics.hot_rows(outcome.cache_lookups, outcome.cache_hits, outcome.cache_bytes_saved)


def _finish(run: _Run, tally: _Tally, wall: float, *, stopped: bool = False) -> dict[str, Any]:
    """Validate, summarise, save, leave the job and write the report. `stopped`: a SIGTERM
    made it leave an elastic job early (no validation: it is being taken away)."""
    cfg, backend, rank, workload = run.cfg, run.backend, run.rank, run.workload
    if backend.dealer is not None:
        run.total = tally.last_step
    # Validation first (it may take a while): val_loss, and the workload's extra metrics
    # (recsys: val_logloss, val_auc) where it has a val_metrics hook.
    val = validate(workload, cfg.batch_size, run.precision.autocast,
                   0 if stopped else cfg.eval_batches)  # fmt: skip
    summary = run_summary(
        cfg,
        backend,
        world=run.world,
        total=run.total,
        samples=tally.samples,
        wall=wall,
        losses=tally.losses,
        outcomes=tally.outcomes,
    )
    summary.update(val)  # val_loss, val_loss_unit (and the hook's metrics), in that order
    summary["rank"] = rank
    if backend.dealer is not None:
        summary["stopped"] = stopped  # left on SIGTERM (else: the job's data was done)
    # The bytes already stand in the summary (same values): shards and extras follow.
    summary.update(backend.report(final=True))
    # An elastic job's model is written by the worker the shards name (rank 0 may have
    # left or died long before the job's last step: issue #45 defect 7).
    writes = backend.dealer.writes_model if backend.dealer is not None else rank == 0
    if cfg.save and writes:
        _save_model(backend.state_dict(), cfg.save)
        logger.info("rank %d: wrote the job's final model to %s", rank, cfg.save)
    if backend.dealer is not None:
        summary["saved_model"] = cfg.save if cfg.save and writes else None
    summary["workers_took_part"] = _took_part(summary, run.world)
    _say_who_took_part(summary, run.world, elastic=backend.dealer is not None)
    backend.finish()
    if cfg.report and (describe(backend).per_rank or rank == 0):
        write_report(cfg.report, rank, summary)
    return summary


def _took_part(summary: dict[str, Any], world: int) -> int | None:
    """How many workers pushed into the job: the shards count them where there are
    shards (rank 0 and an elastic job's model writer have their Stats; other ranks None);
    without shards (allreduce) every rank took part in every step's collective."""
    if "shards" not in summary:
        return world
    shards = summary["shards"]
    return shards[0].get("workers_took_part") if shards else None


def _say_who_took_part(summary: dict[str, Any], world: int, *, elastic: bool) -> None:
    """The summary's line: how many workers took part. A fixed job that trained with
    fewer than its --world-size (one never came, or died early) says so as a warning."""
    took = summary["workers_took_part"]
    if took is None:
        return
    rank = summary["rank"]
    if not elastic and took < world:
        logger.warning("rank %d: only %d of %d workers took part in the job (the others never "
                       "pushed: not started, or gone before their first step)", rank, took,
                       world)  # fmt: skip
    elif elastic:  # workers came and went: each that pushed counts
        logger.info("rank %d: %d workers took part (the job started with %d)", rank, took, world)
    else:
        logger.info("rank %d: %d of %d workers took part", rank, took, world)


def _save_model(state: dict[str, Any], path: str) -> None:
    """torch.save through a temporary file and a rename: a reader (or a second writer of
    an elastic job's model) never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


@contextlib.contextmanager
def _aborting(backend: Backend) -> Iterator[None]:
    """On any error in the steps, let the backend release its waiting threads first, so
    the process exits with the error instead of hanging at interpreter exit."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            backend.finish(failed=True)
        raise


def _metrics(cfg: TrainConfig, arch: str, local_rank: int) -> WorkerRecorder:
    if not cfg.metrics_port:
        return NullWorkerRecorder()
    from psar.worker.metrics import WorkerMetrics, serve_metrics

    m = WorkerMetrics(arch=arch)
    port = cfg.metrics_port + local_rank
    serve_metrics(m.registry, port, cfg.metrics_addr)
    return m
