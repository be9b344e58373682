"""Early pulls: a worker's pull that streams while its own push is still arriving (sync,
`psar server --chunk-rounds`, the TCP data plane; docs/architecture.md, "Early pulls").

Why: with per-chunk rounds a shard applies each slot as soon as every worker has pushed
it (ps/server/modes/sync_chunks.py). An ordinary pull still waits for the whole round, so a
worker's link carries its push, then its pull: 2M/B per step. Sent back as soon as each
slot is applied, the pull travels on the link's other direction while the rest of the
push arrives, which is what lets a PS with its own shard hosts beat ring allreduce's
2(n-1)/n M/B (the BytePS bound; bench/links_grid.py).

What is sent early can still change: a slot applied early is undone if the round is
skipped (an overflow verdict), a worker leaves, or a slot turns out absent in some push
(ChunkedSyncPolicy restores it and redoes it at the close). So the header comes last,
once the round has closed, and says whether the early pieces still hold (`early_void`):
the policy counts every change of a slot's master (`writes`); if any slot sent early has
changed since, every slot follows the header again, else only those not sent yet. A
worker lets nothing it pulled early into its parameters before that header
(ps/client/backend_overlap.py).

A shard without per-chunk rounds (or in async/ssp) answers as for an ordinary pull, once
the worker's push of that clock is in, so a worker may always ask for an early pull.

The pull itself is Pulls.pull_early (ps/server/pulls/pulls.py); here is what it reads of the
per-chunk rule's applied slots while the round is open.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from psar.ps import wire
from psar.ps.errors import Cancelled
from psar.ps.server.state import ShardData

ALIVE_EVERY_S = 1.0
"""How often a waiting early pull asks whether its worker is still there."""

if TYPE_CHECKING:
    from psar.ps.server.modes.sync_chunks import ChunkedSyncPolicy

EarlyItem = tuple[Any, ...]
"""("piece", key, offset, bytes) or ("header", PullHeader, early_void)."""


def check_alive(alive: Callable[[], bool], clock: int) -> None:
    if not alive():
        raise Cancelled(f"early pull at clock {clock}: the worker hung up while it waited")


def next_applied(
    data: ShardData,
    policy: ChunkedSyncPolicy,
    clock: int,
    dtype: torch.dtype,
    sent: dict[str, int],
    deadline: float,
    alive: Callable[[], bool],
) -> list[tuple[str, int, list[tuple[int, Any]]]] | None:
    """Wait for slots applied early that were not sent yet; their bytes (copied while no
    update can touch them), or None once the round closed, the policy was replaced or
    time is up (the caller then serves the rest as an ordinary pull)."""

    def news() -> list[str]:
        return [k for k in list(policy.applied) if k not in sent]

    def done() -> bool:
        return data.rounds >= clock or policy.retired or time.monotonic() >= deadline

    with policy._wake:
        while not (news() or done()):
            policy._wake.wait(min(max(0.0, deadline - time.monotonic()), ALIVE_EVERY_S))
            check_alive(alive, clock)
        keys = news()
        if not keys:
            return None
    out = []
    with policy._apply_lock:  # no update or undo runs while the bytes are copied
        for key in keys:
            if key in policy.applied:
                out.append((key, policy.writes[key], _copy(data, policy, key, dtype)))
    return out


def _copy(
    data: ShardData, policy: ChunkedSyncPolicy, key: str, dtype: torch.dtype
) -> list[tuple[int, Any]]:
    """A slot's wire pieces, shared by every early puller of the same write."""
    stamp = policy.writes[key]
    cache = policy.early_bytes
    hit = cache.get((key, dtype))
    if hit is not None and hit[0] == stamp:
        return hit[1]
    # One copy, cast on the way (the master may be undone or stepped while the pieces are
    # on the wire); the pieces are views of it, which keep it alive.
    fresh = data.masters[key].detach().reshape(-1).to(dtype, copy=True)
    pieces = list(wire.iter_pieces(fresh, data.message_bytes, copy=False))
    cache[(key, dtype)] = (stamp, pieces)
    return pieces
