"""Pure cost model behind ``psar plan``: per-step communication and memory.

Nothing here does I/O. ``psar.worker.plan`` wraps it in a command line. The model and its
assumptions are written up in ``docs/cost-model.md``; in short it is the alpha-beta
model (a message of ``n`` bytes costs ``alpha + n / beta``) on full-duplex links with
no congestion, where every PS shard has a NIC of its own.

Symbols used in comments and docstrings: P parameters, N workers, S PS shards,
K hosts the shards run on (0: on the worker hosts), M = P x bytes of the wire dtype
(one worker's gradient on the wire), alpha the latency, beta the bandwidth in bytes
per second.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from psar.worker.plan_types import (
    DTYPE_BYTES,
    FP32,
    OPTIMIZER_STATES,
    ArchPlan,
    Comm,
    Memory,
    PlanInputs,
    _ceil_div,
)
from psar.worker.plan_verdict import CLOSE_CALL, choose_winner, margin


def ring_allreduce_comm(m: float, n: int, alpha: float, beta: float) -> Comm:
    """Ring allreduce of ``m`` bytes over ``n`` workers.

    Reduce-scatter then all-gather: 2(N-1) steps, each sending one M/N chunk to the
    right neighbour while receiving one from the left. Full-duplex links let the send
    and the receive of a step share its time, and each step pays the latency once.
    """
    steps = 2 * (n - 1)
    return Comm(steps * alpha, steps * (m / n) / beta)


def ps_worker_comm(m: float, alpha: float, beta: float) -> Comm:
    """A PS worker pushes M then pulls M through its own NIC.

    Sync PS cannot pull the new weights before the round closes, so push and pull are
    sequential: full duplex does not help. Messages to the S shards leave back to
    back, so their latencies overlap and each phase pays alpha once.
    """
    return Comm(2 * alpha, 2 * m / beta)


def ps_shard_comm(m: float, n: int, s: int, alpha: float, beta: float, k: int = 0) -> Comm:
    """A PS shard host takes N*M*l/S in (the pushes), then sends as much out (the pulls),
    l = ceil(S/K) the shards on the busiest of K hosts (K = S when not given: l = 1)."""
    per_host = _ceil_div(s, k) if k else 1
    return Comm(2 * alpha, 2 * (n * m * per_host / s) / beta)


def ps_pipelined_comm(m: float, n: int, s: int, k: int, chunk: float, alpha: float,
                      beta: float) -> tuple[Comm, Comm]:  # fmt: skip
    """(worker NIC, busiest shard NIC) of a pipelined sync PS (early pulls): the pull of
    each chunk travels on the NIC's other direction while later chunks are pushed, so a
    phase costs the larger direction, not the sum, plus a tail: every shard's last chunk
    closes when the push ends (a worker streams to all shards at once, each in the same
    slot order), so a worker then still receives one chunk from each of the S shards and
    a shard host sends its last chunk(s) to each of the N workers. K = 0: a host's NIC
    carries, each way, its worker's bytes to and from the other hosts' shards and the
    other workers' bytes to and from its shards: the ring's 2(N-1)/N*M at S = N."""
    last = min(chunk, m / s)  # a shard's last slot: a chunk, or all it holds
    if k == 0:
        if n == 1:
            return Comm(2 * alpha, 0.0), Comm(2 * alpha, 0.0)
        lo, hi = s // n, _ceil_div(s, n)
        each_way = max(m * (s - c) / s + (n - 1) * m * c / s for c in {lo, hi})
        tail = max(max((s - c) * last, (n - 1) * c * last) for c in {lo, hi})
        nic = Comm(2 * alpha, (each_way + tail) / beta)
        return nic, nic
    per_host = _ceil_div(s, k)
    shard_bytes = n * m * per_host / s
    worker = Comm(2 * alpha, (m + s * last) / beta)
    return worker, Comm(2 * alpha, (shard_bytes + n * per_host * last) / beta)


def colocated_phase_bytes(m: float, n: int, s: int) -> float:
    """Bytes on the busiest worker-host NIC, one direction, in one phase (push or pull)
    when the S shards run on the N worker hosts (K = 0).

    In the push phase a host with l of the shards sends M*(S-l)/S of its worker's
    gradient off the host and receives (N-1)*M*l/S for its shards; the pull mirrors it.
    Full duplex: the phase lasts as long as the larger direction on the busiest NIC.
    """
    if n == 1:
        return 0.0  # worker and every shard share the one host: nothing crosses a NIC
    lo, hi = s // n, _ceil_div(s, n)
    return max(max(m * (s - c) / s, (n - 1) * m * c / s) for c in {lo, hi})


def ps_cpu_bytes(m: float, n: int, s: int, k: int, shared: bool) -> float:
    """Bytes through the data path of the busiest host's PS processes per step (or of all
    of them, `shared`): a worker moves its push and its pull (2M), a shard 2*N*M/S."""
    if shared:
        return 4 * n * m
    per_host = _ceil_div(s, k) if k else _ceil_div(s, n)
    shards = 2 * n * m * per_host / s
    return 2 * m + shards if k == 0 else max(2 * m, shards)


def ring_cpu_bytes(m: float, n: int, shared: bool) -> float:
    """Bytes through the ring's data path per step: each worker sends and receives
    2(N-1)/N*M; `shared`: all N workers' together."""
    total = 4 * (n - 1) * m
    return total if shared else total / n


def cpu_seconds(nbytes: float, rate: float, inp: PlanInputs) -> float:
    """Time the cores need to move `nbytes` (0 when the CPU is not modelled)."""
    return 0.0 if inp.cpu_cores is None else nbytes / rate / inp.cpu_cores


def workers_cpu_seconds(inp: PlanInputs) -> float:
    """Time the shared cores need for every worker's own CPU of a step (N*W/C; 0 unless
    cpu_shared and W are given)."""
    if not (inp.cpu_shared and inp.cpu_cores):
        return 0.0
    return inp.workers * inp.worker_cpu_seconds / inp.cpu_cores


def byteps_bound_seconds(m: float, n: int, k: int, beta: float) -> float:
    """The optimum of BytePS (OSDI 2020) for N workers and K CPU hosts, all with
    bandwidth beta: t = 2N(N-1)M / ((N^2 + KN - 2K) beta), bandwidth only.

    K = 0 is the ring's 2(N-1)/N*M/beta; K = N is M/beta, each worker sending and
    receiving its gradient once, both at the same time (full duplex, pipelined).
    """
    if n == 1:
        return 0.0
    return 2 * n * (n - 1) * m / ((n * n + k * n - 2 * k) * beta)


def ddp_worker_memory(params: int, states: int) -> Memory:
    """A DDP rank: fp32 weights, gradients and optimizer state, and the reducer's flat
    fp32 buckets (DDP copies every gradient into them: gradient_as_bucket_view off)."""
    return Memory(weights=FP32 * params, gradients=FP32 * params,
                  optimizer_state=states * FP32 * params, buffers=FP32 * params)  # fmt: skip


def ps_worker_memory(params: int, weights: str, wire: str) -> Memory:
    """A PS worker: working weights and their gradients (autograd makes them in the
    weights' dtype), and a send buffer per slot in the wire dtype (ps/client/backend.py)."""
    ww = DTYPE_BYTES[weights]
    return Memory(weights=ww * params, gradients=ww * params, optimizer_state=0,
                  buffers=DTYPE_BYTES[wire] * params)  # fmt: skip


def ps_shard_memory(params: int, workers: int, servers: int, states: int, wire: str,
                    weights: str, chunk_rounds: bool, exact: bool = True) -> Memory:  # fmt: skip
    """The largest of S shards in a sync job: fp32 masters and optimizer state; the
    round's gradient (fp16 on the wire with `exact`: an int64 exact sum and its fp32 mean,
    and every worker's push in flight, its fp16 bytes held until it is accepted; else every
    worker's push staged in fp32 and their fp32 sum); a snapshot of the masters in the
    pulled dtype (low-precision worker weights); per-chunk rounds (early pulls): undo
    copies of masters and state and a mean buffer per slot (ps/server/modes)."""
    held = _ceil_div(params, servers)
    exact_fp16 = exact and wire == "fp16"
    round_grad = (8 + FP32 + 2 * workers) if exact_fp16 else (workers + 1) * FP32
    snapshot = DTYPE_BYTES[weights] if weights != "fp32" else 0
    undo = (FP32 + states * FP32 + FP32) if chunk_rounds else 0
    return Memory(weights=0, gradients=round_grad * held,
                  optimizer_state=states * FP32 * held, fp32_masters=FP32 * held,
                  buffers=(snapshot + undo) * held)  # fmt: skip


def plan_allreduce(inp: PlanInputs) -> ArchPlan:
    """DDP with ring allreduce: every worker holds the whole fp32 training state."""
    n, m = inp.workers, inp.wire_bytes
    alpha, beta = inp.latency_seconds, inp.bandwidth_bytes_per_second
    moved = 2 * (n - 1) / n * m  # 0 when N == 1: a ring of one has nobody to talk to
    states = OPTIMIZER_STATES[inp.optimizer]
    return ArchPlan(
        name="allreduce",
        bytes_sent_per_worker_per_step=moved,
        bytes_received_per_worker_per_step=moved,
        worker_comm=ring_allreduce_comm(m, n, alpha, beta),
        memory_per_worker=ddp_worker_memory(inp.params, states),
        tail_comm=ring_allreduce_comm(min(inp.bucket_bytes, m), n, alpha, beta),
        compute_seconds=inp.compute_seconds,
        cpu_seconds=cpu_seconds(
            ring_cpu_bytes(m, n, inp.cpu_shared), inp.allreduce_cpu_bytes_per_second, inp
        ),
        workers_cpu_seconds=workers_cpu_seconds(inp),
    )


def plan_ps(inp: PlanInputs) -> ArchPlan:
    """Sync PS: shards own fp32 masters + optimizer state, workers only compute."""
    n, s, m = inp.workers, inp.servers, inp.wire_bytes
    alpha, beta = inp.latency_seconds, inp.bandwidth_bytes_per_second
    bucket = min(inp.bucket_bytes, m)
    states = OPTIMIZER_STATES[inp.optimizer]
    k = inp.hosts_of_shards

    def sides(size: float) -> tuple[Comm, Comm]:
        if inp.early_pull:
            return ps_pipelined_comm(size, n, s, k, inp.chunk_bytes, alpha, beta)
        if k == 0:  # one NIC per worker host carries the worker's and its shards' bytes
            nic = Comm(2 * alpha, 2 * colocated_phase_bytes(size, n, s) / beta)
            return nic, nic
        return ps_worker_comm(size, alpha, beta), ps_shard_comm(size, n, s, alpha, beta, k)

    # The tail applies the same worker/shard formulas to one bucket spread over S shards.
    worker, shard = sides(m)
    tail_w, tail_s = sides(bucket)
    return ArchPlan(
        name="ps",
        bytes_sent_per_worker_per_step=float(m),
        bytes_received_per_worker_per_step=float(m),
        worker_comm=worker,
        shard_comm=shard,
        bytes_received_per_shard_per_step=n * m / s,
        bytes_sent_per_shard_per_step=n * m / s,
        memory_per_worker=ps_worker_memory(inp.params, inp.worker_weights, inp.wire_dtype),
        memory_per_shard=ps_shard_memory(
            inp.params,
            n,
            s,
            states,
            inp.wire_dtype,
            inp.worker_weights,
            inp.early_pull,
            inp.exact_fp16_sum,
        ),  # fmt: skip
        tail_comm=max(tail_w, tail_s, key=lambda c: c.seconds),
        compute_seconds=inp.compute_seconds,
        cpu_seconds=cpu_seconds(
            ps_cpu_bytes(m, n, s, k, inp.cpu_shared), inp.ps_cpu_bytes_per_second, inp
        ),
        workers_cpu_seconds=workers_cpu_seconds(inp),
    )


@dataclass(frozen=True)
class PlanResult:
    """Both predictions, the winner and a one-sentence reason."""

    inputs: PlanInputs
    allreduce: ArchPlan
    ps: ArchPlan
    winner: str
    reason: str

    @property
    def byteps_bound_seconds(self) -> float:
        """BytePS's optimal comm time for these N, M, beta and K = the shard hosts."""
        inp = self.inputs
        return byteps_bound_seconds(
            inp.wire_bytes, inp.workers, inp.hosts_of_shards, inp.bandwidth_bytes_per_second
        )

    def to_dict(self) -> dict[str, object]:
        inputs = asdict(self.inputs)
        inputs["wire_bytes_per_param"] = DTYPE_BYTES[self.inputs.wire_dtype]
        inputs["model_bytes_on_wire"] = self.inputs.wire_bytes
        inputs["optimizer_states_per_param"] = OPTIMIZER_STATES[self.inputs.optimizer]
        inputs["hosts_of_shards"] = self.inputs.hosts_of_shards
        return {
            "allreduce": self.allreduce.to_dict(),
            "ps": self.ps.to_dict(),
            "winner": self.winner,
            "reason": self.reason,
            "byteps_bound_seconds": self.byteps_bound_seconds,
            "margin": margin(self.allreduce, self.ps),
            "inputs": inputs,
        }


def every_h_steps(arch: ArchPlan, inp: PlanInputs) -> ArchPlan:
    """--mode local: one sync (the same bytes as a step's) every H steps, so each step
    carries 1/H of it. The sync runs after the H-th backward, with nothing to overlap,
    so the whole of it is the exposed tail. Workers also keep their inner optimizer's
    state and the anchor weights (fp32 each); the outer optimizer (Nesterov: one fp32
    state per parameter) lives where the update runs: on the shards, or on every rank."""
    h = inp.sync_every
    if h == 1:
        return arch

    def per_step(c: Comm | None) -> Comm | None:
        return None if c is None else Comm(c.latency_seconds / h, c.bandwidth_seconds / h)

    def div(x: float | None) -> float | None:
        return None if x is None else x / h

    worker = per_step(arch.worker_comm)
    assert worker is not None
    inner = OPTIMIZER_STATES[inp.optimizer] * FP32 * inp.params
    anchor_and_outer = 2 * FP32 * inp.params if arch.memory_per_shard is None else FP32 * inp.params
    mem = arch.memory_per_worker
    shard_mem = arch.memory_per_shard
    if shard_mem is not None:  # the shards hold the masters and the outer momentum only
        shard_mem = replace(shard_mem, optimizer_state=_ceil_div(FP32 * inp.params, inp.servers))
    shard = per_step(arch.shard_comm)
    return replace(
        arch,
        bytes_sent_per_worker_per_step=arch.bytes_sent_per_worker_per_step / h,
        bytes_received_per_worker_per_step=arch.bytes_received_per_worker_per_step / h,
        worker_comm=worker,
        shard_comm=shard,
        bytes_received_per_shard_per_step=div(arch.bytes_received_per_shard_per_step),
        bytes_sent_per_shard_per_step=div(arch.bytes_sent_per_shard_per_step),
        memory_per_worker=replace(
            mem,
            weights=max(mem.weights, FP32 * inp.params),  # the inner steps need fp32 weights
            optimizer_state=inner + anchor_and_outer,
        ),
        memory_per_shard=shard_mem,
        tail_comm=max(worker, shard or worker, key=lambda c: c.seconds),
        cpu_seconds=arch.cpu_seconds / h,
    )


def plan(inp: PlanInputs) -> PlanResult:
    """Predict both architectures for ``inp`` and pick the winner."""
    ar, ps = plan_allreduce(inp), plan_ps(inp)
    ar, ps = every_h_steps(ar, inp), every_h_steps(ps, inp)
    winner, reason = choose_winner(inp, ar, ps)
    if inp.sync_every > 1:
        reason += f" (Sizes in this sentence are per sync; one comes every {inp.sync_every} steps.)"
    close = margin(ar, ps)
    if 0 < close < CLOSE_CALL and not reason.startswith("tie"):
        reason += (
            f" The margin is only {100 * close:.2g}%, less than what the model leaves out "
            f"(CPU time, framing, stragglers): treat it as a tie, where allreduce needs no "
            f"server machines."
        )
    return PlanResult(inputs=inp, allreduce=ar, ps=ps, winner=winner, reason=reason)
