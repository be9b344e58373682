"""psar launch: real processes, small configs, no wall-clock assertions."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from psar.worker.launch import LaunchSpec, launch, parse, validate
from psar.worker.supervisor import descendants

FAST = ["--steps", "10", "--eval-batches", "2", "--log-every", "5", "--precision", "fp32"]

CRASHY = """
import os
from psar.worker.workloads.mlp import make as _make

def make(seed, **options):
    if os.environ.get("RANK") == "1":
        raise SystemExit(3)  # worker 1 dies at start-up; worker 0 would wait forever
    return _make(seed, **options)
"""


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def assert_all_gone(pids: list[int]) -> None:
    assert pids, "launch recorded no pids"
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if alive(p)] == []


def spec(tmp_path: Path, *train: str, **kw) -> LaunchSpec:
    out, err = io.StringIO(), io.StringIO()
    return LaunchSpec(train_args=[*FAST, *train], out=out, err=err, timeout=120, **kw)


def test_parse_splits_launch_flags_from_train_flags() -> None:
    s = parse(["--arch", "ps", "--servers", "2", "--workers", "4", "--mode", "ssp",
               "--staleness", "2", "--workload", "lm", "--steps", "7", "--straggler", "3:2.5",
               "--timeout-s", "9", "--report", "r-{rank}.json"])  # fmt: skip
    assert (s.arch, s.servers, s.workers, s.mode, s.staleness) == ("ps", 2, 4, "ssp", 2)
    assert s.straggler == {3: 2.5}
    assert s.train_args == ["--workload", "lm", "--steps", "7", "--timeout-s", "9",
                            "--report", "r-{rank}.json"]  # fmt: skip


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--rank", "1"], "--rank is set by launch"),
        (["--metrics-port=9000"], "--metrics-port is set by launch"),
        (["--steps", "many"], "bad train flag"),  # unknown flags: tests/test_cli_help.py
        (["--steps", "0"], "--steps must be >= 1"),
        (["--straggler", "5:2"], "rank must be < --workers"),
    ],
)
def test_bad_flags_exit_2_before_starting_anything(argv: list[str], needle: str) -> None:
    s = parse(argv)
    s.err = io.StringIO()
    assert launch(s) == 2
    assert needle in s.err.getvalue()
    assert s.pids == []


def test_bad_straggler_and_server_count_are_usage_errors(capsys) -> None:
    for argv in (["--straggler", "1"], ["--straggler", "1:0.5"], ["--servers", "a:1"]):
        with pytest.raises(SystemExit) as e:
            parse(argv)
        assert e.value.code == 2
    assert "launch picks ports" in capsys.readouterr().err


def test_ps_end_to_end(tmp_path: Path) -> None:
    s = spec(tmp_path, "--report", f"{tmp_path}/report-{{rank}}.json", "--run-dir", str(tmp_path),
             arch="ps", servers=1, workers=2, mode="ssp", staleness=1)  # fmt: skip
    assert launch(s) == 0, s.err.getvalue() + s.out.getvalue()
    for r in (0, 1):
        rep = json.loads((tmp_path / f"report-{r}.json").read_text())
        assert (rep["arch"], rep["mode"], rep["rank"], rep["steps"]) == ("ps", "ssp", r, 10)
        assert (tmp_path / f"steps-ps-rank{r}.jsonl").exists()
    out = s.out.getvalue()
    assert "[shard0] psar server listening on 127.0.0.1:" in out
    assert "[worker0] " in out  # rank 0 logs progress; the others stay quiet
    assert (
        s.err.getvalue().splitlines()[-1]
        == "psar launch: all 2 workers finished; stopped the shards"
    )
    assert_all_gone(s.pids)


@pytest.mark.slow  # tests/test_early_pull.py keeps rank 0's decision in the default run
def test_early_pull_workers_get_shards_that_apply_per_chunk(tmp_path: Path) -> None:
    s = spec(tmp_path, "--report", f"{tmp_path}/report-{{rank}}.json", "--early-pull",
             arch="ps", servers=1, workers=2, mode="sync")  # fmt: skip
    assert launch(s) == 0, s.err.getvalue() + s.out.getvalue()
    rep = json.loads((tmp_path / "report-0.json").read_text())
    assert rep["shards"][0]["chunks_applied_early"] > 0  # the job asked for it, no shard flag
    assert rep["shards"][0]["early_pull_slots"] > 0
    assert_all_gone(s.pids)


def test_allreduce_end_to_end_under_torchrun(tmp_path: Path) -> None:
    s = spec(tmp_path, "--report", f"{tmp_path}/report-{{rank}}.json", "--run-dir", str(tmp_path),
             arch="allreduce", workers=2)  # fmt: skip
    assert launch(s) == 0, s.err.getvalue() + s.out.getvalue()
    rep = json.loads((tmp_path / "report-0.json").read_text())
    assert (rep["arch"], rep["world_size"], rep["steps"]) == ("allreduce", 2, 10)
    assert {p.name for p in tmp_path.glob("steps-*")} == {
        "steps-allreduce-rank0.jsonl",
        "steps-allreduce-rank1.jsonl",
    }
    assert "[worker0] " in s.out.getvalue()
    assert_all_gone(s.pids)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["ps", pytest.param("allreduce", marks=pytest.mark.slow)])
def test_one_crashing_worker_stops_everything(tmp_path: Path, arch: str) -> None:
    (tmp_path / "crashy.py").write_text(CRASHY)
    s = spec(tmp_path, "--workload", "crashy:make", "--steps", "100000",
             arch=arch, workers=3, env={"PYTHONPATH": str(tmp_path)})  # fmt: skip
    assert launch(s) == 3
    last = s.err.getvalue().splitlines()[-1]
    assert last == "psar launch: worker 1 exited with code 3; stopped the rest"
    assert_all_gone(s.pids)
    if arch == "allreduce":  # torchrun's own workers were recorded too, not only torchrun
        assert len(s.pids) >= 4


@pytest.mark.slow
def test_sigterm_to_launch_tears_everything_down(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "psar.worker.launch", "--workers", "2", "--steps", "1000000",
           "--log-every", "0", "--run-dir", str(tmp_path), "--grace", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    deadline = time.monotonic() + 240  # generous: a loaded CI box
    try:
        # Running for real: both workers have logged a step.
        while not all((tmp_path / f"steps-ps-rank{r}.jsonl").stat().st_size
                      if (tmp_path / f"steps-ps-rank{r}.jsonl").exists() else 0
                      for r in (0, 1)):  # fmt: skip
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        seen.update(descendants([proc.pid]))
        assert len(seen) >= 3  # a shard and two workers
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.splitlines()[-1] == "psar launch: received SIGTERM; stopped everything"
    # --grace 1: whatever still drains a second after SIGTERM is SIGKILLed, and no later.
    assert_all_gone(sorted(seen))


@pytest.mark.slow
def test_timeout_and_allreduce_straggler_direct_launch(tmp_path: Path) -> None:
    s = spec(tmp_path, "--steps", "1000000", "--log-every", "0", arch="ps", workers=2)
    s.timeout = 8
    assert launch(s) == 124
    assert_all_gone(s.pids)
    s = spec(tmp_path, "--run-dir", str(tmp_path), arch="allreduce", workers=2,
             straggler={1: 2.0})  # fmt: skip
    assert launch(s) == 0, s.err.getvalue()
    assert "torchrun" not in s.out.getvalue()
    assert (tmp_path / "steps-allreduce-rank1.jsonl").exists()
    assert os.environ.get("RANK") is None  # launch never touches its own environment


def test_cli_routes_launch_and_compare(capsys) -> None:
    from psar.worker.cli import main

    for name in ("launch", "compare"):
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        assert f"psar {name}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    helptext = capsys.readouterr().out
    assert "launch" in helptext and "compare" in helptext


def test_a_non_loopback_bind_host_is_a_decision(tmp_path: Path) -> None:
    """Shards on a non-loopback --bind-host without a token and TLS refuse to start
    (psar server); launch says so before starting anything, naming the flag that
    decides it, and passes that flag on to the shards."""
    s = spec(tmp_path, "--steps", "1", arch="ps", workers=2, bind_host="192.0.2.1")
    assert launch(s) == 2
    assert "--bind-host 192.0.2.1 is not loopback" in s.err.getvalue()
    assert "--allow-insecure-bind" in s.err.getvalue() and s.pids == []
    ok = parse(["--arch", "ps", "--bind-host", "192.0.2.1", "--allow-insecure-bind"])
    assert ok.allow_insecure_bind
    validate(ok)  # accepted: the user said so
    validate(parse(["--arch", "allreduce", "--bind-host", "192.0.2.1"]))  # no shard, no metrics
