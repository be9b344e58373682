"""trainkit/precision.py: what --precision, --wire-dtype and --worker-weights resolve to."""

from __future__ import annotations

import pytest
import torch

from psar.trainkit.config import LocalConfig, PSConfig, TrainConfig
from psar.trainkit.precision import resolve

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    "device, precision, want",
    [
        (CUDA, "fp16", torch.float16),  # a GPU worker keeps working weights only
        (CUDA, "bf16", torch.bfloat16),
        (CUDA, "auto", torch.float16),
        (CUDA, "fp32", torch.float32),
        (CPU, "bf16", torch.float32),  # CPU: fp32 weights unless asked
        (CPU, "auto", torch.float32),
    ],
)
def test_auto_worker_weights_follow_the_compute_dtype_on_cuda(device, precision, want) -> None:
    # resolve() only reads the device's type: no GPU is needed to check the rule.
    assert resolve(device, precision, "auto", "auto").weights == want


def test_explicit_worker_weights_are_kept() -> None:
    assert resolve(CPU, "bf16", "auto", "bf16").weights == torch.bfloat16
    assert resolve(CUDA, "fp16", "auto", "fp32").weights == torch.float32
    assert resolve(CPU, "fp32", "auto", "fp16").weights == torch.float16


@pytest.mark.parametrize("weights, precision", [("fp16", "bf16"), ("bf16", "fp16")])
def test_weights_of_another_low_precision_dtype_are_refused_naming_both_flags(
    weights: str, precision: str
) -> None:
    want = f"--worker-weights {weights} with --precision {precision}"
    with pytest.raises(ValueError, match=want):
        TrainConfig(worker_weights=weights, precision=precision)
    with pytest.raises(ValueError, match=want):
        resolve(CPU, precision, "auto", weights)


def test_auto_precision_is_checked_once_the_device_is_known() -> None:
    # --precision auto is bf16 on a CPU: fp16 weights are refused there, not mid-step.
    TrainConfig(worker_weights="fp16")  # the device is not known yet: accepted
    with pytest.raises(ValueError, match="--worker-weights fp16 with --precision bf16"):
        resolve(CPU, "auto", "auto", "fp16")
    assert resolve(CUDA, "auto", "auto", "fp16").weights == torch.float16


def test_local_mode_accepts_auto_worker_weights() -> None:
    cfg = TrainConfig(ps=PSConfig(mode="local"), local=LocalConfig(sync_every=2))
    assert cfg.worker_weights == "auto"  # the loop resolves it to fp32 there
