"""What a staleness rule costs an async shard: time per pull+push, one thread, in process.

Four workers pull and push in turn on one ShardState (no wire), a model of `--params`
fp32 parameters in three slots; each rule runs `--repeats` times, alternating, and the
ratio to the momentum rule (no statistics, no weight copies) is printed. The adaptive
rule keeps the weights it served each worker and per-slot statistics (docs/staleness-rule.md).

    python -m bench.experiments.staleness_cost --params 4M
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from psar.ps.partition import plan_slots
from psar.worker.plan_units import parse_params
from tests.ps_fixtures import grad_for, make_job, make_state, pull, push

RULES = ("momentum", "adaptive")


def ms_per_push(rule: str, params: int, workers: int, clocks: int) -> float:
    """Mean milliseconds of one pull + push under `rule` (staleness up to workers - 1)."""
    slots = plan_slots(
        [("w1", params // 2), ("w2", params // 4), ("w3", params - 3 * (params // 4))],
        1,
        chunk_bytes=1 << 40,
    )
    job = make_job("async", num_workers=workers, slots=slots, staleness_rule=rule)
    st = make_state(job)
    grads = [grad_for(job, w, 1) for w in range(workers)]
    t0, n = time.perf_counter(), 0
    for clock in range(1, clocks + 1):
        versions = [pull(st, w, clock - 1)[0].version for w in range(workers)]
        for w in range(workers):  # all pulled first: staleness 0 .. workers - 1
            push(st, worker=w, clock=clock, base_version=versions[w], grads=grads[w],
                 piece_elems=1 << 20)  # fmt: skip
            n += 1
    return (time.perf_counter() - t0) / n * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="4M", help="parameters on the shard (4M, 400k)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--clocks", type=int, default=15, help="pushes per worker per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    params = parse_params(a.params)
    got: dict[str, list[float]] = {r: [] for r in RULES}
    for _ in range(a.repeats):
        for rule in RULES:
            got[rule].append(ms_per_push(rule, params, a.workers, a.clocks))
    med = {r: statistics.median(v) for r, v in got.items()}
    for rule in RULES:
        print(f"{rule:>9}: {med[rule]:.2f} ms per pull+push (median of {a.repeats}), "
              f"{med[rule] / med['momentum']:.2f}x the momentum rule")  # fmt: skip
    print(f"{params:,} parameters, {a.workers} workers, one thread")


if __name__ == "__main__":
    main()
