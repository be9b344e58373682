"""A parameter-server shard: its state as data, its behaviour in components, composed here.

No gRPC here: the doors (ps/server/doors/servicer.py, ps/server/doors/dataplane.py) decode requests
and call the components; the errors raised (ps/errors.py) become status codes there, so
everything below is testable without a socket. Every request is validated completely
before anything is mutated: a refused push, pull or init leaves the master weights and
optimizer state byte-for-byte unchanged.

`ShardState` is the shard's data (ps/server/state.py) with its components attached, each
owning its part of the behaviour and changing the data under the shard's lock:

- `updates` (ps/server/update/updates.py): optimizer steps, versions, rounds; the ShardView the
  update rule (chosen by the job's mode in the shard's registry, ps/server/modes/) is handed;
- `members` (ps/server/membership/membership.py): the live set, leases, registering and rejoining;
- `durability` (ps/server/durability/durability.py): checkpoints, restore, rollback, draining;
- `pulls` (ps/server/pulls/pulls.py): pulls, parked pulls and early pulls;
- `intake` (ps/server/intake/intake.py): pushes, their pieces and verdicts, pacing.

What is left here is the job's installation (init) and the read-only views (stats, the
state digest).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch

from psar.ps import wire
from psar.ps.errors import FailedPrecondition, InvalidArgument, quote
from psar.ps.job import Job
from psar.ps.server.durability.checkpoints import CheckpointManager
from psar.ps.server.durability.durability import Durability, new_incarnation
from psar.ps.server.intake.intake import Intake
from psar.ps.server.limits import ShardLimits
from psar.ps.server.membership.leases import DEFAULT_JOIN_GRACE_S, DEFAULT_LEASE_S, LeaseTable
from psar.ps.server.membership.ledger import ledger_for
from psar.ps.server.membership.membership import Membership
from psar.ps.server.metrics.recorder import NullShardRecorder, ShardRecorder
from psar.ps.server.modes import BUILTIN, Modes
from psar.ps.server.pulls.pulls import Pulls
from psar.ps.server.state import ShardData
from psar.ps.server.update.buffers import IntBufferLog
from psar.ps.server.update.opt_state import StateValue, load_state, read_state
from psar.ps.server.update.stepper import SlotStepper
from psar.ps.server.update.updates import Updates
from psar.trainkit.optim import StepAdjust, optimizer_impl, resolve_impl

__all__ = ["ShardState"]


class ShardState(ShardData):
    """One shard. Thread-safe: gRPC handler and data-plane threads call it concurrently."""

    def __init__(
        self,
        *,
        modes: Modes = BUILTIN,
        metrics: ShardRecorder | None = None,
        message_bytes: int = wire.DEFAULT_MESSAGE_BYTES,
        lease_s: float = DEFAULT_LEASE_S,
        join_grace_s: float = DEFAULT_JOIN_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        checkpoints: CheckpointManager | None = None,
        chunk_rounds: bool = False,
        update_threads: int = 1,
        push_lead_bytes: int = 0,
        exact_fp16_sum: bool = True,
        limits: ShardLimits | None = None,
    ) -> None:
        super().__init__(
            modes=modes,
            metrics=metrics if metrics is not None else NullShardRecorder(),
            message_bytes=message_bytes,
            leases=LeaseTable(lease_s, join_grace_s, clock),
            checkpoints=checkpoints,
            chunk_rounds=chunk_rounds,
            push_lead_bytes=push_lead_bytes,
            exact_fp16_sum=exact_fp16_sum,
            limits=limits,
        )
        self.updates = Updates(
            self,
            SlotStepper(update_threads),
            on_round_closed=self._round_closed,
            on_update=lambda: self.durability.maybe_checkpoint(),
        )
        self.members = Membership(self, self.updates)
        self.durability = Durability(self, self.updates, started=self._started, forget=self._forget)
        self.pulls = Pulls(self, self.members, self.updates)
        self.intake = Intake(self, self.members, self.updates)

    @property
    def stepper(self) -> SlotStepper:
        """The optimizer's stepping threads (tools: bench/shard_update.py)."""
        return self.updates.stepper

    def apply_update(
        self, grads: dict[str, torch.Tensor], staleness: list[int], adjust: StepAdjust | None = None
    ) -> None:
        """One optimizer step, as an update rule applies it (tools: bench/shard_update.py)."""
        self.updates.apply_update(grads, staleness, adjust)

    def _round_closed(self) -> None:
        self.members.promote_joiners()
        self.members.round_opened()  # elastic data: the next round's batches, rank order
        self.durability.maybe_checkpoint()

    def _forget(self) -> None:
        self.pulls.forget()
        self.intake.forget()

    # ---- the job ------------------------------------------------------------------------

    def init(
        self,
        job: Job,
        values: dict[str, torch.Tensor],
        opt_state: list[StateValue] | None = None,
        *,
        owned: bool = False,
    ) -> bool:
        """Install the job and the initial fp32 values (and the optimizer's state to start
        from, if any: a resumed user loop). Returns True if an identical job was already
        installed (a retried init), raises if a different one was. `owned`: the values
        are the caller's to give away (Init's own buffers): they become the masters
        instead of being copied (a second copy of every master at init was the shard's
        peak memory: the allocator keeps what it frees)."""
        with self.cond:
            if self.check_job(job):
                return True
            job = self.modes.serve(job)
            numel = {s.key: s.numel for s in job.slots}
            missing = sorted(set(numel) - set(values))
            extra = sorted(set(values) - set(numel))
            if missing or extra:
                raise InvalidArgument(
                    f"init values do not match the slots: missing {missing[:5]}, "
                    f"unexpected {extra[:5]}"
                )
            for key, t in values.items():
                if t.numel() != numel[key] or t.dtype != torch.float32:
                    raise InvalidArgument(
                        f"init slot {quote(key)}: expected {numel[key]} fp32 elements, got "
                        f"{t.numel()} {t.dtype}"
                    )
            chunked = job.chunk_rounds or self.chunk_rounds
            if chunked and job.traits is not None and job.traits.rounds:
                why = _whole_rounds_only(job)
                if why:
                    raise InvalidArgument(why)
            try:  # masters live on the CPU: fused only where this torch has the kernel
                resolve_impl(job.optimizer, "cpu")
            except ValueError as e:
                raise InvalidArgument(f"this shard cannot run the job's optimizer: {e}") from None
            masters = {s.key: torch.nn.Parameter(_master(values[s.key], owned)) for s in job.slots}
            self.updates.install(job, masters)
            if opt_state:
                load_state(self.optimizer, masters, opt_state)
            self.live = set(range(job.num_workers))
            self.clocks = [0] * job.capacity
            self.ledger = ledger_for(job)
            self.int_buffers = IntBufferLog.for_job(job)
            self.job = job
            self._started(job)
            self.members.round_opened()  # rounds modes: round 1's batches
            self.durability.maybe_checkpoint(force=True)
            return False

    def check_job(self, job: Job) -> bool:
        """True if `job` is the one installed, False if none is; raises on a conflict, or
        on a job this shard cannot serve (its mode, its configuration: InvalidArgument)."""
        served = self.modes.serve(job)
        if self.job is None:
            self.limits.check_job(job)  # before the job sizes anything (Init's buffers)
            return False
        if self.job == served:
            return True
        raise FailedPrecondition(
            f"shard already initialised for a different job (mode {self.job.mode}, "
            f"{self.job.num_workers} workers, {len(self.job.slots)} slots, id "
            f"{quote(self.job.job_id)}); restart the shard to start a new job",
            reason="conflicting_init",
        )

    def _started(self, job: Job) -> None:
        """The shard holds a job now (init or restore)."""
        self.incarnation = new_incarnation()
        if self.checkpoints is not None:
            self.checkpoints.shard = job.shard_index
        self.leases.grant(self.live, grace=True)
        self.metrics.set_mode(job.mode)
        self.metrics.set_master_bytes(self.master_bytes)
        self.metrics.set_live_workers(len(self.live))
        self.metrics.set_max_workers(job.capacity)
        self.metrics.set_loss_scale(self.loss_scale.scale)
        self.metrics.set_version(self.version)
        self.cond.notify_all()

    def optimizer_state(self) -> list[StateValue]:
        """Every slot's optimizer state now (copies), as of the last closed round."""
        with self.cond:
            self.require_job()
            self.updates.policy.settle(self.updates)
            return read_state(self.optimizer, self.masters)

    def wait_initialized(self, timeout: float | None) -> bool:
        """Block until initialised (or the timeout passes); returns whether it is."""
        with self.cond:
            return self.cond.wait_for(lambda: self.job is not None, timeout)

    # ---- read-only views --------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self.cond:
            hist_len = max(self.staleness_counts, default=-1) + 1
            m = self.checkpoints
            policy = self.policy  # none before init
            return {
                "version": self.version,
                "rounds": self.rounds,
                "updates_applied": self.updates_applied,
                "skipped_rounds": self.skipped_rounds,
                "dropped_nonfinite": self.dropped_nonfinite,
                "live_workers": len(self.live),
                "loss_scale": self.loss_scale.scale if self.job else 1.0,
                "worker_clocks": list(self.clocks),
                "max_clock_gap": self.max_clock_gap,
                "staleness_histogram": [self.staleness_counts[i] for i in range(hist_len)],
                "master_bytes": self.master_bytes,
                "state_digest": self.state_digest(),
                "incarnation": self.incarnation,
                "restores": self.restores,
                "restored_step": self.restored_step,
                "lease_expirations": self.lease_expirations,
                "rejoins": self.rejoins,
                "checkpoints_written": m.written if m is not None else 0,
                "last_checkpoint_step": (m.last_step or 0) if m is not None else 0,
                "live_worker_ids": sorted(self.live),
                "draining": self.draining,
                "chunks_applied_early": policy.chunks_early if policy is not None else 0,
                "chunk_undos": policy.chunk_undos if policy is not None else 0,
                "update_params_per_s": self.stepper.rate(),
                "early_pull_slots": policy.early_slots if policy is not None else 0,
                "early_pull_voids": policy.early_voids if policy is not None else 0,
                "push_paced_s": self.push_paced_s,
                "joins": self.joins,
                "leaves": self.leaves,
                "data_dealt": self.ledger.dealt if self.ledger is not None else 0,
                "data_returned": self.ledger.given_back if self.ledger is not None else 0,
                "data_remaining": self.ledger.remaining() if self.ledger is not None else 0,
                "optimizer_impl": optimizer_impl(self.optimizer) if self.job else "",
                "gradient_bytes": self.intake.gradient_bytes(),
                "workers_took_part": self.members.took_part(),
            }

    def state_digest(self) -> str:
        """sha256 of masters, optimizer state and counters: equal digests, equal state."""
        h = hashlib.sha256()
        with self.cond:
            if self.job is not None and self.policy is not None:
                self.policy.quiesce()
            h.update(f"{self.version}/{self.rounds}/{self.clocks}".encode())
            h.update(self.int_buffers.digest_text().encode())
            for key, p in self.masters.items():
                h.update(key.encode())
                h.update(wire.as_bytes_view(p.detach()))
            if self.job is not None:
                for key, p in self.masters.items():
                    for name, value in sorted(self.optimizer.state.get(p, {}).items()):
                        h.update(f"{key}.{name}".encode())
                        if isinstance(value, torch.Tensor):
                            h.update(wire.as_bytes_view(value.detach().reshape(-1).contiguous()))
                        else:
                            h.update(repr(value).encode())
                h.update(repr(self.loss_scale.scale).encode())
        return h.hexdigest()


def _master(value: torch.Tensor, owned: bool) -> torch.Tensor:
    """A slot's fp32 master from its init value: the value itself where it is the
    caller's to give away (1-D, contiguous, its own storage), else a copy."""
    flat = value.detach().reshape(-1)
    if owned and flat.is_contiguous() and flat.data_ptr() == value.data_ptr():
        return flat
    return flat.clone()


def _whole_rounds_only(job: Job) -> str | None:
    """Why `job`'s rounds cannot be applied chunk by chunk (None: they can)."""
    if job.elastic:
        return (
            "an elastic job (--max-workers) with per-chunk rounds: its early per-slot steps "
            "cannot scale a round's learning rate by the workers in it; start the shards "
            "without --chunk-rounds and rank 0 with --no-early-pull"
        )
    if job.step_options:
        return (
            "this shard applies sync rounds chunk by chunk (psar server --chunk-rounds), but "
            "the job's workers send step options (a loop of their own: its learning rates; "
            "clipping), which apply to whole updates: start the shards without --chunk-rounds"
        )
    return None
