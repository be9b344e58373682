"""A sync round's close with fp16 pushes: exact int64 sums as they arrive vs rank order.

`python -m bench.shard_update --sections round-close` (bench/shard_update.py) runs this.
Two shards hold the same sync job (N workers, fp16 on the wire, AdamW with the
implementation `--impl`, the same update threads): one sums each push into int64
accumulators as its slots arrive (`psar server --exact-fp16-sum`, the default since
issue #36), the other stages every push in fp32 and sums the round in rank order at its
close (`--no-exact-fp16-sum`, the path before #36). Rounds alternate between them (A B A
B ...). Each round drives the shard's own intake as both doors do (begin_push, add_data
per 1 MiB piece, finish_push): N-1 workers push whole, then the last worker's push, all
but its last piece; the clock starts as its last piece is handed over (the last bytes
received) and stops when finish_push returns with the shard's version moved on (the new
version is then what a pull gets: the close runs under the shard lock before it returns).

Gradient memory: the shard's `gradient_bytes` (Stats: the tensors it allocated for
gradients in flight: staging, scratch, accumulators) after one round of 2, 4 and N
workers, their pushes delivered one after another and all streaming at once (their
pieces interleaved).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from psar.ps import wire
from psar.ps.headers import PushHeader
from psar.ps.job import Job
from psar.ps.partition import plan_slots
from psar.ps.server.shard import ShardState
from psar.trainkit.optim import LossScaleConfig, OptimizerConfig

SCALE = 1024.0
PIECE = 1 << 20
"""Bytes of a piece (the data plane's default message size)."""


def _job(params: list[tuple[str, int]], workers: int, opt: OptimizerConfig) -> Job:
    ls = LossScaleConfig(enabled=True, init_scale=SCALE, growth_interval=10**9)
    return Job(mode="sync", num_workers=workers, optimizer=opt, loss_scale=ls,
               slots=plan_slots(params, 1), job_id="bench-round-close")  # fmt: skip


def _shard(job: Job, exact: bool, threads: int) -> ShardState:
    st = ShardState(update_threads=threads, exact_fp16_sum=exact)
    g = torch.Generator().manual_seed(0)
    st.init(job, {s.key: torch.randn(s.numel, generator=g) for s in job.slots})
    return st


def _pushes(job: Job, workers: int) -> list[list[tuple[str, int, bytes]]]:
    """Per worker, its push's pieces (fp16 gradients scaled by SCALE)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(workers):
        pieces = []
        for s in job.slots:
            t = (torch.randn(s.numel, generator=g) * 0.01 * SCALE).half()
            pieces += [(s.key, off, data) for off, data in wire.iter_pieces(t, PIECE)]
        out.append(pieces)
    return out


def _header(st: ShardState, w: int, clock: int) -> PushHeader:
    return PushHeader(worker=w, clock=clock, base_version=st.version, dtype=torch.float16,
                      loss_scale=SCALE)  # fmt: skip


def _push(st: ShardState, w: int, clock: int, pieces: list) -> None:
    t = st.intake.begin_push(_header(st, w, clock), lock_timeout=60)
    try:
        for key, off, data in pieces:
            st.intake.add_data(t, key, off, data)
        st.intake.finish_push(t)
    finally:
        t.release()


def one_round(st: ShardState, pushes: list, clock: int) -> tuple[float, float]:
    """Every push of round `clock`; (wall, CPU) seconds from the last piece's arrival to
    the new version (finish_push of the last push returned). CPU: this thread's, all of
    the close's work with one update thread (the share a loaded machine cannot blur)."""
    *first, last = range(len(pushes))
    for w in first:
        _push(st, w, clock, pushes[w])
    t = st.intake.begin_push(_header(st, last, clock), lock_timeout=60)
    try:
        for key, off, data in pushes[last][:-1]:
            st.intake.add_data(t, key, off, data)
        key, off, data = pushes[last][-1]
        t0, c0 = time.perf_counter(), time.thread_time()
        st.intake.add_data(t, key, off, data)
        st.intake.finish_push(t)
        dt = (time.perf_counter() - t0, time.thread_time() - c0)
    finally:
        t.release()
    assert st.version == clock, "the round did not close"
    return dt


def _interleaved_round(st: ShardState, pushes: list, clock: int) -> None:
    """Every push of round `clock` streaming at once (pieces round-robin)."""
    tickets = [st.intake.begin_push(_header(st, w, clock), lock_timeout=60)
               for w in range(len(pushes))]  # fmt: skip
    try:
        for i in range(max(len(p) for p in pushes)):
            for w, p in enumerate(pushes):
                if i < len(p):
                    st.intake.add_data(tickets[w], *p[i])
        for t in tickets:
            st.intake.finish_push(t)
    finally:
        for t in tickets:
            t.release()
    assert st.version == clock


def measure(params: list[tuple[str, int]], workers: int, threads: int, rounds: int,
            opt: OptimizerConfig) -> dict:  # fmt: skip
    """Round-close latency, exact vs rank order, rounds alternated; and gradient bytes."""
    job = _job(params, workers, opt)
    pushes = _pushes(job, workers)
    shards = {"exact": _shard(job, True, threads), "rank order": _shard(job, False, threads)}
    times: dict[str, list[float]] = {k: [] for k in shards}
    cpu: dict[str, list[float]] = {k: [] for k in shards}
    for r in range(1, rounds + 2):
        for name, st in shards.items():
            wall, used = one_round(st, pushes, r)
            if r > 1:  # round 1 allocates staging and optimizer state: left out
                times[name].append(wall)
                cpu[name].append(used)
    median = {k: statistics.median(v) for k, v in times.items()}
    cpu_median = {k: statistics.median(v) for k, v in cpu.items()}
    out = {
        "workers": workers,
        "params": sum(n for _, n in params),
        "threads": threads,
        "rounds_timed": rounds,
        "close_median_s": median,
        "close_min_s": {k: min(v) for k, v in times.items()},
        "exact_over_rank_order": median["exact"] / median["rank order"],
        "close_cpu_median_s": cpu_median,
        "cpu_exact_over_rank_order": cpu_median["exact"] / cpu_median["rank order"],
        "gradient_bytes_after_rounds": {
            k: st.stats()["gradient_bytes"] for k, st in shards.items()
        },
    }
    for st in shards.values():
        st.stepper.close()
    return out


def memory(params: list[tuple[str, int]], workers: list[int], opt: OptimizerConfig) -> list:
    """gradient_bytes after one round, per worker count, delivery and summing."""
    rows = []
    for n in workers:
        job = _job(params, n, dataclasses.replace(opt))
        pushes = _pushes(job, n)
        for exact in (True, False):
            for together in (False, True):
                st = _shard(job, exact, 1)
                if together:
                    _interleaved_round(st, pushes, 1)
                else:
                    for w in range(n):
                        _push(st, w, 1, pushes[w])
                rows.append({"workers": n, "sum": "exact" if exact else "rank order",
                             "delivery": "at once" if together else "one after another",
                             "gradient_bytes": st.stats()["gradient_bytes"],
                             "bytes_per_param": st.stats()["gradient_bytes"]
                             / sum(m for _, m in params)})  # fmt: skip
                st.stepper.close()
    return rows
