"""Precision names users type (fp32, fp16, bf16) and their torch dtypes."""

from __future__ import annotations

import torch

DTYPE_BY_NAME: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
NAME_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in DTYPE_BY_NAME.items()}
