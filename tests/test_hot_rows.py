"""The worker's hot-row cache (issue #46 item 2; ps/client/hot_rows.py): which rows it
keeps and serves within its bound, and end to end on real shards and workers that it
is the same bits at staleness 0, and saves what it says at a bound of 2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from psar.ps.client.hot_rows import HotRowCache
from tests.procs import run_ps_workers, shards


def _filled(capacity: int = 2, staleness: int = 1) -> HotRowCache:
    cache = HotRowCache(capacity, staleness, row_bytes=10)
    ids = torch.tensor([3, 5, 8, 9])
    rows = torch.arange(8.0).reshape(4, 2)  # row of id i: its position's two values
    cache.offer(0, ids, rows, torch.tensor([1, 4, 1, 4]), versions=[7, 8])
    return cache


def test_it_keeps_the_most_named_rows_and_serves_them_within_the_bound() -> None:
    cache = _filled()
    assert cache.ids.tolist() == [5, 9]  # named 4 times each; 3 and 8 once
    hit, rows = cache.lookup(torch.tensor([1, 5, 8, 9]), step=1)
    assert hit.tolist() == [False, True, False, True]
    assert rows.tolist() == [[2.0, 3.0], [6.0, 7.0]]
    assert cache.versions == [7, 8]
    # Step 2 is two steps after the pull: past a bound of 1, nothing is served.
    hit, rows = cache.lookup(torch.tensor([5, 9]), step=2)
    assert rows is None and not hit.any()
    c = cache.counts.as_dict()
    assert (c["lookups"], c["hits"], c["bytes_saved"]) == (6, 2, 20)
    assert c["hit_rate"] == pytest.approx(2 / 6)


def test_ties_keep_the_smaller_ids_so_every_worker_keeps_the_same() -> None:
    cache = HotRowCache(2, 1, row_bytes=1)
    ids, rows = torch.tensor([4, 6, 7]), torch.zeros(3, 2)
    cache.offer(0, ids, rows, torch.tensor([2, 2, 2]), versions=[0])
    assert cache.ids.tolist() == [4, 6]


def test_a_fresh_cache_is_not_refilled_and_an_old_one_is() -> None:
    cache = _filled()
    cache.offer(1, torch.tensor([1, 2]), torch.ones(2, 2), torch.tensor([9, 9]), [9, 9])
    assert cache.ids.tolist() == [5, 9] and cache.filled_at == 0  # still fresh at step 1
    cache.offer(2, torch.tensor([1, 2]), torch.ones(2, 2), torch.tensor([9, 9]), [9, 9])
    assert cache.ids.tolist() == [1, 2] and cache.filled_at == 2 and cache.versions == [9, 9]


def test_staleness_zero_is_exact_and_serves_nothing() -> None:
    cache = _filled(staleness=0)
    assert not cache.serves and cache.rows is None  # never filled: nothing to serve
    hit, rows = cache.lookup(torch.tensor([5, 9]), step=0)
    assert rows is None and not hit.any() and cache.counts.lookups == 2


def test_flags_are_bounded_and_say_so() -> None:
    from psar.trainkit.config import PSConfig

    with pytest.raises(ValueError, match=r"--hot-row-cache must be in \[0, 10000000\]"):
        PSConfig(hot_row_cache=-1)
    with pytest.raises(ValueError, match=r"--hot-row-staleness must be in \[0, 1000\]"):
        PSConfig(hot_row_staleness=1001)


def test_the_counters_reach_prometheus() -> None:
    from psar.worker.metrics import WorkerMetrics

    m = WorkerMetrics(arch="ps")
    m.hot_rows(100, 40, 4000)
    m.hot_rows(10, 5, 500)
    text = m.exposition().decode()
    assert 'psar_worker_hot_row_lookups_total{arch="ps"} 110.0' in text
    assert 'psar_worker_hot_row_hits_total{arch="ps"} 45.0' in text
    assert 'psar_worker_hot_row_bytes_saved_total{arch="ps"} 4500.0' in text


COMMON = ["--workload", "recsys", "--workload-option", "rows=5000,500",
          "--workload-option", "dim=8", "--workload-option", "samples=4096",
          "--workload-option", "val_samples=256", "--steps", "10", "--batch-size", "64",
          "--seed", "3", "--lr", "0.5", "--momentum", "0", "--eval-batches", "2",
          "--precision", "fp32", "--wire-dtype", "fp32", "--sparse-wire-dtype", "fp32",
          "--mode", "sync"]  # fmt: skip
CACHE = ["--hot-row-cache", "64", "--hot-row-staleness"]


def _run(tmp_path, name: str, extra: list[str]) -> tuple[list[dict], dict]:  # noqa: ANN001
    """A fresh 2-shard job of 2 sync workers; their reports and the saved model."""
    d = tmp_path / name
    d.mkdir()
    with shards(2) as addrs:
        reps = run_ps_workers(addrs, 2, d, [*COMMON, *extra, "--save", str(d / "model.pt")])
    return reps, torch.load(d / "model.pt")


@pytest.mark.slow
def test_end_to_end_exact_at_zero_and_saving_what_it_says_at_two(tmp_path) -> None:  # noqa: ANN001
    none, m_none = _run(tmp_path, "none", [])
    zero, m_zero = _run(tmp_path, "zero", [*CACHE, "0"])
    two, m_two = _run(tmp_path, "two", [*CACHE, "2"])
    # Staleness 0: the same bits as no cache (every loss, every weight and table row).
    assert zero[0]["losses"] == none[0]["losses"]
    assert m_zero.keys() == m_none.keys()
    for k in m_none:
        assert torch.equal(m_zero[k], m_none[k]), k
    assert zero[0]["hot_row_cache"]["hits"] == 0
    assert zero[0]["sparse_bytes_pulled"] == none[0]["sparse_bytes_pulled"]
    # Bound 2: the head of each table is served from the cache on two steps of three,
    # and every byte it saved is a byte not pulled (the batches name the same rows).
    for rep, base in zip(two, none, strict=True):
        hot = rep["hot_row_cache"]
        assert (hot["rows"], hot["staleness"]) == (64, 2)
        assert hot["hits"] > 0 and 0 < hot["hit_rate"] < 1
        assert set(hot["tables"]) == {"tables.0.weight", "tables.1.weight"}
        assert hot["lookups"] == zero[rep["rank"]]["hot_row_cache"]["lookups"]
        assert rep["sparse_bytes_pulled"] + hot["bytes_saved"] == base["sparse_bytes_pulled"]
    # It still trains: stale reads of a few hot rows for at most two steps.
    a, b = np.asarray(two[0]["losses"]), np.asarray(none[0]["losses"])
    assert np.all(np.isfinite(a)) and a[-3:].mean() < a[:3].mean()
    assert not np.array_equal(a, b)  # the cache did serve stale rows
