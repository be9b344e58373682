"""Process helpers for the fault tests: shards on fixed ports that can be killed and
restarted, workers started in the background, and polling a shard's Stats."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from tests.procs import ENV, PSAR, free_port

BASE = ["--workload", "mlp", "--batch-size", "16", "--seed", "1", "--precision", "fp32",
        "--eval-batches", "0", "--torch-threads", "1", "--log-every", "0"]  # fmt: skip


class Shard:
    """One `psar server` on a fixed loopback port, killable and restartable."""

    def __init__(self, index: int, log_dir: Path, *extra: str, port: int | None = None) -> None:
        self.index = index
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.extra = list(extra)
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, *more: str) -> None:
        self.starts += 1
        log = open(self.log_dir / f"shard{self.index}-{self.starts}.log", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*PSAR, "server", "--bind", self.address, "--shard", str(self.index),
             *self.extra, *more],
            stdout=log, stderr=subprocess.STDOUT, text=True, env=ENV, start_new_session=True,
        )  # fmt: skip
        self._log = log
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = (self.log_dir / f"shard{self.index}-{self.starts}.log").read_text()
            if re.search(r"listening on \S+:\d+", text):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"shard {self.index} did not start:\n{self.output()}")

    def output(self) -> str:
        return (self.log_dir / f"shard{self.index}-{self.starts}.log").read_text()

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self) -> int:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def shard_set(n: int, tmp: Path, *extra: str) -> Iterator[list[Shard]]:
    shards = [Shard(i, tmp, *extra) for i in range(n)]
    try:
        for s in shards:
            s.start()
        yield shards
    finally:
        for s in shards:
            s.stop()


class Workers:
    """`world` PS workers running in the background."""

    def __init__(self, servers: Sequence[str], world: int, tmp: Path, args: Sequence[str],
                 per_rank: dict[int, Sequence[str]] | None = None) -> None:  # fmt: skip
        self.tmp, self.world = tmp, world
        self.procs: list[subprocess.Popen | None] = []
        for r in range(world):
            self.procs.append(self._start(servers, r, args, (per_rank or {}).get(r, ())))

    def _start(self, servers, r, args, more) -> subprocess.Popen:  # noqa: ANN001
        cmd = [
            *PSAR, "train", "--arch", "ps", "--servers", ",".join(servers), "--rank", str(r),
            "--world-size", str(self.world), "--report", str(self.tmp / f"report-{r}.json"),
            *BASE, *args, *more,
        ]  # fmt: skip
        log = open(self.tmp / f"worker{r}.log", "a")  # noqa: SIM115 - closed by the child exit
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
        )

    def restart(self, servers, r: int, args, more=()) -> None:  # noqa: ANN001
        self.procs[r] = self._start(servers, r, args, more)

    def kill9(self, r: int) -> None:
        p = self.procs[r]
        assert p is not None
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        self.procs[r] = None

    def log(self, r: int) -> str:
        return (self.tmp / f"worker{r}.log").read_text()[-4000:]

    def wait(self, ranks: Sequence[int] | None = None, timeout: float = 180) -> list[dict]:
        deadline = time.monotonic() + timeout
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        for r in ranks:
            p = self.procs[r]
            assert p is not None, f"worker {r} was killed"
            rc = p.wait(timeout=max(1, deadline - time.monotonic()))
            assert rc == 0, f"worker {r} exited {rc}:\n{self.log(r)}"
        return [json.loads((self.tmp / f"report-{r}.json").read_text()) for r in ranks]

    def close(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def stats(addresses: Sequence[str]) -> list[dict]:
    from psar.ps.client.psclient import ClientConfig, PSClient

    cfg = ClientConfig(timeout_s=5, retry_timeout_s=5)
    with PSClient(addresses, worker=0, cfg=cfg) as client:
        return client.stats()


def wait_until(what: Callable[[], bool], timeout: float = 120, message: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if what():
                return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting: {message}")
