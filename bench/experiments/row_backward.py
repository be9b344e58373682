"""A sparse worker's own CPU per table and step, the two ways it has found a batch's rows
and added their gradients (ps/client/row_bags.py), timed on one thread in one process:

- `unique`: ``torch.unique`` (sorted ids, inverse), regrouped shard by shard
  (sparse_client.group_by_shard), then the backward by one ``index_add_`` from a
  (bags x size x dim) copy of the bags' gradients (the path the hot-row cache and ids
  outside the table still take);
- `sort`: ``batch_rows`` (one stable sort of a shard-then-id key, which also gives where
  the batch names each row), then the backward as an ``embedding_bag`` over the bags'
  gradients.

Both ways' rows, inverse and gradients are checked equal (the same bits) before timing.
The gradient handed to the backward is a column slice of a wider one, as a recsys
model's concatenated features give it. Figures are medians of `--repeats` timings of
`--iters` calls each.

    python bench/experiments/row_backward.py [--rows 10000000,100000] [--batch 4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from psar.ps.client import sparse_client
from psar.ps.client.row_bags import _BagOfRows, batch_rows


def _ms(fn: Callable[[], object], iters: int, repeats: int) -> float:
    """Median over `repeats` of the mean ms of `iters` calls (one warm-up call first)."""
    fn()
    got = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        got.append((time.perf_counter() - t) * 1000 / iters)
    return statistics.median(got)


def one_table(rows: int, batch: int, bag: int, dim: int, shards: int, iters: int,
              repeats: int) -> dict[str, float]:  # fmt: skip
    """ms per call of each way's two halves (rows found, gradient added) for one table."""
    gen = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, rows, (batch, bag), generator=gen)
    flat = ids.reshape(-1)
    wide = torch.randn(batch, 4 * dim, generator=gen)
    grad = wide[:, dim : 2 * dim]  # a slice of the features' gradient: not contiguous

    def unique() -> tuple[torch.Tensor, torch.Tensor]:
        uniq, inv = torch.unique(flat, return_inverse=True)
        return sparse_client.group_by_shard(uniq, inv, shards)

    def sort() -> object:
        return batch_rows(flat, rows, shards)

    uniq, inv = unique()
    told = sort()
    assert told is not None
    assert torch.equal(told.uniq, uniq) and torch.equal(told.inv, inv)
    remapped = inv.reshape(batch, bag)

    def backward(*given: torch.Tensor) -> torch.Tensor:
        w = torch.zeros(uniq.numel(), dim, requires_grad=True)
        _BagOfRows.apply(w, remapped, "sum", *given).backward(grad)
        return w.grad

    assert torch.equal(backward(), backward(told.by_row, told.starts))
    return {
        "unique_rows_ms": _ms(unique, iters, repeats),
        "unique_backward_ms": _ms(backward, iters, repeats),
        "sort_rows_ms": _ms(sort, iters, repeats),
        "sort_backward_ms": _ms(lambda: backward(told.by_row, told.starts), iters, repeats),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="10000000,100000", help="each table's rows, comma-separated")
    p.add_argument("--batch", type=int, default=4096, help="bags per step (one worker's batch)")
    p.add_argument("--bag", type=int, default=4, help="ids per bag")
    p.add_argument("--dim", type=int, default=64, help="values per row")
    p.add_argument("--shards", type=int, default=2, help="shards the rows are grouped for")
    p.add_argument("--iters", type=int, default=50, help="calls per timing")
    p.add_argument("--repeats", type=int, default=5, help="timings per figure (median)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print("rows        find: unique  sort   backward: index_add  bags   both: old    new    ratio")
    for rows in (int(x) for x in a.rows.split(",")):
        t = one_table(rows, a.batch, a.bag, a.dim, a.shards, a.iters, a.repeats)
        old = t["unique_rows_ms"] + t["unique_backward_ms"]
        new = t["sort_rows_ms"] + t["sort_backward_ms"]
        print(f"{rows:<11,d} {t['unique_rows_ms']:>12.2f} {t['sort_rows_ms']:>6.2f} "
              f"{t['unique_backward_ms']:>20.2f} {t['sort_backward_ms']:>6.2f} "
              f"{old:>10.2f} {new:>6.2f} {old / new:>6.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
