"""trainkit/device_io.py and the PS client's staging on a real CUDA device.

Skipped without CUDA (CI has none); bench/gpu/session.sh runs it on a GPU machine. The
same logic runs on a CPU in tests/test_device_io.py.
"""

from __future__ import annotations

import pytest
import torch

from psar.ps.client.overlap import PushBuckets
from psar.ps.client.pull_gate import PullGate
from psar.ps.partition import plan_slots
from psar.trainkit.device_io import DeviceIO, state_to_host, to_host

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def io() -> DeviceIO:
    return DeviceIO(torch.device("cuda", 0))


def test_host_buffers_are_pinned_and_streams_exist(io: DeviceIO) -> None:
    assert io.cuda and io.d2h is not None and io.h2d is not None
    assert io.host_buffer(16, torch.float16).is_pinned()
    assert io.mark() is not None


def test_stage_out_casts_on_device_and_flags_overflow_without_a_device_sync(
    io: DeviceIO,
) -> None:
    src = torch.randn(1 << 20, device="cuda")
    buf = io.host_buffer(src.numel(), torch.float16)
    io.begin_finite()
    ev = io.stage_out([(src, buf)], after=io.mark())
    io.wait_host(ev)
    assert torch.equal(buf, src.half().cpu())
    assert io.finite()
    big = torch.full((8,), 1e6, device="cuda")  # finite in fp32, inf in fp16
    io.stage_out([(big, io.host_buffer(8, torch.float16))], after=io.mark())
    assert not io.finite()
    io.begin_finite()
    assert io.finite()


def test_load_in_waits_for_the_compute_stream_and_lands_on_the_device(io: DeviceIO) -> None:
    dst = torch.zeros(1 << 20, device="cuda")
    src = io.host_buffer(dst.numel(), torch.float32).copy_(torch.arange(dst.numel()))
    # A long kernel on the compute stream reads dst; the copy must come after it.
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(10):
        a = a @ a / 2048
    done = io.mark()
    ev = io.load_in(dst, src, after=done)
    io.wait_device(ev)
    assert torch.equal(dst.cpu(), src)


def test_state_to_host_moves_nested_state() -> None:
    opt_state = {"state": {0: {"exp_avg": torch.ones(3, device="cuda")}}, "lr": [0.1]}
    out = state_to_host(opt_state)
    assert out["state"][0]["exp_avg"].device.type == "cpu" and out["lr"] == [0.1]
    assert to_host(torch.ones(2, device="cuda"), torch.float16).dtype == torch.float16


def test_push_buckets_send_cuda_gradients_through_pinned_buffers(io: DeviceIO) -> None:
    params = {
        "a": torch.zeros(1000, device="cuda", requires_grad=True),
        "b": torch.zeros(300, device="cuda", requires_grad=True),
    }
    slots = plan_slots([("a", 1000), ("b", 300)], 2, chunk_bytes=1 << 10)
    send = {s.key: io.host_buffer(s.numel, torch.float16) for s in slots}
    buckets = PushBuckets(
        params,
        slots,
        send,
        num_shards=2,
        bucket_bytes=1024,
        on_first_bucket=lambda: None,
        io=io,
    )
    buckets.attach()
    buckets.begin_step()
    x = torch.randn(1300, device="cuda")
    (torch.cat([params["a"], params["b"]]) * x).sum().backward()
    assert buckets.finish() is True
    items = [it for shard in range(2) for it in buckets.items(shard, replay=True)]
    got = {it[1]: it[3] for it in items if it[0] == "data"}
    for s in slots:
        want = params[s.param].grad.reshape(-1)[s.start : s.start + s.numel].half().cpu()
        assert torch.equal(got[s.key], want), s.key
    buckets.begin_step()
    (torch.cat([params["a"], params["b"]]) * 1e6).sum().backward()  # fp16 overflow
    assert buckets.finish() is False
    buckets.detach()


def test_pull_gate_copies_each_completed_slot_to_its_parameter(io: DeviceIO) -> None:
    w = torch.zeros(5000, device="cuda")
    slots = plan_slots([("w", 5000)], 1, chunk_bytes=4096)
    recv = {s.key: io.host_buffer(s.numel, torch.float32) for s in slots}
    views = {s.key: w[s.start : s.start + s.numel] for s in slots}
    gate = PullGate(slots, io, lambda k: io.load_in(views[k], recv[k], after=io.mark()))
    gate.begin()
    for s in slots:
        recv[s.key].copy_(torch.arange(s.start, s.start + s.numel, dtype=torch.float32))
        gate.landed(s.key, 0, s.numel)
    gate.wait([s.key for s in slots])
    assert torch.equal(w.cpu(), torch.arange(5000, dtype=torch.float32))
