"""A restarted worker re-registers, pulls the newest weights and continues from the
shards' record of its clock (sync: at the next round boundary). Counted in metrics
(psar_ps_worker_rejoins_total) and in Stats."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import procs
from tests.fault_procs import Workers, shard_set, stats, wait_until

LEASE = ["--lease-s", "2", "--join-grace-s", "30"]


# async is the simpler case (and test_fault_restore covers its clock adoption): slow.
@pytest.mark.slow
@pytest.mark.parametrize("mode", [pytest.param("async", marks=pytest.mark.slow), "sync"])
def test_restarted_worker_rejoins_and_continues(tmp_path, mode: str) -> None:
    steps = 60
    args = ["--steps", str(steps), "--mode", mode, "--emulate-compute-ms", "50"]
    with shard_set(1, tmp_path, *LEASE) as (shard,):
        addr = [shard.address]
        workers = Workers(addr, 2, tmp_path, args)
        try:
            wait_until(lambda: stats(addr)[0]["worker_clocks"][1] >= 4, 120, "clock")
            workers.kill9(1)
            wait_until(lambda: stats(addr)[0]["lease_expirations"] == 1, 60, "expiry")
            killed_at = stats(addr)[0]["worker_clocks"][1]
            workers.restart(addr, 1, args)
            reports = workers.wait()
            final = stats(addr)[0]
        finally:
            workers.close()
    again = reports[1]
    assert again["rejoined"] and final["rejoins"] == 1
    assert len(reports[0]["losses"]) == steps
    assert final["worker_clocks"] == [steps, steps]
    if mode == "async":
        # It continued from the clock the shard had recorded for it.
        assert again["start_step"] == killed_at
    else:
        # It joined at a round boundary after the rounds that closed without it.
        assert again["start_step"] >= killed_at
        assert final["rounds"] == steps
    assert len(again["losses"]) == steps - again["start_step"]
    # It trained on from the shared weights, not from its own fresh initialisation:
    # its first losses are those of a model some way into training.
    first = sum(again["losses"][:5]) / 5
    assert first < sum(reports[0]["losses"][:5]) / 5 - 0.03


@pytest.mark.slow  # the default run checks integer buffers against DDP in the zoo (batchnorm)
def test_a_restarted_worker_takes_rank_0s_integer_buffers(tmp_path, monkeypatch) -> None:
    """BatchNorm's num_batches_tracked travels exactly in shard 0's headers (issue #17):
    a worker relaunched mid-job ends with the count rank 0 has (one per training
    forward of the job), not with the forwards of its own second life."""
    monkeypatch.setitem(procs.ENV, "PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    steps = 40
    args = ["--steps", str(steps), "--mode", "sync", "--emulate-compute-ms", "50",
            "--workload", "tests.zoo_workloads:make", "--workload-option", "model=batchnorm",
            "--precision", "bf16", "--eval-batches", "0"]  # fmt: skip
    with shard_set(2, tmp_path, *LEASE) as shards:
        addr = [s.address for s in shards]
        workers = Workers(addr, 2, tmp_path, args)
        try:
            wait_until(lambda: stats(addr)[0]["worker_clocks"][1] >= 4, 120, "clock")
            workers.kill9(1)
            wait_until(lambda: stats(addr)[0]["lease_expirations"] == 1, 60, "expiry")
            workers.restart(addr, 1, args)
            reports = workers.wait()
        finally:
            workers.close()
    again = reports[1]
    assert again["rejoined"] and again["start_step"] > 0
    # bf16 on the wire holds integers exactly only up to 256: these came in headers.
    assert reports[0]["int_buffers"] == {"norm.num_batches_tracked": [steps]}
    assert again["int_buffers"] == reports[0]["int_buffers"]
