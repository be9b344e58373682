"""A parameter-server shard as a plain class: fp32 masters, optimizer state, clocks, rounds.

No gRPC here: ps/servicer.py feeds requests in and maps the errors raised here
(ps/errors.py) to status codes, so everything below is testable without a socket.

Every request is validated completely before anything is mutated: a refused push,
pull or init leaves the master weights and optimizer state byte-for-byte unchanged.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ps import wire
from ps.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from ps.job import Job
from ps.policies import PushOutcome, StagedPush, make_policy
from worker.nullmetrics import NullMetrics
from worker.optim import DynamicLossScale, build_optimizer, build_scheduler

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(slots=True)
class PushHeader:
    worker: int
    clock: int
    base_version: int
    dtype: torch.dtype
    loss_scale: float = 1.0
    overflow: bool = False
    retry: bool = False


@dataclass(slots=True)
class PullHeader:
    version: int
    rounds: int
    loss_scale: float
    last_round_skipped: bool
    skipped_rounds: int
    dtype: torch.dtype
    clock_gap: int


@dataclass
class PushTicket:
    """An in-flight push: its header, where its bytes go, and how much has arrived."""

    header: PushHeader
    staging: dict[str, torch.Tensor]
    received: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    duplicate: bool = False
    lock: threading.Lock | None = None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


class ShardState:
    """One shard. Thread-safe: gRPC handler threads call it concurrently."""

    def __init__(
        self, *, metrics: Any = None, message_bytes: int = wire.DEFAULT_MESSAGE_BYTES
    ) -> None:
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
        self.clocks: list[int] = []
        self.max_clock_gap = 0
        self.staleness_counts: Counter[int] = Counter()
        self._staging: dict[int, dict[str, torch.Tensor]] = {}
        self._worker_locks: dict[int, threading.Lock] = {}
        self._snapshots: dict[torch.dtype, tuple[int, list[tuple[str, int, bytes]]]] = {}

    # ---- initialisation -------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        return self.job is not None

    def init(self, job: Job, values: dict[str, torch.Tensor]) -> bool:
        """Install the job and the initial fp32 values. Returns True if an identical job
        was already installed (a retried init), raises if a different one was."""
        with self._cond:
            if self.job is not None:
                if _same_job(self.job, job):
                    return True
                raise FailedPrecondition(
                    f"shard already initialised for a different job (mode {self.job.mode}, "
                    f"{self.job.num_workers} workers, {len(self.job.slots)} slots, id "
                    f"{self.job.job_id!r}); restart the shard to start a new job",
                    reason="conflicting_init",
                )
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
                        f"init slot {key!r}: expected {numel[key]} fp32 elements, got "
                        f"{t.numel()} {t.dtype}"
                    )
            self.masters = {
                s.key: torch.nn.Parameter(values[s.key].detach().clone().reshape(-1))
                for s in job.slots
            }
            self.numel = numel
            self.policy = make_policy(job.mode, job.staleness)
            self.optimizer = build_optimizer(self.masters.values(), job.optimizer)
            self.scheduler = build_scheduler(self.optimizer, job.optimizer)
            self.loss_scale = DynamicLossScale(job.loss_scale)
            self.live = set(range(job.num_workers))
            self.clocks = [0] * job.num_workers
            self.job = job
            self.metrics.set_mode(job.mode)
            self.metrics.set_master_bytes(self.master_bytes)
            self.metrics.set_live_workers(len(self.live))
            self.metrics.set_loss_scale(self.loss_scale.scale)
            self._cond.notify_all()
            return False

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

    def begin_push(self, header: PushHeader, *, lock_timeout: float = 60.0) -> PushTicket:
        """Validate a push header; returns the ticket that its data goes into."""
        with self._cond:
            job = self._require_job()
            if not 0 <= header.worker < job.num_workers:
                raise InvalidArgument(
                    f"worker {header.worker} is not in this job (workers 0..{job.num_workers - 1})",
                    reason="bad_worker",
                )
            if header.dtype not in wire.WIRE_FROM_DTYPE:
                raise InvalidArgument(
                    f"unsupported gradient dtype {header.dtype}; send fp32, fp16 or bf16",
                    reason="bad_dtype",
                )
            if not (header.loss_scale > 0 and header.loss_scale < float("inf")):
                raise InvalidArgument(
                    f"loss_scale must be a finite number > 0, got {header.loss_scale}",
                    reason="malformed",
                )
            lock = self._worker_locks.setdefault(header.worker, threading.Lock())
        # One push per worker at a time: a retry racing its original waits here, then
        # finds the original applied and is acknowledged as a duplicate.
        if not lock.acquire(timeout=lock_timeout):
            raise DeadlineExceeded(f"worker {header.worker}: another push is still in flight")
        try:
            with self._cond:
                duplicate = self._check_clock(header)
                if not duplicate:
                    self.policy.check_push(self, header.worker, header.clock, header.base_version)
                staging = self._staging.get(header.worker)
                if staging is None:
                    staging = {k: torch.empty(n) for k, n in self.numel.items()}
                    self._staging[header.worker] = staging
        except BaseException:
            lock.release()
            raise
        return PushTicket(header=header, staging=staging, duplicate=duplicate, lock=lock)

    def _check_clock(self, h: PushHeader) -> bool:
        """Clocks advance by one per push. Returns True for an acknowledged retry."""
        if h.clock < 1:
            raise InvalidArgument(
                f"push clock must be >= 1 (the worker's clock after this push), got {h.clock}",
                reason="malformed",
            )
        last = self.clocks[h.worker]
        if h.clock <= last:
            if h.retry:
                return True
            raise FailedPrecondition(
                f"duplicate push: worker {h.worker} clock {h.clock} was already taken "
                f"(worker clock is {last}); never counted twice. Set retry=true when "
                f"re-sending a push whose reply was lost",
                reason="duplicate",
            )
        if h.worker not in self.live:
            raise FailedPrecondition(
                f"worker {h.worker} has left the job; it cannot push any more",
                reason="left",
            )
        if h.clock != last + 1:
            raise FailedPrecondition(
                f"out-of-order push: worker {h.worker} sent clock {h.clock}, expected {last + 1}",
                reason="out_of_order",
            )
        return False

    def add_data(self, ticket: PushTicket, key: str, offset: int, data: bytes) -> None:
        """Copy one piece of a push into the staging buffers (validated first)."""
        numel = self.numel.get(key)
        if numel is None:
            raise NotFound(f"unknown slot key {key!r}: this shard holds {_some(self.numel)}")
        if ticket.header.overflow:
            raise InvalidArgument("a push flagged overflow must carry no data", reason="malformed")
        itemsize = wire.DTYPE_ITEMSIZE[ticket.header.dtype]
        if len(data) % itemsize:
            raise InvalidArgument(
                f"slot {key!r}: {len(data)} bytes is not a whole number of "
                f"{itemsize}-byte elements",
            )
        n = len(data) // itemsize
        expected = ticket.received.get(key, 0)
        if offset != expected:
            raise InvalidArgument(
                f"slot {key!r}: piece at offset {offset}, expected {expected} (send each "
                f"slot's pieces once, in order)",
            )
        if offset + n > numel:
            raise InvalidArgument(
                f"slot {key!r}: {offset + n} elements sent but it holds {numel} (wrong shape)",
            )
        ticket.received[key] = offset + n
        ticket.bytes_in += len(data)
        if not ticket.duplicate and n:
            ticket.staging[key][offset : offset + n].copy_(wire.decode(data, ticket.header.dtype))

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
            if not h.overflow:
                short = [k for k, n in self.numel.items() if ticket.received.get(k, 0) != n]
                if short:
                    k = short[0]
                    raise InvalidArgument(
                        f"incomplete push: slot {k!r} got {ticket.received.get(k, 0)} of "
                        f"{self.numel[k]} elements ({len(short)} slots short)",
                    )
            grads = ticket.staging
            if not h.overflow:
                inv = 1.0 / h.loss_scale
                finite = True
                for t in grads.values():
                    if inv != 1.0:
                        t.mul_(inv)
                    finite = finite and bool(torch.isfinite(t).all())
                if not finite:
                    with self._cond:
                        sync = self.job is not None and self.job.mode == "sync"
                    if sync:
                        raise InvalidArgument(
                            "non-finite gradient without the overflow flag: in sync mode a "
                            "worker that sees inf/nan must push overflow=true (no data) so "
                            "every shard skips the round",
                            reason="nonfinite",
                        )
                    h.overflow = True  # async/ssp: dropped and counted below
            with self._cond:
                # Re-check under the lock: another thread may have moved the round on.
                self._check_clock(h)
                self.policy.check_push(self, h.worker, h.clock, h.base_version)
                staged = StagedPush(h.worker, h.clock, h.base_version, h.overflow, grads)
                if h.overflow and not self.policy.holds_gradients:
                    staged.grads = {}
                outcome = self.policy.accept(self, staged)
                self.clocks[h.worker] = h.clock
                self.metrics.push_accepted()
                self._cond.notify_all()
                return outcome, self.version, False
        finally:
            ticket.release()

    # ---- called by policies, under the lock -------------------------------------------

    def apply_update(self, grads: dict[str, torch.Tensor], staleness: list[int]) -> None:
        """One optimizer step with these fp32 gradients (keyed by slot)."""
        for key, p in self.masters.items():
            p.grad = grads[key]
        self.optimizer.step()
        self.scheduler.step()
        for p in self.masters.values():
            p.grad = None
        self.version += 1
        self.updates_applied += 1
        self.metrics.optimizer_step()
        self.metrics.set_version(self.version)
        for s in staleness:
            self.staleness_counts[s] += 1
            self.metrics.gradient_applied(s)
        if self.job is not None and self.job.mode == "sync":
            self._close_round(skipped=False)

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

    def drop_nonfinite(self) -> None:
        self.dropped_nonfinite += 1
        self.metrics.nonfinite_dropped()
        self.metrics.push_rejected("nonfinite")

    def slowest_live_clock(self, default: int) -> int:
        return min((self.clocks[w] for w in self.live), default=default)

    # ---- pull -----------------------------------------------------------------------

    def pull(
        self, worker: int, clock: int, dtype: torch.dtype, timeout: float | None
    ) -> tuple[PullHeader, list[tuple[str, int, bytes]]]:
        """Wait until the policy lets `worker` at `clock` read, then snapshot the weights."""
        started = time.monotonic()
        with self._cond:
            job = self._require_job()
            if not 0 <= worker < job.num_workers:
                raise InvalidArgument(
                    f"worker {worker} is not in this job (workers 0..{job.num_workers - 1})"
                )
            if dtype not in wire.WIRE_FROM_DTYPE:
                raise InvalidArgument(f"unsupported pull dtype {dtype}; ask for fp32, fp16 or bf16")
            if clock > self.clocks[worker]:
                raise FailedPrecondition(
                    f"worker {worker} pulls at clock {clock} but has pushed only "
                    f"{self.clocks[worker]} gradients here",
                    reason="out_of_order",
                )
            ok = self._cond.wait_for(lambda: self.policy.pull_ready(self, worker, clock), timeout)
            waited = time.monotonic() - started
            if not ok:
                raise DeadlineExceeded(
                    f"pull by worker {worker} at clock {clock} waited {waited:.1f}s ({job.mode}): "
                    f"round {self.rounds}, worker clocks {self.clocks}, live {sorted(self.live)}. "
                    "A worker is slow or gone; raise --pull-timeout or check the slowest worker",
                )
            if job.mode == "sync":
                self.metrics.barrier_wait(waited)
            elif job.mode == "ssp":
                self.metrics.ssp_wait(waited)
            gap = clock - self.slowest_live_clock(default=clock)
            self.max_clock_gap = max(self.max_clock_gap, gap)
            header = PullHeader(
                version=self.version,
                rounds=self.rounds,
                loss_scale=self.loss_scale.scale,
                last_round_skipped=self.last_round_skipped,
                skipped_rounds=self.skipped_rounds,
                dtype=dtype,
                clock_gap=gap,
            )
            pieces = self._snapshot(dtype)
        self.metrics.bytes_sent(sum(len(p[2]) for p in pieces))
        return header, pieces

    def _snapshot(self, dtype: torch.dtype) -> list[tuple[str, int, bytes]]:
        """Wire pieces of the current weights in `dtype`, shared by every pull of a version."""
        cached = self._snapshots.get(dtype)
        if cached is not None and cached[0] == self.version:
            return cached[1]
        pieces = []
        for key, p in self.masters.items():
            flat = p.detach() if dtype == torch.float32 else p.detach().to(dtype)
            for off, data in wire.iter_pieces(flat, self.message_bytes):
                pieces.append((key, off, data))
        self._snapshots[dtype] = (self.version, pieces)
        return pieces

    # ---- membership and inspection --------------------------------------------------

    def leave(self, worker: int) -> int:
        """`worker` is done: nobody waits for it any more. Returns live workers left."""
        with self._cond:
            job = self._require_job()
            if not 0 <= worker < job.num_workers:
                raise InvalidArgument(f"worker {worker} is not in this job")
            if worker in self.live:
                self.live.discard(worker)
                self.policy.on_leave(self, worker)
                self.metrics.set_live_workers(len(self.live))
                self._cond.notify_all()
            return len(self.live)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            hist_len = max(self.staleness_counts, default=-1) + 1
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
            }

    def state_digest(self) -> str:
        """sha256 of masters, optimizer state and counters: equal digests, equal state."""
        h = hashlib.sha256()
        with self._cond:
            h.update(f"{self.version}/{self.rounds}/{self.clocks}".encode())
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


def _same_job(a: Job, b: Job) -> bool:
    # shard_index/num_shards are part of the job, so a worker talking to the wrong
    # address (another job's shard 1 as its shard 0) is refused too.
    return a == b


def _some(keys: dict[str, int]) -> str:
    names = list(keys)
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(repr(k) for k in names[:3]) + more
