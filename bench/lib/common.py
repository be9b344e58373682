"""Shared helpers of the benchmarks: jobs, step logs, rates, output.

Every job here is real processes (`psar server`, `psar train`, torchrun, plain scripts)
run through worker/supervisor.py's Supervisor, the one `psar launch` uses too: each in a
session of its own with its output in a log file of the run folder; leaving the
measurement (done, failed, timed out, SIGTERM) stops every process it started and their
descendants (torchrun's ranks included).

Rates come from the per-step JSONL logs (`steps-*.jsonl`, written by `psar train
--run-dir` and by the plain baselines in the same format). The rate a benchmark reports
is total samples over the window in which every worker trains (`window_rate`, after each
rank's warm-up steps), so a stall counts and process start-up counts for nobody.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psar.worker.supervisor import ProcessError, Supervisor, free_port

__all__ = ["ProcessError", "Supervisor", "free_port"]  # re-exported for the benchmarks

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
PSAR = [PY, "-m", "psar.worker.cli"]
TORCHRUN = [PY, "-m", "torch.distributed.run"]
PLAIN_DDP = ROOT / "bench" / "baselines" / "plain_ddp.py"
#: The reference workload: MLP 784-1024-1024-10, batch 128/worker, SGD momentum, fp32,
#: one compute thread per process.
REF_WORKLOAD = ["--workload", "mlp", "--workload-option", "in_dim=784",
                "--workload-option", "hidden=1024"]  # fmt: skip
REF_TRAIN = [*REF_WORKLOAD, "--batch-size", "128", "--optimizer", "sgd", "--momentum", "0.9",
             "--lr", "0.05", "--precision", "fp32", "--torch-threads", "1", "--log-every", "0",
             "--eval-batches", "0"]  # fmt: skip
_LISTEN = re.compile(r"listening on (\S+):(\d+)")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # PYTHONFAULTHANDLER: a rank killed by a signal (SIGABRT in a C++ destructor, say)
    # prints every thread's Python stack into its log, which a failed job's error quotes.
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    return {**os.environ, **env, **(extra or {})}


def _raise_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every `with supervisor(...)`: no orphans


def install_sigterm() -> None:
    signal.signal(signal.SIGTERM, _raise_on_sigterm)


# ---- processes ---------------------------------------------------------------------------


def supervisor(log_dir: Path) -> Supervisor:
    """The processes of one measurement: logs in `log_dir`, the benchmarks' child
    environment, the repository as working directory, 5 s from SIGTERM to SIGKILL."""
    return Supervisor(log_dir, env=child_env(), cwd=ROOT, grace=5.0)


def on(host: Any, argv: Sequence[str]) -> list[str]:
    """argv, run inside network-namespace `host` when given (a tests.netns.Host)."""
    return host.cmd(list(argv)) if host is not None else list(argv)


def parse_cpus(spec: str) -> set[int] | None:
    """A CPU list as taskset reads it ("0", "0,2", "0-3"); None for "" (unpinned)."""
    out: set[int] = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out or None


# ---- jobs --------------------------------------------------------------------------------


def start_shards(sup: Supervisor, n: int, *, hosts: Sequence[Any] | None = None,
                 timeout: float = 120.0, server: Sequence[str] = (),
                 cpus: set[int] | None = None, env: dict[str, str] | None = None) -> list[str]:  # fmt: skip
    """n `psar server` shards (shard i in hosts[i] when given; `server`: more flags;
    pinned to `cpus` when given; `env`: their whole environment); their HOST:PORT."""
    binds = [h.addr if hosts else "127.0.0.1" for h in (hosts or [None] * n)]
    if env is None and not hosts:  # shards sharing this host split its cores (--torch-threads auto)
        env = child_env({"PSAR_SHARDS_PER_HOST": str(n)})
    for i in range(n):
        argv = [*PSAR, "server", "--bind", f"{binds[i]}:0", "--shard", str(i), *server]
        if hosts:  # a test LAN of network namespaces: no token, no TLS, by decision
            argv.append("--allow-insecure-bind")
        sup.start(f"shard{i}", on(hosts[i] if hosts else None, argv), env=env, persistent=True,
                  cpus=cpus)  # fmt: skip
    return [f"{binds[i]}:{sup.wait_line(f'shard{i}', _LISTEN, timeout).group(2)}"
            for i in range(n)]  # fmt: skip


def ps_job(out: Path, *, workers: int, shards: int = 1, mode: str = "sync", staleness: int = 1,
           train: Sequence[str] = (), per_rank: dict[int, Sequence[str]] | None = None,
           timeout: float = 600.0, shard_hosts: Sequence[Any] | None = None,
           worker_hosts: Sequence[Any] | None = None, server: Sequence[str] = ()) -> Run:  # fmt: skip
    """Shards (`server`: more `psar server` flags) + `psar train --arch ps` workers to
    completion; their step logs."""
    with supervisor(out) as sup:
        addrs = ",".join(start_shards(sup, shards, hosts=shard_hosts, server=server))
        names = [f"worker{r}" for r in range(workers)]
        for r in range(workers):
            argv = [*PSAR, "train", "--arch", "ps", "--servers", addrs, "--rank", str(r),
                    "--world-size", str(workers), "--mode", mode, "--staleness", str(staleness),
                    "--run-dir", str(out), "--report", str(out / "report-{rank}.json"),
                    *train, *(per_rank or {}).get(r, ())]  # fmt: skip
            sup.start(names[r], on(worker_hosts[r] if worker_hosts else None, argv))
        sup.wait(names, timeout)
    return load_run(out)


def ddp_job(out: Path, *, workers: int, py_args: Sequence[str], timeout: float = 600.0,
            hosts: Sequence[Any] | None = None, env: dict[str, str] | None = None) -> Run:  # fmt: skip
    """`python py_args` on `workers` ranks: under torchrun, or one per namespace host."""
    with supervisor(out) as sup:
        if hosts is None:
            argv = [*TORCHRUN, "--nnodes", "1", "--nproc-per-node", str(workers),
                    "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *py_args]  # fmt: skip
            sup.start("torchrun", argv, env=child_env(env))
            sup.wait(["torchrun"], timeout)
        else:
            port = str(free_port())
            for r in range(workers):
                rank_env = {"RANK": str(r), "LOCAL_RANK": "0", "WORLD_SIZE": str(workers),
                            "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": hosts[0].addr,
                            "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": hosts[r].ifname}  # fmt: skip
                sup.start(f"rank{r}", on(hosts[r], [PY, *py_args]),
                          env=child_env({**(env or {}), **rank_env}))  # fmt: skip
            sup.wait([f"rank{r}" for r in range(workers)], timeout)
    return load_run(out)


def psar_train_args(out: Path, arch: str = "allreduce") -> list[str]:
    """`python` args that run `psar train --arch ARCH` logging into `out` (+ REF-style flags)."""
    return ["-m", "psar.worker.cli", "train", "--arch", arch, "--run-dir", str(out),
            "--report", str(out / "report-{rank}.json")]  # fmt: skip


def psar_allreduce_job(out: Path, workers: int, steps: int, timeout: float) -> Run:
    """`psar train --arch allreduce` on the reference workload under torchrun."""
    py = [*psar_train_args(out), *REF_TRAIN, "--steps", str(steps)]
    return ddp_job(out, workers=workers, py_args=py, timeout=timeout)


def plain_ddp_job(out: Path, workers: int, steps: int, timeout: float, *, local: bool = False,
                  hosts: list | None = None) -> Run:  # fmt: skip
    """bench/baselines/plain_ddp.py on `workers` ranks (local: --no-comm, compute only)."""
    out.mkdir(parents=True, exist_ok=True)
    py = [str(PLAIN_DDP), "--steps", str(steps), "--out", str(out),
          *(["--no-comm"] if local else [])]  # fmt: skip
    return ddp_job(out, workers=workers, py_args=py, timeout=timeout, hosts=hosts)


# ---- step logs and rates -----------------------------------------------------------------


@dataclass
class Series:
    rank: int
    time: list[float]
    samples: list[float]
    loss: list[float]
    start_wall: float
    """Wall-clock time of the series' time 0: the record's `wall`, else the file's mtime
    minus the last record's time (the file was last written at its last step)."""


@dataclass
class Run:
    series: list[Series]
    summaries: list[dict[str, Any]]


def load_run(out: Path) -> Run:
    from psar.worker import report

    loaded, summaries = report.load_run(out)
    series = []
    for s in loaded:
        if not s.time:
            continue
        last = json.loads(s.path.read_text().strip().splitlines()[-1])
        start = (
            last["wall"] - last["time"] if "wall" in last else s.path.stat().st_mtime - s.time[-1]
        )
        series.append(Series(s.rank, s.time, s.samples, s.loss, start))
    series.sort(key=lambda s: s.rank)
    return Run(series, summaries)


def warmup_steps(n: int) -> int:
    """Steps left out at the start of every series: a tenth, at least 2 (fewer if short)."""
    return min(max(2, n // 10), max(0, n - 3))


def step_seconds(s: Series) -> float:
    """Median step time of one rank after its warm-up steps."""
    t = s.time[warmup_steps(len(s.time)) :]
    return statistics.median(b - a for a, b in zip(t, t[1:])) if len(t) > 1 else math.nan  # noqa: B905


def job_rate(run: Run) -> float:
    """All ranks' samples / time after their warm-up steps, added up (the mean rate)."""
    w = [warmup_steps(len(s.time)) for s in run.series]
    return sum((s.samples[-1] - s.samples[i]) / max(s.time[-1] - s.time[i], 1e-9)
               for s, i in zip(run.series, w, strict=True))  # fmt: skip


def job_step_seconds(run: Run) -> float:
    return statistics.median(step_seconds(s) for s in run.series)


def robust_rate(run: Run) -> float:
    """All ranks' samples per step / their median step time, added up: unlike job_rate,
    a burst of other load on a shared machine moves it little."""
    return sum((s.samples[-1] - s.samples[0]) / max(len(s.samples) - 1, 1) / step_seconds(s)
               for s in run.series)  # fmt: skip


def window_rate(run: Run, skip: int = 0) -> tuple[float, float]:
    """(samples/s, seconds) over the window in which every rank was training: from the last
    rank's first step (after its first `skip` steps: warm-up) to the first rank's last step,
    on the shared wall clock."""
    t0 = max(s.start_wall + s.time[min(skip, len(s.time) - 1)] for s in run.series)
    t1 = min(s.start_wall + s.time[-1] for s in run.series)
    if t1 <= t0:
        return math.nan, 0.0

    def done_by(s: Series, t: float) -> float:
        import numpy as np

        return float(np.interp(t, [s.start_wall + x for x in s.time], s.samples))

    total = sum(done_by(s, t1) - done_by(s, t0) for s in run.series)
    return total / (t1 - t0), t1 - t0


def steady_rate(run: Run) -> tuple[float, float]:
    """window_rate after each rank's warm-up steps (as many as the shortest series's
    warm-up): the rate every benchmark reports."""
    return window_rate(run, skip=warmup_steps(min(len(s.time) for s in run.series)))


def staleness(run: Run) -> dict[str, int | None]:
    """p50/p99/max of every applied gradient's staleness, all workers' reports together."""
    hist: Counter[int] = Counter()
    for d in run.summaries:
        for k, n in ((d.get("staleness") or {}).get("histogram") or {}).items():
            hist[int(k)] += n
    vals = sorted(hist.elements())
    if not vals:
        return {"p50": None, "p99": None, "max": None}
    q = lambda f: vals[max(0, math.ceil(f * len(vals)) - 1)]  # noqa: E731
    return {"p50": q(0.5), "p99": q(0.99), "max": vals[-1]}


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else math.nan


def alternate(configs: dict[str, Callable[[int], Any]], repeats: int) -> dict[str, list[Any]]:
    """Run every config once per repeat in ABAB order, so drift hits all alike."""
    out: dict[str, list[Any]] = {k: [] for k in configs}
    for i in range(repeats):
        for name, fn in configs.items():
            log(f"  [{i + 1}/{repeats}] {name}")
            out[name].append(fn(i))
    return out


# ---- output ------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    return (f"{platform.machine()}, {cpus} CPUs, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"load average {load:.1f} at start")  # fmt: skip


def fmt(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"
    return str(v)


def md_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(doc.split("\n\n")[1:]))  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a short smoke run (CI)")
    p.add_argument("--json", action="store_true", help="print the JSON document only")
    p.add_argument("--out", type=Path, default=None, help="run folder (default: runs/bench-*)")
    p.add_argument("--timeout", type=float, default=600.0, help="per job, seconds")
    return p


def out_dir(args: argparse.Namespace, name: str) -> Path:
    out = args.out or ROOT / "runs" / time.strftime(f"bench-{name}-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    return out


def finish(args: argparse.Namespace, out: Path, name: str, doc: dict[str, Any], md: str) -> int:
    """Write out/NAME.json and out/NAME.md; print the JSON (--json) or the table."""
    doc = {"benchmark": name, "machine": machine(), "quick": bool(args.quick), **doc,
           "out": str(out)}  # fmt: skip
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / f"{name}.md").write_text(md + "\n")
    print(json.dumps(doc, indent=2, default=str) if args.json else md, flush=True)
    return 0


def plot(path: Path, lines: dict[str, tuple[Sequence[float], Sequence[float]]], *,
         xlabel: str, ylabel: str, title: str, logx: bool = False, bars: bool = False) -> None:  # fmt: skip
    """A line (or bar) chart into path; silently nothing without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, (label, (xs, ys)) in enumerate(lines.items()):
        if bars:
            width = 0.8 / len(lines)
            ax.bar([j + i * width for j in range(len(xs))], ys, width, label=label)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(xs))], [str(x) for x in xs])
        else:
            ax.plot(
                xs, ys, marker="o", label=label, linestyle="--" if "predicted" in label else "-"
            )
    if logx:
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
