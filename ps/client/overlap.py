"""Overlapping a PS worker's communication with its compute (docs/architectures.md).

Push during backward (`PushBuckets`): like DDP's reducer, a hook on every parameter
notes when its gradient is ready; parameters are grouped, in the order autograd
produces their gradients (reverse registration order), into buckets of about
--bucket-mib. When a bucket is complete its gradients are cast into the persistent send
buffers and queued on the push stream of every shard holding a piece of it, so pushes
travel while backward is still running. The worker knows whether its whole gradient is
finite only once the last bucket is in: that verdict travels last on every stream
(PushVerdict; overflow=true makes every shard drop the push and, in sync, skip the round).

Pull in forward order (`PullGate`): pulled pieces land straight in the parameters (CPU)
while the next step's forward runs; a forward pre-hook on each module that owns
parameters waits until exactly those parameters' slots have arrived. The shards send
slots in parameter order, which is forward order for most models.

Neither changes what is computed: the same bytes reach the same slots, and the shards
reduce each slot in worker-rank order, so overlapped and non-overlapped runs give
bit-identical weights (tests/test_overlap.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import thread as _futures_thread
from typing import Any

import torch

from ps.partition import Slot
from trainkit.finite import all_finite

PushItem = tuple[Any, ...]
"""("data", slot key, element offset, 1-D tensor) or ("verdict", overflow)."""


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
    ) -> None:
        self.params = params
        self.send = send
        """Per slot, what goes on the wire this step: a view of the gradient itself when
        it already has the wire dtype on the CPU (no copy), else the persistent buffer."""
        self._own = dict(send)
        self.num_shards = num_shards
        itemsize = next(iter(send.values())).element_size() if send else 4
        names = bucket_params(params, bucket_bytes, itemsize)
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

        self.active = False
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._pending = list(self.sizes)
        self._filled = [False] * len(self.buckets)
        self._finite = True
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
        """Cast bucket b's gradients into the send buffers and queue them (training thread)."""
        with self._lock:
            if self._filled[b]:
                return
            self._filled[b] = True
            first = not self._started
            self._started = True
        if first:
            self.on_first_bucket()
        bufs = []
        for s in self.buckets[b]:
            g = self.params[s.param].grad
            buf = self._own[s.key]
            if g is None:
                buf.zero_()  # no gradient this step: contributes zero
            elif g.dtype == buf.dtype and g.device == buf.device and g.is_contiguous():
                # Sent from the gradient's own memory: it stays alive (we hold the view)
                # until the next step replaces it, which is after this push has ended.
                buf = g.detach().view(-1)[s.start : s.start + s.numel]
            else:
                buf.copy_(g.reshape(-1)[s.start : s.start + s.numel], non_blocking=True)
            self.send[s.key] = buf
            bufs.append(buf)
        cuda = bool(bufs) and self._own[self.buckets[b][0].key].is_pinned()
        if bufs and not cuda:
            self._finite = self._finite and all_finite(bufs)
        last = all(self._filled)
        if last:
            self._decide()
        if cuda:  # the copies are asynchronous: senders wait for them to land
            event = torch.cuda.Event()
            event.record()
            for q in {s.shard for s in self.buckets[b]}:
                self._queues[q].put(("_sync", event))
        for s in self.buckets[b]:
            self._queues[s.shard].put(("data", s.key, 0, self.send[s.key]))
        if last:
            self._finish_queues()

    def _decide(self) -> None:
        bufs = list(self.send.values())
        if bufs and next(iter(self._own.values())).is_pinned():
            # CUDA: the copies were asynchronous; check once they have all landed.
            torch.cuda.synchronize()
            self._finite = all_finite(bufs)
        self.verdict = not self.decide(self._finite)
        if self.verdict:  # overflow: the verdict goes first, no data after it
            for q in self._queues:
                q.put(("verdict", True))

    def _finish_queues(self) -> None:
        if not self.verdict:
            for q in self._queues:
                q.put(("verdict", False))
        for q in self._queues:
            q.put(None)
        self._all_in.set()

    def finish(self) -> bool:
        """After backward: fill what no hook filled (unused parameters, or no hooks at
        all); returns whether the whole gradient is finite."""
        for b in range(len(self.buckets)):
            if not self._filled[b]:
                self.fill(b)
        if not self.buckets:
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
                yield ("verdict", True)
                return
            for bucket in self.buckets:
                for s in bucket:
                    if s.shard == shard:
                        yield ("data", s.key, 0, self.send[s.key])
            yield ("verdict", False)
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


class PullGate:
    """Lets each module's forward start once its own parameters have been pulled."""

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self._numel = {s.key: s.numel for s in slots}
        self._got: dict[str, int] = {}
        self._done: dict[str, threading.Event] = {s.key: threading.Event() for s in slots}
        self._failed = threading.Event()
        self.waited_s = 0.0
        """Seconds forward spent waiting for weights since the last take_waited()."""
        self.consumed = False
        """A module's forward ran on weights of the pull in flight."""
        self._lock = threading.Lock()
        self.on_failure: Callable[[], None] = lambda: None
        self._handles: list[Any] = []

    def attach(self, model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
        """A forward pre-hook on every module that owns parameters of ours."""
        by_param: dict[str, list[str]] = {}
        for s in self.slots:
            by_param.setdefault(s.param, []).append(s.key)
        ours = {id(p): n for n, p in params.items()}
        for module in model.modules():
            keys = [
                k
                for p in module.parameters(recurse=False)
                for k in by_param.get(ours.get(id(p), ""), [])
            ]
            if keys:
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(keys)))

    def _pre_hook(self, keys: list[str]) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: Any) -> None:
            self.wait(keys)
            self.consumed = True

        return hook

    def begin(self) -> None:
        """A pull starts: every slot is outstanding."""
        with self._lock:
            self._got = {}
            for e in self._done.values():
                e.clear()
            self._failed.clear()
            self.consumed = False

    def landed(self, key: str, offset: int, n: int) -> None:
        """A piece of `key` landed (called by the pulling thread)."""
        with self._lock:
            got = self._got.get(key, 0) + n
            self._got[key] = got
        if got >= self._numel[key]:
            self._done[key].set()

    def fail(self) -> None:
        """The pull in flight failed: waiters must recover (see PSBackend)."""
        self._failed.set()
        for e in self._done.values():
            e.set()

    def complete(self) -> None:
        for e in self._done.values():
            e.set()

    def recovered(self) -> None:
        """The failed pull was redone in full: every slot is in."""
        self._failed.clear()
        self.complete()

    def wait(self, keys: list[str]) -> None:
        """Block until these slots have arrived."""
        t0 = None
        for k in keys:
            e = self._done[k]
            if not e.is_set():
                t0 = t0 or time.perf_counter()
                e.wait()
        if self._failed.is_set():
            t0 = t0 or time.perf_counter()
            self.on_failure()
        if t0 is not None:
            self.waited_s += time.perf_counter() - t0

    def take_waited(self) -> float:
        w, self.waited_s = self.waited_s, 0.0
        return w

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
