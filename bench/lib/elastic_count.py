"""bench/elastic.py's counting: which samples the final model was trained on, from what
the workers logged (never from what the schedule meant to happen).

A sample is a dataset index of the epoch the job trains (one epoch: each index once).

- psar's elastic PS (`steps-ps-rank*.jsonl`): every logged step's `batches` are the batch
  ids shard 0 dealt it; batch id k holds the indices worker/data.py's ElasticBatches
  gives it. Every logged step's push was taken by the shards (a worker logs after its
  step), so every logged step counts. A worker killed between its push and its log line
  trained ids no log names: the shard's counters (ids dealt minus ids given back) say how
  many ids were consumed, and those beyond the logged ones are `unlogged` (counted as
  trained, and reported).
- The allreduce arch under torchrun's elastic agent: each process (one rank of one
  rendezvous round) logs into a folder of its own with its rank and world size
  (bench/lib/elastic_rank.py). Rank r of a world of W at step s trains worker/data.py's
  ShardedBatches(rank=r, world_size=W).indices(s - 1). A round resumes from the newest
  checkpoint as it starts (its step R, in the steps of the round that wrote it: the latest
  earlier round that trained step R, or started at R + 1 having saved it at once); the
  steps that round took after R, and every round in between, were rolled back and are not
  in the final model (`rolled_back`).

Lost: samples of the epoch that no counted step trained; repeated: counted trainings of
a sample beyond its first.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from psar.worker.data import ElasticBatches, ShardedBatches


@dataclass
class Step:
    """One logged step of one process, on the shared wall clock."""

    wall: float
    samples: int
    loss: float
    indices: list[int]


@dataclass
class Proc:
    """One worker process's steps (allreduce: one rank of one rendezvous round)."""

    rank: int
    world: int
    round_key: str
    start_wall: float
    resume_step: int
    """The newest checkpoint's step when it started (the one it resumed from)."""
    steps: dict[int, Step] = field(default_factory=dict)

    @property
    def first_step(self) -> int:
        return min(self.steps)

    @property
    def last_step(self) -> int:
        return max(self.steps)


@dataclass
class Counted:
    """What the final model was trained on, and the timeline of it."""

    trained: Counter[int]
    """How many counted steps trained each sample."""
    timeline: list[tuple[float, int]]
    """(wall, samples) of each counted step, in time order."""
    losses: list[tuple[float, float]]
    """(wall, loss) of each counted step."""
    rolled_back: list[tuple[float, int, float]] = field(default_factory=list)
    """(wall, samples, when the round that threw it away started) of each step a later
    round's restart rolled back (allreduce)."""
    step_s: float = 0.0
    """An ordinary step: the median over processes of their median step-to-step time."""
    unlogged: int = 0
    """Samples the shards consumed beyond the logged ones: a worker killed between its
    push and its log line (ps)."""

    def lost(self, planned: int) -> int:
        """Samples of 0..planned-1 no counted step trained."""
        return sum(1 for i in range(planned) if not self.trained.get(i)) - self.unlogged

    def repeated(self) -> int:
        return sum(n - 1 for n in self.trained.values() if n > 1)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def count_ps(run_dir: Path, dataset_len: int, batch_size: int, seed: int,
             consumed_ids: int | None) -> Counted:  # fmt: skip
    """The elastic PS job's step logs in `run_dir`'s folders (one per worker process);
    `consumed_ids`: shard 0's data_dealt
    - data_returned at the end (None: unknown)."""
    batches = ElasticBatches(range(dataset_len), batch_size=batch_size, seed=seed)
    trained: Counter[int] = Counter()
    timeline, losses = [], []
    ids_seen: set[int] = set()
    gaps = []
    for path in sorted(run_dir.glob("*/steps-ps-rank*.jsonl")):
        recs = _lines(path)
        gaps.append(_median_gap([r["wall"] for r in recs]))
        for rec in recs:
            for k in rec["batches"]:
                ids_seen.add(k)
                trained.update(batches.indices(k).tolist())
            timeline.append((rec["wall"], batch_size * len(rec["batches"])))
            losses.append((rec["wall"], rec["loss"]))
    unlogged = 0
    if consumed_ids is not None:
        unlogged = max(0, consumed_ids - len(ids_seen)) * batch_size
    return Counted(trained, sorted(timeline), sorted(losses), step_s=_median(gaps),
                   unlogged=unlogged)  # fmt: skip


def load_procs(procs_dir: Path, dataset_len: int, batch_size: int, seed: int) -> list[Proc]:
    """Every allreduce process that logged a step: its rank, world, round and steps."""
    out = []
    for d in sorted(procs_dir.iterdir()):
        meta_path, logs = d / "meta.json", list(d.glob("steps-allreduce-rank*.jsonl"))
        if not meta_path.exists() or not logs:
            continue
        meta = json.loads(meta_path.read_text())
        rank, world = int(meta["rank"]), int(meta["world"])
        shard = ShardedBatches(range(dataset_len), batch_size=batch_size, rank=rank,
                               world_size=world, seed=seed)  # fmt: skip
        p = Proc(rank, world, meta["round"], float(meta["start_wall"]), int(meta["resume_step"]))
        for rec in _lines(logs[0]):
            idx = shard.indices(rec["step"] - 1).tolist()
            p.steps[rec["step"]] = Step(rec["wall"], len(idx), rec["loss"], idx)
        if p.steps:
            out.append(p)
    return out


def rounds(procs: list[Proc]) -> list[list[Proc]]:
    """The processes grouped by rendezvous round, oldest round first."""
    by: dict[str, list[Proc]] = {}
    for p in procs:
        by.setdefault(p.round_key, []).append(p)
    return sorted(by.values(), key=lambda g: min(p.start_wall for p in g))


def lineage(groups: list[list[Proc]]) -> dict[int, int | None]:
    """Round index -> the last of its steps in the final model (None: all of them; a
    round absent: none), walking back from the last round through the checkpoints each
    resumed from."""
    keep: dict[int, int | None] = {len(groups) - 1: None}
    cur = len(groups) - 1
    while cur > 0:
        r = max(p.resume_step for p in groups[cur])
        if r == 0:
            break
        writer = next((g for g in range(cur - 1, -1, -1)
                       if min(p.first_step for p in groups[g]) - 1 <= r
                       <= max(p.last_step for p in groups[g])), None)  # fmt: skip
        if writer is None:  # its writer trained no step (saved at start, then failed)
            break
        keep[writer] = r
        cur = writer
    return keep


def count_allreduce(procs: list[Proc]) -> Counted:
    """The lineage of the final model (lineage()): counted steps and rolled-back ones."""
    trained: Counter[int] = Counter()
    timeline, losses, rolled = [], [], []
    groups = rounds(procs)
    keep = lineage(groups)
    for g, group in enumerate(groups):
        # A rolled-back step was thrown away when the next round started.
        later = min(p.start_wall for p in groups[g + 1]) if g + 1 < len(groups) else math.inf
        for p in group:
            for s, st in p.steps.items():
                if g in keep and (keep[g] is None or s <= keep[g]):
                    trained.update(st.indices)
                    timeline.append((st.wall, st.samples))
                    if p.rank == 0:
                        losses.append((st.wall, st.loss))
                else:
                    rolled.append((st.wall, st.samples, later))
    step_s = _median([_median_gap([st.wall for st in p.steps.values()]) for p in procs])
    return Counted(trained, sorted(timeline), sorted(losses), rolled_back=sorted(rolled),
                   step_s=step_s)  # fmt: skip


def _median_gap(walls: list[float]) -> float | None:
    walls = sorted(walls)
    gaps = [b - a for a, b in zip(walls, walls[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def _median(xs: list[float | None]) -> float:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else 0.0


def rate_series(timeline: list[tuple[float, int]], t0: float, t1: float,
                bin_s: float) -> list[tuple[float, float]]:  # fmt: skip
    """(seconds since t0, samples/s) in bins of `bin_s` from t0 to t1."""
    n = max(1, int((t1 - t0) // bin_s) + 1)
    bins = [0] * n
    for wall, samples in timeline:
        i = int((wall - t0) // bin_s)
        if 0 <= i < n:
            bins[i] += samples
    return [(round(i * bin_s, 3), b / bin_s) for i, b in enumerate(bins)]


def time_lost(counted: Counted, events: list[tuple[str, float]], end: float) -> list[dict]:
    """Per event (name, wall): the longest stretch without a counted step between it and
    the next event, less one ordinary step (counted.step_s): the stall; plus the work a restart
    threw away (allreduce: the steps after the checkpoint, rolled back), charged to the
    latest event before the round that replaced them started: the wall time from the
    first of them to the last, plus a step."""
    out = []
    step_s = counted.step_s
    times = [w for w, _ in counted.timeline]
    starts = [t for _, t in events]
    for i, (name, t) in enumerate(events):
        nxt = starts[i + 1] if i + 1 < len(events) else end
        inside = [t, *(w for w in times if t <= w <= nxt), nxt]
        stall = max(0.0, max(b - a for a, b in zip(inside, inside[1:], strict=False)) - step_s)
        mine = [w for w, _, cause in counted.rolled_back if _latest(starts, cause) == i]
        wasted = (max(mine) - min(mine) + step_s) if mine else 0.0
        out.append({"event": name, "stall_s": stall, "rolled_back_s": wasted,
                    "rolled_back_samples": sum(n for _, n, c in counted.rolled_back
                                               if _latest(starts, c) == i),
                    "time_lost_s": stall + wasted})  # fmt: skip
    return out


def _latest(starts: list[float], t: float) -> int:
    """Index of the latest event at or before wall time t (-1: none)."""
    return max((i for i, s in enumerate(starts) if s <= t), default=-1)
