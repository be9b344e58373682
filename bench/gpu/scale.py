"""GPU scale: what the parameter server adds to a ~57M-parameter Byte LM step on one GPU.

One model on one device, trained with no communication and through 1, 4 and 8 PS shards
(the shards are CPU processes, as on a real GPU host), then 2 async workers sharing the
device. Byte LM (`--workload lm`: seq_len 256, d_model 768, 8 layers, 12 heads: 57M
parameters), batch 16 per worker, fp16 with loss scaling, AdamW, 60 steps per run.

Rows: no_comm (DDP with one rank: NCCL on CUDA, gloo on CPU, so nothing is exchanged),
ps_sync_1shard / ps_sync_4shards / ps_sync_8shards (one worker, `--mode sync`) and
ps_async_2workers (two workers on the same device, `--mode async`, --async-shards shards),
and ps_sync_8shards_fp16w: 8 shards with `--worker-weights fp16` (the worker keeps fp16
weights, the shards the fp32 masters: half the bytes pulled).

- step ms: each worker's median step time over the second half of its steps (the
  first half holds start-up, CUDA warm-up and the PS overlap trial), averaged over
  workers; x_no_comm = step ms / the no_comm row's step ms.
- phases: the per-step phases of the `--run-dir` step logs (forward, backward, push,
  wait, pull, optimizer...), median over the same steps, averaged over workers.
- samples/s: all workers' samples inside the window in which every worker is in its
  second half (last worker's start to first worker's end, on the wall clock of the step
  records) / the window's length; never a sum of per-worker medians. ps_async_2workers
  also gets its ratio to the ps_sync row with the same shards (one worker).

Without CUDA (or with --device cpu) the same rows run a scaled-down model on the CPU
(lm 2x64, seq_len 64, fp32, 48 steps) so CI can run the script; those figures say
nothing about a GPU.

    python -m bench.gpu.scale                         # CUDA if present, else the CPU variant
    python -m bench.gpu.scale --json --rows no_comm,ps_sync_1shard --steps 12
    python -m bench.gpu.scale --server-args '--torch-threads auto'   # flags for each shard
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import common as c

#: run name -> (shards, workers, mode); no_comm is DDP with one rank.
ROWS: dict[str, tuple[int, int, str]] = {
    "no_comm": (0, 1, "ddp"),
    "ps_sync_1shard": (1, 1, "sync"),
    "ps_sync_4shards": (4, 1, "sync"),
    "ps_sync_8shards": (8, 1, "sync"),
    "ps_async_2workers": (4, 2, "async"),  # shards: --async-shards
    "ps_sync_8shards_fp16w": (8, 1, "sync"),
}
#: Rows that differ from their namesake by `psar train` flags of their own.
ROW_FLAGS: dict[str, list[str]] = {
    # fp16 weights on the worker (fp32 masters stay on the shards): half the pull bytes.
    "ps_sync_8shards_fp16w": ["--worker-weights", "fp16"],
}
PHASES = ("data", "forward", "backward", "push", "wait", "pull", "optimizer")
GPU_MODEL = {"seq_len": 256, "d_model": 768, "n_layers": 8, "n_heads": 12}
CPU_MODEL = {"seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4}


@dataclass
class Setup:
    device: str  # cuda | cpu
    model: dict[str, int]
    precision: str
    steps: int
    batch: int = 16
    lr: float = 3e-4
    extra: list[str] = field(default_factory=list)  # --train-args

    def train_flags(self) -> list[str]:
        """`psar train` flags shared by every row."""
        opts = [x for k, v in self.model.items() for x in ("--workload-option", f"{k}={v}")]
        # One compute thread per CPU process: on 2 cores the shards and workers share them.
        threads = ["--torch-threads", "1"] if self.device == "cpu" else []
        return ["--workload", "lm", *opts, "--batch-size", str(self.batch),
                "--steps", str(self.steps), "--precision", self.precision,
                "--optimizer", "adamw", "--lr", str(self.lr), "--device", self.device,
                "--eval-batches", "0", "--log-every", "0", *threads, *self.extra]  # fmt: skip


def params(model: dict[str, int]) -> int:
    """Parameter count of the lm workload at these sizes (built on the meta device: free)."""
    import torch

    from psar.worker.workloads.lm import ByteLM

    with torch.device("meta"):
        m = ByteLM(model["seq_len"], model["d_model"], model["n_layers"], model["n_heads"])
    return sum(p.numel() for p in m.parameters())


def run_job(name: str, out: Path, setup: Setup, *, shards: int, timeout: float,
            server: list[str]) -> c.Run:  # fmt: skip
    """One row's processes to completion (its supervisor stops every process)."""
    _, workers, mode = ROWS[name]
    train = [*setup.train_flags(), *ROW_FLAGS.get(name, [])]
    if name == "no_comm":
        py = [*c.psar_train_args(out, "allreduce"), *train]
        return c.ddp_job(out, workers=1, py_args=py, timeout=timeout)
    return c.ps_job(out, workers=workers, shards=shards, mode=mode, train=train,
                    timeout=timeout, server=server)  # fmt: skip


# ---- analysis ----------------------------------------------------------------------------


def second_half(run: c.Run) -> c.Run:
    """Every series cut to its second half of steps (same clock, same start_wall)."""
    cut = []
    for s in run.series:
        h = len(s.time) // 2
        cut.append(c.Series(s.rank, s.time[h:], s.samples[h:], s.loss[h:], s.start_wall))
    return c.Run(cut, run.summaries)


def step_durations(times: list[float]) -> list[float]:
    """Per-step seconds from the records' `time` (seconds since the loop started, at the
    end of each step), so step 1 counts from the loop's start."""
    return [b - a for a, b in zip([0.0, *times], times, strict=False)]


def step_ms(run: c.Run) -> float:
    per = [statistics.median(d[len(d) // 2 :]) for s in run.series if (d := step_durations(s.time))]
    return 1e3 * sum(per) / len(per) if per else math.nan


def phases_ms(out: Path) -> dict[str, float]:
    """Median ms per step of each phase over each worker's second half, mean over workers."""
    per: dict[str, list[float]] = {}
    files = sorted(out.glob("steps-*.jsonl"))
    for path in files:
        recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        recs = recs[len(recs) // 2 :]
        names = {k for r in recs for k in r.get("phases", {})}
        for k in names:  # a phase absent from a step took 0 in it
            per.setdefault(k, []).append(
                1e3 * statistics.median(r.get("phases", {}).get(k, 0.0) for r in recs)
            )
    order = [k for k in PHASES if k in per] + sorted(k for k in per if k not in PHASES)
    return {k: sum(per[k]) / len(files) for k in order}


def finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def analyse(name: str, out: Path, run: c.Run, shards: int) -> dict[str, Any]:
    half = second_half(run)
    rate, window = c.window_rate(half)
    return {"run": name, "workers": ROWS[name][1], "shards": shards, "mode": ROWS[name][2],
            "step_ms": finite(step_ms(run)), "phases_ms": phases_ms(out),
            "samples_per_s": finite(rate), "window_s": finite(window),
            "samples_in_window": finite(rate * window)}  # fmt: skip


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """x_no_comm on every row; x_ps_sync_1worker on the async row (same shard count)."""
    by = {r["run"]: r for r in rows}
    base = (by.get("no_comm") or {}).get("step_ms")
    for r in rows:
        r["x_no_comm"] = r["step_ms"] / base if base and r["step_ms"] else None
    if (a := by.get("ps_async_2workers")) is not None:
        sync = next((r for r in rows if r["mode"] == "sync" and r["shards"] == a["shards"]), {})
        s, x = sync.get("samples_per_s"), a["samples_per_s"]
        a["ps_sync_run"] = sync.get("run")
        a["x_ps_sync_1worker"] = x / s if x and s else None


# ---- output ------------------------------------------------------------------------------


def last_line(text: str) -> str:
    """The error's last line (a log tail ends with the exception), fit for a table cell."""
    lines = [ln.strip(" |") for ln in text.splitlines() if ln.strip(" |")]
    return (lines[-1] if lines else "?").replace("|", "/")[:100]


def table(doc: dict[str, Any]) -> str:
    rows = doc["rows"]
    seen = {k for r in rows for k in r.get("phases_ms", {})}
    cols = [k for k in PHASES if k in seen] + sorted(seen - set(PHASES))
    head = ["run", "workers", "shards", "step ms", "x no_comm", "samples/s",
            "x ps_sync (1 worker)", *(f"{k} ms" for k in cols)]  # fmt: skip
    body = [[r["run"] + (f" (failed: {last_line(r['error'])})" if r.get("error") else ""),
             r["workers"], r["shards"] or "-", r["step_ms"], r.get("x_no_comm"),
             r["samples_per_s"], r.get("x_ps_sync_1worker"),
             *(r.get("phases_ms", {}).get(k) for k in cols)] for r in rows]  # fmt: skip
    m = doc["model"]
    return (
        f"## GPU scale ({doc['device']}: {doc['device_name']})\n\n"
        + c.md_table(head, body)
        + f"\n\nByte LM {m['n_layers']}x{m['d_model']}, {m['n_heads']} heads, seq_len "
        f"{m['seq_len']} ({doc['params']:,} parameters), batch {doc['batch_size']}/worker, "
        f"{doc['precision']}, AdamW, {doc['steps']} steps per run. Step ms and phases: "
        "medians over the second half of each worker's steps; samples/s: all workers' "
        "samples in the window where every worker is in its second half / its length. "
        "no_comm is DDP with one rank (no exchange). Shards run on the CPU."
    )


def failed_row(name: str, shards: int, error: str) -> dict[str, Any]:
    return {"run": name, "workers": ROWS[name][1], "shards": shards, "mode": ROWS[name][2],
            "step_ms": None, "phases_ms": {}, "samples_per_s": None, "error": error}  # fmt: skip


def pick_device(want: str) -> tuple[str, str]:
    """(cuda|cpu, a readable name); --device cuda without CUDA is an error."""
    import torch

    has = torch.cuda.is_available()
    if want == "cuda" and not has:
        raise SystemExit("gpu_scale: --device cuda, but no CUDA device is visible")
    if want == "cuda" or (want == "auto" and has):
        return "cuda", torch.cuda.get_device_name(0)
    return "cpu", "CPU (scaled-down model; not a GPU figure)"


def main(argv: list[str] | None = None) -> int:
    p = c.parser("python -m bench.gpu.scale", __doc__)
    p.add_argument("--timeout-s", dest="timeout", type=float, default=argparse.SUPPRESS,
                   help="per job, seconds (same as --timeout; default 600)")  # fmt: skip
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--steps", type=int, default=None, help="per run (cuda 60, cpu 48, quick 12)")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: %(default)s")
    p.add_argument("--async-shards", type=int, choices=(4, 8), default=4)
    p.add_argument("--server-args", default="", help="more flags for every `psar server`")
    p.add_argument("--train-args", default="", help="more flags for every `psar train`")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    bad = [n for n in names if n not in ROWS]
    if bad or not names:
        p.error(f"--rows: unknown {bad or 'nothing'}; choose from {', '.join(ROWS)}")
    if args.steps is not None and args.steps < 4:
        p.error("--steps must be >= 4 (the second half is measured)")
    c.install_sigterm()  # SIGTERM unwinds through every supervisor: no orphans
    device, device_name = pick_device(args.device)
    gpu = device == "cuda"
    steps = args.steps or (12 if args.quick else 60 if gpu else 48)
    setup = Setup(device, GPU_MODEL if gpu else CPU_MODEL, "fp16" if gpu else "fp32", steps,
                  extra=shlex.split(args.train_args))  # fmt: skip
    out = c.out_dir(args, "gpu_scale")
    rows, stopped = [], 0  # stopped: the exit code of a SIGINT/SIGTERM that ended the runs
    for name in names:
        shards = args.async_shards if name == "ps_async_2workers" else ROWS[name][0]
        if stopped:
            rows.append(failed_row(name, shards, "not run: interrupted"))
            continue
        c.log(f"gpu_scale: {name} ({device}, {steps} steps)")
        try:
            run = run_job(name, out / name, setup, shards=shards, timeout=args.timeout,
                          server=shlex.split(args.server_args))  # fmt: skip
            rows.append(analyse(name, out / name, run, shards))
        except (c.ProcessError, OSError, ValueError) as e:  # one failed row; the rest still run
            c.log(f"gpu_scale: {name} failed: {e}")
            rows.append(failed_row(name, shards, str(e)))
        except (KeyboardInterrupt, SystemExit) as e:  # SIGTERM arrives as SystemExit(143)
            # The job's processes are stopped already; print the rows measured so far, so
            # an outer `timeout` still leaves a table behind.
            stopped = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 130
            rows.append(failed_row(name, shards, "interrupted"))
    add_ratios(rows)
    doc = {"device": device, "device_name": device_name, "model": setup.model,
           "params": params(setup.model), "batch_size": setup.batch,
           "precision": setup.precision, "steps": steps, "rows": rows}  # fmt: skip
    c.finish(args, out, "gpu_scale", doc, table(doc))
    return stopped or (1 if any(r.get("error") for r in rows) else 0)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # every supervisor has stopped its processes
        sys.exit(130)
