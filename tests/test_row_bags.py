"""ps/client/row_bags.py: an EmbeddingBag's index_add_ backward on a worker's row cache."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psar.ps.client.row_bags import install


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
