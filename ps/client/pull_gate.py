"""Pulling in forward order (docs/architecture.md).

Pull in forward order (`PullGate`): pulled pieces land straight in the parameters (CPU)
while the next step's forward runs; forward waits until exactly the slots it reads have
arrived. The shards send slots in parameter order, which is forward order for most models.

Two layers make the gate impossible to bypass from Python:
- a forward pre-hook on each module that owns parameters waits for all of them (the
  cheap common case: one wait per layer);
- while a pull is in flight, the model's forward runs under a TorchFunctionMode that sees
  every torch call and waits for any parameter among its arguments not yet in. That
  catches what module hooks cannot: a functional read of a child's weight whose own
  forward never runs (`F.linear(h, self.head.weight)`), a parameter used outside its
  owner, `.data`, indexing, `torch.cat([...])` of weights. When the model's forward
  returns, the gate waits for every slot still out, so a loss that reads parameters
  sees them whole too.
A model whose parameter reads never reach Python (TorchScript, torch.compile) cannot be
gated: `ungateable_reason()` says why, and the backend pulls before forward instead
(logged once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from psar.ps.partition import Slot
from psar.trainkit.device_io import DeviceIO, Event


def ungateable_reason(model: torch.nn.Module) -> str:
    """Why the gate cannot see this model's parameter reads ('' when it can): TorchScript
    and compiled modules run their ops without calling back into Python."""
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            return f"module {name or '(root)'} is TorchScript"
        if type(m).__name__ == "OptimizedModule":  # torch.compile's wrapper
            return f"module {name or '(root)'} is compiled (torch.compile)"
    return ""


class _ReadGate(TorchFunctionMode):
    """Waits, at each torch call of a forward, for the parameters among its arguments."""

    def __init__(self, gate: PullGate) -> None:
        super().__init__()
        self.gate = gate

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        pending = self.gate._pending
        if pending:
            for a in (*args, *kwargs.values()) if kwargs else args:
                if isinstance(a, (list, tuple)):  # torch.cat([w1, w2]), torch.stack(...)
                    for b in a:
                        if id(b) in pending:
                            self.gate._read(id(b))
                elif id(a) in pending:
                    self.gate._read(id(a))
        return func(*args, **(kwargs or {}))


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
        self._keys_of: dict[int, list[str]] = {}
        """id(parameter) -> its slots (the parameters this gate guards)."""
        self._pending: dict[int, list[str]] = {}
        """The guarded parameters forward has not yet waited for in the pull in flight."""
        self._mode: _ReadGate | None = None
        self.bypass_reads = 0
        """Parameter reads the module hooks missed and the read gate waited for (tests)."""

    def attach(self, model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
        """A forward pre-hook on every module that owns parameters (or buffers) of ours,
        and the read gate around the model's forward."""
        by_param: dict[str, list[str]] = {}
        for s in self.slots:
            by_param.setdefault(s.param, []).append(s.key)
        ours = {id(p): n for n, p in params.items()}
        self._keys_of = {id(p): by_param[n] for n, p in params.items() if n in by_param}
        for module in model.modules():
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            owned = [p for p in own if id(p) in self._keys_of]
            if owned:
                keys = [k for p in owned for k in by_param.get(ours[id(p)], [])]
                ids = [id(p) for p in owned]
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(keys, ids)))
        # The root's forward runs under the read gate while a pull is in flight.
        self._handles.append(model.register_forward_pre_hook(self._enter))
        self._handles.append(model.register_forward_hook(self._exit, always_call=True))

    def _pre_hook(self, keys: list[str], ids: list[int]) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: Any) -> None:
            self.wait(keys)
            for i in ids:
                self._pending.pop(i, None)
            self.consumed = True

        return hook

    def _enter(self, _module: torch.nn.Module, _args: Any) -> None:
        if self._pending and self._mode is None:
            self._mode = _ReadGate(self)
            self._mode.__enter__()

    def _exit(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
            # Forward is over: whatever is still out may be read by the loss.
            self.wait(list(self._numel))
            self._pending.clear()

    def _read(self, pid: int) -> None:
        """A torch call reads parameter `pid` before any module hook waited for it."""
        keys = self._pending.pop(pid, None)
        if keys is not None:
            self.bypass_reads += 1
            self.wait(keys)
            self.consumed = True

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
            self._pending = dict(self._keys_of)

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
        self._pending = {}

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
