"""A plain parameter server written the PyTorch RPC tutorial's way (torch.distributed.rpc).

Rank 0 is the server: like the tutorial's batch-updating parameter server
(`@rpc.functions.async_execution`), it adds up one gradient from every trainer, then
averages them, takes one SGD step and answers every trainer with the whole model. Ranks
1..N are trainers: compute forward and backward, then one `rpc_sync` that sends the
gradients and returns the new weights; nothing is overlapped. Model, data, batches and
optimizer are bench/plain_ddp.py's, so it does the same work as plain DDP.

    torchrun --nproc-per-node 3 bench/rpc_ps_baseline.py --steps 100 --out DIR   # 2 trainers

Trainer r writes DIR/steps-rpc-rank{r-1}.jsonl (the format of psar's step logs).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_ddp import args, build, indices  # noqa: E402


class BatchUpdatePS:
    """Holds the model; one averaged SGD step once all trainers have sent a gradient."""

    def __init__(self, a, trainers: int) -> None:  # noqa: ANN001
        self.model = build(a)[0]
        self.params = list(self.model.parameters())
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.opt = torch.optim.SGD(self.params, lr=a.lr, momentum=a.momentum)
        self.trainers, self.count = trainers, 0
        self.lock = threading.Lock()
        self.future: torch.futures.Future = torch.futures.Future()

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch(ps_rref: rpc.RRef, grads: list[torch.Tensor]) -> torch.futures.Future:
        self = ps_rref.local_value()
        with self.lock:
            for p, g in zip(self.params, grads, strict=True):
                p.grad += g
            self.count += 1
            fut = self.future
            if self.count == self.trainers:
                for p in self.params:
                    p.grad /= self.trainers
                self.opt.step()
                for p in self.params:
                    p.grad.zero_()
                self.count, self.future = 0, torch.futures.Future()
                fut.set_result([p.detach().clone() for p in self.params])
        return fut


def run_trainer(ps_rref: rpc.RRef, a, trank: int, trainers: int) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    model, x, y, order = build(a)
    params = list(model.parameters())
    path = os.path.join(a.out, f"steps-rpc-rank{trank}.jsonl")
    with open(path, "w", buffering=1) as log:
        start = time.perf_counter()
        for step in range(1, a.steps + 1):
            idx = indices(a, order, step, trank, trainers)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            model.zero_grad(set_to_none=True)
            loss.backward()
            new = rpc.rpc_sync(ps_rref.owner(), BatchUpdatePS.update_and_fetch,
                               args=(ps_rref, [p.grad for p in params]))  # fmt: skip
            with torch.no_grad():
                for p, w in zip(params, new, strict=True):
                    p.copy_(w)
            rec = dict(step=step, time=time.perf_counter() - start, samples=step * a.batch_size,
                       loss=loss.item(), wall=time.time(), rank=trank, arch="rpc", mode="sync")  # fmt: skip
            log.write(json.dumps(rec) + "\n")


def main() -> None:
    a = args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=max(16, 4 * world), rpc_timeout=600)
    rpc.init_rpc("ps" if rank == 0 else f"trainer{rank}", rank=rank, world_size=world,
                 rpc_backend_options=opts)  # fmt: skip
    if rank == 0:
        ps_rref = rpc.RRef(BatchUpdatePS(a, world - 1))
        futs = [rpc.rpc_async(f"trainer{r}", run_trainer, args=(ps_rref, a, r - 1, world - 1))
                for r in range(1, world)]  # fmt: skip
        torch.futures.wait_all(futs)
    rpc.shutdown()


if __name__ == "__main__":
    main()
