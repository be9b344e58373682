"""A parameter server on torch.distributed.rpc (TensorPipe), the strongest ways a user would
write one: the PyTorch RPC tutorial's batch-updating server (--style tutorial, the
default) or per-parameter rounds with async futures (--style async).

Rank 0 is the server, ranks 1..N trainers. Model, data, batches and optimizer are
plain_ddp.py's (beside this file), so it does the same work as plain DDP.

- tutorial: like the tutorial's batch-updating parameter server
  (`@rpc.functions.async_execution`), the server adds up one gradient from every trainer,
  averages them, takes one SGD step and answers every trainer with the whole model. A
  trainer computes forward and backward, then one `rpc_sync` sends the gradients and
  returns the new weights; nothing is overlapped.
- async: per-parameter batched updates with futures. A post-accumulate-grad hook on each
  parameter sends its gradient with `rpc_async` the moment backward has made it, so the
  sends overlap the rest of backward; the server keeps one round per parameter and, when
  every trainer's gradient for it is in, averages, steps that parameter's own SGD
  (momentum) and completes the round's future with the new weights. The trainer waits on
  all its futures after backward and copies the weights in. Per-parameter SGD is the same
  arithmetic as one SGD over all parameters.

Which is stronger depends on the transport: on TensorPipe's default (shared memory) the
async style ran ahead, on uv (below) the tutorial's one call per step did (2026-12-02, 2
trainers, reference workload: tutorial 0.94x plain DDP, async 0.76x; docs/results.md,
"Torch RPC parameter servers"), so the tutorial style is the default, the `rpc-ps` row of
bench/step_throughput.py (`rpc-ps-async` is the other style).

TensorPipe moves the tensors over its `uv` transport (TCP) here: its default picks the
shared-memory transport between processes on one host, whose threads poll, and on a
2-core machine that polling takes the cores from the trainers (2026-12-02, 2 trainers, the
reference workload: 1,600-3,500 samples/s with the default, 7,000-7,400 with uv, plain DDP
~10,000). `--transports default` keeps TensorPipe's choice; `--transports shm,uv` names them.

    torchrun --nproc-per-node 3 bench/baselines/rpc_ps.py --steps 100 --out DIR   # 2 trainers

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


class ParamRoundsPS:
    """One batched round per parameter: the async style's server."""

    def __init__(self, a, trainers: int) -> None:  # noqa: ANN001
        self.params = [p.detach() for p in build(a)[0].parameters()]
        self.sums = [torch.zeros_like(p) for p in self.params]
        self.opts = []
        for p in self.params:
            p.grad = torch.zeros_like(p)
            self.opts.append(torch.optim.SGD([p], lr=a.lr, momentum=a.momentum))
        self.trainers = trainers
        self.counts = [0] * len(self.params)
        self.locks = [threading.Lock() for _ in self.params]
        self.futures = [torch.futures.Future() for _ in self.params]

    @staticmethod
    @rpc.functions.async_execution
    def push_param(ps_rref: rpc.RRef, i: int, grad: torch.Tensor) -> torch.futures.Future:
        self = ps_rref.local_value()
        with self.locks[i]:
            self.sums[i] += grad
            self.counts[i] += 1
            fut = self.futures[i]
            if self.counts[i] == self.trainers:
                p = self.params[i]
                torch.div(self.sums[i], self.trainers, out=p.grad)
                self.opts[i].step()
                self.sums[i].zero_()
                self.counts[i], self.futures[i] = 0, torch.futures.Future()
                fut.set_result(p.clone())
        return fut


def run_trainer_async(ps_rref: rpc.RRef, a, trank: int, trainers: int) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    model, x, y, order = build(a)
    params = list(model.parameters())
    futs: dict[int, torch.futures.Future] = {}
    owner = ps_rref.owner()

    def sender(i: int):  # noqa: ANN202
        def hook(p: torch.Tensor) -> None:
            futs[i] = rpc.rpc_async(owner, ParamRoundsPS.push_param, args=(ps_rref, i, p.grad))

        return hook

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(sender(i))
    path = os.path.join(a.out, f"steps-rpc-rank{trank}.jsonl")
    with open(path, "w", buffering=1) as log:
        start = time.perf_counter()
        for step in range(1, a.steps + 1):
            idx = indices(a, order, step, trank, trainers)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            model.zero_grad(set_to_none=True)
            futs.clear()
            loss.backward()  # the hooks send each gradient as soon as it is made
            with torch.no_grad():
                for i, p in enumerate(params):
                    p.copy_(futs[i].wait())
            rec = dict(step=step, time=time.perf_counter() - start, samples=step * a.batch_size,
                       loss=loss.item(), wall=time.time(), rank=trank, arch="rpc", mode="sync")  # fmt: skip
            log.write(json.dumps(rec) + "\n")


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


def _own_flag(name: str, default: str) -> str:
    """A flag of this script's own, taken out of argv (plain_ddp.args() knows only the
    shared flags)."""
    if name not in sys.argv:
        return default
    at = sys.argv.index(name)
    if at + 1 >= len(sys.argv):
        raise SystemExit(f"{name}: needs a value")
    value = sys.argv[at + 1]
    del sys.argv[at : at + 2]
    return value


TRANSPORTS = ("uv", "shm", "ibv")


def main() -> None:
    style = _own_flag("--style", "tutorial")
    if style not in ("async", "tutorial"):
        raise SystemExit(f"--style: unknown {style!r}; accepted: async, tutorial")
    transports = _own_flag("--transports", "uv")
    names = [] if transports == "default" else transports.split(",")
    if any(t not in TRANSPORTS for t in names):
        raise SystemExit(
            f"--transports: unknown in {transports!r}; accepted: default, or a comma-separated "
            f"list of {', '.join(TRANSPORTS)}"
        )
    a = args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kw = {"_transports": names} if names else {}
    opts = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=max(16, 4 * world), rpc_timeout=600, **kw
    )
    rpc.init_rpc("ps" if rank == 0 else f"trainer{rank}", rank=rank, world_size=world,
                 rpc_backend_options=opts)  # fmt: skip
    if rank == 0:
        server, trainer = ((ParamRoundsPS, run_trainer_async) if style == "async"
                           else (BatchUpdatePS, run_trainer))  # fmt: skip
        ps_rref = rpc.RRef(server(a, world - 1))
        futs = [rpc.rpc_async(f"trainer{r}", trainer, args=(ps_rref, a, r - 1, world - 1))
                for r in range(1, world)]  # fmt: skip
        torch.futures.wait_all(futs)
    rpc.shutdown()


if __name__ == "__main__":
    main()
