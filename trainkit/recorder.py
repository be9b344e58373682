"""What a worker records: the one interface of its metrics, and the recorder that drops them.

The training loop records through `WorkerRecorder`; `WorkerMetrics` (worker/metrics.py:
Prometheus series, names pinned by docs/metrics.md) and `NullWorkerRecorder` (no
--metrics-port) implement exactly these methods, so a misspelt call fails at once
(tests/test_recorders.py). Light on purpose: a DDP rank imports it without prometheus.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol, runtime_checkable


@runtime_checkable
class WorkerRecorder(Protocol):
    """The worker's metrics calls (see WorkerMetrics for the series each one feeds)."""

    def step_done(self, samples: int) -> None:
        """A step over `samples` samples finished."""

    def phase(self, name: str, seconds: float) -> None:
        """`seconds` were spent in phase `name` (unknown names count as other)."""

    def time_phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time the `with` body as phase `name`."""
        ...

    def set_loss(self, v: float) -> None:
        """Training loss of the latest step."""

    def set_loss_scale(self, v: float) -> None:
        """Loss scale used for the latest step."""

    def overflow_step(self) -> None:
        """The latest step overflowed and was skipped."""

    def observed_staleness(self, s: int | None) -> None:
        """Staleness a shard reported for a push (None: not reported)."""

    def outer_round(self, nbytes: int, drift: float) -> None:
        """--mode local: an outer round moved `nbytes`; the weights had drifted `drift`."""

    def set_world_size(self, n: int) -> None:
        """Workers in the job as this worker sees it now (elastic jobs change it)."""

    def hot_rows(self, lookups: int, hits: int, bytes_saved: int) -> None:
        """--hot-row-cache: a step's row lookups, cache hits and bytes not pulled."""


class NullWorkerRecorder:
    """A WorkerRecorder that records nothing: exactly the interface's methods."""

    def step_done(self, samples: int) -> None:
        pass

    def phase(self, name: str, seconds: float) -> None:
        pass

    @contextlib.contextmanager
    def time_phase(self, name: str) -> Iterator[None]:
        yield

    def set_loss(self, v: float) -> None:
        pass

    def set_loss_scale(self, v: float) -> None:
        pass

    def overflow_step(self) -> None:
        pass

    def observed_staleness(self, s: int | None) -> None:
        pass

    def outer_round(self, nbytes: int, drift: float) -> None:
        pass

    def set_world_size(self, n: int) -> None:
        pass

    def hot_rows(self, lookups: int, hits: int, bytes_saved: int) -> None:
        pass
