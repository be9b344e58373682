"""Prometheus helpers shared by shard and worker metrics: buckets, the build-info gauge,
pre-created children and the /metrics HTTP endpoint."""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Iterable, Mapping
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import start_http_server as _start_http_server

#: Staleness is counted in versions (update rounds), so small integers dominate;
#: the tail doubles to still tell "a few behind" from "a straggler far behind".
STALENESS_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)

#: Durations from a 100 µs local RPC up to a 60 s barrier stalled on a straggler,
#: roughly 1-2.5-5 per decade so quantiles stay within ~2.5x anywhere in the range.
DURATION_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

#: Catch-all label value: an unexpected reason/method string from a caller is counted
#: here instead of raising inside an RPC handler or creating an unbounded new series.
OTHER = "other"


def psar_version() -> str:
    """Installed version of the ``psar`` distribution, or ``0+unknown`` from a bare checkout."""
    try:
        return importlib.metadata.version("psar")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def build_info(registry: CollectorRegistry, arch: str) -> Gauge:
    """Register ``psar_build_info{version,arch} 1`` in ``registry``.

    The usual "info gauge" idiom: joining on it (``* on(instance) group_left(version)``)
    labels any series with the code version that produced it.  A registry holds one
    metrics object, so this is registered once per registry.
    """
    gauge = Gauge(
        "psar_build_info",
        "Build information; always 1, the labels carry the data.",
        ["version", "arch"],
        registry=registry,
    )
    gauge.labels(version=psar_version(), arch=arch).set(1)
    return gauge


def children(metric, label: str, values: Iterable[str], **fixed: str) -> dict[str, object]:
    """Pre-create one child of a labelled ``metric`` per value of ``label``.

    ``fixed`` binds the other labels (e.g. ``shard``/``mode``); the returned dict maps
    each ``label`` value to its child, so hot paths skip ``labels()`` entirely.
    """
    return {v: metric.labels(**fixed, **{label: v}) for v in values}


def pick(table: Mapping[str, object], key: str):
    """Child for ``key``, or the ``other`` child: never raise on the hot path."""
    child = table.get(key)
    return child if child is not None else table[OTHER]


def serve_metrics(
    registry: CollectorRegistry, port: int, addr: str = "127.0.0.1"
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``registry`` on ``http://addr:port/metrics`` from a daemon thread.

    Port 0 picks a free port; read the real one from ``server.server_port``.  The
    default address is loopback on purpose: binding every interface is an explicit
    choice (``addr="0.0.0.0"`` in a pod).  Stop with :func:`stop_metrics`.
    """
    server, thread = _start_http_server(port, addr=addr, registry=registry)
    return server, thread


def stop_metrics(server: WSGIServer, thread: threading.Thread | None = None) -> None:
    """Stop a server from :func:`serve_metrics` and free its port."""
    server.shutdown()
    server.server_close()
    if thread is not None:
        thread.join(timeout=5)
