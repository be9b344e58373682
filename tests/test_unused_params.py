"""Unused parameters and model buffers on the shards, as DDP treats them (issue #17).

Checked against what torch does (found with a 2-rank gloo DDP, find_unused_parameters=True,
torch 2.13): a parameter some rank used gets the mean over all ranks, the others counting
zeros; one no rank used keeps .grad None, so torch's optimizer skips it (no momentum, no
weight decay, no state). The reference below runs torch's own optimizer that way; the
shard must match it bit for bit, whole-round and per-chunk, and through both doors.
Buffers: rank 0's values (DDP's broadcast), or the mean with --buffers average.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from psar.ps.errors import NotFound
from psar.ps.headers import PushHeader
from psar.ps.server.shard import ShardState
from psar.trainkit.optim import build_optimizer
from tests.ps_fixtures import grad_for, init_values, make_job, make_state
from tests.test_dataplane import config, header, items, shard
from tests.test_transport_contract import door

TIMEOUT = 30.0


def push_absent(
    st: ShardState,
    worker: int,
    clock: int,
    grads: dict[str, torch.Tensor],
    absent: tuple[str, ...] = (),
    *,
    base_version: int = 0,
    loss_scale: float = 1.0,
):
    """A push whose header names `absent` slots; their data is junk (the shard must
    count them as zeros whatever arrives)."""
    h = PushHeader(worker, clock, base_version, torch.float32, loss_scale, absent=absent)
    ticket = st.intake.begin_push(h, lock_timeout=5.0)
    try:
        for k, t in grads.items():
            data = torch.full_like(t, 123.0) if k in absent else t * loss_scale
            st.intake.add_data(ticket, k, 0, data.contiguous().numpy().tobytes())
        return st.intake.finish_push(ticket)
    finally:
        ticket.release()


def reference(job, values, rounds):  # noqa: ANN001, ANN201
    """torch's optimizer on the masters as DDP leaves the grads: `rounds` is a list of
    {key: list of per-worker grads or None (absent)}; a key absent everywhere: None."""
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in values.items()}
    opt = build_optimizer(ps.values(), job.optimizer)
    for r in rounds:
        for k, p in ps.items():
            got = [g for g in r[k] if g is not None]
            if not got:
                p.grad = None
                continue
            total = torch.zeros_like(p)
            for g in r[k]:
                total.add_(g if g is not None else torch.zeros_like(p))
            p.grad = total.div_(len(r[k]))
        opt.step()
    return ps, opt


@pytest.mark.parametrize("chunk_rounds", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sync_unused_slot_is_not_stepped_and_partial_is_the_mean(
    chunk_rounds: bool, optimizer: str
) -> None:
    job = make_job("sync", num_workers=2, optimizer=optimizer)
    values = init_values(job)
    st = make_state(job, values, chunk_rounds=chunk_rounds)
    keys = [s.key for s in job.slots]
    unused, partial = keys[-1], keys[0]  # b#0 used by nobody; w#0 by worker 0 on round 2
    rounds = []
    for clock in (1, 2, 3):
        absent = {0: (unused,), 1: (unused, partial) if clock == 2 else (unused,)}
        row: dict[str, list] = {k: [] for k in keys}
        for w in (0, 1):
            g = grad_for(job, w, clock)
            push_absent(st, w, clock, g, absent[w], base_version=clock - 1, loss_scale=4.0)
            for k in keys:
                row[k].append(None if k in absent[w] else g[k])
        rounds.append(row)
    ref, opt = reference(job, values, rounds)
    for k in keys:
        assert torch.equal(st.masters[k].detach(), ref[k].detach()), k
    # The unused slot: its value is the initial one and the optimizer never saw it.
    assert torch.equal(st.masters[unused].detach(), values[unused])
    assert not st.optimizer.state.get(st.masters[unused])
    assert st.version == 3


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_push_without_a_slot_leaves_it_alone(mode: str) -> None:
    job = make_job(mode, num_workers=2, staleness=4)
    values = init_values(job)
    st = make_state(job, values)
    keys = [s.key for s in job.slots]
    skip = keys[1]
    push_absent(st, 0, 1, grad_for(job, 0, 1), (skip,))
    assert torch.equal(st.masters[skip].detach(), values[skip])
    assert not st.optimizer.state.get(st.masters[skip])
    for k in keys:
        if k != skip:
            assert not torch.equal(st.masters[k].detach(), values[k]), k
    # The next push that has it steps it from where it was.
    push_absent(st, 1, 1, grad_for(job, 1, 1))
    assert not torch.equal(st.masters[skip].detach(), values[skip])


def test_absent_slot_of_another_shard_is_refused_and_changes_nothing() -> None:
    job = make_job("sync", num_workers=2)
    st = make_state(job)
    before = st.state_digest()
    with pytest.raises(NotFound, match="absent slot 'nope#0' is not on this shard"):
        push_absent(st, 0, 1, grad_for(job, 0, 1), ("nope#0",))
    assert st.state_digest() == before


@pytest.mark.parametrize("average", [False, True])
def test_buffers_take_rank0s_values_or_the_mean_never_stepped(average: bool) -> None:
    base = make_job("sync", num_workers=2)
    buf = base.slots[-1].key
    job = dataclasses.replace(base, buffer_slots=(buf,), buffers_average=average)
    values = init_values(job)
    st = make_state(job, values)
    pushed = {}
    for w in (0, 1):
        g = grad_for(job, w, 1)
        pushed[w] = g[buf].clone()
        # A buffer travels as its value: the loss scale must not divide it.
        h = PushHeader(w, 1, 0, torch.float32, 8.0)
        t = st.intake.begin_push(h, lock_timeout=5.0)
        for k, v in g.items():
            data = v if k == buf else v * 8.0
            st.intake.add_data(t, k, 0, data.contiguous().numpy().tobytes())
        st.intake.finish_push(t)
    want = (pushed[0] + pushed[1]) / 2 if average else pushed[0]
    assert torch.equal(st.masters[buf].detach(), want)
    assert not st.optimizer.state.get(st.masters[buf])  # never an optimizer step


def test_buffers_average_needs_sync() -> None:
    base = make_job("async", num_workers=2)
    with pytest.raises(ValueError, match="--buffers average needs --mode sync"):
        dataclasses.replace(base, buffer_slots=(base.slots[0].key,), buffers_average=True)


@pytest.mark.parametrize("chunk_rounds", [False, True])
def test_absent_slots_travel_in_the_verdict_through_both_doors(chunk_rounds: bool) -> None:
    """Streamed pushes (verdict_follows) name their absent slots in the verdict: over
    gRPC and the TCP data plane the shards end byte-identical, and a slot absent from
    every push was not stepped."""
    job = make_job("sync", num_workers=2)
    values = init_values(job)
    unused = job.slots[-1].key
    cfg = config(chunk_rounds=chunk_rounds)
    with shard(job, cfg) as a, shard(job, cfg) as b:
        ta, tb = door(a, "grpc"), door(b, "tcp")
        for w in (0, 1):
            h = header(w, 1, 0, verdict_follows=True)
            its = [*items(grad_for(job, w, 1)), ("verdict", False, (unused,))]
            ta.push(h, its, timeout_s=TIMEOUT)
            tb.push(h, its, timeout_s=TIMEOUT)
        assert a.state.state_digest() == b.state.state_digest()
        for s in (a, b):
            assert s.state.version == 1
            assert torch.equal(s.state.masters[unused].detach(), values[unused])
            assert not torch.equal(
                s.state.masters[job.slots[0].key].detach(), values[job.slots[0].key]
            )
        tb.close()


def test_buffer_slots_and_absent_lists_cross_the_wire() -> None:
    from psar.ps import serde

    base = make_job("sync", num_workers=2)
    job = dataclasses.replace(base, buffer_slots=(base.slots[-1].key,), buffers_average=True)
    spec = serde.job_to_pb(job)
    assert serde.job_from_pb(type(spec).FromString(spec.SerializeToString())) == job
    h = PushHeader(1, 2, 1, torch.float32, absent=("w#1", "b#0"))
    msg = serde.push_header_to_pb(h)
    assert serde.push_header_from_pb(type(msg).FromString(msg.SerializeToString())) == h
