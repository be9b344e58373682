"""GPU check: NCCL DDP and a PS job with CUDA workers in fp16 (with and without
overlap: push during backward from pinned buffers after CUDA events); prints throughput.

Run on a machine with CUDA (a few minutes at most):

    python bench/gpu_check.py [--steps 200] [--json]

It exits 0 with "skipped: no CUDA device" anywhere else, so it can never break CI.
DDP uses as many ranks as there are GPUs (NCCL refuses two ranks on one GPU); with
a single GPU it runs one NCCL rank, which still exercises the NCCL path end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

PSAR = [sys.executable, "-m", "worker.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_args(steps: int, report: str) -> list[str]:
    return ["--workload", "mlp", "--workload-option", "in_dim=784", "--workload-option",
            "hidden=1024", "--workload-option", "samples=65536", "--batch-size", "256",
            "--steps", str(steps), "--precision", "fp16", "--device", "cuda",
            "--eval-batches", "5", "--log-every", "50", "--report", report]  # fmt: skip


def run_ddp(gpus: int, steps: int, tmp: Path) -> dict:
    report = str(tmp / "ddp.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "worker.cli",
           "train", "--arch", "allreduce", "--backend", "nccl", *train_args(steps, report)]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=300)
    return json.loads(Path(report).read_text())


def run_ps(workers: int, steps: int, tmp: Path, *extra: str) -> list[dict]:
    server = subprocess.Popen(
        [*PSAR, "server", "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True
    )
    try:
        addr = None
        for line in server.stdout:
            m = re.search(r"listening on (\S+:\d+)", line)
            if m:
                addr = m.group(1)
                break
        procs = []
        for r in range(workers):
            env = {**os.environ, "LOCAL_RANK": str(r)}
            cmd = [*PSAR, "train", "--arch", "ps", "--servers", addr, "--rank", str(r),
                   "--world-size", str(workers), *train_args(steps, str(tmp / f"ps-{r}.json")),
                   *extra]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env))
        for p in procs:
            if p.wait(timeout=300) != 0:
                raise SystemExit("a PS worker failed")
        return [json.loads((tmp / f"ps-{r}.json").read_text()) for r in range(workers)]
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    gpus = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ddp = run_ddp(gpus, args.steps, tmp)
        ps = run_ps(2, args.steps, tmp)  # overlap on: push during backward (CUDA events)
        plain = run_ps(2, args.steps, tmp, "--no-overlap")
    result = {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": gpus,
        "ddp_nccl_ranks": gpus,
        "ddp_global_samples_per_sec": ddp["global_samples_per_sec"],
        "ddp_final_loss": ddp["final_train_loss"],
        "ps_fp16_workers": 2,
        "ps_global_samples_per_sec": sum(r["samples_per_sec"] for r in ps),
        "ps_final_loss": ps[0]["final_train_loss"],
        "ps_skipped_steps": ps[0]["skipped_steps"],
        "ps_final_loss_scale": ps[0]["final_loss_scale"],
        "ps_no_overlap_global_samples_per_sec": sum(r["samples_per_sec"] for r in plain),
        "ps_no_overlap_final_loss": plain[0]["final_train_loss"],
    }
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
