"""The modes a shard serves, by name: each a `Mode` (its traits, configuration and rule).

A mode is one module of ps/server/modes/ ending in `MODE = Mode(...)`; ps/server/modes/
__init__.py gathers the stock shard's into `BUILTIN`. A shard takes a `Modes` registry
(ShardState(modes=...): BUILTIN, or BUILTIN.with_modes(...) for one of your own, as
tests/drop_stale_mode.py does), and nothing else of ps/server knows a mode by its name:
a job's mode becomes its traits and its rule here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from psar.ps.errors import InvalidArgument
from psar.ps.job import Job, ModeTraits
from psar.ps.server.modes.base import UpdatePolicy


@dataclass(frozen=True)
class RuleOptions:
    """What the shard's own flags say about the rules it makes."""

    chunk_rounds: bool = False
    """psar server --chunk-rounds: a rule in rounds applies each slot as soon as every
    worker's piece of it is in (the sync mode's per-chunk variant; same bits) even for a
    job that does not ask for it (workers from before jobs carried it). A job asks with
    Job.chunk_rounds; a shard needs no flag for that."""
    exact_fp16_sum: bool = True
    """psar server --exact-fp16-sum: a sync round of fp16 pushes is summed exactly as they
    arrive (ps/server/modes/exact_sum.py); off: staged per worker, summed in rank order."""


def no_options(job: Job) -> None:
    """The configuration of a mode that reads only the job's own fields: no mode_options."""
    if job.mode_options:
        raise ValueError(f"--mode {job.mode} takes no mode options, got {sorted(job.mode_options)}")


@dataclass(frozen=True, kw_only=True)
class Mode:
    """One consistency mode: what the workers are told of it, and what the shard runs."""

    name: str
    """--mode NAME (on the wire the JobSpec's Mode enum where it has a value, else its
    mode_name)."""
    traits: ModeTraits
    """How it behaves (rounds, staleness, what workers do between steps, the loss scale,
    rejoining), sent to the workers with the job."""
    rule: Callable[[Job, RuleOptions], UpdatePolicy]
    """A fresh update rule for a job of this mode (a restore or rollback makes another)."""
    chunk_rounds: bool = False
    """Its rule has a per-chunk variant (Job.chunk_rounds): a job asking for per-chunk
    rounds in a mode without one is refused at Init, naming why."""
    configure: Callable[[Job], object] = field(default=no_options)
    """Read and check the job's knobs this mode reads, its configuration (what it returns
    is not kept; a ValueError naming what is wrong: the shard refuses the job with it,
    INVALID_ARGUMENT). The default: the job's own fields, no mode_options."""


class Modes:
    """A registry of modes by name; immutable (with_modes makes a larger one)."""

    def __init__(self, modes: Iterable[Mode] = ()) -> None:
        self._by_name: dict[str, Mode] = {}
        for m in modes:
            if m.name in self._by_name and self._by_name[m.name] is not m:
                raise ValueError(f"mode {m.name!r} registered twice")
            self._by_name[m.name] = m

    def with_modes(self, *modes: Mode) -> Modes:
        """This registry and `modes` (a name already here must be the same Mode)."""
        return Modes([*self, *modes])

    def __iter__(self) -> Iterator[Mode]:
        return iter(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def get(self, name: str) -> Mode:
        """The mode of that name; InvalidArgument naming the ones served if none."""
        mode = self._by_name.get(name)
        if mode is None:
            raise InvalidArgument(
                f"mode {name!r} is not served by this shard; it serves: {', '.join(self._by_name)}",
                reason="malformed",
            )
        return mode

    def serve(self, job: Job) -> Job:
        """`job` as a shard holds it: its mode known, its configuration checked, with the
        mode's traits (Job.served). Raises InvalidArgument otherwise."""
        mode = self.get(job.mode)
        if job.chunk_rounds and not mode.chunk_rounds:
            raise InvalidArgument(
                f"the job asks for per-chunk rounds (--early-pull), which --mode {job.mode} "
                "does not have (its updates do not come in rounds of every worker's push): "
                "use --mode sync, or run without --early-pull",
                reason="malformed",
            )
        try:
            mode.configure(job)
        except ValueError as e:
            raise InvalidArgument(str(e), reason="malformed") from None
        return job.served(mode.traits)

    def rule(self, job: Job, options: RuleOptions) -> UpdatePolicy:
        """A fresh update rule for `job`."""
        return self.get(job.mode).rule(job, options)
