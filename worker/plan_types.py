"""The plan's data: its inputs, one architecture's predicted costs and memory, and the
constants they are measured in. Apart from the model (worker/plan_model.py) so the
verdict (worker/plan_verdict.py) reads them without importing the model back."""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: Bytes per element of the dtypes gradients/weights may travel or live in.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}

#: fp32 optimizer-state tensors per parameter: AdamW keeps two moments, SGD with
#: momentum one velocity buffer, plain SGD nothing.
OPTIMIZER_STATES: dict[str, int] = {"sgd": 0, "sgd-momentum": 1, "adamw": 2}

#: torch DDP's default bucket_cap_mb=25 is in MiB; used for the overlap tail.
DEFAULT_BUCKET_BYTES = 25 * 2**20

FP32 = 4

#: Bytes one core moves per second through each design's data path, each end counting
#: (a push of M is M out of a worker and M into a shard), kernel networking included:
#: `python -m bench.experiments.cpu_rate` on two hosts of an emulated LAN, this project's 2-core
#: x86-64 machine (AMD EPYC), 2026-12-02: psar's PS 2.06-2.44e9, gloo 2.75-2.90e9.
DEFAULT_PS_CPU_RATE = 2.2e9
DEFAULT_RING_CPU_RATE = 2.8e9


def _ceil_div(a: int, b: int) -> int:
    # Shards split unevenly when S does not divide P; the largest one must still fit.
    return -(-a // b)


@dataclass(frozen=True)
class PlanInputs:
    """Everything the model needs; units are SI base units (bytes, seconds)."""

    params: int
    workers: int
    servers: int = 1
    bandwidth_bytes_per_second: float = 12.5e9  # 100 Gbit/s
    latency_seconds: float = 5e-6
    wire_dtype: str = "fp32"
    optimizer: str = "adamw"
    worker_weights: str = "fp32"
    compute_seconds: float | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    shard_hosts: int | None = None
    """K hosts of their own the S shards are spread over; 0: on the worker hosts (one
    NIC carries a worker's and its shards' traffic); None: one host per shard (K = S)."""
    sync_every: int = 1
    """H: workers communicate once every H steps (--mode local, local SGD / DiLoCo); 1:
    every step. Per-step bytes and times are one sync's divided by H."""
    early_pull: bool = False
    """Sync PS pipelined (psar train --early-pull: the job asks its shards for per-chunk rounds): each slot
    is pulled back while later ones are still pushed, so a NIC's two directions work at
    once and the pull ends one chunk after the push."""
    exact_fp16_sum: bool = True
    """Shards summing fp16 rounds exactly as pushes arrive (psar server --exact-fp16-sum,
    the default; --no-exact-fp16-sum: off): 12 bytes of round gradient per parameter held
    instead of 4(N+1)."""
    chunk_bytes: int = 4 * 2**20
    """A slot on the wire at most (psar train --chunk-mib): with early_pull, the pull's
    last chunk can start only once its push has ended."""
    cpu_cores: float | None = None
    """Cores that move one host's bytes through the data path; None: the CPU is not
    modelled, only the links. With cpu_shared, the cores every host shares."""
    cpu_shared: bool = False
    """Every host's processes run on the same cpu_cores: one machine emulating the
    cluster (bench/links.py's namespaces), or a whole job on one host."""
    ps_cpu_bytes_per_second: float = DEFAULT_PS_CPU_RATE
    """Bytes one core moves per second through psar's PS data path (bench/experiments/cpu_rate.py)."""
    allreduce_cpu_bytes_per_second: float = DEFAULT_RING_CPU_RATE
    """Bytes one core moves per second through gloo's ring allreduce (bench/experiments/cpu_rate.py)."""
    worker_cpu_seconds: float = 0.0
    """W: CPU a worker process spends per step besides moving bytes (its forward and
    backward, its optimizer or the install of pulled weights). Only with cpu_shared, where
    the same cores run all N workers' share too: a sync step's compute phase then lasts at
    least N*W/C, for either design. 0: not counted (on hosts of their own, a worker's
    compute is compute_seconds)."""

    def __post_init__(self) -> None:
        # Validate here as well as in the CLI so library callers get the same checks.
        if self.params < 1 or self.workers < 1 or self.servers < 1:
            raise ValueError("params, workers and servers must all be >= 1")
        if self.bandwidth_bytes_per_second <= 0 or self.latency_seconds < 0:
            raise ValueError("bandwidth must be > 0 and latency >= 0")
        if self.wire_dtype not in DTYPE_BYTES or self.worker_weights not in DTYPE_BYTES:
            raise ValueError(f"dtypes must be one of {sorted(DTYPE_BYTES)}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}")
        if self.compute_seconds is not None and self.compute_seconds < 0:
            raise ValueError("compute time must be >= 0")
        if self.bucket_bytes < 1 or self.chunk_bytes < 1:
            raise ValueError("bucket and chunk sizes must be >= 1 byte")
        if self.sync_every < 1:
            raise ValueError(f"sync every must be >= 1 step, got {self.sync_every}")
        if self.cpu_cores is not None and not 0 < self.cpu_cores < float("inf"):
            raise ValueError(f"cpu cores must be a number > 0, got {self.cpu_cores}")
        if self.cpu_shared and self.cpu_cores is None:
            raise ValueError("cpu_shared needs cpu_cores (the cores every host shares)")
        rates = (self.ps_cpu_bytes_per_second, self.allreduce_cpu_bytes_per_second)
        if not all(0 < r < float("inf") for r in rates):
            raise ValueError(f"CPU data-path rates must be > 0 bytes/s, got {rates}")
        if not 0 <= self.worker_cpu_seconds < float("inf"):
            raise ValueError(f"worker CPU per step must be >= 0, got {self.worker_cpu_seconds}")
        if self.worker_cpu_seconds and not self.cpu_shared:
            raise ValueError(
                "worker CPU per step (--worker-cpu-ms) needs shared cores (--cpu-shared): it is "
                "the workers' share of the cores that also move the bytes (on hosts of their "
                "own, a worker's compute is --compute-ms)"
            )
        if self.shard_hosts is not None and not 0 <= self.shard_hosts <= self.servers:
            raise ValueError(
                f"shard hosts must be between 0 (shards on the worker hosts) and the number "
                f"of shards ({self.servers}), got {self.shard_hosts}; a host without a shard "
                f"carries nothing"
            )

    @property
    def hosts_of_shards(self) -> int:
        """K: the hosts of their own the shards use (S when not given; 0: worker hosts)."""
        return self.servers if self.shard_hosts is None else self.shard_hosts

    @property
    def wire_bytes(self) -> int:
        """M: one worker's full gradient (or weights) on the wire."""
        return self.params * DTYPE_BYTES[self.wire_dtype]


@dataclass(frozen=True)
class Comm:
    """One alpha-beta cost, kept split so the report can say which term dominates."""

    latency_seconds: float
    bandwidth_seconds: float

    @property
    def seconds(self) -> float:
        return self.latency_seconds + self.bandwidth_seconds


def overlapped_step(compute: float, comm: float, tail: float) -> float:
    """Step time when communication overlaps compute.

    ``max(compute, comm) + tail``: comm runs under the backward pass bucket by bucket,
    but the last bucket is ready only when backward ends, so its communication is
    exposed. The tail is capped at ``compute`` so overlap can never predict a slower
    step than ``compute + comm`` (tail <= comm holds because a bucket is <= M).
    """
    return max(compute, comm) + min(tail, compute)


@dataclass(frozen=True)
class Memory:
    """Bytes one process holds for the model; activations (they depend on the batch and
    are equal across both designs) are left out."""

    weights: int
    gradients: int
    """A worker's gradients; a shard's: the sync round's (docs/cost-model.md, Memory)."""
    optimizer_state: int
    fp32_masters: int = 0
    buffers: int = 0
    """Communication and round buffers: DDP's gradient buckets, a PS worker's send
    buffers, a shard's pull snapshot and per-chunk-round undo copies."""

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer_state + self.fp32_masters
                + self.buffers)  # fmt: skip


@dataclass(frozen=True)
class ArchPlan:
    """Prediction for one architecture; the ``shard_*`` fields are PS-only."""

    name: str
    bytes_sent_per_worker_per_step: float
    bytes_received_per_worker_per_step: float
    worker_comm: Comm
    memory_per_worker: Memory
    tail_comm: Comm  # the last bucket, exposed after backward when overlapping
    shard_comm: Comm | None = None
    bytes_received_per_shard_per_step: float | None = None
    bytes_sent_per_shard_per_step: float | None = None
    memory_per_shard: Memory | None = None
    compute_seconds: float | None = None
    cpu_seconds: float = 0.0
    """Time the cores need to move a step's bytes (0: the CPU is not modelled)."""
    workers_cpu_seconds: float = 0.0
    """On shared cores, the time they need for every worker's own CPU of a step (N*W/C):
    the compute phase lasts at least that long (0: not modelled)."""

    @property
    def link_seconds_per_step(self) -> float:
        """The slower of the worker NIC and the shard NIC."""
        shard = self.shard_comm.seconds if self.shard_comm else 0.0
        return max(self.worker_comm.seconds, shard)

    @property
    def comm_seconds_per_step(self) -> float:
        """The step waits for the slowest of the worker NIC, the shard NIC and the CPU
        that moves the bytes."""
        return max(self.link_seconds_per_step, self.cpu_seconds)

    @property
    def bottleneck(self) -> str:
        if self.comm_seconds_per_step == 0:
            return "none"
        if self.cpu_seconds > self.link_seconds_per_step:
            return "cpu"
        if self.shard_comm and self.shard_comm.seconds > self.worker_comm.seconds:
            return "shard_nic"
        return "worker_nic"

    @property
    def compute_phase_seconds(self) -> float | None:
        """A step's compute; on shared cores at least the time they need to run every
        worker's forward, backward and optimizer (a sync step's workers compute at once,
        then communicate, so that CPU does not hide under the wire)."""
        if self.compute_seconds is None:
            return None
        return max(self.compute_seconds, self.workers_cpu_seconds)

    @property
    def step_seconds_no_overlap(self) -> float | None:
        compute = self.compute_phase_seconds
        return None if compute is None else compute + self.comm_seconds_per_step

    @property
    def step_seconds_overlap(self) -> float | None:
        compute = self.compute_phase_seconds
        if compute is None:
            return None
        return overlapped_step(compute, self.comm_seconds_per_step, self.tail_seconds)

    @property
    def tail_seconds(self) -> float:
        return self.tail_comm.seconds

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict; PS-only and compute-only keys appear only when they apply."""
        out: dict[str, object] = {
            "bytes_sent_per_worker_per_step": self.bytes_sent_per_worker_per_step,
            "bytes_received_per_worker_per_step": self.bytes_received_per_worker_per_step,
            "comm_seconds_per_step": self.comm_seconds_per_step,
            "comm_latency_seconds_per_step": self.worker_comm.latency_seconds,
            "comm_bandwidth_seconds_per_step": self.worker_comm.bandwidth_seconds,
            "worker_comm_seconds_per_step": self.worker_comm.seconds,
            "bottleneck": self.bottleneck,
            "memory_per_worker_bytes": self.memory_per_worker.total,
            "memory_per_worker_breakdown": asdict(self.memory_per_worker),
            "overlap_tail_seconds": self.tail_seconds,
            "link_seconds_per_step": self.link_seconds_per_step,
            "cpu_seconds_per_step": self.cpu_seconds,
            "workers_cpu_seconds_per_step": self.workers_cpu_seconds,
        }
        if self.shard_comm is not None and self.memory_per_shard is not None:
            # For PS the step's latency/bandwidth split is that of the slower side.
            slow = max(self.worker_comm, self.shard_comm, key=lambda c: c.seconds)
            out["comm_latency_seconds_per_step"] = slow.latency_seconds
            out["comm_bandwidth_seconds_per_step"] = slow.bandwidth_seconds
            out["shard_comm_seconds_per_step"] = self.shard_comm.seconds
            out["bytes_received_per_shard_per_step"] = self.bytes_received_per_shard_per_step
            out["bytes_sent_per_shard_per_step"] = self.bytes_sent_per_shard_per_step
            out["memory_per_shard_bytes"] = self.memory_per_shard.total
            out["memory_per_shard_breakdown"] = asdict(self.memory_per_shard)
        if self.compute_seconds is not None:
            out["compute_phase_seconds"] = self.compute_phase_seconds
            out["step_seconds_no_overlap"] = self.step_seconds_no_overlap
            out["step_seconds_overlap"] = self.step_seconds_overlap
        return out
