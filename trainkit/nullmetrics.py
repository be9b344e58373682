"""A metrics sink that accepts every call and does nothing (metrics are optional)."""

from __future__ import annotations

from typing import Any


class NullMetrics:
    """Stands in for ps.server.metrics.ShardMetrics / worker.metrics.WorkerMetrics when no
    /metrics endpoint was asked for, so call sites never branch on it."""

    def __getattr__(self, name: str) -> Any:
        return _noop


def _noop(*args: Any, **kwargs: Any) -> None:
    return None
