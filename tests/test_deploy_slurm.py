"""deploy/slurm/*.sbatch under bash with fake Slurm commands (runs everywhere, no Slurm):
the steps each script starts, their command lines dry-run by the real parser with the
variables srun would set (tests/test_deploy.py's run_line), and the script's own logic:
the up-front configuration check, addresses from NodeAddr, a shard that fails ending the
job, the shards stopped with SIGINT once the workers are done. tests/test_slurm.py runs
the same scripts on a real Slurm (slow).

The fakes: `srun` records its argv and runs like the step would, in the small (a shard
waits for a signal, or fails at once with FAKE_SHARD_FAILS=1; workers end at once with
FAKE_WORKERS_RC, or wait to be cancelled while a shard fails); `squeue`/`scancel` list and
signal those fake steps; `scontrol` expands node lists and gives each node an address
unlike its name (node03 is 10.1.0.4); `psar` records the --dry-run line the script checks
first and exits FAKE_DRY_RUN_RC.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_deploy import ROLE_ENV, ROOT, run_line

SLURM = ROOT / "deploy" / "slurm"
JOB = "4242"

FAKE_SRUN = r"""#!/usr/bin/env python3
import json, os, signal, sys, time
argv = sys.argv[1:]
name = next((a.split("=", 1)[1] for a in argv if a.startswith("--job-name=")), "")
cmd = [a for a in argv if not a.startswith("--")]
log = os.environ["FAKE_LOG"]
with open(log, "a") as f:
    keep = {k: v for k, v in os.environ.items() if k.startswith(("PSAR_", "TORCH_", "LOGLEVEL"))}
    f.write(json.dumps({"argv": argv, "env": keep}) + "\n")
with open(log + ".steps", "a") as f:  # what the fake squeue lists
    f.write(f"{os.environ['SLURM_JOB_ID']}.{os.getpid()} {name} {os.getpid()}\n")
got = []
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda s, _f: got.append(s))

def wait_for_signal(limit=20.0):
    end = time.monotonic() + limit
    while not got and time.monotonic() < end:
        time.sleep(0.05)
    return got[0] if got else None

if cmd[:2] == ["psar", "server"]:
    if os.environ.get("FAKE_SHARD_FAILS") == "1":
        print("psar server: error: shard 0: could not bind 0.0.0.0:50051", file=sys.stderr)
        sys.exit(1)
    sys.exit(0 if wait_for_signal() == signal.SIGINT else 3)
if os.environ.get("FAKE_SHARD_FAILS") == "1":
    sys.exit(143 if wait_for_signal() == signal.SIGTERM else 4)  # cancelled by the script
sys.exit(int(os.environ.get("FAKE_WORKERS_RC", "0")))
"""
FAKE_SQUEUE = r"""#!/usr/bin/env python3
import os
path = os.environ["FAKE_LOG"] + ".steps"
for line in open(path).read().splitlines() if os.path.exists(path) else []:
    step, name, pid = line.split(" ")
    try:
        os.kill(int(pid), 0)
        print(step, name)
    except ProcessLookupError:
        pass
"""
FAKE_SCANCEL = r"""#!/usr/bin/env python3
import os, signal, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"] + ".scancel", "a") as f:
    f.write(" ".join(args) + "\n")
sig = next((a.split("=", 1)[1] for a in args if a.startswith("--signal=")), "TERM")
for step in (a for a in args if not a.startswith("-")):
    os.kill(int(step.split(".")[1]), getattr(signal, "SIG" + sig))
"""
FAKE_SCONTROL = r"""#!/usr/bin/env python3
import os, sys
nodes = [f"node{i:02d}" for i in range(int(os.environ["FAKE_NODES"]))]
args = [a for a in sys.argv[1:] if a != "--oneliner"]
if args[:2] == ["show", "hostnames"]:
    print("\n".join(nodes))
elif args[:2] == ["show", "node"]:
    for i, n in enumerate(nodes):
        print(f"NodeName={n} Arch=x86_64 CoresPerSocket=1 NodeAddr=10.1.0.{i + 1} "
              f"NodeHostName={n} Version=22.05.8 State=ALLOCATED")
else:
    sys.exit(f"fake scontrol: {sys.argv[1:]}")
"""
FAKE_PSAR = r"""#!/usr/bin/env python3
import os, sys
with open(os.environ["FAKE_LOG"] + ".psar", "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
rc = int(os.environ.get("FAKE_DRY_RUN_RC", "0"))
if rc:
    print("psar train: error: unknown workload 'bogus'", file=sys.stderr)
sys.exit(rc)
"""
SRUN_OPTS = {"--nodes", "--ntasks", "--relative", "--ntasks-per-node", "--kill-on-bad-exit",
             "--job-name", "--gpus-per-node", "--cpus-per-task", "--exact", "--overlap"}  # fmt: skip
SBATCH_OPTS = {"--job-name", "--nodes", "--ntasks-per-node", "--exclusive", "--time", "--output",
               "--gpus-per-node", "--cpus-per-task", "--partition", "--account"}  # fmt: skip


def sbatch_options(path: Path) -> dict[str, str]:
    opts = {}
    for line in path.read_text().splitlines():
        if line.startswith("#SBATCH "):
            for tok in shlex.split(line[len("#SBATCH ") :]):
                key, _, val = tok.partition("=")
                assert key in SBATCH_OPTS, f"{path.name}: #SBATCH {tok} (use --long=value)"
                opts[key] = val
    return opts


class Run:
    """One run of an sbatch script under the fakes: rc, stderr, and what they recorded."""

    def __init__(self, path: Path, tmp: Path, nodes: int, **env: str) -> None:
        bin_dir = tmp / "bin"
        bin_dir.mkdir(exist_ok=True)
        fakes = {"srun": FAKE_SRUN, "squeue": FAKE_SQUEUE, "scancel": FAKE_SCANCEL,
                 "scontrol": FAKE_SCONTROL, "psar": FAKE_PSAR}  # fmt: skip
        for name, text in fakes.items():
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        self.log = tmp / f"fake-{path.stem}-{nodes}.jsonl"
        full = {k: v for k, v in os.environ.items()
                if k not in (*ROLE_ENV, "LOGLEVEL", "TORCH_CPP_LOG_LEVEL", "TORCH_LOGS")
                and not k.startswith(("SLURM", "FAKE_"))}  # fmt: skip
        full.update(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(self.log),
                    FAKE_NODES=str(nodes), SLURM_JOB_ID=JOB,
                    SLURM_JOB_NODELIST=f"node[00-{nodes - 1:02d}]",
                    SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes),
                    STOP_TIMEOUT_S="10", **env)  # fmt: skip
        p = subprocess.run(["bash", str(path)], env=full, capture_output=True, text=True,
                           timeout=60)  # fmt: skip
        self.rc, self.err = p.returncode, p.stderr
        self.calls = [json.loads(ln) for ln in self._lines("")]
        self.steps = [split_srun(c["argv"]) + (c["env"],) for c in self.calls]
        self.dry_runs = [shlex.split(ln) for ln in self._lines(".psar")]
        self.scancels = self._lines(".scancel")
        self.step_ids = {ln.split()[1]: ln.split()[0] for ln in self._lines(".steps")}

    def _lines(self, suffix: str) -> list[str]:
        path = Path(f"{self.log}{suffix}")
        return path.read_text().splitlines() if path.exists() else []


def split_srun(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    opts = {}
    for i, tok in enumerate(argv):
        if not tok.startswith("-"):
            return opts, argv[i:]
        key, _, val = tok.partition("=")
        assert key in SRUN_OPTS, f"srun {tok}: unknown here (write options as --long=value)"
        opts[key] = val
    raise AssertionError(f"srun without a command: {argv}")


def _srun_env(opts: dict[str, str], recorded: dict[str, str], procid: int) -> dict[str, str]:
    ntasks = int(opts.get("--ntasks", "1"))
    per_node = int(opts.get("--ntasks-per-node", str(ntasks)))
    return {**recorded, "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks),
            "SLURM_LOCALID": str(procid % per_node)}  # fmt: skip


@pytest.mark.parametrize(("shards", "nodes", "per_node"), [(None, None, None), ("2", 5, "2")])
def test_slurm_ps(tmp_path, shards, nodes, per_node) -> None:
    path = SLURM / "ps.sbatch"
    nodes = nodes or int(sbatch_options(path)["--nodes"])
    env = {k: v for k, v in (("NUM_SHARDS", shards), ("WORKERS_PER_NODE", per_node)) if v}
    run = Run(path, tmp_path, nodes, CHECKPOINT_DIR="/shared/ckpt", **env)
    assert run.rc == 0, run.err
    n_shards = int(shards or 1)
    shard_steps = sorted(
        (s for s in run.steps if s[1][:2] == ["psar", "server"]),
        key=lambda s: int(s[0]["--relative"]),
    )  # background: any order
    worker_steps = [s for s in run.steps if s[1][:2] == ["psar", "train"]]
    assert len(shard_steps) == n_shards and len(worker_steps) == 1
    assert len(run.steps) == n_shards + 1
    servers = None
    for i, (o, argv, recorded) in enumerate(shard_steps):
        assert o["--relative"] == str(i) and o["--ntasks"] == "1"
        assert o["--job-name"] == f"psar-shard-{i}"
        cfg = run_line(argv, _srun_env(o, recorded, 0))
        assert cfg["shard"] == i and cfg["bind"].startswith("0.0.0.0:")
        assert cfg["checkpoint_dir"] == "/shared/ckpt"
        servers = recorded["PSAR_SERVERS"].split(",")
        # The node's NodeAddr, not its name (the fake scontrol makes them differ).
        assert servers[i] == f"10.1.0.{i + 1}:{cfg['bind'].rpartition(':')[2]}"
    assert len(servers) == n_shards
    o, argv, recorded = worker_steps[0]
    n_workers = (nodes - n_shards) * int(per_node or 1)
    assert o["--ntasks"] == str(n_workers) and o["--relative"] == str(n_shards)
    assert o["--kill-on-bad-exit"] == "1"
    for procid in sorted({0, n_workers - 1}):
        cfg = run_line(argv, _srun_env(o, recorded, procid))
        res = cfg["_resolved"]
        assert cfg["arch"] == "ps" and res["rank"] == procid and res["world_size"] == n_workers
        assert res["servers"].split(",") == servers
        assert cfg["sigterm_exit_code"] == 1  # the failure's code wins srun's max
    # The workers' line was checked first, as is, before any step.
    assert run.dry_runs == [[*argv[1:], "--dry-run"]]
    # The workers done, every shard got SIGINT (drain, final checkpoint, exit 0): nothing
    # was cancelled.
    shard_ids = sorted(run.step_ids[f"psar-shard-{i}"] for i in range(n_shards))
    (stop,) = run.scancels
    assert stop.split()[:3] == ["--ctld", "--quiet", "--signal=INT"]
    assert sorted(stop.split()[3:]) == shard_ids


def test_slurm_ps_refuses_too_few_nodes(tmp_path) -> None:
    run = Run(SLURM / "ps.sbatch", tmp_path, 2, NUM_SHARDS="2")
    assert run.rc == 2 and not run.calls and "more nodes" in run.err


@pytest.mark.parametrize("script", ["ps.sbatch", "allreduce.sbatch"])
def test_slurm_configuration_error_stops_the_job_before_any_step(tmp_path, script) -> None:
    run = Run(SLURM / script, tmp_path, 3, FAKE_DRY_RUN_RC="2", WORKLOAD="bogus")
    assert run.rc == 2, run.err
    assert "unknown workload 'bogus'" in run.err
    if script == "ps.sbatch":  # the shards start while the flags are checked, then stop
        assert run.calls and all("--job-name=psar-shard-0" in c["argv"] for c in run.calls)
        assert run.scancels and "--signal=INT" in run.scancels[0]
    else:
        assert not run.calls  # no step started
    (line,) = run.dry_runs
    assert line[:2] == ["train", "--arch"] and line[-1] == "--dry-run" and "bogus" in line


def test_slurm_ps_a_shard_that_fails_ends_the_job(tmp_path) -> None:
    """The shard step exits at once: the job ends with its code and a line naming it; the
    workers are cancelled instead of waiting out their timeout, or never launched when the
    shard failed while their flags were checked (which comes first depends on the load)."""
    run = Run(SLURM / "ps.sbatch", tmp_path, 3, FAKE_SHARD_FAILS="1")
    assert run.rc == 1, run.err
    assert "psar: shard 0 (10.1.0.1:50051 on node00) exited with code 1" in run.err
    assert "could not bind" in run.err  # the shard's own line
    if "before the workers started" in run.err:
        # The shard failed while the workers' flags were checked: no worker was launched.
        assert "psar-workers" not in run.step_ids, run.err
        return
    # SIGTERM first (a worker leaves at once with exit code 1); the fake workers obey, so
    # the SIGKILL of a plain scancel is not needed.
    assert run.scancels[0] == f"--ctld --quiet --signal=TERM {run.step_ids['psar-workers']}"
    assert not any("psar-workers" in ln or "--signal" not in ln for ln in run.scancels[1:])


def test_slurm_ps_exit_code_is_the_workers(tmp_path) -> None:
    run = Run(SLURM / "ps.sbatch", tmp_path, 3, FAKE_WORKERS_RC="2")
    assert run.rc == 2, run.err
    assert run.scancels and "--signal=INT" in run.scancels[0]  # the shards still drain


@pytest.mark.parametrize(("nodes", "nproc"), [(None, None), (4, "8")])
def test_slurm_allreduce(tmp_path, nodes, nproc) -> None:
    path = SLURM / "allreduce.sbatch"
    opts = sbatch_options(path)
    assert opts["--ntasks-per-node"] == "1", "one torchrun per node"
    nodes = nodes or int(opts["--nodes"])
    run = Run(path, tmp_path, nodes, **({"NPROC_PER_NODE": nproc} if nproc else {}))
    assert run.rc == 0, run.err
    ((o, argv, recorded),) = run.steps
    assert o["--ntasks-per-node"] == "1" and o["--kill-on-bad-exit"] == "1"
    # torch's and torchrun's warnings are not psar's: errors only
    assert recorded["TORCH_CPP_LOG_LEVEL"] == "ERROR" and recorded["LOGLEVEL"] == "ERROR"
    assert recorded["TORCH_LOGS"] == "-distributed"
    # The task is a small bash wrapper that adds the node's own address: run it on the first
    # and the last node with a torchrun that only records what it was given.
    assert argv[:2] == ["bash", "-c"] and argv[3] == "torchrun", argv
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "torchrun").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$OUT"\n')
    (fake / "torchrun").chmod(0o755)
    for node in sorted({0, nodes - 1}):
        out = tmp_path / f"torchrun-{node}.txt"
        env = {"PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(out),
               "SLURMD_NODENAME": f"node{node:02d}", **recorded}  # fmt: skip
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        torchrun = ["torchrun", *out.read_text().splitlines()]
        assert torchrun[1] == f"--local-addr=10.1.0.{node + 1}"  # its NodeAddr
        cfg = run_line(torchrun, _srun_env(o, recorded, node))
        tr = cfg["_torchrun"]
        assert cfg["arch"] == "allreduce" and tr["local_addr"] == f"10.1.0.{node + 1}"
        assert tr["nnodes"] == nodes and tr["nproc"] == int(nproc or 1)
        assert tr["endpoint"] == "10.1.0.1:29400"  # the first node's NodeAddr
    assert run.dry_runs == [[*torchrun[torchrun.index("psar") + 1 :], "--dry-run"]]


def test_slurm_allreduce_wrapper_refuses_a_node_without_address(tmp_path) -> None:
    run = Run(SLURM / "allreduce.sbatch", tmp_path, 2)
    ((_, argv, recorded),) = run.steps
    env = {**os.environ, **recorded, "SLURMD_NODENAME": "elsewhere"}
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "no address for elsewhere" in p.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_slurm_shellcheck() -> None:
    p = subprocess.run(["shellcheck", *map(str, sorted(SLURM.glob("*.sbatch")))],
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 0, p.stdout


def test_output_files_are_ignored_by_git() -> None:
    """Each script writes its output to the submit folder as psar-*.out (a checkout, often)."""
    for path in SLURM.glob("*.sbatch"):
        out = re.search(r"#SBATCH --output=(\S+)", path.read_text()).group(1)
        assert re.fullmatch(r"psar-[\w-]+-%j\.out", out), out
    assert "psar-*.out" in (ROOT / ".gitignore").read_text().splitlines()
