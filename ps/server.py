"""`psar server`: one parameter-server shard as a gRPC server process.

Besides the ParameterServer service it serves the standard gRPC health service
(ps/health.py), writes checkpoints (--checkpoint-dir), resumes from them (--restore),
expires worker leases (--lease-s), and can demand TLS and a bearer token (ps/auth.py).
On SIGTERM it drains: NOT_SERVING, no new pushes, the sync round in flight finishes,
a final checkpoint is written. docs/reliability.md describes all of it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from ps import auth, checkpoint, wire
from ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from ps.dataplane import DataPlaneServer, start_dataplane
from ps.health import ShardHealth
from ps.lease import DEFAULT_JOIN_GRACE_S, DEFAULT_LEASE_S, Reaper
from ps.shard import ShardState
from ps.sparse_servicer import SparseServicer
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
    torch_threads: int = 1
    """torch threads for the shard's copies and optimizer (0: torch's default). One is
    fastest here: a 1 MiB copy took 0.12 ms with one thread, 0.63 ms with the default."""
    lease_s: float = DEFAULT_LEASE_S
    """A worker not heard from for this long leaves the live set (workers heartbeat every
    lease_s / 3)."""
    join_grace_s: float = DEFAULT_JOIN_GRACE_S
    """First lease term of a worker at job start and after a restore (slow starts)."""
    checkpoint_dir: str = ""
    """Write checkpoints into this folder (off when empty)."""
    checkpoint_every: int = 0
    """Checkpoint when the round (sync) or version (async/ssp) is a multiple of this
    (0: 100 in sync mode, or when no --checkpoint-interval is given)."""
    checkpoint_interval: float = 0.0
    """async/ssp: also checkpoint every this many seconds (0: off; sync mode uses rounds)."""
    checkpoint_keep: int = checkpoint.DEFAULT_KEEP
    """Keep this many newest checkpoints (>= 2; sync rollbacks need an older one)."""
    restore: str = ""
    """Resume from the newest checkpoint in this folder (starts fresh if it holds none);
    checkpoints then go on into --checkpoint-dir, or this folder if that is empty."""
    drain_timeout_s: float = 10.0
    """On SIGTERM, wait up to this long for the sync round in flight before the final
    checkpoint."""
    tls_cert: str = ""
    """Serve TLS with this PEM certificate (needs --tls-key)."""
    tls_key: str = ""
    """PEM private key of --tls-cert."""
    tls_ca: str = ""
    """Mutual TLS: only accept clients whose certificate this PEM CA signed."""
    auth_token_file: str = ""
    """Refuse calls without `authorization: Bearer <the token in this file>`."""
    chunk_rounds: bool = False
    """sync: apply the optimizer to each slot as soon as every worker's piece of it is in,
    while later slots still arrive (undone if the round is skipped or a push refused;
    ps/chunk_rounds.py). Bit-identical results either way. Off by default: the undo copy
    of each slot's master and optimizer state costs about what the early update hides
    (measured in docs/architectures.md)."""
    data_port: int = 0
    """TCP port of the data plane (push and pull as plain frames next to gRPC, on the
    --bind host; docs/dataplane.md): 0 picks a free one, -1 turns it off. Workers learn
    it from GetJob. Off when TLS is on (the data plane is plaintext)."""

    def __post_init__(self) -> None:
        if self.torch_threads < 0:
            raise ValueError(f"--torch-threads must be >= 0, got {self.torch_threads}")
        host, sep, port = self.bind.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(
                f"--bind: expected HOST:PORT (e.g. 127.0.0.1:50051), got {self.bind!r}"
            )
        if self.threads < 2:
            raise ValueError(f"--threads must be >= 2, got {self.threads}")
        if not 1024 <= self.message_bytes <= self.max_message_bytes // 2:
            raise ValueError("--message-bytes must be in [1024, max_message_bytes / 2]")
        if not -1 <= self.data_port < 65536:
            raise ValueError(
                f"--data-port must be in [-1, 65535] (0: a free port, -1: off), got "
                f"{self.data_port}"
            )
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if not self.lease_s > 0 or self.join_grace_s < 0:
            raise ValueError("--lease-s must be > 0 and --join-grace-s >= 0")
        if self.checkpoint_every < 0 or self.checkpoint_interval < 0:
            raise ValueError("--checkpoint-every and --checkpoint-interval must be >= 0")
        if self.checkpoint_keep < 2:
            raise ValueError(f"--checkpoint-keep must be >= 2, got {self.checkpoint_keep}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key")

    @property
    def checkpoint_folder(self) -> str:
        return self.checkpoint_dir or self.restore


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


def build_state(cfg: ServerConfig, metrics: Any = None) -> ShardState:
    """The shard state for `cfg`: leases, checkpoint manager, restored if asked."""
    shard = resolve_shard(cfg.shard, os.environ)
    manager = None
    if cfg.checkpoint_folder:
        manager = checkpoint.CheckpointManager(
            cfg.checkpoint_folder,
            shard=shard,
            every=cfg.checkpoint_every,
            interval_s=cfg.checkpoint_interval,
            keep=cfg.checkpoint_keep,
            metrics=metrics,
        )
    state = ShardState(
        metrics=metrics,
        message_bytes=cfg.message_bytes,
        lease_s=cfg.lease_s,
        join_grace_s=cfg.join_grace_s,
        checkpoints=manager,
        chunk_rounds=cfg.chunk_rounds,
    )
    if cfg.restore:
        found = _find_restore(cfg.restore, shard)
        if found is None:
            log.warning(
                "--restore %s: no checkpoint of shard %d; starting fresh", cfg.restore, shard
            )
        else:
            step, snap = found
            state.restore(step, snap)
            log.info("restored shard %d from step %d of %s", shard, step, cfg.restore)
            print(f"psar server restored step {step} from {cfg.restore}", flush=True)
    if manager is not None:
        manager.start_timer(state)
    return state


def _find_restore(folder: str, shard: int) -> tuple[int, dict[str, Any]] | None:
    found = checkpoint.newest_loadable(folder, shard)
    if found is not None:
        return found
    # Only one shard's files in the folder and no --shard given: take those.
    present = checkpoint.shards_in(folder)
    if len(present) == 1:
        (only,) = present
        log.warning("--restore: no files of shard %d; using shard %d's", shard, only)
        return checkpoint.newest_loadable(folder, only)
    return None


def start_server(
    cfg: ServerConfig, state: ShardState | None = None, *, metrics: Any = None
) -> tuple[grpc.Server, int, ShardState]:
    """Start a shard's gRPC server; returns (server, bound port, state). Non-blocking.

    The server's health service is reachable as `server.psar_health` (ps/health.py),
    its data plane (None when off) as `server.psar_dataplane` (ps/dataplane.py).
    """
    if state is None:
        state = build_state(cfg, metrics)
    interceptors = []
    token = auth.read_token(cfg.auth_token_file) if cfg.auth_token_file else ""
    if token:
        interceptors.append(auth.TokenServerInterceptor(token, state.metrics))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=cfg.threads, thread_name_prefix="psar-shard"),
        options=grpc_options(cfg.max_message_bytes),
        interceptors=interceptors,
    )
    servicer = SparseServicer(state)
    pb_grpc.add_ParameterServerServicer_to_server(servicer, server)
    health = ShardHealth(server)
    if cfg.tls_cert:
        creds = auth.server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        port = server.add_secure_port(cfg.bind, creds)
    else:
        port = server.add_insecure_port(cfg.bind)
    if port == 0:
        raise OSError(f"could not bind {cfg.bind}; is the port in use?")
    dataplane: DataPlaneServer | None = None
    if cfg.data_port >= 0 and cfg.tls_cert:
        log.warning("TLS is on: no data plane (it is plaintext); push and pull use gRPC")
    elif cfg.data_port >= 0:
        try:
            dataplane = start_dataplane(
                state,
                bind=cfg.bind,
                port=cfg.data_port,
                token=token,
                max_payload_bytes=cfg.max_message_bytes,
            )
        except OSError as e:
            raise OSError(
                f"could not bind the data plane on {cfg.bind.rpartition(':')[0]}:"
                f"{cfg.data_port} ({e.strerror or e}); is the port in use? (--data-port)"
            ) from None
        servicer.data_port = dataplane.port
    server.start()
    health.serving()
    server.psar_health = health  # type: ignore[attr-defined]
    server.psar_dataplane = dataplane  # type: ignore[attr-defined]
    if getattr(state, "_reaper", None) is None:
        state._reaper = Reaper(state, period=min(1.0, state.leases.lease_s / 4))  # type: ignore[attr-defined]
    return server, port, state


def serve(cfg: ServerConfig) -> int:
    """Run a shard until SIGTERM/SIGINT; returns the process exit code."""
    cfg.shard = resolve_shard(cfg.shard, os.environ)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    metrics = _make_metrics(cfg)
    server, port, state = start_server(cfg, metrics=metrics)
    host = cfg.bind.rpartition(":")[0]
    scheme = "TLS" if cfg.tls_cert else "plaintext"
    log.info("psar shard %d listening on %s:%d (%s)", cfg.shard, host, port, scheme)
    print(f"psar server listening on {host}:{port}", flush=True)
    dataplane = server.psar_dataplane  # type: ignore[attr-defined]
    if dataplane is not None:
        log.info("data plane on %s:%d", host, dataplane.port)
        print(f"psar server data plane on {host}:{dataplane.port}", flush=True)
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: draining", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    stop.wait()
    shutdown(server, state, cfg.drain_timeout_s)
    return 0


def stop_server(server: grpc.Server, grace: float | None = None) -> None:
    """Stop a server from start_server at once: its data plane, then gRPC (tests, tools;
    `shutdown` is the graceful path)."""
    dataplane = getattr(server, "psar_dataplane", None)
    if dataplane is not None:
        dataplane.close()
    server.stop(grace=grace).wait()


def shutdown(server: grpc.Server, state: ShardState, drain_timeout_s: float) -> None:
    """Graceful stop: NOT_SERVING, drain, final checkpoint, stop the server."""
    health = getattr(server, "psar_health", None)
    if health is not None:
        health.not_serving()
    state.drain()
    if not state.wait_drained(drain_timeout_s):
        log.warning("the sync round in flight did not finish in %.1fs", drain_timeout_s)
    if state.checkpoint_now("shutdown", wait=True):
        print(f"psar server final checkpoint at step {state.checkpoint_step}", flush=True)
    if health is not None:
        health.shutdown()
    stop_server(server, grace=2)
    if state.checkpoints is not None:
        state.checkpoints.close()


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
