"""PSBackend: the training loop's backend for the parameter-server architecture.

Each step: the gradients (fp16/bf16/fp32 as --wire-dtype says) are pushed to every
shard, then the new weights are pulled back. Pulls wait as the consistency mode
requires (the sync round closes; the slowest SSP worker catches up). In sync mode the
loss scale comes from the shards with every pull, so workers never drift apart.

Faults (docs/reliability.md): the worker registers on every shard at start (a restarted
worker continues from the shards' record of its clock), heartbeats to keep its lease,
and when a shard says it was restored or rolled back, or that the worker's lease
expired, it re-registers (`_resync`); in sync mode it first rolls every shard back to
the same checkpointed round, so the job stays consistent.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from typing import Any

import torch

from ps import auth
from ps.client import ClientConfig, NeedsResync, PSClient
from ps.job import Job
from ps.partition import Slot, bytes_per_shard, plan_slots
from worker.backend import StepOutcome
from worker.config import TrainConfig
from worker.nullmetrics import NullMetrics
from worker.optim import DynamicLossScale, LossScaleConfig, effective_loss_scale, with_run_length
from worker.precision import PrecisionPolicy, all_finite

log = logging.getLogger("psar.ps")
_MAX_RESYNCS = 50


class PSBackend:
    arch = "ps"

    def __init__(
        self,
        cfg: TrainConfig,
        precision: PrecisionPolicy,
        *,
        rank: int,
        world_size: int,
        total_steps: int,
        metrics: Any = None,
    ) -> None:
        self.cfg = cfg
        self.precision = precision
        self.mode = cfg.ps.mode
        self.rank, self.world_size = rank, world_size
        self.device = precision.device
        self.total_steps = total_steps
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.addresses = cfg.ps.server_list()
        self.clock = 0
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        ls = effective_loss_scale(cfg.loss_scale, precision.loss_scaling)
        self._ls_cfg = ls
        # sync: the shards own the scale; async/ssp: each worker keeps its own.
        self._local_scale = DynamicLossScale(ls)
        self.loss_scale = self._local_scale.scale
        self._skipped_seen = 0
        self.instance = secrets.token_hex(8)
        self.start_step = 0
        """Steps already done by an earlier process of this worker (the loop resumes)."""
        self.restores = 0
        self.rolled_back_updates = 0
        self.resyncs = 0
        self.rejoined = False

    # ---- setup ----------------------------------------------------------------------

    def setup(self, model: torch.nn.Module) -> torch.nn.Module:
        model.to(self.device)
        if self.precision.weights != torch.float32:
            model.to(self.precision.weights)
        self.model = model
        from ps.sparse_worker import SparseSide  # sparse tables: docs/sparse.md

        self.sparse = SparseSide(self, model)
        params = [
            (n, p)
            for n, p in model.named_parameters()
            if p.requires_grad and p.is_floating_point() and n not in self.sparse.names
        ]
        self.params = dict(params)
        chunk = int(self.cfg.ps.chunk_mib * (1 << 20))
        self.slots: list[Slot] = plan_slots(
            [(n, p.numel()) for n, p in params], len(self.addresses), chunk_bytes=chunk
        )
        jobs = self._jobs()
        ps = self.cfg.ps
        self.client = PSClient(
            self.addresses,
            worker=self.rank,
            cfg=ClientConfig(
                timeout_s=ps.timeout_s,
                pull_timeout_s=ps.pull_timeout_s,
                retry_timeout_s=ps.reconnect_timeout_s,
                tls_ca=ps.tls_ca,
                tls_cert=ps.tls_cert,
                tls_key=ps.tls_key,
                tls_server_name=ps.tls_server_name,
                auth_token=auth.read_token(ps.auth_token_file) if ps.auth_token_file else "",
            ),
        )
        self.client.set_slots(self.slots)
        if self.sparse:
            self.sparse.setup()  # before the dense init: a served job implies its tables
        if self.rank == 0:
            values = {s.key: self._view(s).detach().float() for s in self.slots}
            self.client.init(jobs, values)
            per = bytes_per_shard(self.slots, len(self.addresses))
            log.info(
                "bytes per shard: %s",
                ", ".join(f"{i}: {b / 2**20:.2f} MiB" for i, b in enumerate(per)),
            )
        got = self.client.get_jobs(wait=True, timeout_s=self.cfg.ps.pull_timeout_s)
        for i, (want, have) in enumerate(zip(jobs, got, strict=True)):
            if have is None:
                raise RuntimeError(
                    f"shard {i} ({self.addresses[i]}) was not initialised within "
                    f"{self.cfg.ps.pull_timeout_s}s; is the worker of rank 0 running?"
                )
            if have != want:
                raise RuntimeError(
                    f"shard {i} ({self.addresses[i]}) serves a different job (mode {have.mode}, "
                    f"{have.num_workers} workers, {len(have.slots)} slots, id {have.job_id!r}); "
                    "check --servers order, --mode, --world-size and the model on every worker"
                )
        wire = self.precision.wire
        pinned = self.device.type == "cuda"
        self._send = {
            s.key: torch.empty(s.numel, dtype=wire, pin_memory=pinned) for s in self.slots
        }
        # On CPU, pulled bytes land straight in the parameters; on CUDA they land in
        # pinned host buffers and are copied to the device in one go.
        if pinned:
            self._recv = {
                s.key: torch.empty(s.numel, dtype=self.precision.weights, pin_memory=True)
                for s in self.slots
            }
        else:
            self._recv = {s.key: self._view(s) for s in self.slots}
        self.versions = [0] * len(self.addresses)
        self._seen_versions = [0] * len(self.addresses)
        self._known_restores: list[int] | None = None
        self._pushed: int | None = None
        self._push_args: dict[str, Any] = {}
        self._resync(fresh=True)
        self.start_step = self.clock
        self.client.start_heartbeats()
        self._pull_resyncing()
        return model

    def _jobs(self) -> list[Job]:
        opt = with_run_length(self.cfg.optimizer, self.total_steps)
        return [
            Job(
                mode=self.mode,
                staleness=self.cfg.ps.staleness,
                num_workers=self.world_size,
                optimizer=opt,
                loss_scale=self._ls_cfg if self.mode == "sync" else LossScaleConfig(),
                shard_index=i,
                num_shards=len(self.addresses),
                slots=[s for s in self.slots if s.shard == i],
                job_id=self.cfg.ps.job_id,
            )
            for i in range(len(self.addresses))
        ]

    def _view(self, s: Slot) -> torch.Tensor:
        p = self.params[s.param]
        if not p.is_contiguous():
            raise ValueError(f"parameter {s.param} is not contiguous; call .contiguous() on it")
        return p.data.view(-1)[s.start : s.start + s.numel]

    # ---- the step -------------------------------------------------------------------

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # nothing travels until step()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    def step(self) -> StepOutcome:
        t0 = time.perf_counter()
        finite = True
        for s in self.slots:
            g = self.params[s.param].grad
            buf = self._send[s.key]
            if g is None:
                buf.zero_()  # no gradient this step: contributes zero (see docs/architectures.md)
            else:
                buf.copy_(g.reshape(-1)[s.start : s.start + s.numel], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        finite = finite and all_finite(self._send.values())
        if self.sparse:  # row gradients go first, for the same clock
            finite = self.sparse.push(self.clock + 1, finite, self.loss_scale)
        replies = None
        self._push_args = {
            "dtype": self.precision.wire,
            "loss_scale": self.loss_scale,
            "overflow": not finite,
        }
        self._pushed = None
        for attempt in range(_MAX_RESYNCS):
            try:
                replies = self.client.push(
                    clock=self.clock + 1,
                    base_versions=self.versions,
                    dtype=self.precision.wire,
                    grads=self._send,
                    loss_scale=self.loss_scale,
                    overflow=not finite,
                    retry=attempt > 0,
                )
                break
            except NeedsResync as e:
                before = self.clock
                self._resync(fresh=False, cause=e)
                if self.mode == "sync" and self.clock != before:
                    # The round this gradient was for is gone (rollback, or the others
                    # moved on without us): drop it and continue from the new weights.
                    self._pull_resyncing()
                    self._sync_scale()
                    return StepOutcome(skipped=True, loss_scale=self.loss_scale, staleness=0)
        if replies is None:
            raise RuntimeError(f"worker {self.rank}: could not resync with the shards")
        self.clock += 1
        self._pushed = self.clock
        for i, r in enumerate(replies):
            self._seen_versions[i] = max(self._seen_versions[i], r.version)
        if finite:
            self.bytes_pushed += sum(b.numel() * b.element_size() for b in self._send.values())
        t1 = time.perf_counter()
        wait = self._pull_resyncing()
        t2 = time.perf_counter()
        staleness = max(int(r.staleness) for r in replies)
        if self.mode == "sync":
            skipped = self._headers[0].skipped_rounds > self._skipped_seen
            self._sync_scale()
        else:
            skipped = not finite
            self._local_scale.update(overflow=skipped)
            self.loss_scale = self._local_scale.scale
        return StepOutcome(
            skipped=skipped,
            loss_scale=self.loss_scale,
            staleness=staleness,
            phases={"push": t1 - t0, "wait": wait, "pull": max(0.0, t2 - t1 - wait)},
        )

    def _sync_scale(self) -> None:
        self._skipped_seen = self._headers[0].skipped_rounds
        self.loss_scale = self._headers[0].loss_scale

    def _pull_resyncing(self) -> float:
        """_pull, re-registering first whenever a shard asks for it."""
        for _ in range(_MAX_RESYNCS):
            try:
                return self._pull()
            except NeedsResync as e:
                self._resync(fresh=False, cause=e, pushed=self._pushed)
        raise RuntimeError(f"worker {self.rank}: could not resync with the shards")

    def _pull(self) -> float:
        """Pull the newest weights this worker may see; returns seconds spent waiting."""
        dtype = self.precision.weights
        self._headers = self.client.pull(clock=self.clock, dtype=dtype, out=self._recv)
        self.versions = [h.version for h in self._headers]
        self._seen_versions = [
            max(a, b) for a, b in zip(self._seen_versions, self.versions, strict=True)
        ]
        if self.device.type == "cuda":
            for s in self.slots:
                self._view(s).copy_(self._recv[s.key], non_blocking=True)
        self.bytes_pulled += sum(s.numel for s in self.slots) * dtype.itemsize
        if self.mode == "sync":
            self.loss_scale = self._headers[0].loss_scale
        # The shards answer only once the round/bound allows: time to the first reply
        # message is the wait; the rest of the pull is the transfer.
        return self.client.last_pull_wait_s

    # ---- faults ---------------------------------------------------------------------

    def _resync(
        self, *, fresh: bool, cause: Exception | None = None, pushed: int | None = None
    ) -> None:
        """(Re-)register on every shard and agree on this worker's clock.

        sync: if a shard was restored (or rolled back) to an earlier round, every shard
        further on is rolled back to a checkpoint at or before it, until all agree;
        then the worker joins at the next round boundary. async/ssp: the worker keeps
        its clock (a fresh process takes the shards' record of it).

        `pushed` (sync): the clock of the gradient still in the send buffers, pushed
        but not yet pulled back. A restored shard whose open round is that one lost the
        push with its crash: the worker joins that open round and pushes it again.
        """
        if cause is not None:
            log.warning("worker %d: %s; re-registering", self.rank, cause)
            self.resyncs += 1
        old_inc, old_clock = list(self.client.incarnations), self.clock
        for _ in range(_MAX_RESYNCS):
            q = self.client.register(query=True)
            if self.mode == "sync":
                flagged = [r["rounds"] for r in q if r["restored"]]
                ahead = [r["shard"] for r in q if flagged and r["rounds"] > min(flagged)]
                if ahead:
                    for i in ahead:
                        self.client.rollback(i, min(flagged))
                    continue
                clock = max([r["rounds"] for r in q] + [r["clock"] for r in q])
            else:
                clock = max(r["clock"] for r in q) if fresh else self.clock
            lost = []
            if self.mode == "sync" and pushed is not None and pushed == clock:
                lost = [r["shard"] for r in q if r["clock"] < clock and r["rounds"] == clock - 1]
            try:
                regs = self._register(clock, lost)
                if lost:
                    self.client.push(
                        clock=clock,
                        base_versions=[r["version"] for r in q],
                        grads=self._send,
                        retry=True,
                        shards=lost,
                        **self._push_args,
                    )
            except NeedsResync as e:  # too late (the round closed meanwhile) or restored
                log.info("worker %d: register: %s; again", self.rank, e)
                continue
            break
        else:
            raise RuntimeError(f"worker {self.rank}: could not register with the shards")
        self.clock = clock
        self.rejoined = self.rejoined or any(r["rejoined"] for r in regs)
        self._count_restores(regs, old_inc, old_clock, fresh)
        self.versions = [min(v, r["version"]) for v, r in zip(self.versions, regs, strict=True)]

    def _register(self, clock: int, rejoin_open: list[int]) -> list[dict[str, Any]]:
        """Register at `clock` everywhere, except on the shards in `rejoin_open`, where
        the worker joins the open round (clock - 1) to push it again."""
        if not rejoin_open:
            return self.client.register(clock=clock, instance=self.instance)
        rest = [i for i in range(len(self.addresses)) if i not in rejoin_open]
        got = dict(
            zip(
                rejoin_open,
                self.client.register(clock=clock - 1, instance=self.instance, shards=rejoin_open),
                strict=True,
            )
        )
        if rest:
            regs = self.client.register(clock=clock, instance=self.instance, shards=rest)
            got.update(zip(rest, regs, strict=True))
        log.warning("worker %d: re-pushing round %d to shards %s", self.rank, clock, rejoin_open)
        return [got[i] for i in range(len(self.addresses))]

    def _count_restores(
        self, regs: list[dict[str, Any]], old_inc: list[int], old_clock: int, fresh: bool
    ) -> None:
        """Count a restore/rollback and the updates it undid, as this worker saw them:
        sync: the rounds of this worker's clock that were undone (its pushed round
        included); async/ssp: the newest version it had seen minus the restored one."""
        known = self._known_restores
        self._known_restores = [r["restores"] for r in regs]
        if fresh or known is None:
            return
        if any(r["restores"] > k for r, k in zip(regs, known, strict=True)):
            if self.mode == "sync":
                lost = max(0, old_clock - self.clock)
            else:
                lost = max(
                    (
                        max(0, seen - r["version"])
                        for seen, r, inc in zip(self._seen_versions, regs, old_inc, strict=True)
                        if r["incarnation"] != inc
                    ),
                    default=0,
                )
            self.restores += 1
            self.rolled_back_updates += lost
            log.warning("worker %d: shards restored; %d updates rolled back", self.rank, lost)
        self._seen_versions = [r["version"] for r in regs]

    def fault_report(self) -> dict[str, Any]:
        """Fault-tolerance figures for the run's report."""
        return {
            "start_step": self.start_step,
            "restores": self.restores,
            "rolled_back_updates": self.rolled_back_updates,
            "resyncs": self.resyncs,
            "rejoined": self.rejoined,
            **(self.sparse.report() if self.sparse else {}),
        }

    def comm_bytes(self) -> dict[str, int]:
        return {"bytes_pushed": self.bytes_pushed, "bytes_pulled": self.bytes_pulled}

    def state_dict(self) -> dict[str, Any]:
        state = self.model.state_dict()
        if self.sparse:  # the worker holds no tables: fetch them from the shards
            state = self.sparse.fill_state(state)
        if self.precision.weights == torch.float32:
            return state
        # Low-precision worker weights: fetch the fp32 masters for the saved copy.
        full = {s.key: torch.empty(s.numel) for s in self.slots}
        self.client.pull(clock=self.clock, dtype=torch.float32, out=full)
        out = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
        for s in self.slots:
            out[s.param].view(-1)[s.start : s.start + s.numel].copy_(full[s.key])
        return out

    def shard_stats(self) -> list[dict[str, Any]]:
        return self.client.stats()

    def finish(self) -> None:
        self.client.leave()
        self.client.close()
