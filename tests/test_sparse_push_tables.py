"""push_tables (ps/client/sparse_client.py) sends every table's rows to each shard in one
unary PushTables call (PushRows streams when they do not fit in one message): against two
real shards, each table ends bit for bit as after pushing it alone, by either path; per-table
replies and byte counts match; sync rounds of two tables close independently; a PushTables
with one bad push is refused whole, no table changed."""

from __future__ import annotations

import contextlib

import grpc
import pytest
import torch

from psar.ps import serde
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.client_config import ClientConfig
from psar.ps.client.psclient import PSClient
from psar.ps.client.sparse_client import RowsPush, create_tables, pull_rows, push_rows, push_tables
from psar.ps.errors import InvalidArgument
from psar.ps.server.sparse.table import SparseTable
from psar.ps.sparse_spec import TableSpec, init_rows
from tests.ps_fixtures import make_job, raw_stub, serving

SHARDS, DIM = 2, 8
ROWS = {"a": 300, "b": 50}
N = 48  # rows pushed per table: ~1.9 kB per shard, over SMALL's one-message limit


def _spec(name: str, shard: int) -> TableSpec:
    return TableSpec(
        name=name, rows=ROWS[name], dim=DIM, optimizer="sgd", lr=0.5, eps=1e-8,
        init_std=0.1, init_seed=3, shard_index=shard, num_shards=SHARDS,
    )  # fmt: skip


@contextlib.contextmanager
def _cluster(mode: str, workers: int, cfg: ClientConfig | None = None):  # noqa: ANN202
    with serving() as (p0, s0), serving() as (p1, s1):
        for i, st in enumerate((s0, s1)):
            job = make_job(mode, num_workers=workers, shard_index=i, num_shards=SHARDS)
            st.init(job, {"w#0": torch.zeros(8), "w#1": torch.zeros(4), "b#0": torch.zeros(5)})
        clients = [
            PSClient([f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"], worker=w) for w in range(workers)
        ]
        specs = [[_spec(n, i) for n in ROWS] for i in range(SHARDS)]
        for c in clients:
            create_tables(c, specs)
        try:
            yield clients, (s0, s1), (p0, p1)
        finally:
            for c in clients:
                c.close()


def _grads(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: (torch.randperm(rows, generator=g)[:N].sort().values, torch.randn(N, DIM, generator=g))
        for n, rows in ROWS.items()
    }


# A client whose messages are too small for one table's push: push_tables streams PushRows.
SMALL = ClientConfig(message_bytes=1024, max_message_bytes=2048)


@pytest.mark.parametrize("cfg", [None, SMALL], ids=["PushTables", "PushRows streams"])
def test_push_tables_equals_pushing_each_table_alone(cfg: ClientConfig | None) -> None:
    grads = _grads(0)
    got = {}
    for together in (False, True):
        with _cluster("async", 1, cfg if together else None) as (clients, _, _):
            c = clients[0]
            if together:
                pushes = [
                    RowsPush(n, 1, i, g, torch.float32, [0, 0]) for n, (i, g) in grads.items()
                ]
                out = dict(zip(grads, push_tables(c, pushes), strict=True))
            else:
                out = {
                    n: push_rows(
                        c,
                        table=n,
                        clock=1,
                        ids=i,
                        grads=g,
                        dtype=torch.float32,
                        base_versions=[0, 0],
                    )  # fmt: skip
                    for n, (i, g) in grads.items()
                }
            for replies, nbytes in out.values():
                assert len(replies) == SHARDS and all(r.applied for r in replies)
                assert nbytes == N * 8 + N * DIM * 4  # ids + fp32 values, over both shards
            reader = PSClient(c.addresses, worker=0)  # SMALL's replies would be too big
            got[together] = {
                n: pull_rows(reader, n, torch.arange(rows), DIM, torch.float32)[0]
                for n, rows in ROWS.items()
            }
            reader.close()
    for n, rows in ROWS.items():
        assert torch.equal(got[True][n], got[False][n])  # bit for bit
        moved = ~torch.isin(torch.arange(rows), grads[n][0])
        assert torch.equal(got[True][n][moved], init_rows(rows, DIM, 0.1, 3)[moved])
        assert not torch.equal(got[True][n], init_rows(rows, DIM, 0.1, 3))


@pytest.mark.parametrize("overflow", [False, True])
def test_sync_rounds_of_every_table_close_once_all_workers_pushed(overflow: bool) -> None:
    with _cluster("sync", 2) as (clients, states, _):
        for w, c in enumerate(clients):
            pushes = [
                RowsPush(n, 1, i, g, torch.float16, [0, 0], overflow=overflow and w == 1)
                for n, (i, g) in _grads(w).items()
            ]
            push_tables(c, pushes)
            for st in states:  # worker 0 alone closes nothing; worker 1 closes every round
                assert all(t.version == w for t in st.sparse.tables.values())
                assert not st.sparse.pending if w else len(st.sparse.pending) == len(ROWS)
        skipped = [dict(st.sparse.skipped) for st in states]
        assert skipped == ([dict.fromkeys(ROWS, 1)] * SHARDS if overflow else [{}] * SHARDS)


def _whole(table: str, ids: list[int], grads: torch.Tensor) -> pb.RowsPushWhole:
    head = pb.PushRowsHeader(worker=0, clock=1, table=table, num_ids=len(ids),
                             dtype=serde.dtype_to_pb(torch.float32))  # fmt: skip
    return pb.RowsPushWhole(header=head, ids=torch.tensor(ids).numpy().tobytes(),
                            data=grads.numpy().tobytes())  # fmt: skip


@pytest.mark.parametrize(
    ("b", "needle"),
    [(_whole("b", [4, 6], torch.ones(2, DIM + 1)), "wrong embedding width"),
     (_whole("b", [5], torch.ones(1, DIM)), "not held by shard 0"),
     (_whole("a", [8], torch.ones(1, DIM)), "a table named twice"),
     (_whole("nope", [4], torch.ones(1, DIM)), "no sparse table")],
)  # fmt: skip
def test_a_bad_push_refuses_the_whole_call_and_changes_no_table(
    b: pb.RowsPushWhole, needle: str
) -> None:
    with _cluster("async", 1) as (_, states, ports), raw_stub(ports[0]) as stub:
        before = {n: t.weight.clone() for n, t in states[0].sparse.tables.items()}
        good = _whole("a", [2, 4], torch.ones(2, DIM))
        with pytest.raises(grpc.RpcError) as e:
            stub.PushTables(pb.PushTablesRequest(pushes=[good, b]))
        code = (
            grpc.StatusCode.NOT_FOUND if "no sparse" in needle else grpc.StatusCode.INVALID_ARGUMENT
        )
        assert e.value.code() == code and needle in e.value.details()
        for n, t in states[0].sparse.tables.items():
            assert t.version == 0 and torch.equal(t.weight, before[n])
        assert states[0].sparse.clocks == {}
        ok = stub.PushTables(pb.PushTablesRequest(pushes=[good]))  # the good one alone: applied
        assert [r.applied for r in ok.replies] == [True]
        assert states[0].sparse.tables["a"].version == 1


def test_ids_sorted_or_not_are_taken_and_duplicates_refused_either_way() -> None:
    # Sorted ids (what workers send) skip local_index's sort; any others still get it.
    t = SparseTable(_spec("a", 0))  # shard 0 of 2: even rows, at row // 2
    for ids in ([2, 8, 40], [40, 2, 8], [6]):
        assert local(t, ids) == [i // 2 for i in ids]
    for bad in ([2, 8, 8], [8, 2, 8]):
        with pytest.raises(InvalidArgument, match=r"duplicate row ids \[8\]"):
            local(t, bad)


def local(t: SparseTable, ids: list[int]) -> list[int]:
    return t.local_index(torch.tensor(ids), what="PushRows").tolist()
