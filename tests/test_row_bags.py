"""ps/client/row_bags.py: an EmbeddingBag's backward on a worker's row cache, and the
batch's rows (batch_rows) that let it add each row's bags."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psar.ps.client.row_bags import BAG_ROWS, _stable_sort, batch_rows, install


def _pair(mode: str, **kw) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = nn.EmbeddingBag(40, 8, mode=mode, **kw)
    fast = nn.EmbeddingBag(40, 8, mode=mode, **kw)
    fast.load_state_dict(ref.state_dict())
    install(fast)
    return ref, fast


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_same_forward_bits_and_gradient_as_pytorch(mode: str) -> None:
    ref, fast = _pair(mode)
    ids = torch.randint(0, 40, (64, 4), generator=torch.Generator().manual_seed(1))
    ids[0] = 3  # a row named several times in one bag and across bags
    grad = torch.randn(64, 8, generator=torch.Generator().manual_seed(2))
    out_ref, out_fast = ref(ids), fast(ids)
    assert torch.equal(out_ref, out_fast)
    assert out_fast.grad_fn is not None and "BagOfRows" in type(out_fast.grad_fn).__name__
    out_ref.backward(grad)
    out_fast.backward(grad)
    torch.testing.assert_close(fast.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[ids.unique()] = False
    assert not fast.weight.grad[untouched].any()


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2])),  # offsets
        lambda m: m(torch.tensor([[1, 2], [3, 1]]), per_sample_weights=torch.full((2, 2), 0.5)),
    ],
)
def test_other_calls_run_the_modules_own_forward(call) -> None:
    ref, fast = _pair("sum")
    out_ref, out_fast = call(ref), call(fast)
    assert "BagOfRows" not in type(out_fast.grad_fn).__name__
    out_ref.sum().backward()
    out_fast.sum().backward()
    assert torch.equal(fast.weight.grad, ref.weight.grad)


def test_max_mode_and_no_grad_keep_pytorchs_path() -> None:
    ref, fast = _pair("max")
    ids = torch.tensor([[1, 2], [3, 1]])
    assert "BagOfRows" not in type(fast(ids).grad_fn).__name__
    _, fast = _pair("mean")
    with torch.no_grad():
        assert fast(ids).grad_fn is None


def test_embedding_is_left_as_it_is() -> None:
    emb = nn.Embedding(10, 4)
    install(emb)
    assert "forward" not in vars(emb)


# ---- batch_rows: the batch's rows by one sort, and the backward it allows -------------


def _unique_by_shard(ids: torch.Tensor, shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    from psar.ps.client.sparse_client import group_by_shard

    uniq, inv = torch.unique(ids, return_inverse=True)
    return group_by_shard(uniq, inv, shards)


@pytest.mark.parametrize(
    ("rows", "shards", "n"),
    [(10, 1, 30), (10, 3, 50), (10_000_000, 2, 4096), (1000, 4, 1), (7, 2, 2)],
)
def test_batch_rows_are_torch_uniques_grouped_by_shard(rows: int, shards: int, n: int) -> None:
    ids = torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(rows + n))
    told = batch_rows(ids, rows, shards)
    assert told is not None
    uniq, inv = _unique_by_shard(ids, shards)
    assert torch.equal(told.uniq, uniq) and torch.equal(told.inv, inv)
    # Row k's positions: by_row[starts[k]:starts[k+1]], increasing, each naming row k.
    ends = [*told.starts.tolist()[1:], n]
    for k, (a, b) in enumerate(zip(told.starts.tolist(), ends, strict=True)):
        pos = told.by_row[a:b]
        assert b > a and bool((told.inv[pos] == k).all())
        assert bool((pos[1:] > pos[:-1]).all())
    assert sorted(told.by_row.tolist()) == list(range(n))


@pytest.mark.parametrize("bad", [[-1, 3], [3, 10], []])
def test_batch_rows_leave_ids_out_of_range_to_the_shards(bad: list[int]) -> None:
    # An id outside the table would share another row's sort key: torch.unique's path
    # takes it, and the shard refuses it by name.
    assert batch_rows(torch.tensor(bad, dtype=torch.int64), 10, 2) is None


@pytest.mark.parametrize("bound", [100, 1 << 60])  # packed for numpy's sort; torch's
def test_stable_sort_is_torchs_stable_sort(bound: int) -> None:
    key = torch.randint(0, min(bound, 50), (5000,), generator=torch.Generator().manual_seed(4))
    keys, order = _stable_sort(key, bound)
    want_keys, want_order = torch.sort(key, stable=True)
    assert torch.equal(keys, want_keys) and torch.equal(order, want_order)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_told_batch_gets_the_same_gradient_bits_by_bags(mode: str) -> None:
    # The worker's case: the weight is the batch's unique rows and the ids index them.
    raw = torch.randint(0, 1000, (256, 4), generator=torch.Generator().manual_seed(5))
    raw[0] = raw[1, 0]  # a row named several times in one bag and across bags
    told = batch_rows(raw.reshape(-1), 1000, 2)
    assert told is not None
    ids = told.inv.reshape(raw.shape)
    rows = told.uniq.numel()
    _, plain = _pair(mode)
    plain.weight = nn.Parameter(torch.randn(rows, 8, generator=torch.Generator().manual_seed(6)))
    _, fast = _pair(mode)
    fast.weight = nn.Parameter(plain.weight.detach().clone())
    grad = torch.randn(256, 8, generator=torch.Generator().manual_seed(7))
    setattr(fast, BAG_ROWS, (ids, told.by_row, told.starts))
    out_fast, out_plain = fast(ids), plain(ids)
    assert BAG_ROWS not in vars(fast)  # this call's only
    assert len(out_fast.grad_fn.saved_tensors) == 2  # (each position's bag, row starts)
    assert len(out_plain.grad_fn.saved_tensors) == 1  # (the ids): index_add_
    assert torch.equal(out_fast, out_plain)
    out_fast.backward(grad)
    out_plain.backward(grad)
    assert torch.equal(fast.weight.grad, plain.weight.grad)
    ref = nn.EmbeddingBag(rows, 8, mode=mode)  # and PyTorch's own, to float rounding
    ref.weight = nn.Parameter(plain.weight.detach().clone())
    ref(ids).backward(grad)
    torch.testing.assert_close(fast.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)


def test_what_a_call_was_told_about_other_ids_is_dropped() -> None:
    _, fast = _pair("sum")
    ids = torch.tensor([[1, 2], [3, 1]])
    told = batch_rows(ids.reshape(-1), 40, 1)
    assert told is not None
    setattr(fast, BAG_ROWS, (told.inv.reshape(2, 2), told.by_row, told.starts))
    out = fast(ids)  # not the tensor it was told about: the index_add_ backward
    assert BAG_ROWS not in vars(fast)
    assert len(out.grad_fn.saved_tensors) == 1
    out.sum().backward()
    ref, _ = _pair("sum")
    ref(ids).sum().backward()
    torch.testing.assert_close(fast.weight.grad, ref.weight.grad)


def test_the_row_backward_experiment_checks_both_ways_alike(capsys) -> None:
    """bench/experiments/row_backward.py times the two ways only after checking their
    rows and gradients equal; a small run of it end to end."""
    from bench.experiments import row_backward

    t = row_backward.one_table(5000, 64, 4, 8, 2, iters=1, repeats=1)
    assert set(t) == {"unique_rows_ms", "unique_backward_ms", "sort_rows_ms", "sort_backward_ms"}
    assert all(v > 0 for v in t.values())
    threads = torch.get_num_threads()
    try:
        row_backward.main(["--rows", "3000,70", "--batch", "32", "--iters", "1", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)  # main times one thread: the rest of the run keeps its own
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines[1:]] == ["3,000", "70"] and lines[1].endswith("x")
