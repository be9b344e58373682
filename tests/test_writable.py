"""Output paths are checked before the work (issue #45 defect 11): --save, --report,
--run-dir and a shard's --checkpoint-dir that cannot be written fail at start (and in
--dry-run) with one line naming the flag, instead of after every step has trained.

Tests run as root, for whom permission bits do not stop a write: the unwritable places
here are ones no user may create files in (/proc), a folder that does not exist, a path
that is a folder, and a folder whose parent is a file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from psar.trainkit.writable import check_file_writable, check_folder_writable
from tests.procs import ENV, free_port


def test_a_writable_file_and_folder_pass(tmp_path: Path) -> None:
    check_file_writable(str(tmp_path / "w.pt"), "--save")
    (tmp_path / "old.json").write_text("{}")
    check_file_writable(str(tmp_path / "old.json"), "--report")  # replaced at the end
    check_folder_writable(str(tmp_path / "new" / "run"), "--run-dir")  # made if missing
    assert (tmp_path / "new" / "run").is_dir()
    assert not [p for p in tmp_path.rglob(".psar-probe-*")], "the probe file was left behind"


@pytest.mark.parametrize(
    ("path", "why"),
    [("/proc/psar-w.pt", "cannot create a file in /proc"),
     ("{tmp}/no/such/w.pt", "does not exist"),
     ("{tmp}", "is a folder")],
)  # fmt: skip
def test_an_unwritable_file_is_refused_naming_the_flag(tmp_path: Path, path: str, why: str) -> None:
    with pytest.raises(ValueError, match=rf"^--save {path.format(tmp=tmp_path)}: .*{why}"):
        check_file_writable(path.format(tmp=tmp_path), "--save")


def test_an_unwritable_folder_is_refused_naming_the_flag(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match=r"^--checkpoint-dir .*afile/ckpt: cannot make"):
        check_folder_writable(str(tmp_path / "afile" / "ckpt"), "--checkpoint-dir")
    with pytest.raises(ValueError, match=r"^--run-dir /proc: cannot create a file in /proc"):
        check_folder_writable("/proc", "--run-dir")


def _psar(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psar", *args], capture_output=True,
                          text=True, env={**ENV, **(env or {})}, timeout=180)  # fmt: skip


@pytest.mark.slow  # the default run's 5 minutes
def test_dry_run_checks_the_output_paths(tmp_path: Path) -> None:
    r = _psar("train", "--arch", "allreduce", "--dry-run", "--save", "/proc/psar-w.pt")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "psar train: error: --save /proc/psar-w.pt: cannot create a file in /proc: "
        + r.stderr.split("cannot create a file in /proc: ", 1)[1].strip()
    ], r.stderr
    r = _psar("server", "--dry-run", "--checkpoint-dir", str(tmp_path / "f" / "c"))
    assert r.returncode == 0, r.stderr  # a folder psar may make is fine
    (tmp_path / "f2").write_text("")
    r = _psar("server", "--dry-run", "--checkpoint-dir", str(tmp_path / "f2" / "c"))
    assert r.returncode == 2 and "--checkpoint-dir" in r.stderr and "Traceback" not in r.stderr


def test_a_real_run_fails_before_its_first_step(tmp_path: Path) -> None:
    """A one-rank DDP job with an unwritable --report: exit 2, one line, no step run."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    r = _psar("train", "--arch", "allreduce", "--steps", "3", "--log-every", "1",
              "--run-dir", str(tmp_path), "--report", "/proc/psar-r.json", env=env)  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--report /proc/psar-r.json" in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.glob("steps-*")), "steps ran before the check"


def test_a_report_inside_the_run_dir_is_fine(tmp_path: Path) -> None:
    """--run-dir is made first, so a --report inside it (bench.elastic's layout) passes."""
    from psar.trainkit.config import TrainConfig
    from psar.worker.loop import check_outputs

    run = tmp_path / "run" / "w0"
    check_outputs(TrainConfig(run_dir=str(run), report=str(run / "report.json")), 0)
    assert run.is_dir()
