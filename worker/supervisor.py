"""Processes started, watched and stopped as one group: `psar launch` and every benchmark
in bench/ supervise their processes through a `Supervisor`.

- Every child starts in a session of its own (so in its own process group), stdin closed.
  Its output goes either to a log file, `log_dir/NAME.log` (bench: nothing to drain, the
  whole log kept), or, without a log_dir, through a pipe that a thread copies line by line
  into `out` with a `[NAME] ` prefix (`psar launch`), keeping the last lines for errors.
- A child started `persistent` (a shard) must run until it is stopped: its exit, even
  with code 0, is a failure. Any other child fails by exiting non-zero.
- The supervisor remembers every process it has seen, its children and their descendants
  (torchrun starts its ranks in sessions of their own, so signalling torchrun's group
  never reaches them), by pid and start time: stopping reaches a rank whose parent died,
  and never signals a pid the system has since given to someone else.
- `stop()`: SIGTERM to every live child's group, `grace` seconds, then SIGKILL to the
  groups (an exited child's too, while a process it left there lives) and to every
  remembered descendant still alive; then reap. Leaving the `with` block stops.

Linux /proc is read for descendants and start times; elsewhere only the groups are
signalled.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

#: Lines worth quoting from a failed child's output even when they scrolled out of its
#: tail: a torchrun summary ends the log, and the rank's own error sits above it.
ERROR_LINE = re.compile(r"Error|error:|Exception|Traceback|terminate called|what\(\)|Fatal Python")
_SCAN_EVERY_S = 0.5
_TAIL_LINES = 400


class ProcessError(RuntimeError):
    """A supervised process failed or a wait for it timed out; the message quotes its
    output (or a process the caller ran failed: `psar plan`, a probe)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for a rendezvous address)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(eq=False)
class Child:
    """One started process: its name, Popen, output, and when it was first seen gone."""

    name: str
    popen: subprocess.Popen
    persistent: bool
    log: Path | None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_TAIL_LINES))
    pump: threading.Thread | None = None
    exit_ticks: float | None = None  # clock ticks since boot when its exit was first seen

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        rc = self.popen.poll()
        if rc is not None and self.exit_ticks is None:
            self.exit_ticks = _now_ticks()
        return rc

    def lines(self) -> list[str]:
        """Its output so far: the whole log file, or the pumped lines kept."""
        if self.log is not None:
            return self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return list(self.tail)


class Supervisor:
    """The processes of one job; see the module docstring. A context manager."""

    def __init__(
        self,
        log_dir: Path | None = None,
        *,
        out: TextIO | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        grace: float = 10.0,
        relabel: Callable[[str, str], tuple[str, str]] | None = None,
        note: Callable[[str], object] | None = None,
        pids: list[int] | None = None,
    ) -> None:
        """log_dir: children's output in files there (else pumped into `out`, default
        stdout); env: every child's whole environment unless start() gives one (default:
        this process's); relabel(name, line) -> (prefix, line) for pumped lines; note:
        where stop() says that a child needed SIGKILL; pids: a list that receives every
        pid seen (children and descendants)."""
        self.log_dir, self.out, self.env, self.cwd = log_dir, out, env, cwd
        self.grace, self.relabel, self.note = grace, relabel, note
        self.pids = pids if pids is not None else []
        self.children: dict[str, Child] = {}
        self.lock = threading.Lock()  # one output line at a time
        self.seen: dict[int, str] = {}  # {pid: start time} of the children's descendants
        self._scanned = 0.0
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- starting ------------------------------------------------------------------------

    def start(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              persistent: bool = False, cpus: Iterable[int] | None = None) -> subprocess.Popen:  # fmt: skip
        """Start argv as child `name` (unique); `env`: its whole environment; `cpus`: pin
        it (and what it starts) to these CPUs."""
        if name in self.children:
            raise ValueError(f"a child named {name!r} was started already")
        env = dict(env if env is not None else self.env if self.env is not None else os.environ)
        pin = None if cpus is None else _pinner(set(cpus))
        log = None if self.log_dir is None else self.log_dir / f"{name}.log"
        common = dict(stdin=subprocess.DEVNULL, env=env, cwd=self.cwd, start_new_session=True,
                      preexec_fn=pin)  # fmt: skip
        if log is not None:
            with open(log, "w") as fh:
                popen = subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT, **common)
        else:
            popen = subprocess.Popen(list(argv), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, **common)  # fmt: skip
        child = Child(name, popen, persistent, log)
        self.children[name] = child
        self.pids.append(popen.pid)
        if log is None:
            child.pump = threading.Thread(target=self._pump, args=(child,), daemon=True,
                                          name=f"pump-{name}")  # fmt: skip
            child.pump.start()
        return popen

    def _pump(self, child: Child) -> None:
        assert child.popen.stdout is not None
        for raw in iter(child.popen.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            child.tail.append(line)
            prefix, text = self.relabel(child.name, line) if self.relabel else (child.name, line)
            with self.lock:
                stream = self.out or sys.stdout
                stream.write(f"[{prefix}] {text}\n")
                stream.flush()

    # ---- watching ------------------------------------------------------------------------

    def lines(self, name: str, *, drain: float = 0.0) -> list[str]:
        """Child `name`'s output so far; drain: first wait up to this long for its pump to
        copy the rest (an exited child's last lines)."""
        child = self.children[name]
        if drain and child.pump is not None:
            child.pump.join(timeout=drain)
        return child.lines()

    def tail(self, name: str, lines: int = 15, errors: int = 8) -> str:
        """Its last `lines` lines, after the first `errors` error lines above them."""
        text = self.lines(name, drain=1.0)
        above = [ln for ln in text[:-lines] if ERROR_LINE.search(ln)][:errors]
        return "\n".join([*(f"  ! {ln}" for ln in above), *(f"  | {ln}" for ln in text[-lines:])])

    def find_line(self, name: str, pattern: re.Pattern) -> re.Match | None:
        """The first match of `pattern` in child `name`'s output so far, else None."""
        for line in self.lines(name):
            if m := pattern.search(line):
                return m
        return None

    def wait_line(self, name: str, pattern: re.Pattern, timeout: float) -> re.Match:
        """Wait for `pattern` in child `name`'s output; it failing (or any other child
        failing) or the timeout raises ProcessError."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if m := self.find_line(name, pattern):
                return m
            self._raise_on_failure()
            time.sleep(0.05)
        raise ProcessError(f"{name} printed no {pattern.pattern!r} in {timeout:g}s:\n"
                           f"{self.tail(name)}")  # fmt: skip

    def failure(self) -> tuple[Child, int] | None:
        """The first failed child and its exit code (persistent ones looked at first: a
        shard that died explains the workers that follow), else None."""
        self.scan()
        for child in sorted(self.children.values(), key=lambda c: not c.persistent):
            rc = child.poll()
            if rc is not None and (rc != 0 or child.persistent):
                return child, rc
        return None

    def finished(self, names: Iterable[str]) -> bool:
        """Whether every named child has exited 0."""
        return all(self.children[n].poll() == 0 for n in names)

    def wait(self, names: Sequence[str], timeout: float) -> None:
        """Wait until every named child exited 0; any child failing or the timeout raises
        ProcessError with its output's tail."""
        end = time.monotonic() + timeout
        while True:
            self._raise_on_failure()
            if self.finished(names):
                return
            if time.monotonic() > end:
                late = [n for n in names if self.children[n].poll() is None]
                raise ProcessError(f"timeout {timeout:g}s waiting for {late}:\n"
                                   f"{self.tail(late[0])}")  # fmt: skip
            time.sleep(0.05)

    def _raise_on_failure(self) -> None:
        if failed := self.failure():
            child, rc = failed
            what = "exited 0 before it was stopped" if rc == 0 else f"exited {rc}"
            raise ProcessError(f"{child.name} {what}:\n{self.tail(child.name)}")

    def scan(self, *, force: bool = False) -> dict[int, str]:
        """Remember the children's live descendants (at most every 0.5 s unless forced)."""
        if force or time.monotonic() - self._scanned > _SCAN_EVERY_S:
            self._scanned = time.monotonic()
            new = descendants([c.pid for c in self.children.values()])
            self.pids.extend(pid for pid in new if pid not in self.seen)
            self.seen.update(new)
        return self.seen

    # ---- stopping ------------------------------------------------------------------------

    def stop(self, grace: float | None = None) -> None:
        """Stop everything (see the module docstring); safe to call again."""
        grace = self.grace if grace is None else grace
        live = [c for c in self.children.values() if c.poll() is None]
        live_names = {c.name for c in live}
        self.scan(force=True)
        for c in live:
            _send(os.killpg, c.pid, signal.SIGTERM)
        end = time.monotonic() + grace
        while any(c.poll() is None for c in live) and time.monotonic() < end:
            time.sleep(0.05)
        self.scan(force=True)  # what they started while going
        for c in self.children.values():
            running = c.name in live_names
            if running and c.poll() is None and self.note is not None:
                self.note(f"{c.name} still running {grace:g}s after SIGTERM; SIGKILL")
            if running or _group_outlived(c):
                _send(os.killpg, c.pid, signal.SIGKILL)
        for pid, start in self.seen.items():
            if _alive(pid, start):
                _send(os.kill, pid, signal.SIGKILL)
        for c in self.children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.popen.wait(timeout=10)
            if c.pump is not None:
                c.pump.join(timeout=2.0)
            if c.popen.stdout is not None:
                c.popen.stdout.close()
        end = time.monotonic() + 5.0
        while any(_alive(p, st) for p, st in self.seen.items()) and time.monotonic() < end:
            time.sleep(0.05)


def _pinner(cpus: set[int]) -> Callable[[], None]:
    return lambda: os.sched_setaffinity(0, cpus)


def _send(kill: Callable[[int, int], None], target: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        kill(target, sig)


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first); None: gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    """The "PPID START" of a live process (the start tells a reused pid apart); None:
    gone or a zombie."""
    f = _stat(pid)
    return None if f is None or f[0] in ("Z", "X") else f"{f[1]} {f[19]}"


def _alive(pid: int, start: str) -> bool:
    """Whether pid is still the process that started at `start`, and running."""
    return (_start_time(pid) or " ").split()[1:] == [start]


def _now_ticks() -> float:
    """Now, in the clock ticks since boot that /proc/PID/stat's start times count."""
    try:
        with open("/proc/uptime") as fh:
            return float(fh.read().split()[0]) * os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("inf")


def _group_outlived(child: Child) -> bool:
    """Whether the process group of an exited child still holds a process it left there
    (one that started before the child's exit was seen). Linux keeps a group's number
    while any member lives, so such a member proves the group is still ours to signal."""
    if child.exit_ticks is None:
        return False
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return False
    for pid in pids:
        f = _stat(pid)
        live = f is not None and f[0] not in ("Z", "X")
        if live and int(f[2]) == child.pid and int(f[19]) <= child.exit_ticks:
            return True
    return False


def descendants(roots: Iterable[int]) -> dict[int, str]:
    """{pid: start time} of the live descendants of `roots` (Linux /proc; {} elsewhere)."""
    try:
        procs = {int(d): _start_time(int(d)) for d in os.listdir("/proc") if d.isdigit()}
    except OSError:
        return {}
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, st in procs.items():
        if st is not None:
            children[int(st.split()[0])].append(pid)
    out, todo = {}, list(roots)
    while todo:
        for c in children.get(todo.pop(), []):
            out[c] = procs[c].split()[1]
            todo.append(c)
    return out
