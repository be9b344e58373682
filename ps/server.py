"""`psar server`: one parameter-server shard as a gRPC server process."""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc

from ps import wire
from ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from ps.servicer import ParameterServerServicer
from ps.shard import ShardState
from worker.roles import resolve_shard

log = logging.getLogger("psar.server")

# A piece is ~1 MiB plus a small header; allow some slack and refuse anything bigger
# with RESOURCE_EXHAUSTED (gRPC enforces it before our code sees the message).
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20


@dataclass(kw_only=True)
class ServerConfig:
    """One parameter-server shard."""

    bind: str = "127.0.0.1:50051"
    """HOST:PORT to listen on (port 0 picks a free one; 0.0.0.0 listens on every interface)."""
    threads: int = 64
    """gRPC handler threads; each waiting pull (sync barrier, SSP) holds one."""
    message_bytes: int = wire.DEFAULT_MESSAGE_BYTES
    """Bytes of tensor data per streamed message (~1 MiB streams fastest here)."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest single message accepted or sent; bigger ones get RESOURCE_EXHAUSTED."""
    metrics_port: int = 0
    """Serve Prometheus /metrics on this port (0: no metrics endpoint)."""
    metrics_addr: str = "127.0.0.1"
    """Address the /metrics endpoint binds to."""
    shard: int = -1
    """Shard index for logs and metrics (default: env PSAR_SHARD, a StatefulSet pod
    ordinal, SLURM_PROCID, else 0)."""

    def __post_init__(self) -> None:
        host, sep, port = self.bind.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(
                f"--bind: expected HOST:PORT (e.g. 127.0.0.1:50051), got {self.bind!r}"
            )
        if self.threads < 2:
            raise ValueError(f"--threads must be >= 2, got {self.threads}")
        if not 1024 <= self.message_bytes <= self.max_message_bytes // 2:
            raise ValueError("--message-bytes must be in [1024, max_message_bytes / 2]")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel/server options used on both ends: explicit sizes and keepalive."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def start_server(
    cfg: ServerConfig, state: ShardState | None = None
) -> tuple[grpc.Server, int, ShardState]:
    """Start a shard's gRPC server; returns (server, bound port, state). Non-blocking."""
    if state is None:
        state = ShardState(message_bytes=cfg.message_bytes)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=cfg.threads, thread_name_prefix="psar-shard"),
        options=grpc_options(cfg.max_message_bytes),
    )
    pb_grpc.add_ParameterServerServicer_to_server(ParameterServerServicer(state), server)
    port = server.add_insecure_port(cfg.bind)
    if port == 0:
        raise OSError(f"could not bind {cfg.bind}; is the port in use?")
    server.start()
    return server, port, state


def serve(cfg: ServerConfig) -> int:
    """Run a shard until SIGTERM/SIGINT; returns the process exit code."""
    cfg.shard = resolve_shard(cfg.shard, os.environ)
    metrics = _make_metrics(cfg)
    state = ShardState(metrics=metrics, message_bytes=cfg.message_bytes)
    server, port, _ = start_server(cfg, state)
    host = cfg.bind.rpartition(":")[0]
    log.info("psar shard %d listening on %s:%d", cfg.shard, host, port)
    print(f"psar server listening on {host}:{port}", flush=True)
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    stop.wait()
    # Let in-flight pushes and pulls finish (grace), refuse new ones meanwhile.
    server.stop(grace=5).wait()
    return 0


def _make_metrics(cfg: ServerConfig):  # noqa: ANN202 - metrics type is optional here
    if not cfg.metrics_port:
        return None
    from ps.metrics import ShardMetrics, serve_metrics

    metrics = ShardMetrics(shard=cfg.shard)
    serve_metrics(metrics.registry, cfg.metrics_port, cfg.metrics_addr)
    print(
        f"psar server metrics on http://{cfg.metrics_addr}:{cfg.metrics_port}/metrics", flush=True
    )
    return metrics
