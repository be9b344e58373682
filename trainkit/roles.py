"""How a process learns its rank, world size and shard index: flags first, then the
environment each launch engine provides (docs/launch-contract.md lists them all).

Order (the first one set wins):
- rank:       --rank, RANK (torchrun), PSAR_RANK, SLURM_PROCID, JOB_COMPLETION_INDEX
              (Kubernetes Indexed Job), else 0
- world size: --world-size, WORLD_SIZE (torchrun), PSAR_WORLD_SIZE, SLURM_NTASKS, else 1
- local rank: LOCAL_RANK (torchrun), SLURM_LOCALID, else 0
- shard:      --shard, PSAR_SHARD, SLURM_PROCID, the ordinal of a StatefulSet pod name
              (HOSTNAME "psar-shard-3" -> 3), else 0. SLURM_PROCID comes first because
              Slurm nodes are often named like "gpu-12", which is no shard index.
- servers:    --servers, PSAR_SERVERS
"""

from __future__ import annotations

import re
from collections.abc import Mapping

RANK_VARS = ("RANK", "PSAR_RANK", "SLURM_PROCID", "JOB_COMPLETION_INDEX")
WORLD_VARS = ("WORLD_SIZE", "PSAR_WORLD_SIZE", "SLURM_NTASKS")
LOCAL_VARS = ("LOCAL_RANK", "SLURM_LOCALID")


def _first_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        raw = env.get(name, "").strip()
        if raw:
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment {name}={raw!r} is not an integer") from None
    return default


def resolve_rank(flag: int, env: Mapping[str, str]) -> int:
    return flag if flag >= 0 else _first_int(env, RANK_VARS, 0)


def resolve_world_size(flag: int, env: Mapping[str, str]) -> int:
    return flag if flag > 0 else _first_int(env, WORLD_VARS, 1)


def resolve_local_rank(env: Mapping[str, str]) -> int:
    return _first_int(env, LOCAL_VARS, 0)


def resolve_shard(flag: int, env: Mapping[str, str]) -> int:
    if flag >= 0:
        return flag
    for name in ("PSAR_SHARD", "SLURM_PROCID"):
        if env.get(name, "").strip():
            return _first_int(env, (name,), 0)
    m = re.search(r"-(\d+)$", env.get("HOSTNAME", ""))
    return int(m.group(1)) if m else 0
