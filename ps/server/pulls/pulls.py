"""A shard's pulls (a component of the shard, ps/server/shard.py): wait for the update rule,
then send a snapshot of the weights shared by every puller of a version. A pull waits
holding its thread (pull, the data plane) or parked on the event loop (pull_parked, gRPC);
an early pull streams while its push still arrives (ps/server/pulls/early.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any

import torch

from psar.ps import wire
from psar.ps.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from psar.ps.headers import PullHeader
from psar.ps.job import Job
from psar.ps.server.membership.membership import Membership
from psar.ps.server.pulls.early import ALIVE_EVERY_S, EarlyItem, check_alive, next_applied
from psar.ps.server.pulls.parking import Wake, in_pool, parking_of, wait_until
from psar.ps.server.state import ShardData
from psar.ps.server.update.updates import Updates


class Pulls:
    """Serves a shard's pulls (see the module docstring): admits them (membership), waits
    for the update rule (handed `updates`, its ShardView), snapshots the masters."""

    def __init__(self, data: ShardData, members: Membership, updates: Updates) -> None:
        self.data = data
        self.members = members
        self.updates = updates
        self._snapshots: dict[
            tuple[torch.dtype, bool, bool], tuple[Any, list[tuple[str, int, Any]]]
        ] = {}
        """(dtype, views) -> ((incarnation, version), pieces): every pull of a version
        shares them."""

    def forget(self) -> None:
        """The state was replaced (restore, rollback): cached snapshots are void."""
        self._snapshots.clear()

    def pull(
        self,
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
        d = self.data
        started = time.monotonic()
        with d.cond:
            job, inc = self.admit(worker, clock, dtype, incarnation)
            ok = d.cond.wait_for(self.ready(worker, clock, inc), timeout)
            header, pieces = self.serve(job, worker, clock, dtype, inc, views, ok, started)
        d.metrics.bytes_sent(sum(len(p[2]) for p in pieces))
        return header, pieces

    def pull_early(
        self,
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
        applied, the header last (ps/server/pulls/early.py): the items in the order they go
        on the wire. Refusals (a bad dtype, an old incarnation, a clock this worker is not
        pushing) raise at the first next(), before anything is sent; a deadline raises
        after the early pieces. Holds the calling thread.

        alive(): is the worker still there? Asked about once a second while the pull
        waits: a worker whose push failed cuts its early pull short, and the round this
        pull waits for may then never close; Cancelled frees the thread instead of
        holding it to the deadline."""
        d = self.data
        started = time.monotonic()
        deadline = started + timeout
        with d.cond:
            job, inc = self.admit(worker, clock, dtype, incarnation, early=True)
            policy = d.policy
        sent: dict[str, int] = {}
        early_bytes = 0
        if policy.applies_chunks:
            while (got := next_applied(d, policy, clock, dtype, sent, deadline, alive)) is not None:
                for key, stamp, pieces in got:
                    sent[key] = stamp
                    for off, data in pieces:
                        early_bytes += len(data)
                        yield ("piece", key, off, data)
        with d.cond:
            ready = self._early_ready(worker, clock, inc)
            while not (ok := ready()) and (left := deadline - time.monotonic()) > 0:
                d.cond.wait(min(left, ALIVE_EVERY_S))
                check_alive(alive, clock)
            self._check_pushed(worker, clock, inc, timeout)
            header, pieces = self.serve(job, worker, clock, dtype, inc, views, ok, started)
            void = policy is not d.policy or any(
                policy.slot_writes(k) != n for k, n in sent.items()
            )
            if sent:
                policy.early_slots += len(sent)
                policy.early_voids += int(void)
                d.metrics.early_pull_ended(len(sent), void)
        rest = sum(len(p[2]) for p in pieces if void or p[0] not in sent)
        d.metrics.bytes_sent(early_bytes + rest)
        yield ("header", header, void)
        for key, off, data in pieces:
            if void or key not in sent:
                yield ("piece", key, off, data)

    def _early_ready(self, worker: int, clock: int, inc: int) -> Callable[[], bool]:
        """The ordinary pull's condition, and this worker's own push of `clock` is in (an
        async shard would answer at once, before the gradient it is waiting on)."""
        ready = self.ready(worker, clock, inc)
        d = self.data
        return lambda: ready() and (d.clocks[worker] >= clock or d.incarnation != inc)

    def _check_pushed(self, worker: int, clock: int, inc: int, timeout: float) -> None:
        """Under the lock, once an early pull's wait ended: refuse it if the shard moved to
        another incarnation or the worker's push of `clock` never came."""
        self.members.check_incarnation(inc)
        if self.data.clocks[worker] < clock:
            raise DeadlineExceeded(
                f"early pull by worker {worker} at clock {clock}: its push of that clock did "
                f"not arrive within {timeout:.1f}s; check the worker's push errors"
            )

    async def pull_parked(
        self,
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
        that has to wait parks (ps/server/pulls/parking.py) and holds no thread meanwhile. The
        short locked steps run in `executor`, never on the event loop.

        early: an early pull asked through gRPC, which does not stream early: it is
        answered as an ordinary one once this worker's push of `clock` is in."""
        started = time.monotonic()
        deadline = started + timeout
        parking = parking_of(self.data)
        wake = Wake()

        def step(waiter: Any, job: Any, inc: int) -> tuple[Any, Any, int, Any]:
            """Under the lock: serve the pull if it may read (or its time is up), else
            park it again. Returns (waiter, job, incarnation, served or None)."""
            with self.data.cond:
                parking.unpark(waiter)
                if job is None:  # the first step: admit it
                    job, inc = self.admit(worker, clock, dtype, incarnation, early=early)
                ready = self.ready(worker, clock, inc)
                if early:
                    ready = self._early_ready(worker, clock, inc)
                ok = ready()
                if ok or time.monotonic() >= deadline:
                    if early:
                        self._check_pushed(worker, clock, inc, timeout)
                    served = self.serve(job, worker, clock, dtype, inc, views, ok, started)
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
        self.data.metrics.bytes_sent(sum(len(p[2]) for p in pieces))
        return header, pieces

    # ---- clipping in rounds: a round's part of the squared norm (RoundNorm) -------------

    def round_norm(
        self, worker: int, clock: int, timeout: float, *, incarnation: int = 0
    ) -> tuple[float, bool]:
        """This shard's part of round `clock`'s squared norm and whether the round was
        skipped (ps/server/update/clipping.py), once every push of the round is in: this
        holds the calling thread while it waits (round_norm_parked does not)."""
        d = self.data
        started = time.monotonic()
        with d.cond:
            _, inc = self.admit(worker, clock, torch.float32, incarnation)
            d.cond.wait_for(self._norm_ready(clock, inc), timeout)
            return self._norm_answer(worker, clock, inc, started)

    async def round_norm_parked(
        self,
        worker: int,
        clock: int,
        timeout: float,
        *,
        incarnation: int = 0,
        executor: Executor | None = None,
    ) -> tuple[float, bool]:
        """round_norm for an asyncio server: a wait parks, holding no thread."""
        d = self.data
        started = time.monotonic()
        deadline = started + timeout

        def admit() -> int:
            with d.cond:
                return self.admit(worker, clock, torch.float32, incarnation)[1]

        inc = await in_pool(executor, admit)
        ready = self._norm_ready(clock, inc)
        while not await wait_until(d, ready, max(0.0, deadline - time.monotonic()), executor):
            if time.monotonic() >= deadline:
                break

        def answer() -> tuple[float, bool]:
            with d.cond:
                return self._norm_answer(worker, clock, inc, started)

        return await in_pool(executor, answer)

    def _norm_ready(self, clock: int, inc: int) -> Callable[[], bool]:
        d = self.data
        return lambda: self.updates.round_norm(clock) is not None or d.incarnation != inc

    def _norm_answer(self, worker: int, clock: int, inc: int, started: float) -> tuple[float, bool]:
        """Under the lock, once the wait ended: the part, or why not."""
        self.members.check_incarnation(inc)
        got = self.updates.round_norm(clock)
        if got is None:
            d = self.data
            raise DeadlineExceeded(
                f"RoundNorm by worker {worker} for round {clock} waited "
                f"{time.monotonic() - started:.1f}s: round {d.rounds}, worker clocks "
                f"{d.clocks}, live {sorted(d.live)}. A worker is slow or gone; raise "
                "--pull-timeout or check the slowest worker"
            )
        return got

    def release_held(self, clock: int, total_sq: float, *, incarnation: int = 0) -> None:
        """A pull brought round `clock`'s total squared norm: apply the round's held update
        clipped, if this shard still holds it (ps/server/update/clipping.py)."""
        with self.data.cond:
            self.members.check_incarnation(incarnation)
            self.updates.release_held(clock, total_sq)

    def admit(
        self,
        worker: int,
        clock: int,
        dtype: torch.dtype,
        incarnation: int,
        *,
        early: bool = False,
    ) -> tuple[Job, int]:
        """Under the lock: refuse a pull that can never be served; (job, incarnation).
        early: the pull may name the clock this worker is pushing now (early_pull.py)."""
        d = self.data
        job = d.require_job()
        self.members.check_worker(worker)
        if dtype not in wire.WIRE_FROM_DTYPE:
            raise InvalidArgument(f"unsupported pull dtype {dtype}; ask for fp32, fp16 or bf16")
        self.members.check_incarnation(incarnation)
        if clock > d.clocks[worker] + (1 if early else 0):
            raise FailedPrecondition(
                f"worker {worker} pulls at clock {clock} but has pushed only "
                f"{d.clocks[worker]} gradients here"
                + (" (an early pull may name only the clock it is pushing)" if early else ""),
                reason="out_of_order",
            )
        self.members.touch(worker)
        return job, d.incarnation

    def ready(self, worker: int, clock: int, inc: int) -> Callable[[], bool]:
        """When a waiting pull is to be looked at again (under the lock): it may read, the
        shard was restored or rolled back, or it drains with no round left to finish."""

        def ready() -> bool:
            return (
                self.updates.policy.pull_ready(self.updates, worker, clock)
                or self.data.incarnation != inc
                or (
                    self.data.draining
                    and not self.updates.policy.round_in_flight()
                    and self.data.held is None  # a round held for its norm is in flight
                )
            )

        return ready

    def serve(
        self,
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
        d = self.data
        waited = time.monotonic() - started
        self.members.check_incarnation(inc)
        if not self.updates.policy.pull_ready(self.updates, worker, clock):
            if ok:
                raise Unavailable("draining: this shard is shutting down; retry later")
            raise DeadlineExceeded(
                f"pull by worker {worker} at clock {clock} waited {waited:.1f}s ({job.mode}): "
                f"round {d.rounds}, worker clocks {d.clocks}, live {sorted(d.live)}. "
                "A worker is slow or gone; raise --pull-timeout or check the slowest worker",
            )
        self.updates.policy.pull_waited(self.updates, waited)
        gap = clock - d.slowest_live_clock(default=clock)
        d.max_clock_gap = max(d.max_clock_gap, gap)
        batches, data_done = self.members.deal(worker, clock + 1)  # its next step's data
        header = PullHeader(
            version=d.version,
            rounds=d.rounds,
            loss_scale=d.loss_scale.scale,
            last_round_skipped=d.last_round_skipped,
            skipped_rounds=d.skipped_rounds,
            dtype=dtype,
            clock_gap=gap,
            int_buffers=d.int_buffers.for_pull(clock),
            batches=batches,
            data_done=data_done,
            live_workers=len(d.live),
        )
        self.updates.policy.settle(
            self.updates
        )  # per-chunk rounds: the closed round's weights only
        self.updates.policy.served(self.updates, worker)  # async/ssp delay compensation keeps them
        return header, self._snapshot(dtype, views)

    def _snapshot(self, dtype: torch.dtype, views: bool) -> list[tuple[str, int, Any]]:
        """Wire pieces of the current weights in `dtype`, shared by every pull of a version
        (`views`: the caller sends memoryviews as they are; gRPC needs bytes)."""
        d = self.data
        sendable = views
        views = views and dtype == torch.float32 and d.job is not None
        views = views and self.updates.policy.pull_views
        key = (dtype, views, sendable)
        cached = self._snapshots.get(key)
        if cached is not None and cached[0] == (d.incarnation, d.version):
            return cached[1]
        # The last version's pieces go now (a pull still sending them keeps its own
        # reference), not once the new ones exist: two snapshots at once were a shard's
        # peak memory with low-precision pulls.
        self._snapshots.pop(key, None)
        pieces: list[tuple[str, int, Any]] = []
        # Sync fp32: views of the masters themselves, no copy. They cannot change while
        # a pull reads them: the next round needs this worker's next push, which it
        # sends only once its pull has landed. (A worker whose lease ran out mid-pull,
        # or a rollback, may see a torn copy; its next push is then refused and it
        # resyncs and pulls again.) async/ssp apply on every push: they copy (the
        # policy's `pull_views` says which). Another dtype is a converted copy already:
        # the data plane sends views of it. gRPC needs bytes: its pullers share one copy
        # per version.
        for k, p in d.masters.items():
            if dtype == torch.float32:
                flat, copy = p.detach(), not views
            else:
                flat, copy = p.detach().to(dtype), not sendable
            for off, data in wire.iter_pieces(flat, d.message_bytes, copy=copy):
                pieces.append((k, off, data))
        self._snapshots[key] = ((d.incarnation, d.version), pieces)
        return pieces
