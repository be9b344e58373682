"""A real Slurm on one machine: slurmctld and one slurmd per emulated node, each node a
network namespace with its own hostname, address and /etc/hosts (tests/netns.py).

    from tests import slurm_cluster

    reason = slurm_cluster.unavailable_reason()   # None, or why there is no Slurm here
    with slurm_cluster.cluster(tmp_path, nodes=3) as c:
        job = c.sbatch(script, env={"STEPS": "20"})
        result = c.wait(job, timeout=180)          # state, exit code, the job's output
        result.state, result.exit_code, result.output

Layout: the LAN's hub ("hub", 10.77.x.254) runs slurmctld and is the login node where
sbatch, scontrol and sacct run; nodes node1..nodeN (10.77.x.1..N) each run a slurmd. Node
names are no addresses here: a node's /etc/hosts names only itself, so another node is
reached by the NodeAddr slurm.conf gives it, as on a cluster whose node names are not
(or not the right) network addresses. One munged, in the root namespace, serves all of
them through its socket (AuthInfo=socket=...). Everything lives in a temporary folder
(slurm.conf, state, spool, logs; SLURM_CONF points the commands at it); nothing under
/etc/slurm or /etc/munge is read or written. On exit the jobs are cancelled and every
daemon and job process is killed, then the namespaces are deleted. Every wait is bounded.

No accounting database: jobs are recorded by jobcomp/filetxt, which `sacct --completion`
reads (State, ExitCode), and `scontrol show job` while the controller remembers them.
Needs root, iproute2, util-linux's unshare, and `apt-get install -y slurm-wlm munge`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tests import netns

NEEDED = ("slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol", "scancel",
          "squeue", "sinfo", "sacct", "munged")  # fmt: skip
SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")
INSTALL = "apt-get install -y slurm-wlm munge"
SUBNET = "10.77.9"  # apart from netns.DEFAULT_SUBNET; namespaces keep them apart anyway
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
        "PREEMPTED", "BOOT_FAIL", "DEADLINE"}  # fmt: skip


def which(name: str) -> str | None:
    """A Slurm/munge binary, also from the sbin folders a non-login PATH may lack."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def unavailable_reason() -> str | None:
    """None when a Slurm cluster can be started here, else why not."""
    missing = [n for n in NEEDED if which(n) is None]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)}): {INSTALL}"
    if shutil.which("unshare") is None:
        return "util-linux's `unshare` is missing (per-node hostnames)"
    return netns.unavailable_reason()


@dataclass
class JobResult:
    job_id: str
    state: str  # COMPLETED, FAILED, CANCELLED, ...
    exit_code: str  # "rc:signal", as sacct and scontrol print it
    output: str  # the job's --output file
    elapsed_s: float  # from submission to the controller's record of its end


class Cluster:
    """A started cluster (use `cluster()`)."""

    def __init__(self, lan: netns.Lan, folder: Path, env: dict[str, str]) -> None:
        self.lan = lan
        self.folder = folder
        self.env = env  # SLURM_CONF, PATH with sbin: what the Slurm commands need
        self.nodes = sorted(lan.hosts)

    @property
    def login(self) -> netns.Host:
        return self.lan.hub

    def command(self, argv: list[str], timeout: float = 30, **env: str) -> str:
        """A Slurm command on the login node; its stdout, or RuntimeError with stderr."""
        p = self.login.run(argv, env={**self.env, **env}, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()}")
        return p.stdout

    def sbatch(self, script: Path, *options: str, env: Mapping[str, str] = (), cwd: Path) -> str:
        """Submit script from cwd (its output files land there) with env added to the
        submitter's environment (sbatch exports it to the job); returns the job id."""
        out = self.command(["sbatch", "--parsable", f"--chdir={cwd}", *options, str(script)],
                           **dict(env))  # fmt: skip
        return out.strip().split(";")[0]

    def job_fields(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict ({} once the controller forgot the job)."""
        p = self.login.run(["scontrol", "-o", "show", "job", job_id], env=self.env, timeout=30)
        if p.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", p.stdout))

    def wait(self, job_id: str, timeout: float) -> JobResult:
        """Wait (bounded) until the job has ended; its state, exit code and output."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in DONE:
                break
            time.sleep(0.5)
        else:
            with contextlib.suppress(RuntimeError):
                self.command(["scancel", job_id])
            raise AssertionError(
                f"job {job_id} still {fields.get('JobState')} after {timeout:.0f}s\n"
                f"{self.read_output(fields)[-4000:]}"
            )
        return JobResult(job_id, fields["JobState"], fields.get("ExitCode", "?"),
                         self.read_output(fields), time.monotonic() - t0)  # fmt: skip

    @staticmethod
    def read_output(fields: Mapping[str, str]) -> str:
        path = fields.get("StdOut", "")
        return Path(path).read_text(errors="replace") if path and Path(path).exists() else ""

    def sacct(self, job_id: str) -> str:
        """`sacct --completion` lines (JobID, State, ExitCode) from the job completion log."""
        return self.command(["sacct", "--completion", "-j", job_id, "-o",
                             "JobID,JobName,State,ExitCode", "-X"])  # fmt: skip

    def cancel_all(self) -> None:
        """Cancel every job and wait (bounded) until none is left running."""
        self.login.run(["scancel", "--full", "--user", "root"], env=self.env, timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            p = self.login.run(["squeue", "-h", "-o", "%i"], env=self.env, timeout=30)
            if p.returncode != 0 or not p.stdout.strip():
                return
            time.sleep(0.5)


def _conf(folder: Path, lan: netns.Lan, munge_socket: Path) -> str:
    # Every slurmd sees this machine's CPUs; offering at most 2 per node lets 2 tasks share
    # a node (WORKERS_PER_NODE=2) and never exceeds the hardware (a node would be drained).
    cpus = max(1, min(2, os.cpu_count() or 1))
    nodes = "\n".join(
        f"NodeName={n} NodeAddr={lan[n].addr} CPUs={cpus} State=UNKNOWN" for n in sorted(lan.hosts)
    )
    return f"""\
# Written by tests/slurm_cluster.py for one test's cluster.
ClusterName=psartest
SlurmctldHost={lan.hub.name}({lan.hub.addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={folder}/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
KillWait=10
MinJobAge=3600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _start_munge(folder: Path) -> tuple[subprocess.Popen, Path]:
    mdir = folder / "munge"
    mdir.mkdir(mode=0o700)
    key = mdir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = mdir / "munge.socket"
    argv = [which("munged"), "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
            f"--pid-file={mdir / 'munged.pid'}", f"--log-file={mdir / 'munged.log'}",
            f"--seed-file={mdir / 'munged.seed'}"]  # fmt: skip
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 15
    while not sock.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            _stop(p)
            raise RuntimeError(f"munged did not start: {p.stderr.read() if p.stderr else ''}")
        time.sleep(0.1)
    return p, sock


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def _log_tail(path: Path, n: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


@contextlib.contextmanager
def cluster(folder: Path, nodes: int = 3, start_timeout: float = 60) -> Iterator[Cluster]:
    """Start munged, slurmctld on the hub and slurmd on node1..node{nodes}; yields the
    Cluster once every node is idle; kills all of it on exit (module docstring)."""
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    folder = folder / "slurm"
    for sub in ("state", "cgroup", *(f"spool/node{i + 1}" for i in range(nodes))):
        (folder / sub).mkdir(parents=True)
    munged, sock = _start_munge(folder)
    try:
        with netns.lan([f"node{i + 1}" for i in range(nodes)], SUBNET, hostnames=True) as lan:
            conf = folder / "slurm.conf"
            conf.write_text(_conf(folder, lan, sock))
            # slurmd 22.05 always loads a cgroup plugin; no plugin here uses it, so point
            # it at an empty folder (`ip netns exec` hides the host's /sys/fs/cgroup).
            (folder / "cgroup.conf").write_text(
                f"CgroupPlugin=cgroup/v1\nCgroupAutomount=no\nCgroupMountpoint={folder}/cgroup\n"
            )
            path = os.pathsep.join([*SBIN, os.environ.get("PATH", "")])
            env = {**os.environ, "SLURM_CONF": str(conf), "PATH": path}
            c = Cluster(lan, folder, env)
            try:
                lan.hub.popen([which("slurmctld"), "-D", "-i", "-f", str(conf)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
                for name in c.nodes:
                    lan[name].popen([which("slurmd"), "-D", "-f", str(conf)], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
                _wait_idle(c, start_timeout)
                yield c
            finally:
                with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                    c.cancel_all()
    finally:
        _stop(munged)


def _wait_idle(c: Cluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        p = c.login.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=c.env, timeout=30)
        last = (p.stdout + p.stderr).strip()
        states = dict(ln.split() for ln in p.stdout.splitlines() if len(ln.split()) == 2)
        if p.returncode == 0 and sorted(states) == c.nodes and set(states.values()) == {"idle"}:
            return
        time.sleep(0.5)
    raise RuntimeError(
        f"the Slurm nodes did not come up in {timeout:.0f}s (sinfo: {last})\n"
        f"slurmctld.log:\n{_log_tail(c.folder / 'slurmctld.log')}\n"
        f"slurmd-node1.log:\n{_log_tail(c.folder / 'slurmd-node1.log')}"
    )
