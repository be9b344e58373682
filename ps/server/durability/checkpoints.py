"""Shard checkpoints: atomic files, what goes in them, and when they are written.

A checkpoint holds everything a shard needs to carry on: the job (its configuration),
the fp32 masters, the optimizer and LR-schedule state, the loss scale, the version,
rounds and counters, every worker's clock and the live set, and its rows of every sparse
table with their optimizer state, versions and clocks ("sparse"; a file without that key,
written before, restores with no tables).

Writes are atomic: the bytes go to a temporary file in the same folder, which is
fsync'ed, renamed over the final name, and the folder is fsync'ed. A process killed
at any moment leaves either the previous checkpoints alone, or those plus a complete
new one (and maybe a stray temporary file, ignored and removed on the next start).

Files are named ckpt-s{shard}-{step:012d}.pt, where step is the round (sync) or the
version (async/ssp) the state is at, so one folder may hold several shards' files and
"newest" is the largest step. See docs/reliability.md.

Every checkpoint carries a crc32 of each of its tensors ("checksums", computed by the
writer thread, off the shard's lock); a restore or rollback skips a file whose tensors do
not match them, so a damaged disk cannot restore wrong weights silently.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Protocol

import torch

from psar.trainkit.atomic import atomic_save

log = logging.getLogger("psar.checkpoint")

FORMAT = 1
DEFAULT_EVERY = 100
DEFAULT_KEEP = 3
_NAME = re.compile(r"^ckpt-s(\d+)-(\d{12})\.pt$")


class CheckpointSource(Protocol):
    """What the interval timer asks for checkpoints (ps/server/durability/durability.py)."""

    def checkpoint_now(self, reason: str, *, wait: bool = False) -> bool: ...


class UnverifiedCheckpoints(ValueError):
    """--restore: this shard has checkpoints, but none loads and verifies. A ValueError
    so that `psar server` exits non-zero with the message (worker/cli.py)."""


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint with weights_only=True: a planted pickle cannot run code."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _tensors(obj: Any, prefix: str = "") -> Any:
    """(path, tensor) of every tensor in a snapshot's nested dicts and lists."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if not (prefix == "" and k == "checksums"):
                yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}")


def _crc(t: torch.Tensor) -> int:
    # crc32 (zlib, ~4 GB/s here) rather than sha256 (~1.7 GB/s): it is there to catch
    # damage, not forgery (weights_only loading is the guard against planted files).
    # dtype and shape go in too, so a damaged header cannot pass with the same bytes.
    meta = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode())
    flat = t.detach().reshape(-1).contiguous().view(torch.uint8)
    return zlib.crc32(flat.numpy(), meta) if flat.numel() else meta


def checksums(snap: dict[str, Any]) -> dict[str, int]:
    """crc32 of every tensor of a snapshot, by its path in the snapshot."""
    return {path: _crc(t) for path, t in _tensors(snap)}


def verify(snap: dict[str, Any]) -> list[str] | None:
    """The paths of the tensors that do not match the snapshot's checksums ([] if all
    do), or None for a checkpoint written before checksums existed (unverified)."""
    want = snap.get("checksums")
    if want is None:
        return None
    have = checksums(snap)
    return sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))


def clean_temp(folder: str | os.PathLike, shard: int | None = None) -> int:
    """Remove temporary files left by a writer of `shard` (any shard: None) that died."""
    n = 0
    pattern = ".ckpt-*.tmp" if shard is None else f".ckpt-s{shard}-*.tmp"
    for p in Path(folder).glob(pattern):
        p.unlink(missing_ok=True)
        n += 1
    return n


def path_for(folder: str | os.PathLike, shard: int, step: int) -> Path:
    return Path(folder) / f"ckpt-s{shard}-{step:012d}.pt"


def list_checkpoints(folder: str | os.PathLike, shard: int) -> list[tuple[int, Path]]:
    """(step, path) of this shard's checkpoints in `folder`, oldest first."""
    out = []
    if not Path(folder).is_dir():
        return out
    for p in Path(folder).iterdir():
        m = _NAME.match(p.name)
        if m and int(m.group(1)) == shard:
            out.append((int(m.group(2)), p))
    return sorted(out)


def shards_in(folder: str | os.PathLike) -> set[int]:
    """The shard indices that have checkpoints in `folder`."""
    if not Path(folder).is_dir():
        return set()
    return {int(m.group(1)) for p in Path(folder).iterdir() if (m := _NAME.match(p.name))}


def newest_loadable(
    folder: str | os.PathLike, shard: int, max_step: int | None = None
) -> tuple[int, dict[str, Any]] | None:
    """The newest checkpoint (at a step <= max_step) that loads and verifies, or None."""
    return newest_verified(folder, shard, max_step)[0]


def newest_verified(
    folder: str | os.PathLike, shard: int, max_step: int | None = None
) -> tuple[tuple[int, dict[str, Any]] | None, list[str]]:
    """(the newest checkpoint at a step <= max_step that loads and verifies, or None;
    "file: why" of each newer one skipped). Each skip is logged as a warning."""
    rejected: list[str] = []
    for step, path in reversed(list_checkpoints(folder, shard)):
        if max_step is not None and step > max_step:
            continue
        why = ""
        try:
            snap = load(path)
        except Exception as e:  # noqa: BLE001 - a damaged file: fall back to an older one
            why = f"does not load ({e})"
        else:
            bad = verify(snap) if snap.get("format") == FORMAT else []
            if snap.get("format") != FORMAT:
                why = f"has format {snap.get('format')!r}, want {FORMAT}"
            elif bad is None:
                log.warning("checkpoint %s has no checksums (written by an older psar): "
                            "restoring it unverified", path)  # fmt: skip
                return (step, snap), rejected
            elif bad:
                shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
                why = f"is damaged: checksum mismatch in {shown}"
            else:
                return (step, snap), rejected
        log.warning("checkpoint %s %s; trying an older one", path, why)
        rejected.append(f"{path}: {why}")
    return None, rejected


# ---- what a checkpoint holds (ps/server/durability/durability.py takes and loads the snapshots) --------


def job_of(snap: dict[str, Any]):  # noqa: ANN201 - psar.ps.job.Job
    from psar.ps import serde
    from psar.ps._gen.psar.v1 import ps_pb2 as pb

    spec = pb.JobSpec()
    spec.ParseFromString(snap["job"])
    return serde.job_from_pb(spec)


# ---- when checkpoints are written -------------------------------------------------------


class CheckpointManager:
    """Writes a shard's checkpoints into one folder, from a background thread.

    every:    checkpoint when the step (sync: round, else version) is a multiple of it.
              In sync mode every shard therefore checkpoints at the same rounds.
    interval: async/ssp: also checkpoint every this many seconds (ignored in sync mode,
              where checkpoints must fall on the same round on every shard).
    keep:     how many of the newest checkpoints to keep (>= 2).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        shard: int = 0,
        every: int = 0,
        interval_s: float = 0.0,
        keep: int = DEFAULT_KEEP,
        metrics: Any = None,
    ) -> None:
        if every < 0 or interval_s < 0:
            raise ValueError("--checkpoint-every and --checkpoint-interval must be >= 0")
        if keep < 2:
            raise ValueError(f"--checkpoint-keep must be >= 2, got {keep}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        clean_temp(self.folder, shard)
        self.shard = shard
        self.interval_s = interval_s
        self.every = every
        self.keep = keep
        self.metrics = metrics
        self.written = 0
        self.last_step: int | None = None
        self._generation = 0
        self._write_lock = threading.Lock()
        self._queue: queue.Queue[tuple[int, dict[str, Any]] | None] = queue.Queue(maxsize=4)
        self._writer = threading.Thread(target=self._run, name="psar-ckpt-writer", daemon=True)
        self._writer.start()
        self._timer: threading.Thread | None = None
        self._stop = threading.Event()

    def period(self, *, rounds: bool) -> int:
        """The step period; a policy in rounds (sync: its checkpoints must fall on the same
        rounds on every shard) falls back to DEFAULT_EVERY without one."""
        if self.every:
            return self.every
        return DEFAULT_EVERY if rounds or not self.interval_s else 0

    def every_for(self, mode: str) -> int:
        """period() for a mode name (tools and tests; the shard asks its policy)."""
        from psar.ps.server.modes import BUILTIN  # tools only: the shard asks its job's traits

        return self.period(rounds=BUILTIN.get(mode).traits.rounds)

    def due(self, step: int, *, rounds: bool) -> bool:
        every = self.period(rounds=rounds)
        return bool(every) and step % every == 0 and step != self.last_step

    def start_timer(self, state: CheckpointSource) -> None:
        """async/ssp: ask the shard (its durability) for a checkpoint every interval_s
        seconds."""
        if not self.interval_s or self._timer is not None:
            return

        def run() -> None:
            while not self._stop.wait(self.interval_s):
                state.checkpoint_now("interval")

        self._timer = threading.Thread(target=run, name="psar-ckpt-timer", daemon=True)
        self._timer.start()

    def submit(self, step: int, snap: dict[str, Any]) -> None:
        """Queue a snapshot for the writer thread (blocks if the writer is far behind)."""
        self.last_step = step
        self._queue.put((self._generation, snap))

    def write_now(self, step: int, snap: dict[str, Any]) -> Path:
        """Write synchronously (final checkpoint on SIGTERM); returns the file."""
        self.last_step = step
        self.flush()
        return self._write(self._generation, snap)

    def flush(self) -> None:
        """Wait until every queued snapshot is on disk."""
        self._queue.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # noqa: BLE001 - keep serving; the previous checkpoint stands
                log.exception("checkpoint write failed")
                if self.metrics is not None:
                    self.metrics.checkpoint_failed()
            finally:
                self._queue.task_done()

    def _write(self, generation: int, snap: dict[str, Any]) -> Path:
        t0 = time.monotonic()
        # Outside the lock, so a rollback (discard_after) does not wait for it; ~10-25% of
        # the write of a 57M-parameter Adam shard (docs/reliability.md).
        sums = checksums(snap)
        with self._write_lock:
            path = path_for(self.folder, self.shard, int(snap["step"]))
            if generation != self._generation:
                return path  # taken before a rollback: belongs to an abandoned timeline
            atomic_save({**snap, "checksums": sums}, path)
            self.written += 1
            for _, old in list_checkpoints(self.folder, self.shard)[: -self.keep]:
                old.unlink(missing_ok=True)
        if self.metrics is not None:
            self.metrics.checkpoint_written(time.monotonic() - t0)
        log.info("checkpoint %s (%.3fs)", path.name, time.monotonic() - t0)
        return path

    def newest(self, max_step: int | None = None) -> tuple[int, dict[str, Any]] | None:
        return newest_loadable(self.folder, self.shard, max_step)

    def discard_after(self, step: int) -> None:
        """After a rollback to `step`: drop newer files and queued snapshots (they belong
        to the timeline that was rolled back)."""
        with self._write_lock:
            self._generation += 1
            for s, p in list_checkpoints(self.folder, self.shard):
                if s > step:
                    p.unlink(missing_ok=True)
            self.last_step = step

    def close(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._writer.join(timeout=30)
