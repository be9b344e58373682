"""Overlapping a PS worker's communication with its compute (docs/architecture.md).

Push during backward (`PushBuckets`): like DDP's reducer, a hook on every parameter
notes when its gradient is ready; parameters are grouped, in the order autograd
produces their gradients (reverse registration order), into buckets of about
--bucket-mib. When a bucket is complete its gradients are cast into the persistent send
buffers and queued on the push stream of every shard holding a piece of it, so pushes
travel while backward is still running. The worker knows whether its whole gradient is
finite only once the last bucket is in: that verdict travels last on every stream
(PushVerdict; overflow=true makes every shard drop the push and, in sync, skip the round).

Pull in forward order: ps/client/pull_gate.py.

Neither changes what is computed: the same bytes reach the same slots, and the shards
reduce each slot in worker-rank order, so overlapped and non-overlapped runs give
bit-identical weights (tests/test_overlap.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import thread as _futures_thread
from typing import Any

import torch

from psar.ps.partition import Slot
from psar.trainkit.device_io import DeviceIO, Event
from psar.trainkit.optim import StepOptions

PushItem = tuple[Any, ...]
"""("data", slot key, element offset, 1-D tensor) or ("verdict", overflow, absent keys)."""


def bucket_params(
    params: dict[str, torch.Tensor], bucket_bytes: int, itemsize: int
) -> list[list[str]]:
    """Group parameter names into buckets of about `bucket_bytes` (on the wire), in the
    order backward produces their gradients: reverse registration order. A parameter
    is never split (its gradient is ready all at once); a big one is a bucket alone."""
    buckets: list[list[str]] = []
    size = 0
    for name in reversed(list(params)):
        nbytes = params[name].numel() * itemsize
        if buckets and size + nbytes <= bucket_bytes:
            buckets[-1].append(name)
            size += nbytes
        else:
            buckets.append([name])
            size = nbytes
    return buckets


class PushBuckets:
    """Fills the send buffers bucket by bucket during backward and feeds the push streams."""

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        slots: list[Slot],
        send: dict[str, torch.Tensor],
        *,
        num_shards: int,
        bucket_bytes: int,
        on_first_bucket: Callable[[], None],
        io: DeviceIO | None = None,
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.params = params
        self.buffers = buffers or {}
        """Model buffers on the shards: their values go last, after backward (forward
        has updated them by then), in a bucket no gradient hook completes."""
        self.io = io if io is not None else DeviceIO(torch.device("cpu"))
        self.send = send
        """Per slot, what goes on the wire this step: a view of the gradient itself when
        it already has the wire dtype on the CPU (no copy), else the persistent buffer."""
        self._own = dict(send)
        self.num_shards = num_shards
        itemsize = next(iter(send.values())).element_size() if send else 4
        names = bucket_params(params, bucket_bytes, itemsize)
        if self.buffers:
            names.append(list(self.buffers))
        by_param: dict[str, list[Slot]] = {}
        for s in slots:
            by_param.setdefault(s.param, []).append(s)
        self.buckets = [[s for n in b for s in by_param.get(n, [])] for b in names]
        self.bucket_of = {n: i for i, b in enumerate(names) for n in b}
        self.sizes = [len(b) for b in names]
        self.on_first_bucket = on_first_bucket
        self.accumulating = False
        """True inside no_sync(): gradients only accumulate, nothing is pushed."""
        self.decide: Callable[[bool], bool] = lambda finite: finite
        """Last say on finiteness once every bucket is in (sparse row pushes go here)."""
        self.hold_verdict = False
        """The verdict waits for finish() (a worker's own loop: its step options, known
        only when its optimizer steps, travel with it); the data still streams."""
        self.options: StepOptions | None = None
        """This step's options, sent with the verdict (set by finish())."""

        self.active = False
        self._handles: list[Any] = []
        # CUDA: one thread starts the buckets' copies, in the order their hooks fired.
        self._stager = ThreadPoolExecutor(1, "psar-stage") if self.io.cuda else None
        self._staged: list[Future] = []
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.options = None
        self._pending = list(self.sizes)
        self._filled = [False] * len(self.buckets)
        self._finite = True
        self.absent: set[str] = set()
        """Slots whose parameter got no gradient this step (unused in the loss): sent
        as zeros and named in the verdict, so the shards step them as DDP would."""
        self.io.begin_finite()
        self.verdict: bool | None = None
        """The overflow verdict once every bucket is in (None: not yet)."""
        self._queues: list[queue.SimpleQueue[PushItem | None]] = [
            queue.SimpleQueue() for _ in range(self.num_shards)
        ]
        self._all_in = threading.Event()
        self._aborted = False
        self._started = False

    def attach(self) -> None:
        """Register the gradient hooks (push during backward)."""
        for name, p in self.params.items():
            self._handles.append(p.register_post_accumulate_grad_hook(self._hook(name)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._stager is not None:
            self._stager.shutdown(wait=False)

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        b = self.bucket_of[name]

        def hook(_param: torch.Tensor) -> None:
            if self.accumulating or not self.active:
                return
            with self._lock:
                self._pending[b] -= 1
                ready = self._pending[b] == 0 and not self._filled[b]
            if ready:
                self.fill(b)

        return hook

    def begin_step(self) -> None:
        """A new step: nothing filled, nothing queued (called before its backward)."""
        self._reset()
        self.active = True

    def fill(self, b: int) -> None:
        """Stage bucket b's gradients for the wire and queue them (training or autograd
        thread). On CUDA the hook only marks the compute stream and hands the bucket to
        the stager thread, which starts its copy on a side stream (trainkit/device_io.py):
        backward's thread does no more than that; senders wait for the copy."""
        with self._lock:
            if self._filled[b]:
                return
            self._filled[b] = True
            first = not self._started
            self._started = True
        if first:
            self.on_first_bucket()
        if self._stager is None:
            self._stage(b, None)
        else:
            self._staged.append(self._stager.submit(self._stage, b, self.io.mark()))

    def _stage(self, b: int, after: Event) -> None:
        """Bucket b's gradients into the send buffers (cast on the device), queued."""
        pieces = []
        for s in self.buckets[b]:
            buf = self._own[s.key]
            if s.param in self.buffers:  # a value, copied: its memory takes the next pull
                src = self.buffers[s.param].detach().reshape(-1)[s.start : s.start + s.numel]
                pieces.append((src, buf))
                self.send[s.key] = buf
                continue
            g = self.params[s.param].grad
            if g is None:
                # No gradient this step (the parameter took no part in the loss): zeros
                # on the wire, and the verdict names the slot absent (DDP's semantics).
                buf.zero_()
                with self._lock:
                    self.absent.add(s.key)
            elif g.dtype == buf.dtype and g.device == buf.device and g.is_contiguous():
                # Sent from the gradient's own memory: it stays alive (we hold the view)
                # until the next step replaces it, which is after this push has ended.
                buf = g.detach().view(-1)[s.start : s.start + s.numel]
                pieces.append((buf, buf))
            else:
                pieces.append((g.detach().reshape(-1)[s.start : s.start + s.numel], buf))
            self.send[s.key] = buf
        event = self.io.stage_out(pieces, after=after) if pieces else None
        # On CUDA the verdict waits for the side stream's copies: finish() (in step())
        # takes it, so backward's hooks never block on the device.
        last = all(self._filled) and not self.io.cuda and not self.hold_verdict
        if last:
            self._decide()
        if event is not None:  # the copies are asynchronous: senders wait for them
            for q in {s.shard for s in self.buckets[b]}:
                self._queues[q].put(("_sync", event))
        for s in self.buckets[b]:
            self._queues[s.shard].put(("data", s.key, 0, self.send[s.key]))
        if last:
            self._finish_queues()

    def _decide(self) -> None:
        # On CUDA this waits for the side stream's copies and flag only.
        self._finite = self.io.finite()
        self.verdict = not self.decide(self._finite)
        if self.verdict:  # overflow: the verdict goes first, no data after it
            for q in self._queues:
                q.put(("verdict", True, (), self.options))

    def absent_on(self, shard: int) -> tuple[str, ...]:
        """This step's absent slots held by `shard`, in slot order."""
        return tuple(
            s.key for b in self.buckets for s in b if s.shard == shard and s.key in self.absent
        )

    def _finish_queues(self) -> None:
        if not self.verdict:
            for i, q in enumerate(self._queues):
                q.put(("verdict", False, self.absent_on(i), self.options))
        for q in self._queues:
            q.put(None)
        self._all_in.set()

    def finish(self, options: StepOptions | None = None) -> bool:
        """After backward: fill what no hook filled (unused parameters, or no hooks at
        all); returns whether the whole gradient is finite. `options`: the step's (with
        hold_verdict, sent in the verdict)."""
        self.options = options
        for b in range(len(self.buckets)):
            if not self._filled[b]:
                self.fill(b)
        staged, self._staged = self._staged, []
        for f in staged:
            f.result()  # every bucket's copy has been started (errors surface here)
        if self.verdict is None:  # no buckets at all, or CUDA (fill leaves it here)
            self._decide()
            self._finish_queues()
        self.active = False
        return not self.verdict

    def abort(self) -> None:
        """The step will never finish (the training loop failed): end every push stream
        now, without a verdict, so no thread stays blocked on it (the shards refuse the
        incomplete pushes)."""
        self._aborted = True
        for q in self._queues:
            q.put(None)
        self._all_in.set()

    def _get(self, q: queue.SimpleQueue) -> PushItem | None:
        # Poll, so a stream is never stuck when its step dies without abort() (e.g. an
        # exception in user code outside psar's loop): at interpreter exit
        # concurrent.futures joins its threads, and this one must end for that.
        while True:
            try:
                return q.get(timeout=0.25)
            except queue.Empty:
                if self._aborted or getattr(_futures_thread, "_shutdown", False):
                    return None

    def items(self, shard: int, replay: bool) -> Iterator[PushItem]:
        """The push stream of one shard: its slots bucket by bucket as they fill, then the
        verdict. replay=True (a retried push): wait for everything, then send it all."""
        if replay:
            while not self._all_in.wait(0.25):
                if getattr(_futures_thread, "_shutdown", False):
                    return
            if self._aborted:
                return
            if self.verdict:
                yield ("verdict", True, (), self.options)
                return
            for bucket in self.buckets:
                for s in bucket:
                    if s.shard == shard:
                        yield ("data", s.key, 0, self.send[s.key])
            yield ("verdict", False, self.absent_on(shard), self.options)
            return
        q = self._queues[shard]
        while True:
            item = self._get(q)
            if item is None:
                return
            if item[0] == "_sync":
                item[1].synchronize()
                continue
            yield item
            if item[0] == "verdict" and item[1]:
                return
