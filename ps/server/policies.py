"""Consistency modes as pluggable update policies (ps-lite's request handler idea).

A policy makes every decision that differs between consistency modes, so no other module of
ps/server compares mode names (tests/test_mode_wall.py holds that):
- what to do with a validated, unscaled push (`accept`): apply now, or hold it for a round;
- when a pull may be answered (`pull_ready`), what its wait is recorded as (`pull_waited`),
  and whether it may send views of the masters (`pull_views`);
- what a departing worker changes (`on_leave`);
- whether updates come in rounds (`rounds`): what closes them, how checkpoints are numbered
  and when they fall, whether a restore must be followed by every shard (rollback), where a
  (re)joining worker enters;
- what a non-finite gradient without the overflow flag means (`nonfinite_unflagged`);
- how a sparse table's row pushes are applied (`rows`, ps/server/sparse_policy.py).
The shard (ps/server/shard.py) owns the state, the locking and the validation, and calls the
policy under its lock, handing it a `ShardView`: what a rule may read and change of the shard
(ps/server/updates.py implements it), nothing else. tests/test_policy_contract.py runs one
contract suite on each.

Definitions used everywhere: a shard's *version* is the number of update rounds it has
applied; a worker's *clock* is the number of gradients it has pushed; the *staleness* of
an applied gradient is the shard's version when it is applied minus the version of the
weights it was computed from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ps.errors import FailedPrecondition, InvalidArgument
from ps.headers import PushOutcome
from ps.server.sparse_policy import RowPolicy, RowRounds, RowsOnArrival
from ps.server.staleness import ServedWeights, step_adjust
from ps.server.view import ShardView

if TYPE_CHECKING:
    from ps.server.pushdata import PushTicket


@dataclass(slots=True)
class StagedPush:
    """A push that passed validation: fp32 unscaled gradients per slot (or an overflow)."""

    worker: int
    clock: int
    base_version: int
    overflow: bool
    grads: dict[str, torch.Tensor]
    absent: frozenset[str] = frozenset()
    """Slots this push had no gradient for (zeros in `grads` when held for a round)."""


class UpdatePolicy(ABC):
    """How pushes turn into optimizer steps, and when pulls are answered."""

    mode: str = ""
    #: Sync holds gradients across a round, so each worker needs its own staging buffers.
    holds_gradients: bool = False
    #: Wants to hear of each push's slots as they complete (per-chunk rounds).
    applies_chunks: bool = False
    #: Updates come in rounds every live worker takes part in (sync). Then an update or a
    #: skip closes the round; checkpoints are numbered by round and fall on the same rounds
    #: on every shard (never off that grid), so a restored shard's peers can follow it back
    #: (rollback); a (re)joining worker enters at a round boundary. Otherwise the version
    #: numbers checkpoints, an interval timer may add some, and a worker rejoins at once.
    rounds: bool = False
    #: The masters cannot change while a worker reads its pull (the next update needs that
    #: worker's next push), so a pull may send views of them instead of a copy.
    pull_views: bool = False
    #: How this policy applies a sparse table's row pushes (ps/server/sparse_policy.py).
    rows: RowPolicy = RowsOnArrival()
    #: Diagnostic counters of per-chunk rounds (Stats); zero for every other policy.
    chunks_early: int = 0
    chunk_undos: int = 0
    #: Early pulls (ps/server/early_pull.py): slots sent before their round closed, and
    #: pulls whose early slots had changed again (Stats); zero where nothing is early.
    early_slots: int = 0
    early_voids: int = 0

    @abstractmethod
    def check_push(self, view: ShardView, worker: int, clock: int, base_version: int) -> None:
        """Refuse (raise) a push header this policy cannot take, before any byte is read."""

    @abstractmethod
    def accept(self, view: ShardView, push: StagedPush) -> PushOutcome:
        """Take a validated push (called under the shard lock)."""

    @abstractmethod
    def pull_ready(self, view: ShardView, worker: int, clock: int) -> bool:
        """May a pull from `worker` at `clock` be answered now?"""

    def on_leave(self, view: ShardView, worker: int) -> None:  # noqa: B027 - optional hook
        """A worker left the live set (finished, or its lease expired)."""

    def pull_waited(self, view: ShardView, seconds: float) -> None:  # noqa: B027
        """A pull was answered after waiting `seconds` for `pull_ready` (metrics)."""

    def push_ahead(self, ticket: PushTicket, lead_bytes: int) -> bool:
        """Whether this push runs `lead_bytes` ahead of the slowest other push of its
        round still streaming (push pacing, ps/server/push_pacing.py; under the lock).
        False where pushes do not close rounds slot by slot."""
        return False

    def slot_writes(self, key: str) -> int:
        """How many times slot `key`'s master has changed while rounds were open (early
        pulls compare it; ps/server/chunk_rounds.py). 0: this policy sends nothing early."""
        return 0

    def served(self, view: ShardView, worker: int) -> None:  # noqa: B027
        """`worker`'s pull is answered with the weights of view.version (under the lock;
        async/ssp delay compensation keeps them, ps/server/staleness.py)."""

    def nonfinite_unflagged(self, view: ShardView, worker: int) -> None:  # noqa: B027
        """A push holds inf/nan without the overflow flag: raise to refuse it; returning
        lets the shard drop it as an overflow (counted)."""

    def round_in_flight(self) -> bool:
        """Some worker has pushed for a round that has not closed (draining waits for it)."""
        return False

    def checkpoint_step(self, view: ShardView) -> int:
        """What checkpoints (and restores) are numbered by."""
        return view.rounds if self.rounds else view.version

    def takes_int_buffers(self, held: int | None, worker: int) -> bool:
        """Keep this push's integer buffers for its clock (ps/server/buffers.py)? `held`:
        the worker whose values of that clock the shard holds (None: none yet). Here
        (async, ssp): worker 0's, as their float buffers."""
        return worker == 0

    # Per-chunk hooks (called under the shard lock only when applies_chunks is set).

    def push_started(self, view: ShardView, ticket: PushTicket) -> None:  # noqa: B027
        """A push header passed its checks; its data follows."""

    def slot_complete(self, view: ShardView, ticket: PushTicket, key: str) -> None:  # noqa: B027
        """Every piece of slot `key` of this push arrived and was unscaled."""

    def push_dropped(self, view: ShardView, ticket: PushTicket) -> None:  # noqa: B027
        """This push's data no longer counts: refused, cut off, or an overflow verdict."""

    def settle(self, view: ShardView) -> None:  # noqa: B027
        """Make masters and optimizer state those of the last closed round (before a
        checkpoint snapshot or an off-round pull)."""

    def quiesce(self) -> None:  # noqa: B027
        """Wait for work the policy does on threads of its own (before a digest)."""

    def close(self) -> None:  # noqa: B027
        """The shard replaces this policy (restore, rollback): stop what it runs."""


class SyncPolicy(UpdatePolicy):
    """One averaged update per round; a round closes when every live worker has pushed once.

    The mean is summed in worker-rank order in fp32, so the result does not depend on
    arrival order. A round with any overflow flag is skipped on every shard.
    """

    mode = "sync"
    holds_gradients = True
    rounds = True
    pull_views = True
    rows = RowRounds()

    def __init__(self) -> None:
        self.pending: dict[int, StagedPush] = {}

    def check_push(self, view: ShardView, worker: int, clock: int, base_version: int) -> None:
        open_round = view.rounds + 1
        if clock != open_round:
            raise FailedPrecondition(
                f"sync: worker {worker} pushed for round {clock} but round {open_round} is "
                f"open; pull (clock {open_round - 1}) before computing the next gradient",
                reason="out_of_order",
            )
        if base_version != view.version:
            raise FailedPrecondition(
                f"sync: gradient computed from version {base_version}, but round {open_round} "
                f"needs version {view.version}; pull the current weights first",
                reason="too_stale",
            )

    def accept(self, view: ShardView, push: StagedPush) -> PushOutcome:
        self.pending[push.worker] = push
        self._maybe_close(view)
        return PushOutcome(applied=True, dropped_nonfinite=False, staleness=0)

    def pull_ready(self, view: ShardView, worker: int, clock: int) -> bool:
        return view.rounds >= clock

    def on_leave(self, view: ShardView, worker: int) -> None:
        self._maybe_close(view)

    def pull_waited(self, view: ShardView, seconds: float) -> None:
        view.metrics.barrier_wait(seconds)

    def nonfinite_unflagged(self, view: ShardView, worker: int) -> None:
        raise InvalidArgument(
            "non-finite gradient without the overflow flag: in sync mode a worker that sees "
            "inf/nan must push overflow=true (no data) so every shard skips the round",
            reason="nonfinite",
        )

    def takes_int_buffers(self, held: int | None, worker: int) -> bool:
        """The lowest rank's of each clock: rank 0's once its round is in, as DDP
        broadcasts them."""
        return held is None or worker < held

    def round_in_flight(self) -> bool:
        return bool(self.pending)

    def _maybe_close(self, view: ShardView) -> None:
        if not self.pending or not view.live.issubset(self.pending):
            return
        pushes = [self.pending[w] for w in sorted(self.pending)]
        self.pending = {}
        self._close(view, pushes)

    def _close(self, view: ShardView, pushes: list[StagedPush]) -> None:
        """Every live worker has pushed (`pushes`, in rank order): apply or skip."""
        if any(p.overflow for p in pushes):
            view.skip_round("overflow")
            return
        buffers = view.buffer_values([p.grads for p in pushes])  # before the sum below
        # Sum in place into the lowest rank's staging buffers (they are consumed by this
        # round), always in rank order: the bits never depend on arrival order.
        total = pushes[0].grads
        for p in pushes[1:]:
            for k, t in p.grads.items():
                total[k].add_(t)
        if len(pushes) > 1:
            for t in total.values():
                t.div_(len(pushes))
        # DDP (find_unused_parameters): a slot some worker used is the mean over every
        # worker, the others counting zeros (done above); one no worker used is not stepped.
        unused = unused_by_all(pushes)
        if unused or buffers:
            total = {k: t for k, t in total.items() if k not in unused and k not in buffers}
        view.set_buffers(buffers)
        view.apply_update(total, staleness=[0] * len(pushes))


def unused_by_all(pushes: list[StagedPush]) -> frozenset[str]:
    """The slots no push of a round has a gradient for."""
    return frozenset.intersection(*(p.absent for p in pushes)) if pushes else frozenset()


class AsyncPolicy(UpdatePolicy):
    """Every push is applied on arrival as its own optimizer step; staleness is recorded.

    Each step is staleness-aware (ps/server/staleness.py): the momentum rule for
    asynchrony (on by default), and on request lr / (1 + staleness) and DC-ASGD."""

    mode = "async"

    def __init__(self) -> None:
        self.bases = ServedWeights()

    def check_push(self, view: ShardView, worker: int, clock: int, base_version: int) -> None:
        if base_version > view.version:
            raise InvalidArgument(
                f"gradient claims base version {base_version}, but this shard is only at "
                f"version {view.version}; send the version your last pull returned",
                reason="bad_version",
            )

    def accept(self, view: ShardView, push: StagedPush) -> PushOutcome:
        staleness = view.version - push.base_version
        if push.overflow:
            view.drop_nonfinite()
            return PushOutcome(applied=False, dropped_nonfinite=True, staleness=staleness)
        assert view.job is not None
        if view.job.delay_compensation:
            self.bases.compensate(view, push.worker, push.base_version, push.grads)
        view.apply_update(
            push.grads, staleness=[staleness], adjust=step_adjust(view.job, staleness)
        )
        return PushOutcome(applied=True, dropped_nonfinite=False, staleness=staleness)

    def pull_ready(self, view: ShardView, worker: int, clock: int) -> bool:
        return True

    def served(self, view: ShardView, worker: int) -> None:
        if view.job is not None and view.job.delay_compensation:
            self.bases.served(view, worker)

    def on_leave(self, view: ShardView, worker: int) -> None:
        self.bases.forget(worker)


class SSPPolicy(AsyncPolicy):
    """Bounded staleness (Bösen's SSP): async, but a worker whose clock is more than S ahead
    of the slowest live worker waits on its pull until the slowest catches up.

    Blocking the reader wastes no work; rejecting stale gradients would waste whole steps,
    so no gradient inside the bound is ever thrown away.
    """

    mode = "ssp"

    def __init__(self, staleness: int) -> None:
        super().__init__()
        self.staleness = staleness

    def pull_ready(self, view: ShardView, worker: int, clock: int) -> bool:
        return clock - view.slowest_live_clock(default=clock) <= self.staleness

    def pull_waited(self, view: ShardView, seconds: float) -> None:
        view.metrics.ssp_wait(seconds)
