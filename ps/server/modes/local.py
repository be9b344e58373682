"""Local SGD / DiLoCo on the shard (--mode local): rounds of pseudo-gradients.

Each worker takes H inner steps with its own inner optimizer, then pushes its
pseudo-gradient (the weights of the last sync minus its weights now) as clock r. A round
closes when every live worker has pushed: the shard averages the pseudo-gradients in rank
order and applies its optimizer -- which in this mode is the *outer* optimizer (the job's
`optimizer`: Nesterov momentum for DiLoCo, plain SGD at lr 1.0 for model averaging) --
then the workers pull the new masters and start the next H inner steps from them.

That is a sync round with other tensors in it, so the policy is SyncPolicy's
(ps/server/modes/rounds.py: checkpoints, rollbacks and joins work the same way) with its own
refusal message, and the traits are sync's but for what a worker does between steps and
the loss scale, which each worker keeps for its inner steps. Per-chunk rounds are not
used: a pseudo-gradient push arrives once every H steps, after backward, so there is no
backward to overlap it with. Its configuration is the job's sync_every (H), which only the
workers act on.
"""

from __future__ import annotations

from psar.ps.errors import InvalidArgument
from psar.ps.job import Job, ModeTraits
from psar.ps.server.modes.base import UpdatePolicy
from psar.ps.server.modes.registry import Mode, RuleOptions
from psar.ps.server.modes.rounds import SyncPolicy
from psar.ps.server.modes.view import ShardView
from psar.trainkit.optim import StepAdjust

TRAITS = ModeTraits(
    rounds=True,
    staleness="none",
    between_steps="local_steps",
    shard_owns_loss_scale=False,
    rejoin="at_round_boundary",
)


class LocalPolicy(SyncPolicy):
    """Sync rounds of pseudo-gradients; the shard's optimizer is the outer optimizer."""

    def nonfinite_unflagged(self, view: ShardView, worker: int) -> None:
        raise InvalidArgument(
            f"non-finite pseudo-gradient from worker {worker} without the overflow flag: in "
            "local mode a worker whose weights went inf/nan must push overflow=true (no "
            "data) so every shard skips the outer round and the worker restarts from the "
            "masters",
            reason="nonfinite",
        )

    def takes_int_buffers(self, held: int | None, worker: int) -> bool:
        return False  # each worker keeps its own, as allreduce --mode local does

    def round_adjust(self, job: Job | None, n: int) -> StepAdjust | None:
        """Elastic jobs: the outer step is not scaled. The mean of n pseudo-gradients is
        the mean model's move whatever n is (docs/elastic.md)."""
        return None


def _rule(job: Job, options: RuleOptions) -> UpdatePolicy:
    return LocalPolicy()  # never per chunk (see the module docstring)


MODE = Mode(name="local", traits=TRAITS, rule=_rule)
