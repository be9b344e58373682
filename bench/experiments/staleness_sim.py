"""In-process simulation of a PS job's update order (no wire): where async/ssp lose against
sync at equal samples, and what a shard's staleness rule does about it (issues #17, #34).

N workers on the `lm` or `mlp` workload (psar compare's mlp options), each computing its
gradient on the weights it last "pulled"; one torch optimizer applies the pushes. --sched:
`rr` (round robin: staleness N-1 on every push, harsher than the wire), `random` (the next
worker to push drawn at random), `exp` (exponential compute times: the queueing model of
Mitliagkas et al. 2016), `serial` (every worker sees the newest weights: no staleness).
--mode sync applies the mean of the N gradients once per round. Prints rank 0's first and
last 10-step mean loss (psar compare's final loss is the last); with --vs-sync also sync's
on the same seed and the ratio, and with several --seeds their median and spread.

--rule runs a `--staleness-rule` exactly as a shard does (trainkit/staleness_rules.py):
adaptive (the default of async/ssp), momentum (the momentum rule alone), none. Without
--rule the older hand-set flags apply: --mom (the momentum the optimizer applies: 0.15
is the momentum rule's for 0.9 and 4 workers), --stale-lr with --stale-pow P, --dc,
--dca LAMBDA0 (DC-ASGD-a, the arithmetic of ps/server/staleness.py), and ideas measured
but not built: --gap (gap-aware, Barkai et al. 2019), --warmup K, --smom.

    python bench/experiments/staleness_sim.py --mode sync --steps 100
    python bench/experiments/staleness_sim.py --workload mlp --n 2 --rule adaptive --vs-sync --seeds 0,1,2
    python bench/experiments/staleness_sim.py --sched rr --mom 0.15 --stale-lr --stale-pow 0.5 --dca 10
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from psar.trainkit.optim import async_momentum, delay_compensate_
from psar.trainkit.staleness_rules import AdaptiveRule
from psar.worker.data import ShardedBatches
from psar.worker.workloads import lm, mlp

#: A shard rule in the simulation: (push context) -> (lr scale, momentum or None).
Rule = Callable[[dict], tuple[float, float | None]]


def build(workload: str, seed: int):
    if workload == "lm":
        return lm.make(seed, max_bytes=400_000)
    return mlp.make(seed, in_dim=256, hidden=512, samples=65536)  # psar compare's mlp


def rule_of(a: argparse.Namespace) -> Rule:
    """The shard's rule: a --staleness-rule, or the older hand-set flags."""
    if a.rule in ("momentum", "none"):
        m = async_momentum(a.base_mom, a.n) if a.rule == "momentum" else a.base_mom
        return lambda ctx: (1.0, m)
    if a.rule == "adaptive":
        state: dict[str, AdaptiveRule] = {}

        def adaptive(ctx: dict) -> tuple[float, float | None]:
            r = state.setdefault("r", AdaptiveRule(num_workers=a.n, momentum=a.base_mom))
            keyed = {str(i): g for i, g in enumerate(ctx["grads"])}
            adj = r.adjust(keyed, staleness=ctx["s"], version=ctx["version"], lr=ctx["lr"],
                           w_now={str(i): m for i, m in enumerate(ctx["masters"])},
                           w_base={str(i): w for i, w in enumerate(ctx["base"])})  # fmt: skip
            ctx["grads"][:] = [keyed[str(i)] for i in range(len(keyed))]
            return adj.lr_scale, adj.momentum

        return adaptive
    return _legacy(a)


def _legacy(a: argparse.Namespace) -> Rule:
    ms: dict[int, torch.Tensor] = {}
    avg_step: dict[int, torch.Tensor] = {}

    def legacy(ctx: dict) -> tuple[float, float | None]:
        st, version, g, wts = ctx["s"], ctx["version"], ctx["grads"], ctx["base"]
        scale = (1.0 + st) ** -a.stale_pow if a.stale_lr else 1.0
        if a.warmup and version < a.warmup:
            scale *= (version + 1) / a.warmup
        for i, m in enumerate(ctx["masters"]):
            gi = delay_compensate_(g[i], a.dc, m.detach(), wts[i])
            if a.dca:
                ms[i] = ms.get(i, torch.zeros_like(gi)).mul_(0.95).addcmul_(gi, gi, value=0.05)
                corr = gi * gi / (ms[i].sqrt() + 1e-12) * (m.detach() - wts[i])
                gi = gi + a.dca * corr
            if a.gap and st and i in avg_step:
                gapv = (m.detach() - wts[i]).abs() / (avg_step[i] + 1e-12)
                gi = gi / gapv.clamp(min=1.0)
            g[i] = gi
        if a.gap:  # the running mean step of each tensor, measured around the step
            before = [m.detach().clone() for m in ctx["masters"]]

            def after() -> None:
                for i, m in enumerate(ctx["masters"]):
                    step = (m.detach() - before[i]).abs().mean()
                    avg_step[i] = step if i not in avg_step else 0.9 * avg_step[i] + 0.1 * step

            ctx["after"] = after
        mom = max(0.0, a.base_mom - (1 - 1 / (1 + st))) if a.smom else a.mom
        return scale, mom

    return legacy


def simulate(a: argparse.Namespace, mode: str, seed: int) -> dict:
    """One run: rank 0's losses and the staleness of every applied push."""
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    w = build(a.workload, seed)
    model = w.model
    masters = [p.detach().clone() for p in model.parameters()]
    momentum = a.base_mom if (mode == "sync" or a.rule) else a.mom
    lr = a.lr * (a.lr_scale if mode != "sync" else 1.0)
    opt = torch.optim.SGD(masters, lr=lr, momentum=momentum, foreach=False)
    data = [ShardedBatches(w.train_dataset, batch_size=a.batch_size, rank=r, world_size=a.n,
                           seed=seed) for r in range(a.n)]  # fmt: skip

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
    stale: list[int] = []
    if mode == "sync":
        for s in range(a.steps):
            out = [grad_at(masters, r, s) for r in range(a.n)]
            for i, m in enumerate(masters):
                m.grad = sum(g[i] for _, g in out) / a.n
            opt.step()
            losses.append(out[0][0])
        return {"losses": losses, "staleness": stale}
    rule = rule_of(a)
    rng = random.Random(seed + 1)

    def duration() -> float:
        return rng.expovariate(1.0) if a.sched == "exp" else 1.0

    version, clocks = 0, [0] * a.n
    base = [(0, [m.clone() for m in masters]) for _ in range(a.n)]
    due = [duration() + r * 1e-9 for r in range(a.n)]  # rr/serial: in rank order
    while live := [r for r in range(a.n) if clocks[r] < a.steps]:
        r = rng.choice(live) if a.sched == "random" else min(live, key=lambda q: due[q])
        bv, wts = base[r]
        loss, g = grad_at(wts, r, clocks[r])
        ctx = {"s": version - bv, "version": version, "grads": g, "masters": masters,
               "base": wts, "lr": lr}  # fmt: skip
        stale.append(ctx["s"])
        scale, mom = rule(ctx)
        for grp in opt.param_groups:
            grp["lr"] = lr * scale
            if mom is not None:
                grp["momentum"] = mom
        for i, m in enumerate(masters):
            m.grad = ctx["grads"][i]
        opt.step()
        if "after" in ctx:
            ctx["after"]()
        version, clocks[r] = version + 1, clocks[r] + 1
        snap = [m.detach().clone() for m in masters]
        for q in range(a.n) if a.sched == "serial" else [r]:
            base[q] = (version, snap)
        due[r] += duration()
        if r == 0:
            losses.append(loss)
    return {"losses": losses, "staleness": stale}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="lm", choices=["lm", "mlp"])
    ap.add_argument("--mode", default="async", choices=["sync", "async"])
    ap.add_argument("--sched", default="rr", choices=["rr", "random", "exp", "serial"])
    ap.add_argument("--n", type=int, default=4, help="workers")
    ap.add_argument("--steps", type=int, default=100, help="per worker")
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--lr-scale", type=float, default=1.0, help="async: multiply lr by this")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (model and data order)")
    ap.add_argument("--rule", default=None, choices=["adaptive", "momentum", "none"],
                    help="a --staleness-rule as a shard runs it (then --mom etc. are unused)")  # fmt: skip
    ap.add_argument("--vs-sync", action="store_true", help="also run sync; print the ratio")
    ap.add_argument("--mom", type=float, default=0.9, help="momentum the optimizer applies")
    ap.add_argument("--stale-lr", action="store_true", help="lr / (1 + staleness)")
    ap.add_argument("--stale-pow", type=float, default=1.0, help="lr / (1 + staleness)^p")
    ap.add_argument("--dc", type=float, default=0.0, help="DC-ASGD lambda")
    ap.add_argument("--dca", type=float, default=0.0, help="DC-ASGD-a lambda0 (adaptive)")
    ap.add_argument("--gap", action="store_true", help="gap-aware: / max(1, gap) per element")
    ap.add_argument("--warmup", type=int, default=0, help="linear lr warm-up, updates")
    ap.add_argument("--smom", action="store_true", help="momentum - (1 - 1/(1+staleness))")
    ap.add_argument("--base-mom", type=float, default=0.9,
                    help="configured momentum (sync's; --rule and --smom start from it)")  # fmt: skip
    a = ap.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    ratios = []
    for seed in seeds:
        run = simulate(a, a.mode, seed)
        first, final = _mean(run["losses"][:10]), _mean(run["losses"][-10:])
        row = {"workload": a.workload, "n": a.n, "mode": a.mode, "sched": a.sched,
               "rule": a.rule or "flags", "seed": seed, "first": round(first, 4),
               "final": round(final, 4)}  # fmt: skip
        if run["staleness"]:
            row["staleness_mean"] = round(_mean(run["staleness"]), 2)
        if a.vs_sync and a.mode != "sync":
            sync = _mean(simulate(a, "sync", seed)["losses"][-10:])
            row.update(sync_final=round(sync, 4), x_sync=round(final / sync, 4))
            ratios.append(final / sync)
        print(json.dumps(row), flush=True)
    if len(ratios) > 1:
        print(f"x sync over seeds {a.seeds}: median {statistics.median(ratios):.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f}  ({vars(a)})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
