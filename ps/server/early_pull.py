"""Early pulls: a worker's pull that streams while its own push is still arriving (sync,
`psar server --chunk-rounds`, the TCP data plane; docs/architectures.md, "Early pulls").

Why: with per-chunk rounds a shard applies each slot as soon as every worker has pushed
it (ps/server/chunk_rounds.py). An ordinary pull still waits for the whole round, so a
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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ps import wire
from ps.errors import Cancelled, DeadlineExceeded

_ALIVE_EVERY_S = 1.0
"""How often a waiting early pull asks whether its worker is still there."""

if TYPE_CHECKING:
    from ps.server.chunk_rounds import ChunkedSyncPolicy
    from ps.server.shard import ShardState

EarlyItem = tuple[Any, ...]
"""("piece", key, offset, bytes) or ("header", PullHeader, early_void)."""


def iter_early_pull(
    st: ShardState,
    worker: int,
    clock: int,
    dtype: torch.dtype,
    timeout: float,
    *,
    incarnation: int = 0,
    views: bool = False,
    alive: Callable[[], bool] = lambda: True,
) -> Iterator[EarlyItem]:
    """The items of one early pull, in the order they go on the wire. Refusals (a bad
    dtype, an old incarnation, a clock this worker is not pushing) raise at the first
    next(), before anything is sent; a deadline raises after the early pieces.

    alive(): is the worker still there? Asked about once a second while the pull waits: a
    worker whose push failed cuts its early pull short, and the round this pull waits for
    may then never close; Cancelled frees the thread instead of holding it to the deadline."""
    started = time.monotonic()
    deadline = started + timeout
    with st._cond:
        job, inc = st._admit_pull(worker, clock, dtype, incarnation, early=True)
        policy = st.policy
    sent: dict[str, int] = {}
    early_bytes = 0
    if policy.applies_chunks:
        while (got := _next_applied(st, policy, clock, dtype, sent, deadline, alive)) is not None:
            for key, stamp, pieces in got:
                sent[key] = stamp
                for off, data in pieces:
                    early_bytes += len(data)
                    yield ("piece", key, off, data)
    with st._cond:
        ready = early_ready(st, worker, clock, inc)
        while not (ok := ready()) and (left := deadline - time.monotonic()) > 0:
            st._cond.wait(min(left, _ALIVE_EVERY_S))
            _check_alive(alive, clock)
        check_pushed(st, worker, clock, inc, timeout)
        header, pieces = st._serve_pull(job, worker, clock, dtype, inc, views, ok, started)
        void = policy is not st.policy or any(policy.slot_writes(k) != n for k, n in sent.items())
        if sent:
            policy.early_slots += len(sent)
            policy.early_voids += int(void)
            st.metrics.early_pull_ended(len(sent), void)
    rest = sum(len(p[2]) for p in pieces if void or p[0] not in sent)
    st.metrics.bytes_sent(early_bytes + rest)
    yield ("header", header, void)
    for key, off, data in pieces:
        if void or key not in sent:
            yield ("piece", key, off, data)


def _check_alive(alive: Callable[[], bool], clock: int) -> None:
    if not alive():
        raise Cancelled(f"early pull at clock {clock}: the worker hung up while it waited")


def early_ready(st: ShardState, worker: int, clock: int, inc: int) -> Callable[[], bool]:
    """The ordinary pull's condition, and this worker's own push of `clock` is in (an
    async shard would answer at once, before the gradient it is waiting on)."""
    ready = st._pull_ready(worker, clock, inc)
    return lambda: ready() and (st.clocks[worker] >= clock or st.incarnation != inc)


def check_pushed(st: ShardState, worker: int, clock: int, inc: int, timeout: float) -> None:
    """Under the lock, once an early pull's wait ended: refuse it if the shard moved to
    another incarnation or the worker's push of `clock` never came."""
    st.check_incarnation(inc)
    if st.clocks[worker] < clock:
        raise DeadlineExceeded(
            f"early pull by worker {worker} at clock {clock}: its push of that clock did "
            f"not arrive within {timeout:.1f}s; check the worker's push errors"
        )


def _next_applied(
    st: ShardState,
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
        return st.rounds >= clock or policy.retired or time.monotonic() >= deadline

    with policy._wake:
        while not (news() or done()):
            policy._wake.wait(min(max(0.0, deadline - time.monotonic()), _ALIVE_EVERY_S))
            _check_alive(alive, clock)
        keys = news()
        if not keys:
            return None
    out = []
    with policy._apply_lock:  # no update or undo runs while the bytes are copied
        for key in keys:
            if key in policy.applied:
                out.append((key, policy.writes[key], _copy(st, policy, key, dtype)))
    return out


def _copy(
    st: ShardState, policy: ChunkedSyncPolicy, key: str, dtype: torch.dtype
) -> list[tuple[int, Any]]:
    """A slot's wire pieces, shared by every early puller of the same write."""
    stamp = policy.writes[key]
    cache = policy.early_bytes
    hit = cache.get((key, dtype))
    if hit is not None and hit[0] == stamp:
        return hit[1]
    # One copy, cast on the way (the master may be undone or stepped while the pieces are
    # on the wire); the pieces are views of it, which keep it alive.
    fresh = st.masters[key].detach().reshape(-1).to(dtype, copy=True)
    pieces = list(wire.iter_pieces(fresh, st.message_bytes, copy=False))
    cache[(key, dtype)] = (stamp, pieces)
    return pieces
