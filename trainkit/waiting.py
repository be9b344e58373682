"""Saying what a process waits for, while it waits: one line every few seconds.

A wait that can last (a worker of rank > 0 waiting for rank 0 to initialise the shards,
a pull waiting for a slow round, a shard waiting for its job) must not be silent: a user
who sees nothing for minutes cannot tell a slow peer from a hang. `Waits` keeps the
waits in progress (no thread per wait: entering one is a dictionary write) and one
daemon thread logs each that has lasted `first_after_s`, then every `every_s`, with the
time waited and the bound it waits under, until it ends.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator

Describe = Callable[[float], str]
"""seconds waited so far -> the line to log (what is waited for, and the bound)."""


class Waits:
    """The waits of one process (or one client) in progress, reported while they last."""

    def __init__(
        self,
        log: logging.Logger,
        *,
        first_after_s: float = 5.0,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.first_after_s = first_after_s
        self.every_s = every_s
        self.clock = clock
        self._lock = threading.Lock()
        self._waits: dict[int, tuple[float, float, Describe]] = {}
        """id -> (started, next report due, describe)."""
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    @contextlib.contextmanager
    def waiting(self, describe: Describe) -> Iterator[None]:
        """Report `describe(seconds)` while the body runs past first_after_s."""
        now = self.clock()
        key = next(self._ids)
        with self._lock:
            self._waits[key] = (now, now + self.first_after_s, describe)
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, name="psar-waits", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                del self._waits[key]

    def due(self) -> list[str]:
        """The lines due now (and schedule each wait's next): what the thread logs."""
        now = self.clock()
        lines = []
        with self._lock:
            for key, (started, due, describe) in list(self._waits.items()):
                if now >= due:
                    lines.append(describe(now - started))
                    self._waits[key] = (started, now + self.every_s, describe)
        return lines

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        tick = min(1.0, self.first_after_s / 2, self.every_s / 2)
        while not self._closed.wait(tick):
            for line in self.due():
                self.log.warning("%s", line)
