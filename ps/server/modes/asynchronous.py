"""--mode async: every push is applied on arrival as its own optimizer step (Hogwild-style
parameter server); its staleness (versions since the worker's pull) is recorded, and each
step is staleness-aware (ps/server/modes/staleness.py).

The mode is this module: its traits, its rule and its configuration (the job's
staleness_rule, and the fixed rule's staleness_lr, staleness_lr_power, delay_compensation,
dc_adaptive, momentum_correction)."""

from __future__ import annotations

from psar.ps.errors import InvalidArgument
from psar.ps.headers import PushOutcome
from psar.ps.job import Job, ModeTraits
from psar.ps.server.modes.base import StagedPush, UpdatePolicy
from psar.ps.server.modes.registry import Mode, RuleOptions
from psar.ps.server.modes.staleness import AdaptiveStep, ServedWeights, needs_bases, step_adjust
from psar.ps.server.modes.view import ShardView

TRAITS = ModeTraits(
    rounds=False,
    staleness="versions",
    between_steps="pull",
    shard_owns_loss_scale=False,
    rejoin="at_once",
)


class AsyncPolicy(UpdatePolicy):
    """Every push is applied on arrival as its own optimizer step; staleness is recorded.

    Each step is staleness-aware (ps/server/modes/staleness.py): the job's
    --staleness-rule, adaptive by default."""

    def __init__(self) -> None:
        self.bases = ServedWeights()
        self.adaptive: AdaptiveStep | None = None

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
        if view.job.staleness_rule == "adaptive":
            self.adaptive = self.adaptive or AdaptiveStep(view.job)
            adjust = self.adaptive.adjust(
                view, self.bases, push.worker, push.base_version, push.grads
            )
        else:
            if view.job.delay_compensation:
                self.bases.compensate(view, push.worker, push.base_version, push.grads)
            adjust = step_adjust(view.job, staleness)
        view.apply_update(push.grads, staleness=[staleness], adjust=adjust)
        return PushOutcome(applied=True, dropped_nonfinite=False, staleness=staleness)

    def pull_ready(self, view: ShardView, worker: int, clock: int) -> bool:
        return True

    def served(self, view: ShardView, worker: int) -> None:
        if view.job is not None and needs_bases(view.job):
            self.bases.served(view, worker)

    def on_leave(self, view: ShardView, worker: int) -> None:
        self.bases.forget(worker)


def _rule(job: Job, options: RuleOptions) -> UpdatePolicy:
    return AsyncPolicy()


MODE = Mode(name="async", traits=TRAITS, rule=_rule)
