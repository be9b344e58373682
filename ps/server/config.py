"""`psar server`'s flags: one dataclass, validated on construction (trainkit/cli_gen.py
builds the CLI from it; fields made with `everyday` are the ones `psar server --help`
shows, --help-all the rest). Light on purpose: `psar server --help` loads it, so it
imports neither torch nor the shard's machinery."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from psar.ps.grpc_limits import DEFAULT_MAX_MESSAGE_BYTES
from psar.ps.server import limits
from psar.ps.server.membership.leases import DEFAULT_JOIN_GRACE_S, DEFAULT_LEASE_S
from psar.trainkit.cli_gen import everyday
from psar.trainkit.connection import is_loopback

# The values of psar.ps.wire.DEFAULT_MESSAGE_BYTES and checkpoints.DEFAULT_KEEP, written
# out because both modules import torch and `psar server --help` must not
# (tests/test_cli_help.py holds them equal).
DEFAULT_MESSAGE_BYTES = 1 << 20
DEFAULT_CHECKPOINT_KEEP = 3

#: How many shards share this host (`psar server --torch-threads auto` divides its cores).
SHARDS_PER_HOST_ENV = "PSAR_SHARDS_PER_HOST"


@dataclass(kw_only=True)
class ServerConfig:
    """One parameter-server shard."""

    FLAG_NAMES: ClassVar[dict[str, str]] = {"threads": "--rpc-threads"}
    """A flag name means one thing in every psar command: --torch-threads is torch's threads
    (here and in psar train), so the gRPC handler threads are --rpc-threads."""
    FLAG_ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {"--rpc-threads": ("--threads",)}
    HELP_GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "shard": ("--bind", "--shard", "--rpc-threads", "--torch-threads", "--message-bytes",
                  "--max-message-bytes", "--chunk-rounds", "--exact-fp16-sum", "--push-lead-mib",
                  "--malloc-mmap-threshold-mib", "--max-step-lr", "--max-job-workers",
                  "--max-job-slots"),
        "data plane": ("--data-port", "--data-idle-s", "--data-max-conns-per-peer",
                       "--data-shm", "--data-tls-records", "--data-sealed-records"),
        "reliability": ("--lease-s", "--join-grace-s", "--checkpoint-dir", "--checkpoint-every",
                        "--checkpoint-interval", "--checkpoint-keep", "--restore",
                        "--restore-or-fresh", "--init-timeout-s", "--drain-timeout-s"),
        "security": ("--tls-cert", "--tls-key", "--tls-ca", "--auth-token-file",
                     "--allow-insecure-bind"),
        "metrics": ("--metrics-port", "--metrics-addr"),
    }  # fmt: skip
    """`psar server --help`'s sections (trainkit/cli_gen.py; tests/test_cli.py: every flag in one)."""

    bind: str = everyday("127.0.0.1:50051")
    """HOST:PORT to listen on (port 0 picks a free one; 0.0.0.0 listens on every interface)."""
    threads: int = 64
    """gRPC handler threads (--rpc-threads). A pull waiting for its round (sync barrier, SSP) holds none:
    it parks on the server's event loop (ps/server/pulls/parking.py)."""
    message_bytes: int = DEFAULT_MESSAGE_BYTES
    """Bytes of tensor data per streamed message (~1 MiB streams fastest here)."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest single message accepted or sent; bigger ones get RESOURCE_EXHAUSTED."""
    metrics_port: int = everyday(0)
    """Serve Prometheus /metrics on this port (0: no metrics endpoint)."""
    metrics_addr: str = "127.0.0.1"
    """Address the /metrics endpoint binds to."""
    shard: int = everyday(-1)
    """Shard index for logs and metrics (default: env PSAR_SHARD, a StatefulSet pod
    ordinal, SLURM_PROCID, else 0)."""
    torch_threads: str = everyday("auto")
    """Threads of the shard's optimizer update: auto | N | 0. auto (the default, issue #36):
    the cores this process may use divided by the shards on this host (env
    PSAR_SHARDS_PER_HOST, which `psar launch` sets; else 1), at least 1. N > 1: a pool of
    N threads steps the slots, bit-identical to one (ps/server/update/stepper.py); torch
    itself keeps one thread, the fastest for the shard's copies (1 MiB: 0.12 ms vs 0.63 ms
    with its default). Shards sharing a host with workers started by hand: give 1 (or
    set PSAR_SHARDS_PER_HOST). 0: torch's default threads, no pool."""
    lease_s: float = DEFAULT_LEASE_S
    """A worker not heard from for this long leaves the live set (workers heartbeat every
    lease_s / 3)."""
    join_grace_s: float = DEFAULT_JOIN_GRACE_S
    """First lease term of a worker at job start and after a restore (slow starts)."""
    checkpoint_dir: str = everyday("")
    """Write checkpoints into this folder (off when empty)."""
    checkpoint_every: int = everyday(0)
    """Checkpoint when the round (sync) or version (async/ssp) is a multiple of this
    (0: 100 in sync mode, or when no --checkpoint-interval is given)."""
    checkpoint_interval: float = 0.0
    """async/ssp: also checkpoint every this many seconds (0: off; sync mode uses rounds)."""
    checkpoint_keep: int = DEFAULT_CHECKPOINT_KEEP
    """Keep this many newest checkpoints (>= 2; sync rollbacks need an older one)."""
    restore: str = everyday("")
    """Resume from the newest checkpoint in this folder that verifies (starts fresh if it
    holds none of this shard; refuses to start if it holds some but none verifies);
    checkpoints then go on into --checkpoint-dir, or this folder if that is empty."""
    restore_or_fresh: bool = False
    """With --restore: start an empty shard when every checkpoint of this shard is damaged,
    instead of refusing to start (workers must then be restarted: the job begins again)."""
    init_timeout_s: float = 3600.0
    """A shard with no job says every 30 s that it waits for the worker of rank 0's Init,
    and exits 1 if none came within this many seconds (a job whose workers never started,
    or a wrong --servers list); 0: wait for ever. A shard restored from a checkpoint has
    its job already."""
    drain_timeout_s: float = 10.0
    """On SIGTERM, wait up to this long for the sync round in flight before the final
    checkpoint."""
    tls_cert: str = everyday("")
    """Serve TLS with this PEM certificate (needs --tls-key)."""
    tls_key: str = everyday("")
    """PEM private key of --tls-cert."""
    tls_ca: str = everyday("")
    """Mutual TLS: only accept clients whose certificate this PEM CA signed."""
    auth_token_file: str = everyday("")
    """Refuse calls without `authorization: Bearer <the token in this file>`."""
    chunk_rounds: bool = False
    """Not needed any more: per-chunk rounds (sync: each slot stepped as soon as every
    worker's piece of it is in, undone if the round is skipped; same bits) are a property
    of the job, which rank 0's Init carries (workers with --early-pull ask for them). With
    this flag the shard applies them to every sync job, also one that does not ask
    (workers from before jobs carried them)."""
    exact_fp16_sum: bool = True
    """sync, fp16 pushes: add each push's slots into one int64 fixed-point accumulator per
    slot as they arrive (exact: the same bits whatever the arrival order; 12 bytes per
    parameter whatever the number of workers, plus 2 per push while it streams; each
    slot's mean converted once all its pushes are in, so the close mostly steps;
    ps/server/modes/exact_sum.py). Off: every worker's push is staged in fp32 and the
    round summed in rank order at its close (--no-exact-fp16-sum: the behaviour before
    issue #36). fp32 and bf16 pushes are summed in rank order either way (DDP's bits). A
    round summed exactly takes fp16 pushes at one loss scale only: an fp32/bf16 push, or
    one at another scale, is refused (FAILED_PRECONDITION) once an fp16 push of the round
    is in (workers of one job push in one --wire-dtype), and a scale below 2^-112 always
    (INVALID_ARGUMENT: fp16 values unscaled by it may overflow fp32)."""
    push_lead_mib: float = 2.0
    """Per-chunk rounds, on the data plane: read a worker's push at most this many MiB
    ahead of the slowest push of the same round still streaming; the rest waits in TCP's
    buffers, so workers sharing a shard host's NIC keep in step and every slot's round
    closes as early as it can (TCP alone lets one push run far ahead and the pulls pile up
    at the end: ps/server/intake/pacing.py). 0 turns pacing off; results are the same bits
    either way."""
    data_port: int = everyday(0)
    """TCP port of the data plane (push and pull as plain frames next to gRPC, on the
    --bind host; docs/dataplane.md): 0 picks a free one, -1 turns it off. Workers learn
    it from GetJob. Under TLS it is TLS too (the same --tls-* files and token as gRPC)."""
    data_idle_s: float = 300.0
    """Close a data-plane connection that starts no frame for this long (a pooled idle
    connection, or a push gone silent between its pieces: it applies nothing). A new
    connection gets min(this, 30 s) for its TLS handshake and hello, and every frame
    must arrive whole within that long of its first byte."""
    data_tls_records: bool = False
    """Accepted for compatibility, changes nothing: standard TLS records are the data
    plane's default under --tls-* (since issue #33); it used to turn sealed records off.
    Refused together with --data-sealed-records."""
    data_sealed_records: bool = False
    """Opt-in, under --tls-cert/--tls-key: after the TLS handshake and hello, carry the
    data plane in psar's own sealed records (AES-GCM in 1 MiB records under keys agreed
    inside TLS) instead of TLS's 16 KiB records, for less CPU per byte. Read the threat
    model first (docs/sealed-records.md): it is not TLS on the wire."""
    data_shm: bool = True
    """Data plane without TLS: attach to the shared-memory segment a worker on this host
    offers in its hello (a sealed memfd, ps/shm.py), so tensor bytes go through memory, not
    the socket: one copy on each end and no TCP stack (docs/dataplane.md, "Shared
    memory"). --no-data-shm keeps every byte in the socket."""
    data_max_conns_per_peer: int = 256
    """Data-plane connections one peer address may hold at once; more are refused with
    RESOURCE_EXHAUSTED (a worker keeps ~2 per shard: raise it for many workers per host)."""
    max_step_lr: float = limits.DEFAULT_MAX_STEP_LR
    """The largest learning rate a push's step options may carry (a loop of its own ships
    its scheduler's rates); larger ones are refused, as are any above fp32's largest value
    (the masters' dtype) whatever this says."""
    max_job_workers: int = limits.DEFAULT_MAX_JOB_WORKERS
    """The most workers (an elastic job: its --max-workers) a job may declare at Init."""
    max_job_slots: int = limits.DEFAULT_MAX_JOB_SLOTS
    """The most slots a job may give this shard at Init."""
    allow_insecure_bind: bool = False
    """Listen on a non-loopback --bind without both --auth-token-file and TLS (--tls-cert,
    --tls-key), or serve /metrics (no token, no TLS) on a non-loopback --metrics-addr.
    Without it such a shard refuses to start (and --dry-run says so): anyone who reaches
    the port could push gradients, read the model, or evict workers. Say it only for a
    network you trust (a cluster's private network, a Kubernetes pod network)."""
    malloc_mmap_threshold_mib: float = 1.0
    """glibc only: buffers of at least this many MiB are mapped on their own and go back to
    the OS once freed, instead of staying on malloc's heaps, whose threshold otherwise rises
    to 32 MiB (trainkit/allocator.py): a shard's peak stays near what it holds (104M
    benchmark: 32.5-32.8 bytes per parameter held, 35.6-36.0 with glibc's own). 0 keeps
    glibc's rising threshold; at most 32."""

    def __post_init__(self) -> None:
        self.torch_threads = _check_threads(self.torch_threads)
        host, sep, port = self.bind.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(
                f"--bind: expected HOST:PORT (e.g. 127.0.0.1:50051), got {self.bind!r}"
            )
        if not 0 <= self.init_timeout_s < float("inf"):
            raise ValueError(
                f"--init-timeout-s must be a number of seconds >= 0 (0: wait for ever), "
                f"got {self.init_timeout_s}"
            )
        if self.threads < 2:
            raise ValueError(f"--rpc-threads must be >= 2, got {self.threads}")
        if not 0 <= self.malloc_mmap_threshold_mib <= 32:
            raise ValueError(
                "--malloc-mmap-threshold-mib must be in [0, 32] MiB (0: glibc's own), got "
                f"{self.malloc_mmap_threshold_mib}"
            )
        if not 1024 <= self.message_bytes <= self.max_message_bytes // 2:
            raise ValueError("--message-bytes must be in [1024, max_message_bytes / 2]")
        if not -1 <= self.data_port < 65536:
            raise ValueError(
                f"--data-port must be in [-1, 65535] (0: a free port, -1: off), got "
                f"{self.data_port}"
            )
        if not 0 < self.data_idle_s <= 86400:
            raise ValueError(f"--data-idle-s must be in (0, 86400], got {self.data_idle_s}")
        if not 0 <= self.push_lead_mib <= 1024:
            raise ValueError(
                f"--push-lead-mib must be in [0, 1024] MiB (0: no pacing), got {self.push_lead_mib}"
            )
        if self.data_max_conns_per_peer < 1:
            raise ValueError(
                f"--data-max-conns-per-peer must be >= 1, got {self.data_max_conns_per_peer}"
            )
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if not self.lease_s > 0 or self.join_grace_s < 0:
            raise ValueError("--lease-s must be > 0 and --join-grace-s >= 0")
        if self.checkpoint_every < 0 or self.checkpoint_interval < 0:
            raise ValueError("--checkpoint-every and --checkpoint-interval must be >= 0")
        if self.checkpoint_keep < 2:
            raise ValueError(f"--checkpoint-keep must be >= 2, got {self.checkpoint_keep}")
        if self.restore_or_fresh and not self.restore:
            raise ValueError("--restore-or-fresh needs --restore DIR")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.data_sealed_records and self.data_tls_records:
            raise ValueError(
                "--data-sealed-records and --data-tls-records contradict each other: give "
                "one (standard TLS records are the default; --data-tls-records only says so)"
            )
        if self.data_sealed_records and not self.tls_cert:
            raise ValueError(
                "--data-sealed-records needs TLS (--tls-cert and --tls-key): its keys are "
                "agreed inside the data plane's TLS handshake"
            )

        self.limits()  # the bounds' own checks
        self._check_exposure(host)

    def limits(self) -> limits.ShardLimits:
        """The bounds this shard holds its clients to (ps/server/limits.py)."""
        return limits.ShardLimits(
            max_step_lr=self.max_step_lr,
            max_job_workers=self.max_job_workers,
            max_job_slots=self.max_job_slots,
        )

    def _check_exposure(self, host: str) -> None:
        """Exposure is a decision (issue #45): a non-loopback listener without a token
        and TLS starts only with --allow-insecure-bind."""
        if self.allow_insecure_bind:
            return
        if not is_loopback(host) and not (self.auth_token_file and self.tls_cert):
            missing = " and ".join(
                what
                for what, given in (("--auth-token-file", self.auth_token_file),
                                    ("TLS (--tls-cert, --tls-key)", self.tls_cert))
                if not given
            )  # fmt: skip
            raise ValueError(
                f"--bind {self.bind} listens beyond this host without {missing}: anyone who "
                "reaches the port could push gradients, read the model or evict workers. "
                "Give --auth-token-file and --tls-cert/--tls-key, bind 127.0.0.1, or say "
                "--allow-insecure-bind (a network you trust)"
            )
        if self.metrics_port and not is_loopback(self.metrics_addr):
            raise ValueError(
                f"--metrics-addr {self.metrics_addr} serves /metrics beyond this host, with "
                "no token and no TLS: bind it to 127.0.0.1 (scrape through a local agent), "
                "or say --allow-insecure-bind (a network you trust)"
            )

    @property
    def checkpoint_folder(self) -> str:
        return self.checkpoint_dir or self.restore

    def update_threads(self, env: Mapping[str, str] = os.environ) -> int:
        """Threads of the optimizer update that --torch-threads asks for on this host."""
        if self.torch_threads != "auto":
            return max(1, int(self.torch_threads))  # 0: one pool thread, torch's own threads
        shards = env.get(SHARDS_PER_HOST_ENV, "").strip() or "1"
        if not shards.isdigit() or int(shards) < 1:
            raise ValueError(f"{SHARDS_PER_HOST_ENV} must be a number >= 1, got {shards!r}")
        return max(1, _cores() // int(shards))


def _check_threads(value: object) -> str:
    """--torch-threads as a string ("auto" or digits); ints (TOML, Python callers) kept."""
    text = str(value).strip().lower()
    if text == "auto" or text.isdigit():
        return text if text == "auto" else str(int(text))
    raise ValueError(f"--torch-threads: expected a number of threads >= 0 or 'auto', got {value!r}")


def _cores() -> int:
    """Cores this process may run on (its affinity mask: cgroups, taskset, Slurm)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1
