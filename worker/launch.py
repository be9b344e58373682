"""`psar launch`: a whole job (shards and workers) on this machine, as real processes.

--arch ps starts `psar server` shards on free ports, then `psar train` workers given
--servers/--rank/--world-size (and RANK, WORLD_SIZE, LOCAL_RANK). --arch hybrid starts the
shards, then the workers itself with --servers and torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR/PORT: the dense layers' process group). --arch allreduce runs
torchrun (`python -m torch.distributed.run`) on a free MASTER_PORT, or, with --straggler,
starts the ranks itself with torchrun's environment (torchrun gives all ranks one argv).
`-- COMMAND ARGS` runs your own script once per worker instead of `psar train`, the way
torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT or PSAR_SERVERS), with
PSAR_ARCH and PSAR_ARGS (--arch, --mode and the other train flags given to launch) for
worker/own_loop.py's prepare().
On Ctrl-C, SIGTERM, --timeout or any process failing, launch stops every process it
started and their descendants (SIGTERM, SIGKILL after --grace: worker/supervisor.py, the
supervisor bench/ runs its jobs through too) and says why in its last line. See
docs/launch.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from psar.trainkit.choices import DEFAULT_MODE, MODES, local_sgd
from psar.trainkit.cli_strict import StrictParser
from psar.trainkit.config import PSConfig
from psar.trainkit.connection import is_loopback
from psar.worker.supervisor import Supervisor, free_port
from psar.worker.torchrun_compat import torchrun_flags, torchrun_options

EXIT_USAGE, EXIT_TIMEOUT = 2, 124
_LISTEN = re.compile(r"psar server listening on (\S+):(\d+)")
_TEE = re.compile(r"^\[worker(\d+)\]:(.*)$")
_ROOT_RANK = re.compile(r"rank\s*:\s*(\d+)")
_ROOT_CODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
_RESERVED = ("--rank", "--world-size", "--metrics-port", "--servers")
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
ARCHS = ("ps", "allreduce", "hybrid")
WITH_SHARDS = ("ps", "hybrid")
"""The architectures whose jobs launch starts `psar server` shards for."""


@dataclass(kw_only=True)
class LaunchSpec:
    """One job to launch; the fields mirror `psar launch`'s flags."""

    arch: str = "ps"
    servers: int = 1
    workers: int = 2
    mode: str = DEFAULT_MODE
    staleness: int = 1
    metrics_base_port: int = 0
    bind_host: str = "127.0.0.1"
    allow_insecure_bind: bool = False
    straggler: dict[int, float] = field(default_factory=dict)
    timeout: float = 0.0
    train_args: list[str] = field(default_factory=list)
    launcher: str = "auto"  # allreduce: auto (torchrun; direct if straggler) | torchrun | direct
    grace: float = 10.0
    env: dict[str, str] = field(default_factory=dict)  # added to every child's environment
    out: TextIO | None = None  # children's prefixed lines (default: stdout)
    err: TextIO | None = None  # launch's own lines (default: stderr)
    pids: list[int] = field(default_factory=list)  # filled in: every process launch saw
    command: list[str] = field(default_factory=list)
    """After `--`: run this once per worker instead of `psar train` (a loop of your own)."""


def _straggler(text: str) -> tuple[int, float]:
    rank, _, factor = text.partition(":")
    with contextlib.suppress(ValueError):
        if int(rank) >= 0 and float(factor) >= 1.0:
            return int(rank), float(factor)
    raise argparse.ArgumentTypeError(f"expected RANK:FACTOR with FACTOR >= 1, got {text!r}")


def _count(text: str) -> int:
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a count >= 1, got {text!r} (launch picks ports)")


def _servers(text: str) -> int:
    """--servers: a count, or auto (0 here; parse() resolves it with auto_servers)."""
    return 0 if text == "auto" else _count(text)


def auto_servers(workers: int, cores: int | None = None) -> int:
    """Shards for `--servers auto`: one per two cores left after one core per worker (a
    shard's update then has two cores of its own), at least 1 and at most 8 (past that,
    per-shard fixed costs outgrow the parallel update on one host)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, (int(cores or 1) - workers) // 2))


def add_launch_flags(p: argparse.ArgumentParser, *, job: bool = True) -> None:
    """Flags shared by `psar launch` and `psar compare` (job=False: without --arch, --mode)."""
    if job:
        p.add_argument("--arch", choices=ARCHS, default="ps", help="(default: ps)")
        p.add_argument("--mode", choices=MODES, default=DEFAULT_MODE,
                       help=f"ps consistency mode (default: {DEFAULT_MODE})")  # fmt: skip
    p.add_argument("--servers", type=_servers, default=1, metavar="N|auto",
                   help="ps: number of shards to start; auto: one per two cores left after "
                   "one per worker, 1 to 8 (default: 1)")  # fmt: skip
    p.add_argument("--workers", type=_count, default=2, metavar="N",
                   help="number of training processes (default: 2)")  # fmt: skip
    # psar train's own default (the config tree's), so launch, compare and train agree.
    p.add_argument("--staleness", type=int, default=PSConfig.staleness,
                   help="ssp bound (default: %(default)s)")  # fmt: skip
    p.add_argument("--straggler", action="append", type=_straggler, default=[],
                   metavar="RANK:FACTOR", help="emulate a straggler: that worker gets "
                   "`--slowdown FACTOR` (its compute takes FACTOR times as long); repeatable")  # fmt: skip


def build_parser() -> StrictParser:
    p = StrictParser(
        prog="psar launch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n", 1)[1].split(" See docs")[0],
        epilog="Any other flag is passed to every `psar train` (e.g. --workload, --steps, "
        "--precision,\n--report 'out/report-{rank}.json', --run-dir out). Exit code: 0 when "
        "every worker finished;\nthe failing process's code; 124 on --timeout; 128+N on "
        "signal N; 2 on bad flags.\n\nexamples:\n  psar launch --arch ps --servers 2 "
        "--workers 4 --mode ssp --staleness 2 --steps 200\n  psar launch --arch allreduce "
        "--workers 4 --precision fp32 --metrics-base-port 9100\n  psar launch --arch ps "
        "--mode sync --servers 2 --workers 2 -- python examples/own_loop.py\n    (your own "
        "script, once per worker: docs/own-loop.md; train flags before -- reach it in "
        "PSAR_ARGS)",
    )
    add_launch_flags(p)
    p.add_argument("--metrics-base-port", type=int, default=0, metavar="P",
                   help="give every process a /metrics port: shards P.., workers after them")  # fmt: skip
    p.add_argument("--bind-host", default="127.0.0.1", help="address shards, the "
                   "rendezvous and /metrics bind to (default: 127.0.0.1)")  # fmt: skip
    p.add_argument("--allow-insecure-bind", action="store_true",
                   help="let shards (and /metrics) listen on a non-loopback --bind-host "
                   "without a token and TLS (psar server --allow-insecure-bind)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=0.0, metavar="SECONDS",
                   help="stop everything after this long (0: never)")  # fmt: skip
    p.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                   help="after SIGTERM, wait this long before SIGKILL (default: 10)")  # fmt: skip
    return p


def parse(argv: Sequence[str]) -> LaunchSpec:
    argv, command = list(argv), []
    if "--" in argv:  # `-- COMMAND ARGS`: a script of the user's own, once per worker
        argv, command = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
        if not command:
            build_parser().error("nothing after --: give the command to run per worker")
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    parser.refuse_unknown(rest, train_flags())
    args.straggler = dict(args.straggler)
    if args.servers == 0:
        args.servers = auto_servers(args.workers)
    return LaunchSpec(**vars(args), train_args=rest, command=command)


def train_flags() -> list[str]:
    """Every flag `psar train` accepts (launch and compare pass their other flags on to
    it, so a flag neither knows is a typo, answered in their own usage)."""
    from psar.trainkit.cli_strict import option_strings
    from psar.worker import cli_parser

    return option_strings(cli_parser.train_parser())


def validate(spec: LaunchSpec) -> None:
    """Refuse bad flags before starting anything (train flags are parsed like `psar train`)."""
    if spec.arch == "allreduce" and spec.launcher == "torchrun" and spec.straggler:
        raise ValueError("--straggler needs the direct launcher (torchrun: same argv for all)")
    if spec.command and local_sgd(spec.mode):
        raise ValueError(
            f"--mode {spec.mode} runs psar's own inner optimizer: a script of your own runs "
            "under --mode sync, async or ssp"
        )
    if (
        not is_loopback(spec.bind_host)
        and not spec.allow_insecure_bind
        and (spec.arch in WITH_SHARDS or spec.metrics_base_port)
    ):
        # Exposure is a decision (issue #45): the shards would refuse to start anyway.
        raise ValueError(
            f"--bind-host {spec.bind_host} is not loopback: shards and /metrics there would "
            "serve anyone who reaches this host without a token or TLS; pass "
            "--allow-insecure-bind to say so (on a private network only), or run psar "
            "server yourself with --auth-token-file, --tls-cert and --tls-key"
        )
    if bad := [r for r in spec.straggler if r >= spec.workers]:
        raise ValueError(f"--straggler {bad[0]}:...: rank must be < --workers {spec.workers}")
    if bad := [t.split("=")[0] for t in spec.train_args if t.split("=")[0] in _RESERVED]:
        raise ValueError(
            f"{bad[0]} is set by launch (--servers N, --workers N, --metrics-base-port)"
        )
    from psar.trainkit import cli_gen
    from psar.trainkit.config import TrainConfig
    from psar.worker import cli_parser

    argv = ["train", "--arch", spec.arch, *spec.train_args, *_ps_flags(spec, "127.0.0.1:1", 0)]
    try:
        args = cli_parser.train_parser().parse_args(argv[1:])
    except SystemExit:
        raise ValueError("unknown or bad train flag (see `psar train --help`)") from None
    cli_gen.build(TrainConfig, args, args.config)


def _ps_flags(spec: LaunchSpec, servers: str, rank: int) -> list[str]:
    if spec.arch == "hybrid":  # ranks from torchrun's environment, as the process group's
        return ["--servers", servers, "--mode", spec.mode, "--staleness", str(spec.staleness)]
    if spec.arch != "ps":  # of the modes only local SGD (--mode local) applies to allreduce
        return ["--mode", spec.mode] if local_sgd(spec.mode) else []
    return ["--servers", servers, "--rank", str(rank), "--world-size", str(spec.workers),
            "--mode", spec.mode, "--staleness", str(spec.staleness)]  # fmt: skip


def launch(args: LaunchSpec | Sequence[str]) -> int:
    """Run a job to completion; returns launch's exit code (see the module docstring)."""
    spec = args if isinstance(args, LaunchSpec) else parse(args)
    try:
        validate(spec)
    except ValueError as e:
        print(f"psar launch: error: {e}", file=spec.err or sys.stderr, flush=True)
        return EXIT_USAGE
    return _Job(spec).run()


def main(argv: Sequence[str] | None = None) -> int:
    return launch(list(sys.argv[1:] if argv is None else argv))


def _relabel(name: str, line: str) -> tuple[str, str]:
    """torchrun's --tee lines ("[workerN]:...") under the rank's own prefix."""
    if name == "torchrun" and (m := _TEE.match(line)):
        return f"worker{m.group(1)}", m.group(2)
    return name, line


class _Job:
    """One job's processes, started and watched through a Supervisor (worker/supervisor.py:
    process groups, descendants, SIGTERM then SIGKILL after --grace)."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec, self.addrs = spec, {}
        self.kinds: dict[str, tuple[str, int]] = {}  # child name -> (shard|worker|torchrun, index)
        self.out, self.err = spec.out or sys.stdout, spec.err or sys.stderr
        self.signal, self.tmp = 0, None
        self.deadline = time.monotonic() + (spec.timeout or float("inf"))
        self.host = "127.0.0.1" if spec.bind_host in ("0.0.0.0", "::", "") else spec.bind_host
        auto = spec.launcher == "auto" and spec.straggler
        direct = spec.launcher == "direct" or bool(auto) or bool(spec.command)
        # hybrid: launch starts the ranks itself, with torchrun's environment and --servers.
        self.direct = spec.arch == "allreduce" and direct or spec.arch == "hybrid"
        self.sup = Supervisor(out=self.out, grace=spec.grace, relabel=_relabel, note=self.say,
                              pids=spec.pids)  # fmt: skip

    def say(self, msg: str) -> None:
        with self.sup.lock:  # one line, never torn by a child's line
            print(f"psar launch: {msg}", file=self.err, flush=True)

    def run(self) -> int:
        main = threading.current_thread() is threading.main_thread()
        old = {s: signal.signal(s, self._on_signal) for s in _SIGNALS} if main else {}
        try:
            code, why = self._watch()
        finally:
            self.sup.stop()
            for s, h in old.items():
                signal.signal(s, h)
            if self.tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)
        self.say(why)
        return code

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signal = self.signal or signum  # acted on by the watch loop

    def _spawn(self, name: str, kind: str, index: int, cmd: list[str], env: dict) -> None:
        full = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env, **env}
        if self.spec.workers > 1:
            full.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does
        self.kinds[name] = (kind, index)
        # A shard serves until stopped: its exit, even with code 0, fails the job.
        self.sup.start(name, cmd, env=full, persistent=kind == "shard")

    def _metrics(self, port: int) -> list[str]:
        flags = ["--metrics-port", str(port), "--metrics-addr", self.spec.bind_host]
        return flags if self.spec.metrics_base_port else []

    def _start_shards(self) -> None:
        s, p = self.spec, self.spec.metrics_base_port
        # No per-chunk flag: rank 0's Init tells the shards how the job's rounds run.
        for i in range(s.servers):
            cmd = [sys.executable, "-m", "psar.worker.cli", "server", "--bind", f"{s.bind_host}:0",
                   "--shard", str(i), *self._metrics(p + i),
                   *(["--allow-insecure-bind"] if s.allow_insecure_bind else [])]  # fmt: skip
            # All on this host: `--torch-threads auto` splits the cores between them.
            self._spawn(f"shard{i}", "shard", i, cmd, {"PSAR_SHARDS_PER_HOST": str(s.servers)})

    def _start_workers(self) -> None:
        s = self.spec
        base = s.metrics_base_port + (s.servers if s.arch in WITH_SHARDS else 0)
        train = [*self._metrics(base), *s.train_args]
        if s.arch == "allreduce" and not self.direct:
            self.tmp = tempfile.mkdtemp(prefix="psar-launch-")
            # Without --shutdown-timeout, launch's own SIGKILL after --grace still bounds it.
            flags, notes = torchrun_flags(
                ["--nnodes", "1", "--nproc-per-node", str(s.workers), "--max-restarts", "0",
                 "--master-addr", self.host, "--master-port", str(free_port(self.host)),
                 "--role", "worker", "--tee", "3", "--log-dir", self.tmp,
                 "--shutdown-timeout", str(max(1, int(s.grace / 2)))], torchrun_options())  # fmt: skip
            for note in notes:
                self.say(note)
            cmd = [sys.executable, "-m", "torch.distributed.run", *flags,
                   "-m", "psar.worker.cli", "train", "--arch", "allreduce", *train,
                   *_ps_flags(s, "", 0)]  # fmt: skip
            self._spawn("torchrun", "torchrun", 0, cmd, {})
            return
        servers = ",".join(self.addrs[i] for i in sorted(self.addrs))
        master = {"MASTER_ADDR": self.host, "MASTER_PORT": str(free_port(self.host))}
        for r in range(s.workers):
            env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(s.workers),
                   "LOCAL_WORLD_SIZE": str(s.workers), "GROUP_RANK": "0", "ROLE_RANK": str(r),
                   "ROLE_WORLD_SIZE": str(s.workers)}  # fmt: skip
            env.update({"PSAR_SERVERS": servers} if s.arch in WITH_SHARDS else {})
            env.update(master if s.arch != "ps" else {})
            slow = ["--slowdown", str(s.straggler[r])] if r in s.straggler else []
            cmd = [sys.executable, "-m", "psar.worker.cli", "train", "--arch", s.arch, *train,
                   *_ps_flags(s, servers, r), *slow]  # fmt: skip
            if s.command:  # a script of its own: its ranks and shards from the environment
                mode = ["--mode", s.mode, "--staleness", str(s.staleness)] * (s.arch in WITH_SHARDS)
                flags = ["--arch", s.arch, *train, *mode, *slow]
                env.update({"PSAR_ARCH": s.arch, "PSAR_ARGS": shlex.join(flags)})
                cmd = list(s.command)
            self._spawn(f"worker{r}", "worker", r, cmd, env)
        self.say(" ".join(f"{n}=pid {c.pid}" for n, c in self.sup.children.items()))

    def _print_metrics(self) -> None:
        s, p = self.spec, self.spec.metrics_base_port
        names = [f"shard{i}" for i in range(s.servers if s.arch in WITH_SHARDS else 0)]
        for i, n in enumerate([*names, *(f"worker{r}" for r in range(s.workers))] * bool(p)):
            self.say(f"metrics {n}: http://{self.host}:{p + i}/metrics")

    def _watch(self) -> tuple[int, str]:
        s = self.spec
        self._print_metrics()
        if s.arch in WITH_SHARDS:
            self._start_shards()
            while len(self.addrs) < s.servers:
                if r := self._check():
                    return r
                for i in range(s.servers):
                    if i not in self.addrs and (m := self.sup.find_line(f"shard{i}", _LISTEN)):
                        self.addrs[i] = f"{self.host}:{m.group(2)}"
                time.sleep(0.05)
            self.say(f"shards up: {','.join(self.addrs[i] for i in sorted(self.addrs))}")
        self._start_workers()
        training = [n for n, (kind, _) in self.kinds.items() if kind != "shard"]
        while True:
            if r := self._check():
                return r
            if self.sup.finished(training):
                tail = "; stopped the shards" * (s.arch in WITH_SHARDS)
                return 0, f"all {s.workers} workers finished{tail}"
            time.sleep(0.05)

    def _check(self) -> tuple[int, str] | None:
        if self.signal:
            name = signal.Signals(self.signal).name
            return 128 + self.signal, f"received {name}; stopped everything"
        if time.monotonic() > self.deadline:
            return EXIT_TIMEOUT, f"--timeout {self.spec.timeout:g}s reached; stopped everything"
        if (failed := self.sup.failure()) is None:  # also remembers torchrun's workers
            return None
        child, rc = failed
        kind, index = self.kinds[child.name]
        who = f"{kind} {index}"
        if kind == "torchrun":
            who, rc = self._torchrun_failure(child.name, rc)
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        return (128 - rc if rc < 0 else rc or 1), f"{who} {how}; stopped the rest"

    def _torchrun_failure(self, name: str, rc: int) -> tuple[str, int]:
        """The rank and exit code in the 'Root Cause' section of torchrun's summary."""
        _, found, root = "\n".join(self.sup.lines(name, drain=2.0)).partition("Root Cause")
        rank, code = _ROOT_RANK.search(root), _ROOT_CODE.search(root)
        if found and rank and code:
            return f"worker {rank.group(1)}", int(code.group(1))
        return "torchrun", rc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
