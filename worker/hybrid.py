"""HybridBackend (--arch hybrid): sparse tables on the PS shards, dense layers on the ring.

What recommendation systems at scale do (Persia, HugeCTR, XDL, Monolith; issue #46): the
huge, sparsely touched embedding tables live on the parameter-server shards, which move
only the rows a batch touches; every dense parameter (the MLP) is allreduced among the
workers, as DDP does, and stepped on every worker by the same optimizer.

Composed, not reimplemented: the tables are served by a PSBackend (ps/client/backend.py)
given a *view* of the model that holds only the tables (same module paths, so the same
table names), and the dense gradients go through torch.distributed (the process group
allreduce/ joins, gloo on CPU, NCCL on GPUs). This module lies in worker/ because it sees
both sides; ps/client and allreduce never import each other (tests/test_walls.py), and
worker/loop.py imports it lazily, so a DDP run still loads no psar.ps.

Each step, after backward:

1. the dense gradients (unscaled, divided by the world size, in --wire-dtype) are
   allreduced *asynchronously*;
2. meanwhile the PS part pushes every table's touched rows (ps/client/sparse_worker.py;
   one call per shard) for the worker's next clock;
3. where the tables' mode needs it (sync rounds, SSP at a bound of 0), a one-number
   allreduce joins the ranks once every rank's row push was answered: the next step's
   row pulls then see the table round closed, and the number is the job's overflow
   verdict (ps/client/backend_tables.py);
4. the dense allreduce is waited for and the dense optimizer steps on the mean gradient.

No dense round. The shards hold only the tables and see no dense push or pull during
training: a sync table round closes when every worker's rows of its clock are in, as
under --arch ps, and the collectives above give the workers what a dense round would
(reads after the round, one verdict). The view still holds one single-element parameter
per shard ("round slots", `psar_round_<i>`), so that every shard holds a slot of the job
it registers; it is pulled once, at setup. The tables may run --mode sync (equal to
DDP-sparse per step in fp32), async or ssp, while the dense part is always synchronous:
async and SSP need no join, since the dense allreduce keeps the ranks within a clock.

Overflow (fp16): every worker scales its loss by the PS part's loss scale and keeps it
itself. A worker whose dense gradient is non-finite marks its row push as an overflow, so
a sync table round is skipped exactly when some worker's dense or row gradient
overflowed; the join tells every rank so, and each skips its dense step and backs its
scale off alike. Without a join (async, SSP), the dense step is skipped when the
allreduced mean is non-finite (the same sum on every worker) and each worker's scale
follows its own gradients, as under --arch ps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from psar.trainkit.backend import ArchInfo, BackendContext, OnContext, StepOutcome
from psar.trainkit.config import TrainConfig
from psar.trainkit.device_io import state_to_host
from psar.trainkit.finite import all_finite
from psar.trainkit.optim import (
    StepOptions,
    build_optimizer,
    build_scheduler,
    optimizer_impl,
    with_run_length,
)
from psar.trainkit.sparse_tables import marked_tables

log = logging.getLogger("psar.hybrid")

ROUND_SLOT = "psar_round_{}"
"""Name of shard i's one-element round parameter in the PS part's view (module docstring)."""


def tables_view(model: nn.Module, num_shards: int) -> nn.Module:
    """A module holding `model`'s marked sparse tables at their own paths (so the PS part
    names them as a PS run of the whole model does) and one round slot per shard."""
    tables = marked_tables(model)
    if not tables:
        raise ValueError(
            "--arch hybrid puts the model's sparse embedding tables on the shards and "
            "allreduces the rest, but this model has no table marked psar_sparse_table "
            "(docs/sparse.md): use --arch allreduce, or mark its tables"
        )
    if "" in tables:
        raise ValueError("--arch hybrid: the model is a table itself; use --arch ps")
    view = nn.Module()
    for name, mod in tables.items():
        parent = view
        *path, last = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(last, mod)
    # Equal sizes: the placement (largest first, onto the emptiest shard) gives shard i
    # the slot of index i, so every shard holds one (ps/partition.py).
    for i in range(num_shards):
        view.register_parameter(ROUND_SLOT.format(i), nn.Parameter(torch.zeros(1)))
    return view


def own_tables(model: nn.Module, optimizer: torch.optim.Optimizer, sparse_optimizer: str) -> None:
    """A loop of its own: each marked table is stepped on the shards at the learning rate
    of the user's param group holding it (psar_lr, ps/client/sparse_worker.py), by
    --sparse-optimizer; said once where the user's optimizer would step it otherwise."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for name, mod in marked_tables(model).items():
        group = group_of.get(id(mod.weight))
        if group is None:
            continue  # not in the optimizer: the shards step it at --sparse-lr / --lr
        mod.psar_lr = float(group["lr"])
        plain_sgd = (
            isinstance(optimizer, torch.optim.SGD)
            and not group.get("momentum")
            and not group.get("weight_decay")
        )
        if not (plain_sgd and sparse_optimizer == "sgd"):
            log.warning(
                "table %s is stepped on the shards by --sparse-optimizer %s at lr %g, not by "
                "your %s (only SGD without momentum or weight decay is the same step)",
                name, sparse_optimizer, mod.psar_lr, type(optimizer).__name__,
            )  # fmt: skip


class HybridBackend(OnContext):
    """One hybrid worker: a PSBackend for the tables (`ps`) and the dense allreduce."""

    dealer = None  # each rank cuts its shard of the data from its rank

    @classmethod
    def describe(cls, cfg: TrainConfig) -> ArchInfo:
        """--mode (the tables'). The tables may be applied stale (async/ssp: the step's
        staleness is the PS part's); the dense part is lockstep and the job is launched
        like DDP (one --report for it): rank 0 writes the report. No rank flags: the
        environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT: torchrun, psar launch) gives
        the rank, for the process group and the shards alike. No resume yet: a hybrid
        job starts at step 0 (ctx.start_step)."""
        return ArchInfo(
            arch="hybrid",
            mode=cfg.ps.mode,
            staleness=True,
            per_rank=False,
            tables_on_shards=True,
            collective_step=True,
        )

    @classmethod
    def from_config(cls, ctx: BackendContext) -> HybridBackend:
        return cls(ctx)

    def __init__(self, ctx: BackendContext) -> None:
        from psar.ps.client.backend import PSBackend  # lazily: see the module docstring

        self.ctx = ctx
        self.cfg = ctx.cfg
        self.ps = PSBackend(ctx)
        """The tables' side: row pulls in forward, row pushes and the round in step()."""
        self.bytes_allreduced = 0
        self.steps_done = 0

    # ---- setup ----------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
        """`optimizer`: a user's own (worker/own_loop.py): it steps the dense parameters
        here, on the allreduced gradient, as under DDP (its LR schedulers are the user's);
        each table is stepped on the shards by --sparse-optimizer at its param group's
        learning rate (own_tables). None: the one --optimizer configures."""
        from psar.allreduce.backend import init_process_group

        if optimizer is not None:
            own_tables(model, optimizer, self.cfg.ps.sparse_optimizer)

        if self.world_size > 1 or "MASTER_ADDR" in os.environ:
            init_process_group(self.cfg, self.device)
        # else: one worker started by hand (`psar train --arch hybrid --servers ...`):
        # nothing to allreduce, so no process group (and no torchrun) is needed.
        view = tables_view(model, len(self.cfg.ps.server_list()))
        self.ps.setup(view)  # releases the tables: the worker never holds one
        self.ps.sparse.watch(model)  # the whole model says the tables' ids (not the view)
        model.to(self.device)
        self.model = model
        names = self.ps.sparse.names
        self.params = [p for n, p in model.named_parameters() if n not in names and p.requires_grad]
        if self.world_size > 1:  # every rank starts from rank 0's dense weights (as DDP)
            for t in [*self.params, *model.buffers()]:
                if t.numel():
                    dist.broadcast(t.data, src=0)
        opt_cfg = with_run_length(self.cfg.optimizer, self.ctx.total_steps)
        # A loop of its own: its optimizer (its param groups hold the released tables
        # too, which never get a gradient here, so torch's step passes them by).
        self.optimizer = optimizer or build_optimizer(self.params, opt_cfg)
        self.scheduler = build_scheduler(self.optimizer, opt_cfg) if optimizer is None else None
        self.wire = self.precision.wire
        self._step_bytes = sum(p.numel() for p in self.params) * self.wire.itemsize
        log.info(
            "rank %d: %d sparse table(s) on %d shard(s), %d dense parameters allreduced",
            self.rank, len(names), len(self.ps.addresses), sum(p.numel() for p in self.params),
        )  # fmt: skip
        return model

    # ---- the step -------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.ps.loss_scale

    def no_sync(self) -> contextlib.AbstractContextManager:
        # Dense gradients accumulate in .grad; the PS part holds back its row pushes.
        return self.ps.no_sync()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.ps.scale_loss(loss)  # one scale for rows and dense alike

    def step(self, options: StepOptions | None = None) -> StepOutcome:
        # `options`: a loop of its own's; its optimizer holds its learning rates itself.
        if options is not None and options.clip_norm:
            raise ValueError(
                "run.clip_grad_norm_() under --arch hybrid: the tables' gradients are summed "
                "on the shards, so no worker sees the whole norm; clip under --arch ps or "
                "allreduce, or leave clipping out"
            )
        t0 = time.perf_counter()
        scale = self.ps.loss_scale
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        dense_finite = all_finite([flat])
        # Divided first (as DDP's hooks do), so the sum cannot overflow where the mean
        # would not; the loss scale out too, since async workers may hold different ones.
        wire = flat.div_(scale * self.world_size).to(self.wire)
        work = None
        if self.world_size > 1:
            work = dist.all_reduce(wire, async_op=True)
        self.bytes_allreduced += self._step_bytes
        t1 = time.perf_counter()
        tables = self.ps.tables
        out = tables.step(dense_finite)  # rows pushed while the allreduce runs
        t2 = time.perf_counter()
        overflow = out.skipped  # this worker's, rows or dense
        joint = tables.reads_wait  # the mode waits for every rank's rows: one verdict
        if joint and self.world_size > 1:
            # Every rank's rows of this clock are on the shards once this ends (each
            # joins after its push was answered), so the next row pulls see the table
            # round closed; and every rank learns whether any overflowed, the shards'
            # verdict on the round (ps/client/backend_tables.py).
            verdict = torch.tensor([1.0 if overflow else 0.0])
            dist.all_reduce(verdict)
            overflow = bool(verdict.item())
        t3 = time.perf_counter()
        if work is not None:
            work.wait()
        t4 = time.perf_counter()
        mean = wire.float() if wire.dtype != torch.float32 else wire
        finite = all_finite([mean])
        skipped = (overflow and joint) or not finite
        # The verdict moves the scale: the same on every rank where it is the job's.
        scale = tables.settle(overflow)
        if not skipped:
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad = mean[offset : offset + n].view_as(p).to(p.dtype)
                offset += n
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        self.steps_done += 1
        phases = dict(out.phases)
        phases["wait"] = t3 - t2
        phases["allreduce"] = t4 - t3
        phases["optimizer"] = (t1 - t0) + (time.perf_counter() - t4)
        return StepOutcome(
            skipped=skipped or out.skipped,
            loss_scale=scale,
            staleness=out.staleness,
            phases=phases,
            cache_lookups=out.cache_lookups,
            cache_hits=out.cache_hits,
            cache_bytes_saved=out.cache_bytes_saved,
        )

    # ---- the rest -------------------------------------------------------------------

    def report(self, *, final: bool = False) -> dict[str, Any]:
        """The PS part's figures (rows pushed and pulled, the shards'),
        plus the dense allreduce: bytes_sent/received count both (the ring's share as
        DDP's report counts it)."""
        from psar.allreduce.backend import ring_bytes

        out = self.ps.report(final=final)
        ring = ring_bytes(self.bytes_allreduced, self.world_size)
        out["bytes_allreduced"] = self.bytes_allreduced
        # The PS part's bytes_pushed/pulled hold its row bytes already (sparse_worker.py
        # adds them to both counters), so they are counted once here.
        out["bytes_sent"] = self.ps.bytes_pushed + ring
        out["bytes_received"] = self.ps.bytes_pulled + ring
        if "worker_param_bytes" in out:  # the PS part counted its round slots, not the MLP
            out["worker_param_bytes"] += sum(p.numel() * p.element_size() for p in self.params)
        if final:
            out["optimizer_impl"] = optimizer_impl(self.optimizer)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The dense weights (every rank holds the same) and the tables from the shards."""
        return self.ps.sparse.fill_state(state_to_host(self.model.state_dict()))

    def remote_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        return None  # the dense optimizer is each rank's own

    def finish(self, *, failed: bool = False, why: str = "") -> None:
        from psar.allreduce import process_group

        self.ps.finish(failed=failed, why=why)
        if not failed:
            process_group.end_process_group()
