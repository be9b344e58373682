"""`psar server`: one parameter-server shard as a gRPC server process.

Besides the ParameterServer service it serves the standard gRPC health service
(ps/server/doors/health.py), writes checkpoints (--checkpoint-dir), resumes from them (--restore),
expires worker leases (--lease-s), and can demand TLS and a bearer token (ps/auth.py).
On SIGTERM it drains: NOT_SERVING, no new pushes, the sync round in flight finishes,
a final checkpoint is written. docs/reliability.md describes all of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from concurrent import futures
from typing import Any

from psar.ps import auth
from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from psar.ps.grpc_limits import grpc_options
from psar.ps.server.config import ServerConfig
from psar.ps.server.doors.aio_host import ShardServer
from psar.ps.server.doors.dataplane import DataPlaneServer, server_ssl_context, start_dataplane
from psar.ps.server.doors.health import ShardHealth
from psar.ps.server.doors.sparse_servicer import SparseServicer
from psar.ps.server.durability import checkpoints
from psar.ps.server.membership.leases import Reaper
from psar.ps.server.shard import ShardState
from psar.ps.server.update.stepper import apply_torch_threads
from psar.trainkit.allocator import set_mmap_threshold
from psar.trainkit.roles import resolve_shard
from psar.trainkit.waiting import Waits

log = logging.getLogger("psar.server")


def build_state(cfg: ServerConfig, metrics: Any = None) -> ShardState:
    """The shard state for `cfg`: leases, checkpoint manager, restored if asked."""
    shard = resolve_shard(cfg.shard, os.environ)
    manager = None
    if cfg.checkpoint_folder:
        manager = checkpoints.CheckpointManager(
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
        exact_fp16_sum=cfg.exact_fp16_sum,
        update_threads=cfg.update_threads(),
        push_lead_bytes=int(cfg.push_lead_mib * (1 << 20)),
        limits=cfg.limits(),
    )
    if cfg.restore:
        found = _find_restore(cfg.restore, shard, fresh_ok=cfg.restore_or_fresh)
        if found is None:
            log.warning(
                "--restore %s: no usable checkpoint of shard %d; starting fresh", cfg.restore, shard
            )
        else:
            step, snap = found
            state.durability.restore(step, snap)
            log.info("restored shard %d from step %d of %s", shard, step, cfg.restore)
            print(f"psar server restored step {step} from {cfg.restore}", flush=True)
    if manager is not None:
        manager.start_timer(state.durability)
    return state


def _find_restore(
    folder: str, shard: int, *, fresh_ok: bool = False
) -> tuple[int, dict[str, Any]] | None:
    """The checkpoint to restore, or None for a folder without any of this shard (start
    fresh). Checkpoints that exist but none of which verifies: refuse to start, naming
    them (UnverifiedCheckpoints), unless fresh_ok (--restore-or-fresh)."""
    found, rejected = checkpoints.newest_verified(folder, shard)
    if found is None and not rejected:
        # Only one shard's files in the folder and no --shard given: take those.
        present = checkpoints.shards_in(folder)
        if len(present) == 1:
            (only,) = present
            log.warning("--restore: no files of shard %d; using shard %d's", shard, only)
            found, rejected = checkpoints.newest_verified(folder, only)
    if found is not None:
        if rejected:
            log.warning("--restore: skipped %d damaged checkpoint(s): %s", len(rejected),
                        "; ".join(rejected))  # fmt: skip
        return found
    if rejected and not fresh_ok:
        raise checkpoints.UnverifiedCheckpoints(
            f"--restore {folder}: no checkpoint of shard {shard} verifies, refusing to start "
            f"(--restore-or-fresh starts an empty shard instead): {'; '.join(rejected)}"
        )
    if rejected:
        log.warning("--restore-or-fresh: every checkpoint is damaged: %s", "; ".join(rejected))
    return None


def start_server(
    cfg: ServerConfig, state: ShardState | None = None, *, metrics: Any = None
) -> tuple[ShardServer, int, ShardState]:
    """Start a shard's gRPC server; returns (server, bound port, state). Non-blocking.

    The server is grpc.aio with --rpc-threads handler threads (ps/server/doors/aio_host.py): calls
    that wait (Pull, GetJob(wait)) park on its event loop and hold none of them.
    The server's health service is reachable as `server.psar_health` (ps/server/doors/health.py),
    its data plane (None when off) as `server.psar_dataplane` (ps/server/doors/dataplane.py).
    """
    if state is None:
        state = build_state(cfg, metrics)
    interceptors = []
    token = auth.read_token(cfg.auth_token_file) if cfg.auth_token_file else ""
    if token:
        interceptors.append(auth.TokenServerInterceptor(token, state.metrics))
    server = ShardServer(
        futures.ThreadPoolExecutor(max_workers=cfg.threads, thread_name_prefix="psar-shard"),
        # No SO_REUSEPORT: gRPC sets it by default, and a second shard started on a port
        # in use (a stale one, a typo in a launch script) would then share it silently.
        options=[*grpc_options(cfg.max_message_bytes), ("grpc.so_reuseport", 0)],
        interceptors=interceptors,
    )
    servicer = SparseServicer(state)
    servicer.executor = server.executor
    pb_grpc.add_ParameterServerServicer_to_server(servicer, server)
    health = ShardHealth(server)
    try:
        if cfg.tls_cert:
            creds = auth.server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
            port = server.add_secure_port(cfg.bind, creds)
        else:
            port = server.add_insecure_port(cfg.bind)
    except RuntimeError:  # grpc.aio raises where the sync server returned 0
        port = 0
    if port == 0:
        with contextlib.suppress(Exception):
            server.stop(grace=None)
        raise OSError(f"could not bind {cfg.bind}; is the port in use? (--bind)")
    dataplane: DataPlaneServer | None = None
    if cfg.data_port >= 0:
        # Under TLS the data plane is TLS with the same files (and the same token).
        tls = server_ssl_context(cfg.tls_cert, cfg.tls_key, cfg.tls_ca) if cfg.tls_cert else None
        try:
            dataplane = start_dataplane(
                state,
                bind=cfg.bind,
                port=cfg.data_port,
                token=token,
                max_payload_bytes=cfg.max_message_bytes,
                idle_s=cfg.data_idle_s,
                max_conns_per_peer=cfg.data_max_conns_per_peer,
                ssl_context=tls,
                seal_records=cfg.data_sealed_records,
                shm=cfg.data_shm,
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
        # The sweep's period is what a killed worker costs beyond its lease (issue #37's
        # goal: a kill costs at most the lease); a sweep is a scan of the live workers.
        period = min(0.2, state.leases.lease_s / 10)
        state._reaper = Reaper(state.members, period=period)  # type: ignore[attr-defined]
    return server, port, state


def serve(cfg: ServerConfig) -> int:
    """Run a shard until SIGTERM/SIGINT; returns the process exit code."""
    cfg.shard = resolve_shard(cfg.shard, os.environ)
    apply_torch_threads(cfg.torch_threads)  # one torch thread unless 0 (update/stepper.py)
    if set_mmap_threshold(int(cfg.malloc_mmap_threshold_mib * (1 << 20))):
        log.info("malloc: buffers >= %g MiB mapped on their own", cfg.malloc_mmap_threshold_mib)
    metrics = _make_metrics(cfg)
    try:
        server, port, state = start_server(cfg, metrics=metrics)
    except OSError as e:  # say which shard: a job's shards share one output
        raise OSError(f"shard {cfg.shard}: {e}") from None
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
        log.info("shard %d: %s, draining", cfg.shard, signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    code = 0 if _await_job(state, cfg, stop) else 1
    if code == 0:
        stop.wait()
    shutdown(server, state, cfg.drain_timeout_s)
    log.info("shard %d: drained and stopped", cfg.shard)
    return code


def _await_job(state: ShardState, cfg: ServerConfig, stop: threading.Event) -> bool:
    """Until the first Init (or a stop): a line every 30 s saying the shard waits for it.
    False when --init-timeout-s passed without one."""
    bound = cfg.init_timeout_s
    waits = Waits(log, first_after_s=min(30.0, bound or 30.0), every_s=30.0)
    limit = f"; exiting after --init-timeout-s {bound:g}" if bound else ""

    def describe(seconds: float) -> str:
        return f"shard {cfg.shard}: no job yet, waiting {seconds:.0f} s for rank 0's Init{limit}"

    try:
        with waits.waiting(describe):
            started = time.monotonic()  # after the wait's own start: its line is due by now
            while not state.initialized and not stop.is_set():
                if bound and time.monotonic() - started >= bound:
                    # The waiting line is due (first_after_s <= bound): say it before the
                    # error, whichever of this loop and the report thread woke first.
                    for line in waits.due():
                        log.warning("%s", line)
                    log.error(
                        "shard %d: the worker of rank 0 never initialised this shard within "
                        "--init-timeout-s %g; is rank 0 running, with this shard in its "
                        "--servers? stopping",
                        cfg.shard,
                        bound,
                    )
                    return False
                stop.wait(0.5)
    finally:
        waits.close()
    return True


def stop_server(server: ShardServer, grace: float | None = None) -> None:
    """Stop a server from start_server at once: its data plane, then gRPC (tests, tools;
    `shutdown` is the graceful path)."""
    dataplane = getattr(server, "psar_dataplane", None)
    if dataplane is not None:
        dataplane.close()
    server.stop(grace=grace).wait()


def shutdown(server: ShardServer, state: ShardState, drain_timeout_s: float) -> None:
    """Graceful stop: NOT_SERVING, drain, final checkpoint, stop the server."""
    health = getattr(server, "psar_health", None)
    if health is not None:
        health.not_serving()
    durability = state.durability
    durability.drain()
    if not durability.wait_drained(drain_timeout_s):
        log.warning("the sync round in flight did not finish in %.1fs", drain_timeout_s)
    if durability.checkpoint_now("shutdown", wait=True):
        print(f"psar server final checkpoint at step {durability.checkpoint_step}", flush=True)
    if health is not None:
        health.shutdown()
    stop_server(server, grace=2)
    if state.checkpoints is not None:
        state.checkpoints.close()


def _make_metrics(cfg: ServerConfig):  # noqa: ANN202 - metrics type is optional here
    if not cfg.metrics_port:
        return None
    from psar.ps.server.metrics.prometheus import ShardMetrics, serve_metrics

    metrics = ShardMetrics(shard=cfg.shard)
    serve_metrics(metrics.registry, cfg.metrics_port, cfg.metrics_addr)
    print(
        f"psar server metrics on http://{cfg.metrics_addr}:{cfg.metrics_port}/metrics", flush=True
    )
    return metrics
