"""The client a worker uses: push to and pull from every shard concurrently.

Pushes and pulls go to all shards in parallel (one thread each); tensors are cut into
~1 MiB pieces and reassembled straight into the caller's buffers. Every call has a
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from ps import auth, serde, wire
from ps._gen.psar.v1 import ps_pb2 as pb
from ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from ps.client.dataplane_calls import DataPlaneCalls, check_data_plane
from ps.client.errors import RESYNC_PREFIXES, NeedsResync, PSClientError
from ps.client.membership_calls import MembershipCalls
from ps.client.overlap import PushItem
from ps.client.tcp_transport import DEFAULT_MAX_FRAME_BYTES, DataPlaneClient
from ps.grpc_limits import DEFAULT_MAX_MESSAGE_BYTES, grpc_options
from ps.headers import PullHeader, PushHeader
from ps.job import Job
from ps.partition import Slot

log = logging.getLogger("psar.client")
T = TypeVar("T")


@dataclass(kw_only=True)
class ClientConfig:
    """How a worker talks to the shards."""

    timeout_s: float = 60.0
    """Deadline for init, push and other calls that never wait on other workers."""
    pull_timeout_s: float = 300.0
    """Deadline for a pull, which may wait for a sync round or for the slowest SSP worker."""
    retry_timeout_s: float = 60.0
    """Keep retrying UNAVAILABLE (shard starting or restarting) for this long."""
    message_bytes: int = wire.DEFAULT_MESSAGE_BYTES
    """Bytes of tensor data per streamed message."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message sent or accepted."""
    tls_ca: str = ""
    """PEM CA that signed the shards' certificates (TLS on when any tls_* is set)."""
    tls_cert: str = ""
    """Mutual TLS: this worker's PEM certificate."""
    tls_key: str = ""
    """Mutual TLS: this worker's PEM private key."""
    tls_server_name: str = ""
    """Expect this name in the shards' certificates instead of the address's host."""
    auth_token: str = ""
    """Bearer token sent with every call (empty: none)."""
    data_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Data plane: tensor bytes per pushed frame (at most the shard's max message bytes)."""
    data_plane: str = "auto"
    """Where tensor bytes travel: tcp (the shards' plain-TCP data plane, ps/server/dataplane.py),
    grpc, or auto (tcp where a shard offers it and TLS is off, else grpc)."""

    def __post_init__(self) -> None:
        check_data_plane(self.data_plane, self.tls)

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert or self.tls_key)


class PSClient(DataPlaneCalls, MembershipCalls):
    """Push/pull to a set of shards on behalf of one worker."""

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
        # Two calls per shard may be in flight: a push during backward and the pull
        # still landing from the step before (ps/client/overlap.py).
        self._pool = ThreadPoolExecutor(2 * len(self.addresses), thread_name_prefix="psar-client")
        self.slots_by_shard: list[list[Slot]] = [[] for _ in self.addresses]
        self.last_pull_wait_s = 0.0
        """Seconds the last pull waited for its first reply (sync barrier, SSP bound)."""
        self.incarnations = [0] * len(self.addresses)
        """Per shard, the incarnation this worker synchronised with (0: do not check)."""
        self.lease_s = 0.0
        self._data: list[DataPlaneClient | None] = [None] * len(self.addresses)
        self._data_ports = [0] * len(self.addresses)
        self._data_stale = [False] * len(self.addresses)
        self._beat_stop = threading.Event()
        self._beat: threading.Thread | None = None

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    def set_slots(self, slots: Sequence[Slot]) -> None:
        """The partition plan (ps.partition.plan_slots) this worker pushes and pulls by."""
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
    ) -> list[T]:
        """Run fn(shard) for every shard (or those given) concurrently; raise the first
        error, but only once every call has ended (so none is still in flight).

        When a shard asks for a resync, `on_resync` may cut the other calls short (a
        pull waiting for a sync round that cannot close until the worker resyncs)."""
        idx = range(self.num_shards) if shards is None else shards
        futs = [self._pool.submit(fn, i) for i in idx]
        cut = False
        if on_resync is not None and len(futs) > 1:
            pending = set(futs)
            while pending and not cut:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                if pending and any(isinstance(f.exception(), NeedsResync) for f in done):
                    on_resync()
                    cut = True
        errors = [f.exception() for f in futs]
        resync = [e for e in errors if isinstance(e, NeedsResync)]
        other = [e for e in errors if e is not None and not isinstance(e, NeedsResync)]
        if cut:  # the calls we cut short failed because of us
            other = []
        if other or resync:
            raise (other or resync)[0]
        return [f.result() for f in futs]

    def _retrying(self, shard: int, call: Callable[[bool], T]) -> T:
        """call(is_retry) with backoff on UNAVAILABLE; other errors become PSClientError."""
        deadline = time.monotonic() + self.cfg.retry_timeout_s
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
                raise cls(shard, self.addresses[shard], code, details) from None

    # ---- job setup ------------------------------------------------------------------

    def get_jobs(self, *, wait: bool, timeout_s: float | None = None) -> list[Job | None]:
        """Each shard's job (None where not initialised); with wait, block until it is."""
        timeout = timeout_s if timeout_s is not None else self.cfg.timeout_s

        def one(i: int) -> Job | None:
            reply = self._retrying(
                i,
                lambda _r: self._stubs[i].GetJob(
                    pb.GetJobRequest(wait=wait), timeout=timeout, wait_for_ready=True
                ),
            )
            self.lease_s = max(self.lease_s, reply.lease_s)
            if reply.initialized:
                self._use_data_port(i, reply.data_port)
            return serde.job_from_pb(reply.job) if reply.initialized else None

        return self._each(one)

    def init(self, jobs: Sequence[Job], values: dict[str, torch.Tensor]) -> list[bool]:
        """Initialise every shard (rank 0 does this). Returns, per shard, whether an
        identical init had already been applied."""

        def one(i: int) -> bool:
            def chunks() -> Iterator[pb.InitChunk]:
                yield pb.InitChunk(header=pb.InitHeader(job=serde.job_to_pb(jobs[i])))
                for s in jobs[i].slots:
                    flat = values[s.key].detach().to(torch.float32).reshape(-1).contiguous()
                    for off, data in wire.iter_pieces(flat, self.cfg.message_bytes):
                        yield pb.InitChunk(data=pb.TensorData(key=s.key, offset=off, data=data))

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
    ) -> list[pb.PushReply]:
        """Push one gradient (flat tensors in `dtype`, keyed by slot) to every shard
        (or to `shards`; replies then come in that order).

        With overflow=True no data is sent: the shards skip the round (sync) or count
        the push as dropped (async/ssp), and the worker's clock still advances. With
        retry=True the push is flagged as a re-send from the start (after a resync).

        `items(shard, is_retry)` instead of `grads`: the shard's stream as it becomes
        ready (push during backward, ps/client/overlap.py), ending with a verdict item.
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
                )
                msg = serde.push_header_to_pb(header)
                msg.incarnation = self.incarnations[i]
                return msg

            def chunks(again: bool) -> Iterator[pb.PushChunk]:
                yield pb.PushChunk(header=head(again))
                for item in source(i, again):
                    if item[0] == "verdict":
                        yield pb.PushChunk(verdict=pb.PushVerdict(overflow=item[1]))
                        continue
                    _, key, base, flat = item
                    for off, data in wire.iter_pieces(flat, self.cfg.message_bytes):
                        yield pb.PushChunk(
                            data=pb.TensorData(key=key, offset=base + off, data=data)
                        )

            def call(again: bool) -> pb.PushReply:
                if self._data_plane(i) is not None:
                    return self._via_data_plane(
                        i,
                        lambda dp: dp.push(
                            head(again), source(i, again), timeout_s=self.cfg.timeout_s
                        ),
                    )
                return self._stubs[i].Push(chunks(again), timeout=self.cfg.timeout_s)

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
    ) -> list[PullHeader]:
        """Pull every shard's (or `shards`') weights into `out` (flat tensors keyed by
        slot; any float dtype, converted on copy). Waits as the consistency mode requires.

        on_header(shard, header) runs when a shard's header arrives (before its data);
        on_piece(key, offset, n) after each piece has landed in `out` (ps/client/overlap.py)."""

        waits = [0.0] * self.num_shards
        streams: dict[int, Any] = {}
        cut = threading.Event()

        def one(i: int) -> PullHeader:
            def call(_retry: bool) -> PullHeader:
                t0 = time.perf_counter()
                req = pb.PullRequest(
                    worker=self.worker,
                    clock=clock,
                    dtype=serde.dtype_to_pb(dtype),
                    incarnation=self.incarnations[i],
                )
                if cut.is_set():
                    raise PSClientError(i, self.addresses[i], None, "cut short for a resync")
                if self._data_plane(i) is not None:

                    def got_header(msg: pb.PullHeader) -> None:
                        waits[i] = time.perf_counter() - t0
                        if on_header is not None:
                            on_header(i, serde.pull_header_from_pb(msg))

                    msg = self._via_data_plane(
                        i,
                        lambda dp: dp.pull(
                            req,
                            out,
                            timeout_s=self.cfg.pull_timeout_s,
                            on_header=got_header,
                            on_piece=on_piece,
                        ),
                    )
                    return serde.pull_header_from_pb(msg)
                stream = self._stubs[i].Pull(req, timeout=self.cfg.pull_timeout_s)
                streams[i] = stream
                if cut.is_set():
                    stream.cancel()
                header: PullHeader | None = None
                for msg in stream:
                    if header is None:
                        waits[i] = time.perf_counter() - t0
                        header = serde.pull_header_from_pb(msg.header)
                        if on_header is not None:
                            on_header(i, header)
                        continue
                    d = msg.data
                    src = wire.decode(d.data, dtype)
                    out[d.key][d.offset : d.offset + src.numel()].copy_(src)
                    if on_piece is not None:
                        on_piece(d.key, d.offset, src.numel())
                if header is None:
                    raise PSClientError(i, self.addresses[i], None, "pull returned no header")
                return header

            return self._retrying(i, call)

        def cut_short() -> None:
            cut.set()
            for stream in list(streams.values()):
                stream.cancel()
            for dp in self._data:
                if dp is not None:
                    dp.cancel_all()

        headers = self._each(one, shards, on_resync=cut_short)
        self.last_pull_wait_s = max(waits)
        return headers

    def leave(self) -> None:
        """Tell every shard this worker is done, so nobody waits for it."""

        def one(i: int) -> Any:
            return self._retrying(
                i,
                lambda _r: self._stubs[i].Leave(
                    pb.LeaveRequest(worker=self.worker), timeout=self.cfg.timeout_s
                ),
            )

        self._each(one)

    def close(self) -> None:
        self._beat_stop.set()
        self._pool.shutdown(wait=False)
        for dp in self._data:
            if dp is not None:
                dp.close()
        for c in self._channels:
            c.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
