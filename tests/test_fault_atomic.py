"""A shard killed while writing a checkpoint leaves the previous one loadable.

Two ways in: an exception injected between the write and the rename, and a real
process killed with SIGKILL while its temporary file is complete but not renamed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from psar.ps.server.durability.checkpoints import (
    CheckpointManager,
    atomic_save,
    clean_temp,
    list_checkpoints,
    load,
    newest_loadable,
    path_for,
)

ROOT = Path(__file__).resolve().parent.parent


def snap(step: int) -> dict:
    return {"format": 1, "step": step, "masters": {"w": torch.full((1000,), float(step))}}


def test_failure_before_rename_keeps_the_previous_checkpoint(tmp_path) -> None:
    atomic_save(snap(1), path_for(tmp_path, 0, 1))

    def boom(tmp: Path) -> None:
        assert tmp.exists() and tmp.stat().st_size > 0
        raise OSError("disk pulled out (injected)")

    with pytest.raises(OSError, match="injected"):
        atomic_save(snap(2), path_for(tmp_path, 0, 2), before_rename=boom)
    assert [s for s, _ in list_checkpoints(tmp_path, 0)] == [1]
    assert not list(tmp_path.glob(".*.tmp"))  # the writer cleaned up after itself
    step, got = newest_loadable(tmp_path, 0)
    assert step == 1 and torch.equal(got["masters"]["w"], snap(1)["masters"]["w"])


def test_overwriting_the_same_step_is_atomic_too(tmp_path) -> None:
    path = path_for(tmp_path, 0, 5)
    atomic_save(snap(5), path)
    with pytest.raises(RuntimeError):
        atomic_save(snap(6), path, before_rename=lambda _t: (_ for _ in ()).throw(RuntimeError()))
    assert load(path)["step"] == 5


WRITER = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    from psar.ps.server.durability.checkpoints import atomic_save, path_for

    folder = Path(sys.argv[1])
    atomic_save({"format": 1, "step": 1, "x": torch.ones(10)}, path_for(folder, 0, 1))

    def hang(tmp):
        print("WRITTEN", tmp, flush=True)
        time.sleep(60)  # killed here: the new file is complete but not renamed

    atomic_save({"format": 1, "step": 2, "x": torch.zeros(1 << 20)}, path_for(folder, 0, 2),
                before_rename=hang)
    """
)


def test_process_killed_mid_write_leaves_a_loadable_checkpoint(tmp_path) -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        line = p.stdout.readline()
        assert line.startswith("WRITTEN"), line
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert len(list(tmp_path.glob(".ckpt-*.tmp"))) == 1  # the half-done write
    step, got = newest_loadable(tmp_path, 0)
    assert step == 1 and torch.equal(got["x"], torch.ones(10))
    # A shard starting on the folder removes the leftover and carries on from step 1.
    manager = CheckpointManager(tmp_path)
    assert not list(tmp_path.glob(".ckpt-*.tmp"))
    assert manager.newest()[0] == 1
    manager.close()
    assert clean_temp(tmp_path) == 0


def test_a_damaged_newest_file_falls_back_to_the_one_before(tmp_path) -> None:
    atomic_save(snap(1), path_for(tmp_path, 0, 1))
    path_for(tmp_path, 0, 2).write_bytes(b"not a checkpoint")
    assert newest_loadable(tmp_path, 0)[0] == 1
