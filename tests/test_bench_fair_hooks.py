"""Fair comparisons (issue #19): DDP moves gradients in the dtype the PS pushes, with
torch's own compression hooks wherever torch allows them, and the hooks reduce right."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from psar.allreduce.hooks import register_wire_dtype
from psar.allreduce.process_group import end_process_group


class _FakeDDP:
    """What register_wire_dtype reads of a DDP module: its parameters and the hook call."""

    def __init__(self) -> None:
        self.module = torch.nn.Linear(2, 2)
        self.hooks: list = []

    def register_comm_hook(self, state: object, hook: object) -> None:
        self.hooks.append(hook)


def test_fp16_uses_torchs_own_hook_on_cpu() -> None:
    ddp = _FakeDDP()
    register_wire_dtype(ddp, torch.float16)  # type: ignore[arg-type]
    assert ddp.hooks == [default_hooks.fp16_compress_hook]


def test_bf16_on_cpu_gets_an_equivalent_hook_and_fp32_none() -> None:
    ddp = _FakeDDP()
    register_wire_dtype(ddp, torch.bfloat16)  # type: ignore[arg-type]
    assert len(ddp.hooks) == 1 and ddp.hooks[0] is not default_hooks.bf16_compress_hook
    ddp = _FakeDDP()
    register_wire_dtype(ddp, torch.float32)  # type: ignore[arg-type]
    assert ddp.hooks == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hooks_average_gradients_in_a_real_gloo_group(dtype: torch.dtype) -> None:
    """A one-rank gloo group: the gradient comes back as the mean (itself), rounded
    through the wire dtype, for both torch's fp16 hook and the bf16 one."""
    # An in-process store (no TCP rendezvous on a port that may be taken meanwhile) and
    # a short timeout: a stuck group fails this test in a minute instead of hanging the
    # run for torch's default 30 minutes (seen once in a full run).
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        ref = torch.nn.Linear(8, 4)
        ref.load_state_dict(model.state_dict())
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        register_wire_dtype(ddp, dtype)
        x = torch.randn(5, 8)
        ddp(x).sum().backward()
        ref(x).sum().backward()
        want = ref.weight.grad.to(dtype).float()
        assert torch.equal(model.weight.grad, want)
        assert model.weight.grad.dtype == torch.float32
    finally:
        end_process_group()  # a plain destroy could hang: allreduce/process_group.py


def test_the_rpc_baseline_refuses_an_unknown_transport_by_name() -> None:
    # Its default is TensorPipe's uv transport (bench/baselines/rpc_ps.py says why); a bad
    # --transports or --style is refused before any process group or RPC starts.
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "baselines" / "rpc_ps.py"
    for flag, value in (("--transports", "carrier-pigeon"), ("--style", "fast")):
        p = subprocess.run([sys.executable, str(script), flag, value], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
        assert p.returncode != 0 and flag in p.stderr and "accepted" in p.stderr
