"""The rule of modes whose updates come in rounds (sync, and local SGD's outer rounds): one
averaged update per round, a round closing when every live worker has pushed once.

Used by ps/server/modes/sync.py (with its per-chunk variant, sync_chunks.py) and
ps/server/modes/local.py."""

from __future__ import annotations

from collections.abc import Collection

import torch

from psar.ps.errors import FailedPrecondition, InvalidArgument
from psar.ps.headers import PushHeader, PushOutcome
from psar.ps.job import Job
from psar.ps.server.modes.base import StagedPush, UpdatePolicy
from psar.ps.server.modes.exact_sum import ExactSum
from psar.ps.server.modes.rows import RowRounds
from psar.ps.server.modes.view import ShardView
from psar.trainkit.optim import StepAdjust


class SyncPolicy(UpdatePolicy):
    """One averaged update per round; a round closes when every live worker has pushed once.

    The mean is summed in worker-rank order in fp32 (DDP's bits), or, for a round of fp16
    pushes with `exact_fp16`, exactly as the pushes arrive (ps/server/modes/exact_sum.py):
    either way the result does not depend on arrival order. A round with any overflow flag
    is skipped on every shard.
    """

    holds_gradients = True
    pull_views = True
    rows = RowRounds()

    def __init__(self, exact_fp16: bool = False) -> None:
        self.pending: dict[int, StagedPush] = {}
        self.exact_fp16 = exact_fp16
        """Sum rounds of fp16 pushes exactly as they arrive (psar server --exact-fp16-sum)."""
        self.exact: ExactSum | None = None
        """The exact sum (made at the first fp16 round, reused round after round)."""
        self.kind: str | None = None
        """How the open round sums: "exact" or "ordered", set by its first data push."""
        self.under_way: set[int] = set()
        """Workers whose data push of the open round began and has neither been accepted
        nor ended unaccepted: with the accepted ones (`pending`) they hold the round to
        `kind` and its exact sum to its loss scale. When none is left (every push that
        decided them was refused, cut off or superseded), the next push decides afresh:
        a refused push leaves no trace (issue #36, the hostile sync campaign)."""

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
        self.under_way.discard(push.worker)
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

    def exact_sum(self, view: ShardView, header: PushHeader) -> ExactSum | None:
        if self.kind is not None and not self.pending and not self.under_way:
            # Whatever decided the round's kind (and its exact sum's scale) ended
            # unaccepted: the round is as if no push had begun.
            self.kind = None
            if self.exact is not None:
                self.exact.reset(view.rounds + 1)
        exact = self.exact_fp16 and header.dtype == torch.float16
        kind = "exact" if exact else "ordered"
        if self.kind == "exact" and kind != "exact":
            raise FailedPrecondition(
                f"sync round {view.rounds + 1} sums fp16 gradients exactly (its first "
                f"push was fp16); this push is {header.dtype}: every worker must push "
                "in the same dtype (--wire-dtype)",
                reason="bad_dtype",
            )
        if self.kind == "ordered" or not exact:
            # fp32/bf16, or fp16 into a round an fp32/bf16 push opened: staged, rank order
            self.kind = "ordered"
            self.under_way.add(header.worker)
            return None
        if self.exact is None:
            skip = view.buffer_keys
            self.exact = ExactSum({k: p.numel() for k, p in view.masters.items() if k not in skip})
        # may refuse: every push of the round carries the shard's scale (its pulls said it)
        self.exact.open(
            view.rounds + 1, header.loss_scale, len(view.live), shard_scale=view.loss_scale
        )
        self.kind = "exact"
        self.under_way.add(header.worker)
        return self.exact

    def push_not_accepted(self, view: ShardView, worker: int) -> None:
        self.under_way.discard(worker)

    def accept_failed(self, view: ShardView, worker: int) -> None:
        self.pending.pop(worker, None)
        self.under_way.discard(worker)

    def gradient_bytes(self) -> int:
        return self.exact.nbytes() if self.exact is not None else 0

    def _maybe_close(self, view: ShardView) -> None:
        if not self.pending or not view.live.issubset(self.pending):
            return
        pushes = [self.pending[w] for w in sorted(self.pending)]
        self.pending = {}
        exact = self.exact if self.kind == "exact" else None
        self.kind = None
        self.under_way.clear()  # a push still streaming (its worker left) is refused at its end
        if exact is not None:  # withdraws a push still in flight (its worker left)
            exact.close({p.worker for p in pushes})  # nothing lands any more; reset below
        at = (view.rounds, view.version)
        try:
            self._close(view, pushes, exact)
        except Exception:
            if (view.rounds, view.version) == at:  # never a round left open (issue #45)
                view.skip_round("internal")
            raise
        finally:
            if exact is not None:
                exact.reset()

    def _close(self, view: ShardView, pushes: list[StagedPush], exact: ExactSum | None) -> None:
        """Every live worker has pushed (`pushes`, in rank order): apply or skip."""
        if any(p.overflow for p in pushes):
            view.skip_round("overflow")
            return
        buffers = view.buffer_values([p.grads for p in pushes])  # before the sum below
        if exact is not None:
            view.set_buffers(buffers)
            adjust = self.round_adjust(view.job, len(pushes))
            means = exact_means(view, exact, buffers)
            view.apply_update(means, staleness=[0] * len(pushes), adjust=adjust)
            return
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
        adjust = self.round_adjust(view.job, len(pushes))
        view.apply_update(total, staleness=[0] * len(pushes), adjust=adjust)

    def round_adjust(self, job: Job | None, n: int) -> StepAdjust | None:
        """Elastic jobs (docs/elastic.md): the linear scaling rule. Each worker keeps its
        batch, so a round of n workers' gradients is n/W of the global batch the job's
        learning rate was set for (W: its --world-size at start); its step takes lr * n/W."""
        if job is None or not job.elastic or n == job.num_workers:
            return None
        return StepAdjust(lr_scale=n / job.num_workers)


def exact_means(view: ShardView, exact: ExactSum, skip: Collection[str]) -> dict[str, torch.Tensor]:
    """The round's fp32 mean of every slot some worker had a gradient for (not `skip`:
    buffers), converted from the exact sum on the update threads."""
    keys = [k for k in view.masters if k not in skip and k in exact.numel and not exact.unused(k)]
    means: dict[str, torch.Tensor] = {}

    def one(key: str) -> None:
        means[key] = exact.mean(key)

    view.step_each(keys, one)
    return means


def unused_by_all(pushes: list[StagedPush]) -> frozenset[str]:
    """The slots no push of a round has a gradient for."""
    return frozenset.intersection(*(p.absent for p in pushes)) if pushes else frozenset()
