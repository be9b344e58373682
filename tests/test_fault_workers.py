"""Workers come and go: kill -9 a worker in async, ssp and sync mode and the others
finish (its lease expires: a short --lease-s here); a worker with fewer steps leaves
cleanly and nobody waits for it."""

from __future__ import annotations

import pytest

from tests.fault_procs import Workers, shard_set, stats, wait_until

LEASE = ["--lease-s", "2", "--join-grace-s", "30"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode", [pytest.param("async", marks=pytest.mark.slow), "ssp", "sync"]
)  # async: as ssp, no bound
def test_killed_worker_expires_and_the_others_finish(tmp_path, mode: str) -> None:
    steps = 24
    with shard_set(1, tmp_path, *LEASE) as (shard,):
        workers = Workers([shard.address], 3, tmp_path, ["--steps", str(steps), "--mode", mode,
                          "--staleness", "1", "--emulate-compute-ms", "60"])  # fmt: skip
        try:
            wait_until(lambda: stats([shard.address])[0]["worker_clocks"][2] >= 4, 120, "clock")
            workers.kill9(2)
            reports = workers.wait([0, 1])
            # async may finish before the dead worker's lease runs out; it does run out.
            wait_until(lambda: stats([shard.address])[0]["lease_expirations"] == 1, 60, "expiry")
            final = stats([shard.address])[0]
        finally:
            workers.close()
    assert [len(r["losses"]) for r in reports] == [steps, steps]
    assert final["worker_clocks"][:2] == [steps, steps] and final["worker_clocks"][2] < steps
    assert final["live_worker_ids"] == []  # 0 and 1 left, 2 expired
    if mode == "sync":
        # Every round closed, the late ones with the two live workers only.
        assert final["rounds"] == steps and final["updates_applied"] == steps


def test_worker_with_fewer_steps_leaves_and_nobody_waits(tmp_path) -> None:
    with shard_set(1, tmp_path) as (shard,):
        workers = Workers([shard.address], 2, tmp_path, ["--mode", "sync"],
                          per_rank={0: ["--steps", "6"], 1: ["--steps", "11"]})  # fmt: skip
        try:
            reports = workers.wait()
            final = stats([shard.address])[0]
        finally:
            workers.close()
    assert [len(r["losses"]) for r in reports] == [6, 11]
    assert final["rounds"] == 11 and final["lease_expirations"] == 0
