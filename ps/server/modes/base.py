"""The update rule's contract: what every mode's policy decides (ps-lite's request handler idea).

A mode (ps/server/modes/) is one module: its traits (ps/job.py ModeTraits, told to the
workers with the job), its configuration, and its UpdatePolicy, which makes every decision
that differs between consistency modes, so no other module of ps/server compares mode
names (tests/test_mode_wall.py holds that):
- what to do with a validated, unscaled push (`accept`): apply now, or hold it for a round;
- when a pull may be answered (`pull_ready`), what its wait is recorded as (`pull_waited`),
  and whether it may send views of the masters (`pull_views`);
- what a departing worker changes (`on_leave`);
- what a non-finite gradient without the overflow flag means (`nonfinite_unflagged`);
- how a sparse table's row pushes are applied (`rows`, ps/server/modes/rows.py).
Whether updates come in rounds (and so how checkpoints are numbered, whether a restore must
be followed by every shard, where a rejoining worker enters) is the mode's traits'.
The shard (ps/server/shard.py) owns the state, the locking and the validation, and calls the
policy under its lock, handing it a `ShardView` (ps/server/modes/view.py): what a rule may
read and change of the shard, nothing else. tests/test_policy_contract.py runs one contract
suite on each mode.

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

from psar.ps.headers import PushOutcome
from psar.ps.server.modes.rows import RowPolicy, RowsOnArrival
from psar.ps.server.modes.view import ShardView

if TYPE_CHECKING:
    from psar.ps.headers import PushHeader
    from psar.ps.server.intake.pieces import PushTicket
    from psar.ps.server.modes.exact_sum import ExactSum


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

    #: Sync holds gradients across a round, so each worker needs its own staging buffers.
    holds_gradients: bool = False
    #: Wants to hear of each push's slots as they complete (per-chunk rounds).
    applies_chunks: bool = False
    #: The masters cannot change while a worker reads its pull (the next update needs that
    #: worker's next push), so a pull may send views of them instead of a copy.
    pull_views: bool = False
    #: How this policy applies a sparse table's row pushes (ps/server/modes/rows.py).
    rows: RowPolicy = RowsOnArrival()
    #: Diagnostic counters of per-chunk rounds (Stats); zero for every other policy.
    chunks_early: int = 0
    chunk_undos: int = 0
    #: Early pulls (ps/server/pulls/early.py): slots sent before their round closed, and
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
        round still streaming (push pacing, ps/server/intake/pacing.py; under the lock).
        False where pushes do not close rounds slot by slot."""
        return False

    def slot_writes(self, key: str) -> int:
        """How many times slot `key`'s master has changed while rounds were open (early
        pulls compare it; ps/server/modes/sync_chunks.py). 0: this policy sends nothing early."""
        return 0

    def served(self, view: ShardView, worker: int) -> None:  # noqa: B027
        """`worker`'s pull is answered with the weights of view.version (under the lock;
        async/ssp delay compensation keeps them, ps/server/modes/staleness.py)."""

    def nonfinite_unflagged(self, view: ShardView, worker: int) -> None:  # noqa: B027
        """A push holds inf/nan without the overflow flag: raise to refuse it; returning
        lets the shard drop it as an overflow (counted)."""

    def exact_sum(self, view: ShardView, header: PushHeader) -> ExactSum | None:
        """The exact sum a data push's slots go into as they arrive (sync rounds of fp16
        pushes, ps/server/modes/exact_sum.py), or None: staged per worker (everything
        else). Called under the lock once the header passed check_push; may refuse it."""
        return None

    def push_not_accepted(self, view: ShardView, worker: int) -> None:  # noqa: B027
        """`worker`'s push that `exact_sum` was asked about ended without being accepted
        (refused, cut off, superseded): whatever it decided about its round must go with
        it (under the lock)."""

    def accept_failed(self, view: ShardView, worker: int) -> None:  # noqa: B027
        """`accept` of `worker`'s push raised before its round closed (a bug the checks
        did not foresee): forget the push, as if it had never been handed over."""

    def gradient_bytes(self) -> int:
        """Bytes of gradients the rule holds itself (an exact sum's accumulators)."""
        return 0

    def round_in_flight(self) -> bool:
        """Some worker has pushed for a round that has not closed (draining waits for it)."""
        return False

    def takes_int_buffers(self, held: int | None, worker: int) -> bool:
        """Keep this push's integer buffers for its clock (ps/server/update/buffers.py)? `held`:
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
