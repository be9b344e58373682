"""kill -9 a shard mid-run, restart it with --restore on the same address: the job
finishes, the loss continues from the checkpoint, and the workers report how many
updates the restore rolled back (at most one checkpoint interval).

Workers compute for a fixed --emulate-compute-ms per step, so the shard is killed
while the job is running; the tests check counts and orderings, never wall time.
"""

from __future__ import annotations

import pytest

from tests.fault_procs import Shard, Workers, shard_set, stats, wait_until

EVERY = 5


@pytest.mark.slow
def test_async_shard_killed_and_restored_job_finishes(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    steps = 30
    with shard_set(1, tmp_path, "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY),
                   "--lease-s", "5") as (shard,):  # fmt: skip
        workers = Workers([shard.address], 2, tmp_path, ["--steps", str(steps), "--mode", "async",
                          "--emulate-compute-ms", "60"])  # fmt: skip
        try:
            wait_until(lambda: stats([shard.address])[0]["version"] >= 2 * EVERY + 2, 120, "v>=12")
            shard.kill9()
            shard.start("--restore", str(ckpt))
            assert "restored step" in shard.output()
            reports = workers.wait()
            final = stats([shard.address])[0]
        finally:
            workers.close()
    for rep in reports:
        assert len(rep["losses"]) == steps
        assert rep["restores"] == 1
        assert 0 <= rep["rolled_back_updates"] <= 2 * EVERY
    assert final["restores"] == 1 and final["restored_step"] % EVERY == 0
    assert final["restored_step"] >= 2 * EVERY
    # Every push after the restore was applied on top of the checkpoint.
    lost = max(r["rolled_back_updates"] for r in reports)
    unsent = [r["unsent_steps"] for r in reports]
    assert final["version"] >= 2 * steps - 2 * EVERY - lost - sum(unsent)
    # Every step pushed once, except one whose forward ran on weights a background pull
    # was still landing when the shard died (it is skipped, never pushed): at most one
    # per worker for the one kill.
    assert all(0 <= u <= 1 for u in unsent)
    assert final["worker_clocks"] == [steps - u for u in unsent]
    # The loss went on from where the checkpoint left it, not from the start.
    for rep in reports:
        assert rep["losses"][-1] < rep["losses"][0]


# early-pull: shards with per-chunk rounds, workers pulling while they push (the pulls in
# flight when the shard dies are cut short and redone after the resync).
PIPELINED = {"whole-rounds": ([], []), "early-pull": (["--chunk-rounds"], ["--early-pull"])}


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant", ["whole-rounds", pytest.param("early-pull", marks=pytest.mark.slow)]
)
def test_sync_one_of_two_shards_killed_every_shard_continues_from_the_same_round(
    tmp_path, variant: str
) -> None:
    ckpt = tmp_path / "ckpt"
    steps = 30
    server, train = PIPELINED[variant]
    with shard_set(2, tmp_path, "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY),
                   "--lease-s", "5", *server) as shards:  # fmt: skip
        addrs = [s.address for s in shards]
        workers = Workers(addrs, 2, tmp_path, ["--steps", str(steps), "--mode", "sync",
                          "--emulate-compute-ms", "60", "--chunk-mib", "0.005", *train])  # fmt: skip
        try:
            wait_until(lambda: stats(addrs)[1]["rounds"] >= 2 * EVERY + 2, 120, "rounds>=12")
            shards[1].kill9()
            shards[1].start("--restore", str(ckpt))
            reports = workers.wait()
            final = stats(addrs)
        finally:
            workers.close()
    # Shard 1 came back at a checkpointed round; shard 0 was rolled back to the same one,
    # so both applied exactly the same rounds.
    assert final[1]["restores"] == 1 and final[0]["restores"] == 1
    assert final[0]["restored_step"] == final[1]["restored_step"]
    assert final[0]["rounds"] == final[1]["rounds"]
    assert final[0]["updates_applied"] == final[1]["updates_applied"]
    for rep in reports:
        assert rep["restores"] == 1
        assert 0 < rep["rolled_back_updates"] <= EVERY + 1
    # Each worker's step landed in a round that stayed, was rolled back, or (the one in
    # flight at the restore) was dropped as skipped. A worker that lost one step fewer
    # pushes one round more; the last one closes without the worker that has finished.
    kept = [steps - r["rolled_back_updates"] - r["skipped_steps"] for r in reports]
    assert final[0]["rounds"] == max(kept)
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]


@pytest.mark.slow
def test_graceful_sigterm_writes_a_final_checkpoint(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    shard = Shard(0, tmp_path, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1000")
    shard.start()
    try:
        workers = Workers([shard.address], 1, tmp_path, ["--steps", "7", "--mode", "async"])
        workers.wait()
        assert shard.terminate() == 0
        assert "final checkpoint at step 7" in shard.output()
        shard.start("--restore", str(ckpt))
        s = stats([shard.address])[0]
        assert s["version"] == 7 and s["restored_step"] == 7 and s["worker_clocks"] == [7]
    finally:
        shard.stop()
