"""A training loop of your own, trained by psar: nothing in this file says how the
gradients travel; `psar launch` picks it with one flag (docs/own-loop.md):

    psar launch --workers 2 [--arch ...] -- python examples/own_loop.py --steps 40

Everything below is plain PyTorch but a few names: prepare() takes the model and the
optimizer, run.backward(loss) scales the loss where fp16 needs it, run.clip_grad_norm_()
clips the update by its global norm, run.no_sync() accumulates gradients without
communicating (--accum N micro-batches a step) and run.autocast() follows `psar launch
--precision`. Rank 0 prints its last loss as `final_loss=<value>`; --log-every N prints
every rank's loss every N steps; --save and --load write and read a checkpoint (model
and optimizer state dicts, torch's format); --state-dir DIR --save-every N saves the
whole run (run.save_state) and --resume DIR continues it bit for bit
(prepare(resume_from=), the one call: docs/own-loop.md, "Saving and resuming").

`make_workload` at the bottom hands the same model and data to psar's own loop:
`psar train --workload examples.own_loop:make_workload` (tests/test_own_loop.py holds
both loops to the same losses).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from psar import prepare


class Net(torch.nn.Module):
    """A small classifier with dropout."""

    def __init__(self, width: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(32, width),
            torch.nn.ReLU(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
        )
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build_model(seed: int, width: int = 64, dropout: float = 0.1) -> Net:
    """The same initial weights in every process: built right after seeding."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Net(width, dropout)


def build_data(n: int = 4096) -> TensorDataset:
    """A fixed synthetic task (a generator of its own: the same data in every process)."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 32, generator=gen)
    w = torch.randn(32, 4, generator=gen)
    y = (x @ w + 0.5 * torch.randn(n, 4, generator=gen)).argmax(dim=1)
    return TensorDataset(x, y)


def warmup_cosine(warmup: int, total: int):  # noqa: ANN201 - a LambdaLR factor
    """Linear warm-up, then a cosine decay to 0 over `total` steps."""

    def factor(n: int) -> float:
        if warmup and n < warmup:
            return (n + 1) / warmup
        progress = min(1.0, (n - warmup) / max(1, max(total, warmup + 1) - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def linear_warmup(warmup: int, total: int):  # noqa: ANN201 - a LambdaLR factor
    """Hugging Face's get_linear_schedule_with_warmup: from 0 up to the lr over `warmup`
    steps, then linearly down to 0 at step `total`."""

    def factor(n: int) -> float:
        if n < warmup:
            return n / max(1, warmup)
        return max(0.0, (total - n) / max(1, total - warmup))

    return factor


def endless(loader: DataLoader, sampler: DistributedSampler, skip: int = 0):  # noqa: ANN201
    """The loader's batches, epoch after epoch (each epoch shuffled anew), after the
    first `skip` (the batches a resumed run trained already)."""
    epoch, skip = divmod(skip, len(loader))
    while True:
        sampler.set_epoch(epoch)
        yield from itertools.islice(loader, skip, None)
        skip = 0
        epoch += 1


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=1e-4, help="weights only, not biases")
    p.add_argument("--clip", type=float, default=0.25, help="global norm; 0: no clipping")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--schedule", choices=("cosine", "linear"), default="cosine",
                   help="after the warm-up; linear: Hugging Face's linear warm-up from 0")  # fmt: skip
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--log-every", type=int, default=0)
    p.add_argument("--save", default="", help="rank 0 writes a checkpoint here at the end")
    p.add_argument("--load", default="", help="start from this checkpoint (from --save)")
    p.add_argument("--state-dir", default="", help="run.save_state() here every --save-every")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", default="", help="continue the run saved in this folder")
    p.add_argument("--stop-after", type=int, default=0, help="end after this step (a cut)")
    args = p.parse_args(argv)

    model = build_model(args.seed, dropout=args.dropout)
    # Two parameter groups: weight decay on the weights, none on the biases.
    decay = [q for n, q in model.named_parameters() if n.endswith("weight")]
    rest = [q for n, q in model.named_parameters() if not n.endswith("weight")]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": rest, "weight_decay": 0.0}]  # fmt: skip
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=0.9, nesterov=True)
    else:
        optimizer = torch.optim.AdamW(groups, lr=args.lr)
    if args.load:  # before prepare(), as you would before wrapping in anything
        checkpoint = torch.load(args.load)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])

    run = prepare(model, optimizer, seed=args.seed, total_steps=args.steps,
                  resume_from=args.resume or None)  # fmt: skip
    data = build_data()
    sampler = DistributedSampler(
        data, num_replicas=run.world_size, rank=run.rank, seed=args.seed, drop_last=True
    )
    # A generator of its own: without one, each pass over the loader draws its seed from
    # torch's global generator, and dropout's draws would shift.
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        generator=torch.Generator())  # fmt: skip
    schedule = linear_warmup if args.schedule == "linear" else warmup_cosine
    scheduler = run.register(  # saved with the run; resumed: restored here, then the lrs
        torch.optim.lr_scheduler.LambdaLR(run.optimizer, schedule(args.warmup, args.steps))
    )  # and (the last registered) this rank's random generators

    batches = endless(loader, sampler, skip=run.step * args.accum)
    loss = float("nan")
    for step in range(run.step + 1, args.steps + 1):
        run.optimizer.zero_grad()
        loss = 0.0
        for micro in range(args.accum):  # every micro-batch but the last: no_sync()
            x, y = next(batches)
            last = micro == args.accum - 1
            with contextlib.nullcontext() if last else run.no_sync():
                with run.autocast():
                    micro_loss = F.cross_entropy(run.model(x.to(run.device)), y.to(run.device))
                run.backward(micro_loss / args.accum)
            loss += micro_loss.item() / args.accum
        if args.clip:
            run.clip_grad_norm_(args.clip)
        run.optimizer.step()
        scheduler.step()
        if args.log_every and step % args.log_every == 0:
            out = run.last_step  # grad_norm: before clipping (None: not clipped)
            print(f"step={step} rank={run.rank} loss={loss:.9g} grad_norm={out.grad_norm} "
                  f"loss_scale={out.loss_scale:g} skipped={out.skipped}", flush=True)  # fmt: skip
        if args.state_dir and args.save_every and step % args.save_every == 0:
            run.save_state(args.state_dir)  # on every rank
        if step == args.stop_after:
            break
    if args.save and run.rank == 0:  # the optimizer's state: torch's format
        state = {"model": model.state_dict(), "optimizer": run.optimizer.state_dict()}
        torch.save(state, args.save)
    run.finish()
    if run.rank == 0:
        print(f"final_loss={loss:.4f}", flush=True)


def make_workload(seed: int, *, width: str = "64", dropout: str = "0.1"):  # noqa: ANN201
    """The same model and data for psar's own loop (`psar train --workload
    examples.own_loop:make_workload`)."""
    from psar.worker.workloads import Workload

    return Workload(
        model=build_model(seed, int(width), float(dropout)),
        train_dataset=build_data(),
        val_dataset=None,
        loss_fn=F.cross_entropy,
        description="examples/own_loop.py's classifier",
    )


if __name__ == "__main__":
    main()
