"""Integer buffers on the PS (issue #17): BatchNorm's num_batches_tracked and any counter.

They travel exactly in shard 0's push and pull headers (never as slots in the wire dtype,
where bf16 would round 257 to 256); the shard keeps rank 0's values, as DDP's broadcast
does, refuses a push whose integer buffers do not match the job with INVALID_ARGUMENT and
no trace, sends them with every pull and keeps them in checkpoints.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from psar.ps import serde
from psar.ps.client.int_buffers import IntBuffers
from psar.ps.errors import InvalidArgument
from psar.ps.headers import PushHeader
from psar.ps.job import MAX_INT_BUFFER_ELEMENTS
from psar.ps.server.durability import checkpoints
from psar.ps.server.shard import ShardState
from tests.ps_fixtures import grad_for, make_job, make_state, pull
from tests.test_dataplane import header, items, shard
from tests.test_transport_contract import door
from tests.test_transport_contract import pull as door_pull

SPEC = (("bn.num_batches_tracked", 1), ("counts", 3))
TIMEOUT = 30.0


def job_with_ints(mode: str = "sync", **kw: object):  # noqa: ANN201
    return dataclasses.replace(make_job(mode, num_workers=2, staleness=4, **kw), int_buffers=SPEC)


def ints(n: int) -> dict[str, tuple[int, ...]]:
    return {"bn.num_batches_tracked": (n,), "counts": (n, -n, 2**40 + n)}


def push_ints(st: ShardState, worker: int, clock: int, values: dict, base_version: int = 0):  # noqa: ANN001, ANN201
    job = st.job
    h = PushHeader(worker, clock, base_version, torch.float32, 1.0, int_buffers=values)
    ticket = st.intake.begin_push(h, lock_timeout=5.0)
    try:
        for k, t in grad_for(job, worker, clock).items():
            st.intake.add_data(ticket, k, 0, t.contiguous().numpy().tobytes())
        return st.intake.finish_push(ticket)
    finally:
        ticket.release()


def test_sync_keeps_rank0s_whatever_order_the_pushes_come_in() -> None:
    st = make_state(job_with_ints("sync"))
    push_ints(st, 1, 1, ints(11))
    push_ints(st, 0, 1, ints(10))
    head, _ = pull(st, 1, 1)
    assert head.int_buffers == ints(10)
    # Next round: rank 0 first, then rank 1 — still rank 0's.
    push_ints(st, 0, 2, ints(20), base_version=1)
    push_ints(st, 1, 2, ints(21), base_version=1)
    head, _ = pull(st, 0, 2)
    assert head.int_buffers == ints(20)


def test_a_slow_worker_gets_its_rounds_values_not_a_fast_workers_next() -> None:
    """Worker 1 pulls round 1 and pushes clock 2 before worker 0 pulls round 1: worker
    0 must get round 1's counts (rank 0's), or its counters run one ahead each time."""
    st = make_state(job_with_ints("sync"))
    push_ints(st, 0, 1, ints(10))
    push_ints(st, 1, 1, ints(11))
    head1, _ = pull(st, 1, 1)
    push_ints(st, 1, 2, ints(21), base_version=1)
    head0, _ = pull(st, 0, 1)
    assert head1.int_buffers == head0.int_buffers == ints(10)
    push_ints(st, 0, 2, ints(20), base_version=1)
    head0, _ = pull(st, 0, 2)
    assert head0.int_buffers == ints(20)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_keep_worker0s(mode: str) -> None:
    st = make_state(job_with_ints(mode))
    push_ints(st, 1, 1, ints(11))
    assert st.int_buffers.newest() is None  # only worker 0's count
    push_ints(st, 0, 1, ints(10))
    push_ints(st, 1, 2, ints(12), base_version=2)
    head, _ = pull(st, 1, 2)
    assert head.int_buffers == ints(10)


def test_local_mode_keeps_none_each_worker_keeps_its_own() -> None:
    st = make_state(job_with_ints("local"))
    for w in (0, 1):
        push_ints(st, w, 1, ints(10 + w))
    head, _ = pull(st, 0, 1)
    assert head.int_buffers == {} and st.version == 1


def test_a_fresh_shard_sends_none_and_workers_keep_their_own() -> None:
    st = make_state(job_with_ints("sync"))
    head, _ = pull(st, 0, 0)
    assert head.int_buffers == {}


BAD = [
    ("unknown", {**ints(1), "nope": (1,)}, "does not hold"),
    ("missing", {"counts": (1, 2, 3)}, "lacks"),
    ("wrong-numel", {**ints(1), "counts": (1, 2)}, "has 2 elements, the job says 3"),
]


@pytest.mark.parametrize(("values", "words"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_mismatched_integer_buffers_are_refused_and_change_nothing(values, words) -> None:  # noqa: ANN001
    st = make_state(job_with_ints("sync"))
    push_ints(st, 0, 1, ints(10))
    before = st.state_digest()
    with pytest.raises(InvalidArgument, match=words):
        push_ints(st, 1, 1, values)
    assert st.state_digest() == before
    assert st.int_buffers.newest() == (1, 0, ints(10)) and st.version == 0


def test_checkpoints_keep_them_and_their_owner() -> None:
    st = make_state(job_with_ints("sync"))
    for w in (1, 0):
        push_ints(st, w, 1, ints(10 + w))
    with st.cond:
        snap = st.durability.snapshot()
    # The writer's checksums cover the int64 tensors: a damaged counter is caught.
    sums = checkpoints.checksums(snap)
    path = "/int_buffers/1/values/counts"
    assert path in sums
    damaged = {**snap, "checksums": sums}
    damaged["int_buffers"] = {"1": {"worker": 0, "values": {**snap["int_buffers"]["1"]["values"]}}}
    damaged["int_buffers"]["1"]["values"]["counts"] = (
        snap["int_buffers"]["1"]["values"]["counts"] + 1
    )
    assert checkpoints.verify(damaged) == [path]
    back = ShardState()
    back.durability.restore(5, snap)
    assert back.int_buffers.newest() == (1, 0, ints(10))
    assert back.state_digest() == st.state_digest()
    # A checkpoint from before integer buffers existed restores with none.
    old = {k: v for k, v in snap.items() if not k.startswith("int_buffers")}
    older = ShardState()
    older.durability.restore(5, old)
    assert older.int_buffers.newest() is None


def test_jobs_refuse_duplicate_empty_or_oversized_integer_buffers() -> None:
    base = make_job("sync")
    for bad, words in [
        ((("a", 1), ("a", 2)), "unique names"),
        ((("a", 0),), ">= 1 element"),
        ((("a", MAX_INT_BUFFER_ELEMENTS + 1),), "more than 4096"),
    ]:
        with pytest.raises(ValueError, match=words):
            dataclasses.replace(base, int_buffers=bad)


def test_they_cross_the_wire_exactly() -> None:
    job = job_with_ints("sync")
    spec = serde.job_to_pb(job)
    assert serde.job_from_pb(type(spec).FromString(spec.SerializeToString())) == job
    h = PushHeader(0, 1, 0, torch.bfloat16, int_buffers={"counts": (-(2**62), 257, 0)})
    msg = serde.push_header_to_pb(h)
    assert serde.push_header_from_pb(type(msg).FromString(msg.SerializeToString())) == h


@pytest.mark.parametrize("kind", ["grpc", "tcp"])
def test_both_doors_carry_them_and_refuse_a_mismatch(kind: str) -> None:
    job = job_with_ints("sync")
    with shard(job) as s:
        t = door(s, kind)
        try:
            for w in (1, 0):
                pb_values = serde.int_values_to_pb(ints(30 + w))
                t.push(
                    header(w, 1, int_buffers=pb_values),
                    items(grad_for(job, w, 1)),
                    timeout_s=TIMEOUT,
                )
            head, _, _ = door_pull(t, job, 1, 1)
            assert serde.int_values_from_pb(head.int_buffers) == ints(30)
            before = s.state.state_digest()
            bad = serde.int_values_to_pb({"counts": (1, 2, 3)})
            with pytest.raises(grpc.RpcError) as err:
                t.push(
                    header(0, 2, 1, int_buffers=bad), items(grad_for(job, 0, 2)), timeout_s=TIMEOUT
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "send every one of the job's integer buffers" in err.value.details()
            assert s.state.state_digest() == before
        finally:
            close = getattr(t, "close", None)
            if close is not None:
                close()


class Counted(torch.nn.Module):
    def __init__(self, big: int = 0) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(4)
        self.register_buffer("flags", torch.tensor([True, False]))
        self.register_buffer("scale", torch.ones(2))  # float: a slot, not an int buffer
        if big:
            self.register_buffer("table", torch.zeros(big, dtype=torch.int32))


def test_the_worker_side_finds_reads_and_loads_integer_buffers() -> None:
    m = Counted()
    b = IntBuffers(m)
    assert dict(b.spec()) == {"bn.num_batches_tracked": 1, "flags": 2}
    m.bn(torch.randn(3, 4))
    assert b.values() == {"bn.num_batches_tracked": (1,), "flags": (1, 0)}
    b.load({"bn.num_batches_tracked": (2**40,), "flags": (0, 1)})
    assert m.bn.num_batches_tracked.item() == 2**40
    assert m.flags.tolist() == [False, True] and m.flags.dtype == torch.bool
    b.load({})  # a shard with none yet: the worker keeps its own
    assert m.bn.num_batches_tracked.item() == 2**40
    assert not IntBuffers(m, enabled=False)  # --mode local: each keeps its own


def test_too_many_integer_elements_stay_local_with_a_warning(caplog) -> None:  # noqa: ANN001
    with caplog.at_level("WARNING", "psar.client"):
        b = IntBuffers(Counted(big=MAX_INT_BUFFER_ELEMENTS))
    assert not b and "stay each worker's own" in caplog.text
