"""The client a worker uses: push to and pull from every shard concurrently.

Pushes and pulls go to all shards in parallel (one thread each); tensors are cut into
pieces and reassembled straight into the caller's buffers by the transport contract
(ps/client/transport.py), over gRPC or the shard's TCP data plane. Every call has a
deadline; UNAVAILABLE is retried with backoff; a retried push carries retry=true and
the shard's (worker, clock) key makes sure it is never applied twice.

Every push and pull carries the shard incarnation the worker last synchronised with;
a shard that was restored or rolled back since refuses it with ABORTED, which surfaces
here as `NeedsResync` (so does a worker whose lease expired). ps/client/backend.py then
re-registers and carries on (docs/reliability.md). A heartbeat thread keeps the
worker's lease on every shard while it computes or waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import grpc
import torch

from psar.ps import auth, serde, wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from psar.ps.client.client_config import ClientConfig
from psar.ps.client.dataplane_calls import DataPlaneCalls
from psar.ps.client.errors import (
    NOT_INITIALISED,
    RESYNC_PREFIXES,
    NeedsResync,
    PSClientError,
    restarted_empty,
)
from psar.ps.client.grpc_transport import GrpcTransport
from psar.ps.client.membership_calls import (
    INIT_FAILED_PREFIX,
    JOB_STOPPED_PREFIX,
    InitFailed,
    JobStopped,
    MembershipCalls,
)
from psar.ps.client.optimizer_calls import OptimizerCalls, StateBySlot, state_chunks
from psar.ps.client.overlap import PushItem
from psar.ps.client.tcp_transport import DataPlaneClient
from psar.ps.client.transport import PullStream
from psar.ps.grpc_limits import grpc_options
from psar.ps.headers import PullHeader, PushHeader, StepOptions
from psar.ps.job import Job
from psar.ps.partition import Slot
from psar.trainkit.waiting import Waits

__all__ = ["ClientConfig", "InitFailed", "NeedsResync", "PSClient", "PSClientError"]

log = logging.getLogger("psar.client")
T = TypeVar("T")


class PSClient:
    """Push/pull to a set of shards on behalf of one worker. Its parts: `doors` (which
    transport carries each shard's bytes), `membership` (Register, Join, Leave, Rollback,
    Heartbeat) and `optimizer` (RoundNorm, OptimizerState); the calls users make on the
    client are handed to them below, and the per-shard state they share is the client's."""

    def __init__(self, addresses: Sequence[str], *, worker: int, cfg: ClientConfig | None = None):
        if not addresses:
            raise ValueError("--servers: give at least one HOST:PORT")
        self.addresses = list(addresses)
        self.worker = worker
        self.cfg = cfg or ClientConfig()
        opts = grpc_options(self.cfg.max_message_bytes)
        c = self.cfg
        self._channels = [
            auth.make_channel(
                a,
                opts,
                tls_ca=c.tls_ca,
                tls_cert=c.tls_cert,
                tls_key=c.tls_key,
                tls_server_name=c.tls_server_name,
                token=c.auth_token,
            )
            for a in self.addresses
        ]
        self._stubs = [pb_grpc.ParameterServerStub(c) for c in self._channels]
        # The two doors of every shard (ps/client/transport.py): gRPC, and the TCP data
        # plane once GetJob names its port (dataplane_calls.py picks per call).
        self._grpc = [
            GrpcTransport(self._stub_getter(i), a, piece_bytes=self.cfg.message_bytes)
            for i, a in enumerate(self.addresses)
        ]
        # Two calls per shard may be in flight: a push during backward and the pull
        # still landing from the step before (ps/client/overlap.py).
        self._pool = ThreadPoolExecutor(2 * len(self.addresses), thread_name_prefix="psar-client")
        self.slots_by_shard: list[list[Slot]] = [[] for _ in self.addresses]
        self.last_pull_wait_s = 0.0
        self.waits = Waits(log)
        """Long waits of this worker's calls, said while they last (trainkit/waiting.py)."""
        """Seconds the last pull waited for its first reply (sync barrier, SSP bound)."""
        self.incarnations = [0] * len(self.addresses)
        """Per shard, the incarnation this worker synchronised with (0: do not check)."""
        self.lease_s = 0.0
        self._data: list[DataPlaneClient | None] = [None] * len(self.addresses)
        self._data_ports = [0] * len(self.addresses)
        self._data_stale = [False] * len(self.addresses)
        self._beat_stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.instance = ""
        """The instance this client last registered or joined as: its Leave names it (a
        shard refuses a Leave from anyone but the rank's holder)."""
        self.doors = DataPlaneCalls(self)
        self.membership = MembershipCalls(self)
        self.optimizer = OptimizerCalls(self)

    # ---- the parts' calls, on the client as users make them --------------------------

    def register(self, **kw: Any) -> list[dict[str, Any]]:
        return self.membership.register(**kw)

    def join(self, instance: str) -> dict[str, Any]:
        return self.membership.join(instance)

    def leave(self) -> bool:
        """Leave the job on every shard; whether this worker writes the final model."""
        return self.membership.leave()

    def rollback(self, shard: int, max_round: int) -> dict[str, Any]:
        return self.membership.rollback(shard, max_round)

    def stop_job(self, num_workers: int, reason: str = "") -> None:
        self.membership.stop_job(num_workers, reason)

    def report_init_failure(self, error: str) -> None:
        self.membership.report_init_failure(error)

    def heartbeat(self) -> list[bool | None]:
        return self.membership.heartbeat()

    def start_heartbeats(self, lease_s: float | None = None) -> None:
        self.membership.start_heartbeats(lease_s)

    def stats(self) -> list[dict[str, Any]]:
        return self.membership.stats()

    def round_norm(self, clock: int) -> list[tuple[float, bool]]:
        return self.optimizer.round_norm(clock)

    def optimizer_state(self) -> StateBySlot:
        return self.optimizer.optimizer_state()

    def shards_in_shared_memory(self) -> bool:
        return self.doors.shards_in_shared_memory()

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    def _stub_getter(self, i: int) -> Callable[[], Any]:
        return lambda: self._stubs[i]

    def set_slots(self, slots: Sequence[Slot]) -> None:
        """The partition plan (psar.ps.partition.plan_slots) this worker pushes and pulls by."""
        self.slots_by_shard = [[] for _ in self.addresses]
        for s in slots:
            if not 0 <= s.shard < self.num_shards:
                raise ValueError(f"slot {s.key} placed on shard {s.shard} of {self.num_shards}")
            self.slots_by_shard[s.shard].append(s)

    # ---- plumbing -------------------------------------------------------------------

    def _each(
        self,
        fn: Callable[[int], T],
        shards: Sequence[int] | None = None,
        on_resync: Callable[[], None] | None = None,
        cut_by: type[PSClientError] = NeedsResync,
    ) -> list[T]:
        """Run fn(shard) for every shard (or those given) concurrently; raise the first
        error, but only once every call has ended (so none is still in flight).

        When a shard raises `cut_by` (a resync, by default), `on_resync` may cut the other
        calls short (a pull waiting for a sync round that cannot close until the worker
        resyncs; a wait for an init that rank 0 said failed)."""
        idx = range(self.num_shards) if shards is None else shards
        futs = [self._pool.submit(fn, i) for i in idx]
        cut = False
        if on_resync is not None and len(futs) > 1:
            pending = set(futs)
            while pending and not cut:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                if pending and any(isinstance(f.exception(), cut_by) for f in done):
                    on_resync()
                    cut = True
        errors = [f.exception() for f in futs]
        key = [e for e in errors if isinstance(e, cut_by)]
        other = [e for e in errors if e is not None and not isinstance(e, cut_by)]
        if cut:  # the calls we cut short failed because of us
            other = []
        if other or key:
            raise (other or key)[0]
        return [f.result() for f in futs]

    def _retrying(self, shard: int, call: Callable[[bool], T]) -> T:
        """call(is_retry) with backoff on UNAVAILABLE; other errors become PSClientError."""
        deadline = time.monotonic() + self.cfg.reconnect_timeout_s
        delay, attempt = 0.05, 0
        while True:
            try:
                return call(attempt > 0)
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code == grpc.StatusCode.UNAVAILABLE and time.monotonic() + delay < deadline:
                    log.debug("shard %d unavailable, retrying in %.2fs", shard, delay)
                    time.sleep(delay)
                    delay, attempt = min(2.0, delay * 2), attempt + 1
                    continue
                details = (e.details() if hasattr(e, "details") else None) or str(e)
                cls = PSClientError
                if code == grpc.StatusCode.ABORTED and details.startswith(RESYNC_PREFIXES):
                    cls = NeedsResync
                elif code == grpc.StatusCode.FAILED_PRECONDITION and INIT_FAILED_PREFIX in details:
                    cls = InitFailed
                elif code == grpc.StatusCode.FAILED_PRECONDITION and JOB_STOPPED_PREFIX in details:
                    cls = JobStopped
                elif code == grpc.StatusCode.FAILED_PRECONDITION and NOT_INITIALISED in details:
                    if self.incarnations[shard]:  # it had served this worker: restarted
                        details = restarted_empty(self.incarnations[shard], details)
                raise cls(shard, self.addresses[shard], code, details) from None

    # ---- job setup ------------------------------------------------------------------

    def get_jobs(self, *, wait: bool, timeout_s: float | None = None) -> list[Job | None]:
        """Each shard's job (None where not initialised); with wait, block until it is.

        A shard told by rank 0 that its init failed answers with that failure (InitFailed):
        the waits on the other shards are cut short then, so the worker fails at once
        with rank 0's reason instead of waiting out the deadline."""
        timeout = timeout_s if timeout_s is not None else self.cfg.timeout_s
        calls: dict[int, Any] = {}
        cut = threading.Event()

        def ask(i: int) -> Any:
            if cut.is_set():
                raise grpc.FutureCancelledError()
            call = self._stubs[i].GetJob.future(
                pb.GetJobRequest(wait=wait), timeout=timeout, wait_for_ready=True
            )
            calls[i] = call
            if cut.is_set():
                call.cancel()
            return call.result()

        def one(i: int) -> Job | None:
            try:
                reply = self._retrying(i, lambda _r: ask(i))
            except grpc.FutureCancelledError:
                raise PSClientError(
                    i, self.addresses[i], grpc.StatusCode.CANCELLED, "cut short"
                ) from None
            except PSClientError as e:
                if wait and e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return None  # still not initialised when the wait ran out
                raise
            self.lease_s = max(self.lease_s, reply.lease_s)
            if reply.initialized:
                self.doors.use_data_port(i, reply.data_port)
            return serde.job_from_pb(reply.job) if reply.initialized else None

        def cut_short() -> None:
            cut.set()
            for call in list(calls.values()):
                call.cancel()

        return self._each(one, on_resync=cut_short, cut_by=InitFailed)

    def init(
        self,
        jobs: Sequence[Job],
        values: dict[str, torch.Tensor],
        opt_state: StateBySlot | None = None,
    ) -> list[bool]:
        """Initialise every shard (rank 0 does this), the optimizer starting from
        `opt_state` where given. Returns, per shard, whether an identical init had
        already been applied."""

        def one(i: int) -> bool:
            def chunks() -> Iterator[pb.InitChunk]:
                yield pb.InitChunk(header=pb.InitHeader(job=serde.job_to_pb(jobs[i])))
                for s in jobs[i].slots:
                    flat = values[s.key].detach().to(torch.float32).reshape(-1).contiguous()
                    for off, data in wire.iter_pieces(flat, self.cfg.message_bytes):
                        yield pb.InitChunk(data=pb.TensorData(key=s.key, offset=off, data=data))
                mine = {s.key: (opt_state or {}).get(s.key, {}) for s in jobs[i].slots}
                yield from state_chunks(mine, self.cfg.message_bytes)

            reply = self._retrying(
                i,
                lambda _r: self._stubs[i].Init(
                    chunks(), timeout=self.cfg.timeout_s, wait_for_ready=True
                ),
            )
            return reply.already_initialized

        return self._each(one)

    # ---- the data path --------------------------------------------------------------

    def push(
        self,
        *,
        clock: int,
        base_versions: Sequence[int],
        dtype: torch.dtype,
        grads: dict[str, torch.Tensor] | None = None,
        loss_scale: float = 1.0,
        overflow: bool = False,
        retry: bool = False,
        shards: Sequence[int] | None = None,
        items: Callable[[int, bool], Iterable[PushItem]] | None = None,
        absent: Collection[str] = (),
        int_buffers: dict[str, tuple[int, ...]] | None = None,
        options: StepOptions | None = None,
    ) -> list[pb.PushReply]:
        """Push one gradient (flat tensors in `dtype`, keyed by slot) to every shard
        (or to `shards`; replies then come in that order).

        With overflow=True no data is sent: the shards skip the round (sync) or count
        the push as dropped (async/ssp), and the worker's clock still advances. With
        retry=True the push is flagged as a re-send from the start (after a resync).

        `items(shard, is_retry)` instead of `grads`: the shard's stream as it becomes
        ready (push during backward, ps/client/overlap.py), ending with a verdict item.
        `absent`: slots with no gradient this step (zeros in `grads`), named in each
        shard's header (a streamed push names them in its verdict item instead).
        `int_buffers`: the worker's integer buffers, in shard 0's header only
        (ps/client/int_buffers.py). `options`: the step's options (a worker's own loop),
        in each header of a whole push (a streamed one sends them in its verdict item).
        """

        def source(i: int, again: bool) -> Iterable[PushItem]:
            if items is not None:
                return items(i, again)
            if overflow or grads is None:
                return ()
            return [("data", s.key, 0, grads[s.key]) for s in self.slots_by_shard[i]]

        def one(i: int) -> pb.PushReply:
            def head(again: bool) -> pb.PushHeader:
                header = PushHeader(
                    worker=self.worker,
                    clock=clock,
                    base_version=base_versions[i],
                    dtype=dtype,
                    loss_scale=loss_scale,
                    overflow=overflow,
                    retry=retry or again,
                    verdict_follows=items is not None,
                    absent=tuple(s.key for s in self.slots_by_shard[i] if s.key in absent),
                    int_buffers=(int_buffers or {}) if i == 0 else {},
                    options=options or StepOptions(),
                )
                msg = serde.push_header_to_pb(header)
                msg.incarnation = self.incarnations[i]
                return msg

            def call(again: bool) -> pb.PushReply:
                return self.doors.via(
                    i,
                    lambda t: t.push(head(again), source(i, again), timeout_s=self.cfg.timeout_s),
                )

            return self._retrying(i, call)

        return self._each(one, shards)

    def pull(
        self,
        *,
        clock: int,
        dtype: torch.dtype,
        out: dict[str, torch.Tensor],
        shards: Sequence[int] | None = None,
        on_header: Callable[[int, PullHeader], None] | None = None,
        on_piece: Callable[[str, int, int], None] | None = None,
        early: bool = False,
        cutter: list[Callable[[], None]] | None = None,
        clip_total_sq: float | None = None,
    ) -> list[PullHeader]:
        """Pull every shard's (or `shards`') weights into `out` (flat tensors keyed by
        slot; any float dtype, converted on copy). Waits as the consistency mode requires.

        on_header(shard, header) runs when a shard's header arrives (before its data);
        on_piece(key, offset, n) after each piece has landed in `out` (ps/client/overlap.py).
        early: the pull of `clock` asked while its push is still streaming; slots may
        land in `out` before the header, on_piece follows once they hold
        (ps/server/pulls/early.py). cutter: gets a function that cuts this pull short
        (its calls raise), for a caller whose push failed under it. clip_total_sq: the
        round's squared norm over every shard (clipping in rounds: round_norm)."""

        waits = [0.0] * self.num_shards
        streams: dict[int, PullStream] = {}
        cut = threading.Event()

        def one(i: int) -> PullHeader:
            def call(_retry: bool) -> PullHeader:
                t0 = time.perf_counter()
                req = pb.PullRequest(
                    worker=self.worker,
                    clock=clock,
                    dtype=serde.dtype_to_pb(dtype),
                    incarnation=self.incarnations[i],
                    early=early,
                    clip_total_sq=clip_total_sq,
                )
                if cut.is_set():
                    raise PSClientError(i, self.addresses[i], None, "cut short for a resync")

                def opened(stream: PullStream) -> None:
                    streams[i] = stream
                    if cut.is_set():  # cut while it was opening: nobody else will cancel it
                        stream.cancel()

                def got_header(msg: pb.PullHeader) -> None:
                    waits[i] = time.perf_counter() - t0
                    if on_header is not None:
                        on_header(i, serde.pull_header_from_pb(msg))

                msg = self.doors.via(
                    i,
                    lambda t: t.pull(
                        req,
                        out,
                        timeout_s=self.cfg.pull_timeout_s,
                        on_header=got_header,
                        on_piece=on_piece,
                        on_open=opened,
                    ),
                )
                return serde.pull_header_from_pb(msg)

            return self._retrying(i, call)

        def cut_short() -> None:
            cut.set()
            for stream in list(streams.values()):
                stream.cancel()

        if cutter is not None:
            cutter.append(cut_short)

        def describe(seconds: float) -> str:
            ids = range(self.num_shards) if shards is None else shards
            pending = [f"{i} ({self.addresses[i]})" for i in ids if not waits[i]]
            return (
                f"worker {self.worker}: the pull of clock {clock} has waited {seconds:.0f} s "
                f"for shard(s) {', '.join(pending) or '-'}: a round closes once every live "
                f"worker has pushed (a bounded-staleness pull waits for the slowest), so a "
                f"slow or gone worker holds it; failing after --pull-timeout-s "
                f"{self.cfg.pull_timeout_s:g}"
            )

        with self.waits.waiting(describe):
            headers = self._each(one, shards, on_resync=cut_short)
        self.last_pull_wait_s = max(waits)
        return headers

    def close(self) -> None:
        self._beat_stop.set()
        self.waits.close()
        self._pool.shutdown(wait=False)
        for t in [*self._grpc, *self._data]:
            if t is not None:
                t.close()
        for c in self._channels:
            c.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
