"""What a shard records: the one interface of its metrics, and the recorder that drops them.

Every component of a shard records through `ShardRecorder`; `ShardMetrics`
(ps/server/metrics/prometheus.py: Prometheus series, names pinned by docs/metrics.md) and
`NullShardRecorder` (no /metrics endpoint asked for) implement exactly these methods, so
a misspelt call fails at once instead of vanishing into a catch-all
(tests/test_recorders.py holds both the method sets and every call site to it).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ShardRecorder(Protocol):
    """The shard's metrics calls (see ShardMetrics for the series each one feeds)."""

    def set_mode(self, mode: str) -> None:
        """The job arrived: its consistency mode labels every series."""

    def optimizer_step(self) -> None:
        """One optimizer step was applied to the shard's parameters."""

    def gradient_applied(self, staleness: int) -> None:
        """A gradient computed at version v was applied at version v + staleness."""

    def push_accepted(self) -> None:
        """A push passed validation and went to the update rule."""

    def round_skipped(self, reason: str) -> None:
        """A round ended without a step."""

    def push_rejected(self, reason: str) -> None:
        """A push was refused (reason: the error's)."""

    def nonfinite_dropped(self) -> None:
        """A gradient with NaN/Inf values was dropped."""

    def chunk_applied_early(self) -> None:
        """A slot was updated while its round was still open (per-chunk rounds)."""

    def chunk_undo(self) -> None:
        """A round's early slot updates were undone (per-chunk rounds)."""

    def push_paced(self, seconds: float) -> None:
        """A push waited `seconds` for the slowest push of its round (push pacing)."""

    def data_connection(self, transport: str) -> None:
        """A data-plane connection was greeted; its tensor bytes go by `transport`:
        "shm" (the worker's shared-memory ring) or "socket"."""

    def early_pull_ended(self, slots: int, void: bool) -> None:
        """An early pull sent `slots` slots before its header; void: all again after."""

    def update_timed(self, params: int, seconds: float) -> None:
        """An update of `params` parameters took `seconds` of optimizer steps."""

    def bytes_received(self, n: int) -> None:
        """`n` payload bytes arrived from a worker."""

    def bytes_sent(self, n: int) -> None:
        """`n` payload bytes went out to a worker."""

    def lease_expired(self) -> None:
        """A worker's lease ran out and it left the live set."""

    def worker_rejoined(self) -> None:
        """A worker registered again."""

    def membership_changed(self, change: str) -> None:
        """The live set changed: joined, left, expired, rejoining (docs/elastic.md)."""

    def data_dealt(self, n: int, remaining: int) -> None:
        """Elastic data: `n` batch ids dealt; `remaining` not dealt yet."""

    def data_returned(self, n: int) -> None:
        """Elastic data: `n` batch ids given back by a worker that left or died."""

    def shard_restored(self) -> None:
        """The shard took its state from a checkpoint (restore or rollback)."""

    def checkpoint_written(self, seconds: float) -> None:
        """A checkpoint reached disk after `seconds`."""

    def checkpoint_failed(self) -> None:
        """A checkpoint write failed (the previous one stays the newest)."""

    def rpc_observed(self, method: str, seconds: float) -> None:
        """An RPC `method` took `seconds` to handle."""

    def barrier_wait(self, seconds: float) -> None:
        """A pull waited `seconds` for its round to close."""

    def ssp_wait(self, seconds: float) -> None:
        """A pull waited `seconds` for the slowest worker to come within the bound."""

    def set_live_workers(self, n: int) -> None:
        """Workers in the live set now."""

    def set_max_workers(self, n: int) -> None:
        """Ranks the job has room for (elastic: --max-workers)."""

    def set_version(self, v: int) -> None:
        """The shard's version now."""

    def set_loss_scale(self, s: float) -> None:
        """The shard-owned loss scale now."""

    def set_master_bytes(self, b: int) -> None:
        """Bytes of the fp32 masters."""


class NullShardRecorder:
    """A ShardRecorder that records nothing: exactly the interface's methods."""

    def set_mode(self, mode: str) -> None:
        pass

    def optimizer_step(self) -> None:
        pass

    def gradient_applied(self, staleness: int) -> None:
        pass

    def push_accepted(self) -> None:
        pass

    def round_skipped(self, reason: str) -> None:
        pass

    def push_rejected(self, reason: str) -> None:
        pass

    def nonfinite_dropped(self) -> None:
        pass

    def chunk_applied_early(self) -> None:
        pass

    def chunk_undo(self) -> None:
        pass

    def push_paced(self, seconds: float) -> None:
        pass

    def data_connection(self, transport: str) -> None:
        pass

    def early_pull_ended(self, slots: int, void: bool) -> None:
        pass

    def update_timed(self, params: int, seconds: float) -> None:
        pass

    def bytes_received(self, n: int) -> None:
        pass

    def bytes_sent(self, n: int) -> None:
        pass

    def lease_expired(self) -> None:
        pass

    def worker_rejoined(self) -> None:
        pass

    def membership_changed(self, change: str) -> None:
        pass

    def data_dealt(self, n: int, remaining: int) -> None:
        pass

    def data_returned(self, n: int) -> None:
        pass

    def shard_restored(self) -> None:
        pass

    def checkpoint_written(self, seconds: float) -> None:
        pass

    def checkpoint_failed(self) -> None:
        pass

    def rpc_observed(self, method: str, seconds: float) -> None:
        pass

    def barrier_wait(self, seconds: float) -> None:
        pass

    def ssp_wait(self, seconds: float) -> None:
        pass

    def set_live_workers(self, n: int) -> None:
        pass

    def set_max_workers(self, n: int) -> None:
        pass

    def set_version(self, v: int) -> None:
        pass

    def set_loss_scale(self, s: float) -> None:
        pass

    def set_master_bytes(self, b: int) -> None:
        pass
