"""A parameter-server shard as a plain class: fp32 masters, optimizer state, clocks, rounds.

No gRPC here: ps/server/servicer.py feeds requests in and maps the errors raised here
(ps/errors.py) to status codes, so everything below is testable without a socket.

Every request is validated completely before anything is mutated: a refused push,
pull or init leaves the master weights and optimizer state byte-for-byte unchanged.
Leases and the live set live in ps/server/membership.py, checkpoints in ps/server/checkpoint.py,
push validation in ps/server/pushdata.py, pulls in ps/server/shard_pull.py, per-chunk rounds in
ps/server/chunk_rounds.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from ps import wire
from ps.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, quote
from ps.headers import PullHeader, PushHeader, PushOutcome
from ps.job import Job
from ps.server import checkpoint, push_pacing
from ps.server.buffers import IntBufferLog, check_int_buffers, round_buffers
from ps.server.lease import DEFAULT_JOIN_GRACE_S, DEFAULT_LEASE_S, LeaseTable
from ps.server.membership import Membership, Restored, new_incarnation
from ps.server.policies import StagedPush
from ps.server.policy_for_mode import make_policy
from ps.server.push_takeover import InFlightPushes
from ps.server.pushdata import (
    PushTicket,
    add_piece,
    add_piece_streamed,
    add_verdict,
    check_absent,
    check_complete,
    slot_complete,
    unscale_rest,
    unscale_slot,
    zero_absent,
)
from ps.server.pushdata import check_header as _check_header
from ps.server.recovery import Recovery
from ps.server.shard_inspect import Inspection
from ps.server.shard_pull import Pulls
from ps.server.slot_step import SlotStepper
from trainkit.nullmetrics import NullMetrics
from trainkit.optim import DynamicLossScale, StepAdjust, build_optimizer, build_scheduler

__all__ = ["PullHeader", "PushHeader", "PushTicket", "ShardState"]

log = logging.getLogger("psar.shard")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class ShardState(Membership, Recovery, Inspection, Pulls):
    """One shard. Thread-safe: gRPC handler threads call it concurrently."""

    def __init__(
        self,
        *,
        metrics: Any = None,
        message_bytes: int = wire.DEFAULT_MESSAGE_BYTES,
        lease_s: float = DEFAULT_LEASE_S,
        join_grace_s: float = DEFAULT_JOIN_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        checkpoints: checkpoint.CheckpointManager | None = None,
        chunk_rounds: bool = False,
        update_threads: int = 1,
        push_lead_bytes: int = 0,
    ) -> None:
        self.chunk_rounds = chunk_rounds
        """sync: apply each slot as soon as every worker's piece of it is in
        (ps/server/chunk_rounds.py); results are bit-identical either way."""
        self.push_lead_bytes = push_lead_bytes
        """Per-chunk rounds, data plane: read a push at most this far ahead of the slowest
        push of its round still streaming (ps/server/push_pacing.py); 0: no pacing."""
        self.push_paced_s = 0.0
        """Seconds pushes were held back by pacing, all together (Stats)."""
        self._pacing = 0
        """Pushes waiting in pace_push now: a completed or dropped slot wakes the shard's
        condition (and every pull waiting on it) only when one is."""
        self.metrics = metrics if metrics is not None else NullMetrics()
        self.message_bytes = message_bytes
        self._cond = threading.Condition()
        self.job: Job | None = None
        self.numel: dict[str, int] = {}
        self.masters: dict[str, torch.nn.Parameter] = {}
        self.version = 0
        self.rounds = 0
        self.skipped_rounds = 0
        self.last_round_skipped = False
        self.updates_applied = 0
        self.dropped_nonfinite = 0
        self.live: set[int] = set()
        self.left: set[int] = set()
        self.expired: set[int] = set()
        self.joining: dict[int, int] = {}
        self.instances: dict[int, str] = {}
        self.clocks: list[int] = []
        self.max_clock_gap = 0
        self.int_buffers = IntBufferLog()
        """Shard 0: rank 0's integer buffers by clock (ps/server/buffers.py), sent with
        every pull."""
        self.staleness_counts: Counter[int] = Counter()
        self.leases = LeaseTable(lease_s, join_grace_s, clock)
        self.lease_expirations = 0
        self.rejoins = 0
        self.incarnation = 0
        self.restores = 0
        self.restored_step = 0
        self.restored_pending = False
        self.draining = False
        self.checkpoints = checkpoints
        self.stepper = SlotStepper(update_threads)
        """Runs and times the optimizer steps (ps/server/slot_step.py: --torch-threads)."""
        self._staging: dict[int, dict[str, torch.Tensor]] = {}
        self._worker_locks: dict[int, threading.Lock] = {}
        self.in_flight = InFlightPushes()
        """The push each worker is streaming, on either door: a newer one cuts it off
        instead of waiting for its lock (ps/server/push_takeover.py)."""
        self._snapshots: dict[tuple[torch.dtype, bool], tuple[Any, list[tuple[str, int, Any]]]] = {}

    # ---- initialisation -------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        return self.job is not None

    def init(self, job: Job, values: dict[str, torch.Tensor]) -> bool:
        """Install the job and the initial fp32 values. Returns True if an identical job
        was already installed (a retried init), raises if a different one was."""
        with self._cond:
            if self.check_job(job):
                return True
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
            self.masters = {
                s.key: torch.nn.Parameter(values[s.key].detach().clone().reshape(-1))
                for s in job.slots
            }
            self.numel = numel
            self.policy = make_policy(job.mode, job.staleness, chunk_rounds=self.chunk_rounds)
            self.optimizer = build_optimizer(self.masters.values(), job.optimizer)
            self.scheduler = build_scheduler(self.optimizer, job.optimizer)
            self.loss_scale = DynamicLossScale(job.loss_scale)
            self.live = set(range(job.num_workers))
            self.clocks = [0] * job.num_workers
            self.int_buffers = IntBufferLog.for_job(job)
            self.job = job
            self._started(job)
            self._maybe_checkpoint(force=True)
            return False

    def check_job(self, job: Job) -> bool:
        """True if `job` is the one installed, False if none is; raises on a conflict."""
        if self.job is None:
            return False
        if self.job == job:
            return True
        raise FailedPrecondition(
            f"shard already initialised for a different job (mode {self.job.mode}, "
            f"{self.job.num_workers} workers, {len(self.job.slots)} slots, id "
            f"{quote(self.job.job_id)}); restart the shard to start a new job",
            reason="conflicting_init",
        )

    def _started(self, job: Job) -> None:
        self.incarnation = new_incarnation()
        if self.checkpoints is not None:
            self.checkpoints.shard = job.shard_index
        self.leases.grant(self.live, grace=True)
        self.metrics.set_mode(job.mode)
        self.metrics.set_master_bytes(self.master_bytes)
        self.metrics.set_live_workers(len(self.live))
        self.metrics.set_loss_scale(self.loss_scale.scale)
        self.metrics.set_version(self.version)
        self._cond.notify_all()

    def wait_initialized(self, timeout: float | None) -> bool:
        """Block until initialised (or the timeout passes); returns whether it is."""
        with self._cond:
            return self._cond.wait_for(lambda: self.job is not None, timeout)

    @property
    def master_bytes(self) -> int:
        return sum(t.numel() * 4 for t in self.masters.values())

    def _require_job(self) -> Job:
        if self.job is None:
            raise FailedPrecondition(
                "shard not initialised yet: the worker of rank 0 initialises every shard; "
                "start it (or wait for it) before pushing or pulling",
                reason="not_initialized",
            )
        return self.job

    # ---- push -----------------------------------------------------------------------

    def begin_push(
        self, header: PushHeader, *, incarnation: int = 0, lock_timeout: float = 60.0
    ) -> PushTicket:
        """Validate a push header; returns the ticket that its data goes into."""
        with self._cond:
            job = self._require_job()
            _check_header(header, job.num_workers)
            check_int_buffers(job, header.int_buffers)
            self.check_incarnation(incarnation)
            self._check_draining(header.clock)
            lock = self._worker_locks.setdefault(header.worker, threading.Lock())
        # One push per worker at a time: a retry racing its original waits here, then
        # finds the original applied and is acknowledged as a duplicate.
        if not lock.acquire(timeout=lock_timeout):
            raise DeadlineExceeded(f"worker {header.worker}: another push is still in flight")
        try:
            with self._cond:
                self.check_incarnation(incarnation)
                duplicate = self._check_clock(header)
                if not duplicate:
                    self.policy.check_push(self, header.worker, header.clock, header.base_version)
                self.touch(header.worker)
                staging = self._staging.get(header.worker)
                if staging is None:
                    staging = {k: torch.empty(n) for k, n in self.numel.items()}
                    self._staging[header.worker] = staging
                ticket = PushTicket(
                    header=header,
                    staging=staging,
                    duplicate=duplicate,
                    lock=lock,
                    incarnation=self.incarnation,
                    absent=check_absent(self.numel, header.absent),
                    raw=self.buffer_keys,
                )
                if self.policy.applies_chunks:
                    ticket.on_drop = self._push_dropped
                    self.policy.push_started(self, ticket)
        except BaseException:
            lock.release()
            raise
        return ticket

    def add_data(self, ticket: PushTicket, key: str, offset: int, data: bytes) -> None:
        """Copy one piece of a push into the staging buffers (validated first)."""
        add_piece(self.numel, ticket, key, offset, data)
        if slot_complete(self.numel, ticket, key):
            self._slot_done(ticket, key)

    def add_data_from(
        self,
        ticket: PushTicket,
        key: str,
        offset: int,
        nbytes: int,
        read_into: Callable[[memoryview], None],
        read: Callable[[int], Any],
    ) -> None:
        """add_data for a piece whose bytes are still in a socket: checked from its
        description, then (fp32) read straight into the staging buffer, no copy."""
        add_piece_streamed(self.numel, ticket, key, offset, nbytes, read_into, read)
        if slot_complete(self.numel, ticket, key):
            self._slot_done(ticket, key)

    def pace_push(self, ticket: PushTicket, offset: int) -> float:
        """Before a slot's first piece is read: wait while this push runs `push_lead_bytes`
        ahead of the slowest other push of its round (ps/server/push_pacing.py). Returns
        the seconds waited."""
        if offset or not self.push_lead_bytes or not self.policy.applies_chunks:
            return 0.0
        left = push_pacing.BUDGET_S - ticket.paced_s
        if left <= 0:
            return 0.0
        t0 = time.monotonic()
        with self._cond:  # the policy is read each time: a restore may replace it
            self._pacing += 1
            try:
                self._cond.wait_for(
                    lambda: not self.policy.push_ahead(ticket, self.push_lead_bytes), left
                )
            finally:
                self._pacing -= 1
            waited = time.monotonic() - t0
            if waited > 1e-4:
                self.push_paced_s += waited
                ticket.paced_s += waited
                self.metrics.push_paced(waited)
        return waited

    def _slot_done(self, ticket: PushTicket, key: str) -> None:
        """A slot of a push is complete: unscale it now, while later slots still stream
        (off the round's critical path), and tell a per-chunk policy."""
        unscale_slot(ticket, key)
        if self.policy.applies_chunks:
            with self._cond:
                if ticket.incarnation == self.incarnation:
                    self.policy.slot_complete(self, ticket, key)
                if self._pacing:
                    self._cond.notify_all()  # a paced push behind this one may go on

    def _push_dropped(self, ticket: PushTicket) -> None:
        with self._cond:
            self.policy.push_dropped(self, ticket)
            if self._pacing:
                self._cond.notify_all()  # it no longer holds paced pushes back

    def add_verdict(self, ticket: PushTicket, overflow: bool, absent: tuple[str, ...] = ()) -> None:
        """The finiteness verdict of a push that streamed during backward (and the
        slots it had no gradient for, known only then)."""
        add_verdict(ticket, overflow, check_absent(self.numel, absent))
        if overflow and self.policy.applies_chunks:
            with self._cond:  # the round will be skipped: nothing of it may stay applied
                self.policy.push_dropped(self, ticket)

    def finish_push(self, ticket: PushTicket) -> tuple[PushOutcome, int, bool]:
        """Validate completeness and finiteness, then hand the push to the policy.

        Returns (outcome, shard version after it, already_applied).
        """
        try:
            h = ticket.header
            self.metrics.bytes_received(ticket.bytes_in)
            if ticket.duplicate:
                with self._cond:
                    return PushOutcome(False, False, 0), self.version, True
            if h.verdict_follows and ticket.verdict is None:
                check_complete(self.numel, ticket)  # refuses: the verdict never came
            if ticket.verdict:
                h.overflow = True  # data already staged is ignored, like a header overflow
            if not h.overflow:
                check_complete(self.numel, ticket)
                zero_absent(ticket)
            grads = ticket.staging
            if not h.overflow and not unscale_rest(ticket):
                with self._cond:  # sync refuses it; async/ssp drop and count it below
                    self.policy.nonfinite_unflagged(self, h.worker)
                h.overflow = True
            with self._cond:
                # Re-check under the lock: another thread may have moved the round on,
                # or a rollback may have replaced the state the push was checked against.
                if ticket.incarnation != self.incarnation:
                    raise Restored("restored: the shard was rolled back during this push")
                self._check_clock(h)
                self.policy.check_push(self, h.worker, h.clock, h.base_version)
                staged = StagedPush(
                    h.worker, h.clock, h.base_version, h.overflow, grads, ticket.absent
                )
                if h.overflow and not self.policy.holds_gradients:
                    staged.grads = {}
                elif (ticket.absent or ticket.raw) and not self.policy.holds_gradients:
                    # Applied alone (async/ssp): a slot this push has no gradient for
                    # is left alone, not stepped with zeros (apply_update skips it);
                    # buffers are values, taken from rank 0 as DDP broadcasts them.
                    if h.worker == 0:
                        self.set_buffers({k: grads[k] for k in ticket.raw})
                    skip = ticket.absent | ticket.raw
                    staged.grads = {k: g for k, g in grads.items() if k not in skip}
                self.clocks[h.worker] = h.clock
                if h.int_buffers and self.policy.takes_int_buffers(
                    self.int_buffers.held(h.clock), h.worker
                ):
                    self.int_buffers.put(h.clock, h.worker, h.int_buffers)
                ticket.accepted = True
                outcome = self.policy.accept(self, staged)
                self.metrics.push_accepted()
                self._cond.notify_all()
                return outcome, self.version, False
        finally:
            ticket.release()

    # ---- called by policies, under the lock -------------------------------------------

    def apply_update(
        self, grads: dict[str, torch.Tensor], staleness: list[int], adjust: StepAdjust | None = None
    ) -> None:
        """One optimizer step with these fp32 gradients (keyed by slot); `adjust`: this
        step's learning-rate scale / momentum (async/ssp, ps/server/staleness.py). A slot missing
        from `grads` (no gradient: an unused parameter) is not stepped at all: torch's
        optimizers skip a parameter whose .grad is None, state and weight decay included,
        as they do for a DDP parameter no rank used."""
        for key, p in self.masters.items():
            p.grad = grads.get(key)
        try:
            self.stepper.step_all(self, adjust)
        finally:
            for p in self.masters.values():
                p.grad = None
        self.finish_update(staleness)

    @property
    def buffer_keys(self) -> frozenset[str]:
        """The slots holding model buffers (values, never stepped)."""
        return frozenset(self.job.buffer_slots) if self.job is not None else frozenset()

    def buffer_values(self, grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """A sync round's buffer values (ps/server/buffers.py)."""
        return round_buffers(self.job, grads) if self.job is not None else {}

    def set_buffers(self, values: dict[str, torch.Tensor]) -> None:
        """Overwrite buffer slots with these values (they are never optimizer-stepped)."""
        for k, v in values.items():
            self.masters[k].detach().copy_(v)

    def step_slot(self, key: str, grad: torch.Tensor) -> None:
        """The optimizer step of one slot only (per-chunk rounds); finish_update ends the
        round (torch's optimizers step each parameter on its own: same bits)."""
        self.stepper.step_slot(self, key, grad)

    def finish_update(self, staleness: list[int]) -> None:
        """After the optimizer step(s) of an update: schedule, version, counters, round."""
        self.scheduler.step()
        self.version += 1
        self.updates_applied += 1
        numel = sum(self.numel.values())
        self.metrics.update_timed(numel, self.stepper.commit(numel))
        self.metrics.optimizer_step()
        self.metrics.set_version(self.version)
        for s in staleness:
            self.staleness_counts[s] += 1
            self.metrics.gradient_applied(s)
        if self.policy.rounds:
            self._close_round(skipped=False)
        else:
            self._maybe_checkpoint()

    def skip_round(self, reason: str) -> None:
        """Close a sync round without an update (weights and optimizer state untouched)."""
        self.skipped_rounds += 1
        self.metrics.round_skipped(reason)
        self._close_round(skipped=True)

    def _close_round(self, skipped: bool) -> None:
        self.rounds += 1
        self.last_round_skipped = skipped
        self.loss_scale.update(overflow=skipped)
        self.metrics.set_loss_scale(self.loss_scale.scale)
        self.restored_pending = False
        self.promote_joiners()
        self._maybe_checkpoint()

    def drop_nonfinite(self) -> None:
        self.dropped_nonfinite += 1
        self.metrics.nonfinite_dropped()
        self.metrics.push_rejected("nonfinite")

    def slowest_live_clock(self, default: int) -> int:
        return min((self.clocks[w] for w in self.live), default=default)
