"""psar launch passes torchrun only the flags the installed torchrun accepts (issue #16:
torch 2.11's torchrun exits 2 on --shutdown-timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from psar.worker import launch as L
from tests.test_launch import assert_all_gone, spec

# Makes this interpreter's children build torchrun's parser without --shutdown-timeout, as
# torch 2.11 does: a torchrun handed that flag then exits 2 ("unrecognized arguments").
OLD_TORCHRUN = """
import argparse

_add = argparse.ArgumentParser.add_argument


def add_argument(self, *names, **kw):
    if "--shutdown-timeout" in names:  # no such option; its default still reads None
        return self.set_defaults(shutdown_timeout=None)
    return _add(self, *names, **kw)


argparse.ArgumentParser.add_argument = add_argument
"""


def with_path(folder: Path) -> str:
    return os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])


@pytest.mark.parametrize(
    "accepted, want_argv, dropped",
    [
        (None, ["--nnodes", "1", "--shutdown-timeout", "5"], []),  # unknown: pass everything
        ({"--nnodes", "--shutdown-timeout"}, ["--nnodes", "1", "--shutdown-timeout", "5"], []),
        ({"--nnodes", "--shutdown_timeout"}, ["--nnodes", "1", "--shutdown_timeout", "5"], []),
        ({"--nnodes"}, ["--nnodes", "1"], ["--shutdown-timeout"]),
        (set(), [], ["--nnodes", "--shutdown-timeout"]),
    ],
)
def test_flags_are_kept_respelled_or_dropped_with_a_note(
    accepted: set[str] | None, want_argv: list[str], dropped: list[str]
) -> None:
    argv, notes = L.torchrun_flags(["--nnodes", "1", "--shutdown-timeout", "5"], accepted)
    assert argv == want_argv
    assert len(notes) == len(dropped)
    for flag, note in zip(dropped, notes, strict=True):
        assert f"no {flag}" in note


def test_underscore_flag_takes_the_hyphen_spelling_when_only_that_exists() -> None:
    argv, notes = L.torchrun_flags(["--nproc_per_node", "2"], {"--nproc-per-node"})
    assert (argv, notes) == (["--nproc-per-node", "2"], [])


def test_flags_come_in_pairs() -> None:
    with pytest.raises(ValueError):
        L.torchrun_flags(["--nnodes", "1", "--tee"], None)


def test_installed_torchrun_options_are_read_once() -> None:
    opts = L.torchrun_options()
    assert opts is not None and "--nnodes" in opts and "--log-dir" in opts
    assert L.torchrun_options() is opts  # cached: torch's parser is built once per process


def test_old_torchrun_simulation_refuses_the_flag(tmp_path: Path) -> None:
    """The fake below is faithful: such a torchrun really exits 2 on --shutdown-timeout."""
    (tmp_path / "sitecustomize.py").write_text(OLD_TORCHRUN)
    env = {**os.environ, "PYTHONPATH": with_path(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--shutdown-timeout", "1",
           "--nproc-per-node", "1", "-m", "psar.worker.cli", "--help"]  # fmt: skip
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert got.returncode == 2 and "--shutdown-timeout" in got.stderr


@pytest.mark.slow
def test_launch_runs_under_a_torchrun_without_shutdown_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sitecustomize.py").write_text(OLD_TORCHRUN)
    real = L.torchrun_options()
    assert real is not None
    old = real - {"--shutdown-timeout", "--shutdown_timeout"}
    monkeypatch.setattr(L, "torchrun_options", lambda: old)  # what launch would read there
    s = spec(tmp_path, "--report", f"{tmp_path}/report-{{rank}}.json",
             arch="allreduce", workers=1, env={"PYTHONPATH": with_path(tmp_path)})  # fmt: skip
    assert L.launch(s) == 0, s.err.getvalue() + s.out.getvalue()
    err = s.err.getvalue()
    assert "this torchrun has no --shutdown-timeout; not passing --shutdown-timeout" in err
    assert err.splitlines()[-1] == "psar launch: all 1 workers finished"
    assert (tmp_path / "report-0.json").exists()
    assert_all_gone(s.pids)


def test_servers_auto_picks_shards_from_the_cores() -> None:
    assert L.auto_servers(1, cores=16) == 7  # (16 - 1) // 2
    assert L.auto_servers(2, cores=2) == 1  # never below one
    assert L.auto_servers(1, cores=64) == 8  # capped
    spec = L.parse(["--servers", "auto", "--workers", "1", "--steps", "3"])
    assert spec.servers == L.auto_servers(1) >= 1
    with pytest.raises(SystemExit):
        L.parse(["--servers", "many"])
