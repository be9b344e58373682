"""The gRPC servicer: proto in, a shard component's call, proto out; PSError -> status code.

No logic lives here (thin servicers, serde at the edge): every decision is made by
ps/server/shard.py and the mode modules (ps/server/modes/), which tests drive without a socket.

The server is grpc.aio (ps/server/doors/aio_host.py): most handlers are plain functions run in
the --rpc-threads pool as they always were; the ones that wait (Pull, GetJob(wait)) are
coroutines that park on the event loop (ps/server/pulls/parking.py) and hold no thread.

A push and a pull arrive through two doors, this servicer and the TCP data plane
(ps/server/doors/dataplane.py). Both frame them with ps/server/doors/calls.py's PushCall
and start_pull: one decode/validate path for a push's header, pieces and verdict into the
shard's intake, one for a pull's request and header from its pulls, so the two doors
refuse the same things with the same words.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor
from typing import Any

import grpc
import torch

from psar.ps import serde
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from psar.ps.errors import (
    FailedPrecondition,
    InvalidArgument,
    PSError,
    ResourceExhausted,
    bound_details,
    quote,
)
from psar.ps.server.doors.aio_host import Undecodable
from psar.ps.server.doors.calls import PushCall, round_norm_args, start_pull_parked
from psar.ps.server.pulls.parking import wait_until
from psar.ps.server.shard import ShardState
from psar.ps.server.update.opt_state import StateCollector

log = logging.getLogger(__name__)


class StreamBroken(InvalidArgument):
    """A request stream that did not end cleanly: a message gRPC could not decode, or a
    call cancelled meanwhile. Nothing of it is applied. (grpc.aio raises the decode error
    from the request iterator, see `decoded`; the sync server instead ends the iterator
    as if the stream were complete, having answered INTERNAL "Exception deserializing
    request!", which `require_clean_end` catches.)"""

    reason = "malformed"


class StreamCancelled(StreamBroken):
    """A request stream the client cancelled (it will never read an answer)."""

    reason = "cancelled"


def _broken(method: str) -> StreamBroken:
    return StreamBroken(
        f"{method}: the request stream did not end cleanly (a message could not be "
        "decoded, or the call was cancelled); nothing was applied -- send it again"
    )


def decoded(request_iterator: Iterator[Any], method: str) -> Iterator[Any]:
    """The messages of a request stream; a message gRPC could not decode (an Undecodable
    from ps/server/doors/aio_host.py, or an error raised by the iterator) ends it with
    StreamBroken, INVALID_ARGUMENT."""
    it = iter(request_iterator)
    while True:
        try:
            msg = next(it)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - DecodeError, or the call ended under us
            raise _broken(method) from e
        if isinstance(msg, Undecodable):  # aio_host.guard's stand-in for it
            raise _broken(method) from msg.error
        yield msg


def require_clean_end(context: Any, method: str) -> None:
    """Refuse a stream whose iterator ended without the client's clean half-close, before
    anything of it takes effect (issue #33: a push cancelled after its last piece was
    applied).

    - The sync server marks such a call finished (a status already sent, or cancelled),
      so it is no longer active; a stream that really ended is active until answered.
    - grpc.aio (our shards, ps/server/doors/aio_host.py) ends a sync handler's request
      iterator the same way for the client's half-close and for its cancel (its
      _receive_message merges a failed read into EOF) and tells the handler nothing
      else. But a cancelled call refuses every new batch: sending the initial metadata
      now (which the reply would send anyway) raises exactly when the client cancelled.
      A cancel that arrives after this point came after a clean end, like one after the
      reply was sent: the push stands, as it would on the data plane after `end`.
    """
    is_active = getattr(context, "is_active", None)
    if is_active is not None:
        if not is_active():
            raise _broken(method)
        return
    try:
        context.send_initial_metadata(())
    except Exception as e:  # noqa: BLE001 - grpc.aio's ExecuteBatchError: the call is over
        raise StreamCancelled(f"{method}: cancelled by the client before its stream ended; "
                              "nothing was applied") from e  # fmt: skip


def _cut_off(context: Any, cut: threading.Event) -> None:
    """Cut off a gRPC push superseded by a newer push of its worker (from that push's
    thread): answer it ABORTED now. grpc.aio then wakes its handler, blocked in the
    request iterator, with an AbortError (StreamBroken in Push), and ends the call
    quietly whatever the handler returns after that."""
    cut.set()
    try:
        context.abort(
            grpc.StatusCode.ABORTED,
            "Push: superseded by a newer push of this worker (a retry, on gRPC or the data "
            "plane) while this one was still streaming; this one applies nothing",
        )
    except Exception:  # noqa: BLE001, S110 - grpc.aio raises its AbortError here too
        pass


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
        """Port of the shard's data plane (ps/server/doors/dataplane.py) advertised by GetJob; 0: none."""
        self._init_failure: pb.InitFailedRequest | None = None
        """Rank 0's report that its init failed (ReportInitFailure); cleared by an Init."""
        self._lock = threading.Lock()
        self.executor: Executor | None = None
        """The server's handler pool (ps/server/serve.py): the short locked steps of the
        async handlers (Pull, GetJob) run there, never on the event loop."""

    def _fail(self, context: grpc.ServicerContext, method: str, e: PSError) -> None:
        if method == "Push":
            self.metrics.push_rejected(e.reason)
        if isinstance(e, StreamCancelled):
            # Nobody reads an answer, and the call takes no more batches (abort would
            # fail in grpc): end the handler; grpc.aio has cancelled the call's task.
            raise e
        # Details are bounded: they travel in a trailer, and past gRPC's metadata limit
        # the client would get RESOURCE_EXHAUSTED instead of this status. (Under the sync
        # server a StreamBroken call was answered by grpc already: its status stands.)
        context.abort(e.code, bound_details(e.args[0]))

    def Init(self, request_iterator: Iterator[pb.InitChunk], context: grpc.ServicerContext) -> Any:
        t0 = time.monotonic()
        try:
            request_iterator = decoded(request_iterator, "Init")
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise InvalidArgument("Init stream must start with a header", reason="malformed")
            with self._lock:
                self._init_failure = None  # rank 0 tries again: its old failure is history
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
            opt_state = StateCollector(numel)
            for msg in request_iterator:
                if msg.WhichOneof("kind") == "state":
                    st = msg.state
                    opt_state.add(st.slot, st.name, st.numel, st.offset, st.scalar, st.data)
                    continue
                if msg.WhichOneof("kind") != "data":
                    raise InvalidArgument("Init: only one header allowed", reason="malformed")
                d = msg.data
                if d.key not in numel:
                    raise InvalidArgument(
                        f"Init: data for slot {quote(d.key)} not in the job's slots"
                    )
                n = len(d.data) // 4
                if len(d.data) % 4 or d.offset != filled[d.key] or d.offset + n > numel[d.key]:
                    raise InvalidArgument(
                        f"Init: slot {quote(d.key)} piece at {d.offset} of {n} fp32 elements does not "
                        f"continue the {filled[d.key]} received of {numel[d.key]}"
                    )
                values[d.key][d.offset : d.offset + n].copy_(
                    serde.wire.decode(d.data, torch.float32)
                )
                filled[d.key] += n
            require_clean_end(context, "Init")
            short = [k for k, n in numel.items() if filled[k] != n]
            if short:
                raise InvalidArgument(
                    f"Init: slot {quote(short[0])} incomplete ({len(short)} short)"
                )
            already = self.state.init(job, values, opt_state.done(), owned=True)
            return pb.InitReply(already_initialized=already, master_bytes=self.state.master_bytes)
        except PSError as e:
            self._fail(context, "Init", e)
        finally:
            self.metrics.rpc_observed("Init", time.monotonic() - t0)

    async def GetJob(self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext) -> Any:
        t0 = time.monotonic()
        try:
            if request.wait:
                await self._wait_initialized(context)
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
        except PSError as e:
            await context.abort(e.code, bound_details(e.args[0]))
        finally:
            self.metrics.rpc_observed("GetJob", time.monotonic() - t0)

    def ReportInitFailure(
        self, request: pb.InitFailedRequest, context: grpc.ServicerContext
    ) -> Any:
        # An initialised shard keeps serving its job (rank 0 failed on another shard).
        if self.state.job is None:
            with self._lock:
                self._init_failure = request
        return pb.InitFailedReply()

    def StopJob(self, request: pb.StopJobRequest, context: grpc.ServicerContext) -> Any:
        try:
            self.state.members.stop(request.worker, request.num_workers, request.reason)
            return pb.StopJobReply()
        except PSError as e:
            self._fail(context, "StopJob", e)

    async def _wait_initialized(self, context: grpc.aio.ServicerContext) -> None:
        """GetJob(wait): wait (parked, no thread held) until initialised or the deadline,
        but refuse at once (FAILED_PRECONDITION, rank 0's words) once rank 0 reported that
        its init failed. A caller that gives up cancels the wait."""
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        state = self.state

        def ready() -> bool:  # the parking watcher re-checks it every few 100 ms
            return state.job is not None or self._init_failure is not None

        while True:
            with self._lock:
                failure = self._init_failure
            if failure is not None and state.job is None:
                raise FailedPrecondition(serde.init_failure_details(failure), reason="init_failed")
            left = serde.MAX_WAIT_S if deadline is None else deadline - time.monotonic()
            if state.job is not None or left <= 0:
                return
            await wait_until(state, ready, min(left, serde.MAX_WAIT_S), self.executor)

    def Push(self, request_iterator: Iterator[pb.PushChunk], context: grpc.ServicerContext) -> Any:
        t0 = time.monotonic()
        call: PushCall | None = None
        cut = threading.Event()  # this push's token in state.intake.in_flight; set once cut off
        worker: int | None = None
        try:
            request_iterator = decoded(request_iterator, "Push")
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise InvalidArgument("Push stream must start with a header", reason="malformed")
            # A push of this worker still streaming (either door) is cut off rather than
            # waited for (ps/server/intake/takeover.py); this one may be cut off in turn.
            worker = first.header.worker
            self.state.intake.in_flight.supersede(worker, cut, "gRPC")
            call = PushCall(self.state, first.header)
            self.state.intake.in_flight.began(worker, cut, "gRPC", lambda: _cut_off(context, cut))
            for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "data":
                    call.piece_bytes(msg.data.key, msg.data.offset, msg.data.data)
                elif kind == "verdict":
                    call.verdict(msg.verdict)
                else:
                    call.misplaced(kind)
            require_clean_end(context, "Push")
            return call.finish()
        except PSError as e:
            if cut.is_set():  # answered ABORTED by _cut_off; grpc.aio ends the call quietly
                return None
            self._fail(context, "Push", e)
        except Exception as e:  # noqa: BLE001 - a bug the checks missed: INTERNAL, never UNKNOWN
            if cut.is_set():
                return None
            log.exception("Push: unexpected error")
            self._fail(context, "Push", PSError(
                f"Push: internal error ({type(e).__name__}: {e}); retry the push with retry=true "
                "(acknowledged if it counted), and report this with the shard's log", reason="internal"))  # fmt: skip
        finally:
            if call is not None:
                call.release()
            if worker is not None:
                self.state.intake.in_flight.ended(worker, cut)
            self.metrics.rpc_observed("Push", time.monotonic() - t0)

    async def Pull(
        self, request: pb.PullRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        # async: a pull waiting for its round parks on the event loop (ps/server/pulls/parking.py)
        # instead of holding one of the --rpc-threads handler threads.
        t0 = time.monotonic()
        try:
            head, pieces = await start_pull_parked(
                self.state, request, context.time_remaining(), self.executor
            )
        except PSError as e:
            self.metrics.rpc_observed("Pull", time.monotonic() - t0)
            await context.abort(e.code, bound_details(e.args[0]))
            return
        yield pb.PullChunk(header=head)
        for key, offset, data in pieces:
            yield pb.PullChunk(data=pb.TensorData(key=key, offset=offset, data=data))
        self.metrics.rpc_observed("Pull", time.monotonic() - t0)

    async def RoundNorm(
        self, request: pb.RoundNormRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        # async: waits for its round as a pull does, parked (no handler thread held).
        t0 = time.monotonic()
        try:
            clock, wait = round_norm_args(request, context.time_remaining())
            part, skipped = await self.state.pulls.round_norm_parked(
                request.worker,
                clock,
                wait,
                incarnation=request.incarnation,
                executor=self.executor,
            )
            return pb.RoundNormReply(
                sq_norm=part, skipped=skipped, incarnation=self.state.incarnation
            )
        except PSError as e:
            await context.abort(e.code, bound_details(e.args[0]))
        finally:
            self.metrics.rpc_observed("RoundNorm", time.monotonic() - t0)

    def OptimizerState(
        self, request: pb.OptimizerStateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.StateChunk]:
        try:
            values = self.state.optimizer_state()
        except PSError as e:
            self._fail(context, "OptimizerState", e)
            return
        for v in values:
            flat = v.value.reshape(-1).contiguous()
            for off, data in serde.wire.iter_pieces(flat, self.state.message_bytes):
                yield pb.StateChunk(slot=v.slot, name=v.name, numel=flat.numel(), offset=off,
                                    data=data, scalar=v.value.dim() == 0)  # fmt: skip

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> Any:
        try:
            members = self.state.members
            live = members.leave(request.worker, request.instance)
            return pb.LeaveReply(
                live_workers=live,
                write_model=members.writes_model(request.worker, request.instance),
            )
        except PSError as e:
            self._fail(context, "Leave", e)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> Any:
        return pb.StatsReply(**self.state.stats())

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> Any:
        try:
            live, incarnation, lease_s = self.state.members.heartbeat(request.worker)
            return pb.HeartbeatReply(live=live, incarnation=incarnation, lease_s=lease_s)
        except PSError as e:
            self._fail(context, "Heartbeat", e)

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> Any:
        t0 = time.monotonic()
        try:
            clock = serde.check_count("register clock", request.clock)
            reply = self.state.members.register(
                request.worker,
                clock,
                query=request.query,
                instance=request.instance,
                joined=request.joined,
            )
            return pb.RegisterReply(**reply)
        except PSError as e:
            self._fail(context, "Register", e)
        finally:
            self.metrics.rpc_observed("Register", time.monotonic() - t0)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> Any:
        t0 = time.monotonic()
        try:
            return pb.JoinReply(**self.state.members.join(request.instance))
        except PSError as e:
            self._fail(context, "Join", e)
        finally:
            self.metrics.rpc_observed("Join", time.monotonic() - t0)

    def Rollback(self, request: pb.RollbackRequest, context: grpc.ServicerContext) -> Any:
        t0 = time.monotonic()
        try:
            return pb.RollbackReply(**self.state.durability.rollback(request.max_round))
        except PSError as e:
            self._fail(context, "Rollback", e)
        finally:
            self.metrics.rpc_observed("Rollback", time.monotonic() - t0)
