"""The shard's optimizer update on several cores (`psar server --torch-threads N|auto`).

The shard's optimizer is torch's, built from the job's optimizer configuration with the
implementation it names (trainkit/optim.py: fused by default where torch has the kernel,
else foreach or the per-parameter loop). A whole update steps the slots in **groups**:
with one thread, one group of every slot (one `optimizer.step()`: for fused, one kernel
call over the list); with N threads, the slots are dealt into about 2N groups of nearly
equal size, each group a view optimizer over its slots (sharing the shard optimizer's
state and taking its hyperparameters, learning rate included, before each step), stepped
on a pool of N threads with torch on one thread each. Why a pool and not torch's own
intra-op threads (bench/shard_update.py, bench/README.md): every op joins torch's OpenMP
team once, and when a core is busy with other work (gRPC threads, the data plane, workers
on the same host) every join waits for it; groups handed to a pool (torch releases the GIL
inside each kernel) join once, at the end, and copies elsewhere in the shard stay on one
torch thread, the fastest here for them. Twice as many groups as threads so a thread
slowed by another process does not hold the update's tail.

Bit for bit the same whatever the grouping or threads: torch's SGD/AdamW compute each
element from that element's own values, in every implementation (fused, foreach, loop),
so which list a slot is stepped in changes nothing (tests/test_update_threads.py). One
caveat, from torch's fused kernels: a vectorised loop and a scalar tail may round
differently (fused SGD), so a slot cut inside a parameter must start at a multiple of the
vector width to equal a DDP rank stepping the whole parameter: ps/partition.py keeps
chunks at multiples of 64 elements.

Per-chunk rounds step one slot at a time (`step_slot`, from the rule's applier or the pool
through `each`): one slot is one group of its own.

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

from psar.trainkit.optim import StepAdjust, adjusted, build_optimizer

if TYPE_CHECKING:
    from psar.ps.server.state import ShardData

#: Below this many elements in a step the pool costs more than it saves (each slot's
#: step has ~50 us of Python around it): step on the calling thread.
MIN_PARALLEL_NUMEL = 1 << 18


def apply_torch_threads(setting: str) -> None:
    """Process start of a shard: torch's own intra-op threads. 0 keeps torch's default
    (no pool then); anything else pins torch to one thread, the pool being the update's
    parallelism and one thread the fastest for the shard's copies (bench/README.md)."""
    if str(setting) != "0":
        torch.set_num_threads(1)


#: Groups per pool thread: a thread slowed by other work hands the rest to the others.
GROUPS_PER_THREAD = 2


class SlotStepper:
    """Steps a shard's slots on `threads` threads; accounts the update's time."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = max(1, int(threads))
        self._pool: ThreadPoolExecutor | None = None
        self._views: dict[tuple[str, ...], tuple[list[torch.Tensor], torch.optim.Optimizer]] = {}
        """Slot keys of a group -> (its masters when built, its view optimizer)."""
        self._groups: tuple[tuple[str, ...], ...] = ()
        self._grouped: list[torch.Tensor] = []
        """The masters `_groups` was dealt for (replaced by a restore: dealt again)."""
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
        changes this step's lr / momentum (async/ssp staleness-aware updates); the group
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
                self._view_step(st, (key,))
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

    def groups(self, st: ShardData) -> tuple[tuple[str, ...], ...]:
        """The slots dealt into about GROUPS_PER_THREAD x threads groups of nearly equal
        size (largest slot first onto the lightest group), largest group first."""
        masters = list(st.masters.values())
        if len(masters) != len(self._grouped) or any(
            a is not b for a, b in zip(masters, self._grouped, strict=True)
        ):
            n = max(1, min(len(masters), self.threads * GROUPS_PER_THREAD))
            bins: list[list[str]] = [[] for _ in range(n)]
            load = [0] * n
            for key, p in sorted(st.masters.items(), key=lambda kv: -kv[1].numel()):
                i = min(range(n), key=lambda b: (load[b], b))
                bins[i].append(key)
                load[i] += p.numel()
            order = sorted(range(n), key=lambda b: -load[b])
            self._groups = tuple(tuple(bins[b]) for b in order if bins[b])
            self._grouped = masters
        return self._groups

    def _run(self, st: ShardData) -> None:
        """Step every group (grads set) on the pool, largest first so the tail is short."""
        groups = self.groups(st)
        for keys in groups:
            self._view(st, keys)  # built here: the pool threads only read the cache
        pool = self._get_pool()
        _wait_all([pool.submit(self._view_step, st, keys) for keys in groups])

    def _view(self, st: ShardData, keys: tuple[str, ...]) -> torch.optim.Optimizer:
        """The view optimizer of the slots `keys` (rebuilt when the masters were replaced)."""
        params = [st.masters[k] for k in keys]
        cached = self._views.get(keys)
        if cached is not None and all(a is b for a, b in zip(cached[0], params, strict=True)):
            return cached[1]
        assert st.job is not None
        view = build_optimizer(params, st.job.optimizer)
        self._views[keys] = (params, view)
        return view

    def _view_step(self, st: ShardData, keys: tuple[str, ...]) -> None:
        main = st.optimizer
        view = self._view(st, keys)
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
