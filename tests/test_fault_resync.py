"""The worker's resync protocol (ps/client/backend.py) against in-process shards, step by step.

A sync job with two shards and two workers: worker 0 is a real PSBackend, worker 1 is
driven by hand. Shard 1 is killed -9 while worker 0's push for round 2 is waiting in its
open round, and comes back from its round-1 checkpoint on the same port. Worker 0 must
notice, join that open round on the restored shard and push its gradient again, so the
job ends exactly where a run without the crash ends (same state digests).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from psar.ps.client.psclient import ClientConfig, PSClient
from psar.ps.server.config import ServerConfig
from psar.ps.server.durability.checkpoints import CheckpointManager
from psar.ps.server.serve import start_server, stop_server
from psar.ps.server.shard import ShardState
from psar.trainkit.backend import BackendContext
from psar.trainkit.config import PSConfig, TrainConfig
from psar.trainkit.precision import resolve
from tests.fault_procs import Shard, wait_until


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))


def grads_for(m: torch.nn.Module, worker: int, clock: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * worker + clock)
    return {n: torch.randn(p.shape, generator=g) for n, p in m.named_parameters()}


class Job:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        # Shard 0 in this process; shard 1 a real process, so that it can be killed -9.
        self.server0, port0, self.state0 = start_server(
            ServerConfig(bind="127.0.0.1:0", threads=8),
            ShardState(checkpoints=CheckpointManager(tmp / "s0", every=1)),
        )
        self.shard1 = Shard(1, tmp, "--checkpoint-dir", str(tmp / "s1"), "--checkpoint-every", "1")
        self.shard1.start()
        from psar.ps.client.backend import PSBackend

        cfg = TrainConfig(
            arch="ps",
            ps=PSConfig(
                servers=f"127.0.0.1:{port0},{self.shard1.address}",
                rank=0,
                world_size=2,
                mode="sync",
                chunk_mib=0.0001,
                reconnect_timeout_s=60,
                timeout_s=30,
                pull_timeout_s=60,
            ),
        )
        precision = resolve(torch.device("cpu"), "fp32", "fp32", "fp32")
        self.x = PSBackend(BackendContext(cfg, precision, rank=0, world_size=2, total_steps=10))
        self.m = self.x.setup(model())
        self.y = PSClient(self.x.addresses, worker=1, cfg=ClientConfig(timeout_s=30))
        self.y.set_slots(self.x.slots)
        self.y.register(query=True)
        self.y.register(clock=0, instance="y")
        self.y.start_heartbeats()  # keeps worker 1's lease while it idles

    def x_step(self, clock: int) -> threading.Thread:
        """Worker 0's step (push, then a pull that waits for worker 1) in a thread."""
        for n, p in self.m.named_parameters():
            p.grad = grads_for(self.m, 0, clock)[n]
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(o=self.x.step()))
        t.out = out  # type: ignore[attr-defined]
        t.start()
        return t

    def y_push(self, clock: int) -> None:
        g = grads_for(self.m, 1, clock)
        flat = {
            s.key: g[s.param].reshape(-1)[s.start : s.start + s.numel].contiguous()
            for s in self.x.slots
        }
        versions = [r["version"] for r in self.y.register(query=True)]
        self.y.push(clock=clock, base_versions=versions, dtype=torch.float32, grads=flat)

    def digests(self) -> list[str]:
        return [s["state_digest"] for s in self.y.stats()]

    def close(self) -> None:
        self.x.client.close()
        self.y.close()
        stop_server(self.server0)
        self.shard1.stop()


def run(tmp: Path, crash: bool) -> tuple[list[str], list, Job]:
    job = Job(tmp)
    try:
        t = job.x_step(1)
        job.y_push(1)
        t.join(20)
        t = job.x_step(2)  # pushed to both shards; its pull waits for worker 1
        if crash:
            ckpt = job.tmp / "s1" / f"ckpt-s1-{1:012d}.pt"
            wait_until(ckpt.exists, 60, "round 1 checkpoint")
            wait_until(lambda: job.y.stats()[1]["worker_clocks"] == [2, 1], 60, "push 2")
            job.shard1.kill9()  # shard 1 dies with worker 0's push for round 2 in it
            job.shard1.start("--restore", str(job.tmp / "s1"))  # back at round 1
            # Worker 0's pull finds the new shard, resyncs and pushes round 2 there again.
            wait_until(lambda: job.y.stats()[1]["worker_clocks"] == [2, 1], 60, "re-push")
            assert job.y.stats()[1]["rounds"] == 1
            job.y.register(query=True)  # worker 1 notices too (fresh incarnations)
            job.y.register(clock=1, instance="y")
        job.y_push(2)
        t.join(20)
        assert not t.is_alive()
        return job.digests(), [t.out["o"]], job  # type: ignore[attr-defined]
    finally:
        job.close()


@pytest.mark.slow
def test_restored_shard_gets_the_lost_push_again(tmp_path) -> None:
    want, _, _ = run(tmp_path / "plain", crash=False)
    got, outcomes, job = run(tmp_path / "crash", crash=True)
    assert not outcomes[0].skipped
    faults = job.x.faults
    assert faults.restores == 1 and faults.rolled_back_updates == 0 and job.x.clock == 2
    assert got == want  # both shards: the same round 2, means over both workers
