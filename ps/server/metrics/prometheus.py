"""Prometheus metrics of a parameter-server shard, and the helpers workers share.

Every :class:`ShardMetrics` owns its own :class:`~prometheus_client.CollectorRegistry`
(never the global default one): tests and benchmarks run several shards and workers in
one process, and a process-wide registry would mix their counters or refuse the second
registration outright.

All label values are fixed when the object is built: each child (every ``reason``,
``method``...) is created up front, so that

* a scrape taken before the first event already lists every series (dashboards and
  ``rate()`` see a 0 rather than a missing series), and
* the hot-path methods, called by the shard under its lock, are a dict lookup plus a
  lock-free-ish increment, with no label formatting.

Metric names are a contract (dashboards, alerts and ``docs/metrics.md`` refer to them);
``tests/test_metrics_unit.py`` pins them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from psar.ps.server.modes import BUILTIN
from psar.trainkit.choices import DEFAULT_MODE
from psar.trainkit.prom import (
    DURATION_BUCKETS,
    OTHER,
    STALENESS_BUCKETS,
    build_info,
    children,
    pick,
    psar_version,
    serve_metrics,
    stop_metrics,
)

__all__ = [
    "DURATION_BUCKETS",
    "OTHER",
    "RPC_METHODS",
    "SHARD_MODES",
    "SKIP_REASONS",
    "REJECT_REASONS",
    "STALENESS_BUCKETS",
    "ShardMetrics",
    "build_info",
    "psar_version",
    "serve_metrics",
    "stop_metrics",
]

REJECT_REASONS: tuple[str, ...] = (
    "bad_shape",
    "bad_dtype",
    "unknown_key",
    "duplicate",
    "out_of_order",
    "too_stale",
    "nonfinite",
    "not_initialized",
    "unauthenticated",
    "too_large",
    "malformed",
    # Raised by psar.ps.errors too: a push that hit a deadline or a draining shard.
    "deadline",
    "draining",
    # Fault tolerance (docs/reliability.md): a request against an older incarnation of a
    # restored shard, a worker whose lease expired, a join at a round already closed.
    "restored",
    "expired",
    "too_late",
    # An early pull whose worker hung up while it waited (ps/server/pulls/early.py).
    "cancelled",
    OTHER,
)

#: Why a whole update round was skipped (no optimizer step applied).
SKIP_REASONS: tuple[str, ...] = ("overflow", "nonfinite", "empty", OTHER)
DATA_TRANSPORTS: tuple[str, ...] = ("shm", "socket", OTHER)
"""How a data-plane connection's tensor bytes travel (docs/dataplane.md, "Shared memory")."""

RPC_METHODS: tuple[str, ...] = (
    "Init",
    "GetJob",
    "Push",
    "Pull",
    "Leave",
    "Stats",
    "Heartbeat",
    "Register",
    "Rollback",
    "Join",
    OTHER,
)

#: How a shard's live set changed (psar_ps_membership_changes_total's ``change``).
MEMBERSHIP_CHANGES: tuple[str, ...] = ("joined", "left", "expired", "rejoining")

SHARD_MODES: tuple[str, ...] = BUILTIN.names()
"""The ``mode`` label's values: the modes the stock shard serves (ps/server/modes/)."""


class _StampMode(Collector):
    """Expose an inner registry with the owner's current ``mode`` label added.

    A shard learns its mode only when the job arrives (Init), after its metrics endpoint
    is up and may already have counted RPCs or rejections.  Stamping the label at scrape
    time lets :meth:`ShardMetrics.set_mode` relabel everything without losing counts,
    and costs nothing on the hot path.
    """

    def __init__(self, inner: CollectorRegistry, owner: ShardMetrics) -> None:
        self._inner = inner
        self._owner = owner

    def collect(self) -> Iterable[Metric]:
        mode = self._owner.mode
        for fam in self._inner.collect():
            # collect() builds fresh Metric objects per call: safe to rewrite in place.
            fam.samples = [s._replace(labels={**s.labels, "mode": mode}) for s in fam.samples]
            yield fam

    def describe(self) -> Iterable[Metric]:
        # Lets the outer registry detect name clashes at registration.
        return list(self._inner.collect())


class ShardMetrics:
    """Metrics of one PS shard; the shard calls the methods below under its own lock.
    They are exactly psar.ps.server.recorder.ShardRecorder's (tests/test_recorders.py).

    Every series carries ``shard`` and ``mode`` labels (bounded: one value each per
    instance) so that several shards scraped into one Prometheus stay apart even when
    they share an ``instance``.  ``mode`` may be corrected once the job is known, with
    :meth:`set_mode`.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        shard: int = 0,
        mode: str = DEFAULT_MODE,
        modes: tuple[str, ...] = SHARD_MODES,
    ) -> None:
        self.modes = modes
        """The ``mode`` label's values (a shard serving more modes passes their names)."""
        if mode not in modes:
            raise ValueError(f"mode must be one of {modes}, got {mode!r}")
        if int(shard) < 0:
            raise ValueError(f"shard must be >= 0, got {shard}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.shard = int(shard)
        self.mode = mode
        # Metrics live in a private registry labelled by shard only; _StampMode adds
        # ``mode`` when the public registry is scraped.
        reg = CollectorRegistry()
        base = ["shard"]
        fixed = {"shard": str(self.shard)}

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, base, registry=reg).labels(**fixed)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, base, registry=reg).labels(**fixed)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, base, buckets=tuple(buckets), registry=reg).labels(**fixed)

        self._updates = counter(
            "psar_ps_updates_applied_total", "Optimizer steps applied to this shard."
        )
        self._skipped = children(
            Counter(
                "psar_ps_rounds_skipped_total",
                "Update rounds that ended without an optimizer step, by reason.",
                [*base, "reason"],
                registry=reg,
            ),
            "reason",
            SKIP_REASONS,
            **fixed,
        )
        self._staleness = histogram(
            "psar_ps_gradient_staleness",
            "Versions between the one a gradient was computed from and the one it was applied to.",
            STALENESS_BUCKETS,
        )
        self._rejected = children(
            Counter(
                "psar_ps_pushes_rejected_total",
                "Pushes refused before touching the parameters, by reason.",
                [*base, "reason"],
                registry=reg,
            ),
            "reason",
            REJECT_REASONS,
            **fixed,
        )
        self._accepted = counter(
            "psar_ps_pushes_accepted_total", "Pushes accepted into an update round."
        )
        self._nonfinite = counter(
            "psar_ps_nonfinite_dropped_total",
            "Gradients dropped because they held NaN or Inf values.",
        )
        self._chunks_early = counter(
            "psar_ps_chunks_applied_early_total",
            "sync --chunk-rounds: slots updated before their round's last push was in.",
        )
        self._chunk_undos = counter(
            "psar_ps_chunk_undos_total",
            "sync --chunk-rounds: rounds whose early slot updates were undone (an overflow, "
            "a refused push, a worker leaving mid-round).",
        )
        self._push_paced = counter(
            "psar_ps_push_paced_seconds_total",
            "sync --chunk-rounds, data plane: seconds pushes were held back because they ran "
            "--push-lead-mib ahead of the slowest push of their round (push pacing).",
        )
        self._data_connections = children(
            Counter(
                "psar_ps_data_connections_total",
                "Data-plane connections greeted, by how their tensor bytes travel: shm (a "
                "worker on this host's shared-memory ring) or socket.",
                [*base, "transport"],
                registry=reg,
            ),
            "transport",
            DATA_TRANSPORTS,
            **fixed,
        )
        self._early_slots = counter(
            "psar_ps_early_pull_slots_total",
            "Early pulls (--early-pull, --chunk-rounds): slots sent before their round closed.",
        )
        self._early_voids = counter(
            "psar_ps_early_pull_voids_total",
            "Early pulls whose early slots changed again before the round closed (an "
            "overflow, a worker leaving, an absent slot redone): every slot was sent again.",
        )
        self._params_updated = counter(
            "psar_ps_params_updated_total", "Parameters (fp32 elements) of applied updates."
        )
        self._update_seconds = counter(
            "psar_ps_update_seconds_total",
            "Wall seconds of optimizer steps; rate(params_updated) / rate(this) = params/s.",
        )
        self._rx = counter(
            "psar_ps_bytes_received_total", "Payload bytes received from workers (pushes)."
        )
        self._tx = counter("psar_ps_bytes_sent_total", "Payload bytes sent to workers (pulls).")
        self._rpc = children(
            Histogram(
                "psar_ps_rpc_duration_seconds",
                "Server-side handling time of each RPC, by method.",
                [*base, "method"],
                buckets=DURATION_BUCKETS,
                registry=reg,
            ),
            "method",
            RPC_METHODS,
            **fixed,
        )
        self._barrier = histogram(
            "psar_ps_barrier_wait_seconds",
            "Time sync-mode pulls waited for their round to close.",
            DURATION_BUCKETS,
        )
        self._ssp = histogram(
            "psar_ps_ssp_wait_seconds",
            "Time SSP-mode pulls waited for the slowest worker to come within the bound.",
            DURATION_BUCKETS,
        )
        self._live = gauge(
            "psar_ps_live_workers", "Workers currently registered and not timed out."
        )
        self._version = gauge("psar_ps_version", "Update rounds applied so far (shard version).")
        self._loss_scale = gauge(
            "psar_ps_loss_scale", "Current dynamic loss scale of mixed-precision training."
        )
        self._master_bytes = gauge(
            "psar_ps_master_bytes", "Bytes held by the master parameters and optimizer state."
        )
        # Fault tolerance (docs/reliability.md).
        self._lease_expirations = counter(
            "psar_ps_lease_expirations_total",
            "Workers dropped from the live set because their lease ran out.",
        )
        self._rejoins = counter(
            "psar_ps_worker_rejoins_total",
            "Workers that registered again after their lease expired, after leaving, or as "
            "a restarted process.",
        )
        # Elastic jobs (docs/elastic.md): the live set's changes and the data's deal.
        self._membership = children(
            Counter(
                "psar_ps_membership_changes_total",
                "Changes of the live set, by change: joined (a worker entered: at a round "
                "boundary in sync), left (Leave), expired (lease), rejoining (a live worker "
                "re-entering at a later round).",
                [*base, "change"],
                registry=reg,
            ),
            "change",
            MEMBERSHIP_CHANGES,
            **fixed,
        )
        self._max_workers = gauge(
            "psar_ps_max_workers", "Ranks the job has room for (--max-workers; else its size)."
        )
        self._data_dealt = counter(
            "psar_ps_data_batches_dealt_total",
            "Elastic data (shard 0): batch ids dealt to workers, given-back ones again.",
        )
        self._data_returned = counter(
            "psar_ps_data_batches_returned_total",
            "Elastic data (shard 0): batch ids given back by a worker that left or died "
            "before pushing them; dealt again to another.",
        )
        self._data_remaining = gauge(
            "psar_ps_data_batches_remaining",
            "Elastic data (shard 0): batch ids not dealt yet (0: the job's data is done).",
        )
        self._restores = counter(
            "psar_ps_restores_total",
            "Times this shard's state was replaced by a checkpoint (--restore, sync rollback).",
        )
        self._checkpoints = counter(
            "psar_ps_checkpoints_written_total", "Checkpoints written (atomically) to disk."
        )
        self._checkpoint_failures = counter(
            "psar_ps_checkpoint_failures_total",
            "Checkpoint writes that failed (the previous checkpoint stays the newest).",
        )
        self._checkpoint_seconds = histogram(
            "psar_ps_checkpoint_write_seconds",
            "Time to write one checkpoint (serialise, fsync, rename).",
            DURATION_BUCKETS,
        )
        self.registry.register(_StampMode(reg, self))
        build_info(self.registry, "ps")

    def set_mode(self, mode: str) -> None:
        """Set the ``mode`` label (``sync``/``async``/``ssp``), e.g. when Init brings the job.

        Counts recorded so far are kept and shown under the new mode.
        """
        if mode not in self.modes:
            raise ValueError(f"mode must be one of {self.modes}, got {mode!r}")
        self.mode = mode

    # -- counters ---------------------------------------------------------------------

    def optimizer_step(self) -> None:
        """One optimizer step was applied to the shard's parameters."""
        self._updates.inc()

    def gradient_applied(self, staleness: int) -> None:
        """A gradient computed at version ``v`` was applied at version ``v + staleness``."""
        self._staleness.observe(staleness)

    def push_accepted(self) -> None:
        """A push passed validation and joined an update round."""
        self._accepted.inc()

    def round_skipped(self, reason: str) -> None:
        """A round ended without a step (``overflow``, ``nonfinite``, ``empty``; else ``other``)."""
        pick(self._skipped, reason).inc()

    def push_rejected(self, reason: str) -> None:
        """A push was refused; an unknown ``reason`` is counted as ``other``."""
        pick(self._rejected, reason).inc()

    def nonfinite_dropped(self) -> None:
        """A gradient with NaN/Inf values was dropped."""
        self._nonfinite.inc()

    def chunk_applied_early(self) -> None:
        """A slot was updated while its round was still open (per-chunk rounds)."""
        self._chunks_early.inc()

    def chunk_undo(self) -> None:
        """A round's early slot updates were undone (per-chunk rounds)."""
        self._chunk_undos.inc()

    def push_paced(self, seconds: float) -> None:
        """A push waited `seconds` for the slowest push of its round (push pacing)."""
        self._push_paced.inc(seconds)

    def data_connection(self, transport: str) -> None:
        """A data-plane connection was greeted: "shm" or "socket"."""
        pick(self._data_connections, transport).inc()

    def early_pull_ended(self, slots: int, void: bool) -> None:
        """An early pull sent `slots` slots before its header; `void`: all again after."""
        self._early_slots.inc(slots)
        if void:
            self._early_voids.inc()

    def update_timed(self, params: int, seconds: float) -> None:
        """An update of ``params`` parameters took ``seconds`` of optimizer steps."""
        self._params_updated.inc(params)
        self._update_seconds.inc(seconds)

    def bytes_received(self, n: int) -> None:
        """``n`` payload bytes arrived from a worker."""
        self._rx.inc(n)

    def bytes_sent(self, n: int) -> None:
        """``n`` payload bytes went out to a worker."""
        self._tx.inc(n)

    def lease_expired(self) -> None:
        """A worker's lease ran out and it left the live set."""
        self._lease_expirations.inc()

    def worker_rejoined(self) -> None:
        """A worker registered again (after expiry, after leaving, or restarted)."""
        self._rejoins.inc()

    def membership_changed(self, change: str) -> None:
        """The live set changed (``joined``, ``left``, ``expired``, ``rejoining``)."""
        pick(self._membership, change).inc()

    def data_dealt(self, n: int, remaining: int) -> None:
        """Elastic data: ``n`` batch ids dealt; ``remaining`` not dealt yet."""
        self._data_dealt.inc(n)
        self._data_remaining.set(remaining)

    def data_returned(self, n: int) -> None:
        """Elastic data: ``n`` batch ids given back (their worker left or died)."""
        self._data_returned.inc(n)

    def shard_restored(self) -> None:
        """The shard took its state from a checkpoint (restore or rollback)."""
        self._restores.inc()

    def checkpoint_written(self, seconds: float) -> None:
        """A checkpoint reached disk after ``seconds``."""
        self._checkpoints.inc()
        self._checkpoint_seconds.observe(seconds)

    def checkpoint_failed(self) -> None:
        self._checkpoint_failures.inc()

    # -- durations --------------------------------------------------------------------

    def rpc_observed(self, method: str, seconds: float) -> None:
        """An RPC ``method`` took ``seconds`` to handle; unknown methods count as ``other``."""
        pick(self._rpc, method).observe(seconds)

    def barrier_wait(self, seconds: float) -> None:
        """A sync pull waited ``seconds`` for its round to close."""
        self._barrier.observe(seconds)

    def ssp_wait(self, seconds: float) -> None:
        """An SSP pull waited ``seconds`` for the slowest worker."""
        self._ssp.observe(seconds)

    # -- gauges -----------------------------------------------------------------------

    def set_live_workers(self, n: int) -> None:
        self._live.set(n)

    def set_max_workers(self, n: int) -> None:
        self._max_workers.set(n)

    def set_version(self, v: int) -> None:
        self._version.set(v)

    def set_loss_scale(self, s: float) -> None:
        self._loss_scale.set(s)

    def set_master_bytes(self, b: int) -> None:
        self._master_bytes.set(b)

    # -- exposition -------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (what a scrape returns)."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> tuple[WSGIServer, threading.Thread]:
        """Shortcut for :func:`serve_metrics` on this instance's registry."""
        return serve_metrics(self.registry, port, addr)
