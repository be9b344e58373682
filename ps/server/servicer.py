"""The gRPC servicer: proto in, ShardState call, proto out; PSError -> status code.

No logic lives here (thin servicers, serde at the edge): every decision is made by
ps/server/shard.py and ps/server/policies.py, which tests drive without a socket.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import grpc
import torch

from ps import serde
from ps._gen.psar.v1 import ps_pb2 as pb
from ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from ps.errors import InvalidArgument, PSError, ResourceExhausted
from ps.server.shard import ShardState


def physical_memory_bytes() -> int:
    """RAM of this machine (a generous bound for what one Init may ask to allocate)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    def __init__(self, state: ShardState) -> None:
        self.state = state
        self.metrics = state.metrics
        self.data_port = 0
        """Port of the shard's data plane (ps/server/dataplane.py) advertised by GetJob; 0: none."""

    def _fail(self, context: grpc.ServicerContext, method: str, e: PSError) -> None:
        if method == "Push":
            self.metrics.push_rejected(e.reason)
        context.abort(e.code, e.args[0])

    def Init(self, request_iterator: Iterator[pb.InitChunk], context: grpc.ServicerContext) -> Any:
        t0 = time.monotonic()
        try:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise InvalidArgument("Init stream must start with a header", reason="malformed")
            job = serde.job_from_pb(first.header.job)
            # A conflicting job is refused before a byte is allocated for it; an identical
            # one (a retried init) is read and checked as before.
            known = self.state.check_job(job)
            numel = {s.key: s.numel for s in job.slots}
            need = 4 * sum(numel.values())
            if not known and need > physical_memory_bytes():
                raise ResourceExhausted(
                    f"Init: the job declares {need} bytes of fp32 masters, more than this "
                    f"machine's {physical_memory_bytes()} bytes of memory"
                )
            values = {k: torch.empty(n) for k, n in numel.items()}
            filled = dict.fromkeys(numel, 0)
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "data":
                    raise InvalidArgument("Init: only one header allowed", reason="malformed")
                d = msg.data
                if d.key not in numel:
                    raise InvalidArgument(f"Init: data for slot {d.key!r} not in the job's slots")
                n = len(d.data) // 4
                if len(d.data) % 4 or d.offset != filled[d.key] or d.offset + n > numel[d.key]:
                    raise InvalidArgument(
                        f"Init: slot {d.key!r} piece at {d.offset} of {n} fp32 elements does not "
                        f"continue the {filled[d.key]} received of {numel[d.key]}"
                    )
                values[d.key][d.offset : d.offset + n].copy_(
                    serde.wire.decode(d.data, torch.float32)
                )
                filled[d.key] += n
            short = [k for k, n in numel.items() if filled[k] != n]
            if short:
                raise InvalidArgument(f"Init: slot {short[0]!r} incomplete ({len(short)} short)")
            already = self.state.init(job, values)
            return pb.InitReply(already_initialized=already, master_bytes=self.state.master_bytes)
        except PSError as e:
            self._fail(context, "Init", e)
        finally:
            self.metrics.rpc_observed("Init", time.monotonic() - t0)

    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> Any:
        t0 = time.monotonic()
        try:
            if request.wait:
                self.state.wait_initialized(context.time_remaining())
            job = self.state.job
            if job is None:
                return pb.GetJobReply(
                    initialized=False, lease_s=self.state.leases.lease_s, data_port=self.data_port
                )
            return pb.GetJobReply(
                initialized=True,
                job=serde.job_to_pb(job),
                version=self.state.version,
                incarnation=self.state.incarnation,
                rounds=self.state.rounds,
                lease_s=self.state.leases.lease_s,
                data_port=self.data_port,
            )
        finally:
            self.metrics.rpc_observed("GetJob", time.monotonic() - t0)

    def Push(self, request_iterator: Iterator[pb.PushChunk], context: grpc.ServicerContext) -> Any:
        t0 = time.monotonic()
        ticket = None
        try:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise InvalidArgument("Push stream must start with a header", reason="malformed")
            ticket = self.state.begin_push(
                serde.push_header_from_pb(first.header), incarnation=first.header.incarnation
            )
            for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "data":
                    self.state.add_data(ticket, msg.data.key, msg.data.offset, msg.data.data)
                elif kind == "verdict":
                    self.state.add_verdict(ticket, msg.verdict.overflow)
                else:
                    raise InvalidArgument("Push: only one header allowed", reason="malformed")
            ticket_incarnation = ticket.incarnation
            outcome, version, already = self.state.finish_push(ticket)
            ticket = None
            return serde.push_reply_to_pb(outcome, version, already, ticket_incarnation)
        except PSError as e:
            self._fail(context, "Push", e)
        finally:
            if ticket is not None:
                ticket.release()
            self.metrics.rpc_observed("Push", time.monotonic() - t0)

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        t0 = time.monotonic()
        try:
            dtype = serde.dtype_from_pb(request.dtype)
            header, pieces = self.state.pull(
                request.worker,
                request.clock,
                dtype,
                context.time_remaining(),
                incarnation=request.incarnation,
            )
            incarnation = self.state.incarnation
        except PSError as e:
            self.metrics.rpc_observed("Pull", time.monotonic() - t0)
            self._fail(context, "Pull", e)
            return
        head = serde.pull_header_to_pb(header)
        head.incarnation = incarnation
        yield pb.PullChunk(header=head)
        for key, offset, data in pieces:
            yield pb.PullChunk(data=pb.TensorData(key=key, offset=offset, data=data))
        self.metrics.rpc_observed("Pull", time.monotonic() - t0)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> Any:
        try:
            return pb.LeaveReply(live_workers=self.state.leave(request.worker))
        except PSError as e:
            self._fail(context, "Leave", e)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> Any:
        return pb.StatsReply(**self.state.stats())

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> Any:
        try:
            live, incarnation, lease_s = self.state.heartbeat(request.worker)
            return pb.HeartbeatReply(live=live, incarnation=incarnation, lease_s=lease_s)
        except PSError as e:
            self._fail(context, "Heartbeat", e)

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> Any:
        t0 = time.monotonic()
        try:
            reply = self.state.register(
                request.worker, request.clock, query=request.query, instance=request.instance
            )
            return pb.RegisterReply(**reply)
        except PSError as e:
            self._fail(context, "Register", e)
        finally:
            self.metrics.rpc_observed("Register", time.monotonic() - t0)

    def Rollback(self, request: pb.RollbackRequest, context: grpc.ServicerContext) -> Any:
        t0 = time.monotonic()
        try:
            return pb.RollbackReply(**self.state.rollback(request.max_round))
        except PSError as e:
            self._fail(context, "Rollback", e)
        finally:
            self.metrics.rpc_observed("Rollback", time.monotonic() - t0)
