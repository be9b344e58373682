"""Every host<->device move of a worker: pinned staging buffers, side streams, events.

One small module, so the rules live in one place and their logic runs (and is tested)
on a CPU, where every call degrades to a plain copy and every event is ``None``:

* **Device to host (gradients).** A bucket's gradients leave the GPU on a side stream
  (``d2h``) that first waits for an event recorded on the compute stream when the
  bucket's hook fired, so backward's kernels are never queued behind a copy and nobody
  synchronises the whole device. A cast to the wire dtype runs on the device before the
  copy (half the bytes cross PCIe for fp16), and the finiteness check runs on the cast
  values on the same side stream, into one device flag read once per step.
* **Host to device (weights).** Pulled bytes land in pinned host buffers; each slot goes
  to its parameter with a non-blocking copy on a second side stream (``h2d``) that
  first waits for the compute stream to be done with the previous step's weights. The
  compute stream then waits on the slot's event (``wait_device``): forward never blocks
  the host on a copy.
* **Synchronous moves** (Init values, ``--save``, checkpoints, sparse rows) go through
  :func:`to_host` / :func:`to_device`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

Event = Any
"""A ``torch.cuda.Event`` on CUDA, ``None`` on a CPU (nothing to wait for)."""


def to_host(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A CPU tensor with `t`'s values (cast to `dtype` on the device first, if given):
    the tensor itself when it is on the CPU already and needs no cast."""
    t = t.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t if t.device.type == "cpu" else t.to("cpu")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` (synchronous; for setup and rare paths, never per step)."""
    return t if t.device == device else t.to(device)


def state_to_host(state: Any) -> Any:
    """A state (dicts, lists and tuples of tensors, e.g. an optimizer's state_dict) with
    every tensor on the CPU, so a saved file loads on a machine without a GPU."""
    if isinstance(state, torch.Tensor):
        return to_host(state)
    if isinstance(state, dict):
        return {k: state_to_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(state_to_host(v) for v in state)
    return state


class DeviceIO:
    """Staging between host memory and one device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self._flag: torch.Tensor | None = None
        self._flag_host: torch.Tensor | None = None
        self._flag_event: Event = None
        self._cpu_finite = True

    # ---- buffers and events ---------------------------------------------------------

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer to stage `numel` values: pinned on CUDA (DMA-able, so copies
        run asynchronously), plain memory on a CPU."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.cuda)

    def mark(self) -> Event:
        """An event at the current point of the compute stream (None on a CPU)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    @staticmethod
    def wait_host(event: Event) -> None:
        """Block this thread until `event` has happened (that stream only, not the device)."""
        if event is not None:
            event.synchronize()

    def wait_device(self, event: Event) -> None:
        """Make the compute stream wait for `event` without blocking the host."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    # ---- device to host: gradients --------------------------------------------------

    def begin_finite(self) -> None:
        """A new step's finiteness check: nothing seen yet."""
        self._cpu_finite = True
        self._flag_event = None
        if self.cuda:
            if self._flag is None:
                self._flag = torch.zeros(1, device=self.device)
                self._flag_host = torch.zeros(1, pin_memory=True)
            with torch.cuda.stream(self.d2h):
                self._flag.zero_()

    def stage_out(self, pieces: Iterable[tuple[torch.Tensor, torch.Tensor]], after: Event) -> Event:
        """Copy each (source, host buffer) pair to the host, the source cast to the
        buffer's dtype on its own device first, and check the cast values' finiteness.

        On CUDA the work runs on the d2h stream after `after`; the returned event marks
        its end (senders wait for it with wait_host). On a CPU it runs now, returns None.
        """
        pieces = list(pieces)
        if not self.cuda:
            cast = [b.copy_(s) if s is not b else b for s, b in pieces]
            self._cpu_finite = self._cpu_finite and _all_finite(cast)
            return None
        assert self.d2h is not None and self._flag is not None
        with torch.cuda.stream(self.d2h):
            if after is not None:
                self.d2h.wait_event(after)
            cast = []
            for src, buf in pieces:
                # The compute stream may free or reuse the gradient's memory later: tell
                # the allocator this stream still reads it.
                src.record_stream(self.d2h)
                w = src if src.dtype == buf.dtype else src.to(buf.dtype)
                cast.append(w)
                buf.copy_(w, non_blocking=True)
            _flag_nonfinite(cast, self._flag)
            done = _host_event()
            done.record(self.d2h)
        return done

    def finite(self) -> bool:
        """Whether everything staged since begin_finite() was finite. On CUDA this waits
        for the d2h stream alone (one flag read per step), never for the whole device."""
        if not self.cuda:
            return self._cpu_finite
        assert self.d2h is not None and self._flag is not None and self._flag_host is not None
        with torch.cuda.stream(self.d2h):
            self._flag_host.copy_(self._flag, non_blocking=True)
            ev = _host_event()
            ev.record(self.d2h)
        ev.synchronize()
        return not bool(self._flag_host.item())

    # ---- host to device: weights ----------------------------------------------------

    def load_in(self, dst: torch.Tensor, src: torch.Tensor, after: Event = None) -> Event:
        """Copy host `src` into device `dst` (non-blocking on the h2d stream, after
        `after`, e.g. the compute stream's end of backward); returns the copy's event.
        On a CPU (or when dst is on the host) it copies now and returns None."""
        if not self.cuda or dst.device.type == "cpu":
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
            return None
        assert self.h2d is not None
        with torch.cuda.stream(self.h2d):
            if after is not None:
                self.h2d.wait_event(after)
            dst.copy_(src, non_blocking=True)
            ev = _host_event()
            ev.record(self.h2d)
        return ev


def _host_event() -> Event:
    """An event a host thread may wait on. blocking=True: the waiting thread sleeps
    instead of spinning a core (the default), which took cores from the shards and from
    backward's own thread while every push stream waited for its copies."""
    return torch.cuda.Event(blocking=True)


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    from psar.trainkit.finite import all_finite

    return all_finite(tensors)


def _flag_nonfinite(tensors: list[torch.Tensor], flag: torch.Tensor) -> None:
    """Set `flag` (a device float) to 1 if any tensor holds inf/nan, without a host sync:
    the fused kernel torch.amp.GradScaler uses, with a scale of 1 (values unchanged)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    one = torch.ones(1, device=flag.device)
    for group in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, one)
