"""kill -9 a shard holding sparse tables, restart it with --restore: the restored shard
serves exactly the rows (bit for bit) and versions of the checkpoint it came back from,
and the workers finish the job on top of them, as with dense slots
(tests/test_fault_restore.py). Real shard and worker processes, the recsys workload.

The workers are paused (SIGSTOP) from just before the kill until the restored rows have
been read, so nothing updates the tables in between; the test checks bits and counts,
never wall time.
"""

from __future__ import annotations

import contextlib
import os
import signal

import numpy as np
import pytest
import torch

from psar.ps.client.psclient import ClientConfig, PSClient
from psar.ps.client.sparse_client import pull_rows
from psar.ps.server.durability.checkpoints import newest_verified
from tests.fault_procs import Workers, shard_set, stats, wait_until

EVERY = 5
ROWS = {"tables.0.weight": 2000, "tables.1.weight": 500}
DIM = 8
RECSYS = ["--workload", "recsys", "--workload-option", "rows=2000,500",
          "--workload-option", f"dim={DIM}", "--workload-option", "samples=4096",
          "--workload-option", "val_samples=256", "--batch-size", "32", "--lr", "0.5",
          "--sparse-optimizer", "adagrad", "--sparse-lr", "0.05", "--wire-dtype", "fp32",
          "--sparse-wire-dtype", "fp32"]  # fmt: skip


def tables_of(address: str) -> dict[str, tuple[torch.Tensor, int]]:
    """Every table's full fp32 rows and version, pulled from a one-shard job."""
    cfg = ClientConfig(timeout_s=10, retry_timeout_s=10)
    with PSClient([address], worker=0, cfg=cfg) as client:
        out = {}
        for name, rows in ROWS.items():
            got, versions, _ = pull_rows(client, name, torch.arange(rows), DIM, torch.float32)
            out[name] = (got, versions[0])
        return out


def signal_workers(workers: Workers, sig: signal.Signals) -> None:
    for p in workers.procs:
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)


@pytest.mark.slow  # default run under 10 minutes; CI runs -m slow too
def test_async_shard_with_sparse_tables_killed_restores_rows_bit_for_bit(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    steps = 40
    with shard_set(1, tmp_path, "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY),
                   "--lease-s", "30") as (shard,):  # fmt: skip
        workers = Workers([shard.address], 2, tmp_path, [*RECSYS, "--steps", str(steps),
                          "--mode", "async", "--emulate-compute-ms", "60"])  # fmt: skip
        try:
            wait_until(lambda: stats([shard.address])[0]["version"] >= 2 * EVERY + 2, 120, "v>=12")
            signal_workers(workers, signal.SIGSTOP)
            try:
                shard.kill9()
                found, rejected = newest_verified(ckpt, 0)
                assert found is not None and not rejected
                step, snap = found
                shard.start("--restore", str(ckpt))
                assert f"restored step {step}" in shard.output()
                restored = tables_of(shard.address)
            finally:
                signal_workers(workers, signal.SIGCONT)
            reports = workers.wait()
            final = stats([shard.address])[0]
            after = tables_of(shard.address)
        finally:
            workers.close()
    saved = snap["sparse"]["tables"]
    assert step >= 2 * EVERY and step % EVERY == 0
    for name, (rows, version) in restored.items():
        # Trained rows, not the initial ones: the restore brought back real progress.
        assert saved[name]["version"] > 0
        assert version == saved[name]["version"]
        assert torch.equal(rows.view(torch.int32), saved[name]["weight"].view(torch.int32))
        # Training went on from there: more updates, and rows moved.
        assert after[name][1] > version
        assert not torch.equal(after[name][0], rows)
    for rep in reports:
        assert len(rep["losses"]) == steps and np.all(np.isfinite(rep["losses"]))
        assert rep["restores"] == 1
        assert 0 <= rep["rolled_back_updates"] <= 2 * EVERY
        hist = rep["sparse_tables"]["tables.0.weight"]["staleness_histogram"]
        assert sum(hist.values()) >= steps - 1  # row pushes applied after the restore too
    assert final["restores"] == 1 and final["restored_step"] == step
    # A step whose forward ran on a pull the kill cut short is skipped, never pushed.
    assert final["worker_clocks"] == [steps - r["unsent_steps"] for r in reports]


def table_versions(addresses: list[str], shards: int) -> list[dict[str, int]]:
    """Each shard's version of every table (a one-row pull from each shard)."""
    cfg = ClientConfig(timeout_s=10, retry_timeout_s=10)
    with PSClient(addresses, worker=0, cfg=cfg) as client:
        return [
            {n: pull_rows(client, n, torch.arange(shards), DIM, torch.float32)[1][i] for n in ROWS}
            for i in range(shards)
        ]


@pytest.mark.slow
def test_sync_one_of_two_shards_with_sparse_tables_killed_every_table_follows_the_rollback(
    tmp_path,
) -> None:
    """Shard 1 comes back at a checkpointed round and shard 0 rolls back to it, tables
    included; row pushes sent before the rollback are dropped, so no table round stalls:
    every table keeps closing one round per dense round until the job ends."""
    ckpt = tmp_path / "ckpt"
    steps = 30
    with shard_set(2, tmp_path, "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY),
                   "--lease-s", "30") as shards:  # fmt: skip
        addrs = [s.address for s in shards]
        workers = Workers(addrs, 2, tmp_path, [*RECSYS, "--steps", str(steps), "--mode", "sync",
                          "--emulate-compute-ms", "60"])  # fmt: skip
        try:
            wait_until(lambda: stats(addrs)[1]["rounds"] >= 2 * EVERY + 2, 120, "rounds>=12")
            signal_workers(workers, signal.SIGSTOP)
            try:
                shards[1].kill9()
                found, _ = newest_verified(ckpt, 1)
                assert found is not None
                step, snap = found
                shards[1].start("--restore", str(ckpt))
                cfg = ClientConfig(timeout_s=10, retry_timeout_s=10)
                with PSClient(addrs, worker=0, cfg=cfg) as client:
                    name = "tables.0.weight"
                    ids = torch.arange(1, ROWS[name], 2)  # shard 1's rows, in order
                    rows, versions, _ = pull_rows(client, name, ids, DIM, torch.float32)
            finally:
                signal_workers(workers, signal.SIGCONT)
            reports = workers.wait()
            final = stats(addrs)
            versions_end = table_versions(addrs, 2)
        finally:
            workers.close()
    saved = snap["sparse"]["tables"][name]
    assert versions[1] == saved["version"] > 0
    assert torch.equal(rows.view(torch.int32), saved["weight"].view(torch.int32))
    assert final[0]["restored_step"] == final[1]["restored_step"] == step
    assert final[0]["rounds"] == final[1]["rounds"]
    for rep in reports:
        assert rep["restores"] == 1 and len(rep["losses"]) == steps
        assert np.all(np.isfinite(rep["losses"]))
    # One table round per dense round since the rollback (the last may stay open: the
    # first worker to finish leaves; a round whose rows the crash lost has no table round).
    for i in range(2):
        for n in ROWS:
            behind = final[i]["rounds"] - versions_end[i][n]
            assert 0 <= behind <= 2, (i, n, final[i]["rounds"], versions_end[i][n])
