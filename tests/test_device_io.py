"""trainkit/device_io.py: the host<->device rules, run on a CPU (the GPU side runs in
bench/gpu/check.py), and the PS client's use of them (PushBuckets, PullGate)."""

from __future__ import annotations

import threading

import pytest
import torch

from psar.ps import wire
from psar.ps.client.overlap import PushBuckets
from psar.ps.client.pull_gate import PullGate
from psar.ps.partition import plan_slots
from psar.trainkit.device_io import DeviceIO, state_to_host, to_device, to_host

CPU = torch.device("cpu")


def test_to_host_keeps_a_cpu_tensor_and_casts_on_request() -> None:
    t = torch.arange(4, dtype=torch.float32)
    assert to_host(t) is t or to_host(t).data_ptr() == t.data_ptr()
    h = to_host(t, torch.float16)
    assert h.dtype == torch.float16 and h.tolist() == [0, 1, 2, 3]
    assert to_device(t, CPU) is t
    s = state_to_host({"w": t, "n": 3})
    assert s["n"] == 3 and s["w"].device.type == "cpu"


def test_cpu_io_has_no_streams_events_or_pinned_memory() -> None:
    io = DeviceIO(CPU)
    assert not io.cuda and io.d2h is None and io.h2d is None
    assert io.mark() is None
    buf = io.host_buffer(8, torch.float16)
    assert buf.dtype == torch.float16 and buf.numel() == 8 and not buf.is_pinned()
    io.wait_host(None)
    io.wait_device(None)


def test_stage_out_casts_copies_and_tracks_finiteness_of_the_cast_values() -> None:
    io = DeviceIO(CPU)
    io.begin_finite()
    src = torch.tensor([1.0, -2.0, 3.0])
    buf = torch.empty(3, dtype=torch.float16)
    assert io.stage_out([(src, buf)], after=None) is None
    assert buf.tolist() == [1.0, -2.0, 3.0] and io.finite()
    # 1e6 is finite in fp32 but overflows fp16: the wire value decides.
    io.stage_out([(torch.tensor([1e6]), torch.empty(1, dtype=torch.float16))], after=None)
    assert not io.finite()
    io.begin_finite()
    assert io.finite()
    same = torch.tensor([float("nan")])
    io.stage_out([(same, same)], after=None)  # a zero-copy piece is checked too
    assert not io.finite()


def test_load_in_copies_into_the_destination() -> None:
    io = DeviceIO(CPU)
    dst, src = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    assert io.load_in(dst, src, after=None) is None
    assert dst.tolist() == [1.0, 2.0, 3.0]
    assert io.load_in(dst, dst) is None  # the same memory: nothing to do


def test_the_wire_refuses_device_tensors_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="stage it in host memory"):
        wire.as_bytes_view(torch.empty(4, device="meta"))


class RecordingIO(DeviceIO):
    """A CPU DeviceIO that records what the gate asks of the device (pure logic)."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.device_waits: list[object] = []
        self.host_waits: list[object] = []

    def wait_device(self, event: object) -> None:
        self.device_waits.append(event)

    def wait_host(self, event: object) -> None:
        self.host_waits.append(event)


def _slots() -> list:
    return plan_slots([("a", 6), ("b", 4)], 1, chunk_bytes=1 << 20)


def test_gate_starts_each_slot_copy_once_complete_and_forward_waits_on_its_event() -> None:
    io, started = RecordingIO(), []

    def on_slot(key: str) -> str:
        started.append(key)
        return f"event-{key}"

    slots = _slots()
    gate = PullGate(slots, io, on_slot)
    gate.begin()
    a, b = (s.key for s in slots)
    gate.landed(a, 0, 3)
    assert started == []  # half a slot: nothing to copy yet
    gate.landed(a, 3, 3)
    assert started == [a]
    waiter = threading.Thread(target=gate.wait, args=([a],))
    waiter.start()
    waiter.join(5)
    assert not waiter.is_alive() and io.device_waits == [f"event-{a}"]
    gate.landed(b, 0, 4)
    gate.settle_device()
    assert sorted(io.device_waits[1:]) == sorted([f"event-{a}", f"event-{b}"])
    gate.begin()  # the next pull reuses the host buffers: the copies must be done
    assert sorted(io.host_waits) == sorted([f"event-{a}", f"event-{b}"])


def test_gate_loaded_all_copies_every_slot_and_opens() -> None:
    io, started = RecordingIO(), []
    slots = _slots()
    gate = PullGate(slots, io, lambda k: started.append(k) or k)
    gate.begin()
    gate.loaded_all()
    assert sorted(started) == sorted(s.key for s in slots)
    assert sorted(io.device_waits) == sorted(started)
    gate.wait([s.key for s in slots])  # returns at once


def test_push_buckets_stage_through_the_io_and_decide_on_its_flag() -> None:
    params = {"a": torch.zeros(6, requires_grad=True), "b": torch.zeros(4, requires_grad=True)}
    slots = _slots()
    send = {s.key: torch.empty(s.numel, dtype=torch.float16) for s in slots}
    buckets = PushBuckets(
        params, slots, send, num_shards=1, bucket_bytes=1, on_first_bucket=lambda: None
    )
    buckets.begin_step()
    params["a"].grad = torch.full((6,), 2.0)
    params["b"].grad = torch.full((4,), 70000.0)  # overflows fp16 on the wire
    assert buckets.finish() is False
    buckets.begin_step()
    params["b"].grad = torch.full((4,), 3.0)
    assert buckets.finish() is True
    assert send[slots[1].key].tolist() == [3.0] * 4


class FakeEvent:
    def __init__(self) -> None:
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1


class AsyncLikeIO(DeviceIO):
    """The CUDA branch's logic (stager thread, events, the verdict left to finish())
    with CPU copies and inert events: what runs on a GPU, minus the device."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.cuda = True
        self.events: list[FakeEvent] = []

    def mark(self) -> FakeEvent:
        return FakeEvent()

    def stage_out(self, pieces, after):  # noqa: ANN001, ANN201 - the base's signature
        assert isinstance(after, FakeEvent)  # the hook's mark reaches the stager
        self.cuda = False
        try:
            super().stage_out(pieces, None)
        finally:
            self.cuda = True
        self.events.append(FakeEvent())
        return self.events[-1]

    def finite(self) -> bool:
        return self._cpu_finite

    def begin_finite(self) -> None:
        self._cpu_finite = True


def test_cuda_branch_stages_on_a_thread_and_decides_in_finish() -> None:
    io = AsyncLikeIO()
    params = {"a": torch.zeros(6, requires_grad=True), "b": torch.zeros(4, requires_grad=True)}
    slots = plan_slots([("a", 6), ("b", 4)], 2, chunk_bytes=8)
    send = {s.key: torch.empty(s.numel, dtype=torch.float16) for s in slots}
    buckets = PushBuckets(
        params, slots, send, num_shards=2, bucket_bytes=1, on_first_bucket=lambda: None, io=io
    )
    assert buckets._stager is not None
    buckets.attach()
    for scale, want in ((1.0, True), (1e6, False)):
        buckets.begin_step()
        (torch.cat([params["a"], params["b"]]) * torch.arange(10.0) * scale).sum().backward()
        assert buckets.verdict is None  # hooks never decide on CUDA: finish() does
        assert buckets.finish() is want
        streams = [list(buckets.items(shard, replay=False)) for shard in range(2)]
        data = {it[1]: it[3] for st in streams for it in st if it[0] == "data"}
        # The verdict ends every shard's stream (a finite one names its absent slots).
        assert all(st[-1][:2] == ("verdict", not want) for st in streams)
        if want:
            assert sorted(data) == sorted(s.key for s in slots)
            for s in slots:
                g = params[s.param].grad.reshape(-1)[s.start : s.start + s.numel]
                assert torch.equal(data[s.key], g.half())
        for p in params.values():
            p.grad = None
    assert io.events and all(e.waited >= 1 for e in io.events)  # senders waited for copies
    buckets.detach()
