"""Consistency modes, one module each: sync (with its per-chunk variant), async, ssp, local.

Each declares its traits (ps/job.py ModeTraits: sent to the workers with the job), its
configuration (which of the job's knobs it reads, checked when a job arrives) and its
update rule (an UpdatePolicy, ps/server/modes/base.py, handed a ShardView). The sparse
tables' row rules are ps/server/modes/rows.py (each rule names one as its `rows`).

`BUILTIN` is the stock shard's registry; docs/architecture.md has a worked example of
adding a mode.
"""

from __future__ import annotations

from psar.ps.server.modes import asynchronous, local, ssp, sync
from psar.ps.server.modes.base import StagedPush, UpdatePolicy
from psar.ps.server.modes.registry import Mode, Modes, RuleOptions, no_options
from psar.ps.server.modes.view import ShardView

BUILTIN = Modes([sync.MODE, asynchronous.MODE, ssp.MODE, local.MODE])
"""The modes `psar server` serves (trainkit/choices.MODES lists their names for --mode)."""

__all__ = [
    "BUILTIN",
    "Mode",
    "Modes",
    "RuleOptions",
    "ShardView",
    "StagedPush",
    "UpdatePolicy",
    "no_options",
]
