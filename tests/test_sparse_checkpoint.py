"""Sparse tables in shard checkpoints (docs/sparse.md, "Checkpoints"): a snapshot written
and read back restores every table bit for bit (rows, per-row optimizer state, versions,
clocks), damaged table bytes are caught by the checksums, a checkpoint whose tables do
not fit is refused with a message that says why, old checkpoints without tables still
restore, and a sync rollback takes the tables back with the dense state.

In-process shard state and real checkpoint files; the process-level kill -9 + --restore
test is tests/test_sparse_checkpoint_restore.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from psar.ps.errors import FailedPrecondition
from psar.ps.server.durability import checkpoints
from psar.ps.server.durability.checkpoints import CheckpointManager, newest_verified, path_for
from psar.ps.server.shard import ShardState
from psar.ps.server.sparse.tables import RowPush, SparseTables, TablesMismatch
from psar.ps.sparse_spec import TableSpec
from tests.ps_fixtures import grad_for, init_values, make_job, make_slots, push
from tests.test_fault_checksum import damage

DIM = 16
OPTIMIZERS = ("sgd", "adagrad", "lazy_adam")


def specs(shard: int = 0, shards: int = 1, rows: int = 20000) -> list[TableSpec]:
    """One table per sparse optimizer, so every kind of per-row state is checkpointed."""
    return [
        TableSpec(
            name=f"t.{opt}",
            rows=rows // (i + 1),
            dim=DIM,
            optimizer=opt,
            lr=0.05,
            init_std=0.1,
            init_seed=i,
            shard_index=shard,
            num_shards=shards,
        )  # fmt: skip
        for i, opt in enumerate(OPTIMIZERS)
    ]


def shard(mode: str, folder: Path | None = None, *, shards: int = 1) -> ShardState:
    """A shard with a job, checkpoints every step into `folder` (if any) and the tables."""
    m = CheckpointManager(folder, every=1) if folder is not None else None
    st = ShardState(checkpoints=m)
    st.sparse = SparseTables(st)
    st.sparse.create(specs(shards=shards))
    job = make_job(mode, num_workers=2, slots=make_slots(num_shards=shards), num_shards=shards)
    st.init(job, init_values(job))
    return st


def row_push(st: ShardState, name: str, worker: int, clock: int, seed: int) -> None:
    """Push `worker`'s rows of `clock`: 64 random rows of this shard, random gradients."""
    spec = st.sparse.tables[name].spec
    g = torch.Generator().manual_seed(seed * 7919 + worker * 31 + clock)
    held = torch.arange(spec.shard_index, spec.rows, spec.num_shards)
    ids = held[torch.randperm(held.numel(), generator=g)[:64]].sort().values
    grads = torch.randn(ids.numel(), spec.dim, generator=g)
    st.sparse.push(name, RowPush(worker, clock, 0, False, ids, grads))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor (equal bits, not merely equal values: -0.0 != 0.0)."""
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int64)


def assert_same_tables(a: SparseTables, b: SparseTables) -> None:
    assert a.specs == b.specs and a.tables.keys() == b.tables.keys()
    for name, ta in a.tables.items():
        tb = b.tables[name]
        assert ta.version == tb.version
        for k in ("weight", "acc", "m", "v", "steps"):
            x, y = getattr(ta, k), getattr(tb, k)
            assert (x is None) == (y is None), (name, k)
            if x is not None:
                assert torch.equal(bits(x), bits(y)), (name, k)
    assert a.clocks == b.clocks
    assert a.staleness == b.staleness and a.skipped == b.skipped


def test_round_trip_restores_every_table_bit_for_bit_and_training_continues_identically(
    tmp_path,
) -> None:
    st = shard("async", tmp_path)
    for clock in (1, 2, 3):
        for w in (0, 1):
            for name in st.sparse.tables:
                row_push(st, name, w, clock, seed=1)
    with st.cond:
        snap = st.durability.snapshot()
    st.checkpoints.write_now(snap["step"], snap)
    found, rejected = newest_verified(tmp_path, 0)
    assert found is not None and not rejected
    step, loaded = found
    assert {p for p in checkpoints.checksums(loaded) if p.startswith("/sparse/")} >= {
        "/sparse/tables/t.sgd/weight", "/sparse/tables/t.adagrad/acc",
        "/sparse/tables/t.lazy_adam/m", "/sparse/tables/t.lazy_adam/v",
        "/sparse/tables/t.lazy_adam/steps",
    }  # fmt: skip
    back = ShardState()
    back.durability.restore(step, loaded)
    assert_same_tables(st.sparse, back.sparse)
    assert all(t.version == 6 for t in back.sparse.tables.values())  # trained, not initial
    # The same pushes on both give the same bits: optimizer state came back too.
    for s in (st, back):
        for name in s.sparse.tables:
            row_push(s, name, 0, 4, seed=2)
    assert_same_tables(st.sparse, back.sparse)
    # The worker's identical CreateTables after the restore is a retry, not a conflict.
    assert back.sparse.create(specs()) is True


def test_damaged_table_bytes_are_detected_and_the_restore_falls_back(tmp_path, caplog) -> None:
    st = shard("async", tmp_path)
    saved = {}
    for clock in (1, 2):
        row_push(st, "t.sgd", 0, clock, seed=3)
        with st.cond:
            snap = st.durability.snapshot()
        st.checkpoints.write_now(clock, {**snap, "step": clock})
        saved[clock] = st.sparse.tables["t.sgd"].weight.clone()
    # The largest tensor of the file is the 20000 x 16 sgd table's rows.
    damage(path_for(tmp_path, 0, 2))
    with caplog.at_level(logging.WARNING, "psar.checkpoint"):
        found, rejected = newest_verified(tmp_path, 0)
    assert len(rejected) == 1 and "/sparse/tables/t.sgd/weight" in rejected[0]
    assert found is not None and found[0] == 1
    back = ShardState()
    back.durability.restore(*found)
    assert torch.equal(bits(back.sparse.tables["t.sgd"].weight), bits(saved[1]))


def test_an_open_sync_round_is_left_out_and_its_pushers_push_it_again(tmp_path) -> None:
    st = shard("sync")
    row_push(st, "t.sgd", 1, 1, seed=4)  # worker 0 has not pushed clock 1: open round
    before = st.sparse.tables["t.sgd"].weight.clone()
    with st.cond:
        snap = st.durability.snapshot()
    assert snap["sparse"]["clocks"] == [["t.sgd", 1, 0]]  # as if it never arrived
    back = ShardState()
    back.durability.restore(0, snap)
    assert not back.sparse.pending
    for w in (1, 0):  # worker 1's push of clock 1 is taken again, not acknowledged
        row_push(back, "t.sgd", w, 1, seed=4)
    assert back.sparse.tables["t.sgd"].version == 1
    assert not torch.equal(back.sparse.tables["t.sgd"].weight, before)


def test_tables_of_another_shard_or_shape_are_refused_and_nothing_changes() -> None:
    st = shard("async", shards=2)
    with st.cond:
        snap = st.durability.snapshot()
    snap["sparse"]["tables"]["t.sgd"]["spec"]["shard_index"] = 1
    back = ShardState()
    with pytest.raises(
        TablesMismatch, match=r"'t.sgd' holds the rows of shard 1 of 2.*shard 0 of 2"
    ):
        back.durability.restore(0, snap)
    assert back.job is None and getattr(back, "sparse", None) is None
    snap["sparse"]["tables"]["t.sgd"]["spec"]["shard_index"] = 0
    snap["sparse"]["tables"]["t.adagrad"]["acc"] = torch.zeros(3)
    with pytest.raises(TablesMismatch, match=r"'t.adagrad' \(adagrad\): 'acc' should be"):
        back.durability.restore(0, snap)
    assert back.job is None


def test_a_job_with_other_tables_is_refused_by_a_restored_shard_naming_the_difference() -> None:
    st = shard("async")
    with st.cond:
        snap = st.durability.snapshot()
    back = ShardState()
    back.durability.restore(7, snap)
    other = specs(rows=30000)
    with pytest.raises(FailedPrecondition) as err:
        back.sparse.create(other)
    msg = str(err.value)
    assert "'t.sgd': rows 20000 != 30000" in msg and "the checkpoint of step 7" in msg
    assert "without --restore" in msg


def test_a_checkpoint_written_before_sparse_tables_still_restores(caplog) -> None:
    st = shard("async")
    with st.cond:
        snap = st.durability.snapshot()
    del snap["sparse"]  # as psar wrote it before
    back = ShardState()
    back.durability.restore(3, snap)
    assert back.job == st.job and not back.sparse.tables
    with caplog.at_level(logging.WARNING, "psar.sparse"):
        assert back.sparse.create(specs()) is False
    assert "holds no sparse tables" in caplog.text


def test_sync_rollback_takes_the_tables_back_and_drops_pushes_from_before_it(tmp_path) -> None:
    st = shard("sync", tmp_path)
    job = st.job
    at_round_2 = None
    for clock in (1, 2, 3):
        for w in (0, 1):
            row_push(st, "t.adagrad", w, clock, seed=5)
        for w in (0, 1):
            push(st, worker=w, clock=clock, base_version=st.version, grads=grad_for(job, w, clock))
        if clock == 2:
            with st.cond:
                at_round_2 = st.durability.snapshot()["sparse"]
    st.checkpoints.flush()
    row_push(st, "t.adagrad", 0, 4, seed=5)  # round 4 open on the old timeline
    assert st.durability.rollback(2)["rolled_back"]
    t = st.sparse.tables["t.adagrad"]
    assert torch.equal(bits(t.weight), bits(at_round_2["tables"]["t.adagrad"]["weight"]))
    assert torch.equal(bits(t.acc), bits(at_round_2["tables"]["t.adagrad"]["acc"]))
    assert not st.sparse.pending and st.sparse.clocks[("t.adagrad", 0)] == 2
    # A push of clock 4 sent before the rollback (its worker has not re-registered) is
    # dropped without taking the clock; clock 3 is the next round of the new timeline.
    row_push(st, "t.adagrad", 1, 4, seed=9)
    assert not st.sparse.pending and st.sparse.clocks[("t.adagrad", 1)] == 2
    for w in (0, 1):
        row_push(st, "t.adagrad", w, 3, seed=5)
    assert t.version == at_round_2["tables"]["t.adagrad"]["version"] + 1


def test_a_round_whose_rows_died_with_a_shard_closes_when_its_worker_moves_on() -> None:
    st = shard("sync")
    job = st.job
    for w in (0, 1):
        push(st, worker=w, clock=1, base_version=st.version, grads=grad_for(job, w, 1))
    # Round 2: worker 1's rows arrive; worker 0's were lost (it re-pushed only its
    # dense gradient to the restored shard) and it goes on to clock 2 + 1.
    row_push(st, "t.sgd", 1, 2, seed=6)
    for w in (0, 1):
        push(st, worker=w, clock=2, base_version=st.version, grads=grad_for(job, w, 2))
    assert st.sparse.tables["t.sgd"].version == 0
    row_push(st, "t.sgd", 0, 3, seed=6)
    assert st.sparse.tables["t.sgd"].version == 1 and list(st.sparse.pending) == [("t.sgd", 3)]
    row_push(st, "t.sgd", 1, 3, seed=6)
    assert st.sparse.tables["t.sgd"].version == 2 and not st.sparse.pending


def test_tables_count_their_own_rounds_where_no_dense_round_is_pushed() -> None:
    """--arch hybrid: the shards see row pushes and no dense round (worker/hybrid.py), so a
    sync table's rounds close on its own count, and a clock beyond it is still one sent
    before a restore (dropped, its clock not taken)."""
    st = shard("sync")
    for clock in (1, 2, 3):
        for w in (0, 1):
            row_push(st, "t.sgd", w, clock, seed=4)
    t = st.sparse.tables["t.sgd"]
    assert st.rounds == 0 and t.version == 3 and not st.sparse.pending
    assert st.sparse.closed == {"t.sgd": 3}
    row_push(st, "t.sgd", 0, 5, seed=4)  # round 4 never closed: from before a restore
    assert st.sparse.clocks[("t.sgd", 0)] == 3 and not st.sparse.pending
    row_push(st, "t.sgd", 0, 4, seed=4)
    assert list(st.sparse.pending) == [("t.sgd", 4)]
