"""Prometheus metrics of one training worker (either architecture).

Like :class:`psar.ps.server.metrics.ShardMetrics`, each :class:`WorkerMetrics` owns its registry
(several workers run in one test process) and creates every labelled child up front,
so the first scrape lists every series and the per-step methods stay cheap.

The serving helpers live in :mod:`psar.ps.server.metrics.prometheus` (one implementation); they are
re-exported here so worker code needs a single import.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from psar.trainkit.prom import (
    DURATION_BUCKETS,
    OTHER,
    STALENESS_BUCKETS,
    build_info,
    children,
    serve_metrics,
    stop_metrics,
)

__all__ = ["ARCHS", "PHASES", "WorkerMetrics", "serve_metrics", "stop_metrics"]

ARCHS: tuple[str, ...] = ("ps", "allreduce", "hybrid")

#: Where a step's wall time goes.  PS workers use push/pull/wait, DDP workers use
#: allreduce; both use the rest.  ``other`` absorbs unexpected names (bounded labels).
PHASES: tuple[str, ...] = (
    "data",
    "forward",
    "backward",
    "push",
    "pull",
    "wait",
    "allreduce",
    "optimizer",
    OTHER,
)


class WorkerMetrics:
    """Metrics of one worker; every series carries the ``arch`` label (``ps``/``allreduce``).
    Its recording methods are exactly psar.trainkit.recorder.WorkerRecorder's (tests/test_recorders.py)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, arch: str) -> None:
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.arch = arch
        reg = self.registry
        base = ["arch"]

        self._samples = Counter(
            "psar_worker_samples_total",
            "Training samples this worker processed.",
            base,
            registry=reg,
        ).labels(arch)
        self._steps = Counter(
            "psar_worker_steps_total", "Training steps this worker finished.", base, registry=reg
        ).labels(arch)
        self._phases = children(
            Histogram(
                "psar_worker_step_phase_seconds",
                "Wall time spent in each phase of a training step.",
                [*base, "phase"],
                buckets=DURATION_BUCKETS,
                registry=reg,
            ),
            "phase",
            PHASES,
            arch=arch,
        )
        self._loss = Gauge(
            "psar_worker_loss", "Training loss of the latest step.", base, registry=reg
        ).labels(arch)
        self._loss_scale = Gauge(
            "psar_worker_loss_scale",
            "Dynamic loss scale the worker used for the latest step.",
            base,
            registry=reg,
        ).labels(arch)
        self._overflow = Counter(
            "psar_worker_overflow_steps_total",
            "Steps whose scaled gradients overflowed (step skipped, scale lowered).",
            base,
            registry=reg,
        ).labels(arch)
        self._staleness = Histogram(
            "psar_worker_observed_staleness",
            "Versions the shard advanced between this worker's pull and its push (PS modes).",
            base,
            buckets=STALENESS_BUCKETS,
            registry=reg,
        ).labels(arch)
        self._outer_rounds = Counter(
            "psar_worker_outer_rounds_total",
            "--mode local: outer rounds (synchronisations of pseudo-gradients) finished.",
            base,
            registry=reg,
        ).labels(arch)
        self._outer_round_bytes = Gauge(
            "psar_worker_outer_round_bytes",
            "--mode local: bytes this worker moved for the latest outer round.",
            base,
            registry=reg,
        ).labels(arch)
        self._sync_drift = Gauge(
            "psar_worker_sync_drift",
            "--mode local: L2 norm of this worker's weights minus the shared weights of the "
            "last sync, at the latest sync.",
            base,
            registry=reg,
        ).labels(arch)
        self._world_size = Gauge(
            "psar_worker_world_size",
            "Workers in the job as this worker sees it: the shards' live workers at its "
            "latest pull (ps; elastic jobs change it), the process group's size (allreduce).",
            base,
            registry=reg,
        ).labels(arch)
        hot = "Sparse rows the worker's hot-row caches (--hot-row-cache) "
        self._cache_lookups = Counter(
            "psar_worker_hot_row_lookups_total", hot + "looked up.", base, registry=reg
        ).labels(arch)
        self._cache_hits = Counter(
            "psar_worker_hot_row_hits_total", hot + "served (not pulled).", base, registry=reg
        ).labels(arch)
        self._cache_bytes = Counter(
            "psar_worker_hot_row_bytes_saved_total",
            "Bytes the rows served by the worker's hot-row caches would have cost to pull.",
            base,
            registry=reg,
        ).labels(arch)
        build_info(reg, arch)

    def step_done(self, samples: int) -> None:
        """A step over ``samples`` samples finished."""
        self._steps.inc()
        self._samples.inc(samples)

    def phase(self, name: str, seconds: float) -> None:
        """``seconds`` were spent in phase ``name``; unknown names count as ``other``."""
        child = self._phases.get(name)
        (child if child is not None else self._phases[OTHER]).observe(seconds)

    @contextmanager
    def time_phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` body as phase ``name`` (monotonic clock)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase(name, time.perf_counter() - start)

    def set_loss(self, v: float) -> None:
        self._loss.set(v)

    def set_loss_scale(self, v: float) -> None:
        self._loss_scale.set(v)

    def overflow_step(self) -> None:
        """The latest step overflowed and was skipped."""
        self._overflow.inc()

    def observed_staleness(self, s: int | None) -> None:
        """Staleness the server reported for a push; ``None`` (allreduce) is ignored."""
        if s is not None:
            self._staleness.observe(s)

    def outer_round(self, nbytes: int, drift: float) -> None:
        """--mode local: an outer round moved ``nbytes``; the weights had drifted ``drift``."""
        self._outer_rounds.inc()
        self._outer_round_bytes.set(nbytes)
        self._sync_drift.set(drift)

    def set_world_size(self, n: int) -> None:
        self._world_size.set(n)

    def hot_rows(self, lookups: int, hits: int, bytes_saved: int) -> None:
        """--hot-row-cache: a step's lookups, hits and bytes not pulled."""
        self._cache_lookups.inc(lookups)
        self._cache_hits.inc(hits)
        self._cache_bytes.inc(bytes_saved)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (what a scrape returns)."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> tuple[WSGIServer, threading.Thread]:
        """Shortcut for :func:`psar.ps.server.metrics.serve_metrics` on this instance's registry."""
        return serve_metrics(self.registry, port, addr)
