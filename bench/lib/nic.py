"""Bytes a host of an emulated LAN (tests/netns.py) moved, cut to a window of a run:
each host's NIC counters read from /proc/PID/net/dev of a process inside it, sampled
while the job runs, interpolated at the window's ends (bench/lib/sparse_hosts.py)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from bench.lib import common as c
from bench.lib.periodic import Periodic


def nic_bytes(net_dev: str, ifname: str = "eth0") -> int | None:
    """rx + tx bytes of `ifname` in a /proc/PID/net/dev text (None: no such interface)."""
    for line in net_dev.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == ifname and rest:
            f = rest.split()
            return int(f[0]) + int(f[8])
    return None


# A sample is a /proc file read per host (~20 us each, no process spawned), so sampling
# often costs next to nothing, and it must be often: a window's ends are interpolated
# between samples, and a run of a few tenths of a second (60 steps on 2 cores: 0.48 s in
# CI) spanned only 2 samples at 0.25 s, its bytes diluted by the idle time around it.
NIC_EVERY_S = 0.05


class NicSampler(Periodic):
    """Every `every` s, the rx + tx bytes of each host's NIC, read from /proc/PID/net/dev
    of a process inside that host (a file read: no `ip` spawned on the shared cores), so
    the bytes of the window every worker trains in can be cut out: set-up traffic (DDP's
    broadcast of the whole table from rank 0) does not count as per-step bytes."""

    edges = True  # a sample after the workers' exit: the window's end is bracketed

    def __init__(self, pids: dict[str, int], every: float = NIC_EVERY_S) -> None:
        super().__init__(every)
        self.pids = pids
        self.samples: list[tuple[float, dict[str, int]]] = []

    def sample(self) -> None:
        got = {}
        for name, pid in self.pids.items():
            try:
                n = nic_bytes(Path(f"/proc/{pid}/net/dev").read_text())
            except OSError:  # the host's process ended: its earlier samples stand
                continue
            if n is not None:
                got[name] = n
        self.samples.append((time.time(), got))

    def samples_within(self, t0: float, t1: float) -> int:
        """How many samples fall inside [t0, t1]: under ~3, a window's bytes are mostly
        interpolated from idle time around it (a run of few steps reads low)."""
        return sum(t0 <= t <= t1 for t, _ in self.samples)

    def between(self, name: str, t0: float, t1: float) -> float | None:
        """Bytes host `name` moved from wall time t0 to t1 (interpolated samples)."""
        return bytes_between([(t, s[name]) for t, s in self.samples if name in s], t0, t1)


def bytes_between(series: list[tuple[float, int]], t0: float, t1: float) -> float | None:
    """Counter increase from t0 to t1, linear between samples; None unless samples
    bracket the window (a counter sampled too rarely says nothing about it)."""
    if len(series) < 2 or series[0][0] > t0 or series[-1][0] < t1:
        return None
    ts, vs = [t for t, _ in series], [v for _, v in series]
    return float(np.interp(t1, ts, vs) - np.interp(t0, ts, vs))


def window_bounds(run: c.Run) -> tuple[float, float]:
    """The wall-clock window common.steady_rate measures: from the last rank's first
    step after warm-up to the first rank's last step."""
    skip = c.warmup_steps(min(len(s.time) for s in run.series))
    t0 = max(s.start_wall + s.time[min(skip, len(s.time) - 1)] for s in run.series)
    return t0, min(s.start_wall + s.time[-1] for s in run.series)
