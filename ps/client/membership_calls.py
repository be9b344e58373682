"""PSClient's membership calls: Register, Join, Leave, Rollback, Heartbeat
(docs/reliability.md, docs/elastic.md), and
rank 0's report that it could not initialise the shards (ReportInitFailure).

A part of psar.ps.client.psclient.PSClient (it holds one), which provides the stubs, `_retrying`, `_each`,
`incarnations`, `lease_s` and the heartbeat thread's stop event.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from psar.ps import serde
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.errors import PSClientError

log = logging.getLogger("psar.client")

INIT_FAILED_PREFIX = serde.INIT_FAILED_PREFIX
JOB_STOPPED_PREFIX = serde.JOB_STOPPED_PREFIX


class InitFailed(PSClientError):
    """A shard says rank 0 could not initialise it (its details carry rank 0's error):
    waiting longer for the job is pointless."""


class JobStopped(PSClientError, ValueError):
    """The job was stopped: its workers disagree about its size, or one failed a step
    the others wait on (StopJob). A ValueError too, as a flag or a loop of this worker's
    or another's is wrong: `psar train` ends with the shard's one line (exit 2), not a
    traceback."""


class JobSizeMismatch(ValueError):
    """This worker's --world-size is not the job's (rank 0's): it stopped the job."""


class MembershipCalls:
    """A part of PSClient: Register (and query), Join, Leave, Rollback and Heartbeat on the shards; the client holds the state they change (instance, incarnations, lease_s, the heartbeat thread)."""

    def __init__(self, client: Any) -> None:
        self.c = client
        """The PSClient this part serves: its stubs, retries and per-shard state."""

    def register(
        self,
        *,
        clock: int = 0,
        query: bool = False,
        instance: str = "",
        shards: Sequence[int] | None = None,
        joined: bool = False,
    ) -> list[dict[str, Any]]:
        """Register (or with query, only read the record) on every shard or `shards`.
        Each reply's incarnation becomes the one this client's requests carry. joined:
        this worker's rank came from Join (a new worker, never counted as a rejoin)."""
        if instance and not query:
            self.c.instance = instance

        def one(i: int) -> dict[str, Any]:
            req = pb.RegisterRequest(
                worker=self.c.worker, clock=clock, query=query, instance=instance, joined=joined
            )
            r = self.c._retrying(
                i, lambda _r: self.c._stubs[i].Register(req, timeout=self.c.cfg.timeout_s)
            )
            self.c.incarnations[i] = r.incarnation
            self.c.lease_s = max(self.c.lease_s, r.lease_s)
            return {
                "shard": i,
                "incarnation": r.incarnation,
                "clock": r.clock,
                "version": r.version,
                "rounds": r.rounds,
                "live": r.live,
                "rejoined": r.rejoined,
                "lease_s": r.lease_s,
                "restored": r.restored,
                "restores": r.restores,
            }

        return self.c._each(one, shards)

    def join(self, instance: str) -> dict[str, Any]:
        """Elastic jobs: ask shard 0 for a free rank ({worker, live_workers, clock}: the
        clock to register with). The client then speaks as that worker."""
        r = self.c._retrying(
            0,
            lambda _r: self.c._stubs[0].Join(
                pb.JoinRequest(instance=instance), timeout=self.c.cfg.timeout_s
            ),
        )
        self.c.worker = r.worker
        self.c.instance = instance
        return {"worker": r.worker, "live_workers": r.live_workers, "clock": r.clock}

    def leave(self) -> bool:
        """Tell every shard this worker is done, so nobody waits for it. It names the
        instance this client registered as: only the rank's holder may leave it.
        Returns shard 0's word on whether this worker writes the job's final model
        (elastic jobs, LeaveReply.write_model)."""
        req = pb.LeaveRequest(worker=self.c.worker, instance=self.c.instance)

        def one(i: int) -> Any:
            return self.c._retrying(
                i, lambda _r: self.c._stubs[i].Leave(req, timeout=self.c.cfg.timeout_s)
            )

        replies = self.c._each(one)
        return bool(replies and replies[0].write_model)

    def stop_job(self, num_workers: int, reason: str = "") -> None:
        """Tell every shard that this worker was started with --world-size `num_workers`,
        another size than the job's, or (`reason`) that it failed a step the others wait
        on: the job stops, and every worker with it, told why. Best effort, never raises
        (the caller raises its own error next): a shard it cannot reach is logged."""
        req = pb.StopJobRequest(
            worker=max(self.c.worker, 0), num_workers=num_workers, reason=reason
        )

        def one(i: int) -> None:
            try:
                self.c._stubs[i].StopJob(req, timeout=self.c.cfg.timeout_s)
            except grpc.RpcError as e:
                log.warning("could not tell shard %d to stop the job: %s", i, e.details())

        self.c._each(one)

    def rollback(self, shard: int, max_round: int) -> dict[str, Any]:
        """sync: roll `shard` back to its newest checkpoint at a round <= max_round."""
        r = self.c._retrying(
            shard,
            lambda _r: self.c._stubs[shard].Rollback(
                pb.RollbackRequest(max_round=max_round), timeout=self.c.cfg.timeout_s
            ),
        )
        return {
            "rounds": r.rounds,
            "version": r.version,
            "incarnation": r.incarnation,
            "rolled_back": r.rolled_back,
        }

    def report_init_failure(self, error: str) -> None:
        """Rank 0: tell every shard that the init failed and why, so the other workers,
        waiting for it in GetJob, fail now with this reason. Best effort, never raises:
        it runs while rank 0 is already failing (a shard it cannot reach is logged)."""

        def one(i: int) -> None:
            req = serde.init_failure_to_pb(self.c.worker, error)
            try:
                self.c._stubs[i].ReportInitFailure(req, timeout=self.c.cfg.timeout_s)
            except grpc.RpcError as e:
                log.warning("could not tell shard %d that the init failed: %s", i, e)

        try:
            self.c._each(one)
        except Exception:  # noqa: BLE001 - never hide the init's own error behind this
            log.exception("could not tell the shards that the init failed")

    def heartbeat(self) -> list[bool | None]:
        """One heartbeat to every shard: live or not (None where it failed)."""
        out: list[bool | None] = []
        for i, stub in enumerate(self.c._stubs):
            try:
                timeout = max(0.5, self.c.lease_s / 3) if self.c.lease_s else 5.0
                r = stub.Heartbeat(pb.HeartbeatRequest(worker=self.c.worker), timeout=timeout)
                out.append(r.live)
            except grpc.RpcError as e:
                log.debug("heartbeat to shard %d failed: %s", i, e)
                out.append(None)
        return out

    def start_heartbeats(self, lease_s: float | None = None) -> None:
        """Heartbeat every lease_s / 3 from a daemon thread until close()."""
        lease = lease_s or self.c.lease_s
        if self.c._beat is not None or not lease:
            return
        period = lease / 3

        def run() -> None:
            while not self.c._beat_stop.wait(period):
                self.heartbeat()

        self.c._beat = threading.Thread(target=run, name="psar-heartbeat", daemon=True)
        self.c._beat.start()

    def stats(self) -> list[dict[str, Any]]:
        """Each shard's counters (version, rounds, clocks, staleness histogram, digest)."""

        def one(i: int) -> dict[str, Any]:
            r = self.c._retrying(
                i,
                lambda _r: self.c._stubs[i].Stats(pb.StatsRequest(), timeout=self.c.cfg.timeout_s),
            )
            return {
                "version": r.version,
                "rounds": r.rounds,
                "updates_applied": r.updates_applied,
                "skipped_rounds": r.skipped_rounds,
                "dropped_nonfinite": r.dropped_nonfinite,
                "live_workers": r.live_workers,
                "loss_scale": r.loss_scale,
                "worker_clocks": list(r.worker_clocks),
                "max_clock_gap": r.max_clock_gap,
                "staleness_histogram": list(r.staleness_histogram),
                "master_bytes": r.master_bytes,
                "state_digest": r.state_digest,
                "incarnation": r.incarnation,
                "restores": r.restores,
                "restored_step": r.restored_step,
                "lease_expirations": r.lease_expirations,
                "rejoins": r.rejoins,
                "checkpoints_written": r.checkpoints_written,
                "last_checkpoint_step": r.last_checkpoint_step,
                "live_worker_ids": list(r.live_worker_ids),
                "draining": r.draining,
                "chunks_applied_early": r.chunks_applied_early,
                "chunk_undos": r.chunk_undos,
                "update_params_per_s": r.update_params_per_s,
                "early_pull_slots": r.early_pull_slots,
                "early_pull_voids": r.early_pull_voids,
                "push_paced_s": r.push_paced_s,
                "joins": r.joins,
                "leaves": r.leaves,
                "data_dealt": r.data_dealt,
                "data_returned": r.data_returned,
                "data_remaining": r.data_remaining,
                "optimizer_impl": r.optimizer_impl,
                "gradient_bytes": r.gradient_bytes,
                "workers_took_part": r.workers_took_part,
            }

        return self.c._each(one)
