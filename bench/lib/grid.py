"""The crossover on emulated hosts: n workers, k shard hosts, each host its own shaped NIC.

`python -m bench.links --grid small|full` (issue #19). Every worker and every shard host
is a network namespace with one veth NIC shaped both ways by tc (tbf) to the link rate,
as in bench/links.py (bench/lib/netem.py). Per cell (n workers, k shard hosts, link rate):

* **ps-sync**: k = 0 puts n shards on the worker hosts (shard i on worker i's host, so a
  NIC carries a worker's and a shard's bytes); k > 0 puts k shards on k hosts of their own.
* **allreduce**: `psar train --arch allreduce` (DDP, gloo), one rank per worker host. It
  does not depend on k, so one run per (n, link) serves the cells of every k.

Compute is emulated (`psar train --emulate-compute-ms C`: each step's forward+backward
padded with a sleep to C ms, before the last backward, so neither design hides its
communication behind it), with a small batch so the real compute of 8 workers on 2 cores
stays under C. A rate is total samples over the window in which every worker trains
(after each one's warm-up steps): c.window_rate. The measured step is n x batch / rate.

`psar plan --servers S --shard-hosts K --compute-ms C --bandwidth R --latency L` then
predicts each cell: `step_seconds_no_overlap` (C + comm; nothing overlaps the padded
compute), the winner, and the BytePS bound 2n(n-1)M/((n^2+kn-2k)B) with its gain over the
ring's bandwidth term. The plan also models the 2 cores every emulated host shares
(`--cpu-cores --cpu-shared`, rates of bench/experiments/cpu_rate.py measured once before the cells),
and each worker's own CPU per step on them (`--worker-cpu-ms`, measured on one worker of
the grid's workload: a sync step's compute phase lasts at least N*W/C). Goals: the plan's winner is the measured winner in every cell, each
predicted step within +-20% of the measured one.

Choices behind the defaults (measured; docs/results.md, 2026-12-02): the model is an MLP of
80 MB of fp32 gradient, because the regime the grid is about is communication-bound (with
the reference MLP, 7.45 MB, 30 ms of compute and fixed costs weigh as much as the link and
the ideal PS is 1.25x the ring, not 1.5x); PS slots of 0.5 MiB (the plan assumes every shard
holds P/S, and an early pull's tail is one slot per shard: 0.25 MiB measured within noise,
1 MiB slower); TCP cubic in every host (this machine's bbr left some of 16 flows through
tbf's queues 30% behind, and a sync round waits for the slowest; `--congestion system`
keeps the host's). A winner is right when it is the measured one, or when the plan calls a
tie (margin under 5%) and the measured margin is under 5% too (`strict_winner_right`: the
bare comparison).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from bench.lib import common as c
from bench.lib import cpucost
from bench.lib.netem import probe_link, shape_all
from psar.worker.plan_verdict import CLOSE_CALL

TOLERANCE = 0.20
GRIDS = {
    # small: the cell the 1.3x goal names, and its k = 0 and k = n/2 neighbours.
    "small": {"workers": (4,), "mbit": (1000.0,)},
    "full": {"workers": (2, 4, 8), "mbit": (1000.0, 10000.0)},
}
HIDDEN = 4096
"""MLP 784-4096-4096-10: 20.0M parameters, 80 MB of fp32 gradient per worker, so that a
step is communication-bound at 1 Gbit/s (the regime this grid is about). The reference
MLP (hidden 1024, 7.45 MB; `--grid-hidden 1024 --grid-chunk-mib 0.125 --grid-batch 16`)
spends as long computing as communicating there, and fixed costs decide."""
IN_DIM = 784
BATCH = 4
"""Small, so that the real compute of 8 workers on 2 cores stays near the emulated one."""
#: PS slots of 1/2 MiB: the plan assumes every shard holds P/S parameters (psar's default
#: 4 MiB chunks would unbalance 4-8 shards), and an early pull's tail is one slot from each
#: shard (0.25 MiB: within noise of 0.5; 1 MiB: slower, docs/results.md).
CHUNK_MIB = 0.5
CONGESTION = "cubic"
"""TCP congestion control on every emulated host: Linux's own default (this machine's
namespace runs bbr; `--congestion system` keeps that)."""
_ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")


def params(in_dim: int = IN_DIM, hidden: int = HIDDEN) -> int:
    """Parameters of psar's `mlp` workload: in -> hidden -> hidden -> 10, with biases."""
    return in_dim * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10


def shard_counts(n: int, only: str | None = None) -> list[int]:
    """k in {0, n/2, n} (n/2 rounded up, duplicates dropped); `only`: "4" or "0,4"."""
    if only:
        return sorted({int(x) for x in str(only).split(",")})
    return sorted({0, -(-n // 2), n})


def ps_flags(early_pull: bool) -> tuple[list[str], list[str]]:
    """(server, worker) flags of the ps-sync jobs: pipelined (each slot applied as soon
    as every worker pushed it, and pulled back while the rest of the push streams), or
    push-then-pull."""
    if early_pull:
        return ["--chunk-rounds"], ["--early-pull"]
    # psar train pulls early by default wherever a shard is on another host: say no.
    return [], ["--no-early-pull"]


def shape(args: Any) -> tuple[int, float, int]:
    """(hidden width, PS slot MiB, batch per worker) of this run: the grid's flags, else
    the defaults above."""
    return (getattr(args, "grid_hidden", None) or HIDDEN,
            getattr(args, "grid_chunk_mib", None) or CHUNK_MIB,
            getattr(args, "grid_batch", None) or BATCH)  # fmt: skip


def train_args(
    steps: int, compute_ms: float, hidden: int = HIDDEN, batch: int = BATCH
) -> list[str]:
    workload = ["--workload", "mlp", "--workload-option", f"in_dim={IN_DIM}",
                "--workload-option", f"hidden={hidden}"]  # fmt: skip
    return [*workload, "--batch-size", str(batch), "--optimizer", "sgd", "--momentum",
            "0.9", "--lr", "0.05", "--precision", "fp32", "--torch-threads", "1", "--log-every", "0",
            "--eval-batches", "0", "--steps", str(steps),
            "--emulate-compute-ms", f"{compute_ms:g}"]  # fmt: skip


def plan_cell(n: int, s: int, k: int, mbit: float, latency_us: float, compute_ms: float,
              early_pull: bool = True, hidden: int = HIDDEN, chunk_mib: float = CHUNK_MIB,
              cpu: dict | None = None) -> dict:  # fmt: skip
    argv = [*c.PSAR, "plan", "--params", str(params(hidden=hidden)), "--workers", str(n), "--servers", str(s),
            "--shard-hosts", str(k), "--bandwidth", f"{mbit:g}Mbit/s",
            "--latency", f"{latency_us:.1f}us", "--optimizer", "sgd-momentum",
            "--wire-dtype", "fp32", "--compute-ms", f"{compute_ms:.3f}", "--json",
            "--chunk-mib", str(chunk_mib), "--early-pull" if early_pull else "--no-early-pull",
            *cpu_flags(cpu)]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=c.ROOT)
    if p.returncode != 0:
        raise c.ProcessError(f"psar plan failed: {p.stderr}")
    return json.loads(p.stdout)


def cpu_flags(cpu: dict | None) -> list[str]:
    """`psar plan` flags of the CPU every emulated host shares (bench/experiments/cpu_rate.py's rates)."""
    if not cpu:
        return []
    return ["--cpu-cores", f"{cpu['cores']:g}", "--cpu-shared",
            "--ps-cpu-gbps", f"{cpu['ps_bytes_per_cpu_second'] / 1e9:.4g}",
            "--allreduce-cpu-gbps", f"{cpu['allreduce_bytes_per_cpu_second'] / 1e9:.4g}",
            *(["--worker-cpu-ms", f"{1e3 * cpu['worker_cpu_seconds_per_step']:.4g}"]
              if cpu.get("worker_cpu_seconds_per_step") else [])]  # fmt: skip


def cluster_rate(run: c.Run) -> dict[str, float]:
    """Samples/s over the window every worker trains in, after each one's warm-up."""
    rate, window = c.steady_rate(run)
    return {"samples_per_sec": rate, "window_s": window, "median_rate": c.robust_rate(run)}


def run_cell_jobs(out: Path, args: Any, lan: Any, n: int, mbit: float) -> dict[str, Any]:
    """allreduce once, ps-sync for every k, on the shaped LAN; rates per job."""
    workers = [lan[f"w{r}"] for r in range(n)]
    hidden, chunk_mib, batch = shape(args)
    train = train_args(args.steps, args.compute_ms, hidden, batch)
    d = out / f"n{n}-{mbit:g}mbit"
    jobs: dict[str, Any] = {}
    c.log(f"links grid: n={n} {mbit:g} Mbit/s allreduce")
    try:
        ar = c.ddp_job(d / "allreduce", workers=n, hosts=workers, timeout=args.timeout,
                       py_args=[*c.psar_train_args(d / "allreduce"), *train])  # fmt: skip
        jobs["allreduce"] = cluster_rate(ar)
    except c.ProcessError as e:  # one failed job costs its cells, not the whole grid
        jobs["allreduce"] = {"error": str(e)[-2000:]}
    server, early = ps_flags(getattr(args, "early_pull", True))
    for k in shard_counts(n, getattr(args, "grid_shard_hosts", None)):
        s = n if k == 0 else k
        hosts = workers if k == 0 else [lan[f"s{i}"] for i in range(k)]
        c.log(f"links grid: n={n} {mbit:g} Mbit/s ps-sync, {s} shards on k={k} hosts")
        try:
            run = c.ps_job(d / f"ps-k{k}", workers=n, shards=s, mode="sync",
                           train=[*train, "--chunk-mib", str(chunk_mib), *early],
                           timeout=args.timeout, shard_hosts=hosts, worker_hosts=workers,
                           server=server)  # fmt: skip
            jobs[f"ps-k{k}"] = {"shards": s, **cluster_rate(run)}
        except c.ProcessError as e:
            jobs[f"ps-k{k}"] = {"shards": s, "error": str(e)[-2000:]}
    return jobs


def cells(n: int, mbit: float, link: dict, jobs: dict, compute_ms: float,
          early_pull: bool = True, hidden: int = HIDDEN, chunk_mib: float = CHUNK_MIB,
          batch: int = BATCH) -> list[dict]:  # fmt: skip
    """One row per k: measured rates, their ratio, the plan's prediction and the bound."""
    rows = []
    ar = jobs["allreduce"]
    for k in sorted(int(j[4:]) for j in jobs if j.startswith("ps-k")):
        ps = jobs[f"ps-k{k}"]
        if "error" in ps or "error" in ar:
            rows.append({"workers": n, "shard_hosts": k, "shards": ps["shards"], "mbit": mbit,
                         "error": ps.get("error") or ar["error"]})  # fmt: skip
            continue
        ar_step = n * batch / ar["samples_per_sec"]
        # The plan's bandwidth is the link's measured TCP goodput (tbf counts the frames'
        # headers too), the best of 5 transfers: a slower one met other load on the CPU.
        # Its latency is half the measured round trip.
        bw = link["gbps_best"] * 8e3
        pred = plan_cell(n, ps["shards"], k, bw, link["rtt_us"] / 2, compute_ms, early_pull,
                         hidden, chunk_mib, link.get("cpu"))  # fmt: skip
        ps_step = n * batch / ps["samples_per_sec"]
        p_ps = pred["ps"]["step_seconds_no_overlap"]
        p_ar = pred["allreduce"]["step_seconds_no_overlap"]
        measured_winner = "ps" if ps["samples_per_sec"] > ar["samples_per_sec"] else "allreduce"
        ring_bw = pred["allreduce"]["comm_bandwidth_seconds_per_step"]
        bound = pred["byteps_bound_seconds"]
        plan_margin, measured_margin = _margin(p_ps, p_ar), _margin(ps_step, ar_step)
        rows.append({
            "workers": n, "shard_hosts": k, "shards": ps["shards"], "mbit": mbit,
            "ps_samples_per_sec": ps["samples_per_sec"],
            "allreduce_samples_per_sec": ar["samples_per_sec"],
            "ps_over_allreduce": ps["samples_per_sec"] / ar["samples_per_sec"],
            "ps_window_s": ps["window_s"], "allreduce_window_s": ar["window_s"],
            "ps_median_rate": ps["median_rate"], "allreduce_median_rate": ar["median_rate"],
            "byteps_bound_ms": 1e3 * bound,
            "byteps_bound_gain": ring_bw / bound if bound else None,
            "ps_step_ms": 1e3 * ps_step, "ps_plan_step_ms": 1e3 * p_ps,
            "ps_step_ratio": ps_step / p_ps,
            "allreduce_step_ms": 1e3 * ar_step, "allreduce_plan_step_ms": 1e3 * p_ar,
            "allreduce_step_ratio": ar_step / p_ar,
            "ps_plan_bottleneck": pred["ps"]["bottleneck"],
            "allreduce_plan_bottleneck": pred["allreduce"]["bottleneck"],
            "plan_winner": pred["winner"], "measured_winner": measured_winner,
            "plan_margin": plan_margin, "measured_margin": measured_margin,
            **judge_winner(pred["winner"], plan_margin, measured_winner, measured_margin),
            "within_20pct": max(abs(ps_step / p_ps - 1), abs(ar_step / p_ar - 1)) <= TOLERANCE,
        })  # fmt: skip
    return rows


def _margin(a: float, b: float) -> float:
    """How much longer the slower of two step times is than the faster."""
    return abs(a - b) / min(a, b)


def judge_winner(plan_winner: str, plan_margin: float, measured_winner: str,
                 measured_margin: float) -> dict[str, bool]:  # fmt: skip
    """Whether the plan picked right. Within CLOSE_CALL (5%) `psar plan` says "treat it
    as a tie"; when the measured steps are within it too, the two agree that neither
    design wins, whichever came out ahead by a hair (`strict_winner_right` keeps the
    bare comparison)."""
    plan_tie, measured_tie = plan_margin < CLOSE_CALL, measured_margin < CLOSE_CALL
    strict = plan_winner == measured_winner
    return {"plan_tie": plan_tie, "measured_tie": measured_tie, "strict_winner_right": strict,
            "winner_right": strict or (plan_tie and measured_tie)}  # fmt: skip


def set_congestion(lan: Any, algo: str) -> None:
    """TCP congestion control in every host (a per-namespace sysctl); "system" keeps what
    the machine's own namespace has (new namespaces inherit it)."""
    if algo == "system":
        return
    for h in lan.hosts.values():
        p = h.run(["sysctl", "-qw", f"net.ipv4.tcp_congestion_control={algo}"])
        if p.returncode != 0:
            raise c.ProcessError(f"--congestion {algo}: {p.stderr.strip()} (see "
                               "/proc/sys/net/ipv4/tcp_available_congestion_control)")  # fmt: skip


def system_congestion() -> str:
    try:
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        return "unknown"


def congestion_unavailable(algo: str, allowed_file: Path = _ALLOWED) -> str | None:
    """Why the emulated hosts cannot use TCP congestion control `algo`, else None: a
    network namespace other than the machine's own may pick only what the machine's
    net.ipv4.tcp_allowed_congestion_control lists (its own default always works)."""
    if algo in ("system", system_congestion()):
        return None
    try:
        allowed = allowed_file.read_text().split()
    except OSError:
        return None  # no such list here: let sysctl say
    if algo in allowed:
        return None
    return (f"--congestion {algo}: network namespaces here may use only {' '.join(allowed)} "
            "(net.ipv4.tcp_allowed_congestion_control); allow it as root with `sysctl -w "
            f'net.ipv4.tcp_allowed_congestion_control="{" ".join([*allowed, algo])}"`, or '
            "pass --congestion system")  # fmt: skip


def measure(out: Path, args: Any, netns: Any) -> dict[str, Any]:
    congestion = getattr(args, "congestion", None) or CONGESTION

    grid = dict(GRIDS[args.grid])
    if getattr(args, "bandwidths", None):  # e.g. a slower link, where the CPU matters less
        grid["mbit"] = tuple(float(x) for x in str(args.bandwidths).split(","))
    if getattr(args, "grid_workers", None):
        grid["workers"] = tuple(int(x) for x in str(args.grid_workers).split(","))
    rows, links = [], []
    cpu: dict | None = None
    model_cpu = getattr(args, "plan_cpu", True)
    for n in grid["workers"]:
        names = [*(f"w{r}" for r in range(n)), *(f"s{i}" for i in range(n))]
        with netns.lan(names) as lan:  # namespaces named psar<pid>-<counter>-<host>: unique
            set_congestion(lan, congestion)
            if model_cpu and cpu is None:
                # Once, at the grid's fastest link: where the cores, not the link, set the
                # pace (at 1 Gbit/s a transfer mostly waits, and what else runs counts).
                shape_all(netns, lan, max(grid["mbit"]), 0.0)
                with c.supervisor(out / "cpu-rate") as sup:
                    cpu = {"cores": os.cpu_count() or 1, "mbit": max(grid["mbit"]),
                           **cpucost.measure(sup, lan["w0"], lan["s0"])}  # fmt: skip
                hidden, _, batch = shape(args)
                cpu["worker_cpu_seconds_per_step"] = cpucost.worker_cpu_seconds(
                    out / "cpu-rate", train_args(1, args.compute_ms, hidden, batch),
                    timeout=args.timeout)  # fmt: skip
            for mbit in grid["mbit"]:
                shape_all(netns, lan, mbit, 0.0)
                with c.supervisor(out / f"probe-n{n}-{mbit:g}") as sup:
                    link = {"workers": n, "mbit": mbit,
                            **probe_link(sup, lan["w0"], lan["s0"], 16 << 20, 5)}  # fmt: skip
                if model_cpu:
                    link["cpu"] = cpu
                c.log(f"links grid: {mbit:g} Mbit/s: TCP {link['gbps']:.3f} GB/s, "
                      f"rtt {link['rtt_us']:.0f} us" + (
                          f"; CPU: ps {link['cpu']['ps_bytes_per_cpu_second'] / 1e9:.2f}, "
                          f"ring {link['cpu']['allreduce_bytes_per_cpu_second'] / 1e9:.2f} "
                          "GB/s per core" if model_cpu else ""))  # fmt: skip
                links.append(link)
                jobs = run_cell_jobs(out, args, lan, n, mbit)
                rows += cells(n, mbit, link, jobs, args.compute_ms,
                              getattr(args, "early_pull", True), *shape(args))  # fmt: skip
                # What is measured so far survives a later failure or a kill.
                (out / "cells-so-far.json").write_text(json.dumps(rows, indent=1) + "\n")
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    goal = [r for r in rows if (r["workers"], r["shard_hosts"], r["mbit"]) == (4, 4, 1000.0)]
    return {
        "grid": args.grid, "grid_workers": list(grid["workers"]), "grid_mbit": list(grid["mbit"]),
        "steps": args.steps, "compute_ms": args.compute_ms, "batch": shape(args)[2],
        "early_pull": getattr(args, "early_pull", True), "hidden": shape(args)[0],
        "congestion": system_congestion() if congestion == "system" else congestion,
        "params": params(hidden=shape(args)[0]), "chunk_mib": shape(args)[1],
        "plan_cpu": model_cpu, "links": links, "cells": rows,
        "failed_cells": failed,
        "plan_winner_right_everywhere": all(r["winner_right"] for r in rows),
        "plan_winner_strictly_right_everywhere": all(r["strict_winner_right"] for r in rows),
        "plan_winner_right_cells": sum(r["winner_right"] for r in rows),
        "within_20pct_cells": sum(r["within_20pct"] for r in rows),
        "all_within_20pct": all(r["within_20pct"] for r in rows),
        "n4_k4_1gbit_ps_over_allreduce": goal[0]["ps_over_allreduce"] if goal else None,
        "k0_ps_not_faster": all(r["ps_over_allreduce"] <= 1.0 for r in rows
                                if r["shard_hosts"] == 0),
    }  # fmt: skip


def _winner(name: str, margin: float | None, tie: bool) -> str:
    pct = "" if margin is None else f" ({100 * margin:.1f}%)"
    return f"tie: {name}{pct}" if tie else f"{name}{pct}"


def table(doc: dict[str, Any]) -> str:
    if "skipped" in doc:
        return f"## The crossover on emulated hosts\n\nSkipped: {doc['skipped']}"
    head = ["n", "k", "link", "ps-sync samples/s", "allreduce samples/s", "ps/allreduce",
            "BytePS bound ms (gain)", "ps step ms (plan)", "allreduce step ms (plan)",
            "plan winner (margin)", "measured winner", "within 20%"]  # fmt: skip
    rows = [[r["workers"], r["shard_hosts"], f"{r['mbit'] / 1e3:g} Gbit/s",
             r["ps_samples_per_sec"], r["allreduce_samples_per_sec"], r["ps_over_allreduce"],
             f"{r['byteps_bound_ms']:.3g} ({c.fmt(r['byteps_bound_gain'])}x)",
             f"{r['ps_step_ms']:.0f} ({r['ps_plan_step_ms']:.0f})",
             f"{r['allreduce_step_ms']:.0f} ({r['allreduce_plan_step_ms']:.0f})",
             _winner(r["plan_winner"], r["plan_margin"], r.get("plan_tie", False)),
             _winner(r["measured_winner"], r.get("measured_margin"), r.get("measured_tie", False)),
             r["within_20pct"]]
            for r in doc["cells"]]  # fmt: skip
    rtt = ", ".join(f"{x['rtt_us']:.0f}" for x in doc["links"])
    gput = ", ".join(f"{x['gbps_best']:.3f}" for x in doc["links"])
    cpu = sorted({(x["cpu"].get("mbit", x["mbit"]), x["cpu"]["ps_bytes_per_cpu_second"] / 1e9,
                   x["cpu"]["allreduce_bytes_per_cpu_second"] / 1e9, x["cpu"]["cores"],
                   1e3 * x["cpu"].get("worker_cpu_seconds_per_step", 0.0))
                  for x in doc["links"] if x.get("cpu")})  # fmt: skip
    cpu_text = (
        " The plan also models the CPU every host shares (`--cpu-cores C --cpu-shared "
        "--worker-cpu-ms W`; measured by bench/experiments/cpu_rate.py: "
        + "; ".join(f"ps {p:.2f}, ring {r:.2f} GB/s per core, {k:g} cores, at {m / 1e3:g} "
                    f"Gbit/s" + (f", W = {w:.0f} ms of CPU per worker per step" if w else "")
                    for m, p, r, k, w in cpu) + ")."
        if cpu else " The plan models the links alone (`--no-plan-cpu`)."
    )  # fmt: skip
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    hid = doc.get("hidden", HIDDEN)
    failed = "".join(
        f"\n\nFailed: n={r['workers']} k={r['shard_hosts']} {r['mbit']:g} Mbit/s: "
        f"{r['error'].splitlines()[-1][:300]}"
        for r in doc.get("failed_cells", [])
    )
    return (
        "## The crossover on emulated hosts (n workers, k shard hosts)\n\n"
        + c.md_table(head, rows)
        + f"\n\nGrid `{doc['grid']}`; MLP {IN_DIM}-{hid}-{hid}-10 ({doc['params']:,} "
        f"fp32 parameters), batch {doc['batch']} per worker, SGD momentum, {doc['steps']} steps, "
        f"compute emulated at {doc['compute_ms']:g} ms per step; k = 0: n shards on the worker "
        f"hosts, else k shards on k hosts of their own (slots of {doc['chunk_mib']:g} MiB). "
        f"Rates: total samples over the window "
        f"every worker trains in. Plan bandwidth = the measured TCP goodput "
        f"({gput} GB/s), latency = half the measured TCP round trip ({rtt} us).{cpu_text} "
        f"Plan's winner right in every cell: **{yes(doc['plan_winner_right_everywhere'])}**"
        + (
            f" ({doc['plan_winner_right_cells']} of {len(doc['cells'])}; a tie is a margin under "
            f"{100 * CLOSE_CALL:g}%, where psar plan says to treat it as one, and it is right "
            f"when the measured margin is under {100 * CLOSE_CALL:g}% too; the bare comparison: "
            f"{yes(doc['plan_winner_strictly_right_everywhere'])})"
            if "plan_winner_right_cells" in doc
            else ""
        )
        + "; "
        f"every predicted step within +-20%: **{yes(doc['all_within_20pct'])}**"
        + (
            f" ({doc['within_20pct_cells']} of {len(doc['cells'])})"
            if "within_20pct_cells" in doc
            else ""
        )
        + "; "
        f"at k = 0 ps-sync no faster than allreduce: **{yes(doc['k0_ps_not_faster'])}**." + failed
    )
