"""Damaged checkpoints never restore silently (docs/reliability.md, "Checksums").

Every checkpoint carries a crc32 of each tensor. 64 bytes flipped in the newest file's
tensor data: `psar server --restore` falls back to the previous checkpoint and serves
exactly its state. Every file damaged: it refuses to start and names them, unless
--restore-or-fresh. A worker whose shard restarted empty says so instead of blaming rank 0.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch

from psar.ps.server.durability import checkpoints
from psar.ps.server.durability.checkpoints import (
    CheckpointManager,
    list_checkpoints,
    newest_verified,
    path_for,
)
from psar.ps.server.shard import ShardState
from tests.fault_procs import Shard, Workers, stats, wait_until
from tests.procs import ENV, PSAR, free_port


def damage(path: Path, nbytes: int = 64) -> None:
    """Flip `nbytes` bytes in the middle of the file's largest tensor record."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    # Local header: 30 fixed bytes, then the name and the extra field, then the data.
    name_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len + info.file_size // 2 - nbytes // 2
    assert info.file_size >= nbytes
    for i in range(start, start + nbytes):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def snap(step: int) -> dict:
    return {
        "format": checkpoints.FORMAT,
        "step": step,
        "masters": {"w": torch.full((1000,), float(step))},
        "optimizer": {"state": {0: {"exp_avg": torch.arange(1000.0), "step": torch.tensor(3.0)}}},
    }


def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path, caplog) -> None:
    m = CheckpointManager(tmp_path, keep=3)
    for step in (5, 10):
        m.write_now(step, snap(step))
    m.close()
    damage(path_for(tmp_path, 0, 10))
    with caplog.at_level(logging.WARNING, "psar.checkpoint"):
        found, rejected = newest_verified(tmp_path, 0)
    assert found is not None and found[0] == 5
    assert len(rejected) == 1 and "ckpt-s0-000000000010.pt" in rejected[0]
    assert "checksum mismatch" in caplog.text


def test_a_checkpoint_without_checksums_still_loads_unverified(tmp_path, caplog) -> None:
    checkpoints.atomic_save(snap(7), path_for(tmp_path, 0, 7))  # as psar wrote it before
    with caplog.at_level(logging.WARNING, "psar.checkpoint"):
        found, rejected = newest_verified(tmp_path, 0)
    assert found is not None and found[0] == 7 and not rejected
    assert "unverified" in caplog.text


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A folder with shard 0's checkpoints of a short async job (SIGTERM at its end)."""
    tmp = tmp_path_factory.mktemp("trained")
    shard = Shard(0, tmp, "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", "5")
    shard.start()
    try:
        workers = Workers([shard.address], 2, tmp, ["--steps", "12", "--mode", "async"])
        try:
            workers.wait()
        finally:
            workers.close()
        assert shard.terminate() == 0
    finally:
        shard.stop()
    assert len(list_checkpoints(tmp / "ckpt", 0)) == 3
    return tmp / "ckpt"


def digest_of(path: Path, step: int) -> str:
    """The state digest of a shard restored in-process from `path`."""
    state = ShardState()
    state.durability.restore(step, checkpoints.load(path))
    return state.state_digest()


@pytest.mark.slow
def test_restore_skips_a_damaged_newest_and_serves_the_previous_exactly(trained, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained, ckpt)
    (newest_step, newest), (prev_step, prev) = reversed(list_checkpoints(ckpt, 0)[-2:])
    want = digest_of(prev, prev_step)
    damage(newest)
    shard = Shard(0, tmp_path)
    try:
        shard.start("--restore", str(ckpt))
        out = shard.output()
        got = stats([shard.address])[0]
    finally:
        shard.stop()
    assert f"restored step {prev_step} " in out
    assert "checksum mismatch" in out and newest.name in out
    assert got["restored_step"] == prev_step and got["state_digest"] == want


def test_restore_refuses_when_no_checkpoint_verifies_unless_restore_or_fresh(
    trained, tmp_path
) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained, ckpt)
    files = [p for _, p in list_checkpoints(ckpt, 0)]
    for p in files:
        damage(p)
    cmd = [*PSAR, "server", "--bind", f"127.0.0.1:{free_port()}", "--restore", str(ckpt)]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "no checkpoint of shard 0 verifies" in r.stderr
    for p in files:
        assert p.name in r.stderr
    shard = Shard(0, tmp_path)
    try:
        shard.start("--restore", str(ckpt), "--restore-or-fresh")
        got = stats([shard.address])[0]
        assert "starting fresh" in shard.output()
        assert got["restores"] == 0 and got["version"] == 0
    finally:
        shard.stop()


@pytest.mark.slow
def test_a_worker_whose_shard_restarted_empty_says_so(tmp_path) -> None:
    shard = Shard(0, tmp_path)
    shard.start()
    workers = Workers([shard.address], 1, tmp_path, ["--steps", "500", "--mode", "async",
                      "--emulate-compute-ms", "20", "--reconnect-timeout-s", "60"])  # fmt: skip
    try:
        wait_until(lambda: stats([shard.address])[0]["version"] >= 3, 120, "version>=3")
        shard.kill9()
        shard.start()  # no --restore: an empty shard
        proc = workers.procs[0]
        assert proc is not None
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        log = workers.log(0)
        assert proc.poll() not in (None, 0), log
    finally:
        workers.close()
        shard.stop()
    assert "shard restarted empty" in log, log
