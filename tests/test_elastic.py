"""Elastic jobs with real processes (docs/elastic.md): a running job grows (`--join`),
shrinks (SIGTERM: a worker leaves after its step, exit 0) and survives SIGKILL (its lease
runs out), in every mode, and every batch id of the job is trained on exactly once.

Each test runs the schedule of bench/elastic.py, small: 2 workers, a third joins, one is
killed, one is stopped, one more joins; then reads every worker's step log (the batch
ids of each step whose push the shards took) and the shard's Stats."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.fault_procs import BASE, shard_set, stats, wait_until
from tests.procs import ENV, PSAR

LEASE = ["--lease-s", "2", "--join-grace-s", "20"]
MODES = {
    "sync": [],
    "async": [],
    "ssp": ["--staleness", "2"],
    "local": ["--sync-every", "2"],
}


class Job:
    """The workers of one elastic job, started and stopped by name."""

    def __init__(self, servers: list[str], tmp: Path, args: list[str]) -> None:
        self.servers, self.tmp, self.args = servers, tmp, args
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *how: str) -> None:
        cmd = [*PSAR, "train", "--arch", "ps", "--servers", ",".join(self.servers),
               "--run-dir", str(self.tmp / "run"), "--report", str(self.tmp / f"report-{name}.json"),
               *BASE, *self.args, *how]  # fmt: skip
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 - the child keeps it
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
        )

    def signal(self, name: str, sig: int) -> None:
        os.killpg(self.procs[name].pid, sig)

    def wait(self, name: str, timeout: float = 240) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still runs:\n{self.log(name)}") from None

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()[-3000:]

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def steps_taken(tmp: Path) -> dict[int, list[dict]]:
    """Each rank's step log lines (a rank held by several workers in turn: theirs in the
    order they took it, steps-ps-rank{R}.jsonl, then .1, .2, ...)."""
    out: dict[int, list[dict]] = {}
    files = (tmp / "run").glob("steps-ps-rank*.jsonl")
    key = lambda f: tuple(int(x) for x in f.stem.rsplit("rank", 1)[1].split("."))  # noqa: E731
    for f in sorted(files, key=lambda f: (*key(f), 0)[:2]):
        lines = [json.loads(x) for x in f.read_text().split("\n") if x]
        out.setdefault(key(f)[0], []).extend(lines)
    return out


def run_schedule(tmp: Path, mode: str, *, steps: int) -> tuple[dict, dict, dict]:
    """2 workers and a joiner start together (it joins once rank 0 has initialised the
    job); SIGKILL one of the first two, start a second joiner, SIGTERM the first joiner.
    Returns (step logs by rank, exit codes by name, shard 0's Stats at the end)."""
    args = ["--mode", mode, *MODES[mode], "--world-size", "2", "--max-workers", "4",
            "--steps", str(steps), "--emulate-compute-ms", "40"]  # fmt: skip
    with shard_set(1, tmp, *LEASE) as (shard,):
        addr = shard.address
        job = Job([addr], tmp, args)
        try:
            job.start("w0", "--rank", "0")
            job.start("w1", "--rank", "1")
            job.start("j1", "--join")  # gets rank 2
            clock_of = lambda w: stats([addr])[0]["worker_clocks"][w]  # noqa: E731
            wait_until(lambda: clock_of(2) >= 2, 180, "the first joiner trains")
            job.signal("w1", signal.SIGKILL)
            job.start("j2", "--join")  # the lowest free rank: 3 (1 expired: taken last)
            wait_until(lambda: stats([addr])[0]["lease_expirations"] >= 1, 60, "w1's lease")
            wait_until(lambda: clock_of(3) >= 2, 180, "the second joiner trains")
            job.signal("j1", signal.SIGTERM)
            codes = {n: job.wait(n) for n in ("w0", "j1", "j2")}
            codes["w1"] = job.procs["w1"].wait(timeout=10)
            final = stats([addr])[0]
        finally:
            job.close()
    return steps_taken(tmp), codes, final


def check_exactly_once(
    logs: dict[int, list[dict]], final: dict, total: int, killed: int, round_steps: int = 1
) -> None:
    """Every id of 0..total-1 was trained on once: no id in two step logs, and only the
    killed worker may have pushed a step it did not live to log (the shard counts it
    consumed: every id was dealt, and those dealt again were given back first).
    `round_steps`: steps per push (--mode local: an outer round's inner steps, each logged
    as it is taken locally); the killed worker's last round may never have reached the
    shards, so its ids, given back, were trained again by another worker: those of its
    last `round_steps` steps that another worker trained are dropped from its log. (Not
    the last `round_steps` lines blindly: killed mid-round after its last push landed,
    CI 2026-12-04, that dropped the landed round's second half and read its ids missing.)"""
    mine = logs.get(killed, [])
    others = {i for r, lines in logs.items() if r != killed for x in lines for i in x["batches"]}
    for _ in range(round_steps):
        if mine and any(i in others for i in mine[-1]["batches"]):
            mine = mine[:-1]
    logs = {**logs, killed: mine}
    seen = collections.Counter(i for lines in logs.values() for x in lines for i in x["batches"])
    assert max(seen.values()) == 1, [i for i, n in seen.items() if n > 1]
    missing = set(range(total)) - set(seen)
    per_push = max((len(x["batches"]) for x in logs[0]), default=1)
    assert len(missing) <= per_push * max(2, round_steps), sorted(missing)
    assert final["data_remaining"] == 0
    assert final["data_dealt"] - final["data_returned"] == total  # each id consumed once
    if missing:
        last = logs.get(killed, [])
        assert last, "ids missing, but the killed worker logged nothing"


@pytest.mark.parametrize(
    "mode",
    # Every mode slow (~24 s each; CI runs them): the default run keeps the refusals and
    # waits below and the shard's side of growing and shrinking (tests/test_elastic_shard.py).
    [pytest.param(m, marks=pytest.mark.slow) for m in ("sync", "async", "ssp", "local")],
)
def test_grow_kill_stop_grow_trains_every_batch_once(tmp_path: Path, mode: str) -> None:
    steps = 400  # long enough (with 40 ms steps) for the joiners' start on a busy machine
    logs, codes, final = run_schedule(tmp_path, mode, steps=steps)
    assert codes["w0"] == 0 and codes["j2"] == 0
    assert codes["j1"] == 0  # SIGTERM: it left after its step, cleanly
    assert codes["w1"] == -signal.SIGKILL
    assert sorted(logs) == [0, 1, 2, 3]  # the second joiner got rank 3, not the dead 1
    check_exactly_once(logs, final, steps * 2, killed=1, round_steps=2 if mode == "local" else 1)
    assert final["joins"] == 2 and final["leaves"] >= 3  # j1, then w0 and j2 at the end
    assert final["lease_expirations"] == 1
    report = json.loads((tmp_path / "report-j1.json").read_text())
    assert report["stopped"] and report["rank"] == 2


@pytest.mark.slow  # the default run's 5 minutes
def test_join_a_fixed_job_says_what_to_do(tmp_path: Path) -> None:
    with shard_set(1, tmp_path) as (shard,):
        job = Job([shard.address], tmp_path, ["--steps", "200", "--emulate-compute-ms", "20"])
        try:
            job.start("w0", "--rank", "0", "--world-size", "1")
            wait_until(lambda: stats([shard.address])[0]["worker_clocks"][0] >= 1, 120, "w0")
            job.start("j", "--join")
            assert job.wait("j", timeout=120) == 1
            assert "start it with --max-workers" in job.log("j")
        finally:
            job.close()


def test_sigterm_before_the_first_step_leaves_without_training(tmp_path: Path) -> None:
    args = ["--world-size", "2", "--max-workers", "2", "--steps", "6"]
    with shard_set(1, tmp_path, *LEASE) as (shard,):
        job = Job([shard.address], tmp_path, args)
        try:
            job.start("w1", "--rank", "1")  # rank 0 is not there yet: w1 waits for the job
            time.sleep(0.5)
            wait_until(lambda: "setting up" in job.log("w1"), 120, "w1 starts")
            job.signal("w1", signal.SIGTERM)
            job.start("w0", "--rank", "0", "--emulate-compute-ms", "20")
            assert job.wait("w1") == 0 and job.wait("w0") == 0
        finally:
            job.close()
    logs = steps_taken(tmp_path)
    assert logs[1] == [] and sorted(i for x in logs[0] for i in x["batches"]) == list(range(12))


@pytest.mark.slow
def test_a_joiner_waits_for_room_in_a_full_job(tmp_path: Path) -> None:
    """A worker started to replace one that is going (a killed one's lease still runs,
    a stopped one still finishes its step) waits for its rank instead of failing."""
    args = [
        "--world-size",
        "2",
        "--max-workers",
        "2",
        "--steps",
        "300",
        "--emulate-compute-ms",
        "40",
    ]
    with shard_set(1, tmp_path, *LEASE) as (shard,):
        addr = shard.address
        job = Job([addr], tmp_path, args)
        try:
            job.start("w0", "--rank", "0")
            job.start("w1", "--rank", "1")
            wait_until(lambda: min(stats([addr])[0]["worker_clocks"]) >= 2, 180, "both train")
            job.start("j", "--join")
            wait_until(lambda: "waiting (up to --timeout-s" in job.log("j"), 120, "j waits")
            assert stats([addr])[0]["joins"] == 0
            job.signal("w1", signal.SIGTERM)  # it leaves after its step: rank 1 is free
            assert job.wait("w1") == 0 and job.wait("j") == 0 and job.wait("w0") == 0
        finally:
            job.close()
    report = json.loads((tmp_path / "report-j.json").read_text())
    assert report["rank"] == 1 and not report["stopped"] and report["steps"] > 0
