"""Sparse tables on a shard: updates equal dense ones on touched rows, untouched rows stay
bit for bit, sync rounds average in rank order, and bad input is refused unchanged."""

from __future__ import annotations

import grpc
import pytest
import torch

from psar.ps import serde
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.psclient import PSClient
from psar.ps.client.sparse_client import create_tables, pull_rows, push_rows
from psar.ps.server.sparse.table import SparseTable, dense_reference_step
from psar.ps.server.sparse.tables import RowPush, SparseTables
from psar.ps.sparse_spec import TableSpec, init_rows
from tests.ps_fixtures import make_job, make_slots, make_state, raw_stub, serving

ROWS, DIM = 1000, 8


def spec(opt: str = "sgd", shard: int = 0, shards: int = 1) -> TableSpec:
    return TableSpec(
        name="emb", rows=ROWS, dim=DIM, optimizer=opt, lr=0.1, eps=1e-8, init_std=0.1,
        init_seed=5, shard_index=shard, num_shards=shards,
    )  # fmt: skip


def test_init_rows_is_the_same_whichever_shard_draws_it() -> None:
    full = init_rows(ROWS, DIM, 0.1, 5)
    for s in range(3):
        torch.testing.assert_close(init_rows(ROWS, DIM, 0.1, 5, shard=s, num_shards=3), full[s::3])


@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
def test_sparse_update_equals_dense_on_touched_rows(opt: str) -> None:
    t = SparseTable(spec(opt))
    dense = t.weight.clone()
    before = t.weight.clone()
    state: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(0)
    touched = torch.zeros(ROWS, dtype=torch.bool)
    for _ in range(4):
        ids = torch.randperm(ROWS, generator=g)[:50]
        grads = torch.randn(50, DIM, generator=g)
        touched[ids] = True
        t.apply(ids, grads)
        full = torch.zeros(ROWS, DIM)
        full[ids] = grads
        dense_reference_step(t.spec, dense, state, full)
    torch.testing.assert_close(t.weight[touched], dense[touched], rtol=1e-6, atol=1e-7)
    assert torch.equal(t.weight[~touched], before[~touched])  # bit for bit
    if opt == "sgd":
        ref = torch.nn.Parameter(before.clone())
        sgd = torch.optim.SGD([ref], lr=0.1)
        g = torch.Generator().manual_seed(0)
        for _ in range(4):
            ids = torch.randperm(ROWS, generator=g)[:50]
            full = torch.zeros(ROWS, DIM)
            full[ids] = torch.randn(50, DIM, generator=g)
            ref.grad = full
            sgd.step()
        torch.testing.assert_close(t.weight, ref.detach(), rtol=1e-6, atol=1e-7)


def test_lazy_adam_matches_sparse_adam_and_leaves_untouched_state() -> None:
    t = SparseTable(spec("lazy_adam"))
    ref = torch.nn.Parameter(t.weight.clone())
    adam = torch.optim.SparseAdam([ref], lr=0.1, eps=1e-8)
    ids = torch.tensor([3, 10, 999])
    grads = torch.randn(3, DIM)
    before = t.weight.clone()
    t.apply(ids, grads)
    ref.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grads, (ROWS, DIM))
    adam.step()  # one step: per-row and per-table bias corrections agree
    torch.testing.assert_close(t.weight, ref.detach(), rtol=1e-5, atol=1e-6)
    rest = torch.ones(ROWS, dtype=torch.bool)
    rest[ids] = False
    assert torch.equal(t.weight[rest], before[rest])
    assert int(t.steps[rest].sum()) == 0 and float(t.m[rest].abs().sum()) == 0.0


def _tables(mode: str, workers: int = 2) -> SparseTables:
    st = make_state(make_job(mode, num_workers=workers, slots=make_slots()))
    tables = SparseTables(st)
    tables.create([spec("sgd")])
    return tables


def test_sync_round_averages_in_rank_order_and_applies_once() -> None:
    tables = _tables("sync")
    w0 = tables.tables["emb"].weight.clone()
    g1 = torch.ones(2, DIM)
    applied = tables.push("emb", RowPush(1, 1, 0, False, torch.tensor([5, 7]), g1))
    assert applied[0] and tables.tables["emb"].version == 0  # waits for worker 0
    tables.push("emb", RowPush(0, 1, 0, False, torch.tensor([7]), 3 * torch.ones(1, DIM)))
    w = tables.tables["emb"].weight
    assert tables.tables["emb"].version == 1
    torch.testing.assert_close(w[5], w0[5] - 0.1 * 0.5)
    torch.testing.assert_close(w[7], w0[7] - 0.1 * 2.0)
    # A retry of an applied clock is acknowledged, not applied again.
    again = tables.push("emb", RowPush(0, 1, 0, False, torch.tensor([7]), torch.ones(1, DIM)))
    assert again[1] and tables.tables["emb"].version == 1


def test_async_applies_on_arrival_with_staleness() -> None:
    tables = _tables("async")
    tables.push("emb", RowPush(0, 1, 0, False, torch.tensor([1]), torch.ones(1, DIM)))
    _, _, version, stale = tables.push(
        "emb", RowPush(1, 1, 0, False, torch.tensor([1]), torch.ones(1, DIM))
    )
    assert version == 2 and stale == 1
    assert tables.stats()["emb"]["staleness_histogram"] == {0: 1, 1: 1}


@pytest.mark.parametrize(
    ("ids", "grads", "needle"),
    [
        ([1, 1000], torch.ones(2, DIM), "out of range"),
        ([-1], torch.ones(1, DIM), "out of range"),
        ([4, 4], torch.ones(2, DIM), "duplicate row ids [4]"),
        ([4, 5], torch.ones(2, DIM + 1), "wrong embedding width"),
        ([4], torch.full((1, DIM), float("nan")), "non-finite"),
    ],
)
def test_bad_pushes_change_nothing(ids: list[int], grads: torch.Tensor, needle: str) -> None:
    tables = _tables("async")
    before = tables.tables["emb"].weight.clone()
    with pytest.raises(Exception, match="emb") as err:
        tables.push("emb", RowPush(0, 1, 0, False, torch.tensor(ids), grads))
    assert needle in str(err.value)
    assert torch.equal(tables.tables["emb"].weight, before)
    assert tables.tables["emb"].version == 0 and tables.clocks == {}


def _serve_tables(port: int, shards: int = 1) -> PSClient:
    client = PSClient([f"127.0.0.1:{port}"], worker=0)
    create_tables(client, [[spec("adagrad")]])
    return client


def test_grpc_round_trip_and_status_codes() -> None:
    with serving() as (port, state):
        state.init(
            make_job("async", num_workers=1),
            {"w#0": torch.zeros(8), "w#1": torch.zeros(4), "b#0": torch.zeros(5)},
        )
        client = _serve_tables(port)
        ids = torch.tensor([3, 900, 17])
        rows, versions, _ = pull_rows(client, "emb", ids, DIM, torch.float32)
        torch.testing.assert_close(rows, init_rows(ROWS, DIM, 0.1, 5)[ids])
        replies, _ = push_rows(
            client, table="emb", clock=1, ids=ids, grads=torch.ones(3, DIM),
            dtype=torch.float16, base_versions=versions,
        )  # fmt: skip
        assert replies[0].applied and state.sparse.tables["emb"].version == 1
        digest = state.sparse.tables["emb"].weight.clone()
        with raw_stub(port) as stub:
            bad_ids = [torch.tensor([5, 5]), torch.tensor([ROWS + 3])]
            for bad in bad_ids:
                req = pb.PullRowsRequest(worker=0, table="emb", ids=bad.numpy().tobytes(), dtype=1)
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.PullRows(req))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "emb" in e.value.details()
            head = pb.PushRowsHeader(worker=0, clock=2, table="emb", num_ids=1,
                                     dtype=serde.dtype_to_pb(torch.float32))  # fmt: skip
            chunks = [
                pb.PushRowsChunk(header=head),
                pb.PushRowsChunk(ids=torch.tensor([4]).numpy().tobytes()),
                pb.PushRowsChunk(data=torch.ones(DIM - 1).numpy().tobytes()),
            ]
            with pytest.raises(grpc.RpcError) as e:
                stub.PushRows(iter(chunks))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "width" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                list(stub.PullRows(pb.PullRowsRequest(worker=0, table="nope", dtype=1)))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert torch.equal(state.sparse.tables["emb"].weight, digest)
        client.close()


def test_sync_round_left_open_by_an_expired_worker_closes_on_the_next_push() -> None:
    tables = _tables("sync")
    tables.push("emb", RowPush(0, 1, 0, False, torch.tensor([2]), torch.ones(1, DIM)))
    assert tables.tables["emb"].version == 0
    with tables.state.cond:
        tables.state.live.discard(1)  # as a lease expiry does
        # ...which closes dense round 1 too: worker 0 pushes clock 2 after pulling it.
        tables.state.rounds = 1
    tables.push("emb", RowPush(0, 2, 0, False, torch.tensor([2]), torch.ones(1, DIM)))
    assert tables.tables["emb"].version == 2 and not tables.pending


def test_rows_of_another_shard_are_refused() -> None:
    st = make_state(make_job("async", num_workers=2, slots=make_slots()))
    tables = SparseTables(st)
    tables.create([spec("sgd", shard=0, shards=2)])
    with pytest.raises(Exception, match="not held by shard 0 of 2") as err:
        tables.pull(0, "emb", torch.tensor([2, 3]))
    assert "[3]" in str(err.value)
    assert tables.create([spec("sgd", shard=0, shards=2)]) is True  # identical retry
    with pytest.raises(Exception, match="different spec"):
        tables.create([spec("adagrad", shard=0, shards=2)])


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "lazy_adam"])
def test_a_rounds_mean_is_one_step_with_the_mean_gradient(opt: str) -> None:
    """apply_mean (a sync round's close) == apply() of the mean of the workers' row
    gradients, rows named by one worker, by both, or by none; the version moves once.
    SGD steps each worker's rows at lr / 3 in rank order: bit for bit that, and equal to
    the mean's step but for the last bits of rows two workers name; the others bit for
    bit the mean's step."""
    g = torch.Generator().manual_seed(3)
    parts = [
        (torch.tensor([1, 4, 9, 30]), torch.randn(4, DIM, generator=g)),
        (torch.tensor([4, 7, 30]), torch.randn(3, DIM, generator=g)),
        (torch.tensor([], dtype=torch.int64), torch.empty(0, DIM)),
    ]
    a, b = SparseTable(spec(opt)), SparseTable(spec(opt))
    seq = SparseTable(spec(opt))
    for _ in range(2):
        a.apply_mean(parts)
        uniq = torch.tensor([1, 4, 7, 9, 30])
        mean = torch.zeros(5, DIM)
        for ids, grads in parts:
            mean.index_add_(0, torch.searchsorted(uniq, ids), grads)
            seq.weight.index_add_(0, ids, grads, alpha=-seq.spec.lr / 3)
        b.apply(uniq, mean / 3)
    if opt == "sgd":
        assert torch.equal(a.weight, seq.weight)  # bit for bit: rank order, lr / 3 each
        torch.testing.assert_close(a.weight, b.weight, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(a.weight, b.weight)  # bit for bit
    assert a.version == b.version == 2
    for k in SparseTable.STATE[opt]:
        torch.testing.assert_close(getattr(a, k), getattr(b, k))
    untouched = torch.ones(a.weight.shape[0], dtype=torch.bool)
    untouched[[1, 4, 7, 9, 30]] = False
    assert torch.equal(a.weight[untouched], SparseTable(spec(opt)).weight[untouched])
