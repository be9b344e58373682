"""Driving shards directly, as the data-path benchmarks do: push + pull cycles through a
worker's client (`run_config`, bench/ps_datapath.py and bench/experiments/cpu_rate.py), and waiting
for a quiet machine before a timed transfer (`Settler`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from psar.ps.client.psclient import ClientConfig, PSClient
from psar.ps.client.tcp_transport import DEFAULT_MAX_FRAME_BYTES
from psar.ps.job import Job
from psar.ps.partition import plan_slots
from psar.trainkit.optim import OptimizerConfig

# ---- a shared, noisy machine -----------------------------------------------------------


def cpu_idle_fraction(interval_s: float = 0.25) -> float | None:
    """Fraction of all CPUs idle over `interval_s` (/proc/stat); None where unavailable."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
        return f[3] + f[4], sum(f)  # idle + iowait, total

    try:
        i0, t0 = sample()
        time.sleep(interval_s)
        i1, t1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (i1 - i0) / max(1, t1 - t0)


class Settler:
    """Before a timed transfer, wait until the CPUs are at least `idle` idle, so it is not
    measured while other jobs hold the cores: at most max_wait_s each time and budget_s
    in all (then it stops waiting), so a busy machine cannot stall the run."""

    def __init__(self, max_wait_s: float, idle: float, budget_s: float) -> None:
        self.max_wait_s, self.idle, self.budget_s = max_wait_s, idle, budget_s
        self.waited_s = 0.0
        self.last_idle: float | None = None

    def __call__(self) -> None:
        limit = min(self.max_wait_s, self.budget_s - self.waited_s)
        if limit <= 0:
            return
        t0 = time.monotonic()
        while True:
            self.last_idle = cpu_idle_fraction()
            if self.last_idle is None or self.last_idle >= self.idle:
                break
            if time.monotonic() - t0 >= limit:
                break
        self.waited_s += time.monotonic() - t0


# ---- one configuration -----------------------------------------------------------------


def tensor_sizes(payload_bytes: int, tensors: int) -> list[int]:
    """fp32 element counts of `tensors` tensors adding up to payload_bytes (equal split)."""
    total = payload_bytes // 4
    if total < tensors:
        raise ValueError(f"payload of {payload_bytes} bytes is too small for {tensors} tensors")
    base, extra = divmod(total, tensors)
    return [base + (1 if i < extra else 0) for i in range(tensors)]


def run_config(
    addresses: Sequence[str],
    *,
    payload_bytes: int,
    tensors: int,
    chunk_bytes: int,
    message_bytes: int,
    max_message_bytes: int,
    repeats: int,
    warmup: int,
    before_cycle: Callable[[bool], object] | None = None,
    transports: Sequence[str] = ("grpc",),
    frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> dict[str, tuple[list[float], list[float]]]:
    """Push+pull `payload_bytes` through the shards; per transport, (push seconds, pull
    seconds) per repeat. Transports alternate cycle by cycle (A B A B ...).

    before_cycle(timed) runs before every cycle, outside its timing (timed is False
    for the warm-up cycles)."""
    sizes = tensor_sizes(payload_bytes, tensors)
    params = [(f"t{i}", n) for i, n in enumerate(sizes)]
    slots = plan_slots(params, len(addresses), chunk_bytes=chunk_bytes)
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(n, generator=gen) for name, n in params}
    # Tiny finite gradients: the shard's SGD step changes the weights a little each push.
    grads_full = {name: torch.randn(n, generator=gen).mul_(1e-6) for name, n in params}
    pulled = {name: torch.empty(n) for name, n in params}

    def views(src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {s.key: src[s.param][s.start : s.start + s.numel] for s in slots}

    jobs = [
        Job(
            mode="async",
            num_workers=1,
            optimizer=OptimizerConfig(name="sgd", lr=1e-3, momentum=0.0),
            shard_index=i,
            num_shards=len(addresses),
            slots=[s for s in slots if s.shard == i],
            job_id="bench-ps-datapath",
        )
        for i in range(len(addresses))
    ]
    cfg = ClientConfig(
        message_bytes=message_bytes,
        max_message_bytes=max_message_bytes,
        data_frame_bytes=frame_bytes,
        data_plane="auto",
    )
    # The client a worker uses; cfg.data_plane picks the transport of each cycle.
    with PSClient(addresses, worker=0, cfg=cfg) as client:
        client.set_slots(slots)
        # As ps/client/backend.py does: init (rank 0), read the jobs back (and the lease and
        # data ports), register, and keep the lease alive while we push and pull.
        client.init(jobs, views(weights))
        if client.get_jobs(wait=True) != jobs:
            raise RuntimeError("the shards serve a different job than the one sent")
        if "tcp" in transports and not all(client._data_ports):
            raise RuntimeError("a shard has no data plane (started with --data-port -1?)")
        client.register(clock=0)
        client.start_heartbeats()
        grads, out = views(grads_full), views(pulled)
        headers = client.pull(clock=0, dtype=torch.float32, out=out)
        versions = [h.version for h in headers]
        times: dict[str, tuple[list[float], list[float]]] = {t: ([], []) for t in transports}
        cycles = (warmup + repeats) * len(transports)
        for clock in range(1, cycles + 1):
            transport = transports[(clock - 1) % len(transports)]
            cfg.data_plane = transport
            timed = clock > warmup * len(transports)
            if before_cycle is not None:
                before_cycle(timed)
            t0 = time.perf_counter()
            replies = client.push(
                clock=clock, base_versions=versions, dtype=torch.float32, grads=grads
            )
            t1 = time.perf_counter()
            headers = client.pull(clock=clock, dtype=torch.float32, out=out)
            t2 = time.perf_counter()
            versions = [h.version for h in headers]
            if not all(r.applied for r in replies):
                raise RuntimeError(f"a push was not applied: {replies}")
            if timed:
                times[transport][0].append(t1 - t0)
                times[transport][1].append(t2 - t1)
        if versions != [cycles] * len(addresses):
            raise RuntimeError(f"shards applied {versions} updates, expected {cycles}")
    return times
