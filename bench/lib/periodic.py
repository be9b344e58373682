"""A sampler that reads something every `every` seconds on a thread of its own while a
`with` block runs (bench/lib/memory.py's peaks, bench/lib/nic.py's NIC counters)."""

from __future__ import annotations

import threading
from typing import Self


class Periodic:
    """Calls sample() every `every` s between __enter__ and __exit__; with `edges`, once
    more as the block starts and once after it ends (so the samples bracket it)."""

    edges = False

    def __init__(self, every: float) -> None:
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.edges:
            self.sample()

    def _run(self) -> None:
        if self.edges:
            self.sample()
        while not self._stop.wait(self.every):
            self.sample()
