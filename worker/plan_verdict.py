"""Which architecture `psar plan` picks, and the one sentence that says why.

Split from worker/plan_model.py (the cost model itself): the winner is the lower
predicted step (with overlap) or, without a compute time, the lower communication time;
the reason names the term that decides it (docs/cost-model.md, "The winner").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from psar.worker.plan_units import human_bytes, human_seconds

if TYPE_CHECKING:
    from psar.worker.plan_types import ArchPlan, PlanInputs


def _score(arch: ArchPlan) -> float:
    """What the winner is judged on: overlapped step time if known, else comm time."""
    step = arch.step_seconds_overlap
    return arch.comm_seconds_per_step if step is None else step


#: Below this relative difference of the two predictions the verdict says it is a
#: near-tie: shards on the worker hosts (K = 0) tie the ring on bandwidth by design and
#: "win" by a few latencies, far less than what the model leaves out (CPU, framing).
CLOSE_CALL = 0.05


def margin(ar: ArchPlan, ps: ArchPlan) -> float:
    """Relative difference of the two scores: |a - p| / min(a, p) (0 when both are 0)."""
    a, p = _score(ar), _score(ps)
    return abs(a - p) / min(a, p) if min(a, p) > 0 else 0.0


def _ratio(n: int, s: int) -> str:
    """N/S as a count when whole (1024, not 1.02e+03), else to one decimal."""
    return str(n // s) if n % s == 0 else f"{n / s:.1f}"


def _comm_reason(inp: PlanInputs, ar: ArchPlan, ps: ArchPlan) -> str:
    """Why one design moves gradients faster; PS can only win on latency (see docs)."""
    n, s, m = inp.workers, inp.servers, inp.wire_bytes
    if n == 1:
        return f"with one worker the ring has nothing to exchange, while PS still pushes and pulls M = {human_bytes(m)}"
    if "cpu" in (ar.bottleneck, ps.bottleneck):
        return _cpu_reason(inp, ar, ps)
    wins_on_bandwidth = ps.worker_comm.bandwidth_seconds < ar.worker_comm.bandwidth_seconds
    if ar.comm_seconds_per_step > ps.comm_seconds_per_step and wins_on_bandwidth:
        return (
            f"with early pulls each PS worker sends its gradient and receives the weights "
            f"once, both at the same time ({human_seconds(ps.worker_comm.bandwidth_seconds)} on "
            f"the wire), while each ring worker sends and receives 2(N-1)/N*M = "
            f"{human_bytes(ar.bytes_sent_per_worker_per_step)} "
            f"({human_seconds(ar.worker_comm.bandwidth_seconds)}); the K = "
            f"{inp.hosts_of_shards} shard hosts' NICs take the rest"
        )
    if ar.comm_seconds_per_step > ps.comm_seconds_per_step:
        return (
            f"the ring pays the latency on 2(N-1) = {2 * (n - 1)} sequential steps "
            f"({human_seconds(ar.worker_comm.latency_seconds)}) against PS's 2, which outweighs "
            f"the ring's bandwidth saving at this message size"
        )
    if ps.bottleneck == "shard_nic":
        k = inp.hosts_of_shards
        if k != s:  # several shards share a host's NIC
            per = ps.shard_comm.bandwidth_seconds * inp.bandwidth_bytes_per_second / 2
            return (
                f"the busiest of the K = {k} shard hosts' NICs must carry "
                f"{human_bytes(per)} in and again out per step (N*M*ceil(S/K)/S), while the ring "
                f"spreads the load so each worker sends only 2(N-1)/N*M = "
                f"{human_bytes(ar.bytes_sent_per_worker_per_step)}"
            )
        return (
            f"each PS shard's NIC must carry N*M/S = {human_bytes(n * m / s)} in and again out "
            f"per step ({_ratio(n, s)} workers per shard), while the ring spreads the load so each "
            f"worker sends only 2(N-1)/N*M = {human_bytes(ar.bytes_sent_per_worker_per_step)}"
        )
    if inp.early_pull:
        return (
            f"even with early pulls the PS side needs "
            f"{human_seconds(ps.comm_seconds_per_step)} per step (worker NIC "
            f"{human_seconds(ps.worker_comm.seconds)}, busiest shard NIC "
            f"{human_seconds(ps.shard_comm.seconds if ps.shard_comm else 0.0)}) against the "
            f"ring's {human_seconds(ar.comm_seconds_per_step)}"
        )
    if inp.hosts_of_shards == 0:
        return (
            f"with the shards on the worker hosts each NIC carries "
            f"{human_bytes(ps.worker_comm.bandwidth_seconds * inp.bandwidth_bytes_per_second / 2)}"
            f" each way in the push and again in the pull "
            f"({human_seconds(ps.worker_comm.bandwidth_seconds)} on the wire), no less than the "
            f"ring's {human_seconds(ar.worker_comm.bandwidth_seconds)}, and the ring's "
            f"{2 * (n - 1)} latency rounds cost only {human_seconds(ar.worker_comm.latency_seconds)}"
        )
    return (
        f"PS workers push M then pull M one after the other "
        f"({human_seconds(ps.worker_comm.bandwidth_seconds)} on the wire), while the ring's "
        f"sends and receives share the full-duplex links "
        f"({human_seconds(ar.worker_comm.bandwidth_seconds)}) and its {2 * (n - 1)} latency "
        f"rounds cost only {human_seconds(ar.worker_comm.latency_seconds)} (early pulls, "
        f"psar train's default with shards on other hosts, overlap push and pull: psar plan "
        f"without --no-early-pull)"
    )


def _cpu_reason(inp: PlanInputs, ar: ArchPlan, ps: ArchPlan) -> str:
    """The cores, not the links, bound at least one side (--cpu-cores)."""
    where = (
        f"the {inp.cpu_cores:g} cores every host shares"
        if inp.cpu_shared
        else f"{inp.cpu_cores:g} cores per host"
    )
    extra = (
        f"; the workers' own CPU makes each step's compute phase at least "
        f"{human_seconds(ar.workers_cpu_seconds)} on those cores (N*W/C, for both)"
        if ar.workers_cpu_seconds
        else ""
    )
    return (
        f"the CPU that moves the bytes bounds the step ({where}): the PS's processes move "
        f"{human_seconds(ps.cpu_seconds)} worth of bytes per step at "
        f"{human_bytes(inp.ps_cpu_bytes_per_second)}/s per core (a worker its push and pull, "
        f"a shard N*M/S in and out), the ring's {human_seconds(ar.cpu_seconds)} at "
        f"{human_bytes(inp.allreduce_cpu_bytes_per_second)}/s; the links alone would take "
        f"{human_seconds(ps.link_seconds_per_step)} and "
        f"{human_seconds(ar.link_seconds_per_step)}{extra}"
    )


def choose_winner(inp: PlanInputs, ar: ArchPlan, ps: ArchPlan) -> tuple[str, str]:
    """Pick the lower predicted step (overlapped) or comm time and say why."""
    a, p = _score(ar), _score(ps)
    if abs(a - p) <= 1e-12 * max(a, p):
        what = "step" if inp.compute_seconds is not None else "communication"
        return "allreduce", (
            f"tie at {human_seconds(a)} of {what} per step; allreduce is preferred because it "
            f"needs no server machines"
        )
    winner, loser = (ar, ps) if a < p else (ps, ar)
    comm_winner = ar if ar.comm_seconds_per_step < ps.comm_seconds_per_step else ps
    if inp.compute_seconds is None:
        return winner.name, f"{winner.name} wins: {_comm_reason(inp, ar, ps)}."
    compute = inp.compute_seconds
    steps = (
        f"{human_seconds(_score(winner))} vs {human_seconds(_score(loser))} per step with overlap"
    )
    tails = f"{human_seconds(winner.tail_seconds)} vs {human_seconds(loser.tail_seconds)}"
    if max(ar.comm_seconds_per_step, ps.comm_seconds_per_step) <= compute:
        return winner.name, (
            f"{winner.name} wins ({steps}): both hide their communication behind "
            f"{human_seconds(compute)} of compute, and its non-overlappable last bucket is "
            f"shorter ({tails})."
        )
    if winner is comm_winner and winner.comm_seconds_per_step < loser.comm_seconds_per_step:
        return winner.name, f"{winner.name} wins ({steps}): {_comm_reason(inp, ar, ps)}."
    return winner.name, (
        f"{winner.name} wins ({steps}) despite communicating no faster, because its "
        f"non-overlappable last bucket is shorter ({tails})."
    )
