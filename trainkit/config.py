"""The training configuration: one tree of dataclasses, validated in __post_init__.

`psar train`'s flags are generated from this tree (trainkit/cli_gen.py): each field is a
flag, its docstring is the flag's help, and a TOML file given with --config fills the
same fields (flags win). Sections [optimizer], [loss_scale], [ps], [ddp] in the file
map to the nested dataclasses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from psar.trainkit.choices import (
    DEFAULT_MODE,
    OUTER_OPTIMIZERS,
    SPARSE_OPTIMIZERS,
    averages_buffers,
    check_mode,
    chunk_rounds,
    local_sgd,
)
from psar.trainkit.cli_gen import everyday
from psar.trainkit.connection import ConnectionConfig
from psar.trainkit.optim_config import LossScaleConfig, OptimizerConfig

ARCHS = ("ps", "allreduce", "hybrid")
MAX_HOT_ROWS = 10_000_000
"""--hot-row-cache's bound: rows per table a worker may keep (the cache is for a head)."""
MAX_HOT_ROW_STALENESS = 1000
"""--hot-row-staleness's bound, in steps."""


@dataclass(kw_only=True)
class PSConfig(ConnectionConfig):
    """Parameter-server architecture (--arch ps).

    The connection fields (--timeout-s, --pull-timeout-s, --data-plane,
    --reconnect-timeout-s, --tls-*) and their checks are inherited from
    psar.trainkit.connection.ConnectionConfig, which the worker's ClientConfig inherits too:
    declared once, so the two cannot drift apart (ps/client/client_config.py)."""

    servers: str = everyday("")
    """Comma-separated HOST:PORT of every shard, in shard order (or env PSAR_SERVERS)."""
    rank: int = everyday(-1)
    """This worker's rank, 0..world_size-1 (default: env RANK, else 0)."""
    world_size: int = everyday(0)
    """Number of workers (default: env WORLD_SIZE, else 1)."""
    mode: str = everyday(DEFAULT_MODE)
    """Consistency mode: sync | async | ssp | local (local SGD / DiLoCo: --sync-every;
    local also applies to --arch allreduce)."""
    max_workers: int = 0
    """An elastic job (docs/elastic.md): it starts with --world-size workers and may grow to
    this many while it runs (workers started with --join), shrink (SIGTERM: a worker
    leaves after its step) and survive kills; shard 0 deals the data, so every sample is
    trained on once per epoch whatever the membership does. Give it to every worker of
    the job. 0: a fixed job of --world-size workers."""
    join: bool = False
    """Join a running elastic job (started with --max-workers): shard 0 gives this worker
    a free rank (unless --rank names one), and it enters at the next round boundary on
    every shard. The job's size, length and schedule come from the shards; pass the
    job's other flags as its first workers got them."""
    staleness: int = everyday(1)
    """ssp: no worker runs more than this many clocks ahead of the slowest live worker."""
    staleness_rule: str = "adaptive"
    """async/ssp: how the shards apply a gradient computed on weights that moved since:
    adaptive | fixed | momentum | none. adaptive (the default): per slot, from what the
    shard observes (the staleness, the curvature along the weights' motion, the
    gradient's signal-to-noise, the step size, the workers), between sync's movement per
    sample and lr / sqrt(1 + staleness), with delay compensation (docs/staleness-rule.md);
    fixed: the momentum rule plus --staleness-lr / --delay-compensation as given;
    momentum: the momentum rule alone (momentum - (1 - 1/N)); none: the optimizer as
    configured."""
    staleness_lr: bool = False
    """Alias (kept for scripts): selects --staleness-rule fixed, whose shards apply a
    gradient `staleness` updates old with lr / (1 + staleness) (Zhang et al., IJCAI 2016)."""
    delay_compensation: float = 0.0
    """Alias: selects --staleness-rule fixed with DC-ASGD's LAMBDA (Zheng et al., ICML
    2017): g + LAMBDA * g * g * (w_now - w_base), w_base the weights the worker computed
    it on (the shards keep them: up to one copy per worker); 0: off."""
    staleness_lr_power: float = 1.0
    """Alias: selects --staleness-rule fixed; with --staleness-lr the shards scale lr by
    (1 / (1 + staleness)) ** P."""
    dc_adaptive: bool = False
    """Alias: selects --staleness-rule fixed; with --delay-compensation LAMBDA0, DC-ASGD-a
    (Zheng et al. 2017): lambda = LAMBDA0 / sqrt(v) per element, v a moving mean of g * g."""
    momentum_correction: bool = True
    """--staleness-rule fixed: the shards apply max(0, --momentum - (1 - 1/N)) as momentum
    (AdamW: --beta1), since asynchrony itself adds about 1 - 1/N (Mitliagkas et al. 2016).
    --no-momentum-correction alone is an alias of --staleness-rule none (as configured)."""
    chunk_mib: float = 4.0
    """Tensors larger than this (MiB of fp32) are cut into chunks spread over shards."""
    job_id: str = "psar"
    """Job name sent to the shards; a shard refuses a second job with another name."""
    buffers: str = "rank0"
    """Model buffers (BatchNorm running stats, any registered float buffer) live on the
    shards and come back with every pull: rank0 | average. rank0: rank 0's, as DDP
    broadcasts them before every forward; average (sync only): the mean over the workers
    of each round."""
    overlap: bool = True
    """Push gradient buckets while backward runs and start the next forward on the first
    layers while later ones are still being pulled (same results, bit for bit)."""
    bucket_mib: float = 1.0
    """--overlap: gradients are pushed in buckets of about this many MiB."""
    pull_overlap: bool = True
    """--overlap: let the next forward start while later layers are still
    being pulled. Off: only the push overlaps (backward); step() waits for the whole pull.
    Where workers and shards share few cores the pulling thread takes its core from
    forward; --overlap-trial finds out (docs/results.md, step throughput)."""
    early_pull: bool | None = None
    """Sync: every worker asks for each step's pull while its push still streams, so a
    slot comes back as soon as the shards have applied it (they apply the job's rounds
    slot by slot), over the data plane; the link carries the pull while the rest of the
    push goes out. Same bits as without. A property of the job: rank 0 decides it and
    carries it to every shard with Init, the other workers follow what the shards serve
    (no shard flag has to agree). Default (auto): on where some shard is on another host
    and the data plane may be used, off on one host, where it only costs CPU
    (docs/architecture.md, "Early pulls"). --early-pull / --no-early-pull force it."""
    overlap_trial: int = 30
    """--overlap: after 5 warm-up steps, this many steps try push+pull overlap (if
    --pull-overlap), push only, and neither, in blocks of consecutive steps, twice over;
    the arm with the lowest steady-state step time is kept for the rest of the run
    (results are the same bits whichever runs). 0: no trial, run what
    --overlap/--pull-overlap say. Runs shorter than 5 + 2 x this skip the trial."""
    overlap_host_busy: float = 0.75
    """--overlap-trial: keep no overlap without a trial where compute is on the CPU, every
    shard is on this host (shared memory) and the host's CPUs were at least this busy
    (0-1) over the warm-up steps: there is no idle core for overlap to use (docs/results.md,
    step throughput). 0: always try."""
    auth_token_file: str = ""
    """Send `authorization: Bearer <the token in this file>` with every call."""
    # -- sparse embedding tables (docs/sparse.md) --
    sparse_optimizer: str = "sgd"
    """Optimizer the shards apply to sparse tables: sgd | adagrad (row-wise) | lazy_adam."""
    sparse_lr: float = 0.0
    """Learning rate of the sparse tables (0: --lr)."""
    sparse_eps: float = 1e-8
    """eps of the sparse adagrad / lazy_adam update."""
    sparse_wire_dtype: str = "fp16"
    """dtype of sparse row gradients on the wire: fp16 | bf16 | fp32."""
    sparse_pull_dtype: str = "auto"
    """dtype the rows of sparse tables are pulled in: auto | fp16 | bf16 | fp32. auto: the
    worker's weights dtype (--worker-weights). fp16 halves the bytes of a pull from fp32
    where the links between workers and shards are what limits a step; the rows are
    rounded to it, then used in the model's own dtype (the shards keep fp32 masters)."""
    sparse_min_rows: int = 0
    """A loop of your own (prepare()) under --arch ps or hybrid: also put every
    nn.Embedding / nn.EmbeddingBag with sparse=True and at least this many rows on the
    shards as a sparse table. The shards initialise it N(0, 1), as torch initialises an
    embedding: its weights in your model are not sent. 0: only the tables you mark
    (psar_sparse_table, docs/sparse.md)."""
    hot_row_cache: int = 0
    """Keep up to this many of each sparse table's most used rows on the worker and
    serve them for up to --hot-row-staleness steps instead of pulling them again (the
    Zipf head every batch names; docs/sparse.md). 0: no cache."""
    hot_row_staleness: int = 0
    """--hot-row-cache: how many steps a cached row may be served after the step that
    pulled it. 0 is exact (no row is served from the cache: the same bits as without
    one); S >= 1 reads hot rows at most S steps late, as --mode ssp reads the model."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the connection fields (timeouts, --data-plane with TLS)
        check_mode(self.mode)
        if self.staleness < 0:
            raise ValueError(f"--staleness must be >= 0, got {self.staleness}")
        if self.max_workers < 0:
            raise ValueError(f"--max-workers must be >= 0 (0: a fixed job), got {self.max_workers}")
        if self.buffers not in ("rank0", "average"):
            raise ValueError(f"--buffers: unknown {self.buffers!r}; accepted: rank0, average")
        if self.early_pull and not chunk_rounds(self.mode):
            raise ValueError(
                f"--early-pull with --mode {self.mode}: early pulls stream the slots of a "
                "round as they are applied, which only modes in rounds of every worker's "
                "push have (--mode sync); drop --early-pull"
            )
        if self.buffers == "average" and not averages_buffers(self.mode):
            raise ValueError(
                f"--buffers average needs --mode sync (a round to average over), not {self.mode}"
            )
        # Here, not at the top: the rules need torch, and `psar ... --help` builds its
        # flags from this tree without it.
        from psar.trainkit.staleness_rules import rule_of

        # The fixed rule's flags select it; --no-momentum-correction alone selects none.
        self.staleness_rule = rule_of(self)
        if not 0.0 < self.staleness_lr_power <= 4.0:
            raise ValueError(
                "--staleness-lr-power must be in (0, 4] (the exponent of 1 / (1 + staleness); "
                f"1: lr / (1 + staleness)), got {self.staleness_lr_power}"
            )
        if self.dc_adaptive and not self.delay_compensation:
            raise ValueError(
                "--dc-adaptive scales DC-ASGD's lambda: give its lambda0 with "
                "--delay-compensation LAMBDA0 (> 0)"
            )
        if not 0.0 <= self.delay_compensation < float("inf"):
            raise ValueError(
                "--delay-compensation must be a finite number >= 0 (DC-ASGD's lambda; 0: off), "
                f"got {self.delay_compensation}"
            )
        if not self.chunk_mib > 0:
            raise ValueError(f"--chunk-mib must be > 0, got {self.chunk_mib}")
        if self.overlap_trial < 0:
            raise ValueError(
                f"--overlap-trial must be >= 0 (0: no trial), got {self.overlap_trial}"
            )
        if not 0.0 <= self.overlap_host_busy <= 1.0:
            raise ValueError(
                "--overlap-host-busy must be a fraction in [0, 1] (0: always try), got "
                f"{self.overlap_host_busy}"
            )
        if not self.bucket_mib > 0:
            raise ValueError(f"--bucket-mib must be > 0, got {self.bucket_mib}")
        if self.sparse_optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(
                f"--sparse-optimizer: unknown {self.sparse_optimizer!r}; "
                f"accepted: {', '.join(SPARSE_OPTIMIZERS)}"
            )
        if self.sparse_wire_dtype not in ("fp16", "bf16", "fp32"):
            raise ValueError("--sparse-wire-dtype: accepted: fp16, bf16, fp32")
        if self.sparse_pull_dtype not in ("auto", "fp16", "bf16", "fp32"):
            raise ValueError(
                f"--sparse-pull-dtype: accepted: auto, fp16, bf16, fp32; got {self.sparse_pull_dtype!r}"
            )
        if self.sparse_min_rows < 0:
            raise ValueError(
                f"--sparse-min-rows must be >= 0 (0: only marked tables), got {self.sparse_min_rows}"
            )
        if not 0 <= self.hot_row_cache <= MAX_HOT_ROWS:
            raise ValueError(
                f"--hot-row-cache must be in [0, {MAX_HOT_ROWS}] rows per table (0: no "
                f"cache), got {self.hot_row_cache}"
            )
        if not 0 <= self.hot_row_staleness <= MAX_HOT_ROW_STALENESS:
            raise ValueError(
                f"--hot-row-staleness must be in [0, {MAX_HOT_ROW_STALENESS}] steps (0: "
                f"exact), got {self.hot_row_staleness}"
            )

    def server_list(self) -> list[str]:
        raw = self.servers or os.environ.get("PSAR_SERVERS", "")
        addrs = [a.strip() for a in raw.split(",") if a.strip()]
        if not addrs:
            raise ValueError(
                "--servers: give the shards as HOST:PORT,HOST:PORT (or set PSAR_SERVERS); "
                "start them with `psar server --bind HOST:PORT`"
            )
        for a in addrs:
            host, sep, port = a.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"--servers: {a!r} is not HOST:PORT")
        return addrs


@dataclass(kw_only=True)
class DDPConfig:
    """AllReduce architecture (--arch allreduce), launched by torchrun."""

    backend: str = "auto"
    """Process-group backend: auto (nccl on CUDA, gloo on CPU) | nccl | gloo."""
    pg_timeout_s: float = 600.0
    """Process-group timeout: a hung collective fails after this many seconds."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MB."""
    find_unused_parameters: bool = False
    """Let DDP handle parameters that get no gradient (the workload may also ask for it)."""
    checkpoint_dir: str = ""
    """Rank 0 checkpoints model, optimizer, scaler, schedule and step here; every rank
    resumes from the newest one at start (relaunches under torchrun --max-restarts)."""
    checkpoint_every: int = 100
    """With --checkpoint-dir: checkpoint every this many steps (and at the end)."""

    def __post_init__(self) -> None:
        if self.checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"--backend: unknown {self.backend!r}; accepted: auto, nccl, gloo")
        if not self.pg_timeout_s > 0 or not self.bucket_cap_mb > 0:
            raise ValueError("--pg-timeout-s and --bucket-cap-mb must be > 0")


OUTER_LR_DEFAULTS = {"nesterov": 0.7, "sgd": 1.0}
"""--outer-lr 0 means these (DiLoCo's 0.7 for nesterov; plain averaging for sgd)."""


@dataclass(kw_only=True)
class LocalConfig:
    """--mode local: local SGD / DiLoCo (either architecture).

    Every worker runs --optimizer (the inner optimizer) on its own weights for
    --sync-every steps, then the pseudo-gradients (weights at the last sync minus weights
    now) are averaged over the workers and the outer optimizer applies the average to the
    shared weights (on the shards for ps, on every rank for allreduce)."""

    sync_every: int = everyday(0)
    """--mode local: inner steps between synchronisations (H; required there, refused
    with any other mode)."""
    outer_optimizer: str = "nesterov"
    """--mode local: optimizer of the averaged pseudo-gradients: nesterov (DiLoCo) | sgd
    (no momentum; with --outer-lr 1 this is plain model averaging)."""
    outer_lr: float = 0.0
    """--mode local: outer learning rate (0: 0.7 for nesterov, 1.0 for sgd)."""
    outer_momentum: float = 0.9
    """--mode local, --outer-optimizer nesterov: the outer momentum."""

    def __post_init__(self) -> None:
        if self.sync_every < 0:
            raise ValueError(f"--sync-every must be >= 1, got {self.sync_every}")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(
                f"--outer-optimizer: unknown {self.outer_optimizer!r}; "
                f"accepted: {', '.join(OUTER_OPTIMIZERS)}"
            )
        if not 0 <= self.outer_lr < float("inf"):
            raise ValueError(
                f"--outer-lr must be a finite number > 0 (0: the outer optimizer's default), "
                f"got {self.outer_lr}"
            )
        if not 0 < self.outer_momentum < 1:
            raise ValueError(f"--outer-momentum must be in (0, 1), got {self.outer_momentum}")

    def effective_lr(self) -> float:
        """--outer-lr, or the outer optimizer's default when 0."""
        return self.outer_lr or OUTER_LR_DEFAULTS[self.outer_optimizer]


@dataclass(kw_only=True)
class TrainConfig:
    """One worker of a training job (`psar train`)."""

    FLAG_NAMES: ClassVar[dict[str, str]] = {"threads": "--torch-threads"}
    """A flag name means one thing in every psar command: --torch-threads is torch's
    threads, as in psar server (whose gRPC handler threads are --rpc-threads)."""
    FLAG_ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {"--torch-threads": ("--threads",)}
    HELP_GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "model and data": ("--workload", "--workload-option", "--steps", "--epochs",
                           "--batch-size", "--grad-accum", "--seed", "--eval-batches",
                           "--device", "--torch-threads", "--save"),
        "optimizer": ("--optimizer", "--lr", "--momentum", "--nesterov", "--weight-decay",
                      "--beta1", "--beta2", "--eps", "--schedule", "--warmup-steps",
                      "--total-steps", "--min-lr-ratio", "--clip-grad-norm",
                      "--optimizer-impl"),
        "architecture": ("--arch", "--mode", "--staleness", "--sync-every",
                         "--outer-optimizer", "--outer-lr", "--outer-momentum", "--backend",
                         "--pg-timeout-s", "--bucket-cap-mb", "--find-unused-parameters"),
        "ps": ("--servers", "--rank", "--world-size", "--max-workers", "--join",
               "--staleness-rule", "--staleness-lr",
               "--delay-compensation", "--staleness-lr-power", "--dc-adaptive",
               "--momentum-correction", "--chunk-mib", "--job-id", "--buffers", "--overlap",
               "--bucket-mib", "--pull-overlap", "--early-pull", "--overlap-trial",
               "--overlap-host-busy",
               "--data-plane", "--data-shm-mib", "--sparse-optimizer", "--sparse-lr", "--sparse-eps",
               "--sparse-wire-dtype", "--sparse-pull-dtype", "--sparse-min-rows", "--hot-row-cache",
               "--hot-row-staleness"),
        "precision": ("--precision", "--wire-dtype", "--worker-weights", "--loss-scale-enabled",
                      "--loss-scale-init-scale", "--loss-scale-growth-factor",
                      "--loss-scale-backoff-factor", "--loss-scale-growth-interval"),
        "reliability": ("--timeout-s", "--pull-timeout-s", "--reconnect-timeout-s",
                        "--checkpoint-dir", "--checkpoint-every", "--sigterm-exit-code"),
        "security": ("--tls-ca", "--tls-cert", "--tls-key", "--tls-server-name",
                     "--auth-token-file"),
        "metrics": ("--report", "--run-dir", "--log-every", "--metrics-port", "--metrics-addr",
                    "--metrics-linger-s"),
        "benchmarks and tests": ("--slowdown", "--emulate-compute-ms", "--inject-overflow-step"),
    }  # fmt: skip
    """`psar train --help`'s sections (trainkit/cli_gen.py; tests/test_cli.py: every flag in one)."""

    arch: str = everyday("ps")
    """Architecture: ps (parameter server) | allreduce (DDP under torchrun) | hybrid (sparse
    tables on the shards, dense layers allreduced; launched like DDP, with --servers)."""
    workload: str = everyday("mlp")
    """Built-in workload (mlp, lm, recsys; docs/workloads.md) or your own factory as
    package.module:function."""
    workload_option: list[str] = everyday(default_factory=list)
    """key=value passed to the workload factory (repeatable)."""
    steps: int = everyday(100)
    """Optimizer steps to run (ignored when --epochs is given)."""
    epochs: float = everyday(0.0)
    """Run this many passes over the training data instead of --steps."""
    batch_size: int = everyday(32)
    """Per-worker micro-batch size."""
    grad_accum: int = 1
    """Accumulate gradients over K micro-batches per step (one push / one allreduce per step)."""
    seed: int = everyday(0)
    """Seed for the model's initial weights and the data order (same in both architectures);
    once the model is built, each process's torch/random/numpy generators are seeded from
    it and the rank, so dropout draws are the same run after run and under either --arch."""
    precision: str = everyday("auto")
    """Compute precision: auto (fp16 on CUDA, bf16 on CPU) | fp32 | fp16 | bf16."""
    wire_dtype: str = "auto"
    """dtype of gradients on the wire: auto (as --precision) | fp32 | fp16 | bf16."""
    worker_weights: str = "auto"
    """PS: dtype of the weights a worker keeps (fp32 masters stay on the shards): auto |
    fp32 | fp16 | bf16. fp16/bf16 halve the worker's memory and the pull's bytes. auto:
    the compute dtype on CUDA when --precision is fp16 or bf16, else fp32. A low-precision
    choice must match a low-precision --precision (fp16 weights under bf16 compute would
    mix dtypes in norms and losses)."""
    device: str = everyday("auto")
    """auto (cuda:LOCAL_RANK if CUDA is present, else cpu) | cpu | cuda."""
    threads: int = 0
    """torch compute threads of this process (--torch-threads, as in psar server; 0:
    torch's default)."""
    save: str = everyday("")
    """Write the final weights (a state_dict) here (rank 0)."""
    report: str = everyday("")
    """Write the summary JSON here; '{rank}' in the path is replaced by the worker's rank."""
    run_dir: str = everyday("")
    """Write a per-step JSONL log of this process into this folder."""
    eval_batches: int = 20
    """Validation batches evaluated at the end (0: skip validation)."""
    log_every: int = everyday(10)
    """Rank 0 prints progress every this many steps (0: never)."""
    metrics_port: int = 0
    """Serve Prometheus /metrics on this port (+ LOCAL_RANK under torchrun; 0: off)."""
    metrics_addr: str = "127.0.0.1"
    """Address the /metrics endpoint binds to."""
    metrics_linger_s: float = 0.0
    """Keep /metrics up this many seconds after training, so a last scrape sees final counts."""
    sigterm_exit_code: int = 143
    """Exit code after SIGTERM (143 = 128 + 15, what torchrun and Kubernetes expect).
    deploy/slurm/ps.sbatch gives 1: srun reports the highest code of a step's tasks, so the
    workers Slurm stops after another one failed then never hide that failure's code."""
    slowdown: float = 1.0
    """Emulate a straggler: after each step's compute, sleep (slowdown - 1) x its measured
    compute time, so this worker runs that many times slower (1: off)."""
    emulate_compute_ms: float = 0.0
    """Emulate compute for benchmarks: pad each step's forward+backward with sleep to this
    many ms (times --slowdown), so many workers share few cores honestly (0: off)."""
    inject_overflow_step: int = 0
    """Testing aid: rank 0 makes its gradient non-finite at this step (0: never)."""
    clip_grad_norm: float = 0.0
    """Clip each update to this global L2 norm, as torch.nn.utils.clip_grad_norm_ clips
    the averaged gradient under DDP (0: off). ps sync: the shards clip the round's mean
    by its norm over every shard; async/ssp: each push by its own gradient's norm
    (docs/own-loop.md, "Clipping")."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer (applied on the shards for ps, on every rank for allreduce)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling for fp16 (enabled automatically when fp16 is used)."""
    ps: PSConfig = field(default_factory=PSConfig)
    """Parameter-server settings."""
    ddp: DDPConfig = field(default_factory=DDPConfig)
    """AllReduce settings."""
    local: LocalConfig = field(default_factory=LocalConfig)
    """Local SGD / DiLoCo settings (--mode local)."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"--arch: unknown {self.arch!r}; accepted: {', '.join(ARCHS)}")
        for name in ("batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.steps < 1 and self.epochs <= 0:
            raise ValueError("--steps must be >= 1 (or give --epochs)")
        if self.epochs < 0 or self.eval_batches < 0 or self.log_every < 0 or self.threads < 0:
            raise ValueError(
                "--epochs, --eval-batches, --log-every and --torch-threads must be >= 0"
            )
        if self.emulate_compute_ms < 0:
            raise ValueError(f"--emulate-compute-ms must be >= 0, got {self.emulate_compute_ms}")
        if not 0.0 <= self.clip_grad_norm < float("inf"):
            raise ValueError(
                f"--clip-grad-norm must be a finite number >= 0 (0: off), got {self.clip_grad_norm}"
            )
        if self.clip_grad_norm and self.local_sgd:
            raise ValueError("--clip-grad-norm with --mode local: not supported; leave it out")
        if self.clip_grad_norm and self.ps.early_pull:
            raise ValueError(
                "--clip-grad-norm with --early-pull: a round's update waits for its norm over "
                "every shard, so nothing comes back early; leave --early-pull out"
            )
        if self.slowdown < 1.0:
            raise ValueError(f"--slowdown must be >= 1 (1 means no slowdown), got {self.slowdown}")
        if not 0 <= self.sigterm_exit_code <= 255:
            raise ValueError(
                f"--sigterm-exit-code must be in [0, 255], got {self.sigterm_exit_code}"
            )
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        choices = {
            "precision": ("auto", "fp32", "fp16", "bf16"),
            "wire_dtype": ("auto", "fp32", "fp16", "bf16"),
            "worker_weights": ("auto", "fp32", "fp16", "bf16"),
            "device": ("auto", "cpu", "cuda"),
        }
        for name, accepted in choices.items():
            if getattr(self, name) not in accepted:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag}: unknown {getattr(self, name)!r}; accepted: {', '.join(accepted)}"
                )
        self._check_local()
        self._check_hybrid()
        if (self.ps.max_workers or self.ps.join) and self.arch != "ps":
            raise ValueError(
                "--max-workers and --join are for --arch ps (allreduce jobs change size "
                "under torchrun --nnodes MIN:MAX, restarting from --checkpoint-dir)"
            )
        from psar.trainkit.precision import check_weights_dtype  # torch: see PSConfig

        check_weights_dtype(self.worker_weights, self.precision)
        for opt in self.workload_option:
            if "=" not in opt:
                raise ValueError(f"--workload-option: expected key=value, got {opt!r}")

    @property
    def elastic(self) -> bool:
        """An elastic PS job (--max-workers, or --join): the shards deal the data."""
        return self.arch == "ps" and (self.ps.max_workers > 0 or self.ps.join)

    @property
    def local_sgd(self) -> bool:
        """--mode local: workers step on their own and synchronise every --sync-every."""
        return local_sgd(self.ps.mode)

    def _check_local(self) -> None:
        """--sync-every belongs to --mode local, and local mode needs fp32 worker weights
        (the inner optimizer steps them on the worker)."""
        if self.local_sgd and self.local.sync_every < 1:
            raise ValueError("--mode local needs --sync-every H (inner steps per sync, >= 1)")
        if not self.local_sgd and self.local.sync_every:
            raise ValueError(
                f"--sync-every {self.local.sync_every} needs --mode local (got --mode "
                f"{self.ps.mode}); accepted with --mode local only"
            )
        if self.local_sgd and self.ddp.checkpoint_dir:
            raise ValueError(
                "--checkpoint-dir with --mode local: DDP checkpoints do not hold the outer "
                "optimizer and anchor weights yet; leave --checkpoint-dir out"
            )
        if self.local_sgd and self.worker_weights not in ("auto", "fp32"):
            raise ValueError(
                f"--worker-weights {self.worker_weights} with --mode local: the inner "
                "optimizer steps the worker's own weights, which must be fp32; accepted: fp32"
            )

    def _check_hybrid(self) -> None:
        """--arch hybrid (worker/hybrid.py) runs sync, async or ssp tables beside a
        synchronous dense allreduce; what it does not do yet is refused by name."""
        if self.arch != "hybrid":
            return
        refused = {
            "--mode local": self.local_sgd,
            "--clip-grad-norm": bool(self.clip_grad_norm),
            "--checkpoint-dir": bool(self.ddp.checkpoint_dir),
        }
        if given := [flag for flag, on in refused.items() if on]:
            raise ValueError(
                f"{', '.join(given)} with --arch hybrid: not supported yet; leave "
                f"{'it' if len(given) == 1 else 'them'} out (or use --arch ps / allreduce)"
            )

    def workload_options(self) -> dict[str, str]:
        return dict(opt.split("=", 1) for opt in self.workload_option)
