"""In-process simulation of a PS job's update order on the `lm` workload (no wire):
where async/ssp lose against sync at equal samples (docs/results.md, issue #17).

N workers, each computing its gradient on the weights it last "pulled"; one torch
optimizer applies the pushes. --sched: `rr` (round robin: staleness N-1, what the real
4-worker runs see), `random` (the next worker to push drawn at random) or `serial` (every
worker sees the newest weights: no staleness, the same update order). --mode sync applies
the mean of the N gradients once per round. Prints rank 0's first and last 10-step mean
loss. The shard's rules: --mom (the momentum it applies: 0.15 is the momentum rule's for
0.9 and 4 workers), --stale-lr with --stale-pow P (--staleness-lr-power), --dc
(--delay-compensation), --dca LAMBDA0 (--delay-compensation LAMBDA0 --dc-adaptive, the
same arithmetic as ps/server/staleness.py); and ideas measured but not built: --gap
(gap-aware, Barkai et al. 2019: divide each element's gradient by its gap, |w_now -
w_base| over the running mean step), --warmup K (lr ramp over K updates), --smom
(momentum minus 1 - 1/(1 + staleness) per step).

    python bench/experiments/staleness_sim.py --mode sync --steps 100
    python bench/experiments/staleness_sim.py --sched rr --mom 0.15 --stale-lr --steps 100
    python bench/experiments/staleness_sim.py --sched serial --mom 0.9 --lr-scale 0.25 --steps 100
    python bench/experiments/staleness_sim.py --sched rr --mom 0.15 --stale-lr --stale-pow 0.5 --dca 10
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from trainkit.optim import delay_compensate_
from worker.data import ShardedBatches
from worker.workloads import lm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="async", choices=["sync", "async"])
    ap.add_argument("--sched", default="rr", choices=["rr", "random", "serial"])
    ap.add_argument("--n", type=int, default=4, help="workers")
    ap.add_argument("--steps", type=int, default=100, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--mom", type=float, default=0.9, help="momentum the optimizer applies")
    ap.add_argument("--lr-scale", type=float, default=1.0, help="multiply lr by this")
    ap.add_argument("--stale-lr", action="store_true", help="lr / (1 + staleness)")
    ap.add_argument("--dc", type=float, default=0.0, help="DC-ASGD lambda")
    ap.add_argument("--dca", type=float, default=0.0, help="DC-ASGD-a lambda0 (adaptive)")
    ap.add_argument("--gap", action="store_true", help="gap-aware: / max(1, gap) per element")
    ap.add_argument("--warmup", type=int, default=0, help="linear lr warm-up, updates")
    ap.add_argument("--stale-pow", type=float, default=1.0, help="lr / (1 + staleness)^p")
    ap.add_argument("--smom", action="store_true", help="momentum - (1 - 1/(1+staleness))")
    ap.add_argument("--base-mom", type=float, default=0.9, help="configured momentum (--smom)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    w = lm.make(0, max_bytes=400_000)
    model = w.model
    masters = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(masters, lr=a.lr * a.lr_scale, momentum=a.mom, foreach=False)
    data = [ShardedBatches(w.train_dataset, batch_size=32, rank=r, world_size=a.n, seed=0)
            for r in range(a.n)]  # fmt: skip

    def grad_at(weights: list[torch.Tensor], r: int, step: int) -> tuple[float, list]:
        with torch.no_grad():
            for p, v in zip(model.parameters(), weights, strict=True):
                p.copy_(v)
        x, y = data[r].batch(step)
        model.zero_grad()
        loss = w.loss_fn(model(x), y)
        loss.backward()
        return loss.item(), [p.grad.detach().clone() for p in model.parameters()]

    losses: list[float] = []
    if a.mode == "sync":
        for s in range(a.steps):
            out = [grad_at(masters, r, s) for r in range(a.n)]
            for i, m in enumerate(masters):
                m.grad = sum(g[i] for _, g in out) / a.n
            opt.step()
            losses.append(out[0][0])
    else:
        rng = random.Random(0)
        version, clocks = 0, [0] * a.n
        base = [(0, [m.clone() for m in masters]) for _ in range(a.n)]
        ms = [torch.zeros_like(m) for m in masters]
        avg_step = [torch.tensor(0.0) for _ in masters]
        for k in range(a.steps * a.n):
            live = [r for r in range(a.n) if clocks[r] < a.steps]
            r = rng.choice(live) if a.sched == "random" else live[k % len(live)]
            bv, wts = base[r]
            loss, g = grad_at(wts, r, clocks[r])
            st = version - bv
            scale = (1.0 + st) ** -a.stale_pow if a.stale_lr else 1.0
            if a.warmup and version < a.warmup:
                scale *= (version + 1) / a.warmup
            for grp in opt.param_groups:
                grp["lr"] = a.lr * a.lr_scale * scale
                if a.smom:
                    grp["momentum"] = max(0.0, a.base_mom - (1 - 1 / (1 + st)))
            for i, m in enumerate(masters):
                gi = delay_compensate_(g[i], a.dc, m.detach(), wts[i])
                if a.dca:
                    ms[i].mul_(0.95).addcmul_(gi, gi, value=0.05)
                    corr = gi * gi / (ms[i].sqrt() + 1e-12) * (m.detach() - wts[i])
                    gi = gi + a.dca * corr
                if a.gap and st:
                    gapv = (m.detach() - wts[i]).abs() / (avg_step[i] + 1e-12)
                    gi = gi / gapv.clamp(min=1.0)
                m.grad = gi
            before = [m.detach().clone() for m in masters] if a.gap else None
            opt.step()
            if a.gap:
                for i, m in enumerate(masters):
                    stepmag = (m.detach() - before[i]).abs().mean()
                    avg_step[i] = stepmag if version == 0 else 0.9 * avg_step[i] + 0.1 * stepmag
            version, clocks[r] = version + 1, clocks[r] + 1
            snap = [m.detach().clone() for m in masters]
            for q in range(a.n) if a.sched == "serial" else [r]:
                base[q] = (version, snap)
            if r == 0:
                losses.append(loss)
    first, last = losses[:10], losses[-10:]
    print(f"{vars(a)} first {sum(first) / len(first):.4g} final {sum(last) / len(last):.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
