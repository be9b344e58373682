"""Hostile membership calls against a real `psar server` process (issue #45, defect 5):
a rank belongs to the instance that registered it. A Leave from anyone else (no
instance, a stranger's, the rank's previous holder's) and a Register with joined=true by
another instance are refused FAILED_PRECONDITION, and the shard's live set, records and
state digest stay as they were; the holder's own Leave, through the worker's client,
still works."""

from __future__ import annotations

from pathlib import Path

import grpc

from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from psar.ps.client.errors import PSClientError
from tests import hostile as h

SC = grpc.StatusCode


def _status(call) -> tuple[SC | None, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    except PSClientError as e:  # the worker's client
        return e.code, e.details
    return None, ""


def _seen(s: h.HostileShard) -> tuple:
    """What a refused call must not move: the live set, leaves, rejoins, the digest."""
    r = s.stub.Stats(pb.StatsRequest(), timeout=h.TIMEOUT)
    return (tuple(r.live_worker_ids), r.leaves, r.rejoins, r.state_digest, tuple(r.worker_clocks))


def test_only_the_holder_of_a_rank_may_leave_it_or_be_replaced_by_a_joiner(
    tmp_path: Path,
) -> None:
    with h.hostile_shard(tmp_path) as s, s.client(1, "grpc") as holder:
        holder.register(clock=0, instance="holder-of-1")
        before = _seen(s)
        assert before[0] == (0, 1)
        refused = [
            ("no instance", lambda: s.stub.Leave(pb.LeaveRequest(worker=1), timeout=h.TIMEOUT)),
            (
                "a stranger",
                lambda: s.stub.Leave(
                    pb.LeaveRequest(worker=1, instance="intruder"), timeout=h.TIMEOUT
                ),
            ),
            (
                "a joiner on a live rank",
                lambda: s.stub.Register(
                    pb.RegisterRequest(worker=1, clock=0, instance="intruder", joined=True),
                    timeout=h.TIMEOUT,
                ),
            ),
        ]
        for what, call in refused:
            code, details = _status(call)
            assert code == SC.FAILED_PRECONDITION, (what, code, details)
            assert "instance" in details and "nothing changed" in details.lower(), details
            assert _seen(s) == before, what

        # The rank's process restarts (a new instance takes it over, a rejoin): the old
        # process's Leave, arriving late, is stale and refused.
        with s.client(1, "grpc") as restarted:
            restarted.register(clock=0, instance="holder-of-1-restarted")
            again = _seen(s)
            code, details = _status(holder.leave)
            assert code == SC.FAILED_PRECONDITION and "another instance" in details, details
            assert _seen(s) == again and again[0] == (0, 1)
            restarted.leave()  # the holder itself: accepted
        live, leaves, *_ = _seen(s)
        assert live == (0,) and leaves == 1


def test_a_rank_nobody_registered_can_be_neither_left_nor_joined(tmp_path: Path) -> None:
    with h.hostile_shard(tmp_path) as s:
        before = _seen(s)
        req = pb.LeaveRequest(worker=1, instance="guess")
        code, details = _status(lambda: s.stub.Leave(req, timeout=h.TIMEOUT))
        assert code == SC.FAILED_PRECONDITION and "no registered instance" in details
        reg = pb.RegisterRequest(worker=0, clock=0, instance="guess", joined=True)
        code, _ = _status(lambda: s.stub.Register(reg, timeout=h.TIMEOUT))  # rank 0 is live
        assert code == SC.FAILED_PRECONDITION
        assert _seen(s) == before


def test_stop_job_is_refused_where_the_sizes_agree_and_stops_every_call_where_not(
    tmp_path: Path,
) -> None:
    """Issue #45 defect 13: StopJob (a worker of another --world-size) changes nothing
    when its size is the job's; otherwise every later call says why, never UNKNOWN."""
    with h.hostile_shard(tmp_path) as s, s.client(1, "grpc") as holder:
        holder.register(clock=0, instance="holder-of-1")
        before = _seen(s)
        same = pb.StopJobRequest(worker=1, num_workers=2)
        code, details = _status(lambda: s.stub.StopJob(same, timeout=h.TIMEOUT))
        assert code == SC.FAILED_PRECONDITION and "nothing changed" in details, details
        assert _seen(s) == before
        other = pb.StopJobRequest(worker=1, num_workers=3)
        assert _status(lambda: s.stub.StopJob(other, timeout=h.TIMEOUT)) == (None, "")
        reg = pb.RegisterRequest(worker=0, clock=0, instance="x")
        code, details = _status(lambda: s.stub.Register(reg, timeout=h.TIMEOUT))
        assert code == SC.FAILED_PRECONDITION and "disagree about its size" in details
        assert "--world-size 3" in details


def test_stop_job_needs_the_token(tmp_path: Path) -> None:
    with h.hostile_shard(tmp_path, token="sekrit") as s:
        before = _seen(s)
        with grpc.insecure_channel(s.address) as ch:
            stub = pb_grpc.ParameterServerStub(ch)
            req = pb.StopJobRequest(worker=1, num_workers=3)
            code, _ = _status(lambda: stub.StopJob(req, timeout=h.TIMEOUT))
        assert code == SC.UNAUTHENTICATED
        assert _seen(s) == before
