"""Atomic file writes: a reader (or a restart after a crash) sees the old file or the new
one, never half of one. Shards' checkpoints, --save and DDP checkpoints use them."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a folder, so a rename inside it survives a power cut (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[IO[bytes]], None],
    *,
    before_rename: Callable[[Path], None] | None = None,
) -> None:
    """Write a file atomically: temp file, fsync, rename, fsync of the folder.

    `before_rename(tmp_path)` is a test hook called once the temporary file is complete.
    If anything fails (or the process dies) before the rename, `path` is untouched.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_save(obj: Any, path: str | os.PathLike, **kw: Any) -> None:
    """torch.save `obj` to `path` atomically (see atomic_write)."""
    atomic_write(path, lambda fh: torch.save(obj, fh), **kw)
