"""trainkit/finite.py: the fused finiteness checks agree with torch.isfinite().all()."""

from __future__ import annotations

import pytest
import torch

from psar.trainkit.finite import all_finite, all_finite_readonly


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_both_checks_agree_with_isfinite(bad: float | None, dtype: torch.dtype) -> None:
    for at in (0, 511, 1023):
        t = torch.randn(1024).to(dtype)
        if bad is not None:
            t[at] = bad
        want = bool(torch.isfinite(t).all())
        assert all_finite_readonly([t, None, torch.empty(0)]) is want
        assert all_finite([t.clone()]) is want


def test_the_readonly_check_writes_nothing() -> None:
    data = bytes(torch.tensor([1.0, -0.0, 3.5]).numpy().tobytes())
    view = torch.frombuffer(bytearray(data), dtype=torch.float32)
    before = view.clone()
    assert all_finite_readonly([view])
    assert torch.equal(view, before) and view[1].item() == 0.0 and str(view[1].item()) == "-0.0"
