"""DDPBackend: the training loop's backend for ring-allreduce (PyTorch DDP).

Launched the way PyTorch users launch DDP: torchrun sets RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and LOCAL_RANK; the process group is NCCL on CUDA and gloo
on CPU unless --backend says otherwise. With a low-precision wire dtype DDP registers
the matching compression hook, so both architectures move the same bytes.

With --checkpoint-dir, rank 0 writes model, optimizer, GradScaler, LR schedule and step
every --checkpoint-every steps (atomically, ps/server/durability/checkpoints.py) and at the end; at start
every rank loads the newest one and the loop resumes after its step, so a job that
torchrun relaunches (--max-restarts) continues instead of starting over.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from psar.allreduce import process_group
from psar.allreduce.hooks import register_wire_dtype
from psar.trainkit.atomic import atomic_save
from psar.trainkit.backend import ArchInfo, BackendContext, OnContext, StepOutcome
from psar.trainkit.config import TrainConfig
from psar.trainkit.device_io import state_to_host
from psar.trainkit.finite import all_finite
from psar.trainkit.local_sgd import LocalSteps, outer_optimizer_config
from psar.trainkit.optim import (
    StepOptions,
    build_optimizer,
    build_scheduler,
    effective_loss_scale,
    optimizer_impl,
    with_run_length,
)
from psar.trainkit.sparse_tables import materialize_tables

log = logging.getLogger("psar.allreduce")
_NAME = re.compile(r"^ddp-(\d{12})\.pt$")
_KEEP = 3


def list_checkpoints(folder: str) -> list[tuple[int, Path]]:
    """(step, path) of the DDP checkpoints in `folder`, oldest first."""
    if not folder or not Path(folder).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(folder).iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def init_process_group(cfg: TrainConfig, device: torch.device) -> None:
    """Join torchrun's group: NCCL on a GPU, gloo on CPUs, unless --ddp-backend says."""
    backend = cfg.ddp.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    process_group.init_process_group(backend, cfg.ddp.pg_timeout_s)


class DDPBackend(OnContext):
    dealer = None  # each rank cuts its shard from its rank (torchrun --nnodes: restarts)

    @classmethod
    def describe(cls, cfg: TrainConfig) -> ArchInfo:
        """ddp, or --mode local's. Every rank applies the same gradient to the same weights,
        in lockstep: rank 0's report speaks for the job. No rank flags: torchrun's
        environment (RANK, WORLD_SIZE) is the only source (Backend)."""
        return ArchInfo(
            arch="allreduce",
            mode=cfg.ps.mode if cfg.local_sgd else "ddp",
            staleness=False,
            per_rank=False,
            collective_step=not cfg.local_sgd,
        )

    @classmethod
    def from_config(cls, ctx: BackendContext) -> DDPBackend:
        """The loop's one way to build a backend (Backend protocol). `ctx.metrics` is
        unused: DDP's traffic runs inside torch, and the loop's own series cover this
        worker."""
        return cls(ctx)

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        cfg = self.cfg = ctx.cfg
        self.total_steps = ctx.total_steps
        self.find_unused = ctx.find_unused_parameters or cfg.ddp.find_unused_parameters
        self.bytes_allreduced = 0
        self.loss_scale = 1.0
        self.steps_done = 0
        self.checkpoints_written = 0
        self._saved_step = -1
        self.local: LocalSteps | None = None
        """--mode local: the inner optimizer and anchor (trainkit/local_sgd.py)."""

    def setup(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.nn.Module:
        """`optimizer`: a user's own (worker/own_loop.py), stepped here as it is, its LR
        scheduler the user's; None: the one --optimizer configures, with its schedule."""
        if optimizer is not None and (self.cfg.local_sgd or self.cfg.ddp.checkpoint_dir):
            raise ValueError(
                "a loop of your own saves its own checkpoints and runs without --mode local: "
                "leave --checkpoint-dir and --mode local out"
            )
        init_process_group(self.cfg, self.device)
        materialize_tables(model)  # every rank holds whole sparse tables under DDP
        model.to(self.device)
        self.model = model
        if self.cfg.local_sgd:
            return self._setup_local(model)
        resume = self._load_newest()
        if resume is not None:
            model.load_state_dict(resume["model"])
        self.ddp = DDP(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.cfg.ddp.bucket_cap_mb,
            find_unused_parameters=self.find_unused,
        )
        wire = self.precision.wire
        register_wire_dtype(self.ddp, wire)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._step_bytes = sum(p.numel() for p in self.params) * wire.itemsize
        opt_cfg = with_run_length(self.cfg.optimizer, self.total_steps)
        self.optimizer = optimizer or build_optimizer(self.params, opt_cfg)
        self.scheduler = build_scheduler(self.optimizer, opt_cfg) if optimizer is None else None
        ls = effective_loss_scale(self.cfg.loss_scale, self.precision.loss_scaling)
        self.scaler = torch.amp.GradScaler(
            self.device.type,
            init_scale=ls.init_scale,
            growth_factor=ls.growth_factor,
            backoff_factor=ls.backoff_factor,
            growth_interval=ls.growth_interval,
            enabled=ls.enabled,
        )
        if resume is not None:
            self.optimizer.load_state_dict(resume["optimizer"])
            self.scheduler.load_state_dict(resume["scheduler"])
            self.scaler.load_state_dict(resume["scaler"])
            self.start_step = self.steps_done = self._saved_step = int(resume["step"])
            log.info("rank %d resumed from step %d", self.rank, self.start_step)
            self._rebase(int(resume.get("world", self.world_size)))
        self.loss_scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        return self.ddp

    def _setup_local(self, model: torch.nn.Module) -> torch.nn.Module:
        """--mode local: a plain module (no per-step gradient allreduce), the inner
        optimizer on every rank's own weights, and the outer optimizer every rank applies
        to the allreduced pseudo-gradients (the same step on the same numbers everywhere)."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        for t in model.state_dict().values():  # every rank starts from rank 0's weights
            if dist.is_initialized() and self.world_size > 1:
                dist.broadcast(t, src=0)
        ls = effective_loss_scale(self.cfg.loss_scale, self.precision.loss_scaling)
        self.local = LocalSteps(
            self.params,
            self.cfg.optimizer,
            sync_every=self.cfg.local.sync_every,
            total_steps=self.total_steps,
            loss_scale=ls,
            device=self.device,
        )
        self.optimizer, self.scheduler = self.local.optimizer, self.local.scheduler
        self.scaler = self.local.scaler
        lc = self.cfg.local
        outer = outer_optimizer_config(lc.outer_optimizer, lc.effective_lr(), lc.outer_momentum)
        self.outer = build_optimizer(self.params, outer)
        self._step_bytes = sum(p.numel() for p in self.params) * self.precision.wire.itemsize
        self.loss_scale = self.local.loss_scale
        return model

    def _local_step(self, local: LocalSteps) -> StepOutcome:
        """An inner step; every H steps also the outer round: allreduce the pseudo-
        gradients (in the wire dtype, divided by the world size first, as hooks.py does)
        and apply the outer optimizer from the anchor weights."""
        t0 = time.perf_counter()
        skipped = local.inner_step()
        self.loss_scale = local.loss_scale
        self.steps_done += 1
        t1 = time.perf_counter()
        if not local.due():
            return StepOutcome(skipped, self.loss_scale, phases={"optimizer": t1 - t0})
        pseudo, drift, _ = local.pseudo_gradients()
        flat = torch.cat([g.reshape(-1) for g in pseudo])
        wire = flat.div(self.world_size).to(self.precision.wire)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(wire)
        mean = wire.float()
        self.bytes_allreduced += self._step_bytes
        t2 = time.perf_counter()
        # A non-finite mean (some rank's weights went inf/nan) skips the round on every
        # rank alike: the shared weights stay those of the last sync (as the shards do).
        finite = all_finite([mean])
        local.restore_anchor()
        if finite:
            offset = 0
            for p in self.params:
                p.grad = mean[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self.outer.step()
            for p in self.params:
                p.grad = None
        local.rebase(self._step_bytes, drift, skipped=not finite)
        return StepOutcome(
            skipped=skipped or not finite,
            loss_scale=self.loss_scale,
            phases={"optimizer": t1 - t0 + time.perf_counter() - t2, "allreduce": t2 - t1},
            outer_round=True,
            round_bytes=self._step_bytes,
            drift=drift,
        )

    # ---- checkpoints ----------------------------------------------------------------

    def _load_newest(self) -> dict[str, Any] | None:
        """Every rank loads the newest checkpoint; all must agree on its step."""
        folder = self.cfg.ddp.checkpoint_dir
        if not folder:
            return None
        found = list_checkpoints(folder)
        snap = None
        if found:
            snap = torch.load(found[-1][1], map_location=self.device, weights_only=True)
        step = int(snap["step"]) if snap is not None else 0
        steps = [step]
        if dist.is_initialized() and self.world_size > 1:
            steps = [None] * self.world_size
            dist.all_gather_object(steps, step)
        if len(set(steps)) != 1:
            raise RuntimeError(
                f"--checkpoint-dir {folder}: ranks see different newest checkpoints (steps "
                f"{steps}); every rank must see the same folder (a shared file system)"
            )
        return snap

    def _rebase(self, saved_world: int) -> None:
        """A checkpoint written by a world of another size (torchrun --nnodes MIN:MAX
        restarted the job with more or fewer nodes): step s of a world of W trains batches
        s*W .. (s+1)*W-1 of the epoch's permutation (worker/data.py ShardedBatches), so
        this world continues at the step that reaches the same place, rounded down (a
        batch or two trained again rather than skipped). Rank 0 saves that step at once,
        and drops the checkpoints numbered past it (in the old world's steps), so the
        newest checkpoint is always in the current world's steps."""
        if saved_world == self.world_size:
            return
        old = self.start_step
        self.start_step = self.steps_done = old * saved_world // self.world_size
        log.info(
            "rank %d: the checkpoint of step %d is a world of %d's; this world of %d "
            "continues at its step %d, the same place in the data",
            self.rank, old, saved_world, self.world_size, self.start_step,
        )  # fmt: skip
        self._saved_step = -1
        self._save(prune=False)  # written before any is dropped: never none on disk
        self._saved_step = self.start_step
        if self.rank == 0:
            for step, path in list_checkpoints(self.cfg.ddp.checkpoint_dir):
                if step > self.start_step:
                    path.unlink(missing_ok=True)

    def _save(self, *, prune: bool = True) -> None:
        if self.rank != 0 or self.steps_done == self._saved_step:
            return
        folder = Path(self.cfg.ddp.checkpoint_dir)
        folder.mkdir(parents=True, exist_ok=True)
        snap = {
            "format": 1,
            "step": self.steps_done,
            "world": self.world_size,  # the steps' unit: a world of another size rebases
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }
        # Host copies: the file loads anywhere, and map_location puts it back on the device.
        atomic_save(state_to_host(snap), folder / f"ddp-{self.steps_done:012d}.pt")
        self._saved_step = self.steps_done
        self.checkpoints_written += 1
        for _, old in list_checkpoints(str(folder))[:-_KEEP] if prune else []:
            old.unlink(missing_ok=True)

    def no_sync(self):  # noqa: ANN201 - DDP's own context manager
        if self.local is not None:
            return contextlib.nullcontext()  # a plain module: nothing to hold back
        return self.ddp.no_sync()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def step(self, options: StepOptions | None = None) -> StepOutcome:
        # Gradients were allreduced during backward (DDP's bucket hooks), so every rank
        # sees the same gradients and reaches the same skip decision with no collective.
        # `options`: a loop of its own's (its optimizer's learning rates are its own).
        if self.local is not None:
            return self._local_step(self.local)
        t0 = time.perf_counter()
        self.bytes_allreduced += self._step_bytes
        clip = options.clip_norm if options is not None else self.cfg.clip_grad_norm
        grad_norm = self.clip(clip) if clip else None
        if self.scaler.is_enabled():
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.loss_scale = self.scaler.get_scale()
            skipped = self.loss_scale < before
        else:
            skipped = not all_finite(_values(p.grad) for p in self.params if p.grad is not None)
            if not skipped:
                self.optimizer.step()
        if not skipped and self.scheduler is not None:
            self.scheduler.step()
        self.steps_done += 1
        ckpt = self.cfg.ddp
        if ckpt.checkpoint_dir and self.steps_done % ckpt.checkpoint_every == 0:
            self._save()
        return StepOutcome(
            skipped=skipped,
            loss_scale=self.loss_scale,
            grad_norm=None if skipped else grad_norm,
            phases={"optimizer": time.perf_counter() - t0},
        )

    def clip(self, max_norm: float) -> float:
        """Clip the averaged gradient to `max_norm` (unscaled first, as GradScaler users
        do); returns its norm before clipping. Once per step: step() calls it."""
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        return float(norm)

    def report(self, *, final: bool = False) -> dict[str, Any]:
        """The bytes; `final`: no shards, then the fault figures and --mode local's
        rounds (Backend protocol)."""
        # A ring allreduce of M bytes over n ranks (reduce-scatter, then all-gather) sends
        # and receives 2(n-1)/n * M on every rank: what gloo's and NCCL's rings move
        # (tests/test_wire_bytes.py checks it against the ranks' interface counters).
        on_wire = ring_bytes(self.bytes_allreduced, self.world_size)
        out: dict[str, Any] = {
            "bytes_allreduced": self.bytes_allreduced,
            "bytes_sent": on_wire,
            "bytes_received": on_wire,
        }
        if not final:
            return out
        out["shards"] = []
        out.update(start_step=self.start_step, checkpoints_written=self.checkpoints_written,
                   optimizer_impl=optimizer_impl(self.optimizer))  # fmt: skip
        return {**out, **(self.local.report() if self.local is not None else {})}

    def state_dict(self) -> dict[str, Any]:
        return state_to_host(self.model.state_dict())  # --save: loads without a GPU

    def remote_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        return None  # every rank's optimizer holds its own state

    def finish(self, *, failed: bool = False, why: str = "") -> None:
        """`failed`: nothing of ours waits on a step: DDP's collectives belong to torch,
        which the process group timeout (--pg-timeout-s) ends. `why`: the own loop told
        the other ranks itself (allreduce/own_agree.py)."""
        if failed:
            return
        if self.cfg.ddp.checkpoint_dir:
            self._save()
        process_group.end_process_group()


def ring_bytes(payload: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) to ring-allreduce `payload` bytes."""
    if world_size < 2:
        return 0
    return payload * 2 * (world_size - 1) // world_size


def _values(grad: torch.Tensor) -> torch.Tensor:
    """The stored values of a gradient (sparse ones: nn.Embedding(sparse=True))."""
    return grad.coalesce().values() if grad.is_sparse else grad
