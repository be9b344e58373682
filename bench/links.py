"""Scaling and links: ps vs allreduce as links slow down and as workers and shard hosts
grow, with `psar plan`'s prediction checked against every measurement.

- (default) the link sweep: 2 workers and 1 shard, each process on a host of its own,
  at 10, 3 and 1 Gbit/s; step time against the plan's, goal within +-30%.
- `--grid small|full`: the crossover, n workers x k shard hosts x link rate, ps-sync
  against allreduce, the plan's winner and step (goals: the winner right in every cell,
  each step within +-20%; bench/lib/grid.py).
- `--grid loopback`: ps-sync over 1-8 workers x 1-4 shards, all on this host, against
  linear scaling from 1 worker (bench/lib/scaling.py); no namespaces needed.

Hosts are network namespaces with one veth NIC on a bridge (tests/netns.py,
bench/lib/netem.py). Both ends of every veth are shaped with tc (tbf for rate; netem when
--delay-ms adds latency), so each host has a full-duplex NIC of the given rate, as `psar
plan` assumes (docs/cost-model.md). Without root, `ip` or `tc` the emulated modes print
why they skipped. In the link sweep the shard runs on host s0, workers on w0..wN-1;
allreduce ranks (gloo) on w0..wN-1, launched directly (one per host). Per link: raw TCP
between two hosts (one-way GB/s, and the small-message round trip, whose half is the
plan's latency), then psar ps-sync (1 shard) and psar allreduce on the reference workload
(MLP 784-1024-1024-10, batch 128, SGD momentum, fp32, 1 thread). The compute time C is
the median over the links of a no-communication run on the same hosts
(bench/baselines/plain_ddp.py --no-comm), one per link, between the others. Then `psar
plan --json --compute-ms C --bandwidth R --latency L` predicts each step: allreduce
`step_seconds_overlap` (DDP overlaps), ps `step_seconds_no_overlap` (psar's PS pushes after
backward, then pulls). Ratio = measured median step / predicted; comm = step - C;
samples/s over the window every worker trains in.

    python -m bench.links                     # 10000, 3000, 1000 Mbit/s, 2 workers
    python -m bench.links --quick --json      # 1000 Mbit/s only
    python -m bench.links --grid small        # n workers x k shard hosts (bench/lib/grid.py)
    python -m bench.links --grid full         # n in 2,4,8 x k in 0,n/2,n x 1, 10 Gbit/s
    python -m bench.links --grid loopback     # 1-8 workers x 1-4 shards, this host only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib import common as c
from bench.lib.netem import probe_link, shape_all, unavailable

TOLERANCE = 0.30
PARAMS = 1_863_690  # MLP 784-1024-1024-10


def plan(n: int, mbit: float, latency_us: float, compute_ms: float) -> dict:
    argv = [*c.PSAR, "plan", "--params", str(PARAMS), "--workers", str(n), "--servers", "1",
            "--bandwidth", f"{mbit:g}Mbit/s", "--latency", f"{latency_us:.1f}us",
            "--optimizer", "sgd-momentum", "--wire-dtype", "fp32",
            "--compute-ms", f"{compute_ms:.3f}", "--json"]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=c.ROOT)
    if p.returncode != 0:
        raise c.ProcessError(f"psar plan failed: {p.stderr}")
    return json.loads(p.stdout)


def measure(out: Path, args, netns) -> dict:  # noqa: ANN001
    names = ["s0", *(f"w{r}" for r in range(args.workers))]
    train = [*c.REF_TRAIN, "--steps", str(args.steps)]
    links, runs = [], {}
    with netns.lan(names) as lan:
        workers = [lan[f"w{r}"] for r in range(args.workers)]
        for mbit in args.bandwidths:
            shape_all(netns, lan, mbit, args.delay_ms)
            with c.supervisor(out / f"probe-{mbit:g}") as sup:
                link = {"mbit": mbit, **probe_link(sup, lan["w0"], lan["s0"], 32 << 20)}
            c.log(
                f"links: {mbit:g} Mbit/s: TCP {link['gbps']:.3f} GB/s, rtt {link['rtt_us']:.0f} us"
            )
            d = out / f"{mbit:g}mbit"
            nocomm = c.plain_ddp_job(d / "nocomm", args.workers, args.steps, args.timeout,
                                     local=True, hosts=workers)  # fmt: skip
            link["compute_ms"] = 1e3 * c.job_step_seconds(nocomm)
            links.append(link)
            runs[mbit] = {
                "ps": c.ps_job(d / "ps", workers=args.workers, shards=1, mode="sync",
                               train=train, timeout=args.timeout, shard_hosts=[lan["s0"]],
                               worker_hosts=workers),
                "allreduce": c.ddp_job(d / "allreduce", workers=args.workers, hosts=workers,
                                       py_args=[*c.psar_train_args(d / "allreduce"), *train],
                                       timeout=args.timeout),
            }  # fmt: skip
    # One compute time for all links: the median of the no-communication runs (one per
    # link, between the others), so a burst of load during one of them counts little.
    compute_s = c.median([x["compute_ms"] for x in links]) / 1e3
    cases = []
    for link in links:
        pred = plan(args.workers, link["mbit"], link["rtt_us"] / 2, 1e3 * compute_s)
        for arch, run in runs[link["mbit"]].items():
            step = c.job_step_seconds(run)
            key = "step_seconds_overlap" if arch == "allreduce" else "step_seconds_no_overlap"
            p_step, p_comm = pred[arch][key], pred[arch]["comm_seconds_per_step"]
            cases.append({
                "mbit": link["mbit"], "arch": arch, "measured_step_ms": 1e3 * step,
                "predicted_step_ms": 1e3 * p_step, "step_ratio": step / p_step,
                "within_30pct": abs(step / p_step - 1) <= TOLERANCE,
                "measured_comm_ms": 1e3 * (step - compute_s), "predicted_comm_ms": 1e3 * p_comm,
                "comm_ratio": (step - compute_s) / p_comm if p_comm else None,
                "samples_per_sec": c.steady_rate(run)[0],
                "median_samples_per_sec": c.robust_rate(run), "plan_winner": pred["winner"],
            })  # fmt: skip
        ps, ar = cases[-2:]
        ps["ps_over_allreduce_step"] = ps["measured_step_ms"] / ar["measured_step_ms"]
    return {"workers": args.workers, "shards": 1, "steps": args.steps, "delay_ms": args.delay_ms,
            "netem_available": netns.netem_available(),
            "compute_ms": 1e3 * compute_s, "links": links, "cases": cases,
            "all_within_30pct": all(x["within_30pct"] for x in cases)}  # fmt: skip


def table(doc: dict) -> str:
    if "skipped" in doc:
        return f"## Emulated links\n\nSkipped: {doc['skipped']}"
    link = {x["mbit"]: x for x in doc["links"]}
    head = ["link", "raw TCP GB/s", "arch", "step ms", "plan step ms", "measured/plan",
            "within 30%", "comm ms", "plan comm ms", "ps/allreduce step"]  # fmt: skip
    rows = [[f"{x['mbit']:g} Mbit/s", link[x["mbit"]]["gbps"], x["arch"], x["measured_step_ms"],
             x["predicted_step_ms"], x["step_ratio"], x["within_30pct"], x["measured_comm_ms"],
             x["predicted_comm_ms"], x.get("ps_over_allreduce_step")] for x in doc["cases"]]  # fmt: skip
    rtt = ", ".join(f"{x['rtt_us']:.0f}" for x in doc["links"])
    each = ", ".join(f"{x['compute_ms']:.1f}" for x in doc["links"])
    return (
        "## Emulated links (psar plan checked)\n\n"
        + c.md_table(head, rows)
        + f"\n\n{doc['workers']} workers, 1 shard, reference workload, {doc['steps']} steps; "
        f"compute C = {doc['compute_ms']:.1f} ms/step (median of the no-communication runs: "
        f"{each}); added delay "
        f"{doc['delay_ms']:g} ms{'' if doc['netem_available'] else ' (tc netem is missing here, so no latency can be added)'}; plan latency = half the measured TCP round trip ({rtt} us). "
        f"All within +-30%: **{'yes' if doc['all_within_30pct'] else 'no'}**."
    )


def write_plot(out: Path, doc: dict) -> None:
    lines = {}
    for arch in ("ps", "allreduce"):
        xs = [x for x in doc["cases"] if x["arch"] == arch]
        lines[f"{arch} measured"] = ([x["mbit"] for x in xs], [x["measured_step_ms"] for x in xs])
        lines[f"{arch} predicted"] = ([x["mbit"] for x in xs], [x["predicted_step_ms"] for x in xs])
    c.plot(out / "links.png", lines, xlabel="link Mbit/s", ylabel="step ms", logx=True,
           title="step time on emulated links")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = c.parser("python -m bench.links", __doc__)
    p.add_argument(
        "--bandwidths", default=None, help="Mbit/s (default 10000,3000,1000; quick 1000)"
    )
    p.add_argument("--delay-ms", type=float, default=0.0, help="added one-way delay (needs netem)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="(default 40; quick 15)")
    p.add_argument("--grid", choices=("small", "full", "loopback"), default=None,
                   help="the crossover instead: n workers x k shard hosts (bench/lib/grid.py); "
                   "small: n=4 at 1 Gbit/s, full: n in 2,4,8 x 1, 10 Gbit/s; loopback: "
                   "ps-sync over 1-8 workers x 1-4 shards on this host, no links "
                   "(bench/lib/scaling.py)")  # fmt: skip
    p.add_argument("--compute-ms", type=float, default=None,
                   help="--grid: emulated compute per step, ms (default 30; loopback 100)")  # fmt: skip
    p.add_argument("--grid-workers", default=None,
                   help="--grid: worker counts instead of the grid's (e.g. 2,4; loopback "
                   "1,2,4,8, quick 1,4); --bandwidths likewise replaces its links")  # fmt: skip
    p.add_argument("--grid-shards", default=None,
                   help="--grid loopback: shard counts (default 1,2,4; quick 1,2)")  # fmt: skip
    p.add_argument("--grid-shard-hosts", default=None,
                   help="--grid: shard-host counts k instead of 0, n/2, n (e.g. 4)")  # fmt: skip
    p.add_argument("--grid-hidden", type=int, default=None,
                   help="--grid: the MLP's hidden width (default 4096: 80 MB of fp32 "
                   "gradient; 2048: 23.3 MB; 1024: 7.45 MB)")  # fmt: skip
    p.add_argument("--grid-chunk-mib", type=float, default=None,
                   help="--grid: PS slot size in MiB (default 0.5)")  # fmt: skip
    p.add_argument("--grid-batch", type=int, default=None,
                   help="--grid: batch per worker (default 4; loopback 16)")  # fmt: skip
    p.add_argument("--congestion", default=None,
                   help="--grid: TCP congestion control in every emulated host (default "
                   "cubic, Linux's default; 'system': what this machine's namespace has)")  # fmt: skip
    p.add_argument("--plan-cpu", action=argparse.BooleanOptionalAction, default=True,
                   help="--grid: the plan also models the 2 cores every emulated host shares "
                   "(bench/experiments/cpu_rate.py measures each design's bytes per CPU-second first; "
                   "default), or the links alone")  # fmt: skip
    p.add_argument("--early-pull", action=argparse.BooleanOptionalAction, default=True,
                   help="--grid: ps-sync with --chunk-rounds shards and --early-pull workers "
                   "(psar's pipelined sync PS; default), or without (push, then pull)")  # fmt: skip
    args = p.parse_args(argv)
    if args.grid == "loopback":
        return main_loopback(args)
    if args.grid:
        return main_grid(args)
    args.bandwidths = [
        float(x)
        for x in (args.bandwidths or ("1000" if args.quick else "10000,3000,1000")).split(",")
    ]
    args.steps = args.steps or (15 if args.quick else 40)
    c.install_sigterm()
    out = c.out_dir(args, "links")
    netns, reason = unavailable(args.delay_ms)
    if reason:
        c.log(f"links: skipped: {reason}")
        doc = {"skipped": reason}
    else:
        doc = measure(out, args, netns)
        write_plot(out, doc)
    return c.finish(args, out, "links", doc, table(doc))


def main_grid(args) -> int:  # noqa: ANN001
    """The n x k x link crossover (bench/lib/grid.py) into its own run folder."""
    from bench.lib import grid

    args.steps = args.steps or (12 if args.quick else 30)
    args.compute_ms = args.compute_ms or 30.0
    c.install_sigterm()
    out = c.out_dir(args, "links-grid")
    netns, reason = unavailable(0.0)
    reason = reason or grid.congestion_unavailable(args.congestion or grid.CONGESTION)
    doc = {"skipped": reason} if reason else grid.measure(out, args, netns)
    if reason:
        c.log(f"links grid: skipped: {reason}")
    return c.finish(args, out, "links_grid", doc, grid.table(doc))


def main_loopback(args) -> int:  # noqa: ANN001
    """ps-sync over workers x shards on this host (bench/lib/scaling.py)."""
    from bench.lib import scaling

    ints = lambda text: sorted(int(x) for x in text.split(","))  # noqa: E731
    c.install_sigterm()
    out = c.out_dir(args, "scaling")
    doc = scaling.measure(
        out, workers=ints(args.grid_workers or ("1,4" if args.quick else "1,2,4,8")),
        shards=ints(args.grid_shards or ("1,2" if args.quick else "1,2,4")),
        compute_ms=args.compute_ms or 100.0, batch=args.grid_batch or 16,
        steps=args.steps or (15 if args.quick else 30), timeout=args.timeout)  # fmt: skip
    scaling.write_plot(out, doc)
    return c.finish(args, out, "scaling", doc, scaling.table(doc))


if __name__ == "__main__":
    sys.exit(main())
