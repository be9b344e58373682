"""DDPBackend: the training loop's backend for ring-allreduce (PyTorch DDP).

Launched the way PyTorch users launch DDP: torchrun sets RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and LOCAL_RANK; the process group is NCCL on CUDA and gloo
on CPU unless --backend says otherwise. With a low-precision wire dtype DDP registers
the matching compression hook, so both architectures move the same bytes.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from allreduce.hooks import register_wire_dtype
from worker.backend import StepOutcome
from worker.config import TrainConfig
from worker.optim import build_optimizer, build_scheduler, effective_loss_scale
from worker.precision import PrecisionPolicy


def init_process_group(cfg: TrainConfig, device: torch.device) -> None:
    """Join torchrun's process group (env://) with an explicit timeout."""
    if dist.is_initialized():
        return
    backend = cfg.ddp.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend, timeout=datetime.timedelta(seconds=cfg.ddp.pg_timeout_s)
    )


class DDPBackend:
    arch = "allreduce"
    mode = "ddp"

    def __init__(
        self,
        cfg: TrainConfig,
        precision: PrecisionPolicy,
        *,
        rank: int,
        world_size: int,
        total_steps: int,
        find_unused_parameters: bool = False,
    ) -> None:
        self.cfg = cfg
        self.precision = precision
        self.device = precision.device
        self.rank, self.world_size = rank, world_size
        self.total_steps = total_steps
        self.find_unused = find_unused_parameters or cfg.ddp.find_unused_parameters
        self.bytes_allreduced = 0
        self.loss_scale = 1.0

    def setup(self, model: torch.nn.Module) -> torch.nn.Module:
        init_process_group(self.cfg, self.device)
        model.to(self.device)
        self.model = model
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
        opt_cfg = self.cfg.optimizer
        if opt_cfg.schedule != "constant" and opt_cfg.total_steps == 0:
            opt_cfg = type(opt_cfg)(**{**vars(opt_cfg), "total_steps": self.total_steps})
        self.optimizer = build_optimizer(self.params, opt_cfg)
        self.scheduler = build_scheduler(self.optimizer, opt_cfg)
        ls = effective_loss_scale(self.cfg.loss_scale, self.precision.loss_scaling)
        self.scaler = torch.amp.GradScaler(
            self.device.type,
            init_scale=ls.init_scale,
            growth_factor=ls.growth_factor,
            backoff_factor=ls.backoff_factor,
            growth_interval=ls.growth_interval,
            enabled=ls.enabled,
        )
        self.loss_scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        return self.ddp

    def no_sync(self):  # noqa: ANN201 - DDP's own context manager
        return self.ddp.no_sync()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def step(self) -> StepOutcome:
        # Gradients were allreduced during backward (DDP's bucket hooks), so every rank
        # sees the same gradients and reaches the same skip decision with no collective.
        t0 = time.perf_counter()
        self.bytes_allreduced += self._step_bytes
        if self.scaler.is_enabled():
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.loss_scale = self.scaler.get_scale()
            skipped = self.loss_scale < before
        else:
            skipped = not all(
                bool(torch.isfinite(p.grad).all()) for p in self.params if p.grad is not None
            )
            if not skipped:
                self.optimizer.step()
        if not skipped:
            self.scheduler.step()
        return StepOutcome(
            skipped=skipped,
            loss_scale=self.loss_scale,
            phases={"optimizer": time.perf_counter() - t0},
        )

    def comm_bytes(self) -> dict[str, int]:
        return {"bytes_allreduced": self.bytes_allreduced}

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def shard_stats(self) -> list[dict[str, Any]]:
        return []

    def finish(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
