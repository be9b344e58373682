"""The client a worker uses: push to and pull from every shard concurrently.

Pushes and pulls go to all shards in parallel (one thread each); tensors are cut into
~1 MiB pieces and reassembled straight into the caller's buffers. Every call has a
deadline; UNAVAILABLE is retried with backoff; a retried push carries retry=true and
the shard's (worker, clock) key makes sure it is never applied twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from ps import serde, wire
from ps._gen.psar.v1 import ps_pb2 as pb
from ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from ps.job import Job
from ps.partition import Slot
from ps.server import DEFAULT_MAX_MESSAGE_BYTES, grpc_options
from ps.shard import PullHeader, PushHeader

log = logging.getLogger("psar.client")
T = TypeVar("T")


class PSClientError(RuntimeError):
    """A shard refused a request or could not be reached; says which shard and why."""

    def __init__(self, shard: int, address: str, code: grpc.StatusCode | None, details: str):
        name = code.name if code is not None else "ERROR"
        super().__init__(f"shard {shard} ({address}): {name}: {details}")
        self.shard, self.address, self.code, self.details = shard, address, code, details


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


class PSClient:
    """Push/pull to a set of shards on behalf of one worker."""

    def __init__(self, addresses: Sequence[str], *, worker: int, cfg: ClientConfig | None = None):
        if not addresses:
            raise ValueError("--servers: give at least one HOST:PORT")
        self.addresses = list(addresses)
        self.worker = worker
        self.cfg = cfg or ClientConfig()
        opts = grpc_options(self.cfg.max_message_bytes)
        self._channels = [grpc.insecure_channel(a, options=opts) for a in self.addresses]
        self._stubs = [pb_grpc.ParameterServerStub(c) for c in self._channels]
        self._pool = ThreadPoolExecutor(len(self.addresses), thread_name_prefix="psar-client")
        self.slots_by_shard: list[list[Slot]] = [[] for _ in self.addresses]
        self.last_pull_wait_s = 0.0
        """Seconds the last pull waited for its first reply (sync barrier, SSP bound)."""

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

    def _each(self, fn: Callable[[int], T]) -> list[T]:
        """Run fn(shard) for every shard concurrently; raise the first error."""
        futs = [self._pool.submit(fn, i) for i in range(self.num_shards)]
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
                details = e.details() if hasattr(e, "details") else str(e)
                raise PSClientError(shard, self.addresses[shard], code, details) from None

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
        grads: dict[str, torch.Tensor],
        loss_scale: float = 1.0,
        overflow: bool = False,
    ) -> list[pb.PushReply]:
        """Push one gradient (flat tensors in `dtype`, keyed by slot) to every shard.

        With overflow=True no data is sent: the shards skip the round (sync) or count
        the push as dropped (async/ssp), and the worker's clock still advances.
        """

        def one(i: int) -> pb.PushReply:
            def chunks(retry: bool) -> Iterator[pb.PushChunk]:
                header = PushHeader(
                    worker=self.worker,
                    clock=clock,
                    base_version=base_versions[i],
                    dtype=dtype,
                    loss_scale=loss_scale,
                    overflow=overflow,
                    retry=retry,
                )
                yield pb.PushChunk(header=serde.push_header_to_pb(header))
                if overflow:
                    return
                for s in self.slots_by_shard[i]:
                    for off, data in wire.iter_pieces(grads[s.key], self.cfg.message_bytes):
                        yield pb.PushChunk(data=pb.TensorData(key=s.key, offset=off, data=data))

            return self._retrying(
                i, lambda retry: self._stubs[i].Push(chunks(retry), timeout=self.cfg.timeout_s)
            )

        return self._each(one)

    def pull(
        self, *, clock: int, dtype: torch.dtype, out: dict[str, torch.Tensor]
    ) -> list[PullHeader]:
        """Pull every shard's weights into `out` (flat tensors keyed by slot; any float
        dtype, converted on copy). Waits as the consistency mode requires."""

        waits = [0.0] * self.num_shards

        def one(i: int) -> PullHeader:
            def call(_retry: bool) -> PullHeader:
                t0 = time.perf_counter()
                req = pb.PullRequest(
                    worker=self.worker, clock=clock, dtype=serde.dtype_to_pb(dtype)
                )
                stream = self._stubs[i].Pull(req, timeout=self.cfg.pull_timeout_s)
                header: PullHeader | None = None
                for msg in stream:
                    if header is None:
                        waits[i] = time.perf_counter() - t0
                        header = serde.pull_header_from_pb(msg.header)
                        continue
                    d = msg.data
                    src = wire.decode(d.data, dtype)
                    out[d.key][d.offset : d.offset + src.numel()].copy_(src)
                if header is None:
                    raise PSClientError(i, self.addresses[i], None, "pull returned no header")
                return header

            return self._retrying(i, call)

        headers = self._each(one)
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

    def stats(self) -> list[dict[str, Any]]:
        """Each shard's counters (version, rounds, clocks, staleness histogram, digest)."""

        def one(i: int) -> dict[str, Any]:
            r = self._retrying(
                i, lambda _r: self._stubs[i].Stats(pb.StatsRequest(), timeout=self.cfg.timeout_s)
            )
            return {
                "version": r.version,
                "rounds": r.rounds,
                "updates_applied": r.updates_applied,
                "skipped_rounds": r.skipped_rounds,
                "dropped_nonfinite": r.dropped_nonfinite,
                "live_workers": r.live_workers,
                "loss_scale": r.loss_scale,
                "worker_clocks": list(r.worker_clocks),
                "max_clock_gap": r.max_clock_gap,
                "staleness_histogram": list(r.staleness_histogram),
                "master_bytes": r.master_bytes,
                "state_digest": r.state_digest,
            }

        return self._each(one)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for c in self._channels:
            c.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
