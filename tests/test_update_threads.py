"""The shard's update on several threads (`psar server --torch-threads N|auto`,
ps/server/update/stepper.py): bit-identical to one thread in every mode, with per-chunk rounds,
a learning-rate schedule and a restore; the update rate in Stats and /metrics; the flag.
"""

from __future__ import annotations

import argparse
import threading
import warnings

import pytest
import torch

from psar.ps.server.config import SHARDS_PER_HOST_ENV, ServerConfig
from psar.ps.server.metrics.prometheus import ShardMetrics
from psar.ps.server.shard import ShardState
from psar.ps.server.update import stepper
from psar.trainkit.cli_gen import add_flags, build
from tests.ps_fixtures import grad_for, init_values, make_job, optimizer_config, pull, push


@pytest.fixture(autouse=True)
def _pool_for_tiny_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test slots are tiny: use the pool anyway (the threshold only saves time)."""
    monkeypatch.setattr(stepper, "MIN_PARALLEL_NUMEL", 0)


def _run(mode: str, opt: str, threads: int, *, chunk_rounds: bool = False, clocks: int = 4):
    cfg = optimizer_config(opt, schedule="warmup_cosine", warmup_steps=2, total_steps=8)
    job = make_job(mode, num_workers=2, optimizer=cfg, staleness=1)
    st = ShardState(chunk_rounds=chunk_rounds, update_threads=threads)
    st.init(job, init_values(job))
    for c in range(1, clocks + 1):
        base = st.version
        for w in (1, 0):
            push(st, worker=w, clock=c, base_version=base, grads=grad_for(job, w, c))
        pull(st, 0, c, timeout=5.0)
    return st, job


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize(
    ("mode", "chunk_rounds"),
    [("sync", False), ("sync", True), ("async", False), ("ssp", False)],
    ids=["sync", "chunked-sync", "async", "ssp"],
)
def test_threads_give_the_same_bits(mode: str, chunk_rounds: bool, opt: str) -> None:
    one, _ = _run(mode, opt, 1, chunk_rounds=chunk_rounds)
    many, _ = _run(mode, opt, 3, chunk_rounds=chunk_rounds)
    assert many.stepper._views  # per-slot optimizers stepped (early ones: the applier's)
    assert one.state_digest() == many.state_digest()
    assert one.scheduler.last_epoch == many.scheduler.last_epoch > 0


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_chunked_round_closed_by_a_leave_steps_its_slots_on_the_pool(opt: str) -> None:
    """Nothing can be applied early (worker 2 never pushes clock 2): the round's close,
    when worker 2 leaves, applies every slot through the pool."""
    digests = []
    for threads in (1, 3):
        job = make_job("sync", num_workers=3, optimizer=opt)
        st = ShardState(chunk_rounds=True, update_threads=threads)
        st.init(job, init_values(job))
        for c, workers in ((1, (0, 1, 2)), (2, (1, 0))):
            base = st.version
            for w in workers:
                push(st, worker=w, clock=c, base_version=base, grads=grad_for(job, w, c))
        st.policy.quiesce()
        assert st.rounds == 1
        st.members.leave(2)
        assert st.rounds == 2
        assert (st.stepper._pool is not None) == (threads > 1)
        digests.append(st.state_digest())
    assert digests[0] == digests[1]


def test_the_pool_steps_on_its_own_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    names: set[str] = set()
    step = stepper.SlotStepper._view_step

    def spy(self, st, keys):  # noqa: ANN001, ANN202
        names.add(threading.current_thread().name)
        return step(self, st, keys)

    monkeypatch.setattr(stepper.SlotStepper, "_view_step", spy)
    _run("async", "adamw", 2, clocks=1)
    assert names and all(n.startswith("psar-update") for n in names)


def test_no_scheduler_warning_without_optimizer_step() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()"
        _run("sync", "adamw", 2, clocks=2)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_restored_shard_keeps_stepping_the_same_bits(threads: int) -> None:
    """Also mid-schedule: a restore once resumed warmup_cosine at its first lr (the
    scheduler was rebuilt after the optimizer's saved lr was loaded)."""
    one, job = _run("sync", "adamw", 1, clocks=2)
    many, _ = _run("sync", "adamw", threads, clocks=2)
    with many.cond:
        snap = many.durability.snapshot()
    back = ShardState(update_threads=threads)
    back.durability.restore(
        many.durability.checkpoint_step, snap
    )  # new masters: the per-slot optimizers follow
    for st in (one, back):
        base = st.version
        for w in (0, 1):
            push(st, worker=w, clock=3, base_version=base, grads=grad_for(job, w, 3))
    assert back.state_digest() == one.state_digest()


def test_update_rate_in_stats_and_metrics() -> None:
    metrics = ShardMetrics()
    job = make_job("async", num_workers=1)
    st = ShardState(metrics=metrics, update_threads=2)
    st.init(job, init_values(job))
    assert st.stats()["update_params_per_s"] == 0.0
    for c in (1, 2, 3):
        push(st, worker=0, clock=c, base_version=st.version, grads=grad_for(job, 0, c))
    numel = sum(s.numel for s in job.slots)
    assert st.stepper.params_updated == 3 * numel
    assert st.stats()["update_params_per_s"] == pytest.approx(3 * numel / st.stepper.update_seconds)
    text = metrics.exposition().decode()
    assert f'psar_ps_params_updated_total{{mode="async",shard="0"}} {3 * numel}.0' in text
    assert "psar_ps_update_seconds_total" in text


# ---- the flag ------------------------------------------------------------------------


def _parse(*argv: str) -> ServerConfig:
    p = argparse.ArgumentParser()
    add_flags(p, ServerConfig)
    return build(ServerConfig, p.parse_args(list(argv)))


def test_flag_accepts_numbers_and_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(12)))
    assert _parse().torch_threads == "auto"  # the default: sized from the host's cores
    assert _parse().update_threads({}) == 12
    assert _parse("--torch-threads", "6").update_threads() == 6
    assert _parse("--torch-threads", "0").update_threads() == 1  # torch's own threads
    auto = _parse("--torch-threads", "AUTO")
    assert auto.torch_threads == "auto"
    assert auto.update_threads({}) == 12
    assert auto.update_threads({SHARDS_PER_HOST_ENV: "5"}) == 2
    assert auto.update_threads({SHARDS_PER_HOST_ENV: "40"}) == 1  # at least one
    assert ServerConfig(torch_threads=4).torch_threads == "4"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=SHARDS_PER_HOST_ENV):
        auto.update_threads({SHARDS_PER_HOST_ENV: "0"})


@pytest.mark.parametrize("bad", ["-1", "two", "", "1.5"])
def test_flag_refuses_anything_else(bad: str) -> None:
    with pytest.raises(ValueError, match=r"--torch-threads: .*>= 0 or 'auto'"):
        ServerConfig(torch_threads=bad)


def test_torch_keeps_one_thread_unless_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    stepper.apply_torch_threads("auto")
    stepper.apply_torch_threads("4")
    stepper.apply_torch_threads("0")
    assert calls == [1, 1]
