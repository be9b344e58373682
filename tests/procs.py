"""Start real psar processes for integration tests: shards, PS workers, torchrun jobs.

Every process is started in its own session and killed (with its group) when the
test ends, so a failing test never leaves servers behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

PSAR = [sys.executable, "-m", "psar.worker.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def run_own_group(args: Sequence[str], timeout: float, **popen: Any) -> subprocess.CompletedProcess:
    """Run `args` to the end in a process group of its own (text output captured; popen:
    more Popen arguments) and kill the group afterwards, so a child that hangs, a
    torchrun rank say, ends with its test instead of outliving it."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "env": ENV, **popen}
    proc = subprocess.Popen(args, text=True, start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        _kill(proc)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@contextlib.contextmanager
def shards(n: int, *extra: str, metrics_ports: Sequence[int] | None = None) -> Iterator[list[str]]:
    """Start n `psar server` processes on free loopback ports; yields their addresses."""
    procs, addrs = [], []
    try:
        for i in range(n):
            metrics = ["--metrics-port", str(metrics_ports[i])] if metrics_ports else []
            p = subprocess.Popen(
                [*PSAR, "server", "--bind", "127.0.0.1:0", "--shard", str(i), *metrics, *extra],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=ENV,
                start_new_session=True,
            )
            procs.append(p)
        for p in procs:
            deadline = time.monotonic() + 60
            while True:
                line = p.stdout.readline()
                m = re.search(r"listening on (\S+:\d+)", line)
                if m:
                    addrs.append(m.group(1))
                    break
                if not line and p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"shard did not start: {line!r}")
        yield addrs
    finally:
        for p in procs:
            _kill(p)


def run_ps_workers(
    servers: Sequence[str],
    world: int,
    tmp: Path,
    common: Sequence[str],
    per_rank: dict[int, Sequence[str]] | None = None,
    timeout: float = 240,
) -> list[dict]:
    """Run `world` PS workers to completion; returns their reports (rank order)."""
    procs = []
    try:
        for r in range(world):
            args = [
                *PSAR, "train", "--arch", "ps", "--servers", ",".join(servers),
                "--rank", str(r), "--world-size", str(world), "--torch-threads", "1",
                "--report", str(tmp / f"report-{r}.json"), "--log-every", "0",
                *common, *(per_rank or {}).get(r, ()),
            ]  # fmt: skip
            log = open(tmp / f"worker{r}.log", "w")  # noqa: SIM115 - closed by the child exit
            procs.append(
                subprocess.Popen(
                    args, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
                )
            )
        deadline = time.monotonic() + timeout
        for r, p in enumerate(procs):
            rc = p.wait(timeout=max(1, deadline - time.monotonic()))
            if rc != 0:
                raise AssertionError(
                    f"worker {r} exited {rc}:\n{(tmp / f'worker{r}.log').read_text()[-3000:]}"
                )
        return [json.loads((tmp / f"report-{r}.json").read_text()) for r in range(world)]
    finally:
        for p in procs:
            _kill(p)


def run_torchrun(world: int, tmp: Path, common: Sequence[str], timeout: float = 240) -> dict:
    """Run `psar train --arch allreduce` under torchrun with `world` ranks; rank 0's report."""
    args = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "psar.worker.cli", "train", "--arch", "allreduce", "--torch-threads", "1",
        "--report", str(tmp / "report-ddp.json"), "--log-every", "0", *common,
    ]  # fmt: skip
    p = run_own_group(args, timeout)  # a rank hung at exit once and outlived its test
    if p.returncode != 0:
        raise AssertionError(
            f"torchrun exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
        )
    return json.loads((tmp / "report-ddp.json").read_text())


def shard_stats(addrs: Sequence[str]) -> list[dict]:
    """Each live shard's counters and state digest (the Stats RPC)."""
    from psar.ps.client.psclient import PSClient

    with PSClient(addrs, worker=0) as client:
        return client.stats()
