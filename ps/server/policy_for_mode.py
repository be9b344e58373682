"""Which update policy a job's mode names (the one place a mode string becomes a policy)."""

from __future__ import annotations

from ps.server.chunk_rounds import ChunkedSyncPolicy
from ps.server.local_policy import LocalPolicy
from ps.server.policies import AsyncPolicy, SSPPolicy, SyncPolicy, UpdatePolicy


def make_policy(mode: str, staleness: int, *, chunk_rounds: bool = False) -> UpdatePolicy:
    """The policy for a mode name (sync | async | ssp | local); chunk_rounds: sync applies each
    slot as soon as every worker's piece of it is in (ps/server/chunk_rounds.py)."""
    if mode == "sync" and chunk_rounds:
        return ChunkedSyncPolicy()
    if mode == "sync":
        return SyncPolicy()
    if mode == "async":
        return AsyncPolicy()
    if mode == "ssp":
        return SSPPolicy(staleness)
    if mode == "local":  # local SGD / DiLoCo (ps/server/local_policy.py)
        return LocalPolicy()
    raise ValueError(f"unknown mode {mode!r}; accepted: sync, async, ssp, local")
