"""`psar plan` for models with sparse embedding tables: four ways to train them.

Pure (no I/O, no torch), next to the dense model of worker/plan_model.py whose formulas
it reuses; docs/cost-model.md, "Sparse tables", writes it up. The dense layers are
`PlanInputs.params` (P), the tables `SparseInputs.table_rows` x `dim`. Per step and
worker, u rows of the tables are touched (expected distinct ids of the batch's Zipf
draws, worker/plan_zipf.py) and U across all N workers (what a shard applies, and what
every DDP rank coalesces and applies).

- allreduce_dense: DDP with dense gradients: the tables are P's too, ring-allreduced.
- allreduce_sparse: DDP with `sparse=True` tables: the dense part ring-allreduced, and per
  table gloo allgathers every rank's coalesced rows (int64 id + fp32 values); every rank
  holds the whole tables and their optimizer state.
- ps: every parameter through the shards: the dense part as `plan_ps`, plus the touched
  rows pulled before the forward and pushed after the backward.
- hybrid: the tables on the shards (rows as under ps), the dense part ring-allreduced
  while the rows are pushed (the two overlap); workers hold the dense part and the rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from psar.worker.plan_model import (
    colocated_phase_bytes,
    ddp_worker_memory,
    plan_allreduce,
    plan_ps,
    ring_allreduce_comm,
    ring_cpu_bytes,
)
from psar.worker.plan_types import DTYPE_BYTES, FP32, OPTIMIZER_STATES, Comm, Memory, PlanInputs
from psar.worker.plan_types import _ceil_div as ceil_div
from psar.worker.plan_zipf import expected_distinct

ID_BYTES = 8  # int64 row ids on every wire (PullRows, PushRows, gloo's sparse indices)

#: The tables' optimizers (psar train --sparse-optimizer).
SPARSE_OPTIMIZERS = ("sgd", "adagrad", "lazy_adam")
#: Their fp32 state per table element on a DDP rank, where torch keeps it dense (Adagrad's
#: sum, SparseAdam's two moments); a shard keeps adagrad's one accumulator per row instead.
_DDP_STATE = {"sgd": 0, "adagrad": 1, "lazy_adam": 2}

#: Seconds of the cores per row beyond moving its bytes and beyond W (`--worker-cpu-ms`:
#: one DDP-sparse rank's CPU per step in a ring of one, which dedups, coalesces and applies
#: its own u rows), on this project's 2-core AMD EPYC VM, 2026-12-07, recsys 1M + 100k rows,
#: batch 4096, 2 workers, 2 shards, derived from the *measured steps* (wall) of
#: `python bench/sparse.py --rows 1000000 --steps 200 --dense-max-rows 0 --ways
#: hybrid,allreduce_sparse,torchrec --repeats 3 --no-plan` (medians: hybrid 260,678
#: samples/s, 31.4 ms a step; DDP-sparse 225,882, 36.3 ms) and W = 17.23 ms
#: (bench/experiments/sparse_cpu.py), so they hold the time the cores wait on the row path
#: too (gloo's sparse allreduce leaves DDP's ranks idle ~40% of its wall; CPU time alone
#: gave 0.01 us a DDP row and 0.25 us a PS row): a DDP rank's per row of the union it
#: applies beyond its own ((36.3 - W - its gloo bytes 2.3 ms) / 9,188 rows), and the PS
#: path's ((31.4 - W) x 2 cores - its row bytes 11.8 ms) / 24,532 rows = 0.68 us, split
#: between a shard's and a worker's as their CPU windows split (2 : 1). Docs:
#: docs/cost-model.md "Sparse tables".
DEFAULT_ROW_CPU_PS_WORKER = 0.22e-6
DEFAULT_ROW_CPU_PS_SHARD = 0.46e-6
DEFAULT_ROW_CPU_DDP = 1.8e-6
#: The cores' seconds of one worker's dense round with one shard under --arch ps (its push
#: and its pull, both ends, the frames and the round's wait), which a hybrid step no longer
#: has: hybrid with and without its per-step round-slot round trips, alternated 3 times at
#: 10M rows (bench/sparse.py --ways hybrid): 267.6k -> 304.2k samples/s, 3.7 ms a step
#: for 2 workers x 2 shards on 2 cores (docs/results.md, 2026-12-07).
DEFAULT_ROUND_CPU_PS = 1.85e-3


@dataclass(frozen=True)
class SparseInputs:
    """The tables of the model and how a step touches them; sizes in rows and bytes."""

    table_rows: tuple[int, ...]
    dim: int = 64
    bag: int = 4
    """Lookups per sample per table."""
    batch: int = 4096
    """Samples per worker per step."""
    zipf: float = 1.05
    touched_rows: float | None = None
    """Given directly: distinct rows one worker touches per step, all tables (the union
    over workers is then taken as min(N u, rows): no overlap)."""
    worker_mem_bytes: int | None = None
    sparse_wire_dtype: str = "fp16"
    sparse_optimizer: str = "sgd"
    row_cpu_ps_worker: float = DEFAULT_ROW_CPU_PS_WORKER
    row_cpu_ps_shard: float = DEFAULT_ROW_CPU_PS_SHARD
    row_cpu_ddp: float = DEFAULT_ROW_CPU_DDP
    round_cpu_ps: float = DEFAULT_ROUND_CPU_PS
    """Seconds of the cores per worker per shard per step for --arch ps's dense round."""

    def __post_init__(self) -> None:
        if not self.table_rows or min(self.table_rows) < 1:
            raise ValueError(f"table rows must be >= 1 each, got {self.table_rows}")
        if self.dim < 1 or self.bag < 1 or self.batch < 1:
            raise ValueError("dim, bag and batch must be >= 1")
        if not 0 <= self.zipf < float("inf"):
            raise ValueError(f"zipf exponent must be >= 0, got {self.zipf}")
        if self.touched_rows is not None and not 0 <= self.touched_rows <= sum(self.table_rows):
            raise ValueError(f"touched rows must be between 0 and the rows of all tables, "
                             f"got {self.touched_rows}")  # fmt: skip
        if self.sparse_wire_dtype not in DTYPE_BYTES:
            raise ValueError(f"sparse wire dtype must be one of {sorted(DTYPE_BYTES)}")
        if self.sparse_optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"sparse optimizer must be one of {SPARSE_OPTIMIZERS}")

    @property
    def elements(self) -> int:
        return sum(self.table_rows) * self.dim

    def touched(self, workers: int) -> tuple[float, float]:
        """(u, U): distinct rows one worker touches per step, and all N together."""
        if self.touched_rows is not None:
            return self.touched_rows, min(workers * self.touched_rows, sum(self.table_rows))
        n = self.batch * self.bag

        def total(draws: float) -> float:
            return sum(expected_distinct(draws, r, self.zipf) for r in self.table_rows)

        return total(n), total(workers * n)


@dataclass(frozen=True)
class SparseArch:
    """One design's predicted step: link and CPU time, bytes, memory, whether it fits."""

    name: str
    bytes_sent_per_worker_per_step: float
    bytes_received_per_worker_per_step: float
    link: Comm
    cpu_seconds: float
    memory_per_worker: Memory
    memory_per_shard: Memory | None
    compute_seconds: float | None
    workers_cpu_seconds: float
    fits: bool
    bytes_per_shard_per_step: float | None = None

    @property
    def comm_seconds_per_step(self) -> float:
        return max(self.link.seconds, self.cpu_seconds)

    @property
    def step_seconds(self) -> float | None:
        """Compute, then communication: row pulls precede the forward and the sparse
        gradients exist only after the backward, so nothing overlaps (see docs)."""
        if self.compute_seconds is None:
            return None
        return max(self.compute_seconds, self.workers_cpu_seconds) + self.comm_seconds_per_step

    @property
    def score(self) -> float:
        step = self.step_seconds
        return self.comm_seconds_per_step if step is None else step

    def to_dict(self, samples_per_step: int) -> dict[str, object]:
        out: dict[str, object] = {
            "bytes_sent_per_worker_per_step": self.bytes_sent_per_worker_per_step,
            "bytes_received_per_worker_per_step": self.bytes_received_per_worker_per_step,
            "link_seconds_per_step": self.link.seconds,
            "cpu_seconds_per_step": self.cpu_seconds,
            "comm_seconds_per_step": self.comm_seconds_per_step,
            "bottleneck": "cpu" if self.cpu_seconds > self.link.seconds else "links",
            "memory_per_worker_bytes": self.memory_per_worker.total,
            "memory_per_worker_breakdown": asdict(self.memory_per_worker),
            "fits": self.fits,
        }
        if self.memory_per_shard is not None:
            out["memory_per_shard_bytes"] = self.memory_per_shard.total
            out["bytes_per_shard_per_step"] = self.bytes_per_shard_per_step
        if self.step_seconds is not None:
            out["step_seconds"] = self.step_seconds
            out["samples_per_second"] = (
                samples_per_step / self.step_seconds if self.step_seconds else None
            )
        return out


def _cpu(nbytes: float, rate: float, rows_cpu: float, inp: PlanInputs) -> float:
    """Seconds the cores need for `nbytes` at `rate` plus `rows_cpu` CPU-seconds."""
    return 0.0 if inp.cpu_cores is None else (nbytes / rate + rows_cpu) / inp.cpu_cores


def _row_phase(worker_bytes: float, inp: PlanInputs, messages: int) -> tuple[Comm, Comm]:
    """(worker NIC, busiest shard NIC) of one row phase: each worker sends (or receives)
    `worker_bytes`, spread evenly over the shards (row r lives on shard r % S)."""
    n, s, k = inp.workers, inp.servers, inp.hosts_of_shards
    alpha, beta = inp.latency_seconds, inp.bandwidth_bytes_per_second
    lat = messages * alpha
    if k == 0:  # a worker host's NIC carries its worker's and its shards' rows
        nic = Comm(lat, colocated_phase_bytes(worker_bytes, n, s) / beta)
        return nic, nic
    shard = n * worker_bytes * ceil_div(s, k) / s
    return Comm(lat, worker_bytes / beta), Comm(lat, shard / beta)


def _slower(*comms: Comm) -> Comm:
    return max(comms, key=lambda c: c.seconds)


def _add(a: Comm, b: Comm) -> Comm:
    return Comm(a.latency_seconds + b.latency_seconds, a.bandwidth_seconds + b.bandwidth_seconds)


@dataclass(frozen=True)
class _Rows:
    """A step's row traffic per worker (PS and hybrid alike)."""

    pull_request: float  # ids out
    pull_reply: float  # rows in, in the worker weights' dtype
    push: float  # ids and row gradients out, in the sparse wire dtype


def _rows(inp: PlanInputs, sp: SparseInputs, u: float) -> _Rows:
    return _Rows(ID_BYTES * u, u * sp.dim * DTYPE_BYTES[inp.worker_weights],
                 u * (ID_BYTES + sp.dim * DTYPE_BYTES[sp.sparse_wire_dtype]))  # fmt: skip


def _row_cache(inp: PlanInputs, sp: SparseInputs, u: float, r: _Rows) -> int:
    """A worker's pulled rows and their gradients (weights' dtype) and the push buffer."""
    return int(2 * u * sp.dim * DTYPE_BYTES[inp.worker_weights] + r.push)


def _shard_tables(inp: PlanInputs, sp: SparseInputs, u_all: float) -> Memory:
    """The largest shard's rows of every table (fp32) and their optimizer state, and one
    round's pushes of its rows held in fp32 (N workers' rows, ids included)."""
    held = ceil_div(sp.elements, inp.servers)
    rows_held = ceil_div(sum(sp.table_rows), inp.servers)
    state = {"sgd": 0, "adagrad": FP32 * rows_held, "lazy_adam": 2 * FP32 * held + 8 * rows_held}
    pushes = inp.workers * ceil_div(int(u_all), inp.servers) * (FP32 * sp.dim + ID_BYTES)
    return Memory(weights=0, gradients=pushes, optimizer_state=state[sp.sparse_optimizer],
                  fp32_masters=FP32 * held)  # fmt: skip


def _fits(mem: Memory, sp: SparseInputs) -> bool:
    return sp.worker_mem_bytes is None or mem.total <= sp.worker_mem_bytes


def _plus(a: Memory, b: Memory) -> Memory:
    return Memory(*(x + y for x, y in zip(asdict(a).values(), asdict(b).values(), strict=True)))


@dataclass(frozen=True)
class _RowPath:
    """The rows through the shards, as ps and hybrid move them: the pull before the
    forward (one request per table, ids out and rows back at once, full duplex), the push
    after the backward (one PushTables per shard); and the cores that takes (the bytes at
    the PS's rate, each end counting, plus the per-row work of workers and shards)."""

    rows: _Rows
    pull: Comm  # the slower of the worker NIC and the busiest shard NIC
    push_worker: Comm
    push_shard: Comm
    cpu_seconds: float
    bytes_per_shard: float  # in and out


def _row_path(inp: PlanInputs, sp: SparseInputs, u: float, round_cpu: float = 0.0) -> _RowPath:
    """`round_cpu`: the cores' seconds of a dense round per worker per shard, half at each
    end (--arch ps's; hybrid has none: its ranks join by a collective)."""
    n, s, k = inp.workers, inp.servers, inp.hosts_of_shards
    r = _rows(inp, sp, u)
    pull = _slower(*_row_phase(max(r.pull_request, r.pull_reply), inp, len(sp.table_rows)))
    push_w, push_s = _row_phase(r.push, inp, 1)
    row_bytes = r.pull_request + r.pull_reply + r.push  # one worker's, one end
    per_host = ceil_div(s, k) if k else ceil_div(s, n)  # shards on the busiest shard host
    worker = (row_bytes, u * sp.row_cpu_ps_worker + s * round_cpu / 2)
    shard = (row_bytes * n * per_host / s,
             n * per_host * (u / s * sp.row_cpu_ps_shard + round_cpu / 2))  # fmt: skip
    if inp.cpu_shared:  # every worker's and every shard's share on the same cores
        nbytes = 2 * n * row_bytes
        rows_cpu = n * u * (sp.row_cpu_ps_worker + sp.row_cpu_ps_shard) + n * s * round_cpu
    elif k == 0:  # a worker host runs its worker and its shards
        nbytes, rows_cpu = worker[0] + shard[0], worker[1] + shard[1]
    else:  # the busier of a worker host and the busiest shard host
        rate = inp.ps_cpu_bytes_per_second
        nbytes, rows_cpu = max(worker, shard, key=lambda x: x[0] / rate + x[1])
    cpu = _cpu(nbytes, inp.ps_cpu_bytes_per_second, rows_cpu, inp)
    return _RowPath(r, pull, push_w, push_s, cpu, n * row_bytes / s)


def plan_sparse(inp: PlanInputs, sp: SparseInputs) -> dict[str, SparseArch]:
    """The four designs' predictions, by name."""
    n = inp.workers
    u, u_all = sp.touched(n)
    alpha, beta = inp.latency_seconds, inp.bandwidth_bytes_per_second
    states = OPTIMIZER_STATES[inp.optimizer]
    shared = inp.cpu_shared
    wcpu = n * inp.worker_cpu_seconds / inp.cpu_cores if shared and inp.cpu_cores else 0.0
    base = {"compute_seconds": inp.compute_seconds, "workers_cpu_seconds": wcpu}
    m_dense = inp.wire_bytes
    ring = ring_allreduce_comm(m_dense, n, alpha, beta)
    ring_moved = 2 * (n - 1) / n * m_dense
    ring_cpu = _cpu(
        ring_cpu_bytes(m_dense, n, shared), inp.allreduce_cpu_bytes_per_second, 0.0, inp
    )
    dense_mem = ddp_worker_memory(inp.params, states)
    out: dict[str, SparseArch] = {}

    # allreduce_dense: the tables are dense parameters like any other.
    ad = plan_allreduce(replace(inp, params=inp.params + sp.elements))
    ad_mem = ddp_worker_memory(inp.params + sp.elements, states)
    out["allreduce_dense"] = SparseArch(
        "allreduce_dense", ad.bytes_sent_per_worker_per_step, ad.bytes_received_per_worker_per_step,
        ad.worker_comm, ad.cpu_seconds, ad_mem, None, fits=_fits(ad_mem, sp), **base)  # fmt: skip

    # allreduce_sparse: gloo allgathers ids then values, per table, ring style: each rank
    # sends and receives every other rank's rows, (N - 1) u (8 + 4 dim), then applies the
    # union U (its own u are in W, measured in a ring of one).
    gathered = (n - 1) * u * (ID_BYTES + FP32 * sp.dim)
    sparse_comm = Comm(2 * len(sp.table_rows) * (n - 1) * alpha, gathered / beta)
    ranks = n if shared else 1
    as_cpu = ring_cpu + _cpu(ranks * 2 * gathered, inp.allreduce_cpu_bytes_per_second,
                             ranks * (u_all - u) * sp.row_cpu_ddp, inp)  # fmt: skip
    table = sp.elements * FP32
    as_mem = _plus(dense_mem, Memory(
        weights=table, gradients=int(u_all * (ID_BYTES + FP32 * sp.dim)),
        optimizer_state=_DDP_STATE[sp.sparse_optimizer] * table))  # fmt: skip
    out["allreduce_sparse"] = SparseArch(
        "allreduce_sparse", ring_moved + gathered, ring_moved + gathered,
        _add(ring, sparse_comm) if n > 1 else Comm(0.0, 0.0), as_cpu, as_mem, None,
        fits=_fits(as_mem, sp), **base)  # fmt: skip

    rp = _row_path(inp, sp, u)
    r, cache, tables = rp.rows, _row_cache(inp, sp, u, rp.rows), _shard_tables(inp, sp, u_all)

    # ps: rows are pushed before the dense push of the same clock, and pulled in the
    # forward: the three phases one after the other.
    ps = plan_ps(inp)
    assert ps.memory_per_shard is not None
    ps_rows = _row_path(inp, sp, u, sp.round_cpu_ps)  # the same rows, and the dense rounds
    ps_mem = replace(ps.memory_per_worker, buffers=ps.memory_per_worker.buffers + cache)
    out["ps"] = SparseArch(
        "ps", ps.bytes_sent_per_worker_per_step + r.pull_request + r.push,
        ps.bytes_received_per_worker_per_step + r.pull_reply,
        _add(_add(rp.pull, _slower(rp.push_worker, rp.push_shard)), Comm(0.0, ps.link_seconds_per_step)),
        ps.cpu_seconds + ps_rows.cpu_seconds, ps_mem, _plus(ps.memory_per_shard, tables),
        fits=_fits(ps_mem, sp),
        bytes_per_shard_per_step=2 * (ps.bytes_received_per_shard_per_step or 0.0) + rp.bytes_per_shard,
        **base)  # fmt: skip

    # hybrid: the ring's bytes leave the worker's NIC with the row push, at the same time;
    # then the ranks join (a one-number allreduce: sync rounds, worker/hybrid.py).
    both = Comm(max(rp.push_worker.latency_seconds, ring.latency_seconds),
                (r.push + ring_moved) / beta)  # fmt: skip
    push = _slower(both, rp.push_shard, ring) if n > 1 else _slower(rp.push_worker, rp.push_shard)
    push = _add(push, Comm(2 * (n - 1) * alpha, 0.0))
    h_mem = replace(dense_mem, buffers=dense_mem.buffers + cache)
    out["hybrid"] = SparseArch(
        "hybrid", ring_moved + r.pull_request + r.push, ring_moved + r.pull_reply,
        _add(rp.pull, push), ring_cpu + rp.cpu_seconds, h_mem, tables, fits=_fits(h_mem, sp),
        bytes_per_shard_per_step=rp.bytes_per_shard, **base)  # fmt: skip
    return out
