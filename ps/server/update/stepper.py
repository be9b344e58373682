"""The shard's optimizer update on several cores (`psar server --torch-threads N|auto`).

A pool of threads steps the shard's slots, each thread running torch single-threaded,
rather than one optimizer.step() with torch's intra-op threads. Why (bench/shard_update.py,
bench/README.md has the figures): the shard's optimizer is torch's per-parameter AdamW/SGD
(foreach=False, for bit-identity with DDP), a chain of about ten elementwise ops per slot,
each of which wakes and joins torch's OpenMP team once; when a core is busy with other
work (gRPC threads, the data plane, workers on the same host) every join waits for it, and
the step got ten times slower with two intra-op threads on the 2-core test machine. Slots
handed out one at a time to a pool (torch releases the GIL inside each op) need no join
until the last slot, and copies elsewhere in the shard stay on one torch thread, the fastest
here for them.

Bit for bit the same as one thread: each slot is stepped by torch's own optimizer code
(a per-slot optimizer built by trainkit.optim.build_optimizer, sharing the shard
optimizer's state dict and taking its hyperparameters, learning rate included, before each
step), and torch's per-parameter optimizers compute each parameter on its own: the same
elementwise ops on the same values. A slot is one call either way, so even where a
vectorised and a scalar path round differently, the same elements take the same path.

The stepper also measures the update: wall seconds spent stepping, committed with the
parameters of each finished update (`commit`), so Stats and /metrics report parameters/s.
Work that per-chunk rounds undid is counted in the seconds of the next update.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from trainkit.optim import StepAdjust, adjusted, build_optimizer

if TYPE_CHECKING:
    from ps.server.state import ShardData

#: Below this many elements in a step the pool costs more than it saves (each slot's
#: step has ~50 us of Python around it): step on the calling thread.
MIN_PARALLEL_NUMEL = 1 << 18


def apply_torch_threads(setting: str) -> None:
    """Process start of a shard: torch's own intra-op threads. 0 keeps torch's default
    (no pool then); anything else pins torch to one thread, the pool being the update's
    parallelism and one thread the fastest for the shard's copies (bench/README.md)."""
    if str(setting) != "0":
        torch.set_num_threads(1)


class SlotStepper:
    """Steps a shard's slots on `threads` threads; accounts the update's time."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = max(1, int(threads))
        self._pool: ThreadPoolExecutor | None = None
        self._views: dict[str, tuple[torch.Tensor, torch.optim.Optimizer]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pending_s = 0.0
        self.params_updated = 0
        """Parameters (fp32 elements) of the updates committed so far."""
        self.update_seconds = 0.0
        """Wall seconds spent stepping for them."""

    # ---- stepping --------------------------------------------------------------------

    def step_all(self, st: ShardData, adjust: StepAdjust | None = None) -> None:
        """One optimizer step of every slot; each master's .grad is already set. `adjust`
        changes this step's lr / momentum (async/ssp staleness-aware updates); the per-slot
        optimizers take the adjusted values from the shard optimizer's group."""
        t0 = time.perf_counter()
        with adjusted(st.optimizer, adjust):
            if self._parallel(st, st.masters.values()):
                self._run(st)
            else:
                st.optimizer.step()
        self._add(time.perf_counter() - t0)

    def step_slot(self, st: ShardData, key: str, grad: torch.Tensor) -> None:
        """One optimizer step of slot `key` only (per-chunk rounds). Safe to call from
        several threads at once for different slots when threads > 1."""
        t0 = time.perf_counter()
        p = st.masters[key]
        p.grad = grad
        try:
            if self.threads > 1 and len(st.optimizer.param_groups) == 1:
                self._view_step(st, key, p)
            else:
                _step_one(st.optimizer, p)
        finally:
            p.grad = None
        if not getattr(self._local, "batched", False):
            self._add(time.perf_counter() - t0)

    def each(self, st: ShardData, keys: Iterable[str], fn: Callable[[str], Any]) -> None:
        """fn(key) for each slot, on the pool when it pays (fn may call step_slot);
        timed as one batch of update work."""
        keys = list(keys)
        t0 = time.perf_counter()
        if self._parallel(st, (st.masters[k] for k in keys)):
            pool = self._get_pool()
            order = sorted(keys, key=lambda k: -st.masters[k].numel())
            _wait_all([pool.submit(self._batched, fn, k) for k in order])
        else:
            for k in keys:
                self._batched(fn, k)
        self._add(time.perf_counter() - t0)

    # ---- accounting ------------------------------------------------------------------

    def commit(self, numel: int) -> float:
        """An update of `numel` parameters finished: returns the seconds counted for it."""
        with self._lock:
            seconds, self._pending_s = self._pending_s, 0.0
            self.params_updated += numel
            self.update_seconds += seconds
        return seconds

    def rate(self) -> float:
        """Parameters updated per second of update work so far (0 before the first)."""
        with self._lock:
            return self.params_updated / self.update_seconds if self.update_seconds else 0.0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    # ---- internals -------------------------------------------------------------------

    def _add(self, seconds: float) -> None:
        with self._lock:
            self._pending_s += seconds

    def _parallel(self, st: ShardData, params: Iterable[torch.Tensor]) -> bool:
        if self.threads < 2 or len(st.optimizer.param_groups) != 1:
            return False
        sizes = [p.numel() for p in params]
        return len(sizes) > 1 and sum(sizes) >= MIN_PARALLEL_NUMEL

    def _get_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="psar-update")
        return self._pool

    def _batched(self, fn: Callable[[str], Any], key: str) -> Any:
        self._local.batched = True
        try:
            return fn(key)
        finally:
            self._local.batched = False

    def _run(self, st: ShardData) -> None:
        """Step every slot (grads set) on the pool, largest first so the tail is short."""
        for key, p in st.masters.items():
            self._view(st, key, p)  # built here: the pool threads only read the cache
        pool = self._get_pool()
        items = sorted(st.masters.items(), key=lambda kv: -kv[1].numel())
        _wait_all([pool.submit(self._view_step, st, k, p) for k, p in items])

    def _view(self, st: ShardData, key: str, p: torch.Tensor) -> torch.optim.Optimizer:
        """The per-slot optimizer of `key` (rebuilt when the masters were replaced)."""
        cached = self._views.get(key)
        if cached is not None and cached[0] is p:
            return cached[1]
        assert st.job is not None
        view = build_optimizer([p], st.job.optimizer)
        self._views[key] = (p, view)
        return view

    def _view_step(self, st: ShardData, key: str, p: torch.Tensor) -> None:
        main = st.optimizer
        view = self._view(st, key, p)
        view.state = main.state  # shared: checkpoints and digests read the shard's optimizer
        _sync_hyper(main.param_groups[0], view.param_groups[0])
        view.step()
        # What main.step() would mark: torch's LR scheduler warns on its first step
        # otherwise (it would think the optimizer never stepped).
        main._opt_called = True  # type: ignore[attr-defined]


def _wait_all(futures: list[Future]) -> None:
    """Wait for every one (none may still run when the caller's lock is released), then
    raise the first failure."""
    wait(futures)
    for f in futures:
        f.result()


def _sync_hyper(src: Mapping[str, Any], dst: dict[str, Any]) -> None:
    """The shard optimizer's hyperparameters (the scheduler's lr) into a per-slot one."""
    for name, value in src.items():
        if name != "params":
            dst[name] = value


def _step_one(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> None:
    """optimizer.step() for parameter `p` alone: with one param group (trainkit/optim.py)
    the group holds only `p` for this step, so torch does not walk every other parameter."""
    groups = optimizer.param_groups
    params = groups[0]["params"] if len(groups) == 1 else None
    try:
        if params is not None:
            groups[0]["params"] = [p]
        optimizer.step()
    finally:
        if params is not None:
            groups[0]["params"] = params
