"""Is this host's CPU already taken? The overlap trial's first question
(ps/client/overlap_tuner.py, `psar train --overlap-host-busy`).

Overlapping communication with compute runs it on other threads, which wins where a core
is idle and loses where none is. Where every shard is on this host the bytes only move
through memory (ps/shm.py): no link time to hide, only copies that take a core. If the
host's CPUs were nearly all busy over the warm-up steps anyway (the workers' compute and
a shard sharing the cores), overlapping threads can only take their cores from compute,
and the trial's arms differ by less than its steps' noise (measured: 2 workers and a
shard on 2 cores, 88% busy, running without overlap 1.03x the trial's pick; 1 worker and
a shard, 59% busy, where overlap wins). So such a worker keeps no overlap without trying.
"""

from __future__ import annotations

from collections.abc import Callable

PROC_STAT = "/proc/stat"
MIN_TICKS = 10
"""Fewer CPU clock ticks than this between the two reads (all CPUs together, 100 a second
each) say too little to judge: no verdict, the trial runs."""


def read_proc_stat(path: str = PROC_STAT) -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat's first line;
    None where there is none (not Linux). Steal counts as busy: the CPU was wanted."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    ticks = [int(x) for x in fields[1:9]]
    total = sum(ticks)
    return total - ticks[3] - ticks[4], total


class HostBusy:
    """The busy share of this host's CPU time between start() and fraction()."""

    def __init__(self, read: Callable[[], tuple[int, int] | None] = read_proc_stat) -> None:
        self._read = read
        self._at: tuple[int, int] | None = None

    def start(self) -> None:
        self._at = self._read()

    def fraction(self) -> float | None:
        """Busy ticks / all ticks since start(); None without a reading or with fewer than
        MIN_TICKS ticks to judge from."""
        now = self._read()
        if self._at is None or now is None:
            return None
        busy, total = now[0] - self._at[0], now[1] - self._at[1]
        if total < MIN_TICKS:
            return None
        return max(0.0, min(1.0, busy / total))


class CoLocatedCPU:
    """The overlap tuner's host check: a reason to keep no overlap without a trial, or None.

    Says so only where compute is on the CPU, every shard takes this worker's bytes
    through shared memory (`in_shared_memory`: they are on this host) and the host's CPUs
    were at least `threshold` busy between start() and verdict() (0: never)."""

    def __init__(
        self,
        threshold: float,
        *,
        cpu_compute: bool,
        in_shared_memory: Callable[[], bool],
        busy: HostBusy | None = None,
    ) -> None:
        self.threshold = threshold
        self.cpu_compute = cpu_compute
        self.in_shared_memory = in_shared_memory
        self.busy = busy if busy is not None else HostBusy()
        self.measured: float | None = None
        """The busy share verdict() read (None: not read, or too little to judge)."""

    def start(self) -> None:
        self.busy.start()

    def verdict(self) -> str | None:
        if not self.threshold or not self.cpu_compute:
            return None
        self.measured = self.busy.fraction()
        if self.measured is None or self.measured < self.threshold:
            return None
        if not self.in_shared_memory():
            return None  # a shard elsewhere: link time that overlap may hide
        return (
            f"every shard is on this host and its CPUs were {self.measured:.0%} busy over "
            f"the warm-up steps (--overlap-host-busy {self.threshold:g}): overlapping "
            "threads would take their cores from compute"
        )
