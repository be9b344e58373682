"""deploy/slurm/*.sbatch on a real Slurm: slurmctld and three slurmd, each node a network
namespace with its own hostname, address and /etc/hosts (tests/slurm_cluster.py). The
scripts run unchanged, submitted with sbatch, as a user would; psar and torchrun come
from the submitter's PATH (the job inherits it), psar's code from PYTHONPATH.

A node's /etc/hosts names only itself, so a script that used node names as addresses
fails here: everything must go by NodeAddr. Slow (about a minute and a half in all) and
skipped, with the reason, where Slurm is not installed (`apt-get install -y slurm-wlm
munge`) or namespaces cannot be made (not root). tests/test_deploy_slurm.py checks the
same scripts with fake Slurm commands on every run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import slurm_cluster

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "deploy" / "slurm"
JOB_ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "STEPS": "20", "BATCH_SIZE": "16"}  # fmt: skip
WORKER_TIMEOUT_S = 60.0  # psar train's --timeout-s: what workers would wait for a dead shard
pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path):
    reason = slurm_cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    with slurm_cluster.cluster(tmp_path) as c:
        print(f"slurm: 3 nodes up in {time.monotonic() - t0:.1f}s")
        names = {h.ns for h in c.lan.all_hosts()}
        yield c
    # Torn down: no namespace, and no process of the cluster or its jobs, left.
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not names & {ln.split()[0] for ln in listed.splitlines() if ln.strip()}
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "slurm")], capture_output=True)
    assert left.returncode == 1, f"still running: {left.stdout.decode()}"


def _submit(c, tmp_path: Path, script: str, **env: str) -> slurm_cluster.JobResult:
    job = c.sbatch(SLURM / script, env={**JOB_ENV, **env}, cwd=tmp_path)
    result = c.wait(job, timeout=300)
    print(f"{script} {env or ''}: job {job} {result.state} {result.exit_code} "
          f"in {result.elapsed_s:.1f}s\n{c.sacct(job)}")  # fmt: skip
    assert Path(tmp_path / f"psar-{script.split('.')[0]}-{job}.out").exists()
    return result


def _error_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if re.search(r"error|abort|terminate", ln, re.I)]


def test_ps_job_completes_and_its_shards_drain(cluster, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    r = _submit(cluster, tmp_path, "ps.sbatch", CHECKPOINT_DIR=str(ckpt))
    assert (r.state, r.exit_code) == ("COMPLETED", "0:0"), r.output
    assert not _error_lines(r.output), r.output
    # By NodeAddr: node1's name does not resolve on the worker nodes.
    assert f"psar: 1 shard(s) {cluster.lan['node1'].addr}:50051; 2 worker(s)" in r.output
    assert '"steps": 20' in r.output and '"final_train_loss"' in r.output
    # SIGINT from the script, not the SIGKILL of an aborted srun.
    assert "shard 0: SIGINT, draining" in r.output, r.output
    assert "psar server final checkpoint at step 20" in r.output
    assert "shard 0: drained and stopped" in r.output
    assert any(ckpt.iterdir()), "no checkpoint written"


def test_allreduce_job_completes(cluster, tmp_path) -> None:
    r = _submit(cluster, tmp_path, "allreduce.sbatch")
    assert (r.state, r.exit_code) == ("COMPLETED", "0:0"), r.output
    assert not _error_lines(r.output), r.output
    assert f"rendezvous {cluster.lan['node1'].addr}:29400" in r.output
    assert '"arch": "allreduce"' in r.output and '"steps": 20' in r.output


@pytest.mark.parametrize("script", ["ps.sbatch", "allreduce.sbatch"])
def test_a_configuration_error_is_exit_code_2(cluster, tmp_path, script) -> None:
    r = _submit(cluster, tmp_path, script, WORKLOAD="bogus")
    assert (r.state, r.exit_code) == ("FAILED", "2:0"), r.output
    assert "psar train: error: unknown workload 'bogus'" in r.output
    assert "SIGTERM" not in r.output and "CANCELLED" not in r.output


def test_a_shard_that_cannot_start_fails_the_job_at_once(cluster, tmp_path) -> None:
    """Port 50051 on node1 is taken: the shard fails, and the job with it, naming the shard,
    long before the workers would have given up on it (--timeout-s)."""
    node1 = cluster.lan["node1"]
    hold = node1.popen([sys.executable, "-c", "import socket, time\n"
                        "s = socket.socket(); s.bind(('0.0.0.0', 50051)); s.listen()\n"
                        "print('held', flush=True); time.sleep(600)"],
                       stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert hold.stdout.readline().strip() == "held"
    r = _submit(cluster, tmp_path, "ps.sbatch")
    assert r.state == "FAILED" and r.exit_code == "1:0", r.output
    assert "psar server: error: shard 0: could not bind 0.0.0.0:50051" in r.output, r.output
    # Which comes first, the shard's failure or the workers' launch, depends on the load:
    # ps.sbatch checks the workers' flags while the shards start.
    named = f"psar: shard 0 ({node1.addr}:50051 on node1) exited with code 1 "
    assert named + "while the workers ran" in r.output or (
        named + "before the workers started" in r.output
    ), r.output
    assert "DEADLINE_EXCEEDED" not in r.output  # no worker waited the shard out
    assert "terminate called" not in r.output and "Abort" not in r.output
    fields = cluster.job_fields(r.job_id)
    ran = _seconds(fields["EndTime"]) - _seconds(fields["StartTime"])
    print(f"job ran {ran:.0f}s by Slurm's clock (the issue asks for < 15 s)")
    assert ran < WORKER_TIMEOUT_S, f"the job lasted {ran}s: did it wait for the workers?"


def _seconds(stamp: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
