"""Can this process write where a flag points? Asked before the work, not after it.

An unwritable --save or --report used to fail after every step had trained (the weights
lost with the traceback), and a shard whose --checkpoint-dir could not be written started
and logged a traceback at every checkpoint into its own log only (issue #45 defect 11).
These checks run at start and in --dry-run; each failure is a ValueError naming the flag,
which the CLI prints as one line (exit 2).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _probe_folder(folder: Path) -> str | None:
    """Why a new file cannot be made in `folder` (None: it can)."""
    if not folder.exists():
        return f"its folder {folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".psar-probe-"):
            pass
    except OSError as e:
        return f"cannot create a file in {folder}: {e.strerror or e}"
    return None


def check_file_writable(path: str, flag: str) -> None:
    """`path` (a file psar will write, replacing any) can be written: its folder exists and
    takes a new file, and `path` itself is not a folder nor a read-only file."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a folder; give a file path")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{flag} {path}: the file exists and is read-only; give another path")
    if why := _probe_folder(p.parent):  # Path("w.pt").parent is Path(".")
        raise ValueError(f"{flag} {path}: {why}; give a path psar can write before training")


def check_folder_writable(path: str, flag: str) -> None:
    """`path` (a folder psar writes into, made if missing) takes new files."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot make the folder: {e.strerror or e}") from None
    if why := _probe_folder(p):
        raise ValueError(f"{flag} {path}: {why}; give a folder psar can write")
