"""Precision policy: which dtype computes, which travels, which weights a worker keeps.

`auto` means fp16 on CUDA and bf16 on CPU: CPUs without fp16 matmul units emulate it
(~70x slower than bf16 measured on this project's CPU), while GPUs run fp16 natively.
Casts are selective through torch.autocast: matmuls in low precision; softmax, losses
and norms stay fp32 (autocast's own op lists).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from psar.trainkit.dtypes import DTYPE_BY_NAME, NAME_BY_DTYPE

PRECISIONS = ("auto", "fp32", "fp16", "bf16")
WIRE_DTYPES = ("auto", "fp32", "fp16", "bf16")


@dataclass(frozen=True)
class PrecisionPolicy:
    """Resolved precision choices for one worker on one device."""

    device: torch.device
    compute: torch.dtype
    """dtype of matmuls under autocast (fp32: autocast off)."""
    wire: torch.dtype
    """dtype gradients (and pulled weights) travel in."""
    weights: torch.dtype
    """dtype of the weights a PS worker keeps (masters stay fp32 on the shards)."""

    @property
    def loss_scaling(self) -> bool:
        """fp16 gradients need dynamic loss scaling; bf16 has fp32's range and needs none."""
        return self.compute == torch.float16 or self.wire == torch.float16

    @property
    def name(self) -> str:
        return NAME_BY_DTYPE[self.compute]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.compute == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute)


WORKER_WEIGHTS = ("auto", "fp32", "fp16", "bf16")
_LOW = ("fp16", "bf16")


def check_weights_dtype(worker_weights: str, precision: str) -> None:
    """Refuse low-precision worker weights of another dtype than a low-precision compute
    (fp16 weights under bf16 autocast: norms and losses would see mixed dtypes, which CPU
    kernels refuse mid-step), naming both flags. `precision` may still be auto."""
    if worker_weights in _LOW and precision in _LOW and worker_weights != precision:
        raise ValueError(
            f"--worker-weights {worker_weights} with --precision {precision}: a worker's "
            f"low-precision weights must be in the compute dtype; use --worker-weights "
            f"{precision} (or auto), or fp32"
        )


def resolve(
    device: torch.device, precision: str, wire_dtype: str = "auto", worker_weights: str = "auto"
) -> PrecisionPolicy:
    """Turn the --precision / --wire-dtype / --worker-weights flags into a policy.

    --worker-weights auto: on CUDA, the compute dtype when it is fp16 or bf16 (a worker
    keeps only working weights; the fp32 masters are the shards'), else fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision: unknown {precision!r}; accepted: {', '.join(PRECISIONS)}")
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(
            f"--wire-dtype: unknown {wire_dtype!r}; accepted: {', '.join(WIRE_DTYPES)}"
        )
    if worker_weights not in WORKER_WEIGHTS:
        raise ValueError(
            f"--worker-weights: unknown {worker_weights!r}; accepted: {', '.join(WORKER_WEIGHTS)}"
        )
    if precision == "auto":
        precision = "fp16" if device.type == "cuda" else "bf16"
    check_weights_dtype(worker_weights, precision)
    if worker_weights == "auto":
        worker_weights = precision if device.type == "cuda" and precision in _LOW else "fp32"
    compute = DTYPE_BY_NAME[precision]
    wire = compute if wire_dtype == "auto" else DTYPE_BY_NAME[wire_dtype]
    return PrecisionPolicy(
        device=device, compute=compute, wire=wire, weights=DTYPE_BY_NAME[worker_weights]
    )


def pick_device(spec: str, local_rank: int) -> torch.device:
    """--device auto|cpu|cuda: auto takes cuda:LOCAL_RANK when CUDA is present."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible; use --device cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if spec == "cpu":
        return torch.device("cpu")
    raise ValueError(f"--device: unknown {spec!r}; accepted: auto, cpu, cuda")
