"""PSBackend's part for elastic jobs (docs/elastic.md): joining a running job (--join: shard
0 gives a free rank; the job's size, length and data are the ones on the shards), the
batch ids shard 0 deals with each pull (the data follows membership), and leaving the job
once its data is dealt or the worker was told to stop (SIGTERM).

A part of ps/client/backend.py's PSBackend (it holds one as `elastic`; in an elastic job
it is also the backend's `dealer`, trainkit/backend.py), which provides the client, rank,
clock, local SGD part, pulls and the worker's config.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import grpc

from psar.ps.client.errors import PSClientError
from psar.ps.client.membership_calls import JobSizeMismatch
from psar.ps.headers import PullHeader
from psar.ps.job import Job

log = logging.getLogger("psar.ps")


class Elastic:
    """Membership and dealt data. `backend`: the PSBackend (typed Any: in ps/ an import of
    the backend here, even for annotations, would be a cycle)."""

    def __init__(self, backend: Any, cfg: Any, world_size: int) -> None:
        self.b = backend
        self.deals_data: bool = cfg.elastic
        """An elastic job: shard 0 deals this worker's batches (docs/elastic.md)."""
        self.data_plan: tuple[int, str] = (0, "")
        """Elastic data, rank 0: (the job's batch ids, how ids map to samples)."""
        self.deal: tuple[int, tuple[int, ...]] = (0, ())
        """Elastic data: (clock, the batch ids of that push's steps), from shard 0's last
        pull header (--mode local: the H inner steps of an outer round)."""
        self.deal_used = 0
        """--mode local: ids of the deal the inner steps took so far."""
        self.join_clock = 0
        """--join: the clock shard 0 said to register with (sync: the round after the
        open one; async/ssp: the slowest live worker's)."""
        self.given_rank = False
        """--join without --rank: shard 0 gave this worker its rank."""
        self.left_job = False
        self.said_joined = False
        self.writes_model = False
        """Shard 0 said, when this worker left, that it writes the job's final model
        (Dealer protocol: its push took the job's last batch ids; rank 0 may be gone)."""
        """--join: "joined" is logged once the first pull after Register answered."""
        self.world_size_now = world_size
        """The shards' live workers at the last pull (the job's size now)."""

    def took_header(self, header: PullHeader) -> None:
        """Shard 0's header of a pull: the batches of the next push, the job's size."""
        b = self.b
        self.joined(header)
        deal = (b.clock + 1, tuple(header.batches))
        if deal != self.deal:
            self.deal, self.deal_used = deal, 0
        self.world_size_now = header.live_workers
        b.metrics.set_world_size(self.world_size_now)

    def plan_data(self, total_batches: int, stream: str) -> None:
        """Elastic data (Backend protocol): the job's batch ids, 0..total_batches-1, and how
        the workers map ids to samples (`stream`: a job whose workers disagree is refused).
        Rank 0 tells the shards with the job."""
        self.data_plan = (total_batches, stream)

    def next_batches(self, *, stop: bool = False) -> list[int] | None:
        """Elastic data (Backend protocol): the batch ids of the next step, dealt by shard
        0 with the last pull; None when the job's data is all dealt or `stop` (SIGTERM:
        leave after the step just done). Either way this worker leaves the job now: a
        sync round no longer waits for it, and what it was dealt goes to the others."""
        b = self.b
        clock, ids = self.deal
        mid_round = b.local is not None and 0 < self.deal_used < len(ids)
        if (not stop or mid_round) and clock == b.clock + 1 and self.deal_used < len(ids):
            if b.local is None:
                return list(ids)  # a step whose push did not go out takes them again
            # --mode local leaves at an outer round's end: its inner steps count.
            take = ids[self.deal_used : self.deal_used + b.cfg.grad_accum]
            self.deal_used += len(take)
            return list(take)
        if not self.left_job:
            why = "asked to stop" if stop else "the job's data is all dealt"
            log.info("worker %d: %s; leaving the job after step %d", b.rank, why, b.clock)
            self._leave_job()
        return None

    def _leave_job(self) -> None:
        self.b.overlap.await_pull()
        self.writes_model = self.b.client.leave()
        self.left_job = True

    def _join_when_room(self) -> dict[str, Any]:
        """Shard 0's Join, waiting up to --timeout-s while the job holds its --max-workers
        workers (a killed worker's rank is free once its lease runs out; a worker started
        to replace it should wait for that, not fail)."""
        bound = self.b.cfg.ps.timeout_s
        deadline = time.monotonic() + bound
        said = 0.0
        while True:
            try:
                return self.b.client.join(self.b.instance)
            except PSClientError as e:
                if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                if time.monotonic() - said > 10:
                    log.info("--join: %s; waiting (up to --timeout-s %g)", e.details, bound)
                    said = time.monotonic()
                time.sleep(0.5)

    def enter_running_job(self, jobs: list[Job], served: Job) -> list[Job]:
        """--join: the job's size, length, data and schedule are the ones rank 0 chose
        (the shards hold them). No rank is taken yet: the caller first checks that this
        worker's job is the one served, then take_rank() (a worker refused for another
        model must not hold a rank of the job meanwhile: issue #45 defect 8)."""
        if not served.elastic:
            raise RuntimeError(
                f"--join: the job on the shards keeps its {served.num_workers} workers; start "
                "it with --max-workers N (every worker) to let workers join it"
            )
        b = self.b
        b.ctx = dataclasses.replace(b.ctx, world_size=served.num_workers)
        keep = ("num_workers", "max_workers", "data_batches")
        return [
            dataclasses.replace(
                job,
                **{k: getattr(served, k) for k in keep},
                optimizer=dataclasses.replace(
                    job.optimizer, total_steps=served.optimizer.total_steps
                ),
            )
            for job in jobs
        ]

    def check_size(self, served: Job | None) -> None:
        """A worker started with another --world-size than the job rank 0 initialised
        stops the job (every worker exits with one line, the shards' reason) and fails
        with one line itself; a joiner takes the job's size instead (issue #45 defect 13:
        rank 1 failed in a traceback and rank 0 trained alone, saying nothing)."""
        b = self.b
        if served is None or b.cfg.ps.join or served.num_workers == b.world_size:
            return
        b.client.stop_job(b.world_size)
        raise JobSizeMismatch(
            f"worker {b.rank} was started with --world-size {b.world_size}, but the job rank "
            f"0 initialised on the shards has {served.num_workers} workers; the job is "
            "stopped (every worker exits): restart the shards and start every worker with "
            "the same --world-size"
        )

    def take_rank(self) -> None:
        """--join without --rank, once the served job is this worker's: shard 0 gives it
        a free rank. A job whose data is all dealt has none to give: the worker says so
        and exits 0 (LateJoin) instead of waiting for a round nobody will close."""
        b = self.b
        if not b.cfg.ps.join or b.rank >= 0:
            return
        try:
            reply = self._join_when_room()
        except PSClientError as e:
            if e.code == grpc.StatusCode.FAILED_PRECONDITION and DATA_DONE in e.details:
                log.warning("--join: %s", e.details)
                raise LateJoin(0) from None
            raise
        b.ctx = dataclasses.replace(b.ctx, rank=reply["worker"])
        self.join_clock, self.given_rank = reply["clock"], True
        log.info("worker %d: rank given by shard 0; registering", b.rank)

    def joined(self, header: PullHeader) -> None:
        """The first pull after registering answered: the worker is in the job now."""
        if self.given_rank and not self.said_joined:
            self.said_joined = True
            log.info("worker %d: joined a job of %d live workers", self.b.rank,
                     header.live_workers)  # fmt: skip


class LateJoin(SystemExit):
    """--join found the job's data all dealt: nothing to train, not an error (exit 0).
    A SystemExit, so `psar train` ends with its code; code calling train() may catch it."""


DATA_DONE = "data is all dealt"
"""Shard 0's words refusing a Join to a job with no batch ids left (membership.py)."""


def elastic_note(have: Job, want: Job) -> str:
    """What differs in an elastic job's data, for the refusal's message."""
    if have.data_stream != want.data_stream:
        return f"; its data: {have.data_stream or 'cut per rank'}, this worker's: {want.data_stream or 'cut per rank'}"
    if have.max_workers != want.max_workers:
        return f"; --max-workers {have.max_workers} there, {want.max_workers} here"
    return ""
