"""Deterministic placement of parameters onto shards.

Tensors larger than `chunk_bytes` are cut into chunks; chunks and small tensors are
then placed greedily, largest first, onto the shard holding the fewest bytes so far
(ties: lowest shard index). Every worker computes the same plan from the model's
parameter list, so the plan never travels except as a check (round-robin placement
by variable unbalances shards badly when sizes differ: tensorflow#45291).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_CHUNK_BYTES = 4 << 20
CHUNK_ALIGN = 64
"""Chunks of at least this many elements are cut at multiples of it: torch's fused
optimizer kernels round a vector loop and its scalar tail differently (fused SGD), so a
slot must start where a vector of the whole parameter would for a shard stepping slots to
equal a DDP rank stepping the parameter (ps/server/update/stepper.py)."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One piece of one parameter held by one shard."""

    key: str
    """Unique slot name: '<param>#<chunk index>'."""
    param: str
    """Name of the parameter (as in model.named_parameters())."""
    start: int
    """First element of the parameter's flat view that this slot holds."""
    numel: int
    """Number of elements."""
    shard: int
    """Index of the shard that holds it."""


def plan_slots(
    params: Sequence[tuple[str, int]],
    num_shards: int,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    itemsize: int = 4,
) -> list[Slot]:
    """Cut and place parameters (name, numel) onto `num_shards` shards.

    Returns slots in parameter order (then chunk order), which is also the order in
    which workers push and pull them.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if itemsize < 1:
        raise ValueError(f"itemsize must be >= 1 byte, got {itemsize}")
    if chunk_bytes < itemsize:
        raise ValueError(f"chunk_bytes must be >= {itemsize}, got {chunk_bytes}")
    names = [n for n, _ in params]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    per_chunk = chunk_bytes // itemsize
    if per_chunk >= CHUNK_ALIGN:
        per_chunk -= per_chunk % CHUNK_ALIGN
    pieces: list[tuple[str, str, int, int]] = []  # key, param, start, numel
    for name, numel in params:
        if numel <= 0:
            raise ValueError(f"parameter {name!r} has no elements")
        for i, start in enumerate(range(0, numel, per_chunk)):
            pieces.append((f"{name}#{i}", name, start, min(per_chunk, numel - start)))
    load = [0] * num_shards
    placed: dict[str, int] = {}
    # Largest first, ties broken by position, so the plan depends only on the list.
    order = sorted(range(len(pieces)), key=lambda i: (-pieces[i][3], i))
    for i in order:
        shard = min(range(num_shards), key=lambda s: (load[s], s))
        load[shard] += pieces[i][3] * itemsize
        placed[pieces[i][0]] = shard
    return [Slot(k, p, s, n, placed[k]) for k, p, s, n in pieces]


def bytes_per_shard(slots: Sequence[Slot], num_shards: int, itemsize: int = 4) -> list[int]:
    """fp32 master bytes each shard holds under this plan."""
    out = [0] * num_shards
    for s in slots:
        out[s.shard] += s.numel * itemsize
    return out


def check_every_shard_holds_a_slot(
    slots: Sequence[Slot], num_shards: int, chunk_mib: float
) -> None:
    """Refuse a plan that leaves a shard without parameters (ValueError naming the flags):
    such a shard has nothing to hold or update, and used to fail at Init with torch's
    "optimizer got an empty parameter list"."""
    empty = sorted(set(range(num_shards)) - {s.shard for s in slots})
    if empty:
        raise ValueError(
            f"--servers: {num_shards} shards, but the model cuts into only {len(slots)} "
            f"slot(s) at --chunk-mib {chunk_mib:g}, so shard(s) {empty} would hold nothing; "
            f"use at most {len(slots)} shards, or a smaller --chunk-mib"
        )
