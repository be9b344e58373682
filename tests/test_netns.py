"""A multi-host run on one machine: shards on one host, workers on two others, each host
a network namespace on a private bridge (tests/netns.py). Processes only talk over those
addresses; the metrics are scraped from yet another host (the hub).

The workers learn their role the way a Kubernetes Indexed Job gives it
(JOB_COMPLETION_INDEX, PSAR_WORLD_SIZE, PSAR_SERVERS; docs/launch-contract.md), so this
is also an end-to-end check of the launch contract. Skipped where namespaces cannot be
made (not root, no iproute2, no CAP_NET_ADMIN).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import netns

PY = sys.executable
STEPS, BATCH = 20, 16
SHARD_PORTS = (50051, 50052)
METRICS = 9400
ROOT = Path(__file__).resolve().parents[1]
# Drop anything a launcher around pytest may have set: roles come from what we give.
_ROLE_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PSAR_RANK",
              "PSAR_WORLD_SIZE", "PSAR_SERVERS", "PSAR_SHARD", "SLURM_PROCID", "SLURM_NTASKS",
              "SLURM_LOCALID", "JOB_COMPLETION_INDEX")  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in _ROLE_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **extra)
    return env


@pytest.fixture
def lan3():
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with netns.lan(["shards", "w0", "w1"]) as lan:
        yield lan


def _value(text: str, name: str) -> float:
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    )


def _scrape_until(host: netns.Host, url: str, name: str, at_least: float, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            text = host.fetch(url, timeout=3)
            if _value(text, name) >= at_least:
                return text
            last = f"{name}={_value(text, name)}"
        except OSError as e:
            last = str(e)
        time.sleep(0.3)
    raise AssertionError(f"{url}: {name} never reached {at_least} ({last})")


def _wait_listening(p, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        m = re.search(r"listening on (\S+:\d+)", line)
        if m:
            return m.group(1)
        if not line and p.poll() is not None:
            break
    raise AssertionError(f"shard did not start (exit {p.poll()})")


@pytest.mark.slow  # CI's slow stage runs it; the default run stays under 10 min
def test_ps_job_across_namespaces(lan3, tmp_path) -> None:
    t0 = time.monotonic()
    shards_host, hub = lan3["shards"], lan3.hub
    # Two shards on the shard host, bound to its LAN address only.
    shard_procs = []
    for i, port in enumerate(SHARD_PORTS):
        argv = [PY, "-m", "psar.worker.cli", "server", "--bind", f"{shards_host.addr}:{port}",
                "--shard", str(i), "--metrics-port", str(METRICS + i),
                "--metrics-addr", shards_host.addr, "--allow-insecure-bind"]  # fmt: skip
        out = subprocess.PIPE
        p = shards_host.popen(
            argv, stdout=out, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT
        )
        shard_procs.append(p)
    addrs = [_wait_listening(p) for p in shard_procs]
    assert addrs == [f"{shards_host.addr}:{p}" for p in SHARD_PORTS]

    # Isolation: a worker host cannot reach the shards on its own loopback.
    probe = lan3["w0"].run(
        [PY, "-c", "import socket; socket.create_connection(('127.0.0.1', 50051), timeout=2)"]
    )
    assert probe.returncode != 0, "w0's loopback reached a shard: namespaces are not isolated"

    # Two workers, one per host, roles from an Indexed Job's environment.
    servers = ",".join(addrs)
    workers = []
    for rank, name in enumerate(("w0", "w1")):
        host = lan3[name]
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed by the child exit
        argv = [PY, "-m", "psar.worker.cli", "train", "--arch", "ps", "--steps", str(STEPS),
                "--batch-size", str(BATCH), "--precision", "fp32", "--eval-batches", "0",
                "--log-every", "0", "--torch-threads", "1", "--metrics-port", str(METRICS),
                "--metrics-addr", host.addr, "--metrics-linger-s", "8",
                "--report", str(tmp_path / "report-{rank}.json")]  # fmt: skip
        env = _env(JOB_COMPLETION_INDEX=str(rank), PSAR_WORLD_SIZE="2", PSAR_SERVERS=servers)
        workers.append(host.popen(argv, stdout=log, stderr=log, env=env, cwd=ROOT))

    # Scraped across namespaces, from the hub, while the workers linger.
    urls = [f"http://{lan3[n].addr}:{METRICS}/metrics" for n in ("w0", "w1")]
    finals = [_scrape_until(hub, u, "psar_worker_steps_total", STEPS, timeout=120) for u in urls]
    for text in finals:
        assert _value(text, "psar_worker_steps_total") == STEPS
        assert _value(text, "psar_worker_samples_total") == STEPS * BATCH
    shard_texts = [hub.fetch(f"http://{shards_host.addr}:{METRICS + i}/metrics") for i in range(2)]
    applied = [_value(t, "psar_ps_updates_applied_total") for t in shard_texts]
    received = [_value(t, "psar_ps_bytes_received_total") for t in shard_texts]
    assert max(applied) == STEPS, applied  # sync: one update per step on each shard used
    assert sum(received) > 0

    # The job finishes: both workers exit 0 after their linger, reports agree.
    for name, p in zip(("w0", "w1"), workers, strict=True):
        rc = p.wait(timeout=60)
        assert rc == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    reports = [json.loads((tmp_path / f"report-{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["steps"] == STEPS and r["world_size"] == 2 for r in reports)
    # The shards are on another host: --early-pull's default turned it on for the job
    # (no shard flag), and slots came back while pushes still streamed.
    assert sum(s["early_pull_slots"] for s in reports[0]["shards"]) > 0
    print(f"netns PS job: {time.monotonic() - t0:.1f}s")


@pytest.mark.slow
def test_allreduce_job_across_namespaces(tmp_path) -> None:
    """`torchrun --rdzv-backend c10d` on two hosts, as deploy/slurm/allreduce.sbatch runs it."""
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    with netns.lan(["n0", "n1"]) as lan:
        endpoint = f"{lan['n0'].addr}:29400"
        procs = []
        for name in ("n0", "n1"):
            # torchrun hosts the c10d store where the endpoint names this machine's hostname
            # and advertises its FQDN; namespaces share one hostname, so say which host
            # holds the store and which address to advertise (as on a multi-NIC node).
            is_host = "1" if name == "n0" else "0"
            log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed by the child exit
            argv = [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "netns",
                    "--rdzv-conf", f"is_host={is_host}", "--local-addr", lan[name].addr,
                    "--max-restarts", "0", "-m", "psar.worker.cli", "train", "--arch", "allreduce",
                    "--steps", str(STEPS), "--batch-size", str(BATCH), "--precision", "fp32",
                    "--eval-batches", "0", "--log-every", "0", "--torch-threads", "1",
                    "--report", str(tmp_path / "report-{rank}.json")]  # fmt: skip
            env = _env(GLOO_SOCKET_IFNAME="eth0")
            procs.append(lan[name].popen(argv, stdout=log, stderr=log, env=env, cwd=ROOT))
        for name, p in zip(("n0", "n1"), procs, strict=True):
            rc = p.wait(timeout=90)
            assert rc == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    report = json.loads((tmp_path / "report-0.json").read_text())  # DDP: rank 0 reports
    assert report["arch"] == "allreduce"
    assert report["steps"] == STEPS and report["world_size"] == 2
    print(f"netns allreduce job: {time.monotonic() - t0:.1f}s")


def test_lan_helpers_shape_and_clean_up() -> None:
    """tests/netns.py for benchmarks: tc shaping on a host's link, and nothing left after."""
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with netns.lan(["a", "b"]) as lan:
        names = {h.ns for h in lan.all_hosts()}
        argv = netns.shape(lan["a"], rate_mbit=200)  # tbf: rate only
        assert "tbf" in argv
        assert "tbf" in lan["a"].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
        if netns.netem_available():
            netns.shape(lan["a"], delay_ms=2, rate_mbit=200)
            assert "netem" in lan["a"].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
        else:
            with pytest.raises(netns.ShapingUnavailable):
                netns.shape(lan["a"], delay_ms=2)
        netns.shape(lan["a"])  # no arguments: back to the default qdisc
        assert "tbf" not in lan["a"].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
        echo = "import sys; print(open('/proc/self/net/dev').read().count('eth0'))"
        assert lan["b"].run([PY, "-c", echo]).stdout.strip() == "1"
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not names & {ln.split()[0] for ln in left.splitlines() if ln.strip()}


def test_lan_hostnames_hosts_files_and_teardown_of_escaped_processes() -> None:
    """lan(hostnames=True): each host has its name as hostname and an /etc/hosts naming
    only itself; a process that left its process group (a daemon) is killed with the
    namespaces, and their /etc/netns folders are removed."""
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with netns.lan(["alpha", "beta"], hostnames=True) as lan:
        a = lan["alpha"]
        assert a.run(["hostname"]).stdout.strip() == "alpha"
        assert lan.hub.run(["hostname"]).stdout.strip() == "hub"
        hosts = a.run(["cat", "/etc/hosts"]).stdout
        assert f"{a.addr}\talpha" in hosts and "beta" not in hosts
        lookup = "import socket, sys; print(socket.gethostbyname(sys.argv[1]))"
        assert a.run([PY, "-c", lookup, "alpha"]).stdout.strip() == a.addr
        assert a.run([PY, "-c", lookup, "beta"]).returncode != 0  # by address only
        # A daemon: double fork, new session, so Host.kill_all does not reach it.
        spawn = (
            "import subprocess as s; print(s.Popen(['sleep', '300'], start_new_session=True,"
            " stdout=s.DEVNULL, stderr=s.DEVNULL).pid)"
        )
        daemon = int(lan["beta"].run([PY, "-c", spawn]).stdout)
        etc = [Path(netns.ETC_NETNS) / h.ns for h in lan.all_hosts()]
        assert all(p.is_dir() for p in etc)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{daemon}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # killed; reaped by init
    stat = Path(f"/proc/{daemon}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z", "the daemon survived"
    assert not any(p.exists() for p in etc)
