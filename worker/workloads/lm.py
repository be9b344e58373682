"""Built-in ``lm`` workload: a small byte-level transformer on the Python stdlib's source.

Every Python install ships its standard library as ``.py`` files, so this is real
text with no download. The corpus is the top-level ``*.py`` files of the stdlib
directory (not ``site-packages``, whose contents vary between environments), in
sorted order, so every process on one install reads the same bytes. Different
Python versions ship different files, so compare numbers within one install.

The input and output embeddings are tied (one Parameter used twice), which
exercises parameter sharing in both the parameter server and DDP.
"""

from __future__ import annotations

import math
import sysconfig
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from psar.worker.workloads.base import Workload, opt_float, opt_int, seeded

__all__ = [
    "ByteLM",
    "ByteWindows",
    "lm_loss",
    "make",
    "nats_to_bits",
    "split_files",
    "stdlib_files",
]

VOCAB = 256


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention that only looks at earlier positions."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (B, T, D) -> (B, H, T, D/H)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ByteLM(nn.Module):
    """Byte-level causal transformer: (B, T) long bytes -> (B, T, 256) logits."""

    def __init__(self, seq_len: int, d_model: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(VOCAB, d_model)
        self.pos_emb = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one Parameter, two uses
        # Small embeddings (GPT-2 style): N(0, 1) embeddings would make the tied
        # output layer's initial logits large and the first steps unstable.
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ByteWindows(TensorDataset):
    """Non-overlapping windows of a byte stream: item i = (bytes[i*L:(i+1)*L], next bytes).

    Inputs and targets are views into one long tensor (targets shifted by one), so
    the data costs 8 bytes per byte of text rather than 16. ``files`` records the
    source files, for reports and for checking the train/val split.
    """

    def __init__(self, data: bytes, seq_len: int, files: list[str]) -> None:
        n = (len(data) - 1) // seq_len
        if n < 1:
            raise ValueError(f"{len(data)} bytes of text is too little for seq_len={seq_len}")
        tokens = torch.frombuffer(bytearray(data[: n * seq_len + 1]), dtype=torch.uint8).long()
        super().__init__(tokens[:-1].view(n, seq_len), tokens[1:].view(n, seq_len))
        self.files = files
        self.num_bytes = len(data)


def stdlib_files() -> list[Path]:
    """Top-level ``*.py`` files of this interpreter's standard library, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"), key=lambda p: p.name)


def split_files(files: list[Path], val_fraction: float) -> tuple[list[Path], list[Path]]:
    """Split files into (train, val) by a CRC of the file name.

    A hash of the name (not Python's randomised ``hash``) is the same in every
    process, and a file's side does not change when other files come or go.
    """
    cut = int(val_fraction * 10_000)
    val = [f for f in files if zlib.crc32(f.name.encode()) % 10_000 < cut]
    train = [f for f in files if zlib.crc32(f.name.encode()) % 10_000 >= cut]
    return train, val


def _read(files: list[Path], budget: int) -> tuple[bytes, list[str]]:
    """Concatenate files in order until ``budget`` bytes; the last one may be cut short."""
    parts: list[bytes] = []
    names: list[str] = []
    total = 0
    for path in files:
        if total >= budget:
            break
        chunk = path.read_bytes()[: budget - total]
        parts.append(chunk)
        names.append(path.name)
        total += len(chunk)
    return b"".join(parts), names


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: (B, T, 256) logits vs (B, T) bytes."""
    # .float(): bf16 logits (autocast) would lose precision in log-softmax.
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def nats_to_bits(nats: float) -> float:
    """Mean loss in nats per byte -> bits per byte."""
    return nats / math.log(2)


def make(
    seed: int,
    *,
    seq_len: Any = 64,
    d_model: Any = 64,
    n_layers: Any = 2,
    n_heads: Any = 4,
    max_bytes: Any = 2_000_000,
    val_fraction: Any = 0.1,
) -> Workload:
    """Build the ``lm`` workload. Options (``--workload-option key=value``):

    - ``seq_len`` (int, 64): bytes per training window (and the position table size).
    - ``d_model`` (int, 64): embedding width; must be divisible by ``n_heads``.
    - ``n_layers`` (int, 2): transformer blocks.
    - ``n_heads`` (int, 4): attention heads.
    - ``max_bytes`` (int, 2000000): total text read, train + val; the stdlib has
      a few MB of top-level ``.py`` files, more is simply all of it.
    - ``val_fraction`` (float, 0.1): share of files (by name hash) and of the byte
      budget held out for validation; 0 disables validation.

    ``seed`` sets the initial weights only; the text is the same for every seed.
    The validation metric is bits per byte.
    """
    seq_len = opt_int("seq_len", seq_len, minimum=1)
    d_model = opt_int("d_model", d_model, minimum=1)
    n_layers = opt_int("n_layers", n_layers, minimum=0)
    n_heads = opt_int("n_heads", n_heads, minimum=1)
    max_bytes = opt_int("max_bytes", max_bytes, minimum=2)
    val_fraction = opt_float("val_fraction", val_fraction, low=0.0, high=0.9)

    with seeded(seed):
        model = ByteLM(seq_len, d_model, n_layers, n_heads)

    train_files, val_files = split_files(stdlib_files(), val_fraction)
    val_budget = int(max_bytes * val_fraction)
    train_text, train_names = _read(train_files, max_bytes - val_budget)
    train = ByteWindows(train_text, seq_len, train_names)
    val = None
    if val_budget > seq_len:
        val_text, val_names = _read(val_files, val_budget)
        val = ByteWindows(val_text, seq_len, val_names)

    params = sum(p.numel() for p in model.parameters())
    return Workload(
        model=model,
        train_dataset=train,
        val_dataset=val,
        loss_fn=lm_loss,
        val_metric="bits_per_byte",
        val_transform=nats_to_bits,
        description=(
            f"byte lm {n_layers}x{d_model} ({params:,} params), seq_len {seq_len}, "
            f"{train.num_bytes:,} train bytes from {len(train_names)} stdlib files"
        ),
    )
