"""`psar launch`: a whole job (shards and workers) on this machine, as real processes.

--arch ps starts `psar server` shards on free ports (each binds port 0 and prints the
port it got), then `psar train` workers with --servers/--rank/--world-size (and RANK,
WORLD_SIZE, LOCAL_RANK in their environment). --arch allreduce runs PyTorch's own
launcher (`python -m torch.distributed.run`, i.e. torchrun) on a free MASTER_PORT; with
--straggler it starts the ranks itself with torchrun's environment instead, because
torchrun gives every rank the same argv. Every child runs in its own session; on Ctrl-C,
SIGTERM, --timeout or any process failing, launch stops every process group (SIGTERM,
then SIGKILL after a grace period) and says why in its last line. See docs/launch.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

EXIT_USAGE, EXIT_TIMEOUT = 2, 124
_LISTEN = re.compile(r"psar server listening on (\S+):(\d+)")
_TEE = re.compile(r"^\[worker(\d+)\]:(.*)$")
_ROOT_RANK = re.compile(r"rank\s*:\s*(\d+)")
_ROOT_CODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
_RESERVED = ("--rank", "--world-size", "--metrics-port", "--servers")
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(kw_only=True)
class LaunchSpec:
    """One job to launch; the fields mirror `psar launch`'s flags."""

    arch: str = "ps"
    servers: int = 1
    workers: int = 2
    mode: str = "sync"
    staleness: int = 1
    metrics_base_port: int = 0
    bind_host: str = "127.0.0.1"
    straggler: dict[int, float] = field(default_factory=dict)
    timeout: float = 0.0
    train_args: list[str] = field(default_factory=list)
    launcher: str = "auto"
    """allreduce: auto (torchrun, or direct with a straggler) | torchrun | direct."""
    grace: float = 10.0
    env: dict[str, str] = field(default_factory=dict)
    out: TextIO | None = None
    """Children's prefixed lines go here (default: stdout)."""
    err: TextIO | None = None
    """launch's own lines go here (default: stderr)."""
    pids: list[int] = field(default_factory=list)
    """Filled in: the pid of every process launch started, and of their children."""


class LaunchError(ValueError):
    """A bad launch configuration, found before anything starts."""


def _straggler(text: str) -> tuple[int, float]:
    rank, sep, factor = text.partition(":")
    try:
        r, f = int(rank), float(factor)
    except ValueError:
        r, f = -1, 0.0
    if not sep or r < 0 or not f >= 1.0:
        raise argparse.ArgumentTypeError(f"expected RANK:FACTOR with FACTOR >= 1, got {text!r}")
    return r, f


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"expected a count >= 1, got {text!r} (launch starts the shards and picks the ports)"
        )
    return int(text)


def add_launch_flags(p: argparse.ArgumentParser, *, job: bool = True) -> None:
    """Flags shared by `psar launch` and `psar compare` (job=False: without --arch, --mode)."""
    if job:
        p.add_argument("--arch", choices=("ps", "allreduce"), default="ps", help="(default: ps)")
        p.add_argument("--mode", choices=("sync", "async", "ssp"), default="sync",
                       help="ps consistency mode (default: sync)")  # fmt: skip
    p.add_argument("--servers", type=_count, default=1, metavar="N",
                   help="ps: number of shards to start (default: 1)")  # fmt: skip
    p.add_argument("--workers", type=_count, default=2, metavar="N",
                   help="number of training processes (default: 2)")  # fmt: skip
    p.add_argument("--staleness", type=int, default=1 if job else 2,
                   help="ssp bound (default: %(default)s)")  # fmt: skip
    p.add_argument("--straggler", action="append", type=_straggler, default=[],
                   metavar="RANK:FACTOR", help="emulate a straggler: that worker gets "
                   "`--slowdown FACTOR` (its compute takes FACTOR times as long); repeatable")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psar launch",
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n", 1)[1].split(" See docs")[0],
        epilog="Any other flag is passed to every `psar train` (e.g. --workload, --steps, "
        "--precision,\n--report 'out/report-{rank}.json', --run-dir out). Exit code: 0 when "
        "every worker finished;\nthe failing process's code; 124 on --timeout; 128+N on "
        "signal N; 2 on bad flags.\n\nexamples:\n  psar launch --arch ps --servers 2 "
        "--workers 4 --mode ssp --staleness 2 --steps 200\n  psar launch --arch allreduce "
        "--workers 4 --precision fp32 --metrics-base-port 9100",
    )
    add_launch_flags(p)
    p.add_argument("--metrics-base-port", type=int, default=0, metavar="P",
                   help="give every process a /metrics port: shards P.., workers after them")  # fmt: skip
    p.add_argument("--bind-host", default="127.0.0.1", help="address shards, the "
                   "rendezvous and /metrics bind to (default: 127.0.0.1)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=0.0, metavar="SECONDS",
                   help="stop everything after this long (0: never)")  # fmt: skip
    p.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                   help="after SIGTERM, wait this long before SIGKILL (default: 10)")  # fmt: skip
    return p


def parse(argv: Sequence[str]) -> LaunchSpec:
    args, rest = build_parser().parse_known_args(list(argv))
    return LaunchSpec(
        **{k: v for k, v in vars(args).items() if k != "straggler"},
        straggler=dict(args.straggler),
        train_args=rest,
    )


def validate(spec: LaunchSpec) -> None:
    """Refuse bad flags before starting anything (train flags are parsed like `psar train`)."""
    if spec.arch == "allreduce" and spec.launcher == "torchrun" and spec.straggler:
        raise LaunchError("--straggler needs the direct launcher (torchrun: same argv for all)")
    for r in spec.straggler:
        if r >= spec.workers:
            raise LaunchError(f"--straggler {r}:...: rank must be < --workers {spec.workers}")
    for tok in spec.train_args:
        if tok.split("=", 1)[0] in _RESERVED:
            raise LaunchError(
                f"{tok.split('=', 1)[0]} is set by launch (use --servers N, --workers N, "
                "--metrics-base-port P)"
            )
    from worker import cli, cli_gen
    from worker.config import TrainConfig

    argv = ["train", "--arch", spec.arch, *spec.train_args, *_ps_flags(spec, "127.0.0.1:1", 0)]
    try:
        args = cli.build_parser().parse_args(argv)
    except SystemExit:
        raise LaunchError("unknown or bad train flag (see `psar train --help`)") from None
    cli_gen.build(TrainConfig, args, args.config)


def _ps_flags(spec: LaunchSpec, servers: str, rank: int) -> list[str]:
    if spec.arch != "ps":
        return []
    return ["--servers", servers, "--rank", str(rank), "--world-size", str(spec.workers),
            "--mode", spec.mode, "--staleness", str(spec.staleness)]  # fmt: skip


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch(args: LaunchSpec | Sequence[str]) -> int:
    """Run a job to completion; returns launch's exit code (see the module docstring)."""
    spec = args if isinstance(args, LaunchSpec) else parse(args)
    err = spec.err or sys.stderr
    try:
        validate(spec)
    except ValueError as e:
        print(f"psar launch: error: {e}", file=err, flush=True)
        return EXIT_USAGE
    return _Job(spec).run()


def main(argv: Sequence[str] | None = None) -> int:
    return launch(list(sys.argv[1:] if argv is None else argv))


@dataclass
class _Proc:
    name: str
    kind: str  # shard | worker | torchrun
    index: int
    popen: subprocess.Popen
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=400))
    thread: threading.Thread | None = None


class _Job:
    def __init__(self, spec: LaunchSpec) -> None:
        self.spec, self.procs, self.addrs = spec, [], {}
        self.out, self.err = spec.out or sys.stdout, spec.err or sys.stderr
        self.lock, self.signal, self.tmp = threading.Lock(), 0, None
        self.host = "127.0.0.1" if spec.bind_host in ("0.0.0.0", "::", "") else spec.bind_host
        ar = spec.arch == "allreduce"
        self.direct = ar and (spec.launcher == "direct" or (spec.launcher == "auto" and spec.straggler))

    def say(self, msg: str) -> None:
        with self.lock:
            print(f"psar launch: {msg}", file=self.err, flush=True)

    def run(self) -> int:
        main = threading.current_thread() is threading.main_thread()
        old = {s: signal.signal(s, self._on_signal) for s in _SIGNALS} if main else {}
        try:
            code, why = self._watch()
        finally:
            self._stop_all()
            for s, h in old.items():
                signal.signal(s, h)
            if self.tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)
        self.say(why)
        return code

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signal = self.signal or signum

    # -- starting ---------------------------------------------------------------------
    def _spawn(self, name: str, kind: str, index: int, cmd: list[str], env: dict) -> None:
        full = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env, **env}
        if self.spec.workers > 1:
            full.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does
        popen = subprocess.Popen(cmd, env=full, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        proc = _Proc(name, kind, index, popen)
        proc.thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        proc.thread.start()
        self.procs.append(proc)
        self.spec.pids.append(popen.pid)

    def _pump(self, proc: _Proc) -> None:
        assert proc.popen.stdout is not None
        for raw in iter(proc.popen.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            proc.tail.append(line)
            prefix = proc.name
            if proc.kind == "torchrun" and (m := _TEE.match(line)):
                prefix, line = f"worker{m.group(1)}", m.group(2)
            if proc.kind == "shard" and (m := _LISTEN.search(line)):
                self.addrs[proc.index] = f"{self.host}:{m.group(2)}"
            with self.lock:
                self.out.write(f"[{prefix}] {line}\n")
                self.out.flush()

    def _metrics(self, port: int) -> list[str]:
        if not self.spec.metrics_base_port:
            return []
        return ["--metrics-port", str(port), "--metrics-addr", self.spec.bind_host]

    def _start_shards(self) -> None:
        s, p = self.spec, self.spec.metrics_base_port
        for i in range(s.servers):
            cmd = [sys.executable, "-m", "worker.cli", "server", "--bind", f"{s.bind_host}:0",
                   "--shard", str(i), *self._metrics(p + i)]  # fmt: skip
            self._spawn(f"shard{i}", "shard", i, cmd, {})

    def _start_workers(self) -> None:
        s = self.spec
        base = s.metrics_base_port + (s.servers if s.arch == "ps" else 0)
        train = [*self._metrics(base), *s.train_args]
        if s.arch == "allreduce" and not self.direct:
            self.tmp = tempfile.mkdtemp(prefix="psar-launch-")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                   "--nproc-per-node", str(s.workers), "--max-restarts", "0",
                   "--master-addr", self.host, "--master-port", str(free_port(self.host)),
                   "--role", "worker", "--tee", "3", "--log-dir", self.tmp,
                   "--shutdown-timeout", str(max(1, int(s.grace / 2))),
                   "-m", "worker.cli", "train", "--arch", "allreduce", *train]  # fmt: skip
            self._spawn("torchrun", "torchrun", 0, cmd, {})
            return
        servers = ",".join(self.addrs[i] for i in sorted(self.addrs))
        master = {"MASTER_ADDR": self.host, "MASTER_PORT": str(free_port(self.host))}
        for r in range(s.workers):
            env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(s.workers),
                   "LOCAL_WORLD_SIZE": str(s.workers), "GROUP_RANK": "0", "ROLE_RANK": str(r),
                   "ROLE_WORLD_SIZE": str(s.workers)}  # fmt: skip
            if s.arch == "ps":
                env["PSAR_SERVERS"] = servers
            else:
                env.update(master)
            slow = ["--slowdown", str(s.straggler[r])] if r in s.straggler else []
            cmd = [sys.executable, "-m", "worker.cli", "train", "--arch", s.arch, *train,
                   *_ps_flags(s, servers, r), *slow]  # fmt: skip
            self._spawn(f"worker{r}", "worker", r, cmd, env)
        self.say(" ".join(f"{p.name}=pid {p.popen.pid}" for p in self.procs))

    def _print_metrics(self) -> None:
        s, p = self.spec, self.spec.metrics_base_port
        if not p:
            return
        names = [f"shard{i}" for i in range(s.servers if s.arch == "ps" else 0)]
        names += [f"worker{r}" for r in range(s.workers)]
        for i, n in enumerate(names):
            self.say(f"metrics {n}: http://{self.host}:{p + i}/metrics")

    # -- watching ---------------------------------------------------------------------
    def _watch(self) -> tuple[int, str]:
        s = self.spec
        self.deadline = time.monotonic() + s.timeout if s.timeout > 0 else float("inf")
        self._print_metrics()
        if s.arch == "ps":
            self._start_shards()
            while len(self.addrs) < s.servers:
                if r := self._check():
                    return r
                time.sleep(0.05)
            self.say(f"shards up: {','.join(self.addrs[i] for i in sorted(self.addrs))}")
        self._start_workers()
        while True:
            if r := self._check():
                return r
            if all(p.popen.poll() == 0 for p in self.procs if p.kind != "shard"):
                n = s.workers
                return 0, f"all {n} workers finished" + ("; stopped the shards" * (s.arch == "ps"))
            time.sleep(0.05)

    def _check(self) -> tuple[int, str] | None:
        if self.signal:
            name = signal.Signals(self.signal).name
            return 128 + self.signal, f"received {name}; stopped everything"
        if time.monotonic() > self.deadline:
            return EXIT_TIMEOUT, f"--timeout {self.spec.timeout:g}s reached; stopped everything"
        for p in sorted(self.procs, key=lambda p: p.kind != "shard"):
            rc = p.popen.poll()
            if rc is None or (rc == 0 and p.kind != "shard"):
                continue
            code = 128 - rc if rc < 0 else rc or 1
            who = f"{p.kind} {p.index}"
            if p.kind == "torchrun":
                who, code = self._torchrun_failure(p, code)
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
            if p.kind == "torchrun" and who.startswith("worker"):
                how = f"exited with code {code}"
            return code, f"{who} {how}; stopped the rest"
        return None

    def _torchrun_failure(self, p: _Proc, code: int) -> tuple[str, int]:
        """torchrun's summary names the first failed rank ('Root Cause' section)."""
        if p.thread:
            p.thread.join(timeout=2.0)
        text = "\n".join(p.tail)
        root = text.split("Root Cause", 1)[-1]
        rank, rc = _ROOT_RANK.search(root), _ROOT_CODE.search(root)
        if rank and rc and "Root Cause" in text:
            c = int(rc.group(1))
            return f"worker {rank.group(1)}", (128 - c if c < 0 else c) or code
        return "torchrun", code

    # -- stopping ---------------------------------------------------------------------
    def _stop_all(self) -> None:
        live = [p for p in self.procs if p.popen.poll() is None]
        seen = _descendants([p.popen.pid for p in self.procs])
        self.spec.pids.extend(pid for pid in seen if pid not in self.spec.pids)
        for p in live:
            _killpg(p.popen.pid, signal.SIGTERM)
        end = time.monotonic() + self.spec.grace
        while any(p.popen.poll() is None for p in live) and time.monotonic() < end:
            time.sleep(0.05)
        seen.update(_descendants([p.popen.pid for p in live if p.popen.poll() is None]))
        for p in live:
            if p.popen.poll() is None:
                self.say(f"{p.name} ignored SIGTERM for {self.spec.grace:g}s; SIGKILL")
            _killpg(p.popen.pid, signal.SIGKILL)
        for pid, start in seen.items():
            if _start_time(pid) == start:
                _kill(pid, signal.SIGKILL)
        for p in self.procs:
            p.popen.wait()
            if p.thread:
                p.thread.join(timeout=2.0)
        end = time.monotonic() + 5.0
        while any(_start_time(pid) == st for pid, st in seen.items()) and time.monotonic() < end:
            time.sleep(0.05)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stat(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state is [0], ppid [1])."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    """The process's start time (tells a reused pid apart); None once gone or a zombie."""
    f = _stat(pid)
    return None if f is None or f[0] in ("Z", "X") else f[19]


def _descendants(roots: list[int]) -> dict[int, str]:
    """{pid: start time} of the live descendants of `roots` (Linux /proc; {} elsewhere)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        if (f := _stat(pid)) is not None:
            children[int(f[1])].append(pid)
    out: dict[int, str] = {}
    todo = list(roots)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out and (st := _start_time(c)) is not None:
                out[c] = st
                todo.append(c)
    return out


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
