"""--mode sync: one averaged update per round, a round closing when every live worker has
pushed once (the parameter server's bulk-synchronous mode; DDP's semantics, bit for bit).

The mode is this module: its traits, its rule (ps/server/modes/rounds.py's SyncPolicy;
with per-chunk rounds, which the job asks for (Job.chunk_rounds, rank 0's --early-pull)
or `psar server --chunk-rounds` forces, the per-chunk variant, ps/server/modes/sync_chunks.py,
bit-identical) and its configuration (the job's buffers_average and its shard-owned loss
scale, which the traits say)."""

from __future__ import annotations

from psar.ps.job import Job, ModeTraits
from psar.ps.server.modes.base import UpdatePolicy
from psar.ps.server.modes.registry import Mode, RuleOptions
from psar.ps.server.modes.rounds import SyncPolicy
from psar.ps.server.modes.sync_chunks import ChunkedSyncPolicy

TRAITS = ModeTraits(
    rounds=True,
    staleness="none",
    between_steps="pull",
    shard_owns_loss_scale=True,
    rejoin="at_round_boundary",
)


def _rule(job: Job, options: RuleOptions) -> UpdatePolicy:
    exact = options.exact_fp16_sum
    if job.chunk_rounds or options.chunk_rounds:
        return ChunkedSyncPolicy(exact_fp16=exact)
    return SyncPolicy(exact)


MODE = Mode(name="sync", traits=TRAITS, rule=_rule, chunk_rounds=True)
