"""Plain PyTorch DDP on the reference workload; no psar code. The baseline psar is held to.

torchrun --nproc-per-node 2 bench/baselines/plain_ddp.py --steps 100 --out DIR   (--no-comm: no DDP)
Data as psar's `mlp` workload makes it; one JSON line per step in DIR/steps-plain-rankR.jsonl.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def build(a):  # noqa: ANN001, ANN201 - the model, inputs, labels and data order
    gen = torch.Generator().manual_seed(0)  # Gaussian inputs, labels of a linear teacher
    teacher = torch.randn(a.in_dim, 10, generator=gen)
    x = torch.randn(4096 + 1024, a.in_dim, generator=gen)[:4096]
    torch.manual_seed(a.seed)
    model = nn.Sequential(nn.Linear(a.in_dim, a.hidden), nn.ReLU(),
                          nn.Linear(a.hidden, a.hidden), nn.ReLU(), nn.Linear(a.hidden, 10))  # fmt: skip
    return model, x, (x @ teacher).argmax(1), torch.randperm(4096, generator=gen)


def indices(a, order, step, rank, world):  # noqa: ANN001, ANN201 - this rank's batch
    return order[(torch.arange(a.batch_size) + ((step - 1) * world + rank) * a.batch_size) % 4096]


def args(argv=None):  # noqa: ANN001, ANN201
    p = argparse.ArgumentParser()
    for k, v in dict(steps=100, batch_size=128, in_dim=784, hidden=1024, seed=0).items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--out", default=".")
    p.add_argument("--no-comm", action="store_true", help="same work, no DDP, no communication")
    return p.parse_args(argv)


def main() -> None:
    a = args()
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    model, x, y, order = build(a)
    if not a.no_comm:
        dist.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    log = open(os.path.join(a.out, f"steps-plain-rank{rank}.jsonl"), "w", buffering=1)  # noqa: SIM115
    start = time.perf_counter()
    for step in range(1, a.steps + 1):
        idx = indices(a, order, step, rank, world)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rec = dict(step=step, time=time.perf_counter() - start, samples=step * a.batch_size,
                   loss=loss.item(), wall=time.time(), rank=rank, arch="plain", mode="ddp")  # fmt: skip
        log.write(json.dumps(rec) + "\n")
    if not a.no_comm:
        # Barrier, then a pause without the GIL before the group goes: a DDP work object
        # that gloo's thread drops at interpreter exit aborts the rank (SIGABRT after the
        # last step). allreduce/process_group.py explains; psar's DDP backend does the same.
        dist.barrier()
        time.sleep(0.05)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
