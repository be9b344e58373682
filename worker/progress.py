"""Progress on rank 0: one line per --log-every steps (a bar when stderr is a terminal)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    def __init__(self, total: int, *, enabled: bool, every: int, stream: TextIO | None = None):
        self.total, self.enabled, self.every = total, enabled, max(1, every)
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, rate: float, loss: float, outcome: Any) -> None:
        if not self.enabled or (step % self.every and step != self.total):
            return
        width = 24
        done = int(width * step / self.total)
        bar = "#" * done + "." * (width - done)
        parts = [f"[{bar}] step {step}/{self.total}", f"{rate:,.0f} samples/s", f"loss {loss:.4f}"]
        if outcome.loss_scale != 1.0:
            parts.append(f"scale {outcome.loss_scale:g}")
        if outcome.staleness is not None:
            parts.append(f"staleness {outcome.staleness}")
        if outcome.skipped:
            parts.append("SKIPPED")
        line = " | ".join(parts)
        end = "\r" if self.tty and step != self.total else "\n"
        self.stream.write(line + end)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
