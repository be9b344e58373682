"""Rank, world size and shard index from flags or each launcher's environment."""

from __future__ import annotations

import pytest

from psar.trainkit.roles import resolve_local_rank, resolve_rank, resolve_shard, resolve_world_size


@pytest.mark.parametrize(
    ("flag", "env", "want"),
    [
        (2, {"RANK": "5"}, 2),  # the flag wins
        (-1, {"RANK": "5", "SLURM_PROCID": "7"}, 5),  # torchrun
        (-1, {"PSAR_RANK": "4", "SLURM_PROCID": "7"}, 4),
        (-1, {"SLURM_PROCID": "7"}, 7),  # Slurm
        (-1, {"JOB_COMPLETION_INDEX": "3"}, 3),  # Kubernetes Indexed Job
        (-1, {}, 0),
    ],
)
def test_rank(flag: int, env: dict, want: int) -> None:
    assert resolve_rank(flag, env) == want


@pytest.mark.parametrize(
    ("flag", "env", "want"),
    [(4, {"WORLD_SIZE": "8"}, 4), (0, {"WORLD_SIZE": "8"}, 8), (0, {"SLURM_NTASKS": "6"}, 6),
     (0, {"PSAR_WORLD_SIZE": "3"}, 3), (0, {}, 1)],
)  # fmt: skip
def test_world_size(flag: int, env: dict, want: int) -> None:
    assert resolve_world_size(flag, env) == want


def test_local_rank() -> None:
    assert resolve_local_rank({"LOCAL_RANK": "1"}) == 1
    assert resolve_local_rank({"SLURM_LOCALID": "2"}) == 2
    assert resolve_local_rank({}) == 0


@pytest.mark.parametrize(
    ("flag", "env", "want"),
    [(1, {"PSAR_SHARD": "3"}, 1), (-1, {"PSAR_SHARD": "3"}, 3),
     (-1, {"HOSTNAME": "psar-shard-2"}, 2), (-1, {"SLURM_PROCID": "5"}, 5),
     (-1, {"SLURM_PROCID": "1", "HOSTNAME": "gpu-12"}, 1), (-1, {}, 0)],
)  # fmt: skip
def test_shard(flag: int, env: dict, want: int) -> None:
    assert resolve_shard(flag, env) == want


def test_garbage_is_named() -> None:
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        resolve_rank(-1, {"RANK": "x"})
