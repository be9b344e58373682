"""Shared helpers of the bench/ benchmarks: processes, jobs, step logs, rates, output.

Every job here is real processes (`psar server`, `psar train`, torchrun, plain scripts)
started in their own sessions with their output in a log file; `Procs` kills every
process group it started when the measurement ends, also on failure or SIGTERM.

Rates come from the per-step JSONL logs (`steps-*.jsonl`, written by `psar train
--run-dir` and by the plain baselines in the same format): a rank's steady-state rate is
(samples after the first `warmup` steps) / (time they took), so process start-up, the
rendezvous and the first slow steps are left out of every configuration alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
PSAR = [PY, "-m", "worker.cli"]
TORCHRUN = [PY, "-m", "torch.distributed.run"]
#: The reference workload: MLP 784-1024-1024-10, batch 128/worker, SGD momentum, fp32,
#: one compute thread per process.
REF_WORKLOAD = ["--workload", "mlp", "--workload-option", "in_dim=784",
                "--workload-option", "hidden=1024"]  # fmt: skip
REF_TRAIN = [*REF_WORKLOAD, "--batch-size", "128", "--optimizer", "sgd", "--momentum", "0.9",
             "--lr", "0.05", "--precision", "fp32", "--threads", "1", "--log-every", "0",
             "--eval-batches", "0"]  # fmt: skip
_LISTEN = re.compile(r"listening on (\S+):(\d+)")


class BenchError(RuntimeError):
    """A job failed or hung; the message carries the tail of its log."""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # PYTHONFAULTHANDLER: a rank killed by a signal (SIGABRT in a C++ destructor, say)
    # prints every thread's Python stack into its log, which a failed job's error quotes.
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    return {**os.environ, **env, **(extra or {})}


# Lines worth quoting from a failed job's log even when they scrolled out of its tail:
# a torchrun summary ends the log, and the rank's own error sits above it.
_ERROR_LINE = re.compile(r"Error|error:|Exception|Traceback|terminate called|what\(\)|Fatal Python")


def _raise_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every `with Procs`: no orphans


def install_sigterm() -> None:
    signal.signal(signal.SIGTERM, _raise_on_sigterm)


# ---- processes ---------------------------------------------------------------------------


def parse_cpus(spec: str) -> set[int] | None:
    """A CPU list as taskset reads it ("0", "0,2", "0-3"); None for "" (unpinned)."""
    out: set[int] = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out or None


class Procs:
    """The processes of one measurement; logs in `log_dir`; all killed on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
              host: Any = None, cpus: set[int] | None = None) -> subprocess.Popen:  # fmt: skip
        """Start argv (inside network-namespace `host` when given, a tests.netns.Host),
        pinned with what it starts to `cpus` when given (parse_cpus)."""
        cmd = host.cmd(list(argv)) if host is not None else list(argv)
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        with open(self.log_dir / f"{name}.log", "w") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env or child_env(), cwd=ROOT,
                                 start_new_session=True, preexec_fn=pin)  # fmt: skip
        self.procs[name] = p
        return p

    def tail(self, name: str, lines: int = 15, errors: int = 8) -> str:
        """The log's last `lines`, after the first `errors` error lines above them."""
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        above = [ln for ln in text[:-lines] if _ERROR_LINE.search(ln)][:errors]
        return "\n".join([*(f"  ! {ln}" for ln in above), *(f"  | {ln}" for ln in text[-lines:])])

    def wait_line(self, name: str, pattern: re.Pattern, timeout: float) -> re.Match:
        """The first match of `pattern` in the log of `name` (it must stay alive)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = pattern.search((self.log_dir / f"{name}.log").read_text(errors="replace"))
            if m:
                return m
            if self.procs[name].poll() is not None:
                raise BenchError(f"{name} exited {self.procs[name].returncode}:\n{self.tail(name)}")
            time.sleep(0.05)
        raise BenchError(
            f"{name} printed no {pattern.pattern!r} in {timeout:g}s:\n{self.tail(name)}"
        )

    def wait(self, names: Sequence[str], timeout: float) -> None:
        """Wait until every named process exited 0; any failure or the timeout raises."""
        end = time.monotonic() + timeout
        while True:
            codes = {n: self.procs[n].poll() for n in names}
            bad = [n for n, c in codes.items() if c not in (None, 0)]
            if bad:
                raise BenchError(f"{bad[0]} exited {codes[bad[0]]}:\n{self.tail(bad[0])}")
            if all(c == 0 for c in codes.values()):
                return
            if time.monotonic() > end:
                late = [n for n, c in codes.items() if c is None]
                raise BenchError(f"timeout {timeout:g}s waiting for {late}:\n{self.tail(late[0])}")
            time.sleep(0.05)

    def close(self, grace: float = 5.0) -> None:
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        end = time.monotonic() + grace
        while any(p.poll() is None for p in live) and time.monotonic() < end:
            time.sleep(0.05)
        for p in self.procs.values():  # the group too: torchrun's ranks, stray children
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


# ---- jobs --------------------------------------------------------------------------------


def start_shards(procs: Procs, n: int, *, hosts: Sequence[Any] | None = None,
                 timeout: float = 120.0, server: Sequence[str] = (),
                 cpus: set[int] | None = None) -> list[str]:  # fmt: skip
    """n `psar server` shards (shard i in hosts[i] when given; `server`: more flags;
    pinned to `cpus` when given); their HOST:PORT."""
    binds = [h.addr if hosts else "127.0.0.1" for h in (hosts or [None] * n)]
    # Shards sharing this host split its cores under `--torch-threads auto`.
    env = None if hosts else child_env({"PSAR_SHARDS_PER_HOST": str(n)})
    for i in range(n):
        procs.start(f"shard{i}", [*PSAR, "server", "--bind", f"{binds[i]}:0", "--shard", str(i),
                                        *server],
                    env=env, host=hosts[i] if hosts else None, cpus=cpus)  # fmt: skip
    return [f"{binds[i]}:{procs.wait_line(f'shard{i}', _LISTEN, timeout).group(2)}"
            for i in range(n)]  # fmt: skip


def ps_job(out: Path, *, workers: int, shards: int = 1, mode: str = "sync", staleness: int = 1,
           train: Sequence[str] = (), per_rank: dict[int, Sequence[str]] | None = None,
           timeout: float = 600.0, shard_hosts: Sequence[Any] | None = None,
           worker_hosts: Sequence[Any] | None = None, server: Sequence[str] = ()) -> Run:  # fmt: skip
    """Shards (`server`: more `psar server` flags) + `psar train --arch ps` workers to
    completion; their step logs."""
    with Procs(out) as procs:
        addrs = ",".join(start_shards(procs, shards, hosts=shard_hosts, server=server))
        names = [f"worker{r}" for r in range(workers)]
        for r in range(workers):
            argv = [*PSAR, "train", "--arch", "ps", "--servers", addrs, "--rank", str(r),
                    "--world-size", str(workers), "--mode", mode, "--staleness", str(staleness),
                    "--run-dir", str(out), "--report", str(out / "report-{rank}.json"),
                    *train, *(per_rank or {}).get(r, ())]  # fmt: skip
            procs.start(names[r], argv, host=worker_hosts[r] if worker_hosts else None)
        procs.wait(names, timeout)
    return load_run(out)


def ddp_job(out: Path, *, workers: int, py_args: Sequence[str], timeout: float = 600.0,
            hosts: Sequence[Any] | None = None, env: dict[str, str] | None = None) -> Run:  # fmt: skip
    """`python py_args` on `workers` ranks: under torchrun, or one per namespace host."""
    with Procs(out) as procs:
        if hosts is None:
            argv = [*TORCHRUN, "--nnodes", "1", "--nproc-per-node", str(workers),
                    "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *py_args]  # fmt: skip
            procs.start("torchrun", argv, env=child_env(env))
            procs.wait(["torchrun"], timeout)
        else:
            port = str(free_port())
            for r in range(workers):
                rank_env = {"RANK": str(r), "LOCAL_RANK": "0", "WORLD_SIZE": str(workers),
                            "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": hosts[0].addr,
                            "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": hosts[r].ifname}  # fmt: skip
                procs.start(f"rank{r}", [PY, *py_args], env=child_env({**(env or {}), **rank_env}),
                            host=hosts[r])  # fmt: skip
            procs.wait([f"rank{r}" for r in range(workers)], timeout)
    return load_run(out)


def psar_train_args(out: Path, arch: str = "allreduce") -> list[str]:
    """`python` args that run `psar train --arch ARCH` logging into `out` (+ REF-style flags)."""
    return ["-m", "worker.cli", "train", "--arch", arch, "--run-dir", str(out),
            "--report", str(out / "report-{rank}.json")]  # fmt: skip


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
    from worker import report

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
