"""Pulling in forward order (docs/architectures.md).

Pull in forward order (`PullGate`): pulled pieces land straight in the parameters (CPU)
while the next step's forward runs; a forward pre-hook on each module that owns
parameters waits until exactly those parameters' slots have arrived. The shards send
slots in parameter order, which is forward order for most models.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ps.partition import Slot
from trainkit.device_io import DeviceIO, Event


class PullGate:
    """Lets each module's forward start once its own parameters have been pulled.

    On CUDA the pulled bytes land in pinned host buffers: when a slot is complete,
    `on_slot(key)` starts its copy to the device and returns the copy's event; a waiting
    forward then makes the compute stream wait for that event (no host block on copies).
    """

    def __init__(
        self,
        slots: list[Slot],
        io: DeviceIO | None = None,
        on_slot: Callable[[str], Event] | None = None,
    ) -> None:
        self.slots = slots
        self.io = io if io is not None else DeviceIO(torch.device("cpu"))
        self.on_slot = on_slot
        self._events: dict[str, Event] = {}
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
        """A pull starts: every slot is outstanding. The previous pull's copies to the
        device must be done before its host buffers are written again."""
        self.settle_host()
        with self._lock:
            self._events = {}
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
            if self.on_slot is not None:
                self._events[key] = self.on_slot(key)  # before set(): waiters read it
            self._done[key].set()

    def loaded_all(self) -> None:
        """A pull outside the gate landed in full on the host: start every slot's copy to
        the device (CUDA), have the compute stream wait for them, open the gate."""
        if self.on_slot is not None:
            self._events = {k: self.on_slot(k) for k in self._numel}
            self.settle_device()
        self.complete()

    def settle_host(self) -> None:
        """Block until every device copy started by on_slot has ended."""
        for ev in list(self._events.values()):
            self.io.wait_host(ev)

    def settle_device(self) -> None:
        """Make the compute stream wait for every device copy started by on_slot."""
        for ev in list(self._events.values()):
            self.io.wait_device(ev)

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
            self.io.wait_device(self._events.get(k))
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
