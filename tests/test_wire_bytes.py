"""The bytes a worker reports (bytes_sent / bytes_received: `psar compare`'s
bytes/step/worker) are what crosses its network interface, under both architectures.

Each worker runs on a host of its own (a network namespace, tests/netns.py), so its
interface counters hold its traffic alone. Start-up (Init's weights, rendezvous, DDP's
initial broadcast, teardown) is the same for a short and a long run of the same job, so
the difference of the two divided by the difference in steps is the wire's bytes per
step; the reports are differenced the same way. The interface adds TCP/IP headers and
ACKs (a few %), hence the tolerance; a count off by the ring's 2(n-1)/n (4/3 with three
ranks) or by a whole direction is far outside it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import netns

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]
SHORT, LONG = 4, 24
MODEL = ["--workload", "mlp", "--workload-option", "in_dim=256", "--workload-option",
         "hidden=512", "--batch-size", "16", "--precision", "fp32", "--eval-batches", "0",
         "--log-every", "0", "--torch-threads", "1"]  # fmt: skip
TOLERANCE = (0.99, 1.06)
"""Interface bytes / reported payload bytes per step (measured 1.002-1.004: the veths
carry large segments, so TCP/IP headers and ACKs add well under 1%)."""
_ROLE_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PSAR_RANK",
              "PSAR_WORLD_SIZE", "PSAR_SERVERS", "PSAR_SHARD", "SLURM_PROCID", "SLURM_NTASKS",
              "SLURM_LOCALID", "JOB_COMPLETION_INDEX")  # fmt: skip

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in _ROLE_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **extra)
    return env


@pytest.fixture(autouse=True)
def _namespaces() -> None:
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)


def _counters(host: netns.Host) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of the host's interface."""
    out = subprocess.run(["ip", "-j", "-s", "-n", host.ns, "link", "show", host.ifname],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    stats = json.loads(out)[0]["stats64"]
    return stats["tx"]["bytes"], stats["rx"]["bytes"]


def _wait_all(procs: list, logs: list[Path], timeout: float) -> None:
    for p, log in zip(procs, logs, strict=True):
        rc = p.wait(timeout=timeout)
        assert rc == 0, log.read_text()[-3000:]


def _ps_run(lan: netns.Lan, tmp: Path, steps: int) -> tuple[list[tuple[int, int]], list[dict]]:
    """One PS job (one shard on its host, a worker on each of w0, w1): per worker, the
    interface's (tx, rx) during the job and its report."""
    shard_host = lan["shards"]
    shard = shard_host.popen(
        [PY, "-m", "psar.worker.cli", "server", "--bind", f"{shard_host.addr}:0",
         "--allow-insecure-bind"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT)  # fmt: skip
    addr = None
    for _ in range(200):
        line = shard.stdout.readline()
        if m := re.search(r"listening on (\S+:\d+)", line):
            addr = m.group(1)
            break
        if not line and shard.poll() is not None:
            break
    assert addr, "shard did not start"
    hosts = [lan["w0"], lan["w1"]]
    before = [_counters(h) for h in hosts]
    procs, logs = [], []
    for rank, host in enumerate(hosts):
        log = tmp / f"ps-{steps}-{rank}.log"
        argv = [PY, "-m", "psar.worker.cli", "train", "--arch", "ps", *MODEL, "--steps", str(steps),
                "--report", str(tmp / f"ps-{steps}-report-{{rank}}.json")]  # fmt: skip
        env = _env(PSAR_RANK=str(rank), PSAR_WORLD_SIZE="2", PSAR_SERVERS=addr)
        procs.append(host.popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT))  # fmt: skip
        logs.append(log)
    _wait_all(procs, logs, timeout=180)
    after = [_counters(h) for h in hosts]
    shard.kill()
    shard.wait(timeout=10)
    reports = [json.loads((tmp / f"ps-{steps}-report-{r}.json").read_text()) for r in (0, 1)]
    return [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)], reports


def _ddp_run(lan: netns.Lan, tmp: Path, steps: int, names: list[str]) -> tuple[list, list]:
    """One torchrun job with one rank per host: per rank (tx, rx) and its report."""
    hosts = [lan[n] for n in names]
    endpoint = f"{hosts[0].addr}:29400"
    before = [_counters(h) for h in hosts]
    procs, logs = [], []
    for i, host in enumerate(hosts):
        log = tmp / f"ddp-{steps}-{i}.log"
        argv = [PY, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)),
                "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-id", f"bytes{steps}", "--rdzv-conf", f"is_host={int(i == 0)}",
                "--local-addr", host.addr, "--max-restarts", "0", "-m", "psar.worker.cli", "train",
                "--arch", "allreduce", *MODEL, "--steps", str(steps),
                "--report", str(tmp / f"ddp-{steps}-report-{{rank}}.json")]  # fmt: skip
        env = _env(GLOO_SOCKET_IFNAME="eth0")
        procs.append(host.popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT))  # fmt: skip
        logs.append(log)
    _wait_all(procs, logs, timeout=180)
    after = [_counters(h) for h in hosts]
    report = json.loads((tmp / f"ddp-{steps}-report-0.json").read_text())  # rank 0 reports
    return [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)], [report]


def _per_step(long: float, short: float) -> float:
    return (long - short) / (LONG - SHORT)


def _check(name: str, wire: tuple[float, float], reported: tuple[float, float]) -> None:
    for what, w, r in zip(("sent", "received"), wire, reported, strict=True):
        assert r > 0, (name, what)
        ratio = w / r
        print(f"{name} {what}: interface {w:,.0f} B/step, reported {r:,.0f} B/step, {ratio:.3f}")
        assert TOLERANCE[0] <= ratio <= TOLERANCE[1], (name, what, w, r)


def test_ps_worker_bytes_match_its_interface(tmp_path: Path) -> None:
    with netns.lan(["shards", "w0", "w1"]) as lan:
        short_wire, short_rep = _ps_run(lan, tmp_path, SHORT)
        long_wire, long_rep = _ps_run(lan, tmp_path, LONG)
    for rank in (0, 1):
        wire = tuple(_per_step(long_wire[rank][i], short_wire[rank][i]) for i in (0, 1))
        rep = tuple(_per_step(long_rep[rank][k], short_rep[rank][k])
                    for k in ("bytes_sent", "bytes_received"))  # fmt: skip
        _check(f"ps rank {rank}", wire, rep)
        # A PS worker sends its gradient once and receives the weights once.
        assert long_rep[rank]["bytes_sent"] == long_rep[rank]["bytes_pushed"]


def test_ring_allreduce_rank_bytes_match_its_interface(tmp_path: Path) -> None:
    names = ["n0", "n1", "n2"]  # three ranks: the ring's 2(n-1)/n is 4/3, not 1
    with netns.lan(names) as lan:
        short_wire, (short_rep,) = _ddp_run(lan, tmp_path, SHORT, names)
        long_wire, (long_rep,) = _ddp_run(lan, tmp_path, LONG, names)
    rep = tuple(_per_step(long_rep[k], short_rep[k]) for k in ("bytes_sent", "bytes_received"))
    payload = _per_step(long_rep["bytes_allreduced"], short_rep["bytes_allreduced"])
    assert rep[0] == pytest.approx(payload * 4 / 3, rel=1e-6)
    for i in range(len(names)):  # every rank of a ring moves the same
        wire = tuple(_per_step(long_wire[i][j], short_wire[i][j]) for j in (0, 1))
        _check(f"allreduce rank {i}", wire, rep)
