"""`psar plan`'s launch command: how to start the regime it picks, with psar's defaults.

The command names only what differs from the defaults of `psar train` and `psar server`,
so what a user runs is what the plan modelled: early pulls, in particular, are what
`psar train` does by itself wherever a worker has a shard on another host
(ps/client/locality.py; the plan's --early-pull defaults to the same), so they appear as
a flag only where the plan was told otherwise.
"""

from __future__ import annotations

from psar.worker.plan_model import PlanInputs, PlanResult

SHARD_PORT = 50051
RDZV_PORT = 29400
_OPTIMIZER_FLAGS = {
    "adamw": ["--optimizer", "adamw"],
    "sgd-momentum": [],  # psar train's default: sgd, momentum 0.9
    "sgd": ["--momentum", "0"],
}


def _default_early_pull(inp: PlanInputs) -> bool:
    """What psar train picks by itself for this layout (the plan's own default)."""
    return (inp.hosts_of_shards > 0 or inp.workers > 1) and inp.sync_every == 1


def train_flags(inp: PlanInputs, arch: str) -> list[str]:
    """psar train's flags for the planned job, beyond --arch and the roles."""
    flags = [*_OPTIMIZER_FLAGS.get(inp.optimizer, [])]
    if inp.wire_dtype != "fp32":
        flags += ["--precision", inp.wire_dtype]  # its wire dtype follows (auto)
    else:
        flags += ["--precision", "fp32"]  # psar train's auto is a low precision
    if inp.sync_every > 1:
        flags += ["--mode", "local", "--sync-every", str(inp.sync_every)]
    if arch == "ps":
        if inp.worker_weights != "fp32":
            flags += ["--worker-weights", inp.worker_weights]
        if inp.early_pull != _default_early_pull(inp):
            flags.append("--early-pull" if inp.early_pull else "--no-early-pull")
        if inp.early_pull and inp.chunk_bytes != 4 * 2**20:
            flags += ["--chunk-mib", f"{inp.chunk_bytes / 2**20:g}"]
    return flags


def launch_lines(result: PlanResult) -> list[str]:
    """The commands of the winner's regime, one line per kind of host."""
    inp = result.inputs
    n, s, k = inp.workers, inp.servers, inp.hosts_of_shards
    flags = " ".join(train_flags(inp, result.winner))
    if result.winner == "allreduce":
        return [
            f"launch ({result.winner}): on each of the {n} worker hosts, one process per host "
            f"(HOST0 the first worker host):",
            f"  torchrun --nnodes {n} --nproc-per-node 1 --rdzv-backend c10d "
            f"--rdzv-endpoint HOST0:{RDZV_PORT} $(which psar) train --arch allreduce {flags}",
        ]
    where = f"on the {k} shard host{'s' if k != 1 else ''}" if k else "on the worker hosts"
    servers = ",".join(f"SHARD{i}:{SHARD_PORT}" for i in range(min(s, 3)))
    if s > 3:
        servers += f",...(all {s} shards, in order)"
    return [
        f"launch ({result.winner}): {s} shard{'s' if s != 1 else ''} {where}, then the "
        f"{n} worker{'s' if n != 1 else ''} (RANK 0..{n - 1}):",
        f"  psar server --bind 0.0.0.0:{SHARD_PORT} --auth-token-file TOKEN "
        "--tls-cert CERT --tls-key KEY",
        f"  psar train --arch ps --servers {servers} --world-size {n} --rank RANK {flags}",
    ]
