"""Overlap changes timing, never results (issue #10).

Real processes: overlapped and non-overlapped sync runs, runs with different bucket
sizes, and shards updating per chunk or per whole round must end with bit-identical
weights. Unit tests cover the pieces:
bucket order, the push stream a hook-driven step produces (verdict last, or first on
overflow), chunks and slots arriving in any order at a shard, and the forward gate.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from psar.ps.client.overlap import PushBuckets, bucket_params
from psar.ps.client.pull_gate import PullGate
from psar.ps.partition import plan_slots
from psar.ps.server.intake.pieces import PushHeader
from psar.ps.server.shard import ShardState
from tests.procs import run_ps_workers, shards
from tests.ps_fixtures import grad_for, init_values, make_job

COMMON = ["--workload", "mlp", "--steps", "12", "--batch-size", "16", "--seed", "5",
          "--lr", "0.05", "--momentum", "0.9", "--precision", "fp32"]  # fmt: skip


def _weights(path) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return torch.load(path, weights_only=True)


def _assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


RUNS = {
    "overlap": ["--overlap", "--bucket-mib", "1"],
    "plain": ["--no-overlap"],
    "tiny-buckets": ["--overlap", "--bucket-mib", "0.001"],
    "push-only": ["--overlap", "--no-pull-overlap"],
    "chunk-rounds": ["--overlap"],  # and shards updating per chunk (below)
    # Steps 5-7 try push+pull overlap, push only and neither, then keep the fastest.
    # (--overlap-host-busy 0: the trial runs whatever the host's load)
    "trial": ["--overlap", "--overlap-trial", "3", "--overlap-host-busy", "0"],
}
SERVER = {"chunk-rounds": ["--chunk-rounds"]}  # the others: whole rounds (the default)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("num_shards", "names"),
    [
        pytest.param(1, tuple(RUNS), marks=pytest.mark.slow),
        (2, ("overlap", "plain", "chunk-rounds", "trial")),
        pytest.param(2, ("overlap", "tiny-buckets", "push-only"), marks=pytest.mark.slow),
    ],
    ids=["1-all", "2", "2-buckets-push-only"],
)
def test_overlapped_and_plain_steps_give_identical_weights(
    tmp_path, num_shards: int, names: tuple[str, ...]
) -> None:
    reports = {}
    for name in names:
        extra = RUNS[name]
        d = tmp_path / name
        d.mkdir()
        with shards(num_shards, *SERVER.get(name, [])) as addrs:  # one job per shard life
            reports[name] = run_ps_workers(
                addrs, 2, d, [*COMMON, *extra, "--save", str(d / "w.pt")]
            )
    ref = _weights(tmp_path / "overlap" / "w.pt")
    for name in names[1:]:
        _assert_bit_identical(ref, _weights(tmp_path / name / "w.pt"))
        for r in range(2):
            assert reports[name][r]["losses"] == reports["overlap"][r]["losses"]
    assert all(r["skipped_steps"] == 0 for rs in reports.values() for r in rs)
    arms = {(True, True): "push+pull", (True, False): "push", (False, False): "none"}
    for r in reports.get("trial", []):
        ms = r["overlap_trial_ms"]
        assert set(ms) == {"push+pull", "push", "none"}
        kept = arms[(r["overlap"]["push"], r["overlap"]["pull"])]
        assert ms[kept] == min(ms.values())
    assert all(r["overlap"] == {"push": False, "pull": False} for r in reports.get("plain", []))
    assert all(r["overlap"] == {"push": True, "pull": False} for r in reports.get("push-only", []))


@pytest.mark.slow
def test_workers_whose_host_is_busy_with_compute_keep_no_overlap_untried(tmp_path) -> None:
    """2 workers computing on this host's cores beside their shard: over the warm-up steps
    the host is at least 1/cores busy (each worker's compute keeps a core busy), so both
    keep no overlap without a trial and say why (ps/client/host_cpu.py)."""
    threshold = max(0.05, 1.0 / (os.cpu_count() or 1))
    heavy = ["--workload", "mlp", "--workload-option", "in_dim=784", "--workload-option",
             "hidden=2048", "--batch-size", "128", "--steps", "14", "--precision", "fp32",
             "--overlap", "--overlap-trial", "3", "--overlap-host-busy", f"{threshold:.3f}"]  # fmt: skip
    with shards(1) as addrs:
        reports = run_ps_workers(addrs, 2, tmp_path, heavy)
    for r in reports:
        assert r["overlap"] == {"push": False, "pull": False}, r
        assert "every shard is on this host" in r["overlap_untried"]
        assert "overlap_trial_ms" not in r


def _whole_vs_chunks(tmp_path, args: list[str]) -> tuple[dict, dict]:  # noqa: ANN001
    """The same 2-worker run on a whole-round shard, on a --chunk-rounds shard and with
    early pulls too: same weights, losses, one skipped step each, same shard digest.
    Returns the three shards' stats."""
    reports = {}
    runs = {"whole": ([], []), "chunks": (["--chunk-rounds"], []),
            "early": (["--chunk-rounds"], ["--early-pull"])}  # fmt: skip
    for name, (server, extra) in runs.items():
        d = tmp_path / name
        d.mkdir()
        with shards(1, *server) as addrs:
            reports[name] = run_ps_workers(addrs, 2, d, [*args, *extra, "--save", str(d / "w.pt")])
    for name in ("chunks", "early"):
        _assert_bit_identical(
            _weights(tmp_path / "whole" / "w.pt"), _weights(tmp_path / name / "w.pt")
        )
        for r in range(2):
            assert reports[name][r]["losses"] == reports["whole"][r]["losses"]
            assert reports[name][r]["skipped_steps"] == reports["whole"][r]["skipped_steps"] == 1
    whole, chunks = reports["whole"][0]["shards"][0], reports["chunks"][0]["shards"][0]
    assert chunks["state_digest"] == whole["state_digest"]
    early = reports["early"][0]["shards"][0]
    assert early["state_digest"] == whole["state_digest"]
    assert early["early_pull_slots"] > 0  # the rounds that closed streamed slots early
    return whole, chunks, early


@pytest.mark.slow
def test_per_chunk_rounds_undo_an_overflowing_round_and_keep_the_bits(tmp_path) -> None:
    """fp16 with an overflow injected at step 4 (rank 0): shards updating per chunk undo
    that round's early slots and skip it, exactly as whole-round shards skip it."""
    args = ["--workload", "mlp", "--steps", "8", "--batch-size", "16", "--seed", "5",
            "--lr", "0.05", "--momentum", "0.9", "--precision", "fp16",
            "--inject-overflow-step", "4", "--loss-scale-init-scale", "1024"]  # fmt: skip
    whole, chunks, _ = _whole_vs_chunks(tmp_path, args)
    assert whole["chunks_applied_early"] == whole["chunk_undos"] == 0
    assert chunks["chunks_applied_early"] > 0
    assert chunks["skipped_rounds"] == whole["skipped_rounds"] == 1


@pytest.mark.slow  # default run under 10 minutes; CI runs -m slow too
def test_a_late_overflow_undoes_the_slots_already_updated(tmp_path) -> None:
    """The first layer's gradient turns inf (step 4, both workers) after the other
    layers' buckets reached the shard, which with --chunk-rounds has updated those slots:
    the verdict undoes them, and the run ends as on a whole-round shard, bit for bit."""
    args = ["--workload", "tests.user_workloads:make_late_overflow", "--steps", "8",
            "--batch-size", "16", "--seed", "5", "--precision", "fp32", "--lr", "0.05",
            "--momentum", "0.9", "--bucket-mib", "0.0001", "--overlap-trial", "0"]  # fmt: skip
    whole, chunks, early = _whole_vs_chunks(tmp_path, args)
    assert whole["chunk_undos"] == 0
    assert chunks["chunk_undos"] >= 1  # the overflowing round had slots to undo
    # The early pulls had sent those slots: at the close their header said so, and
    # every slot went again (the worker never let the undone ones into its weights).
    assert early["early_pull_voids"] >= 1


def test_buckets_follow_backward_order_and_never_split_a_parameter() -> None:
    params = {n: torch.zeros(k) for n, k in [("a", 10), ("b", 300), ("c", 20), ("d", 5)]}
    got = bucket_params(params, bucket_bytes=4 * 100, itemsize=4)
    assert got == [["d", "c"], ["b"], ["a"]]
    assert bucket_params(params, bucket_bytes=1 << 30, itemsize=4) == [["d", "c", "b", "a"]]
    assert bucket_params(params, bucket_bytes=1, itemsize=4) == [["d"], ["c"], ["b"], ["a"]]


def _model_and_buckets(bucket_bytes: int, num_shards: int = 2):  # noqa: ANN202
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    params = dict(model.named_parameters())
    slots = plan_slots([(n, p.numel()) for n, p in params.items()], num_shards, chunk_bytes=64)
    send = {s.key: torch.empty(s.numel) for s in slots}
    started = []
    b = PushBuckets(
        params,
        slots,
        send,
        num_shards=num_shards,
        bucket_bytes=bucket_bytes,
        on_first_bucket=lambda: started.append(time.perf_counter()),
    )
    b.attach()
    return model, params, slots, send, b, started


def _drain(b: PushBuckets, shard: int, replay: bool = False) -> list[tuple]:
    return [(i[0], i[1]) for i in b.items(shard, replay)]


def test_hooks_fill_buckets_during_backward_and_the_verdict_comes_last() -> None:
    model, params, slots, send, b, started = _model_and_buckets(bucket_bytes=40)
    b.begin_step()
    model(torch.randn(4, 6)).pow(2).sum().backward()
    assert started, "the first full bucket must open the push during backward"
    assert all(b._filled), "every parameter got a gradient: every bucket filled in backward"
    assert b.finish() is True
    for shard in range(2):
        got = _drain(b, shard)
        keys = [k for kind, k in got if kind == "data"]
        assert keys == [s.key for bucket in b.buckets for s in bucket if s.shard == shard], (
            "slots go out bucket by bucket, in backward order"
        )
        assert got[-1] == ("verdict", False)
        assert _drain(b, shard, replay=True) == got, "a retry re-sends the same stream"
    for s in slots:  # the send buffers hold exactly the gradients
        flat = params[s.param].grad.reshape(-1)[s.start : s.start + s.numel]
        assert torch.equal(send[s.key], flat)


def test_overflow_verdict_goes_first_and_stops_the_stream() -> None:
    model, _params, _slots, _send, b, _ = _model_and_buckets(bucket_bytes=1 << 20)
    b.begin_step()
    (model(torch.randn(4, 6)).sum() * float("inf")).backward()
    assert b.finish() is False
    for shard in range(2):
        assert _drain(b, shard) == [("verdict", True)]
        assert _drain(b, shard, replay=True) == [("verdict", True)]


def test_accumulating_micro_batches_push_nothing() -> None:
    model, _params, _slots, _send, b, started = _model_and_buckets(bucket_bytes=40)
    b.begin_step()
    b.accumulating = True
    model(torch.randn(4, 6)).sum().backward()
    b.accumulating = False
    assert not started and not any(b._filled)
    model(torch.randn(4, 6)).sum().backward()  # the last micro-batch pushes
    assert started and all(b._filled)


def test_unused_parameters_are_filled_with_zeros_by_finish() -> None:
    model, params, slots, send, b, _ = _model_and_buckets(bucket_bytes=40)
    b.begin_step()
    model[0](torch.randn(4, 6)).sum().backward()  # the last layer gets no gradient
    assert not all(b._filled)
    assert b.finish() is True
    for s in slots:
        if s.param.startswith("2."):
            assert torch.count_nonzero(send[s.key]) == 0


def test_forward_waits_only_for_its_own_layer() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    params = dict(model.named_parameters())
    slots = plan_slots([(n, p.numel()) for n, p in params.items()], 1)
    gate = PullGate(slots)
    gate.attach(model, params)
    gate.begin()
    reached: list[str] = []
    model[1].register_forward_pre_hook(lambda *_: reached.append("layer1"))
    t = threading.Thread(target=lambda: model(torch.randn(1, 4)))
    t.start()
    first = [s for s in slots if s.param.startswith("0.")]
    for s in first:
        gate.landed(s.key, 0, s.numel)
    time.sleep(0.2)  # the layer-0 forward may run now; layer 1 must still wait
    assert t.is_alive() and reached == []
    for s in slots:
        if s not in first:
            gate.landed(s.key, 0, s.numel)
    t.join(5)
    assert not t.is_alive() and reached == ["layer1"]


def test_slot_and_chunk_arrival_order_does_not_change_the_round() -> None:
    """Two sync shards take the same pushes, pieces sent in different orders and with
    the verdict before or after the data: same weights and optimizer state, bit for bit."""
    job = make_job("sync", num_workers=2)
    digests = []
    for order in ("forward", "reverse"):
        st = ShardState(message_bytes=16)
        st.init(job, init_values(job))

        workers = [1, 0] if order == "reverse" else [0, 1]
        for w in workers:
            g = grad_for(job, w, 1)
            h = PushHeader(
                worker=w, clock=1, base_version=0, dtype=torch.float32, verdict_follows=True
            )
            ticket = st.intake.begin_push(h)
            keys = list(g) if order == "forward" else list(reversed(g))
            if order == "reverse":
                st.intake.add_verdict(ticket, False)  # the verdict may precede the last data
            for k in keys:
                flat = g[k]
                pieces = [(o, flat[o : o + 3]) for o in range(0, flat.numel(), 3)]
                for off, piece in pieces:
                    st.intake.add_data(ticket, k, off, piece.numpy().tobytes())
            if order == "forward":
                st.intake.add_verdict(ticket, False)
            st.intake.finish_push(ticket)
        assert st.rounds == 1
        digests.append(st.state_digest())
    assert digests[0] == digests[1]


def test_a_step_whose_pull_failed_midway_is_skipped_not_pushed() -> None:
    """The background pull fails after a forward already ran on part of its weights: the
    worker pulls again in full, and that step's gradient (of mixed weights) is never
    pushed; the next step pushes the same clock. Real shard in-process; the failure is
    planted where the pulling thread would report it."""
    from concurrent.futures import Future

    from psar.ps.client.backend import PSBackend
    from psar.ps.client.errors import NeedsResync
    from psar.trainkit.backend import BackendContext
    from psar.trainkit.config import PSConfig, TrainConfig
    from psar.trainkit.precision import resolve
    from tests.ps_fixtures import serving

    with serving() as (port, state):
        cfg = TrainConfig(arch="ps", ps=PSConfig(servers=f"127.0.0.1:{port}", rank=0, world_size=1))
        precision = resolve(torch.device("cpu"), "fp32", "fp32", "fp32")
        b = PSBackend(BackendContext(cfg, precision, rank=0, world_size=1, total_steps=100))
        torch.manual_seed(0)
        m = b.setup(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)))

        def step() -> object:
            m.zero_grad(set_to_none=True)
            m(torch.randn(4, 6)).pow(2).sum().backward()
            return b.step()

        assert not step().skipped and b.clock == 1
        b.overlap.await_pull()
        failed: Future = Future()
        failed.set_exception(NeedsResync(0, "x", None, "restored: planted for the test"))
        b.overlap.pull_future = failed
        b.overlap.gate.begin()
        b.overlap.gate.consumed = True  # a module already ran on the failed pull's weights
        b.overlap.gate.fail()
        out = step()
        assert out.skipped and b.clock == 1 and b.faults.resyncs == 1
        assert b.report(final=True)["unsent_steps"] == 1
        assert state.stats()["worker_clocks"] == [1], "the mixed gradient was not pushed"
        assert not step().skipped and b.clock == 2
        assert state.stats()["worker_clocks"] == [2] and state.rounds == 2
        b.finish()


@pytest.mark.slow
def test_a_worker_whose_backward_fails_mid_push_exits_with_the_error(tmp_path) -> None:
    """Later layers' buckets are already streaming when the first layer's backward
    raises: the worker must exit non-zero with the error, not hang on its push threads."""
    import subprocess

    from tests.procs import ENV, PSAR

    with shards(1) as addrs:
        p = subprocess.run(
            [*PSAR, "train", "--arch", "ps", "--servers", addrs[0], "--world-size", "1",
             "--workload", "tests.user_workloads:make_failing", "--steps", "10",
             "--bucket-mib", "0.0001", "--log-every", "0"],
            capture_output=True, text=True, env=ENV, timeout=120,
        )  # fmt: skip
    assert p.returncode != 0
    assert "user backward failed on purpose" in p.stderr + p.stdout
