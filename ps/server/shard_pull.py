"""Pulls of a ShardState (a mixin; ps/server/shard.py): wait for the policy, then send a
snapshot of the weights shared by every puller of a version. A pull waits holding its
thread (pull, the data plane) or parked on the event loop (pull_parked, gRPC)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import torch

from ps import wire
from ps.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from ps.headers import PullHeader
from ps.job import Job
from ps.server.early_pull import EarlyItem, check_pushed, early_ready, iter_early_pull
from ps.server.parking import Wake, in_pool, parking_of

if TYPE_CHECKING:
    from ps.server.shard import ShardState


class Pulls:
    """Needs ShardState's lock (_cond), job, policy, masters, clocks and metrics."""

    def pull(
        self: ShardState,
        worker: int,
        clock: int,
        dtype: torch.dtype,
        timeout: float | None,
        *,
        incarnation: int = 0,
        views: bool = False,
    ) -> tuple[PullHeader, list[tuple[str, int, Any]]]:
        """Wait until the policy lets `worker` at `clock` read, then snapshot the weights.
        This holds the calling thread while it waits (the data plane's socket threads);
        the gRPC door parks the call instead (pull_parked).

        views=True (a transport that sends buffers as they are, the TCP data plane): in
        sync mode fp32 pieces may be memoryviews of the masters instead of bytes copies."""
        started = time.monotonic()
        with self._cond:
            job, inc = self._admit_pull(worker, clock, dtype, incarnation)
            ok = self._cond.wait_for(self._pull_ready(worker, clock, inc), timeout)
            header, pieces = self._serve_pull(job, worker, clock, dtype, inc, views, ok, started)
        self.metrics.bytes_sent(sum(len(p[2]) for p in pieces))
        return header, pieces

    def pull_early(
        self: ShardState,
        worker: int,
        clock: int,
        dtype: torch.dtype,
        timeout: float,
        *,
        incarnation: int = 0,
        views: bool = False,
        alive: Callable[[], bool] = lambda: True,
    ) -> Iterator[EarlyItem]:
        """A pull of the round this worker is pushing now, its slots sent as they are
        applied, the header last (ps/server/early_pull.py). Holds the calling thread;
        alive(): is the worker still waiting for the answer (asked about once a second)."""
        return iter_early_pull(
            self, worker, clock, dtype, timeout, incarnation=incarnation, views=views, alive=alive
        )

    async def pull_parked(
        self: ShardState,
        worker: int,
        clock: int,
        dtype: torch.dtype,
        timeout: float,
        *,
        incarnation: int = 0,
        views: bool = False,
        executor: Executor | None = None,
        early: bool = False,
    ) -> tuple[PullHeader, list[tuple[str, int, Any]]]:
        """pull() for an asyncio server: the same checks, answers and errors, but a pull
        that has to wait parks (ps/server/parking.py) and holds no thread meanwhile. The
        short locked steps run in `executor`, never on the event loop.

        early: an early pull asked through gRPC, which does not stream early: it is
        answered as an ordinary one once this worker's push of `clock` is in."""
        started = time.monotonic()
        deadline = started + timeout
        parking = parking_of(self)
        wake = Wake()

        def step(waiter: Any, job: Any, inc: int) -> tuple[Any, Any, int, Any]:
            """Under the lock: serve the pull if it may read (or its time is up), else
            park it again. Returns (waiter, job, incarnation, served or None)."""
            with self._cond:
                parking.unpark(waiter)
                if job is None:  # the first step: admit it
                    job, inc = self._admit_pull(worker, clock, dtype, incarnation, early=early)
                ready = self._pull_ready(worker, clock, inc)
                if early:
                    ready = early_ready(self, worker, clock, inc)
                ok = ready()
                if ok or time.monotonic() >= deadline:
                    if early:
                        check_pushed(self, worker, clock, inc, timeout)
                    served = self._serve_pull(job, worker, clock, dtype, inc, views, ok, started)
                    return None, job, inc, served
                return parking.park(ready, wake), job, inc, None

        waiter, job, inc, served = None, None, 0, None
        try:
            waiter, job, inc, served = await in_pool(executor, step, None, None, 0)
            while served is None:
                await wake.wait(max(0.0, deadline - time.monotonic()))
                waiter, job, inc, served = await in_pool(executor, step, waiter, job, inc)
        finally:
            wake.closed = True  # cancelled (caller gone, server stopping): unpark for good
            parking.unpark(waiter)
        header, pieces = served
        self.metrics.bytes_sent(sum(len(p[2]) for p in pieces))
        return header, pieces

    def _admit_pull(
        self: ShardState,
        worker: int,
        clock: int,
        dtype: torch.dtype,
        incarnation: int,
        *,
        early: bool = False,
    ) -> tuple[Job, int]:
        """Under the lock: refuse a pull that can never be served; (job, incarnation).
        early: the pull may name the clock this worker is pushing now (early_pull.py)."""
        job = self._require_job()
        self.check_worker(worker)
        if dtype not in wire.WIRE_FROM_DTYPE:
            raise InvalidArgument(f"unsupported pull dtype {dtype}; ask for fp32, fp16 or bf16")
        self.check_incarnation(incarnation)
        if clock > self.clocks[worker] + (1 if early else 0):
            raise FailedPrecondition(
                f"worker {worker} pulls at clock {clock} but has pushed only "
                f"{self.clocks[worker]} gradients here"
                + (" (an early pull may name only the clock it is pushing)" if early else ""),
                reason="out_of_order",
            )
        self.touch(worker)
        return job, self.incarnation

    def _pull_ready(self: ShardState, worker: int, clock: int, inc: int) -> Callable[[], bool]:
        """When a waiting pull is to be looked at again (under the lock): it may read, the
        shard was restored or rolled back, or it drains with no round left to finish."""

        def ready() -> bool:
            return (
                self.policy.pull_ready(self, worker, clock)
                or self.incarnation != inc
                or (self.draining and not self.round_in_flight)
            )

        return ready

    def _serve_pull(
        self: ShardState,
        job: Job,
        worker: int,
        clock: int,
        dtype: torch.dtype,
        inc: int,
        views: bool,
        ok: bool,
        started: float,
    ) -> tuple[PullHeader, list[tuple[str, int, Any]]]:
        """Under the lock, once the wait ended (`ok`: ready() held): the header and pieces,
        or why not (restored, draining, deadline)."""
        waited = time.monotonic() - started
        self.check_incarnation(inc)
        if not self.policy.pull_ready(self, worker, clock):
            if ok:
                raise Unavailable("draining: this shard is shutting down; retry later")
            raise DeadlineExceeded(
                f"pull by worker {worker} at clock {clock} waited {waited:.1f}s ({job.mode}): "
                f"round {self.rounds}, worker clocks {self.clocks}, live {sorted(self.live)}. "
                "A worker is slow or gone; raise --pull-timeout or check the slowest worker",
            )
        self.policy.pull_waited(self, waited)
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
            int_buffers=self.int_buffers.for_pull(clock),
        )
        self.policy.settle(self)  # per-chunk rounds: the closed round's weights only
        self.policy.served(self, worker)  # async/ssp delay compensation keeps them
        return header, self._snapshot(dtype, views)

    def _snapshot(self: ShardState, dtype: torch.dtype, views: bool) -> list[tuple[str, int, Any]]:
        """Wire pieces of the current weights in `dtype`, shared by every pull of a version."""
        views = views and dtype == torch.float32 and self.job is not None
        views = views and self.policy.pull_views
        cached = self._snapshots.get((dtype, views))
        if cached is not None and cached[0] == (self.incarnation, self.version):
            return cached[1]
        pieces: list[tuple[str, int, Any]] = []
        # Sync fp32: views of the masters themselves, no copy. They cannot change while
        # a pull reads them: the next round needs this worker's next push, which it
        # sends only once its pull has landed. (A worker whose lease ran out mid-pull,
        # or a rollback, may see a torn copy; its next push is then refused and it
        # resyncs and pulls again.) async/ssp apply on every push: they copy (the
        # policy's `pull_views` says which). gRPC needs bytes: its pullers share one copy
        # per version.
        for key, p in self.masters.items():
            flat = p.detach() if dtype == torch.float32 else p.detach().to(dtype)
            for off, data in wire.iter_pieces(flat, self.message_bytes, copy=not views):
                pieces.append((key, off, data))
        self._snapshots[(dtype, views)] = ((self.incarnation, self.version), pieces)
        return pieces
