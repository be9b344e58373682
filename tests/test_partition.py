"""psar.ps.partition.plan_slots: deterministic, chunked, balanced, complete; clear errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psar.ps.partition import Slot, bytes_per_shard, plan_slots

# A small transformer-ish parameter list: sizes differ by orders of magnitude.
MODEL = [
    ("embed.weight", 50_000),
    ("block0.attn.weight", 12_288),
    ("block0.attn.bias", 96),
    ("block0.mlp.weight", 24_576),
    ("block0.mlp.bias", 128),
    ("norm.weight", 32),
    ("head.weight", 50_000),
]

param_lists = st.lists(
    st.tuples(st.text("abcxyz.#", min_size=1, max_size=6), st.integers(1, 3000)),
    min_size=1,
    max_size=12,
    unique_by=lambda p: p[0],
)


def check_cover(params: list[tuple[str, int]], slots: list[Slot]) -> None:
    """Every element of every parameter is held by exactly one slot."""
    by_param: dict[str, list[Slot]] = {}
    for s in slots:
        by_param.setdefault(s.param, []).append(s)
    assert set(by_param) == {n for n, _ in params}
    for name, numel in params:
        covered = [0] * numel
        for s in by_param[name]:
            assert s.numel > 0
            for i in range(s.start, s.start + s.numel):
                covered[i] += 1
        assert covered == [1] * numel, f"{name}: elements not covered exactly once"


def test_deterministic() -> None:
    a = plan_slots(MODEL, 3, chunk_bytes=16 << 10)
    b = plan_slots(list(MODEL), 3, chunk_bytes=16 << 10)
    assert a == b
    # Slots come back in parameter order, then chunk order (the push/pull order).
    assert [s.param for s in a] == sorted((s.param for s in a), key=[n for n, _ in MODEL].index)
    for name, _ in MODEL:
        starts = [s.start for s in a if s.param == name]
        assert starts == sorted(starts)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(params=param_lists, num_shards=st.integers(1, 5), chunk_elems=st.integers(1, 700))
def test_properties(params: list[tuple[str, int]], num_shards: int, chunk_elems: int) -> None:
    chunk_bytes = chunk_elems * 4
    slots = plan_slots(params, num_shards, chunk_bytes=chunk_bytes)
    assert slots == plan_slots(params, num_shards, chunk_bytes=chunk_bytes)
    check_cover(params, slots)
    assert len({s.key for s in slots}) == len(slots), "slot keys must be unique"
    assert all(0 <= s.shard < num_shards for s in slots)
    # Chunking: no piece is larger than chunk_bytes; a parameter is cut only if bigger.
    for name, numel in params:
        mine = [s for s in slots if s.param == name]
        assert all(s.numel * 4 <= chunk_bytes for s in mine)
        per = chunk_elems - chunk_elems % 64 if chunk_elems >= 64 else chunk_elems
        assert len(mine) == -(-numel // per)
        # Cut at multiples of 64 elements (CHUNK_ALIGN): where a fused kernel's vector
        # loop over the whole parameter would start a vector.
        assert all(s.start % per == 0 for s in mine)
        assert [s.key for s in mine] == [f"{name}#{i}" for i in range(len(mine))]
    # Balance: greedy largest-first keeps the spread within the largest piece.
    load = bytes_per_shard(slots, num_shards)
    assert sum(load) == 4 * sum(n for _, n in params)
    assert max(load) - min(load) <= max(s.numel for s in slots) * 4


def test_large_tensors_are_chunked() -> None:
    chunk_bytes = 16 << 10  # 4096 fp32 elements
    slots = plan_slots(MODEL, 2, chunk_bytes=chunk_bytes)
    embed = [s for s in slots if s.param == "embed.weight"]
    assert [s.numel for s in embed] == [4096] * 12 + [50_000 - 12 * 4096]
    assert [s.start for s in embed] == [4096 * i for i in range(13)]
    # Exactly chunk_bytes is not cut; small tensors stay whole.
    exact = plan_slots([("a", 4096), ("b", 4097)], 1, chunk_bytes=chunk_bytes)
    assert [(s.key, s.numel) for s in exact] == [("a#0", 4096), ("b#0", 4096), ("b#1", 1)]
    # The chunks of one big tensor spread over the shards.
    assert {s.shard for s in embed} == {0, 1}
    check_cover(MODEL, slots)


def test_balance_beats_round_robin() -> None:
    # One huge and many tiny tensors: placing by variable round-robin puts the huge one
    # and half the tiny ones on shard 0; chunking + greedy keeps shards within a chunk.
    params = [("big", 100_000)] + [(f"tiny{i}", 10) for i in range(9)]
    slots = plan_slots(params, 2, chunk_bytes=4096)
    load = bytes_per_shard(slots, 2)
    assert max(load) - min(load) <= 4096
    check_cover(params, slots)


def test_itemsize_sets_the_chunk_length() -> None:
    slots = plan_slots([("h", 10)], 1, chunk_bytes=8, itemsize=2)
    assert [s.numel for s in slots] == [4, 4, 2]
    assert bytes_per_shard(slots, 1, itemsize=2) == [20]


def test_more_shards_than_pieces() -> None:
    slots = plan_slots([("a", 3), ("b", 2)], 4, chunk_bytes=64)
    assert [s.shard for s in slots] == [0, 1]
    assert bytes_per_shard(slots, 4) == [12, 8, 0, 0]


@pytest.mark.parametrize(
    ("params", "kwargs", "words"),
    [
        ([("a", 4)], {"num_shards": 0}, "num_shards"),
        ([("a", 4)], {"num_shards": -1}, "num_shards"),
        ([("a", 4)], {"num_shards": 1, "chunk_bytes": 3}, "chunk_bytes"),
        ([("a", 4)], {"num_shards": 1, "chunk_bytes": 0}, "chunk_bytes"),
        ([("a", 4)], {"num_shards": 1, "itemsize": 0}, "itemsize"),
        ([("a", 4), ("a", 2)], {"num_shards": 1}, "unique"),
        ([("a", 4), ("z", 0)], {"num_shards": 1}, "'z' has no elements"),
        ([("a", -1)], {"num_shards": 1}, "no elements"),
    ],
)
def test_errors(params: list[tuple[str, int]], kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        plan_slots(params, **kwargs)


def test_a_plan_that_leaves_a_shard_empty_is_refused_naming_the_flags() -> None:
    from psar.ps.partition import check_every_shard_holds_a_slot

    params = [("w", 10), ("b", 2)]
    check_every_shard_holds_a_slot(plan_slots(params, 2), 2, 1.0)  # two slots, two shards
    with pytest.raises(ValueError, match=r"--servers: 3 shards.*--chunk-mib 1.*at most 2"):
        check_every_shard_holds_a_slot(plan_slots(params, 3), 3, 1.0)
